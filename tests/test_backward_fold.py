"""Folding during backward: ``opt.backward(loss, weight=w); opt.step()``, bucket by bucket.

Every result is compared with the step-time loop or a float64 big batch; each test runs for every backend that
can run here (Triton through its interpreter on CPU).
"""

import contextlib
import copy

import pytest
import torch
import torch.utils.checkpoint

from gafused import GradAccumulator, ops
from gafused.buffer import DEFAULT_BUCKET_BYTES, FlatGradBuffer
from gafused.ingest import RELEARN_CALLS, BucketHooks

WIDTH = 6


def _model(layers=4, seed=0):
    torch.manual_seed(seed)
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
    return torch.nn.Sequential(*blocks).double()


def _batches(count, rows=3, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(rows + i, WIDTH, generator=generator, dtype=torch.float64) for i in range(count)]


def _loss(model, x):
    return model(x).square().mean()


def _layer_bytes():
    return (WIDTH * WIDTH + WIDTH) * 8


def _assert_same(a, b, tolerance=1e-12):
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=tolerance, atol=tolerance)


def _step_time_run(model, batches, steps, weights, **kwargs):
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), steps, **kwargs)
    for x, w in zip(batches, weights, strict=True):
        _loss(model, x).backward()
        opt.step(weight=w)
        opt.zero_grad()
    return opt


def test_buckets_are_folded_and_released_while_backward_runs(backend, monkeypatch):
    """When the first layer's gradient lands, every later layer's bucket is already folded and released."""
    model = _model()
    # One bucket per Linear layer (weight + bias): 4 buckets.
    opt = GradAccumulator(
        torch.optim.SGD(model.parameters(), lr=0.1), 2, backend=backend, bucket_bytes=_layer_bytes() - 8
    )
    assert len(opt.buffers[0].bucket_ranges) == 4
    folds = _count_folds(monkeypatch)
    seen = {}

    def probe(param):  # runs after the accumulator's own hook on this parameter
        seen["later grads"] = [p.grad for p in model[6].parameters()]
        seen["folds so far"] = len(folds)

    model[0].weight.register_post_accumulate_grad_hook(probe)
    for index, x in enumerate(_batches(2)):
        folds.clear()
        opt.backward(_loss(model, x), weight=float(x.shape[0]))
        assert seen["later grads"] == [None, None]  # the last layer's bucket was folded before the first's
        assert seen["folds so far"] >= 3
        assert folds == ["fold_" if index == 0 else "fold_finish_"] * 4  # one op per bucket, none per parameter
        assert all(p.grad is None for p in model.parameters())
        opt.step()
    assert opt.stepped


def test_hooks_registered_after_the_accumulator_find_and_change_every_gradient(backend):
    """A post-accumulate-grad hook registered on every parameter after the accumulator runs after the accumulator's
    own: it finds each parameter's gradient of the micro-batch, the one that completes a bucket included, and what it
    changes in place is what is folded. Buckets are still folded while backward runs. Against a float64 truth."""
    model, truth = _model(), _model()
    opt = GradAccumulator(
        torch.optim.SGD(model.parameters(), lr=0.1), 2, backend=backend, bucket_bytes=_layer_bytes() - 8
    )
    found, later_folded = [], []

    def halve(param):  # e.g. gradient masking or scaling done in a hook
        found.append(param.grad is not None)
        if param.grad is not None:
            param.grad.mul_(0.5)

    for param in model.parameters():
        param.register_post_accumulate_grad_hook(halve)
    model[0].weight.register_post_accumulate_grad_hook(lambda p: later_folded.append(model[6].weight.grad is None))
    batches = _batches(2)
    for x in batches:
        opt.backward(_loss(model, x), weight=float(x.shape[0]))
        opt.step()
    assert found == [True] * (2 * len(list(model.parameters())))
    assert later_folded == [True, True]

    weights = [float(x.shape[0]) for x in batches]
    grads = [torch.autograd.grad(_loss(truth, x), list(truth.parameters())) for x in batches]
    with torch.no_grad():
        for i, param in enumerate(truth.parameters()):
            mean = sum(w * g[i] for w, g in zip(weights, grads, strict=True)) / sum(weights)
            param -= 0.1 * 0.5 * mean
    _assert_same(model, truth)


