"""GradAccumulator against first principles: one big batch per step, in float64.

Every test runs for each backend that can run here (the Triton backend through its interpreter on CPU).
"""

import copy
import gc
import io
import math
import re
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch

import gafused
from gafused import GradAccumulator, ops

from casekit import micro_batch, tanh_mlp


def _model(dtype=torch.float64, seed=0):
    return tanh_mlp(seed=seed, dtype=dtype)


def _data(sizes, dtype=torch.float64, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(n, 5, generator=generator, dtype=dtype), torch.randn(n, 3, generator=generator, dtype=dtype))
        for n in sizes
    ]


def _make_optimizer(kind, params):
    if kind == "sgd-momentum":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def _loss(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)  # mean-reduced: no division by N anywhere


@pytest.fixture(params=["step", "backward"])
def loop(request):
    """The two loops: ``loss.backward(); opt.step(weight=w)`` and ``opt.backward(loss, weight=w); opt.step()``."""
    return request.param


def _big_batch_step(model, optimizer, batches, max_norm=None):
    """One optimizer step on the concatenation of the micro-batches: the definition of correct."""
    optimizer.zero_grad()
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    _loss(model, x, y).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm else math.inf)
    optimizer.step()
    return norm


def _assert_same_params(a, b, tolerance):
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa.double(), pb.double(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("kind", ["sgd-momentum", "adamw"])
@pytest.mark.parametrize("steps", [1, 3, 4])
def test_matches_big_batch_in_float64(backend, kind, steps, loop):
    model = _model()
    reference = copy.deepcopy(model)
    opt = GradAccumulator(_make_optimizer(kind, model.parameters()), accumulation_steps=steps, backend=backend)
    reference_opt = _make_optimizer(kind, reference.parameters())
    assert opt.backend == backend
    for window in range(3):
        batches = _data([4] * steps, seed=window)
        for index, (x, y) in enumerate(batches):
            micro_batch(opt, _loss(model, x, y), loop)
            assert opt.stepped == (index == steps - 1)
            assert opt.micro_step == (index + 1) % steps
            opt.zero_grad()
        _big_batch_step(reference, reference_opt, batches)
        _assert_same_params(model, reference, 1e-12)


def test_unequal_weighted_micro_batches(backend, loop):
    model = _model()
    reference = copy.deepcopy(model)
    opt = GradAccumulator(_make_optimizer("adamw", model.parameters()), accumulation_steps=3, backend=backend)
    reference_opt = _make_optimizer("adamw", reference.parameters())
    for window in range(2):
        sizes = [2, 7, 3] if window == 0 else [5, 1, 6]
        batches = _data(sizes, seed=10 + window)
        for n, (x, y) in zip(sizes, batches, strict=True):
            weight = n if window == 0 else torch.tensor(n)  # numbers and 0-d tensors
            micro_batch(opt, _loss(model, x, y), loop, weight)
            opt.zero_grad()
        _big_batch_step(reference, reference_opt, batches)
        _assert_same_params(model, reference, 1e-12)


def test_unweighted_unequal_micro_batches_are_not_the_big_batch(backend):
    """The control for the test above: without weights, unequal micro-batches give the mean of means."""
    model = _model()
    reference = copy.deepcopy(model)
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=3, backend=backend)
    batches = _data([2, 7, 3], seed=12)
    for x, y in batches:
        _loss(model, x, y).backward()
        opt.step()
    _big_batch_step(reference, torch.optim.SGD(reference.parameters(), lr=0.1), batches)
    pairs = zip(model.parameters(), reference.parameters(), strict=True)
    difference = max(float((a - b).detach().abs().max()) for a, b in pairs)
    assert difference > 1e-6


def test_partial_window_with_flush(backend, loop):
    model = _model()
    reference = copy.deepcopy(model)
    opt = GradAccumulator(_make_optimizer("sgd-momentum", model.parameters()), accumulation_steps=4, backend=backend)
    reference_opt = _make_optimizer("sgd-momentum", reference.parameters())
    assert opt.flush() is False  # nothing open: nothing to do
    windows = [_data([3] * 4, seed=20), _data([3, 5], seed=21)]  # a full window, then an epoch's tail
    for batches in windows:
        for x, y in batches:
            micro_batch(opt, _loss(model, x, y), loop, x.shape[0])
            opt.zero_grad()
        if len(batches) < 4:
            assert not opt.stepped and opt.micro_step == 2
            assert opt.flush() is True
            assert opt.stepped and opt.micro_step == 0
        _big_batch_step(reference, reference_opt, batches)
        _assert_same_params(model, reference, 1e-12)


def test_flush_refuses_unfolded_gradients(backend):
    model = _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=4, backend=backend)
    (x, y), (x2, y2) = _data([3, 3])
    _loss(model, x, y).backward()
    opt.step()
    _loss(model, x2, y2).backward()
    with pytest.raises(RuntimeError, match="not folded by step"):
        opt.flush()
    assert opt.micro_step == 1 and all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("max_norm", [0.05, 1e3], ids=["clipping", "not-clipping"])
def test_clipping_and_reported_norm_equal_clip_grad_norm(backend, max_norm, loop):
    model = _model()
    reference = copy.deepcopy(model)
    opt = GradAccumulator(
        torch.optim.SGD(model.parameters(), lr=0.5), accumulation_steps=3, max_grad_norm=max_norm, backend=backend
    )
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for window in range(2):
        batches = _data([4, 4, 4], seed=30 + window)
        for x, y in batches:
            micro_batch(opt, _loss(model, x, y), loop)
        finished = [p.grad.clone() for p in model.parameters()]  # what the inner step used
        opt.zero_grad()
        norm = _big_batch_step(reference, reference_opt, batches, max_norm=max_norm)
        assert opt.grad_norm.dim() == 0
        torch.testing.assert_close(opt.grad_norm, norm, rtol=1e-12, atol=0)
        for grad, p in zip(finished, reference.parameters(), strict=True):
            torch.testing.assert_close(grad, p.grad, rtol=1e-12, atol=1e-15)
        _assert_same_params(model, reference, 1e-12)
    if max_norm < 1:
        assert float(opt.grad_norm) > max_norm  # the clipping branch really ran


def test_the_norm_of_float32_and_float64_buffers_together_is_taken_in_float64(backend):
    """A float64 parameter beside a float32 one: the window's norm is float64 (the widest buffer's dtype), exact to
    float64 rounding, and a float64 gradient beyond float32's range is clipped and stepped, not skipped as inf."""
    wide = torch.nn.Parameter(torch.zeros(5, dtype=torch.float64))
    narrow = torch.nn.Parameter(torch.zeros(7, dtype=torch.float32))
    opt = GradAccumulator(torch.optim.SGD([wide, narrow], lr=1e-100), 1, max_grad_norm=1.0, backend=backend)
    generator = torch.Generator().manual_seed(3)
    # The float32 buffer's sum of squares is a float32 number: small beside the float64 one, its rounding does not
    # show in the norm, which a float32 result would round at ~1e-8.
    wide_grad = torch.randn(5, generator=generator, dtype=torch.float64) * 1e3
    narrow_grad = torch.randn(7, generator=generator) * 1e-3
    wide.grad, narrow.grad = wide_grad.clone(), narrow_grad.clone()
    opt.step()
    truth = torch.cat([wide_grad, narrow_grad.double()]).norm()
    assert opt.grad_norm.dtype == torch.float64
    torch.testing.assert_close(opt.grad_norm, truth, rtol=1e-14, atol=0)
    wide.grad, narrow.grad = torch.full((5,), 1e100, dtype=torch.float64), torch.ones(7)
    before = wide.detach().clone()
    opt.step()
    assert opt.stepped and opt.skipped_steps == 0
    torch.testing.assert_close(
        opt.grad_norm, torch.tensor(math.sqrt(5) * 1e100, dtype=torch.float64), rtol=1e-14, atol=0
    )
    coef = 1.0 / (math.sqrt(5) * 1e100)  # the clip factor: max_grad_norm / norm
    torch.testing.assert_close(wide.detach(), before - 1e-100 * 1e100 * coef, rtol=1e-12, atol=0)


def test_the_buckets_sums_of_squares_are_added_in_float64():
    """Folded during backward, each finished bucket gives its sum of squares in its buffer's dtype (float32 here); the
    window adds them in float64 before the square root: exactly sqrt(sum of float64(bucket sums)), rounded once to
    float32. (Added in float32, these 600 sums round to another norm.)"""
    generator = torch.Generator().manual_seed(4)
    values = (
        torch.randn(600, generator=generator) * torch.logspace(-3, 3, 600)[torch.randperm(600, generator=generator)]
    )
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in values]
    opt = GradAccumulator(torch.optim.SGD(params, lr=0.0), 1, backend="reference", bucket_bytes=1)
    assert len(opt.buffers[0].buckets) == len(params)
    opt.backward(sum((p * v).sum() for p, v in zip(params, values.tolist(), strict=True)))
    opt.step()
    bucket_sums = values.double().square().float()  # each one-element bucket's sum of squares, in float32
    assert float(opt.grad_norm) == float(bucket_sums.double().sum().sqrt().float())


def test_a_clip_threshold_equal_to_the_norm_scales_as_clip_grad_norm(backend):
    """``clip_grad_norm_`` scales by max / (norm + 1e-6) whenever that is below 1, so also when max_grad_norm equals
    the norm: the finished gradient is the same, bit for bit."""
    param = torch.nn.Parameter(torch.zeros(2))
    opt = GradAccumulator(torch.optim.SGD([param], lr=0.0), 1, max_grad_norm=5.0, backend=backend)
    param.grad = torch.tensor([3.0, 4.0])
    opt.step()
    twin = torch.nn.Parameter(torch.zeros(2))
    twin.grad = torch.tensor([3.0, 4.0])
    torch.nn.utils.clip_grad_norm_([twin], 5.0)
    assert float(opt.grad_norm) == 5.0 and not torch.equal(twin.grad, torch.tensor([3.0, 4.0]))
    assert torch.equal(param.grad, twin.grad)


def test_float32_clipping_scales_by_the_float32_factor_of_the_reported_norm(backend, loop):
    """The clip factor of a float32 window is ``clip_grad_norm_``'s, computed in float32 from the reported norm, and
    the finished gradient is the unclipped mean times it, rounded once: bit for bit against an unclipped twin."""
    model = _model(torch.float32)
    twin = copy.deepcopy(model)
    clipped = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.0), 3, max_grad_norm=0.05, backend=backend)
    unclipped = GradAccumulator(torch.optim.SGD(twin.parameters(), lr=0.0), 3, backend=backend)
    for window in range(4):
        for x, y in _data([4, 3, 5], dtype=torch.float32, seed=60 + window):
            micro_batch(clipped, _loss(model, x, y), loop, weight=len(x))
            micro_batch(unclipped, _loss(twin, x, y), loop, weight=len(x))
        assert clipped.stepped and clipped.grad_norm.dtype == torch.float32
        assert torch.equal(clipped.grad_norm, unclipped.grad_norm) and float(clipped.grad_norm) > 0.05
        coef = (0.05 / (clipped.grad_norm + 1e-6)).clamp(max=1.0)
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad * coef)
        clipped.zero_grad()
        unclipped.zero_grad()


def test_a_micro_batch_whose_second_backward_folds_nothing_keeps_its_first(backend):
    """A micro-batch of two backward() calls where the second's loss reaches no parameter: the first call's fold
    stays the micro-batch's (step() takes it, zero_grad() refuses to drop what is folded), and the window is the
    big batch's."""
    model = _model()
    reference = copy.deepcopy(model)
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, backend=backend)
    batches = _data([3, 4])
    opt.backward(_loss(model, *batches[0]), weight=3)
    opt.step()
    opt.backward(_loss(model, *batches[1]), weight=4)
    opt.backward(torch.ones(2, dtype=torch.float64, requires_grad=True).sum())  # reaches no parameter
    with pytest.raises(RuntimeError, match="already folded"):
        opt.zero_grad()
    opt.step()
    assert opt.stepped
    _big_batch_step(reference, reference_opt, batches)
    _assert_same_params(model, reference, 1e-12)


def test_a_flush_with_nothing_to_finish_says_no_step_ran():
    """``stepped`` tells whether the last step() or flush() ran the inner step: after a window's last step() it is
    True, and a flush() with no micro-batch open returns False and makes it False (an epoch-end
    ``opt.flush(); if opt.stepped: scheduler.step()`` would otherwise step the scheduler twice)."""
    model = _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 1)
    opt.backward(_loss(model, *_data([3])[0]))
    opt.step()
    assert opt.stepped
    assert opt.flush() is False and opt.stepped is False


def test_normalization_cannot_change_once_a_backward_opened_the_window():
    """A window's first backward() folds with the window's normalization: changing it before that micro-batch's
    step() is refused, the value kept, and the window finished as it began."""
    param = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    opt = GradAccumulator(torch.optim.SGD([param], lr=1.0), 1, backend="reference")
    opt.backward((param * torch.tensor([1.0, 2.0], dtype=torch.float64)).sum(), weight=4)
    with pytest.raises(RuntimeError, match="normalization: the open window is accumulated to be finished as 'mean'"):
        opt.normalization = "sum"
    assert opt.normalization == "mean"
    opt.step()
    assert torch.equal(param.detach(), torch.tensor([-1.0, -2.0], dtype=torch.float64))  # the mean: 4 * g / 4


def test_an_accumulator_alive_at_interpreter_exit_leaves_quietly():
    """An accumulator still alive when Python exits can be collected after gafused's module globals are cleared (seen
    here with weights kept as device tensors, the path a GPU takes): its __del__ raised TypeError there, which Python
    printed as "Exception ignored in: GradAccumulator.__del__" at the end of the user's script."""
    script = textwrap.dedent(
        """
        import torch, gafused, gafused.accumulator as accumulator
        accumulator._checked_on_host = lambda device: False  # the device path a GPU takes
        for backend in ("reference", "foreach"):
            param = torch.nn.Parameter(torch.zeros((), dtype=torch.float64))
            opt = gafused.GradAccumulator(torch.optim.SGD([param], lr=1.0), 2, backend=backend)
            for count in (torch.tensor(1.0, requires_grad=True) * 1, torch.tensor(3.0)):
                opt.backward(param * 2.0, weight=count)
                opt.step()
        print("trained", float(param.detach()))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "trained -2.0", done.stderr
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_collected_accumulator_takes_its_finished_gradients_with_it():
    """The finished gradients an accumulator hands out are views of its buffer: when it is collected they go too, so a
    new accumulator over the same parameters does not take them for new gradients (its empty step is refused)."""
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = GradAccumulator(inner, 1)
    opt.backward(_loss(model, *_data([3])[0]))
    opt.step()
    assert all(p.grad is not None for p in model.parameters())
    del opt
    gc.collect()
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(RuntimeError, match="no parameter of the accumulator received a gradient"):
        GradAccumulator(inner, 2).step()


def test_loading_a_checkpoint_drops_a_micro_batch_awaiting_its_step():
    """``load_state_dict`` rolls back to the checkpoint: a backward() whose step() never came is dropped with its
    weight, and the next micro-batch (with another weight) finishes the window as the uninterrupted run does."""
    model = _model()
    twin = copy.deepcopy(model)
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    uninterrupted = GradAccumulator(torch.optim.SGD(twin.parameters(), lr=0.1), 2)
    (x, y), (x2, y2) = _data([3, 4])
    for accumulator, net in ((opt, model), (uninterrupted, twin)):
        accumulator.backward(_loss(net, x, y), weight=3)
        accumulator.step()
    saved = opt.state_dict()
    opt.backward(_loss(model, x2, y2), weight=7)  # interrupted: no step()
    opt.load_state_dict(saved)
    for accumulator, net in ((opt, model), (uninterrupted, twin)):
        accumulator.backward(_loss(net, x2, y2), weight=4)
        accumulator.step()
    assert opt.stepped and all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True))


def test_norm_is_of_the_average_and_independent_of_n(backend, loop):
    norms = []
    for steps in (1, 2, 4):
        model = _model()
        opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.0), accumulation_steps=steps, backend=backend)
        x, y = _data([8], seed=40)[0]
        for xs, ys in zip(x.chunk(steps), y.chunk(steps), strict=True):
            micro_batch(opt, _loss(model, xs, ys), loop)
        norms.append(opt.grad_norm)
    torch.testing.assert_close(norms[1], norms[0], rtol=1e-12, atol=0)
    torch.testing.assert_close(norms[2], norms[0], rtol=1e-12, atol=0)


def test_bf16_parameters_accumulate_in_fp32(backend):
    """One large and many small micro-gradients: bf16 accumulation loses the small ones, gafused does not."""
    param = torch.nn.Parameter(torch.zeros(37, dtype=torch.bfloat16))
    steps = 64
    opt = GradAccumulator(torch.optim.SGD([param], lr=1.0), accumulation_steps=steps, backend=backend)
    generator = torch.Generator().manual_seed(50)
    grads = [torch.full((37,), 1.0) + 0.25 * torch.rand(37, generator=generator)]
    grads += [1e-3 * (1 + torch.rand(37, generator=generator)) for _ in range(steps - 1)]
    grads = [g.to(torch.bfloat16) for g in grads]
    naive = torch.zeros(37, dtype=torch.bfloat16)
    for g in grads:
        param.grad = g.clone()
        naive += g
        opt.step()
    exact = torch.stack([g.double() for g in grads]).sum(0) / steps
    assert param.grad.dtype == torch.bfloat16
    # the fp32 buffer holds the exact mean to fp32 rounding; p.grad is its bf16 rounding
    torch.testing.assert_close(opt.buffers[0].view(0).double(), exact, rtol=1e-6, atol=0)
    assert torch.equal(param.grad, opt.buffers[0].view(0).to(torch.bfloat16))
    naive_error = float(((naive.double() / steps) - exact).abs().max() / exact.abs().max())
    assert naive_error > 0.02  # the control: bf16 accumulation really loses the small gradients


def _snapshot(model, optimizer):
    return [p.detach().clone() for p in model.parameters()], copy.deepcopy(optimizer.state_dict())


def _assert_unchanged(model, optimizer, snapshot):
    params, state = snapshot
    for p, before in zip(model.parameters(), params, strict=True):
        assert torch.equal(p.detach(), before)
    assert str(optimizer.state_dict()) == str(state)


@pytest.mark.parametrize("bucket_bytes", [32 * 2**20, 64], ids=["one_bucket", "several_buckets"])
@pytest.mark.parametrize("position", [0, 1, 2], ids=["first", "middle", "last"])
@pytest.mark.parametrize("value", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_nonfinite_window_is_skipped_and_training_goes_on(backend, position, value, loop, bucket_bytes):
    """With several buckets the backward loop measures each bucket on its own: any bucket's flag skips the window."""
    model = _model()
    reference = copy.deepcopy(model)
    inner = _make_optimizer("adamw", model.parameters())
    reference_opt = _make_optimizer("adamw", reference.parameters())
    opt = GradAccumulator(inner, accumulation_steps=3, max_grad_norm=1.0, backend=backend, bucket_bytes=bucket_bytes)
    assert len(opt.buffers[0].bucket_ranges) > 1 or bucket_bytes > 64
    warm = _data([2, 2, 2], seed=60)
    for x, y in warm:  # a normal window first, so there is optimizer state to protect
        micro_batch(opt, _loss(model, x, y), loop)
    opt.zero_grad()
    _big_batch_step(reference, reference_opt, warm, max_norm=1.0)
    snapshot = _snapshot(model, inner)

    def poison(grad):
        grad = grad.clone()
        grad[1, 2] = value
        return grad

    for index, (x, y) in enumerate(_data([2, 2, 2], seed=61)):
        # The non-finite value enters the gradient inside backward, where both loops see it.
        handle = model[0].weight.register_hook(poison) if index == position else None
        micro_batch(opt, _loss(model, x, y), loop)
        if handle is not None:
            handle.remove()
        opt.zero_grad()
    assert not opt.stepped and opt.skipped_steps == 1 and opt.micro_step == 0
    assert not math.isfinite(float(opt.grad_norm))
    assert all(p.grad is None for p in model.parameters())
    _assert_unchanged(model, inner, snapshot)

    after = _data([2, 2, 2], seed=62)
    for x, y in after:
        micro_batch(opt, _loss(model, x, y), loop)
    assert opt.stepped
    _big_batch_step(reference, reference_opt, after, max_norm=1.0)
    _assert_same_params(model, reference, 1e-12)


@pytest.mark.parametrize("max_grad_norm", [None, 1.0], ids=["unclipped", "clipped"])
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the Triton interpreter's squares
def test_finite_gradient_whose_norm_overflows_skips_the_step(backend, max_grad_norm):
    # 1e20 is a finite float32, its square is not: the float32 sum of squares is inf, so the norm is unknown (the
    # float64 truth, 2e20, would clip to 0.5 per element; a clip by an infinite norm would step with zeros).
    param = torch.nn.Parameter(torch.zeros(4))
    inner = torch.optim.SGD([param], lr=1.0)
    opt = GradAccumulator(inner, accumulation_steps=2, max_grad_norm=max_grad_norm, backend=backend)
    for _ in range(2):
        param.grad = torch.full((4,), 1e20)
        opt.step()
    assert not opt.stepped and opt.skipped_steps == 1 and opt.micro_step == 0
    assert math.isinf(float(opt.grad_norm)) and torch.equal(param.detach(), torch.zeros(4))
    for _ in range(2):
        param.grad = torch.full((4,), 2.0)
        opt.step()
    assert opt.stepped  # the mean gradient 2.0 has norm 4: clipped to 0.5 per element
    torch.testing.assert_close(param.detach(), torch.full((4,), -0.5 if max_grad_norm else -2.0))


@pytest.mark.parametrize("split", ["buckets", "buffers", "beside_float64"])
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the Triton interpreter's squares
def test_sum_of_squares_overflowing_across_buckets_skips_the_step_in_both_loops(backend, loop, split):
    """Two parameters whose squares sum to 2e38 each (within float32) and 4e38 together (beyond it), in two buckets
    of one buffer, in two buffers (fp32 and bf16 parameters), or in two buckets beside a float64 buffer: the float32
    sum of squares overflows as it does in one bucket, so every loop and layout skips the window (its norm 2e19 in
    float64 would pass)."""
    dtypes = (torch.float32, torch.float32 if split != "buffers" else torch.bfloat16)
    params = [torch.nn.Parameter(torch.zeros(2, dtype=dtype)) for dtype in dtypes]
    wide = [torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))] if split == "beside_float64" else []
    inner = torch.optim.SGD(params + wide, lr=1.0)
    opt = GradAccumulator(inner, 1, max_grad_norm=1.0, backend=backend, bucket_bytes=8)
    assert sum(len(buffer.buckets) for buffer in opt.buffers if buffer.accum_dtype == torch.float32) == 2
    c = torch.tensor(1e19)  # bf16 rounds it to 1.0016e19: still about 2e38 per parameter, 4e38 in all
    loss = sum((p.float() * c).sum() for p in params) + sum(p.sum().float() for p in wide)
    micro_batch(opt, loss, loop)
    assert not opt.stepped and opt.skipped_steps == 1 and math.isinf(float(opt.grad_norm))
    assert all(torch.equal(p.detach(), torch.zeros_like(p)) for p in params + wide)


