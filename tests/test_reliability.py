"""Failure semantics: nothing silently wrong, failures surface, a refused call changes nothing.

Each case below was wrong once; each test compares against plain PyTorch or a float64 truth.
"""

import copy
import gc
import io
import math
import re
import sys
import warnings
import weakref

import numpy as np
import pytest
import torch

from gafused import GradAccumulator

from casekit import micro_batch, tanh_mlp


def _model(seed=0):
    return tanh_mlp(seed=seed)


def _batches(count, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(2 + i % 3, 5, generator=generator, dtype=torch.float64) for i in range(count)]


def _loss(model, x):
    return model(x).square().mean()


def _assert_same(a, b, tolerance=1e-12):
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=tolerance, atol=tolerance)


def _truth(model, windows, lr=0.1, momentum=0.0, losses=None):
    """Plain PyTorch: one SGD step per window on the token-weighted big batch (of ``losses[i]``, default ``_loss``,
    for window ``i``). With momentum, a parameter no loss of a window reaches keeps p.grad None and is skipped."""
    sgd = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    for window, loss in zip(windows, losses or [_loss] * len(windows), strict=True):
        sgd.zero_grad()
        total = sum(x.shape[0] for x in window)
        sum(loss(model, x) * x.shape[0] / total for x in window).backward()
        sgd.step()


def _spent(output):
    """A loss of ``output`` whose graph down to ``output`` was already run (``torch.autograd.grad``, which leaves
    ``p.grad`` alone): it passes backward()'s own checks, and autograd then refuses it."""
    loss = output.square().mean()
    torch.autograd.grad(loss, output)
    return loss


def _explode(grad):
    raise RuntimeError("hook failed")


def _one_window_matches_the_truth(opt, model, reference, window):
    """Train one whole window through opt.backward() and compare with plain PyTorch on the same window."""
    for x in window:
        opt.backward(_loss(model, x), weight=x.shape[0])
        opt.step()
    assert opt.stepped
    _truth(reference, [window])
    _assert_same(model, reference)


@pytest.mark.parametrize("loop", ["step", "backward"])
def test_no_zero_grad_after_step_or_flush_does_not_leak_into_the_next_window(backend, loop):
    """The finished gradient stays readable as p.grad, and the next backward never adds into it."""
    model, reference = _model(), _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 3, backend=backend)
    batches = _batches(5)
    windows = []
    for _ in range(2):  # two epochs of a full window and a flushed partial one, no zero_grad anywhere
        for x in batches:
            micro_batch(opt, _loss(model, x), loop, weight=x.shape[0])
            if opt.stepped:
                assert all(p.grad is not None for p in model.parameters())  # readable until the next backward
        assert opt.flush() is True
        windows += [batches[:3], batches[3:]]
    _truth(reference, windows)
    _assert_same(model, reference)


def test_unused_parameter_keeps_the_published_gradient_out_of_the_next_window(backend):
    model, reference = _model(), _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, backend=backend)
    x1, x2, x3, x4 = _batches(4)
    for x in (x1, x2):
        _loss(model, x).backward()
        opt.step(weight=x.shape[0])
    published = model[2].weight.grad
    # The next window uses only the first layer: model[2]'s p.grad is still the published view, not a gradient.
    for x in (x3, x4):
        model[0](x).square().mean().backward()
        opt.step(weight=x.shape[0])
    assert published is not None and model[2].weight.grad is None  # no gradient in the window: None, as in torch
    _truth(reference, [[x1, x2]])
    sgd = torch.optim.SGD(reference.parameters(), lr=0.1)
    sgd.zero_grad()
    total = x3.shape[0] + x4.shape[0]
    sum(reference[0](x).square().mean() * x.shape[0] / total for x in (x3, x4)).backward()
    sgd.step()
    _assert_same(model, reference)


class _FlakyStep(torch.optim.SGD):
    """SGD whose step raises when told to."""

    fail = False

    def step(self, closure=None):
        if self.fail:
            raise RuntimeError("inner step failed")
        return super().step(closure)


@pytest.mark.parametrize("loop", ["step", "backward"])
def test_failing_inner_step_surfaces_and_training_goes_on(backend, loop):
    model, reference = _model(), _model()
    inner = _FlakyStep(model.parameters(), lr=0.1)
    opt = GradAccumulator(inner, 2, backend=backend)
    batches = _batches(6)
    inner.fail = True
    with pytest.raises(RuntimeError, match="inner step failed") as raised:
        for x in batches[:2]:
            micro_batch(opt, _loss(model, x), loop, weight=x.shape[0])
    assert "window was discarded" in "".join(getattr(raised.value, "__notes__", []))
    assert opt.micro_step == 0 and not opt.stepped
    assert all(p.grad is None for p in model.parameters())
    inner.fail = False
    for x in batches[2:]:
        _loss(model, x).backward()
        opt.step(weight=x.shape[0])
    _truth(reference, [batches[2:4], batches[4:6]])
    _assert_same(model, reference)


def test_exception_in_a_gradient_hook_discards_the_window_and_training_goes_on(backend):
    model, reference = _model(), _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 3, backend=backend, bucket_bytes=1)
    batches = _batches(5)
    opt.backward(_loss(model, batches[0]), weight=2)
    opt.step()

    handle = model[0].weight.register_hook(_explode)  # fires after later layers' buckets were folded
    with pytest.raises(RuntimeError, match="hook failed") as raised:
        opt.backward(_loss(model, batches[1]), weight=2)
    handle.remove()
    assert "window was discarded" in "".join(raised.value.__notes__)
    assert opt.micro_step == 0 and all(p.grad is None for p in model.parameters())
    _one_window_matches_the_truth(opt, model, reference, batches[2:])


class _InterruptedFold:
    """``ops.fold_`` that runs and then raises KeyboardInterrupt at its ``at``-th call: CPython raises a Ctrl-C
    that arrives while an op runs as the op returns, after the op changed the buffer."""

    def __init__(self, fold, at):
        self.fold, self.at, self.calls = fold, at, 0

    def __call__(self, *args, **kwargs):
        result = self.fold(*args, **kwargs)
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt
        return result


@pytest.mark.parametrize("loop", ["step", "backward"])
def test_an_interrupt_as_a_fold_returns_discards_the_window(backend, loop, monkeypatch):
    """Kept, the window would hold part of the interrupted micro-batch, and retrying it would fold that twice."""
    import gafused.ops

    model, reference = _model(), _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 3, backend=backend, bucket_bytes=1)
    batches = _batches(5)
    micro_batch(opt, _loss(model, batches[0]), loop, weight=2)
    monkeypatch.setattr(gafused.ops, "fold_", _InterruptedFold(gafused.ops.fold_, at=1))
    with pytest.raises(KeyboardInterrupt) as raised:
        micro_batch(opt, _loss(model, batches[1]), loop, weight=2)
    monkeypatch.undo()
    assert "window was discarded" in "".join(raised.value.__notes__)
    assert opt.micro_step == 0 and opt._micro is None
    assert all(p.grad is None for p in model.parameters())
    _one_window_matches_the_truth(opt, model, reference, batches[2:])


@pytest.mark.parametrize("end", ["counted", "flush"])
@pytest.mark.parametrize("loop", ["step", "backward"])
def test_an_interrupt_at_the_windows_host_sync_discards_the_window(backend, loop, end, monkeypatch):
    """Ctrl-C lands where the host waits: the window's one sync. Kept, the window sat past its last micro-batch (a
    counted one never ended again, with no error) and its buffers were scaled already."""
    model, reference = _model(), _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 3 if end == "counted" else None, backend=backend)
    batches = _batches(6)
    tolist = torch.Tensor.tolist

    def interrupted(tensor):
        values = tolist(tensor)
        if sys._getframe(1).f_code.co_name == "_finish":
            raise KeyboardInterrupt
        return values

    for x in batches[:2]:
        micro_batch(opt, _loss(model, x), loop, weight=x.shape[0])
    monkeypatch.setattr(torch.Tensor, "tolist", interrupted)
    with pytest.raises(KeyboardInterrupt) as raised:  # the window's third micro-batch, or a flush after it
        micro_batch(opt, _loss(model, batches[2]), loop, weight=2)
        if end == "flush":
            opt.flush()
    monkeypatch.undo()
    assert "window was discarded" in "".join(raised.value.__notes__)
    assert opt.micro_step == 0 and not opt.stepped
    assert all(p.grad is None for p in model.parameters())
    for x in batches[3:]:
        micro_batch(opt, _loss(model, x), loop, weight=x.shape[0])
    if end == "flush":
        assert opt.flush()
    assert opt.stepped
    _truth(reference, [batches[3:]])
    _assert_same(model, reference)


def test_a_step_refused_at_a_windows_start_keeps_the_gradients():
    """A GradScaler with no scale yet (the loss was not scaled) is refused when the window starts, before anything
    changes: the gradients stay, and no note says a window was discarded."""
    model = _model()
    opt = GradAccumulator(
        torch.optim.SGD(model.parameters(), lr=0.1), 2, grad_scaler=torch.amp.GradScaler("cpu", init_scale=4.0)
    )
    _loss(model, _batches(1)[0]).backward()
    grads = [p.grad for p in model.parameters()]
    with pytest.raises(RuntimeError, match="grad_scaler has no scale yet") as raised:
        opt.step()
    assert not getattr(raised.value, "__notes__", [])
    assert [p.grad for p in model.parameters()] == grads and opt.micro_step == 0


def test_zero_grad_after_a_windows_first_backward_drops_that_batch(backend):
    """As zero_grad() drops a batch in a plain loop: the batch is the whole window so far, which goes."""
    model, reference = _model(), _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 3, backend=backend)
    batches = _batches(4)
    opt.backward(_loss(model, batches[0]), weight=2)
    opt.zero_grad()
    assert opt.micro_step == 0 and opt._micro is None
    _one_window_matches_the_truth(opt, model, reference, batches[1:])


def test_zero_grad_after_a_backward_that_folded_nothing_drops_that_batch(backend):
    model, reference = _model(), _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 3, backend=backend)
    batches = _batches(4)
    opt.backward(_loss(model, batches[0]), weight=2)
    opt.step()
    opt.backward(torch.ones(2, requires_grad=True).sum(), weight=7)  # reaches no parameter
    opt.zero_grad()
    assert opt.micro_step == 1 and opt._micro is None
    for x in batches[1:3]:  # any weight: the dropped micro-batch's 7 is gone
        opt.backward(_loss(model, x), weight=x.shape[0])
        opt.step()
    assert opt.stepped
    _truth(reference, [batches[:3]])
    _assert_same(model, reference)


