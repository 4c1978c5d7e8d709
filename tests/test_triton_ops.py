"""The fused backends (triton, foreach) against the reference backend, op by op; then Triton's own properties.

Without a GPU the Triton kernels run on CPU tensors under TRITON_INTERPRET=1 (set in conftest.py), so sizes
stay small. Every comparison builds two identical buffers, runs the same op with the backend under test
(``candidate``) on one and backend="reference" on the other, and compares. Buffer padding holds a sentinel
that must survive.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from gafused import GradAccumulator, ops
from gafused.buffer import FlatGradBuffer

pytest.importorskip("triton", reason="triton is not installed")

from gafused.triton_backend import _layout, unavailable_reason  # noqa: E402 - only importable with triton

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
_TRITON_REASON = ops.backend_unavailable_reason("triton", DEVICE)
# Tests of Triton's own properties (launch counts, tables, availability) need it on this module's device.
needs_triton = pytest.mark.skipif(_TRITON_REASON is not None, reason=f"triton backend unavailable: {_TRITON_REASON}")
SENTINEL = -7777.25  # exactly representable in every dtype used here; no random value comes near it

# Segment shapes. "mixed" holds an empty, a one-element and an odd segment, one below a block and three
# that end just past a block boundary (blocks are 1024 elements for buffers this small, checked below).
LAYOUTS = {
    "mixed": [(0,), (1,), (3, 5), (1000,), (1025,), (2, 1025), (7,)],
    "many_small": [(n,) for n in (3, 1, 17, 0, 29, 5, 11, 2, 31, 8, 13, 1, 23, 4, 19, 6, 37, 9, 2, 15)],
    "one_element": [(1,)],
    "all_empty": [(0,), (0, 3)],
}
ACCUM_DTYPES = {"acc_fp32": torch.float32, "acc_fp64": torch.float64}
GRAD_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}
# (rtol, atol) for values computed in the buffer's dtype. Elementwise results round exactly where the reference's
# device path does (one rounding per multiply, add and cast; every launch turns fp contraction off), so they match
# bit for bit; sums differ by summation order.
ELEMENTWISE_TOL = {torch.float32: (0.0, 0.0), torch.float64: (0.0, 0.0)}
# Sums of squares: each square rounds once, a block adds up to 1024 of them pairwise (10 levels), stage 2 adds in
# float64 and rounds once, the reference rounds its float64 sum once: within 13 unit roundoffs of each other.
SUM_TOL = {torch.float32: (13 * 2.0**-24, 0.0), torch.float64: (13 * 2.0**-53, 0.0)}
# The CUDA kernels' sums, which add a thread's squares one after another (fused multiply-adds): no bound derived.
CUDA_SUM_TOL = {torch.float32: (1e-5, 1e-5), torch.float64: (1e-12, 1e-12)}


@pytest.fixture(params=["foreach", "triton"])
def candidate(request) -> str:
    """A backend compared with the reference on this module's device (skipped where it cannot run)."""
    reason = ops.backend_unavailable_reason(request.param, DEVICE)
    if reason is not None:
        pytest.skip(f"{request.param} backend cannot run on {DEVICE}: {reason}")
    return request.param


def _ids(mapping: dict) -> dict:
    return {"argvalues": list(mapping.values()), "ids": list(mapping.keys())}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(20240611)


@pytest.fixture(autouse=True)
def _device_paths(monkeypatch):
    """The reference and foreach backends take on CPU the path they take on a GPU (the weight kept a 0-d tensor:
    ``acc + (weight * grad)``, two roundings), which the Triton kernels follow; their CPU-only path, one fused
    ``add_`` rounding, is checked against float64 in tests/test_reference_ops.py and tests/test_foreach_ops.py."""
    from gafused import foreach_backend, reference

    monkeypatch.setattr(reference, "_host_scalars", lambda device: False)
    monkeypatch.setattr(foreach_backend, "_host_scalars", lambda device: False)


def _buffers(shapes, accum_dtype) -> tuple[FlatGradBuffer, FlatGradBuffer]:
    """Two buffers with the same layout and random contents; padding holds SENTINEL."""
    params = [torch.empty(shape, device=DEVICE) for shape in shapes]
    candidate_buffer = FlatGradBuffer(params, accum_dtype)
    reference_buffer = FlatGradBuffer(params, accum_dtype)
    contents = torch.full((candidate_buffer.numel,), SENTINEL, dtype=accum_dtype, device=DEVICE)
    for index in range(len(candidate_buffer)):
        start, numel = candidate_buffer.offsets[index], candidate_buffer.numels[index]
        contents[start : start + numel] = torch.randn(numel, dtype=accum_dtype, device=DEVICE)
    candidate_buffer.data.copy_(contents)
    reference_buffer.data.copy_(contents)
    return candidate_buffer, reference_buffer


def _padding_mask(buffer: FlatGradBuffer) -> torch.Tensor:
    in_segment = torch.zeros(buffer.numel, dtype=torch.bool, device=DEVICE)
    for start, numel in zip(buffer.offsets, buffer.numels, strict=True):
        in_segment[start : start + numel] = True
    return ~in_segment


def _assert_padding_untouched(buffer: FlatGradBuffer) -> None:
    padding = buffer.data[_padding_mask(buffer)]
    assert torch.all(padding == SENTINEL), "an op wrote into the padding between segments"


def _grads(buffer: FlatGradBuffer, dtypes, missing=()) -> list[torch.Tensor | None]:
    """Random gradients shaped like the buffer's params; ``dtypes`` cycles over segments."""
    grads: list[torch.Tensor | None] = []
    for index, shape in enumerate(buffer.shapes):
        dtype = dtypes[index % len(dtypes)]
        grads.append(None if index in missing else torch.randn(shape, device=DEVICE).to(dtype))
    return grads


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, tolerances: dict) -> None:
    rtol, atol = tolerances[expected.dtype]
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=True)


