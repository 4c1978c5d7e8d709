"""bench/host_overhead.py runs and reports what it claims (timing itself is not asserted)."""

from __future__ import annotations

import gc
import json
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


def _fake_run(medians: list[float], interrupted: dict | None = None) -> list[dict]:
    """Rows as ``rows()`` returns them: the baseline, one fold and the backward loop beside plain backward."""
    names = [("torch._foreach_add_", "-"), ("fold_", "foreach"), (host_overhead.PLAIN_BACKWARD, "-"),
             (host_overhead.BACKWARD_LOOP, "foreach")]  # fmt: skip
    table = [
        {"what": what, "backend": backend, "tensors": 2, "numel": 3, "median_us": median, "q20_us": median,
         "q80_us": median, "launches": 2, "reps": 3, "interrupted": interrupted, "note": None}
        for (what, backend), median in zip(names, medians, strict=True)
    ]  # fmt: skip
    for row in table:
        row["ratio"] = row["median_us"] / medians[0]
        row["x_plain_backward"] = row["median_us"] / medians[2] if row["what"] == host_overhead.BACKWARD_LOOP else None
    return table


def test_ranges_hold_each_rows_least_and_greatest_over_the_runs():
    runs = [_fake_run([10.0, 15.0, 40.0, 60.0]), _fake_run([20.0, 26.0, 50.0, 55.0]), _fake_run([16.0, 24, 44, 66])]
    spans = host_overhead.ranges(runs)
    assert [(span["what"], span["backend"]) for span in spans] == [(r["what"], r["backend"]) for r in runs[0]]
    fold, loop = spans[1], spans[3]
    assert fold["median_us"] == [15.0, 26.0] and fold["ratio"] == [1.3, 1.5] and fold["x_plain_backward"] is None
    assert loop["median_us"] == [55.0, 66.0] and loop["x_plain_backward"] == [1.1, 1.5]
    assert spans[0]["ratio"] == [1.0, 1.0]
    table = host_overhead.format_ranges(spans, 3)
    assert table.splitlines()[0] == "over 3 runs (least-greatest of the runs' medians):"
    assert "15.0-26.0" in table and "1.30-1.50" in table and "1.10-1.50" in table
    # Rows some run lacks (a run stopped before the baseline alone was sampled) are left out.
    assert host_overhead.ranges([runs[0], runs[1][:3]]) == spans[:3]
    with pytest.raises(ValueError, match="rows that every run has"):
        host_overhead.ranges([runs[0], []])
    with pytest.raises(ValueError, match="at least one run"):
        host_overhead.ranges([])


def test_runs_are_measured_one_after_another_and_saved_with_their_ranges(tmp_path, capsys):
    out = tmp_path / "results"
    assert host_overhead.main(["--tensors", "2", "--numel", "3", "--reps", "3", "--runs", "2", "--out", str(out)]) == 0
    (path,) = out.glob("*-host-2x3-fp32.json")
    saved = json.loads(path.read_text())
    assert len(saved["runs"]) == 2 and saved["runs"][0] is not saved["runs"][1]
    assert saved["runs"][0] != saved["runs"][1]  # two measurements, not one saved twice
    assert saved["ranges"] == host_overhead.ranges(saved["runs"])
    meta = saved["meta"]
    assert meta["complete"] is True and meta["interrupted"] is None and meta["cpu_threads"] == 1
    assert meta["arguments"]["runs"] == 2 and meta["arguments"]["tensors"] == 2 and meta["device"].startswith("CPU")
    report = path.with_suffix(".txt").read_text()
    assert report == capsys.readouterr().out
    assert "run 1 of 2:" in report and "run 2 of 2:" in report and "over 2 runs" in report
    # One run prints one table as before: no run headers, no ranges.
    assert host_overhead.main(["--tensors", "2", "--numel", "3", "--reps", "3"]) == 0
    printed = capsys.readouterr().out
    assert "run 1 of" not in printed and "over 1 runs" not in printed and "torch._foreach_add_" in printed


