"""What a results file records about the code and the machine that produced it, beside the device name.

``facts(device)`` returns the git commit of this checkout (and whether tracked files differ from it), the tree
the files on disk make and whether it differs from that commit's, the CPU core count, and the CUDA, driver and
Triton versions. A fact that does not apply or cannot be read is None (no GPU: no driver; not a git checkout or
no git: no commit and no tree), never a guess.

The commit alone does not say what ran: a copy of a working tree (what a GPU machine is handed) keeps whatever
HEAD its ``.git`` had, however far the files have moved from it. ``git_tree`` is the git tree id of the files
themselves, tracked and untracked but not ignored, read from disk: what ``git add --all && git write-tree`` would
print, computed without writing anything to the repository. A clean checkout's is ``git rev-parse HEAD^{tree}``;
for any other, ``git log --format='%h %T' | grep <tree>`` finds the commit whose files ran, if there is one.
Untracked files count (``git_untracked`` names them), results written inside the tree included, and clean or
smudge filters (line endings, LFS) are not applied. An untracked repository of its own inside the checkout counts
as the commit it has checked out, as ``git add --all`` records it; one with no commit leaves ``git_tree`` None.

The scripts import the installed gafused, which is this checkout's after ``pip install -e .`` but may be another
copy: ``gafused_from_checkout`` says whether the package that ran is this checkout's ``gafused/``, the code the
tree describes.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.metadata
import json
import os
import platform
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import torch

__all__ = ["cpu_name", "device_name", "facts", "git_commit", "git_tree", "package_version", "slug", "save_report"]

_ROOT = Path(__file__).resolve().parents[1]


def _run(command: list[str], cwd: Path | None = None) -> str | None:
    """stdout of ``command`` stripped, or None when it cannot run or fails."""
    try:
        done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


def _run_bytes(command: list[str], cwd: Path) -> bytes | None:
    """stdout of ``command`` as bytes (``-z`` listings hold any file name), or None when it cannot run or fails."""
    try:
        return subprocess.run(command, cwd=cwd, capture_output=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def _is_checkout(root: Path) -> bool:
    """Whether ``root`` is the top level of a git checkout and git runs (a copy unpacked inside some other
    repository is not that repository's tree)."""
    if shutil.which("git") is None:
        return False
    top = _run(["git", "rev-parse", "--show-toplevel"], cwd=root)
    return top is not None and Path(top).resolve() == root.resolve()


def git_commit(root: Path = _ROOT) -> tuple[str | None, bool | None]:
    """(commit, tracked files modified) of the checkout at ``root``; (None, None) outside a git checkout of it.

    A copy unpacked inside some other repository is not that repository's commit: the checkout's top level
    must be ``root`` itself.
    """
    if not _is_checkout(root):
        return None, None
    commit = _run(["git", "rev-parse", "HEAD"], cwd=root)
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root)
    return commit or None, None if status is None else bool(status)


def _git_object(kind: bytes, body: bytes) -> bytes:
    """The binary id git gives an object of ``kind`` (b"blob", b"tree") with content ``body``."""
    return hashlib.sha1(kind + b" %d\0" % len(body) + body).digest()


def _tree_id(entries: dict) -> bytes:
    """Id of a tree from ``{name: (mode, id)}`` (a file or gitlink) or ``{name: dict}`` (a subtree), git's order:
    by name, a subtree's name compared as if it ended in "/"."""
    items = []
    for name, entry in entries.items():
        if isinstance(entry, dict):
            items.append((name + b"/", b"40000", name, _tree_id(entry)))
        else:
            items.append((name, entry[0], name, entry[1]))
    body = b"".join(mode + b" " + name + b"\0" + object_id for _, mode, name, object_id in sorted(items))
    return _git_object(b"tree", body)