@pytest.mark.parametrize("max_grad_norm", [None, 1.0], ids=["unclipped", "clipped"])
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # the Triton interpreter's cast
def test_finished_gradient_that_overflows_the_parameter_dtype_skips_the_step(backend, loop, max_grad_norm):
    """fp16 parameters, normalization="sum": each micro-batch's gradient fits fp16, their fp32 sum may not. A
    finished value that the cast to fp16 would make inf skips the window like a non-finite one; a norm beyond
    65504 made of values that fit, or clipped back into range, steps."""
    param = torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))
    inner = torch.optim.SGD([param], lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    opt = GradAccumulator(
        inner,
        accumulation_steps=2,
        max_grad_norm=max_grad_norm,
        backend=backend,
        normalization="sum",
        grad_scaler=scaler,
    )

    def window(values):
        # The gradient of (param * c).sum() is c, exactly representable in fp16 here.
        coefficients = torch.tensor(values, dtype=torch.float32)
        for _ in range(2):
            loss = (param.float() * coefficients).sum()
            micro_batch(opt, loss if loop == "backward" else scaler.scale(loss), loop)  # backward() scales itself
            opt.zero_grad()
        return 2 * coefficients.double()

    summed = window([40000.0, 30000.0, 1.0, 2.0])  # 80000 does not fit fp16
    assert opt.grad_norm is not None and float(opt.grad_norm) == pytest.approx(float(summed.norm()), rel=1e-6)
    if max_grad_norm is None:
        assert not opt.stepped and opt.skipped_steps == 1 and opt.micro_step == 0
        assert torch.equal(param.detach(), torch.zeros(4, dtype=torch.float16))
        # Left as it was: the finished gradient is unscaled, a smaller loss scale would not make it fit fp16.
        assert scaler.get_scale() == 1.0 and int(scaler._growth_tracker) == 0
        assert param.grad is None
    else:
        assert opt.stepped and opt.skipped_steps == 0
        step = summed * max_grad_norm / (summed.norm() + 1e-6)
        # One fp16 rounding: half an ulp, 2^-11 of the value (2^-25 absolute among the subnormals).
        assert bool(((param.detach().double() + step).abs() <= 2.0**-11 * step.abs() + 2.0**-25).all())
    before = param.detach().double()
    summed = window([30000.0, -30000.0, 30000.0, 3.0])  # norm ~1e5 > 65504, every value fits fp16
    assert opt.stepped
    step = summed if max_grad_norm is None else summed * max_grad_norm / (summed.norm() + 1e-6)
    # Two fp16 roundings (the gradient's cast, SGD's add), each within half an ulp.
    error = (param.detach().double() - (before - step)).abs()
    assert bool((error <= 2.0**-10 * (before.abs() + step.abs()) + 2.0**-24).all()), error


def test_unused_parameters_keep_no_grad_and_are_not_decayed(backend, loop):
    model = _model()
    unused = torch.nn.Parameter(torch.randn(6, dtype=torch.float64))
    partial = torch.nn.Parameter(torch.randn(2, dtype=torch.float64))
    inner = torch.optim.AdamW([*model.parameters(), unused, partial], lr=0.1, weight_decay=0.5)
    opt = GradAccumulator(inner, accumulation_steps=3, backend=backend)
    unused_before = unused.detach().clone()
    reference_partial = partial.detach().clone().requires_grad_()
    reference_inner = torch.optim.AdamW([reference_partial], lr=0.1, weight_decay=0.5)
    partial_grads = []
    for index, (x, y) in enumerate(_data([2, 2, 2], seed=70)):
        loss = _loss(model, x, y)
        if index == 1:  # `partial` takes part in one micro-batch of three
            loss = loss + (partial**2).sum()
            partial_grads.append(2 * partial.detach().clone())
        micro_batch(opt, loss, loop)
        if index < 2:
            assert all(p.grad is None for p in inner.param_groups[0]["params"])  # folded and released
    assert opt.stepped
    assert unused.grad is None and torch.equal(unused.detach(), unused_before)
    assert unused not in inner.state
    torch.testing.assert_close(partial.grad, partial_grads[0] / 3, rtol=1e-12, atol=0)
    reference_partial.grad = partial_grads[0] / 3
    reference_inner.step()
    torch.testing.assert_close(partial.detach(), reference_partial.detach(), rtol=1e-12, atol=0)


@pytest.mark.parametrize("max_grad_norm", [None, 0.1], ids=["unclipped", "clipped"])
def test_mixed_dtypes_get_one_buffer_each_and_grads_in_their_dtype(backend, max_grad_norm):
    """One buffer per parameter dtype, one global norm over both, each finished gradient cast to its dtype."""
    torch.manual_seed(80)
    low = torch.nn.Linear(6, 5).to(torch.bfloat16)
    high = torch.nn.Linear(5, 2)
    params = [*low.parameters(), *high.parameters()]
    opt = GradAccumulator(
        torch.optim.SGD(params, lr=0.0), accumulation_steps=2, max_grad_norm=max_grad_norm, backend=backend
    )
    assert sorted(str(b.params[0].dtype) for b in opt.buffers) == ["torch.bfloat16", "torch.float32"]
    assert all(b.accum_dtype == torch.float32 for b in opt.buffers)
    expected = [torch.zeros(p.shape, dtype=torch.float64) for p in params]
    for seed in (81, 82):
        generator = torch.Generator().manual_seed(seed)
        for p, e in zip(params, expected, strict=True):
            p.grad = torch.randn(p.shape, generator=generator).to(p.dtype)
            e += p.grad.double() / 2  # exact, as is the float32 buffer's g1 + g2 then * 1/2
        opt.step()
    norm = torch.cat([e.reshape(-1) for e in expected]).norm()
    torch.testing.assert_close(opt.grad_norm.double(), norm, rtol=1e-6, atol=0)
    coef = 1.0 if max_grad_norm is None else min(1.0, max_grad_norm / (float(norm) + 1e-6))
    assert coef < 1.0 or max_grad_norm is None  # the clipped case clips
    for p, e in zip(params, expected, strict=True):
        assert p.grad.dtype == p.dtype
        if max_grad_norm is None:
            assert torch.equal(p.grad, e.to(p.dtype))  # one rounding, in the cast
        else:
            # The coefficient from a float32 norm and division, the float32 product, then the cast: a few float32
            # roundings, or the bf16 cast's one.
            rtol = max(torch.finfo(p.dtype).eps, 4 * torch.finfo(torch.float32).eps)
            torch.testing.assert_close(p.grad.double(), e * coef, rtol=rtol, atol=0)


def test_float64_parameters_accumulate_in_float64():
    param = torch.nn.Parameter(torch.randn(3, dtype=torch.float64))
    opt = GradAccumulator(torch.optim.SGD([param], lr=0.1), accumulation_steps=2)
    assert opt.buffers[0].accum_dtype == torch.float64


def test_mid_window_checkpoint_resumes_exactly(backend, loop):
    def build():
        model = _model()
        opt = GradAccumulator(
            _make_optimizer("adamw", model.parameters()), accumulation_steps=4, max_grad_norm=0.5, backend=backend
        )
        return model, opt

    model, opt = build()
    batches = _data([3, 1, 4, 2, 5, 2, 3, 1, 2, 3], seed=90)
    uninterrupted, uninterrupted_opt = build()
    for n_done, (x, y) in enumerate(batches):
        _loss(uninterrupted, x, y).backward()
        uninterrupted_opt.step(weight=x.shape[0])
        uninterrupted_opt.zero_grad()
        if n_done < 6:  # 1 full window, then 2 micro-batches into the second
            micro_batch(opt, _loss(model, x, y), loop, torch.tensor(x.shape[0]))
            opt.zero_grad()
    assert opt.micro_step == 2

    resumed, resumed_opt = _resumed(model, opt, build)
    assert resumed_opt.micro_step == 2
    for x, y in batches[6:]:
        _loss(resumed, x, y).backward()
        resumed_opt.step(weight=x.shape[0])
        resumed_opt.zero_grad()
    for a, b in zip(resumed.parameters(), uninterrupted.parameters(), strict=True):
        assert torch.equal(a, b)


def _resumed(model, opt, build):
    """``build()``'s model and accumulator, loaded from a checkpoint of ``model`` and ``opt`` saved to bytes."""
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, saved)
    saved.seek(0)
    checkpoint = torch.load(saved, weights_only=True)
    resumed, resumed_opt = build()
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt.load_state_dict(checkpoint["opt"])
    return resumed, resumed_opt


def test_mid_window_checkpoint_with_weights_inexact_in_float32_resumes_exactly(backend, loop):
    # Weights k/10 sum to no float32 number: a weight sum that lost precision on its way through the checkpoint
    # would scale the resumed window's float64 mean by another factor. SGD keeps that factor in every update.
    def build():
        model = _model()
        return model, GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 4, backend=backend)

    batches = _data([3, 1, 4, 2, 5, 2, 3, 1], seed=91)
    weights = [torch.tensor(0.1 * (index + 1), dtype=torch.float64) for index in range(len(batches))]
    uninterrupted, uninterrupted_opt = build()
    model, opt = build()
    for index, ((x, y), weight) in enumerate(zip(batches, weights, strict=True)):
        micro_batch(uninterrupted_opt, _loss(uninterrupted, x, y), loop, weight)
        uninterrupted_opt.zero_grad()
        if index < 6:  # 1 full window, then 2 micro-batches into the second
            micro_batch(opt, _loss(model, x, y), loop, weight)
            opt.zero_grad()
    resumed, resumed_opt = _resumed(model, opt, build)
    assert resumed_opt.micro_step == 2
    for (x, y), weight in zip(batches[6:], weights[6:], strict=True):
        micro_batch(resumed_opt, _loss(resumed, x, y), loop, weight)
        resumed_opt.zero_grad()
    assert resumed_opt.stepped and uninterrupted_opt.stepped
    for a, b in zip(resumed.parameters(), uninterrupted.parameters(), strict=True):
        assert torch.equal(a, b)


def test_parameter_unused_in_a_checkpointed_window_keeps_no_grad_and_is_not_decayed(backend, loop):
    # A parameter with no gradient in the window must come out of the resumed window as it would have without the
    # checkpoint: p.grad None, so AdamW leaves it alone (a zero gradient would decay it).
    def build():
        model = _model()
        unused = torch.nn.Parameter(torch.randn(6, dtype=torch.float64, generator=torch.Generator().manual_seed(3)))
        model.register_parameter("unused", unused)
        inner = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
        return model, GradAccumulator(inner, accumulation_steps=3, backend=backend)

    batches = _data([2, 3, 4], seed=71)
    uninterrupted, uninterrupted_opt = build()
    model, opt = build()
    unused_before = model.unused.detach().clone()
    for index, (x, y) in enumerate(batches):
        micro_batch(uninterrupted_opt, _loss(uninterrupted, x, y), loop)
        if index < 1:
            micro_batch(opt, _loss(model, x, y), loop)
    resumed, resumed_opt = _resumed(model, opt, build)
    assert resumed_opt.micro_step == 1
    for x, y in batches[1:]:
        micro_batch(resumed_opt, _loss(resumed, x, y), loop)
    assert resumed_opt.stepped and uninterrupted_opt.stepped
    assert resumed.unused.grad is None and uninterrupted.unused.grad is None
    assert torch.equal(resumed.unused.detach(), unused_before)
    assert resumed.unused not in resumed_opt.state
    for a, b in zip(resumed.parameters(), uninterrupted.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_checkpoint_between_windows_ignores_the_learning_rates_of_a_window_before():
    """Between windows the checkpoint's ``window_lrs`` (those of the window that ended) are neither checked nor
    kept: a checkpoint whose groups have other learning rates loads, and the next window records its own."""
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = GradAccumulator(inner, accumulation_steps=2)
    for x, y in _data([2, 3], seed=4):
        _micro_step(opt, model, x, y, "step")
    state = opt.state_dict()
    assert opt.micro_step == 0
    state["gafused"]["window_lrs"] = ["not a learning rate"]
    opt.load_state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "learning rate changed inside a window" from a stale record
        for x, y in _data([2, 3], seed=5):
            _micro_step(opt, model, x, y, "step")
    assert opt.stepped


def test_grad_norm_is_none_after_a_load_until_a_window_ends():
    """``grad_norm`` is not in a checkpoint: after a load it is None (as in a new accumulator), not the norm of a
    window the load rolled back past."""
    model = _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2, max_grad_norm=1.0)
    batches = _data([2, 3, 2, 1], seed=6)
    _micro_step(opt, model, *batches[0], "backward")
    state = opt.state_dict()
    _micro_step(opt, model, *batches[1], "backward")
    assert opt.grad_norm is not None
    opt.load_state_dict(state)
    assert opt.grad_norm is None and opt.micro_step == 1
    _micro_step(opt, model, *batches[1], "backward")
    assert opt.grad_norm is not None and opt.stepped


def test_load_state_dict_rejects_other_models():
    opt = GradAccumulator(torch.optim.SGD(_model().parameters(), lr=0.1), accumulation_steps=2)
    same_count = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)).double()
    other = GradAccumulator(torch.optim.SGD(same_count.parameters(), lr=0.1), accumulation_steps=2)
    with pytest.raises(ValueError, match="do not match"):
        opt.load_state_dict(other.state_dict())
    fewer = GradAccumulator(torch.optim.SGD(torch.nn.Linear(3, 3).parameters(), lr=0.1), accumulation_steps=2)
    with pytest.raises(ValueError, match=re.escape("param_groups'][0]: the checkpoint's group has 2 parameters")):
        opt.load_state_dict(fewer.state_dict())
    with pytest.raises(ValueError, match="state_dict"):
        opt.load_state_dict({"optimizer": {}})


@pytest.mark.parametrize("window", ["between windows", "mid-window"])
def test_a_checkpoint_of_other_parameter_groups_is_refused_as_that(window):
    """Groups are checked before the window's fields: a checkpoint with two groups loaded where there is one is
    refused for its groups (as the inner optimizer would), not for a window field sized by the groups."""
    model = _model()
    weights = [p for name, p in model.named_parameters() if name.endswith("weight")]
    biases = [p for name, p in model.named_parameters() if name.endswith("bias")]
    saver = GradAccumulator(
        torch.optim.SGD([{"params": weights}, {"params": biases, "lr": 0.01}], lr=0.1), accumulation_steps=2
    )
    batches = _data([2, 3, 2], seed=5)
    for x, y in batches[: 3 if window == "mid-window" else 2]:
        _micro_step(saver, model, x, y, "step")
    state = saver.state_dict()
    loader = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2)
    _micro_step(loader, model, *batches[0], "step")
    before = copy.deepcopy(loader.optimizer.state_dict()), loader.micro_step, [b.data.clone() for b in loader.buffers]
    with pytest.raises(ValueError, match=r"param_groups'\]: the checkpoint has 2 parameter groups, the optimizer 1"):
        loader.load_state_dict(state)
    assert loader.optimizer.state_dict() == before[0] and loader.micro_step == before[1] == 1
    assert all(torch.equal(b.data, kept) for b, kept in zip(loader.buffers, before[2], strict=True))


def test_scheduler_steps_once_per_window_and_per_micro_batch_use_warns(backend):
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=1.0)
    opt = GradAccumulator(inner, accumulation_steps=2, backend=backend)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.5**epoch)  # built on the accumulator
    with warnings.catch_warnings():
        # Neither gafused's warning nor "lr_scheduler.step() before optimizer.step()" (both UserWarnings).
        warnings.simplefilter("error", UserWarning)
        for x, y in _data([2] * 6, seed=100):
            _loss(model, x, y).backward()
            opt.step()
            opt.zero_grad()
            if opt.stepped:
                scheduler.step()
    assert inner.param_groups[0]["lr"] == pytest.approx(0.5**3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # warned once all the same: gafused keeps count itself
        for x, y in _data([2] * 6, seed=101):
            _loss(model, x, y).backward()
            opt.step()
            scheduler.step()  # the mistake: stepped every micro-batch
    said = [str(w.message) for w in caught if "learning rate changed inside an accumulation window" in str(w.message)]
    assert len(said) == 1, said


def test_param_groups_and_state_are_the_inner_optimizers():
    inner = torch.optim.AdamW(_model().parameters(), lr=0.1)
    opt = GradAccumulator(inner, accumulation_steps=2)
    assert opt.param_groups is inner.param_groups and opt.state is inner.state and opt.optimizer is inner
    assert opt.grad_norm is None and opt.skipped_steps == 0 and opt.stepped is False
    assert "GradAccumulator(AdamW" in repr(opt)


@pytest.mark.parametrize("window", ["between windows", "mid-window"])
def test_a_checkpoint_group_of_more_parameters_is_refused_as_that(window):
    """A checkpoint whose group lists more parameters than the optimizer's is refused for that group (as the inner
    optimizer would), not for the window's parameter sizes; nothing changes."""
    model = _model()
    saver = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2)
    batches = _data([2, 3, 2], seed=5)
    for x, y in batches[: 3 if window == "mid-window" else 2]:
        _micro_step(saver, model, x, y, "step")
    state = saver.state_dict()
    weights = [p for name, p in model.named_parameters() if name.endswith("weight")]
    loader = GradAccumulator(torch.optim.SGD(weights, lr=0.1), accumulation_steps=2)
    _micro_step(loader, model, *batches[0], "step")
    before = copy.deepcopy(loader.optimizer.state_dict()), loader.micro_step, [b.data.clone() for b in loader.buffers]
    message = "param_groups'][0]: the checkpoint's group has 4 parameters, the optimizer's 2"
    with pytest.raises(ValueError, match=re.escape(message)):
        loader.load_state_dict(state)
    assert loader.optimizer.state_dict() == before[0] and loader.micro_step == before[1] == 1
    assert all(torch.equal(b.data, kept) for b, kept in zip(loader.buffers, before[2], strict=True))


def test_numpy_integers_are_taken_as_ints():
    """A count read from a NumPy array or config (np.int64) is an int to the accumulator, and kept as a Python int
    (what a checkpoint saves); a NumPy bool or float is refused as a Python one is."""
    model = _model()
    opt = GradAccumulator(
        torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=np.int64(3), bucket_bytes=np.int32(4096)
    )
    assert type(opt.accumulation_steps) is int and opt.accumulation_steps == 3
    opt.accumulation_steps = np.int16(2)
    assert type(opt.accumulation_steps) is int and opt.state_dict()["gafused"]["accumulation_steps"] == 2
    for bad in (np.bool_(True), np.float64(2.0)):
        with pytest.raises(ValueError, match="accumulation_steps must be a positive int"):
            GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=bad)
        with pytest.raises(ValueError, match="bucket_bytes must be a positive int"):
            GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, bucket_bytes=bad)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"accumulation_steps": 0}, ValueError, "accumulation_steps"),
        ({"accumulation_steps": -2}, ValueError, "accumulation_steps"),
        ({"accumulation_steps": 2.0}, ValueError, "accumulation_steps"),
        ({"accumulation_steps": True}, ValueError, "accumulation_steps"),
        ({"max_grad_norm": 0.0}, ValueError, "max_grad_norm"),
        ({"max_grad_norm": -1.0}, ValueError, "max_grad_norm"),
        ({"max_grad_norm": float("inf")}, ValueError, "max_grad_norm"),
        ({"max_grad_norm": float("nan")}, ValueError, "max_grad_norm"),
        ({"max_grad_norm": "1"}, ValueError, "max_grad_norm"),
        ({"accum_dtype": torch.bfloat16}, ValueError, "accum_dtype"),
        ({"backend": "fastest"}, ValueError, "backend"),
        ({"grad_scaler": object()}, TypeError, "grad_scaler"),
        ({"normalization": "avg"}, ValueError, "normalization"),
        ({"normalization": None}, ValueError, "normalization"),
    ],
    # Ids that are the same in every process (pytest-xdist compares them): an object's repr holds its address.
    ids=lambda value: (
        str(value)
        if not isinstance(value, dict)
        else "-".join(f"{k}={type(v).__name__ if type(v) is object else v}" for k, v in value.items())
    ),
)
def test_constructor_rejects_bad_arguments(kwargs, error, message):
    arguments = {"optimizer": torch.optim.SGD(_model().parameters(), lr=0.1), "accumulation_steps": 2, **kwargs}
    with pytest.raises(error, match=message):
        GradAccumulator(**arguments)


