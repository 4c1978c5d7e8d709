"""gafused.integrations.accelerate: Accelerate's accumulate() recipe against a float64 token-weighted big batch.

The recipes and the data are in tests/accelerate_cases.py: a tiny GPT-2 from a config, micro-batches of very uneven
token counts, Accelerator(gradient_accumulation_steps=4) over 10 micro-batches per process (windows 4, 4 and a partial
2 at the end of the dataloader), SGD and a LambdaLR scheduler prepared by Accelerate. One process runs here, in
pytest's; two gloo ranks (Accelerate's MULTI_CPU) run once in a subprocess.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import signal
import subprocess
import sys
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

import accelerate_cases as cases  # noqa: E402 - after the skips: it needs both

import gafused  # noqa: E402
import gafused.integrations.accelerate as gafused_accelerate  # noqa: E402

# |p - p_truth| / |p_truth - p0| of fp32 training against the float64 truth: float32 rounding of forward, backward and
# the sums over 3 windows (plain fp32 PyTorch on the same big batch lands inside it: the baseline test).
FP32_ERROR = 2e-5
GAFUSED_CASES = [name for name, case in cases.CASES.items() if case["recipe"] != "accelerate"]


@contextlib.contextmanager
def _one_thread():
    """A tiny model: torch's threads cost more than they give (and the two ranks run beside)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture
def fresh_accelerate():
    """Accelerate keeps its state in process-wide singletons: each in-process test starts and ends clean."""
    _reset_accelerate()
    yield
    _reset_accelerate()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict]]:
    """Every case: on 2 ranks in a subprocess and, meanwhile, on one process here (one torch thread each)."""
    out = tmp_path_factory.mktemp("accelerate") / "two.pt"
    script = Path(cases.__file__)
    ranks = subprocess.Popen(
        [sys.executable, str(script), str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=script.parent,
        start_new_session=True,  # its ranks in its process group: a run that hangs is killed whole
    )
    _reset_accelerate()
    try:
        with _one_thread():
            one = [cases.run_all()]
    finally:
        _reset_accelerate()
        try:
            _, stderr = ranks.communicate(timeout=300)  # about 20 s on a 2-core CPU machine
        except subprocess.TimeoutExpired:
            os.killpg(ranks.pid, signal.SIGKILL)
            _, stderr = ranks.communicate()
            pytest.fail(f"the 2-rank run did not end within 300 s; its stderr: {stderr[-4000:]}")
    assert ranks.returncode == 0, stderr[-4000:]
    return {1: one, 2: torch.load(out, weights_only=False)}


class _Truths(dict):
    """The float64 truth of (world, clip, data), computed when first asked for."""

    def __missing__(self, key: tuple[int, bool, str]) -> dict:
        with _one_thread():
            self[key] = cases.truth(*key)
        return self[key]


@pytest.fixture(scope="module")
def truths() -> _Truths:
    return _Truths()


def _truth(truths: _Truths, world: int, name: str) -> dict:
    case = cases.CASES[name]
    return truths[world, case["clip"], case.get("data", cases.MAIN)]


def _result(runs: dict[int, list[dict]], world: int, name: str, rank: int = 0) -> dict:
    result = runs[world][rank][name]
    assert "error" not in result, f"{name} on {world} process(es), rank {rank}: {result['error']}"
    return result


@pytest.mark.parametrize("world", [1, 2])
def test_plain_fp32_baseline_is_within_the_bound(truths: _Truths, world: int) -> None:
    baseline = cases.error(
        cases.truth(world, True, cases.MAIN, torch.float32)["params"], truths[world, True, cases.MAIN]
    )
    assert 0 < baseline < FP32_ERROR


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("name", GAFUSED_CASES)
def test_matches_float64_big_batch(runs: dict, truths: _Truths, world: int, name: str) -> None:
    """Token weights, a partial last window, clipping by the global norm, one scheduler step per window."""
    clip = cases.CASES[name]["clip"]
    truth = _truth(truths, world, name)
    for rank in range(world):
        result = _result(runs, world, name, rank)
        assert cases.error(result["params"], truth) < FP32_ERROR
        assert result["norms"] == pytest.approx(truth["norms"], rel=1e-5)
        assert result["lrs"] == truth["lrs"]  # the scheduler moved once per window, as Accelerate steps it
        assert result["micro_step"] == 0  # the partial window at the end of the dataloader was finished
    if clip:  # every window's norm is above the threshold: clipping was exercised
        assert min(truth["norms"]) > cases.MAX_NORM


ACCELERATE_CASES = [name for name, case in cases.CASES.items() if case["recipe"] == "accelerate"]


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("name", ACCELERATE_CASES)
def test_accelerates_own_accumulation(runs: dict, truths: _Truths, world: int, name: str) -> None:
    """Accelerate's recipe on the same data: exact where its assumptions hold (equal tokens, full windows: the truth
    and the data assignment are right), far off with uneven tokens or a partial window (per-micro-batch means, the
    partial window divided by 4 too): the gafused cases' agreement is not an accident of the data."""
    result = _result(runs, world, name)
    error = cases.error(result["params"], _truth(truths, world, name))
    if name == "accelerate/even":
        assert error < FP32_ERROR
    else:
        assert error > 0.05
    assert result["lrs"] == _truth(truths, world, name)["lrs"]  # same schedule: the difference is the gradient


@pytest.mark.parametrize("world", [1, 2])
def test_micro_batches_are_the_ones_the_truth_uses(runs: dict, world: int) -> None:
    for rank in range(world):
        for name, case in cases.CASES.items():
            batches = cases.DATA[case.get("data", cases.MAIN)][1]
            expected = [cases.global_batch(world, rank, micro) for micro in range(batches)]
            assert _result(runs, world, name, rank)["seen"] == expected


def _same_tensors(first: list[torch.Tensor], second: list[torch.Tensor]) -> None:
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def _same_run(first: dict, second: dict) -> None:
    """Two runs end bitwise alike: the same norm at every window and the same parameters."""
    assert first["norms"] == second["norms"]
    _same_tensors(first["params"], second["params"])


@pytest.mark.parametrize("name", list(cases.CASES))
def test_ranks_agree_bitwise(runs: dict, name: str) -> None:
    _same_run(_result(runs, 2, name, 0), _result(runs, 2, name, 1))


@pytest.mark.parametrize("world", [1, 2])
def test_save_state_mid_window_resumes_bitwise(runs: dict, world: int) -> None:
    """save_state after the first micro-batch of window 1, everything built anew, load_state, skip_first_batches."""
    assert cases.CHECKPOINT_AFTER % cases.GA != 0  # mid-window
    for rank in range(world):
        resumed = _result(runs, world, f"gafused-checkpoint-clip/{cases.MAIN}", rank)
        _same_run(resumed, _result(runs, world, f"gafused-clip/{cases.MAIN}", rank))


@pytest.mark.parametrize("world", [1, 2])
def test_trigger_sync_in_backward_leaves_the_sync_to_gafused(runs: dict, world: int) -> None:
    """accelerator.trigger_sync_in_backward(model) around every backward: under DDP it switched DDP's own all-reduce
    on for that backward, and DDP's averaged gradients were folded on top of gafused's sum (the bias came out twice
    plain Accelerate's update). With gafused it does nothing: its one reduction per window is already plain
    Accelerate's result with the trigger, and the run equals the one without it, bitwise."""
    for rank in range(world):
        triggered = _result(runs, world, f"gafused-trigger-clip/{cases.MAIN}", rank)
        _same_run(triggered, _result(runs, world, f"gafused-clip/{cases.MAIN}", rank))


@pytest.mark.parametrize("world", [1, 2])
def test_a_loop_without_accumulate_is_refused_on_every_process(runs: dict, world: int) -> None:
    """Accelerator(gradient_accumulation_steps=4), backward every micro-batch, step every 4th, no accumulate(): the
    first accelerator.backward is refused on every process, naming the recipe, before anything changed (under DDP
    it used to fail at the second backward, after the first had launched its reductions), and the accumulate()
    recipe run next on the same objects ends bitwise where a fresh one does."""
    for rank in range(world):
        result = _result(runs, world, "refusal/without-accumulate", rank)
        assert result["refusal"] is not None
        assert "no accelerator.accumulate(model) block was entered" in result["refusal"]
        assert f"gradient_accumulation_steps is {cases.GA}" in result["refusal"]
        assert result["after"] == {"micro_step": 0, "grads": [False, False]}
        _same_tensors(result["then"], result["fresh"])


def test_trigger_called_on_the_class_is_refused_under_ddp(runs: dict) -> None:
    """``Accelerator.trigger_sync_in_backward(model)`` (not through the accelerator) turns DDP's all-reduce on behind
    the adapter: a backward inside it whose forward ran before it is refused on every rank before it runs. One process
    has no DDP to trigger."""
    for rank in range(2):
        result = _result(runs, 2, "refusal/trigger-on-the-class", rank)
        assert result["refusal"] is not None and "trigger_sync_in_backward" in result["refusal"]
        assert result["micro_step"] == 0 and result["sync"] is False
    one = _result(runs, 1, "refusal/trigger-on-the-class")
    assert one["refusal"] is None and one["sync"] is False


def test_a_checkpoint_without_its_window_files_is_refused_on_every_process(runs: dict) -> None:
    """Under DDP optimizer.bin holds rank 0's part of an open window only: with the window files gone, every rank
    refuses it rather than resume rank 0's part everywhere. On one process optimizer.bin is the whole window."""
    for rank in range(2):
        result = _result(runs, 2, "refusal/checkpoint-without-window-files", rank)
        assert result["refusal"] is not None and "open window of one process only" in result["refusal"]
        assert result["micro_step"] == 0
    one = _result(runs, 1, "refusal/checkpoint-without-window-files")
    assert one["refusal"] is None and one["micro_step"] == 1


# --- in-process checks, one process ----------------------------------------------------------------------------------


def _initial_state(accelerator, model) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """A copy of the model's parameters before training, for the reference windows."""
    return {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}


def _prepared(clip: float | None = None, steps: int = 2, batches: int = 5):
    from accelerate import Accelerator

    accelerator = Accelerator(gradient_accumulation_steps=steps, cpu=True)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    data = [torch.randn(4, 3, generator=torch.Generator().manual_seed(i)) for i in range(batches)]
    loader = torch.utils.data.DataLoader(data, batch_size=None)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    return accelerator, model, optimizer, loader, scheduler


def test_prepare_refuses_bad_input(fresh_accelerate) -> None:
    accelerator, model, optimizer, _, _ = _prepared()
    with pytest.raises(TypeError, match="accelerator must be"):
        gafused_accelerate.prepare(object(), model, optimizer)
    with pytest.raises(TypeError, match="optimizer must be the optimizer returned by accelerator.prepare"):
        gafused_accelerate.prepare(accelerator, model, optimizer.optimizer)
    with pytest.raises(TypeError, match="model must be the model returned by accelerator.prepare"):
        gafused_accelerate.prepare(accelerator, torch.nn.Linear(3, 2), optimizer)
    with pytest.raises(TypeError, match="accumulation_steps"):  # the window is Accelerate's: no second count
        gafused_accelerate.prepare(accelerator, model, optimizer, accumulation_steps=4)
    with pytest.raises(ValueError, match="max_grad_norm"):
        gafused_accelerate.prepare(accelerator, model, optimizer, max_grad_norm=-1.0)
    # A refused call changed nothing: the accelerator still holds Accelerate's optimizer and its own methods.
    assert accelerator._optimizers == [optimizer]
    assert "backward" not in vars(accelerator)
    prepared = gafused_accelerate.prepare(accelerator, model, optimizer)
    assert accelerator._optimizers == [prepared]
    assert accelerator._schedulers[0].optimizers == [prepared]
    with pytest.raises(RuntimeError, match=r"already called on it; .* call accelerator.free_memory\(\) first"):
        gafused_accelerate.prepare(accelerator, model, optimizer)


def test_a_prepared_optimizer_refuses_a_new_group_and_a_second_prepare(fresh_accelerate) -> None:
    """add_param_group() on the prepared optimizer is the accumulator's refusal (its buffers are laid out for the
    parameters it was built with), and the inner optimizer keeps its groups; once free_memory() let the accelerator
    be prepared again, the optimizer prepare() returned is refused as already prepared, not wrapped twice."""
    accelerator, model, optimizer, _, _ = _prepared()
    prepared = gafused_accelerate.prepare(accelerator, model, optimizer)
    with pytest.raises(RuntimeError, match=r"add_param_group\(\): .*build a new GradAccumulator"):
        prepared.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    assert len(optimizer.optimizer.param_groups) == 1
    accelerator.free_memory()
    with pytest.raises(RuntimeError, match=r"optimizer: already prepared by gafused.integrations.accelerate.prepare"):
        gafused_accelerate.prepare(accelerator, model, prepared)


def test_the_optimizer_prepare_replaced_refuses_step_and_zero_grad(fresh_accelerate) -> None:
    """A loop that dropped prepare()'s return value and kept Accelerate's optimizer would bypass gafused: that
    optimizer's step() and zero_grad() raise, naming the fix, and change nothing; free_memory() gives them back."""
    accelerator, model, optimizer, loader, _ = _prepared(steps=2, batches=2)
    prepared = gafused_accelerate.prepare(accelerator, model, optimizer)
    with accelerator.accumulate(model):
        accelerator.backward(model(next(iter(loader))).square().mean())
        for call in ("step", "zero_grad"):
            with pytest.raises(RuntimeError, match=rf"optimizer\.{call}\(\): this optimizer was replaced.*use the opt"):
                getattr(optimizer, call)()
        assert prepared.accumulator._micro is not None  # the micro-batch is still open: prepared.step() ends it
        prepared.step()
    assert prepared.micro_step == 1
    accelerator.free_memory()
    assert "step" not in vars(optimizer) and "zero_grad" not in vars(optimizer)


def test_prepare_refuses_what_it_does_not_support(fresh_accelerate, monkeypatch: pytest.MonkeyPatch) -> None:
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    accelerator, model, optimizer, _, _ = _prepared()
    second = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(NotImplementedError, match="2 optimizers"):
        gafused_accelerate.prepare(accelerator, model, optimizer)
    accelerator._optimizers.remove(second)
    for kind in (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.XLA, DistributedType.MEGATRON_LM):
        monkeypatch.setattr(Accelerator, "distributed_type", property(lambda self, kind=kind: kind))
        with pytest.raises(NotImplementedError, match=str(kind.value)):
            gafused_accelerate.prepare(accelerator, model, optimizer)
    assert accelerator._optimizers == [optimizer] and "backward" not in vars(accelerator)


def test_prepare_refuses_an_accelerate_without_what_it_relies_on(
    fresh_accelerate, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The adapter points Accelerate's schedulers at its optimizer and counts blocks in _do_sync: an Accelerate
    without either is refused up front (a scheduler left on the old optimizer would step after a skipped window)."""
    from accelerate import Accelerator

    accelerator, model, optimizer, _, scheduler = _prepared()
    optimizers = scheduler.optimizers
    del scheduler.optimizers
    with pytest.raises(RuntimeError, match="has no AcceleratedScheduler.optimizers"):
        gafused_accelerate.prepare(accelerator, model, optimizer)
    scheduler.optimizers = optimizers
    monkeypatch.delattr(Accelerator, "_do_sync")
    with pytest.raises(RuntimeError, match=r"has no Accelerator\._do_sync"):
        gafused_accelerate.prepare(accelerator, model, optimizer)
    assert accelerator._optimizers == [optimizer] and "backward" not in vars(accelerator)


def test_prepare_refuses_an_accumulator_inside_accelerates_optimizer(fresh_accelerate) -> None:
    """The recipe the issue started from: a GradAccumulator handed to accelerator.prepare() itself."""
    from accelerate import Accelerator

    accelerator = Accelerator(gradient_accumulation_steps=2, cpu=True)
    model = torch.nn.Linear(3, 2)
    accumulator = gafused.GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    model, optimizer = accelerator.prepare(model, accumulator)
    with pytest.raises(TypeError, match="was given a GradAccumulator"):
        gafused_accelerate.prepare(accelerator, model, optimizer)


@pytest.mark.parametrize("max_grad_norm", [None, 1.0])
@pytest.mark.parametrize("method", ["clip_grad_norm_", "clip_grad_value_"])
def test_accelerates_clipping_is_refused(fresh_accelerate, max_grad_norm: float | None, method: str) -> None:
    accelerator, model, optimizer, loader, _ = _prepared()
    optimizer = gafused_accelerate.prepare(accelerator, model, optimizer, max_grad_norm=max_grad_norm)
    batch = next(iter(loader))
    with accelerator.accumulate(model):
        accelerator.backward(model(batch).square().mean(), weight=4)
        expected = "already clips to max_grad_norm=1.0" if max_grad_norm else "pass max_grad_norm="
        with pytest.raises(RuntimeError, match=expected):
            getattr(accelerator, method)(model.parameters(), 0.5)
        optimizer.step()  # the refusal changed nothing: the micro-batch ends as usual
    assert optimizer.micro_step == 1
    other = torch.nn.Parameter(torch.ones(2))  # not gafused's: Accelerate clips it as before
    other.grad = torch.full((2,), 3.0)
    accelerator.clip_grad_norm_([other], 1.0)
    assert other.grad.norm().item() == pytest.approx(1.0, rel=1e-5)


def test_backward_refuses_unknown_arguments(fresh_accelerate) -> None:
    accelerator, model, optimizer, loader, _ = _prepared()
    optimizer = gafused_accelerate.prepare(accelerator, model, optimizer)
    batch = next(iter(loader))
    with accelerator.accumulate(model), pytest.raises(TypeError, match="learning_rate"):
        accelerator.backward(model(batch).square().mean(), learning_rate=0.1)
    assert optimizer.micro_step == 0 and all(p.grad is None for p in model.parameters())


def _reference_windows(
    initial: dict[str, torch.Tensor], batches: list[torch.Tensor], windows: list[list[int]], lrs: list[float]
) -> torch.nn.Linear:
    """Plain float64 PyTorch: one SGD step per window, at its learning rate, on the weighted mean of its micro-batches'
    losses (micro-batch ``i`` weighs ``1 + i``)."""
    reference = torch.nn.Linear(3, 2).double()
    reference.load_state_dict(initial)
    for window, lr in zip(windows, lrs, strict=True):
        reference.zero_grad()
        weights = [1.0 + i for i in window]
        total = sum(w * reference(batches[i].double()).square().mean() for w, i in zip(weights, window, strict=True))
        (total / sum(weights)).backward()
        with torch.no_grad():
            for p in reference.parameters():
                p -= lr * p.grad
    return reference


def _assert_matches(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    for p, r in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.allclose(p.double(), r, rtol=1e-6, atol=1e-7)  # fp32 rounding of a 3x2 linear model


def _micro_batch(accelerator, model, optimizer, batch: torch.Tensor, index: int, loop: str) -> None:
    """One micro-batch's backward and step, through ``accelerator.backward`` or ``loss.backward()``."""
    loss = model(batch).square().mean()
    if loop == "accelerator.backward":
        accelerator.backward(loss, weight=1.0 + index)
        optimizer.step()
    else:
        loss.backward()
        optimizer.step(weight=1.0 + index)


def _train_windows(accelerator, model, optimizer, loader, scheduler) -> tuple[list[torch.Tensor], list[bool]]:
    """Every batch of ``loader`` as a micro-batch of weight 1 + index; the batches (for the reference) and, per
    batch, whether the optimizer stepped."""
    stepped, batches = [], list(loader)
    for index, batch in enumerate(loader):
        with accelerator.accumulate(model):
            accelerator.backward(model(batch).square().mean(), weight=1.0 + index)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        stepped.append(optimizer.stepped)
    return batches, stepped


def test_windows_follow_sync_gradients(fresh_accelerate) -> None:
    """gradient_accumulation_steps=2 over 5 batches: inner steps after micro-batches 2, 4 and 5 (end of the data),
    each on the weighted mean of its window, and the scheduler steps once per window."""
    accelerator, model, optimizer, loader, scheduler = _prepared(steps=2, batches=5)
    optimizer = gafused_accelerate.prepare(accelerator, model, optimizer)
    initial = _initial_state(accelerator, model)
    batches, stepped = _train_windows(accelerator, model, optimizer, loader, scheduler)
    assert stepped == [False, True, False, True, True]
    assert scheduler.scheduler.last_epoch == 3
    reference = _reference_windows(initial, batches, [[0, 1], [2, 3], [4]], [0.1 / (1 + w) for w in range(3)])
    _assert_matches(accelerator.unwrap_model(model), reference)


def test_a_model_compiled_by_accelerate_is_accepted_and_trains_exactly(fresh_accelerate) -> None:
    """Accelerator(dynamo_backend=...) returns the compiled wrapper and records the module inside it."""
    from accelerate import Accelerator

    accelerator = Accelerator(gradient_accumulation_steps=2, cpu=True, dynamo_backend="eager")
    module = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    data = [torch.randn(4, 3, generator=torch.Generator().manual_seed(i)) for i in range(5)]
    loader = torch.utils.data.DataLoader(data, batch_size=None)
    model, optimizer, loader, scheduler = accelerator.prepare(module, optimizer, loader, scheduler)
    assert isinstance(model, torch._dynamo.eval_frame.OptimizedModule)
    optimizer = gafused_accelerate.prepare(accelerator, model, optimizer)
    initial = {k: v.clone() for k, v in module.state_dict().items()}
    batches, _ = _train_windows(accelerator, model, optimizer, loader, scheduler)
    reference = _reference_windows(initial, batches, [[0, 1], [2, 3], [4]], [0.1 / (1 + w) for w in range(3)])
    _assert_matches(module, reference)


def test_free_memory_gives_the_accelerator_back_for_a_new_run(fresh_accelerate) -> None:
    """free_memory() (and clear()) forgets the prepared optimizer: gafused's routing goes with it, so a sweep can
    prepare the next run on the same Accelerator, with gafused or plain."""
    accelerator, model, optimizer, loader, scheduler = _prepared(steps=2, batches=2)
    originals = dict(vars(accelerator))
    optimizer = gafused_accelerate.prepare(accelerator, model, optimizer)
    _train_windows(accelerator, model, optimizer, loader, scheduler)
    accelerator.free_memory()
    assert {name for name in vars(accelerator) if vars(accelerator)[name] is not originals.get(name)} <= {
        "_optimizers", "_models", "_schedulers", "_dataloaders", "deepspeed_engine_wrapped", "step",
    }  # fmt: skip
    for run in ("gafused", "plain"):
        module = torch.nn.Linear(3, 2)
        optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        data = [torch.randn(4, 3, generator=torch.Generator().manual_seed(10 + i)) for i in range(4)]
        loader = torch.utils.data.DataLoader(data, batch_size=None)
        model, optimizer, loader, scheduler = accelerator.prepare(module, optimizer, loader, scheduler)
        initial = _initial_state(accelerator, model)
        if run == "gafused":
            optimizer = gafused_accelerate.prepare(accelerator, model, optimizer)
            batches, _ = _train_windows(accelerator, model, optimizer, loader, scheduler)
            windows = [[0, 1], [2, 3]]
            reference = _reference_windows(initial, batches, windows, [0.1 / (1 + w) for w in range(2)])
            _assert_matches(module, reference)
        else:  # Accelerate's own accumulation: the loss divided by gradient_accumulation_steps, no weight
            for batch in loader:
                with accelerator.accumulate(model):
                    accelerator.backward(model(batch).square().mean())
                    optimizer.step()
                    optimizer.zero_grad()
            assert optimizer.step_was_skipped is False
        accelerator.clear()


@pytest.mark.parametrize("loop", ["accelerator.backward", "loss.backward"])
def test_training_goes_on_after_a_failed_step(fresh_accelerate, loop: str) -> None:
    """The inner optimizer raises at the second window's sync step: gafused discards that window and the error
    reaches the loop, which goes on with the next batch; the next window folds and steps as plain PyTorch does."""
    accelerator, model, optimizer, loader, scheduler = _prepared(steps=2, batches=6)
    calls = []

    def fail_once(inner: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        calls.append(len(calls))
        if len(calls) == 2:
            raise RuntimeError("inner step failed")

    optimizer.optimizer.register_step_pre_hook(fail_once)
    optimizer = gafused_accelerate.prepare(accelerator, model, optimizer)
    initial = _initial_state(accelerator, model)
    stepped, failed, batches = [], [], list(loader)
    for index, batch in enumerate(loader):
        with accelerator.accumulate(model):
            try:
                _micro_batch(accelerator, model, optimizer, batch, index, loop)
            except RuntimeError as error:
                assert "inner step failed" in str(error)
                failed.append((index, optimizer.micro_step))
                continue  # neither the scheduler nor zero_grad for the failed window
            scheduler.step()
            optimizer.zero_grad()
            stepped.append(optimizer.stepped)
    assert failed == [(3, 0)]  # the second window's sync step; its window was discarded
    assert stepped == [False, True, False, False, True]
    assert optimizer.micro_step == 0 and scheduler.scheduler.last_epoch == 2
    reference = _reference_windows(initial, batches, [[0, 1], [4, 5]], [0.1, 0.1 / 2])
    _assert_matches(accelerator.unwrap_model(model), reference)


@pytest.mark.parametrize("zero_grad", [True, False])
@pytest.mark.parametrize("loop", ["accelerator.backward", "loss.backward"])
@pytest.mark.parametrize("empty", [2, 3])
def test_a_block_without_backward_changes_nothing(fresh_accelerate, loop: str, empty: int, zero_grad: bool) -> None:
    """An accumulate() block that runs no backward and no step (a batch the loop skips) adds nothing: at a sync step
    (micro-batch 3) the window goes on to the next one, as Accelerate's own p.grad does; every later window folds
    and steps as plain PyTorch does. Without zero_grad(), the finished gradient the inner step was handed is still
    in p.grad after the sync step: it is not a gradient waiting for a step()."""
    accelerator, model, optimizer, loader, scheduler = _prepared(steps=2, batches=6)
    optimizer = gafused_accelerate.prepare(accelerator, model, optimizer)
    initial = _initial_state(accelerator, model)
    batches = list(loader)
    windows, window = [], []
    for index, batch in enumerate(loader):
        with accelerator.accumulate(model):
            if index == empty:
                continue
            _micro_batch(accelerator, model, optimizer, batch, index, loop)
            scheduler.step()
            if zero_grad:
                optimizer.zero_grad()
        window.append(index)
        if optimizer.stepped:
            windows.append(window)
            window = []
    expected = [[0, 1], [3], [4, 5]] if empty == 2 else [[0, 1], [2, 4, 5]]
    assert windows == expected and window == [] and optimizer.micro_step == 0
    assert scheduler.scheduler.last_epoch == len(expected)
    reference = _reference_windows(initial, batches, expected, [0.1 / (1 + w) for w in range(len(expected))])
    _assert_matches(accelerator.unwrap_model(model), reference)


@pytest.mark.parametrize("weight", [None, 0.0])
def test_a_block_that_steps_without_backward_is_a_micro_batch_without_gradients(fresh_accelerate, weight) -> None:
    """optimizer.step() in a block that ran no backward ends a micro-batch with no gradients: of weight 1 by
    default, so it counts in the window's mean (micro-batches 0 and 2 weigh 1 and 3: their mean times 4 / 5, the
    same step as the mean at 4 / 5 of the learning rate), and left out with weight=0."""
    accelerator, model, optimizer, loader, _ = _prepared(steps=3, batches=3)
    optimizer = gafused_accelerate.prepare(accelerator, model, optimizer)
    initial = _initial_state(accelerator, model)
    batches = list(loader)
    for index, batch in enumerate(loader):
        with accelerator.accumulate(model):
            if index == 1:
                optimizer.step() if weight is None else optimizer.step(weight=weight)
            else:
                _micro_batch(accelerator, model, optimizer, batch, index, "accelerator.backward")
            optimizer.zero_grad()
    assert optimizer.stepped and optimizer.micro_step == 0
    lr = 0.1 * 4 / 5 if weight is None else 0.1
    _assert_matches(accelerator.unwrap_model(model), _reference_windows(initial, batches, [[0, 2]], [lr]))


def test_another_accumulators_finished_gradients_are_not_waiting_for_a_step(fresh_accelerate) -> None:
    """A second accumulator over the same model stepped and left its finished gradients as p.grad: a block that
    runs no backward still settles (they are not gradients a step() must end), and the loop goes on."""
    accelerator, model, optimizer, loader, _ = _prepared(steps=2, batches=2)
    optimizer = gafused_accelerate.prepare(accelerator, model, optimizer)
    other = gafused.GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 1)
    model(torch.randn(2, 3)).square().mean().backward()
    other.step()
    assert all(p.grad is not None for p in model.parameters())
    with accelerator.accumulate(model):
        pass  # a skipped batch
    with accelerator.accumulate(model):
        accelerator.backward(model(torch.randn(2, 3)).square().mean(), weight=2.0)
        optimizer.step()
    assert optimizer.stepped  # the second block is Accelerate's sync step: a window of one micro-batch


def test_a_refused_step_changes_nothing(fresh_accelerate) -> None:
    """A step() refused for its weight leaves the micro-batch's gradients where they were: the loop may drop them
    (zero_grad) and go on, and the next windows fold and step as plain PyTorch does without that micro-batch."""
    accelerator, model, optimizer, loader, scheduler = _prepared(steps=2, batches=6)
    optimizer = gafused_accelerate.prepare(accelerator, model, optimizer)
    initial = _initial_state(accelerator, model)
    batches = list(loader)
    for index, batch in enumerate(loader):
        with accelerator.accumulate(model):
            model(batch).square().mean().backward()
            if index == 2:
                grads = [p.grad.clone() for p in model.parameters()]
                with pytest.raises(ValueError, match="weight"):
                    optimizer.step(weight=-1.0)
                assert optimizer.micro_step == 0
                assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
                optimizer.zero_grad()  # the loop drops this micro-batch
                continue
            optimizer.step(weight=1.0 + index)
            scheduler.step()
            optimizer.zero_grad()
    assert optimizer.micro_step == 0 and scheduler.scheduler.last_epoch == 3
    reference = _reference_windows(initial, batches, [[0, 1], [3], [4, 5]], [0.1, 0.1 / 2, 0.1 / 3])
    _assert_matches(accelerator.unwrap_model(model), reference)


@pytest.mark.parametrize("loop", ["accelerator.backward", "loss.backward"])
def test_a_second_step_in_one_block_is_refused(fresh_accelerate, loop: str) -> None:
    """A second optimizer.step() in one accumulate() block, with no backward since the first, would end a
    micro-batch without gradients: at the sync step a window of its own, the inner optimizer stepping again on a
    zero gradient. It is refused in every block and changes nothing: the windows step as plain PyTorch does."""
    accelerator, model, optimizer, loader, scheduler = _prepared(steps=2, batches=4)
    inner_steps = []
    optimizer.optimizer.register_step_post_hook(lambda *_: inner_steps.append(1))
    optimizer = gafused_accelerate.prepare(accelerator, model, optimizer)
    initial = _initial_state(accelerator, model)
    batches = list(loader)
    for index, batch in enumerate(loader):
        with accelerator.accumulate(model):
            _micro_batch(accelerator, model, optimizer, batch, index, loop)
            before = (len(inner_steps), optimizer.micro_step, optimizer.stepped, optimizer.step_was_skipped)
            with pytest.raises(RuntimeError, match=r"already ended by an earlier optimizer\.step\(\)"):
                optimizer.step()
            assert (len(inner_steps), optimizer.micro_step, optimizer.stepped, optimizer.step_was_skipped) == before
            scheduler.step()
            optimizer.zero_grad()
    assert len(inner_steps) == 2 and scheduler.scheduler.last_epoch == 2
    reference = _reference_windows(initial, batches, [[0, 1], [2, 3]], [0.1, 0.1 / 2])
    _assert_matches(accelerator.unwrap_model(model), reference)


_OUTSIDE = r"no accelerator\.accumulate\(model\) block was entered since the last optimizer\.step\(\)"


@pytest.mark.parametrize("where", ["before any block", "after the block's step"])
def test_backward_without_an_accumulate_block_is_refused(fresh_accelerate, where: str) -> None:
    """gradient_accumulation_steps=2: plain Accelerate divides every loss by 2, also outside accumulate(), where
    gafused would fold every backward until step() into one undivided micro-batch (an update 2x plain Accelerate's).
    A backward with no accumulate() block entered since the last step() is refused before it runs: the recipe goes
    on as if it had not been made."""
    accelerator, model, optimizer, loader, scheduler = _prepared(steps=2, batches=4)
    optimizer = gafused_accelerate.prepare(accelerator, model, optimizer)
    initial = _initial_state(accelerator, model)
    batches = list(loader)
    refused = _OUTSIDE + r".*gradient_accumulation_steps is 2: plain Accelerate divides each loss by 2"
    for index, batch in enumerate(loader):
        if where == "before any block" and index == 0:
            with pytest.raises(RuntimeError, match=refused):
                accelerator.backward(model(batch).square().mean(), weight=1.0)
            assert optimizer.micro_step == 0 and optimizer.accumulator._micro is None
            assert all(p.grad is None for p in model.parameters())
        with accelerator.accumulate(model):
            _micro_batch(accelerator, model, optimizer, batch, index, "accelerator.backward")
            if where == "after the block's step" and index == 2:
                with pytest.raises(RuntimeError, match=refused):
                    accelerator.backward(model(batch).square().mean())  # a second micro-batch in one block
                assert optimizer.micro_step == 1 and optimizer.accumulator._micro is None
            scheduler.step()
            optimizer.zero_grad()
    reference = _reference_windows(initial, batches, [[0, 1], [2, 3]], [0.1, 0.1 / 2])
    _assert_matches(accelerator.unwrap_model(model), reference)


def test_backward_and_step_after_the_blocks_exit_belong_to_its_micro_batch(fresh_accelerate) -> None:
    """The forward in the accumulate() block, backward and step() after it: each block's micro-batch is still told
    apart (no block was refused), as plain Accelerate's flag, set by the block, still holds after it."""
    accelerator, model, optimizer, loader, scheduler = _prepared(steps=2, batches=4)
    optimizer = gafused_accelerate.prepare(accelerator, model, optimizer)
    initial = _initial_state(accelerator, model)
    batches = list(loader)
    for index, batch in enumerate(loader):
        with accelerator.accumulate(model):
            loss = model(batch).square().mean()
        accelerator.backward(loss, weight=1.0 + index)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    reference = _reference_windows(initial, batches, [[0, 1], [2, 3]], [0.1, 0.1 / 2])
    _assert_matches(accelerator.unwrap_model(model), reference)


@pytest.mark.parametrize("loop", ["accelerator.backward", "loss.backward"])
def test_sync_gradients_set_false_outside_accumulate_is_refused(fresh_accelerate, loop: str) -> None:
    """A loop that drives accelerator.sync_gradients by hand, without accumulate(): at False plain Accelerate's
    step() does not step and the gradients go on summing, where gafused would end a micro-batch and average the
    micro-batches. backward and step() are refused there, changing nothing."""
    accelerator, model, optimizer, loader, _ = _prepared(steps=1, batches=2)
    optimizer = gafused_accelerate.prepare(accelerator, model, optimizer)
    accelerator.sync_gradients = False
    loss = model(next(iter(loader))).square().mean()
    refused = _OUTSIDE + r", and accelerator\.sync_gradients is False"
    if loop == "accelerator.backward":
        with pytest.raises(RuntimeError, match=refused):
            accelerator.backward(loss)
        assert all(p.grad is None for p in model.parameters())
    else:
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        with pytest.raises(RuntimeError, match=refused):
            optimizer.step(weight=2.0)
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    assert optimizer.micro_step == 0 and optimizer.accumulator._micro is None


@pytest.mark.parametrize(
    "loop, steps", [("accelerator.backward", 1), ("loss.backward", 4)], ids=["accelerator.backward", "loss.backward"]
)
def test_a_loop_without_accumulate_that_is_accepted_steps_as_plain_accelerate(
    fresh_accelerate, loop: str, steps: int
) -> None:
    """Outside accumulate(), where nothing is refused, each step() is a window of its own: the sum of every gradient
    since the last step(), plain Accelerate's update (its backward divides by gradient_accumulation_steps, 1 here;
    loss.backward() divides by nothing, whatever gradient_accumulation_steps is). Two backward calls per step()."""

    def train(with_gafused: bool) -> list[torch.Tensor]:
        _reset_accelerate()
        torch.manual_seed(0)
        accelerator, model, optimizer, loader, _ = _prepared(steps=steps, batches=4)
        if with_gafused:
            optimizer = gafused_accelerate.prepare(accelerator, model, optimizer)
        for index, batch in enumerate(loader):
            loss = model(batch).square().mean()
            accelerator.backward(loss) if loop == "accelerator.backward" else loss.backward()
            if index % 2 == 1:
                optimizer.step()
                optimizer.zero_grad()
        return [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]

    _same_tensors(train(False), train(True))


@pytest.mark.parametrize("loop", ["accelerator.backward", "loss.backward"])
def test_stepping_only_at_the_sync_step_is_refused(fresh_accelerate, loop: str) -> None:
    """Plain Accelerate's `if accelerator.sync_gradients: optimizer.step()` would fold a window's micro-batches as one
    (summed, not averaged): the micro-batch after a block that ended without step() is refused, naming the fix."""
    accelerator, model, optimizer, loader, _ = _prepared(steps=4, batches=4)
    optimizer = gafused_accelerate.prepare(accelerator, model, optimizer)
    batches = iter(loader)
    with accelerator.accumulate(model):
        loss = model(next(batches)).square().mean()
        accelerator.backward(loss, weight=2) if loop == "accelerator.backward" else loss.backward()
        assert not accelerator.sync_gradients  # plain Accelerate's loop would not step here
    with accelerator.accumulate(model), pytest.raises(RuntimeError, match="in every accelerator.accumulate"):
        loss = model(next(batches)).square().mean()
        if loop == "accelerator.backward":
            accelerator.backward(loss, weight=3)
        else:
            loss.backward()
            optimizer.step(weight=3)
    assert optimizer.micro_step == 0 and not optimizer.stepped


def test_every_block_with_its_step_is_accepted_across_epochs(fresh_accelerate) -> None:
    """The counted blocks do not refuse the README loop: two epochs whose windows end at the dataloader's end."""
    accelerator, model, optimizer, loader, _ = _prepared(steps=2, batches=3)
    optimizer = gafused_accelerate.prepare(accelerator, model, optimizer)
    stepped = []
    for _ in range(2):
        for batch in loader:
            with accelerator.accumulate(model):
                accelerator.backward(model(batch).square().mean(), weight=4)
                optimizer.step()
                optimizer.zero_grad()
            stepped.append(optimizer.stepped)
    assert stepped == [False, True, True] * 2


def test_skipped_window_does_not_step_the_scheduler(fresh_accelerate) -> None:
    accelerator, model, optimizer, loader, scheduler = _prepared(steps=2, batches=4)
    optimizer = gafused_accelerate.prepare(accelerator, model, optimizer)
    for index, batch in enumerate(loader):
        with accelerator.accumulate(model):
            loss = model(batch).square().mean() * (math.inf if index == 1 else 1.0)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if index == 1:
            assert optimizer.step_was_skipped and accelerator.optimizer_step_was_skipped
    assert optimizer.skipped_steps == 1
    assert scheduler.scheduler.last_epoch == 1  # the second window only


def test_a_step_inside_a_window_is_no_skipped_step(fresh_accelerate) -> None:
    """``accelerator.optimizer_step_was_skipped`` (which Accelerate's scheduler wrapper reads too) is False after a
    micro-batch's step inside a window, as with plain Accelerate: the step folded, and only a window's end steps."""
    accelerator, model, optimizer, loader, _ = _prepared(steps=2, batches=4)
    optimizer = gafused_accelerate.prepare(accelerator, model, optimizer)
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(batch).square().mean())
            optimizer.step()
            optimizer.zero_grad()
        assert optimizer.step_was_skipped is False and accelerator.optimizer_step_was_skipped is False


def test_open_window_of_one_process_is_refused_across_processes(fresh_accelerate) -> None:
    """Accelerate saves optimizer.bin from the main process only: under DDP, loading its open window into every
    process would give them rank 0's part; without the per-process window file it is refused."""
    accelerator, model, optimizer, loader, _ = _prepared()
    optimizer = gafused_accelerate.prepare(accelerator, model, optimizer)
    with accelerator.accumulate(model):
        accelerator.backward(model(next(iter(loader))).square().mean())
        optimizer.step()
    state = optimizer.state_dict()
    assert state["gafused"]["micro_step"] == 1
    other = gafused_accelerate.AcceleratedGradAccumulator(
        gafused.GradAccumulator(torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=0.1), None), num_processes=2
    )
    with pytest.raises(ValueError, match="gafused_window_"):
        other.load_state_dict(state)
    assert other.micro_step == 0
    other._loaded_window = {**state["gafused"], "micro_step": 2}  # what the load-state hook read: another checkpoint
    with pytest.raises(ValueError, match="different checkpoints"):
        other.load_state_dict(state)
    assert other.micro_step == 0
    # A checkpoint between windows holds no window of any process: it loads without the window file.
    with accelerator.accumulate(model):
        accelerator.backward(model(next(iter(loader))).square().mean())
        optimizer.step()
    assert optimizer.stepped
    between = optimizer.state_dict()
    assert between["gafused"]["micro_step"] == 0
    other.load_state_dict(between)
    assert other.micro_step == 0 and other.state_dict()["param_groups"] == between["param_groups"]