def test_zero_grad_after_a_windows_first_backward_drops_the_gradients_a_plain_backward_added(backend):
    """The window's first micro-batch: opt.backward() folded part of it, a plain loss.backward() left the rest in
    p.grad (step() would fold them into it). zero_grad() drops the whole micro-batch: those gradients too, and the
    window is as new (stepped False)."""
    model, reference = _model(), _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, backend=backend)
    batches = _batches(5)
    _one_window_matches_the_truth(opt, model, reference, batches[:2])
    assert opt.stepped
    opt.backward(_loss(model, batches[2]), weight=2)
    _loss(model, batches[2]).backward()  # joins the micro-batch at step()
    assert all(p.grad is not None for p in model.parameters())
    opt.zero_grad()
    assert opt.micro_step == 0 and opt._micro is None and not opt.stepped
    assert all(p.grad is None for p in model.parameters())
    _one_window_matches_the_truth(opt, model, reference, batches[3:])


def test_zero_grad_after_a_later_backward_is_refused_and_changes_nothing(backend):
    """That micro-batch is folded into the window's sum: it cannot be dropped alone, nor silently merged with the
    next batch (zero_grad() once left it open, and the next backward() joined it)."""
    model, reference = _model(), _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 3, backend=backend)
    batches = _batches(3)
    opt.backward(_loss(model, batches[0]), weight=batches[0].shape[0])
    opt.step()
    opt.backward(_loss(model, batches[1]), weight=batches[1].shape[0])
    before = [buffer.data.clone() for buffer in opt.buffers]
    refused = r"zero_grad\(\): backward\(\) already folded .*micro-batch 2 of the window.*weight=0"
    with pytest.raises(RuntimeError, match=refused):
        opt.zero_grad()
    assert opt.micro_step == 1 and opt._micro is not None
    assert all(torch.equal(a, b.data) for a, b in zip(before, opt.buffers, strict=True))
    opt.step()
    opt.backward(_loss(model, batches[2]), weight=batches[2].shape[0])
    opt.step()
    assert opt.stepped
    _truth(reference, [batches])
    _assert_same(model, reference)


def test_failed_create_graph_backward_keeps_held_gradients_it_replaced(backend):
    """With create_graph=True autograd accumulates out of place: a failing opt.backward() leaves every gradient
    held from a plain loss.backward() unchanged (new tensors replace them), so each is put back as it was, no note
    says some were dropped, and step() folds them as that micro-batch."""
    model, reference = _model(), _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, backend=backend)
    x1, x2, x3 = _batches(3)
    _loss(model, x1).backward()
    held = [p.grad for p in model.parameters()]
    values = [g.clone() for g in held]

    handle = model[0].weight.register_hook(_explode)
    with pytest.raises(RuntimeError, match="hook failed") as raised:
        opt.backward(_loss(model, x2), weight=1, create_graph=True)
    handle.remove()
    assert all(p.grad is g for p, g in zip(model.parameters(), held, strict=True))  # the very tensors
    assert all(torch.equal(g, v) for g, v in zip(held, values, strict=True))
    assert not any("gradient(s) held" in note for note in getattr(raised.value, "__notes__", []))
    assert opt.micro_step == 0
    opt.step(weight=x1.shape[0])
    opt.backward(_loss(model, x3), weight=x3.shape[0])
    opt.step()
    assert opt.stepped
    _truth(reference, [[x1, x3]])
    _assert_same(model, reference)


@pytest.mark.parametrize("end", ["counted", "flush"])
@pytest.mark.parametrize("loop", ["step", "backward"])
def test_a_failing_step_post_hook_keeps_the_finished_window(backend, loop, end):
    """A post-hook runs after the inner step ended the window: its error reaches the caller, but the step it
    follows stands (stepped, the finished gradients in p.grad, no note of a discarded window) and the next window
    starts clean."""
    model, reference = _model(), _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2 if end == "counted" else None, backend=backend)
    batches = _batches(4)
    fail = [True]

    def post_hook(*_):
        if fail[0]:
            raise RuntimeError("post-hook failed")

    opt.register_step_post_hook(post_hook)
    with pytest.raises(RuntimeError, match="post-hook failed") as raised:
        for x in batches[:2]:
            micro_batch(opt, _loss(model, x), loop, weight=x.shape[0])
        if end == "flush":
            opt.flush()
    assert not any("discarded" in note for note in getattr(raised.value, "__notes__", []))
    assert opt.stepped and opt.micro_step == 0
    assert all(p.grad is not None for p in model.parameters())
    _truth(reference, [batches[:2]])
    _assert_same(model, reference)
    fail[0] = False
    for x in batches[2:]:
        micro_batch(opt, _loss(model, x), loop, weight=x.shape[0])
    if end == "flush":
        assert opt.flush()
    assert opt.stepped
    _truth(reference, [batches[2:]])
    _assert_same(model, reference)


def test_backward_that_fails_before_any_fold_changes_nothing(backend):
    model = _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 3, backend=backend)
    opt.backward(_loss(model, _batches(1)[0]), weight=2)
    opt.step()
    before = opt.buffers[0].data.clone()
    with pytest.raises(RuntimeError, match="Trying to backward through the graph a second time"):
        opt.backward(_spent(model(_batches(1)[0])))  # autograd refuses before any hook runs
    assert opt.micro_step == 1 and torch.equal(opt.buffers[0].data, before)
    opt.backward(_loss(model, _batches(1)[0]), weight=5)  # a new micro-batch with its own weight
    opt.step()
    assert opt.micro_step == 2


def test_backward_that_fails_midway_before_any_fold_leaves_no_partial_gradient(backend):
    """One bucket: a gradient hook on the first layer raises after the last layer's gradients landed in p.grad
    but before the bucket was complete. Those partial gradients must not join the next micro-batch."""
    model, reference = _model(), _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, backend=backend)
    batches = _batches(3)

    handle = model[0].weight.register_hook(_explode)
    with pytest.raises(RuntimeError, match="hook failed"):
        opt.backward(_loss(model, batches[0]), weight=batches[0].shape[0])
    handle.remove()
    assert opt.micro_step == 0 and all(p.grad is None for p in model.parameters())
    _one_window_matches_the_truth(opt, model, reference, batches[1:])


def test_second_backward_refused_by_autograd_keeps_the_window_and_the_micro_batch(backend):
    """A second backward() through a freed graph is refused by autograd before any gradient lands: what the
    micro-batch's first backward() folded, and the window's earlier micro-batches, stay."""
    model, reference = _model(), _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, backend=backend, bucket_bytes=1)
    x1, x2 = _batches(2)
    opt.backward(_loss(model, x1), weight=x1.shape[0])
    opt.step()
    out = model(x2)
    opt.backward(out.square().mean(), weight=x2.shape[0])
    with pytest.raises(RuntimeError, match="second time"):
        opt.backward(out.abs().mean())  # the graph was freed by the first backward
    assert opt.micro_step == 1 and all(p.grad is None for p in model.parameters())
    opt.step()
    assert opt.stepped
    _truth(reference, [[x1, x2]])
    _assert_same(model, reference)


def test_failed_backward_drops_held_gradients_it_changed_and_says_so(backend):
    """Gradients held from a plain loss.backward() that a failing opt.backward() added to in place cannot be
    restored: they are dropped (never left half-updated) and the error says so; untouched ones stay as they were."""
    model = _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, backend=backend)
    x1, x2 = _batches(2)
    _loss(model, x1).backward()
    held = [p.grad.clone() for p in model.parameters()]

    handle = model[0].weight.register_hook(_explode)
    with pytest.raises(RuntimeError, match="hook failed") as raised:
        opt.backward(_loss(model, x2), weight=1)
    handle.remove()
    kept = [p.grad is not None and torch.equal(p.grad, g) for p, g in zip(model.parameters(), held, strict=True)]
    dropped = [p.grad is None for p in model.parameters()]
    assert all(k or d for k, d in zip(kept, dropped, strict=True))
    assert dropped[2] and dropped[3] and kept[0]  # the last layer's were added to; the first layer's weight not
    assert f"{sum(dropped)} gradient(s) held" in "".join(raised.value.__notes__)
    assert opt.micro_step == 0


@pytest.mark.parametrize("loop", ["step", "backward"])
def test_a_parameter_no_gradient_reaches_in_a_window_gets_none_in_either_loop(backend, loop):
    """Used in the first window only: in the second its finished gradient is None, as in torch (momentum SGD skips
    it), not a zero gradient carried over from the first window's record of which parameters had one."""
    model, reference = _model(), _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), 2, backend=backend)
    x1, x2, x3, x4 = _batches(4)

    def first_layer(net, x):  # reaches the first layer only
        return net[0](x).square().mean()

    for x in (x1, x2):
        micro_batch(opt, _loss(model, x), loop, weight=x.shape[0])
    assert opt.stepped and model[2].weight.grad is not None
    for x in (x3, x4):
        micro_batch(opt, first_layer(model, x), loop, weight=x.shape[0])
    assert opt.stepped
    assert model[2].weight.grad is None and model[0].weight.grad is not None
    _truth(reference, [[x1, x2], [x3, x4]], momentum=0.9, losses=[_loss, first_layer])
    _assert_same(model, reference)


@pytest.mark.parametrize("create_graph", [False, True])
@pytest.mark.parametrize("loop", ["step", "backward"])
def test_a_parameter_frozen_when_the_window_ends_gets_its_finished_gradient_for_the_step_only(
    backend, loop, create_graph
):
    """A parameter frozen when the finished gradient is handed out can take no release hook: unfrozen without
    zero_grad(), a plain backward would add into that view (in place, or with create_graph into a new tensor that
    looks like a new gradient). Its p.grad is released once the inner step returned, so the next window holds the
    new gradients only."""
    model = _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, backend=backend)
    x1, x2, x3, x4 = _batches(4)
    seen = []
    opt.register_step_post_hook(lambda *_: seen.append(model[2].weight.grad is not None))
    _loss(model, x1).backward()
    opt.step(weight=x1.shape[0])
    model[2].weight.requires_grad_(False)
    _loss(model, x2).backward()
    opt.step(weight=x2.shape[0])
    assert opt.stepped and seen == [True]  # the inner step and its post-hooks had it
    assert model[2].weight.grad is None and model[0].weight.grad is not None
    model[2].weight.requires_grad_(True)
    reference = copy.deepcopy(model)
    _loss(model, x3).backward(create_graph=create_graph)
    if loop == "step":
        opt.step(weight=x3.shape[0])
        _loss(model, x4).backward(create_graph=create_graph)
        opt.step(weight=x4.shape[0])
    else:
        opt.step(weight=x3.shape[0])
        opt.backward(_loss(model, x4), weight=x4.shape[0], create_graph=create_graph)
        opt.step()
    assert opt.stepped
    _truth(reference, [[x3, x4]])
    _assert_same(model, reference)


