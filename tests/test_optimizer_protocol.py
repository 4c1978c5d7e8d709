"""GradAccumulator as a torch.optim.Optimizer: what LR schedulers and training frameworks rely on.

The accumulator owns no parameter groups: ``param_groups``, ``state`` and ``defaults`` are the inner optimizer's.
Schedulers built on it are compared with the same scheduler on a plain optimizer stepped once per window.
"""

import collections
import copy
import pickle
import warnings

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from gafused import GradAccumulator

from casekit import tanh_mlp

STEPS = 2  # micro-batches per window
WINDOWS = 7


def _model(seed=0):
    return tanh_mlp(seed=seed)


def _micro_batches(count, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(3, 5, generator=generator, dtype=torch.float64), torch.randn(3, 3, generator=generator))
        for _ in range(count)
    ]


def _loss(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y.double())


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _two_groups(model, make):
    """Two parameter groups, so schedulers that keep one value per group are checked per group."""
    first, second = list(model[0].parameters()), list(model[2].parameters())
    return make([{"params": first}, {"params": second, "lr": 0.05}])


SCHEDULERS = {
    "LambdaLR": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.8**epoch),
    "StepLR": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
    "OneCycleLR": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[0.4, 0.2], total_steps=WINDOWS),
    "CosineAnnealingWarmRestarts": lambda opt: torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=3),
    "SequentialLR": lambda opt: torch.optim.lr_scheduler.SequentialLR(
        opt,
        [
            torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=2),
            torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.7),
        ],
        milestones=[2],
    ),
    "ReduceLROnPlateau": lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0),
}
# ReduceLROnPlateau steps on a metric: a fixed sequence that plateaus, so the learning rate drops.
METRICS = [1.0, 0.9, 0.95, 0.97, 0.8, 0.85, 0.9]


def _step_scheduler(scheduler, window):
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        scheduler.step(METRICS[window])
    else:
        scheduler.step()


def _hyperparameters(optimizer):
    return [(group["lr"], group.get("momentum")) for group in optimizer.param_groups]


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_schedulers_build_on_it_and_match_a_plain_optimizer_stepped_per_window(name):
    model, twin = _model(), _model()
    inner = _two_groups(model, _sgd)
    plain = _two_groups(twin, _sgd)
    opt = GradAccumulator(inner, accumulation_steps=STEPS)
    with warnings.catch_warnings():
        # Neither torch's "lr_scheduler.step() before optimizer.step()" nor gafused's in-window lr warning.
        warnings.simplefilter("error")
        scheduler = SCHEDULERS[name](opt)
        plain_scheduler = SCHEDULERS[name](plain)
        assert _hyperparameters(inner) == _hyperparameters(plain)
        batches = _micro_batches(STEPS * WINDOWS)
        for window in range(WINDOWS):
            for x, y in batches[window * STEPS : (window + 1) * STEPS]:
                opt.backward(_loss(model, x, y))
                opt.step()
                opt.zero_grad()
                if opt.stepped:  # the recommended loop: the scheduler steps once per window
                    _step_scheduler(scheduler, window)
            plain.zero_grad()
            sum(_loss(twin, x, y) for x, y in batches[window * STEPS : (window + 1) * STEPS]).div(STEPS).backward()
            plain.step()
            _step_scheduler(plain_scheduler, window)
            # The accumulator's scheduler changed the inner optimizer's learning rate (and OneCycleLR's momentum).
            assert _hyperparameters(inner) == _hyperparameters(plain)
    assert scheduler.state_dict().keys() == plain_scheduler.state_dict().keys()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    if name != "ReduceLROnPlateau":
        assert scheduler.get_last_lr() == plain_scheduler.get_last_lr()
    assert _hyperparameters(inner) != [(0.1, 0.9), (0.05, 0.9)]  # the schedule really moved


def test_it_is_an_optimizer_whose_groups_state_and_defaults_are_the_inner_ones():
    inner = torch.optim.AdamW(_model().parameters(), lr=0.1, weight_decay=0.01)
    opt = GradAccumulator(inner, accumulation_steps=2)
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is inner.param_groups and opt.state is inner.state and opt.defaults is inner.defaults
    assert opt.defaults["weight_decay"] == 0.01
    opt.param_groups[0]["lr"] = 0.5  # written where the inner optimizer reads it
    assert inner.param_groups[0]["lr"] == 0.5
    defaults = dict(inner.defaults, lr=0.25)
    opt.defaults = defaults
    assert inner.defaults is defaults
    text = repr(opt)
    assert text.startswith("GradAccumulator(AdamW, accumulation_steps=2, normalization='mean'")
    assert "accumulation_steps=None" in repr(GradAccumulator(torch.optim.SGD(_model().parameters(), lr=0.1), None))