def test_a_plain_accelerate_checkpoint_resumes_with_an_empty_window(fresh_accelerate, tmp_path) -> None:
    """save_state by plain Accelerate (the inner optimizer's state, no window) loads into gafused's optimizer: the
    momentum buffers come back and the next window trains from them."""
    accelerator, model, optimizer, loader, _ = _prepared(steps=2, batches=4)
    optimizer.optimizer.param_groups[0]["momentum"] = 0.9
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(batch).square().mean())
            optimizer.step()
            optimizer.zero_grad()
    accelerator.save_state(str(tmp_path))
    saved = {id_: state["momentum_buffer"].clone() for id_, state in enumerate(optimizer.optimizer.state.values())}
    assert len(saved) == 2
    _reset_accelerate()

    accelerator, model, optimizer, loader, _ = _prepared(steps=2, batches=4)
    optimizer.optimizer.param_groups[0]["momentum"] = 0.9
    optimizer = gafused_accelerate.prepare(accelerator, model, optimizer)
    accelerator.load_state(str(tmp_path))
    loaded = list(optimizer.accumulator.optimizer.state.values())
    assert all(torch.equal(state["momentum_buffer"], saved[i]) for i, state in enumerate(loaded))
    assert optimizer.micro_step == 0
    with accelerator.accumulate(model):
        accelerator.backward(model(next(iter(loader))).square().mean())
        optimizer.step()
    with pytest.raises(RuntimeError, match="open window"):  # a plain state cannot replace an open window
        optimizer.load_state_dict(torch.load(tmp_path / "optimizer.bin", weights_only=True))
    assert optimizer.micro_step == 1


