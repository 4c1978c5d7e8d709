"""The reference backend against float64 first principles, and the layout it works on."""

from fractions import Fraction

import numpy as np
import pytest
import torch

from gafused import FlatGradBuffer, ops, reference

from casekit import own_scalar_case

SHAPES = {
    "mixed": [(5,), (3, 7), (0,), (1,), (2, 3, 4), (17,)],
    "one-element": [(1,)],
    "empty-and-one": [(0,), (1,), (0,)],
    "odd": [(131,), (1, 97), (13, 13)],
}
GRAD_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def _buffer(shapes, accum_dtype=torch.float32, alignment_bytes=64):
    params = [torch.empty(shape) for shape in shapes]
    return FlatGradBuffer(params, accum_dtype=accum_dtype, alignment_bytes=alignment_bytes)


def _grads(buffer, dtype, generator, missing=()):
    return [
        None if i in missing else torch.randn(shape, generator=generator).to(dtype)
        for i, shape in enumerate(buffer.shapes)
    ]


def _poison_padding(buffer):
    """Fill every element outside segments with a sentinel so tests can see it is never touched."""
    inside = torch.zeros(buffer.numel, dtype=torch.bool)
    for start, numel in zip(buffer.offsets, buffer.numels, strict=True):
        inside[start : start + numel] = True
    buffer.data[~inside] = 12345.0
    return ~inside


# Both of the reference's paths run on CPU: the one it takes there (the weight read as a Python number) and the one
# it takes on other devices (the weight kept a 0-d tensor), chosen by ``_host_scalars``.
PATHS = {"host_path": True, "device_path": False}


def _unit_roundoff(dtype):
    return torch.finfo(dtype).eps / 2


