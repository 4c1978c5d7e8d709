"""The ``torch.ops.gafused`` custom ops as torch.compile sees them, checked by ``torch.library.opcheck``.

A custom op whose schema says less than it does (a tensor it writes but does not list in ``mutates_args``, an
output that aliases an input) or whose fake implementation disagrees with the real one (shape, dtype, device)
is silently miscompiled: functionalization reorders or drops the write. ``opcheck`` runs each op for real and
under fake tensors and AOT dispatch, and compares schema, mutations and outputs. Every backend that runs on
CPU is checked (triton through its interpreter), with gradients of every dtype the ops take, a missing gradient,
an fp64 buffer, and ``out=`` for ``scale_``.
"""

from __future__ import annotations

import pytest
import torch

from gafused import ops

OFFSETS = [0, 16, 32, 48]
NUMELS = [12, 8, 5, 16]


def _grads(dtype: torch.dtype) -> list[torch.Tensor | None]:
    generator = torch.Generator().manual_seed(0)
    shapes = [(3, 4), None, (5,), (4, 4)]
    return [None if shape is None else torch.randn(shape, generator=generator).to(dtype) for shape in shapes]


def _cases(backend: str, accum_dtype: torch.dtype, grad_dtype: torch.dtype):
    acc = torch.randn(64, generator=torch.Generator().manual_seed(1), dtype=accum_dtype)
    weight = torch.tensor(0.75, dtype=accum_dtype)
    scale = torch.tensor(1 / 3, dtype=accum_dtype)
    grads = _grads(grad_dtype)
    out = torch.zeros(64, dtype=torch.bfloat16)
    return {
        "fold_ first": (ops._fold_op, (acc.clone(), grads, OFFSETS, NUMELS, weight, True, backend)),
        "fold_ middle": (ops._fold_op, (acc.clone(), grads, OFFSETS, NUMELS, weight, False, backend)),
        "fold_finish_": (ops._fold_finish_op, (acc.clone(), grads, OFFSETS, NUMELS, weight, scale, False, backend)),
        "sum_of_squares": (ops._sum_of_squares_op, (acc.clone(), OFFSETS, NUMELS, False, backend)),
        "sum_of_squares per segment": (ops._sum_of_squares_op, (acc.clone(), OFFSETS, NUMELS, True, backend)),
        "scale_": (ops._scale_op, (acc.clone(), OFFSETS, NUMELS, scale, None, backend)),
        "scale_ out": (ops._scale_op, (acc.clone(), OFFSETS, NUMELS, scale, out, backend)),
    }