def test_a_bucket_handed_over_early_waits_for_the_hooks_after_a_later_gradient_of_its_own(backend):
    """One bucket of two parameters, each with a hook registered after the accumulator that halves its gradient in
    place. The first micro-batch uses only ``first``, so the next call's bucket is complete once ``first`` lands, its
    hand-over deferred until ``first``'s hook has run; ``second``'s gradient lands after that and belongs to the same
    bucket, so the bucket must wait for ``second``'s hook too (the end-of-backward pass folds it), not be handed over
    while ``second``'s gradient is still unhalved. Exact against the step-time loop with the same hooks."""
    torch.manual_seed(3)
    values = [torch.randn(WIDTH, dtype=torch.float64) for _ in range(2)]
    params = [torch.nn.Parameter(value.clone()) for value in values]
    ref_params = [torch.nn.Parameter(value.clone()) for value in values]
    opt = GradAccumulator(torch.optim.SGD(params, lr=0.1), 3, backend=backend)
    ref_opt = GradAccumulator(torch.optim.SGD(ref_params, lr=0.1), 3, backend=backend)
    assert len(opt.buffers[0].bucket_ranges) == 1

    def halve(param):  # reads p.grad unconditionally: a bucket folded under it would leave None here
        param.grad.mul_(0.5)

    for param in params + ref_params:
        param.register_post_accumulate_grad_hook(halve)
    x = torch.randn(3, WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(4))

    def loss_of(first, second, index, uses_second):
        # second's term built first: autograd runs the nodes built last first, so second's gradient lands last
        extra = (second * x[index]).sum() ** 2 if uses_second else 0.0
        return extra + ((first * x[index]).sum() - 1.0) ** 2

    for index, uses_second in enumerate([False, True, True]):
        opt.backward(loss_of(*params, index, uses_second))
        opt.step()
        loss_of(*ref_params, index, uses_second).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert opt.stepped and ref_opt.stepped
    for param, ref_param in zip(params, ref_params, strict=True):
        torch.testing.assert_close(param, ref_param, rtol=1e-12, atol=1e-12)
    assert not torch.equal(params[1].detach(), values[1])


def _freeze_schedule(backend, frozen_at, seed, watch="bias") -> list[bool]:
    """Train with the last layer's weight frozen at the indices ``frozen_at`` says, folding during backward, against
    the step-time loop (asserted exact); returns, per micro-batch, whether the last layer's bucket was folded while
    backward ran (its ``watch`` gradient gone by the time the first layer's weight gradient lands). The accumulators
    are built with the weight as ``frozen_at[0]`` says (frozen: construction warns about it)."""
    model, reference = _model(), _model()
    for net in (model, reference):
        net[6].weight.requires_grad_(not frozen_at[0])
    with pytest.warns(UserWarning, match="1 parameter") if frozen_at[0] else contextlib.nullcontext():
        opt = GradAccumulator(
            torch.optim.SGD(model.parameters(), lr=0.1), 3, backend=backend, bucket_bytes=_layer_bytes() - 8
        )
        ref_opt = GradAccumulator(torch.optim.SGD(reference.parameters(), lr=0.1), 3, backend=backend)
    seen = []
    watched = getattr(model[6], watch)
    model[0].weight.register_post_accumulate_grad_hook(lambda param: seen.append(watched.grad is None))
    for index, x in enumerate(_batches(len(frozen_at), seed=seed)):
        model[6].weight.requires_grad_(not frozen_at[index])
        reference[6].weight.requires_grad_(not frozen_at[index])
        opt.backward(_loss(model, x), weight=float(x.shape[0]))
        opt.step()
        _loss(reference, x).backward()
        ref_opt.step(weight=float(x.shape[0]))
        ref_opt.zero_grad()
    assert opt.stepped
    _assert_same(model, reference)
    return seen


