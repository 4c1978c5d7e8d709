"""The benchmark providers compute what they claim: every one finishes a window with the same gradient.

Timing is not tested here (no timing assertions); ``python bench/run.py --quick`` is the smoke run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import param_sets  # noqa: E402 - bench/ is not a package; its modules import each other as siblings
import providers  # noqa: E402
import traffic  # noqa: E402

ACCUMULATION_STEPS = 4
MAX_GRAD_NORM = 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["naive", "foreach", "gafused-reference"])
def test_provider_finishes_the_window_like_float64(name: str, dtype: torch.dtype) -> None:
    param_set = param_sets.gpt2(hidden=8, layers=1, vocab=37, positions=5, name="tiny")
    generator = torch.Generator().manual_seed(1)
    # One gradient set per micro-batch, so the window folds each exactly once, in order.
    pool = [
        [torch.randn(shape, generator=generator).to(dtype) for shape in param_set.shapes]
        for _ in range(ACCUMULATION_STEPS)
    ]
    params = [torch.nn.Parameter(torch.empty(shape, dtype=dtype)) for shape in param_set.shapes]
    provider = providers.make_provider(name, params, pool, ACCUMULATION_STEPS, MAX_GRAD_NORM)

    provider.prepare("last")
    assert provider.position() == ACCUMULATION_STEPS - 1
    provider.step()
    assert provider.position() == 0

    mean = [sum(grads[i].double() for grads in pool) / ACCUMULATION_STEPS for i in range(len(params))]
    norm = torch.sqrt(sum(g.square().sum() for g in mean))
    assert norm > MAX_GRAD_NORM, "the clip must be active for this test to check it"
    coef = MAX_GRAD_NORM / (norm + 1e-6)
    for param, expected in zip(params, mean, strict=True):
        assert param.grad is not None and param.grad.dtype == dtype
        torch.testing.assert_close(param.grad, (expected * coef).to(dtype))


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
    assert run.run_memory(quick=True, progress=None) == (None, "not built yet")

    calls = []
    row = {"recipe": "plain PyTorch", "param_dtype": "float32", "peak_bytes_per_param": 16.0, "note": "AdamW"}

    def fake_run(quick, progress):
        calls.append((quick, progress))
        return [row]

    monkeypatch.setitem(sys.modules, "memory", types.SimpleNamespace(run=fake_run))
    marker = object()
    assert run.run_memory(quick=False, progress=marker) == ([row], None)
    assert calls == [(False, marker)]

    def failing_run(quick, progress):
        raise RuntimeError("no room")

    monkeypatch.setitem(sys.modules, "memory", types.SimpleNamespace(run=failing_run))
    rows, status = run.run_memory(quick=True, progress=None)
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

    class _NoCount:
        def start(self):
            return self

        def result(self):
            return {"skipped": "not counted in this test"}

    monkeypatch.setattr(triton_launches, "Count", _NoCount)
    memory = types.SimpleNamespace(run=lambda quick, progress: _MEMORY_ROWS) if memory_built else None
    monkeypatch.setitem(sys.modules, "memory", memory)
    argv = ["--quick", "--out", str(tmp_path), "--no-e2e", "--sets", "single-big", "--dtypes", "fp32",
            "--providers", "naive,gafused-reference", "--no-progress", "--device", "cpu"]  # fmt: skip
    assert run.main(argv) == 0
    screen = capsys.readouterr().out
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