@pytest.mark.parametrize("path", PATHS.values(), ids=PATHS.keys())
@pytest.mark.parametrize("shapes", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("accum_dtype", [torch.float32, torch.float64], ids=str)
def test_window_matches_float64(shapes, grad_dtype, accum_dtype, path, monkeypatch):
    monkeypatch.setattr(reference, "_host_scalars", lambda device: path)
    generator = torch.Generator().manual_seed(1)
    buffer = _buffer(shapes, accum_dtype)
    padding = _poison_padding(buffer)
    # Weights inexact in every float dtype: a weight or product rounded to the gradient's dtype shows.
    weights = [0.3, torch.tensor(1.7, dtype=torch.float64), 0.45]
    windows = [_grads(buffer, grad_dtype, generator, missing={0} if k == 1 else ()) for k in range(3)]
    expected = [torch.zeros(shape, dtype=torch.float64) for shape in shapes]
    magnitude = [torch.zeros(shape, dtype=torch.float64) for shape in shapes]  # sum of |w g|
    for grads, weight in zip(windows, weights, strict=True):
        for i, grad in enumerate(grads):
            if grad is not None:
                expected[i] += float(weight) * grad.double()
                magnitude[i] += float(weight) * grad.double().abs()
    scale = 1.0 / sum(float(w) for w in weights)
    expected = [e * scale for e in expected]

    ops.fold_(buffer, windows[0], weights[0], first=True, backend="reference")
    ops.fold_(buffer, windows[1], weights[1], first=False, backend="reference")
    sumsq, nonfinite = ops.fold_finish_(buffer, windows[2], weights[2], scale, first=False, backend="reference")

    # At most six roundings in the buffer's dtype (the weight, a gradient of another dtype, three products or sums,
    # the scale), each within u of a partial sum no larger than the sum of |w g|: the error is within 6u of it.
    bound = 6 * _unit_roundoff(accum_dtype)
    for i, (e, m) in enumerate(zip(expected, magnitude, strict=True)):
        error = (buffer.view(i).double() - e).abs()
        assert bool((error <= bound * m * scale).all()), float((error / (m * scale)).max())
    assert sumsq.dtype == accum_dtype and sumsq.dim() == 0
    # The sum of squares of the values written, a dot product per segment then a sum of those, in any order: within
    # n*u/(1 - n*u) of the exact sum, u the unit roundoff, n = longest segment + number of segments (Higham,
    # "Accuracy and Stability of Numerical Algorithms", 3.1: a dot product of length m is within m*u/(1 - m*u)).
    written = torch.cat([buffer.segment(i) for i in range(len(shapes))]).tolist()
    exact = sum(Fraction(value) ** 2 for value in written)
    bound = (max(buffer.numels) + len(shapes)) * _unit_roundoff(accum_dtype)
    assert abs(Fraction(float(sumsq)) - exact) <= Fraction(bound / (1 - bound)) * exact
    assert nonfinite.dtype == torch.bool and not bool(nonfinite)
    assert torch.all(buffer.data[padding] == 12345.0)


@pytest.mark.parametrize("grad_dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_first_fold_overwrites_and_zeroes_missing(grad_dtype):
    generator = torch.Generator().manual_seed(2)
    buffer = _buffer(SHAPES["mixed"])
    buffer.data.normal_(generator=generator)  # stale values from an earlier window
    grads = _grads(buffer, grad_dtype, generator, missing={1})
    ops.fold_(buffer, grads, 0.3, first=True, backend="reference")
    for i, grad in enumerate(grads):
        if grad is None:
            assert torch.equal(buffer.view(i), torch.zeros(buffer.shapes[i]))
            continue
        # The gradient's upcast to float32 is exact; the weight's rounding and the product's are within u each.
        expected = 0.3 * grad.double()
        rtol = 2 * _unit_roundoff(torch.float32) + _unit_roundoff(torch.float32) ** 2
        torch.testing.assert_close(buffer.view(i).double(), expected, rtol=rtol, atol=0)


@pytest.mark.parametrize("position", ["first", "middle", "last"])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
def test_finish_flags_nonfinite(position, value):
    generator = torch.Generator().manual_seed(3)
    buffer = _buffer([(9,), (4, 5), (3,)])
    grads = _grads(buffer, torch.float32, generator)
    index = {"first": 0, "middle": 10, "last": 19}[position]
    grads[1].view(-1)[index] = value
    ops.fold_(buffer, _grads(buffer, torch.float32, generator), 1.0, first=True, backend="reference")
    _, nonfinite = ops.fold_finish_(buffer, grads, 1.0, 0.5, first=False, backend="reference")
    assert bool(nonfinite)
    finished = buffer.view(1).view(-1)[index]
    assert torch.isnan(finished) if value != value else torch.isinf(finished)


def test_finish_scales_segments_without_grad():
    generator = torch.Generator().manual_seed(4)
    buffer = _buffer([(6,), (5,)])
    first = _grads(buffer, torch.float32, generator)
    ops.fold_(buffer, first, 1.0, first=True, backend="reference")
    ops.fold_finish_(buffer, [None, None], 1.0, 0.25, first=False, backend="reference")
    for i, grad in enumerate(first):
        torch.testing.assert_close(buffer.view(i), grad * 0.25)


@pytest.mark.parametrize("shapes", SHAPES.values(), ids=SHAPES.keys())
def test_sum_of_squares_matches_float64_and_repeats_bitwise(shapes):
    generator = torch.Generator().manual_seed(5)
    buffer = _buffer(shapes)
    _poison_padding(buffer)
    ops.fold_(buffer, _grads(buffer, torch.float32, generator), 1.0, first=True, backend="reference")
    per_segment = ops.sum_of_squares(buffer, per_segment=True, backend="reference")
    expected = torch.tensor(
        [float(buffer.view(i).double().square().sum()) for i in range(len(buffer))], dtype=torch.float64
    )
    torch.testing.assert_close(per_segment.double(), expected, rtol=1e-6, atol=1e-6)
    total = ops.sum_of_squares(buffer, backend="reference")
    assert float(total) == pytest.approx(float(expected.sum()), rel=1e-6)
    for _ in range(3):
        assert torch.equal(ops.sum_of_squares(buffer, backend="reference"), total)
    torch.testing.assert_close(ops.norm(buffer, backend="reference"), total.sqrt())


def test_sum_of_squares_of_a_long_segment_is_one_rounding_from_exact(monkeypatch):
    """The oracle's sums of squares must beat the kernels it checks: on a 10M-element float32 segment a float32
    accumulation (torch.dot) drifts by ~4e-6; adding in float64 leaves only the final rounding (2**-24). The piece
    size is lowered so the segment spans several pieces."""
    values = torch.rand(10_000_000, generator=torch.Generator().manual_seed(3)) + 0.5
    exact = float(np.sum(np.square(values.numpy().astype(np.float64))))  # pairwise in float64
    for piece in (reference._SQUARES_PIECE, 3_000_001):
        monkeypatch.setattr(reference, "_SQUARES_PIECE", piece)
        total = reference.sum_of_squares(values, [0], [values.numel()], per_segment=False)
        per_segment = reference.sum_of_squares(values, [0], [values.numel()], per_segment=True)
        assert total.dtype == torch.float32
        assert float(total) == pytest.approx(exact, rel=2**-24)
        assert float(per_segment[0]) == pytest.approx(exact, rel=2**-24)


@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_scale_in_place_or_cast(out_dtype):
    generator = torch.Generator().manual_seed(6)
    buffer = _buffer(SHAPES["mixed"])
    padding = _poison_padding(buffer)
    ops.fold_(buffer, _grads(buffer, torch.float32, generator), 1.0, first=True, backend="reference")
    before = buffer.data.clone()
    coef = torch.tensor(0.3)  # inexact in every dtype: a coefficient rounded anywhere else shows
    # The float64 product of two float32 values is exact: rounded once to float32 it is the correctly rounded
    # float32 product, then rounded once more to the output's dtype.
    expected = (before.double() * float(coef)).float()
    if out_dtype is None:
        ops.scale_(buffer, coef, backend="reference")
        assert torch.equal(buffer.data[~padding], expected[~padding])
    else:
        out = torch.full((buffer.numel,), -7.0, dtype=out_dtype)
        ops.scale_(buffer, coef, out=out, backend="reference")
        assert torch.equal(buffer.data, before)
        for i in range(len(buffer)):
            assert torch.equal(buffer.view(i, out), buffer.view(i, expected).to(out_dtype))
        assert torch.all(out[padding] == -7.0)
    assert torch.all(buffer.data[padding] == 12345.0)


def test_layout_alignment_offsets_and_views():
    buffer = _buffer([(3,), (0,), (5, 2), (1,)], alignment_bytes=16)
    assert buffer.offsets == [0, 4, 4, 16]
    assert buffer.numel == 20
    assert all(isinstance(offset, int) for offset in buffer.offsets)
    assert buffer.offsets_tensor.dtype == torch.int64
    assert buffer.offsets_tensor.tolist() == buffer.offsets and buffer.offsets_tensor is buffer.offsets_tensor
    assert buffer.numels_tensor.dtype == torch.int64 and buffer.numels_tensor.tolist() == [3, 0, 10, 1]
    assert buffer.numels_tensor is buffer.numels_tensor  # made once
    assert repr(buffer) == (
        "FlatGradBuffer(segments=4, numel=20, accum_dtype=torch.float32, device=cpu, alignment_bytes=16)"
    )
    view = buffer.view(2)
    view.fill_(2.0)
    assert view.shape == (5, 2) and view.data_ptr() == buffer.data.data_ptr() + 4 * 4
    assert torch.all(buffer.segment(2) == 2.0)
    wide = _buffer([(3,), (5,)], accum_dtype=torch.float64, alignment_bytes=64)
    assert wide.offsets == [0, 8]


def test_buckets_are_views_of_the_buffer_with_their_own_indices():
    """A bucket is a buffer of its own over a slice of the parent's memory: its segments, views and permuted (memory
    order other than row-major) segments are counted from the bucket's first segment, and its views are the
    parent's views of the same segments (the slice's storage offset included)."""
    params = [
        torch.empty(2, 3, 2, 2).contiguous(memory_format=torch.channels_last),  # permuted
        torch.empty(4, 4),
        torch.empty(3, 2, 1, 2).contiguous(memory_format=torch.channels_last),  # permuted
        torch.empty(5),
    ]
    buffer = FlatGradBuffer(params, bucket_bytes=64)
    assert len(buffer.buckets) > 2 and buffer.permuted == {0, 2}
    for bucket, indices in zip(buffer.buckets, buffer.bucket_ranges, strict=True):
        assert bucket.permuted == {index - indices.start for index in buffer.permuted if index in indices}
        views = bucket.views()
        for local, index in enumerate(indices):
            parent = buffer.view(index)
            for view in (bucket.view(local), views[local]):
                assert view.data_ptr() == parent.data_ptr() and view.stride() == parent.stride()
        # The bucket's memory runs to the next bucket's first segment: its trailing alignment padding is its own.
        end = buffer.offsets[indices.stop] if indices.stop < len(buffer) else buffer.numel
        assert bucket.numel == end - buffer.offsets[indices.start] and bucket.data.numel() == bucket.numel
        # A bucket is one bucket: itself (made per call, not kept).
        assert len(bucket.buckets) == 1 and bucket.buckets[0] is bucket and bucket.bucket_ranges == [range(len(bucket))]


def test_views_refuse_a_strided_source():
    """``view(i, data)`` and ``views(data)`` read ``data`` as the buffer's flat layout: a strided tensor with the
    right number of elements is not one (its elements would be read from the wrong places)."""
    buffer = FlatGradBuffer([torch.empty(3), torch.empty(2, 2)])
    strided = torch.zeros(2 * buffer.numel)[::2]
    for call in (lambda: buffer.view(0, strided), lambda: buffer.views(strided)):
        with pytest.raises(ValueError, match="must be flat and contiguous"):
            call()


@pytest.mark.parametrize(
    ("offsets", "numels", "numel", "message"),
    [
        ([0, 3], [4, 4], 8, r"segment 1 starts at 3, before segment 0 ends at 4"),
        ([0, 0], [1, 1], 2, r"segment 1 starts at 0, before segment 0 ends at 1"),
        ([0, 4], [4, 5], 8, r"segment 1 \[4, 9\) lies outside acc of 8 elements"),
        ([-1], [1], 2, r"segment 0 has a negative offset or numel \(-1, 1\)"),
        ([0], [-1], 2, r"segment 0 has a negative offset or numel \(0, -1\)"),
        ([0], [4, 4], 8, r"offsets and numels must have the same length, got 1 and 2"),
    ],
    ids=["overlap-by-one", "same-start", "outside", "negative-offset", "negative-numel", "lengths-differ"],
)
def test_check_layout_refuses_each_bad_layout_for_its_own_reason(offsets, numels, numel, message):
    from gafused.buffer import check_layout

    with pytest.raises(ValueError, match=message):
        check_layout(offsets, numels, numel)
    check_layout([0, 4], [4, 4], 8)  # touching is fine


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"params": []}, "at least one"),
        ({"accum_dtype": torch.bfloat16}, "accum_dtype"),
        ({"alignment_bytes": 24}, "alignment_bytes"),
        ({"alignment_bytes": 8}, "alignment_bytes"),
        ({"bucket_bytes": 0}, "bucket_bytes"),
        (
            {"params": [torch.empty(3), torch.empty(3, dtype=torch.int64)]},
            r"params\[1\] must be float16, bfloat16, float32 or float64",
        ),
        ({"params": [torch.empty(3), torch.empty(3, dtype=torch.float64)]}, r"narrower than params\[1\]'s dtype"),
        ({"params": [torch.empty(3), torch.empty(3, device="meta")]}, "share one device"),
    ],
    ids=["empty", "bf16-accum", "unaligned", "small-alignment", "zero-bucket", "int-param", "fp64-param", "devices"],
)
def test_buffer_rejects_bad_input(kwargs, message):
    arguments = {"params": [torch.empty(3)], "accum_dtype": torch.float32, **kwargs}
    with pytest.raises(ValueError, match=message):
        FlatGradBuffer(**arguments)


