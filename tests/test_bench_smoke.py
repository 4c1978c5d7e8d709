"""The benchmark providers compute what they claim: every one finishes a window with the same gradient.

Timing is not tested here (no timing assertions); ``python bench/run.py --quick`` is the smoke run.
"""

from __future__ import annotations

import functools
import json
import mmap
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gafused

ROOT = Path(__file__).resolve().parents[1]

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import param_sets  # noqa: E402 - bench/ is not a package; its modules import each other as siblings
import providers  # noqa: E402
import traffic  # noqa: E402

ACCUMULATION_STEPS = 4
MAX_GRAD_NORM = 0.5


class _NoCount:
    """Stands in for the Triton launch count's child process."""

    def start(self):
        return self

    def result(self):
        return {"skipped": "not counted in this test"}


# Every provider the CPU run times, but `compiled` (torch.compile: slow to build, the same math as foreach).
_CPU_PROVIDERS = [name for name in providers.provider_names(torch.device("cpu")) if name != "compiled"]


@pytest.mark.parametrize("clipped", [True, False], ids=["clipped", "unclipped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", _CPU_PROVIDERS)
def test_provider_finishes_the_window_like_float64(name: str, dtype: torch.dtype, clipped: bool) -> None:
    """Clipped, the finished gradient is the mean's direction at MAX_GRAD_NORM whatever its scale; unclipped, it is
    the mean itself, which a missing 1/N or weight sum would miss."""
    param_set = param_sets.gpt2(hidden=8, layers=1, vocab=37, positions=5, name="tiny")
    generator = torch.Generator().manual_seed(1)
    # One gradient set per micro-batch, so the window folds each exactly once, in order.
    pool = [
        [torch.randn(shape, generator=generator).to(dtype) for shape in param_set.shapes]
        for _ in range(ACCUMULATION_STEPS)
    ]
    params = [torch.nn.Parameter(torch.empty(shape, dtype=dtype)) for shape in param_set.shapes]
    max_norm = MAX_GRAD_NORM if clipped else 1e6
    provider = providers.make_provider(name, params, pool, ACCUMULATION_STEPS, max_norm)
    if name.startswith("gafused-"):
        assert provider.accumulator.backend == name.removeprefix("gafused-")

    provider.prepare("last")
    assert provider.position() == ACCUMULATION_STEPS - 1
    provider.step()
    assert provider.position() == 0

    mean = [sum(grads[i].double() for grads in pool) / ACCUMULATION_STEPS for i in range(len(params))]
    norm = torch.sqrt(sum(g.square().sum() for g in mean))
    assert (norm > max_norm) == clipped, "the clip must be active exactly where the test checks it"
    coef = min(1.0, max_norm / (norm + 1e-6))
    # fp32: a few roundings of each element, against the largest element (the defaults' atol=1e-5 is 2e-4 of it
    # when clipped); bf16: torch's bf16 defaults (one rounding of the finished value).
    largest = max(float((g * coef).abs().max()) for g in mean)
    tolerance = {"rtol": 1.3e-6, "atol": 1e-6 * largest} if dtype == torch.float32 else {}
    for param, expected in zip(params, mean, strict=True):
        assert param.grad is not None and param.grad.dtype == dtype
        torch.testing.assert_close(param.grad, (expected * coef).to(dtype), **tolerance)


def test_traffic_matches_the_design_table() -> None:
    # docs/design.md section 3, bf16 grads into fp32: first 6, middle 10 bytes per element; fp32 grads add 2.
    assert traffic.bytes_per_element("first", torch.bfloat16) == 6
    assert traffic.bytes_per_element("middle", torch.bfloat16) == 10
    assert traffic.bytes_per_element("middle", torch.float32) == 12
    # last = the fused pass (10) + reading the buffer and writing the finished bf16 grad (4 + 2)
    assert traffic.bytes_per_element("last", torch.bfloat16) == 16
    with pytest.raises(ValueError, match="moment"):
        traffic.bytes_per_element("second", torch.bfloat16)


def test_kernel_sweep_traffic_matches_the_design_table() -> None:
    # docs/design.md section 3: fold and the fused finish move 10 bytes per element for bf16 grads (12 for fp32);
    # writing the finished bf16 gradient reads acc and writes 2 bytes; a norm alone reads acc.
    assert traffic.op_bytes_per_element("fold", torch.bfloat16) == 10
    assert traffic.op_bytes_per_element("fold_finish", torch.float32) == 12
    assert traffic.op_bytes_per_element("scale_cast", torch.bfloat16) == 6
    assert traffic.op_bytes_per_element("sum_of_squares", torch.bfloat16) == 4
    with pytest.raises(ValueError, match="op must be one of"):
        traffic.op_bytes_per_element("clip", torch.bfloat16)


def test_param_set_tensor_counts() -> None:
    assert param_sets.gpt2().count == 148
    assert param_sets.llama().count == 291
    assert param_sets.gpt2().numel == 124_439_808


# --- the run's parts: correctness figures, the memory hook, progress, the summary and the files -------------------


def test_correctness_part_separates_the_recipes() -> None:
    import correctness

    result = correctness.run_correctness(progress=None)
    for scenario in result["scenarios"]:
        errors = {row["recipe"]: row["relative_error"] for row in scenario["rows"]}
        # float32 against float64: token weights sit at the rounding floor, like the big batch itself ...
        assert errors["gafused, token weights"] < 1e-5
        assert errors["big batch"] < 1e-5
        # ... and loss / N is a different gradient, not noise.
        assert errors["loss / N"] > 0.05
    tokens = result["scenarios"][0]["loss_tokens_per_micro_batch"]
    assert len(set(tokens)) == len(tokens), "micro-batches must differ in loss tokens for the comparison to mean much"


def test_progress_helpers() -> None:
    import progress

    assert progress.factory(enabled=False) is None
    with progress.open_bar(None, "nothing", total=3) as bar:
        bar.update()
    seen = []

    class _Recorder:
        def update(self, n: int = 1) -> None:
            seen.append(n)

        def close(self) -> None:
            seen.append("closed")

    with progress.open_bar(lambda desc, total: _Recorder(), "two steps", total=2) as bar:
        bar.update()
        bar.update(1)
    assert seen == [1, 1, "closed"]


def test_memory_hook_reports_a_missing_module_and_passes_quick_and_progress(monkeypatch) -> None:
    import types

    import run

    monkeypatch.setitem(sys.modules, "memory", None)  # `import memory` now fails as for an absent file
    cpu = torch.device("cpu")
    assert run.run_memory(quick=True, progress=None, device=cpu) == (None, "not built yet")

    calls = []
    row = {"recipe": "plain PyTorch", "param_dtype": "float32", "peak_bytes_per_param": 16.0, "note": "AdamW"}

    def fake_run(quick, progress, device):
        calls.append((quick, progress, device))
        return [row]

    monkeypatch.setitem(sys.modules, "memory", types.SimpleNamespace(run=fake_run))
    marker = object()
    assert run.run_memory(quick=False, progress=marker, device=cpu) == ([row], None)
    assert calls == [(False, marker, cpu)]  # --device reaches the memory part

    def failing_run(quick, progress, device):
        raise RuntimeError("no room")

    monkeypatch.setitem(sys.modules, "memory", types.SimpleNamespace(run=failing_run))
    rows, status = run.run_memory(quick=True, progress=None, device=cpu)
    assert rows is None and "no room" in status


_MEMORY_ROWS = [
    {"recipe": "plain PyTorch", "param_dtype": "float32", "peak_bytes_per_param": 16.0, "note": "AdamW"},
    {"recipe": "gafused", "param_dtype": "float32", "peak_bytes_per_param": 16.5, "note": "fold during backward"},
    {"recipe": "Megatron-style main_grad", "param_dtype": "bfloat16", "peak_bytes_per_param": 12.0, "note": ""},
]


@pytest.mark.parametrize("memory_built", [False, True], ids=["memory-absent", "memory-rows"])
def test_small_run_writes_the_files_its_summary_lists(monkeypatch, tmp_path, capsys, memory_built: bool) -> None:
    import types

    pytest.importorskip("matplotlib")
    import run
    import summary
    import triton_launches

    monkeypatch.setattr(triton_launches, "Count", _NoCount)
    quick_seen = []

    def fake_memory_run(quick, progress, device):
        quick_seen.append(quick)
        return _MEMORY_ROWS

    memory = types.SimpleNamespace(run=fake_memory_run) if memory_built else None
    monkeypatch.setitem(sys.modules, "memory", memory)
    argv = ["--quick", "--out", str(tmp_path), "--no-e2e", "--sets", "single-big", "--dtypes", "fp32",
            "--providers", "naive,gafused-reference", "--no-progress", "--device", "cpu"]  # fmt: skip
    assert run.main(argv) == 0
    screen = capsys.readouterr().out
    assert quick_seen == ([run.MEMORY_QUICK["quick"]] if memory_built else [])
    for heading in ("MEMORY", "CORRECTNESS", "LAUNCHES AND HOST TIME", "KERNELS VS COPY BANDWIDTH", "FILES"):
        assert heading in screen
    if memory_built:
        assert "Megatron-style main_grad" in screen and "16.5" in screen
    else:
        assert "memory: not built yet" in screen
    written = sorted(path.name for path in tmp_path.iterdir())
    listed = [name for name in written if name in screen]
    assert listed == written, "the summary names every file the run wrote"
    for name in written:
        assert any(name.endswith(suffix) for suffix in summary.FILE_ROLES), name
    assert any(name.endswith("-kernels.png") for name in written)
    assert any(name.endswith("-memory.png") for name in written) == memory_built

    # The screen names the backend "auto" ran here, and the results say which backend each row ran.
    results = json.loads(next(tmp_path.glob("*.json")).read_text())
    default = gafused.ops.resolve_backend("auto", "cpu")
    assert results["meta"]["default_backend"] == default
    assert f"default CPU backend, `{default}`" in " ".join(screen.split())
    micro_backends = {r["backend"] for r in results["micro"] if r["provider"].startswith("gafused-")}
    assert micro_backends == {"reference"}
    kernel_backends = [b for b in gafused.available_backends("cpu") if b != "triton"]
    assert {r["backend"] for r in results["kernels"]} == set(kernel_backends)
    # Each kernel row keeps its calls' host time and the copy's; on CPU a call's host time is its time.
    timed = [r for r in results["kernels"] if r["status"] == "ok"]
    assert timed and all(r["host_ms"] == r["median_ms"] and r["copy_host_ms"] > 0 for r in timed)
    kernels_heading = next(line for line in screen.splitlines() if line.startswith("KERNELS VS COPY BANDWIDTH"))
    assert all(f"`{b}`" in kernels_heading for b in kernel_backends)


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


def _git_at(folder: Path, *args: str) -> str:
    """stdout of ``git ARGS`` run in ``folder`` (a scratch repository), with an identity to commit under."""
    identity = ["-c", "user.name=bench", "-c", "user.email=bench@example.com"]
    done = subprocess.run(["git", *identity, *args], cwd=folder, capture_output=True, text=True, check=True)
    return done.stdout.strip()


def _scratch_repository(folder: Path) -> functools.partial:
    """A new git repository in ``folder`` (the test is skipped without git), and ``git`` to run there."""
    if _git("--version") is None:
        pytest.skip("git is not installed")
    _git_at(folder, "init", "-q")
    return functools.partial(_git_at, folder)


def test_results_meta_records_the_code_and_the_machine(monkeypatch, tmp_path) -> None:
    import importlib.metadata

    import provenance
    import run
    import triton_launches

    monkeypatch.setattr(triton_launches, "Count", None)  # --kernels-only counts no Triton launches
    argv = ["--kernels-only", "--quick", "--out", str(tmp_path), "--no-progress", "--no-plots", "--device", "cpu"]
    assert run.main(argv) == 0
    meta = json.loads(next(tmp_path.glob("*.json")).read_text())["meta"]
    top = _git("rev-parse", "--show-toplevel")
    commit = _git("rev-parse", "HEAD") if top is not None and Path(top).resolve() == ROOT else None
    assert meta["git_commit"] == commit
    modified = _git("status", "--porcelain", "--untracked-files=no")
    assert meta["git_tracked_files_modified"] == (None if commit is None else bool(modified))
    # The tree of the files that ran (test_git_tree_names_the_files_on_disk_not_only_head checks its value).
    if commit is None:
        assert meta["git_tree"] is None and meta["git_tree_dirty"] is None
    else:
        assert len(meta["git_tree"]) == 40 and isinstance(meta["git_tree_dirty"], bool)
        assert meta["git_tree_dirty"] or not modified
    assert meta["transformers"] == provenance.package_version("transformers")
    assert meta["complete"] is True and meta["interrupted"] is None
    assert meta["cpu_cores"] == os.cpu_count() and meta["cpu_cores"] >= 1
    assert meta["cuda_version"] == torch.version.cuda
    assert meta["cuda_driver_version"] is None  # a CPU run reads no driver
    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = meta["triton"]  # another distribution name, or none
    assert meta["triton"] == triton
    # Outside a git checkout of this tree there is no commit to name, and no guess.
    assert provenance.git_commit(tmp_path) == (None, None)
    # On a GPU the driver comes from nvidia-smi, one line per GPU; without nvidia-smi it is None.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(provenance, "_run", lambda command, cwd=None: "570.1.2\n570.1.2")
    monkeypatch.setattr(provenance.shutil, "which", lambda name: f"/usr/bin/{name}")
    assert provenance._driver_version(torch.device("cuda")) == "570.1.2"
    assert provenance._driver_version(torch.device("cpu")) is None
    monkeypatch.setattr(provenance.shutil, "which", lambda name: None)
    assert provenance._driver_version(torch.device("cuda")) is None


def test_every_gafused_backend_can_be_asked_for(capsys) -> None:
    import argparse

    import run

    cpu = torch.device("cpu")
    assert [f"gafused-{b}" for b in gafused.ops.BACKENDS] == [n for n in providers.PROVIDERS if "gafused" in n]
    timed = providers.provider_names(cpu)
    for backend in gafused.ops.BACKENDS:
        name = f"gafused-{backend}"
        chosen = run._selected_providers(argparse.Namespace(providers=f"naive,{name}"), cpu)
        message = capsys.readouterr().err
        if name in timed:
            assert chosen == ["naive", name] and message == ""
            assert providers.unavailable_reason(name, cpu) is None
        else:
            # Asked for, not timed here: skipped with the reason, the rest still runs.
            reason = providers.unavailable_reason(name, cpu)
            assert chosen == ["naive"] and reason and f"{name} skipped on cpu: {reason}" in message
    assert "gafused-foreach" in timed  # the CPU default backend is timed on CPU
    with pytest.raises(SystemExit) as refused:
        run._selected_providers(argparse.Namespace(providers="gafused-nonexistent"), cpu)
    assert refused.value.code == 2 and "--providers: unknown ['gafused-nonexistent']" in capsys.readouterr().err


def test_summary_and_plots_name_the_backend_that_ran() -> None:
    import plots
    import summary

    def results(default, backends):
        rows = [
            {"set": "many-small", "tensors": 3, "elements": 30, "grad_dtype": "fp32", "provider": f"gafused-{b}",
             "backend": b, "moment": moment, "status": "ok", "median_ms": 1.0, "host_ms": 1.0, "launches": 3}
            for b in backends for moment in ("middle", "last")
        ]  # fmt: skip
        meta = {"device_type": "cpu", "device": "CPU x", "gafused": "0", "torch": "0", "mode": "quick",
                "date_utc": "2000-01-01T00:00:00+00:00", "default_backend": default}  # fmt: skip
        return {"meta": meta, "micro": rows}

    screen = " ".join(summary.render(results("foreach", ["reference", "foreach"]), []).split())
    assert "default CPU backend, `foreach`" in screen and "also times `reference`" in screen
    screen = " ".join(summary.render(results("reference", ["reference"]), []).split())
    assert "default CPU backend, `reference`" in screen and "foreach" not in screen.split("MEMORY")[0]
    # Results written before the meta recorded it: the end-to-end gafused row says which backend ran.
    old = results(None, ["reference"])
    old["e2e"] = {"rows": [{"recipe": "gafused", "backend": "reference"}]}
    assert summary.default_backend(old) == "reference"
    assert plots._backends(results("foreach", ["reference", "foreach"])["micro"]) == "reference and foreach backends"


def test_memory_modes_are_the_ones_bench_readme_states() -> None:
    import run

    readme = (ROOT / "bench" / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| memory:"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    default, full = cells[2], cells[3]
    assert f"quick={run.MEMORY_QUICK['default']}" in default
    assert f"quick={run.MEMORY_QUICK['full']}" in full


def _touch_fresh_pages(nbytes: int) -> None:
    """Write one byte per page of a fresh anonymous mapping (small pages): a page fault per page."""
    block = mmap.mmap(-1, nbytes)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        block.madvise(mmap.MADV_NOHUGEPAGE)
    for offset in range(0, nbytes, mmap.PAGESIZE):
        block[offset] = 1
    block.close()


def test_timer_counts_first_touch_and_the_sweep_drops_those_rows(monkeypatch) -> None:
    import kernels
    import timing

    timer = timing.Timer(torch.device("cpu"), budget_s=0.01, min_reps=3, max_reps=5, warmup=1)
    if timer.measure(lambda: None).page_faults is None:
        pytest.skip("this platform does not count page faults")
    pages = 4 * kernels.FIRST_TOUCH_FAULTS
    fresh = timer.measure(lambda: _touch_fresh_pages(pages * mmap.PAGESIZE))
    assert fresh.page_faults >= pages
    touched = torch.zeros(pages * mmap.PAGESIZE // 4)
    assert timer.measure(lambda: touched.add_(1)).page_faults < kernels.FIRST_TOUCH_FAULTS

    real_work = kernels.op_call

    def work(op, buffer, grads, out, backend):
        if op == "fold" and backend == "reference":
            return lambda: _touch_fresh_pages(pages * mmap.PAGESIZE)
        return real_work(op, buffer, grads, out, backend)

    monkeypatch.setattr(kernels, "op_call", work)
    rows = kernels.run_kernel_sweep(torch.device("cpu"), "quick", timer)
    # Only the injected rows are sure to fault: a real op may fault too when the allocator hands its temporaries
    # back to the OS between calls, which depends on what ran before in this process (the whole suite, say).
    injected = [r for r in rows if (r["backend"], r["op"]) == ("reference", "fold")]
    assert injected and all(r["status"].startswith("dropped") and r["page_faults"] >= pages for r in injected)
    dropped = [r for r in rows if r["status"] != "ok"]
    assert all(r["status"].startswith("dropped") and r["page_faults"] >= kernels.FIRST_TOUCH_FAULTS for r in dropped)
    assert all(r["page_faults"] < kernels.FIRST_TOUCH_FAULTS for r in rows if r["status"] == "ok")
    table = kernels.format_kernel_table(rows)
    dropped_lines = [line.split() for line in table.splitlines() if "dropped" in line]
    assert sorted((words[1], words[2]) for words in dropped_lines) == sorted((r["backend"], r["op"]) for r in dropped)


def _ratio_range(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}x"


def _cited_cpu_run(readme: str) -> tuple[str, dict]:
    """The committed CPU run README's Benchmarks section cites ("Committed figures: `FILE`"): its path and content."""
    section = readme[readme.index("## Benchmarks") :]
    cited = section.split("Committed figures: `", 1)[1].split("`", 1)[0]
    return cited, json.loads((ROOT / cited).read_text())


def test_the_readme_benchmark_figures_are_the_committed_results() -> None:
    import summary

    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Benchmarks") : readme.index("## Development")]
    cited, results = _cited_cpu_run(readme)
    meta = results["meta"]
    assert meta["mode"] == "full" and meta["device_type"] == "cpu"
    assert cited.removeprefix("bench/results/") in (ROOT / "bench" / "results" / "README.md").read_text()
    flat = " ".join(section.split())
    for table in summary.readme_tables(results).split("\n\n"):
        assert table in section, "README's tables are `python bench/run.py --table` of the cited file"

    import kernels

    rows = {(r["set"], r["grad_dtype"], r["moment"], r["provider"]): r for r in results["micro"]}
    # The comparisons leave out rows where some provider's timed calls page-faulted (its temporaries fresh from the
    # OS on every call): those time the OS's page handling, as the kernel sweep's dropped rows do.
    faulted = {key[:3] for key, row in rows.items() if (row.get("page_faults") or 0) >= kernels.FIRST_TOUCH_FAULTS}
    keys = sorted({key[:3] for key in rows} - faulted)

    def ratio(key, provider, baseline):
        return rows[(*key, provider)]["median_ms"] / rows[(*key, baseline)]["median_ms"]

    default = meta["default_backend"]
    mine = f"gafused-{default}"
    last = [ratio(k, mine, "naive") for k in keys if k[2] == "last"]
    middle = [ratio(k, mine, "naive") for k in keys if k[2] == "middle"]
    reference = [ratio(k, "gafused-reference", "naive") for k in keys]
    faster = sum(rows[(*k, "foreach")]["median_ms"] < rows[(*k, mine)]["median_ms"] for k in keys)
    e2e = {row["recipe"].split(":")[0]: row for row in results["e2e"]["rows"]}
    plain, ours = e2e["plain"], e2e["gafused"]
    config = results["e2e"]["config"]
    gpt2_last = {provider: rows[("gpt2-124m-cpu-h256", "bf16", "last", provider)] for provider in (mine, "naive")}
    quoted = [
        f"{meta['date_utc'][:10]}, N = {meta['accumulation_steps']}, git commit {meta['git_commit'][:7]}",
        f"torch {meta['torch']}",
        f'`backend="auto"` ran `{default}` there',
        f"takes {_ratio_range(last)} `naive`'s time on last micro-batches and {_ratio_range(middle)} on middle",
        f"faster than it on {faster} of the {len(keys)} rows",
        f"{len(faulted)} row(s) left out",
        f"The reference backend takes {_ratio_range(reference)} `naive`'s time",
        f"{config['parameters'] / 1e6:.2f}M-parameter GPT, sequence {config['seq_len']}",
        f"gafused is {ours['ms_per_step'] / plain['ms_per_step'] - 1:.0%} slower than the plain PyTorch recipe",
        f"({ours['ms_per_step']:.1f} ms against {plain['ms_per_step']:.1f} ms",
        f"with the `opt.backward(loss, weight=w)` loop ({e2e['gafused backward']['ms_per_step']:.1f} ms)",
        f"on GPT-2's 148 bf16 gradients runs {gpt2_last[mine]['launches']} aten ops here, `naive` "
        f"{gpt2_last['naive']['launches']}",
    ]
    for text in quoted:
        assert text in flat, text
    # What the words claim of those figures holds in the file.
    assert min(last) > 1 and ours["ms_per_step"] > plain["ms_per_step"] and ours["backend"] == default
    assert ours["q20_ms"] > plain["q80_ms"], "the README calls their quantile ranges apart"
    if meta["git_tracked_files_modified"]:
        assert "with uncommitted changes in the tree" in flat


def test_the_readme_full_run_time_is_the_committed_runs() -> None:
    readme = " ".join((ROOT / "README.md").read_text().split())
    seconds = _cited_cpu_run(readme)[1]["meta"]["seconds"]
    assert f"`python bench/run.py --full` runs the whole sweep (about {round(seconds / 60)} minutes" in readme
    assert f"the committed run took {round(seconds)} s)" in readme


def test_the_readme_framework_exactness_tables_are_the_committed_reports() -> None:
    committed = (ROOT / "bench" / "results" / "frameworks-cases-cpu.md").read_text()
    readme = (ROOT / "README.md").read_text()
    tables = re.findall(r"(?:^\|.*\n)+", committed, re.MULTILINE)
    assert len(tables) == 3, "one table per framework: Accelerate, Trainer, Lightning"
    for table, script in zip(tables, ("accelerate", "transformers", "lightning"), strict=True):
        assert table in readme, f"README's table of `python tests/{script}_cases.py --report` is the committed one"
        cited = readme.split(f"python tests/{script}_cases.py --report`", 1)[1][:200]
        assert "`bench/results/frameworks-cases-cpu.md`" in cited
    assert "`frameworks-cases-cpu.md`" in (ROOT / "bench" / "results" / "README.md").read_text()


def test_the_readme_cpu_host_cost_figures_are_the_committed_runs() -> None:
    """Every host-cost figure of README "Benchmarks" is read from the three committed ``host_overhead.py --runs 3``
    files it cites, which the results index lists."""
    import host_overhead

    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("Host cost of a middle micro-step") : readme.index("**GPU: ")]
    flat = " ".join(section.split())
    cited = re.findall(r"`(bench/results/[^`]+-host-[^`]+\.json)`", flat)
    index = (ROOT / "bench" / "results" / "README.md").read_text()
    files = {}
    for path in cited:
        saved = json.loads((ROOT / path).read_text())
        assert saved["meta"]["complete"] and saved["meta"]["device"].startswith("CPU") and len(saved["runs"]) == 3
        assert saved["ranges"] == host_overhead.ranges(saved["runs"])
        assert path.removeprefix("bench/results/") in index
        args = saved["meta"]["arguments"]
        files[(args["tensors"], args["numel"], args["dtype"], saved["meta"]["triton_interpret"])] = saved
    assert sorted(files) == [(148, 64, "bf16", "1"), (148, 4096, "fp32", None), (1024, 64, "fp32", None)]

    def rows(saved: dict, what: str, backend: str = "-") -> list[dict]:
        return [next(r for r in run if (r["what"], r["backend"]) == (what, backend)) for run in saved["runs"]]

    def span(saved: dict, what: str, backend: str = "-", field: str = "ratio", spec: str = ".2f") -> str:
        values = [row[field] for row in rows(saved, what, backend)]
        return f"{min(values):{spec}}-{max(values):{spec}}"

    small, wide, triton = (
        files[(1024, 64, "fp32", None)],
        files[(148, 4096, "fp32", None)],
        files[(148, 64, "bf16", "1")],
    )
    baseline, plain, loop = "torch._foreach_add_", host_overhead.PLAIN_BACKWARD, host_overhead.BACKWARD_LOOP
    assert f"same tensors ({span(small, baseline, field='median_us', spec='.0f')} us interleaved" in flat
    alone = span(small, f"{baseline} alone, before profiling", field="median_us", spec=".0f")
    assert f"{alone} us called back to back" in flat
    assert f"`ops.fold_` with its gradient check {span(small, 'fold_', 'foreach')}x" in flat
    assert f"without it {span(small, 'fold_ check=False', 'foreach')}x" in flat
    assert f"`GradAccumulator.step()` {span(small, 'step', 'foreach')}x" in flat
    back_to_back = [
        step["median_us"] / alone["median_us"]
        for step, alone in zip(
            rows(small, "step", "foreach"), rows(small, f"{baseline} alone, before profiling"), strict=True
        )
    ]
    assert f"a whole step is {min(back_to_back):.2f}-{max(back_to_back):.2f}x, run by run" in flat
    assert f"reading every `p.grad` ({span(small, 'read p.grad')}x)" in flat
    assert f"setting each to None ({span(small, 'release p.grad')}x)" in flat
    assert f"takes {span(small, loop, 'foreach', 'x_plain_backward')}x plain PyTorch's" in flat
    assert f"adding into `.grad` ({span(small, plain, field='median_us', spec='.0f')} us;" in flat
    per_parameter = [
        (mine["median_us"] - theirs["median_us"]) / mine["tensors"]
        for mine, theirs in zip(rows(small, loop, "foreach"), rows(small, plain), strict=True)
    ]
    assert f"{min(per_parameter):.1f}-{max(per_parameter):.1f} us more per parameter" in flat
    assert f"the `reference` backend {span(small, loop, 'reference', 'x_plain_backward')}x" in flat
    floor = [
        read["ratio"] + release["ratio"]
        for read, release in zip(rows(wide, "read p.grad"), rows(wide, "release p.grad"), strict=True)
    ]
    assert f"that floor is {min(floor):.2f}-{max(floor):.2f}x" in flat
    assert f"`ops.fold_` {span(wide, 'fold_', 'foreach')}x, `step()` {span(wide, 'step', 'foreach')}x" in flat
    # The baseline alone before and after the profiled calls, run by run: how many within 4%, and the others.
    before, after = f"{baseline} alone, before profiling", f"{baseline} alone, after profiling"
    after_before = [
        second["median_us"] / first["median_us"]
        for saved in (small, wide, triton)
        for first, second in zip(rows(saved, before), rows(saved, after), strict=True)
    ]
    assert all(abs(ratio - 1) <= 0.04 for ratio in after_before), after_before
    assert "are within 4% of each other in all nine committed runs" in flat
    assert f"`ops.fold_` {span(triton, 'fold_', 'triton-host')}x the same run's `torch._foreach_add_`" in flat
    assert f"({span(triton, baseline, field='median_us', spec='.0f')} us), a whole `step()`" in flat
    assert f"`step()` {span(triton, 'step', 'triton-host')}x." in flat
    assert f"(`fold_ check=False`, {span(triton, 'fold_ check=False', 'triton-host')}x)" in flat


def test_the_readme_h100_test_counts_are_the_committed_log() -> None:
    log = (ROOT / "bench" / "results" / "nvidia-h100-80gb-hbm3-20261126-172216-gpu-check-tests.log").read_text()
    collected = int(re.search(r"workers \[(\d+) items\]", log).group(1))
    outcomes = re.findall(r"^\[gw\d+\] \[ *\d+%\] (PASSED|SKIPPED|FAILED|ERROR) (\S+?)::", log, re.MULTILINE)
    counts = {word: sum(outcome == word for outcome, _ in outcomes) for word in ("PASSED", "SKIPPED", "FAILED")}
    ran = len(outcomes)
    accelerate = [path for _, path in outcomes if path == "tests/test_integration_accelerate.py"]
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert (f"after {ran:,} of its {collected:,} tests: {counts['PASSED']:,} passed, {counts['SKIPPED']:,} skipped, "
            f"{counts['FAILED']} failed") in readme  # fmt: skip
    # Every test not run is one of the Accelerate file's, which the README names.
    assert (f"The {collected - ran} not run are the rest of `tests/test_integration_accelerate.py` (its first "
            f"{len(accelerate)} had passed)") in readme  # fmt: skip
    assert f"after 1,632 of {collected:,} tests" in " ".join((ROOT / "bench" / "NOTES.md").read_text().split())


def test_the_readme_gpu_kernel_table_is_the_committed_result() -> None:
    import summary

    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("**GPU: ") : readme.index("## Development")]
    cited = section.split("GPU kernel figures: `", 1)[1].split("`", 1)[0]
    results = json.loads((ROOT / cited).read_text())
    assert results["meta"]["device_type"] == "cuda" and results["meta"]["device"] in cited.replace("-", " ").upper()
    assert cited.removeprefix("bench/results/") in (ROOT / "bench" / "results" / "README.md").read_text()
    assert summary.readme_tables(results) in section, "the table is `python bench/run.py --table` of the cited file"
    flat = " ".join(section.split())
    rows = {(r["backend"], r["op"], r["grad_dtype"], r["acc_mb"]): r for r in results["kernels"]}
    largest = max(r["acc_mb"] for r in results["kernels"])
    reached = sorted(key[:3] for key, r in rows.items() if key[3] == largest and r["fraction_of_copy_bw"] >= 0.9)
    assert reached == sorted(
        [("triton", op, dtype) for op, dtype in [("fold", "bf16"), ("scale_cast", "-"), ("fold", "fp32"),
                                                 ("fold_finish", "fp32")]]
        + [("cuda", op, dtype) for op, dtype in [("fold", "fp32"), ("fold_finish", "fp32"), ("scale_cast", "-"),
                                                 ("sum_of_squares", "-")]]
    ), "the README names the ops that reach 90% at the largest size"  # fmt: skip
    for backend, op, dtype, name in [
        ("triton", "fold_finish", "bf16", "bf16 `fold_finish`"),
        ("triton", "sum_of_squares", "-", "`sum_of_squares`"),
        ("cuda", "fold", "bf16", "bf16 `fold`"),
        ("cuda", "fold_finish", "bf16", "`fold_finish`"),
    ]:
        fraction = rows[(backend, op, dtype, largest)]["fraction_of_copy_bw"]
        assert 0.89 <= fraction < 0.9 and f"{name} {fraction:.1%}" in flat, (backend, op, fraction)  # fmt: skip
    smallest = [r["fraction_of_copy_bw"] for key, r in rows.items() if key[3] == 256 and key[0] in ("triton", "cuda")]
    assert f"every op does ({min(smallest) * 100:.0f}-{max(smallest):.0%})" in flat


def test_a_failed_provider_fails_the_run(monkeypatch, tmp_path, capsys) -> None:
    import run
    import triton_launches

    monkeypatch.setattr(triton_launches, "Count", _NoCount)
    monkeypatch.setitem(sys.modules, "memory", None)  # the memory part reports itself absent
    real = providers.make_provider

    def broken(name, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202 - the provider factory's signature
        if name == "naive":
            raise RuntimeError("broken on purpose")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(providers, "make_provider", broken)
    argv = ["--quick", "--out", str(tmp_path), "--no-e2e", "--no-kernels", "--no-plots", "--sets", "single-big",
            "--dtypes", "fp32", "--providers", "naive,gafused-reference", "--no-progress"]  # fmt: skip
    assert run.main([*argv, "--device", "cpu"]) == 1
    said = capsys.readouterr()
    assert "row(s) failed" in said.err and "wrote " in said.err


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--accumulation-steps", "2"], "--accumulation-steps must be >= 3"), (["--out", "FILE"], "is not a directory")],
    ids=["n-too-small", "out-is-a-file"],
)
def test_bad_arguments_are_refused_before_anything_runs(monkeypatch, tmp_path, capsys, argv, message) -> None:
    import run

    monkeypatch.setattr(run, "run_micro", None)  # reached only if the refusal comes too late
    afile = tmp_path / "afile"
    afile.write_text("")
    argv = [str(afile) if arg == "FILE" else arg for arg in argv]
    with pytest.raises(SystemExit) as info:
        run.main(["--quick", "--no-progress", "--device", "cpu", *argv])
    assert message in str(info.value) + capsys.readouterr().err


# Every provider asked for exists, none can be timed on CPU (Triton's interpreter is not timed; the CUDA extension
# needs CUDA tensors).
_UNTIMED_ON_CPU = [name for name in providers.PROVIDERS if name not in providers.provider_names(torch.device("cpu"))]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--dtypes", "fp16"], "--dtypes: unknown ['fp16'] in 'fp16'; choose from bf16, fp32"),
        (["--dtypes", "bf16,"], "--dtypes: unknown ['']"),
        (["--sets", "single-big,nosuchset"], "--sets: unknown ['nosuchset']; a quick run on cpu has "),
        (["--sets", "llama-7b"], "--sets: none of ['llama-7b'] is a set of a quick run on cpu; choose from "),
        (["--providers", ",".join(_UNTIMED_ON_CPU)], "--providers: none of "),
        (["--providers", ""], "--providers: unknown ['']"),
        (["--device", "tpu"], "--device: 'tpu' is neither cuda (cuda:N) nor cpu"),
        (["--threads", "0"], "--threads must be >= 1"),
        (["--compile-max-tensors", "-1"], "--compile-max-tensors must be >= 0"),
        (["--table", "MISSING"], "is not a file"),
        (["--table", "NOTJSON"], "is not a results JSON written by bench/run.py"),
        (["--table", "OTHERJSON"], "is JSON, but not results written by bench/run.py"),
        (["--plot-only", "NOTJSON"], "--plot-only: "),
        (["--plot-only", "NODEVICE"], "is JSON, but not results written by bench/run.py (no meta.device)"),
        (["--table", "NODEVICE"], "is JSON, but not results written by bench/run.py (no meta.device)"),
        (["--out", "FILE/out"], "--out: FILE exists and is not a directory"),
        (["--kernels-only", "--no-kernels"], "--kernels-only with --no-kernels leaves nothing to run"),
        (["--plot-only", "RESULTS"], "--plot-only reads a results file and takes no other option, got --quick,"),
        (["--table", "RESULTS", "--plot-only", "RESULTS"], "takes no other option, got --plot-only, --quick,"),
    ],
    ids=["dtype", "empty-dtype", "unknown-set", "set-of-another-mode", "no-provider-runs", "empty-provider",
         "device", "threads", "compile-max-tensors", "missing-table", "table-not-json", "table-other-json",
         "plot-not-json", "plot-no-device", "table-no-device", "out-below-a-file", "nothing-to-run",
         "plot-with-run-options", "table-with-plot-only"],
)  # fmt: skip
def test_bad_options_are_refused_before_any_part_runs_or_any_file_is_written(
    monkeypatch, tmp_path, capsys, argv, message
) -> None:
    """A wrong option used to surface only when the micro-benchmark started, after memory and correctness (30-45 s
    on CPU, minutes on a GPU), leaving a results file marked partial."""
    import run

    def too_late(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - stands in for _run_parts
        raise AssertionError("a part ran before the options were checked")

    monkeypatch.setattr(run, "_run_parts", too_late)
    out = tmp_path / "out"
    (tmp_path / "not.json").write_text("not JSON")
    (tmp_path / "file").write_text("")
    (tmp_path / "other.json").write_text('{"meta": {"device": "cpu"}, "rows": []}')  # another script's results
    (tmp_path / "nodevice.json").write_text('{"meta": {"device_type": "cpu"}}')  # the plots name the device
    (tmp_path / "results.json").write_text('{"meta": {"device_type": "cpu", "device": "cpu"}, "rows": []}')
    names = {
        "RESULTS": "results.json",
        "MISSING": "missing.json",
        "NOTJSON": "not.json",
        "OTHERJSON": "other.json",
        "NODEVICE": "nodevice.json",
        "FILE": "file",
    }
    argv = [re.sub("|".join(names), lambda m: str(tmp_path / names[m[0]]), arg) for arg in argv]
    message = message.replace("FILE", str(tmp_path / "file"))
    with pytest.raises(SystemExit) as info:
        run.main(["--quick", "--no-progress", "--device", "cpu", "--out", str(out), *argv])
    assert info.value.code == 2  # as argparse refuses an option, and as the other scripts do
    assert message in capsys.readouterr().err
    assert not out.exists() and not (tmp_path / "file" / "out").exists()


@pytest.mark.parametrize(
    ("script", "argv", "message"),
    [
        ("host_overhead", ["--reps", "1"], "--reps must be at least 2, got 1"),
        ("host_overhead", ["--tensors", "0"], "--tensors must be at least 1, got 0"),
        ("host_overhead", ["--numel", "0"], "--numel must be at least 1, got 0"),
        ("host_overhead", ["--threads", "0"], "--threads must be at least 1, got 0"),
        ("host_overhead", ["--device", "tpu"], "--device: 'tpu' is neither cuda (cuda:N) nor cpu"),
        ("host_overhead", ["--out", "FILE/out"], "--out: FILE exists and is not a directory"),
        ("e2e_profile", ["--device", "tpu"], "--device: 'tpu' is neither cuda (cuda:N) nor cpu"),
        ("e2e_profile", ["--out", "FILE"], "--out: FILE exists and is not a directory"),
        ("e2e_profile", ["--threads", "0"], "--threads must be >= 1, got 0"),
        ("distributed", ["--out", "DIR"], "--out: DIR is a directory; a file is expected"),
        ("distributed", ["--out", "FILE/out.json"], "--out: FILE exists and is not a directory"),
        ("frameworks", ["--out", "DIR"], "--out: DIR is a directory; a file is expected"),
        ("frameworks", ["--table", "--out", "FILE"], "--table: cannot read the results of FILE (JSONDecodeError"),
        ("frameworks", ["--table", "--out", "DIR/missing.json"], "--table: cannot read the results of DIR/missing"),
        ("frameworks", ["--table", "--out", "LIST"], "--table: cannot read the results of LIST (TypeError"),
        ("host_overhead", ["--out", "BROKEN"], "--out: BROKEN is a broken symbolic link"),
        ("distributed", ["--out", "DIR/sub.json"], "--out: DIR/sub.csv is a directory; a file is expected"),
    ],
)
def test_the_other_scripts_refuse_bad_options_before_they_measure(monkeypatch, tmp_path, capsys, script, argv, message):
    """Exit status 2 with the option named, before anything is measured or written: not a traceback (or a lost run,
    where the output was checked only when saving it)."""
    import importlib

    module = importlib.import_module(script)
    for name in ("run", "rows", "profile_recipe"):  # what measures, in each script
        if hasattr(module, name):
            monkeypatch.setattr(module, name, lambda *args, **kwargs: pytest.fail("measured before refusing"))
    (tmp_path / "file").write_text("not JSON")
    (tmp_path / "list.json").write_text("[]")
    (tmp_path / "sub.csv").mkdir()  # where distributed.py would write the CSV beside sub.json
    (tmp_path / "broken").symlink_to(tmp_path / "nowhere")
    made = sorted(path.name for path in tmp_path.iterdir())
    places = {"FILE": tmp_path / "file", "DIR": tmp_path, "LIST": tmp_path / "list.json", "BROKEN": tmp_path / "broken"}
    placed = re.compile("|".join(places))
    argv = [placed.sub(lambda m: str(places[m[0]]), arg) for arg in argv]
    with pytest.raises(SystemExit) as info:
        module.main(argv)
    assert info.value.code == 2
    assert placed.sub(lambda m: str(places[m[0]]), message) in capsys.readouterr().err
    assert sorted(path.name for path in tmp_path.iterdir()) == made


def test_a_provider_selection_that_cannot_run_here_exits_non_zero_with_the_reasons(tmp_path) -> None:
    """The command line as a user runs it: exit status 2 (1 is a run with a failed row), the reasons and the usage
    on stderr, no results directory."""
    out = tmp_path / "out"
    command = [sys.executable, str(ROOT / "bench/run.py"), "--quick", "--no-progress", "--no-e2e", "--no-kernels",
               "--device", "cpu", "--out", str(out), "--providers", ",".join(_UNTIMED_ON_CPU)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("usage: run.py")
    assert f"--providers: none of {_UNTIMED_ON_CPU} can be timed on cpu" in done.stderr
    for name in _UNTIMED_ON_CPU:
        assert f"{name}: {providers.unavailable_reason(name, torch.device('cpu'))}" in done.stderr
    assert done.stdout == "" and not out.exists()


def test_a_set_of_another_mode_or_device_is_skipped_with_a_message(capsys) -> None:
    import run

    args = run._parse_args(["--quick", "--sets", "gpt2-124m,single-big"])  # gpt2-124m: the GPU's layout
    assert [s.name for s in run._selected_sets(args, torch.device("cpu"), "quick")] == ["single-big"]
    assert "--sets: gpt2-124m skipped: not a set of a quick run on cpu" in capsys.readouterr().err


def test_the_memory_tracker_keeps_the_profilers_lines_off_stderr(capfd) -> None:
    """torch.profiler prints native start/stop lines on stderr (torch 2.13), over run.py's progress bars."""
    import memory

    row = memory.measure("plain", torch.float32, layers=1, width=8)
    assert row["peak_bytes"] > 0
    assert capfd.readouterr().err == ""


def test_gpu_launch_counts_leave_out_the_device_copies_of_profiler_ranges(monkeypatch) -> None:
    """On a GPU the profiler mirrors host ranges (torch.compile's ``## Call CompiledFxGraph ##``) as CUDA events
    marked as user annotations: they launch nothing, so they are not counted."""
    import types

    import timing

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [
        types.SimpleNamespace(device_type=cuda, is_user_annotation=False, name="triton_poi_fused_add_0"),
        types.SimpleNamespace(device_type=cuda, is_user_annotation=True, name="## Call CompiledFxGraph ##"),
        types.SimpleNamespace(device_type=cuda, is_user_annotation=False, name="Memset (Device)"),
        types.SimpleNamespace(device_type=cpu, is_user_annotation=True, name="## Call CompiledFxGraph ##"),
    ]

    class Profile:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def events(self):
            return events

    monkeypatch.setattr(torch.profiler, "profile", lambda **kwargs: Profile())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    assert timing.count_launches(lambda: None, None, torch.device("cuda")) == 2


def test_on_a_gpu_the_memory_cases_follow_an_unrecorded_one(monkeypatch) -> None:
    """A GPU peak counts from what was allocated when its case began: memory the process allocates once (library
    workspaces) would fall to the first case, so on a GPU that case first runs once unrecorded. On CPU, where the
    tracker sees tensors only, every case runs once."""
    import memory

    calls = []

    def measure(recipe, dtype, layers, width, device, bucket_bytes):
        calls.append((recipe, dtype))
        return {"recipe": recipe, "param_dtype": str(dtype), "backend": "", "peak_bytes_per_param": len(calls)}

    monkeypatch.setattr(memory, "measure", measure)
    cpu_rows = memory.run(quick=True, device=torch.device("cpu"))
    assert calls == [(row["recipe"], getattr(torch, row["param_dtype"].removeprefix("torch."))) for row in cpu_rows]
    calls.clear()
    gpu_rows = memory.run(quick=True, device=torch.device("cuda"))
    assert calls[0] == calls[1] == ("plain", torch.float32) and len(calls) == len(gpu_rows) + 1
    assert [row["peak_bytes_per_param"] for row in gpu_rows] == list(range(2, len(calls) + 1))


def test_end_to_end_tables_show_the_requested_peak_where_it_was_measured() -> None:
    """Results with ``peak_requested_mb`` (the allocator's requested-bytes peak, free of block rounding) show it
    beside the block peak; older results, which lack it, print as before."""
    import run
    import summary

    rows = [
        {"recipe": "plain", "ms_per_step": 2.0, "q20_ms": 1.9, "q80_ms": 2.1, "samples_per_s": 8.0,
         "backend": None, "peak_memory_mb": 3905.0, "peak_requested_mb": 3870.123456},
        {"recipe": "gafused", "ms_per_step": 1.5, "q20_ms": 1.4, "q80_ms": 1.6, "samples_per_s": 9.0,
         "backend": "cuda", "peak_memory_mb": 3909.0, "peak_requested_mb": 3870.125},
    ]  # fmt: skip
    config = {"parameters": 10, "hidden": 4, "layers": 1, "seq_len": 8, "batch": 8, "autocast_bf16": True}
    results = {"meta": {"device_type": "cuda"}, "micro": [], "e2e": {"config": config, "rows": rows}}
    table = summary.readme_tables(results)
    assert "| peak MiB | peak MiB requested |" in table
    assert "| plain | 2.0 | - | 3905 | 3870.123 |" in table and "| gafused | 1.5 | cuda | 3909 | 3870.125 |" in table
    assert "3870.123" in run.format_e2e_table(results["e2e"], "a GPU")
    older = [{key: value for key, value in row.items() if key != "peak_requested_mb"} for row in rows]
    table = summary.readme_tables({**results, "e2e": {"config": config, "rows": older}})
    assert "requested" not in table and "| plain | 2.0 | - | 3905 |" in table


def test_the_readme_gpu_window_end_to_end_and_memory_figures_are_the_committed_results() -> None:
    import summary

    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("**GPU: ") : readme.index("## Development")]
    flat = " ".join(section.split())
    cited = flat.split("GPU window, end-to-end and memory figures: `", 1)[1].split("`", 1)[0]
    results = json.loads((ROOT / cited).read_text())
    meta = results["meta"]
    assert meta["device_type"] == "cuda" and meta["accumulation_steps"] == 8 and meta["triton"] == "3.6.0"
    assert cited.removeprefix("bench/results/") in (ROOT / "bench" / "results" / "README.md").read_text()
    assert summary.readme_tables(results) in section, "the tables are `python bench/run.py --table` of the file"

    windows = summary.window_ms(results["micro"], meta["accumulation_steps"])

    def times(set_name: str, provider: str, baseline: str = "naive") -> str:
        return f"{windows[(set_name, 'bf16', baseline)] / windows[(set_name, 'bf16', provider)]:.1f}x"

    gpt2 = [times("gpt2-124m", p) for p in ("gafused-cuda", "gafused-triton", "foreach", "compiled")]
    llama = [times("llama-7b", p) for p in ("gafused-cuda", "gafused-triton", "foreach", "compiled")]
    margins = [times(s, p, "foreach") for s in ("gpt2-124m", "llama-7b") for p in ("gafused-cuda", "gafused-triton")]
    assert f"gafused-cuda {gpt2[0]} `naive` and gafused-triton {gpt2[1]}, ahead of `foreach` ({gpt2[2]})" in flat
    assert f"and `compiled` ({gpt2[3]}): the goal is met" in flat
    assert (
        f"the margin is {margins[0]} (cuda) and {margins[1]} (triton) on GPT-2 shapes, {margins[2]} (cuda) and "
        f"{margins[3]} (triton) on LLaMA-7B shapes" in flat
    )
    assert (
        f"Against `naive` on LLaMA-7B shapes: {llama[0]} (cuda) and {llama[1]} (triton), ahead of `foreach` "
        f"({llama[2]} `naive`) and `compiled` ({llama[3]})" in flat
    )
    assert min(float(x[:-1]) for x in gpt2[:2]) >= 3 and max(float(x[:-1]) for x in llama[:2]) < 3
    assert all(windows[(s, "bf16", p)] < windows[(s, "bf16", "foreach")]
               for s in ("gpt2-124m", "llama-7b") for p in ("gafused-cuda", "gafused-triton"))  # fmt: skip
    rows = {(r["set"], r["moment"], r["provider"]): r for r in results["micro"]}
    naive_middle = rows[("llama-7b", "middle", "naive")]
    assert f"at {naive_middle['fraction_of_copy_bw']:.0%} of copy bandwidth on a middle micro-batch" in flat
    assert f"would be {1 / naive_middle['fraction_of_copy_bw']:.1f}x" in flat
    # That run divided every set by one 256 MiB copy; against the 4 GB copy of the kernel sweep file (README's
    # kernel table) the fractions and bounds are these.
    sweep_path = flat.split("in the H200's kernel sweep file (`", 1)[1].split("`", 1)[0]
    sweep = json.loads((ROOT / sweep_path).read_text())
    assert sweep["meta"]["device"] == results["meta"]["device"] == "NVIDIA H200"
    copy_4g = next(r["copy_gbps"] for r in sweep["kernels"] if r["acc_mb"] == 4096)
    copy_run = meta["copy_bandwidth_gbps"]
    floor_ms = {m: rows[("llama-7b", m, "naive")]["min_bytes"] / (copy_4g * 1e9) * 1e3 for m in ("middle", "last")}
    window_bound = windows[("llama-7b", "bf16", "naive")] / (7 * floor_ms["middle"] + floor_ms["last"])
    middle_bound = naive_middle["median_ms"] / floor_ms["middle"]
    assert meta["copy_bytes"] == 2 * 256 * 2**20 and window_bound < 3
    triton_llama = rows[("llama-7b", "middle", "gafused-triton")]
    notes = " ".join((ROOT / "bench" / "NOTES.md").read_text().split())
    for text, where in [
        (f"its run's one copy of 256 MiB ({copy_run:.0f} GB/s", flat),
        (f"{copy_4g:.0f} GB/s at 4 GB in the H200's kernel sweep file", flat),
        (f"`naive` streams at {naive_middle['gbps'] / copy_4g:.0%} (its {naive_middle['gbps']:.0f} GB/s)", flat),
        (f"would be {middle_bound:.1f}x and the whole window at most {window_bound:.1f}x", flat),
        (f"every fraction of that run reads {copy_4g / copy_run - 1:.0%} high ({copy_4g:.0f} / {copy_run:.0f})", flat),
        (f"single 256 MiB copy ({copy_run:.0f} GB/s", notes),
        (f"naive's {naive_middle['gbps']:.0f} GB/s is {naive_middle['gbps'] / copy_4g:.0%}", notes),
        (f"is at most {middle_bound:.1f}x, the whole window", notes),
        (f"at most {window_bound:.1f}x; every micro-benchmark fraction of this file reads {copy_4g / copy_run - 1:.0%}"
         f" high ({copy_4g:.0f} / {copy_run:.0f})", notes),
        (f"is {triton_llama['fraction_of_copy_bw']:.0%} of the 256 MiB copy and {triton_llama['gbps'] / copy_4g:.0%}"
         f" of the 4 GB one", notes),
    ]:  # fmt: skip
        assert text in where, text
    triton, cuda = rows[("gpt2-124m", "middle", "gafused-triton")], rows[("gpt2-124m", "middle", "gafused-cuda")]
    assert f"{triton['host_ms']:.2f} ms of host time in {triton['median_ms']:.2f} ms" in flat
    assert f"(cuda: {cuda['host_ms']:.2f} ms in {cuda['median_ms']:.2f} ms)" in flat
    launches = {rows[(s, "middle", p)]["launches"] for s in ("gpt2-124m", "llama-7b") for p in ("gafused-triton",)}
    assert launches == {4} and {rows[(s, "middle", "gafused-cuda")]["launches"] for s in ("gpt2-124m", "llama-7b")} == {
        5
    }

    e2e = results["e2e"]
    assert e2e["config"]["model"] == "transformers GPT2LMHeadModel" and e2e["config"]["accumulation_steps"] == 8
    by = {row["recipe"].split(":")[0]: row for row in e2e["rows"]}
    plain, step, backward = by["plain"], by["gafused"], by["gafused backward"]
    big = next(row for row in e2e["rows"] if row["recipe"].startswith("big batch"))
    assert {row["reps"] for row in e2e["rows"][1:]} == {5}, "the README says 5 windows each"
    quoted = [
        f"the gafused loop that folds at `step()` took {step['ms_per_step']:.1f} ms, the plain PyTorch recipe "
        f"{plain['ms_per_step']:.1f} ms and the loop that folds during backward (`opt.backward(loss)`) "
        f"{backward['ms_per_step']:.1f} ms",
        f"ranges overlap ({step['q20_ms']:.0f}-{step['q80_ms']:.0f}, {plain['q20_ms']:.0f}-{plain['q80_ms']:.0f} "
        f"and {backward['q20_ms']:.0f}-{backward['q80_ms']:.0f} ms)",
        f"about {plain['ms_per_step'] / 8:.0f} ms each where the whole batch takes {big['ms_per_step'] / 8:.1f} ms",
        f"both gafused loops {step['peak_memory_mb']:.0f} MiB against plain PyTorch's "
        f"{plain['peak_memory_mb']:.0f} MiB",
        f"{step['peak_memory_mb'] - plain['peak_memory_mb']:.0f} MiB over the goal",
    ]
    # What the words claim: the ranges do overlap, so no speed difference is established.
    assert step["q80_ms"] > plain["q20_ms"] and plain["q80_ms"] > backward["q20_ms"]
    for text in quoted:
        assert text in flat, text
    assert round(step["peak_memory_mb"]) == round(backward["peak_memory_mb"])
    # Those peaks are raw (results of that time): they include the run's timer's cache-flush buffer.
    import timing

    assert "peak_memory_raw_mb" not in plain and timing._CACHE_FLUSH_BYTES["cuda"] == 256 * 2**20
    assert "Every peak of that run includes the benchmark's own 256 MiB cache-flush buffer" in flat
    assert "include the timer's 256 MiB cache-flush buffer" not in flat
    notes = " ".join((ROOT / "bench" / "NOTES.md").read_text().split())
    assert f"plain {plain['peak_memory_mb']:.0f} MiB, both gafused loops {step['peak_memory_mb']:.0f} MiB" in notes
    assert "Each of these peaks includes the timer's 256 MiB cache-flush buffer" in notes
    bench_readme = " ".join((ROOT / "bench" / "README.md").read_text().split())
    assert (f"the committed H200 figures ({plain['peak_memory_mb']:.0f} MiB plain, {step['peak_memory_mb']:.0f} MiB "
            f"both gafused loops) include the 256 MiB flush buffer") in bench_readme  # fmt: skip

    memory = {(r["recipe"], r["param_dtype"]): f"{r['peak_bytes_per_param']:.2f}" for r in results["memory"]}
    assert all(r["device"] == "cuda" and r["backend"] in ("", "cuda") for r in results["memory"])
    for dtype in ("float32", "bfloat16"):
        assert memory[("gafused-step", dtype)] == memory[("gafused-backward", dtype)], "the README says both loops"
    plain32, ours32 = memory[("plain", "float32")], memory[("gafused-step", "float32")]
    assert f"fp32 parameters plain PyTorch {plain32} bytes (the run's first case" in flat
    assert f"gafused {ours32} (both loops)" in flat
    # The first case's excess over the next, which README and NOTES put down to memory allocated once per process.
    first, second = results["memory"][:2]
    assert (first["recipe"], first["param_dtype"], second["recipe"]) == ("plain", "float32", "gafused-step")
    excess = first["peak_bytes"] - second["peak_bytes"]
    per_param = f"{excess / first['params']:.1f} bytes per parameter"
    whole = " ".join((ROOT / "README.md").read_text().split())
    assert f"it read {per_param} below plain" in whole and f"gap ({excess / 2**20:.0f} MiB)" in whole
    assert f"most likely {per_param.split()[0]} bytes of it" in flat
    notes = " ".join((ROOT / "bench" / "NOTES.md").read_text().split())
    assert f"its {excess:,} bytes ({excess / 2**20:.0f} MiB, {per_param}) over the next case" in notes
    plain16, megatron, ours16 = (memory[(r, "bfloat16")] for r in ("plain", "megatron", "gafused-step"))
    assert (
        f"bf16 parameters plain PyTorch {plain16} (bf16 sums), Megatron-style fp32 accumulation {megatron}, "
        f"gafused {ours16}" in flat
    )


def test_the_readme_gpu_kernel_configuration_figures_are_the_committed_results() -> None:
    readme = (ROOT / "README.md").read_text()
    flat = " ".join(readme[readme.index("**GPU: ") : readme.index("## Development")].split())
    cited = flat.split("Kernel time alone (`", 1)[1].split("`", 1)[0]
    rows = json.loads((ROOT / cited).read_text())["rows"]
    assert cited.removeprefix("bench/results/") in (ROOT / "bench" / "results" / "README.md").read_text()

    def span(size: int, backend: str, key: str) -> str:
        values = [r[key] for r in rows if (r["acc_mb"], r["backend"], r["config"]) == (size, backend, "default")]
        return f"{min(values) * 100:.0f}-{max(values):.0%}"

    assert (f"at 256 MB the kernels alone reach {span(256, 'triton', 'queued_fraction')} of copy (triton) and "
            f"{span(256, 'cuda', 'queued_fraction')} (cuda), `sum_of_squares` the lowest of each, against "
            f"{span(256, 'triton', 'idle_fraction')} and {span(256, 'cuda', 'idle_fraction')} from an idle "
            "device") in flat  # fmt: skip
    assert (f"at 4 GB every op of both backends reaches the goal (triton {span(4096, 'triton', 'queued_fraction')}, "
            f"cuda {span(4096, 'cuda', 'queued_fraction')} of copy)") in flat  # fmt: skip
    assert min(r["queued_fraction"] for r in rows if r["acc_mb"] == 4096 and r["config"] == "default") >= 0.9
    for size in (256, 4096):
        lowest = {backend: min((r["queued_fraction"], r["op"]) for r in rows
                               if (r["acc_mb"], r["backend"], r["config"]) == (size, backend, "default"))[1]
                  for backend in ("triton", "cuda")}  # fmt: skip
        assert size != 256 or lowest == {"triton": "sum_of_squares", "cuda": "sum_of_squares"}
    # Each queued fraction divides by a copy timed queued too, so neither side pays a launch the other does not.
    assert all(r["copy_queued_gbps"] > 0 for r in rows)

    def fraction(config: str, op: str, key: str = "queued_fraction") -> str:
        row = next(r for r in rows if (r["acc_mb"], r["config"], r["op"], r["grad_dtype"]) == (4096, config, op, "bf16")
                   and r["backend"] == "triton")  # fmt: skip
        return f"{row[key]:.0%}"

    # Version 1 ran 4096 x 8; version 2 (the default since) runs 4096 x 4 for bf16 gradients.
    assert f"bf16 `fold` went from {fraction('4096x8', 'fold')} to {fraction('4096x4', 'fold')}" in flat
    assert (
        f"`fold_finish` from {fraction('4096x8', 'fold_finish')} to {fraction('4096x4', 'fold_finish')} of copy" in flat
    )
    idle = [fraction(c, op, "idle_fraction") for op in ("fold", "fold_finish") for c in ("4096x8", "4096x4")]
    assert f"from an idle device {idle[0]} to {idle[1]} and {idle[2]} to {idle[3]})" in flat
    from gafused.triton_backend._layout import fold_num_warps, launch_config

    assert launch_config((1 << 20,)) == (4096, 8) and fold_num_warps(8, 4, 2) == 4


# --- a run stopped by its time limit keeps what it measured (SIGTERM from bench/gpu_check.sh's `timeout`) ---------


class _Unhandled(Exception):
    """Raised by the test's own SIGTERM handler: the code under test did not handle the signal itself."""


@pytest.fixture
def sigterm_fallback():
    """While the test runs, a SIGTERM that the code under test does not handle raises ``_Unhandled`` (instead of
    killing the test process)."""
    import signal

    def unhandled(signum, frame):
        raise _Unhandled("SIGTERM reached the test's fallback handler")

    previous = signal.signal(signal.SIGTERM, unhandled)
    yield
    signal.signal(signal.SIGTERM, previous)


def _sigterm_self() -> None:
    import signal

    os.kill(os.getpid(), signal.SIGTERM)  # the handler runs in this (main) thread before the next line


_STOP_ARGV = ["--quick", "--no-kernels", "--no-plots", "--sets", "single-big", "--dtypes", "fp32",
              "--providers", "naive,gafused-reference", "--no-progress", "--device", "cpu"]  # fmt: skip


@pytest.mark.parametrize("stop_in", ["provider", "e2e"])
def test_a_run_stopped_by_sigterm_writes_what_it_measured(monkeypatch, tmp_path, capsys, sigterm_fallback, stop_in):
    """SIGTERM inside a provider or the end-to-end part: the rows measured before it are written, marked partial in
    the JSON, the tables and the screen; the stopped provider is not reported as a failure; the exit is 143."""
    import e2e
    import run
    import triton_launches

    monkeypatch.setattr(triton_launches, "Count", _NoCount)
    monkeypatch.setitem(sys.modules, "memory", None)
    real_make = providers.make_provider

    def make(name, *args, **kwargs):
        provider = real_make(name, *args, **kwargs)
        if stop_in == "provider" and name == "gafused-reference":
            provider.step = _sigterm_self
        return provider

    monkeypatch.setattr(providers, "make_provider", make)
    monkeypatch.setattr(e2e, "run_e2e", lambda *args, **kwargs: _sigterm_self())
    assert run.main([*_STOP_ARGV, "--out", str(tmp_path)]) == 143
    said = capsys.readouterr()
    results = json.loads(next(tmp_path.glob("*.json")).read_text())
    meta = results["meta"]
    during = "micro-benchmark: single-big fp32 gafused-reference" if stop_in == "provider" else "end to end"
    assert meta["complete"] is False and meta["interrupted"]["signal"] == "SIGTERM"
    assert meta["interrupted"]["during"] == during
    measured = {(r["provider"], r["moment"]): r["status"] for r in results["micro"]}
    expected = {("naive", "middle"): "ok", ("naive", "last"): "ok"}
    if stop_in == "e2e":
        expected |= {("gafused-reference", "middle"): "ok", ("gafused-reference", "last"): "ok"}
    assert measured == expected, "the rows before the signal, none for the stopped provider, no 'failed' row"
    assert results["e2e"] is None and results["kernels"] == [] and results["correctness"] is not None
    tables = next(tmp_path.glob("*-tables.txt")).read_text()
    assert tables.startswith("PARTIAL RESULTS: stopped by SIGTERM") and during in tables.splitlines()[0]
    assert "PARTIAL RESULTS" in said.out and "(partial: stopped by SIGTERM" in said.err
    assert not list(tmp_path.glob("*.png")), "no figures: SIGKILL follows soon; --plot-only draws them later"
    assert not list(tmp_path.glob("*.tmp"))


def test_the_kernel_configs_and_profile_scripts_keep_what_they_measured(monkeypatch, tmp_path, sigterm_fallback):
    import e2e
    import e2e_profile
    import interrupt
    import kernel_configs

    def two_rows_then_stopped(device, sizes, configs, reps, rows, where):
        rows += [{"acc_mb": 256, "backend": "triton", "config": "default", "op": "fold", "grad_dtype": "bf16",
                  "idle_ms": 1.0, "idle_fraction": 0.5, "queued_ms": 0.8, "queued_fraction": 0.6}] * 2  # fmt: skip
        where["during"] = "4096 MB, cuda, config default"
        _sigterm_self()

    # The fake GPU only for the kernel configs: left in place, the CPU profile below would make torch's optimizers
    # ask a CUDA build of torch without a driver whether its stream is capturing, which raises.
    with monkeypatch.context() as fake_gpu:
        fake_gpu.setattr(torch.cuda, "is_available", lambda: True)
        fake_gpu.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
        fake_gpu.setattr(kernel_configs, "run", two_rows_then_stopped)
        assert kernel_configs.main(["--out", str(tmp_path)]) == 143
    (path,) = tmp_path.glob("*-kernel-configs.json")
    saved = json.loads(path.read_text())
    assert len(saved["rows"]) == 2 and saved["meta"]["complete"] is False
    assert saved["meta"]["interrupted"] == {"signal": "SIGTERM", "during": "4096 MB, cuda, config default"}
    assert path.with_suffix(".txt").read_text().startswith("PARTIAL RESULTS: stopped by SIGTERM")

    real_profile = e2e_profile.profile_recipe
    profiled = []

    def stop_at_the_second(*args, **kwargs):
        if profiled:
            raise interrupt.Interrupted("SIGTERM")
        profiled.append(real_profile(*args, **kwargs))
        return profiled[-1]

    monkeypatch.setattr(e2e_profile, "profile_recipe", stop_at_the_second)
    out = tmp_path / "profile"
    assert e2e_profile.main(["--quick", "--device", "cpu", "--warmup", "1", "--out", str(out)]) == 143
    saved = json.loads(next(out.glob("*-e2e-profile.json")).read_text())
    first, second = list(e2e.setup(torch.device("cpu"), "quick").recipes)[1:3]
    assert list(saved["recipes"]) == [first[0]] and saved["meta"]["interrupted"]["during"] == second[0]
    assert saved["meta"]["complete"] is False


def test_host_overhead_has_a_same_dtype_floor_beside_a_mixed_dtype_baseline():
    """bf16 gradients into fp32 accumulators cannot take torch's multi-tensor fast path; the same-dtype row can."""
    import host_overhead

    rows = host_overhead.rows(tensors=3, numel=4, dtype=torch.bfloat16, reps=3, warmup=1)
    assert [row["what"] for row in rows[:2]] == ["torch._foreach_add_", "torch._foreach_add_ same dtype"]
    assert all(row["reps"] == 3 and row["interrupted"] is None for row in rows)
    assert "torch._foreach_add_ same dtype" not in {row["what"] for row in host_overhead.rows(3, 4, reps=3, warmup=1)}


# --- end-to-end peaks net of the harness; one timer; the copy at the set's size; nothing of a finished provider ---


class _FakeCudaMemory:
    """torch.cuda's allocator counters, for code that only reads them: ``allocate``/``free`` move them."""

    def __init__(self) -> None:
        self.allocated = self.peak = 0

    def allocate(self, nbytes: int) -> None:
        self.allocated += nbytes
        self.peak = max(self.peak, self.allocated)

    def free(self, nbytes: int) -> None:
        self.allocated -= nbytes

    def install(self, monkeypatch) -> None:
        def reset(device=None):
            self.peak = self.allocated

        stats = {"memory_allocated": lambda device=None: self.allocated,
                 "max_memory_allocated": lambda device=None: self.peak, "reset_peak_memory_stats": reset,
                 "synchronize": lambda device=None: None, "empty_cache": lambda: None,
                 "memory_stats": lambda device=None: {"requested_bytes.all.current": self.allocated - 100,
                                                      "requested_bytes.all.peak": self.peak - 100}}  # fmt: skip
        for name, fake in stats.items():
            monkeypatch.setattr(torch.cuda, name, fake)


def test_end_to_end_peaks_leave_out_the_harness_and_reuse_the_runs_timer(monkeypatch):
    """On a GPU (its allocator counters faked here): one Timer for the whole run (no second 256 MiB flush buffer),
    at least E2E_MIN_REPS_GPU windows, and peaks net of what was allocated before the recipe's model existed."""
    import e2e
    import timing

    mib = 2**20
    memory = _FakeCudaMemory()
    memory.install(monkeypatch)
    memory.allocate(256 * mib)  # the run's timer's flush buffer, allocated before the end-to-end part
    model_bytes, step_bytes = 100 * mib, 50 * mib

    def build():
        memory.allocate(model_bytes)  # the recipe's model and optimizer state: its own, kept in its peak
        return torch.nn.Linear(2, 2), None

    def make_step(model, optimizer):
        def step():
            memory.allocate(step_bytes)
            memory.free(step_bytes)

        return step

    config = e2e.config_for(torch.device("cpu"), "quick")
    fake = e2e.Setup(config, lambda config: torch.nn.Linear(2, 2), True, build, [("plain", 4, make_step)])
    monkeypatch.setattr(e2e, "setup", lambda device, mode, max_grad_norm: fake)

    def no_second_timer(*args, **kwargs):
        raise AssertionError("run_e2e built a Timer of its own: a second cache-flush buffer")

    monkeypatch.setattr(e2e, "Timer", no_second_timer)
    asked = []

    class _Timer:
        min_reps, max_reps, budget_s, warmup = 5, 40, 0.25, 1

        def measure(self, run, prepare=None, min_reps=None):
            asked.append(min_reps)
            run()
            return timing.Timing(1.0, 0.9, 1.1, min_reps or self.min_reps, 1.0)

    result = e2e.run_e2e(torch.device("cuda"), "quick", _Timer())
    (row,) = result["rows"]
    assert asked == [e2e.E2E_MIN_REPS_GPU]
    assert row["harness_mb"] == 256
    assert row["peak_memory_mb"] == (model_bytes + step_bytes) / mib
    assert row["peak_memory_raw_mb"] == 256 + (model_bytes + step_bytes) / mib
    assert row["peak_requested_mb"] == (model_bytes + step_bytes) / mib
    assert row["peak_requested_raw_mb"] == 256 + (model_bytes + step_bytes - 100) / mib
    import run
    import summary

    assert "peaks net of the harness's 256 MiB" in run.format_e2e_table(result, "a GPU")
    table = summary.readme_tables({"meta": {"device_type": "cuda"}, "micro": [], "e2e": result})
    assert "| peak MiB (harness excluded) | peak MiB requested (harness excluded) |" in table
    assert "| plain | 1.0 | - | 150 | 150.000 |" in table


def test_micro_rows_carry_the_copy_of_their_sets_size(monkeypatch, tmp_path):
    import run
    import timing

    sizes = []
    real = timing.copy_bandwidth_gbps

    def spy(timer, nbytes):
        sizes.append(nbytes)
        return real(timer, nbytes)

    monkeypatch.setattr(timing, "copy_bandwidth_gbps", spy)
    args = run._parse_args(["--quick", "--sets", "single-big,many-small", "--dtypes", "bf16,fp32",
                            "--providers", "naive", "--device", "cpu"])  # fmt: skip
    timer = timing.Timer(torch.device("cpu"), budget_s=0.01, min_reps=1, max_reps=2, warmup=0)
    rows = run.run_micro(args, torch.device("cpu"), timer, progress=None)
    # One copy per set (both dtypes share it), at the quick CPU floor of 16 MiB: these sets are smaller.
    assert sizes == [16 * 2**20, 16 * 2**20]
    for row in rows:
        assert row["copy_bytes"] == 2 * 16 * 2**20
        assert row["fraction_of_copy_bw"] == pytest.approx(row["gbps"] / row["copy_gbps"])
    # On a GPU: the set's fp32 accumulator, at least 1 GiB, at most 40% of free memory per buffer.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40 * 2**30, 80 * 2**30))
    cuda = torch.device("cuda")
    assert run._copy_nbytes(param_sets.gpt2(), cuda, quick=False) == 2**30
    assert run._copy_nbytes(param_sets.single(1 << 30), cuda, quick=False) == 4 * 2**30
    assert run._copy_nbytes(param_sets.llama(), cuda, quick=False) == int(0.4 * 40 * 2**30)


def test_a_provider_that_would_not_fit_is_skipped_by_its_own_need():
    """``compiled`` holds one more fp32 copy of the accumulators than the other providers: on an 80 GB GPU the
    LLaMA-7B shapes fit every provider but it (its rows are skipped with the reason, not failed by running out of
    memory), on a 141 GB one every provider."""
    import run

    llama, gib = param_sets.llama(), 2**30
    base = run._memory_needed(llama, torch.bfloat16)
    assert run._memory_needed(llama, torch.bfloat16, "naive") == base == llama.numel * 10
    assert run._memory_needed(llama, torch.bfloat16, "compiled") == llama.numel * 14
    h100_free, h200_free = 79 * gib, 139 * gib
    assert run._memory_skip_reason(llama, torch.bfloat16, None, h100_free) is None
    assert run._memory_skip_reason(llama, torch.bfloat16, "gafused-triton", h100_free) is None
    reason = run._memory_skip_reason(llama, torch.bfloat16, "compiled", h100_free)
    assert reason == f"skipped: needs ~{llama.numel * 14 / gib:.1f} GiB, 79.0 GiB free"
    assert run._memory_skip_reason(llama, torch.bfloat16, "compiled", h200_free) is None


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_nothing_of_a_finished_provider_is_alive_when_the_next_one_is_built(monkeypatch, dtype):
    """A finished provider leaves its gradients in p.grad; the micro-benchmark releases them (and the provider)
    before the next provider allocates its own, so one provider's memory is alive at a time."""
    import gc
    import weakref

    import run
    import timing

    alive = []  # weak references to every tensor of the providers built so far
    real_make = providers.make_provider

    def make(name, params, *args, **kwargs):
        assert all(param.grad is None for param in params), "a p.grad left by the previous provider"
        dead = [ref for ref in alive if ref() is None]
        assert len(dead) == len(alive), f"{len(alive) - len(dead)} tensors of a finished provider still alive"
        provider = real_make(name, params, *args, **kwargs)
        held = getattr(provider, "main_grads", []) + [f for f in getattr(provider, "finished", []) if f is not None]
        if hasattr(provider, "accumulator"):
            held += [buffer.data for buffer in provider.accumulator.buffers]
        alive.extend(weakref.ref(tensor) for tensor in held)
        return provider

    monkeypatch.setattr(providers, "make_provider", make)
    names = [n for n in providers.provider_names(torch.device("cpu")) if n != "compiled"]
    args = run._parse_args(["--quick", "--sets", "single-big", "--dtypes", dtype, "--providers", ",".join(names),
                            "--device", "cpu"])  # fmt: skip
    timer = timing.Timer(torch.device("cpu"), budget_s=0.01, min_reps=1, max_reps=2, warmup=0)
    rows = run.run_micro(args, torch.device("cpu"), timer, progress=None)
    assert {row["status"] for row in rows} == {"ok"} and len(rows) == 2 * len(names)
    gc.collect()
    assert all(ref() is None for ref in alive)


def test_compiled_rows_record_the_compile_warm_up(monkeypatch):
    import run
    import timing

    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)  # the plumbing, not torch.compile's time
    args = run._parse_args(["--quick", "--sets", "single-big", "--dtypes", "fp32", "--providers", "compiled,naive",
                            "--device", "cpu"])  # fmt: skip
    timer = timing.Timer(torch.device("cpu"), budget_s=0.01, min_reps=1, max_reps=2, warmup=0)
    rows = run.run_micro(args, torch.device("cpu"), timer, progress=None)
    compiled = [row for row in rows if row["provider"] == "compiled"]
    assert len(compiled) == 2 and all(row["compile_warmup_s"] > 0 for row in compiled)
    assert not any("compile_warmup_s" in row for row in rows if row["provider"] == "naive")


