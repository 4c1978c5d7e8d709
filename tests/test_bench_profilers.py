"""bench/e2e_profile.py (one profiled window per recipe) and bench/kernel_configs.py (Triton block shapes against
the copy of the same buffer): what they report is what they measured, under its own label and unit.

The GPU paths (CUDA events, synchronizes, kernels seen by the profiler) run here against fakes of those calls; the CPU
paths run for real (Triton under its interpreter). No timing is asserted.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch

import gafused

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import traffic  # noqa: E402 - bench/ is not a package; its modules import each other as siblings

_CPU, _CUDA = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA


def _triton_device() -> torch.device:
    """Where Triton runs here: CPU under its interpreter (TRITON_INTERPRET=1, as CI sets), else the GPU, else skip."""
    device = torch.device("cpu")
    reason = gafused.ops.backend_unavailable_reason("triton", device)
    if reason is not None and torch.cuda.is_available():
        device = torch.device("cuda")
        reason = gafused.ops.backend_unavailable_reason("triton", device)
    if reason is not None:
        pytest.skip(reason)
    return device


# --- e2e_profile ------------------------------------------------------------------------------------------------------


class _Event:
    def __init__(self, name, device_type, cpu_us=0.0, start=0.0, end=0.0, annotation=False):
        self.name, self.device_type, self.cpu_time_total = name, device_type, cpu_us
        self.time_range = types.SimpleNamespace(start=start, end=end)
        self.is_user_annotation = annotation


class _Average:
    def __init__(self, key, count, self_us, total_us, device_type=_CPU):
        self.key, self.count, self.device_type = key, count, device_type
        self.self_cpu_time_total, self.cpu_time_total = self_us, total_us


class _FakeProfile:
    """torch.profiler.profile that hands back fixed events and averages."""

    def __init__(self, events, averages):
        self._events, self._averages = events, averages

    def __call__(self, activities):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def events(self):
        return self._events

    def key_averages(self):
        return self._averages


def test_e2e_profile_reports_each_accumulation_recipe_and_gafused_own_host_time(tmp_path) -> None:
    import e2e_profile

    originals = {name: getattr(gafused.GradAccumulator, name) for name in ("backward", "step", "on_bucket_ready")}
    assert e2e_profile.main(["--quick", "--device", "cpu", "--warmup", "1", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*-e2e-profile.json")
    results = json.loads(path.read_text())
    recipes = results["recipes"]
    assert [label.split(":")[0] for label in recipes] == ["plain", "gafused", "gafused backward"]
    n = results["config"]["accumulation_steps"]
    plain, step, backward = recipes.values()
    assert plain["gafused_ranges"] == {} and plain["backend"] is None
    # One backward() per micro-batch in the loop that folds during backward, none in the other; step() in both.
    assert "gafused: GradAccumulator.backward" not in step["gafused_ranges"]
    assert backward["gafused_ranges"]["gafused: GradAccumulator.backward"]["count"] == n
    assert backward["gafused_ranges"]["gafused: on_bucket_ready (fold one bucket)"]["count"] >= n
    assert step["gafused_ranges"]["gafused: GradAccumulator.step"]["count"] == n
    assert all(r["kernels"] == 0 and r["kernel_busy_ms"] is None and r["wall_ms"] > 0 for r in recipes.values())
    assert results["meta"]["warmup"] == 1
    for r in (step, backward):
        assert r["backend"] in gafused.available_backends(torch.device("cpu"))
        assert r["gafused_ranges"]["gafused: GradAccumulator.zero_grad"]["count"] == n
        assert 0 < r["host_ms"] <= r["wall_ms"]
        assert all(0 < c["cpu_ms"] <= r["wall_ms"] for c in r["gafused_ranges"].values())
        top = [t["self_cpu_ms"] for t in r["top_self_cpu"]]
        assert top == sorted(top, reverse=True)
    # The wrappers are gone once the profile is over.
    assert all(getattr(gafused.GradAccumulator, name) is method for name, method in originals.items())
    assert "e2e-profile" in path.name and path.with_suffix(".txt").read_text().startswith("one window per recipe")


def test_busy_time_is_the_union_of_kernel_intervals() -> None:
    import e2e_profile

    assert e2e_profile._busy_ms([(0, 1000), (500, 1500), (3000, 4000), (3200, 3300)]) == 2.5
    assert e2e_profile._busy_ms([]) == 0.0


def test_e2e_profile_recipe_reports_what_the_profiler_saw_in_ms(monkeypatch) -> None:
    """Kernels are the device events but annotations, busy time their union (whatever their order); runtime calls
    are host events only; ranges keep their host entry; top ops are the 20 busiest by self time; all in ms."""
    import e2e_profile

    events = [
        _Event("cudaLaunchKernel", _CPU, cpu_us=10.0),
        _Event("cudaLaunchKernel", _CPU, cpu_us=10.0),
        _Event("cudaLaunchKernel", _CPU, cpu_us=10.0),
        _Event("cudaStreamSynchronize", _CPU, cpu_us=2000.0),
        _Event("cudaMemcpyAsync", _CPU, cpu_us=500.0),
        # device side, out of order: a copy kernel (not a runtime call), two overlapping kernels, an annotation
        _Event("scale_kernel", _CUDA, start=300.0, end=600.0),
        _Event("fold_kernel", _CUDA, start=100.0, end=400.0),
        _Event("Memcpy DtoD (Device -> Device)", _CUDA, cpu_us=7.0, start=0.0, end=100.0),
        _Event("gafused: GradAccumulator.step", _CUDA, start=0.0, end=5000.0, annotation=True),
    ]
    averages = [_Average(f"aten::op{i}", 1, float(i), float(i)) for i in range(25)]
    averages += [
        _Average("aten::mul", 2, 900.0, 950.0),
        _Average("gafused: GradAccumulator.step", 4, 50.0, 1200.0),
        _Average("gafused: GradAccumulator.step", 4, 0.0, 0.0, device_type=_CUDA),
        _Average("aten::addmm", 8, 700.0, 800.0),
        _Average("gafused::fold_", 4, 30.0, 40.0),  # a custom op, not an entry point
    ]
    monkeypatch.setattr(torch.profiler, "profile", _FakeProfile(events, averages))
    clock = iter([10.0, 10.004, 10.010])
    monkeypatch.setattr(e2e_profile, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    steps = []

    def make_step(model, optimizer):
        def step():
            steps.append(1)

        step.backend = "triton"
        return step

    result = e2e_profile.profile_recipe(make_step, lambda: (None, None), torch.device("cpu"), warmup=2)
    assert len(steps) == 3, "two warm-up windows, then the profiled one"
    assert result["backend"] == "triton"
    assert result["host_ms"] == pytest.approx(4.0) and result["wall_ms"] == pytest.approx(10.0)
    assert result["kernels"] == 3 and result["kernel_busy_ms"] == pytest.approx(0.6)
    calls = result["runtime_calls"]
    assert list(calls) == list(e2e_profile.RUNTIME_CALLS)
    assert calls["LaunchKernel"]["count"] == 3 and calls["LaunchKernel"]["ms"] == pytest.approx(0.03)
    assert calls["StreamSynchronize"] == {"count": 1, "ms": pytest.approx(2.0)}
    assert calls["Memcpy"] == {"count": 1, "ms": pytest.approx(0.5)}
    assert calls["DeviceSynchronize"] == {"count": 0, "ms": 0}
    assert result["gafused_ranges"] == {"gafused: GradAccumulator.step": {"count": 4, "cpu_ms": pytest.approx(1.2)}}
    top = result["top_self_cpu"]
    assert len(top) == 20
    assert top[0] == {"op": "aten::mul", "count": 2, "self_cpu_ms": pytest.approx(0.9)}
    assert top[1]["op"] == "aten::addmm" and top[1]["self_cpu_ms"] == pytest.approx(0.7)
    assert [t["self_cpu_ms"] for t in top] == sorted((t["self_cpu_ms"] for t in top), reverse=True)


def test_e2e_profile_report_shows_each_figure_under_its_own_label() -> None:
    import e2e_profile

    calls = {name: {"count": 0, "ms": 0.0} for name in e2e_profile.RUNTIME_CALLS}
    calls["LaunchKernel"] = {"count": 3, "ms": 0.25}
    recipe = {
        "backend": "triton", "host_ms": 4.0, "wall_ms": 10.0, "kernels": 3, "kernel_busy_ms": 0.6,
        "runtime_calls": calls,
        "gafused_ranges": {"gafused: GradAccumulator.step": {"count": 4, "cpu_ms": 1.2}},
        "top_self_cpu": [{"op": "aten::mul", "count": 2, "self_cpu_ms": 0.9},
                         {"op": "aten::add_", "count": 5, "self_cpu_ms": 0.3}],
    }  # fmt: skip
    results = {"meta": {"device": "cpu"}, "config": {"model": "tiny"}, "recipes": {"gafused: x": recipe}}
    lines = e2e_profile.format_report(results).splitlines()
    assert "gafused: x (backend triton): wall 10.0 ms, host 4.0 ms, 3 kernels busy 0.6 ms" in lines
    assert any(line.startswith("  runtime calls:") and "LaunchKernel 3 (0.25 ms)" in line for line in lines)
    assert "  gafused: GradAccumulator.step: 4 calls, 1.20 ms of host time" in lines
    top = lines[lines.index("  top self CPU time:") + 1 :]
    assert [line.split()[-1] for line in top] == ["aten::mul", "aten::add_"]


def test_e2e_profile_refuses_a_warmup_below_one(capsys, tmp_path) -> None:
    import e2e_profile

    with pytest.raises(SystemExit) as exited:
        e2e_profile.main(["--quick", "--device", "cpu", "--warmup", "0", "--out", str(tmp_path)])
    assert exited.value.code == 2 and "--warmup" in capsys.readouterr().err and not list(tmp_path.iterdir())


def test_e2e_profile_wall_time_on_a_gpu_waits_for_the_device(monkeypatch) -> None:
    """Warm-up windows drain before the profile; the wall time is read after a synchronize, the host time before;
    the cache is emptied after the recipe."""
    import e2e_profile

    log = []
    clock = iter([1.0, 1.002, 1.010])

    def perf_counter():
        log.append("clock")
        return next(clock)

    monkeypatch.setattr(e2e_profile, "time", types.SimpleNamespace(perf_counter=perf_counter))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append("sync"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: log.append("empty_cache"))
    monkeypatch.setattr(torch.profiler, "profile", _FakeProfile([], []))

    def make_step(model, optimizer):
        return lambda: log.append("step")

    result = e2e_profile.profile_recipe(make_step, lambda: (None, None), torch.device("cuda"), warmup=1)
    assert log == ["step", "sync", "clock", "step", "clock", "sync", "clock", "empty_cache"]
    assert result["host_ms"] == pytest.approx(2.0) and result["wall_ms"] == pytest.approx(10.0)
    assert result["kernels"] == 0 and result["kernel_busy_ms"] is None


# --- kernel_configs ---------------------------------------------------------------------------------------------------


def test_kernel_configs_times_the_triton_folds_under_each_block_configuration(monkeypatch) -> None:
    import kernel_configs

    from gafused.triton_backend import _layout

    device = _triton_device()
    built = []
    original = _layout._block_table

    def spy(device, itemsize, acc_numel, offsets, numels):
        table = original(device, itemsize, acc_numel, offsets, numels)
        built.append((table.block_size, table.num_warps))
        return table

    from gafused.triton_backend import fold

    launched = []  # (block, warps, gradient dtype) of every fold launch
    real_kernel = fold._fold_kernel

    class Recording:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append((kwargs["BLOCK"], kwargs["num_warps"], args[1].dtype))
                return real_kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(_layout, "_block_table", spy)
    monkeypatch.setattr(fold, "_fold_kernel", Recording())
    rows = kernel_configs.run(device, [1 / 64], [(512, 2), (256, 8)], reps=3)
    # The heuristic's own config first, then the ones asked for; each config's warps reach the fold launches of
    # both gradient dtypes (fold_num_warps would give 16-bit gradients 4 of 8); both heuristics are restored.
    assert built == [(1024, 4), (512, 2), (256, 8)]
    assert set(launched) == {(b, w, d) for b, w in built for d in (torch.bfloat16, torch.float32)}
    assert _layout.launch_config((1 << 20,)) == (4096, 8) and fold.fold_num_warps is _layout.fold_num_warps
    # On a GPU with gafused._C built, the cuda backend's rows come too, of its one (default) configuration.
    triton_rows = [r for r in rows if r["backend"] == "triton"]
    others = [r for r in rows if r["backend"] != "triton"]
    assert all(r["backend"] == "cuda" and r["config"] == "default" for r in others)
    assert bool(others) == ("cuda" in gafused.available_backends(device))
    seen = {(r["config"], r["op"], r["grad_dtype"]) for r in triton_rows}
    folds = {(op, dtype) for op in ("fold", "fold_finish") for dtype in ("bf16", "fp32")}
    assert seen == {("default", *k) for k in folds | {("scale_cast", "-"), ("sum_of_squares", "-")}} | {
        (config, *k) for k in folds for config in ("512x2", "256x8")
    }
    assert all(r["idle_ms"] > 0 and (r["queued_ms"] is None) == (device.type == "cpu") for r in rows)
    table = kernel_configs.format_table(rows)
    assert "512x2" in table and "fold_finish" in table


@pytest.mark.parametrize(
    "text", ["4096", "100x8", "4096x3", "4096x8,x", "64x4", "3000x8", "4096x8junk", "4096x8x2", "4096x64"]
)
def test_kernel_configs_refuses_a_malformed_config(text: str) -> None:
    import kernel_configs

    with pytest.raises(ValueError, match="--configs"):
        kernel_configs.parse_configs(text)
    assert kernel_configs.parse_configs("4096x8, 8192x16") == [(4096, 8), (8192, 16)]
    assert kernel_configs.parse_configs("128x1,16384x32") == [(128, 1), (16384, 32)]  # the smallest and largest


def test_kernel_configs_queued_ms_is_the_median_after_one_warmup_sample(monkeypatch) -> None:
    import kernel_configs

    clock = [0.0]

    class Event:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            self.t = clock[0]

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return end.t - self.t

    flush = types.SimpleNamespace(is_cuda=True, add_=lambda value: None)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None)
    durations = iter([50.0, 1.0, 2.0, 9.0])

    def run():
        clock[0] += next(durations)

    assert kernel_configs.queued_ms(run, flush, reps=3) == 2.0
    assert kernel_configs.queued_ms(run, torch.empty(1), reps=3) is None


def test_kernel_configs_queued_copy_counts_read_and_write(monkeypatch) -> None:
    import kernel_configs

    monkeypatch.setattr(kernel_configs, "queued_ms", lambda run, flush, reps: (run(), 2.0)[1])
    assert kernel_configs.queued_copy_gbps(1000, torch.empty(1), reps=3) == pytest.approx(2 * 1000 / 2e-3 / 1e9)


def test_kernel_configs_rows_hold_each_op_bytes_against_the_copy_of_the_same_buffer(monkeypatch) -> None:
    """Fractions are the op's own bytes over its time, against the copy of the whole buffer timed the same way;
    the rows go to the caller's list as they come and ``where`` names what is being measured; --reps caps both."""
    import kernel_configs

    device = _triton_device()
    copied, timers = [], []
    real_timer = kernel_configs.Timer

    def timer(*args, **kwargs):
        timers.append(kwargs)
        return real_timer(*args, **kwargs)

    monkeypatch.setattr(kernel_configs, "Timer", timer)

    def idle_copy(timer, nbytes):
        copied.append(("idle", nbytes))
        return 100.0, None

    def queued_copy(nbytes, flush, reps):
        copied.append(("queued", nbytes))
        return 50.0

    monkeypatch.setattr(kernel_configs, "copy_bandwidth_gbps", idle_copy)
    monkeypatch.setattr(kernel_configs, "queued_copy_gbps", queued_copy)
    monkeypatch.setattr(kernel_configs, "queued_ms", lambda run, flush, reps: (run(), 0.25)[1])
    rows, where = [], {}
    size_mb = 1 / 64
    returned = kernel_configs.run(device, [size_mb], [(512, 2)], reps=3, rows=rows, where=where)
    assert returned is rows and len(rows) == (10 if "cuda" not in gafused.available_backends(device) else 16)
    assert where["during"] == f"{size_mb} MB, triton, config (512, 2)"
    nbytes = int(size_mb * 2**20)
    assert copied == [("idle", nbytes), ("queued", nbytes)]
    assert timers[0]["max_reps"] == 3
    numel = nbytes // 4
    for r in rows:
        assert r["acc_mb"] == size_mb and r["copy_gbps"] == 100.0 and r["copy_queued_gbps"] == 50.0
        dtype = kernel_configs.GRAD_DTYPES["bf16" if r["grad_dtype"] == "-" else r["grad_dtype"]]
        moved = traffic.op_bytes_per_element(r["op"], dtype) * numel
        assert r["idle_fraction"] == pytest.approx(moved / (r["idle_ms"] * 1e-3) / 1e9 / 100.0)
        assert r["queued_ms"] == 0.25
        assert r["queued_fraction"] == pytest.approx(moved / 0.25e-3 / 1e9 / 50.0)