def test_buffer_names_a_param_that_is_no_tensor():
    with pytest.raises(TypeError, match=r"params\[1\] must be a torch.Tensor, got list"):
        FlatGradBuffer([torch.empty(3), [1.0, 2.0]])


@pytest.mark.parametrize(
    ("grads", "error", "message"),
    [
        ([torch.randn(3)], ValueError, "one entry per buffer segment"),
        ([torch.randn(4), torch.randn(2)], ValueError, "elements"),
        ([torch.randn(3), torch.randn(2, dtype=torch.complex64)], ValueError, "real floating"),
        ([torch.randn(3), torch.ones(2, dtype=torch.int32)], ValueError, "real floating"),
        ([torch.randn(3), "grad"], TypeError, "tensor or None"),
    ],
    ids=["count", "numel", "complex", "integer", "not-a-tensor"],
)
def test_ops_reject_bad_grads(grads, error, message):
    buffer = _buffer([(3,), (2,)])
    before = buffer.data.clone()
    with pytest.raises(error, match=message):
        ops.fold_(buffer, grads, 1.0, first=True, backend="reference")
    assert torch.equal(buffer.data, before)


def test_ops_reject_bad_scalars_and_backend():
    buffer = _buffer([(3,)])
    with pytest.raises(ValueError, match=r"weight must be a Python number or a 0-d tensor, got shape \(2,\)"):
        ops.fold_(buffer, [torch.randn(3)], torch.ones(2), first=True, backend="reference")
    with pytest.raises(TypeError, match="coef must be a real number or a 0-d tensor, got str"):
        ops.scale_(buffer, "2", backend="reference")
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'reference', .*got 'fastest'"):
        ops.norm(buffer, backend="fastest")
    with pytest.raises(ValueError, match=rf"out must be a flat tensor of {buffer.numel} elements on cpu, got shape"):
        ops.scale_(buffer, 1.0, out=torch.empty(3), backend="reference")


@pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning")  # interpreter: 0 * inf
@pytest.mark.parametrize("backend", ["reference", "foreach", "triton"])
def test_a_number_beyond_the_buffers_range_rounds_as_a_tensor_would(backend):
    """A Python number is rounded into the buffer's dtype as a float64 0-d tensor would be (inf beyond its range,
    not an error); an integer no float can hold is refused, naming the scalar, with nothing changed."""
    if backend == "triton" and ops.backend_unavailable_reason("triton", "cpu"):
        pytest.skip(ops.backend_unavailable_reason("triton", "cpu"))
    results = []
    huge = torch.tensor(1e300, dtype=torch.float64)
    for weight in (1e300, huge, -(10**40), -huge):
        buffer = _buffer([(3,), (2,)])
        ops.fold_(buffer, [torch.ones(3), -torch.ones(2)], weight, first=True, backend=backend)
        results.append(buffer.data.clone())
    assert torch.equal(results[0], results[1]) and torch.equal(results[2], results[3])
    assert torch.isinf(results[0]).sum() == 5 and torch.equal(results[0], -results[2])
    # Just above float32's largest value, a number rounds to it, as the float64 tensor does.
    above = float(torch.finfo(torch.float32).max) * (1 + 2**-30)
    buffer = _buffer([(3,)])
    ops.scale_(buffer, 1.0, backend=backend)
    ops.fold_(buffer, [torch.ones(3)], above, first=True, backend=backend)
    assert torch.equal(buffer.data[:3], torch.full((3,), torch.finfo(torch.float32).max))
    before = buffer.data.clone()
    too_large = "is too large in magnitude for a float: "
    with pytest.raises(ValueError, match=rf"scale {too_large}an int of about 1e\+400; float64 ends near 1.8e\+308"):
        ops.fold_finish_(buffer, [torch.ones(3)], 1.0, 10**400, first=False, backend=backend)
    # Too long for str() (more than 4300 digits), negative, not an int: the error gives sign and magnitude.
    with pytest.raises(ValueError, match=rf"weight {too_large}a negative int of about 1e\+5000;"):
        ops.fold_(buffer, [torch.ones(3)], -(10**5000), first=False, backend=backend)
    with pytest.raises(ValueError, match=rf"weight {too_large}a Fraction of about 1e\+399;"):
        ops.fold_(buffer, [torch.ones(3)], Fraction(10**400, 3), first=False, backend=backend)
    assert torch.equal(buffer.data, before)