@needs_triton
def test_small_layouts_cross_block_boundaries():
    block_size, _ = _layout.launch_config(tuple(torch.Size(s).numel() for s in LAYOUTS["mixed"]))
    assert block_size == 1024, "the 'mixed' layout is sized around 1024-element blocks"


@pytest.mark.parametrize("accum_dtype", **_ids(ACCUM_DTYPES))
@pytest.mark.parametrize("grad_dtype", **_ids(GRAD_DTYPES))
@pytest.mark.parametrize("shapes", **_ids(LAYOUTS))
def test_fold_matches_reference(shapes, grad_dtype, accum_dtype, candidate):
    candidate_buffer, reference_buffer = _buffers(shapes, accum_dtype)
    # First micro-batch with a Python weight, then two more with 0-d tensor weights.
    weights = [0.75, torch.tensor(1.5), torch.tensor(0.3, dtype=torch.float64)]
    for step, weight in enumerate(weights):
        grads = _grads(candidate_buffer, [grad_dtype])
        ops.fold_(candidate_buffer, grads, weight, first=step == 0, backend=candidate)
        ops.fold_(reference_buffer, grads, weight, first=step == 0, backend="reference")
        _assert_close(candidate_buffer.data, reference_buffer.data, ELEMENTWISE_TOL)
    _assert_padding_untouched(candidate_buffer)


# The interpreter evaluates 0 * inf on masked-off lanes too (numpy warns); the kernel discards those lanes.
@pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning")
@pytest.mark.parametrize("accum_dtype", **_ids(ACCUM_DTYPES))
@pytest.mark.parametrize("first", [True, False], ids=["first", "not_first"])
def test_fold_missing_grads(first, accum_dtype, candidate):
    candidate_buffer, reference_buffer = _buffers(LAYOUTS["mixed"], accum_dtype)
    before = candidate_buffer.data.clone()
    missing = {1, 3, 5}
    grads = _grads(candidate_buffer, [torch.bfloat16, torch.float32], missing=missing)
    # An inf weight must not leak into segments without a gradient (0 * inf would be nan).
    weight = torch.tensor(float("inf"))
    ops.fold_(candidate_buffer, grads, weight, first=first, backend=candidate)
    ops.fold_(reference_buffer, grads, weight, first=first, backend="reference")
    _assert_close(candidate_buffer.data, reference_buffer.data, ELEMENTWISE_TOL)
    for index in missing:
        segment = candidate_buffer.segment(index)
        expected = torch.zeros_like(segment) if first else before[candidate_buffer.offsets[index] :][: segment.numel()]
        assert torch.equal(segment, expected)
    _assert_padding_untouched(candidate_buffer)


@pytest.mark.parametrize("accum_dtype", **_ids(ACCUM_DTYPES))
def test_last_fold_scales_a_segment_without_gradient_bit_for_bit(accum_dtype, candidate):
    # Segment 4 (1025 elements, past a block boundary) has no gradient on the last micro-batch: it is only
    # multiplied by the scale (no power of two: one rounding, in the buffer's dtype), so its signed zeros stay
    # negative, as in the reference.
    candidate_buffer, reference_buffer = _buffers(LAYOUTS["mixed"], accum_dtype)
    for buffer in (candidate_buffer, reference_buffer):
        buffer.segment(4).view(-1)[::2] = -0.0
    grads = _grads(candidate_buffer, [torch.float32], missing={4})
    ops.fold_finish_(candidate_buffer, grads, 1.0, 1 / 3, first=False, backend=candidate)
    ops.fold_finish_(reference_buffer, grads, 1.0, 1 / 3, first=False, backend="reference")
    assert torch.equal(torch.signbit(candidate_buffer.segment(4)), torch.signbit(reference_buffer.segment(4)))
    assert torch.equal(candidate_buffer.segment(4), reference_buffer.segment(4))


@pytest.mark.parametrize("accum_dtype", **_ids(ACCUM_DTYPES))
def test_fold_mixed_grad_dtypes_in_one_call(accum_dtype, candidate):
    candidate_buffer, reference_buffer = _buffers(LAYOUTS["many_small"], accum_dtype)
    for first in (True, False):
        grads = _grads(candidate_buffer, list(GRAD_DTYPES.values()), missing={2, 9})
        ops.fold_(candidate_buffer, grads, 0.5, first=first, backend=candidate)
        ops.fold_(reference_buffer, grads, 0.5, first=first, backend="reference")
        _assert_close(candidate_buffer.data, reference_buffer.data, ELEMENTWISE_TOL)
    _assert_padding_untouched(candidate_buffer)


@pytest.mark.parametrize("accum_dtype", **_ids(ACCUM_DTYPES))
@pytest.mark.parametrize("first", [True, False], ids=["first", "not_first"])
@pytest.mark.parametrize("shapes", **_ids(LAYOUTS))
def test_fold_finish_matches_reference(shapes, first, accum_dtype, candidate):
    candidate_buffer, reference_buffer = _buffers(shapes, accum_dtype)
    # Segment 1 has no gradient: it must still be scaled (and zeroed first when ``first``). The scale is no power of
    # two: rounded anywhere but into the buffer's dtype, it shows.
    grads = _grads(candidate_buffer, [torch.bfloat16, torch.float16, torch.float32], missing={1})
    weight, scale = torch.tensor(0.8), 1 / 3
    result = ops.fold_finish_(candidate_buffer, grads, weight, scale, first=first, backend=candidate)
    expected = ops.fold_finish_(reference_buffer, grads, weight, scale, first=first, backend="reference")
    _assert_close(candidate_buffer.data, reference_buffer.data, ELEMENTWISE_TOL)
    assert result[0].shape == () and result[0].dtype == accum_dtype
    assert result[1].shape == () and result[1].dtype == torch.bool
    _assert_close(result[0], expected[0], SUM_TOL)
    assert not result[1] and not expected[1]
    _assert_padding_untouched(candidate_buffer)