def test_a_parameter_frozen_later_does_not_hold_its_bucket_to_the_end_of_backward(backend):
    """Bucket gradient counts are learned from the backward before: once a parameter is frozen after the
    accumulator was built, its bucket is folded while backward runs again (not at its end, with every gradient of
    the bucket alive); unfrozen again, the bucket waits for it. Exact against the step-time loop throughout."""
    seen = _freeze_schedule(backend, [2 <= index < 6 for index in range(9)], seed=4)
    # Folded during backward except right after a change: the first frozen call (index 2, the bucket waits for
    # the frozen weight) and the first unfrozen one (index 6, handed over early once, completed at the end).
    assert seen == [True, True, False, True, True, True, True, True, True]


def test_a_parameter_given_frozen_and_unfrozen_later_is_folded_during_backward(backend):
    """A parameter that did not require grad when the accumulator was built has no hook yet: the next backward
    hooks it, so its bucket is folded while backward runs (before: its gradient lived to the end of every
    backward). Exact against the step-time loop, with the cost named at construction."""
    seen = _freeze_schedule(backend, [True] + [False] * 5, seed=6, watch="weight")
    # Index 0: frozen, no gradient to hold. From index 1 on the weight is hooked and its bucket waits for it.
    assert seen == [True] * 6


def test_a_bucket_handed_over_early_waits_for_all_only_until_its_use_is_stable_again(backend):
    """Frozen, unfrozen (one early hand-over), frozen again: once the bucket's count has been the same for
    RELEARN_CALLS calls it waits for that count again, so the second freeze holds it for one backward only, like
    the first. Exact against the step-time loop throughout."""
    assert RELEARN_CALLS == 2, "the schedule below is laid out for 2"
    seen = _freeze_schedule(backend, [index in (2, 3) or index >= 7 for index in range(12)], seed=5)
    # Held to the end of backward only on the first call of each freeze (2 and 7); 4 hands over early, 5 and 6
    # wait for both gradients (the count is stable from 5 on), and from 8 on the bucket waits for one gradient.
    assert seen == [True, True, False, True, True, True, True, False, True, True, True, True]


def _bucket_outcomes(calls, trainable_at_start=True):
    """BucketHooks alone over one bucket of two parameters, ``first`` and ``second``; per backward call, ``calls``
    gives (uses first, uses second, second requires grad). Per call: "ok" when the bucket is handed over as its last
    used gradient lands, "early" before that, "held" when it is not handed over during backward."""
    first = torch.nn.Parameter(torch.ones(3))
    second = torch.nn.Parameter(torch.ones(3), requires_grad=trainable_at_start)
    elsewhere = torch.ones(3, requires_grad=True)  # outside the buffer: a backward that reaches neither
    fired = []
    uses = (False, False)

    class Owner:
        def on_bucket_ready(self, group_index, bucket_index):
            fired.append((uses[0] and first.grad is None) or (uses[1] and second.grad is None))

    owner = Owner()
    hooks = BucketHooks([FlatGradBuffer([first, second])], owner)
    got = []
    for *uses, trainable in calls:
        second.requires_grad_(trainable)
        fired.clear()
        first.grad = second.grad = elsewhere.grad = None
        hooks.start()
        # second's term built first: autograd runs the nodes built last first, so second's gradient lands last
        loss = (second.sum() if uses[1] else 0) + elsewhere.sum() + (first.sum() if uses[0] else 0)
        loss.backward()
        hooks.stop()
        got.append("held" if not fired else "early" if fired[0] else "ok")
    return got