@pytest.mark.parametrize("change", ["scaled", "zeroed"])
def test_a_finished_gradient_changed_in_place_is_neither_refused_nor_folded(backend, change):
    """The finished gradients are views of one buffer; changing one in place (scaling it for a log, or
    model.zero_grad(set_to_none=False)) touches only the finished window: the next window is exact."""
    model, reference = _model(), _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, backend=backend)
    x1, x2, x3, x4 = _batches(4)
    for x in (x1, x2):
        opt.backward(_loss(model, x), weight=x.shape[0])
        opt.step()
    assert opt.stepped
    if change == "scaled":
        model[2].weight.grad.mul_(0.5)
    else:
        model.zero_grad(set_to_none=False)
    _truth(reference, [[x1, x2]])
    _one_window_matches_the_truth(opt, model, reference, [x3, x4])


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_backward_that_fails_before_any_fold_releases_the_finished_gradients(backend, dtype):
    """Any backward() releases the last step's finished gradients before autograd runs, one that autograd then
    refuses too: their memory (bf16 parameters: the cast copy) is free for the backward, no view is left without
    its hook, and a plain loss.backward() after it is folded alone."""
    model, reference = _model().to(dtype), _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, backend=backend)
    x1, x2, x3, x4 = _batches(4)
    for x in (x1, x2):
        opt.backward(_loss(model, x.to(dtype)), weight=x.shape[0])
        opt.step()
    assert all(p.grad is not None for p in model.parameters())
    cast_copy = opt._groups[0].finished
    assert (cast_copy is None) is (dtype == torch.float64)
    cast_copy = None if cast_copy is None else weakref.ref(cast_copy)
    with pytest.raises(RuntimeError):
        opt.backward(_spent(model(x4.to(dtype))))  # autograd refuses
    assert all(p.grad is None for p in model.parameters()) and opt.micro_step == 0
    assert cast_copy is None or cast_copy() is None
    if dtype != torch.float64:
        return  # the exact comparison below needs float64 parameters
    _truth(reference, [[x1, x2]])
    for x in (x3, x4):
        _loss(model, x).backward()  # no hook left to release anything: p.grad holds the new gradient only
        opt.step(weight=x.shape[0])
    assert opt.stepped
    _truth(reference, [[x3, x4]])
    _assert_same(model, reference)


def test_failed_backward_with_end_window_does_not_end_the_window(backend):
    """end_window given to a second backward() of the micro-batch that autograd refuses: the micro-batch ends at
    step() as it was opened (not the window's last), and the counted window goes on."""
    model, reference = _model(), _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 3, backend=backend)
    x1, x2, x3 = _batches(3)
    out = model(x1)
    opt.backward(out.square().mean(), weight=x1.shape[0], retain_graph=False)
    with pytest.raises(RuntimeError, match="second time"):
        opt.backward(out.abs().mean(), end_window=True)  # the graph was freed
    opt.step()
    assert opt.micro_step == 1 and not opt.stepped
    for x in (x2, x3):
        opt.backward(_loss(model, x), weight=x.shape[0])
        opt.step()
    assert opt.stepped
    _truth(reference, [[x1, x2, x3]])
    _assert_same(model, reference)


def test_normalization_is_checked_and_kept_for_the_open_window():
    model = _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    with pytest.raises(ValueError, match="normalization must be one of"):
        opt.normalization = "Mean"
    x1, x2 = _batches(2)
    opt.backward(_loss(model, x1))
    opt.step()
    with pytest.raises(RuntimeError, match="normalization: the open window"):
        opt.normalization = "sum"
    assert opt.normalization == "mean"
    opt.backward(_loss(model, x2))
    opt.step()
    opt.normalization = "sum"  # between windows
    assert opt.normalization == "sum"


def test_a_new_accumulator_does_not_fold_the_old_ones_finished_gradients_again(backend):
    """Rebuilding the accumulator (new accumulation_steps, say) without zero_grad(): the finished gradients the
    old one handed out are views of its buffers, not new gradients."""
    model, reference = _model(), _model()
    x1, x2, x3 = _batches(3)
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 1, backend=backend)
    _loss(model, x1).backward()
    opt.step(weight=x1.shape[0])
    assert all(p.grad is not None for p in model.parameters())
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, backend=backend)
    for x in (x2, x3):
        _loss(model, x).backward()
        opt.step(weight=x.shape[0])
    assert opt.stepped
    _truth(reference, [[x1], [x2, x3]])
    _assert_same(model, reference)


def test_a_new_accumulator_while_the_old_one_lives_does_not_fold_its_finished_gradients(backend):
    model, reference = _model(), _model()
    x1, x2 = _batches(2)
    first = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 1, backend=backend)
    _loss(model, x1).backward()
    first.step(weight=x1.shape[0])
    second = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 1, backend=backend)
    assert all(p.grad is None for p in model.parameters())
    _loss(model, x2).backward()
    second.step(weight=x2.shape[0])
    assert second.stepped and first.micro_step == 0
    _truth(reference, [[x1], [x2]])
    _assert_same(model, reference)


@pytest.mark.parametrize("loop", ["step", "backward"])
def test_an_older_accumulator_does_not_fold_a_newer_ones_finished_gradients(backend, loop):
    """Two live accumulators over the same parameters, the older one used after the newer one stepped: the newer
    one's finished gradients (a parameter the micro-batch does not reach keeps its view) are not new gradients
    for the older one, in either loop, and flush() does not take them for unfolded ones."""
    model, reference = _model(), _model()
    x1, x2 = _batches(2)
    first = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, backend=backend)
    second = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 1, backend=backend)
    _loss(model, x1).backward()
    second.step(weight=x1.shape[0])
    assert all(p.grad is not None for p in model.parameters())
    model[0].bias.requires_grad_(False)  # not reached by the next backward: keeps second's finished gradient
    micro_batch(first, _loss(model, x2), loop, weight=x2.shape[0])
    model[0].bias.requires_grad_(True)
    assert first.flush()
    _truth(reference, [[x1]])
    frozen = reference[0].bias.detach().clone()
    _truth(reference, [[x2]])
    with torch.no_grad():
        reference[0].bias.copy_(frozen)  # no gradient in first's window: SGD leaves it
    _assert_same(model, reference)


def test_a_backward_releases_another_accumulators_finished_gradients_only_where_they_share_parameters(backend):
    """Two accumulators sharing one parameter (a shared encoder under two heads): one's backward releases the
    other's finished gradient of the shared parameter (it is about to get a new one), not the other head's."""
    generator = torch.Generator().manual_seed(0)
    shared, head_a, head_b = (
        torch.nn.Parameter(torch.randn(3, 3, generator=generator, dtype=torch.float64)) for _ in range(3)
    )
    x = torch.randn(2, 3, generator=generator, dtype=torch.float64)
    first = GradAccumulator(torch.optim.SGD([shared, head_a], lr=0.1), 1, backend=backend)
    second = GradAccumulator(torch.optim.SGD([shared, head_b], lr=0.1), 1, backend=backend)
    first.backward((x @ shared @ head_a).square().mean())
    first.step()
    finished = head_a.grad
    assert finished is not None and shared.grad is not None
    with pytest.raises(RuntimeError):
        second.backward(_spent(x @ shared @ head_b))  # autograd refuses
    assert head_a.grad is finished and shared.grad is None


def test_a_backward_over_the_same_bf16_model_frees_another_accumulators_cast_copy(backend):
    """Every finished gradient another accumulator handed out is released by this one's backward: its bf16 cast
    copy goes too, before autograd runs (memory parity), and its release hooks with it."""
    model = torch.nn.Linear(16, 16).to(torch.bfloat16)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    first = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 1, backend=backend)
    second = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 1, backend=backend)
    first.backward(model(x).float().square().mean())
    first.step()
    cast_copy = weakref.ref(first._groups[0].finished)
    alive = []
    model.weight.register_hook(lambda grad: alive.append(cast_copy() is not None))
    second.backward(model(x).float().square().mean())
    assert alive == [False] and first._published_hooks == []
    second.step()
    assert second.stepped


@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
@pytest.mark.parametrize("loop", ["step", "backward"])
def test_channels_last_parameters_with_fused_optimizers(kind, loop):
    """Fused CPU optimizers walk p.grad's memory as the parameter's: p.grad must have p's strides."""
    torch.manual_seed(3)
    conv = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    reference = copy.deepcopy(conv)
    make = {
        "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
        "adam": lambda p: torch.optim.Adam(p, lr=0.01, fused=True),
        "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, fused=True),
    }[kind]
    opt = GradAccumulator(make(conv.parameters()), 2, backend="reference")
    ref_opt = make(reference.parameters())
    generator = torch.Generator().manual_seed(4)
    for _ in range(2):
        xs = [torch.randn(2, 3, 6, 7, generator=generator).to(memory_format=torch.channels_last) for _ in range(2)]
        for x in xs:
            micro_batch(opt, conv(x).square().mean(), loop)
        assert conv.weight.grad.stride() == conv.weight.stride()
        ref_opt.zero_grad()
        sum(reference(x).square().mean() / 2 for x in xs).backward()
        ref_opt.step()
        for p, r in zip(conv.parameters(), reference.parameters(), strict=True):
            # The gradient too: Adam's step hardly moves with the gradient's scale.
            torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)


def test_channels_last_gradient_with_other_strides_is_reordered():
    """A gradient given row-major for a channels_last parameter lands in the parameter's memory order."""
    param = torch.nn.Parameter(torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last))
    opt = GradAccumulator(torch.optim.SGD([param], lr=0.0), 1, backend="reference")
    grad = torch.randn(2, 3, 4, 5)
    param.grad = grad.clone()  # contiguous, not channels_last
    opt.step()
    assert param.grad.stride() == param.stride()
    torch.testing.assert_close(param.grad, grad, rtol=0, atol=0)


