"""Peak memory of accumulation recipes, in bytes per parameter, measured exactly.

    python bench/memory.py            # ~100 MB of fp32 parameters (24 x Linear(1024, 1024)), fp32 and bf16
    python bench/memory.py --quick    # a smaller model

Each recipe trains the same model on the same data for two windows of N micro-batches with AdamW; the
figure is the peak of live tensor bytes during the second window (parameters, gradients, buffers, optimizer
state, activations and temporaries all included), divided by the number of parameters. ``measure`` also gives the
peak of each phase of that window: its micro-batches, and its end (finish, clip, inner step). On CPU the live
bytes come from torch.profiler's allocation events, which record every tensor allocation and free with its exact
size (``track_peak`` is checked against known allocations by tests/test_memory.py); on a GPU from
``torch.cuda.max_memory_allocated``, over what was allocated when the case began (``run`` first runs one case
unrecorded on a GPU, so that memory the process allocates once falls to no case). The profiler sees only the threads
it follows: where other threads free tensors (gloo's workers, in bench/distributed.py), ``count_every_thread()`` at
process start and ``live_peak_after_mark()`` count the whole process instead.

The recipes:
- ``plain``: ``(loss / N).backward()``; autograd accumulates into ``p.grad`` (in the parameters' dtype);
- ``megatron``: an fp32 ``main_grad`` per parameter, ``main_grad += p.grad.float()`` after each backward,
  ``p.grad`` cast back for the optimizer step (bf16 parameters only: for fp32 it is ``plain``);
- ``gafused-step``: ``loss.backward(); opt.step(weight=w)`` (folds at step time);
- ``gafused-backward``: ``opt.backward(loss, weight=w); opt.step()`` (folds during backward, bucket by bucket).

The gafused recipes run the backend users get, ``backend="auto"`` (foreach on CPU, the fused kernels on a GPU);
``measure(..., backend=...)`` takes another.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import timing  # noqa: E402 - bench/timing.py, a sibling (bench/ is on the path wherever this module is imported)

import gafused  # noqa: E402 - run as a script from a checkout as well as installed

RECIPES = ("plain", "megatron", "gafused-step", "gafused-backward")
ACCUMULATION_STEPS = 4
_MARK_BYTES = 7_777  # the first mark's allocation, of an odd size no real tensor has; later marks' grow by 2
_EVERY_THREAD = [False]  # count_every_thread() was called in this process


# --- the tracker ------------------------------------------------------------------------------------------


def count_every_thread() -> None:
    """From now on, count the CPU tensor bytes of the whole process, whichever thread allocates or frees them.

    The profiler records allocation events only on the threads it profiles. A tensor whose last reference is
    dropped by another thread (a gloo worker finishing a collective after the caller has moved on) is freed
    without an event, so ``peak_after_mark`` would count it as live for good. This sets the c10 flag
    ``caffe2_report_cpu_memory_usage`` (no Python API sets it; ctypes writes the exported global): PyTorch's CPU
    allocator then keeps a process-wide count of live bytes, updated on every thread, and stamps it on each
    event, which ``live_peak_after_mark`` reads. Call it at process start, before the tensors to be counted
    exist (their sizes are recorded when they are allocated). It cannot be undone.
    """
    import ctypes

    library = next(Path(torch.__file__).parent.joinpath("lib").glob("*c10.*"), None)
    try:
        flag = ctypes.c_bool.in_dll(ctypes.CDLL(str(library)), "FLAGS_caffe2_report_cpu_memory_usage")
    except (OSError, ValueError, TypeError) as error:
        raise RuntimeError(f"memory: cannot set caffe2_report_cpu_memory_usage in {library}: {error}") from error
    flag.value = True
    _EVERY_THREAD[0] = True


class _CpuTracker:
    """Live tensor bytes on the CPU from the profiler's allocation events (exact sizes, in order)."""

    def __init__(self) -> None:
        self._profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        self._phases: list[str] = []

    # The profiler's native start/stop lines would break up run.py's progress bars; only those two calls are
    # silenced, not what the tracked block prints.
    def __enter__(self) -> _CpuTracker:
        with timing.quiet_stderr():
            self._profile.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        with timing.quiet_stderr():
            self._profile.__exit__(*exc)

    def mark(self, phase: str = "measured") -> None:
        """Start the measured stretch, or (called again) a new phase of it; see ``phase_peaks``."""
        _check_new_phase(self._phases, phase)
        self._phases.append(phase)
        # Each mark is an allocation of its own odd size, freed at once: the events show where each phase begins.
        # The cyclic collector is kept out of it (it could free a tensor between the two).
        collecting = gc.isenabled()
        gc.disable()
        try:
            marker = torch.empty(_marker_bytes(len(self._phases) - 1), dtype=torch.uint8)
            del marker
        finally:
            if collecting:
                gc.enable()

    def phase_peaks(self) -> dict[str, int]:
        """Per phase, in the order marked: the highest live byte count from its mark to the next (live bytes
        counted from the tracker's start; the marks' own bytes are not counted)."""
        events = [
            event
            for event in self._profile.profiler.kineto_results.events()
            if event.name() == "[memory]" and event.device_type() == torch.autograd.DeviceType.CPU
        ]
        events.sort(key=lambda event: event.start_ns())  # a stable sort keeps same-timestamp events in order
        sizes = [event.nbytes() for event in events]
        peaks: list[int] = []
        live, index = 0, 0
        while index < len(sizes):
            size = sizes[index]
            index += 1
            marker = _marker_bytes(len(peaks))
            # A mark: its allocation, freed at once (a tensor of that size that lives on is not one).
            if len(peaks) < len(self._phases) and size == marker and index < len(sizes) and sizes[index] == -marker:
                peaks.append(live)  # the next phase begins; the marker is not counted
                index += 1
                continue
            live += size
            if peaks:
                peaks[-1] = max(peaks[-1], live)
        if len(peaks) < len(self._phases):
            raise RuntimeError(f"memory tracker: the mark of phase {self._phases[len(peaks)]!r} was not recorded")
        return dict(zip(self._phases, peaks, strict=True))

    def peak_after_mark(self) -> int:
        """The highest live byte count after the first ``mark()`` (live bytes counted from the tracker's start)."""
        return max(self.phase_peaks().values(), default=0) if self._phases else _no_mark()

    def live_peak_after_mark(self) -> int:
        """The highest live byte count of the whole process after ``mark()``, every thread included: the
        allocator's own count stamped on each event (needs ``count_every_thread()`` before those tensors were
        allocated)."""
        if not _EVERY_THREAD[0]:
            raise RuntimeError("memory tracker: live_peak_after_mark() needs count_every_thread() at process start")
        allocation = torch._C._profiler._EventType.Allocation
        stack = list(self._profile.profiler.kineto_results.experimental_event_tree())
        events = []
        while stack:
            node = stack.pop()
            stack.extend(node.children)
            if node.tag == allocation:
                events.append((node.start_time_ns, node.extra_fields))
        events.sort(key=lambda event: event[0])
        start = next((i for i, (_, fields) in enumerate(events) if fields.alloc_size == _marker_bytes(0)), None)
        if start is None:
            raise RuntimeError("memory tracker: the mark() allocation was not recorded")
        # The mark's own event counts the mark; the events after it (its free first) do not.
        return max((fields.total_allocated for _, fields in events[start + 1 :]), default=0)