@pytest.mark.parametrize(
    ("uses", "outcomes"),
    [
        # One micro-batch that used more: one early hand-over, then waiting for both until the count (one
        # gradient) has been stable for two calls, then folding when the one gradient lands.
        ([False, True, False, False, False, False], ["held", "early", "held", "held", "ok", "ok"]),
        # Use that keeps changing: the second early hand-over doubles the calls needed (4), which alternation
        # never gives: from then on the bucket waits for both, held to the end whenever one is unused.
        (
            [True, False, True, True, False, False, True, False, True, False, True, False],
            ["ok", "held", "early", "ok", "held", "ok", "early", "held", "ok", "held", "ok", "held"],
        ),
        # A second early hand-over (call 6) doubles the calls needed to 4: the bucket waits for both through
        # calls 7-10 (with 2 it would wait for one from call 9 on).
        (
            [True, False, True, True, False, False, True, False, False, False, False, False],
            ["ok", "held", "early", "ok", "held", "ok", "early", "held", "held", "held", "held", "ok"],
        ),
    ],
    ids=["grew-once", "alternating", "grew-twice"],
)
def test_bucket_hooks_relearn_with_doubling_patience(uses, outcomes):
    """BucketHooks alone, one bucket of two parameters, the second used or not per backward call (see
    ``_bucket_outcomes``)."""
    assert _bucket_outcomes([(True, use, True) for use in uses]) == outcomes


def test_bucket_hooks_learn_nothing_from_a_backward_that_reaches_none_of_a_buckets_parameters():
    """Another loss of the micro-batch (or a backward through other parameters) gives the bucket no gradient: the
    count it waits for stays what it learned, so the next call that uses both parameters hands it over on time."""
    both, neither, only_first = (True, True, True), (False, False, True), (True, False, True)
    assert _bucket_outcomes([both, neither, both]) == ["ok", "held", "ok"]
    # Learned one gradient (second unused): a call reaching neither keeps that, so the next one-gradient call folds.
    assert _bucket_outcomes([only_first, only_first, neither, only_first]) == ["held", "ok", "held", "ok"]


def test_bucket_hooks_hook_a_parameter_unfrozen_several_backward_calls_later():
    """A parameter frozen when the hooks were built and still frozen at the next backward calls is looked at again
    at each one: unfrozen at the third, it is hooked then, and its bucket waits for it."""
    frozen, unfrozen = (True, False, False), (True, True, True)
    # second's gradient lands after first's: a bucket waiting for one gradient is handed over early
    assert _bucket_outcomes([(True, False, True), unfrozen]) == ["held", "early"]
    assert _bucket_outcomes([frozen, frozen, unfrozen, unfrozen], trainable_at_start=False) == ["ok"] * 4


def _bucket_outcomes_of_three(calls, trainable_at_start=(True, True, True)):
    """BucketHooks alone over one bucket of three parameters; per backward call, ``calls`` gives (the autograd
    backward passes it runs, each a tuple of the parameters it reaches, by index; which parameters require grad).
    Gradients land in index order within a pass. Per call, as ``_bucket_outcomes``: "ok", "early" or "held"."""
    params = [torch.nn.Parameter(torch.ones(3), requires_grad=trainable) for trainable in trainable_at_start]
    fired = []
    used = set()

    class Owner:
        def on_bucket_ready(self, group_index, bucket_index):
            fired.append(any(params[index].grad is None for index in used))

    owner = Owner()
    hooks = BucketHooks([FlatGradBuffer(params)], owner)
    got = []
    for passes, trainable in calls:
        for param, flag in zip(params, trainable, strict=True):
            param.requires_grad_(flag)
            param.grad = None
        used = {index for reached in passes for index in reached}
        fired.clear()
        hooks.start()
        for reached in passes:
            # built from the last index down: autograd runs the nodes built last first
            sum(params[index].sum() for index in sorted(reached, reverse=True)).backward()
        hooks.stop()
        got.append("held" if not fired else "early" if fired[0] else "ok")
    return got