def test_kernel_configs_table_puts_each_figure_in_its_column() -> None:
    import kernel_configs

    row = {"acc_mb": 256, "backend": "triton", "config": "4096x8", "op": "fold", "grad_dtype": "bf16",
           "idle_ms": 1.0, "idle_fraction": 0.5, "queued_ms": 0.8, "queued_fraction": 0.75}  # fmt: skip
    lines = kernel_configs.format_table([row, {**row, "queued_ms": None, "queued_fraction": None}])
    *_, first, second = lines.splitlines()
    assert first.split() == ["256", "triton", "4096x8", "fold", "bf16", "1.000", "50%", "0.800", "75%"]
    assert second.split()[-3:] == ["50%", "-", "-"]


@pytest.mark.parametrize("argv", [["--sizes-mb", "0"], ["--reps", "2"], ["--sizes-mb", "256,"], ["--configs", "100x8"]])
def test_kernel_configs_refuses_bad_arguments_before_running(monkeypatch, tmp_path, capsys, argv) -> None:
    import kernel_configs

    def never(*args, **kwargs):
        raise AssertionError("ran despite a bad argument")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernel_configs, "run", never)
    with pytest.raises(SystemExit) as exited:
        kernel_configs.main([*argv, "--out", str(tmp_path)])
    assert exited.value.code == 2 and not list(tmp_path.iterdir())