def test_readme_tables_skip_a_kernel_size_that_did_not_fit() -> None:
    import summary

    results = json.loads((ROOT / "bench/results/nvidia-h200-20261126-012944-kernels-only.json").read_text())
    results["kernels"].append({"acc_mb": 8192, "status": "skipped: not enough free device memory"})
    table = summary.readme_tables(results)
    header, _, copy, *rows = table.splitlines()
    assert header.endswith("| 8192 MB: GB/s (of copy) |") and copy.endswith("| 4262 | skipped |")
    assert all(row.endswith("| - |") for row in rows)


# --- provenance: the tree that ran, not only the HEAD of the copy it ran in ---------------------------------------


def test_the_facts_say_whether_the_gafused_that_ran_is_the_checkouts(tmp_path, monkeypatch) -> None:
    """The scripts import the installed gafused: the tree names the checkout's code only where that is what ran."""
    import provenance

    assert provenance.facts("cpu")["gafused_from_checkout"] is True  # (the suite runs this checkout's gafused)
    assert provenance.gafused_from_checkout(tmp_path) is False  # another copy's root
    monkeypatch.setattr(gafused, "__file__", str(tmp_path / "site-packages" / "gafused" / "__init__.py"))
    assert provenance.facts("cpu")["gafused_from_checkout"] is False