def test_load_state_before_prepare_is_refused(fresh_accelerate, tmp_path) -> None:
    """accelerator.load_state() before prepare(): Accelerate's own optimizer drops the checkpoint's open window (the
    window-file hook is not installed yet) while accelerator.step comes back mid-window. prepare() refuses, changing
    nothing; in the README's order (prepare, then load_state) the window comes back."""
    accelerator, model, optimizer, loader, _ = _prepared(steps=4, batches=6)
    optimizer = gafused_accelerate.prepare(accelerator, model, optimizer)
    for index, batch in enumerate(list(loader)[:2]):
        with accelerator.accumulate(model):
            _micro_batch(accelerator, model, optimizer, batch, index, "accelerator.backward")
            optimizer.zero_grad()
    accelerator.save_state(str(tmp_path))
    saved = optimizer.state_dict()["gafused"]
    assert saved["micro_step"] == 2
    _reset_accelerate()

    accelerator, model, optimizer, _, scheduler = _prepared(steps=4, batches=6)
    accelerator.load_state(str(tmp_path))
    assert accelerator.step == 2
    with pytest.raises(RuntimeError, match=r"accelerator\.load_state\(\) was called before .*load_state\(\) after"):
        gafused_accelerate.prepare(accelerator, model, optimizer)
    assert accelerator._optimizers == [optimizer] and scheduler.optimizers == [optimizer]
    assert "backward" not in vars(accelerator) and "step" not in vars(optimizer) and accelerator.step == 2
    _reset_accelerate()

    accelerator, model, optimizer, _, _ = _prepared(steps=4, batches=6)
    optimizer = gafused_accelerate.prepare(accelerator, model, optimizer)
    accelerator.load_state(str(tmp_path))
    assert accelerator.step == 2 and optimizer.micro_step == 2
    assert torch.equal(optimizer.state_dict()["gafused"]["weight_sum"], saved["weight_sum"])