class _CudaTracker:
    """Live bytes on the current CUDA device from the caching allocator's statistics."""

    def __enter__(self) -> _CudaTracker:
        torch.cuda.synchronize()
        self._start = torch.cuda.memory_allocated()
        self._phases: list[str] = []
        self._peaks: list[int] = []
        return self

    def __exit__(self, *exc: object) -> None:
        self._close_phase()

    def _peaks_so_far(self) -> list[int]:
        """The closed phases' peaks, and the open phase's so far (the allocator's peak since its mark)."""
        torch.cuda.synchronize()
        peaks = list(self._peaks)
        if len(peaks) < len(self._phases):
            peaks.append(torch.cuda.max_memory_allocated() - self._start)
        return peaks

    def _close_phase(self) -> None:
        self._peaks = self._peaks_so_far()

    def mark(self, phase: str = "measured") -> None:
        _check_new_phase(self._phases, phase)  # before the previous phase is closed
        self._close_phase()
        self._phases.append(phase)
        torch.cuda.reset_peak_memory_stats()

    def phase_peaks(self) -> dict[str, int]:
        # Read inside the block, the open phase's peak so far: only mark() and leaving the block close it.
        return dict(zip(self._phases, self._peaks_so_far(), strict=True))

    def peak_after_mark(self) -> int:
        return max(self.phase_peaks().values(), default=0) if self._phases else _no_mark()

    def live_peak_after_mark(self) -> int:
        return max(self.phase_peaks().values(), default=0) + self._start if self._phases else _no_mark()