def test_constructor_rejects_non_optimizers_and_complex_parameters():
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        GradAccumulator(_model().parameters(), accumulation_steps=2)
    with pytest.raises(TypeError, match=r"instance, got the class AdamW: build it first, e.g. .*\(AdamW\("):
        GradAccumulator(torch.optim.AdamW, accumulation_steps=2)
    with pytest.raises(TypeError, match="LBFGS cannot be wrapped"):
        GradAccumulator(torch.optim.LBFGS, accumulation_steps=2)
    with pytest.raises(TypeError, match="not another GradAccumulator"):
        GradAccumulator(GradAccumulator, accumulation_steps=2)
    complex_param = torch.nn.Parameter(torch.randn(3, dtype=torch.complex64))
    with pytest.raises(ValueError, match="must be float16, bfloat16, float32 or float64, got torch.complex64"):
        GradAccumulator(torch.optim.SGD([complex_param], lr=0.1), accumulation_steps=2)
    # A float8 parameter (floating point, but no op folds its gradients) is named by its place in the optimizer.
    fp8 = torch.nn.Parameter(torch.zeros(3).to(torch.float8_e5m2), requires_grad=False)
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))]}, {"params": [torch.nn.Parameter(torch.zeros(4)), fp8]}]
    with pytest.raises(
        ValueError, match=r"param_groups\[1\]\['params'\]\[1\] \(shape \(3,\)\): .* got torch.float8_e5m2"
    ):
        GradAccumulator(torch.optim.SGD(groups, lr=0.1), accumulation_steps=2)


def test_missing_backend_raises_with_install_command(monkeypatch):
    """A named backend that does not import says so and how to install it (as where gafused._C was not built)."""
    monkeypatch.setattr(ops, "_loaded", {k: v for k, v in ops._loaded.items() if k != "cuda"})
    monkeypatch.setattr(ops, "_import_errors", {**ops._import_errors, "cuda": "ImportError('no module gafused._C')"})
    with pytest.raises(RuntimeError, match="failed to import.*To install it"):
        GradAccumulator(torch.optim.SGD(_model().parameters(), lr=0.1), accumulation_steps=2, backend="cuda")


def test_a_backend_that_imports_but_cannot_run_on_the_device_says_why_without_an_install_hint(monkeypatch):
    """The triton backend imports wherever triton does (the cuda one only where gafused._C was built); on CPU
    tensors without TRITON_INTERPRET it refuses, naming the reason, and installing nothing would help."""
    pytest.importorskip("triton")
    import gafused.triton_backend

    monkeypatch.setattr(gafused.triton_backend, "_INTERPRETED", False)  # as where the kernels were compiled
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError) as refused:
        GradAccumulator(torch.optim.SGD(_model().parameters(), lr=0.1), accumulation_steps=2, backend="triton")
    assert "TRITON_INTERPRET" in str(refused.value) and "To install it" not in str(refused.value)


def test_env_backend_is_used_by_auto(monkeypatch):
    monkeypatch.setenv("GAFUSED_BACKEND", "reference")
    opt = GradAccumulator(torch.optim.SGD(_model().parameters(), lr=0.1), accumulation_steps=2)
    assert opt.backend == "reference"
    monkeypatch.setenv("GAFUSED_BACKEND", "fastest")
    with pytest.raises(ValueError, match="GAFUSED_BACKEND"):
        GradAccumulator(torch.optim.SGD(_model().parameters(), lr=0.1), accumulation_steps=2)


def test_available_backends_lists_reference():
    assert "reference" in gafused.available_backends()
    assert "reference" in gafused.available_backends("cpu")
    assert gafused.available_backends(0) == gafused.available_backends("cuda:0")  # an index is a CUDA device's


@pytest.mark.parametrize(
    "device, error, message",
    [
        ("xyz", ValueError, r"available_backends\(\): device 'xyz' names no device here"),
        (True, TypeError, r"available_backends\(\): device must be a torch.device, a str, an index or None, got bool"),
        (2.0, TypeError, r"available_backends\(\): device must be .* got float"),
    ],
)
def test_available_backends_names_a_bad_device(device, error, message):
    with pytest.raises(error, match=message):
        gafused.available_backends(device)


@pytest.mark.parametrize("caller", ["resolve_backend", "backend_unavailable_reason"])
@pytest.mark.parametrize(
    "device, error, message",
    [
        ("xyz", ValueError, r"\(\): device 'xyz' names no device here"),
        (None, TypeError, r"\(\): device must be a torch.device, a str or an index, got NoneType"),
        (True, TypeError, r"\(\): device must be .* got bool"),
        (2.0, TypeError, r"\(\): device must be .* got float"),
    ],
)
def test_the_backend_queries_name_a_bad_device(caller, device, error, message):
    """ops.resolve_backend and ops.backend_unavailable_reason check their device as available_backends does (an
    index is a CUDA device's there too)."""
    with pytest.raises(error, match=re.escape(caller) + message):
        getattr(ops, caller)("foreach", device)
    assert ops.backend_unavailable_reason("reference", 0) == ops.backend_unavailable_reason("reference", "cuda:0")
    assert ops.resolve_backend("reference", 0) == "reference"


@pytest.mark.parametrize("name", ["auto", "Foreach", None, ["foreach"]])
def test_backend_unavailable_reason_takes_a_backend_name_only(name):
    with pytest.raises(ValueError, match=r"backend must be one of \('reference', 'foreach', 'triton', 'cuda'\), got"):
        ops.backend_unavailable_reason(name, "cpu")


@pytest.mark.parametrize("check", ["no", 0, None])
@pytest.mark.parametrize("op", ["fold_", "fold_finish_"])
def test_the_ops_check_flag_must_be_a_bool(op, check):
    """check="no" would run the checks (a truthy str), 0 or None skip them: refused, the buffer untouched."""
    buffer = gafused.FlatGradBuffer([torch.nn.Parameter(torch.zeros(4))])
    buffer.data.fill_(7.0)
    extra = {"weight": 1.0, "scale": 1.0} if op == "fold_finish_" else {}
    with pytest.raises(TypeError, match="check must be a bool, got"):
        getattr(ops, op)(buffer, [torch.ones(4)], first=True, check=check, **extra)
    assert torch.equal(buffer.data, torch.full_like(buffer.data, 7.0))


def test_a_flat_grad_buffer_of_one_tensor_instead_of_a_list_is_refused():
    """list() of a (3, 2) tensor is its three rows: a buffer of three parameters of 2 elements, silently."""
    with pytest.raises(TypeError, match=r"params must be a sequence of tensors, got one tensor: pass \[tensor\]"):
        gafused.FlatGradBuffer(torch.nn.Parameter(torch.zeros(3, 2)))


def _state(model, opt):
    return (
        opt.micro_step,
        [b.data.clone() for b in opt.buffers],
        [None if p.grad is None else p.grad.clone() for p in model.parameters()],
    )


def _assert_same_state(a, b):
    assert a[0] == b[0]
    for x, y in zip(a[1], b[1], strict=True):
        assert torch.equal(x, y)
    for x, y in zip(a[2], b[2], strict=True):
        assert (x is None and y is None) or torch.equal(x, y)


@pytest.mark.parametrize("path", ["host", "device"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.int64], ids=str)
def test_a_weight_tensor_changed_in_place_later_keeps_the_value_it_had(backend, loop, dtype, path, monkeypatch):
    """A reused token counter: the weight is the tensor's value when given, whatever the tensor holds later. On the
    device path (forced here on CPU) a float64 tensor on the buffer's device would otherwise be kept by reference."""
    if path == "device":
        monkeypatch.setattr(gafused.accumulator, "_checked_on_host", lambda device: False)
    param = torch.nn.Parameter(torch.zeros((), dtype=torch.float64))
    opt = GradAccumulator(torch.optim.SGD([param], lr=1.0), accumulation_steps=2, backend=backend)
    counter = torch.zeros((), dtype=dtype)
    for slope, count in ((1.0, 1), (4.0, 3)):
        counter.fill_(count)
        micro_batch(opt, param * slope, loop, weight=counter)
    assert opt.stepped
    assert float(param.detach()) == -(1.0 * 1 + 4.0 * 3) / (1 + 3)


@pytest.mark.parametrize("weight", [1e-39, 1e39, torch.tensor(1e39, dtype=torch.float64), 1e-300], ids=str)
def test_weight_outside_the_accumulation_range_is_refused(backend, loop, weight):
    """A float32 fold would carry 1e39 as inf and 1e-39 as a subnormal (1e-300 as zero): refused with the range,
    before anything changes, rather than skipped as non-finite or folded wrongly. The range is the accumulation
    dtype's: a float64 buffer takes both."""
    model = _model(torch.float32)
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2, backend=backend)
    x, y = _data([3], dtype=torch.float32)[0]
    with pytest.raises(ValueError, match="weight must be 0 or between 1.175e-38 and 3.403e[+]38"):
        micro_batch(opt, _loss(model, x, y), loop, weight=weight)
    assert opt.micro_step == 0 and opt.skipped_steps == 0
    opt.zero_grad()
    micro_batch(opt, _loss(model, x, y), loop, weight=0.0)  # zero stays a valid weight
    assert opt.micro_step == 1
    model = _model(torch.float32)
    wide = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, backend=backend, accum_dtype=torch.float64)
    micro_batch(wide, _loss(model, x, y), loop, weight=weight)
    assert wide.micro_step == 1


@pytest.mark.parametrize("accum_dtype", [torch.float32, torch.float64], ids=str)
def test_a_mean_window_whose_weights_sum_beyond_its_scale_is_refused_at_its_end(backend, loop, accum_dtype):
    """With normalization="mean" a window's sum is multiplied by 1 / its weight sum, a normal number of the
    accumulation dtype only while that sum is at most 1 / tiny: beyond it float32's scale was subnormal (the finished
    gradient off by up to 1e-4 relative), and float64 weights that each fit summed to inf, a scale of 0, so the inner
    optimizer stepped an all-zero gradient. Every weight here fits, their sum does not: the window's end refuses it,
    nothing steps, and the next window is exact. A weight beyond it on its own is refused when given."""
    limit = 1 / torch.finfo(accum_dtype).tiny
    model, twin = _model(torch.float32), _model(torch.float32)
    before = [param.detach().clone() for param in model.parameters()]
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 5, backend=backend, accum_dtype=accum_dtype)
    batches = _data([2] * 5, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"weight must be at most .* with normalization='mean'"):
        micro_batch(opt, _loss(model, *batches[0]), loop, weight=1.5 * limit)
    assert opt.micro_step == 0
    opt.zero_grad()
    weight = 0.9 * limit
    total = f"{5 * weight:.4g}"  # float64: inf
    for index, (x, y) in enumerate(batches):
        if index < 4:
            micro_batch(opt, _loss(model, x, y), loop, weight=weight)
            opt.zero_grad()
            continue
        with pytest.raises(
            ValueError, match=rf"this window's weights sum to {re.escape(total)}, beyond .*1 / that sum"
        ):
            micro_batch(opt, _loss(model, x, y), loop, weight=weight)
    assert opt.micro_step == 0 and not opt.stepped and opt.skipped_steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(param.grad is None for param in model.parameters())
    fresh = GradAccumulator(torch.optim.SGD(twin.parameters(), lr=0.1), 2, backend=backend, accum_dtype=accum_dtype)
    opt.accumulation_steps = 2
    for x, y in batches[:2]:
        for net, acc in ((model, opt), (twin, fresh)):
            micro_batch(acc, _loss(net, x, y), loop, weight=x.shape[0])
            acc.zero_grad()
    assert opt.stepped and fresh.stepped
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True))


@pytest.mark.parametrize(
    ("weight", "error", "message"),
    [
        (-1.0, ValueError, "non-negative finite"),
        (float("nan"), ValueError, "non-negative finite"),
        (float("inf"), ValueError, "non-negative finite"),
        (torch.tensor(-3), ValueError, "non-negative finite"),
        (torch.tensor(float("nan")), ValueError, "non-negative finite"),
        (torch.ones(2), ValueError, "0-d tensor"),
        (torch.tensor(True), ValueError, "real number"),
        (True, TypeError, "weight"),
        ("3", TypeError, "weight"),
        # Ints no float holds, one too long for str(): the error gives their sign and magnitude.
        (10**400, ValueError, "non-negative finite number, got an int of about 1e[+]400$"),
        (-(10**5000), ValueError, "non-negative finite number, got a negative int of about 1e[+]5000$"),
    ],
    ids=[
        "negative",
        "nan",
        "inf",
        "negative-tensor",
        "nan-tensor",
        "1d-tensor",
        "bool-tensor",
        "bool",
        "string",
        "huge-int",
        "int-too-long-to-show",
    ],
)
def test_refused_step_changes_nothing_and_can_be_retried(backend, weight, error, message):
    model = _model()
    reference = copy.deepcopy(model)
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2, backend=backend)
    batches = _data([3, 4], seed=110)
    _loss(model, *batches[0]).backward()
    opt.step(weight=3)
    _loss(model, *batches[1]).backward()
    before = _state(model, opt)
    with pytest.raises(error, match=message):
        opt.step(weight=weight)
    _assert_same_state(before, _state(model, opt))
    opt.step(weight=4)  # the same micro-batch, folded again with a good weight
    assert opt.stepped
    _big_batch_step(reference, torch.optim.SGD(reference.parameters(), lr=0.1), batches)
    _assert_same_params(model, reference, 1e-12)


@pytest.mark.parametrize(
    "name", ["optimizer", "micro_step", "stepped", "grad_norm", "skipped_steps", "accum_dtype", "grad_scaler"]
)
def test_state_attributes_are_read_only(name):
    """What only the accumulator's own calls change cannot be set: a micro_step set back would lengthen the open
    window, a grad_scaler set to another object would break the next backward far from the cause."""
    model = _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2)
    _loss(model, *_data([3], seed=3)[0]).backward()
    opt.step(weight=3)
    before = getattr(opt, name)
    with pytest.raises(AttributeError, match=name):
        setattr(opt, name, 0)
    assert getattr(opt, name) is before and opt.micro_step == 1


@pytest.mark.parametrize(
    "typo, meant",
    [
        ("max_grad_nrom", "max_grad_norm"),
        ("accumulation_step", "accumulation_steps"),
        ("normalisation", "normalization"),
    ],
)
def test_a_misspelled_setting_is_refused_not_added(typo, meant):
    """``opt.max_grad_nrom = 0.5`` would add an attribute nothing reads and leave the gradient unclipped. Other new
    attributes stay legal: GradScaler sets ``grad_scale`` and ``found_inf`` on optimizers, frameworks set theirs."""
    model = _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2, max_grad_norm=1.0)
    before = {name: getattr(opt, name) for name in ("accumulation_steps", "normalization", "max_grad_norm")}
    with pytest.raises(AttributeError, match=f"no setting '{typo}': did you mean '{meant}'"):
        setattr(opt, typo, 0.5)
    assert typo not in vars(opt)
    assert {name: getattr(opt, name) for name in before} == before
    for name in ("grad_scale", "found_inf", "skipped_iter"):
        setattr(opt, name, 7)
        assert getattr(opt, name) == 7


@pytest.mark.parametrize(
    "name", ["last_grad_norm", "max_norm", "accum_steps", "normalize", "clip_grad_norm", "gradient_accumulation_steps"]
)
def test_a_new_attribute_more_than_two_edits_from_every_setting_is_set(name):
    """A name of the user's own (bookkeeping such as ``last_grad_norm``, three edits from ``max_grad_norm``) is no
    typo of a setting: set as on any object, the settings unchanged."""
    model = _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2)
    setattr(opt, name, 7)
    assert vars(opt)[name] == 7
    assert (opt.accumulation_steps, opt.normalization, opt.max_grad_norm) == (2, "mean", None)


def test_sparse_gradients_are_refused_by_name():
    embedding = torch.nn.Embedding(10, 3, sparse=True).double()
    opt = GradAccumulator(torch.optim.SGD(embedding.parameters(), lr=0.1), accumulation_steps=2)
    embedding(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\].*sparse"):
        opt.step()
    assert opt.micro_step == 0 and embedding.weight.grad is not None


def test_parameters_added_later_are_refused():
    """A group added to the inner optimizer after the accumulator was built: every call that would use the window
    refuses, state_dict() too (its checkpoint's window is laid out for parameters the optimizer no longer has)."""
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = GradAccumulator(inner, accumulation_steps=3)
    x, y = _data([2], seed=3)[0]
    _micro_step(opt, model, x, y, "step")
    inner.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))]})
    for call in (opt.step, opt.flush, opt.state_dict, lambda: opt.backward(_loss(model, x, y))):
        with pytest.raises(RuntimeError, match="add_param_group"):
            call()
    assert opt.micro_step == 1
    inner.param_groups.pop()
    inner.param_groups[0]["params"].pop()  # one removed: named as a change, not as an added group
    with pytest.raises(RuntimeError, match=r"now has \d+ parameters.*or params added to or removed from a param group"):
        opt.step()
    assert opt.micro_step == 1


# The Triton interpreter computes with numpy, which warns on the 0 * inf this window is made of.
@pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning")
@pytest.mark.parametrize("normalization", ["mean", "sum"])
def test_zero_weight_window_is_skipped(backend, loop, normalization):
    """A window whose weights sum to zero holds no data: skipped, whichever way the window is normalized."""
    model = _model()
    opt = GradAccumulator(
        torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2, backend=backend, normalization=normalization
    )
    before = [p.detach().clone() for p in model.parameters()]
    for x, y in _data([2, 2], seed=120):
        micro_batch(opt, _loss(model, x, y), loop, 0)
    assert not opt.stepped and opt.skipped_steps == 1
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.detach(), b)


# --- driven windows and normalization ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("loop", "declared"),
    [("backward", "backward"), ("backward", "step"), ("backward", "flush"), ("step", "step"), ("step", "flush")],
    ids=[
        "backward-loop-end-at-backward",
        "backward-loop-end-at-step",
        "backward-loop-flush",
        "step-loop-end-at-step",
        "step-loop-flush",
    ],
)
def test_driven_windows_match_big_batch_in_float64(backend, loop, declared):
    """accumulation_steps=None: a window ends only when the caller says so, at any length."""
    model = _model()
    reference = copy.deepcopy(model)
    opt = GradAccumulator(
        _make_optimizer("adamw", model.parameters()), accumulation_steps=None, max_grad_norm=0.3, backend=backend
    )
    reference_opt = _make_optimizer("adamw", reference.parameters())
    for window, sizes in enumerate([[3, 1, 4], [2], [5, 2, 3, 1, 4, 2]]):
        batches = _data(sizes, seed=140 + window)
        for index, (x, y) in enumerate(batches):
            end = index == len(batches) - 1 and declared != "flush"
            loss = _loss(model, x, y)
            if loop == "backward":
                opt.backward(loss, weight=x.shape[0], end_window=end and declared == "backward")
                opt.step(end_window=end and declared == "step")
            else:
                loss.backward()
                opt.step(weight=x.shape[0], end_window=end)
            opt.zero_grad()
            assert opt.stepped == end
            assert opt.micro_step == (0 if end else index + 1)  # never ended by a count
        if declared == "flush":
            assert opt.flush() is True
        norm = _big_batch_step(reference, reference_opt, batches, max_norm=0.3)
        torch.testing.assert_close(opt.grad_norm, norm, rtol=1e-12, atol=0)
        _assert_same_params(model, reference, 1e-12)


def test_end_window_ends_a_counted_window_early(backend, loop):
    """end_window=True ends a counted window at that micro-batch; the next window counts from zero again."""
    model = _model()
    reference = copy.deepcopy(model)
    opt = GradAccumulator(_make_optimizer("sgd-momentum", model.parameters()), accumulation_steps=4, backend=backend)
    reference_opt = _make_optimizer("sgd-momentum", reference.parameters())
    for window, sizes in enumerate([[3, 5], [2, 4, 1, 3], [6]]):
        batches = _data(sizes, seed=150 + window)
        early = len(sizes) < 4
        for index, (x, y) in enumerate(batches):
            end = early and index == len(batches) - 1
            loss = _loss(model, x, y)
            micro_batch(opt, loss, loop, weight=x.shape[0], end_window=end)
            opt.zero_grad()
        assert opt.stepped and opt.micro_step == 0
        _big_batch_step(reference, reference_opt, batches)
        _assert_same_params(model, reference, 1e-12)


def test_end_declared_by_a_later_backward_of_themicro_batch(backend):
    """A micro-batch of two backward() calls, the window's end declared by the second: step() finishes it."""
    model = _model()
    reference = copy.deepcopy(model)
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=None, backend=backend)
    (x1, y1), (x2, y2), (x3, y3) = _data([3, 2, 4], seed=160)
    opt.backward(_loss(model, x1, y1), weight=3)
    opt.step()
    opt.backward(_loss(model, x2, y2), weight=6)  # the second micro-batch: x2 and x3, weighed together
    opt.backward(_loss(model, x3, y3), weight=6, end_window=True)
    assert not opt.stepped
    opt.step()
    assert opt.stepped and opt.micro_step == 0
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    (3 * _loss(reference, x1, y1) + 6 * (_loss(reference, x2, y2) + _loss(reference, x3, y3))).div(9).backward()
    reference_opt.step()
    _assert_same_params(model, reference, 1e-12)


def _window_normalized_loss(model, x, y, window_elements):
    """A micro-batch's loss already divided by the whole window's size (transformers' num_items_in_batch)."""
    return torch.nn.functional.mse_loss(model(x), y, reduction="sum") / window_elements