@pytest.mark.parametrize("backend", ["reference", "foreach", "triton"])
def test_a_scalar_in_the_buffers_own_memory_is_read_before_the_op_writes(backend):
    """A 0-d view of the buffer given as a scalar (``coef = buffer.data[0]``) is the value it held when the op was
    called, on every backend (the fused kernels read the scalar in every program, after others wrote it)."""
    if backend == "triton" and ops.backend_unavailable_reason("triton", "cpu"):
        pytest.skip(ops.backend_unavailable_reason("triton", "cpu"))
    own_scalar_case(backend, "cpu", 3000)


@pytest.mark.parametrize("backend", ["reference", "foreach", "triton"])
def test_scale_into_out_refuses_what_no_gradient_can_be_before_writing(backend):
    """``out`` takes a parameter gradient's dtype (the dtypes every backend casts to) and must start on its element
    size (GPU kernels fault on a view cut at an odd byte): anything else is refused, nothing written."""
    if backend == "triton" and ops.backend_unavailable_reason("triton", "cpu"):
        pytest.skip(ops.backend_unavailable_reason("triton", "cpu"))
    buffer = _buffer([(3,), (2,)])
    ops.fold_(buffer, [torch.randn(3), torch.randn(2)], 1.0, first=True, backend="reference")
    fp8 = torch.zeros(buffer.numel, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"out must be a contiguous float16, bfloat16, float32 or float64 tensor"):
        ops.scale_(buffer, 0.5, out=fp8, backend=backend)
    assert not fp8.view(torch.uint8).any()
    storage = torch.zeros(4 * buffer.numel + 1, dtype=torch.uint8).untyped_storage()
    odd = torch.empty(0).set_(storage[1:], 0, (buffer.numel,), (1,))
    assert odd.is_contiguous() and odd.data_ptr() % 4
    with pytest.raises(ValueError, match="out must start at a multiple of its 4-byte element size"):
        ops.scale_(buffer, 0.5, out=odd, backend=backend)
    assert not torch.empty(0, dtype=torch.uint8).set_(storage).any()


