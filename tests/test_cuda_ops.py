"""The cuda backend (gafused._C) against the reference backend, and against triton where it runs.

The kernels round exactly where the reference does (one rounding per multiply, add, cast), so folded and
scaled buffers must match it bit for bit; sums of squares add in another order and match within a tolerance
that follows the dtype, and must be bitwise repeatable. GPU tests skip without a CUDA device (conftest).
"""

from __future__ import annotations

import re
import warnings
import zlib

import pytest
import torch

from gafused import ops, reference
from gafused.buffer import FlatGradBuffer

from casekit import own_scalar_case

ACCUM_DTYPES = [torch.float32, torch.float64]
GRAD_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
# Empty, one element, odd, around the 8192-element chunk, and past 2**16.
SIZES = [0, 1, 3, 8191, 8193, 70001]
# Sums of ~10^5 squares in another order than torch's.
SUM_RTOL = {torch.float32: 2e-5, torch.float64: 1e-12}
MODES = {
    "first": dict(first=True, finish=False),
    "middle": dict(first=False, finish=False),
    "last": dict(first=False, finish=True),
    "first_and_last": dict(first=True, finish=True),
}
LAYOUTS = ["aligned", "misaligned"]
# Folds also see aligned segments with gradients that are not 16-byte aligned (e.g. views into a DDP bucket).
FOLD_LAYOUTS = [*LAYOUTS, "misaligned_grads"]
# csrc/gafused_kernels.h kChunkElems and csrc/kernel_utils.cuh kThreads.
CHUNK_ELEMS = 8192
BLOCK_THREADS = 256


# --- CPU: the backend is reported missing, never used silently ------------------------------------------------


def test_cuda_backend_on_cpu_raises_with_the_reason():
    """Not built (or not loading): the reason and the command that builds it; built: the reason alone (CUDA tensors
    only), since an install command would send the user to rebuild what works."""
    with pytest.raises(RuntimeError) as info:
        ops.resolve_backend("cuda", "cpu")
    if ops._load("cuda") is None:
        assert "gafused._C" in str(info.value) and ops.INSTALL_HINTS["cuda"] in str(info.value)
    else:
        assert str(info.value) == "the cuda backend runs on CUDA devices only, got cpu"


def test_available_backends_on_cpu_exclude_cuda():
    names = ops.available_backends("cpu")
    assert "cuda" not in names
    assert "reference" in names


def test_cuda_backend_import_failure_or_cpu_refusal_is_explained():
    try:
        from gafused import cuda_backend
    except ImportError as error:
        assert "gafused._C" in str(error)
    else:
        reason = cuda_backend.unavailable_reason(torch.device("cpu"))
        assert reason is not None and "CUDA devices only" in reason


def _built_extension():
    try:
        from gafused import _C
    except ImportError as error:
        pytest.skip(f"gafused._C is not built or does not load here ({error}); bench/cuda_build_check.sh builds it")
    return _C


def test_built_extension_refuses_cpu_tensors_naming_the_argument():
    """Every op of a built gafused._C, and its Python wrapper, refuses a CPU buffer with a message (no GPU needed)."""
    extension = _built_extension()
    from gafused import cuda_backend

    acc, grad, scalar = torch.zeros(64), torch.ones(8), torch.tensor(1.0)
    stream = 0  # never used: the checks come first
    extension_calls = {
        "fold_": lambda: extension.fold_(acc, [grad], [0], [8], scalar, True, stream),
        "fold_finish_": lambda: extension.fold_finish_(acc, [grad], [0], [8], scalar, scalar, True, stream),
        "sum_of_squares": lambda: extension.sum_of_squares(acc, [0], [8], False, stream),
        "scale_": lambda: extension.scale_(acc, [0], [8], scalar, None, stream),
    }
    # An op added to the extension must be added here too (kernel_image_error takes a device index, no tensor).
    assert {name for name in dir(extension) if not name.startswith("_")} == {*extension_calls, "kernel_image_error"}
    for name, call in extension_calls.items():
        with pytest.raises(RuntimeError, match=re.escape(f"{name}: acc must be a CUDA tensor, got one on cpu")):
            call()

    wrapper_calls = {
        "fold_": lambda: cuda_backend.fold_(acc, [grad], [0], [8], scalar, True),
        "fold_finish_": lambda: cuda_backend.fold_finish_(acc, [grad], [0], [8], scalar, scalar, True),
        "sum_of_squares": lambda: cuda_backend.sum_of_squares(acc, [0], [8], False),
        "scale_": lambda: cuda_backend.scale_(acc, [0], [8], scalar, None),
    }
    assert set(wrapper_calls) <= set(cuda_backend.__all__)
    for call in wrapper_calls.values():
        with pytest.raises(ValueError, match=re.escape("needs acc on a CUDA device, got one on cpu")):
            call()