def _marker_bytes(index: int) -> int:
    """The size of the ``index``-th mark's allocation: odd, so that no tensor of 2-, 4- or 8-byte elements has it."""
    return _MARK_BYTES + 2 * index


def _check_new_phase(phases: list[str], phase: str) -> None:
    if phase in phases:
        raise ValueError(f"memory tracker: phase {phase!r} was already marked (phases: {phases})")


def _no_mark() -> int:
    raise RuntimeError("memory tracker: mark() was never called")


@contextlib.contextmanager
def track_peak(device: torch.device) -> Iterator[_CpuTracker | _CudaTracker]:
    """Track live tensor bytes allocated inside the block; ``peak_after_mark()`` once it has exited (bytes
    allocated inside the block), or ``live_peak_after_mark()`` (every live byte of the process; on CPU after
    ``count_every_thread()``)."""
    gc.collect()
    tracker = _CudaTracker() if device.type == "cuda" else _CpuTracker()
    with tracker:
        yield tracker


# --- the recipes ------------------------------------------------------------------------------------------


def _model(layers: int, width: int, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width, bias=True), torch.nn.Tanh()]
    return torch.nn.Sequential(*blocks).to(device=device, dtype=dtype)


def _micro_batches(count: int, width: int, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(4, width, generator=generator).to(device=device, dtype=dtype) for _ in range(count)]


def _loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().square().mean()


def _train(
    recipe: str, model: torch.nn.Module, data: list[torch.Tensor], tracker, bucket_bytes: int, backend: str
) -> None:
    """Two windows of ``recipe``. The second is measured in two phases: "micro-batches" (every forward and
    backward, with what each recipe does between them) and "window end" (the call that ends the window: the last
    ``step()`` of the gafused recipes, which folds or finishes the window and runs the inner step; the inner step,
    and the cast of ``main_grad`` before it, in the others)."""
    n = ACCUMULATION_STEPS
    inner = torch.optim.AdamW(model.parameters(), lr=1e-4)
    opt = None
    if recipe.startswith("gafused"):
        opt = gafused.GradAccumulator(inner, n, backend=backend, bucket_bytes=bucket_bytes)
    if recipe == "megatron":
        for param in model.parameters():
            param.main_grad = torch.zeros_like(param, dtype=torch.float32)
    for window in range(2):
        if window == 1:
            tracker.mark("micro-batches")
        for step, x in enumerate(data[window * n : (window + 1) * n]):
            loss = _loss(model, x)
            last = step == n - 1
            if recipe == "gafused-backward":
                opt.backward(loss, weight=1)
                if last and window == 1:
                    tracker.mark("window end")
                opt.step()
                opt.zero_grad()
            elif recipe == "gafused-step":
                loss.backward()
                if last and window == 1:
                    tracker.mark("window end")
                opt.step(weight=1)
                opt.zero_grad()
            else:
                (loss / n).backward()
                if recipe == "megatron":
                    for param in model.parameters():
                        param.main_grad += param.grad.float()
                        param.grad = None
            del loss
        if window == 1 and not recipe.startswith("gafused"):
            tracker.mark("window end")
        if recipe == "plain":
            inner.step()
            inner.zero_grad(set_to_none=True)
        elif recipe == "megatron":
            for param in model.parameters():
                param.grad = param.main_grad.to(param.dtype)
            inner.step()
            for param in model.parameters():
                param.grad = None
                param.main_grad.zero_()