def test_bucket_hooks_count_a_parameter_whose_gradient_lands_twice_in_one_call_once():
    """A parameter reached twice in one backward call (used inside and outside a reentrant checkpoint: two autograd
    passes) is one gradient of its bucket: the count learned is one, so the next call that reaches it alone hands
    the bucket over as it lands. Counted twice, the bucket would wait for a second gradient that a single pass never
    gives, holding it (and its gradients' memory) to the end of the next backward."""
    all_trainable = (True, True, True)
    twice = (((0,), (0,)), all_trainable)
    once = (((0,),), all_trainable)
    # The first call learns (three hooked, one reached); counted twice, the second call would be held.
    assert _bucket_outcomes_of_three([twice, once, once]) == ["held", "ok", "ok"]


def test_bucket_hooks_handed_over_early_wait_for_every_parameter_not_for_the_larger_count():
    """A bucket of three that learned one gradient and then got two is handed over early; it then waits for all
    three (not for the two of that call), so a call that reaches all three hands it over as the last lands rather
    than early again, before the third gradient exists."""
    all_trainable = (True, True, True)
    calls = [(((0,),), all_trainable), (((0, 1),), all_trainable), (((0, 1, 2),), all_trainable)]
    assert _bucket_outcomes_of_three(calls) == ["held", "early", "ok"]


def test_bucket_hooks_unfrozen_parameter_adds_one_to_a_learned_count_not_all():
    """A bucket that learned fewer gradients than it has hooked parameters (one unused) waits, once a frozen
    parameter of it is unfrozen, for one gradient more than it learned: the call that reaches the first parameter
    and the unfrozen one hands it over as the second lands, not held to the end of backward waiting for the unused
    one."""
    frozen_second, unfrozen = (True, False, True), (True, True, True)
    calls = [(((0,),), frozen_second), (((0,),), frozen_second), (((0, 1),), unfrozen), (((0, 1),), unfrozen)]
    assert _bucket_outcomes_of_three(calls, trainable_at_start=frozen_second) == ["held", "ok", "ok", "ok"]


def _bucket_handovers(calls, bucket_bytes=DEFAULT_BUCKET_BYTES):
    """BucketHooks alone over ``first`` and ``second`` (one bucket, or one each with a small ``bucket_bytes``); per
    backward call, ``calls`` gives the backward passes it runs, each a tuple of the parameters it reaches ("first",
    "second"; "first" before "second" in the loss, so second's gradient lands first). Per call: the
    (pass, bucket) of every hand-over, in order, and ``landed_any()`` at its end."""
    params = {"first": torch.nn.Parameter(torch.ones(3)), "second": torch.nn.Parameter(torch.ones(3))}
    elsewhere = torch.ones(3, requires_grad=True)  # outside the buffer: a pass that reaches neither
    handed = []
    current = [0]

    class Owner:
        def on_bucket_ready(self, group_index, bucket_index):
            handed.append((current[0], bucket_index))

    owner = Owner()
    hooks = BucketHooks([FlatGradBuffer(list(params.values()), bucket_bytes=bucket_bytes)], owner)
    got = []
    for passes in calls:
        handed.clear()
        for param in (*params.values(), elsewhere):
            param.grad = None
        hooks.start()
        for index, reached in enumerate(passes):
            current[0] = index
            (sum((params[name].sum() for name in reached), torch.zeros(())) + elsewhere.sum()).backward()
        hooks.stop()
        got.append((list(handed), hooks.landed_any()))
    return got


def test_bucket_hooks_say_whether_a_gradient_reached_any_bucket():
    """``landed_any()`` (what decides, under FSDP2, whether a backward that failed midway loses the window) is true
    when any one bucket got a gradient in the call, not only when all did, and false when none did."""
    only_first, neither, both = (("first",),), ((),), (("first", "second"),)
    outcomes = _bucket_handovers([only_first, neither, both], bucket_bytes=1)
    assert [landed for _, landed in outcomes] == [True, False, True]
    assert sorted(bucket for _, bucket in outcomes[2][0]) == [0, 1]  # two buckets, each handed over once