def test_param_groups_and_state_assigned_on_the_accumulator_are_the_inner_optimizers():
    """param_groups and state are the inner optimizer's: code that assigns them on the optimizer it was given (as
    torch.optim's own load_state_dict assigns param_groups) replaces the inner optimizer's, which its step reads."""
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = GradAccumulator(inner, accumulation_steps=1)
    groups = [{**group, "lr": 0.0} for group in inner.param_groups]
    opt.param_groups = groups
    assert inner.param_groups is groups and opt.param_groups is groups
    state = collections.defaultdict(dict)
    opt.state = state
    assert inner.state is state and opt.state is state
    before = [param.detach().clone() for param in model.parameters()]
    x, y = _micro_batches(1)[0]
    _loss(model, x, y).backward()
    opt.step()
    assert opt.stepped  # stepped with the assigned groups' lr 0: nothing moved
    assert all(torch.equal(param, old) for param, old in zip(model.parameters(), before, strict=True))


def test_add_param_group_is_refused():
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = GradAccumulator(inner, accumulation_steps=2)
    with pytest.raises(RuntimeError, match="add_param_group.*build a new GradAccumulator"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))]})
    assert len(inner.param_groups) == 1


@pytest.mark.parametrize("copier", [pickle.dumps, copy.deepcopy, copy.copy], ids=["pickle", "deepcopy", "copy"])
def test_pickling_and_copying_are_refused_with_the_way_out(copier):
    opt = GradAccumulator(torch.optim.SGD(_model().parameters(), lr=0.1), accumulation_steps=2)
    with pytest.raises(TypeError, match="state_dict"):
        copier(opt)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_releases_the_gradients(set_to_none):
    model = _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2)
    (x, y), _ = _micro_batches(2)
    _loss(model, x, y).backward()
    opt.zero_grad(set_to_none=set_to_none)
    assert all(p.grad is None for p in model.parameters())


def test_step_hooks_fire_once_per_inner_step_with_the_finished_gradient():
    model = _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=3)
    calls = []

    def pre_hook(optimizer, args, kwargs):
        assert optimizer is opt and args == () and kwargs == {}
        calls.append(("pre", model[0].weight.grad.clone(), model[0].weight.detach().clone()))

    def post_hook(optimizer, args, kwargs):
        calls.append(("post", None, model[0].weight.detach().clone()))

    global_calls = []
    handles = [
        opt.register_step_pre_hook(pre_hook),
        opt.register_step_post_hook(post_hook),
        register_optimizer_step_post_hook(lambda o, a, k: global_calls.append(o)),
    ]
    try:
        batches = _micro_batches(6)
        for index, (x, y) in enumerate(batches):
            opt.backward(_loss(model, x, y))
            opt.step()
            if index % 3 < 2:
                assert not calls  # no hook fires on a micro-step that does not step the inner optimizer
            else:
                (_, grad, before), (_, _, after) = calls
                assert torch.equal(grad, opt.buffers[0].view(0))  # the pre-hook saw the finished gradient
                torch.testing.assert_close(after, before - 0.1 * grad, rtol=0, atol=1e-15)
                calls.clear()
        assert global_calls == [opt.optimizer] * 2  # global hooks fire once per inner step, for the inner optimizer
    finally:
        for handle in handles:
            handle.remove()
    x, y = batches[0]
    for _ in range(3):
        opt.backward(_loss(model, x, y))
        opt.step()
    assert opt.stepped and not calls  # removed hooks stay silent


def test_no_step_hook_fires_on_a_skipped_window():
    model = _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2)
    calls = []
    opt.register_step_pre_hook(lambda *args: calls.append("pre"))
    opt.register_step_post_hook(lambda *args: calls.append("post"))
    for x, y in _micro_batches(2):
        (_loss(model, x, y) * float("nan")).backward()
        opt.step()
    assert opt.skipped_steps == 1 and calls == []


@pytest.mark.parametrize("loop", ["backward", "step"])
def test_a_step_post_hook_may_drop_the_finished_gradients_with_zero_grad(loop):
    """A post-hook that calls zero_grad() (as a training loop might, right after the step) drops the finished
    gradients the step handed out: p.grad is None after each window, and the next windows are the plain optimizer's
    windows of the same micro-batches."""
    model = _model()
    reference = copy.deepcopy(model)
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=STEPS)
    opt.register_step_post_hook(lambda optimizer, args, kwargs: optimizer.zero_grad())
    batches = _micro_batches(3 * STEPS)
    for window in range(3):
        pair = batches[STEPS * window : STEPS * (window + 1)]
        for x, y in pair:
            if loop == "backward":
                opt.backward(_loss(model, x, y))
            else:
                _loss(model, x, y).backward()
            opt.step()
        assert opt.stepped and all(param.grad is None for param in model.parameters())
        plain.zero_grad()
        (sum(_loss(reference, x, y) for x, y in pair) / STEPS).backward()
        plain.step()
        for param, expected in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(param, expected, rtol=0, atol=1e-14)