def test_a_refused_steps_gradients_are_not_folded_into_the_next_block(fresh_accelerate) -> None:
    """loss.backward(), then a step() refused for its weight, and the loop goes on to the next block without
    zero_grad(): the gradients the refused step left are still waiting, so the next block's step() is refused (they
    would be summed into its micro-batch); dropping them with zero_grad() there lets the windows go on exactly."""
    accelerator, model, optimizer, loader, scheduler = _prepared(steps=2, batches=6)
    optimizer = gafused_accelerate.prepare(accelerator, model, optimizer)
    initial = _initial_state(accelerator, model)
    batches = list(loader)
    for index, batch in enumerate(loader):
        with accelerator.accumulate(model):
            if index == 3:
                model(batch).square().mean().backward()
                with pytest.raises(RuntimeError, match="left gradients no step"):
                    optimizer.step(weight=1.0 + index)
                optimizer.zero_grad()  # drops both blocks' gradients: micro-batches 2 and 3 are left out
                continue
            model(batch).square().mean().backward()
            if index == 2:
                with pytest.raises(ValueError, match="weight"):
                    optimizer.step(weight=-1.0)
                continue  # no zero_grad(): the refused micro-batch's gradients stay in p.grad
            optimizer.step(weight=1.0 + index)
            scheduler.step()
            optimizer.zero_grad()
    assert optimizer.micro_step == 0 and scheduler.scheduler.last_epoch == 2
    reference = _reference_windows(initial, batches, [[0, 1], [4, 5]], [0.1, 0.1 / 2])
    _assert_matches(accelerator.unwrap_model(model), reference)