def _counting(function, log, name):
    def wrapper(*args, **kwargs):
        log.append(name)
        return function(*args, **kwargs)

    return wrapper


def _count_folds(monkeypatch):
    """A list that records, in order, every ``ops.fold_`` and ``ops.fold_finish_`` call from now on (by name)."""
    calls = []
    monkeypatch.setattr(ops, "fold_", _counting(ops.fold_, calls, "fold_"))
    monkeypatch.setattr(ops, "fold_finish_", _counting(ops.fold_finish_, calls, "fold_finish_"))
    return calls


def _folds_per_micro_batch(monkeypatch, opt, loss_of, count=3):
    """The fold ops of each of ``count`` micro-batches of the backward loop, the loss of each from ``loss_of()``."""
    calls = _count_folds(monkeypatch)
    per_micro_batch = []
    for _ in range(count):
        calls.clear()
        opt.backward(loss_of())
        opt.step()
        per_micro_batch.append(list(calls))
    return per_micro_batch


@pytest.mark.parametrize("n_params", [3, 300])
def test_ops_per_micro_batch_are_buckets_not_parameters(monkeypatch, n_params):
    """The same total size in 3 or 300 parameters and 2 buckets: 2 fold ops per micro-batch either way."""
    sizes = [600 // n_params] * n_params
    params = [torch.nn.Parameter(torch.randn(size, dtype=torch.float64)) for size in sizes]
    opt = GradAccumulator(torch.optim.SGD(params, lr=0.1), 3, backend="reference", bucket_bytes=300 * 8)
    assert len(opt.buffers[0].bucket_ranges) == 2
    per_micro_batch = _folds_per_micro_batch(monkeypatch, opt, lambda: sum((p * p).sum() for p in params))
    assert per_micro_batch == [["fold_"] * 2, ["fold_"] * 2, ["fold_finish_"] * 2]


def test_a_bucket_no_gradient_reaches_in_a_middle_micro_batch_costs_no_op(monkeypatch):
    """Two buckets; a middle micro-batch's backward reaches only the first: its step() adds nothing to the second
    (a missing gradient contributes zero), so no op runs for it; the first and last micro-batches still write every
    bucket (zeroing it, finishing it)."""
    used = torch.nn.Parameter(torch.randn(300, dtype=torch.float64))
    spare = torch.nn.Parameter(torch.randn(300, dtype=torch.float64))
    opt = GradAccumulator(torch.optim.SGD([used, spare], lr=0.1), 3, backend="reference", bucket_bytes=300 * 8)
    assert len(opt.buffers[0].bucket_ranges) == 2
    per_micro_batch = _folds_per_micro_batch(monkeypatch, opt, lambda: (used * used).sum())
    assert per_micro_batch == [["fold_"] * 2, ["fold_"], ["fold_finish_"] * 2]
    assert opt.stepped


def _explode(grad):
    raise RuntimeError("hook failed")


def test_a_backward_that_fails_midway_teaches_the_bucket_hooks_nothing(backend, monkeypatch):
    """One bucket: a gradient hook on the first layer raises after the later layers' gradients landed. That call's
    partial count must not become what the bucket waits for: the next backward folds the bucket once, when it is
    complete, and the result is exact."""
    model, reference = _model(), _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), 2, backend=backend)
    assert len(opt.buffers[0].bucket_ranges) == 1
    batches = _batches(3)
    handle = model[0].weight.register_hook(_explode)
    with pytest.raises(RuntimeError, match="hook failed"):
        opt.backward(_loss(model, batches[0]), weight=1.0)
    handle.remove()
    assert opt.micro_step == 0
    folds = _count_folds(monkeypatch)
    weights = [float(x.shape[0]) for x in batches[1:]]
    for x, w in zip(batches[1:], weights, strict=True):
        folds.clear()
        opt.backward(_loss(model, x), weight=w)
        assert len(folds) == 1  # the bucket folded once, complete
        opt.step()
    assert opt.stepped
    monkeypatch.undo()
    _step_time_run(reference, batches[1:], 2, weights, backend=backend)
    _assert_same(model, reference)


