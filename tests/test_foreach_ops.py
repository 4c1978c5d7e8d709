"""What the foreach backend promises beyond tests/test_triton_ops.py's comparisons: bitwise folds (the finishing fold's
values too) and scales on both of its paths (host weight on CPU, device weight elsewhere), exact non-finite flags
where float64 sums of squares overflow, gradient shapes that change between calls, and views that do not keep a
buffer alive."""

from __future__ import annotations

import gc
import math
import weakref

import pytest
import torch

from gafused import FlatGradBuffer, foreach_backend, ops, reference

SHAPES = [(3, 5), (0,), (1,), (2, 3, 4), (17,), (1, 97)]
GRAD_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}
ACCUM_DTYPES = {"acc_fp32": torch.float32, "acc_fp64": torch.float64}


def _buffers(accum_dtype, generator):
    params = [torch.empty(shape) for shape in SHAPES]
    first, second = FlatGradBuffer(params, accum_dtype), FlatGradBuffer(params, accum_dtype)
    start = torch.randn(first.numel, generator=generator, dtype=accum_dtype)
    first.data.copy_(start)
    second.data.copy_(start)
    return first, second


def _grads(buffer, dtype, generator, missing=()):
    return [
        None if index in missing else torch.randn(shape, generator=generator).to(dtype)
        for index, shape in enumerate(buffer.shapes)
    ]


# Temporaries are made CHUNK_BYTES at a time; 40 bytes cuts every segment longer than 5 or 10 elements in pieces.
CHUNKS = {"one_chunk": 1 << 24, "pieces": 40}


@pytest.mark.parametrize("chunk", CHUNKS.values(), ids=CHUNKS.keys())
@pytest.mark.parametrize("accum_dtype", ACCUM_DTYPES.values(), ids=ACCUM_DTYPES.keys())
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES.values(), ids=GRAD_DTYPES.keys())
def test_host_path_fold_is_bitwise_the_reference(grad_dtype, accum_dtype, chunk, monkeypatch):
    monkeypatch.setattr(foreach_backend, "CHUNK_BYTES", chunk)
    generator = torch.Generator().manual_seed(5)
    candidate, expected = _buffers(accum_dtype, generator)
    for step, weight in enumerate([0.75, torch.tensor(1.3), torch.tensor(0.1, dtype=torch.float64)]):
        grads = _grads(candidate, grad_dtype, generator, missing={step % len(SHAPES)})
        ops.fold_(candidate, grads, weight, first=step == 0, backend="foreach")
        ops.fold_(expected, grads, weight, first=step == 0, backend="reference")
        assert torch.equal(candidate.data, expected.data)


@pytest.mark.parametrize("chunk", CHUNKS.values(), ids=CHUNKS.keys())
@pytest.mark.parametrize("accum_dtype", ACCUM_DTYPES.values(), ids=ACCUM_DTYPES.keys())
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES.values(), ids=GRAD_DTYPES.keys())
def test_device_path_fold_is_bitwise_the_reference_device_path(grad_dtype, accum_dtype, chunk, monkeypatch):
    # The path a GPU takes (the weight stays a tensor), run on CPU by both backends: acc + (grad * weight).
    monkeypatch.setattr(foreach_backend, "_host_scalars", lambda device: False)
    monkeypatch.setattr(reference, "_host_scalars", lambda device: False)
    monkeypatch.setattr(foreach_backend, "DEVICE_CHUNK_BYTES", chunk)
    monkeypatch.setattr(foreach_backend, "CHUNK_BYTES", chunk)
    generator = torch.Generator().manual_seed(6)
    candidate, expected = _buffers(accum_dtype, generator)
    weight = torch.tensor(0.37, dtype=accum_dtype)
    grads = _grads(candidate, grad_dtype, generator, missing={2})
    ops.fold_(candidate, grads, weight, first=False, backend="foreach")
    ops.fold_(expected, grads, weight, first=False, backend="reference")
    assert torch.equal(candidate.data, expected.data)


