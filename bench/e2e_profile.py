"""Where one end-to-end window spends its time: each recipe of ``e2e.py`` under torch.profiler.

The end-to-end table gives one number per optimizer step. This script runs each accumulation recipe (plain
PyTorch, gafused folding at ``step()``, gafused folding during backward) for warm-up windows, then profiles one
window and reports what the table cannot show:

- the window's wall time, and on a GPU the kernels' busy time inside it (the union of kernel intervals): a
  window much longer than its kernels waited on the host;
- the CUDA runtime calls that make the host wait or are slow (stream and device synchronizations, memcpys,
  pinned allocations, kernel launches): how many and how long;
- the ops that kept the host busiest (self CPU time), and the host time of gafused's entry points
  (``GradAccumulator.backward``, ``step``, ``zero_grad`` and the fold of each bucket during backward), which
  this script wraps in ``record_function`` ranges while it profiles.

    python bench/e2e_profile.py --out DIR            # the e2e model of the device (GPT-2 124M on a GPU)
    python bench/e2e_profile.py --quick --out DIR    # the tiny model (CPU smoke run)

Writes ``<device>-<date>-e2e-profile.json`` and ``.txt`` to ``--out``, the device named as bench/run.py names it
(on CPU its model and the torch thread count, ``--threads``, default 1). Stopped by SIGTERM (bench/gpu_check.sh's
time limit) or Ctrl-C, it writes the recipes profiled so far, marked partial (``meta.interrupted``), and exits
with 143 (130).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import e2e  # noqa: E402 - bench/ modules are imported as siblings, after the path is set
import interrupt  # noqa: E402
import provenance  # noqa: E402
from timing import profiler_activities  # noqa: E402

import gafused  # noqa: E402

# CUDA runtime / driver calls worth counting (matched as substrings of the profiler's event names).
RUNTIME_CALLS = ("StreamSynchronize", "DeviceSynchronize", "EventSynchronize", "Memcpy", "HostAlloc", "LaunchKernel")
# gafused entry points timed as ranges (object, attribute, label).
_RANGES = (
    (gafused.GradAccumulator, "backward", "gafused: GradAccumulator.backward"),
    (gafused.GradAccumulator, "step", "gafused: GradAccumulator.step"),
    (gafused.GradAccumulator, "zero_grad", "gafused: GradAccumulator.zero_grad"),
    (gafused.GradAccumulator, "on_bucket_ready", "gafused: on_bucket_ready (fold one bucket)"),
)


@contextlib.contextmanager
def _ranges() -> Iterator[None]:
    """Wrap gafused's entry points in ``record_function`` ranges while profiling."""
    saved = []
    for owner, name, label in _RANGES:
        original = getattr(owner, name)

        def wrapped(*args, _original=original, _label=label, **kwargs):  # noqa: ANN002, ANN003, ANN202
            with torch.profiler.record_function(_label):
                return _original(*args, **kwargs)

        functools.update_wrapper(wrapped, original)
        saved.append((owner, name, original))
        setattr(owner, name, wrapped)
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def _busy_ms(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals, in ms (profiler times are in us)."""
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        busy += end - max(start, reach)
        reach = end
    return busy / 1e3


def profile_recipe(make_step, build, device: torch.device, warmup: int) -> dict:
    """Warm ``warmup`` windows up, then profile one: wall ms, kernel busy ms, runtime calls, top host ops."""
    model, optimizer = build()
    step = make_step(model, optimizer)
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    with _ranges(), torch.profiler.profile(activities=profiler_activities(device)) as prof:
        begin = time.perf_counter()
        step()
        host_ms = (time.perf_counter() - begin) * 1e3
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall_ms = (time.perf_counter() - begin) * 1e3
    events = prof.events()
    # record_function ranges also leave user-annotation events on the GPU timeline, spanning idle time: not kernels.
    on_gpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = [e for e in on_gpu if not getattr(e, "is_user_annotation", False)]
    calls = {}
    for name in RUNTIME_CALLS:
        matching = [e for e in events if name in e.name and e.device_type == torch.autograd.DeviceType.CPU]
        calls[name] = {"count": len(matching), "ms": sum(e.cpu_time_total for e in matching) / 1e3}
    averages = prof.key_averages()
    top = sorted(averages, key=lambda a: a.self_cpu_time_total, reverse=True)[:20]
    # A range has a CPU entry and, on a GPU, an annotation entry under the same key (no CPU time): keep the CPU one.
    # Only the ranges set here: gafused's custom ops ("gafused::fold_", ...) are ops, not entry points.
    labels = {label for _, _, label in _RANGES}
    ranges = {
        a.key: {"count": a.count, "cpu_ms": a.cpu_time_total / 1e3}
        for a in averages
        if a.key in labels and a.device_type == torch.autograd.DeviceType.CPU
    }
    result = {
        "backend": getattr(step, "backend", None),
        "host_ms": host_ms,
        "wall_ms": wall_ms,
        "kernels": len(kernels),
        "kernel_busy_ms": _busy_ms([(e.time_range.start, e.time_range.end) for e in kernels]) if kernels else None,
        "runtime_calls": calls,
        "gafused_ranges": ranges,
        "top_self_cpu": [{"op": a.key, "count": a.count, "self_cpu_ms": a.self_cpu_time_total / 1e3} for a in top],
    }
    del model, optimizer, step
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def format_report(results: dict) -> str:
    lines = [f"one window per recipe, profiled: {results['meta']['device']}, model {results['config']['model']}"]
    for label, r in results["recipes"].items():
        busy = "-" if r["kernel_busy_ms"] is None else f"{r['kernel_busy_ms']:.1f}"
        lines.append(f"\n{label} (backend {r['backend'] or '-'}): wall {r['wall_ms']:.1f} ms, host {r['host_ms']:.1f} "
                     f"ms, {r['kernels']} kernels busy {busy} ms")  # fmt: skip
        calls = ", ".join(f"{name} {c['count']} ({c['ms']:.2f} ms)" for name, c in r["runtime_calls"].items())
        lines.append(f"  runtime calls: {calls}")
        for name, c in r["gafused_ranges"].items():
            lines.append(f"  {name}: {c['count']} calls, {c['cpu_ms']:.2f} ms of host time")
        lines.append("  top self CPU time:")
        for op in r["top_self_cpu"][:12]:
            lines.append(f"    {op['self_cpu_ms']:9.2f} ms {op['count']:6d}x  {op['op'][:80]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("."), help="directory for the JSON and the report")
    parser.add_argument("--quick", action="store_true", help="the tiny model of the smoke run")
    parser.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--warmup", type=int, default=2, help="windows before the profiled one (default 2)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads for torch on CPU (default 1, as bench/run.py; the count is recorded with the results)",
    )
    args = parser.parse_args(argv)
    if args.warmup < 1:
        parser.error(f"--warmup must be >= 1 (the first window builds buffers and caches), got {args.warmup}")
    if args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    device = provenance.device_option(parser, args.device)
    provenance.check_out_option(parser, args.out)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    # The device as bench/run.py names it (and its files): the GPU's name, or the CPU's model and thread count.
    device_label = provenance.device_name(device)
    if device.type == "cpu":
        device_label += f" ({threads} thread{'s' if threads > 1 else ''})"
    run = e2e.setup(device, "quick" if args.quick else "full")
    recipes = {label: make for label, accumulation, make in run.recipes if accumulation > 1}
    results = {
        "meta": {"device": device_label, "cpu_threads": threads, "warmup": args.warmup, "interrupted": None},
        "config": {**run.config.__dict__, "model": run.model_name},
        "recipes": {},
    }
    stop = name = None
    with interrupt.sigterm_raises():
        try:
            for name, make in recipes.items():
                results["recipes"][name] = profile_recipe(make, run.build, device, args.warmup)
        except interrupt.STOPPED as stopped:
            stop = stopped
            results["meta"]["interrupted"] = interrupt.describe(stopped, name)
    with interrupt.sigterm_ignored():
        provenance.save_report(args.out, device, device_label, "e2e-profile", results, format_report(results))
    return 0 if stop is None else interrupt.exit_status(stop)


if __name__ == "__main__":
    raise SystemExit(main())