def test_a_plain_optimizer_state_beside_a_stale_window_file_is_refused(fresh_accelerate, tmp_path) -> None:
    """A folder that held a gafused checkpoint taken mid-window, overwritten by plain Accelerate's save_state: its
    optimizer.bin is the inner optimizer's, the gafused_window_0.bin beside it is the old run's. load_state refuses
    the pair rather than resume the stale window."""
    accelerator, model, optimizer, loader, _ = _prepared(steps=4, batches=4)
    optimizer = gafused_accelerate.prepare(accelerator, model, optimizer)
    with accelerator.accumulate(model):
        accelerator.backward(model(next(iter(loader))).square().mean())
        optimizer.step()
    accelerator.save_state(str(tmp_path))
    assert (tmp_path / gafused_accelerate.WINDOW_FILE.format(rank=0)).exists()
    _reset_accelerate()

    accelerator, model, optimizer, loader, _ = _prepared(steps=4, batches=4)
    accelerator.save_state(str(tmp_path))  # plain Accelerate, into the same folder, between windows
    _reset_accelerate()

    accelerator, model, optimizer, loader, _ = _prepared(steps=4, batches=4)
    optimizer = gafused_accelerate.prepare(accelerator, model, optimizer)
    with pytest.raises(ValueError, match="plain optimizer state beside a gafused window file"):
        accelerator.load_state(str(tmp_path))
    assert optimizer.micro_step == 0


