"""Peak memory, measured exactly: folding during backward costs no more than the recipes it replaces.

The tracker counts every tensor allocation and free (torch.profiler's allocation events on CPU); it is first
checked against allocations of known sizes. The model is ~100 MB of fp32 parameters (24 x Linear(1024, 1024)).
The gafused recipes run ``backend="auto"``, what users get: the foreach backend on CPU.
"""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from gafused import FlatGradBuffer, foreach_backend, ops

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import memory  # noqa: E402 - bench/memory.py, on the path just above (the sdist ships bench/ too)

BUCKET = 32 * 2**20


def test_tracker_counts_known_allocations_exactly():
    with memory.track_peak(torch.device("cpu")) as tracker:
        kept = torch.empty(1000, dtype=torch.float32)  # 4000 bytes, alive before the mark
        tracker.mark()
        a = torch.empty(3000, dtype=torch.float64)  # 24000
        b = torch.empty(500, dtype=torch.uint8)  # 500: peak = 4000 + 24000 + 500
        del a, b
        c = torch.empty(2000, dtype=torch.float32)  # 8000: below the peak
        del c, kept
    assert tracker.peak_after_mark() == 4000 + 24000 + 500


def _peak(run) -> int:
    """Peak live bytes allocated while ``run()`` runs, beyond what was live before."""
    with memory.track_peak(torch.device("cpu")) as tracker:
        tracker.mark()
        run()
    return tracker.peak_after_mark()