def test_a_parameter_whose_dtype_changed_after_building_is_refused_by_name(backend):
    """model.double() after the buffers were laid out for float32: the window's edge refuses it, naming the
    parameter, before anything is folded (the buffer would hold the float64 gradients in float32)."""
    model = tanh_mlp(dtype=torch.float32)
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, backend=backend)
    model[2].double()
    x = _batches(1)[0].float()
    loss = model[2](torch.tanh(model[0](x)).double()).square().mean()
    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['params'\]\[2\] changed since"):
        opt.backward(loss)
    assert opt.micro_step == 0 and opt._micro is None
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("built, later", [("contiguous", "channels_last"), ("channels_last", "contiguous")])
@pytest.mark.parametrize("loop", ["step", "backward"])
def test_a_parameter_whose_memory_format_changed_after_building_is_refused_by_name(built, later, loop):
    """model.to(memory_format=...) after the buffers were laid out: the published p.grad would keep the old strides,
    and a fused optimizer, which walks p.grad's memory as the parameter's, would update the wrong elements. The
    window's edge refuses it, naming the parameter and both strides, before anything is folded or stepped."""
    formats = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}
    conv = torch.nn.Conv2d(3, 4, 3).to(memory_format=formats[built])
    opt = GradAccumulator(torch.optim.AdamW(conv.parameters(), lr=0.1, fused=True), 2, backend="reference")
    built_strides = conv.weight.stride()
    conv.to(memory_format=formats[later])
    before = [p.detach().clone() for p in conv.parameters()]
    for _ in range(2):  # and again: a refusal must not accept the new strides for the next call
        loss = conv(torch.randn(2, 3, 6, 6)).square().mean()
        with pytest.raises(RuntimeError) as info:
            micro_batch(opt, loss, loop)
        assert "param_groups[0]['params'][0] changed since" in str(info.value)
        assert f"strides {conv.weight.stride()}, built for {built_strides}" in str(info.value)
        conv.zero_grad()
    assert opt.micro_step == 0 and opt._micro is None and opt.state == {}
    assert all(torch.equal(p, b) for p, b in zip(conv.parameters(), before, strict=True))


def test_a_stride_change_that_moves_no_element_is_accepted():
    """channels_last on a 1x1 convolution changes only the strides of its size-1 dimensions: the memory order,
    the buffer's layout and what a fused optimizer reads stay the same, so training goes on, exactly."""
    conv = torch.nn.Conv2d(3, 4, 1)
    reference = copy.deepcopy(conv)
    opt = GradAccumulator(torch.optim.AdamW(conv.parameters(), lr=0.1, fused=True), 1, backend="reference")
    conv.to(memory_format=torch.channels_last)
    assert conv.weight.stride() != reference.weight.stride()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.1, fused=True)
    x = torch.randn(2, 3, 5, 5)
    micro_batch(opt, conv(x).square().mean(), "backward")
    reference(x).square().mean().backward()
    ref_opt.step()
    assert opt.stepped
    for p, r in zip(conv.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)


@pytest.mark.skipif(not hasattr(torch.Tensor, "grad_dtype"), reason="this torch has no Tensor.grad_dtype")
def test_a_grad_dtype_other_than_the_parameters_is_refused(backend):
    """A bf16 parameter whose grad_dtype asks autograd for float32 gradients: the finished gradient, handed over
    in the parameter's dtype, could not be assigned to p.grad, so the accumulator refuses it, at construction or
    (set afterwards) at the window's edge."""
    model = tanh_mlp(dtype=torch.bfloat16)
    model[0].weight.grad_dtype = torch.float32
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\].*grad_dtype is torch.float32"):
        GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, backend=backend)
    model[0].weight.grad_dtype = torch.bfloat16
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, backend=backend)
    model[0].weight.grad_dtype = torch.float32
    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['params'\]\[0\] changed since"):
        opt.backward(model(_batches(1)[0].bfloat16()).float().square().mean())
    assert opt.micro_step == 0


def test_a_failure_handing_the_finished_gradients_over_discards_the_window(backend, monkeypatch):
    """Whatever fails between the window's last fold and the inner step discards the window, as a failing inner
    step does: the window never stays open at its last position (where no later step() would end it)."""
    model, reference = _model(), _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, backend=backend)
    batches = _batches(6)

    def broken(group, coef):
        raise RuntimeError("publishing failed")

    with monkeypatch.context() as patched:
        patched.setattr(opt, "_publish_grads", broken)
        with pytest.raises(RuntimeError, match="publishing failed") as raised:
            for x in batches[:2]:
                opt.backward(_loss(model, x), weight=x.shape[0])
                opt.step()
    assert "window was discarded" in "".join(getattr(raised.value, "__notes__", []))
    assert opt.micro_step == 0 and not opt.stepped
    for x in batches[2:]:
        opt.backward(_loss(model, x), weight=x.shape[0])
        opt.step()
    _truth(reference, [batches[2:4], batches[4:6]])
    _assert_same(model, reference)


def _assert_refused_backward_changes_nothing(make_loss, options, error, message):
    """A window with one micro-batch; then backward(make_loss(...), **options) is refused with ``message`` and
    changes nothing: state_dict, micro_step and buffers as before, no micro-batch open, no p.grad."""
    model = _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    x, y = _batches(2)
    opt.backward(_loss(model, x))
    opt.step()
    before = _everything(opt)
    with pytest.raises(error, match=message):
        opt.backward(make_loss(model, y), **options)
    after = _everything(opt)
    assert before[:2] == after[:2] and opt._micro is None
    assert all(torch.equal(a, b) for a, b in zip(before[3], after[3], strict=True))
    assert all(param.grad is None for param in model.parameters())


@pytest.mark.parametrize(
    "make_loss, error, message",
    [
        (lambda model, x: 1.0, TypeError, "loss must be a tensor, got float"),
        (lambda model, x: None, TypeError, "loss must be a tensor, got NoneType"),
        (
            lambda model, x: model(x).square().mean(dim=1),
            ValueError,
            r"loss must have one element .* got shape \(\d+,\)",
        ),
        (lambda model, x: model(x).square().mean().detach(), ValueError, "loss does not require grad"),
        (
            lambda model, x: model(x).square().mean() * (1 + 1j),
            TypeError,
            "loss must be a real floating-point tensor, got torch.complex",
        ),
    ],
    ids=["float", "None", "vector", "detached", "complex"],
)
def test_bad_losses_are_refused_by_name_and_change_nothing(make_loss, error, message):
    _assert_refused_backward_changes_nothing(make_loss, {}, error, message)


@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"retain_graph": "yes"}, TypeError, r"backward\(\): retain_graph must be a bool, got str"),
        ({"create_graph": None}, TypeError, r"backward\(\): create_graph must be a bool, got NoneType"),
        ({"create_graph": 1}, TypeError, r"backward\(\): create_graph must be a bool, got int"),
        ({"inputs": "weight"}, TypeError, r"backward\(\): inputs must be None, a tensor or an iterable of .* got str"),
        ({"inputs": []}, ValueError, r"backward\(\): inputs must not be empty"),
        ({"inputs": [None]}, TypeError, r"backward\(\): inputs\[0\] must be a tensor, got NoneType"),
    ],
    ids=["retain_graph-str", "create_graph-None", "create_graph-int", "inputs-str", "inputs-empty", "inputs-None"],
)
def test_bad_autograd_options_of_backward_are_refused_by_name_and_change_nothing(options, error, message):
    _assert_refused_backward_changes_nothing(_loss, options, error, message)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: torch.tensor(2.0).to_sparse(), "weight must be a dense tensor, got layout torch.sparse_coo"),
        (lambda: torch.tensor(2.0, device="meta"), "weight must hold a value, got a tensor on the meta device"),
    ],
    ids=["sparse", "meta"],
)
def test_a_weight_tensor_holding_no_dense_value_is_refused_by_name(make, message):
    model = _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    weight = make()
    with pytest.raises(ValueError, match=message):
        opt.backward(_loss(model, _batches(1)[0]), weight=weight)
    _loss(model, _batches(1)[0]).backward()
    with pytest.raises(ValueError, match=message):
        opt.step(weight=weight)
    assert opt.micro_step == 0


def test_parameters_on_the_meta_device_are_refused_by_name():
    """Built before model.to_empty(): the buffers would be laid out on the meta device."""
    with torch.device("meta"):
        model = tanh_mlp()
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\].*meta device.*to_empty"):
        GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2)


def test_non_leaf_parameters_are_refused_by_name():
    """torch's differentiable optimizers take non-leaf tensors (meta-learning); autograd gives them no .grad, and
    the accumulator folds values: refused by name, not torch's error about grad_dtype."""
    weight = torch.randn(3, requires_grad=True).clone()
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\].*leaf tensors.*CloneBackward0"):
        GradAccumulator(torch.optim.SGD([weight], lr=0.1, differentiable=True), 2)


@pytest.mark.parametrize("call", ["optimizer.step()", "scaler.step(optimizer)"])
def test_the_wrapped_optimizer_stepped_directly_is_refused_while_the_accumulator_lives(backend, call):
    """Existing code keeps stepping the optimizer it wrapped (still in scope): it stepped on each micro-batch's own
    gradient, outside the window, silently. Refused, nothing changed; the accumulator steps it once per window as
    before (also through an LR scheduler built on it, which wraps its step), and once the accumulator is gone the
    optimizer steps as usual."""
    model = tanh_mlp(seed=0, dtype=torch.float64)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.5)
    opt = GradAccumulator(inner, 2, backend=backend)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    x, x2 = _batches(2)
    before = [param.detach().clone() for param in model.parameters()]
    (_loss(model, x) if call == "optimizer.step()" else scaler.scale(_loss(model, x))).backward()
    said = "nothing changed" if call == "optimizer.step()" else "the scaler unscaled the gradients in p.grad already"
    refused = rf"SGD\.step\(\) was called on the optimizer a GradAccumulator wraps.*{said}"
    with pytest.raises(RuntimeError, match=refused):
        inner.step() if call == "optimizer.step()" else scaler.step(inner)
    assert all(map(torch.equal, model.parameters(), before)) and opt.micro_step == 0 and not inner.state
    model.zero_grad()
    _loss(model, x).backward()
    opt.step()
    opt.zero_grad()
    opt.backward(_loss(model, x2))
    opt.step()
    assert opt.stepped and not all(map(torch.equal, model.parameters(), before))
    scheduler.step()
    assert inner.param_groups[0]["lr"] == 0.05
    del opt
    gc.collect()
    after = [param.detach().clone() for param in model.parameters()]
    _loss(model, x).backward()
    inner.step()
    assert not all(map(torch.equal, model.parameters(), after))


