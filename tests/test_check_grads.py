"""ops.check_grads once a buffer has recorded the layout of accepted gradients: lists laid out the same way are
matched in one call, and every other list, bad gradients included, is still checked, named and refused exactly as
the per-gradient path does, before anything changes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gafused import FlatGradBuffer, GradAccumulator, ops

SHAPES = [(3, 5), (7,), (2, 3, 4)]
NAMES = ["layer0.weight", "layer1.bias", "layer2.weight"]


def _buffer(channels_last: bool = False) -> FlatGradBuffer:
    """Three parameters; with ``channels_last`` the last one is a channels_last 4-d parameter."""
    last = torch.empty(2, 3, 4, 5).to(memory_format=torch.channels_last) if channels_last else torch.empty(SHAPES[2])
    return FlatGradBuffer([torch.empty(SHAPES[0]), torch.empty(SHAPES[1]), last])


def _grads(buffer: FlatGradBuffer, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    grads = []
    for param in buffer.params:
        grad = torch.randn(param.shape, generator=generator)
        grads.append(torch.empty_like(param).copy_(grad))  # the parameter's strides, as autograd gives them
    return grads


def _recorded(buffer: FlatGradBuffer) -> list:
    """Check one list of good gradients, then another laid out the same way; the shapes both share show that the
    second was matched against the layout the first recorded."""
    first = ops.check_grads(buffer, _grads(buffer, 1))
    second = ops.check_grads(buffer, _grads(buffer, 2))
    assert first.shapes is not None and second.shapes is first.shapes
    return second.shapes


def test_torch_provides_the_tensor_check_the_fast_path_uses():
    # If a torch release drops or changes it, check_grads still works (per gradient) but loses its speed.
    assert ops._TensorGuards is not None, "torch._C._dynamo.guards.TensorGuards is missing or answers differently"


def test_a_tensor_check_that_is_missing_or_answers_differently_is_not_used(monkeypatch):
    """The fast path takes torch's private TensorGuards only where it gives the answers check_grads relies on: a
    guard that also matches a tensor of another dtype, one that fails when built, or none at all leaves it off."""
    guards = pytest.importorskip("torch._C._dynamo.guards")
    real = guards.TensorGuards

    class MatchesEverything:
        def __init__(self, *tensors, **kwargs):
            pass

        def check(self, *tensors):
            return True

    class FailsWhenBuilt:
        def __init__(self, *tensors, **kwargs):
            raise RuntimeError("no guards here")

    assert ops._load_tensor_guards() is real
    for replacement in (MatchesEverything, FailsWhenBuilt):
        monkeypatch.setattr(guards, "TensorGuards", replacement)
        assert ops._load_tensor_guards() is None, replacement.__name__
    monkeypatch.delattr(guards, "TensorGuards")
    assert ops._load_tensor_guards() is None


def test_gradients_laid_out_like_the_recorded_ones_come_back_as_given():
    buffer = _buffer()
    _recorded(buffer)
    grads = _grads(buffer, 3)
    checked = ops.check_grads(buffer, grads)
    assert all(got is given for got, given in zip(checked, grads, strict=True))


NOT_REAL = "gradients must be real floating point"
BAD = {
    "numel": (lambda good: torch.randn(good.numel() + 1), ValueError, "the gradient has 8 elements, its segment 7"),
    "integer": (lambda good: torch.ones(good.shape, dtype=torch.int32), ValueError, NOT_REAL),
    "complex": (lambda good: torch.ones(good.shape, dtype=torch.complex64), ValueError, NOT_REAL),
    "sparse": (lambda good: good.to_sparse(), ValueError, "sparse gradients are not supported"),
    "meta": (lambda good: torch.empty(good.shape, device="meta"), ValueError, "the gradient is on meta, the buffer"),
    "not_a_tensor": (lambda good: "grad", TypeError, "a gradient must be a tensor or None, got str"),
}


@pytest.mark.parametrize(("make", "error", "message"), BAD.values(), ids=BAD.keys())
def test_a_bad_gradient_after_a_recorded_layout_is_named_and_refused(make, error, message):
    buffer = _buffer()
    _recorded(buffer)
    grads = _grads(buffer, 3)
    grads[1] = make(grads[1])
    with pytest.raises(error, match=f"layer1.bias: {message}"):
        ops.check_grads(buffer, grads, names=NAMES)
    before = buffer.data.clone()
    with pytest.raises(error, match=message):
        ops.fold_(buffer, grads, 1.0, first=False, backend="foreach")
    assert torch.equal(buffer.data, before)


def test_gradients_that_differ_from_the_recorded_layout_are_still_converted():
    buffer = _buffer()
    shapes = _recorded(buffer)
    with_graph = torch.randn(3, 5, requires_grad=True) * 2
    other_dtype = torch.randn(7, dtype=torch.bfloat16)
    strided = torch.randn(4, 3, 2).permute(2, 1, 0)
    checked = ops.check_grads(buffer, [with_graph, other_dtype, strided])
    assert checked.shapes is not shapes  # not matched: checked gradient by gradient
    assert not checked[0].requires_grad and torch.equal(checked[0], with_graph.detach())
    assert checked[1] is other_dtype
    assert checked[2].is_contiguous() and torch.equal(checked[2], strided)


def test_missing_gradients_are_matched_by_position():
    buffer = _buffer()
    grads = _grads(buffer, 1)
    first = ops.check_grads(buffer, [grads[0], None, grads[2]])
    again = ops.check_grads(buffer, [grads[0], None, grads[2]])
    assert again.shapes is first.shapes and again[1] is None
    moved = ops.check_grads(buffer, [None, grads[1], grads[2]])  # a gradient where None was, and the reverse
    assert moved[0] is None and moved[1] is grads[1] and moved.shapes is not first.shapes
    twice = torch.randn(7)
    shared = ops.check_grads(buffer, [grads[0], twice, grads[2]])
    assert shared[1] is twice


def test_one_tensor_for_two_segments_is_accepted_every_time():
    buffer = FlatGradBuffer([torch.empty(4), torch.empty(4)])
    grad = torch.randn(4)
    for _ in range(2):
        checked = ops.check_grads(buffer, [grad, grad])
        assert checked[0] is grad and checked[1] is grad
    ops.fold_(buffer, [grad, grad], 1.0, first=True, backend="foreach")
    assert torch.equal(buffer.segment(1), grad)


def test_channels_last_gradients_come_back_in_memory_order_on_both_paths():
    buffer = _buffer(channels_last=True)
    assert buffer.permuted == {2}
    _recorded(buffer)
    grads = _grads(buffer, 3)
    checked = ops.check_grads(buffer, grads)
    # Matched: a flat view of the gradient's own memory, no copy.
    assert checked[2].shape == (120,) and checked[2].data_ptr() == grads[2].data_ptr()
    assert torch.equal(checked[2], grads[2].permute(0, 2, 3, 1).reshape(-1))
    row_major = grads[2].contiguous()
    reordered = ops.check_grads(buffer, [grads[0], grads[1], row_major])
    assert torch.equal(reordered[2], checked[2]) and reordered[2].data_ptr() != row_major.data_ptr()


@pytest.mark.parametrize("backend", ["reference", "foreach"])
def test_row_major_gradients_of_a_channels_last_segment_are_reordered_every_time(backend):
    """A row-major gradient of a channels_last segment is copied into the segment's memory order: a list that needed
    such a copy is not recorded as accepted as given, so the next list like it is reordered again, not folded as it
    lies. Three folds against their float64 sum."""
    buffer = FlatGradBuffer([torch.empty(2, 3, 2, 2).contiguous(memory_format=torch.channels_last)])
    generator = torch.Generator().manual_seed(5)
    grads = [torch.randn(2, 3, 2, 2, generator=generator) for _ in range(3)]
    for index, grad in enumerate(grads):
        ops.fold_(buffer, [grad], 1.0, first=index == 0, backend=backend)
    truth = sum(grad.double() for grad in grads)
    torch.testing.assert_close(buffer.view(0).double(), truth, rtol=1e-6, atol=1e-6)


def test_tensor_subclasses_are_checked_each_time():
    buffer = _buffer()
    grads = [torch.nn.Parameter(grad) for grad in _grads(buffer, 1)]
    first = ops.check_grads(buffer, grads)
    assert first.shapes is None and ops.check_grads(buffer, grads).shapes is None
    grads[0] = torch.nn.Parameter(torch.randn(4))
    with pytest.raises(ValueError, match="elements"):
        ops.check_grads(buffer, grads)


def test_without_torchs_tensor_check_every_gradient_is_checked(monkeypatch):
    monkeypatch.setattr(ops, "_TensorGuards", None)
    buffer = _buffer()
    for seed in (1, 2):
        checked = ops.check_grads(buffer, _grads(buffer, seed))
        assert checked.shapes is None
    grads = _grads(buffer, 3)
    grads[0] = torch.randn(16)
    with pytest.raises(ValueError, match="layer0.weight: the gradient has 16 elements, its segment 15"):
        ops.check_grads(buffer, grads, names=NAMES)


def test_accumulator_steps_match_the_reference_once_layouts_are_recorded():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    reference = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    reference.load_state_dict(model.state_dict())
    fast = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 3, backend="foreach")
    slow = GradAccumulator(torch.optim.SGD(reference.parameters(), lr=0.1), 3, backend="reference")
    for step in range(7):
        x = torch.randn(5, 4)
        for net, opt in ((model, fast), (reference, slow)):
            net(x).square().mean().backward()
            if step == 4:  # a bad gradient in the middle of a window: refused, nothing folded
                first = next(net.parameters())
                good, first.grad = first.grad, first.grad.to_sparse()  # the grad setter lets a sparse one through
                with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\].*sparse"):
                    opt.step(weight=step + 1)
                first.grad = good
            opt.step(weight=step + 1)
    for got, expected in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


def test_a_compiled_fold_checks_gradient_by_gradient():
    buffer = FlatGradBuffer([torch.empty(5), torch.empty(3)])
    grads = [torch.randn(5), torch.randn(3)]
    ops.check_grads(buffer, grads)  # records the layout eagerly; the traced call must not use it

    def fold(g0, g1):
        ops.fold_(buffer, [g0, g1], 2.0, first=True, backend="reference")

    torch.compile(fold, backend="eager")(*grads)
    torch.testing.assert_close(torch.cat([buffer.segment(0), buffer.segment(1)]), torch.cat(grads) * 2)
    with pytest.raises(ValueError, match="elements"):
        torch.compile(fold, backend="eager")(torch.randn(4), grads[1])


def test_a_channels_last_gradient_of_another_shape_is_refused_before_anything_changes():
    # Its elements have no defined place in the parameter's memory order (a (5, 4, 3, 2) tensor given the
    # strides of a (2, 3, 4, 5) channels_last one would leave holes): refused on both paths, nothing folded.
    buffer = _buffer(channels_last=True)
    for recorded in (False, True):
        if recorded:
            _recorded(buffer)
        grads = _grads(buffer, 3)
        grads[2] = torch.randn(5, 4, 3, 2)
        before = buffer.data.clone()
        with pytest.raises(ValueError, match=r"layer2.weight: the gradient has shape \(5, 4, 3, 2\).*\(2, 3, 4, 5\)"):
            ops.check_grads(buffer, grads, names=NAMES)
        with pytest.raises(ValueError, match=r"grads\[2\]: the gradient has shape"):
            ops.fold_(buffer, grads, 1.0, first=False, backend="foreach")
        assert torch.equal(buffer.data, before)


@pytest.mark.parametrize("backend", ["reference", "foreach", "triton"])
def test_a_lazily_negated_gradient_folds_its_values(backend):
    # torch._neg_view keeps the memory and a negative bit: the values folded are the negated ones (a kernel
    # reading the raw memory would fold the values before negation).
    reason = ops.backend_unavailable_reason(backend, torch.device("cpu"))
    if reason is not None:
        pytest.skip(f"{backend}: {reason}")
    buffer = _buffer()
    _recorded(buffer)
    grads = _grads(buffer, 3)
    negated = torch._neg_view(grads[1])
    assert negated.is_neg()
    checked = ops.check_grads(buffer, [grads[0], negated, grads[2]])
    assert not checked[1].is_neg() and torch.equal(checked[1], -grads[1])
    ops.fold_(buffer, [grads[0], negated, grads[2]], 1.0, first=True, backend=backend)
    assert torch.equal(buffer.segment(1), -grads[1])


def test_a_gradient_that_is_a_view_of_the_buffer_is_refused_and_changes_nothing(backend):
    """The fold would read what it writes (a finished gradient handed out as p.grad, passed back as a new one):
    every backend refuses it, naming it, before any segment is written."""
    buffer = FlatGradBuffer([torch.zeros(4), torch.zeros(3)])
    buffer.data.copy_(torch.arange(float(buffer.data.numel())))
    before = buffer.data.clone()
    for aliased in (buffer.view(1), buffer.data[2:5]):
        with pytest.raises(ValueError, match=r"grads\[1\] shares memory with the buffer"):
            ops.fold_(buffer, [torch.ones(4), aliased], 2.0, first=False, backend=backend)
        assert torch.equal(buffer.data, before)
    ops.fold_(buffer, [torch.ones(4), buffer.view(1).clone()], 2.0, first=False, backend=backend)  # a copy folds


def test_the_registered_ops_refuse_lists_of_other_lengths(backend):
    """torch.ops.gafused.* skip check_grads (what gafused.ops runs first), but a backend given a shorter gradient
    list than the layout would read past its end (triton did, and wrote the segment)."""
    acc = torch.zeros(8)
    before = acc.clone()
    with pytest.raises(ValueError, match="one entry per segment, got 1, 2 and 2"):
        torch.ops.gafused.fold_(acc, [torch.ones(4)], [0, 4], [4, 4], torch.tensor(1.0), False, backend)
    assert torch.equal(acc, before)


def test_a_layout_of_no_segments_is_a_no_op_on_every_backend(backend):
    acc = torch.zeros(0)
    one = torch.tensor(1.0)
    total, bad = torch.ops.gafused.fold_finish_(acc, [], [], [], one, one, False, backend)
    assert total.item() == 0 and not bad.item()
    torch.ops.gafused.scale_(acc, [], [], one, None, backend)
    per_segment = torch.ops.gafused.sum_of_squares(acc, [], [], True, backend)
    assert per_segment.shape == (0,) and per_segment.dtype == acc.dtype
    total = torch.ops.gafused.sum_of_squares(acc, [], [], False, backend)
    assert total.shape == () and total.dtype == acc.dtype and total.item() == 0


@pytest.mark.parametrize(
    "out, error, message",
    [
        (1.0, TypeError, "out must be a torch.Tensor or None, got float"),
        (torch.zeros(7, requires_grad=True), ValueError, "out must not require grad"),
    ],
)
def test_scale_refuses_an_out_that_is_no_tensor_or_requires_grad(backend, out, error, message):
    buffer = FlatGradBuffer([torch.zeros(4), torch.zeros(3)])
    with pytest.raises(error, match=message):
        ops.scale_(buffer, 0.5, out=out, backend=backend)


@pytest.mark.parametrize(
    "view", [lambda data: data, lambda data: data.view(torch.bfloat16)[: data.numel()]], ids=["itself", "bf16-view"]
)
def test_scale_refuses_an_out_in_the_buffers_memory(backend, view):
    """A fused kernel's blocks would write what others still read (a bf16 view's element k overlays fp32 element
    k / 2); refused on every backend, the buffer left as it was."""
    buffer = FlatGradBuffer([torch.zeros(4), torch.zeros(3)])
    buffer.data.copy_(torch.arange(buffer.numel, dtype=torch.float32))
    before = buffer.data.clone()
    with pytest.raises(ValueError, match="out shares memory with the buffer"):
        ops.scale_(buffer, 0.5, out=view(buffer.data), backend=backend)
    assert torch.equal(buffer.data, before)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda b: ops.fold_(b.data, [None, None], first=True), TypeError, "buffer must be a gafused.FlatGradBuffer"),
        (lambda b: ops.sum_of_squares([b]), TypeError, "buffer must be a gafused.FlatGradBuffer, got list"),
        (lambda b: ops.fold_(b, None, first=True), TypeError, "grads must be a list .* got NoneType"),
        (lambda b: ops.check_grads(b, [torch.zeros(4), 1.0], names=["w"]), ValueError, "names must name every"),
        (lambda b: ops.norm(b, per_segment="yes"), TypeError, "per_segment must be a bool, got str"),
    ],
)
def test_bad_arguments_of_the_ops_are_named(call, error, message):
    buffer = FlatGradBuffer([torch.zeros(4), torch.zeros(3)])
    with pytest.raises(error, match=message):
        call(buffer)


@pytest.mark.parametrize(
    "param, kwargs, message",
    [
        (torch.zeros(4, dtype=torch.float8_e4m3fn), {}, r"params\[0\] must be float16, bfloat16, float32 or float64"),
        (torch.zeros(4).to_sparse(), {}, r"params\[0\] must be a dense \(strided\) tensor"),
        (torch.zeros(4), {"alignment_bytes": 64.0}, "alignment_bytes must be a power of two >= 16, got 64.0"),
    ],
)
def test_buffers_the_ops_could_not_fold_into_are_refused_at_construction(param, kwargs, message):
    with pytest.raises(ValueError, match=message):
        FlatGradBuffer([param], **kwargs)


def test_alignment_bytes_may_be_any_integer():
    buffer = FlatGradBuffer([torch.zeros(3), torch.zeros(5)], alignment_bytes=np.int64(64))
    assert buffer.alignment_bytes == 64 and type(buffer.alignment_bytes) is int and buffer.offsets == [0, 16]


def _layouts(numel):
    strided = torch.full((2 * numel,), -7.0)
    return {
        "2-D": (
            torch.full((1, numel), -7.0),
            r"out must be a flat tensor of \d+ elements on cpu, got shape \(1, \d+\)",
        ),
        "meta": (torch.empty(numel, device="meta"), r"out must be a flat tensor .* on cpu, got .* on meta"),
        "strided": (strided[::2], r"out must be a contiguous .* \(not contiguous\)"),
    }


@pytest.mark.parametrize("kind", ["2-D", "meta", "strided"])
def test_scale_refuses_an_out_without_the_buffers_flat_layout_before_writing(backend, kind):
    """``out`` must be laid out like the buffer (flat, contiguous, on its device): a kernel writing segment offsets
    through its pointer would scatter the values elsewhere. Refused on every backend, nothing written."""
    buffer = FlatGradBuffer([torch.zeros(4), torch.zeros(3)])
    buffer.data.copy_(torch.arange(buffer.numel, dtype=torch.float32))
    before = buffer.data.clone()
    out, message = _layouts(buffer.numel)[kind]
    base = out if out._base is None else out._base
    written = None if out.is_meta else base.clone()
    with pytest.raises(ValueError, match=message):
        ops.scale_(buffer, 0.5, out=out, backend=backend)
    assert torch.equal(buffer.data, before)
    if written is not None:
        assert torch.equal(base, written)


def test_to_device_copies_when_asked_even_where_nothing_would_change():
    """copy=True is how the accumulator keeps a micro-batch's weight when the caller reuses the tensor (a token
    counter changed in place later): the result must be a copy even when device and dtype already match."""
    value = torch.tensor(3.0, dtype=torch.float64)
    copied = ops.to_device(value, torch.device("cpu"), torch.float64, copy=True)
    value.fill_(5.0)
    assert copied.item() == 3.0
    assert ops.to_device(value, torch.device("cpu"), torch.float64) is value  # no copy unless asked


def _shaped_buffer(shapes, accum_dtype=torch.float32):
    return FlatGradBuffer([torch.empty(shape) for shape in shapes], accum_dtype=accum_dtype)


@pytest.mark.parametrize(
    ("weight", "error", "message"),
    [
        (torch.tensor(1.0 + 2.0j), ValueError, "weight must be a real number, got dtype torch.complex64"),
        (torch.tensor(True), ValueError, "weight must be a real number, got dtype torch.bool"),
        (torch.tensor(2.0, device="meta"), ValueError, "weight must hold a value, got a tensor on the meta device"),
        (True, TypeError, "weight must be a real number or a 0-d tensor, got bool"),
    ],
    ids=["complex", "bool-tensor", "meta", "bool"],
)
def test_ops_refuse_a_scalar_that_is_no_real_value_before_writing(backend, weight, error, message):
    """A complex weight would lose its imaginary part in the cast, a bool would count as 0 or 1, a meta tensor has
    no value to copy: each is refused, naming the scalar, with nothing written."""
    buffer = _shaped_buffer([(3,), (2,)])
    grads = [torch.ones(3), torch.ones(2)]
    ops.fold_(buffer, grads, 1.0, first=True, backend="reference")
    before = buffer.data.clone()
    with pytest.raises(error, match=message):
        ops.fold_(buffer, grads, weight, first=False, backend=backend)
    assert torch.equal(buffer.data, before)


@pytest.mark.parametrize(
    "dtype",
    [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32, torch.uint64],
    ids=str,
)
def test_an_integer_tensor_scalar_folds_its_value(backend, dtype):
    """A token count kept as an integer tensor is a valid weight (and scale, coef): folded as its value, in any
    integer dtype GradAccumulator takes."""
    buffer = _shaped_buffer([(3,), (2,)])
    grads = [torch.full((3,), 0.5), torch.full((2,), -1.0)]
    ops.fold_(buffer, grads, torch.tensor(3, dtype=dtype), first=True, backend=backend)
    total, _ = ops.fold_finish_(buffer, grads, 1.0, torch.tensor(2, dtype=dtype), first=False, backend=backend)
    ops.scale_(buffer, torch.tensor(1, dtype=dtype), backend=backend)
    assert torch.equal(buffer.view(0), torch.full((3,), 4.0)) and torch.equal(buffer.view(1), torch.full((2,), -8.0))
    assert total.item() == 3 * 16.0 + 2 * 64.0


@pytest.mark.parametrize("op", ["fold_", "fold_finish_"])
def test_a_call_that_skips_check_grads_still_refuses_what_is_no_buffer(op):
    """check=False skips the gradient checks only: a tensor passed as the buffer is still named as the mistake."""
    buffer = FlatGradBuffer([torch.zeros(4), torch.zeros(3)])
    call = {
        "fold_": lambda: ops.fold_(buffer.data, [None, None], first=True, check=False),
        "fold_finish_": lambda: ops.fold_finish_(buffer.data, [None, None], 1.0, 0.5, first=True, check=False),
    }[op]
    with pytest.raises(TypeError, match="buffer must be a gafused.FlatGradBuffer, got Tensor"):
        call()