@pytest.mark.parametrize("steps", [3, None], ids=["counted", "driven"])
def test_sum_normalization_matches_big_batch_in_float64(backend, loop, steps):
    """normalization="sum": losses normalized over the window are summed, not averaged again."""
    model = _model()
    reference = copy.deepcopy(model)
    opt = GradAccumulator(
        _make_optimizer("adamw", model.parameters()),
        accumulation_steps=steps,
        max_grad_norm=0.3,
        backend=backend,
        normalization="sum",
    )
    reference_opt = _make_optimizer("adamw", reference.parameters())
    for window, sizes in enumerate([[2, 7, 3], [5, 1, 6], [4, 2]]):  # the last is partial: ended early or flushed
        batches = _data(sizes, seed=170 + window)
        window_elements = sum(y.numel() for _, y in batches)
        for index, (x, y) in enumerate(batches):
            end = steps is None and index == len(batches) - 1
            loss = _window_normalized_loss(model, x, y, window_elements)
            micro_batch(opt, loss, loop, end_window=end)
            opt.zero_grad()
        if not opt.stepped:
            assert opt.flush() is True
        norm = _big_batch_step(reference, reference_opt, batches, max_norm=0.3)
        torch.testing.assert_close(opt.grad_norm, norm, rtol=1e-12, atol=0)
        _assert_same_params(model, reference, 1e-12)


def test_sum_normalization_is_not_the_mean(backend):
    """The control for the test above: the same window-normalized losses under the default "mean" are k times
    too small."""
    model = _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.0), accumulation_steps=3, backend=backend)
    batches = _data([2, 7, 3], seed=170)
    window_elements = sum(y.numel() for _, y in batches)
    for x, y in batches:
        _window_normalized_loss(model, x, y, window_elements).backward()
        opt.step()
    reference = copy.deepcopy(model)
    norm = _big_batch_step(reference, torch.optim.SGD(reference.parameters(), lr=0.0), batches)
    torch.testing.assert_close(opt.grad_norm * 3, norm, rtol=1e-12, atol=0)


def test_driven_sum_checkpoint_resumes_exactly(backend, loop):
    def build():
        model = _model()
        opt = GradAccumulator(
            _make_optimizer("adamw", model.parameters()),
            accumulation_steps=None,
            max_grad_norm=0.5,
            backend=backend,
            normalization="sum",
        )
        return model, opt

    sizes = [3, 1, 4, 2, 5, 2, 3]  # one window, checkpointed after the fifth micro-batch
    batches = _data(sizes, seed=180)
    window_elements = sum(y.numel() for _, y in batches)

    def run(model, opt, part):
        for index, (x, y) in part:
            loss = _window_normalized_loss(model, x, y, window_elements)
            end = index == len(sizes) - 1
            micro_batch(opt, loss, loop, end_window=end)
            opt.zero_grad()

    uninterrupted, uninterrupted_opt = build()
    run(uninterrupted, uninterrupted_opt, list(enumerate(batches)))
    assert uninterrupted_opt.stepped

    model, opt = build()
    run(model, opt, list(enumerate(batches))[:5])
    assert opt.micro_step == 5
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, saved)
    saved.seek(0)
    checkpoint = torch.load(saved, weights_only=True)
    assert checkpoint["opt"]["gafused"]["accumulation_steps"] is None
    assert checkpoint["opt"]["gafused"]["normalization"] == "sum"
    resumed, resumed_opt = build()
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt.load_state_dict(checkpoint["opt"])
    assert resumed_opt.micro_step == 5
    run(resumed, resumed_opt, list(enumerate(batches))[5:])
    assert resumed_opt.stepped
    for a, b in zip(resumed.parameters(), uninterrupted.parameters(), strict=True):
        assert torch.equal(a, b)


def test_checkpoint_window_must_fit_the_accumulator():
    model = _model()
    driven = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), None, normalization="sum")
    for x, y in _data([2] * 5, seed=190):
        _loss(model, x, y).backward()
        driven.step()
    open_window = driven.state_dict()
    assert open_window["gafused"]["micro_step"] == 5
    counted = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 4, normalization="sum")
    with pytest.raises(ValueError, match=r"\['micro_step'\].*accumulation_steps=4"):
        counted.load_state_dict(open_window)
    mean = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), None)
    with pytest.raises(
        ValueError, match=r"\['normalization'\].*as 'sum'.*normalization='mean'.*= 'sum' \(between windows\) before"
    ):
        mean.load_state_dict(open_window)
    twin = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), None)
    twin.normalization = "sum"  # what the refusal says to do
    twin.load_state_dict(open_window)
    assert twin.micro_step == 5
    bad = copy.deepcopy(open_window)
    bad["gafused"]["normalization"] = "median"
    with pytest.raises(ValueError, match=r"\['normalization'\]"):
        driven.load_state_dict(bad)
    assert driven.flush()
    closed = driven.state_dict()
    mean.load_state_dict(closed)  # between windows the normalization may change
    older = copy.deepcopy(open_window)
    del older["gafused"]["normalization"]  # checkpoints from before normalization=: all "mean"
    mean.load_state_dict(older)
    assert mean.micro_step == 5


def test_end_window_and_weight_arguments_are_checked():
    model = _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), None)
    (x, y), _ = _data([2, 2], seed=200)
    with pytest.raises(TypeError, match="end_window must be a bool"):
        opt.backward(_loss(model, x, y), end_window=1)
    assert opt.micro_step == 0 and all(p.grad is None for p in model.parameters())
    _loss(model, x, y).backward()
    with pytest.raises(TypeError, match="end_window must be a bool"):
        opt.step(end_window="yes")
    with pytest.raises(TypeError, match="end_window must be a bool, got numpy.bool"):  # NumPy's is not Python's
        opt.step(end_window=np.True_)
    with pytest.raises(TypeError, match=r"step\(weight=w\)"):
        opt.step(3)  # a positional argument is the closure, as in torch.optim.Optimizer.step
    assert opt.micro_step == 0 and all(p.grad is not None for p in model.parameters())
    opt.step(weight=2, end_window=True)
    assert opt.stepped


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), 1e39, 1e-39], ids=str)
def test_device_tensor_weight_checked_at_window_end(bad, device, monkeypatch):
    """A device tensor weight is not read when given (a host sync): it is flagged on the device and refused at the
    window's end, the window discarded. On CPU, where it is read at once, the device path is forced."""
    if device == "cpu":
        monkeypatch.setattr(gafused.accumulator, "_checked_on_host", lambda device: False)
    model = _model(torch.float32).to(device)
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2)
    before = [p.detach().clone() for p in model.parameters()]
    for index, (x, y) in enumerate(_data([2, 2], dtype=torch.float32, seed=130)):
        _loss(model, x.to(device), y.to(device)).backward()
        weight = torch.tensor(bad if index == 0 else 2.0, dtype=torch.float64, device=device)
        if index == 0:
            opt.step(weight=weight)  # no host sync: the check waits for the end of the window
        else:
            with pytest.raises(ValueError, match="one given as a device tensor was negative"):
                opt.step(weight=weight)
    assert opt.micro_step == 0 and not opt.stepped
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.detach(), b)


@pytest.mark.parametrize("when", ["window start", "window end"])
def test_parameter_swapped_in_the_inner_optimizer_is_refused(loop, when):
    """Same count, another tensor: its gradient would never be folded, so the window's first and last micro-batch
    refuse it, naming where it sits, before anything changes."""
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = GradAccumulator(inner, accumulation_steps=2)
    batches = _data([3, 4])
    if when == "window end":
        _micro_step(opt, model, *batches[0], loop)
    inner.param_groups[0]["params"][1] = torch.nn.Parameter(model[0].bias.detach().clone())
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['params'\]\[1\] is not the parameter"):
        _micro_step(opt, model, *batches[1], loop)
    assert opt.micro_step == (1 if when == "window end" else 0) and not opt.stepped
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.fixture
def swap_on_conversion():
    """load_state_dict() and model.to() swap each parameter's tensor in place (torch.utils.swap_tensors)."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    yield
    torch.__future__.set_swap_module_params_on_conversion(before)


def _swap_every_tensor(model, how):
    tensors = [p._cdata for p in model.parameters()]
    if how == "load_state_dict":
        model.load_state_dict(model.state_dict())
        assert all(p._cdata != tensor for p, tensor in zip(model.parameters(), tensors, strict=True))
    elif how == "to":
        model.to("cpu")  # already there: the tensors are swapped all the same
        assert all(p._cdata != tensor for p, tensor in zip(model.parameters(), tensors, strict=True))
    else:  # several swaps: a later tensor may take a freed one's address, the one the accumulator saw
        for _ in range(3):
            model.to("cpu")


@pytest.mark.parametrize("how", ["load_state_dict", "to", "to three times"])
def test_parameters_swapped_in_place_between_windows_keep_their_hooks(loop, how, swap_on_conversion):
    """A swapped parameter keeps its hook tables, but autograd runs those of the tensor it held before: the buckets
    were no longer folded during backward, nor a user's hook run. The accumulator attaches the tables again at the
    window's first micro-batch (before its backward in the backward() loop, at its step() in the other)."""
    model = _model()
    reference = copy.deepcopy(model)
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, bucket_bytes=1)
    buckets = len(opt.buffers[0].bucket_ranges)
    assert buckets == 4
    ready = []
    on_bucket_ready = opt.on_bucket_ready
    opt.on_bucket_ready = lambda g, b: (ready.append(b), on_bucket_ready(g, b))
    user = []
    model[0].weight.register_post_accumulate_grad_hook(lambda param: user.append(param.grad.clone()))
    batches = _data([3, 4, 2, 5, 4, 3])
    for window in range(3):
        if window == 1:
            _swap_every_tensor(model, how)
        ready.clear()
        user.clear()
        pair = batches[2 * window : 2 * window + 2]
        for x, y in pair:
            _micro_step(opt, model, x, y, loop)
        assert opt.stepped
        _big_batch_step(reference, reference_opt, pair)
        _assert_same_params(model, reference, 1e-12)
        if loop == "backward":
            if window == 0:  # bucket by bucket; the one whose last hook the user's follows, after backward
                folded_during_backward = sorted(ready)
                assert len(folded_during_backward) == 2 * (buckets - 1)
            assert sorted(ready) == folded_during_backward
            assert len(user) == 2
        elif window != 1:  # the step-time loop attaches them at the swap's first step(), after its backward
            assert len(user) == 2


def test_hooks_are_attached_again_after_swaps_that_reuse_a_freed_tensors_address(swap_on_conversion):
    """After several swaps a parameter may hold a tensor at the address of the one the accumulator saw (freed by an
    earlier swap): the address alone said "not swapped" and the buckets were no longer folded during backward. The
    mark the accumulator leaves in the parameter's __dict__ goes with every swap."""
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, bucket_bytes=1)
    ready = []
    on_bucket_ready = opt.on_bucket_ready
    opt.on_bucket_ready = lambda g, b: (ready.append(b), on_bucket_ready(g, b))
    tensors = [p._cdata for p in model.parameters()]
    counts = []
    for window in range(3):
        if window == 1:
            for _ in range(3):
                model.to("cpu")
            reused = any(p._cdata == tensor for p, tensor in zip(model.parameters(), tensors, strict=True))
        ready.clear()
        for _ in range(2):
            opt.backward(model(torch.randn(4, 5)).square().mean(), weight=4)
            opt.step()
            opt.zero_grad()
        counts.append(len(ready))
    assert counts == [4, 4, 4], (counts, reused)


def test_the_swap_mark_saves_with_parameters_and_leaves_with_its_accumulator():
    """The mark each accumulator leaves in its parameters' __dict__ is an int: Parameters saved with it (an EMA copy,
    state_dict(keep_vars=True)) load with torch.load's weights_only. Each accumulator has its own, taken away when
    it is dropped."""
    import gc

    model = _model()
    first = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    second = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    assert len(vars(model[0].weight)["_gafused_hooks"]) == 2
    saved = io.BytesIO()
    torch.save(model.state_dict(keep_vars=True), saved)
    saved.seek(0)
    loaded = torch.load(saved, weights_only=True)
    assert torch.equal(loaded["0.weight"], model[0].weight)
    del first, second
    gc.collect()
    assert all("_gafused_hooks" not in vars(p) for p in model.parameters())


def test_two_accumulators_over_the_same_parameters_take_turns_exactly_under_create_graph():
    """Each one's mark is its own: the other's use is not a swap (a new p.grad with a graph was refused as one)."""
    model = _model()
    reference = copy.deepcopy(model)
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    accumulators = [GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2) for _ in range(2)]
    batches = _data([3, 4, 2, 5, 4, 3, 2, 2])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # create_graph=True's warning about the cycle between a parameter and its grad
        for window in range(4):
            pair = batches[2 * window : 2 * window + 2]
            opt = accumulators[window % 2]
            for x, y in pair:
                _loss(model, x, y).backward(create_graph=True)
                opt.step(weight=len(x))
            assert opt.stepped
            _big_batch_step(reference, reference_opt, pair)
            _assert_same_params(model, reference, 1e-12)


@pytest.mark.parametrize("create_graph", [False, True], ids=["in place", "create_graph"])
def test_a_finished_gradient_kept_through_a_swap_and_added_into_is_refused(swap_on_conversion, create_graph):
    """The step-time loop without zero_grad(): model.to() keeps the finished gradient a window's step handed out,
    and the hook that releases it before a backward no longer runs on the swapped tensor, so autograd adds the next
    micro-batch into it (in place, or into a new tensor under create_graph=True). That gradient cannot be told from
    the finished one: refused, changing nothing, also after several swaps; after zero_grad() the micro-batch runs
    again and the window is the big batch's. load_state_dict() drops p.grad, and the windows after it are exact
    without zero_grad(), but under create_graph=True a new p.grad with a graph looks like such a sum: refused too."""
    model = _model()
    reference = copy.deepcopy(model)
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    batches = _data([3, 4, 2, 5, 4, 3, 2, 2, 3, 3])

    def backward(x, y):
        _loss(model, x, y).backward(create_graph=create_graph)

    def window(pair, swap=None):
        for index, (x, y) in enumerate(pair):
            if swap is not None and index == 0:
                _swap_every_tensor(model, swap)
            backward(x, y)
            if index == 0 and (swap in ("to", "to three times") or (swap is not None and create_graph)):
                before = [p.detach().clone() for p in model.parameters()]
                said = "create_graph=True a new p.grad" if create_graph else "written in place"
                with pytest.raises(RuntimeError, match=rf"params'\]\[0\].*may be the finished gradient.*{said}"):
                    opt.step(weight=len(x))
                assert opt.micro_step == 0 and opt.stepped  # as the last window's step left it
                assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
                opt.zero_grad()
                backward(x, y)
            opt.step(weight=len(x))  # no zero_grad(): the finished gradients stay in p.grad
        assert opt.stepped
        _big_batch_step(reference, reference_opt, pair)
        _assert_same_params(model, reference, 1e-12)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # create_graph=True's warning about the cycle between a parameter and its grad
        window(batches[0:2])
        window(batches[2:4], swap="load_state_dict")
        window(batches[4:6])
        window(batches[6:8], swap="to")
        window(batches[8:10], swap="to three times")


def test_a_conversion_there_and_back_moves_the_finished_gradient_off_the_buffer(loop, swap_on_conversion):
    """model.to() converts each p.grad by swapping it too: model.float().double() leaves the finished gradient a
    window's step handed out as the same tensor object in new memory, where the step-time loop without zero_grad()
    has autograd add the next micro-batch. That step() is refused, changing nothing (it released the sum as the
    finished gradient, the micro-batch lost); after zero_grad() the micro-batch runs again and the window is the big
    batch's. backward() asks before autograd runs: the moved gradient is released, and the window is exact."""
    model = _model()
    reference = copy.deepcopy(model)
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    batches = _data([3, 4, 2, 5])

    def micro_batch(x, y):
        if loop == "backward":
            opt.backward(_loss(model, x, y), weight=len(x))
            opt.step()
        else:
            _loss(model, x, y).backward()
            opt.step(weight=len(x))  # no zero_grad(): the finished gradients stay in p.grad

    for x, y in batches[:2]:
        micro_batch(x, y)
    _big_batch_step(reference, reference_opt, batches[:2])
    grads = [p.grad for p in model.parameters()]
    for network in (model, reference):
        network.float().double()
    assert all(p.grad is grad for p, grad in zip(model.parameters(), grads, strict=True))  # the same objects
    if loop == "step":
        x, y = batches[2]
        _loss(model, x, y).backward()
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(RuntimeError, match=r"params'\]\[0\].*may be the finished gradient.*moved that p.grad"):
            opt.step(weight=len(x))
        assert opt.micro_step == 0 and opt.stepped  # as the last window's step left it
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        opt.zero_grad()
    for x, y in batches[2:]:
        micro_batch(x, y)
    assert opt.stepped
    _big_batch_step(reference, reference_opt, batches[2:])
    _assert_same_params(model, reference, 1e-12)


def test_a_moved_finished_gradient_nobody_wrote_is_released_as_finished(swap_on_conversion):
    """A layer converted there and back between windows (float().double()), the step-time loop without zero_grad():
    the next micro-batch does not use it, so its p.grad hold the moved finished gradients unwritten (the conversion's
    new memory, version 0): released as the finished gradients they are, not refused; the window is the big
    batch's."""
    torch.manual_seed(0)
    used, unused = torch.nn.Linear(5, 3).double(), torch.nn.Linear(5, 3).double()
    model = torch.nn.ModuleList([used, unused])
    reference = copy.deepcopy(model)
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 1)
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    x = torch.randn(4, 5, dtype=torch.float64)
    for network, optimizer in ((model, opt), (reference, reference_opt)):
        (network[0](x) + network[1](x)).square().sum().backward()
        optimizer.step()  # no zero_grad(): the accumulator's p.grad are the finished gradients' views
        network[1].float().double()
    assert all(p.grad is not None for p in unused.parameters())
    reference_opt.zero_grad()
    for network in (model, reference):
        network[0](x).square().mean().backward()
    opt.step()
    reference_opt.step()
    assert opt.stepped and all(p.grad is None for p in unused.parameters())
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-15, atol=0)


def test_the_swap_refusal_names_every_view_that_may_have_been_added_into(swap_on_conversion):
    """A finished gradient's views share their buffer's version counter: after a swap and a backward through one layer
    of two, which view autograd added into cannot be told, so every swapped parameter still holding its view is
    named, not the first of them alone (which was the other layer's)."""
    torch.manual_seed(0)
    first, second = torch.nn.Linear(5, 3), torch.nn.Linear(5, 3)
    model = torch.nn.ModuleList([first, second])
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 1)
    x = torch.randn(4, 5)
    (first(x) + second(x)).sum().backward()
    opt.step()  # no zero_grad(): every p.grad is its finished gradient's view
    model.to("cpu")
    second(x).sum().backward()  # autograd adds into the second layer's views only
    with pytest.raises(RuntimeError) as refused:
        opt.step()
    said = str(refused.value)
    names = [
        f"param_groups[0]['params'][{index}] (shape {tuple(p.shape)})" for index, p in enumerate(model.parameters())
    ]
    assert said.startswith(", ".join(names) + ": the p.grad of one or more of these may be the finished gradient")
    assert "which of them cannot be told" in said and opt.stepped and opt.micro_step == 0


def test_the_swap_refusal_names_the_views_of_every_buffer_written_since(swap_on_conversion):
    """Layers of two dtypes have two buffers: a backward through both after a swap names the views of both, one through
    the float64 layer only names that buffer's views alone (the other buffer was not written)."""
    for through_both in (True, False):
        torch.manual_seed(0)
        narrow, wide = torch.nn.Linear(5, 3), torch.nn.Linear(5, 3).double()
        model = torch.nn.ModuleList([narrow, wide])
        opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 1)
        assert len(opt.buffers) == 2
        x = torch.randn(4, 5)
        (narrow(x).double() + wide(x.double())).sum().backward()
        opt.step()  # no zero_grad(): every p.grad is its finished gradient's view
        model.to("cpu")
        (narrow(x).double() + wide(x.double()) if through_both else wide(x.double())).sum().backward()
        with pytest.raises(RuntimeError) as refused:
            opt.step()
        names = [f"param_groups[0]['params'][{i}] (shape {tuple(p.shape)})" for i, p in enumerate(model.parameters())]
        named = names if through_both else names[2:]
        assert str(refused.value).startswith(", ".join(named) + ": the p.grad of one or more of these may be")


def test_a_swap_after_a_window_whose_finished_gradients_nobody_wrote_is_accepted(swap_on_conversion):
    """The backward loop without zero_grad(), and model.to() between windows: the finished gradients still in p.grad
    were not written since (opt.backward() releases them before autograd runs), so nothing is refused, and every
    window is the big batch's."""
    model = _model()
    reference = copy.deepcopy(model)
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    batches = _data([3, 4, 2, 5, 4, 3])
    for window in range(3):
        pair = batches[2 * window : 2 * window + 2]
        if window:
            _swap_every_tensor(model, "to")  # p.grad: the last window's finished views, unwritten
        for x, y in pair:
            opt.backward(_loss(model, x, y), weight=len(x))
            opt.step()
        assert opt.stepped
        _big_batch_step(reference, reference_opt, pair)
        _assert_same_params(model, reference, 1e-12)


def test_a_frozen_parameter_swapped_between_windows_is_accepted(swap_on_conversion):
    """A parameter that does not require grad has no hook tables and no finished gradient in p.grad: model.to()
    swapping it between windows (the backward loop without zero_grad()) is accepted, the others' hooks are attached
    again (every micro-batch still folds during backward), and every window is the big batch's."""
    model = _model()
    model[0].bias.requires_grad_(False)
    reference = copy.deepcopy(model)
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="do not require grad"):
        opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    ready = []
    on_bucket_ready = opt.on_bucket_ready
    opt.on_bucket_ready = lambda g, b: (ready.append(b), on_bucket_ready(g, b))
    batches = _data([3, 4, 2, 5, 4, 3])
    for window in range(3):
        pair = batches[2 * window : 2 * window + 2]
        if window:
            _swap_every_tensor(model, "to")
        ready.clear()
        for x, y in pair:
            opt.backward(_loss(model, x, y), weight=len(x))
            opt.step()
        assert opt.stepped and len(ready) == 2 and model[0].bias.grad is None
        _big_batch_step(reference, reference_opt, pair)
        _assert_same_params(model, reference, 1e-12)


