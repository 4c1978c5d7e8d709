"""What the benchmark publishes: its timing statistics, the bytes behind every GB/s, the ratios, the rows the summary
screen picks, and recipes that compute the same result window after window (fake timers, tiny sets: seconds on CPU)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import param_sets  # noqa: E402 - bench/ is not a package; its modules import each other as siblings
import providers  # noqa: E402
import timing  # noqa: E402
import traffic  # noqa: E402

ACCUMULATION_STEPS = 4


# --- timing.py: the statistics of a measurement, on a scripted clock ---------------------------------------------


class _Clock:
    """Stands in for time.perf_counter: only run() and prepare() move it, by the amounts scripted."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def _scripted_timer(monkeypatch, durations_ms, warmup, prepare_ms=0.0, faults=None, **kwargs):
    """A CPU Timer whose clock moves only by the scripted durations: warmup calls first, then the samples."""
    clock = _Clock()
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    fault_count = [0]
    monkeypatch.setattr(timing, "_minor_faults", lambda: fault_count[0])
    calls = iter(durations_ms)
    fault_script = iter(faults or [])

    def run():
        clock.now += next(calls) * 1e-3
        fault_count[0] += next(fault_script, 0)

    def prepare():
        clock.now += prepare_ms * 1e-3

    timer = timing.Timer(torch.device("cpu"), warmup=warmup, **kwargs)
    return timer, run, prepare


def test_timer_reports_median_and_20_80_quantiles_of_the_timed_samples_only(monkeypatch):
    """Warmup calls (1000 ms each here) and prepare (500 ms) are not in any figure; the samples are 1..10 ms, with
    one slow outlier so the mean would not be the median."""
    samples = [7, 1, 9, 3, 5, 2, 10, 4, 8, 60]
    timer, run, prepare = _scripted_timer(
        monkeypatch, [1000, 1000, *samples], warmup=2, prepare_ms=500, budget_s=0.0, min_reps=10, max_reps=10
    )
    result = timer.measure(run, prepare)
    ordered = sorted(samples)  # 1 2 3 4 5 7 8 9 10 60
    assert result.reps == 10
    assert result.median_ms == pytest.approx((5 + 7) / 2)
    # inclusive quantiles: position p * (n - 1) in the sorted samples
    assert result.q20_ms == pytest.approx(ordered[1] + 0.8 * (ordered[2] - ordered[1]))  # 2.8
    assert result.q80_ms == pytest.approx(ordered[7] + 0.2 * (ordered[8] - ordered[7]))  # 9.2
    assert result.host_ms == pytest.approx(result.median_ms)  # on CPU a call's host time is its time
    # every call (warmup included) rewrote the cache-flush buffer once
    assert int(timer._flush[0]) == 2 + 10


def test_timer_stops_at_the_budget_after_min_reps_and_never_past_the_cap(monkeypatch):
    # 10 ms samples, a 50 ms budget: five samples (more than min_reps), far fewer than the cap.
    timer, run, _ = _scripted_timer(monkeypatch, [10] * 200, warmup=0, budget_s=0.05, min_reps=3, max_reps=100)
    assert timer.measure(run).reps == 5
    # The budget spent already, min_reps still holds; a per-call min_reps above the cap raises the cap to it.
    timer, run, _ = _scripted_timer(monkeypatch, [10] * 200, warmup=0, budget_s=0.0, min_reps=3, max_reps=5)
    assert timer.measure(run).reps == 3
    assert timer.measure(run, min_reps=8).reps == 8
    # A single sample is its own median and quantiles.
    timer, run, _ = _scripted_timer(monkeypatch, [4.0], warmup=0, budget_s=0.0, min_reps=1, max_reps=1)
    assert timer.measure(run) == timing.Timing(4.0, 4.0, 4.0, 1, 4.0, 0)


def test_timer_page_faults_are_the_median_per_call(monkeypatch):
    timer, run, _ = _scripted_timer(
        monkeypatch, [1] * 5, warmup=0, faults=[0, 0, 100, 100, 100], budget_s=0.0, min_reps=5, max_reps=5
    )
    assert timer.measure(run).page_faults == 100