@pytest.mark.parametrize("accum_dtype", **_ids(ACCUM_DTYPES))
@pytest.mark.parametrize("bad_value", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_fold_finish_flags_nonfinite(where, bad_value, accum_dtype, candidate):
    candidate_buffer, reference_buffer = _buffers(LAYOUTS["mixed"], accum_dtype)
    grads = _grads(candidate_buffer, [torch.bfloat16, torch.float32])
    target = grads[5].view(-1)  # 2050 elements, spanning three blocks
    target[{"first": 0, "middle": target.numel() // 2, "last": target.numel() - 1}[where]] = bad_value
    for first in (True, False):
        result = ops.fold_finish_(candidate_buffer, grads, 1.0, 0.5, first=first, backend=candidate)
        expected = ops.fold_finish_(reference_buffer, grads, 1.0, 0.5, first=first, backend="reference")
        assert result[1] and expected[1]
        assert torch.equal(torch.isnan(candidate_buffer.data), torch.isnan(reference_buffer.data))
        assert torch.equal(torch.isinf(candidate_buffer.data), torch.isinf(reference_buffer.data))
        _assert_close(candidate_buffer.data, reference_buffer.data, ELEMENTWISE_TOL)
        _assert_close(result[0], expected[0], SUM_TOL)
    _assert_padding_untouched(candidate_buffer)


@pytest.mark.parametrize("accum_dtype", **_ids(ACCUM_DTYPES))
@pytest.mark.parametrize("per_segment", [False, True], ids=["global", "per_segment"])
@pytest.mark.parametrize("shapes", **_ids(LAYOUTS))
def test_sum_of_squares_matches_reference(shapes, per_segment, accum_dtype, candidate):
    candidate_buffer, reference_buffer = _buffers(shapes, accum_dtype)
    result = ops.sum_of_squares(candidate_buffer, per_segment=per_segment, backend=candidate)
    expected = ops.sum_of_squares(reference_buffer, per_segment=per_segment, backend="reference")
    assert result.shape == expected.shape and result.dtype == expected.dtype
    _assert_close(result, expected, SUM_TOL)
    _assert_close(
        ops.norm(candidate_buffer, per_segment=per_segment, backend=candidate),
        ops.norm(reference_buffer, per_segment=per_segment, backend="reference"),
        SUM_TOL,
    )


@pytest.mark.parametrize("accum_dtype", **_ids(ACCUM_DTYPES))
def test_reductions_are_bitwise_repeatable(accum_dtype, candidate):
    candidate_buffer, _ = _buffers(LAYOUTS["mixed"], accum_dtype)
    grads = _grads(candidate_buffer, [torch.bfloat16, torch.float32])
    start = candidate_buffer.data.clone()
    totals, flags, globals_, per_segments = [], [], [], []
    for _ in range(3):
        candidate_buffer.data.copy_(start)
        total, flag = ops.fold_finish_(candidate_buffer, grads, 0.7, 0.5, first=False, backend=candidate)
        totals.append(total)
        flags.append(flag)
        globals_.append(ops.sum_of_squares(candidate_buffer, backend=candidate))
        per_segments.append(ops.sum_of_squares(candidate_buffer, per_segment=True, backend=candidate))
    for values in (totals, flags, globals_, per_segments):
        assert all(torch.equal(values[0], other) for other in values[1:])


@pytest.mark.parametrize("accum_dtype", **_ids(ACCUM_DTYPES))
@pytest.mark.parametrize("coef", [0.37, torch.tensor(1.75)], ids=["number", "tensor"])
@pytest.mark.parametrize("shapes", **_ids(LAYOUTS))
def test_scale_in_place_matches_reference(shapes, coef, accum_dtype, candidate):
    candidate_buffer, reference_buffer = _buffers(shapes, accum_dtype)
    ops.scale_(candidate_buffer, coef, backend=candidate)
    ops.scale_(reference_buffer, coef, backend="reference")
    # One multiply in the buffer's dtype: IEEE fixes the result, so it must match exactly.
    torch.testing.assert_close(candidate_buffer.data, reference_buffer.data, rtol=0, atol=0)
    _assert_padding_untouched(candidate_buffer)


@pytest.mark.parametrize("accum_dtype", **_ids(ACCUM_DTYPES))
@pytest.mark.parametrize("out_dtype", **_ids(GRAD_DTYPES))
def test_scale_into_out_matches_reference(out_dtype, accum_dtype, candidate):
    candidate_buffer, reference_buffer = _buffers(LAYOUTS["mixed"], accum_dtype)
    before = candidate_buffer.data.clone()
    out_sentinel = torch.tensor(SENTINEL, dtype=out_dtype).item()
    candidate_out = torch.full((candidate_buffer.numel,), out_sentinel, dtype=out_dtype, device=DEVICE)
    reference_out = candidate_out.clone()
    coef = torch.tensor(0.3)
    ops.scale_(candidate_buffer, coef, out=candidate_out, backend=candidate)
    ops.scale_(reference_buffer, coef, out=reference_out, backend="reference")
    # A multiply and a round-to-nearest-even cast (through float32, as torch casts): exact match.
    torch.testing.assert_close(candidate_out, reference_out, rtol=0, atol=0)
    assert torch.equal(candidate_buffer.data, before), "scale_ with out must leave the buffer unchanged"
    assert torch.all(candidate_out[_padding_mask(candidate_buffer)] == out_sentinel)


def test_scale_rounds_bfloat16_to_nearest_even(candidate):
    # Halfway and just-above-halfway float32 values, where truncation and rounding disagree.
    values = torch.tensor([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 1.0 + 2.0**-8 + 2.0**-20, -(1.0 + 3 * 2.0**-8)])
    values = values.to(DEVICE)
    buffer = FlatGradBuffer([torch.empty(values.numel(), device=DEVICE)])
    buffer.data[: values.numel()] = values
    out = torch.empty(buffer.numel, dtype=torch.bfloat16, device=DEVICE)
    ops.scale_(buffer, 1.0, out=out, backend=candidate)
    assert torch.equal(out[: values.numel()], values.to(torch.bfloat16))


def test_scale_to_bfloat16_keeps_every_nan_a_nan(candidate):
    """A NaN whose payload's low bits are all ones would round into the exponent (0x7FFFFFFF + 0x7FFF carries into
    the sign, -0.0) or to infinity (0x7F800001 rounds down to 0x7F80): every NaN must store as a bfloat16 NaN."""
    bits = torch.tensor([0x7FFFFFFF, -1, 0x7F800001, -0x007FFFFF, 0x7FC00000], dtype=torch.int32)  # -1: 0xFFFFFFFF
    values = bits.view(torch.float32).to(DEVICE)
    assert values.isnan().all()
    buffer = FlatGradBuffer([torch.empty(values.numel(), device=DEVICE)])
    buffer.data[: values.numel()] = values
    out = torch.empty(buffer.numel, dtype=torch.bfloat16, device=DEVICE)
    ops.scale_(buffer, 1.0, out=out, backend=candidate)
    assert out[: values.numel()].isnan().all(), out[: values.numel()].float().tolist()


def _count_launches(monkeypatch) -> list[str]:
    """Record the name of every Triton kernel launched: every launch is ``kernel[grid](...)``, so at ``[grid]``,
    which every Triton release routes through the kernel's class."""
    from gafused.triton_backend.fold import _fold_kernel

    launches: list[str] = []
    kernel_type = type(_fold_kernel)  # JITFunction on a GPU, InterpretedFunction under TRITON_INTERPRET=1
    original_getitem = kernel_type.__getitem__

    def counting_getitem(self, grid):
        launches.append(self.fn.__name__)
        return original_getitem(self, grid)

    monkeypatch.setattr(kernel_type, "__getitem__", counting_getitem)
    return launches


@needs_triton
def test_launch_count_does_not_grow_with_parameters(monkeypatch):
    launches = _count_launches(monkeypatch)
    counts = {}
    for n_params in (3, 300):
        triton_buffer, _ = _buffers([(2,)] * n_params, torch.float32)
        per_op = {}
        for name, run in {
            "fold": lambda b: ops.fold_(b, _grads(b, [torch.bfloat16]), 1.0, first=False, backend="triton"),
            "fold_two_dtypes": lambda b: ops.fold_(
                b, _grads(b, [torch.bfloat16, torch.float32]), 1.0, first=True, backend="triton"
            ),
            "fold_finish": lambda b: ops.fold_finish_(
                b, _grads(b, [torch.float16], missing={0}), 1.0, 0.5, first=False, backend="triton"
            ),
            "sum_of_squares": lambda b: ops.sum_of_squares(b, per_segment=True, backend="triton"),
            "scale": lambda b: ops.scale_(b, 0.5, backend="triton"),
        }.items():
            launches.clear()
            run(triton_buffer)
            per_op[name] = list(launches)
        counts[n_params] = per_op
    assert counts[3] == counts[300]
    assert counts[300]["fold"] == ["_fold_kernel"]
    assert counts[300]["fold_two_dtypes"] == ["_fold_kernel", "_fold_kernel"]
    assert counts[300]["fold_finish"] == ["_fold_kernel", "_reduce_partials_kernel"]
    assert counts[300]["sum_of_squares"] == ["_block_sum_of_squares_kernel", "_reduce_partials_kernel"]
    assert counts[300]["scale"] == ["_scale_kernel"]


def test_unavailable_reason():
    # Not behind needs_triton: with triton installed the backend must run on the tests' device (on CPU under the
    # interpreter conftest.py turns on), or every test of it would skip and the suite pass without them.
    assert unavailable_reason(DEVICE) is None
    reason = unavailable_reason(torch.device("meta"))
    assert reason is not None and "TRITON_INTERPRET=1" in reason


@pytest.mark.parametrize(
    ("triton_version", "numpy_version", "refused"),
    [("3.6.0", "2.4.1", True), ("3.6.0", "2.3.5", False), ("3.7.0", "2.4.1", False), ("3.10.0", "3.0.0", False)],
)
def test_the_interpreter_of_an_older_triton_with_numpy_2_4_is_unavailable(
    monkeypatch, triton_version, numpy_version, refused
):
    """Triton 3.6's interpreter (torch 2.11's) turns a loop bound into an int with int() of a one-element array, which
    NumPy 2.4 refuses inside every kernel with a reduction loop: the backend says so (with the remedy) up front."""
    import numpy
    import triton

    import gafused.triton_backend as backend

    monkeypatch.setattr(triton, "__version__", triton_version)
    monkeypatch.setattr(numpy, "__version__", numpy_version)
    reason = backend._interpreter_reason()
    if refused:
        assert reason is not None and f"Triton {triton_version}'s interpreter" in reason and "numpy<2.4" in reason
    else:
        assert reason is None


def test_unavailable_on_cpu_without_interpreter():
    # TRITON_INTERPRET is read when kernels are defined, so this needs a fresh interpreter process.
    script = (
        "import torch\n"
        "from gafused.triton_backend import unavailable_reason\n"
        "print(unavailable_reason(torch.device('cpu')))\n"
    )
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert "TRITON_INTERPRET=1" in result.stdout


def test_compiled_kernels_do_not_need_numpy():
    # Only Triton's interpreter needs numpy: without TRITON_INTERPRET the backend must import where numpy is absent
    # (a GPU machine with torch and triton only) and run its CUDA checks.
    script = (
        "import sys\n"
        "class NoNumpy:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'numpy':\n"
        "            raise ModuleNotFoundError('numpy is not installed')\n"
        "sys.meta_path.insert(0, NoNumpy())\n"
        "import torch\n"
        "from gafused import triton_backend\n"
        "print(triton_backend._INTERPRETED, triton_backend.unavailable_reason(torch.device('cpu')))\n"
    )
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert result.stdout.startswith("False triton kernels need CUDA tensors")


@needs_triton
@pytest.mark.parametrize("per_segment", [False, True], ids=["total", "per_segment"])
def test_stage_two_adds_many_partials_without_drift(per_segment):
    """A 7B-parameter float32 buffer leaves 1.7M block partials, about 1,700 per lane of the stage-2 reduction.
    Each partial here is 1.0001 and each lane adds 512: in float32 every add rounds at the running sum's
    magnitude and the lanes drift by 2.7e-6 (23 float32 epsilons); the result must be one rounding from exact."""
    from types import SimpleNamespace

    from gafused.triton_backend.norm import reduce_partials

    count = _layout.REDUCE_BLOCK * 512
    partials = torch.full((count,), 1.0001, dtype=torch.float32, device=DEVICE)
    table = SimpleNamespace(
        segment_numel=torch.zeros(1, dtype=torch.int64, device=DEVICE),
        n_blocks=count,
        segment_first_block=torch.tensor([0, count], device=DEVICE),
    )
    total, _ = reduce_partials(partials, None, table, per_segment=per_segment)
    exact = count * float(partials[0])  # in float64: exact
    assert float(total.reshape(-1)[0]) == pytest.approx(exact, rel=torch.finfo(torch.float32).eps)


@needs_triton
def test_block_tables_hold_offsets_past_2_31_and_the_offsets_true_alignment():
    """The kernels read segment offsets from the block table: past 2^31 elements they must stay int64 (an int32 table
    wraps to negative offsets), and the alignment hint must divide every offset (a wider one would let a GPU load
    misaligned vectors). Built on the CPU; no buffer of that size is allocated."""
    table = _layout._block_table(torch.device("cpu"), 4, 2**31 + 32, (0, 2**31 + 16), (16, 16))
    assert table.segment_offset.dtype == torch.int64 and table.segment_offset.tolist() == [0, 2**31 + 16]
    assert table.block_start.dtype == table.block_segment.dtype == table.segment_numel.dtype == torch.int64
    assert table.offset_align == 16
    for offsets, align in [((0, 3), 1), ((0, 6), 2), ((4, 12), 4), ((0, 8, 24), 8), ((0,), 16)]:
        table = _layout._block_table(torch.device("cpu"), 4, 64, offsets, (1,) * len(offsets))
        assert table.offset_align == align, (offsets, table.offset_align)


@needs_triton
def test_layout_outside_acc_is_rejected():
    from gafused.triton_backend import sum_of_squares

    acc = torch.randn(8, device=DEVICE)
    with pytest.raises(ValueError, match="outside acc"):
        sum_of_squares(acc, [4], [5], per_segment=False)


@needs_triton
def test_gradient_tables_are_reused_when_addresses_repeat():
    acc = torch.zeros(64, device=DEVICE)
    grads = [torch.randn(5, device=DEVICE), None, torch.randn(7, device=DEVICE).to(torch.bfloat16)]
    first = _layout.grad_tables(acc, grads)
    assert _layout.grad_tables(acc, grads).table is first.table
    moved = [grads[0].clone(), None, grads[2]]
    assert _layout.grad_tables(acc, moved).table is not first.table
    strided = [torch.randn(5, 2, device=DEVICE)[:, 0], None, grads[2]]  # copied for the call: never cached
    assert _layout.grad_tables(acc, strided).table is not _layout.grad_tables(acc, strided).table


def _fold_both(candidate_buffer, reference_buffer, grads) -> None:
    """Fold ``grads`` into both buffers (triton, reference) and compare: a table that reads the wrong memory shows."""
    ops.fold_(candidate_buffer, grads, 0.5, first=False, backend="triton")
    ops.fold_(reference_buffer, grads, 0.5, first=False, backend="reference")
    _assert_close(candidate_buffer.data, reference_buffer.data, ELEMENTWISE_TOL)


@needs_triton
def test_checked_gradients_are_matched_by_address():
    """Gradients from check_grads with a known layout are looked up by their addresses alone: the same addresses
    reuse the table (no new host-to-device copy), moved ones get a new one, and a misaligned one is never cached."""
    candidate_buffer, reference_buffer = _buffers([(5,), (0,), (3, 4), (6,)], torch.float32)
    acc = candidate_buffer.data
    grads = [torch.randn(5, device=DEVICE), None, torch.randn(3, 4, device=DEVICE), torch.randn(6, device=DEVICE)]
    checked = ops.check_grads(candidate_buffer, grads)
    assert checked.shapes is not None, "a list accepted as given carries its layout"
    first = _layout.grad_tables(acc, checked)
    again = ops.check_grads(candidate_buffer, grads)
    assert again.shapes is checked.shapes
    assert _layout.grad_tables(acc, again).table is first.table
    known = _layout._cached[acc].by_address
    assert known.layout is checked.shapes and known.present == [0, 2, 3] and len(known.entries) == 1
    _fold_both(candidate_buffer, reference_buffer, grads)

    moved = [grads[0], None, grads[2].clone(), grads[3]]
    checked_moved = ops.check_grads(candidate_buffer, moved)
    assert checked_moved.shapes is checked.shapes, "same layout, other addresses"
    assert _layout.grad_tables(acc, checked_moved).table is not first.table
    _fold_both(candidate_buffer, reference_buffer, moved)


@needs_triton
@pytest.mark.skipif(DEVICE.type != "cpu", reason="a byte-misaligned fp32 tensor faults in CUDA kernels")
def test_a_misaligned_gradient_of_a_known_layout_is_copied_every_call():
    """Contiguous, with the layout's dtype and strides, but one byte off its dtype's alignment: the guard of
    check_grads cannot see that, so the table is built (from an aligned copy) every call and never cached."""
    candidate_buffer, reference_buffer = _buffers([(5,), (6,)], torch.float32)
    acc = candidate_buffer.data
    grads = [torch.randn(5, device=DEVICE), torch.randn(6, device=DEVICE)]
    checked = ops.check_grads(candidate_buffer, grads)
    _layout.grad_tables(acc, checked)
    storage = torch.zeros(4 * 6 + 1, dtype=torch.uint8, device=DEVICE).untyped_storage()
    odd = torch.empty(0, device=DEVICE).set_(storage[1:], 0, (6,), (1,))
    assert odd.is_contiguous() and odd.data_ptr() % odd.element_size()
    odd.copy_(torch.randn(6, device=DEVICE))
    unaligned = [grads[0], odd]
    checked_unaligned = ops.check_grads(candidate_buffer, unaligned)
    assert checked_unaligned.shapes is checked.shapes
    tables = _layout.grad_tables(acc, checked_unaligned)
    assert tables.keep_alive and _layout.grad_tables(acc, checked_unaligned).table is not tables.table
    assert len(_layout._cached[acc].by_address.entries) == 1, "only the aligned list's table is cached"
    _fold_both(candidate_buffer, reference_buffer, unaligned)


@needs_triton
@pytest.mark.skipif(DEVICE.type != "cpu", reason="a byte-misaligned fp32 tensor faults in CUDA kernels")
def test_a_copy_landing_on_a_cached_address_is_not_filed_under_the_original(monkeypatch):
    """A misaligned gradient's aligned copy may land where an earlier gradient lived, whose table is cached by
    (address, dtype): that table fits the copy, not the original, so it must not be filed under the original's
    address, or the next call would read the copy's memory, stale by then. The copy is put at that address on
    purpose (the allocator would do so only by chance)."""
    n = 1000
    candidate_buffer, reference_buffer = _buffers([(n,), (n,)], torch.float32)
    acc = candidate_buffer.data
    kept = torch.randn(n, device=DEVICE)
    storage = torch.zeros(4 * n + 1, dtype=torch.uint8, device=DEVICE).untyped_storage()
    odd = torch.empty(0, device=DEVICE).set_(storage[1:], 0, (n,), (1,))
    odd.copy_(torch.randn(n, device=DEVICE))
    landing = torch.randn(n, device=DEVICE)
    _layout.grad_tables(acc, ops.check_grads(candidate_buffer, [kept, landing]))  # cached for (kept, landing)
    clone = torch.Tensor.clone

    def clone_into_landing(tensor, *args, **kwargs):
        return landing.copy_(tensor) if tensor is odd else clone(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "clone", clone_into_landing)
    tables = _layout.grad_tables(acc, ops.check_grads(candidate_buffer, [kept, odd]))
    assert tables.keep_alive[0].data_ptr() == landing.data_ptr()  # the copy is where a cached table points
    del tables
    odd.copy_(torch.randn(n, device=DEVICE))  # landing still holds odd's old values
    for _ in range(2):
        _fold_both(candidate_buffer, reference_buffer, [kept, odd])


@needs_triton
def test_a_table_built_while_another_thread_changed_the_layout_is_not_filed_under_it(monkeypatch):
    """Thread A (fp32 gradients) builds a table; meanwhile thread B folds bf16 gradients at the same addresses (a
    new layout). A's table must not end up among B's layout's tables, where the addresses alone would find it."""
    import threading

    candidate_buffer, reference_buffer = _buffers([(8,), (8,)], torch.float32)
    acc = candidate_buffer.data
    storage = torch.randn(32, device=DEVICE)
    raw = storage.view(torch.bfloat16)
    raw.copy_(torch.randn(64, device=DEVICE).to(torch.bfloat16))  # finite as bf16 and as fp32
    as_fp32, as_bf16 = [storage[:8], storage[16:24]], [raw[:8], raw[32:40]]
    checked_fp32 = ops.check_grads(candidate_buffer, as_fp32)
    checked_bf16 = ops.check_grads(candidate_buffer, as_bf16)  # the layout check_grads matches from now on
    build, building, go_on = _layout._grad_tables, threading.Event(), threading.Event()

    def paused(*args):
        if threading.current_thread().name == "A":
            building.set()
            go_on.wait(timeout=30)
        return build(*args)

    monkeypatch.setattr(_layout, "_grad_tables", paused)
    results = []
    thread = threading.Thread(target=lambda: results.append(_layout.grad_tables(acc, checked_fp32)), name="A")
    thread.start()
    assert building.wait(timeout=30)
    _layout.grad_tables(acc, checked_bf16)
    go_on.set()
    thread.join(timeout=30)
    assert not thread.is_alive() and len(results) == 1, "thread A did not finish its call"
    monkeypatch.setattr(_layout, "_grad_tables", build)
    _fold_both(candidate_buffer, reference_buffer, as_bf16)


@needs_triton
def test_a_new_dtype_at_the_same_addresses_gets_its_own_table():
    """The same memory seen as fp32 gradients, then as bf16 ones: element offsets differ (16 vs 32 between the two
    gradients), so a table keyed by address alone across layouts would read the wrong elements."""
    candidate_buffer, reference_buffer = _buffers([(8,), (8,)], torch.float32)
    storage = torch.randn(32, device=DEVICE)
    as_fp32 = [storage[:8], storage[16:24]]
    raw = storage.view(torch.bfloat16)  # 64 bf16 elements over the same bytes
    as_bf16 = [raw[:8], raw[32:40]]
    assert [g.data_ptr() for g in as_fp32] == [g.data_ptr() for g in as_bf16]
    for grads in (as_fp32, as_bf16, as_fp32):
        raw[:8].copy_(torch.randn(8, device=DEVICE).to(torch.bfloat16))  # finite bf16 and fp32 values either way
        raw[32:40].copy_(torch.randn(8, device=DEVICE).to(torch.bfloat16))
        _fold_both(candidate_buffer, reference_buffer, grads)


@needs_triton
def test_tables_of_many_buckets_are_reused_every_micro_batch():
    """A model cut into more buckets than one table cache holds folds them in turn every micro-batch: each bucket
    keeps its own tables, so the second micro-batch builds and copies none."""
    buckets = _layout.GRAD_TABLE_CACHE_SIZE + _layout.BLOCK_TABLE_CACHE_SIZE + 3
    accs = [torch.zeros(16 + index, device=DEVICE) for index in range(buckets)]
    grads = [[torch.randn(8 + index, device=DEVICE)] for index in range(buckets)]

    def micro_batch():
        return [
            (_layout.block_table(acc, [0], [8 + index]), _layout.grad_tables(acc, grads[index]).table)
            for index, acc in enumerate(accs)
        ]

    first, second = micro_batch(), micro_batch()
    for (block_a, grad_a), (block_b, grad_b) in zip(first, second, strict=True):
        assert block_a is block_b and grad_a is grad_b
    assert all(acc in _layout._cached for acc in accs)
    held = len(_layout._cached)
    del accs[0]  # a dropped buffer takes its tables with it
    assert len(_layout._cached) == held - 1


@needs_triton
def test_alignment_hints_divide_every_offset():
    assert _layout.alignment([0, 16, 48]) == 16
    assert _layout.alignment([64, 24]) == 8
    assert _layout.alignment([3, 16]) == 1
    # Gradients that are views at odd element offsets of one tensor: the launch's hint must drop to 1.
    storage = torch.randn(64, device=DEVICE)
    grads = [storage[1:6], storage[9:16], storage[20:29]]
    tables = _layout.grad_tables(torch.zeros(64, device=DEVICE), grads)
    offsets = tables.table[0].tolist()
    assert tables.aligns == [1] and all(offset % tables.aligns[0] == 0 for offset in offsets)
    candidate_buffer, reference_buffer = _buffers([(5,), (7,), (9,)], torch.float32)
    ops.fold_(candidate_buffer, grads, 0.5, first=False, backend="triton")
    ops.fold_(reference_buffer, grads, 0.5, first=False, backend="reference")
    _assert_close(candidate_buffer.data, reference_buffer.data, ELEMENTWISE_TOL)


class _NoStep(torch.optim.Optimizer):
    """An inner optimizer that does nothing: its own launches are the user's, not the accumulator's."""

    def __init__(self, params):
        super().__init__(params, {})

    def step(self, closure=None):
        return None


# Handing each parameter its finished gradient makes one view of the buffer per parameter: metadata, no kernel.
_VIEW_OPS = {"aten::view", "aten::slice", "aten::as_strided"}


@needs_triton
def test_wrapper_step_launches_do_not_grow_with_parameters(monkeypatch):
    """A whole GradAccumulator.step(), middle and finishing: the same kernels and torch ops for 3 or 300 params."""
    launches = _count_launches(monkeypatch)
    per_size = {}
    for n_params in (3, 300):
        generator = torch.Generator().manual_seed(n_params)
        params = [
            torch.nn.Parameter(torch.zeros(5 + i % 7, dtype=torch.bfloat16, device=DEVICE)) for i in range(n_params)
        ]
        opt = GradAccumulator(_NoStep(params), accumulation_steps=2, max_grad_norm=1.0, backend="triton")
        moments = {}
        for moment in ("middle", "last"):
            for p in params:
                p.grad = torch.randn(p.shape, generator=generator).to(device=DEVICE, dtype=torch.bfloat16)
            launches.clear()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
                opt.step(weight=torch.tensor(2.0))
            names = [event.name for event in profile.events() if event.name.startswith("aten::")]
            moments[moment] = (list(launches), sum(1 for name in names if name not in _VIEW_OPS))
        assert opt.stepped and all(p.grad is not None for p in params)
        per_size[n_params] = moments
    assert per_size[3] == per_size[300]
    assert per_size[300]["middle"][0] == ["_fold_kernel"]
    # finish: fold + scale + partial sums, their reduction, then the clip coefficient applied while casting to bf16
    assert per_size[300]["last"][0] == ["_fold_kernel", "_reduce_partials_kernel", "_scale_kernel"]


@pytest.mark.gpu
def test_segments_past_int32_offsets():
    """Segments that cross and start past element 2**31 of a buffer: int64 offsets in every kernel."""
    from gafused import reference, triton_backend

    size = 2**31 + 2**16
    if torch.cuda.mem_get_info()[0] < size * 6 + 2**30:
        pytest.skip(f"needs {size * 6 / 2**30 + 1:.0f} GiB of free GPU memory")
    generator = torch.Generator(device="cuda").manual_seed(31)
    numels = [20001, 9000]
    offsets = [2**31 - 10000, 2**31 + 30003]
    acc = torch.zeros(size, dtype=torch.float32, device="cuda")
    # The reference runs on a small copy of each segment's neighbourhood: the contract does not depend on where
    # a segment lies, and the comparison needs no second 8 GiB buffer.
    margin = 64
    windows = [slice(start - margin, start + numel + margin) for start, numel in zip(offsets, numels, strict=True)]
    local_offsets = [margin, numels[0] + 3 * margin]
    expected = torch.cat([acc[window] for window in windows])
    weight = torch.tensor(0.75, device="cuda")
    scale = torch.tensor(0.5, device="cuda")

    def grads():
        return [torch.randn(n, device="cuda", generator=generator).to(torch.bfloat16) for n in numels]

    for first in (True, False):
        step = grads()
        triton_backend.fold_(acc, step, offsets, numels, weight, first)
        reference.fold_(expected, step, local_offsets, numels, weight, first)
    step = grads()
    total, nonfinite = triton_backend.fold_finish_(acc, step, offsets, numels, weight, scale, False)
    expected_total, _ = reference.fold_finish_(expected, step, local_offsets, numels, weight, scale, False)
    torch.testing.assert_close(torch.cat([acc[window] for window in windows]), expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(total, expected_total, rtol=1e-5, atol=0)
    assert not bool(nonfinite)

    per_segment = triton_backend.sum_of_squares(acc, offsets, numels, True)
    expected_per_segment = reference.sum_of_squares(expected, local_offsets, numels, True)
    torch.testing.assert_close(per_segment, expected_per_segment, rtol=1e-5, atol=0)
    out = torch.zeros(size, dtype=torch.bfloat16, device="cuda")
    triton_backend.scale_(acc, offsets, numels, scale, out)
    expected_out = torch.zeros(expected.numel(), dtype=torch.bfloat16, device="cuda")
    reference.scale_(expected, local_offsets, numels, scale, expected_out)
    assert torch.equal(torch.cat([out[window] for window in windows]), expected_out)


def _run_every_op(
    device: torch.device, backend: str, seed: int, keep: list[FlatGradBuffer] | None = None
) -> list[torch.Tensor]:
    """Two folds, a fold_finish_, per-segment sums of squares and a scale into bf16, on a buffer on ``device``.

    Everything is made and run on the current stream; the results are returned for comparison across backends.
    ``keep`` gets the buffer, which keeps its cached device tables alive (they are held weakly by the buffer).
    """
    generator = torch.Generator(device=device).manual_seed(seed)
    params = [torch.empty(shape, device=device) for shape in LAYOUTS["mixed"]]
    buffer = FlatGradBuffer(params, torch.float32)

    def grads() -> list[torch.Tensor]:
        return [torch.randn(p.shape, device=device, generator=generator).to(torch.bfloat16) for p in params]

    weight, scale = torch.tensor(0.75, device=device), torch.tensor(0.5, device=device)
    ops.fold_(buffer, grads(), weight, first=True, backend=backend)
    ops.fold_(buffer, grads(), weight, first=False, backend=backend)
    total, nonfinite = ops.fold_finish_(buffer, grads(), weight, scale, first=False, backend=backend)
    per_segment = ops.sum_of_squares(buffer, per_segment=True, backend=backend)
    out = torch.zeros(buffer.numel, dtype=torch.bfloat16, device=device)
    ops.scale_(buffer, scale, out=out, backend=backend)
    if keep is not None:
        keep.append(buffer)
    return [buffer.data.clone(), total, nonfinite, per_segment, out]


def _assert_same_results(actual: list[torch.Tensor], expected: list[torch.Tensor], sums: dict = SUM_TOL) -> None:
    data, total, nonfinite, per_segment, out = actual
    _assert_close(data, expected[0], ELEMENTWISE_TOL)
    _assert_close(total, expected[1], sums)
    assert not bool(nonfinite) and not bool(expected[2])
    _assert_close(per_segment, expected[3], sums)
    # The buffers may differ by an fp32 ulp (contraction), which can move a rounding to bf16 by one bf16 ulp.
    torch.testing.assert_close(out.float(), expected[4].float(), rtol=2**-7, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_buffer_on_a_device_that_is_not_current(backend):
    """Ops on a buffer on cuda:1 while cuda:0 is current run on cuda:1 (Triton launches on the current device)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    device = torch.device("cuda", 1)
    reason = ops.backend_unavailable_reason(backend, device)
    if reason is not None:
        pytest.skip(f"{backend} backend cannot run on {device}: {reason}")
    with torch.cuda.device(0):
        actual = _run_every_op(device, backend, seed=5)
        expected = _run_every_op(device, "reference", seed=5)
    _assert_same_results(actual, expected, CUDA_SUM_TOL if backend == "cuda" else SUM_TOL)


@pytest.mark.gpu
@needs_triton
def test_ops_on_a_side_stream_after_the_default_stream():
    """The cached device tables are per stream: a second stream gets tables its own launches are ordered after."""
    device = torch.device("cuda", torch.cuda.current_device())
    expected = _run_every_op(device, "reference", seed=9)
    kept: list[FlatGradBuffer] = []
    _assert_same_results(_run_every_op(device, "triton", seed=9, keep=kept), expected)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        on_side = _run_every_op(device, "triton", seed=9, keep=kept)
    torch.cuda.current_stream(device).wait_stream(side)
    _assert_same_results(on_side, expected)
    # Every table cached for the kept buffers' memory, found by address (the ops may be handed another tensor
    # object over the same memory); each cache's keys start with the stream.
    addresses = {buffer.data.data_ptr() for buffer in kept}
    caches = [cached for acc, cached in list(_layout._cached.items()) if acc.data_ptr() in addresses]
    keys = [key for cached in caches for key in (*cached.blocks, *cached.grads)]
    keys += [key for cached in caches if cached.by_address is not None for key in cached.by_address.entries]
    streams = {key[0] for key in keys}
    assert {torch.cuda.current_stream(device).stream_id, side.stream_id} <= streams, (len(caches), keys)