def git_tree(root: Path = _ROOT) -> dict:
    """The tree the files of the checkout at ``root`` make on disk (see the module doc): ``git_tree`` (its id),
    ``git_tree_dirty`` (it differs from HEAD's tree: a tracked file changed, or an untracked, not ignored, file
    exists) and ``git_untracked`` (those files' paths, at most 50). All None outside a git checkout or without git.
    """
    unknown = {"git_tree": None, "git_tree_dirty": None, "git_untracked": None}
    if not _is_checkout(root):
        return unknown
    # Tracked entries with their index mode and id (a gitlink's id is its commit), then the untracked, not ignored.
    staged = _run_bytes(["git", "ls-files", "--stage", "-z"], cwd=root)
    others = _run_bytes(["git", "ls-files", "--others", "--exclude-standard", "-z"], cwd=root)
    head_tree = _run(["git", "rev-parse", "HEAD^{tree}"], cwd=root)
    if staged is None or others is None:
        return unknown
    files: dict[bytes, tuple[bytes, bytes] | None] = {}
    for record in filter(None, staged.split(b"\0")):
        info, path = record.split(b"\t", 1)
        mode, object_id, _stage = info.split()
        files[path] = (mode, bytes.fromhex(object_id.decode())) if mode == b"160000" else None
    untracked = [path for path in filter(None, others.split(b"\0"))]
    for path in untracked:
        if path.endswith(b"/"):  # a git repository of its own: `git add --all` adds its checked-out commit
            head = _run(["git", "rev-parse", "--verify", "-q", "HEAD"], cwd=root / os.fsdecode(path))
            if head is None:  # none checked out: `git add --all` would refuse it, so no tree says what is on disk
                return {**unknown, "git_tree_dirty": True, "git_untracked": _listed(untracked)}
            files[path.rstrip(b"/")] = (b"160000", bytes.fromhex(head))
        else:
            files[path] = None
    tree: dict = {}
    for path, gitlink in sorted(files.items()):
        on_disk = root / os.fsdecode(path)
        if gitlink is not None:
            entry = gitlink
        elif on_disk.is_symlink():
            entry = (b"120000", _git_object(b"blob", os.fsencode(os.readlink(on_disk))))
        elif on_disk.is_file():
            executable = bool(on_disk.stat().st_mode & stat.S_IXUSR)  # git's test: the owner's execute bit
            entry = (b"100755" if executable else b"100644", _git_object(b"blob", on_disk.read_bytes()))
        else:
            continue  # deleted since it was staged: `git add --all` would drop it too
        *folders, name = path.split(b"/")
        node = tree
        for folder in folders:
            node = node.setdefault(folder, {})
        node[name] = entry
    tree_id = _tree_id(tree).hex()
    return {
        "git_tree": tree_id,
        "git_tree_dirty": None if head_tree is None else tree_id != head_tree,
        "git_untracked": _listed(untracked),
    }


def _listed(untracked: list[bytes]) -> list[str]:
    """The first 50 untracked paths, sorted (a repository of its own ends in '/')."""
    return sorted(os.fsdecode(path) for path in untracked)[:50]


def package_version(*names: str) -> str | None:
    """The installed version of the first of ``names`` that is installed (distribution names), else None."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _driver_version(device: torch.device) -> str | None:
    """The NVIDIA driver's version (nvidia-smi), or None without a CUDA device or nvidia-smi."""
    if device.type != "cuda" or not torch.cuda.is_available() or shutil.which("nvidia-smi") is None:
        return None
    # One driver serves every GPU of the machine: the first line is it (nvidia-smi's indices are not torch's
    # under CUDA_VISIBLE_DEVICES).
    listed = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return listed.splitlines()[0].strip() if listed else None


def facts(device: torch.device | str) -> dict:
    """The code and machine facts of a run on ``device`` (see the module doc); every key is always present."""
    device = torch.device(device)
    commit, modified = git_commit()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "git_commit": commit,
        "git_tracked_files_modified": modified,
        **git_tree(),
        "gafused_from_checkout": gafused_from_checkout(),
        "cpu_cores": os.cpu_count(),
        "cpu_cores_usable": usable,
        "cuda_version": torch.version.cuda,
        "cuda_driver_version": _driver_version(device),
        "triton": package_version("triton", "pytorch-triton"),
    }