def _micro_step(opt, model, x, y, loop, scaler=None, weight=None):
    """One micro-batch weighted by ``weight`` (default: its size) in either loop; ``scaler``: the step-time loop
    scales the loss with it (``opt.backward`` scales it with the accumulator's own)."""
    weight = len(x) if weight is None else weight
    if loop == "backward":
        opt.backward(_loss(model, x, y), weight=weight)
        opt.step()
    else:
        loss = _loss(model, x, y)
        (loss if scaler is None else scaler.scale(loss)).backward()
        opt.step(weight=weight)
    opt.zero_grad()


@pytest.mark.parametrize("resumed_with", ["no scaler", "a scaler at another scale"])
def test_mid_window_checkpoint_taken_under_a_loss_scale_resumes_exactly(loop, resumed_with):
    """The folded part of a checkpointed window is unscaled already; the rest is unscaled with the loss scale of
    the accumulator that resumes it (none, or its own scaler's), not the one saved."""
    batches = _data([3, 5])
    model = _model()
    reference = copy.deepcopy(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, grad_scaler=scaler)
    _micro_step(opt, model, *batches[0], loop, scaler)
    state = opt.state_dict()

    other = torch.amp.GradScaler("cpu", init_scale=2.0**16) if resumed_with != "no scaler" else None
    resumed = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, grad_scaler=other)
    resumed.load_state_dict(state)
    _micro_step(resumed, model, *batches[1], loop, other)
    assert resumed.stepped
    _big_batch_step(reference, torch.optim.SGD(reference.parameters(), lr=0.1), batches)
    _assert_same_params(model, reference, 1e-12)


@pytest.mark.parametrize("loop", ["step", "backward"])
def test_a_grad_scaler_used_by_another_live_accumulator_is_refused(loop):
    """Two accumulators sharing a scaler: one's window end grows (or backs off) the scale while the other holds
    gradients scaled by the old scale, which it would unscale with the new one (40% off with windows of 2 and 3).
    The second user is refused before anything changes; once the first is dropped, the scaler is free."""
    import gc

    model = _model()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    first = GradAccumulator(torch.optim.SGD(list(model[0].parameters()), lr=0.1), 2, grad_scaler=scaler)
    second = GradAccumulator(torch.optim.SGD(list(model[2].parameters()), lr=0.1), 3, grad_scaler=scaler)
    x, y = _data([3])[0]
    micro_batch(first, _loss(model, x, y) if loop == "backward" else scaler.scale(_loss(model, x, y)), loop)
    grads = {name: p.grad for name, p in model.named_parameters() if name.startswith("2.")}
    loss = _loss(model, x, y)
    with pytest.raises(RuntimeError, match="grad_scaler is used by another GradAccumulator that is still alive"):
        if loop == "backward":
            second.backward(loss)
        else:
            second.step()
    assert second.micro_step == 0 and second._micro is None
    assert all(model.get_parameter(name).grad is grad for name, grad in grads.items())
    assert first.micro_step == 1

    del first
    gc.collect()
    second.zero_grad()
    micro_batch(second, _loss(model, x, y) if loop == "backward" else scaler.scale(_loss(model, x, y)), loop)
    assert second.micro_step == 1


def test_an_equal_cpu_tensor_weight_may_be_repeated_by_a_later_backward():
    model = _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2)
    x, y = _data([3])[0]
    opt.backward(_loss(model, x, y), weight=torch.tensor(3.0), retain_graph=True)
    opt.backward(_loss(model, x, y), weight=torch.tensor(3.0, dtype=torch.float64), retain_graph=True)
    opt.backward(_loss(model, x, y), weight=3)
    with pytest.raises(ValueError, match=r"given as tensor\(3\.\).*got tensor\(2\.\).*equal number or CPU tensor"):
        opt.backward(_loss(model, x, y), weight=torch.tensor(2.0))
    opt.step()
    assert opt.micro_step == 1


def test_a_weight_of_1_repeats_a_first_backward_that_gave_none():
    """A first backward() without a weight weighs its micro-batch 1: a later backward() of the same micro-batch may
    repeat that as 1 (a number or a CPU tensor), and folds what weight=None would; any other weight is refused."""
    model, reference = _model(), _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2)
    plain = GradAccumulator(torch.optim.SGD(reference.parameters(), lr=0.1), accumulation_steps=2)
    batches = _data([3, 2, 4])
    for weights in ((None, 1, torch.tensor(1.0)), (None, None, None)):
        net, accumulator = (model, opt) if weights[1] is not None else (reference, plain)
        for (x, y), weight in zip(batches, weights, strict=True):
            accumulator.backward(_loss(net, x, y), weight=weight)
        if accumulator is opt:
            with pytest.raises(ValueError, match=r"given as None by an earlier backward\(\); got 2\.0"):
                opt.backward(_loss(model, *batches[0]), weight=2.0)
        accumulator.step()
        accumulator.backward(_loss(net, *batches[1]))
        accumulator.step()
        assert accumulator.stepped
    _assert_same_params(model, reference, 0)


def test_loss_scaler_is_updated_only_for_a_step_that_ran_or_was_skipped():
    """As with GradScaler: update() follows a step that ran (growth) or found inf (back-off); a window whose inner
    step (or step pre-hook) raised leaves the scaler as it was."""
    model = _model(torch.float32)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=1)
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 1, grad_scaler=scaler)
    x, y = _data([3], dtype=torch.float32)[0]

    def window(target=y):
        opt.backward(_loss(model, x, target))
        opt.step()
        opt.zero_grad()

    window()
    assert opt.stepped and scaler.get_scale() == 8.0

    def refuse(optimizer, args, kwargs):
        raise RuntimeError("pre-hook says no")

    handle = opt.register_step_pre_hook(refuse)
    with pytest.raises(RuntimeError, match="pre-hook says no"):
        window()
    assert scaler.get_scale() == 8.0 and int(scaler._growth_tracker) == 0
    handle.remove()
    window(torch.full_like(y, float("inf")))
    assert not opt.stepped and opt.skipped_steps == 1 and scaler.get_scale() == 4.0


def test_parameter_swapped_before_a_closure_that_ends_the_window_is_refused():
    """step(closure): the closure's backward(end_window=True) makes this step() the window's last one, so the
    parameters are checked again after the closure, before the window is finished."""
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = GradAccumulator(inner, accumulation_steps=None)
    batches = _data([3, 4])
    _micro_step(opt, model, *batches[0], "backward")
    inner.param_groups[0]["params"][0] = torch.nn.Parameter(model[0].weight.detach().clone())
    before = [p.detach().clone() for p in model.parameters()]

    def closure():
        loss = _loss(model, *batches[1])
        opt.backward(loss, weight=4, end_window=True)
        return loss

    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['params'\]\[0\] is not the parameter"):
        opt.step(closure)
    assert not opt.stepped and opt.micro_step == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_device_tensor_learning_rate_changed_in_place_inside_a_window_warns(device, monkeypatch):
    """A device-tensor learning rate is not read (a host sync): it is compared by identity and version, so a
    scheduler that changes it in place (fill_) every micro-batch is still seen (by identity alone it was not). On
    CPU, where it is read, the device path is forced."""
    if device == "cpu":
        monkeypatch.setattr(gafused.accumulator, "_checked_on_host", lambda device: False)
    model = _model(torch.float32).to(device)
    inner = torch.optim.Adam(model.parameters(), lr=torch.tensor(1e-3, device=device), foreach=False)
    opt = GradAccumulator(inner, accumulation_steps=2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.5**epoch)
    lr = inner.param_groups[0]["lr"]
    with pytest.warns(UserWarning, match="learning rate changed inside an accumulation window"):
        for x, y in _data([2] * 2, dtype=torch.float32, seed=101):
            _loss(model, x.to(device), y.to(device)).backward()
            opt.step(weight=2)
            scheduler.step()  # the mistake: stepped every micro-batch
    assert inner.param_groups[0]["lr"] is lr  # changed in place, the same tensor


@pytest.mark.gpu
@pytest.mark.parametrize("gpu_backend", ["auto", "foreach", "triton", "cuda"])
@pytest.mark.parametrize("loop", ["step", "backward"])
@pytest.mark.parametrize("weight", ["number", "cpu tensor", "cuda tensor"])
def test_a_middle_micro_step_makes_no_host_sync(loop, weight, gpu_backend):
    """No host sync per micro-step, whatever the weight is given as and on every backend a GPU runs: a CPU tensor's
    value is read on the host and not copied to the device (a blocking copy would wait for the queued backward)."""
    if gpu_backend != "auto" and ops.backend_unavailable_reason(gpu_backend, "cuda") is not None:
        pytest.skip(ops.backend_unavailable_reason(gpu_backend, "cuda"))
    model = _model(torch.float32).cuda()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=4, backend=gpu_backend)
    batches = [(x.cuda(), y.cuda()) for x, y in _data([3] * 6, dtype=torch.float32, seed=8)]
    given = {
        "number": lambda: 3.0,
        "cpu tensor": lambda: torch.tensor(3),
        "cuda tensor": lambda: torch.tensor(3.0, device="cuda"),
    }[weight]
    for index, (x, y) in enumerate(batches):
        middle = index == 5  # a window's second micro-step, after one whole window made the tables
        weight_given = given()  # made before the check: a CUDA tensor made from a number is a blocking copy itself
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if middle else "default")
        try:
            micro_batch(opt, _loss(model, x, y), loop, weight=weight_given)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        opt.zero_grad()
    assert opt.micro_step == 2


@pytest.mark.gpu
def test_device_tensor_learning_rate_does_not_warn_after_a_mid_window_checkpoint():
    """A GPU-tensor learning rate is compared by identity (no sync): after a load, the loaded optimizer's tensor
    stands for the saved one, so resuming the window is not taken for a scheduler stepped inside it."""
    model = _model(torch.float32).cuda()
    batches = [(x.cuda(), y.cuda()) for x, y in _data([2, 3], dtype=torch.float32, seed=7)]

    def build():
        inner = torch.optim.Adam(model.parameters(), lr=torch.tensor(1e-3, device="cuda"), foreach=False)
        return GradAccumulator(inner, accumulation_steps=2)

    opt = build()
    _micro_step(opt, model, *batches[0], "backward")
    state = opt.state_dict()
    resumed = build()
    resumed.load_state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _micro_step(resumed, model, *batches[1], "backward")
    assert resumed.stepped


@pytest.mark.parametrize("loop", ["step", "backward"])
def test_weight_that_underflows_once_divided_by_the_loss_scale_is_refused(loop):
    """A weight inside float32's normal range on its own can leave it once the loss scale divides it: the fold
    weight would lose its precision to underflow, so the window is refused like a bad device weight."""
    model = _model(torch.float32)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20)
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 1, grad_scaler=scaler)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = _data([3], dtype=torch.float32)[0]
    tiny = torch.finfo(torch.float32).tiny * 4  # a normal number; 2^-20 of it is not
    top = torch.finfo(torch.float32).max
    fitting = re.escape(f"0, or {torch.finfo(torch.float32).tiny * 2.0**20:.3g} to {top:.3g})")  # the weights that fit
    with pytest.raises(ValueError, match=rf"divided by grad_scaler's loss scale .*: {fitting}"):
        _micro_step(opt, model, x, y, loop, scaler, weight=tiny)
    assert opt.micro_step == 0 and not opt.stepped and scaler.get_scale() == 2.0**20
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    opt.backward(_loss(model, x, y), weight=3.0)  # a weight that fits still folds
    opt.step()
    assert opt.stepped


def test_weight_above_the_range_once_divided_by_a_loss_scale_below_one_is_refused_with_that_range():
    """A loss scale below 1 raises a weight: one near float32's maximum leaves the range from above, and the refusal
    gives the range of weights that fit at that scale, both ends. (With "sum": "mean" refuses a weight above 1 / tiny
    when it is given, as its window's scale would not be a normal number.)"""
    model = _model(torch.float32)
    scaler = torch.amp.GradScaler("cpu", init_scale=0.5)
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 1, grad_scaler=scaler, normalization="sum")
    x, y = _data([3], dtype=torch.float32)[0]
    tiny, top = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max
    with pytest.raises(ValueError, match=re.escape(f"at the loss scale 0.5: 0, or {tiny:.3g} to {top * 0.5:.3g})")):
        _micro_step(opt, model, x, y, "backward", scaler, weight=2e38)
    assert opt.micro_step == 0 and not opt.stepped


def test_a_bad_weight_flagged_in_an_open_window_survives_a_checkpoint(loop):
    """A weight found bad after it was folded is held as a flag that refuses the window at its end: a checkpoint
    taken before that end carries the flag, and the resumed window is refused too, its parameters unchanged."""

    def build():
        model = _model(torch.float32)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20)
        return model, scaler, GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, grad_scaler=scaler)

    model, scaler, opt = build()
    (x, y), (x2, y2) = _data([3, 4], dtype=torch.float32)
    tiny = torch.finfo(torch.float32).tiny * 4  # a normal number; 2^-20 of it is not
    _micro_step(opt, model, x, y, loop, scaler, weight=tiny)
    assert opt.micro_step == 1  # the first of two micro-batches: the window is open, with the flag
    state = opt.state_dict()
    resumed_model, resumed_scaler, resumed = build()
    resumed_model.load_state_dict(model.state_dict())
    resumed_scaler.load_state_dict(scaler.state_dict())
    resumed.load_state_dict(state)
    before = [p.detach().clone() for p in resumed_model.parameters()]
    with pytest.raises(ValueError, match="divided by grad_scaler.s loss scale"):
        _micro_step(resumed, resumed_model, x2, y2, loop, resumed_scaler)
    assert all(torch.equal(a, b) for a, b in zip(before, resumed_model.parameters(), strict=True))


def test_cast_overflow_check_ignores_the_cast_copys_alignment_padding(monkeypatch):
    """The fp16 copy of the finished gradient is written segment by segment: whatever its alignment padding
    holds (here inf) must not count as an overflow."""
    params = [torch.nn.Parameter(torch.zeros(3, dtype=torch.float16)) for _ in range(2)]
    opt = GradAccumulator(torch.optim.SGD(params, lr=1.0), 1, backend="reference", normalization="sum")
    assert opt.buffers[0].numel > sum(opt.buffers[0].numels)  # there is padding
    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        out = real_empty(*args, **kwargs)
        return out.fill_(math.inf) if out.dtype == torch.float16 else out

    monkeypatch.setattr(torch, "empty", poisoned_empty)
    coefficients = torch.tensor([30000.0, -30000.0, 30000.0])  # every value fits fp16, the norm (5.2e4 * 2) not
    (params[0].float() * coefficients).sum().backward()
    (params[1].float() * coefficients).sum().backward()
    opt.step()
    assert opt.stepped and opt.skipped_steps == 0
    for param in params:
        assert torch.equal(param.detach(), -coefficients.to(torch.float16))


def test_accumulation_steps_and_max_grad_norm_are_checked_when_changed_later():
    model = _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 4, max_grad_norm=1.0)
    for bad in (0, -1, 2.5, True, "4"):
        with pytest.raises(ValueError, match="accumulation_steps"):
            opt.accumulation_steps = bad
    for bad in (0.0, -1.0, math.nan, math.inf, "1"):
        with pytest.raises(ValueError, match="max_grad_norm"):
            opt.max_grad_norm = bad
    assert opt.accumulation_steps == 4 and opt.max_grad_norm == 1.0  # refused changes changed nothing
    x, y = _data([3], seed=4)[0]
    for _ in range(2):
        _micro_step(opt, model, x, y, "step")
    assert opt.micro_step == 2
    with pytest.raises(ValueError, match=r"above the open window's micro_step \(2\)"):
        opt.accumulation_steps = 2  # the window could never end
    opt.backward(_loss(model, x, y))
    with pytest.raises(RuntimeError, match="opened a micro-batch"):
        opt.accumulation_steps = 5
    opt.step()
    opt.accumulation_steps = 4  # allowed: the fourth step() ends this window
    opt.max_grad_norm = None
    _micro_step(opt, model, x, y, "step")
    assert opt.stepped


def test_no_copy_to_the_cpu_is_non_blocking(loop, monkeypatch):
    """A non-blocking copy from a device to the CPU returns before its data arrives: the host would read stale
    memory. Every copy gafused makes to the CPU over a whole window (weights, scale, norm, clip) must wait."""
    calls = []
    original = torch.Tensor.to

    def recording_to(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        calls.append((result.device, kwargs.get("non_blocking", False)))
        return result

    model = _model(torch.float32)
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2, max_grad_norm=0.1)
    monkeypatch.setattr(torch.Tensor, "to", recording_to)
    for x, y in _data([2, 3], dtype=torch.float32, seed=11):
        _micro_step(opt, model, x, y, loop)
    monkeypatch.undo()
    assert opt.stepped and calls  # the window went through the copies it makes
    assert [device for device, non_blocking in calls if non_blocking and device.type == "cpu"] == []


def _mixed_device_model(home: str, other: str, seed: int = 0):
    """Two parameters, the first (which sets the accumulator's home device) on ``home``, the second on ``other``."""
    generator = torch.Generator().manual_seed(seed)
    first = torch.nn.Parameter(torch.randn(64, generator=generator).to(home))
    second = torch.nn.Parameter(torch.randn(64, generator=generator).to(other))
    return [first, second]


def _mixed_device_loss(params, x):
    """A loss on the CPU whose gradient reaches both devices."""
    on_gpu = next(p for p in params if p.is_cuda)
    on_cpu = next(p for p in params if not p.is_cuda)
    return (on_gpu * x).sin().sum().cpu() + (on_cpu * x).pow(2).sum()


@pytest.mark.gpu
@pytest.mark.parametrize("home", ["cuda", "cpu"])
def test_parameters_on_cpu_and_gpu_with_a_busy_stream_match_plain_pytorch(loop, home):
    """Values that cross from the GPU to the CPU (the fold weight and window scale of a home on the GPU, the norm
    of a GPU group for a home on the CPU) are read only once they have arrived, however busy the GPU stream."""
    other = "cpu" if home == "cuda" else "cuda"
    params = _mixed_device_model(home, other)
    plain_params = [p.detach().clone().requires_grad_() for p in params]
    opt = GradAccumulator(torch.optim.SGD(params, lr=1.0), accumulation_steps=2, max_grad_norm=0.5)
    plain = torch.optim.SGD(plain_params, lr=1.0)
    busy_cycles = 200_000_000  # a stream busy for ~0.1 s: an unfinished copy would still be queued behind it
    for window in range(3):
        for micro in range(2):
            x = float(micro + 1 + window)
            torch.cuda._sleep(busy_cycles)
            if loop == "backward":
                opt.backward(_mixed_device_loss(params, x))
                torch.cuda._sleep(busy_cycles)
                opt.step()
            else:
                _mixed_device_loss(params, x).backward()
                torch.cuda._sleep(busy_cycles)
                opt.step()
            opt.zero_grad()
            _mixed_device_loss(plain_params, x).div(2).backward()
        norm = torch.nn.utils.clip_grad_norm_(plain_params, 0.5)
        plain.step()
        plain.zero_grad()
        assert opt.stepped
        torch.testing.assert_close(opt.grad_norm.cpu().double(), norm.cpu().double(), rtol=1e-5, atol=0)
        for p, q in zip(params, plain_params, strict=True):
            torch.testing.assert_close(p.detach().cpu(), q.detach().cpu(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("loop", ["step", "backward"])
def test_a_dropped_accumulator_frees_its_buffers_without_waiting_for_the_cycle_collector(loop):
    """Rebuilding the accumulator (after add_param_group, model.to) must not hold two buffers at once: nothing of
    it may sit in a reference cycle, which only a later gc pass would free."""
    import gc
    import weakref

    model = _model(torch.float32)
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2, bucket_bytes=64)
    for x, y in _data([2, 3], dtype=torch.float32, seed=3):
        _micro_step(opt, model, x, y, loop)
    assert opt.stepped and len(opt.buffers[0].buckets) > 1
    data = [weakref.ref(buffer.data) for buffer in opt.buffers]
    gc.disable()
    try:
        del opt
        assert all(ref() is None for ref in data)
    finally:
        gc.enable()


def test_frozen_parameters_in_the_optimizer_are_named_with_the_memory_they_cost():
    """Plain PyTorch spends nothing on a parameter that gets no gradient; the buffer keeps its segment (it may be
    unfrozen later), so the cost is said at construction, once, and not for trainable parameters."""
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    model[0].requires_grad_(False)
    with pytest.warns(UserWarning) as caught:
        GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "2 parameter(s) of the optimizer do not require grad" in message
    assert "param_groups[0]['params'][0] (shape (512, 512))" in message and "1.0 MiB" in message
    assert caught[0].filename == __file__  # points at the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GradAccumulator(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1), 2)


@pytest.mark.parametrize("loop", ["step", "backward"])
def test_a_loss_scale_changed_inside_a_window_unscales_each_micro_batch_with_its_own(loop):
    """The scale moved mid-window (scaler.update(new) by hand, or a plain AMP optimizer sharing the scaler): each
    micro-batch is unscaled with the scale its loss was scaled with (read once per window, the later ones were off by
    the ratio: 13x the true norm here)."""
    model, reference = _model(), _model()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, grad_scaler=scaler)
    batches = _data([3, 4])
    for index, (x, y) in enumerate(batches):
        if index == 1:
            scaler.update(2.0**14)
        _micro_step(opt, model, x, y, loop, scaler)
    assert opt.stepped
    sum(_loss(reference, x, y) * len(x) / 7 for x, y in batches).backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
    torch.testing.assert_close(opt.grad_norm, norm, rtol=1e-12, atol=0)


def _goes_on_after_the_refusal(opt, scaler, model, reference, batches):
    """The corrected loop (scaler.scale(loss).backward(); opt.step(weight=w)) over ``batches``, one window: its norm
    is the float64 big batch's."""
    for x, y in batches:
        scaler.scale(_loss(model, x, y)).backward()
        opt.step(weight=len(x))
    assert opt.stepped
    total = sum(len(x) for x, _ in batches)
    sum(_loss(reference, x, y) * len(x) / total for x, y in batches).backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
    torch.testing.assert_close(opt.grad_norm, norm, rtol=1e-12, atol=0)