def test_a_pre_hook_returning_arguments_is_refused_and_the_window_discarded():
    model = _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2)
    before = [p.detach().clone() for p in model.parameters()]
    opt.register_step_pre_hook(lambda optimizer, args, kwargs: (args, {**kwargs, "closure": None}))
    with pytest.raises(RuntimeError, match="pre-hook must return None"):
        for x, y in _micro_batches(2):
            _loss(model, x, y).backward()
            opt.step()
    assert opt.micro_step == 0 and not opt.stepped
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before, strict=True))


@pytest.mark.parametrize("inside", ["loss.backward", "opt.backward"])
def test_step_with_a_closure_runs_it_with_grad_enabled_and_returns_its_result(inside):
    model, twin = _model(), _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2)
    plain = GradAccumulator(torch.optim.SGD(twin.parameters(), lr=0.1), accumulation_steps=2)
    for x, y in _micro_batches(4):

        def closure(x=x, y=y):
            loss = _loss(model, x, y)
            if inside == "opt.backward":
                opt.backward(loss, weight=3)
            else:
                loss.backward()
            return loss

        with torch.no_grad():  # frameworks may call step() without grad; the closure still backpropagates
            returned = opt.step(closure) if inside == "opt.backward" else opt.step(closure, weight=3)
        torch.testing.assert_close(returned, _loss(twin, x, y).detach())
        _loss(twin, x, y).backward()
        plain.step(weight=3)
        assert opt.stepped == plain.stepped
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)
    assert opt.step(weight=0) is None  # without a closure step() returns None


def test_a_bad_weight_is_refused_before_the_closure_runs():
    model = _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2)
    ran = []
    with pytest.raises(ValueError, match="non-negative finite"):
        opt.step(lambda: ran.append(1), weight=-1)
    assert ran == [] and opt.micro_step == 0


def test_lr_scheduler_patches_step_and_sees_it_called():
    opt = GradAccumulator(torch.optim.SGD(_model().parameters(), lr=0.1), accumulation_steps=2)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    assert getattr(opt.step, "_wrapped_by_lr_sched", False)
    assert not getattr(opt, "_opt_called", False)
    opt.step(weight=0)  # a micro-step without gradients still counts as the optimizer's step() being called
    assert opt._opt_called
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scheduler.step()


def test_a_load_state_dict_pre_hook_may_return_the_dict_to_load():
    """As with torch.optim.Optimizer: a load pre-hook that returns a dict has that dict loaded instead of the one
    given (which stays as it was); one that returns None leaves the given dict to load."""
    model = _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2)
    state = opt.state_dict()
    window = state["gafused"]

    def replacing(optimizer, loaded):
        return {**loaded, "gafused": {**loaded["gafused"], "skipped_steps": 3}}

    opt.register_load_state_dict_pre_hook(replacing)
    opt.register_load_state_dict_pre_hook(lambda optimizer, loaded: None)
    opt.load_state_dict(state)
    assert opt.skipped_steps == 3
    assert state["gafused"] is window and window["skipped_steps"] == 0


def test_state_dict_hooks_run_around_the_whole_dict():
    model = _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2)
    seen = []
    opt.register_state_dict_pre_hook(lambda optimizer: seen.append("save-pre"))
    opt.register_state_dict_post_hook(lambda optimizer, state: {**state, "extra": 1})

    def load_pre_hook(optimizer, state):  # edits the dict it is given in place, returning None
        state["gafused"] = {**state["gafused"], "skipped_steps": state["extra"]}

    opt.register_load_state_dict_pre_hook(load_pre_hook)
    opt.register_load_state_dict_post_hook(lambda optimizer: seen.append("load-post"))
    state = opt.state_dict()
    window = state["gafused"]
    assert state["extra"] == 1 and set(state) == {"state", "param_groups", "gafused", "extra"}
    opt.load_state_dict(state)
    assert opt.skipped_steps == 1  # what the pre-hook made of the dict was loaded
    assert state["gafused"] is window and window["skipped_steps"] == 0  # the caller's dict is not changed
    assert seen == ["save-pre", "load-post"]