def test_one_process_resumes_its_window_from_optimizer_bin_alone(fresh_accelerate, tmp_path) -> None:
    """On one process Accelerate's optimizer.bin holds the whole open window: a checkpoint copied without
    gafused_window_0.bin still resumes mid-window, ending where the uninterrupted run does, bitwise."""

    def run(checkpoint: bool) -> list[torch.Tensor]:
        _reset_accelerate()
        torch.manual_seed(0)
        accelerator, model, optimizer, loader, scheduler = _prepared(steps=4, batches=8)
        optimizer = gafused_accelerate.prepare(accelerator, model, optimizer)
        for index, batch in enumerate(list(loader)):
            if checkpoint and index == 2:  # mid-window: 2 of 4 micro-batches folded
                accelerator.save_state(str(tmp_path))
                os.remove(tmp_path / gafused_accelerate.WINDOW_FILE.format(rank=0))
                _reset_accelerate()
                accelerator, model, optimizer, loader, scheduler = _prepared(steps=4, batches=8)
                optimizer = gafused_accelerate.prepare(accelerator, model, optimizer)
                accelerator.load_state(str(tmp_path))
                assert accelerator.step == 2 and optimizer.micro_step == 2
            with accelerator.accumulate(model):
                accelerator.backward(model(batch).square().mean(), weight=1.0 + index)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        assert optimizer.micro_step == 0 and scheduler.scheduler.last_epoch == 2
        return [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]

    _same_tensors(run(True), run(False))


def test_prepare_refuses_an_accelerated_optimizer_this_accelerator_did_not_prepare(fresh_accelerate) -> None:
    from accelerate.optimizer import AcceleratedOptimizer

    accelerator, model, optimizer, _, _ = _prepared()
    stranger = AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), device_placement=False)
    with pytest.raises(TypeError, match="optimizer must be the optimizer returned by accelerator.prepare"):
        gafused_accelerate.prepare(accelerator, model, stranger)
    assert accelerator._optimizers == [optimizer] and "backward" not in vars(accelerator)