def _refused_after_unscaling(habit):
    """The AMP recipe kept around the accumulator in the loss.backward() loop: ``scaler.step(opt)`` (or
    ``scaler.unscale_(opt); opt.step()``) unscales p.grad, then the step would divide by the scale again (a step
    1/scale too small, silently): refused. The model, its float64 twin, scaler, accumulator, its state_dict from
    before, and the two batches left."""
    model, reference = _model(), _model()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, grad_scaler=scaler)
    saved = opt.state_dict()
    batches = _data([3, 4, 2])
    scaler.scale(_loss(model, *batches[0])).backward()
    refusal = r"unscaled this optimizer's gradients \(scaler.step\(opt\) .* First drop this micro-batch's unscaled"
    with pytest.raises(RuntimeError, match=refusal):
        if habit == "scaler.step(opt)":
            scaler.step(opt)
        else:
            scaler.unscale_(opt)
            opt.step(weight=3)
    assert opt.micro_step == 0
    return model, reference, scaler, opt, saved, batches[1:]


@pytest.mark.parametrize("habit", ["scaler.unscale_(opt)", "scaler.step(opt)"])
def test_the_unscaled_gradients_of_a_refused_step_are_never_folded(habit):
    """The refusal leaves the unscaled gradients in p.grad: the same step() again (a notebook cell rerun, a retry
    after reading only the first sentence) would fold them and divide them by the scale a second time (the window's
    gradient 1/scale of the truth); a backward() would add the next loss's gradients to them. Both are refused,
    changing nothing, until zero_grad() drops them; then the corrected loop goes on to the float64 result."""
    model, reference, scaler, opt, _, batches = _refused_after_unscaling(habit)
    unscaled = [p.grad.clone() for p in model.parameters()]
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"step\(\): the grad_scaler unscaled .* refused until then"):
            opt.step(weight=3)
        with pytest.raises(RuntimeError, match=r"backward\(\): p.grad holds gradients the grad_scaler unscaled"):
            opt.backward(_loss(model, *batches[0]), weight=3)
        assert opt.micro_step == 0
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), unscaled, strict=True))
    opt.zero_grad()
    _goes_on_after_the_refusal(opt, scaler, model, reference, batches)


@pytest.mark.parametrize("released_by", ["model.zero_grad()", "load_state_dict()"])
def test_unscaled_gradients_released_another_way_end_the_refusal(released_by):
    """The refusal lasts while the unscaled gradients can be folded: once every p.grad is gone (the model's
    zero_grad(), or a checkpoint loaded, which releases unfolded gradients) the next micro-batch goes on. Until then
    flush() says to drop them (its usual advice, to include them with step(), is what is refused)."""
    model, reference, scaler, opt, saved, batches = _refused_after_unscaling("scaler.unscale_(opt)")
    with pytest.raises(RuntimeError, match=r"the grad_scaler unscaled them .* drop them with zero_grad\(\) first"):
        opt.flush()
    if released_by == "model.zero_grad()":
        model.zero_grad()
    else:
        opt.load_state_dict(saved)
    assert all(p.grad is None for p in model.parameters())
    _goes_on_after_the_refusal(opt, scaler, model, reference, batches)


@pytest.mark.parametrize("mistake", ["step() twice", "step(end_window=True) for flush()"])
def test_a_step_without_gradients_or_weight_is_refused(loop, mistake):
    """A step() with no backward since the last one would end an empty micro-batch of weight 1: the window's mean
    diluted (k/(k+1)), with no error. Refused, nothing changed; a weight given says the empty micro-batch is meant."""
    model, reference = _model(), _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 3 if mistake == "step() twice" else None)
    batches = _data([4, 4, 4])
    for index, (x, y) in enumerate(batches):
        end = mistake != "step() twice" and index == len(batches) - 1
        if loop == "backward":
            opt.backward(_loss(model, x, y), weight=len(x), end_window=end)
            opt.step()
        else:
            _loss(model, x, y).backward()
            opt.step(weight=len(x), end_window=end)
        opt.zero_grad()
        if index == 0 or end:
            micro_step = opt.micro_step
            with pytest.raises(RuntimeError, match=r"received a gradient since the last step\(\).*weight 1"):
                opt.step(end_window=end)
            assert opt.micro_step == micro_step and opt.stepped == end  # nothing changed
    assert opt.stepped
    _big_batch_step(reference, torch.optim.SGD(reference.parameters(), lr=0.1), batches)
    _assert_same_params(model, reference, 1e-12)
    opt.step(weight=0)  # an empty micro-batch on purpose: counted, adding nothing
    assert opt.micro_step == 1


def test_a_second_accumulator_takes_the_weight_of_the_backward_that_gave_its_gradients(backend):
    """Two optimizers over one model (Muon and AdamW, say), each an accumulator: the first's backward(loss, weight=w)
    gives the second's parameters their gradients, which the second's step() folds. Counted 1 there, the two
    windows weighed the micro-batches differently (silently). step() without that weight (even 1: ranks must
    decide alike), or with another, is refused, nothing changed; with it both equal one accumulator over the model,
    bitwise. Gradients the second got otherwise since (zero_grad, then a plain backward) take any weight again."""
    whole, split = _model(), _model()
    one = GradAccumulator(torch.optim.SGD(whole.parameters(), lr=0.1), 3, backend=backend)
    params = list(split.parameters())
    first = GradAccumulator(torch.optim.SGD(params[:2], lr=0.1), 3, backend=backend)
    second = GradAccumulator(torch.optim.SGD(params[2:], lr=0.1), 3, backend=backend)
    batches = _data([1, 7, 3])
    for index, (x, y) in enumerate(batches):
        one.backward(_loss(whole, x, y), weight=len(x))
        one.step()
        one.zero_grad()
        first.backward(_loss(split, x, y), weight=len(x))
        first.step()
        if index == 1:
            held = [param.grad.clone() for param in params[2:]]
            for wrong, shown in ((None, "None"), (len(x) + 1, str(len(x) + 1))):
                with pytest.raises(ValueError, match=rf"backward\(loss, weight=7\).*same weight.*\(got {shown};"):
                    second.step(weight=wrong)
            assert second.micro_step == 1
            assert all(torch.equal(param.grad, grad) for param, grad in zip(params[2:], held, strict=True))
        second.step(weight=torch.tensor(len(x)))  # an equal CPU tensor is the same weight
        first.zero_grad()
        second.zero_grad()
    assert one.stepped and first.stepped and second.stepped
    assert all(torch.equal(a, b) for a, b in zip(whole.parameters(), split.parameters(), strict=True))
    first.backward(_loss(split, *batches[0]), weight=5)
    first.step()
    second.zero_grad()
    _loss(split, *batches[0]).backward()
    first.zero_grad()
    second.step(weight=2)  # its own plain backward's gradients: any weight
    assert second.micro_step == 1
    first.backward(_loss(split, *batches[1]), weight=1)
    first.step()
    with pytest.raises(ValueError, match=r"weight=1\).*\(got None;"):  # ranks must decide alike, whatever their weight
        second.step()
    second.step(weight=1)
    assert second.micro_step == 2


def _raise_once(param, failing):
    """A hook on ``param`` that raises while ``failing[0]``: the backward fails after autograd gave the later layers
    (the second accumulator's parameters) their gradients, before it reached ``param``."""

    def hook(grad):
        if failing[0]:
            raise RuntimeError("bad batch")

    return param.register_hook(hook)


def _failing_backward(first, params, *args, **kwargs):
    """``first.backward(*args, **kwargs)``, failing in a hook on ``params[0]`` (``_raise_once``, left registered and
    inactive); the pytest ExceptionInfo of its error."""
    failing = [True]
    _raise_once(params[0], failing)
    with pytest.raises(RuntimeError, match="bad batch") as failed:
        first.backward(*args, **kwargs)
    failing[0] = False
    return failed


@pytest.mark.parametrize("failing_micro", [0, 1])
def test_a_failed_backward_puts_back_the_gradients_it_gave_another_accumulator(backend, failing_micro):
    """Two optimizers over one model: the first's backward(loss, weight=w) fails after autograd gave the second's
    parameters their gradients. Those stayed in the second's p.grad, so running the micro-batch again folded it
    twice into the second's window, silently (0.37 off). Now they are put back as they were: none, also where the
    second's finished gradients were handed out (at a window's first micro-batch: they stay released, as the
    backward's hook left them); both then step as one accumulator over the model, bitwise."""
    whole, split = _model(), _model()
    one = GradAccumulator(torch.optim.SGD(whole.parameters(), lr=0.1), 2, backend=backend)
    params = list(split.parameters())
    first = GradAccumulator(torch.optim.SGD(params[:2], lr=0.1), 2, backend=backend)
    second = GradAccumulator(torch.optim.SGD(params[2:], lr=0.1), 2, backend=backend)
    failing = [False]
    _raise_once(params[0], failing)
    for index, (x, y) in enumerate(_data([3, 5, 2, 4])):
        one.backward(_loss(whole, x, y), weight=len(x))
        one.step()
        if index == 2 + failing_micro:
            failing[0] = True
            with pytest.raises(RuntimeError, match="bad batch"):
                first.backward(_loss(split, x, y), weight=len(x))
            failing[0] = False
            assert all(param.grad is None for param in params[2:])
            assert (first.micro_step, second.micro_step) == (failing_micro, failing_micro)
        first.backward(_loss(split, x, y), weight=len(x))
        first.step()
        second.step(weight=len(x))
    assert all(torch.equal(a, b) for a, b in zip(whole.parameters(), split.parameters(), strict=True))


@pytest.mark.parametrize("call", ["step", "backward"])
def test_gradients_a_failed_backward_added_to_are_refused_by_the_other_accumulator(backend, call):
    """The second accumulator holds its own loss.backward()'s gradients; the first's backward fails after adding to
    them in place, which cannot be undone. The failure's note says so, and the second's step() and backward()
    refuse them, nothing changed, until they are dropped; then they go through."""
    split, first, second = _split_accumulators(backend)
    params = list(split.parameters())
    (x, y), (x2, y2) = _data([3, 5])
    _loss(split, x, y).backward()  # the second's micro-batch (the first's gradients dropped)
    first.zero_grad()
    held = [param.grad for param in params[2:]]
    failed = _failing_backward(first, params, _loss(split, x2, y2), weight=5)
    assert "the failed call added to gradients held by 1 other accumulator(s)" in " ".join(failed.value.__notes__)
    added = [param.grad.clone() for param in params[2:]]
    assert all(param.grad is grad for param, grad in zip(params[2:], held, strict=True))
    refused = (lambda: second.step()) if call == "step" else (lambda: second.backward(_loss(split, x, y)))
    with pytest.raises(
        RuntimeError,
        match=rf"^{call}\(\): gradients it would fold hold part of another accumulator's "
        r"backward\(\) that failed.*nothing changed\); drop them",
    ):
        refused()
    assert second.micro_step == 0 and first.micro_step == 0
    assert all(torch.equal(param.grad, grad) for param, grad in zip(params[2:], added, strict=True))
    second.zero_grad()
    first.zero_grad()
    second.backward(_loss(split, x, y))
    second.step()
    assert second.micro_step == 1


def test_a_failed_backward_puts_back_the_very_gradients_it_replaced_out_of_place(backend):
    """With create_graph=True autograd adds into a held p.grad out of place (a new tensor): the second accumulator's
    own loss.backward() gradients are still intact, so the failed backward puts those very tensors back, with no
    refusal and no note about gradients added to in place; the second then steps them as if nothing had failed."""
    split, first, second = _split_accumulators(backend)
    params = list(split.parameters())
    (x, y), (x2, y2) = _data([3, 5])
    _loss(split, x, y).backward()  # the second's micro-batch
    first.zero_grad()
    held = [param.grad for param in params[2:]]
    values = [grad.clone() for grad in held]
    failing = [True]
    _raise_once(params[0], failing)
    with warnings.catch_warnings(), pytest.raises(RuntimeError, match="bad batch") as failed:
        warnings.filterwarnings("ignore", message=".*create_graph=True", category=UserWarning)
        first.backward(_loss(split, x2, y2), weight=5, create_graph=True)
    failing[0] = False
    assert not any("other accumulator" in note for note in getattr(failed.value, "__notes__", []))
    assert all(param.grad is grad for param, grad in zip(params[2:], held, strict=True))
    assert all(torch.equal(grad, value) for grad, value in zip(held, values, strict=True))
    second.step(weight=3)
    assert second.micro_step == 1 and all(param.grad is None for param in params[2:])


def test_a_failed_backward_leaves_the_finished_gradients_it_did_not_reach(backend):
    """The second accumulator over the first layer stepped: its p.grad are its finished gradients, readable until a
    backward reaches them. The first's backward (over the last layer) fails before autograd reaches the first layer:
    those finished gradients are still in p.grad, as a failed plain backward would leave them."""
    split = _model()
    params = list(split.parameters())
    first = GradAccumulator(torch.optim.SGD(params[2:], lr=0.1), 1, backend=backend)
    second = GradAccumulator(torch.optim.SGD(params[:2], lr=0.1), 1, backend=backend)
    (x, y), (x2, y2) = _data([3, 5])
    first.backward(_loss(split, x, y), weight=3)
    first.step()
    second.step(weight=3)
    assert second.stepped
    finished = [param.grad for param in params[:2]]
    assert all(grad is not None for grad in finished)
    failing = [True]
    _raise_once(params[2], failing)
    with pytest.raises(RuntimeError, match="bad batch"):
        first.backward(_loss(split, x2, y2), weight=5)
    failing[0] = False
    assert all(param.grad is grad for param, grad in zip(params[:2], finished, strict=True))


def test_a_failed_backward_retried_in_its_micro_batch_is_still_refused_by_the_other_accumulator(backend):
    """The first's micro-batch takes two backward() calls; the second call fails after adding in place to the
    gradients the first call gave the second accumulator, before reaching the first's own (its micro-batch stays
    open). Running the failed call again succeeds, and adds the whole loss once more into those gradients: they
    hold it one time and a part, so the second's step() still refuses them as a failed backward's, whatever the
    weight, until they are dropped."""
    split, first, second = _split_accumulators(backend)
    params = list(split.parameters())
    ((x, y),) = _data([4])
    failing = [False]
    _raise_once(params[0], failing)
    first.backward(_loss(split, x[:2], y[:2]), weight=4)
    failing[0] = True
    with pytest.raises(RuntimeError, match="bad batch"):
        first.backward(_loss(split, x[2:], y[2:]))
    failing[0] = False
    assert first.micro_step == 0 and all(param.grad is not None for param in params[2:])
    first.backward(_loss(split, x[2:], y[2:]))
    first.step()
    for weight in (None, 4):
        with pytest.raises(
            RuntimeError, match=r"^step\(\): gradients it would fold hold part of another accumulator's"
        ):
            second.step(weight=weight)
    assert second.micro_step == 0
    second.zero_grad()
    assert second._weight_from_elsewhere() is None


def test_a_failed_backward_keeps_the_weight_of_the_earlier_backward_in_its_record(backend):
    """The first call of the first's micro-batch (weight 4) gave the second's parameters their gradients; a second
    call fails after adding in place to the last bias's alone. The record of the failure keeps the earlier call's
    gradients too: dropping only the one the failed call reached still leaves the second refusing the rest (a
    micro-batch with part of it dropped), where it used to forget that they were given with weight 4."""
    split, first, second = _split_accumulators(backend)
    params = list(split.parameters())
    ((x, y),) = _data([4])
    first.backward(_loss(split, x[:2], y[:2]), weight=4)
    before = [param.grad._version for param in params[2:]]
    failing = [True]
    _raise_once(params[2], failing)  # autograd accumulates the last bias before the last weight
    with pytest.raises(RuntimeError, match="bad batch"):
        first.backward(_loss(split, x[2:], y[2:]))
    failing[0] = False
    assert [param.grad._version for param in params[2:]] == [before[0], before[1] + 1]
    params[3].grad = None
    with pytest.raises(RuntimeError, match=r"^step\(\): gradients it would fold hold part of another accumulator's"):
        second.step()
    assert second.micro_step == 0 and params[2].grad is not None


def test_a_failed_backward_drops_what_it_added_to_in_place_in_a_parameter_it_shares_with_another(backend):
    """Overlapping accumulators: the first over the whole model, the second over its last layer, which holds its own
    loss.backward() gradients. The first's backward fails after adding into them in place, before folding: they are
    its own parameters too, so they are dropped (its note says how many), not put back for the second, where the
    first's retry would add to them again and fold the failed call's part twice."""
    split = _model()
    params = list(split.parameters())
    first = GradAccumulator(torch.optim.SGD(params, lr=0.1), 2, backend=backend)
    second = GradAccumulator(torch.optim.SGD(params[2:], lr=0.1), 2, backend=backend)
    (x, y), (x2, y2) = _data([3, 5])
    torch.autograd.backward(_loss(split, x, y), inputs=params[2:])  # the second's micro-batch
    failed = _failing_backward(first, params, _loss(split, x2, y2), weight=5)
    notes = " ".join(failed.value.__notes__)
    assert "2 gradient(s) held from an earlier loss.backward() were added to in place" in notes
    assert "other accumulator" not in notes
    assert all(param.grad is None for param in params)
    assert first.micro_step == 0 and second._weight_from_elsewhere() is None


def _one_and_split_after_a_micro_batch(backend, **first_options):
    """``one`` accumulator over a float64 tanh_mlp ``whole``; over a copy ``split``, ``first`` (its first layer, with
    ``first_options``) and ``second`` (the rest); a hook on split's first weight that raises while ``failing[0]``;
    the state_dict() of first and second before the window; then the window's first micro-batch (``_data([3, 5])``'s
    first, weight 3) through first's backward() and both step()s. ``one`` has not run it."""
    whole, split = _model(), _model()
    one = GradAccumulator(torch.optim.SGD(whole.parameters(), lr=0.1), 2, backend=backend)
    params = list(split.parameters())
    first = GradAccumulator(torch.optim.SGD(params[:2], lr=0.1), 2, backend=backend, **first_options)
    second = GradAccumulator(torch.optim.SGD(params[2:], lr=0.1), 2, backend=backend)
    saved = [first.state_dict(), second.state_dict()]
    failing = [False]
    _raise_once(params[0], failing)
    x, y = _data([3, 5])[0]
    first.backward(_loss(split, x, y), weight=3)
    first.step()
    second.step(weight=3)
    return whole, split, one, first, second, failing, saved


def test_a_failed_backward_that_discards_its_window_names_the_other_accumulators_open_windows(backend):
    """The first accumulator folded part of the failed call (a bucket per gradient), so its window is discarded; the
    second's stays open at its micro_step, out of step with the first's from then on. The note says so and names
    the way out: loading each with the state_dict() it gave between windows, after which both run the window again
    and step as one accumulator over the model, bitwise."""
    whole, split, one, first, second, failing, saved = _one_and_split_after_a_micro_batch(backend, bucket_bytes=8)
    batches = _data([3, 5])
    (x2, y2) = batches[1]
    failing[0] = True
    with pytest.raises(RuntimeError, match="bad batch") as failed:
        first.backward(_loss(split, x2, y2), weight=5)
    failing[0] = False
    notes = " ".join(failed.value.__notes__)
    assert "the open accumulation window was discarded" in notes
    assert "1 other accumulator(s) over this loss keep their open windows (micro_step 1), now out of step" in notes
    assert "load each with the state_dict() it gave between windows" in notes
    assert (first.micro_step, second.micro_step) == (0, 1)
    first.load_state_dict(saved[0])
    second.load_state_dict(saved[1])
    for x, y in batches:
        one.backward(_loss(whole, x, y), weight=len(x))
        one.step()
        first.backward(_loss(split, x, y), weight=len(x))
        first.step()
        second.step(weight=len(x))
    assert one.stepped and first.stepped and second.stepped
    assert all(torch.equal(a, b) for a, b in zip(whole.parameters(), split.parameters(), strict=True))