def measure(
    recipe: str,
    dtype: torch.dtype,
    layers: int = 24,
    width: int = 1024,
    device: torch.device | str = "cpu",
    bucket_bytes: int = gafused.buffer.DEFAULT_BUCKET_BYTES,
    backend: str = "auto",
) -> dict:
    """Peak live bytes of ``recipe`` over its second window, and per parameter (``backend``: the gafused recipes')."""
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
    device = torch.device(device)
    with track_peak(device) as tracker:
        model = _model(layers, width, dtype, device)
        data = _micro_batches(2 * ACCUMULATION_STEPS, width, dtype, device)
        _train(recipe, model, data, tracker, bucket_bytes, backend)
        params = sum(p.numel() for p in model.parameters())
        del model, data
    phases = tracker.phase_peaks()
    peak = max(phases.values())
    return {
        "recipe": recipe,
        "param_dtype": str(dtype).removeprefix("torch."),
        "params": params,
        "peak_bytes": peak,
        "peak_bytes_per_param": peak / params,
        "micro_batches_peak_bytes": phases["micro-batches"],
        "window_end_peak_bytes": phases["window end"],
        "device": str(device),
        "backend": gafused.ops.resolve_backend(backend, device) if recipe.startswith("gafused") else "",
    }


def _note(recipe: str, dtype: torch.dtype, backend: str) -> str:
    if recipe == "plain" and dtype != torch.float32:
        return "accumulates in bf16"
    if recipe == "gafused-step":
        return f"buffer + a full set of grads at step() ({backend} backend)"
    if recipe == "gafused-backward":
        return f"buffer + about one bucket ({backend} backend)"
    return ""


def run(quick: bool, progress: Callable | None = None, device: torch.device | None = None) -> list[dict]:
    """Every recipe for fp32 and bf16 parameters: rows of recipe, param_dtype, peak_bytes_per_param, note.

    Args:
        quick: a smaller model (8 x Linear(512, 512), 1 MiB buckets) instead of ~100 MB of parameters.
        progress: optional ``progress(desc, total)`` returning an object with ``update()`` and ``close()``.
        device: where to measure (default: CUDA when available, else CPU).
    """
    layers, width = (8, 512) if quick else (24, 1024)
    bucket_bytes = 2**20 if quick else gafused.buffer.DEFAULT_BUCKET_BYTES
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cases = [
        (recipe, dtype)
        for dtype in (torch.float32, torch.bfloat16)
        for recipe in RECIPES
        if not (recipe == "megatron" and dtype == torch.float32)
    ]
    if device.type == "cuda":
        # A GPU peak is measured from what was allocated before the case began, so memory the process allocates
        # once and keeps (the first matmuls' library workspaces, one per thread: backward runs on another) would
        # count to the first case alone. Measured on an H200 before this warm-up, that case (plain, fp32) read
        # 65 MiB (2.7 bytes per parameter) above the case after it. The first case runs once unrecorded first.
        measure(*cases[0], layers, width, device, bucket_bytes)
    bar = progress("memory: peak bytes per parameter", len(cases)) if progress is not None else None
    rows = []
    for recipe, dtype in cases:
        row = measure(recipe, dtype, layers, width, device, bucket_bytes)
        row["note"] = _note(recipe, dtype, row["backend"])
        rows.append(row)
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model")
    args = parser.parse_args()
    rows = run(args.quick)
    print(f"{'recipe':<18} {'params':<9} {'peak MB':>9} {'bytes/param':>12}  note")
    for row in rows:
        print(
            f"{row['recipe']:<18} {row['param_dtype']:<9} {row['peak_bytes'] / 2**20:>9.1f} "
            f"{row['peak_bytes_per_param']:>12.2f}  {row['note']}"
        )


if __name__ == "__main__":
    main()