def test_the_wrapped_optimizer_stays_refused_after_its_step_inside_the_accumulator_failed(backend):
    """The inner optimizer's step fails at a window's end (a step pre-hook of its own raised): the accumulator's step
    of it is over, so the wrapped optimizer stepped directly afterwards is refused as before, nothing changed."""
    model = tanh_mlp(seed=0, dtype=torch.float64)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = GradAccumulator(inner, 1, backend=backend)
    failing = [True]

    def fail_once(optimizer, args, kwargs):
        if failing and failing.pop():
            raise RuntimeError("inner step failed")

    inner.register_step_pre_hook(fail_once)
    (x,) = _batches(1)
    opt.backward(_loss(model, x))
    with pytest.raises(RuntimeError, match="inner step failed"):
        opt.step()
    before = [param.detach().clone() for param in model.parameters()]
    model.zero_grad()
    _loss(model, x).backward()
    with pytest.raises(RuntimeError, match=r"SGD\.step\(\) was called on the optimizer a GradAccumulator wraps"):
        inner.step()
    assert all(map(torch.equal, model.parameters(), before))


def test_a_function_of_the_callers_named_as_grad_scalers_is_not_taken_for_it(backend):
    """GradScaler.step(opt) is told by its module as well as its function's name: a training loop's own helper that
    happens to share the name steps the accumulator as usual."""
    model = tanh_mlp(seed=0, dtype=torch.float64)
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, backend=backend)

    def _maybe_opt_step(optimizer):
        optimizer.step()

    _loss(model, _batches(1)[0]).backward()
    _maybe_opt_step(opt)
    assert opt.micro_step == 1


def test_grad_scaler_step_of_an_accumulator_built_without_it_is_refused(backend):
    """The AMP recipe kept as it was, scaler.step(opt) on each micro-batch, without grad_scaler=: the scaler skips the
    step() of a micro-batch that overflowed, which zero_grad() then drops, and every later window shifts by one
    (silently, the scale changed per micro-batch). Refused at the first step() it makes, nothing folded."""
    model = tanh_mlp(seed=0, dtype=torch.float64)
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, backend=backend)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(_loss(model, _batches(1)[0])).backward()
    refused = r"GradScaler\.step\(opt\).*without grad_scaler=.*Nothing was folded; the scaler unscaled"
    with pytest.raises(RuntimeError, match=refused):
        scaler.step(opt)
    assert opt.micro_step == 0 and all(not buffer.data.any() for buffer in opt.buffers)


def test_a_checkpoint_whose_device_weight_was_bad_loads_and_its_window_is_refused_at_the_end():
    """A GPU weight is checked on the device and refused at the window's end; a checkpoint taken before that holds
    its window with bad_weight set and whatever weight sum the bad weight made (nan here). It loads (as the run it
    resumes would have gone on), and the window's end refuses it as that run would have."""
    _, source = _mid_window()
    state = copy.deepcopy(source.state_dict())
    state["gafused"]["weight_sum"] = torch.tensor(float("nan"), dtype=torch.float64)
    state["gafused"]["bad_weight"] = torch.tensor(True)
    model, target = _mid_window()
    target.load_state_dict(state)
    assert target.micro_step == 1
    x, last = _batches(2, seed=9)
    _loss(model, x).backward()
    target.step(weight=x.shape[0])
    _loss(model, last).backward()
    with pytest.raises(ValueError, match="weight: a weight of this window was refused at its end") as refused:
        target.step(weight=last.shape[0])  # the window's third micro-batch, its end
    assert "grad_scaler" not in str(refused.value)  # (none here: no loss scale divided any weight)
    assert target.micro_step == 0 and not target.stepped


def _open_float64_window(weight):
    """A float32 Linear(3, 1), its input, a builder of accumulators of 3 micro-batches over it by accum_dtype, and the
    state_dict() of a float64 one whose window holds one micro-batch of ``weight``."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1, bias=False)
    x = torch.ones(1, 3)

    def accumulator(accum_dtype):
        return GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 3, accum_dtype=accum_dtype)

    source = accumulator(torch.float64)
    source.backward(model(x).sum(), weight=weight)
    source.step()
    return model, x, accumulator, copy.deepcopy(source.state_dict())


def test_a_flagged_window_a_float32_accumulator_cannot_scale_still_loads_and_is_refused_at_its_end():
    """A window whose device weight was bad (bad_weight set) is refused at its end whatever its weight sum; its
    checkpoint loads as the run it resumes would have gone on, even with a sum float32 buffers cannot scale by (1e39,
    beyond float32's 8.5e37, that a float64 window can). Refusing it at load as "resume it with float64" would name
    the wrong cause and turn away a checkpoint that the window's end settles."""
    model, x, accumulator, state = _open_float64_window(1.0)
    state["gafused"]["weight_sum"] = torch.tensor(1e39, dtype=torch.float64)
    state["gafused"]["bad_weight"] = torch.tensor(True)
    before = model.weight.detach().clone()
    target = accumulator(torch.float32)
    target.load_state_dict(state)
    assert target.micro_step == 1
    for micro in range(2):
        target.backward(model(x).sum(), weight=1.0)
        if micro == 0:
            target.step()
    with pytest.raises(ValueError, match="weight: a weight of this window was refused at its end"):
        target.step()
    assert target.micro_step == 0 and not target.stepped
    assert torch.equal(model.weight.detach(), before)


def test_a_mean_window_whose_sum_is_exactly_the_largest_float64_can_scale_is_refused_by_float32_buffers():
    """The edge of the refusal above: a float64 window whose weights sum to exactly 1 / tiny (2**1022, the largest
    sum float64 can scale by, itself a weight float64 takes) is one its own buffers finish, so float32 buffers refuse
    it at load, naming weight_sum; an off-by-one edge (``<`` for ``<=``) would load it and refuse it at its end."""
    edge = 1 / torch.finfo(torch.float64).tiny
    assert edge == 2.0**1022
    model, x, accumulator, state = _open_float64_window(edge)
    assert state["gafused"]["weight_sum"].item() == edge
    target = accumulator(torch.float32)
    before = _everything(target)
    with pytest.raises(ValueError, match=r"\['weight_sum'\]: the open window's weights sum to .* "
                       r"resume it with accum_dtype=torch\.float64"):  # fmt: skip
        target.load_state_dict(state)
    after = _everything(target)
    assert before[:2] == after[:2] and after[1] == 0
    resumed = accumulator(torch.float64)
    resumed.load_state_dict(state)
    assert resumed.micro_step == 1


@pytest.mark.parametrize("path", ["host", "device"])
@pytest.mark.parametrize("normalization", ["mean", "sum"])
def test_a_window_whose_weights_overflowed_to_inf_checkpoints_and_ends_as_its_normalization_says(
    normalization, path, monkeypatch
):
    """float64 weights that each fit (at most 1 / tiny, 4.5e307, with "mean") sum to inf. A checkpoint of that open
    window loads (it was refused as "a sum no weights can make"). Its end: "mean" would scale by 1 / inf = 0, so it is
    refused; "sum" ignores the weight sum and steps the true sum of w * g. On the device path (a GPU's, forced here on
    CPU) nothing is checked when the weight is given: the window's end refuses it all the same."""
    import gafused.accumulator

    if path == "device":
        monkeypatch.setattr(gafused.accumulator, "_checked_on_host", lambda device: False)
    weight = 0.9 / torch.finfo(torch.float64).tiny
    # w * g near 1e148: the finished gradient's sum of squares stays far inside float64.
    grads = [torch.tensor([1e-160, -2e-160], dtype=torch.float64), torch.tensor([3e-160, 4e-160], dtype=torch.float64)]

    def accumulator():
        param = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
        return param, GradAccumulator(torch.optim.SGD([param], lr=1e-150), 6, normalization=normalization)

    param, source = accumulator()
    for index in range(5):
        param.grad = grads[index % 2].clone()
        source.step(weight=torch.tensor(weight, dtype=torch.float64))
    state = copy.deepcopy(source.state_dict())
    assert math.isinf(state["gafused"]["weight_sum"].item())
    param, target = accumulator()
    target.load_state_dict(state)
    assert target.micro_step == 5
    param.grad = grads[1].clone()
    if normalization == "mean":
        with pytest.raises(ValueError, match=r"this window's weights sum to inf, beyond 4\.494e\+307") as refused:
            target.step(weight=weight)
        assert "was refused at its end: one given as a device tensor" not in str(refused.value)
        assert target.micro_step == 0 and not target.stepped and target.skipped_steps == 0
        assert torch.equal(param.detach(), torch.ones(2, dtype=torch.float64))
        return
    target.step(weight=weight)
    assert target.stepped and target.skipped_steps == 0
    products = [weight * grad for grad in grads * 3]
    expected = torch.ones(2, dtype=torch.float64) - 1e-150 * sum(products)
    # Six roundings of the fold (an add with its weight may fuse its multiply) and one of the step, in float64.
    bound = 8 * torch.finfo(torch.float64).eps * (1e-150 * sum(product.abs() for product in products) + 1)
    assert ((param.detach() - expected).abs() <= bound).all()
    assert not torch.equal(param.detach(), torch.ones(2, dtype=torch.float64))  # the step moved it


def test_a_mean_window_a_float32_accumulator_cannot_scale_is_refused_at_load_not_at_its_end():
    """An open float64 window whose weights sum to 1e300 (its scale 1e-300 a normal float64) loaded into float32
    buffers, whose scale must be at least float32's tiny (sums up to 8.5e37): refused at load, naming weight_sum and
    the dtype to resume with, nothing changed; rather than loaded and refused at its end with the micro-batches run
    since. The float64 accumulator it came from resumes and finishes it."""
    model, x, accumulator, state = _open_float64_window(1e300)  # float32 parameters: buffers of either dtype
    target = accumulator(torch.float32)
    before = _everything(target)
    with pytest.raises(ValueError, match=r"\['weight_sum'\]: the open window's weights sum to 1e\+300, .* "
                       r"resume it with accum_dtype=torch\.float64"):  # fmt: skip
        target.load_state_dict(state)
    after = _everything(target)
    assert before[:2] == after[:2] and after[1] == 0
    del target
    resumed = accumulator(torch.float64)
    resumed.load_state_dict(state)
    for _ in range(2):
        resumed.backward(model(x).sum(), weight=1e300)
        resumed.step()
    assert resumed.stepped


def test_a_parameter_listed_twice_is_refused():
    w = torch.nn.Parameter(torch.randn(3))
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="listed once"):
        GradAccumulator(torch.optim.SGD([w, w], lr=0.1), 2)


@pytest.mark.parametrize(
    "make, name",
    [
        (lambda p: torch.optim.LBFGS(p), "LBFGS"),
        (lambda p: torch.optim.SparseAdam(p), "SparseAdam"),
    ],
)
def test_optimizers_that_cannot_step_on_a_finished_gradient_are_refused(make, name):
    with pytest.raises(TypeError, match=name):
        GradAccumulator(make([torch.nn.Parameter(torch.randn(3))]), 2)