# --- traffic.py and run.py: the bytes behind every GB/s figure ------------------------------------------------------


def test_last_micro_batch_traffic_counts_the_finished_gradient_in_the_parameters_dtype():
    # fp32 grads and parameters: fused pass 4 + 8, then read acc 4 and write the fp32 finished grad 4.
    assert traffic.bytes_per_element("last", torch.float32) == 20
    # bf16 grads, fp32 parameters: 2 + 8 + 4 + 4; fp32 grads, bf16 parameters: 4 + 8 + 4 + 2.
    assert traffic.bytes_per_element("last", torch.bfloat16, torch.float32) == 18
    assert traffic.bytes_per_element("last", torch.float32, torch.bfloat16) == 18
    assert traffic.min_bytes("last", 1000, torch.bfloat16) == 16_000
    assert traffic.min_bytes("first", 1000, torch.float32) == 8_000


def test_micro_rows_gbps_speedups_and_bytes_follow_their_moment(monkeypatch):
    """Each row: the minimum bytes of its own moment, GB/s from its median time, speedup = baseline / row time."""
    import run

    medians = {"naive": 4.0, "gafused-reference": 2.0}
    made = []
    real_make = providers.make_provider

    def make(name, *args, **kwargs):
        made.append(name)
        return real_make(name, *args, **kwargs)

    class _Timer:
        device = torch.device("cpu")

        def measure(self, run_, prepare=None, min_reps=None):
            if prepare is None:  # the copy_ of the set's size
                run_()
                return timing.Timing(8.0, 7.0, 9.0, 3, 8.0, 0)
            prepare()
            run_()
            ms = medians[made[-1]]
            return timing.Timing(ms, ms / 2, ms * 2, 3, ms, 0)

    monkeypatch.setattr(providers, "make_provider", make)
    args = run._parse_args(["--quick", "--sets", "many-small", "--dtypes", "bf16,fp32",
                            "--providers", "naive,gafused-reference", "--device", "cpu"])  # fmt: skip
    rows = run.run_micro(args, torch.device("cpu"), _Timer(), progress=None)
    assert len(rows) == 8 and {row["status"] for row in rows} == {"ok"}
    for row in rows:
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[row["grad_dtype"]]
        per_element = {"middle": 10, "last": 16}[row["moment"]] if dtype == torch.bfloat16 else {
            "middle": 12, "last": 20}[row["moment"]]  # fmt: skip
        assert row["min_bytes"] == row["elements"] * per_element
        median = medians[row["provider"]]
        assert row["median_ms"] == median and row["q20_ms"] == median / 2 and row["q80_ms"] == median * 2
        assert row["gbps"] == pytest.approx(row["min_bytes"] / (median * 1e-3) / 1e9)
        assert row["copy_gbps"] == pytest.approx(row["copy_bytes"] / 8e-3 / 1e9)
        assert row["fraction_of_copy_bw"] == pytest.approx(row["gbps"] / row["copy_gbps"])
        assert row["speedup_vs_naive"] == pytest.approx(4.0 / median)  # gafused: 2x faster than naive


# --- kernels.py: the sweep's GB/s ----------------------------------------------------------------------------------


def test_kernel_sweep_gbps_counts_every_segment_against_the_copy_of_the_buffer(monkeypatch):
    import kernels

    class _Timer:
        device = torch.device("cpu")

        def measure(self, run_, prepare=None, min_reps=None):
            run_()
            return timing.Timing(2.0, 1.0, 3.0, 3, 2.0, 0)

    rows = kernels.run_kernel_sweep(torch.device("cpu"), "quick", _Timer())
    (acc_bytes,) = kernels.sweep_sizes("cpu", "quick")
    numel = acc_bytes // 4
    copy_gbps = 2 * acc_bytes / 2e-3 / 1e9
    assert rows and all(row["status"] == "ok" for row in rows)
    for row in rows:
        dtype = kernels.GRAD_DTYPES[row["grad_dtype"]] if row["grad_dtype"] != "-" else torch.bfloat16
        expected = traffic.op_bytes_per_element(row["op"], dtype) * numel / 2e-3 / 1e9
        assert row["copy_gbps"] == pytest.approx(copy_gbps)
        assert row["gbps"] == pytest.approx(expected), row
        assert row["fraction_of_copy_bw"] == pytest.approx(expected / copy_gbps)
    fold_fp32 = next(r for r in rows if (r["op"], r["grad_dtype"]) == ("fold", "fp32"))
    assert fold_fp32["fraction_of_copy_bw"] == pytest.approx(12 / 8)  # same time: 12 bytes/element against 8