def gafused_from_checkout(root: Path = _ROOT) -> bool:
    """Whether the gafused package imported here is ``root``'s ``gafused/`` (not another install of it)."""
    import gafused

    return Path(gafused.__file__).resolve().parent == (root / "gafused").resolve()


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` says of the processor or machine."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: torch.device | str) -> str:
    """The GPU's name for a CUDA device, else ``CPU <model name>``."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {cpu_name()}"


def selected_device(text: str | None) -> torch.device:
    """A bench script's ``--device`` (cuda, cuda:N or cpu; None: cuda when torch sees one, else cpu), or ValueError
    saying why torch cannot use it (for the script to refuse before anything runs)."""
    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cuda", "cpu"):
        raise ValueError(f"{text!r} is neither cuda (cuda:N) nor cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{text} asked for, but torch {torch.__version__} sees no CUDA device; use --device cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"{text} does not exist; {torch.cuda.device_count()} CUDA device(s) seen")
    return device


def out_problem(out: Path) -> str | None:
    """Why the folder ``out`` cannot take a script's results (a file there or above it, no permission to write), or
    None. Creates nothing: scripts ask before they measure, and make the folder when they save."""
    existing = out
    while not existing.exists() and not existing.is_symlink() and existing.parent != existing:
        existing = existing.parent
    if existing.is_symlink() and not existing.exists():
        return f"{existing} is a broken symbolic link"
    if not existing.is_dir():
        return f"{existing} exists and is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable"
    return None


def out_file_problem(path: Path) -> str | None:
    """As ``out_problem``, for a script that writes the results file ``path`` itself (and a .csv beside it)."""
    if path.suffix.lower() == ".csv":
        return f"{path} ends in .csv, the name of the CSV written beside the results; name the JSON file (.json)"
    for written in (path, path.with_suffix(".csv")):
        if written.is_dir():
            return f"{written} is a directory; a file is expected"
    return out_problem(path.parent)


def device_option(parser: argparse.ArgumentParser, text: str | None) -> torch.device:
    """``selected_device(text)``, or the script's refusal of its ``--device`` (exit status 2)."""
    try:
        return selected_device(text)
    except ValueError as error:
        parser.error(f"--device: {error}")


def check_out_option(parser: argparse.ArgumentParser, out: Path, file: bool = False) -> None:
    """Refuse the script's ``--out`` (exit status 2) where ``out_problem`` (``out_file_problem`` for a ``file``)
    finds one."""
    problem = out_file_problem(out) if file else out_problem(out)
    if problem is not None:
        parser.error(f"--out: {problem}")


def slug(text: str) -> str:
    """``text`` as a file-name part: lower case, runs of anything but letters and digits as one dash."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def save_report(out: Path, device: torch.device, label: str, kind: str, results: dict, report: str) -> Path:
    """Write ``results`` (a ``meta`` entry with the device, date, torch and ``facts`` is added in front of its own)
    as ``<label>-<UTC time>-<kind>.json`` in ``out`` and ``report`` beside it as ``.txt``; print the report and
    ``wrote <json>`` (the line bench/gpu_check.sh reports). Returns the JSON's path.

    A run that was stopped (``results["meta"]["interrupted"]``, see interrupt.py) is marked as partial in the JSON
    (``complete``: false), on the report's first line and on the ``wrote`` line.
    """
    now = datetime.datetime.now(datetime.timezone.utc)
    stopped = results.get("meta", {}).get("interrupted")
    meta = {"device": label, "date_utc": now.isoformat(timespec="seconds"), "torch": torch.__version__,
            **facts(device), "complete": not stopped, **results.get("meta", {})}  # fmt: skip
    if stopped:
        where = stopped.get("during") or "setup"
        report = f"PARTIAL RESULTS: stopped by {stopped['signal']} during {where}; only what follows ran\n{report}"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{slug(label)}-{now:%Y%m%d-%H%M%S}-{kind}.json"
    path.write_text(json.dumps({**results, "meta": meta}, indent=1))
    path.with_suffix(".txt").write_text(report + "\n")
    print(report)
    print(f"wrote {path}" + (f" (partial: stopped by {stopped['signal']})" if stopped else ""), file=sys.stderr)
    return path