def test_kernel_configs_runs_the_arguments_it_was_given_and_records_them(monkeypatch, tmp_path) -> None:
    import kernel_configs

    called = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")

    def run(device, sizes, configs, reps, rows, where):
        called.append((sizes, configs, reps))

    monkeypatch.setattr(kernel_configs, "run", run)
    argv = ["--reps", "5", "--sizes-mb", "1,64", "--configs", "4096x8", "--out", str(tmp_path)]
    assert kernel_configs.main(argv) == 0
    assert called == [([1, 64], [(4096, 8)], 5)]
    saved = json.loads(next(tmp_path.glob("*-kernel-configs.json")).read_text())
    assert saved["meta"]["reps"] == 5 and saved["meta"]["interrupted"] is None and saved["rows"] == []


def test_kernel_configs_without_triton_times_the_cuda_defaults_only(monkeypatch) -> None:
    """Block configurations are Triton's: a device whose only fused backend is cuda gets none of them; a device
    with neither fused backend is refused."""
    import kernel_configs

    monkeypatch.setattr(gafused, "available_backends", lambda device: ("reference", "foreach", "cuda"))
    monkeypatch.setattr(kernel_configs, "op_call", lambda op, buffer, grads, out, backend: lambda: None)
    rows = kernel_configs.run(torch.device("cpu"), [1 / 64], [(512, 2)], reps=3)
    assert {(r["backend"], r["config"]) for r in rows} == {("cuda", "default")} and len(rows) == 6
    monkeypatch.setattr(gafused, "available_backends", lambda device: ("reference", "foreach"))
    with pytest.raises(RuntimeError, match="neither fused backend"):
        kernel_configs.run(torch.device("cpu"), [1 / 64], [(512, 2)], reps=3)