def test_git_tree_names_the_files_on_disk_not_only_head(tmp_path, monkeypatch) -> None:
    import provenance

    git = _scratch_repository(tmp_path)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.py").write_text("a = 1\n")
    (tmp_path / "run.sh").write_text("echo\n")
    (tmp_path / "run.sh").chmod(0o755)
    (tmp_path / ".gitignore").write_text("*.log\n")
    git("add", "-A")
    git("commit", "-q", "-m", "one")
    clean = provenance.git_tree(tmp_path)
    assert clean == {"git_tree": git("rev-parse", "HEAD^{tree}"), "git_tree_dirty": False, "git_untracked": []}
    # A copy whose files moved on from its HEAD: the tree is what `git add --all && git write-tree` would record.
    (tmp_path / "sub" / "a.py").write_text("a = 2\n")
    (tmp_path / "new.py").write_text("b = 1\n")
    (tmp_path / "ignored.log").write_text("not part of the tree\n")
    moved = provenance.git_tree(tmp_path)
    assert moved["git_tree_dirty"] is True and moved["git_untracked"] == ["new.py"]
    assert provenance.git_commit(tmp_path) == (git("rev-parse", "HEAD"), True)
    git("add", "-A")
    assert moved["git_tree"] == git("write-tree")
    # Without git, or outside a checkout: None, never a failure.
    assert provenance.git_tree(tmp_path / "sub") == {"git_tree": None, "git_tree_dirty": None, "git_untracked": None}
    monkeypatch.setattr(provenance.shutil, "which", lambda name: None)
    assert provenance.git_tree(tmp_path)["git_tree"] is None and provenance.facts("cpu")["git_tree"] is None