@pytest.mark.parametrize("op", ["fold", "fold_finish"])
def test_kernel_sweep_times_the_middle_micro_batch_fold_that_reads_the_buffer(op):
    """The sweep's folds are middle micro-batches (read g, read and write acc: the bytes it counts), not first ones."""
    import kernels

    import gafused

    params = [torch.empty((), dtype=torch.float32).expand(6) for _ in range(2)]
    buffer = gafused.FlatGradBuffer(params)
    buffer.data.fill_(1.0)
    grads = [torch.full((6,), 2.0) for _ in range(2)]
    out = torch.zeros(buffer.numel, dtype=torch.bfloat16)
    kernels.op_call(op, buffer, grads, out, "reference")()
    for view in buffer.views():
        assert torch.equal(view, torch.full((6,), 3.0))  # 1 + 2: the fold read the buffer


# --- providers.py: every recipe computes the same window, window after window --------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["naive", "foreach", "gafused-reference", "gafused-foreach"])
def test_provider_finishes_every_window_like_float64_and_times_the_moment_it_names(name, dtype):
    """Three windows in a row, from three gradient sets (so each window starts at another set): each finished
    gradient is that window's own mean, unclipped (max norm 1e6), not the previous windows' sums; prepare(moment) leaves
    the provider at that moment, with p.grad released after each micro-batch."""
    param_set = param_sets.gpt2(hidden=8, layers=1, vocab=37, positions=5, name="tiny")
    generator = torch.Generator().manual_seed(3)
    pool = [[torch.randn(shape, generator=generator).to(dtype) for shape in param_set.shapes] for _ in range(3)]
    params = [torch.nn.Parameter(torch.empty(shape, dtype=dtype)) for shape in param_set.shapes]
    provider = providers.make_provider(name, params, pool, ACCUMULATION_STEPS, 1e6)
    for window in range(3):
        provider.prepare("last")
        provider.step()
        used = [pool[(ACCUMULATION_STEPS * window + k) % 3] for k in range(ACCUMULATION_STEPS)]
        for i, param in enumerate(params):
            mean = sum(grads[i].double() for grads in used) / ACCUMULATION_STEPS
            torch.testing.assert_close(param.grad, mean.to(dtype))
    provider.prepare("middle")
    assert provider.position() == 1
    provider.prepare("first")
    assert provider.position() == 0
    provider.step()
    assert all(param.grad is None for param in params), "a micro-batch releases the gradients it folded"


def test_compiled_provider_compiles_both_functions():
    """``compiled`` times the foreach functions under torch.compile, not the eager ones."""
    param_set = param_sets.gpt2(hidden=8, layers=1, vocab=37, positions=5, name="tiny")
    params = [torch.nn.Parameter(torch.empty(shape)) for shape in param_set.shapes]
    pool = [[torch.zeros(shape) for shape in param_set.shapes]]
    provider = providers.make_provider("compiled", params, pool, ACCUMULATION_STEPS, 1.0)
    assert provider._fold_fn is not providers._foreach_fold
    assert provider._finish_fn is not providers._foreach_fold_and_finish


# --- summary.py: the closing screen picks the rows it claims --------------------------------------------------------


def _micro_row(set_name, elements, provider, moment, ms, launches):
    return {
        "set": set_name, "tensors": 3, "elements": elements, "grad_dtype": "bf16", "provider": provider,
        "backend": None, "moment": moment, "status": "ok", "median_ms": ms, "host_ms": ms, "launches": launches,
    }  # fmt: skip