def test_ops_refuse_a_first_flag_that_is_not_a_bool():
    buffer = _buffer([(3,)])
    ops.fold_(buffer, [torch.ones(3)], 1.0, first=True, backend="reference")
    before = buffer.data.clone()
    with pytest.raises(TypeError, match="first must be a bool, got str"):
        ops.fold_(buffer, [torch.ones(3)], 1.0, first="False", backend="reference")
    with pytest.raises(TypeError, match="first must be a bool, got int"):
        ops.fold_finish_(buffer, [torch.ones(3)], 1.0, 0.5, first=0, backend="reference")
    with pytest.raises(TypeError, match="first must be a bool, got numpy.bool"):  # not "got bool"
        ops.fold_(buffer, [torch.ones(3)], 1.0, first=np.False_, backend="reference")
    with pytest.raises(TypeError, match="per_segment must be a bool, got numpy.bool"):
        ops.sum_of_squares(buffer, per_segment=np.True_, backend="reference")
    assert torch.equal(buffer.data, before)


@pytest.mark.parametrize("backend", ["reference", "foreach", "triton"])
def test_ops_refuse_a_sparse_scalar_before_writing(backend):
    """A 0-d sparse tensor as a weight or scale: the reference backend corrupted the heap with one, and foreach
    wrote wrong values."""
    if backend == "triton" and ops.backend_unavailable_reason("triton", "cpu"):
        pytest.skip(ops.backend_unavailable_reason("triton", "cpu"))
    buffer = _buffer([(3,), (2,)])
    grads = [torch.ones(3), torch.ones(2)]
    ops.fold_(buffer, grads, 1.0, first=True, backend="reference")
    before = buffer.data.clone()
    sparse = torch.tensor(2.0).to_sparse()
    with pytest.raises(ValueError, match="weight must be a dense tensor, got layout torch.sparse_coo"):
        ops.fold_(buffer, grads, sparse, first=False, backend=backend)
    with pytest.raises(ValueError, match="scale must be a dense tensor, got layout torch.sparse_coo"):
        ops.fold_finish_(buffer, grads, 1.0, sparse, first=False, backend=backend)
    with pytest.raises(ValueError, match="coef must be a dense tensor, got layout torch.sparse_coo"):
        ops.scale_(buffer, sparse, backend=backend)
    assert torch.equal(buffer.data, before)