# --- GPU helpers ------------------------------------------------------------------------------------------


def _backend():
    from gafused import cuda_backend

    return cuda_backend


def _generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def _random(numel: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    # Mixed magnitudes so that rounding differences, if any, show up in the low bits.
    values = torch.randn(numel, generator=gen, device="cuda", dtype=torch.float64)
    values *= torch.exp2(torch.randint(-6, 7, (numel,), generator=gen, device="cuda")).double()
    return values.to(dtype)


def _layout(numels: list[int], layout: str) -> tuple[list[int], int]:
    """Segment offsets and total size: 16-element aligned starts, or odd starts so no segment is 16-byte aligned."""
    offsets, cursor = [], 0
    for numel in numels:
        if layout == "misaligned":
            cursor += 1 if cursor % 2 == 0 else 2  # odd start
        else:
            cursor = (cursor + 15) // 16 * 16 + 16  # aligned start after a 16-element gap
        offsets.append(cursor)
        cursor += numel
    return offsets, cursor + 7


def _padding_mask(size: int, offsets: list[int], numels: list[int]) -> torch.Tensor:
    mask = torch.ones(size, dtype=torch.bool, device="cuda")
    for start, numel in zip(offsets, numels, strict=True):
        mask[start : start + numel] = False
    return mask


def _accumulator(size: int, offsets: list[int], numels: list[int], dtype: torch.dtype, gen) -> torch.Tensor:
    """Random segments; NaN padding, so a kernel that reads padding poisons its sums and flags."""
    acc = _random(size, dtype, gen)
    acc[_padding_mask(size, offsets, numels)] = float("nan")
    return acc


def _grad(numel: int, dtype: torch.dtype, layout: str, gen) -> torch.Tensor:
    if layout == "misaligned":
        # A contiguous view one element into its storage: not aligned for wide loads.
        return _random(numel + 1, dtype, gen)[1:]
    return _random(numel, dtype, gen)


def _case(accum_dtype: torch.dtype, layout: str, seed: int, missing: tuple[int, ...] = (1, 9)):
    """Segments of every size for every gradient dtype, some without a gradient.

    ``layout``: "aligned" (segments and gradients 16-byte aligned), "misaligned" (neither), "misaligned_grads"
    (aligned segments, gradients one element into their storage).
    """
    gen = _generator(seed)
    numels = [numel for _ in GRAD_DTYPES for numel in SIZES]
    dtypes = [dtype for dtype in GRAD_DTYPES for _ in SIZES]
    offsets, size = _layout(numels, "aligned" if layout == "misaligned_grads" else layout)
    acc = _accumulator(size, offsets, numels, accum_dtype, gen)
    grad_layout = "aligned" if layout == "aligned" else "misaligned"
    grads = [
        None if i in missing else _grad(n, d, grad_layout, gen)
        for i, (n, d) in enumerate(zip(numels, dtypes, strict=True))
    ]
    return acc, grads, offsets, numels


def _scalar(value: float, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(value, dtype=dtype, device="cuda")


def _assert_bitwise(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


def _fold(module, acc, grads, offsets, numels, weight, scale, first, finish):
    if finish:
        return module.fold_finish_(acc, grads, offsets, numels, weight, scale, first)
    module.fold_(acc, grads, offsets, numels, weight, first)
    return None


# --- GPU: fold ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("layout", FOLD_LAYOUTS)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("accum_dtype", ACCUM_DTYPES, ids=str)
def test_fold_matches_reference_bitwise(accum_dtype, mode, layout):
    first, finish = MODES[mode]["first"], MODES[mode]["finish"]
    acc, grads, offsets, numels = _case(accum_dtype, layout, seed=zlib.crc32(f"{accum_dtype}{mode}{layout}".encode()))
    expected = acc.clone()
    weight, scale = _scalar(0.37, accum_dtype), _scalar(1 / 3, accum_dtype)

    result = _fold(_backend(), acc, grads, offsets, numels, weight, scale, first, finish)
    expected_result = _fold(reference, expected, grads, offsets, numels, weight, scale, first, finish)

    _assert_bitwise(acc, expected)  # segments, and NaN padding left as it was
    if finish:
        total, nonfinite = result
        expected_total, expected_nonfinite = expected_result
        assert total.dtype == accum_dtype and total.shape == () and total.device == acc.device
        assert nonfinite.dtype == torch.bool and nonfinite.shape == ()
        assert not bool(nonfinite) and not bool(expected_nonfinite)
        torch.testing.assert_close(total, expected_total, rtol=SUM_RTOL[accum_dtype], atol=0)
        segments = [acc[start : start + numel].double() for start, numel in zip(offsets, numels, strict=True)]
        exact = sum(float(segment.square().sum()) for segment in segments)
        assert float(total) == pytest.approx(exact, rel=SUM_RTOL[accum_dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("accum_dtype", ACCUM_DTYPES, ids=str)
def test_window_of_micro_batches_matches_reference(accum_dtype):
    """first, middle, middle, last on the same buffer, with changing grads and None patterns."""
    gen = _generator(7)
    numels = [70001, 3, 8192, 1, 0, 12345]
    offsets, size = _layout(numels, "aligned")
    acc = _accumulator(size, offsets, numels, accum_dtype, gen)
    expected = acc.clone()
    steps = [(True, False, {1}), (False, False, set()), (False, False, {0, 2}), (False, True, {3})]
    for step, (first, finish, missing) in enumerate(steps):
        dtype = GRAD_DTYPES[step % len(GRAD_DTYPES)]
        grads = [None if i in missing else _random(n, dtype, gen) for i, n in enumerate(numels)]
        weight, scale = _scalar(float(step + 1), accum_dtype), _scalar(1 / 10, accum_dtype)
        result = _fold(_backend(), acc, grads, offsets, numels, weight, scale, first, finish)
        expected_result = _fold(reference, expected, grads, offsets, numels, weight, scale, first, finish)
        _assert_bitwise(acc, expected)
    torch.testing.assert_close(result[0], expected_result[0], rtol=SUM_RTOL[accum_dtype], atol=0)
    assert not bool(result[1]) and not bool(expected_result[1])


def _more_chunks_than_resident_blocks() -> int:
    """Elements that make at least two chunks per block of any launch: the kernels' grids are capped at the blocks
    the device holds at once, at most its threads per SM / BLOCK_THREADS per SM."""
    properties = torch.cuda.get_device_properties(torch.cuda.current_device())
    most_blocks = properties.multi_processor_count * properties.max_threads_per_multi_processor // BLOCK_THREADS
    return 2 * most_blocks * CHUNK_ELEMS


@pytest.mark.gpu
def test_blocks_that_walk_many_chunks_across_segments_match_reference():
    """Real models give each block hundreds of chunks, which it walks across segment boundaries (including empty
    segments) and reduces one after another: every test above fits one chunk per block."""
    gen = _generator(11)
    total = _more_chunks_than_resident_blocks()
    numels = [0, total // 2 + 1, 1, 0, 8191, total // 2 + 8193, 0, 5]
    offsets, size = _layout(numels, "aligned")
    acc = _accumulator(size, offsets, numels, torch.float32, gen)
    expected = acc.clone()
    weight, scale = _scalar(0.6, torch.float32), _scalar(0.5, torch.float32)
    for first, finish in ((True, False), (False, False), (False, True)):
        grads = [None if i == 2 else _random(n, torch.bfloat16, gen) for i, n in enumerate(numels)]
        result = _fold(_backend(), acc, grads, offsets, numels, weight, scale, first, finish)
        expected_result = _fold(reference, expected, grads, offsets, numels, weight, scale, first, finish)
        _assert_bitwise(acc, expected)
    torch.testing.assert_close(result[0], expected_result[0], rtol=SUM_RTOL[torch.float32], atol=0)
    assert not bool(result[1])
    for per_segment in (False, True):
        torch.testing.assert_close(
            _backend().sum_of_squares(acc, offsets, numels, per_segment),
            reference.sum_of_squares(acc, offsets, numels, per_segment),
            rtol=SUM_RTOL[torch.float32],
            atol=0,
        )


@pytest.mark.gpu
def test_ops_run_on_the_current_stream():
    """Gradients made on a side stream are folded there, ordered after the kernel that wrote them: a launch on
    another stream would read them before they exist."""
    acc, grads, offsets, numels = _case(torch.float32, "aligned", seed=13)
    expected = acc.clone()
    weight, scale = _scalar(0.5, torch.float32), _scalar(0.25, torch.float32)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # the side stream is busy when the gradients are made and folded
        made = [None if grad is None else grad * 2 for grad in grads]
        result = _backend().fold_finish_(acc, made, offsets, numels, weight, scale, False)
        _backend().scale_(acc, offsets, numels, weight, None)
    side.synchronize()
    expected_result = reference.fold_finish_(
        expected, [None if grad is None else grad * 2 for grad in grads], offsets, numels, weight, scale, False
    )
    reference.scale_(expected, offsets, numels, weight, None)
    _assert_bitwise(acc, expected)
    torch.testing.assert_close(result[0], expected_result[0], rtol=SUM_RTOL[torch.float32], atol=0)


@pytest.mark.gpu
def test_a_buffer_on_another_device_than_the_current_one():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    with torch.cuda.device(1):
        acc, grads, offsets, numels = _case(torch.float32, "aligned", seed=17)
    expected = acc.clone()
    weight, scale = _scalar(0.5, torch.float32).to(acc.device), _scalar(0.25, torch.float32).to(acc.device)
    with torch.cuda.device(0):
        result = _backend().fold_finish_(acc, grads, offsets, numels, weight, scale, False)
    expected_result = reference.fold_finish_(expected, grads, offsets, numels, weight, scale, False)
    _assert_bitwise(acc, expected)
    torch.testing.assert_close(result[0], expected_result[0], rtol=SUM_RTOL[torch.float32], atol=0)
    assert result[0].device == acc.device


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["fold_", "fold_finish_", "scale_", "scale_ out"])
def test_every_write_is_seen_by_autograd(op):
    """The kernels write through raw pointers; each op bumps the written tensor's version as torch's in-place ops
    do, so a write to a tensor saved for backward is reported."""
    weight = _scalar(0.5, torch.float32)
    grads = [torch.ones(8, device="cuda")]
    acc, out = torch.randn(8, device="cuda"), torch.zeros(8, device="cuda")
    writes = {
        "fold_": (lambda: _backend().fold_(acc, grads, [0], [8], weight, False), acc),
        "fold_finish_": (lambda: _backend().fold_finish_(acc, grads, [0], [8], weight, weight, False), acc),
        "scale_": (lambda: _backend().scale_(acc, [0], [8], weight, None), acc),
        "scale_ out": (lambda: _backend().scale_(acc, [0], [8], weight, out), out),
    }
    write, written = writes[op]
    x = torch.randn(8, device="cuda", requires_grad=True)
    saved = (x * written).sum()  # mul saves ``written`` for x's gradient
    write()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.backward()


@pytest.mark.gpu
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("position", ["first", "middle", "last"])
@pytest.mark.parametrize("accum_dtype", ACCUM_DTYPES, ids=str)
def test_fold_finish_flags_nonfinite(accum_dtype, position, value):
    gen = _generator(11)
    numels = [5, 70001, 8193]
    offsets, size = _layout(numels, "aligned")
    acc = _accumulator(size, offsets, numels, accum_dtype, gen)
    expected = acc.clone()
    grads = [_random(n, torch.bfloat16, gen) for n in numels]
    index = {"first": 0, "middle": numels[1] // 2, "last": numels[1] - 1}[position]
    grads[1][index] = value
    weight, scale = _scalar(1.0, accum_dtype), _scalar(0.5, accum_dtype)

    total, nonfinite = _backend().fold_finish_(acc, grads, offsets, numels, weight, scale, False)
    expected_total, expected_nonfinite = reference.fold_finish_(expected, grads, offsets, numels, weight, scale, False)

    _assert_bitwise(acc, expected)
    assert bool(nonfinite) and bool(expected_nonfinite)
    torch.testing.assert_close(total, expected_total, equal_nan=True)  # inf, or nan for nan and inf - inf


@pytest.mark.gpu
@pytest.mark.parametrize("accum_dtype", ACCUM_DTYPES, ids=str)
def test_fold_finish_on_buffer_through_ops(accum_dtype):
    """The public op on a FlatGradBuffer with backend='cuda' (custom op, dispatch, scalars as numbers)."""
    gen = _generator(3)
    params = [torch.empty(shape, device="cuda") for shape in [(7, 13), (1,), (300, 301), (0,), (4097,)]]
    buffer, expected = FlatGradBuffer(params, accum_dtype), FlatGradBuffer(params, accum_dtype)
    for step in range(3):
        grads = [_random(p.numel(), torch.bfloat16, gen).view(p.shape) for p in params]
        if step < 2:
            ops.fold_(buffer, grads, 2.0, first=step == 0, backend="cuda")
            ops.fold_(expected, grads, 2.0, first=step == 0, backend="reference")
        else:
            result = ops.fold_finish_(buffer, grads, 2.0, 1 / 6, first=False, backend="cuda")
            expected_result = ops.fold_finish_(expected, grads, 2.0, 1 / 6, first=False, backend="reference")
        _assert_bitwise(buffer.data, expected.data)
    torch.testing.assert_close(result[0], expected_result[0], rtol=SUM_RTOL[accum_dtype], atol=0)
    assert bool(result[1]) is False


@pytest.mark.gpu
def test_the_build_has_code_for_the_visible_gpu():
    _built_extension()
    from gafused import cuda_backend

    index = torch.cuda.current_device()
    assert cuda_backend._C.kernel_image_error(index) == ""
    assert ops.backend_unavailable_reason("cuda", torch.device("cuda", index)) is None


@pytest.mark.gpu
def test_a_build_without_code_for_the_gpu_is_unavailable_and_auto_moves_on(monkeypatch):
    """A build for other architectures (made without a GPU for sm_80/sm_90, run on a T4): "auto" must not pick the
    cuda backend, and naming it says how to rebuild."""
    _built_extension()
    from gafused import cuda_backend

    error = "cudaErrorNoKernelImageForDevice: no kernel image is available for execution on the device"
    monkeypatch.setattr(cuda_backend, "_kernel_image_error", lambda index: error)
    device = torch.device("cuda", torch.cuda.current_device())
    reason = ops.backend_unavailable_reason("cuda", device)
    assert reason is not None and error in reason and "TORCH_CUDA_ARCH_LIST=" in reason
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no fused backend left warns when triton is missing too
        assert ops.resolve_backend("auto", device) != "cuda"
    with pytest.raises(RuntimeError, match="TORCH_CUDA_ARCH_LIST="):
        ops.resolve_backend("cuda", device)


@pytest.mark.gpu
def test_fold_past_int32_offsets():
    """Segments that cross and start past element 2**31 of the buffer (int64 offsets in the kernels)."""
    size = 2**31 + 2**16
    if torch.cuda.mem_get_info()[0] < size * 4 + 2**30:
        pytest.skip(f"needs {size * 4 / 2**30 + 1:.0f} GiB of free GPU memory")
    gen = _generator(5)
    numels = [20001, 9000]
    offsets = [2**31 - 10000, 2**31 + 30003]  # windows below do not overlap
    acc = torch.zeros(size, dtype=torch.float32, device="cuda")
    # The reference runs on a small copy holding only the neighbourhood of each segment (the contract does not
    # depend on where a segment lies), so the comparison needs no second 8 GiB buffer.
    margin = 64
    windows = [slice(start - margin, start + numel + margin) for start, numel in zip(offsets, numels, strict=True)]
    local_offsets = [margin, (numels[0] + 2 * margin) + margin]
    expected = torch.cat([acc[window] for window in windows])
    weight, scale = _scalar(0.75, torch.float32), _scalar(0.5, torch.float32)
    for first in (True, False):
        grads = [_random(n, torch.bfloat16, gen) for n in numels]
        _backend().fold_(acc, grads, offsets, numels, weight, first)
        reference.fold_(expected, grads, local_offsets, numels, weight, first)
    grads = [_random(n, torch.bfloat16, gen) for n in numels]
    total, nonfinite = _backend().fold_finish_(acc, grads, offsets, numels, weight, scale, False)
    expected_total, _ = reference.fold_finish_(expected, grads, local_offsets, numels, weight, scale, False)

    _assert_bitwise(torch.cat([acc[window] for window in windows]), expected)
    torch.testing.assert_close(total, expected_total, rtol=SUM_RTOL[torch.float32], atol=0)
    assert not bool(nonfinite)


# --- GPU: sum of squares, scale ---------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("per_segment", [False, True], ids=["total", "per_segment"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("accum_dtype", ACCUM_DTYPES, ids=str)
def test_sum_of_squares_matches_reference_and_repeats_bitwise(accum_dtype, layout, per_segment):
    acc, _, offsets, numels = _case(accum_dtype, layout, seed=21)
    before = acc.clone()
    result = _backend().sum_of_squares(acc, offsets, numels, per_segment)
    again = _backend().sum_of_squares(acc, offsets, numels, per_segment)
    expected = reference.sum_of_squares(acc, offsets, numels, per_segment)

    _assert_bitwise(acc, before)  # read only
    assert result.dtype == accum_dtype and result.shape == expected.shape
    assert torch.equal(result, again)
    torch.testing.assert_close(result, expected, rtol=SUM_RTOL[accum_dtype], atol=0)
    exact = torch.stack([acc[s : s + n].double().square().sum() for s, n in zip(offsets, numels, strict=True)])
    torch.testing.assert_close(
        result.double(), exact if per_segment else exact.sum(), rtol=SUM_RTOL[accum_dtype], atol=0
    )


@pytest.mark.gpu
@pytest.mark.parametrize("accum_dtype", ACCUM_DTYPES, ids=str)
def test_fold_finish_sum_repeats_bitwise(accum_dtype):
    acc, grads, offsets, numels = _case(accum_dtype, "aligned", seed=31)
    start = acc.clone()
    weight, scale = _scalar(0.9, accum_dtype), _scalar(0.25, accum_dtype)
    totals = []
    for _ in range(3):
        acc.copy_(start)
        totals.append(_backend().fold_finish_(acc, grads, offsets, numels, weight, scale, False)[0])
    assert all(torch.equal(totals[0], total) for total in totals[1:])


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("out_dtype", [None, *GRAD_DTYPES], ids=lambda d: "in_place" if d is None else str(d))
@pytest.mark.parametrize("accum_dtype", ACCUM_DTYPES, ids=str)
def test_scale_matches_reference_bitwise(accum_dtype, out_dtype, layout):
    acc, _, offsets, numels = _case(accum_dtype, layout, seed=41)
    expected = acc.clone()
    coef = _scalar(0.3, accum_dtype)
    out = expected_out = None
    if out_dtype is not None:
        # Random contents, so padding that is written (or segments that are not) shows.
        gen = _generator(42)
        out = _random(acc.numel(), out_dtype, gen)
        expected_out = out.clone()

    _backend().scale_(acc, offsets, numels, coef, out)
    reference.scale_(expected, offsets, numels, coef, expected_out)

    _assert_bitwise(acc, expected)
    if out is not None:
        _assert_bitwise(out, expected_out)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["foreach", "triton", "cuda"])
def test_a_scalar_in_the_buffers_own_memory_is_read_before_the_op_writes(backend):
    """tests/test_reference_ops.py's CPU case on a GPU, at 2**24 elements per segment: thousands of programs, most
    of them starting after the first wrote the scalar's element, which a kernel reading the scalar in every program
    would then see changed."""
    reason = ops.backend_unavailable_reason(backend, "cuda")
    if reason is not None:
        pytest.skip(reason)
    own_scalar_case(backend, "cuda", 1 << 24)


# --- GPU: against triton, argument checks --------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("accum_dtype", ACCUM_DTYPES, ids=str)
def test_matches_triton_backend(accum_dtype):
    reason = ops.backend_unavailable_reason("triton", "cuda")
    if reason is not None:
        pytest.skip(f"triton backend unavailable: {reason}")
    from gafused import triton_backend

    acc, grads, offsets, numels = _case(accum_dtype, "aligned", seed=51)
    other = acc.clone()
    weight, scale = _scalar(1.5, accum_dtype), _scalar(0.125, accum_dtype)
    for module, buffer in ((_backend(), acc), (triton_backend, other)):
        module.fold_(buffer, grads, offsets, numels, weight, True)
    result = _backend().fold_finish_(acc, grads, offsets, numels, weight, scale, False)
    expected = triton_backend.fold_finish_(other, grads, offsets, numels, weight, scale, False)
    # Triton may contract multiply-add into one fma (one rounding where the reference has two): a few ulps of
    # the operands' magnitude apart, which is relative error without bound where old + g * w nearly cancels.
    eps = torch.finfo(accum_dtype).eps
    atol = 4 * eps * float(acc.nan_to_num(0.0).abs().max())
    torch.testing.assert_close(acc, other, rtol=4 * eps, atol=atol, equal_nan=True)
    torch.testing.assert_close(result[0], expected[0], rtol=SUM_RTOL[accum_dtype], atol=0)
    assert bool(result[1]) == bool(expected[1])
    torch.testing.assert_close(
        _backend().sum_of_squares(acc, offsets, numels, True),
        triton_backend.sum_of_squares(acc, offsets, numels, True),
        rtol=SUM_RTOL[accum_dtype],
        atol=0,
    )


@pytest.mark.gpu
def test_argument_errors_name_the_argument():
    from gafused import _C

    stream = torch.cuda.current_stream().cuda_stream
    acc = torch.zeros(64, device="cuda")
    weight = _scalar(1.0, torch.float32)
    grad = torch.ones(8, device="cuda")
    cases = [
        (lambda: _C.fold_(acc, [grad.cpu()], [0], [8], weight, True, stream), "grads[0] is on cpu"),
        (lambda: _C.fold_(acc.half(), [grad], [0], [8], weight.half(), True, stream), "acc must be float32 or float64"),
        (lambda: _C.fold_(acc, [grad], [60], [8], weight, True, stream), "ends past"),
        (
            lambda: _C.fold_(acc, [grad, grad], [0, 4], [8, 8], weight, True, stream),
            "segment 1 starts at 4, before segment 0 ends at 8: segments must be ordered and non-overlapping",
        ),
        (lambda: _C.fold_(acc, [grad], [0], [7], weight, True, stream), "grads[0] has 8 elements"),
        (lambda: _C.fold_(acc, [torch.ones(4, 2, device="cuda").t()], [0], [8], weight, True, stream), "contiguous"),
        (lambda: _C.fold_(acc, [grad], [0], [8], weight.cpu(), True, stream), "weight must be on acc's device"),
        (lambda: _C.fold_(acc, [grad.int()], [0], [8], weight, True, stream), "grads[0] must be float32"),
        (lambda: _C.scale_(acc, [0], [8], weight, torch.zeros(63, device="cuda"), stream), "out must be flat"),
        (lambda: _C.sum_of_squares(acc.cpu(), [0], [8], False, stream), "acc must be a CUDA tensor"),
    ]
    for call, message in cases:
        with pytest.raises(RuntimeError, match=re.escape(message)):
            call()


def _cut_at_an_odd_byte(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous CUDA tensor one byte into its storage: legal in torch, but no element is at its alignment."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    storage = torch.zeros(itemsize * numel + 1, dtype=torch.uint8, device="cuda").untyped_storage()
    tensor = torch.empty(0, dtype=dtype, device="cuda").set_(storage[1:], 0, (numel,), (1,))
    assert tensor.is_contiguous() and tensor.data_ptr() % itemsize
    return tensor


@pytest.mark.gpu
@pytest.mark.parametrize("what", ["grad", "out", "acc"])
def test_a_tensor_cut_at_an_odd_byte_is_refused_before_any_launch(what):
    """Its loads would fault (misaligned address), and that error takes the process's CUDA context with it: refused
    with a message, nothing written, and the device still works afterwards."""
    from gafused import _C

    stream = torch.cuda.current_stream().cuda_stream
    acc = torch.full((64,), 3.0, device="cuda")
    weight = _scalar(1.0, torch.float32)
    grad = torch.ones(8, device="cuda")
    out = None
    if what == "grad":
        grad = _cut_at_an_odd_byte(8, torch.float32)
        message = "fold_: grads[0] must start at a multiple of its 4-byte element size"
    elif what == "out":
        out = _cut_at_an_odd_byte(64, torch.bfloat16)
        message = "scale_: out must start at a multiple of its 2-byte element size"
    else:
        acc = _cut_at_an_odd_byte(64, torch.float32)
        message = "fold_: acc must start at a multiple of its 4-byte element size"
    # Compared as bytes of the whole storage: torch's own kernels would fault on the misaligned tensor too.
    acc_bytes = torch.empty(0, dtype=torch.uint8, device="cuda").set_(acc.untyped_storage())
    before = acc_bytes.clone()
    with pytest.raises(RuntimeError, match=re.escape(message)):
        if what == "out":
            _C.scale_(acc, [0], [8], weight, out, stream)
        else:
            _C.fold_(acc, [grad], [0], [8], weight, False, stream)
    torch.cuda.synchronize()  # no launch happened, so no sticky error is waiting here
    assert torch.equal(acc_bytes, before)
    assert torch.ones(3, device="cuda").sum().item() == 3.0


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["reference", "foreach"])
def test_a_gpu_weight_for_a_cpu_buffer_is_read_once_it_has_arrived(backend):
    """A 0-d CUDA weight for a CPU buffer crosses to the CPU: the fold must see its value, not the memory the copy
    has yet to fill while the stream is busy."""
    buffer = FlatGradBuffer([torch.empty(1000)])
    for trial in range(5):
        torch.cuda._sleep(200_000_000)  # keeps the stream busy: a copy queued behind it has not run yet
        weight = torch.full((), 3.0 + trial, device="cuda")
        ops.fold_(buffer, [torch.ones(1000)], weight, first=True, backend=backend)
        assert torch.equal(buffer.data[:1000], torch.full((1000,), 3.0 + trial))