def test_a_bad_run_count_or_out_is_refused_before_measuring(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(host_overhead, "rows", lambda *a, **k: pytest.fail("measured"))
    with pytest.raises(SystemExit):
        host_overhead.main(["--runs", "0"])
    assert "--runs must be at least 1, got 0" in capsys.readouterr().err
    occupied = tmp_path / "file"
    occupied.write_text("")
    with pytest.raises(SystemExit):
        host_overhead.main(["--out", str(occupied)])
    assert "exists and is not a directory" in capsys.readouterr().err


def test_a_stop_keeps_the_runs_taken_and_saves_them_as_partial(tmp_path, monkeypatch, capsys):
    import interrupt

    taken = []

    def second_run_stopped(*args, **kwargs):
        if taken:
            raise interrupt.Interrupted("SIGTERM")
        taken.append(_fake_run([10.0, 15.0, 40.0, 60.0]))
        return taken[-1]

    monkeypatch.setattr(host_overhead, "rows", second_run_stopped)
    assert host_overhead.main(["--runs", "3", "--out", str(tmp_path)]) == 143
    (path,) = tmp_path.glob("*-host-1024x64-fp32.json")
    saved = json.loads(path.read_text())
    assert saved["runs"] == taken and saved["meta"]["complete"] is False
    assert saved["meta"]["interrupted"] == {"signal": "SIGTERM", "during": "run 2 of 3, before two rounds"}
    assert path.with_suffix(".txt").read_text().startswith("PARTIAL RESULTS: stopped by SIGTERM during run 2 of 3")
    capsys.readouterr()
    # A run stopped after two rounds is kept, partial, and no run follows it.
    calls = []

    def first_run_partial(*args, **kwargs):
        calls.append(1)
        return _fake_run([10.0, 15.0, 40.0, 60.0], {"signal": "KeyboardInterrupt", "during": "sampling"})

    monkeypatch.setattr(host_overhead, "rows", first_run_partial)
    assert host_overhead.main(["--runs", "3"]) == 130
    assert len(calls) == 1
    assert capsys.readouterr().out.startswith("PARTIAL RESULTS: stopped by KeyboardInterrupt during sampling")
    # Stopped before any run had two rounds: nothing to show or save.
    monkeypatch.setattr(host_overhead, "rows", lambda *a, **k: (_ for _ in ()).throw(interrupt.Interrupted("SIGTERM")))
    assert host_overhead.main(["--runs", "2", "--out", str(tmp_path / "none")]) == 143
    assert "no table" in capsys.readouterr().out and not (tmp_path / "none").exists()


class _Clock:
    """``time`` for host_overhead: each perf_counter call moves 1 us on (plus what ``spend`` adds); SIGTERM's
    exception on call ``calls`` + 1 when ``calls`` is given."""

    def __init__(self, calls: int | None = None) -> None:
        self.calls, self.now = calls, 0.0

    def spend(self, seconds: float) -> None:
        self.now += seconds

    def perf_counter(self) -> float:
        import interrupt

        if self.calls is not None:
            self.calls -= 1
            if self.calls < 0:
                raise interrupt.Interrupted("SIGTERM")
        self.now += 1e-6
        return self.now


def test_each_rows_median_and_quantiles_are_of_its_own_samples(monkeypatch):
    """median_us, q20_us and q80_us are the median and the 20% and 80% quantiles (statistics' default method) of
    the row's samples, and reps is how many there are."""
    import statistics

    real = statistics.quantiles
    samples = []

    def quantiles(data, *args, **kwargs):
        samples.append(list(data))
        return real(data, *args, **kwargs)

    monkeypatch.setattr(statistics, "quantiles", quantiles)
    rows = host_overhead.rows(tensors=3, numel=2, reps=9, warmup=1)
    assert len(samples) == len(rows)
    for row, times in zip(rows, samples, strict=True):
        q = real(times, n=5)
        assert row["reps"] == len(times) == 9
        assert (row["median_us"], row["q20_us"], row["q80_us"]) == (statistics.median(times), q[0], q[3]), row
        assert row["q20_us"] <= row["median_us"] <= row["q80_us"]


def test_the_baseline_alone_rows_time_the_baseline(monkeypatch):
    """The rows ``alone, before/after profiling`` time torch._foreach_add_ of the baseline, not another case."""
    clock = _Clock()
    real_add = torch._foreach_add_

    def add(*args, **kwargs):
        clock.spend(1e-3)  # every _foreach_add_ costs 1000 us on the fake clock
        return real_add(*args, **kwargs)

    monkeypatch.setattr(torch, "_foreach_add_", add)
    monkeypatch.setattr(host_overhead, "time", clock)
    rows = host_overhead.rows(tensors=3, numel=2, reps=3, warmup=1)
    assert rows[0]["median_us"] == pytest.approx(1001)
    assert rows[1]["what"] == "read p.grad" and rows[1]["median_us"] == pytest.approx(1)
    assert [row["median_us"] for row in rows[-2:]] == pytest.approx([1001, 1001])


def test_rows_stopped_mid_round_keep_whole_rounds_only(monkeypatch):
    """SIGTERM in the middle of a round: every row holds the same whole rounds, the partial round is dropped."""
    cases = len(host_overhead.rows(tensors=2, numel=3, reps=2, warmup=0)) - 2
    # Three whole rounds, then all but one case of the fourth (two perf_counter calls per sample).
    monkeypatch.setattr(host_overhead, "time", _Clock(calls=2 * cases * 3 + 2 * (cases - 1)))
    rows = host_overhead.rows(tensors=2, numel=3, reps=10, warmup=0)
    assert len(rows) == cases and all(row["reps"] == 3 for row in rows)
    assert rows[0]["interrupted"] == {"signal": "SIGTERM", "during": "sampling, after 3 of 10 rounds"}
    assert all(row["launches"] is None for row in rows)


def test_rows_stopped_after_the_launch_count_keep_the_counts(monkeypatch):
    """Stopped while the baseline is sampled alone after profiling: the launches were counted and are kept, and
    the baseline alone before profiling is a row; the one after, with under two samples, is not."""
    reps = 4
    cases = len(host_overhead.rows(tensors=2, numel=3, reps=2, warmup=0)) - 2
    monkeypatch.setattr(host_overhead, "time", _Clock(calls=2 * cases * reps + 2 * reps + 3))
    rows = host_overhead.rows(tensors=2, numel=3, reps=reps, warmup=0)
    assert rows[0]["interrupted"]["during"] == "sampling the baseline alone, after profiling, after 4 of 4 rounds"
    assert rows[0]["launches"] == 2 and all(isinstance(row["launches"], int) for row in rows)
    assert [row["what"] for row in rows[-1:]] == ["torch._foreach_add_ alone, before profiling"]


def test_a_ctrl_c_before_two_rounds_exits_130_with_no_table(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(host_overhead, "rows", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    assert host_overhead.main(["--runs", "2", "--out", str(tmp_path / "none")]) == 130
    assert "STOPPED by KeyboardInterrupt before two whole sampling rounds: no table" in capsys.readouterr().out
    assert not (tmp_path / "none").exists()


def test_a_partial_run_after_a_whole_one_is_counted_in_the_ranges(tmp_path, monkeypatch, capsys):
    """--runs 3, the second run stopped after two rounds: two runs saved, their ranges 'over 2 runs', the report
    marked partial once, no third run."""
    calls = []

    def measured(*args, **kwargs):
        calls.append(1)
        stopped = {"signal": "SIGTERM", "during": "sampling, after 5 of 200 rounds"} if len(calls) == 2 else None
        return _fake_run([10.0, 15.0 + len(calls), 40.0, 60.0], stopped)

    monkeypatch.setattr(host_overhead, "rows", measured)
    assert host_overhead.main(["--runs", "3", "--out", str(tmp_path)]) == 143
    assert len(calls) == 2
    (path,) = tmp_path.glob("*-host-1024x64-fp32.json")
    saved = json.loads(path.read_text())
    assert len(saved["runs"]) == 2 and saved["ranges"] == host_overhead.ranges(saved["runs"])
    assert saved["ranges"][1]["median_us"] == [16.0, 17.0]
    assert saved["meta"]["complete"] is False
    assert saved["meta"]["interrupted"] == {"signal": "SIGTERM", "during": "sampling, after 5 of 200 rounds"}
    report = path.with_suffix(".txt").read_text()
    assert report.count("PARTIAL RESULTS") == 1
    assert "over 2 runs (least-greatest of the runs' medians):" in report and "over 3 runs" not in report
    assert "run 2 of 3:" in report and "run 3 of 3:" not in report


def test_the_printed_table_holds_each_rows_figures():
    table = _fake_run([10.0, 15.0, 40.0, 60.0])
    for row in table:
        row["q20_us"], row["q80_us"] = row["median_us"] - 1, row["median_us"] + 2
    lines = host_overhead.format_table(table).splitlines()
    fold = next(line for line in lines if line.startswith("fold_ "))
    assert fold.split()[1:] == ["foreach", "15.0", "14.0", "17.0", "1.50", "2"]
    assert f"{host_overhead.BACKWARD_LOOP} (foreach): 1.50x {host_overhead.PLAIN_BACKWARD}" in lines


def test_a_check_that_never_matches_is_named_per_gradient(monkeypatch):
    """A recorded layout that never matches: every check goes gradient by gradient, and the row says so even though
    each check recorded an (equal) layout."""
    if gafused.ops._TensorGuards is None:
        pytest.skip("torch's TensorGuards is not usable here")
    monkeypatch.setattr(gafused.ops._AcceptedLayout, "matches", lambda self, grads: False)
    rows = host_overhead.rows(tensors=3, numel=2, reps=2, warmup=1)
    assert [row["what"] for row in rows if row["what"].startswith("check_grads")] == ["check_grads (per gradient)"]


def test_rows_reject_an_empty_tensor_size():
    with pytest.raises(ValueError, match="numel=0"):
        host_overhead.rows(tensors=3, numel=0, dtype=torch.float32)


def test_the_cases_are_sampled_in_a_new_order_every_round(monkeypatch):
    import random

    orders = []

    class _Spy(random.Random):
        def shuffle(self, x):  # noqa: ANN001, ANN202
            super().shuffle(x)
            orders.append(list(x))

    monkeypatch.setattr(host_overhead.random, "Random", _Spy)
    rows = host_overhead.rows(tensors=2, numel=3, reps=5, warmup=1)
    cases = len(rows) - 2
    assert len(orders) == 6 and all(sorted(order) == list(range(cases)) for order in orders)
    assert len({tuple(order) for order in orders}) > 1


def test_a_run_stopped_while_sampling_is_saved_beside_the_whole_ones(tmp_path, monkeypatch, capsys):
    """The real rows of a run stopped after a few rounds lack the baseline-alone rows: the ranges cover the rows
    both runs have, and the runs are saved, marked partial."""
    cases = len(host_overhead.rows(tensors=2, numel=3, reps=2, warmup=0)) - 2
    whole_run = 2 * cases * (20 + 10) + 2 * 2 * (20 + 10)  # every case, then the baseline alone twice
    monkeypatch.setattr(host_overhead, "time", _Clock(calls=whole_run + 2 * cases * (20 + 3) + 3))
    argv = ["--tensors", "2", "--numel", "3", "--reps", "10", "--runs", "2", "--out", str(tmp_path)]
    assert host_overhead.main(argv) == 143
    (path,) = tmp_path.glob("*-host-2x3-fp32.json")
    saved = json.loads(path.read_text())
    first, second = saved["runs"]
    assert len(first) == len(second) + 2 and second[0]["reps"] == 3 and first[0]["reps"] == 10
    assert saved["ranges"] == host_overhead.ranges(saved["runs"])
    assert [(span["what"], span["backend"]) for span in saved["ranges"]] == [(r["what"], r["backend"]) for r in second]
    assert saved["meta"]["complete"] is False and saved["meta"]["interrupted"]["during"].startswith("sampling")
    assert "over 2 runs" in path.with_suffix(".txt").read_text()


def test_host_overhead_stopped_prints_the_rounds_it_took(monkeypatch, capsys):
    # The cases sampled in rounds: every row but the last two (the baseline alone, before and after profiling).
    cases = len(host_overhead.rows(tensors=2, numel=3, reps=2, warmup=0)) - 2
    monkeypatch.setattr(host_overhead, "time", _Clock(calls=2 * cases * (20 + 3) + 3))
    assert host_overhead.main(["--tensors", "2", "--numel", "3", "--reps", "10"]) == 143
    printed = capsys.readouterr().out
    assert printed.startswith("PARTIAL RESULTS: stopped by SIGTERM during sampling, after 3 of 10 rounds")
    assert "3 samples per row" in printed
    # Stopped before two whole rounds there is no table: said so, with the same exit status.
    monkeypatch.setattr(host_overhead, "time", _Clock(calls=2 * cases * (20 + 1) + 3))
    assert host_overhead.main(["--tensors", "2", "--numel", "3", "--reps", "10"]) == 143
    assert "STOPPED by SIGTERM before two whole sampling rounds: no table" in capsys.readouterr().out
    # Stopped after the rounds, while the baseline is called alone before the launches are counted: every round's
    # rows, no launch counts, no rows of the baseline alone.
    monkeypatch.setattr(host_overhead, "time", _Clock(calls=2 * cases * (20 + 10) + 3))
    assert host_overhead.main(["--tensors", "2", "--numel", "3", "--reps", "10"]) == 143
    printed = capsys.readouterr().out
    assert printed.startswith(
        "PARTIAL RESULTS: stopped by SIGTERM during sampling the baseline alone, before profiling, "
        "after 10 of 10 rounds"
    )
    rows = [line.split() for line in printed.splitlines() if line.startswith(("fold_ ", "step "))]
    assert rows and all(row[-1] == "-" for row in rows)
    assert not any(line.startswith("torch._foreach_add_ alone") for line in printed.splitlines())