@pytest.mark.parametrize("chunk", CHUNKS.values(), ids=CHUNKS.keys())
@pytest.mark.parametrize("accum_dtype", ACCUM_DTYPES.values(), ids=ACCUM_DTYPES.keys())
def test_device_path_fold_of_mixed_dtypes_and_layouts_is_bitwise_the_reference(accum_dtype, chunk, monkeypatch):
    # One call with gradients of every dtype, one transposed (not contiguous) and one missing: in each chunk the
    # gradients of another dtype than the buffer's are upcast into temporaries, one multi-tensor copy per source
    # dtype; those of the buffer's dtype are multiplied directly.
    monkeypatch.setattr(foreach_backend, "_host_scalars", lambda device: False)
    monkeypatch.setattr(reference, "_host_scalars", lambda device: False)
    monkeypatch.setattr(foreach_backend, "DEVICE_CHUNK_BYTES", chunk)
    monkeypatch.setattr(foreach_backend, "CHUNK_BYTES", chunk)  # (the device path on a CPU tensor budgets with it)
    copies = []
    real_copy = torch._foreach_copy_

    def copy(targets, sources):
        copies.append({source.dtype for source in sources})
        return real_copy(targets, sources)

    monkeypatch.setattr(torch, "_foreach_copy_", copy)
    generator = torch.Generator().manual_seed(16)
    candidate, expected = _buffers(accum_dtype, generator)
    dtypes = list(GRAD_DTYPES.values())
    grads = []
    for index, shape in enumerate(candidate.shapes):
        grad = torch.randn(shape, generator=generator).to(dtypes[index % len(dtypes)])
        grads.append(grad.t().contiguous().t() if grad.dim() == 2 else grad)
    grads[4] = None
    assert any(grad is not None and not grad.is_contiguous() for grad in grads)
    weight = torch.tensor(0.37, dtype=accum_dtype)
    for first in (True, False, False):
        copies.clear()
        ops.fold_(candidate, grads, weight, first=first, backend="foreach")
        ops.fold_(expected, grads, weight, first=first, backend="reference")
        assert torch.equal(candidate.data, expected.data)
        # One source dtype per multi-tensor copy (the first fold copies every gradient into its segment); a middle
        # fold copies only the other dtypes' (three here), into temporaries: more copies when cut in pieces.
        assert copies and all(len(dtypes) == 1 for dtypes in copies)
        if not first:
            assert all(accum_dtype not in dtypes for dtypes in copies)
            assert (len(copies) > 3) == (chunk == CHUNKS["pieces"])


@pytest.mark.parametrize("host", [True, False], ids=["host_path", "device_path"])
@pytest.mark.parametrize("accum_dtype", ACCUM_DTYPES.values(), ids=ACCUM_DTYPES.keys())
def test_fold_finish_values_are_bitwise_the_reference(accum_dtype, host, monkeypatch):
    # A scale that is no power of two, given as a Python number: rounded once, into the buffer's dtype.
    monkeypatch.setattr(foreach_backend, "_host_scalars", lambda device: host)
    monkeypatch.setattr(reference, "_host_scalars", lambda device: host)
    generator = torch.Generator().manual_seed(10)
    candidate, expected = _buffers(accum_dtype, generator)
    grads = _grads(candidate, torch.bfloat16, generator, missing={0})
    _, flag = ops.fold_finish_(candidate, grads, torch.tensor(0.7), 1 / 3, first=False, backend="foreach")
    _, expected_flag = ops.fold_finish_(expected, grads, torch.tensor(0.7), 1 / 3, first=False, backend="reference")
    assert torch.equal(candidate.data, expected.data)
    assert not flag and not expected_flag


@pytest.mark.parametrize("host", [True, False], ids=["host_path", "device_path"])
def test_float64_overflowing_sum_of_squares_is_not_a_nonfinite_value(host, monkeypatch):
    monkeypatch.setattr(foreach_backend, "_host_scalars", lambda device: host)
    params = [torch.empty(4, dtype=torch.float64), torch.empty(0, dtype=torch.float64)]
    candidate, expected = FlatGradBuffer(params, torch.float64), FlatGradBuffer(params, torch.float64)
    grads = [torch.full((4,), 1e200, dtype=torch.float64), None]  # finite, but its square overflows
    total, flag = ops.fold_finish_(candidate, grads, 1.0, 1.0, first=True, backend="foreach")
    expected_total, expected_flag = ops.fold_finish_(expected, grads, 1.0, 1.0, first=True, backend="reference")
    assert torch.isinf(total) and torch.isinf(expected_total)
    assert not flag and not expected_flag
    grads[0][2] = float("nan")
    _, flag = ops.fold_finish_(candidate, grads, 1.0, 1.0, first=True, backend="foreach")
    assert flag


@pytest.mark.parametrize("chunk", CHUNKS.values(), ids=CHUNKS.keys())
def test_sum_of_squares_against_float64(chunk, monkeypatch):
    monkeypatch.setattr(foreach_backend, "CHUNK_BYTES", chunk)
    generator = torch.Generator().manual_seed(7)
    buffer, _ = _buffers(torch.float32, generator)
    exact = [buffer.segment(i).double().square().sum() for i in range(len(buffer))]
    per_segment = ops.sum_of_squares(buffer, per_segment=True, backend="foreach")
    torch.testing.assert_close(per_segment.double(), torch.stack(exact), rtol=1e-7, atol=0)
    torch.testing.assert_close(ops.sum_of_squares(buffer, backend="foreach").double(), sum(exact), rtol=1e-7, atol=0)
    buffer.data[buffer.offsets[-1] + 50] = float("inf")  # in a segment cut in pieces
    total, flag = ops.fold_finish_(buffer, [None] * len(buffer), 0.0, 1.0, first=False, backend="foreach")
    assert torch.isinf(total) and flag


@pytest.mark.parametrize("chunk", CHUNKS.values(), ids=CHUNKS.keys())
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_scale_into_out_is_bitwise_the_reference(out_dtype, chunk, monkeypatch):
    monkeypatch.setattr(foreach_backend, "CHUNK_BYTES", chunk)
    candidate, _ = _buffers(torch.float32, torch.Generator().manual_seed(9))
    out, expected = (torch.full((candidate.numel,), 3.0, dtype=out_dtype) for _ in range(2))
    ops.scale_(candidate, torch.tensor(0.37), out=out, backend="foreach")
    ops.scale_(candidate, torch.tensor(0.37), out=expected, backend="reference")
    assert torch.equal(out, expected)