@pytest.mark.parametrize("accum_dtype", [torch.float32, torch.float64], ids=["acc_fp32", "acc_fp64"])
def test_foreach_temporaries_stay_within_a_chunk(accum_dtype, monkeypatch):
    """Each foreach op that needs temporaries (conversions, products, float64 copies for norms) makes them at most
    CHUNK_BYTES (4 MiB on CPU) at a time, even for a segment four times that long, or one and a half, in a float32
    or float64 buffer (a chunk holds half as many float64 elements)."""
    chunk = foreach_backend.CHUNK_BYTES
    assert chunk == 4 * 2**20  # the budget the README and docs/design.md give
    per_chunk = chunk // torch.empty(0, dtype=accum_dtype).element_size()
    shapes = [(4 * per_chunk,), (5,), (3 * per_chunk // 2,), (3, 7)]
    buffer = FlatGradBuffer([torch.empty(shape) for shape in shapes], accum_dtype)
    grads = [torch.randn(shape).to(torch.bfloat16) for shape in buffer.shapes]
    out = torch.empty(buffer.numel, dtype=torch.bfloat16)
    ops.fold_(buffer, grads, 0.5, first=True, backend="foreach")
    checked = ops.check_grads(buffer, grads)
    weight, scale = torch.tensor(0.5), torch.tensor(0.25)
    peaks = {
        "fold": _peak(lambda: ops.fold_(buffer, checked, weight, first=False, backend="foreach", check=False)),
        "fold_finish": _peak(lambda: ops.fold_finish_(buffer, checked, weight, scale, first=False, backend="foreach")),
        "scale_into_out": _peak(lambda: ops.scale_(buffer, scale, out=out, backend="foreach")),
    }
    monkeypatch.setattr(foreach_backend, "_host_scalars", lambda device: False)  # the path a GPU takes
    peaks["device_fold"] = _peak(lambda: ops.fold_(buffer, checked, weight, first=False, backend="foreach"))
    monkeypatch.undo()
    # float64 gradients into a float32 buffer are added in float64 on CPU: wider temporaries, the same budget.
    wide = [grad.double() for grad in grads]
    peaks["fold_float64_grads"] = _peak(lambda: ops.fold_(buffer, wide, weight, first=False, backend="foreach"))
    slack = 2**16  # 0-d tensors, per-segment norms
    assert all(0 < value <= chunk + slack for value in peaks.values()), peaks


@pytest.mark.parametrize(
    ("accum_dtype", "grad_dtype"),
    [(torch.float32, torch.float32), (torch.float32, torch.float64), (torch.float32, torch.bfloat16)]
    + [(torch.float64, torch.float64), (torch.float64, torch.float32)],
    ids=["fp32_into_fp32", "fp64_into_fp32", "bf16_into_fp32", "fp64_into_fp64", "fp32_into_fp64"],
)
def test_foreach_small_runs_stay_within_a_chunk(accum_dtype, grad_dtype):
    """A CPU middle fold adds neighbouring small segments a run at a time (one cat of their gradients, one add_):
    the concatenation and what add_ converts stay within CHUNK_BYTES, float64 gradients into a float32 buffer
    included (added in float64: the buffer's run and the sum converted too)."""
    chunk = foreach_backend.CHUNK_BYTES
    small = foreach_backend.SMALL_SEGMENT_BYTES // torch.empty(0, dtype=accum_dtype).element_size()
    segments = 2 * chunk // (small * torch.empty(0, dtype=accum_dtype).element_size())  # a few runs' worth
    buffer = FlatGradBuffer([torch.empty(small) for _ in range(segments)], accum_dtype)
    grads = [torch.randn(small).to(grad_dtype) for _ in range(segments)]
    ops.fold_(buffer, grads, 0.5, first=True, backend="foreach")
    checked = ops.check_grads(buffer, grads)
    ops.fold_(buffer, checked, 0.5, first=False, backend="foreach", check=False)  # plans the runs
    views = foreach_backend._views_cache[buffer.data]
    assert views.small_runs is not None and len(views.small_runs.runs) > 1
    peak = _peak(lambda: ops.fold_(buffer, checked, 0.5, first=False, backend="foreach", check=False))
    assert 0 < peak <= chunk + 2**16, peak


def test_foreach_per_segment_squares_stay_within_a_chunk():
    """Per-segment norms of a float32 buffer copy to float64 a piece at a time; and a segment measured there (its
    length cached for that chunk) is still cut for a later fold of float64 gradients, which needs 16 bytes an
    element, not 8."""
    chunk = foreach_backend.CHUNK_BYTES
    buffer = FlatGradBuffer([torch.empty(chunk), torch.empty(chunk // 8), torch.empty(3, 7)])
    ops.fold_(buffer, [torch.randn(shape) for shape in buffer.shapes], 0.5, first=True, backend="foreach")
    wide = ops.check_grads(buffer, [torch.randn(shape, dtype=torch.float64) for shape in buffer.shapes])
    peaks = {
        "per_segment_squares": _peak(lambda: ops.sum_of_squares(buffer, per_segment=True, backend="foreach")),
        "fold_float64_grads": _peak(lambda: ops.fold_(buffer, wide, 0.5, first=False, backend="foreach")),
    }
    slack = 2**16
    assert all(0 < value <= chunk + slack for value in peaks.values()), peaks


def test_live_peak_counts_frees_made_by_other_threads():
    """A tensor whose last reference dies on a thread the profiler does not follow (as gloo's workers drop a
    collective's buffers) has no free event: peak_after_mark keeps it live, live_peak_after_mark does not. In a
    child process, since count_every_thread() changes the whole process for good."""
    script = textwrap.dedent(
        f"""
        import sys, threading, torch
        sys.path.insert(0, {str(Path(memory.__file__).parent)!r})
        import memory
        memory.count_every_thread()
        with memory.track_peak(torch.device("cpu")) as tracker:
            kept = torch.empty(1000)  # 4000 bytes, alive throughout
            tracker.mark()
            parcel = [torch.empty(3000, dtype=torch.float64)]  # 24000 bytes, freed by another thread
            thread = threading.Thread(target=parcel.clear)
            thread.start()
            thread.join()
            later = torch.empty(30000, dtype=torch.uint8)  # 30000 bytes: the peak is 4000 + 30000
            del later, kept
        print(tracker.peak_after_mark(), tracker.live_peak_after_mark())
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    events_peak, live_peak = map(int, done.stdout.split())
    assert events_peak == 4000 + 24000 + 30000  # the free on the other thread was never seen
    assert live_peak == 4000 + 30000


def test_live_peak_needs_count_every_thread():
    with memory.track_peak(torch.device("cpu")) as tracker:
        tracker.mark()
    with pytest.raises(RuntimeError, match="count_every_thread"):
        tracker.live_peak_after_mark()


def test_tracker_splits_the_measured_stretch_into_phases():
    with memory.track_peak(torch.device("cpu")) as tracker:
        kept = torch.empty(1000, dtype=torch.float32)  # 4000 bytes, alive throughout
        tracker.mark("first")
        a = torch.empty(3000, dtype=torch.float64)  # 24000: the first phase's peak is 28000
        del a
        tracker.mark("second")
        b = torch.empty(500, dtype=torch.uint8)  # alive into the third phase: 4500 at its start
        tracker.mark("third")
        c = torch.empty(2000, dtype=torch.float32)  # 8000: the third phase's peak is 12500
        del b, c, kept
        with pytest.raises(ValueError, match="'second' was already marked"):
            tracker.mark("second")
    assert tracker.phase_peaks() == {"first": 4000 + 24000, "second": 4000 + 500, "third": 4000 + 500 + 8000}
    assert tracker.peak_after_mark() == 28000


def test_tracker_marks_hold_when_the_collector_would_run_inside_them():
    """A collection inside mark() could free a tensor between the mark's allocation and its free."""
    import gc

    class Cycle:
        pass

    threshold = gc.get_threshold()
    with memory.track_peak(torch.device("cpu")) as tracker:
        tracker.mark("a")
        cycle = Cycle()
        cycle.self, cycle.tensor = cycle, torch.empty(1000, dtype=torch.uint8)
        del cycle
        gc.set_threshold(1)
        try:
            tracker.mark("b")
        finally:
            gc.set_threshold(*threshold)
        gc.collect()
    assert tracker.phase_peaks()["a"] == 1000


def test_tracker_takes_a_tensor_of_a_marks_size_for_a_tensor():
    """A mark is an allocation freed at once: a byte tensor of the next mark's size that lives on is counted."""
    with memory.track_peak(torch.device("cpu")) as tracker:
        tracker.mark("a")
        lookalike = torch.empty(memory._marker_bytes(1), dtype=torch.uint8)
        temporary = torch.empty(100_000, dtype=torch.uint8)
        del temporary
        tracker.mark("b")
        del lookalike
    assert tracker.phase_peaks() == {"a": memory._marker_bytes(1) + 100_000, "b": memory._marker_bytes(1)}


def test_gpu_tracker_splits_phases_from_the_allocator_statistics(monkeypatch):
    """The CUDA tracker's phases, on a stand-in for the caching allocator's statistics (no GPU here): each phase's
    peak is the allocator's peak since that phase's mark (reset there), over what was allocated at the start. Read
    inside the block, the open phase's peak is the one so far, and the phase stays open."""

    class Allocator:
        allocated, peak = 1000, 1000  # 1000 bytes allocated before the block

        def take(self, size):
            self.allocated += size
            self.peak = max(self.peak, self.allocated)

        def reset(self):
            self.peak = self.allocated

    allocator = Allocator()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: allocator.allocated)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: allocator.peak)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", allocator.reset)
    with memory.track_peak(torch.device("cuda")) as tracker:
        allocator.take(500)  # before the first mark: alive throughout, not a peak of its own
        allocator.take(-500)
        allocator.take(100)
        tracker.mark("first")
        allocator.take(50)
        assert tracker.phase_peaks() == {"first": 150}  # read inside the block: the open phase so far...
        allocator.take(2950)  # ...which goes on: the first phase's peak is 100 + 3000 over the start
        allocator.take(-3000)
        tracker.mark("second")
        allocator.take(200)  # the second phase's: 300
        with pytest.raises(ValueError, match="'first' was already marked"):
            tracker.mark("first")
    assert tracker.phase_peaks() == {"first": 3100, "second": 300}
    assert tracker.peak_after_mark() == 3100
    assert tracker.live_peak_after_mark() == 4100


# Bytes a recipe may hold beyond the one it is compared with where nothing more is expected: the 0-d tensors of
# the window (weight sum, norm, the micro-batch's weight and scale). Measured: 32 to 46 bytes.
SCALARS = 1024


@pytest.fixture(scope="module")
def peaks():
    rows = {}
    for recipe, dtype in [
        ("plain", torch.float32),
        ("gafused-backward", torch.float32),
        ("gafused-step", torch.float32),
        ("plain", torch.bfloat16),
        ("megatron", torch.bfloat16),
        ("gafused-backward", torch.bfloat16),
        ("gafused-step", torch.bfloat16),
    ]:
        rows[recipe, dtype] = memory.measure(recipe, dtype)
    return rows


def test_fold_during_backward_fp32_holds_one_bucket_beside_plain_pytorch_then_what_it_holds(peaks):
    """Each phase of the window on its own: during the micro-batches the buffer replaces plain PyTorch's
    gradients and at most one bucket of fresh gradients is alive beside it; at the window's end (finish, clip,
    inner step) nothing beyond a few scalars."""
    # What users get on CPU is the foreach backend: these bounds are its bounds.
    assert peaks["gafused-backward", torch.float32]["backend"] == ops.resolve_backend("auto", "cpu") == "foreach"
    plain = peaks["plain", torch.float32]
    ours = peaks["gafused-backward", torch.float32]
    assert plain["params"] * 4 > 95e6  # the model really is ~100 MB of parameters
    assert ours["micro_batches_peak_bytes"] <= plain["micro_batches_peak_bytes"] + BUCKET
    assert ours["window_end_peak_bytes"] <= plain["window_end_peak_bytes"] + SCALARS
    assert ours["peak_bytes"] <= plain["peak_bytes"] + BUCKET


def test_fold_at_step_fp32_holds_one_set_of_gradients_beside_the_buffer(peaks):
    plain = peaks["plain", torch.float32]
    ours = peaks["gafused-step", torch.float32]
    grads = 4 * plain["params"]
    assert ours["micro_batches_peak_bytes"] <= plain["micro_batches_peak_bytes"] + grads + SCALARS
    assert ours["window_end_peak_bytes"] <= plain["window_end_peak_bytes"] + grads + SCALARS


def test_fold_during_backward_bf16_holds_the_fp32_buffer_and_one_bucket_then_what_megatron_holds(peaks):
    """bf16 parameters: during the micro-batches, the fp32 buffer in place of plain PyTorch's bf16 gradients
    (2 bytes per parameter more) and at most one bucket beside it (the fresh gradients of the bucket being filled,
    and the fold's temporaries); at the window's end what Megatron-style fp32 ``main_grad`` accumulation holds
    (the fp32 sums and a bf16 copy for the inner step), a few scalars aside."""
    plain = peaks["plain", torch.bfloat16]
    megatron = peaks["megatron", torch.bfloat16]
    ours = peaks["gafused-backward", torch.bfloat16]
    widened = 2 * plain["params"]
    assert ours["micro_batches_peak_bytes"] <= plain["micro_batches_peak_bytes"] + widened + BUCKET
    assert ours["micro_batches_peak_bytes"] <= megatron["micro_batches_peak_bytes"]
    assert ours["window_end_peak_bytes"] <= megatron["window_end_peak_bytes"] + SCALARS


def test_fold_at_step_bf16_holds_what_megatron_holds(peaks):
    """The step-time loop holds a full set of bf16 gradients beside the fp32 buffer, as Megatron-style ``main_grad``
    does after each backward; it no longer holds the last micro-batch's gradients through the inner step."""
    megatron = peaks["megatron", torch.bfloat16]
    ours = peaks["gafused-step", torch.bfloat16]
    assert ours["micro_batches_peak_bytes"] <= megatron["micro_batches_peak_bytes"] + SCALARS
    assert ours["window_end_peak_bytes"] <= megatron["window_end_peak_bytes"] + SCALARS


@pytest.mark.parametrize("recipe", ["gafused-backward", "gafused-step"])
@pytest.mark.parametrize("layers, width", [(8, 512), (32, 64)], ids=["8x512", "32x64"])
def test_bf16_window_end_holds_what_megatron_holds_on_a_model_of_small_layers(recipe, layers, width):
    """``bench/memory.py --quick``'s model (8 x Linear(512, 512), 1 MiB buckets), and one of 4096-element layers,
    where no temporary of the inner step hides the finish's: the cast of the finished gradient into bf16 and the
    norm's float64 copies make no temporary bigger than what Megatron-style ``main_grad`` accumulation's window end
    holds (END_PIECE_BYTES aside, which the second model's layers are above)."""
    megatron = memory.measure("megatron", torch.bfloat16, layers=layers, width=width, bucket_bytes=2**20)
    ours = memory.measure(recipe, torch.bfloat16, layers=layers, width=width, bucket_bytes=2**20)
    assert ours["backend"] == "foreach"
    assert ours["window_end_peak_bytes"] <= megatron["window_end_peak_bytes"] + SCALARS
    assert ours["peak_bytes"] <= megatron["peak_bytes"] + SCALARS


@pytest.mark.parametrize("autocast", [True, False], ids=["bf16-autocast", "fp32"])
def test_end_to_end_recipes_hold_no_more_than_plain_accumulation_but_a_few_scalars(autocast):
    """bench/e2e.py's recipes on its tiny GPT, tracked exactly (the figures bench/e2e_memory.py prints): both gafused
    loops peak within a few 0-d tensors (the window's weight sum, grad_norm, the micro-batch's weight and scale) of
    plain PyTorch accumulation. On the 4 threads it runs on, this model's peak falls during backward (fp32: 3.15 MB,
    against 2.45 MB during the inner step), so the test holds the micro-batches' backward: nothing but a few scalars
    beside what plain PyTorch holds there. It does not bound the optimizer step on its own (a copy smaller than the
    backward's excess would pass); the 100 MB model's tests above hold that moment only through the overall peak. From
    16 threads on, CPU attention's backward scratch (per thread) makes both loops hold the buffer beside the
    micro-batch's gradients of this model's one bucket (fp32: 34,444 bytes over plain, as first seen on a 16-core GPU
    machine): the measurement runs on 4 threads, whatever the machine has."""
    import e2e_memory

    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        rows = {row["recipe"].split(":")[0]: row for row in e2e_memory.rows("quick", autocast=autocast)}
    finally:
        torch.set_num_threads(threads)
    assert rows["plain"]["peak_bytes"] > 1_000_000  # the model, AdamW's state and the gradients were all seen
    for recipe in ("gafused", "gafused backward"):
        assert rows[recipe]["over_plain_bytes"] <= 64, rows[recipe]


def test_a_mid_window_state_dict_holds_one_copy_of_the_buffer_in_either_memory_format():
    """The window is saved row-major: each channels_last segment is copied straight into the one saved tensor (a
    list of reshaped copies, then torch.cat, held the buffer twice)."""
    from gafused import GradAccumulator

    for memory_format in (torch.contiguous_format, torch.channels_last):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Conv2d(8, 8, 3, bias=False) for _ in range(4)])
        model = model.to(memory_format=memory_format)
        opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 4)
        opt.backward(model(torch.randn(1, 8, 12, 12).to(memory_format=memory_format)).square().mean())
        opt.step()
        opt.zero_grad()
        saved_bytes = sum(opt.buffers[0].numels) * 4
        with memory.track_peak(torch.device("cpu")) as tracker:
            tracker.mark()
            state = opt.state_dict()
            del state
        # The saved tensor, and a few bytes of Python-side bookkeeping tensors at most.
        assert saved_bytes <= tracker.peak_after_mark() < saved_bytes + 1024, (memory_format, tracker.peak_after_mark())


def test_each_row_peak_is_its_highest_phase_and_the_window_end_includes_the_inner_step(peaks):
    """The published peak is the higher of the two phases; the "window end" phase starts before the call that ends
    the window, so it holds that call's inner step: where gafused's step holds what the recipe it replaces holds
    (fold during backward against plain PyTorch for fp32, against Megatron-style main_grad for bf16, and fold at step
    for bf16), its window end is that recipe's within a few scalars, not below it."""
    for row in peaks.values():
        assert row["peak_bytes"] == max(row["micro_batches_peak_bytes"], row["window_end_peak_bytes"])
        assert row["peak_bytes_per_param"] == row["peak_bytes"] / row["params"]
    pairs = [
        (("gafused-backward", torch.float32), ("plain", torch.float32)),
        (("gafused-backward", torch.bfloat16), ("megatron", torch.bfloat16)),
        (("gafused-step", torch.bfloat16), ("megatron", torch.bfloat16)),
    ]
    for ours, theirs in pairs:
        difference = peaks[ours]["window_end_peak_bytes"] - peaks[theirs]["window_end_peak_bytes"]
        assert abs(difference) <= SCALARS, (ours, theirs, difference)