@pytest.mark.parametrize("backend", ["reference", "foreach"])
def test_scalars_with_a_graph_or_from_numpy_fold_their_values(backend):
    # A weight that requires grad is read as its value: no graph reaches the buffer, on every backend.
    buffer = _buffer([(3,)])
    weight = torch.tensor(2.0, requires_grad=True)
    scale = torch.tensor(0.25, requires_grad=True) * 2
    ops.fold_(buffer, [torch.ones(3)], weight, first=True, backend=backend)
    ops.fold_(buffer, [torch.ones(3)], np.float32(4.0), first=False, backend=backend)
    total, _ = ops.fold_finish_(buffer, [torch.ones(3)], weight, scale, first=False, backend=backend)
    ops.scale_(buffer, weight, backend=backend)
    assert not buffer.data.requires_grad and buffer.data.grad_fn is None and not total.requires_grad
    assert torch.equal(buffer.segment(0), torch.full((3,), 8.0))
    assert total.item() == 3 * 4.0**2


def test_ops_are_torch_library_ops_and_trace_under_compile():
    buffer = _buffer([(5,), (3,)])
    grads = [torch.randn(5), torch.randn(3)]
    weight = torch.tensor(2.0)
    scale = torch.tensor(0.5)

    def finish(data, g0, g1, w, s):
        return torch.ops.gafused.fold_finish_(data, [g0, g1], buffer.offsets, buffer.numels, w, s, True, "reference")

    compiled = torch.compile(finish, backend="aot_eager", fullgraph=True)
    sumsq, nonfinite = compiled(buffer.data, *grads, weight, scale)
    expected = torch.cat([g * 2.0 * 0.5 for g in grads])
    torch.testing.assert_close(torch.cat([buffer.segment(0), buffer.segment(1)]), expected)
    torch.testing.assert_close(sumsq, expected.square().sum())
    assert not bool(nonfinite)


def test_check_grads_names_segments_detaches_and_makes_contiguous():
    buffer = _buffer([(3,), (2,)])
    names = ["layer.weight", "layer.bias"]
    with pytest.raises(ValueError, match="layer.bias: the gradient has 3 elements, its segment 2"):
        ops.check_grads(buffer, [torch.randn(3), torch.randn(3)], names=names)
    with pytest.raises(ValueError, match="layer.weight: sparse"):
        ops.check_grads(buffer, [torch.randn(3).to_sparse(), None], names=names)
    with_graph = torch.randn(3, requires_grad=True) * 2
    strided = torch.randn(2, 2)[:, 0]
    checked = ops.check_grads(buffer, [with_graph, strided])
    assert not checked[0].requires_grad and torch.equal(checked[0], with_graph.detach())
    assert checked[1].is_contiguous() and torch.equal(checked[1], strided)
    ops.fold_(buffer, checked, 1.0, first=True, backend="reference", check=False)
    torch.testing.assert_close(buffer.view(1), strided)
