"""Host cost of a middle micro-step on many small tensors, against ``torch._foreach_add_``.

    python bench/host_overhead.py                 # 1024 tensors of 64 fp32 elements, every backend on CPU
    python bench/host_overhead.py --tensors 148 --numel 4096
    python bench/host_overhead.py --runs 3 --out bench/results   # three runs, their ranges, saved as JSON and .txt

A middle micro-step folds one gradient per parameter into the buffer and nothing else, so on tensors this
small its time is almost all host work: Python, dispatch, argument checks, tables. The baseline is the least
any multi-tensor accumulation can do: one ``torch._foreach_add_(main_grads, grads)`` over the same tensors.
docs/design.md section 3 holds a CPU middle micro-step to at most 1.5x that baseline.

With 16-bit gradients (``--dtype bf16``) the baseline adds bf16 gradients into fp32 accumulators: the dtypes
differ, so torch's multi-tensor fast path does not apply and ``_foreach_add_`` falls back to one op per tensor
(on a GPU, a kernel per tensor: the committed H200 micro-benchmark counts 148 for GPT-2's 148 gradients). A GPU
comparison against that baseline is one against that fallback. The row ``torch._foreach_add_ same dtype`` (only
then) gives the one-kernel floor: the same call with gradients already in the accumulators' dtype.

Rows (``rows()``) measure, per backend that runs on the device:
- ``fold_``: ``gafused.ops.fold_`` with its gradient check (``ops.check_grads``), the op a wrapper calls per buffer;
- ``fold_ check=False``: the same without the check: dispatch and backend alone;
- ``step``: a whole ``GradAccumulator.step()`` in the middle of a window (gather ``p.grad``, check, fold,
  release the gradients), over a no-op inner optimizer;
- ``backward; step; zero_grad``: the loop users write, backward included, in the middle of a window: the loss
  ``cat(params) @ c`` (its graph built untimed before each sample) gives every parameter its gradient from one
  autograd node, and the hooks fold them bucket by bucket. Its baseline is the row ``loss.backward() (plain)``:
  the same backward adding into existing ``.grad`` tensors, as plain accumulation's middle micro-batches do; the
  script prints the ratio of each backend's row to it (``x_plain_backward`` in ``rows()``).
Two rows of no backend give the part of ``step`` that is Python per parameter, whatever the backend:
``read p.grad`` (``[p.grad for p in params]``) and ``release p.grad`` (``p.grad = None`` for each); a third,
``check_grads``, the gradient check alone, named by the path it took: ``layout matched`` (one C++ match against the
layout the buffer last accepted, the usual case) or ``per gradient`` (every gradient checked in Python); after a
``per gradient`` row the script prints why the match missed (what torch's guard found different, say).
On CPU with ``TRITON_INTERPRET=1`` set, the same four rows of backend ``triton-host`` time the Triton backend
with its kernel launches skipped: gafused's own host work per call (checks, tables, scalars), without Triton's
launcher or the interpreter, which a GPU run adds.
Each row gives the median and 20/80% quantiles in microseconds, the ratio to the baseline's median, and what one
call launches (``launches``: CUDA kernels on a GPU, leaf compute aten ops on CPU; ``timing.count_launches``, one
call under ``torch.profiler`` after the sampling). A profiler session can leave its CUDA hooks (CUPTI) attached
and every later launch slower (torch tears them down only when ``TEARDOWN_CUPTI=1``), so the last two rows time the
baseline called back to back (warm caches: below the first row, whose calls follow other cases), just before and
just after the counted calls: ``after`` well above ``before`` says that what a benchmark times after a profiled
call pays for it.
Timings use ``time.perf_counter`` around each call. The cases' samples are interleaved, in a new (seeded) order
every round, so neither load from other processes nor what the previous case left behind (a synchronize that
waited on its kernels, its garbage) falls on one case more than another; Python's cyclic garbage collector is
kept out of the timed calls (as ``timeit`` does: a collection that allocations elsewhere made due runs after the
call). The gradients are handed back to the parameters untimed before every ``step`` sample, as backward would.
``--runs K`` measures K times, one run after the other in this process, prints each run's table and then each
row's least and greatest median (and ratios) over the runs (``ranges()``): host timings on a shared machine move
with its load, so a single run says little. ``--out DIR`` also saves the runs, their ranges and what produced them
(commit, versions, arguments, ``TRITON_INTERPRET``) as JSON, and the printed report as .txt, beside it.
Stopped by SIGTERM (the time limit of bench/gpu_check.sh) or Ctrl-C after at least two samples of every case, it
prints the table of the samples taken so far, says how many, and exits with 143 (130); with ``--runs``, the runs
taken before (a run stopped before two rounds is left out), and no further run.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import interrupt
import provenance
import timing
import torch

import gafused
from gafused import FlatGradBuffer, GradAccumulator, ops

__all__ = ["main", "rows", "ranges", "format_table", "format_ranges", "PLAIN_BACKWARD", "BACKWARD_LOOP"]

# The rows of the backward loop (``_backward_loop_case``): plain PyTorch's, then gafused's per backend.
PLAIN_BACKWARD = "loss.backward() (plain)"
BACKWARD_LOOP = "backward; step; zero_grad"


class _NoStep(torch.optim.Optimizer):
    """An inner optimizer that does nothing, so a finishing step would time only the accumulator."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__(params, {})

    def step(self, closure=None):  # noqa: ANN001 - torch.optim.Optimizer's signature
        return None