@pytest.mark.parametrize(
    "weight",
    [np.float32(3), np.int64(3), np.float64(3), 3, 3.0],
    ids=["np.float32", "np.int64", "np.float64", "int", "float"],
)
def test_numpy_and_python_numbers_are_weights(weight):
    param = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
    opt = GradAccumulator(torch.optim.SGD([param], lr=1.0), 2)
    for g, w in ((1.0, weight), (4.0, 1)):
        param.grad = torch.full((2,), g, dtype=torch.float64)
        opt.step(weight=w)
    torch.testing.assert_close(param.grad, torch.full((2,), (3 * 1.0 + 4.0) / 4, dtype=torch.float64))


def test_overflowing_numbers_raise_value_errors_naming_the_argument():
    param = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="max_grad_norm"):
        GradAccumulator(torch.optim.SGD([param], lr=1.0), 2, max_grad_norm=10**400)
    with pytest.raises(ValueError, match="max_grad_norm .* got an int of about 1e\\+5000"):
        GradAccumulator(torch.optim.SGD([param], lr=1.0), 2, max_grad_norm=10**5000)  # beyond str()'s 4300 digits
    opt = GradAccumulator(torch.optim.SGD([param], lr=1.0), 2)
    param.grad = torch.ones(2)
    with pytest.raises(ValueError, match="weight"):
        opt.step(weight=10**400)
    with pytest.raises(TypeError, match="weight"):
        opt.step(weight=np.bool_(True))
    assert opt.micro_step == 0


def test_tensor_learning_rate_changed_inside_a_window_warns():
    param = torch.nn.Parameter(torch.ones(2))
    inner = torch.optim.Adam([param], lr=torch.tensor(0.1))
    opt = GradAccumulator(inner, 3)
    param.grad = torch.ones(2)
    opt.step()
    inner.param_groups[0]["lr"].fill_(0.05)  # what a scheduler does to a tensor learning rate
    param.grad = torch.ones(2)
    with pytest.warns(UserWarning, match="learning rate changed"):
        opt.step()


def test_learning_rate_changed_inside_a_window_warns_at_the_backward_that_sees_it():
    """The backward() loop: the micro-batch's backward() is the first call after a scheduler stepped per micro-batch,
    and warns there (once), before its gradients are folded."""
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = GradAccumulator(inner, 3)
    x1, x2, x3 = _batches(3)
    opt.backward(_loss(model, x1), weight=x1.shape[0])
    opt.step()
    inner.param_groups[0]["lr"] = 0.05  # a scheduler stepped per micro-batch
    with pytest.warns(UserWarning, match="learning rate changed"):
        opt.backward(_loss(model, x2), weight=x2.shape[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per accumulator
        opt.step()
        opt.backward(_loss(model, x3), weight=x3.shape[0])
        opt.step()
    assert opt.stepped


# --- load_state_dict: validate everything, then change anything ------------------------------------------


def _mid_window(backend="reference"):
    model = _model()
    opt = GradAccumulator(torch.optim.AdamW(model.parameters(), lr=0.1), 3, backend=backend)
    for x in _batches(4):  # one finished window (AdamW state exists) and one micro-batch of the next
        _loss(model, x).backward()
        opt.step(weight=x.shape[0])
    return model, opt


def _everything(opt):
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    return buffer.getvalue(), opt.micro_step, opt._weight_sum, [b.data.clone() for b in opt.buffers]


def _corrupt(field):
    def edit(state):
        window = state["gafused"]
        if field == "segments missing":
            del window["buffers"][0]["segments"]
        elif field == "segments truncated":
            window["buffers"][0]["segments"] = window["buffers"][0]["segments"][:-1]
        elif field == "micro_step negative":
            window["micro_step"] = -1
        elif field == "micro_step too large":
            window["micro_step"] = 3
        elif field == "had_grad length":
            window["buffers"][0]["had_grad"] = window["buffers"][0]["had_grad"][:-1]
        elif field == "weight_sum missing":
            window["weight_sum"] = None
        elif field == "weight_sum deleted":
            del window["weight_sum"]
        elif field == "buffers deleted":
            del window["buffers"]
        elif field.startswith("weight_sum ="):  # a value no window's weights sum to
            window["weight_sum"] = torch.tensor(float(field.split("=")[1]), dtype=torch.float64)
        elif field == "segments bf16":  # rounded: the window's sums would lose their precision silently
            window["buffers"][0]["segments"] = window["buffers"][0]["segments"].bfloat16()
        elif field == "gafused None":
            state["gafused"] = None
        elif field == "buffers None":
            window["buffers"] = None
        elif field == "version":
            window["version"] = 99
        elif field == "skipped_steps":
            window["skipped_steps"] = "many"
        elif field == "window_lrs":
            window["window_lrs"] = [0.1, 0.2]
        elif field == "window_lrs entry":
            window["window_lrs"] = ["fast"]
        elif field == "weight_sum on meta":  # a checkpoint loaded onto the meta device
            window["weight_sum"] = window["weight_sum"].to("meta")
        elif field == "segments on meta":
            window["buffers"][0]["segments"] = window["buffers"][0]["segments"].to("meta")
        elif field == "inv_loss_scale on meta":
            window["inv_loss_scale"] = torch.ones((), dtype=torch.float64, device="meta")
        elif field == "segments sparse":  # refused before the inner optimizer loads (it raised after, half loaded)
            window["buffers"][0]["segments"] = window["buffers"][0]["segments"].to_sparse()
        elif field == "weight_sum sparse":
            window["weight_sum"] = window["weight_sum"].to_sparse()
        elif field == "positions":
            window["buffers"][0]["positions"] = window["buffers"][0]["positions"][::-1]
        return state

    return edit


@pytest.mark.parametrize(
    "field, message",
    [
        ("segments missing", r"\['segments'\]"),
        ("segments truncated", r"\['segments'\]"),
        ("micro_step negative", "micro_step"),
        ("micro_step too large", "micro_step"),
        ("had_grad length", "had_grad"),
        ("weight_sum missing", "weight_sum"),
        ("weight_sum deleted", r"\['weight_sum'\]: expected a 0-d torch.float64 tensor .*, it is missing"),
        ("buffers deleted", r"\['buffers'\]: expected a list of dicts .* \(it is missing\)"),
        ("weight_sum = -1", r"\['weight_sum'\]: expected a sum of micro-batch weights"),
        ("weight_sum = nan", r"\['weight_sum'\]: expected a sum of micro-batch weights"),
        ("weight_sum = 1e-310", r"\['weight_sum'\]: expected a sum of micro-batch weights"),
        ("segments bf16", r"\['segments'\]: expected a dense flat float32 or float64 tensor"),
        ("gafused None", r"\['gafused'\]"),
        ("buffers None", "buffers"),
        ("version", "version"),
        ("skipped_steps", "skipped_steps"),
        ("window_lrs", "window_lrs"),
        ("window_lrs entry", r"\['window_lrs'\].*numbers or None"),
        ("weight_sum on meta", r"\['weight_sum'\].*meta device"),
        ("segments on meta", r"\['segments'\].*meta device"),
        ("inv_loss_scale on meta", r"\['inv_loss_scale'\].*meta device"),
        ("segments sparse", r"\['segments'\]: expected a dense flat"),
        ("weight_sum sparse", r"\['weight_sum'\]: expected None or a dense 0-d"),
        ("positions", r"\['positions'\]: expected \[0, 1, 2, 3\]"),
    ],
)
def test_refused_load_state_dict_changes_nothing(field, message):
    _, source = _mid_window()
    state = _corrupt(field)(copy.deepcopy(source.state_dict()))
    model, target = _mid_window()
    for x in _batches(2, seed=9):  # make the target differ from the checkpoint
        _loss(model, x).backward()
        target.step()
    before = _everything(target)
    with pytest.raises(ValueError, match=message):
        target.load_state_dict(state)
    after = _everything(target)
    assert before[0] == after[0] and before[1] == after[1]
    assert torch.equal(before[2], after[2])
    assert all(torch.equal(a, b) for a, b in zip(before[3], after[3], strict=True))


def test_a_window_saved_with_graphs_or_strided_segments_loads_as_plain_values():
    """Saved tensors that require grad, or a segments tensor that is a strided view, load as their values: the
    buffers get no graph (the finished gradients handed out had a grad_fn), and the window ends as the saved one."""
    model, source = _mid_window()
    state = copy.deepcopy(source.state_dict())
    window = state["gafused"]
    segments = window["buffers"][0]["segments"]
    window["buffers"][0]["segments"] = torch.stack([segments, torch.zeros_like(segments)], 1)[:, 0].requires_grad_()
    window["weight_sum"] = window["weight_sum"].clone().requires_grad_()
    assert not window["buffers"][0]["segments"].is_contiguous()
    twin = copy.deepcopy(model)
    target = GradAccumulator(torch.optim.AdamW(twin.parameters(), lr=0.1), 3, backend="reference")
    target.load_state_dict(state)
    assert all(buffer.data.grad_fn is None for buffer in target.buffers)
    for x in _batches(2, seed=5):
        _loss(model, x).backward()
        source.step(weight=x.shape[0])
        _loss(twin, x).backward()
        target.step(weight=x.shape[0])
    assert target.stepped and all(p.grad.grad_fn is None for p in twin.parameters())
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True))


def test_a_mid_window_checkpoint_whose_parameters_moved_between_buffers_is_refused():
    """Saved with parameters [fp32, bf16, fp32], resumed after a cast to [fp32, fp32, bf16]: each buffer has the
    same sizes and shapes, but other parameters. Their parts of the window would have been loaded into one another."""

    def accumulator(dtypes):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(4, 4, dtype=dtype)) for dtype in dtypes]
        return params, GradAccumulator(torch.optim.SGD(params, lr=0.1), 2)

    params, saved = accumulator([torch.float32, torch.bfloat16, torch.float32])
    for param in params:
        param.grad = torch.ones_like(param)
    saved.step()
    state = saved.state_dict()
    assert [entry["positions"] for entry in state["gafused"]["buffers"]] == [[0, 2], [1]]
    _, resumed = accumulator([torch.float32, torch.float32, torch.bfloat16])
    before = _everything(resumed)
    with pytest.raises(ValueError, match=r"\['buffers'\]\[0\]\['positions'\]: expected \[0, 1\].*got \[0, 2\]"):
        resumed.load_state_dict(state)
    after = _everything(resumed)
    assert before[:2] == after[:2] and all(torch.equal(a, b) for a, b in zip(before[3], after[3], strict=True))
    state["gafused"]["micro_step"] = 0  # between windows the buffers are not loaded: any layout is taken
    del state["gafused"]["buffers"][0]["segments"], state["gafused"]["buffers"][1]["segments"]
    resumed.load_state_dict(state)