def test_gradient_shapes_may_change_between_calls():
    generator = torch.Generator().manual_seed(8)
    candidate, expected = _buffers(torch.float32, generator)
    shaped = _grads(candidate, torch.float32, generator)
    for grads in (shaped, [None if g is None else g.reshape(-1) for g in shaped], shaped):
        ops.fold_(candidate, grads, 0.5, first=False, backend="foreach")
        ops.fold_(expected, grads, 0.5, first=False, backend="reference")
        assert torch.equal(candidate.data, expected.data)


def test_cached_views_follow_a_buffer_whose_storage_was_replaced():
    """The backend keeps views of a buffer between calls: after ``data.set_()`` gives the buffer other memory (the same
    tensor object), the next fold must reach the new memory, not the old."""
    buffer = FlatGradBuffer([torch.zeros(3), torch.zeros(5)])
    grads = [torch.ones(3), torch.ones(5)]
    ops.fold_(buffer, grads, 1.0, first=True, backend="foreach")
    buffer.data.set_(torch.zeros(buffer.numel))
    ops.fold_(buffer, grads, 2.0, first=True, backend="foreach")
    assert torch.equal(buffer.view(0), torch.full((3,), 2.0)) and torch.equal(buffer.view(1), torch.full((5,), 2.0))


def test_cached_views_do_not_keep_a_buffer_alive():
    buffer = FlatGradBuffer([torch.empty(5), torch.empty(3)])
    ops.scale_(buffer, 0.5, backend="foreach")
    assert buffer.data in foreach_backend._views_cache
    alive = weakref.ref(buffer.data)
    del buffer
    gc.collect()
    assert alive() is None


def test_layout_outside_acc_is_rejected():
    with pytest.raises(ValueError, match="outside acc"):
        foreach_backend.sum_of_squares(torch.zeros(8), [4], [5], per_segment=False)


# Segments that follow one another with no padding (multiples of 16 fp32 elements, the 64-byte alignment) make runs:
# 1024 + 7 x 16 elements, then one of 17 (padding after it), then 5 x 16 more.
RUN_SHAPES = [(1024,)] + [(4, 4)] * 7 + [(17,)] + [(16,)] * 5