def test_bench_distributed_by_hand_never_overwrites_the_committed_results(monkeypatch, tmp_path) -> None:
    import distributed

    committed = tmp_path / "results" / "distributed-cpu.json"
    monkeypatch.setattr(distributed, "DEFAULT_OUT", committed)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    meta = {"seconds": 1.0}
    monkeypatch.setattr(distributed, "run", lambda quick, names, memory: {"meta": meta, "rows": []})
    monkeypatch.setattr(distributed, "format_table", lambda results: "")
    for argv, name in [(["--quick"], "distributed-quick.json"), ([], "distributed-cpu.json"),
                       (["--plain-fsdp2", "--no-memory"], "distributed-cpu.json")]:  # fmt: skip
        assert distributed.main(argv) == 0
        assert not committed.exists(), argv
        assert (tmp_path / "cache" / "gafused" / "bench" / name).exists(), argv
    assert distributed.main(["--plain-fsdp2"]) == 0 and committed.exists(), "the command of the committed file"


# --- bench/gpu_check.sh: phases stopped at their limit keep their output; env fails without a GPU; the plan --------


def _gpu_check_tree(tmp_path: Path, fake_python: str | None = None) -> dict[str, str]:
    """A tree holding bench/gpu_check.sh and a built-looking extension; the environment to run it with."""
    (tmp_path / "bench").mkdir()
    (tmp_path / "gafused").mkdir()
    (tmp_path / "gafused" / "_C.fake.so").write_text("")
    (tmp_path / "bench" / "gpu_check.sh").write_text((ROOT / "bench" / "gpu_check.sh").read_text())
    python = sys.executable
    if fake_python is not None:
        python = str(tmp_path / "python")
        Path(python).write_text(f"#!{sys.executable}\n{fake_python}")
        Path(python).chmod(0o755)
    return {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": python, "GPU_CHECK_GRACE_S": "5"}


def _gpu_check(tmp_path: Path, env: dict[str, str], script: str) -> subprocess.CompletedProcess:
    """Run ``script`` in bash after sourcing the tree's gpu_check.sh (which then only defines its functions)."""
    return subprocess.run(["bash", "-c", f"source bench/gpu_check.sh; {script}"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


_STOPPED_BENCHMARK = """import signal, sys, time
if sys.argv[1:2] == ["-c"]:
    sys.exit(1)  # have_matplotlib: no
def stop(signum, frame):
    time.sleep(0.5)  # writing its partial results
    print("wrote /x/partial.json (partial: stopped by SIGTERM during the kernel sweep)", file=sys.stderr, flush=True)
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
print("measuring", flush=True)
time.sleep(60)
"""


def test_gpu_check_phase_at_its_limit_gets_sigterm_and_keeps_what_its_program_wrote(tmp_path) -> None:
    env = _gpu_check_tree(tmp_path, _STOPPED_BENCHMARK)
    done = _gpu_check(tmp_path, env, "run_phase kernels 2; echo status=$?")
    # The log's last line is written by the program's SIGTERM handler: stopped at the limit, not killed.
    assert "status=1" in done.stdout and "== kernels: TIMED OUT" in done.stdout
    log = (tmp_path / "out" / "gpu-kernels.log").read_text()
    assert log == "measuring\nwrote /x/partial.json (partial: stopped by SIGTERM during the kernel sweep)\n"
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert summary.split()[:3] == ["kernels", "TIMED", "OUT"]
    assert summary.rstrip().endswith("wrote partial.json (partial: stopped by SIGTERM during the kernel sweep)")


def test_gpu_check_host_summary_reads_each_step_row_ratio(tmp_path, capsys) -> None:
    """The summary line of the ``host`` phase: each backend's ``step`` ratio to the baseline, read from the table
    bench/host_overhead.py prints (whose last column is the launch count, not the ratio)."""
    import host_overhead

    assert host_overhead.main(["--tensors", "3", "--numel", "2", "--reps", "3"]) == 0
    table = capsys.readouterr().out
    ratios = {line.split()[1]: line.split()[-2] for line in table.splitlines() if line.startswith("step ")}
    assert set(ratios) >= {"reference", "foreach"}
    env = _gpu_check_tree(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "gpu-host.log").write_text(table)
    done = _gpu_check(tmp_path, env, "detail_of host")
    assert done.stdout.strip() == ";".join(f"{backend} {ratio}x" for backend, ratio in ratios.items())


def test_gpu_check_env_fails_without_a_cuda_torch(tmp_path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: env passes here")
    env = _gpu_check_tree(tmp_path)  # this machine's python: torch imports, no GPU
    done = _gpu_check(tmp_path, env, "run_phase env 60; echo status=$?")
    assert "== env: FAILED (1)" in done.stdout and "status=1" in done.stdout
    assert "env: FAILED: torch is not a CUDA build or sees no GPU" in (tmp_path / "out" / "gpu-env.log").read_text()


def test_gpu_check_plans_and_limits_fit_the_budget(tmp_path) -> None:
    env = _gpu_check_tree(tmp_path)
    script = """set -e
plan all; plan; plan env build tests; plan configs host windows profile; plan bench bench_fp32
rm gafused/_C.fake.so; plan env kernels host; plan env
for phase in env build sanitize tests; do echo "$phase ${phase_cap[$phase]}"; done
echo "grace $grace_s"
"""
    lines = _gpu_check(tmp_path, {**env, "GPU_CHECK_GRACE_S": "20"}, script).stdout.splitlines()
    assert lines[:7] == [
        "env build sanitize tests", "env build sanitize tests", "env build tests", "configs host windows profile",
        "bench bench_fp32", "env build kernels host", "env",
    ]  # fmt: skip
    caps = dict(line.split() for line in lines[7:11])
    cap = {phase: int(value) for phase, value in caps.items()}
    grace, budget = int(lines[11].split()[1]), 570
    # `all`: sanitize gets its whole cap even after env and build take their whole caps (bench/README says so) ...
    assert budget - cap["env"] - cap["build"] - grace >= cap["sanitize"]
    # ... and the suite what is left: on the H200, env, build and sanitize took 10 + 55 + 119 s.
    assert budget - (10 + 55 + 119) - grace == 366
    # `env build tests` (the next run's call) gives the suite its whole cap after the H200's env and build.
    assert budget - (10 + 55) - grace >= cap["tests"]
    limits = _gpu_check(tmp_path, env, "phase_limit sanitize 300; phase_limit tests 100; phase_limit tests 600")
    assert limits.stdout.split() == ["200", "95", "480"]
    refused = subprocess.run(["bash", "bench/gpu_check.sh", "env", "bogus"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    assert refused.returncode == 2 and "unknown phase 'bogus'" in refused.stderr
    assert not (tmp_path / "out" / "gpu-env.log").exists(), "refused before any phase ran"


# --- what the docs say of sizes, N, commits and the host baseline is what the code and the files hold ---------------


def test_the_docs_state_the_kernel_sweep_sizes_and_the_end_to_end_n() -> None:
    import e2e
    import kernels

    readme = (ROOT / "README.md").read_text()
    section = " ".join(readme[readme.index("## Benchmarks") : readme.index("## Development")].split())
    default = [mb for mb in kernels._SIZES_MB["cuda"]["default"]]
    added = [mb for mb in kernels._SIZES_MB["cuda"]["full"] if mb not in default]

    def sizes(mbs: list[int]) -> str:
        return ", ".join(f"{mb} MB" if mb < 1024 else f"{mb // 1024} GB" for mb in mbs)

    assert default == [256, 1024, 4096] and added == [512, 2048]
    assert f"only the kernel sweep: {sizes(default)} on a GPU (--full adds {sizes(added)})" in section
    cpu, gpu = (e2e.config_for(torch.device(kind), "full") for kind in ("cpu", "cuda"))
    bench_readme = " ".join((ROOT / "bench" / "README.md").read_text().split())
    assert (f"a batch of {cpu.batch} in {cpu.accumulation_steps} micro-batches on CPU, of {gpu.batch} in "
            f"{gpu.accumulation_steps} on a GPU") in bench_readme  # fmt: skip
    assert "always splits its batch" not in bench_readme
    host = "on a GPU, its launches plus any wait for the device inside the call"
    assert host in bench_readme and "the launches without waiting for the kernels" not in bench_readme


def test_the_results_index_names_the_commit_each_gpu_file_records() -> None:
    index = " ".join((ROOT / "bench" / "results" / "README.md").read_text().split())
    for path in sorted((ROOT / "bench" / "results").glob("nvidia-*.json")):
        commit = json.loads(path.read_text())["meta"]["git_commit"][:7]
        sentence = next(part for part in index.split("; ") if f"`{path.name}`" in part and "record" in part)
        assert commit in sentence, (path.name, commit)
    # `all` no longer runs the kernel sweep: the index says what it was then.
    assert "`bash bench/gpu_check.sh all` as it was then (env, build, tests, sanitize, kernels;" in index


def test_a_sigterm_that_fired_stays_ignored_after_its_block(monkeypatch):
    """Between the measuring block and the writing block a second SIGTERM must not kill the run."""
    import signal

    import interrupt

    monkeypatch.setattr(interrupt, "_fired", False)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(interrupt.Interrupted):
            with interrupt.sigterm_raises():
                os.kill(os.getpid(), signal.SIGTERM)
                for _ in range(10**7):  # the handler runs between bytecodes
                    pass
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_the_kernel_sweep_alone_takes_no_micro_benchmark_options(monkeypatch, tmp_path) -> None:
    """--kernels-only runs no micro-benchmark: a provider that cannot run here is not its concern."""
    import run

    reached = []

    def parts(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - stands in for _run_parts
        reached.append(args[-1])
        raise KeyboardInterrupt

    monkeypatch.setattr(run, "_run_parts", parts)
    argv = ["--quick", "--no-progress", "--device", "cpu", "--out", str(tmp_path / "out"), "--no-plots"]
    run.main([*argv, "--kernels-only", "--providers", ",".join(_UNTIMED_ON_CPU)])
    assert reached == [None]


def test_git_tree_orders_folders_and_keeps_links_and_deletions_as_git_does(tmp_path) -> None:
    """A folder sorts as if its name ended in '/' (``a.py`` before ``a/``), a symlink is its target's path, a
    deleted tracked file is left out, and every untracked file is named: the tree is ``git add --all``'s."""
    import provenance

    git = _scratch_repository(tmp_path)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.py").write_text("x = 1\n")
    (tmp_path / "a.py").write_text("a = 1\n")
    (tmp_path / "gone.py").write_text("g = 1\n")
    (tmp_path / "link").symlink_to("a.py")
    git("add", "-A")
    git("commit", "-q", "-m", "one")
    assert provenance.git_tree(tmp_path)["git_tree"] == git("rev-parse", "HEAD^{tree}")
    (tmp_path / "gone.py").unlink()
    (tmp_path / "new2.py").write_text("n = 2\n")
    (tmp_path / "new1.py").write_text("n = 1\n")
    moved = provenance.git_tree(tmp_path)
    assert moved["git_untracked"] == ["new1.py", "new2.py"] and moved["git_tree_dirty"] is True
    git("add", "-A")
    assert moved["git_tree"] == git("write-tree")


def test_the_cpu_name_is_procs_model_name() -> None:
    import provenance

    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), None)
    if model is None:
        pytest.skip("/proc/cpuinfo names no model here")
    assert provenance.cpu_name() == model and provenance.device_name("cpu") == f"CPU {model}"


def test_interrupt_exit_statuses_and_a_second_sigterm_inside_the_block(monkeypatch):
    """143 for SIGTERM, 130 for Ctrl-C; once a SIGTERM raised, a second one in the same block is ignored (the
    script is writing what it measured); sigterm_ignored puts back the handler it found."""
    import signal

    import interrupt

    assert interrupt.exit_status(interrupt.Interrupted("SIGTERM")) == 143
    assert interrupt.exit_status(KeyboardInterrupt()) == 130
    monkeypatch.setattr(interrupt, "_fired", False)
    previous = signal.getsignal(signal.SIGTERM)

    def mine(signum, frame):  # noqa: ANN001, ANN202
        raise AssertionError("the handler sigterm_ignored replaced ran")

    try:
        signal.signal(signal.SIGTERM, mine)
        with interrupt.sigterm_ignored():
            assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is mine
        with interrupt.sigterm_raises():
            with pytest.raises(interrupt.Interrupted):
                os.kill(os.getpid(), signal.SIGTERM)
                for _ in range(10**7):
                    pass
            assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_gpu_check_host_summary_says_partial(tmp_path) -> None:
    import host_overhead

    rows = host_overhead.rows(tensors=3, numel=2, reps=3, warmup=1)
    stopped = "PARTIAL RESULTS: stopped by SIGTERM during sampling, after 3 of 500 rounds"
    log = f"{stopped}\n{host_overhead.format_table(rows)}"
    env = _gpu_check_tree(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "gpu-host.log").write_text(log + "\n")
    done = _gpu_check(tmp_path, env, "detail_of host")
    steps = [f"{row['backend']} {row['ratio']:.2f}x" for row in rows if row["what"] == "step"]
    assert done.stdout.strip() == ";".join(["partial", *steps])


_IGNORES_SIGTERM = """import signal, sys, time
if sys.argv[1:2] == ["-c"]:
    sys.exit(1)  # have_matplotlib: no
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("measuring", flush=True)
time.sleep(60)
"""


def test_gpu_check_phase_killed_after_its_grace_is_timed_out(tmp_path) -> None:
    env = {**_gpu_check_tree(tmp_path, _IGNORES_SIGTERM), "GPU_CHECK_GRACE_S": "1"}
    done = _gpu_check(tmp_path, env, "run_phase kernels 1; echo status=$?")
    assert "== kernels: TIMED OUT" in done.stdout and "status=1" in done.stdout


def _gpu_check_main(tmp_path: Path, env: dict[str, str], phases: str, defined: str) -> subprocess.CompletedProcess:
    """``main PHASES`` of the sourced script with the phase functions of ``defined`` in place of the real ones."""
    names = " ".join(re.findall(r"(phase_[a-z_0-9]+)\(\)", defined))
    script = f"{defined}\nexport -f {names}\nmain {phases}"
    return _gpu_check(tmp_path, env, script)


def test_gpu_check_main_stops_after_a_failed_build_and_reports_the_budget(tmp_path) -> None:
    env = _gpu_check_tree(tmp_path)
    out = tmp_path / "out"
    fakes = """phase_build() { echo building; return 1; }
phase_kernels() { echo ran > "$out/kernels-ran"; }
phase_env() { sleep "${ENV_SLEEP:-0}"; return "${ENV_STATUS:-0}"; }
phase_sanitize() { echo "compute-sanitizer not found" > "$(log sanitize)"; return 77; }"""
    # A failed build: nothing after it runs, the call fails with 1.
    done = _gpu_check_main(tmp_path, env, "build kernels", fakes)
    assert done.returncode == 1 and not (out / "kernels-ran").exists()
    summary = (out / "summary.txt").read_text().splitlines()
    assert summary[0].split()[:3] == ["build", "FAILED", "(1)"] and summary[1].split()[:3] == ["later", "not", "run"]
    # A skipped phase (no compute-sanitizer) is no failure.
    done = _gpu_check_main(tmp_path, env, "sanitize", fakes)
    assert done.returncode == 0 and "sanitize   skipped" in done.stdout
    # No phase starts with less than 20 s: 24 s of budget less 5 of grace leaves 19 -> not run, status 3.
    done = _gpu_check_main(tmp_path, {**env, "GPU_CHECK_BUDGET_S": "24"}, "env", fakes)
    assert done.returncode == 3 and "budget of 24 s spent" in done.stdout
    # A phase that fails and spends the budget: the next is not run, and the status says the failure (1), not 3.
    slow = {**env, "GPU_CHECK_BUDGET_S": "27", "ENV_SLEEP": "3", "ENV_STATUS": "1"}
    done = _gpu_check_main(tmp_path, slow, "env kernels", fakes)
    assert done.returncode == 1 and not (out / "kernels-ran").exists()
    assert "kernels    not run" in done.stdout and "budget of 27 s spent" in done.stdout


def test_git_tree_reads_the_execute_bit_and_nested_repositories_as_git_add_does(tmp_path) -> None:
    """A file is 100755 when its owner may execute it (git's test, whoever runs the check); an untracked repository
    of its own is the commit it has checked out, as ``git add --all`` adds it, and one with no commit leaves no tree
    to name."""
    import provenance

    git = _scratch_repository(tmp_path)
    (tmp_path / "run.sh").write_text("echo\n")
    (tmp_path / "run.sh").chmod(0o654)  # group and others may execute, the owner may not: not executable to git
    (tmp_path / "tool.sh").write_text("echo\n")
    (tmp_path / "tool.sh").chmod(0o744)
    git("add", "-A")
    git("commit", "-q", "-m", "one")
    clean = provenance.git_tree(tmp_path)
    assert clean["git_tree"] == git("rev-parse", "HEAD^{tree}") and clean["git_tree_dirty"] is False
    inner = tmp_path / "inner"
    inner.mkdir()
    _git_at(inner, "init", "-q")
    (inner / "x.py").write_text("x = 1\n")
    unborn = provenance.git_tree(tmp_path)
    assert unborn["git_tree"] is None and unborn["git_tree_dirty"] is True and unborn["git_untracked"] == ["inner/"]
    _git_at(inner, "add", "-A")
    _git_at(inner, "commit", "-q", "-m", "inner")
    nested = provenance.git_tree(tmp_path)
    assert nested["git_untracked"] == ["inner/"] and nested["git_tree_dirty"] is True
    git("add", "-A")
    assert nested["git_tree"] == git("write-tree")


def test_every_kernel_sweep_series_has_its_own_colour_line_and_marker(monkeypatch, tmp_path) -> None:
    """Two backends of six (op, grad dtype) series each are more than matplotlib's ten colours: each line is told
    apart by its colour, line style and marker together, never by its legend label alone."""
    pytest.importorskip("matplotlib")
    import plots
    from matplotlib.colors import to_hex

    drawn = []
    monkeypatch.setattr(plots, "_save", lambda figure, path: drawn.append(figure) or path)
    series = [(op, dtype) for dtype in ("bf16", "fp32") for op in traffic.OP_NAMES if dtype == "bf16" or "fold" in op]
    rows = [
        {"status": "ok", "acc_mb": mb, "copy_gbps": 10.0, "backend": backend, "op": op, "grad_dtype": dtype,
         "gbps": 5.0 + index}
        for backend in ("triton", "cuda", "foreach") for index, (op, dtype) in enumerate(series) for mb in (256, 1024)
    ]  # fmt: skip
    assert plots.kernels(rows, tmp_path / "kernels.png", "GPU x", cpu=False) is not None
    (figure,) = drawn
    lines = [line for line in figure.axes[0].get_lines() if not line.get_label().startswith(("copy_", "goal"))]
    assert len(lines) == 3 * len(series) > 10
    looks = [(to_hex(line.get_color()), line.get_linestyle(), line.get_marker()) for line in lines]
    assert len(set(looks)) == len(looks), "two series look the same"
    figure.clf()


def test_the_summary_says_why_it_has_no_launch_table_when_no_set_it_compares_ran() -> None:
    """The launch table compares the gpt2* and many-small sets: a run of --sets single-big says so in its place,
    not an empty table of headings."""
    import summary

    rows = [
        {"set": "single-big", "tensors": 1, "elements": 1 << 20, "grad_dtype": "fp32", "provider": provider,
         "backend": None, "moment": moment, "status": "ok", "median_ms": 1.0, "host_ms": 1.0, "launches": 3}
        for provider in ("naive", "gafused-reference") for moment in ("middle", "last")
    ]  # fmt: skip
    meta = {"device_type": "cpu", "device": "CPU x", "gafused": "0", "torch": "0", "mode": "quick",
            "date_utc": "2000-01-01T00:00:00+00:00", "default_backend": "reference"}  # fmt: skip
    triton = {"skipped": "not counted in this test"}
    screen = summary.render({"meta": meta, "micro": rows, "triton_launches": triton}, [])
    section = screen.split("LAUNCHES AND HOST TIME")[1].split("KERNELS VS COPY BANDWIDTH")[0]
    said = " ".join(section.split())
    assert "no table" in said and "gpt2* and many-small" in said and "only single-big" in said
    assert all(line.split()[:1] != ["provider"] for line in section.splitlines()), "no heading of an empty table"
    assert "gafused-triton launches: not counted in this test" in said
    rows = [{**row, "set": "many-small-512"} for row in rows]
    section = summary.render({"meta": meta, "micro": rows}, []).split("LAUNCHES AND HOST TIME")[1]
    assert "no table" not in section and "naive" in section and "many-small-512: 1 tensors" in section


@pytest.mark.parametrize("state", ["interrupted", "unfinished", "complete"])
def test_the_readme_tables_of_a_partial_results_file_say_it_is_partial(tmp_path, capsys, state) -> None:
    """``--table`` of a run stopped by SIGTERM (or still being written) says so first, as its -tables.txt does."""
    import run

    row = {"set": "single-big", "tensors": 1, "elements": 1 << 20, "grad_dtype": "fp32", "provider": "naive",
           "moment": "middle", "status": "ok", "median_ms": 1.0, "launches": 3}  # fmt: skip
    meta = {"device_type": "cpu", "device": "CPU x", "complete": state == "complete", "interrupted": None}
    if state == "interrupted":
        meta["interrupted"] = {"signal": "SIGTERM", "during": "end to end", "after_s": 12.0}
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"meta": meta, "micro": [row], "e2e": None, "kernels": []}))
    assert run.main(["--table", str(path)]) == 0
    printed = capsys.readouterr().out
    first = printed.splitlines()[0]
    if state == "interrupted":
        assert first.startswith("PARTIAL RESULTS: stopped by SIGTERM") and "during end to end" in first
    elif state == "unfinished":
        assert first.startswith("PARTIAL RESULTS: the run was still measuring")
    else:
        assert "PARTIAL" not in printed and first.startswith("| set | grads | moment |")
    assert "| single-big (1 tensor, 1.0M elements) | fp32 | middle | 1.00 |" in printed


def test_an_out_folder_that_cannot_be_made_is_refused_naming_out(monkeypatch, tmp_path, capsys) -> None:
    """An --out that passes the up-front checks but cannot be created (``/proc/x``: /proc is writable to root, yet
    takes no new folder) is refused with exit status 2 naming --out, before any part runs: not a traceback."""
    import run

    monkeypatch.setattr(run, "_run_parts", lambda *args, **kwargs: pytest.fail("a part ran before --out was made"))
    real_mkdir = Path.mkdir

    def mkdir(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - Path.mkdir's signature
        if self == tmp_path / "out":
            raise FileNotFoundError(2, "No such file or directory", str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    with pytest.raises(SystemExit) as info:
        run.main(["--quick", "--no-progress", "--device", "cpu", "--no-plots", "--out", str(tmp_path / "out")])
    assert info.value.code == 2
    assert f"--out: cannot create {tmp_path / 'out'}: No such file or directory" in capsys.readouterr().err


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_an_out_under_proc_is_refused_by_the_command_line(tmp_path) -> None:
    command = [sys.executable, str(ROOT / "bench/run.py"), "--quick", "--no-progress", "--device", "cpu",
               "--out", "/proc/gafused-bench-out"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "--out: " in done.stderr and done.stdout == ""


@pytest.mark.parametrize("cuda", [True, False], ids=["gpu", "no-gpu"])
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--sizes-mb", "abc"], "argument --sizes-mb: expected whole MB >= 1 separated by commas (like 256,4096), "
                                "got 'abc'"),
        (["--sizes-mb", "256,"], "argument --sizes-mb: "),
        (["--sizes-mb", "0"], "argument --sizes-mb: "),
        (["--configs", "4096xa"], "argument --configs: expected BLOCKxWARPS items like 4096x8, got '4096xa'"),
        (["--reps", "2"], "--reps must be >= 3, got 2"),
    ],
    ids=["sizes-not-a-number", "sizes-empty-item", "sizes-zero", "configs", "reps"],
)  # fmt: skip
def test_kernel_configs_names_the_option_it_refuses(monkeypatch, tmp_path, capsys, cuda, argv, message) -> None:
    """A malformed --sizes-mb used to end in int()'s own words ("invalid literal for int() with base 10"), or, with
    no GPU, in "needs a CUDA device": the refusal names the option whether or not a GPU is there."""
    import kernel_configs

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(kernel_configs, "run", lambda *args, **kwargs: pytest.fail("measured before refusing"))
    with pytest.raises(SystemExit) as info:
        kernel_configs.main([*argv, "--out", str(tmp_path / "out")])
    assert info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_kernels_only_run_writes_no_memory_none(tmp_path) -> None:
    """--kernels-only measures no memory: its tables have no memory section (not "memory: None") and its summary
    says the part did not run."""
    command = [sys.executable, str(ROOT / "bench/run.py"), "--kernels-only", "--quick", "--no-plots", "--no-progress",
               "--device", "cpu", "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    (tables,) = tmp_path.glob("*-kernels-only-tables.txt")
    text = tables.read_text()
    assert "None" not in text and "memory" not in text.lower()
    assert "kernel sweep" in text
    for summary_text in (done.stdout, next(tmp_path.glob("*-summary.txt")).read_text()):
        memory = summary_text.split("MEMORY ")[1].split("CORRECTNESS ")[0]
        assert memory.splitlines()[1:3] == ["  not run", ""]


@pytest.mark.parametrize("threads", [1, 2])
def test_the_profile_script_fixes_and_records_the_thread_count_and_names_its_files_as_run_does(
    monkeypatch, tmp_path, threads
) -> None:
    """e2e_profile.py on CPU runs torch with --threads (default 1, as bench/run.py), records the count, and names its
    files after the device as bench/run.py does (the CPU's model and threads), not ``cpu-...``."""
    import e2e_profile
    import provenance

    monkeypatch.setattr(
        e2e_profile, "profile_recipe", lambda *args, **kwargs: {"seen_threads": torch.get_num_threads()}
    )
    monkeypatch.setattr(e2e_profile, "format_report", lambda results: "report")
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        argv = ["--quick", "--device", "cpu", "--warmup", "1", "--out", str(tmp_path)]
        assert e2e_profile.main(argv + ([] if threads == 1 else ["--threads", str(threads)])) == 0
    finally:
        torch.set_num_threads(before)
    (path,) = tmp_path.glob("*-e2e-profile.json")
    saved = json.loads(path.read_text())
    label = f"{provenance.device_name('cpu')} ({threads} thread{'s' if threads > 1 else ''})"
    assert saved["meta"]["device"] == label and saved["meta"]["cpu_threads"] == threads
    assert {r["seen_threads"] for r in saved["recipes"].values()} == {threads}
    assert path.name.startswith(provenance.slug(label) + "-") and not path.name.startswith("cpu-2")


def test_gpu_check_refuses_an_unknown_phase_before_it_creates_anything(tmp_path) -> None:
    """``bash bench/gpu_check.sh nope`` is refused (status 2) without making its output folder, $OUT's or the
    default bench/results/gpu-check; a call it accepts makes it."""
    env = _gpu_check_tree(tmp_path)
    before = sorted(str(path.relative_to(tmp_path)) for path in tmp_path.rglob("*"))
    default = {key: value for key, value in env.items() if key != "OUT"}
    for environment in (env, default):
        refused = subprocess.run(["bash", "bench/gpu_check.sh", "nope"], cwd=tmp_path, env=environment,
                                 capture_output=True, text=True, timeout=60)  # fmt: skip
        assert refused.returncode == 2 and "unknown phase 'nope'" in refused.stderr
        assert sorted(str(path.relative_to(tmp_path)) for path in tmp_path.rglob("*")) == before
    done = _gpu_check_main(tmp_path, env, "env", 'phase_env() { echo ok > "$(log env)"; }')
    assert done.returncode == 0 and (tmp_path / "out" / "gpu-env.log").read_text() == "ok\n"
    assert (tmp_path / "out" / "summary.txt").exists()