class _NoLaunch:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid: object) -> Callable[..., None]:
        return lambda *args, **kwargs: None


def _without_triton_launches(run: Callable[[], object]) -> Callable[[], None]:
    """``run`` with the Triton fold kernel's launches skipped (a middle micro-step launches nothing else)."""
    from gafused.triton_backend import fold

    def skipped() -> None:
        kernel, fold._fold_kernel = fold._fold_kernel, _NoLaunch()
        try:
            run()
        finally:
            fold._fold_kernel = kernel

    return skipped


def _held_as_grads(tensors: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    """Parameters that hold ``tensors`` as their ``.grad`` (keep them alive as long as the tensors are timed)."""
    owners = [torch.nn.Parameter(torch.zeros_like(tensor)) for tensor in tensors]
    for owner, tensor in zip(owners, tensors, strict=True):
        owner.grad = tensor
    return owners


def _layout_miss_reason(buffer: FlatGradBuffer, grads: list[torch.Tensor]) -> str:
    """Why ``ops.check_grads`` checked ``grads`` one by one instead of matching the layout the buffer last accepted."""
    if ops._TensorGuards is None:
        return "torch's TensorGuards is missing here or failed gafused's check of it: every call checks per gradient"
    accepted = ops._accepted_layouts.get(buffer)
    if accepted is None:
        return "no layout was recorded: the first check did not accept the gradients as they were given"
    given = [index for index in accepted.missing if grads[index] is not None]
    if given:
        return f"the entries of grads at {given} were None when the layout was recorded"
    present = [grads[index] for index in accepted.present]
    names = [f"grads[{index}]" for index in accepted.present]
    reason = accepted.guard.check_verbose(*present, tensor_check_names=names)
    if reason is True or not reason:
        return "the recorded layout matches these gradients when checked again"
    return f"the recorded layout does not match: {reason}"


def _backward_loop_case(
    label: str, backend: str | None, numel: int, tensors: int, dtype: torch.dtype, device: torch.device
) -> tuple[str, str, Callable[[], None], Callable[[], None]]:
    """A middle micro-step of the loop users write, backward included: plain PyTorch's ``loss.backward()`` adding
    into ``.grad`` (``backend`` None), or ``opt.backward(loss); opt.step(); opt.zero_grad()`` folding during backward.

    The loss, ``cat(parameters) @ c`` (built untimed before every sample), hands every parameter its gradient from
    one autograd node, so the difference between the two rows is what each does per gradient: autograd's in-place
    add into ``.grad``, or gafused's hooks, bucket folds and release.
    """
    params = [torch.nn.Parameter(torch.zeros(numel, dtype=dtype, device=device)) for _ in range(tensors)]
    coefficients = torch.randn(tensors * numel, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    graph: list[torch.Tensor] = []

    def build() -> None:
        graph[:] = [torch.cat(params) @ coefficients]

    if backend is None:
        build()
        graph.pop().backward()  # every .grad exists: later calls add into it, as a middle micro-batch does

        def run() -> None:
            graph.pop().backward()

        return (PLAIN_BACKWARD, label, run, build)
    opt = GradAccumulator(_NoStep(params), accumulation_steps=1 << 30, backend=backend)

    def run() -> None:
        opt.backward(graph.pop())
        opt.step()
        opt.zero_grad()

    build()
    run()  # the first micro-step of the window: later ones are middle micro-steps
    if label != backend:
        run = _without_triton_launches(run)
    return (BACKWARD_LOOP, label, run, build)


def rows(
    tensors: int = 1024,
    numel: int = 64,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    reps: int = 200,
    warmup: int = 20,
) -> list[dict[str, object]]:
    """Time a middle micro-step of each backend that runs on ``device`` against ``torch._foreach_add_``.

    Args:
        tensors: number of parameters (and gradients).
        numel: elements per parameter.
        dtype: parameter and gradient dtype (the buffer accumulates in float32, float64 for float64).
        device: where tensors live; CUDA times include the launch, not the kernel's completion.
        reps: timed samples per measurement.
        warmup: untimed calls before sampling.

    Returns:
        One dict per measurement: ``what``, ``backend``, ``tensors``, ``numel``, ``median_us``, ``q20_us``,
        ``q80_us``, ``ratio`` (median over the ``torch._foreach_add_`` median; 1.0 for the baseline), ``launches``
        (``timing.count_launches`` of one call: CUDA kernels, or leaf compute aten ops on CPU; None when stopped
        before they were counted), ``reps``
        (samples taken) and ``interrupted`` (None, or what ``interrupt.describe`` says of a SIGTERM or Ctrl-C that
        stopped the sampling after at least two rounds: the rows then hold the rounds taken), ``note`` (why the
        layout match missed, on a ``check_grads (per gradient)`` row; else None) and ``x_plain_backward`` (on a
        ``backward; step; zero_grad`` row, its median over the ``loss.backward() (plain)`` median; else None).
    """
    device = torch.device(device)
    if tensors < 1 or numel < 1:
        raise ValueError(f"tensors and numel must be positive, got tensors={tensors}, numel={numel}")
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(numel, generator=generator).to(device=device, dtype=dtype) for _ in range(tensors)]
    accum_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    main_grads = [torch.zeros(numel, dtype=accum_dtype, device=device) for _ in range(tensors)]
    # Every gradient a timed call reads is some parameter's .grad all along, as backward leaves gradients: torch takes
    # a tensor that C++ also holds faster than one only Python holds (``_foreach_add_`` of 1024 tensors: 7% on CPU),
    # so gradients that cases attach and release would time differently with the order of the cases. The cases that
    # assign or release p.grad (read, release, step) use copies of their own.
    owners = _held_as_grads(grads)

    # (what, backend, run, prepare); the first is the baseline.
    cases: list[tuple[str, str, Callable[[], object], Callable[[], object] | None]] = [
        ("torch._foreach_add_", "-", lambda: torch._foreach_add_(main_grads, grads), None)
    ]
    if dtype != accum_dtype:
        # Mixed dtypes keep the baseline off torch's multi-tensor fast path (module doc): the one-kernel floor.
        same_grads = [grad.to(accum_dtype) for grad in grads]
        owners += _held_as_grads(same_grads)
        same_mains = [torch.zeros_like(main) for main in main_grads]
        cases.append(("torch._foreach_add_ same dtype", "-", lambda: torch._foreach_add_(same_mains, same_grads), None))
    # The per-parameter Python floor of owning p.grad, whatever the backend: reading every p.grad, and releasing
    # every one (p.grad = None) after the fold.
    held = [torch.nn.Parameter(torch.zeros(numel, dtype=dtype, device=device)) for _ in range(tensors)]
    held_grads = [grad.clone() for grad in grads]

    def give_back(params: list[torch.nn.Parameter] = held) -> None:
        for param, grad in zip(params, held_grads, strict=True):
            param.grad = grad

    def release(params: list[torch.nn.Parameter] = held) -> None:
        for param in params:
            param.grad = None

    give_back()
    cases.append(("read p.grad", "-", lambda: [param.grad for param in held], give_back))
    cases.append(("release p.grad", "-", release, give_back))
    # gafused's gradient check alone, what `check=False` skips: one C++ match against the layout the buffer last
    # accepted, or, when that misses, a Python check per gradient. Which one ran shows in the row's name: a match
    # hands back the recorded shapes list itself, a check per gradient makes a new one.
    checked_buffer = FlatGradBuffer(held, accum_dtype)
    shapes = [ops.check_grads(checked_buffer, grads).shapes for _ in range(2)]
    matched = shapes[0] is not None and shapes[0] is shapes[1]
    check_label = f"check_grads ({'layout matched' if matched else 'per gradient'})"
    cases.append((check_label, "-", lambda: ops.check_grads(checked_buffer, grads), None))
    notes = {} if matched else {check_label: _layout_miss_reason(checked_buffer, grads)}
    cases.append(_backward_loop_case("-", None, numel, tensors, dtype, device))
    for backend in gafused.available_backends(device):
        label = backend
        if backend == "triton" and device.type == "cpu":
            label = "triton-host"  # interpreted kernels are a logic check, not a speed: time the rest only
        params = [torch.nn.Parameter(torch.zeros(numel, dtype=dtype, device=device)) for _ in range(tensors)]
        weight = torch.ones((), device=device)
        # One buffer per case: a backend keeps state per buffer (the foreach backend's views shaped like the last
        # gradients it saw), and cases sharing one would time each other's leftovers.
        buffers = {check: FlatGradBuffer(params, accum_dtype) for check in (True, False)}
        for buffer in buffers.values():
            ops.fold_(buffer, grads, weight, first=True, backend=backend)

        def middle_fold(
            weight: torch.Tensor = weight, backend: str = backend, check: bool = True, buffers: dict = buffers
        ) -> None:
            ops.fold_(buffers[check], grads, weight, first=False, backend=backend, check=check)

        opt = GradAccumulator(_NoStep(params), accumulation_steps=1 << 30, backend=backend)
        handed = [grad.clone() for grad in grads]

        def hand_over(params: list[torch.nn.Parameter] = params, handed: list[torch.Tensor] = handed) -> None:
            for param, grad in zip(params, handed, strict=True):
                param.grad = grad

        hand_over()
        opt.step()  # the first micro-step of the window: later ones are middle micro-steps
        runs = [middle_fold, functools.partial(middle_fold, check=False), opt.step]
        if label != backend:
            runs = [_without_triton_launches(run) for run in runs]
        cases.append(("fold_", label, runs[0], None))
        cases.append(("fold_ check=False", label, runs[1], None))
        cases.append(("step", label, runs[2], hand_over))
        cases.append(_backward_loop_case(label, backend, numel, tensors, dtype, device))

    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    collecting = gc.isenabled()

    def sample(run: Callable[[], object], prepare: Callable[[], object] | None) -> float:
        """One timed call in microseconds, without the garbage collector (module doc)."""
        if prepare is not None:
            prepare()
        synchronize()
        try:
            gc.disable()
            start = time.perf_counter()
            run()
            return (time.perf_counter() - start) * 1e6
        finally:
            if collecting:
                gc.enable()

    def sample_alone(times: list[float]) -> None:
        """The baseline called back to back, its samples appended to ``times`` as they are taken."""
        for rep in range(warmup + reps):
            elapsed = sample(cases[0][2], cases[0][3])
            if rep >= warmup:
                times.append(elapsed)

    samples: list[list[float]] = [[] for _ in cases]
    launches: list[int | None] = [None] * len(cases)
    alone: dict[str, list[float]] = {"before": [], "after": []}  # the baseline called back to back (module doc)
    stopped = None
    # Samples of all cases are interleaved, in a new order each round (module doc).
    order = list(range(len(cases)))
    shuffle = random.Random(0).shuffle
    during = "sampling"
    try:
        for rep in range(warmup + reps):
            shuffle(order)
            for index in order:
                elapsed = sample(cases[index][2], cases[index][3])
                if rep >= warmup:
                    samples[index].append(elapsed)
        # Launches are counted after the sampling: a profiled call can leave the profiler's CUDA hooks (CUPTI)
        # attached, costing every later launch host time. The baseline called back to back just before and just
        # after the counted calls says whether it did.
        during = "sampling the baseline alone, before profiling"
        sample_alone(alone["before"])
        during = "counting launches"
        launches = [timing.count_launches(run, prepare, device) for _, _, run, prepare in cases]
        during = "sampling the baseline alone, after profiling"
        sample_alone(alone["after"])
    except interrupt.STOPPED as stop:
        taken = min(len(times) for times in samples)  # whole rounds only: every case the same count
        if taken < 2:
            raise
        samples = [times[:taken] for times in samples]
        stopped = interrupt.describe(stop, f"{during}, after {taken} of {reps} rounds")
    for moment, times in alone.items():
        if len(times) >= 2:
            cases.append((f"{cases[0][0]} alone, {moment} profiling", "-", cases[0][2], cases[0][3]))
            samples.append(times)
            launches.append(launches[0])
    results: list[dict[str, object]] = []
    for (what, backend, _, _), times, count in zip(cases, samples, launches, strict=True):
        q = statistics.quantiles(times, n=5)
        results.append(
            {"what": what, "backend": backend, "tensors": tensors, "numel": numel,
             "median_us": statistics.median(times), "q20_us": q[0], "q80_us": q[3], "launches": count,
             "reps": len(times), "interrupted": stopped, "note": notes.get(what)}
        )  # fmt: skip
    baseline = results[0]["median_us"]
    plain_backward = next(row["median_us"] for row in results if row["what"] == PLAIN_BACKWARD)
    for row in results:
        row["ratio"] = row["median_us"] / baseline
        row["x_plain_backward"] = row["median_us"] / plain_backward if row["what"] == BACKWARD_LOOP else None
    return results


def format_table(table: list[dict[str, object]]) -> str:
    """One run's rows as the script prints them: median, quantiles, ratio to the baseline, launches."""
    width = max(len(row["what"]) for row in table)
    lines = [
        f"{'what':<{width}} {'backend':<10} {'median us':>10} {'q20 us':>9} {'q80 us':>9} {'x foreach':>10} "
        f"{'launches':>9}"
    ]
    for row in table:
        lines.append(
            f"{row['what']:<{width}} {row['backend']:<10} {row['median_us']:>10.1f} {row['q20_us']:>9.1f} "
            f"{row['q80_us']:>9.1f} {row['ratio']:>10.2f} {'-' if row['launches'] is None else row['launches']:>9}"
        )
    for row in table:
        if row["x_plain_backward"] is not None:
            lines.append(f"{BACKWARD_LOOP} ({row['backend']}): {row['x_plain_backward']:.2f}x {PLAIN_BACKWARD}")
    for row in table:
        if row["note"]:
            lines.append(f"{row['what']}: {row['note']}")
    return "\n".join(lines)


def ranges(runs: list[list[dict[str, object]]]) -> list[dict[str, object]]:
    """Each row's least and greatest median, ratio and ``x_plain_backward`` over ``runs`` (lists of ``rows()``
    output): ``what``, ``backend``, ``median_us``, ``ratio`` and ``x_plain_backward`` (None where the rows hold
    none), each a ``[least, greatest]`` pair, for the rows every run has, in the first run's order (a run stopped
    part way has no rows of the baseline alone, whose sampling it did not reach)."""
    if not runs:
        raise ValueError("ranges needs at least one run")
    by_key = [{(row["what"], row["backend"]): row for row in run} for run in runs]
    keys = [(row["what"], row["backend"]) for row in runs[0] if all((row["what"], row["backend"]) in r for r in by_key)]
    if not keys:
        raise ValueError("ranges needs rows that every run has")
    spans = []
    for key in keys:
        span: dict[str, object] = {"what": key[0], "backend": key[1]}
        for field in ("median_us", "ratio", "x_plain_backward"):
            values = [rows[key][field] for rows in by_key]
            span[field] = None if values[0] is None else [min(values), max(values)]
        spans.append(span)
    return spans


def format_ranges(spans: list[dict[str, object]], runs: int) -> str:
    """The ``ranges`` table: least-greatest median, ratio to the baseline and, on the backward loop's rows, ratio to
    plain PyTorch's backward, over ``runs`` runs."""
    width = max(len(span["what"]) for span in spans)
    lines = [
        f"over {runs} runs (least-greatest of the runs' medians):",
        f"{'what':<{width}} {'backend':<10} {'median us':>15} {'x foreach':>11} {'x plain backward':>17}",
    ]
    for span in spans:
        plain = span["x_plain_backward"]
        lines.append(
            f"{span['what']:<{width}} {span['backend']:<10} {'{:.1f}-{:.1f}'.format(*span['median_us']):>15} "
            f"{'{:.2f}-{:.2f}'.format(*span['ratio']):>11} "
            f"{'-' if plain is None else '{:.2f}-{:.2f}'.format(*plain):>17}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the host-cost table for the command-line sizes (with ``--runs``, each run's and the ranges over them;
    with ``--out``, also saved there); 143 (130) when SIGTERM (Ctrl-C) cut it short."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=1024)
    parser.add_argument("--numel", type=int, default=64)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--reps", type=int, default=200, help="samples per case and run (at least 2; default 200)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument(
        "--runs", type=int, default=1, help="measure this many times, one after another (default 1), and print the "
        "least and greatest of each row's medians over the runs"
    )  # fmt: skip
    parser.add_argument(
        "--out", type=Path, default=None, help="also write the runs as JSON, and the printed report as .txt, into "
        "this folder (<device>-<UTC time>-host-<tensors>x<numel>-<dtype>)"
    )  # fmt: skip
    args = parser.parse_args(argv)
    for option, value, least in (("--runs", args.runs, 1), ("--reps", args.reps, 2), ("--tensors", args.tensors, 1),
                                 ("--numel", args.numel, 1), ("--threads", args.threads, 1)):  # fmt: skip
        if value < least:
            parser.error(f"{option} must be at least {least}, got {value}")
    device = provenance.device_option(parser, args.device)
    if args.out is not None:
        provenance.check_out_option(parser, args.out)
    torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    runs: list[list[dict[str, object]]] = []
    stopped = None
    with interrupt.sigterm_raises():
        for _ in range(args.runs):
            try:
                runs.append(rows(args.tensors, args.numel, dtype, device, args.reps))
            except interrupt.STOPPED as stop:  # before two whole sampling rounds of this run: it is left out
                stopped = interrupt.describe(stop, f"run {len(runs) + 1} of {args.runs}, before two rounds")
                break
            stopped = runs[-1][0]["interrupted"]
            if stopped:
                break
    if not runs:
        print(f"STOPPED by {stopped['signal']} before two whole sampling rounds: no table")
        return 143 if stopped["signal"] == "SIGTERM" else 130
    lines = []
    if stopped and args.out is None:  # (save_report says it itself)
        lines.append(f"PARTIAL RESULTS: stopped by {stopped['signal']} during {stopped['during']}")
    threads = torch.get_num_threads()
    lines.append(
        f"middle micro-step, {args.tensors} x {args.numel} {args.dtype} on {args.device}, torch {torch.__version__}, "
        f"{threads} thread(s), {runs[0][0]['reps']} samples per row"
        + (f", TRITON_INTERPRET={os.environ['TRITON_INTERPRET']}" if "TRITON_INTERPRET" in os.environ else "")
    )
    lines.append(f"launches: {timing.launch_unit(args.device)} in one call")
    for index, table in enumerate(runs, 1):
        if args.runs > 1:
            lines.append(f"run {index} of {args.runs}:")
        lines.append(format_table(table))
    spans = ranges(runs) if args.runs > 1 else None
    if spans is not None:
        lines.append(format_ranges(spans, len(runs)))
    report = "\n".join(lines)
    with interrupt.sigterm_ignored():  # the last writes, complete or not, are not cut short by a (second) SIGTERM
        if args.out is None:
            print(report)
        else:
            label = provenance.device_name(device)
            if device.type == "cpu":
                label += f" ({threads} thread{'s' if threads > 1 else ''})"
            arguments = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
            meta = {
                "arguments": arguments,
                "cpu_threads": threads,
                "interrupted": stopped,  # save_report marks the files partial
                "triton_interpret": os.environ.get("TRITON_INTERPRET"),
                "python": platform.python_version(),
            }
            kind = f"host-{args.tensors}x{args.numel}-{args.dtype}"
            results = {"meta": meta, "runs": runs, "ranges": spans}
            provenance.save_report(args.out, device, label, kind, results, report)
    return 143 if stopped and stopped["signal"] == "SIGTERM" else 130 if stopped else 0


if __name__ == "__main__":
    raise SystemExit(main())
