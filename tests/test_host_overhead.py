"""bench/host_overhead.py runs and reports what it claims (timing itself is not asserted)."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch

import gafused

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import host_overhead  # noqa: E402 - bench/ is not a package


def test_rows_cover_the_baseline_and_every_cpu_backend():
    rows = host_overhead.rows(tensors=5, numel=3, reps=3, warmup=1)
    assert (rows[0]["what"], rows[0]["ratio"]) == ("torch._foreach_add_", 1.0)
    assert [(row["what"], row["backend"]) for row in rows[1:4]] == [
        ("read p.grad", "-"),
        ("release p.grad", "-"),
        ("check_grads (layout matched)", "-"),
    ]
    measured = {(row["what"], row["backend"]) for row in rows[1:]}
    for backend in ("reference", "foreach"):
        assert {("fold_", backend), ("fold_ check=False", backend), ("step", backend)} <= measured
        assert (host_overhead.BACKWARD_LOOP, backend) in measured
    assert (host_overhead.PLAIN_BACKWARD, "-") in measured
    # The backward loop's rows, and only they, carry their ratio to plain PyTorch's backward.
    plain = next(row["median_us"] for row in rows if row["what"] == host_overhead.PLAIN_BACKWARD)
    for row in rows:
        if row["what"] == host_overhead.BACKWARD_LOOP:
            assert row["x_plain_backward"] == pytest.approx(row["median_us"] / plain)
        else:
            assert row["x_plain_backward"] is None
    assert all(row["median_us"] > 0 and row["tensors"] == 5 for row in rows)
    # What one call launches: on CPU, leaf compute aten ops (torch's CPU foreach add is one add per tensor).
    launches = {(row["what"], row["backend"]): row["launches"] for row in rows}
    assert launches[("torch._foreach_add_", "-")] == 5
    assert launches[("read p.grad", "-")] == 0 and launches[("check_grads (layout matched)", "-")] == 0
    assert launches[("fold_", "foreach")] == launches[("fold_ check=False", "foreach")] > 0
    # Last, the baseline called back to back just before and just after the launches were counted.
    assert [row["what"] for row in rows[-2:]] == [
        "torch._foreach_add_ alone, before profiling",
        "torch._foreach_add_ alone, after profiling",
    ]
    assert all(row["launches"] == 5 and row["reps"] == 3 for row in rows[-2:])


def test_timed_calls_run_without_the_garbage_collector(monkeypatch):
    """A collection that other allocations made due is not charged to the call that happens to trigger it."""
    enabled = []
    real_add = torch._foreach_add_

    def add(*args, **kwargs):
        enabled.append(gc.isenabled())
        return real_add(*args, **kwargs)

    monkeypatch.setattr(torch, "_foreach_add_", add)
    reps, warmup = 4, 2
    host_overhead.rows(tensors=3, numel=2, reps=reps, warmup=warmup)
    assert gc.isenabled()
    # The baseline calls torch._foreach_add_ once per round and twice as many times alone, with the collector off;
    # count_launches' calls run with it on.
    assert enabled.count(False) >= 3 * (reps + warmup) and True in enabled
    # A caller that turned the collector off finds it off afterwards.
    gc.disable()
    try:
        host_overhead.rows(tensors=3, numel=2, reps=2, warmup=1)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_triton_rows_skip_only_the_launches():
    """On CPU the triton backend's rows (``triton-host``) time its host work with the fold kernel's launches skipped:
    while a timed call runs the fold kernel is a stand-in that launches nothing, and the real kernel is put back
    afterwards."""
    if gafused.ops.backend_unavailable_reason("triton", "cpu") is not None:
        pytest.skip("the triton backend does not run on CPU here")
    from gafused.triton_backend import fold

    kernel = fold._fold_kernel
    rows = host_overhead.rows(tensors=4, numel=3, dtype=torch.bfloat16, reps=3, warmup=1)
    assert fold._fold_kernel is kernel
    assert {row["what"] for row in rows if row["backend"] == "triton-host"} == {
        "fold_",
        "fold_ check=False",
        "step",
        host_overhead.BACKWARD_LOOP,
    }
    assert not any(row["backend"] == "triton" for row in rows)
    folds = []
    skipped = host_overhead._without_triton_launches(lambda: folds.append(fold._fold_kernel))
    skipped()
    assert isinstance(folds[0], host_overhead._NoLaunch) and fold._fold_kernel is kernel


def test_the_check_row_names_the_path_the_check_took(monkeypatch):
    """Without torch's C++ guards every check goes gradient by gradient, and the row says so."""
    monkeypatch.setattr(gafused.ops, "_TensorGuards", None)
    rows = host_overhead.rows(tensors=3, numel=2, reps=2, warmup=1)
    assert [row["what"] for row in rows if row["what"].startswith("check_grads")] == ["check_grads (per gradient)"]
    note = next(row["note"] for row in rows if row["what"] == "check_grads (per gradient)")
    assert "TensorGuards is missing" in note
    assert all(row["note"] is None for row in rows if row["what"] != "check_grads (per gradient)")


def test_a_missed_layout_match_is_explained():
    """Why check_grads went gradient by gradient: what torch's guard finds different from the recorded layout."""
    if gafused.ops._TensorGuards is None:
        pytest.skip("torch's TensorGuards is not usable here")
    params = [torch.nn.Parameter(torch.zeros(2, 3)) for _ in range(3)]
    buffer = gafused.FlatGradBuffer(params)
    assert "no layout was recorded" in host_overhead._layout_miss_reason(buffer, [torch.ones(2, 3)] * 3)
    grads = [torch.ones(2, 3), None, torch.ones(2, 3)]
    gafused.ops.check_grads(buffer, grads)
    assert host_overhead._layout_miss_reason(buffer, grads) == (
        "the recorded layout matches these gradients when checked again"
    )
    assert host_overhead._layout_miss_reason(buffer, [torch.ones(2, 3)] * 3) == (
        "the entries of grads at [1] were None when the layout was recorded"
    )
    reason = host_overhead._layout_miss_reason(buffer, [torch.ones(2, 3), None, torch.ones(3, 2)])
    assert reason.startswith("the recorded layout does not match: tensor 'grads[2]' size mismatch")
    wanting = [torch.ones(2, 3, requires_grad=True), None, torch.ones(2, 3)]
    assert "tensor 'grads[0]' requires_grad mismatch" in host_overhead._layout_miss_reason(buffer, wanting)


def test_rows_reject_bad_sizes():
    with pytest.raises(ValueError, match="tensors"):
        host_overhead.rows(tensors=0, numel=3, dtype=torch.float32)