def test_accelerators_grad_scaler_is_gafuseds(fresh_accelerate) -> None:
    """fp16 Accelerate keeps a GradScaler on the accelerator (a CPU one stands for it here): gafused scales the loss
    and updates that scaler once per window, so a non-finite window backs its scale off and is skipped, and the
    finite windows step as plain PyTorch does."""
    accelerator, model, optimizer, loader, scheduler = _prepared(steps=2, batches=6)
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    optimizer = gafused_accelerate.prepare(accelerator, model, optimizer)
    assert optimizer.accumulator.grad_scaler is accelerator.scaler
    initial = _initial_state(accelerator, model)
    batches = list(loader)
    for index, batch in enumerate(loader):
        with accelerator.accumulate(model):
            loss = model(batch).square().mean() * (math.inf if index == 3 else 1.0)
            accelerator.backward(loss, weight=1.0 + index)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    assert optimizer.skipped_steps == 1 and accelerator.scaler.get_scale() == 2.0**9
    reference = _reference_windows(initial, batches, [[0, 1], [4, 5]], [0.1, 0.1 / 2])
    _assert_matches(accelerator.unwrap_model(model), reference)


def test_prepare_passes_its_options_to_the_accumulator(fresh_accelerate) -> None:
    """accum_dtype, bucket_bytes and normalization reach the accumulator; reduce_dtype too (refused on one process,
    as GradAccumulator refuses it without a DDP model). With normalization="sum" the window's gradient is the sum of
    the micro-batches' (each loss already normalized over the window): one SGD step on the summed loss."""
    accelerator, model, optimizer, _, _ = _prepared()
    with pytest.raises(ValueError, match="reduce_dtype is the dtype DDP's buckets .* this accelerator runs in one"):
        gafused_accelerate.prepare(accelerator, model, optimizer, reduce_dtype=torch.bfloat16)
    assert accelerator._optimizers == [optimizer] and "backward" not in vars(accelerator)
    _reset_accelerate()

    accelerator, model, optimizer, loader, _ = _prepared(steps=2, batches=2)
    optimizer = gafused_accelerate.prepare(
        accelerator, model, optimizer, accum_dtype=torch.float64, bucket_bytes=16, normalization="sum"
    )
    accumulator = optimizer.accumulator
    assert accumulator.accum_dtype == torch.float64 and accumulator.normalization == "sum"
    assert len(accumulator.buffers[0].bucket_ranges) == 2  # weight and bias apart: 16 bytes a bucket
    initial = _initial_state(accelerator, model)
    batches = list(loader)
    for batch in batches:
        with accelerator.accumulate(model):
            accelerator.backward(model(batch).square().mean() / 4)
            optimizer.step()
            optimizer.zero_grad()
    assert optimizer.stepped
    reference = torch.nn.Linear(3, 2).double()
    reference.load_state_dict(initial)
    sum(reference(b.double()).square().mean() / 4 for b in batches).backward()
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.1 * p.grad
    _assert_matches(accelerator.unwrap_model(model), reference)


def test_backward_is_refused_once_the_accelerator_holds_another_optimizer(fresh_accelerate) -> None:
    accelerator, model, optimizer, loader, _ = _prepared()
    optimizer = gafused_accelerate.prepare(accelerator, model, optimizer)
    accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    with accelerator.accumulate(model), pytest.raises(RuntimeError, match="other optimizers than gafused's"):
        accelerator.backward(model(next(iter(loader))).square().mean())
    assert optimizer.micro_step == 0 and all(p.grad is None for p in model.parameters())


def test_two_backward_calls_in_one_block_are_one_micro_batch(fresh_accelerate) -> None:
    """Two losses of one micro-batch, each through accelerator.backward in the same accumulate() block (the weight
    given to the first): one micro-batch, whose gradient is the sum of both losses'."""
    accelerator, model, optimizer, loader, _ = _prepared(steps=2, batches=2)
    optimizer = gafused_accelerate.prepare(accelerator, model, optimizer)
    initial = _initial_state(accelerator, model)
    batches = list(loader)
    for index, batch in enumerate(loader):
        with accelerator.accumulate(model):
            out = model(batch)
            accelerator.backward(out[:, 0].square().mean(), weight=1.0 + index, retain_graph=True)
            accelerator.backward(out[:, 1].square().mean())
            optimizer.step()
            optimizer.zero_grad()
        assert optimizer.micro_step == (index + 1) % 2
    # Each micro-batch's loss is the sum of its two column means: twice the mean of the squares.
    reference = _reference_windows(initial, batches, [[0, 1]], [0.1 * 2])
    _assert_matches(accelerator.unwrap_model(model), reference)


@pytest.mark.parametrize("parameters", ["one tensor", "with another parameter"])
def test_accelerates_clipping_is_refused_for_any_of_gafuseds_parameters(fresh_accelerate, parameters: str) -> None:
    accelerator, model, optimizer, loader, _ = _prepared()
    optimizer = gafused_accelerate.prepare(accelerator, model, optimizer)
    other = torch.nn.Parameter(torch.ones(2))
    other.grad = torch.full((2,), 3.0)
    with accelerator.accumulate(model):
        accelerator.backward(model(next(iter(loader))).square().mean())
        target = model.weight if parameters == "one tensor" else [*model.parameters(), other]
        with pytest.raises(RuntimeError, match="clips the window's finished gradient"):
            accelerator.clip_grad_norm_(target, 0.5)
        optimizer.step()
    assert torch.equal(other.grad, torch.full((2,), 3.0))  # the refusal clipped nothing


def test_free_memory_lets_go_of_the_accumulator_and_its_checkpoint_hooks(fresh_accelerate, tmp_path) -> None:
    """After free_memory(), a plain run on the same accelerator saves no gafused window file, and the freed
    accumulator (its buffers) is not kept alive by the accelerator's save/load-state hooks."""
    accelerator, model, optimizer, loader, scheduler = _prepared(steps=2, batches=2)
    optimizer = gafused_accelerate.prepare(accelerator, model, optimizer)
    _train_windows(accelerator, model, optimizer, loader, scheduler)
    freed = weakref.ref(optimizer.accumulator)
    del optimizer, model, loader, scheduler
    accelerator.free_memory()
    gc.collect()
    assert freed() is None
    module = torch.nn.Linear(3, 2)
    model, plain = accelerator.prepare(module, torch.optim.SGD(module.parameters(), lr=0.1))
    accelerator.save_state(str(tmp_path))
    assert not (tmp_path / gafused_accelerate.WINDOW_FILE.format(rank=0)).exists()


def test_a_step_without_backward_before_any_block_is_plain_accelerates(fresh_accelerate) -> None:
    """Outside accumulate(), with gradient_accumulation_steps=1, a step() that no backward preceded (a skipped
    batch) is a window of its own without gradients: nothing moves, as with plain Accelerate."""

    def train(with_gafused: bool) -> list[torch.Tensor]:
        _reset_accelerate()
        torch.manual_seed(0)
        accelerator, model, optimizer, loader, _ = _prepared(steps=1, batches=3)
        if with_gafused:
            optimizer = gafused_accelerate.prepare(accelerator, model, optimizer)
        for index, batch in enumerate(loader):
            if index != 1:
                accelerator.backward(model(batch).square().mean())
            optimizer.step()
            optimizer.zero_grad()
        return [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]

    _same_tensors(train(False), train(True))


def test_the_module_docstrings_example_imports_the_adapter_before_calling_it() -> None:
    """``import gafused`` alone does not import its integrations (each needs its framework): the example copied from
    the docstring raised AttributeError."""
    before_the_call = gafused_accelerate.__doc__.split("gafused.integrations.accelerate.prepare(")[0]
    assert "\n    import gafused.integrations.accelerate\n" in before_the_call