def test_summary_launch_table_shows_the_largest_set_and_middle_then_last():
    import summary

    rows = []
    for set_name, elements in (("gpt2-small", 10), ("gpt2-big", 1000)):
        rows += [_micro_row(set_name, elements, "naive", "middle", 1.25, 7),
                 _micro_row(set_name, elements, "naive", "last", 9.75, 11)]  # fmt: skip
    meta = {"device_type": "cpu", "device": "CPU x", "gafused": "0", "torch": "0", "mode": "quick",
            "date_utc": "2000-01-01T00:00:00+00:00", "default_backend": "foreach"}  # fmt: skip
    screen = summary.render({"meta": meta, "micro": rows}, [])
    section = screen.split("LAUNCHES AND HOST TIME")[1].split("KERNELS VS COPY")[0]
    assert "gpt2-big" in section and "gpt2-small" not in section
    naive_line = next(line for line in section.splitlines() if line.strip().startswith("naive"))
    assert naive_line.split()[1:] == ["7", "1.25", "9.75"]  # launches of the middle step, ms middle, ms last


def test_summary_kernels_line_is_the_largest_buffer():
    import summary

    rows = [
        {"status": "ok", "acc_mb": mb, "backend": "foreach", "op": "fold", "grad_dtype": "bf16", "gbps": gbps,
         "fraction_of_copy_bw": gbps / 100.0, "copy_gbps": 100.0}
        for mb, gbps in ((4, 11.0), (64, 77.0))
    ]  # fmt: skip
    meta = {"device_type": "cpu", "device": "CPU x", "gafused": "0", "torch": "0", "mode": "quick",
            "date_utc": "2000-01-01T00:00:00+00:00", "default_backend": "foreach"}  # fmt: skip
    screen = " ".join(summary.render({"meta": meta, "kernels": rows}, []).split())
    assert "64 MB buffer" in screen and "fold bf16 77.0 GB/s (77%)" in screen
    assert "11.0 GB/s" not in screen


# --- e2e.py: the recipes compared compute the same gradient; the row's statistics ---------------------------------


def test_end_to_end_recipes_hand_the_optimizer_the_same_gradient():
    """Unclipped (max norm 1e6), every recipe's optimizer sees the big batch's mean gradient: a recipe that forgot
    the 1/N (or double-counted a micro-batch) would be timed doing other work."""
    import e2e

    run = e2e.setup(torch.device("cpu"), "quick", max_grad_norm=1e6)
    seen = {}
    for label, _, make_step in run.recipes:
        model, optimizer = run.build()
        real_step = optimizer.step

        def record(*args, _label=label, _model=model, _real=real_step, **kwargs):
            seen[_label] = [p.grad.detach().clone() for p in _model.parameters()]
            return _real(*args, **kwargs)

        optimizer.step = record
        make_step(model, optimizer)()
    big = seen.pop(run.recipes[0][0])
    assert len(seen) == 3
    for label, grads in seen.items():
        for got, expected in zip(grads, big, strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6, msg=label)


def test_end_to_end_row_statistics(monkeypatch):
    import e2e

    config = e2e.config_for(torch.device("cpu"), "quick")
    fake = e2e.Setup(config, lambda config: torch.nn.Linear(2, 2), False, lambda: (None, None),
                     [("plain", 4, lambda model, optimizer: lambda: None)])  # fmt: skip
    monkeypatch.setattr(e2e, "setup", lambda device, mode, max_grad_norm: fake)

    class _Timer:
        def measure(self, run_, prepare=None, min_reps=None):
            return timing.Timing(2.0, 1.5, 2.5, 7, 2.0)

    (row,) = e2e.run_e2e(torch.device("cpu"), "quick", _Timer())["rows"]
    assert (row["ms_per_step"], row["q20_ms"], row["q80_ms"], row["reps"]) == (2.0, 1.5, 2.5, 7)
    assert row["samples_per_s"] == pytest.approx(config.batch / 2e-3)


def test_cpu_launch_count_leaves_out_views_and_allocations():
    """On CPU a launch is a leaf compute aten op: a view, a reshape or an empty is not one."""
    x = torch.zeros(4, 4)

    def run():
        y = x.view(-1)[1:].reshape(3, 5)
        torch.empty(3).copy_(y[0, :3])
        y.neg_()

    assert timing.count_launches(run, None, torch.device("cpu")) == 2  # copy_, neg_