def test_gradients_a_failed_backward_added_to_are_refused_until_all_are_dropped(backend):
    """Three layers, the second accumulator over the last two: the first's backward() gave them gradients, then its
    next backward() of the micro-batch fails after adding in place to the last layer's only. Dropping those alone
    leaves the rest of that micro-batch's gradients, still refused; all dropped, the second steps."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3)
    ).to(torch.float64)
    params = list(model.parameters())
    first = GradAccumulator(torch.optim.SGD(params[:2], lr=0.1), 2, backend=backend)
    second = GradAccumulator(torch.optim.SGD(params[2:], lr=0.1), 2, backend=backend)
    ((x, y),) = _data([3])
    failing = [False]
    _raise_once(params[2], failing)
    first.backward(_loss(model, x, y), weight=3)
    before = [(param.grad, param.grad._version) for param in params[2:]]
    failing[0] = True
    with pytest.raises(RuntimeError, match="bad batch"):
        first.backward(_loss(model, x, y) * 0.5, weight=3)
    failing[0] = False
    changed = [
        param.grad is not grad or param.grad._version != version
        for param, (grad, version) in zip(params[2:], before, strict=True)
    ]
    assert changed[-2:] == [True, True] and not all(changed)
    for param, was_changed in zip(params[2:], changed, strict=True):
        if was_changed:
            param.grad = None
    with pytest.raises(RuntimeError, match="that failed"):
        second.step(weight=3)
    second.zero_grad()
    second.step(weight=0)
    assert second.micro_step == 1


def _split_accumulators(backend, steps=2):
    """A float64 tanh_mlp with two accumulators over it: ``first`` over its first layer, ``second`` over the rest."""
    split = tanh_mlp(seed=0, dtype=torch.float64)
    params = list(split.parameters())
    first = GradAccumulator(torch.optim.SGD(params[:2], lr=0.1), steps, backend=backend)
    second = GradAccumulator(torch.optim.SGD(params[2:], lr=0.1), steps, backend=backend)
    return split, first, second


def _assert_split_equals_one(whole, split, one, first, second):
    """Both accumulators over ``split`` stepped as ``one`` over ``whole`` did, to float64 rounding."""
    assert one.stepped and first.stepped and second.stepped
    for a, b in zip(whole.parameters(), split.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("aux", ["after", "before"])
def test_an_auxiliary_loss_added_by_plain_backward_keeps_the_second_accumulators_weight(backend, aux):
    """After first.backward(loss, weight=w), a plain backward of an auxiliary loss adds into the second's gradients
    (in place): still that micro-batch's, which the first folds with w too. The second's step() without w was
    accepted and counted 1 (0.002 off); now it is refused, and with w both equal one accumulator over the model.
    With the auxiliary backward first, first.backward adds into the second's p.grad in place (the same tensors, a
    new version): the same."""
    whole = _model()
    one = GradAccumulator(torch.optim.SGD(whole.parameters(), lr=0.1), 2, backend=backend)
    split, first, second = _split_accumulators(backend)

    def auxiliary(model, x):
        (0.1 * model(x).abs().mean()).backward()

    for x, y in _data([2, 7]):
        if aux == "before":
            auxiliary(whole, x)
        one.backward(_loss(whole, x, y), weight=len(x))
        if aux == "after":
            auxiliary(whole, x)
        one.step()
        one.zero_grad()
        if aux == "before":
            auxiliary(split, x)
        first.backward(_loss(split, x, y), weight=len(x))
        if aux == "after":
            auxiliary(split, x)
        first.step()
        with pytest.raises(ValueError, match=rf"backward\(loss, weight={len(x)}\).*\(got None;"):
            second.step()
        second.step(weight=len(x))
        first.zero_grad()
        second.zero_grad()
    # w * (g + aux) folded at once here, w * g then w * aux there: a few float64 roundings apart.
    _assert_split_equals_one(whole, split, one, first, second)


def test_a_model_that_is_neither_ddp_nor_fsdp2_is_refused_and_a_compiled_one_is_told_what_to_pass():
    """model= owns a DDP or FSDP2 wrapper's synchronization; anything else is refused naming its type, and
    torch.compile's wrapper (OptimizedModule, around the DDP module when it compiled that) says to pass
    model._orig_mod."""
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"fully_shard, got Sequential$"):
        GradAccumulator(sgd, 2, model=model)
    with pytest.raises(
        TypeError, match=r"got OptimizedModule \(torch.compile's wrapper of a Sequential: .*_orig_mod\)"
    ):
        GradAccumulator(sgd, 2, model=torch.compile(model))


def test_a_model_whose_parameters_were_replaced_is_told_why_its_gradients_are_missing(loop):
    """model.load_state_dict(..., assign=True) gives the model new Parameter objects; the optimizer still holds the
    old ones, which get no gradient (plain PyTorch stops training them without a word). The refusal names that."""
    model = _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    model.load_state_dict({name: value.clone() for name, value in model.state_dict().items()}, assign=True)
    x, y = _data([3])[0]
    with pytest.raises(RuntimeError, match=r"parameters were replaced since the accumulator was built.*assign=True"):
        micro_batch(opt, _loss(model, x, y), loop)
    assert opt.micro_step == 0


def test_a_backward_whose_loss_reaches_no_parameter_is_refused_at_step_without_a_weight():
    """opt.backward(loss) with no weight, whose loss reaches none of the accumulator's parameters (only another
    optimizer's), folds nothing: its step() would count an empty micro-batch of weight 1 and halve this window's
    mean. Refused as in the step-time loop, nothing changed; zero_grad() drops the micro-batch, and the window is
    the big batch's. With its weight given, the empty micro-batch is meant and counted."""
    model, reference = _model(), _model()
    other = torch.nn.Parameter(torch.ones(3))
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    opt.backward((other**2).sum())
    with pytest.raises(RuntimeError, match=r"backward\(\) whose loss reached none of its parameters.*zero_grad"):
        opt.step()
    with pytest.raises(ValueError, match=r"opened this micro-batch without a weight.*backward\(loss, weight=w\)"):
        opt.step(weight=1.0)
    assert opt.micro_step == 0 and other.grad is not None
    opt.zero_grad()
    batches = _data([4, 4])
    for x, y in batches:
        opt.backward(_loss(model, x, y))
        opt.step()
        opt.zero_grad()
    assert opt.stepped
    _big_batch_step(reference, torch.optim.SGD(reference.parameters(), lr=0.1), batches)
    _assert_same_params(model, reference, 1e-12)
    opt.backward((other**2).sum(), weight=0)
    opt.step()
    assert opt.micro_step == 1


def test_a_window_of_frozen_parameters_steps_without_gradients(loop):
    """Every parameter of the accumulator frozen (a backbone during a warm-up, the head trained by another
    optimizer): its steps have no gradient to fold and are not refused as steps without a backward; nothing moves."""
    model = _model()
    opt = GradAccumulator(torch.optim.SGD(model[0].parameters(), lr=0.1), 2)
    head = torch.optim.SGD(model[2].parameters(), lr=0.1)
    model[0].requires_grad_(False)
    before = [p.detach().clone() for p in model[0].parameters()]
    for x, y in _data([3, 4]):
        loss = _loss(model, x, y)
        if loop == "backward":
            opt.backward(loss)
            opt.step()
        else:
            loss.backward()
            opt.step()
        head.step()
        head.zero_grad()
    assert opt.micro_step == 0
    assert all(torch.equal(p, b) for p, b in zip(model[0].parameters(), before, strict=True))


def test_an_accumulator_built_under_inference_mode_trains(loop):
    """Built inside torch.inference_mode() (as a plain optimizer can be), its buffers are ordinary tensors: the
    folds outside it work (they failed on inference tensors, every window discarded)."""
    model, reference = _model(), _model()
    with torch.inference_mode():
        opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    assert not any(buffer.data.is_inference() for buffer in opt.buffers)
    batches = _data([3, 5])
    for x, y in batches:
        micro_batch(opt, _loss(model, x, y), loop, weight=len(x))
    assert opt.stepped
    _big_batch_step(reference, torch.optim.SGD(reference.parameters(), lr=0.1), batches)
    _assert_same_params(model, reference, 1e-12)


def test_uninitialized_lazy_parameters_are_refused_by_position():
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.LazyLinear(3))
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[2\]: .*lazy module; run one forward"):
        GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    model(torch.randn(2, 5))
    GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2)


def test_a_sparse_parameter_is_refused_by_position_when_the_accumulator_is_built():
    """The buffers lay out dense parameters only: a sparse one is refused at construction, named by its place in the
    optimizer's groups (not later, at the first fold)."""
    dense = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    sparse = torch.nn.Parameter(torch.zeros(3, 3, dtype=torch.float64).to_sparse())
    inner = torch.optim.SGD([{"params": [dense]}, {"params": [sparse]}], lr=0.1)
    refusal = r"param_groups\[1\]\['params'\]\[0\] \(shape \(3, 3\)\): .*dense .*sparse_coo"
    with pytest.raises(ValueError, match=refusal):
        GradAccumulator(inner, 2)


def test_an_optimizer_whose_groups_hold_no_parameter_is_refused():
    """torch.optim accepts a group with an empty parameter list; an accumulator would have nothing to manage."""
    with pytest.raises(ValueError, match="optimizer has no parameters to manage"):
        GradAccumulator(torch.optim.SGD([{"params": []}], lr=0.1), 2)


def test_a_step_pre_hook_may_hand_back_its_empty_arguments():
    """A pre-hook written for any optimizer may return the (args, kwargs) it got: no change, so the window steps;
    new arguments are still refused (the inner step takes none), discarding the window."""
    model, reference = _model(), _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 1)
    handle = opt.register_step_pre_hook(lambda optimizer, args, kwargs: (args, kwargs))
    x, y = _data([3])[0]
    micro_batch(opt, _loss(model, x, y), "step", weight=3)
    assert opt.stepped
    _big_batch_step(reference, torch.optim.SGD(reference.parameters(), lr=0.1), [(x, y)])
    _assert_same_params(model, reference, 1e-12)
    handle.remove()
    opt.register_step_pre_hook(lambda optimizer, args, kwargs: ((), {"closure": None}))
    with pytest.raises(RuntimeError, match="step pre-hook must return None"):
        micro_batch(opt, _loss(model, x, y), "step", weight=3)
    assert opt.micro_step == 0 and not opt.stepped
    assert "cannot change the step's arguments" in GradAccumulator.register_step_pre_hook.__doc__


@pytest.mark.parametrize(
    "method",
    [
        "register_step_pre_hook",
        "register_step_post_hook",
        "register_state_dict_pre_hook",
        "register_state_dict_post_hook",
        "register_load_state_dict_pre_hook",
        "register_load_state_dict_post_hook",
    ],
)
def test_a_hook_that_cannot_be_called_is_refused_when_registered(method):
    """torch.optim.Optimizer registers anything; a hook that cannot be called would fail only when it runs, after a
    whole window (discarded then) or after load_state_dict() loaded everything. Refused by name, nothing registered."""
    model = _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 1)
    with pytest.raises(TypeError, match=rf"{method}\(\): hook must be callable, got int"):
        getattr(opt, method)(5)
    x, y = _data([2])[0]
    opt.backward(_loss(model, x, y))
    opt.step()
    assert opt.stepped
    opt.load_state_dict(opt.state_dict())
    calls = []
    getattr(opt, method)(lambda *args: calls.append(1))  # a callable one is registered as by torch
    opt.load_state_dict(opt.state_dict())
    opt.backward(_loss(model, x, y))
    opt.step()
    assert calls


_CALLS_WHILE_STEPPING = {
    "step": lambda opt, loss: opt.step(weight=1.0),
    "step(end_window)": lambda opt, loss: opt.step(weight=1.0, end_window=True),
    "flush": lambda opt, loss: opt.flush(),
    "backward": lambda opt, loss: opt.backward(loss),
    "zero_grad": lambda opt, loss: opt.zero_grad(),
    "state_dict": lambda opt, loss: opt.state_dict(),
    "load_state_dict": lambda opt, loss: opt.load_state_dict(opt._saved),
}


@pytest.mark.parametrize("hooked", ["accumulator", "inner"])
@pytest.mark.parametrize("call", list(_CALLS_WHILE_STEPPING))
def test_window_calls_while_the_inner_step_runs_are_refused_and_the_window_steps_once(backend, loop, call, hooked):
    """A step pre-hook (the accumulator's or the inner optimizer's) runs with the finished gradients in p.grad and
    the window not closed: a call there that reads or moves the window would step it twice, release what the inner
    step reads, or save a half-finished window. Refused, naming the call; the window steps once, as the big batch."""
    model, reference = _model(), _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = GradAccumulator(inner, 2, backend=backend)
    opt._saved = opt.state_dict()
    steps, refused = [], []

    def pre_hook(optimizer, args, kwargs):
        if refused:  # a second call would mean the window was finished again
            refused.append("called again")
            return
        x, y = _data([2], seed=5)[0]
        try:
            _CALLS_WHILE_STEPPING[call](opt, _loss(model, x, y))
        except RuntimeError as error:
            refused.append(str(error))

    handle = (opt if hooked == "accumulator" else inner).register_step_pre_hook(pre_hook)
    inner.register_step_post_hook(lambda *_: steps.append(1))
    batches = _data([1, 3])
    for x, y in batches:
        micro_batch(opt, _loss(model, x, y), loop, weight=len(x))
    assert len(refused) == 1 and refused[0].startswith(call.split("(")[0] + "(): called while the window's inner step")
    assert steps == [1] and opt.stepped and opt.micro_step == 0
    _big_batch_step(reference, torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9), batches)
    _assert_same_params(model, reference, 1e-12)
    handle.remove()
    opt.zero_grad()  # the window is closed: the calls work again
    for x, y in batches:
        micro_batch(opt, _loss(model, x, y), loop, weight=len(x))
    assert opt.stepped and steps == [1, 1]


@pytest.mark.parametrize("how", ["by a closure", "through a wrapper"])
def test_gradients_unscaled_by_a_closure_or_through_a_wrapper_are_refused(how):
    """scaler.unscale_ inside step(closure) (the check before the closure cannot see it), or through another object
    standing for the accumulator (Lightning's LightningOptimizer from self.optimizers(), another id): the gradients
    are divided by the scale once there and would be again by the fold. Refused, the micro-batch kept; dropped with
    zero_grad(), the window goes on to the right result."""
    model, reference = _model(), _model()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, grad_scaler=scaler)
    batches = _data([3, 4, 2])
    stand_in = type("Wrapper", (), {"param_groups": property(lambda self: opt.param_groups)})()

    def unscaled_closure():
        scaler.scale(_loss(model, *batches[0])).backward()
        scaler.unscale_(opt)

    with pytest.raises(RuntimeError, match=r"unscaled this optimizer's gradients.*drop this micro-batch"):
        if how == "by a closure":
            opt.step(unscaled_closure)
        else:
            scaler.scale(_loss(model, *batches[0])).backward()
            scaler.unscale_(stand_in)
            opt.step()
    assert opt.micro_step == 0 and all(p.grad is not None for p in model.parameters())
    opt.zero_grad()
    _goes_on_after_the_refusal(opt, scaler, model, reference, batches[1:])


def test_scaler_unscale_after_backward_folded_says_to_step_again():
    """In the opt.backward() loop the micro-batch is folded (unscaled once) before scaler.unscale_ can touch it:
    the refusal says to call step() again, which finishes the micro-batch as it is."""
    model = _model()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, grad_scaler=scaler)
    x, y = _data([3])[0]
    opt.backward(_loss(model, x, y), weight=len(x))
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match=r"backward\(\) already folded this micro-batch.*call opt.step\(\) again"):
        opt.step()
    opt.step()
    assert opt.micro_step == 1


@pytest.mark.parametrize("then", ["step", "flush"])
def test_a_resumed_window_with_a_freshly_loaded_scaler(then):
    """A mid-window checkpoint resumed with a scaler loaded from its state (no scale() since): a step() whose
    gradients were not scaled is refused keeping the resumed window (once, it was discarded), and flush() finishes
    the window with the loaded scale (once, it crashed in the scaler's update after the inner step had run)."""
    batches = _data([3, 5, 2])
    model = _model()
    reference = copy.deepcopy(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 4, grad_scaler=scaler)
    for x, y in batches[:2]:
        scaler.scale(_loss(model, x, y)).backward()
        opt.step(weight=len(x))
        opt.zero_grad()
    state, scaler_state = opt.state_dict(), scaler.state_dict()
    del opt
    loaded = torch.amp.GradScaler("cpu")
    loaded.load_state_dict(scaler_state)
    resumed = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 4, grad_scaler=loaded)
    resumed.load_state_dict(state)
    if then == "step":
        x, y = batches[2]
        _loss(model, x, y).backward()  # scaler.scale forgotten
        with pytest.raises(RuntimeError, match="grad_scaler has no scale yet"):
            resumed.step(weight=len(x))
        assert resumed.micro_step == 2
        resumed.zero_grad()
        loaded.scale(_loss(model, x, y)).backward()
        resumed.step(weight=len(x), end_window=True)
    else:
        assert resumed.flush()
    assert resumed.stepped and resumed.micro_step == 0
    assert loaded.get_scale() == 2.0**9  # grown once (growth_interval=1), from the loaded scale
    used = batches if then == "step" else batches[:2]
    _big_batch_step(reference, torch.optim.SGD(reference.parameters(), lr=0.1), used)
    _assert_same_params(model, reference, 1e-12)


@pytest.mark.parametrize("accum_dtype", [torch.float32, torch.float64], ids=str)
def test_a_mean_window_whose_weights_sum_to_exactly_one_over_tiny_steps(backend, loop, accum_dtype):
    """The largest weight sum "mean" takes is 1 / tiny itself (float32: 2**126): its scale 1 / sum is tiny, still a
    normal number. A weight of exactly that, and a window of two halves summing to it, are accepted and step the
    plain gradient (the weight and the scale are powers of two: exact)."""
    limit = 1 / torch.finfo(accum_dtype).tiny
    torch.manual_seed(0)
    model = tanh_mlp(seed=0, dtype=torch.float32)
    reference = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, 5, generator=generator) for _ in range(3)]
    ys = [torch.randn(4, 3, generator=generator) for _ in range(3)]

    def loss(net, x, y):
        return torch.nn.functional.mse_loss(net(x), y)

    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 1, backend=backend, accum_dtype=accum_dtype)
    micro_batch(opt, loss(model, xs[0], ys[0]), loop, weight=limit)  # one micro-batch of weight 1 / tiny
    opt.zero_grad()
    assert opt.stepped
    opt.accumulation_steps = 2
    for x, y in zip(xs[1:], ys[1:], strict=True):  # two of 1 / (2 tiny): the sum is 1 / tiny
        micro_batch(opt, loss(model, x, y), loop, weight=limit / 2)
        opt.zero_grad()
    assert opt.stepped and opt.skipped_steps == 0
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    plain.zero_grad()
    loss(reference, xs[0], ys[0]).backward()
    plain.step()
    plain.zero_grad()
    (0.5 * loss(reference, xs[1], ys[1]) + 0.5 * loss(reference, xs[2], ys[2])).backward()
    plain.step()
    for param, expected in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(param, expected, rtol=1e-6, atol=1e-7)


def test_an_unweighted_backward_of_the_first_accumulator_asks_no_weight_of_the_second(backend):
    """first.backward(loss) without a weight counts the micro-batch 1, as the second's step() does without one: the
    usual loop of two optimizers over one model, unweighted, runs as before and equals one accumulator."""
    whole = tanh_mlp(seed=0, dtype=torch.float64)
    one = GradAccumulator(torch.optim.SGD(whole.parameters(), lr=0.1), 2, backend=backend)
    split, first, second = _split_accumulators(backend)
    for x, y in _data([2, 7]):
        one.backward(_loss(whole, x, y))
        one.step()
        one.zero_grad()
        first.backward(_loss(split, x, y))
        first.step()
        second.step()
        first.zero_grad()
        second.zero_grad()
    _assert_split_equals_one(whole, split, one, first, second)


def test_gradients_a_weighted_backward_of_the_first_accumulator_did_not_touch_take_any_weight(backend):
    """The second's p.grad from its own plain backward, then first.backward(loss, weight=w) over a loss that reaches
    only the first's parameters: it gave the second nothing, so the second's step() takes its own weight (or none),
    as with no other accumulator."""
    split, first, second = _split_accumulators(backend)
    (x, y), (x2, y2) = _data([3, 4])
    hidden = torch.tanh(split[0](x)).detach()
    torch.nn.functional.mse_loss(split[2](hidden), y).backward()  # the second's parameters only
    assert all(param.grad is None for param in split[0].parameters())
    first.backward(split[0](x2).square().mean(), weight=5)  # the first's parameters only
    first.step()
    second.step()  # its own gradients, weight 1
    assert first.micro_step == 1 and second.micro_step == 1


def test_gradients_a_weighted_backward_gave_and_that_were_dropped_since_ask_no_weight_though_still_alive(backend):
    """first.backward(loss, weight=5) gives the second its gradients; the caller keeps them (a gradient logger), then
    drops them from p.grad (zero_grad) and runs a plain backward: what the second's step() folds now is none of that
    backward's, so it takes its own weight, as when the old gradients are freed."""
    split, first, second = _split_accumulators(backend)
    (x, y), (x2, y2) = _data([3, 4])
    first.backward(_loss(split, x, y), weight=5)
    first.step()
    logged = [param.grad for param in list(split.parameters())[2:]]  # kept alive by the caller
    second.zero_grad()
    first.zero_grad()
    _loss(split, x2, y2).backward()
    assert all(param.grad is not grad for param, grad in zip(list(split.parameters())[2:], logged, strict=True))
    second.step(weight=2)  # its own plain backward's gradients: any weight
    assert second.micro_step == 1


def test_the_second_accumulators_own_backward_loop_takes_what_the_first_gave_in_its_micro_batch(backend):
    """Both accumulators in the backward loop, with the same weight: second.backward(loss, weight=w) over a loss of
    its own parameters opens its micro-batch, then first.backward(loss, weight=w) over the whole model gives the
    second more gradients. The second's step() (no weight: its backward gave it) folds them into its open
    micro-batch, counted w."""
    split, first, second = _split_accumulators(backend)
    ((x, y),) = _data([3])
    hidden = torch.tanh(split[0](x)).detach()
    second.backward(split[2](hidden).square().mean(), weight=5)  # the second's parameters only
    first.backward(_loss(split, x, y), weight=5)
    first.step()
    second.step()
    assert first.micro_step == 1 and second.micro_step == 1


def test_the_latest_weighted_backward_of_the_first_accumulator_sets_the_weight_the_second_must_repeat(backend):
    """The second skips a micro-batch (zero_grad() drops what first.backward(loss, weight=5) gave it); the next,
    first.backward(loss, weight=7), gives it new gradients: its step() must repeat 7, not the skipped 5."""
    split, first, second = _split_accumulators(backend, 3)
    (x, y), (x2, y2) = _data([3, 4])
    first.backward(_loss(split, x, y), weight=5)
    first.step()
    first.zero_grad()
    second.zero_grad()  # the second leaves this micro-batch out
    first.backward(_loss(split, x2, y2), weight=7)
    first.step()
    for wrong in (None, 5, 3):
        with pytest.raises(ValueError, match=r"backward\(loss, weight=7\)"):
            second.step(weight=wrong)
    second.step(weight=7)
    assert second.micro_step == 1