class _ForeachLists(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the tensor lists handed to ``torch._foreach_*`` ops, by op name."""

    def __init__(self) -> None:
        super().__init__()
        self.lists: dict[str, list[list[torch.Tensor]]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name.startswith("_foreach_"):
            self.lists.setdefault(name, []).append(list(args[0]))
        return func(*args, **(kwargs or {}))


def test_runs_cover_the_segments_exactly_and_break_at_padding():
    buffer = FlatGradBuffer([torch.empty(shape) for shape in RUN_SHAPES + [(0,), (3,), (0,)]])
    runs = foreach_backend._runs(buffer.offsets, buffer.numels, 1 << 30)
    covered = {i for start, numel in runs for i in range(start, start + numel)}
    segments = {
        i for start, numel in zip(buffer.offsets, buffer.numels, strict=True) for i in range(start, start + numel)
    }
    assert covered == segments and sum(numel for _, numel in runs) == len(segments)
    assert all(numel > 0 for _, numel in runs)
    # Maximal: padding between every two runs; the 17-element segment ends the first, and segments without elements
    # break nothing.
    assert all(start + numel < following for (start, numel), (following, _) in zip(runs, runs[1:], strict=False))
    assert [numel for _, numel in runs] == [1024 + 7 * 16 + 17, 5 * 16 + 3]
    assert foreach_backend._runs([], [], 8) == [] and foreach_backend._runs([0, 16], [0, 0], 8) == []
    # Cut at the cap: pieces in order, the last one shorter.
    assert foreach_backend._runs(buffer.offsets, buffer.numels, 1024) == [
        (runs[0][0], 1024), (runs[0][0] + 1024, 7 * 16 + 17), (runs[1][0], 83)
    ]  # fmt: skip


@pytest.mark.parametrize("chunk", CHUNKS.values(), ids=CHUNKS.keys())
@pytest.mark.parametrize("host", [True, False], ids=["host_path", "device_path"])
def test_ops_over_runs_are_bitwise_the_reference_and_leave_padding_alone(host, chunk, monkeypatch):
    """Scales and first folds take one view per run of segments; the padding between runs (poisoned here) is never
    read into a result or written."""
    monkeypatch.setattr(foreach_backend, "CHUNK_BYTES", chunk)
    monkeypatch.setattr(foreach_backend, "_host_scalars", lambda device: host)
    monkeypatch.setattr(reference, "_host_scalars", lambda device: host)
    generator = torch.Generator().manual_seed(11)
    params = [torch.empty(shape) for shape in RUN_SHAPES]
    candidate, expected = FlatGradBuffer(params), FlatGradBuffer(params)
    poison = torch.full((candidate.numel,), float("nan"))
    candidate.data.copy_(poison)
    expected.data.copy_(poison)
    for first, missing in ((True, {3}), (True, set()), (False, {0})):
        grads = _grads(candidate, torch.bfloat16, generator, missing)
        ops.fold_(candidate, grads, torch.tensor(0.7), first=first, backend="foreach")
        ops.fold_(expected, grads, torch.tensor(0.7), first=first, backend="reference")
        assert torch.equal(candidate.data.nan_to_num(7.0), expected.data.nan_to_num(7.0))
    grads = _grads(candidate, torch.float32, generator)
    total, flag = ops.fold_finish_(candidate, grads, 0.3, 1 / 3, first=False, backend="foreach")
    expected_total, _ = ops.fold_finish_(expected, grads, 0.3, 1 / 3, first=False, backend="reference")
    assert torch.equal(candidate.data.nan_to_num(7.0), expected.data.nan_to_num(7.0)) and not flag
    exact = sum(candidate.segment(i).double().square().sum() for i in range(len(candidate)))
    torch.testing.assert_close(total.double(), exact, rtol=1e-7, atol=0)
    torch.testing.assert_close(total, expected_total, rtol=1e-6, atol=0)
    for out_dtype in (None, torch.bfloat16):
        out = expected_out = None
        if out_dtype is not None:
            out, expected_out = (torch.full((candidate.numel,), 3.0, dtype=out_dtype) for _ in range(2))
        ops.scale_(candidate, torch.tensor(0.37), out=out, backend="foreach")
        ops.scale_(expected, torch.tensor(0.37), out=expected_out, backend="reference")
        assert torch.equal(candidate.data.nan_to_num(7.0), expected.data.nan_to_num(7.0))
        assert out is None or torch.equal(out, expected_out)
    padding = torch.ones(candidate.numel, dtype=torch.bool)
    for index in range(len(candidate)):
        padding[candidate.offsets[index] : candidate.offsets[index] + candidate.numels[index]] = False
    assert padding.any() and candidate.data[padding].isnan().all()


# Neighbouring small segments of mixed shapes: the middle fold on CPU adds runs of them (one dtype, one shape but the
# first dimension, no padding between) with one cat each; a large one and the 17-element one (padding after it) stop
# a run, as does a change of shape or of gradient dtype.
SMALL_RUN_SHAPES = [(16,)] * 3 + [(2, 8)] * 4 + [(4096,)] + [(16,)] * 2 + [(17,)] + [(4, 4)] * 2 + [(32,)] * 3


@pytest.mark.parametrize("chunk", CHUNKS.values(), ids=CHUNKS.keys())
@pytest.mark.parametrize("accum_dtype", ACCUM_DTYPES.values(), ids=ACCUM_DTYPES.keys())
def test_middle_fold_of_small_runs_is_bitwise_the_reference_and_leaves_padding_alone(accum_dtype, chunk, monkeypatch):
    monkeypatch.setattr(foreach_backend, "CHUNK_BYTES", chunk)
    generator = torch.Generator().manual_seed(13)
    params = [torch.empty(shape, dtype=accum_dtype) for shape in SMALL_RUN_SHAPES]
    candidate, expected = FlatGradBuffer(params, accum_dtype), FlatGradBuffer(params, accum_dtype)
    poison = torch.full((candidate.numel,), float("nan"), dtype=accum_dtype)
    candidate.data.copy_(poison)
    expected.data.copy_(poison)
    # Gradients of the parameters' dtype, then some of them in other dtypes (a run breaks there), then one missing.
    dtypes = [accum_dtype] * len(params)
    layouts = [(dtypes, set()), ([torch.bfloat16] * 9 + [torch.float64] * 3 + [accum_dtype] * 4, set())]
    layouts.append((dtypes, {1, 9}))
    runs_used = 0
    for step, (grad_dtypes, missing) in enumerate(layouts * 2):
        grads = [
            None if index in missing else torch.randn(shape, generator=generator).to(dtype)
            for index, (shape, dtype) in enumerate(zip(SMALL_RUN_SHAPES, grad_dtypes, strict=True))
        ]
        for weight in (0.37, torch.tensor(1.7)):
            checked = ops.check_grads(candidate, grads)
            ops.fold_(candidate, checked, weight, first=step == 0, backend="foreach", check=False)
            ops.fold_(expected, grads, weight, first=step == 0, backend="reference")
            assert torch.equal(candidate.data.nan_to_num(7.0), expected.data.nan_to_num(7.0))
            small = foreach_backend._small_runs(foreach_backend._views_cache[candidate.data], checked, candidate.data)
            runs_used += small is not None and step > 0
    padding = torch.ones(candidate.numel, dtype=torch.bool)
    for index in range(len(candidate)):
        padding[candidate.offsets[index] : candidate.offsets[index] + candidate.numels[index]] = False
    assert padding.any() and candidate.data[padding].isnan().all()
    assert runs_used > 0 or chunk == CHUNKS["pieces"]  # (40-byte chunks leave no room for a run of two)


def test_small_runs_follow_the_layout():
    """Runs of neighbouring small segments: broken by padding, a large segment, a missing gradient, a change of
    gradient dtype or of shape past the first dimension (not by a 1-D segment of another length, the 17 elements
    here, padded after); a run of one is added per segment."""
    params = [torch.empty(shape) for shape in SMALL_RUN_SHAPES]
    buffer = FlatGradBuffer(params)
    grads = [torch.zeros(shape) for shape in SMALL_RUN_SHAPES]
    grads[13] = grads[13].double()
    grads[4] = None
    checked = ops.check_grads(buffer, grads)
    ops.fold_(buffer, checked, 1.0, first=True, backend="foreach", check=False)
    ops.fold_(buffer, checked, 1.0, first=False, backend="foreach", check=False)
    small = foreach_backend._small_runs(foreach_backend._views_cache[buffer.data], checked, buffer.data)
    assert [(start, stop) for _, start, stop in small.runs] == [(0, 3), (5, 7), (8, 11), (11, 13), (14, 16)]
    assert small.rest == [3, 4, 7, 13]
    for target, start, stop in small.runs:
        assert target.data_ptr() == buffer.segment(start).data_ptr()
        assert target.numel() == sum(buffer.numels[start:stop])
    # A list without a recorded layout is added per segment.
    assert foreach_backend._small_runs(foreach_backend._views_cache[buffer.data], list(checked), buffer.data) is None


def _planned(buffer: FlatGradBuffer, grads: list[torch.Tensor | None]) -> tuple[object, ops.CheckedGrads]:
    """The small runs a CPU middle fold of ``grads`` plans (after a first fold), and the checked list it folded."""
    checked = ops.check_grads(buffer, grads)
    ops.fold_(buffer, checked, 1.0, first=True, backend="foreach", check=False)
    ops.fold_(buffer, checked, 1.0, first=False, backend="foreach", check=False)
    return foreach_backend._small_runs(foreach_backend._views_cache[buffer.data], checked, buffer.data), checked


@pytest.mark.parametrize("accum_dtype", ACCUM_DTYPES.values(), ids=ACCUM_DTYPES.keys())
def test_small_runs_take_segments_of_at_most_small_segment_bytes_and_plan_once(accum_dtype):
    """A segment of exactly SMALL_SEGMENT_BYTES in the buffer joins a run, one an alignment longer does not (in
    either buffer dtype); a later call with the same layout reuses the plan, one with another layout makes its own."""
    small = foreach_backend.SMALL_SEGMENT_BYTES // torch.empty(0, dtype=accum_dtype).element_size()
    step = 64 // torch.empty(0, dtype=accum_dtype).element_size()  # the default alignment: no padding after either
    shapes = [(small,)] * 2 + [(small + step,)] * 2 + [(small,)] * 2
    buffer = FlatGradBuffer([torch.empty(shape, dtype=accum_dtype) for shape in shapes], accum_dtype)
    grads = [torch.ones(shape, dtype=accum_dtype) for shape in shapes]
    small_runs, checked = _planned(buffer, grads)
    assert [(start, stop) for _, start, stop in small_runs.runs] == [(0, 2), (4, 6)]
    assert small_runs.rest == [2, 3]
    again = ops.check_grads(buffer, [torch.ones(shape, dtype=accum_dtype) for shape in shapes])
    assert again.shapes is checked.shapes
    ops.fold_(buffer, again, 1.0, first=False, backend="foreach", check=False)
    views = foreach_backend._views_cache[buffer.data]
    assert foreach_backend._small_runs(views, again, buffer.data) is small_runs  # planned once per layout
    other = ops.check_grads(buffer, [None, *grads[1:]])
    ops.fold_(buffer, other, 1.0, first=False, backend="foreach", check=False)
    replanned = foreach_backend._small_runs(views, other, buffer.data)
    assert [(start, stop) for _, start, stop in replanned.runs] == [(4, 6)]
    assert torch.equal(buffer.data[: buffer.numels[0]], torch.full((small,), 3.0, dtype=accum_dtype))


@pytest.mark.parametrize(
    ("grad_dtype", "bytes_per_element"),
    [(torch.float32, 4), (torch.bfloat16, 16), (torch.float16, 16), (torch.float64, 24)],
    ids=["fp32", "bf16", "fp16", "fp64"],
)
def test_small_runs_hold_at_most_a_chunk_of_temporaries(grad_dtype, bytes_per_element, monkeypatch):
    """A run's temporaries stay within CHUNK_BYTES: its concatenated gradients, and in another dtype what add_
    converts (float64 gradients into a float32 buffer are added in float64: the buffer's run and the sum converted
    too, 24 bytes an element with the concatenation). Runs fill the chunk: 4-element segments, 256-byte chunks."""
    monkeypatch.setattr(foreach_backend, "CHUNK_BYTES", 256)
    shapes = [(4,)] * 20
    buffer = FlatGradBuffer([torch.empty(shape) for shape in shapes], alignment_bytes=16)
    small_runs, _ = _planned(buffer, [torch.ones(shape, dtype=grad_dtype) for shape in shapes])
    per_run = 256 // bytes_per_element // 4
    expected = [(start, min(start + per_run, 20)) for start in range(0, 20, per_run)]
    assert [(start, stop) for _, start, stop in small_runs.runs] == expected


def test_a_0d_gradient_right_after_a_run_is_added_on_its_own():
    """A 0-d parameter straight after 1-D segments (no padding between): its gradient has no first dimension to
    concatenate along, so it stays out of the run before it."""
    shapes = [(16,), (16,), ()]
    params = [torch.empty(shape) for shape in shapes]
    candidate, expected = FlatGradBuffer(params), FlatGradBuffer(params)
    for step in range(3):
        grads = [torch.full(shape, 0.1 * (step + index + 1)) for index, shape in enumerate(shapes)]
        ops.fold_(candidate, ops.check_grads(candidate, grads), 0.37, first=step == 0, backend="foreach", check=False)
        ops.fold_(expected, grads, 0.37, first=step == 0, backend="reference")
        assert torch.equal(candidate.data, expected.data)
    small_runs, _ = _planned(candidate, [torch.ones(shape) for shape in shapes])
    assert [(start, stop) for _, start, stop in small_runs.runs] == [(0, 2)]
    assert small_runs.rest == [2]


def test_a_run_before_a_converted_long_segment_is_bitwise_the_reference(monkeypatch):
    """A long gradient of another dtype, cut into chunks, after a run of small segments and before another: the
    pieces are cut where that gradient now sits among the segments added one by one."""
    monkeypatch.setattr(foreach_backend, "CHUNK_BYTES", 4096)
    shapes = [(16,)] * 4 + [(3000,)] + [(16,)] * 3
    params = [torch.empty(shape) for shape in shapes]
    candidate, expected = FlatGradBuffer(params), FlatGradBuffer(params)
    generator = torch.Generator().manual_seed(5)
    dtypes = [torch.float32] * 4 + [torch.bfloat16] + [torch.float32] * 3
    for step in range(3):
        grads = [torch.randn(shape, generator=generator).to(dtype) for shape, dtype in zip(shapes, dtypes, strict=True)]
        checked = ops.check_grads(candidate, grads)
        ops.fold_(candidate, checked, 0.37, first=step == 0, backend="foreach", check=False)
        ops.fold_(expected, grads, 0.37, first=step == 0, backend="reference")
        assert torch.equal(candidate.data, expected.data)
    small_runs = foreach_backend._small_runs(foreach_backend._views_cache[candidate.data], checked, candidate.data)
    assert [(start, stop) for _, start, stop in small_runs.runs] == [(0, 4), (5, 8)]


def test_a_finishing_fold_scales_and_measures_runs_not_segments():
    """On CPU: the window scale is one multiply per run of segments, and the sum of squares the float64 norms of the
    runs in pieces of at most half the longest segment (a piece's float64 copy is no bigger than that segment)."""
    buffer = FlatGradBuffer([torch.empty(shape) for shape in RUN_SHAPES])
    grads = [torch.ones(shape) for shape in RUN_SHAPES]
    layout = (buffer.data, grads, buffer.offsets, buffer.numels)
    foreach_backend.fold_(*layout, torch.tensor(1.0), True)
    with _ForeachLists() as seen:  # (the backend itself: a mode sees a gafused custom op as one call)
        total, _ = foreach_backend.fold_finish_(*layout, torch.tensor(1.0), torch.tensor(0.5), False)
    assert total.item() == sum(buffer.numels)  # every element 1.0 after the scale
    (scaled,) = seen.lists["_foreach_mul_"]
    assert [tensor.numel() for tensor in scaled] == [1024 + 7 * 16 + 17, 5 * 16]
    (normed,) = seen.lists["_foreach_norm"]
    assert [tensor.numel() for tensor in normed] == [512, 512, 7 * 16 + 17, 5 * 16]
    assert max(tensor.numel() for tensor in normed) * 8 <= max(buffer.numels) * buffer.data.element_size()
    with _ForeachLists() as seen:
        foreach_backend.fold_(*layout, torch.tensor(2.0), True)
    assert [len(tensors) for tensors in seen.lists["_foreach_mul_"]] == [2]


def test_scale_into_out_makes_no_product_longer_than_the_longest_segment():
    """On CPU the products cast into ``out`` are the runs in pieces of at most the longest segment (what a cast per
    segment makes), however long the runs, and they are the reference's bits."""
    buffer = FlatGradBuffer([torch.empty(shape) for shape in RUN_SHAPES])
    buffer.data.copy_(torch.randn(buffer.numel, generator=torch.Generator().manual_seed(3)))
    out, expected = (torch.zeros(buffer.numel, dtype=torch.bfloat16) for _ in range(2))
    with _ForeachLists() as seen:
        foreach_backend.scale_(buffer.data, buffer.offsets, buffer.numels, torch.tensor(0.37), out)
    products = [tensor for tensors in seen.lists["_foreach_mul"] for tensor in tensors]
    assert [tensor.numel() for tensor in products] == [1024, 7 * 16 + 17, 5 * 16]
    ops.scale_(buffer, torch.tensor(0.37), out=expected, backend="reference")
    assert torch.equal(out, expected)


def test_a_window_end_over_small_segments_takes_pieces_of_end_piece_bytes_and_casts_a_scale_of_one_whole():
    """Segments smaller than END_PIECE_BYTES are not cast or measured one call each: pieces of that many bytes (the
    products in the buffer's dtype, the norms' float64 copies); a scale of 1 (an unclipped window) is one cast of
    each run, with no product. Both are the reference's bits."""
    shapes = [(4, 4)] * 200  # 16 elements each, no padding between them: one run of 3200
    buffer = FlatGradBuffer([torch.empty(shape) for shape in shapes])
    buffer.data.copy_(torch.randn(buffer.numel, generator=torch.Generator().manual_seed(5)))
    layout = (buffer.data, buffer.offsets, buffer.numels)
    floor = foreach_backend.END_PIECE_BYTES
    for coef, cut in ((0.37, floor // 4), (1.0, None)):
        out, expected = (torch.zeros(buffer.numel, dtype=torch.bfloat16) for _ in range(2))
        with _ForeachLists() as seen:
            foreach_backend.scale_(*layout, torch.tensor(coef), out)
        products = [tensor.numel() for tensors in seen.lists.get("_foreach_mul", []) for tensor in tensors]
        if cut is None:
            assert products == [] and [len(tensors) for tensors in seen.lists["_foreach_copy_"]] == [1]
        else:
            assert products == [cut] * (3200 // cut) + ([3200 % cut] if 3200 % cut else [])
        ops.scale_(buffer, torch.tensor(coef), out=expected, backend="reference")
        assert torch.equal(out, expected)
    with _ForeachLists() as seen:
        total = foreach_backend.sum_of_squares(*layout, per_segment=False)
    cut = floor // 8
    assert [tensor.numel() for tensor in seen.lists["_foreach_norm"][0]] == [cut] * (3200 // cut) + (
        [3200 % cut] if 3200 % cut else []
    )
    torch.testing.assert_close(total.double(), buffer.data.double().square().sum(), rtol=1e-7, atol=0)


def test_runs_are_cut_at_the_longer_of_run_elements_and_the_longest_segment(monkeypatch):
    """No tensor an op gets from the runs is longer than both RUN_ELEMENTS and the longest segment."""
    monkeypatch.setattr(foreach_backend, "RUN_ELEMENTS", 64)
    buffer = FlatGradBuffer([torch.empty(shape) for shape in RUN_SHAPES])
    grads = [torch.ones(shape) for shape in RUN_SHAPES]
    layout = (buffer.data, grads, buffer.offsets, buffer.numels)
    foreach_backend.fold_(*layout, torch.tensor(1.0), True)
    with _ForeachLists() as seen:
        total, _ = foreach_backend.fold_finish_(*layout, torch.tensor(1.0), torch.tensor(0.5), False)
    assert total.item() == sum(buffer.numels)
    (scaled,) = seen.lists["_foreach_mul_"]
    assert [tensor.numel() for tensor in scaled] == [1024, 7 * 16 + 17, 5 * 16]


def test_cached_views_follow_a_new_layout_of_the_same_tensor():
    """The views are kept per tensor: a call with other offsets, or other element counts, on the same tensor must
    measure the new segments, not the cached ones."""
    acc = torch.arange(1.0, 9.0)
    squares = [value**2 for value in range(1, 9)]
    assert foreach_backend.sum_of_squares(acc, [0], [4], per_segment=False).item() == sum(squares[:4])
    assert foreach_backend.sum_of_squares(acc, [4], [4], per_segment=False).item() == sum(squares[4:])  # offsets
    assert foreach_backend.sum_of_squares(acc, [4], [2], per_segment=False).item() == sum(squares[4:6])  # numels
    foreach_backend.scale_(acc, [0, 4], [2, 2], torch.tensor(2.0), None)
    assert acc.tolist() == [2.0, 4.0, 3.0, 4.0, 10.0, 12.0, 7.0, 8.0]


@pytest.mark.parametrize("accum_dtype", ACCUM_DTYPES.values(), ids=ACCUM_DTYPES.keys())
def test_per_segment_squares_in_pieces_keep_every_segment(accum_dtype, monkeypatch):
    """Per-segment sums of squares of a float32 buffer cut long segments in pieces (5 elements here) and sum them
    back: one value per segment, the short ones after the last long one included, each of float64 norms."""
    monkeypatch.setattr(foreach_backend, "CHUNK_BYTES", 40)
    shapes = [(3,), (17,), (2,), (1, 100), (4,), (0,), (3,)]  # the last long segment is not the last
    buffer = FlatGradBuffer([torch.empty(shape) for shape in shapes], accum_dtype)
    buffer.data.copy_(torch.randn(buffer.numel, generator=torch.Generator().manual_seed(12), dtype=accum_dtype))
    # Pieces of [1, s, s, s, s]: float32 norms lose every s**2 to 1 (20.0); float64 ones do not (20.0000032).
    buffer.segment(3).copy_(torch.tensor([1.0, 2e-4, 2e-4, 2e-4, 2e-4] * 20))
    exact = torch.stack([buffer.segment(i).double().square().sum() for i in range(len(buffer))])
    per_segment = ops.sum_of_squares(buffer, per_segment=True, backend="foreach")
    assert per_segment.shape == (len(buffer),)
    torch.testing.assert_close(per_segment.double(), exact, rtol=1e-7, atol=0)


@pytest.mark.parametrize("per_segment", [False, True], ids=["total", "per_segment"])
def test_large_pieces_are_measured_through_one_float64_scratch_with_the_same_bits(per_segment, monkeypatch):
    """On CPU a piece of at least SCRATCH_ELEMENTS is copied into one float64 scratch, piece after piece, the smaller
    ones normed in one foreach call: every piece keeps its own float64 norm, in order (the bits of float64 norms
    that convert their input themselves), and each segment its own sum."""
    monkeypatch.setattr(foreach_backend, "CHUNK_BYTES", 40)  # per-segment pieces of 5 elements
    monkeypatch.setattr(foreach_backend, "SCRATCH_ELEMENTS", 5)
    shapes = [(3,), (17,), (2,), (1, 100), (4,), (9,), (3,)]  # runs and segments both above and below 5 elements
    buffer = FlatGradBuffer([torch.empty(shape) for shape in shapes])
    buffer.data.copy_(torch.randn(buffer.numel, generator=torch.Generator().manual_seed(21)))
    # Pieces of [1, s, s, s, s]: float32 norms lose every s**2 to 1 (20.0); float64 ones do not (20.0000032).
    buffer.segment(3).copy_(torch.tensor([1.0, 2e-4, 2e-4, 2e-4, 2e-4] * 20))
    layout = (buffer.data, buffer.offsets, buffer.numels)
    views = foreach_backend._views(*layout)
    if per_segment:
        long = views.longer_than(5)
        pieces, _ = foreach_backend._cut(views.flat, views.flat, long, 5)
    else:
        pieces = views.run_pieces(foreach_backend._end_piece_elements(views, buffer.data, 8))
    assert {piece.numel() >= 5 for piece in pieces} == {True, False}
    norms = torch.stack(torch._foreach_norm(pieces, 2, dtype=torch.float64))
    with _ForeachLists() as seen:
        squares = foreach_backend.sum_of_squares(*layout, per_segment=per_segment)
    assert [tensor.numel() for tensor in seen.lists["_foreach_norm"][0]] == [p.numel() for p in pieces if p.numel() < 5]
    exact = torch.stack([buffer.segment(i).double().square().sum() for i in range(len(buffer))])
    if per_segment:
        torch.testing.assert_close(squares.double(), exact, rtol=1e-7, atol=0)
    else:
        assert torch.equal(squares, norms.square().sum().to(torch.float32))
        torch.testing.assert_close(squares.double(), exact.sum(), rtol=1e-7, atol=0)


def test_cpu_float64_norms_of_pieces_in_any_order_are_each_pieces_own_norm():
    """Pieces below, at and above SCRATCH_ELEMENTS, empty ones, a first large piece shorter than a later one and
    shorter large pieces after longer ones (the scratch must fit the longest and each norm see only its piece), inf
    and nan in a large piece: each norm is, bit for bit and in order, the float64 norm of its piece alone."""
    scratch = foreach_backend.SCRATCH_ELEMENTS
    sizes = [scratch - 1, scratch, 0, 5, 3 * scratch, scratch + 1, 1, 0, scratch, 2 * scratch + 5, 4]
    flat = torch.randn(sum(sizes), generator=torch.Generator().manual_seed(22))
    pieces = list(flat.split(sizes))
    # [1, s, s, s, s]: a float32 norm loses every s**2 to 1, a float64 one does not.
    pieces[3].copy_(torch.tensor([1.0, 2e-4, 2e-4, 2e-4, 2e-4]))
    pieces[9][100], pieces[9][-1] = math.inf, math.nan
    pieces[8][7] = -math.inf
    norms = foreach_backend._cpu_float64_norms(pieces)
    expected = [torch.linalg.vector_norm(piece.double()) for piece in pieces]
    assert len(norms) == len(expected)
    for norm, exact in zip(norms, expected, strict=True):
        torch.testing.assert_close(norm, exact, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("per_segment", [False, True], ids=["total", "per_segment"])
def test_sums_of_squares_of_large_pieces_at_the_real_threshold_are_the_pieces_own(per_segment):
    """With the real SCRATCH_ELEMENTS and chunk sizes: segments (per segment) or run pieces (total) of 16383 to
    6 * 16384 elements, a large one after a longer one, the first large one not the longest, a small segment whose
    float32 norm would round: the same bits as norming each piece alone in float64."""
    scratch = foreach_backend.SCRATCH_ELEMENTS
    shapes = [(scratch,), (6 * scratch,), (5,), (scratch + 1,), (scratch - 1,)]
    buffer = FlatGradBuffer([torch.empty(shape) for shape in shapes])
    buffer.data.copy_(torch.randn(buffer.numel, generator=torch.Generator().manual_seed(23)))
    buffer.segment(2).copy_(torch.tensor([1.0, 2e-4, 2e-4, 2e-4, 2e-4]))
    layout = (buffer.data, buffer.offsets, buffer.numels)
    views = foreach_backend._views(*layout)
    if per_segment:
        pieces = views.flat
    else:
        pieces = views.run_pieces(foreach_backend._end_piece_elements(views, buffer.data, 8))
    sizes = [piece.numel() for piece in pieces]
    large = [size for size in sizes if size >= scratch]
    # A small piece, and a large piece after a longer one (per segment, the first large one is not the longest).
    assert min(sizes) < scratch and large[-1] < max(large)
    assert large[0] < max(large) or not per_segment
    squares = torch.stack([torch.linalg.vector_norm(piece.double()) for piece in pieces]).square()
    expected = squares if per_segment else squares.sum()
    assert torch.equal(foreach_backend.sum_of_squares(*layout, per_segment=per_segment), expected.to(torch.float32))