def test_failure_inside_the_inner_load_changes_nothing_of_the_window(monkeypatch):
    _, source = _mid_window()
    state = source.state_dict()
    _, target = _mid_window()
    target.step(weight=1)  # an empty micro-batch: micro_step 2 while the checkpoint holds 1
    before = _everything(target)

    def broken(_):
        raise RuntimeError("inner load failed")

    monkeypatch.setattr(target.optimizer, "load_state_dict", broken)
    with pytest.raises(RuntimeError, match="inner load failed"):
        target.load_state_dict(state)
    after = _everything(target)
    assert before[1] == after[1] == 2
    assert all(torch.equal(a, b) for a, b in zip(before[3], after[3], strict=True))


def _malformed(case):
    """A mid-window checkpoint (``state``) with one field as no state_dict() writes it: the whole state_dict given to
    load_state_dict (a dict edited in place, or a replacement returned)."""

    def edit(state):
        window = state["gafused"]
        entry = window["buffers"][0]
        if case == "state_dict None":
            return None
        if case == "earlier layout, optimizer a list":
            return {"optimizer": [state["state"], state["param_groups"]], "gafused": window}
        if case == "version 0":
            window["version"] = 0
        elif case == "a newer version":
            window["version"] = 7
        elif case == "version True":
            window["version"] = True
        elif case == "micro_step True":
            window["micro_step"] = True
        elif case == "skipped_steps True":
            window["skipped_steps"] = True
        elif case == "skipped_steps negative":
            window["skipped_steps"] = -1
        elif case == "weight_sum 1-d":
            window["weight_sum"] = window["weight_sum"].reshape(1)
        elif case == "weight_sum float32":
            window["weight_sum"] = window["weight_sum"].float()
        elif case == "bad_weight False, weight_sum nan":  # not flagged: the sum is checked as any other
            window["bad_weight"] = torch.tensor(False)
            window["weight_sum"] = torch.tensor(float("nan"), dtype=torch.float64)
        elif case == "normalization unknown, between windows":
            window["micro_step"] = 0
            window["normalization"] = "median"
        elif case == "rank 1":
            window["rank"] = 1
        elif case == "numels floats":
            entry["numels"] = [float(numel) for numel in entry["numels"]]
        elif case == "buffer entry not a dict":
            window["buffers"][0] = list(entry)
        elif case == "a buffer entry more":
            window["buffers"].append(copy.deepcopy(entry))
        elif case == "numels reordered":  # the same parameter sizes, in another order
            entry["numels"] = entry["numels"][::-1]
        elif case == "had_grad ints":
            entry["had_grad"] = [int(flag) for flag in entry["had_grad"]]
        elif case == "segments 2-d":  # the right number of elements, in one row
            entry["segments"] = entry["segments"].reshape(1, -1)
        elif case == "window_lrs a dict":
            window["window_lrs"] = {0: 0.1}
        elif case == "window_lrs bool":
            window["window_lrs"] = [True]
        elif case == "window_lrs pair":
            window["window_lrs"] = [[0.1, 0.2]]
        return state

    return edit


@pytest.mark.parametrize(
    "case, message",
    [
        ("state_dict None", "state_dict must be a dict from state_dict(), got NoneType"),
        ("earlier layout, optimizer a list", "state_dict['optimizer'] must be a dict, got list"),
        ("version 0", "state_dict['gafused']['version']: unknown gafused state version 0"),
        ("a newer version", "state_dict['gafused']['version']: unknown gafused state version 7"),
        ("version True", "state_dict['gafused']['version']: unknown gafused state version True"),
        ("micro_step True", "['micro_step']: expected a non-negative int, got True"),
        ("skipped_steps True", "['skipped_steps']: expected a non-negative int, got True"),
        ("skipped_steps negative", "['skipped_steps']: expected a non-negative int, got -1"),
        ("weight_sum 1-d", "['weight_sum']: expected None or a dense 0-d torch.float64 tensor"),
        ("weight_sum float32", "['weight_sum']: expected None or a dense 0-d torch.float64 tensor"),
        ("bad_weight False, weight_sum nan", "['weight_sum']: expected a sum of micro-batch weights"),
        ("normalization unknown, between windows", "['normalization']: expected one of ('mean', 'sum'), got 'median'"),
        ("rank 1", "['rank']: expected 0 (the open window holds rank 1's part of the window"),
        ("numels floats", "['buffers']: expected a list of dicts with 'numels' (lists of ints)"),
        ("buffer entry not a dict", "['buffers']: expected a list of dicts with 'numels' (lists of ints)"),
        ("a buffer entry more", "['buffers']: expected 1 buffer entries for this accumulator's parameters"),
        ("numels reordered", "['buffers'][0]: its 'numels' do not match this accumulator's parameters"),
        ("had_grad ints", "['buffers'][0]['had_grad']: expected bools only"),
        ("segments 2-d", "['buffers'][0]['segments']: expected a dense flat float32 or float64 tensor"),
        ("window_lrs a dict", "['window_lrs']: expected None or a list of 1 learning rates"),
        ("window_lrs bool", "['window_lrs']: expected None or a list of 1 learning rates"),
        ("window_lrs pair", "['window_lrs']: expected None or a list of 1 learning rates"),
    ],
)
def test_a_malformed_window_is_refused_by_name_and_changes_nothing(case, message):
    """Each field is checked for what state_dict() writes, before anything changes: a value of another type that
    compares equal (True for 1, 16.0 for 16, a dict for a list), of another shape or dtype, or out of range is refused
    naming the field, and the accumulator, mid-window itself, keeps its window and its inner optimizer's state."""
    _, source = _mid_window()
    state = _malformed(case)(copy.deepcopy(source.state_dict()))
    model, target = _mid_window()
    x = _batches(1, seed=9)[0]  # make the target differ from the checkpoint, its window still open
    _loss(model, x).backward()
    target.step(weight=x.shape[0])
    before = _everything(target)
    assert before[1] == 2
    with pytest.raises(ValueError, match=re.escape(message)):
        target.load_state_dict(state)
    after = _everything(target)
    assert before[0] == after[0] and before[1] == after[1]
    assert torch.equal(before[2], after[2])
    assert all(torch.equal(a, b) for a, b in zip(before[3], after[3], strict=True))


# --- a long run: flat memory --------------------------------------------------------------------------------


def _live_tensors():
    gc.collect()
    return sum(1 for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor))


@pytest.mark.parametrize("loop", ["step", "backward"])
def test_long_run_keeps_memory_flat(loop):
    """Thousands of micro-steps: the number of live tensors does not grow."""
    model = _model()
    opt = GradAccumulator(torch.optim.AdamW(model.parameters(), lr=1e-3), 4, max_grad_norm=1.0)
    x = _batches(1)[0]
    counts = []
    for step in range(2000):
        micro_batch(opt, _loss(model, x), loop, weight=3)
        if step in (999, 1999):  # the same position in a window, after a warm-up
            counts.append(_live_tensors())
    assert counts[1] <= counts[0]  # earlier tests' garbage may still go; nothing of this run may stay
    assert math.isfinite(float(opt.grad_norm))


def test_a_bad_device_weight_of_a_sum_window_is_refused_without_the_mean_only_cause(monkeypatch):
    """With normalization="sum" the weight sum is not a scale: a device weight above float32's range (1e39) is refused
    at the window's end for its range alone, not also for a sum "beyond 1 / tiny" that only "mean" refuses."""
    import gafused.accumulator

    monkeypatch.setattr(gafused.accumulator, "_checked_on_host", lambda device: False)  # a GPU's path, on CPU
    param = torch.nn.Parameter(torch.ones(2))
    opt = GradAccumulator(torch.optim.SGD([param], lr=0.1), 1, normalization="sum")
    param.grad = torch.tensor([1.0, -1.0])
    with pytest.raises(ValueError, match="was refused at its end: one given as a device tensor") as refused:
        opt.step(weight=torch.tensor(1e39, dtype=torch.float64))
    assert "this window's weights sum to" not in str(refused.value)
    assert opt.micro_step == 0 and not opt.stepped
    assert torch.equal(param.detach(), torch.ones(2))


def test_a_bad_device_weight_under_an_infinite_loss_scale_is_refused_with_its_cause(monkeypatch):
    """An infinite loss scale (1 / scale = 0) takes every weight to 0 once divided; a negative device weight is still
    refused at the window's end, by a ValueError naming the weight's range (no range at that scale to add)."""
    import gafused.accumulator

    monkeypatch.setattr(gafused.accumulator, "_checked_on_host", lambda device: False)
    param = torch.nn.Parameter(torch.ones(2))
    scaler = torch.amp.GradScaler("cpu", init_scale=float("inf"))
    opt = GradAccumulator(torch.optim.SGD([param], lr=0.1), 1, grad_scaler=scaler)
    scaler.scale((param * torch.tensor([1.0, -1.0])).sum()).backward()
    with pytest.raises(ValueError, match="was refused at its end: one given as a device tensor") as refused:
        opt.step(weight=torch.tensor(-1.0))
    assert "loss scale" not in str(refused.value)
    assert opt.micro_step == 0 and not opt.stepped


@pytest.mark.parametrize(
    "make_inputs",
    [
        lambda model: torch.nn.ParameterList([model.weight]),
        lambda model: {"weight": model.weight}.values(),
    ],
    ids=["ParameterList", "dict_values"],
)
def test_backward_takes_inputs_as_torch_autograd_backward_does(make_inputs):
    """torch.autograd.backward takes any sized iterable of tensors as inputs (it calls tuple() on it)."""
    torch.manual_seed(0)
    model, twin = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    twin.load_state_dict(model.state_dict())
    x = torch.randn(4, 3)
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 1)
    opt.backward(model(x).sum(), inputs=make_inputs(model))
    opt.step()
    assert opt.stepped and model.bias.grad is None
    plain = torch.optim.SGD(twin.parameters(), lr=0.1)
    twin(x).sum().backward(inputs=make_inputs(twin))
    plain.step()
    torch.testing.assert_close(model.weight, twin.weight)