def test_the_second_accumulators_own_backward_loop_refuses_what_the_first_gave_at_another_weight(backend):
    """second.backward(loss, weight=3) opens its micro-batch; first.backward(loss, weight=5) then gives the second
    more gradients, which its step() would fold at 3: refused, naming both, nothing folded."""
    split, first, second = _split_accumulators(backend)
    ((x, y),) = _data([3])
    hidden = torch.tanh(split[0](x)).detach()
    second.backward(split[2](hidden).square().mean(), weight=3)
    before = [buffer.data.clone() for buffer in second.buffers]
    first.backward(_loss(split, x, y), weight=5)
    first.step()
    refused = r"backward\(loss, weight=5\).*own backward\(\) gave 3, so drop them.*p\.grad = None.*got 3;"
    with pytest.raises(ValueError, match=refused):
        second.step()
    assert second.micro_step == 0 and all(map(torch.equal, [b.data for b in second.buffers], before))
    for param in list(split.parameters())[2:]:
        param.grad = None  # the way out the error names: the micro-batch is then the second's own backward alone
    second.step()
    assert second.micro_step == 1


@pytest.mark.parametrize("another", [True, False])
def test_the_second_accumulators_own_backward_refuses_what_the_first_gave_at_another_weight_before_folding(
    backend, another
):
    """first.backward(loss, weight=w) gives the second's parameters gradients; second.backward(loss, weight=w + 1) (or
    without one) would add into them and fold them at its own weight during backward, silently (the other order is
    refused at step()): refused before anything changes. With the same weight both count the micro-batch alike and
    equal one accumulator over the model."""
    whole = tanh_mlp(seed=0, dtype=torch.float64)
    one = GradAccumulator(torch.optim.SGD(whole.parameters(), lr=0.1), 2, backend=backend)
    split, first, second = _split_accumulators(backend)

    def own(model, x):  # reaches the second's parameters only
        return model[2](torch.tanh(model[0](x)).detach()).square().mean()

    for x, y in _data([3, 4]):
        one.backward(_loss(whole, x, y), weight=len(x))
        one.backward(own(whole, x))
        one.step()
        one.zero_grad()
        own_loss = own(split, x)  # before first.step() changes the first layer, as in one's micro-batch
        first.backward(_loss(split, x, y), weight=len(x))
        held = [param.grad for param in list(split.parameters())[2:]]
        versions = [grad._version for grad in held]
        before = [buffer.data.clone() for buffer in second.buffers]
        own_weight = len(x) + 1 if another else None
        with pytest.raises(ValueError, match=rf"this backward\(\) would fold.*weight={len(x)}\).*got {own_weight};"):
            second.backward(own_loss, weight=own_weight)
        assert all(p.grad is g for p, g in zip(list(split.parameters())[2:], held, strict=True))
        assert [grad._version for grad in held] == versions
        assert all(map(torch.equal, [b.data for b in second.buffers], before))
        second.backward(own_loss, weight=len(x))
        first.step()
        second.step()
        first.zero_grad()
        second.zero_grad()
    _assert_split_equals_one(whole, split, one, first, second)


@pytest.mark.parametrize("first_weight", [5, None])
def test_a_later_backward_of_the_seconds_micro_batch_holds_what_the_first_gave_to_the_micro_batchs_weight(
    backend, first_weight
):
    """second.backward(loss, weight=5) opens its micro-batch; first.backward(loss, weight=w) then gives the second's
    parameters more gradients, which the second's next backward of that micro-batch (no weight: the micro-batch's, 5)
    adds into and folds at 5. With w = 5 both count the micro-batch alike: taken. Unweighted (counted 1 there), it is
    refused before anything changes, naming the micro-batch's 5 as the weight given."""
    split, first, second = _split_accumulators(backend)
    ((x, y),) = _data([3])
    hidden = torch.tanh(split[0](x)).detach()
    second.backward(split[2](hidden).square().mean(), weight=5)  # the second's parameters only
    first.backward(_loss(split, x, y), weight=first_weight)
    first.step()
    later = split[2](hidden).abs().mean()
    if first_weight is None:
        held = [param.grad for param in list(split.parameters())[2:]]
        versions = [grad._version for grad in held]
        before = [buffer.data.clone() for buffer in second.buffers]
        refused = r"would fold.*weight=None\).*own backward\(\) gave 5, so drop them.*keep that backward off them"
        with pytest.raises(ValueError, match=refused):
            second.backward(later)
        assert all(p.grad is g for p, g in zip(list(split.parameters())[2:], held, strict=True))
        assert [grad._version for grad in held] == versions
        assert all(map(torch.equal, [b.data for b in second.buffers], before))
        return
    second.backward(later)
    second.step()
    assert first.micro_step == 1 and second.micro_step == 1


@pytest.mark.parametrize("later", [7, 5])
@pytest.mark.parametrize("loop", ["step", "backward"])
def test_gradients_two_micro_batches_of_the_first_accumulator_gave_are_refused_at_every_weight(backend, loop, later):
    """The second leaves a micro-batch out without dropping its gradients: first.backward(loss, weight=7) adds into
    what first.backward(loss, weight=5) gave (in place). The sum holds both micro-batches, which no one weight counts
    as one; the record kept only the latest, so step(weight=7) folded both at 7 (and at equal weights, 5 and 5, as one
    micro-batch of 5, on a rank whose counts happened to be equal while another rank's were refused). Every weight
    is refused, nothing changed; once dropped, the second takes its next micro-batch as usual."""
    split, first, second = _split_accumulators(backend, 3)
    (x, y), (x2, y2), (x3, y3) = _data([3, 4, 2])
    first.backward(_loss(split, x, y), weight=5)
    first.step()
    first.backward(_loss(split, x2, y2), weight=later)
    first.step()
    held = [param.grad.clone() for param in list(split.parameters())[2:]]
    for weight in (None, 5, 7):
        with pytest.raises(ValueError, match=r"more than one micro-batch of other accumulators.*p\.grad = None"):
            if loop == "step":
                second.step(weight=weight)
            else:
                second.backward(split[2](torch.tanh(split[0](x)).detach()).sum(), weight=weight)
    assert second.micro_step == 0
    assert all(map(torch.equal, [param.grad for param in list(split.parameters())[2:]], held))
    second.zero_grad()
    first.zero_grad()
    first.backward(_loss(split, x3, y3), weight=2)
    first.step()
    second.step(weight=2)
    assert second.micro_step == 1


def test_a_later_backward_of_the_first_accumulators_micro_batch_keeps_the_conflict_its_first_backward_made(backend):
    """The second leaves a micro-batch out without zero_grad(): first.backward(loss, weight=7) adds into what
    first.backward(loss, weight=5) gave, which no weight counts as one micro-batch. Another backward of the first's
    micro-batch (an auxiliary loss, weight 7 as its first gave) adds into them once more: still both micro-batches,
    refused at every weight (the last backward's record alone took 7), nothing changed."""
    split, first, second = _split_accumulators(backend, 3)
    (x, y), (x2, y2) = _data([3, 4])
    first.backward(_loss(split, x, y), weight=5)
    first.step()
    first.backward(_loss(split, x2, y2), weight=7)
    first.backward(0.1 * split(x2).abs().mean())
    first.step()
    held = [param.grad.clone() for param in list(split.parameters())[2:]]
    for weight in (None, 5, 7):
        with pytest.raises(ValueError, match=r"more than one micro-batch of other accumulators.*p\.grad = None"):
            second.step(weight=weight)
    assert second.micro_step == 0
    assert all(map(torch.equal, [param.grad for param in list(split.parameters())[2:]], held))


def test_gradients_two_micro_batches_gave_stay_refused_once_the_later_ones_are_dropped_alone(backend):
    """first.backward(loss, weight=5) gives the second's weight and bias gradients; the second leaves the micro-batch
    out without zero_grad(), and first.backward(loss, weight=7, inputs=...) adds into the weight's alone. Dropping the
    weight's gradient leaves the bias's, the first micro-batch's: the record of the two still finds it, so step()
    without 5 is refused (it found none and took any weight); dropped too, the second takes its own."""
    split, first, second = _split_accumulators(backend, 3)
    (x, y), (x2, y2) = _data([3, 4])
    first.backward(_loss(split, x, y), weight=5)
    first.step()
    first.backward(_loss(split, x2, y2), weight=7, inputs=[*split[0].parameters(), split[2].weight])
    first.step()
    split[2].weight.grad = None
    for weight in (None, 7):
        with pytest.raises(ValueError, match=r"more than one micro-batch of other accumulators.*p\.grad = None"):
            second.step(weight=weight)
    assert second.micro_step == 0
    split[2].bias.grad = None
    _loss(split, x2, y2).backward(inputs=list(split[2].parameters()))
    second.step(weight=2)  # its own plain backward's gradients: any weight
    assert second.micro_step == 1


def test_gradients_two_other_accumulators_gave_at_different_weights_are_refused_at_every_weight(backend):
    """Three accumulators over one model: the first's backward(loss, weight=5) and the second's backward(loss,
    weight=7) each give the third's parameters gradients, which hold both micro-batches summed. No weight counts them
    as one: refused at both weights (7, the latest, was taken), nothing changed. At the same weight both backward
    calls count the one micro-batch alike: taken."""
    for weights in ((5, 7), (5, 5)):
        split = tanh_mlp(seed=0, dtype=torch.float64)
        first, second, third = (
            GradAccumulator(torch.optim.SGD(params, lr=0.1), 2, backend=backend)
            for params in ([split[0].weight], [split[0].bias], list(split[2].parameters()))
        )
        ((x, y),) = _data([3])
        first.backward(_loss(split, x, y), weight=weights[0], inputs=[split[0].weight, *split[2].parameters()])
        second.backward(_loss(split, x, y), weight=weights[1], inputs=[split[0].bias, *split[2].parameters()])
        first.step()
        second.step()
        if weights[0] != weights[1]:
            held = [param.grad.clone() for param in split[2].parameters()]
            for weight in weights:
                with pytest.raises(ValueError, match=r"more than one micro-batch of other accumulators"):
                    third.step(weight=weight)
            assert third.micro_step == 0
            assert all(map(torch.equal, [param.grad for param in split[2].parameters()], held))
        else:
            third.step(weight=weights[0])
            assert third.micro_step == 1


def test_a_cpu_weight_tensor_changed_between_two_backward_calls_of_a_micro_batch_counts_its_first_value(backend):
    """first.backward(loss, weight=t) opens its micro-batch with t's value (5); the caller changes t, then a second
    backward of that micro-batch (weight None: the micro-batch's) adds to the second's gradients. One micro-batch,
    counted 5: the second's step(weight=5) is taken (it was refused as a conflict of 5 and 7), 7 refused."""
    split, first, second = _split_accumulators(backend)
    ((x, y),) = _data([3])
    count = torch.tensor(5.0)
    first.backward(_loss(split, x, y), weight=count)
    count.fill_(7.0)
    first.backward(0.1 * split(x).abs().mean())
    first.step()
    with pytest.raises(ValueError, match=r"backward\(loss, weight=5\.0\).*\(got 7;"):
        second.step(weight=7)
    second.step(weight=5)
    assert second.micro_step == 1


def test_a_cpu_weight_tensor_changed_after_the_first_accumulators_backward_counts_as_it_was_then(backend):
    """first.backward(loss, weight=t) counted t's value then (5); the caller reuses t for the next count (7). The
    second's step(weight=t) would compare t with itself and fold at 7: refused; 5, as counted, is taken."""
    split, first, second = _split_accumulators(backend)
    ((x, y),) = _data([3])
    count = torch.tensor(5.0)
    first.backward(_loss(split, x, y), weight=count)
    first.step()
    count.fill_(7.0)
    for wrong in (count, 7):
        with pytest.raises(ValueError, match=r"backward\(loss, weight=5\.0\)"):
            second.step(weight=wrong)
    second.step(weight=5)
    assert second.micro_step == 1


def test_an_unweighted_backward_of_the_first_accumulator_refuses_a_weight_at_the_seconds_step(backend):
    """first.backward(loss) counts the micro-batch 1; the gradients it gave the second folded with weight 7 would
    count it 7 there: refused, as a weighted backward's other weight is (the second's step() without one matches)."""
    split, first, second = _split_accumulators(backend)
    ((x, y),) = _data([3])
    first.backward(_loss(split, x, y))
    first.step()
    for weight in (7, 1):  # (1 too: None for None, so that every rank decides alike)
        with pytest.raises(ValueError, match=rf"backward\(loss, weight=None\).*\(got {weight};"):
            second.step(weight=weight)
    assert second.micro_step == 0
    second.step()
    assert second.micro_step == 1


def _other_notes(failed):
    return [note for note in getattr(failed.value, "__notes__", []) if "other accumulator" in note]


def test_a_failed_backward_that_keeps_its_window_says_nothing_of_the_other_accumulators_windows(backend):
    """The first's backward fails before folding anything (one bucket for the layer), so its window stays as it was;
    the second's window is open (micro_step 1) and the call gave its parameters gradients, put back (none). Nothing
    went out of step: no note names the second's open window, and both step on as one accumulator, bitwise."""
    whole, split, one, first, second, failing, _ = _one_and_split_after_a_micro_batch(backend)
    params = list(split.parameters())
    batches = _data([3, 5])
    (x2, y2) = batches[1]
    failing[0] = True
    with pytest.raises(RuntimeError, match="bad batch") as failed:
        first.backward(_loss(split, x2, y2), weight=5)
    failing[0] = False
    assert _other_notes(failed) == []
    assert (first.micro_step, second.micro_step) == (1, 1)
    assert all(param.grad is None for param in params[2:])
    for x, y in batches:
        one.backward(_loss(whole, x, y), weight=len(x))
        one.step()
    first.backward(_loss(split, x2, y2), weight=5)
    first.step()
    second.step(weight=5)
    assert one.stepped and first.stepped and second.stepped
    assert all(torch.equal(a, b) for a, b in zip(whole.parameters(), split.parameters(), strict=True))


def test_a_failed_backward_that_discards_its_window_names_another_accumulators_open_first_micro_batch(backend):
    """The second accumulator's own backward() opened the window's first micro-batch (micro_step still 0); the
    first's backward then fails after folding part of the call (a bucket per gradient) and after giving the
    second's parameters gradients: the first's window is discarded, the second's first micro-batch stays folded,
    out of step. The note names it at micro_step 0."""
    split = _model()
    params = list(split.parameters())
    first = GradAccumulator(torch.optim.SGD(params[:2], lr=0.1), 2, backend=backend, bucket_bytes=8)
    second = GradAccumulator(torch.optim.SGD(params[2:], lr=0.1), 2, backend=backend)
    (x, y), (x2, y2) = _data([3, 5])
    second.backward(_loss(split, x, y), weight=3, inputs=params[2:])
    assert second.micro_step == 0 and all(param.grad is None for param in params)
    failed = _failing_backward(first, params, _loss(split, x2, y2), weight=5)
    notes = " ".join(failed.value.__notes__)
    assert "the open accumulation window was discarded" in notes
    assert "1 other accumulator(s) over this loss keep their open windows (micro_step 0)" in notes
    assert all(param.grad is None for param in params[2:])


def test_a_failed_backward_that_discards_its_window_names_the_open_window_it_only_added_to_in_place(backend):
    """The second's window is open (micro_step 1) and its parameters hold an auxiliary loss's gradients; the first's
    backward folds part of the call (its window is discarded) and fails after adding to those in place, giving the
    second's parameters no new gradient. The second is reached all the same: both notes, and its record."""
    split = _model()
    params = list(split.parameters())
    first = GradAccumulator(torch.optim.SGD(params[:2], lr=0.1), 2, backend=backend, bucket_bytes=8)
    second = GradAccumulator(torch.optim.SGD(params[2:], lr=0.1), 2, backend=backend)
    (x, y), (x2, y2) = _data([3, 5])
    first.backward(_loss(split, x, y), weight=3)
    first.step()
    second.step(weight=3)
    torch.autograd.backward(_loss(split, x2, y2), inputs=params[2:])  # an auxiliary loss of the second's
    held = [(param.grad, param.grad._version) for param in params[2:]]
    failed = _failing_backward(first, params, _loss(split, x2, y2), weight=5)
    assert all(
        param.grad is grad and grad._version != version for param, (grad, version) in zip(params[2:], held, strict=True)
    )
    notes = " ".join(failed.value.__notes__)
    assert "the open accumulation window was discarded" in notes
    assert "the failed call added to gradients held by 1 other accumulator(s)" in notes
    assert "1 other accumulator(s) over this loss keep their open windows (micro_step 1)" in notes
    with pytest.raises(RuntimeError, match="that failed"):
        second.step(weight=5)


def test_a_failed_backward_that_discards_its_window_leaves_an_accumulator_over_another_model_alone(backend):
    """A third accumulator over another model has its window open (micro_step 1) and holds gradients of its own
    loss.backward(); the failed call over the first model reaches none of them: no note names it, no record is
    made, and its step() folds them."""
    split, apart = _model(), _model(seed=1)
    params = list(split.parameters())
    first = GradAccumulator(torch.optim.SGD(params[:2], lr=0.1), 2, backend=backend, bucket_bytes=8)
    second = GradAccumulator(torch.optim.SGD(params[2:], lr=0.1), 2, backend=backend)
    third = GradAccumulator(torch.optim.SGD(apart.parameters(), lr=0.1), 2, backend=backend)
    (x, y), (x2, y2) = _data([3, 5])
    third.backward(_loss(apart, x, y), weight=3)
    third.step()
    _loss(apart, x2, y2).backward()
    assert third.micro_step == 1
    failed = _failing_backward(first, params, _loss(split, x2, y2), weight=5)
    assert _other_notes(failed) == []
    assert second._weighted_elsewhere is None and third._weighted_elsewhere is None
    third.step()
    assert third.stepped


class _Held:
    """An unreduced_fingerprint as FSDP2's (pairs of tag and version), set by hand: what FSDP held of an accumulator's
    parameters, and when a backward added to it."""

    def __init__(self, value):
        self.value = value

    def __call__(self):
        return self.value


@pytest.mark.parametrize(
    ("before", "after"),
    [(None, ((8, 0),)), (((7, 0),), ((7, 0),)), (((7, 0),), ((7, 1),))],
    ids=["new", "same", "added"],
)
def test_a_failed_backward_puts_back_new_gradients_unless_fsdp_reduced_what_it_held(backend, before, after):
    """What FSDP held of the second's parameters (stood in for by its fingerprint) decides whether the new p.grad the
    failed call gave them may hold earlier micro-batches: only if FSDP reduced some of what it held (a tag gone).
    Held nothing before, the call made it hold some: the new p.grad are put back (none), and what FSDP holds now is
    recorded. Held before, unchanged: put back, no record. Held before and added to in place (its sync off in the
    middle of a window, nothing reduced): put back, and what it holds recorded."""
    split = _model()
    params = list(split.parameters())
    first = GradAccumulator(torch.optim.SGD(params[:2], lr=0.1), 2, backend=backend)
    second = GradAccumulator(torch.optim.SGD(params[2:], lr=0.1), 2, backend=backend)
    held = second._sync.unreduced_fingerprint = _Held(before)

    def add(grad):
        held.value = after

    params[-1].register_hook(add)
    ((x, y),) = _data([3])
    _failing_backward(first, params, _loss(split, x, y), weight=3)
    assert all(param.grad is None for param in params[2:])
    record = second._weighted_elsewhere
    if after == before:
        assert record is None
    else:
        assert record is not None and record.failed and record.unreduced == (after[0][0],) and record.produced == []


def test_a_failed_backward_that_discards_its_window_names_one_whose_fsdp_held_more_of_it(backend):
    """The call gave none of the second's parameters a p.grad (FSDP with its sync off holds them unreduced, stood in
    for by the second's fingerprint, which the call moved): the second is reached all the same, and, the first's
    window discarded, the note names the second's open window."""
    split, apart = _model(), _model(seed=1)
    params = list(split.parameters())
    first = GradAccumulator(torch.optim.SGD(params, lr=0.1), 2, backend=backend, bucket_bytes=8)
    second = GradAccumulator(torch.optim.SGD(apart.parameters(), lr=0.1), 2, backend=backend)
    (x, y), (x2, y2) = _data([3, 5])
    second.backward(_loss(apart, x, y), weight=3)
    second.step()
    held = second._sync.unreduced_fingerprint = _Held(((7, 0),))

    def add(grad):
        held.value = ((7, 1),)

    params[-1].register_hook(add)
    failed = _failing_backward(first, params, _loss(split, x2, y2), weight=5)
    notes = " ".join(failed.value.__notes__)
    assert "the open accumulation window was discarded" in notes
    assert "1 other accumulator(s) over this loss keep their open windows (micro_step 1)" in notes
    assert second._weighted_elsewhere.unreduced == (7,)


def test_a_failed_backward_keeps_the_gradients_fsdp_reduced_what_it_held_into(backend):
    """On a window's last micro-batch FSDP (its sync turned on) reduces what it held of the second's parameters into
    new p.grad with the failed call's part (stood in for by the second's fingerprint, emptied by the call): those
    hold the earlier micro-batches, so they are kept, not put back, and the second's step() refuses them, naming
    the way out FSDP's held gradients need."""
    split = _model()
    params = list(split.parameters())
    first = GradAccumulator(torch.optim.SGD(params[:2], lr=0.1), 2, backend=backend)
    second = GradAccumulator(torch.optim.SGD(params[2:], lr=0.1), 2, backend=backend)
    held = second._sync.unreduced_fingerprint = _Held(((7, 0),))

    def reduce(grad):
        held.value = None

    params[-1].register_hook(reduce)
    ((x, y),) = _data([3])
    failed = _failing_backward(first, params, _loss(split, x, y), weight=3)
    assert "the failed call added to gradients held by 1 other accumulator(s)" in " ".join(failed.value.__notes__)
    kept = [param.grad for param in params[2:]]
    assert all(grad is not None for grad in kept)
    with pytest.raises(RuntimeError, match="that failed.*load every accumulator over the model"):
        second.step(weight=3)
    assert second.micro_step == 0 and all(param.grad is grad for param, grad in zip(params[2:], kept, strict=True))