@pytest.mark.parametrize("steps", [1, 3])
def test_matches_the_step_time_loop_with_small_buckets(backend, steps):
    batches = _batches(2 * steps)
    weights = [float(x.shape[0]) for x in batches]
    model, reference = _model(), _model()
    _step_time_run(reference, batches, steps, weights, backend=backend)
    opt = GradAccumulator(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), steps, backend=backend, bucket_bytes=1
    )
    for x, w in zip(batches, weights, strict=True):
        opt.backward(_loss(model, x), weight=w)
        opt.step()
        opt.zero_grad()
    _assert_same(model, reference)


def test_a_bucket_no_gradient_reaches_in_a_windows_first_micro_batch_starts_from_zero(backend):
    """A parameter used in the first window but not in the second window's first micro-batch: its bucket is
    untouched by that backward, and step() must zero it (the window's first write), not add the next micro-batch
    onto the last window's values. One bucket per parameter; against a float64 truth."""
    model, truth = _model(), _model()
    extra = torch.nn.Parameter(torch.randn(WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(9)))
    truth_extra = extra.detach().clone()
    opt = GradAccumulator(torch.optim.SGD([*model.parameters(), extra], lr=0.1), 2, backend=backend, bucket_bytes=1)
    batches = _batches(4)
    uses_extra = [True, True, False, True]  # the second window's first micro-batch leaves it out

    def loss_of(net, spare, x, used):
        return _loss(net, x) + ((spare * x.sum(0)).sum() ** 2 if used else 0.0)

    for x, used in zip(batches, uses_extra, strict=True):
        opt.backward(loss_of(model, extra, x, used), weight=float(x.shape[0]))
        opt.step()
        opt.zero_grad()
    assert opt.stepped
    params = [*truth.parameters(), truth_extra.requires_grad_()]
    for window in (0, 1):
        pairs = list(zip(batches, uses_extra, strict=True))[2 * window : 2 * window + 2]
        weights = [float(x.shape[0]) for x, _ in pairs]
        loss = sum(w * loss_of(truth, truth_extra, x, used) for w, (x, used) in zip(weights, pairs, strict=True))
        grads = torch.autograd.grad(loss / sum(weights), params)
        with torch.no_grad():
            for param, grad in zip(params, grads, strict=True):
                param -= 0.1 * grad
    _assert_same(model, truth)
    torch.testing.assert_close(extra.detach(), truth_extra.detach(), rtol=1e-12, atol=1e-12)


def test_unused_parameter_leaves_its_bucket_incomplete_and_is_still_exact(backend):
    model = _model()
    spare = torch.nn.Parameter(torch.randn(WIDTH, dtype=torch.float64))
    model.register_parameter("spare", spare)  # in the first layer's bucket, never used
    reference = copy.deepcopy(model)
    batches = _batches(3)
    weights = [float(x.shape[0]) for x in batches]
    _step_time_run(reference, batches, 3, weights, backend=backend)
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), 3, backend=backend)
    for x, w in zip(batches, weights, strict=True):
        opt.backward(_loss(model, x), weight=w)
        assert all(p.grad is None for p in model.parameters())
        opt.step()
    assert spare.grad is None and opt.stepped
    _assert_same(model, reference)