@pytest.mark.parametrize("accum_dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("grad_dtype", sorted(ops.GRAD_DTYPES, key=str), ids=str)
def test_every_op_passes_opcheck(backend, accum_dtype, grad_dtype):
    failures = {}
    for name, (op, args) in _cases(backend, accum_dtype, grad_dtype).items():
        results = torch.library.opcheck(op, args, raise_exception=False)
        bad = {check: result for check, result in results.items() if result != "SUCCESS"}
        if bad:
            failures[name] = bad
    assert not failures, failures


def test_opcheck_catches_an_undeclared_mutation():
    """The check above can fail: an op that writes a tensor its schema does not list is reported."""

    @torch.library.custom_op("gafused_test::undeclared_scale_", mutates_args=())
    def undeclared(acc: torch.Tensor, coef: float) -> torch.Tensor:
        acc.mul_(coef)
        return acc.sum()

    @undeclared.register_fake
    def _(acc, coef):
        return acc.new_empty(())

    results = torch.library.opcheck(undeclared, (torch.randn(8), 0.5), raise_exception=False)
    assert results["test_schema"] != "SUCCESS"


def _writes(module, acc: torch.Tensor, out: torch.Tensor) -> dict:
    """Each eager op that writes, called on the backend module itself, with the tensor it writes."""
    weight = torch.tensor(0.75, dtype=acc.dtype)
    grads = _grads(torch.bfloat16)
    return {
        "fold_": (lambda: module.fold_(acc, grads, OFFSETS, NUMELS, weight, False), acc),
        "fold_finish_": (lambda: module.fold_finish_(acc, grads, OFFSETS, NUMELS, weight, weight, False), acc),
        "scale_": (lambda: module.scale_(acc, OFFSETS, NUMELS, weight, None), acc),
        "scale_ out": (lambda: module.scale_(acc, OFFSETS, NUMELS, weight, out), out),
    }


def test_every_eager_write_is_seen_by_autograd(backend):
    """A kernel writing through a raw pointer bumps the tensor's version as torch's in-place ops do, so a write to a
    tensor saved for backward is reported instead of giving a wrong gradient silently."""
    module = ops._backend_for(torch.zeros(1), backend)
    for name in ("fold_", "fold_finish_", "scale_", "scale_ out"):
        write, written = _writes(module, torch.randn(64), torch.zeros(64))[name]
        x = torch.randn(64, requires_grad=True)
        saved = (x * written).sum()  # mul saves ``written`` for x's gradient
        write()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            saved.backward()


OVERLAPPING = {
    "overlap": ([0, 10], [16, 8], "ordered and non-overlapping"),
    "out of order": ([32, 0], [8, 8], "ordered and non-overlapping"),
    "past the end": ([0, 60], [8, 8], "outside acc"),
    "negative offset": ([0, -4], [8, 8], r"negative offset or numel \(-4, 8\)"),
    "negative numel": ([0, 16], [8, -4], r"negative offset or numel \(16, -4\)"),
}


@pytest.mark.parametrize("offsets, numels, refusal", OVERLAPPING.values(), ids=OVERLAPPING.keys())
def test_every_backend_refuses_a_layout_of_overlapping_or_outside_segments(backend, offsets, numels, refusal):
    """``FlatGradBuffer`` never builds such layouts; called directly, no backend folds them (two blocks of a GPU
    launch would race on an overlap) and a refused call writes nothing. Each layout is refused for its own fault."""
    module = ops._backend_for(torch.zeros(1), backend)
    acc = torch.randn(64)
    before = acc.clone()
    grads = [torch.ones(n if n > 0 else 1) for n in numels]
    weight = torch.tensor(0.5)
    calls = {
        "fold_": lambda: module.fold_(acc, grads, offsets, numels, weight, False),
        "fold_finish_": lambda: module.fold_finish_(acc, grads, offsets, numels, weight, weight, False),
        "sum_of_squares": lambda: module.sum_of_squares(acc, offsets, numels, False),
        "scale_": lambda: module.scale_(acc, offsets, numels, weight, None),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=rf"segment 1 .*{refusal}"):
            call()
        assert torch.equal(acc, before), name


def _odd_float32(numel: int) -> torch.Tensor:
    """A contiguous float32 tensor whose memory starts one byte into its storage (GPU kernels fault on it)."""
    storage = torch.zeros(4 * numel + 1, dtype=torch.uint8).untyped_storage()
    return torch.empty(0).set_(storage[1:], 0, (numel,), (1,))


def test_called_directly_every_op_refuses_tensors_its_backend_would_address_out_of_place(backend):
    """``torch.ops.gafused.*`` called directly skip ``check_grads`` (the caller vouches for the gradients, as with
    ``check=False``), but a backend reads ``numels[i]`` elements of ``grads[i]`` from its first address and writes
    ``acc`` (and ``out``) as one run of memory: a shorter gradient would be read past its end, a strided ``acc``
    written where its elements are not. Each is refused, by name, before anything is written."""
    grads, offsets, numels = [torch.ones(8), torch.ones(4)], [0, 8], [8, 4]
    weight, scale = torch.tensor(0.5), torch.tensor(2.0)

    def calls(acc, grads=grads, out=None):
        return {
            "fold_": lambda: ops._fold_op(acc, grads, offsets, numels, weight, False, backend),
            "fold_finish_": lambda: ops._fold_finish_op(acc, grads, offsets, numels, weight, scale, False, backend),
            "sum_of_squares": lambda: ops._sum_of_squares_op(acc, offsets, numels, False, backend),
            "scale_": lambda: ops._scale_op(acc, offsets, numels, scale, out, backend),
        }

    storage = torch.randn(24)
    cases = {  # what each op is given -> the refusal, and the memory that must stay as it was
        "strided acc": (calls(storage[::2]), r"acc must be a contiguous 1-D .* strides \(2,\)"),
        "2-D acc": (calls(storage[:12].view(3, 4)), r"acc must be a contiguous 1-D .* shape \(3, 4\)"),
        "float16 acc": (calls(torch.zeros(12, dtype=torch.float16)), r"acc must be .* got torch\.float16"),
        "acc cut at an odd byte": (calls(_odd_float32(12)), r"acc must start at a multiple of its 4-byte element size"),
    }
    acc = storage[:12]
    bad_grads = {
        "short gradient": ([torch.ones(8), torch.ones(3)], r"grads\[1\] must have numels\[1\] = 4 elements, got 3"),
        "long gradient": ([torch.ones(9), torch.ones(4)], r"grads\[0\] must have numels\[0\] = 8 elements, got 9"),
        "int gradient": ([torch.ones(8, dtype=torch.int32), None], r"grads\[0\] must be a dense .* got .*int32"),
        "sparse gradient": ([torch.ones(8).to_sparse(), None], r"grads\[0\] must be a dense .* got torch\.sparse_coo"),
    }
    for name, (given, refusal) in bad_grads.items():
        everything = calls(acc, given)
        cases[name] = ({op: everything[op] for op in ("fold_", "fold_finish_")}, refusal)
    bad_outs = {
        "strided out": (torch.zeros(24)[::2], r"out must be a contiguous 1-D .* got .* shape \(12,\)"),
        "short out": (torch.zeros(11), r"out must be .* of 12 elements .* shape \(11,\)"),
        "2-D out": (torch.zeros(3, 4), r"out must be a contiguous 1-D .* shape \(3, 4\)"),
        "float8 out": (torch.zeros(12, dtype=torch.float8_e4m3fn), r"out must be .* got torch\.float8_e4m3fn"),
        "out cut at an odd byte": (_odd_float32(12), r"out must be .* aligned to its element size"),
    }
    for name, (out, refusal) in bad_outs.items():
        cases[name] = ({"scale_": calls(acc, out=out)["scale_"]}, refusal)
    before = storage.clone()
    for case, (ops_called, refusal) in cases.items():
        for op, call in ops_called.items():
            with pytest.raises(ValueError, match=refusal):
                call()
            assert torch.equal(storage, before), f"{case}: {op} wrote before refusing"
    # A gradient on another device (a CUDA one would be read at an address of the wrong device); a meta tensor
    # stands for it here, checked by the function each op calls (the dispatcher sends a call holding a meta tensor
    # to the ops' fake implementations).
    with pytest.raises(ValueError, match=r"grads\[1\] must be .* on cpu, got .* meta"):
        ops._check_op_tensors(acc, [None, torch.ones(4, device="meta")], numels)
    with pytest.raises(ValueError, match=r"out must be .* on cpu.* got torch\.float32 of shape \(12,\) on meta"):
        ops._check_op_tensors(acc, out=torch.zeros(12, device="meta"))
    for out, _ in bad_outs.values():  # (the odd view's storage starts zero, as every other out does)
        assert not out.view(torch.uint8).any() if out.dtype.itemsize == 1 else not out.any()


def test_called_directly_every_op_refuses_a_scalar_its_backend_would_misread_and_reads_one_in_its_memory_first(
    backend,
):
    """A backend reads one value of ``acc``'s dtype at a scalar's address: an empty weight was read past its end
    (the Triton interpreter crashed), a 1-D one taken for its first element, a sparse one has no strided memory (the
    reference backend scaled a segment to 0). Each scalar that is not a 0-d tensor of
    acc's dtype on its device (what ``gafused.ops`` hands the ops) is refused by name, nothing written. A scalar in
    the memory the op writes (a 0-d view of acc: what a compiled ``gafused.ops`` call passes when given one, no
    tensor having memory to copy while tracing) is read before the op writes, as in eager; an out in acc's memory is
    refused."""
    offsets, numels = [0, 8], [8, 4]
    grads = [torch.full((8,), 0.5), torch.full((4,), -1.0)]
    acc = torch.arange(1.0, 13.0)
    before = acc.clone()
    one = torch.tensor(1.0)
    for shown, bad in {
        "empty": torch.empty(0),
        "1-D": torch.tensor([3.0, 5.0]),
        "int64": torch.tensor(3),
        "float64": torch.tensor(3.0, dtype=torch.float64),
        "sparse": torch.tensor(3.0).to_sparse(),
    }.items():
        calls = {
            "weight": lambda bad=bad: ops._fold_op(acc, grads, offsets, numels, bad, False, backend),
            "scale": lambda bad=bad: ops._fold_finish_op(acc, grads, offsets, numels, one, bad, False, backend),
            "coef": lambda bad=bad: ops._scale_op(acc, offsets, numels, bad, None, backend),
        }
        for name, call in calls.items():
            with pytest.raises(ValueError, match=rf"{name} must be a dense 0-d torch.float32 tensor on cpu"):
                call()
            assert torch.equal(acc, before), f"{shown} {name}"
    with pytest.raises(ValueError, match="out shares memory with the buffer"):
        ops._scale_op(acc, offsets, numels, one, acc.view(torch.bfloat16)[:12], backend)
    assert torch.equal(acc, before)
    flat = torch.cat(grads)
    ops._fold_op(acc, grads, offsets, numels, acc[1], False, backend)  # weight 2, read before acc[1] changes
    assert torch.equal(acc, before + 2.0 * flat)
    expected = (acc + acc[3] * flat) * acc[0]
    total, _ = ops._fold_finish_op(acc, grads, offsets, numels, acc[3], acc[0], False, backend)
    assert torch.equal(acc, expected) and torch.equal(total, expected.double().square().sum().float())
    expected = acc * acc[5]
    ops._scale_op(acc, offsets, numels, acc[5], None, backend)
    assert torch.equal(acc, expected)


def test_called_directly_scale_reads_a_coefficient_in_outs_memory_before_it_writes(backend):
    """A coef that is a 0-d view of ``out`` (what a compiled call passes when given one): read before the op writes
    out, as in eager, so every element is scaled by its value."""
    offsets, numels = [0, 8], [8, 4]
    acc = torch.arange(1.0, 13.0)
    out = torch.full((12,), 3.0)
    ops._scale_op(acc, offsets, numels, out[2], out, backend)
    assert torch.equal(out, torch.arange(1.0, 13.0) * 3.0)
    assert torch.equal(acc, torch.arange(1.0, 13.0))


def test_op_scalars_refuses_a_scalar_on_another_device():
    """A backend reads a scalar at its address on acc's device: one elsewhere (a CPU scalar for a CUDA acc) is refused
    by name. On CPU the op itself cannot be handed a meta scalar (the dispatcher runs its fake implementation), so the
    check is called directly."""
    acc = torch.arange(1.0, 13.0)
    with pytest.raises(ValueError, match=r"coef must be a dense 0-d torch.float32 tensor on cpu .*on meta"):
        ops._op_scalars(acc, None, coef=torch.tensor(2.0, device="meta"))
    (same,) = ops._op_scalars(acc, None, coef=torch.tensor(2.0))
    assert same.device == acc.device
