"""What a results file records about the code and the machine that produced it, beside the device name.

``facts(device)`` returns the git commit of this checkout (and whether tracked files differ from it), the CPU
core count, and the CUDA, driver and Triton versions. A fact that does not apply or cannot be read is None
(no GPU: no driver; not a git checkout: no commit), never a guess.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch

__all__ = ["facts", "git_commit"]

_ROOT = Path(__file__).resolve().parents[1]


def _run(command: list[str], cwd: Path | None = None) -> str | None:
    """stdout of ``command`` stripped, or None when it cannot run or fails."""
    try:
        done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


def git_commit(root: Path = _ROOT) -> tuple[str | None, bool | None]:
    """(commit, tracked files modified) of the checkout at ``root``; (None, None) outside a git checkout of it.

    A copy unpacked inside some other repository is not that repository's commit: the checkout's top level
    must be ``root`` itself.
    """
    if shutil.which("git") is None:
        return None, None
    top = _run(["git", "rev-parse", "--show-toplevel"], cwd=root)
    if top is None or Path(top).resolve() != root.resolve():
        return None, None
    commit = _run(["git", "rev-parse", "HEAD"], cwd=root)
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root)
    return commit or None, None if status is None else bool(status)


def _package_version(*names: str) -> str | None:
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
        "cpu_cores": os.cpu_count(),
        "cpu_cores_usable": usable,
        "cuda_version": torch.version.cuda,
        "cuda_driver_version": _driver_version(device),
        "triton": _package_version("triton", "pytorch-triton"),
    }


def slug(text: str) -> str:
    """``text`` as a file-name part: lower case, runs of anything but letters and digits as one dash."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def save_report(out: Path, device: torch.device, label: str, kind: str, results: dict, report: str) -> Path:
    """Write ``results`` (a ``meta`` entry with the device, date, torch and ``facts`` is added in front of its own)
    as ``<label>-<UTC time>-<kind>.json`` in ``out`` and ``report`` beside it as ``.txt``; print the report and
    ``wrote <json>`` (the line bench/gpu_check.sh reports). Returns the JSON's path."""
    now = datetime.datetime.now(datetime.timezone.utc)
    meta = {"device": label, "date_utc": now.isoformat(timespec="seconds"), "torch": torch.__version__,
            **facts(device), **results.get("meta", {})}  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{slug(label)}-{now:%Y%m%d-%H%M%S}-{kind}.json"
    path.write_text(json.dumps({**results, "meta": meta}, indent=1))
    path.with_suffix(".txt").write_text(report + "\n")
    print(report)
    print(f"wrote {path}", file=sys.stderr)
    return path