@pytest.mark.parametrize("steps", [1, 2])
def test_several_backward_calls_in_one_micro_batch(backend, steps):
    """Two losses with retain_graph, folded one after the other, equal one backward of their sum, also on a
    window's last micro-batch (where the second backward adds to buckets already finished)."""
    batches = _batches(steps)
    model, reference = _model(), _model()
    ref_opt = GradAccumulator(torch.optim.SGD(reference.parameters(), lr=0.1), steps, backend=backend)
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), steps, backend=backend, bucket_bytes=1)
    for x in batches:
        out = reference(x)
        (out.square().mean() + out.abs().mean()).backward()
        ref_opt.step(weight=5)
        out = model(x)
        opt.backward(out.square().mean(), weight=5, retain_graph=True)
        opt.backward(out.abs().mean())  # the same micro-batch: its weight carries over
        opt.step()
    assert opt.stepped
    torch.testing.assert_close(opt.grad_norm, ref_opt.grad_norm, rtol=1e-12, atol=0)
    _assert_same(model, reference)


def test_a_plain_backward_before_opt_backward_joins_the_micro_batch(backend):
    batches = _batches(2)
    model, reference = _model(), _model()
    ref_opt = GradAccumulator(torch.optim.SGD(reference.parameters(), lr=0.1), 2, backend=backend)
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, backend=backend)
    for x in batches:
        (_loss(reference, x) * 2).backward()
        ref_opt.step(weight=3)
        _loss(model, x).backward()  # accumulates into p.grad; folded with the next backward's gradients
        opt.backward(_loss(model, x), weight=3)
        opt.step()
    _assert_same(model, reference)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_gradient_checkpointing(backend, reentrant):
    batches = _batches(2)
    model, reference = _model(), _model()
    weights = [float(x.shape[0]) for x in batches]
    _step_time_run(reference, batches, 2, weights, backend=backend)
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), 2, backend=backend, bucket_bytes=1)

    def checkpointed_loss(x):
        hidden = torch.utils.checkpoint.checkpoint(model[:4], x, use_reentrant=reentrant)
        return model[4:](hidden).square().mean()

    for x, w in zip(batches, weights, strict=True):
        opt.backward(checkpointed_loss(x.requires_grad_(reentrant)), weight=w)
        opt.step()
    _assert_same(model, reference)


def test_create_graph_folds_the_gradient_values(backend):
    batches = _batches(2)
    model, reference = _model(), _model()
    _step_time_run(reference, batches, 2, [1.0, 1.0], backend=backend)
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), 2, backend=backend)
    for x in batches:
        opt.backward(_loss(model, x), create_graph=True)
        opt.step()
    _assert_same(model, reference)


def test_weight_given_to_backward_and_step_is_refused_and_changes_nothing(backend):
    model = _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, backend=backend)
    x = _batches(1)[0]
    opt.backward(_loss(model, x), weight=2)
    before = opt.buffers[0].data.clone()
    with pytest.raises(ValueError, match="already given to backward"):
        opt.step(weight=2)
    assert opt.micro_step == 0 and torch.equal(opt.buffers[0].data, before)
    with pytest.raises(ValueError, match="weight was given as 2"):
        opt.backward(_loss(model, x), weight=3)
    opt.step()
    assert opt.micro_step == 1


def test_state_dict_and_flush_refuse_an_unfinished_micro_batch(backend):
    model = _model()
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 3, backend=backend)
    opt.backward(_loss(model, _batches(1)[0]))
    with pytest.raises(RuntimeError, match="call step"):
        opt.state_dict()
    with pytest.raises(RuntimeError, match="call step"):
        opt.flush()
    opt.step()
    assert opt.flush() is True


def test_grad_scaler_through_backward_matches_the_step_time_recipe(backend):
    batches = _batches(4)
    runs = []
    for loop in ("step", "backward"):
        model = _model()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
        opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, backend=backend, grad_scaler=scaler)
        for x in batches:
            if loop == "backward":
                opt.backward(_loss(model, x), weight=float(x.shape[0]))  # scales the loss itself
                opt.step()
            else:
                scaler.scale(_loss(model, x)).backward()
                opt.step(weight=float(x.shape[0]))
        runs.append((model, scaler.get_scale()))
    assert runs[0][1] == runs[1][1] == 2.0**12  # grew once per window
    _assert_same(runs[0][0], runs[1][0])