def test_a_sum_window_of_float64_buffers_with_a_sum_beyond_float32s_scale_loads_into_float32():
    """With normalization="sum" the window's scale is 1, whatever its weight sum: a float64 window whose weights
    (each within float32's range) sum beyond 1 / float32's tiny loads into float32 buffers and finishes there."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1, bias=False)
    x = torch.full((1, 3), 1e-30)

    def accumulator(accum_dtype):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return GradAccumulator(opt, 3, accum_dtype=accum_dtype, normalization="sum")

    source = accumulator(torch.float64)
    for _ in range(2):
        source.backward(model(x).sum(), weight=1e38)
        source.step()
    state = copy.deepcopy(source.state_dict())
    assert state["gafused"]["weight_sum"].item() > 1 / torch.finfo(torch.float32).tiny
    del source
    target = accumulator(torch.float32)
    target.load_state_dict(state)
    assert target.micro_step == 2
    before = model.weight.detach().clone()
    target.backward(model(x).sum(), weight=1e38)
    target.step()
    assert target.stepped and not torch.equal(model.weight.detach(), before)


def test_a_mixed_dtype_accumulators_own_window_loads_back_whatever_its_sum():
    """float32 and float64 parameters with accum_dtype=float32 give a float32 and a float64 buffer; the window is
    scaled in the narrowest (float32). Its own checkpoint, even one whose weights sum beyond float32's scale (which
    its window end refuses), loads back into the same accumulator: the float64 buffer does not make it a float64
    window."""
    torch.manual_seed(0)
    narrow = torch.nn.Linear(3, 1, bias=False)
    wide = torch.nn.Linear(3, 1, bias=False).double()
    params = [*narrow.parameters(), *wide.parameters()]
    x = torch.ones(1, 3)
    opt = GradAccumulator(torch.optim.SGD(params, lr=0.1), 3)
    assert sorted(str(g.buffer.accum_dtype) for g in opt._groups) == ["torch.float32", "torch.float64"]
    for _ in range(2):
        opt.backward(narrow(x).sum() + wide(x.double()).sum().float(), weight=5e37)
        opt.step()
    state = copy.deepcopy(opt.state_dict())
    assert state["gafused"]["weight_sum"].item() > 1 / torch.finfo(torch.float32).tiny
    opt.load_state_dict(state)
    assert opt.micro_step == 2


@pytest.mark.parametrize("end", ["counted", "end_window"])
@pytest.mark.parametrize("loop", ["step", "backward"])
def test_an_interrupt_after_the_last_micro_batch_was_counted_does_not_leave_the_window_past_its_end(
    backend, loop, end, monkeypatch
):
    """Ctrl-C lands in step() after the window's last micro-batch was folded and counted, before the window's end
    began. Kept, the window sat past its last micro-batch with no note: a counted window never ended again (the
    inner optimizer never stepped again, silently), a driven one took the next micro-batches into it."""
    model, reference = _model(), _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 3 if end == "counted" else None, backend=backend)
    batches = _batches(6)
    fingerprint = opt._sync.unreduced_fingerprint

    def interrupted():
        if opt.micro_step == 3:  # the line after the window's last micro-batch was counted
            raise KeyboardInterrupt
        return fingerprint()

    monkeypatch.setattr(opt._sync, "unreduced_fingerprint", interrupted)
    with pytest.raises(KeyboardInterrupt) as raised:
        for i, x in enumerate(batches[:3]):
            micro_batch(opt, _loss(model, x), loop, weight=x.shape[0], end_window=end == "end_window" and i == 2)
            opt.zero_grad()
    monkeypatch.undo()
    assert "window was discarded" in "".join(getattr(raised.value, "__notes__", []))
    assert opt.micro_step == 0 and opt._micro is None and not opt.stepped
    opt.zero_grad()
    for i, x in enumerate(batches[3:]):
        micro_batch(opt, _loss(model, x), loop, weight=x.shape[0], end_window=end == "end_window" and i == 2)
        opt.zero_grad()
    assert opt.stepped
    _truth(reference, [batches[3:]])
    _assert_same(model, reference)


def test_an_interrupt_in_backward_before_autograd_runs_leaves_no_micro_batch_open(backend, monkeypatch):
    """Ctrl-C lands in backward() after it opened the micro-batch, before autograd ran: nothing was folded, so the
    accumulator must be as before the call. Kept open (no note), the micro-batch took the next batch of the same
    weight into it, with the interrupted call's end_window: the window ended a batch early, silently."""
    model, reference = _model(), _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), None, backend=backend)
    batches = [torch.randn(3, 5, generator=torch.Generator().manual_seed(i), dtype=torch.float64) for i in range(6)]
    start = opt._hooks.start

    def interrupted():
        monkeypatch.setattr(opt._hooks, "start", start)
        raise KeyboardInterrupt

    for x in batches[:2]:
        opt.backward(_loss(model, x), weight=3)
        opt.step()
    monkeypatch.setattr(opt._hooks, "start", interrupted)
    with pytest.raises(KeyboardInterrupt):
        opt.backward(_loss(model, batches[2]), weight=3, end_window=True)  # declared the window's last
    assert opt._micro is None and opt.micro_step == 2
    for i, x in enumerate(batches[3:]):  # the interrupted batch skipped: the window ends at the next declared end
        opt.backward(_loss(model, x), weight=3, end_window=i == 2)
        opt.step()
        assert opt.stepped == (i == 2)
    _truth(reference, [batches[:2] + batches[3:]])
    _assert_same(model, reference)


@pytest.mark.parametrize("end", ["counted", "flush"])
@pytest.mark.parametrize("loop", ["step", "backward"])
def test_an_interrupt_updating_the_loss_scaler_after_the_inner_step_does_not_claim_a_discarded_window(
    backend, loop, end, monkeypatch
):
    """Ctrl-C lands in the loss scaler's update, after the inner step ran: the step stands, so the error must not
    say the window was discarded (nor leave stepped False, which an `if opt.stepped: scheduler.step()` reads)."""
    model, reference = _model(), _model()
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    opt = GradAccumulator(
        torch.optim.SGD(model.parameters(), lr=0.1),
        2 if end == "counted" else None,
        backend=backend,
        grad_scaler=scaler,
    )
    batches = _batches(2)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt) as raised:
        for x in batches:
            loss = _loss(model, x)
            micro_batch(opt, loss if loop == "backward" else scaler.scale(loss), loop, weight=x.shape[0])
            if loop == "backward" or opt.micro_step == 1:
                monkeypatch.setattr(torch, "_amp_update_scale_", interrupted)
        if end == "flush":
            opt.flush()
    monkeypatch.undo()
    _truth(reference, [batches])
    _assert_same(model, reference)  # the inner step ran
    assert not any("discarded" in note for note in getattr(raised.value, "__notes__", []))
    assert opt.stepped and opt.micro_step == 0


@pytest.mark.parametrize("at", ["return", "window_scale"])
def test_an_interrupt_inside_opening_the_micro_batch_leaves_none_open(backend, at, monkeypatch):
    """Ctrl-C lands while backward() opens its micro-batch (as the opening returns, or in a call it makes): the
    interrupt itself reaches the caller, no micro-batch stays open, and the windows after it are exact."""
    model, reference = _model(), _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), None, backend=backend)
    batches = [torch.randn(3, 5, generator=torch.Generator().manual_seed(i), dtype=torch.float64) for i in range(6)]
    for x in batches[:2]:
        opt.backward(_loss(model, x), weight=3)
        opt.step()
    loss = _loss(model, batches[2])
    if at == "return":  # as the opening returns: after it set the micro-batch up, before backward() goes on

        def local(frame, event, arg):
            if event == "return":
                raise KeyboardInterrupt
            return local

        def tracer(frame, event, arg):
            return local if event == "call" and frame.f_code is GradAccumulator._open_micro_batch.__code__ else None

        previous = sys.gettrace()
        sys.settrace(tracer)
        try:
            with pytest.raises(KeyboardInterrupt):
                opt.backward(loss, weight=3, end_window=True)
        finally:
            sys.settrace(previous)
    else:

        def interrupted(*args, **kwargs):
            raise KeyboardInterrupt

        monkeypatch.setattr(opt, "_window_scale", interrupted)
        with pytest.raises(KeyboardInterrupt):
            opt.backward(loss, weight=3, end_window=True)
        monkeypatch.undo()
    assert opt._micro is None and opt.micro_step == 2
    for i, x in enumerate(batches[3:]):
        opt.backward(_loss(model, x), weight=3, end_window=i == 2)
        opt.step()
        assert opt.stepped == (i == 2)
    _truth(reference, [batches[:2] + batches[3:]])
    _assert_same(model, reference)


def test_an_interrupt_turning_the_wrappers_sync_on_still_hands_it_back(backend, monkeypatch):
    """Ctrl-C lands as backward() turns the wrapper's gradient sync on for a window's last micro-batch (FSDP2's
    set_requires_gradient_sync(True) returning): the setting it took is put back (after_backward), or the user's
    sync-off setting would be lost for every later window; and no micro-batch stays open."""
    model = _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, backend=backend)
    x = torch.randn(3, 5, dtype=torch.float64)
    opt.backward(_loss(model, x), weight=3)
    opt.step()
    setting = {"sync": False}
    taken = []

    def before_backward(last):
        taken.append(setting["sync"])
        setting["sync"] = True
        raise KeyboardInterrupt

    def after_backward():
        if taken:
            setting["sync"] = taken.pop()

    monkeypatch.setattr(opt._sync, "before_backward", before_backward)
    monkeypatch.setattr(opt._sync, "after_backward", after_backward)
    with pytest.raises(KeyboardInterrupt):
        opt.backward(_loss(model, x), weight=3)
    assert setting["sync"] is False
    assert opt._micro is None and opt.micro_step == 1


def test_a_skipped_window_whose_loss_scaler_update_is_interrupted_still_counts_as_skipped(backend, monkeypatch):
    """A window with a non-finite gradient is skipped on every rank alike; an interrupt in the loss scaler's update
    that follows (on one rank, say) must not leave that rank counting one window fewer: the count of windows ended
    goes across ranks with each window's end, and would refuse every later one."""
    model = _model()
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 1, backend=backend, grad_scaler=scaler)
    x = _batches(1)[0]

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "_amp_update_scale_", interrupted)
    with pytest.raises(KeyboardInterrupt) as raised:
        opt.backward(_loss(model, x) * float("nan"), weight=1)
        opt.step()
    monkeypatch.undo()
    assert "window was discarded" in "".join(getattr(raised.value, "__notes__", []))
    assert opt.skipped_steps == 1 and opt._windows_ended == 1 and opt.micro_step == 0 and not opt.stepped
