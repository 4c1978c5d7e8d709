"""Lightning: ``Trainer(accumulate_grad_batches=N)`` plus ``GradAccumulation`` against a float64 big batch.

The model, data and recipes are tests/lightning_cases.py: a tiny GPT-2, micro-batches of very different token
counts, N = 3 over an epoch of 11 batches (windows of 3, 3, 3 and a partial 2), SGD, a per-step LambdaLR schedule,
clipping. One process runs in this process; 2 gloo ranks under Lightning's DDP strategy run once, in a subprocess.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
import torch

pytest.importorskip("lightning", reason="needs Lightning: pip install 'gafused[lightning]'")
pytest.importorskip("transformers", reason="the tiny GPT-2 needs transformers: pip install 'gafused[transformers]'")

import lightning.pytorch as pl  # noqa: E402
import lightning_cases as cases  # noqa: E402

import gafused  # noqa: E402
from gafused.integrations.lightning import GradAccumulation  # noqa: E402

from casekit import run_case_script  # noqa: E402

# |p - p_truth| / |p_truth - p0| over the parameter vector, float32 against float64: float32 rounds each operation
# at 2^-24 relative, and the forward, backward and sums of a window chain a few hundred of them. Plain fp32 PyTorch
# on the same big batch lands near 1e-6 (test_plain_fp32_baseline_is_within_the_bound); a wrong weight (one
# micro-batch of ~10 tokens among ~30 counted like the others) moves the result by 1e-2 and more.
FP32_ERROR = 1e-5
# Each window's gradient norm, computed in float32 by gafused, against float64.
NORM_RTOL = 1e-5


def _quiet_trainer(**overrides: Any) -> pl.Trainer:
    options: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        accumulate_grad_batches=cases.N,
        **cases.ONE_QUIET_EPOCH,
    )
    options.update(overrides)
    return pl.Trainer(**options)


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    torch.set_num_threads(1)
    return cases.run_all(0, 1, str(tmp_path_factory.mktemp("lightning-single")))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, Any]]]:
    return run_case_script(cases.__file__, tmp_path_factory.mktemp("lightning-ranks") / "results.pt")


@pytest.fixture(scope="module")
def truths() -> dict[tuple[int, bool], tuple]:
    """(world, token-weighted) -> float64 truth: the token-weighted big batch, or the mean of the micro-batch means."""
    worlds = (1, cases.WORLD)
    return {(world, weighted): cases.truth(world, weighted=weighted) for world in worlds for weighted in (True, False)}


def _results(single: dict, ranks: list[dict], world: int) -> list[dict[str, dict[str, Any]]]:
    return [single] if world == 1 else ranks


def _result(results: dict[str, dict[str, Any]], recipe: str) -> dict[str, Any]:
    result = results[recipe]
    assert "error" not in result, f"{recipe}: {result['error']}"
    return result


@pytest.mark.parametrize("world", [1, cases.WORLD], ids=["1-process", "2-ranks"])
def test_plain_fp32_baseline_is_within_the_bound(truths: dict[tuple[int, bool], tuple], world: int) -> None:
    truth_params, initial, _ = truths[world, True]
    assert 0 < cases.error(cases.plain_fp32(world), truth_params, initial) < FP32_ERROR


@pytest.mark.parametrize("recipe", ["gafused", "gafused-resumed", "gafused-unweighted"])
@pytest.mark.parametrize("world", [1, cases.WORLD], ids=["1-process", "2-ranks"])
def test_matches_float64_big_batch(
    single: dict, ranks: list[dict], truths: dict[tuple[int, bool], tuple], world: int, recipe: str
) -> None:
    """Token weights (or none: the mean of the micro-batch means), a partial last window, clipping: every rank ends
    at the float64 big batch, and every window's grad_norm is the big batch's."""
    truth_params, initial, truth_norms = truths[world, recipe not in cases.UNWEIGHTED]
    for results in _results(single, ranks, world):
        result = _result(results, recipe)
        assert cases.error(result["params"], truth_params, initial) < FP32_ERROR
        assert result["norms"] == pytest.approx(truth_norms, rel=NORM_RTOL)
    # Some windows were clipped and some were not.
    assert max(truth_norms) > cases.MAX_NORM > min(truth_norms)


@pytest.mark.parametrize("world", [1, cases.WORLD], ids=["1-process", "2-ranks"])
def test_lightning_own_accumulation_is_far_off_on_this_data(
    single: dict, ranks: list[dict], truths: dict[tuple[int, bool], tuple], world: int
) -> None:
    """The data expose Lightning's scale errors, so the exact rows are not an accident of the data: loss / N on
    uneven tokens, and on the partial window alone (against the mean of the micro-batch means); its own resume loses
    the open window on top."""
    results = _results(single, ranks, world)[0]
    for recipe, weighted in (("lightning", True), ("lightning-resumed", True), ("lightning", False)):
        truth_params, initial, _ = truths[world, weighted]
        assert cases.error(_result(results, recipe)["params"], truth_params, initial) > 100 * FP32_ERROR


@pytest.mark.parametrize("world", [1, cases.WORLD], ids=["1-process", "2-ranks"])
def test_scheduler_steps_once_per_window(single: dict, ranks: list[dict], world: int) -> None:
    expected = [cases.LR * cases.lr_factor(window) for window in range(len(cases.epoch_windows()))]
    for results in _results(single, ranks, world):
        for recipe in ("gafused", "gafused-resumed"):
            assert _result(results, recipe)["lrs"] == expected


@pytest.mark.parametrize("world", [1, cases.WORLD], ids=["1-process", "2-ranks"])
def test_checkpoint_mid_window_resumes_bitwise(single: dict, ranks: list[dict], world: int) -> None:
    for results in _results(single, ranks, world):
        resumed = _result(results, "gafused-resumed")
        assert resumed["micro_step_at_checkpoint"] == (cases.CHECKPOINT_AFTER + 1) % cases.N == 2  # mid-window
        assert "GradAccumulation" in resumed["checkpoint_callback_states"]
        uninterrupted = _result(results, "gafused")
        for a, b in zip(resumed["params"], uninterrupted["params"], strict=True):
            assert torch.equal(a, b)


def test_ranks_agree_bitwise(ranks: list[dict]) -> None:
    for recipe in ("gafused", "gafused-resumed"):
        for a, b in zip(_result(ranks[0], recipe)["params"], _result(ranks[1], recipe)["params"], strict=True):
            assert torch.equal(a, b)


def test_training_step_returning_none_on_a_window_end() -> None:
    """Lightning steps on what was accumulated when the window's last training_step returns None: the window is
    finished with its other micro-batches, exactly."""
    _, TinyLM, _ = cases._lightning_classes()
    skipped = {2, 4}  # the last batch of the first window, a middle batch of the second

    class Skipping(TinyLM):
        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor | None:
            return None if batch_idx in skipped else super().training_step(batch, batch_idx)

    module = Skipping(0)
    _quiet_trainer(callbacks=[GradAccumulation(weight=cases.tokens, max_grad_norm=cases.MAX_NORM)]).fit(module)
    truth_params, initial, _ = cases.truth(1, skip=skipped)
    assert cases.error([p.detach() for p in module.model.parameters()], truth_params, initial) < FP32_ERROR
    assert len(module.lrs) == len(cases.epoch_windows())


def test_accumulation_that_changes_per_epoch() -> None:
    """Lightning's GradientAccumulationScheduler changes N between epochs (2, then 4 over 6 batches: a partial
    window of 2): the windows follow it, each still the token-weighted big batch."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    _, TinyLM, _ = cases._lightning_classes()
    module = TinyLM(0)
    callbacks = [
        GradientAccumulationScheduler({0: 2, 1: 4}),
        GradAccumulation(weight=cases.tokens, max_grad_norm=cases.MAX_NORM),
    ]
    trainer = _quiet_trainer(callbacks=callbacks, accumulate_grad_batches=1, max_epochs=2, limit_train_batches=6)
    trainer.fit(module)
    windows = cases.epoch_windows(6, 2) + cases.epoch_windows(6, 4)
    truth_params, initial, _ = cases.truth(1, windows=windows)
    assert cases.error([p.detach() for p in module.model.parameters()], truth_params, initial) < FP32_ERROR
    assert module.lrs == [cases.LR * cases.lr_factor(window) for window in range(len(windows))]


def test_the_trainer_holds_the_accumulator() -> None:
    _, TinyLM, _ = cases._lightning_classes()
    callback = GradAccumulation(weight=cases.tokens)
    module = TinyLM(0)
    trainer = _quiet_trainer(callbacks=[callback], limit_train_batches=4)
    trainer.fit(module)
    accumulator = callback.accumulator
    assert isinstance(accumulator, gafused.GradAccumulator) and trainer.optimizers == [accumulator]
    assert accumulator.accumulation_steps is None and accumulator.micro_step == 0  # the partial window was finished
    assert "backward" not in trainer.precision_plugin.__dict__  # the plugin's own backward is back after fit


def test_the_module_can_be_copied_during_fit() -> None:
    """An EMA or SWA copy, or torch.save of the module, taken mid-window: the module carries nothing of the fit
    (the callback routes the precision plugin's backward, not the module's), and the fit goes on exactly."""
    import copy
    import io

    _, TinyLM, _ = cases._lightning_classes()
    copies = []

    class Copying(TinyLM):
        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == cases.CHECKPOINT_AFTER:
                copies.append(copy.deepcopy(self))
                torch.save(self.model, io.BytesIO())  # the module's __dict__ pickles too

    module = Copying(0)
    _quiet_trainer(callbacks=[GradAccumulation(weight=cases.tokens, max_grad_norm=cases.MAX_NORM)]).fit(module)
    truth_params, initial, _ = cases.truth(1)
    assert cases.error([p.detach() for p in module.model.parameters()], truth_params, initial) < FP32_ERROR
    (copied,) = copies
    assert "backward" not in copied.__dict__ and "backward" not in module.__dict__


@pytest.mark.parametrize("saved_with", ["gafused", "plain"])
def test_checkpoints_cross_between_gafused_and_plain_lightning(tmp_path: Any, saved_with: str) -> None:
    """A checkpoint saved with the callback resumes without it (the optimizer state is the inner optimizer's plus a
    "gafused" entry), and one saved without it resumes with it (loaded with an empty window)."""
    _, TinyLM, _ = cases._lightning_classes()
    path = str(tmp_path / "saved.ckpt")
    with_callback = [GradAccumulation(weight=cases.tokens)]
    first = _quiet_trainer(callbacks=with_callback if saved_with == "gafused" else [], limit_train_batches=cases.N)
    first.fit(TinyLM(0))
    first.save_checkpoint(path)
    callbacks = [] if saved_with == "gafused" else [GradAccumulation(weight=cases.tokens)]
    module = TinyLM(0)
    resumed = _quiet_trainer(callbacks=callbacks, limit_train_batches=cases.N, max_epochs=2)
    resumed.fit(module, ckpt_path=path)
    assert resumed.global_step == 2  # one window restored, one trained here
    assert module.lrs == [cases.LR * cases.lr_factor(1)]  # the schedule went on from the checkpoint


def test_an_open_window_of_a_run_on_other_ranks_is_refused_on_every_rank() -> None:
    """Lightning hands rank 0's optimizer state to every rank. When its open window comes from a run on another
    number of ranks, every rank refuses it as rank 0 does (naming world_size): one that swapped it for an empty
    window would wait for rank 0 in Lightning's next barrier. On one process, a window saved as rank 1 of 2 stands
    for what a rank other than the saving one receives."""
    from gafused.integrations.lightning import _LightningAccumulator

    model = torch.nn.Linear(3, 2)
    accumulator = _LightningAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), None)
    model(torch.randn(4, 3)).square().mean().backward()
    gafused.GradAccumulator.step(accumulator)  # one micro-batch into a driven window
    state = accumulator.state_dict()
    state["gafused"].update(world_size=2, rank=1)  # rank 1's part of a window of 2 ranks, on this 1-rank run
    with pytest.raises(ValueError, match=r"\['world_size'\]"):
        accumulator.load_state_dict(state)
    assert accumulator.micro_step == 1


@pytest.mark.parametrize(
    "state",
    [{"version": 2, "windows": None}, {"windows": None}, [], {"version": 1, "windows": {}}],
    ids=["other-version", "no-version", "not-a-dict", "windows-not-a-list"],
)
def test_the_callbacks_state_of_another_version_or_shape_is_refused(state) -> None:
    """The callback's own checkpoint entry (the other ranks' windows) is read only in the layout it was written in."""
    callback = GradAccumulation()
    with pytest.raises(ValueError, match="expected"):
        callback.load_state_dict(state)
    callback.load_state_dict({"version": 1, "windows": None})  # its own layout loads


def test_a_precision_plugin_that_overrides_backward_is_refused() -> None:
    from lightning.pytorch.plugins.precision import Precision

    class OwnBackward(Precision):
        def backward(self, tensor, model, optimizer, *args, **kwargs) -> None:  # noqa: ANN001
            super().backward(tensor, model, optimizer, *args, **kwargs)

    _, TinyLM, _ = cases._lightning_classes()
    _fit_refused(TinyLM(0), RuntimeError, "OwnBackward overrides Precision.backward", plugins=[OwnBackward()])


# --- refused configurations ---------------------------------------------------------------------------------------


def _fit_refused(module: pl.LightningModule, error: type[Exception], match: str, **trainer: Any) -> None:
    callback = GradAccumulation(weight=cases.tokens)
    fit = _quiet_trainer(callbacks=[callback], limit_train_batches=2, **trainer)
    with pytest.raises(error, match=match):
        fit.fit(module)
    assert "backward" not in fit.precision_plugin.__dict__


def test_gradient_clip_val_is_refused() -> None:
    _, TinyLM, _ = cases._lightning_classes()
    _fit_refused(TinyLM(0), ValueError, r"gradient_clip_val=1\.0.*max_grad_norm", gradient_clip_val=1.0)


def test_a_lightning_without_the_accumulation_rule_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The callback reads Lightning's own window rule, a private method: one that is gone is named, up front."""
    from lightning.pytorch.loops.fit_loop import _FitLoop

    _, TinyLM, _ = cases._lightning_classes()
    monkeypatch.delattr(_FitLoop, "_should_accumulate")
    _fit_refused(TinyLM(0), RuntimeError, r"fit_loop\._should_accumulate\(\) \(Lightning 2\.x\)")


def test_configure_optimizers_returning_an_accumulator_is_refused() -> None:
    _, TinyLM, _ = cases._lightning_classes()

    class Wrapped(TinyLM):
        def configure_optimizers(self) -> gafused.GradAccumulator:
            return gafused.GradAccumulator(torch.optim.SGD(self.parameters(), lr=cases.LR), None)

    _fit_refused(Wrapped(0), TypeError, "return the plain optimizer")


def test_manual_optimization_is_refused() -> None:
    _, TinyLM, _ = cases._lightning_classes()

    class Manual(TinyLM):
        def __init__(self, rank: int) -> None:
            super().__init__(rank)
            self.automatic_optimization = False

    _fit_refused(Manual(0), RuntimeError, "automatic optimization", accumulate_grad_batches=1)


@pytest.mark.parametrize(
    ("through", "ending"),
    [
        ("self.optimizers()", "end_window"),
        ("self.optimizers()", "flush"),
        ("trainer.optimizers[0]", "end_window"),
        ("trainer.optimizers[0]", "flush"),
    ],
)
def test_manual_optimization_through_lightnings_optimizer_wrapper(through: str, ending: str) -> None:
    """The refusal above sends manual optimization to the accumulator's own loop (the one its message and README
    give: ``end_window=self.trainer.is_last_batch`` ends the epoch's partial window; ``flush()`` at the epoch's end
    does too); ``self.optimizers()`` returns Lightning's wrapper, whose class subclasses the accumulator's: its
    backward, flush and properties must act on the accumulator (they once ran on the wrapper: every window empty,
    nothing stepped, nothing raised). ``global_step`` counts micro-batches there, as README says."""
    torch.manual_seed(0)
    data = [(torch.randn(count, 4), torch.randn(count, 3)) for count in (2, 5, 1, 4, 3, 6, 2)]
    steps, windows = 3, 3  # windows of 3, 3 and a partial 1, ended at the epoch's end

    class Manual(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(1)
            self.net = torch.nn.Linear(4, 3)
            self.automatic_optimization = False
            self.norms: list[float] = []

        def optimizer(self) -> gafused.GradAccumulator:
            return self.optimizers() if through == "self.optimizers()" else self.trainer.optimizers[0]

        def configure_optimizers(self) -> gafused.GradAccumulator:
            return gafused.GradAccumulator(torch.optim.SGD(self.net.parameters(), lr=0.1), steps)

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(data, batch_size=None)

        def training_step(self, batch: Any, index: int) -> None:
            opt = self.optimizer()
            opt.max_grad_norm = 0.5  # a property set through the wrapper
            x, y = batch
            last = self.trainer.is_last_batch if ending == "end_window" else False
            opt.backward(torch.nn.functional.mse_loss(self.net(x), y), weight=len(x), end_window=last)
            opt.step()
            opt.zero_grad()
            if opt.stepped:
                self.norms.append(opt.grad_norm.item())

        def on_train_epoch_end(self) -> None:
            if ending == "flush" and self.optimizer().flush():
                self.norms.append(self.optimizer().grad_norm.item())

    module = Manual()
    trainer = _quiet_trainer(accumulate_grad_batches=1, limit_train_batches=len(data))
    trainer.fit(module)
    accumulator = trainer.optimizers[0]
    assert (accumulator.micro_step, accumulator.max_grad_norm) == (0, 0.5)
    assert len(module.norms) == windows
    # Lightning counts the steps of its wrapper; the accumulator itself, stepped directly, is not counted.
    assert trainer.global_step == (len(data) if through == "self.optimizers()" else 0)

    # The same windows by hand in float64: the token-weighted mean gradient, clipped at 0.5, an SGD step.
    torch.manual_seed(1)
    net = torch.nn.Linear(4, 3).double()
    norms = []
    for start in range(0, len(data), steps):
        window = data[start : start + steps]
        total = sum(len(x) for x, _ in window)
        net.zero_grad()
        for x, y in window:
            (torch.nn.functional.mse_loss(net(x.double()), y.double()) * len(x) / total).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5).item())
        with torch.no_grad():
            for p in net.parameters():
                p -= 0.1 * p.grad
    assert module.norms == pytest.approx(norms, rel=1e-5)
    for got, want in zip(module.net.parameters(), net.parameters(), strict=True):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("hook", ["backward", "configure_gradient_clipping"])
def test_overridden_backward_or_clipping_hook_is_refused(hook: str) -> None:
    _, TinyLM, _ = cases._lightning_classes()
    overridden = type("Overriding", (TinyLM,), {hook: lambda self, *args, **kwargs: None})
    _fit_refused(overridden(0), RuntimeError, f"overrides LightningModule.{hook}")


def test_adding_a_param_group_during_fit_says_what_to_do() -> None:
    """Lightning's BaseFinetuning callbacks add a group to trainer.optimizers[0] when they unfreeze; the message
    speaks to a Lightning user, who never built a GradAccumulator."""
    _, TinyLM, _ = cases._lightning_classes()

    class Unfreezing(TinyLM):
        def on_train_epoch_start(self) -> None:
            if self.current_epoch == 1:
                extra = torch.nn.Parameter(torch.zeros(3))
                self.trainer.optimizers[0].add_param_group({"params": [extra]})

    callback = GradAccumulation(weight=cases.tokens)
    with pytest.raises(RuntimeError, match="BaseFinetuning.*configure_optimizers"):
        _quiet_trainer(callbacks=[callback], max_epochs=2).fit(Unfreezing(0))


def test_an_optimizer_step_that_runs_the_closure_itself_is_told_how_to_step() -> None:
    _, TinyLM, _ = cases._lightning_classes()

    class SkippingNonFinite(TinyLM):
        def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:  # noqa: ANN001
            loss = optimizer_closure()
            if torch.isfinite(loss):
                optimizer.step()

    callback = GradAccumulation(weight=cases.tokens)
    with pytest.raises(RuntimeError, match=r"optimizer.step\(closure=optimizer_closure\)"):
        _quiet_trainer(callbacks=[callback], limit_train_batches=cases.N).fit(SkippingNonFinite(0))


def test_bad_weight_names_the_weight_function() -> None:
    _, TinyLM, _ = cases._lightning_classes()
    callback = GradAccumulation(weight=lambda batch: -1.0)
    with pytest.raises(ValueError, match="weight") as raised:
        _quiet_trainer(callbacks=[callback], limit_train_batches=2).fit(TinyLM(0))
    assert "GradAccumulation(weight=" in "".join(getattr(raised.value, "__notes__", []))


def test_a_weight_function_that_returns_none_is_refused_not_taken_as_weight_1() -> None:
    _, TinyLM, _ = cases._lightning_classes()

    def forgot_to_return(batch: Any) -> None:
        (batch["labels"][..., 1:] != -100).sum()

    module = TinyLM(0)
    start = [p.detach().clone() for p in module.parameters()]
    callback = GradAccumulation(weight=forgot_to_return)
    with pytest.raises(
        TypeError, match=r"GradAccumulation\(weight=<function .*forgot_to_return.*returned None for batch 0"
    ):
        _quiet_trainer(callbacks=[callback], limit_train_batches=2).fit(module)
    assert all(torch.equal(p, q) for p, q in zip(module.parameters(), start, strict=True))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"weight": 3}, TypeError, "weight must be a callable"),
        ({"max_grad_norm": 0.0}, ValueError, "max_grad_norm"),
        ({"max_grad_norm": float("nan")}, ValueError, "max_grad_norm"),
        ({"max_grad_norm": True}, ValueError, "max_grad_norm"),
        ({"max_grad_norm": 10**400}, ValueError, "max_grad_norm must be .* got an int of about 1e\\+400"),
        ({"backend": "nope"}, ValueError, "backend must be one of"),
        ({"bucket_bytes": -1}, ValueError, "bucket_bytes must be a positive int"),
        ({"accum_dtype": torch.float16}, ValueError, "accum_dtype must be one of"),
        ({"reduce_dtype": torch.float16}, ValueError, "reduce_dtype must be None or one of"),
    ],
    ids=[
        "weight-not-callable",
        "max_grad_norm-zero",
        "max_grad_norm-nan",
        "max_grad_norm-bool",
        "max_grad_norm-huge",
        "backend",
        "bucket_bytes",
        "accum_dtype",
        "reduce_dtype",
    ],
)
def test_bad_arguments_name_the_parameter(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        GradAccumulation(**kwargs)


def test_reduce_dtype_without_ddp_is_refused() -> None:
    _, TinyLM, _ = cases._lightning_classes()
    callback = GradAccumulation(reduce_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="reduce_dtype"):
        _quiet_trainer(callbacks=[callback], limit_train_batches=2).fit(TinyLM(0))


def test_a_window_lightning_abandons_is_not_merged_silently() -> None:
    """on_train_batch_start returning -1 mid-window ends the epoch without stepping; Lightning would drop those
    gradients at the next window's zero_grad. gafused refuses to fold them into the next epoch's first window."""
    _, TinyLM, _ = cases._lightning_classes()

    class Abandoning(TinyLM):
        def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
            return -1 if self.current_epoch == 0 and batch_idx == cases.CHECKPOINT_AFTER else None

    callback = GradAccumulation(weight=cases.tokens)
    with pytest.raises(
        RuntimeError,
        match=r"new window at batch 0 \(accumulate_grad_batches=3\), but 1 micro-batch.*"
        r"returned -1 in the middle of a window.*at a window's first batch only",
    ):
        _quiet_trainer(callbacks=[callback], max_epochs=2).fit(Abandoning(0))


class _StopInSecondWindow(pl.Callback):
    """Stops the fit after the second window's first batch, as EarlyStopping does after a mid-epoch validation."""

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if args[-1] == cases.N:  # batch_idx
            trainer.should_stop = True


def test_a_fit_stopped_mid_window_resumes_from_its_epoch_end_checkpoint_without_that_window(tmp_path: Any) -> None:
    """The checkpoint a fit stopped mid-window saves at its epoch's end holds the open window; Lightning resumes at
    the next epoch's start, where its windows begin again, without those micro-batches. The callback drops them,
    saying so (it refused, naming causes that had not happened), and the resumed epoch is the big batch's."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    _, TinyLM, _ = cases._lightning_classes()
    saving = ModelCheckpoint(dirpath=str(tmp_path), save_last=True)
    callbacks = [_StopInSecondWindow(), GradAccumulation(weight=cases.tokens, max_grad_norm=cases.MAX_NORM), saving]
    with pytest.warns(UserWarning, match=r"training ended with 1 micro-batch\(es\) in a window"):
        _quiet_trainer(callbacks=callbacks, enable_checkpointing=True, max_epochs=2).fit(TinyLM(0))
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert checkpoint["optimizer_states"][0]["gafused"]["micro_step"] == 1
    module = TinyLM(0)
    callback = GradAccumulation(weight=cases.tokens, max_grad_norm=cases.MAX_NORM)
    with pytest.warns(UserWarning, match=r"holds 1 micro-batch\(es\).*start of epoch 1.*they are dropped"):
        _quiet_trainer(callbacks=[callback], max_epochs=2).fit(module, ckpt_path=str(tmp_path / "last.ckpt"))
    windows = cases.epoch_windows()[:1] + cases.epoch_windows()
    truth_params, initial, _ = cases.truth(1, windows=windows)
    assert cases.error([p.detach() for p in module.model.parameters()], truth_params, initial) < FP32_ERROR
    assert module.lrs == [cases.LR * cases.lr_factor(window) for window in range(1, len(windows))]


def test_a_resume_inside_a_window_that_a_scheduler_of_n_does_not_cut_says_so(tmp_path: Any) -> None:
    """Lightning applies a GradientAccumulationScheduler at an epoch's start only: resumed from a checkpoint taken
    inside a window, it accumulates 1 batch per step until the epoch ends, so the window cannot be finished as it was
    cut. Refused, naming the scheduler and the way out."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    _, TinyLM, Recorder = cases._lightning_classes()
    path = str(tmp_path / "inside.ckpt")
    first = GradAccumulation(weight=cases.tokens)
    callbacks = [GradientAccumulationScheduler({0: cases.N}), Recorder(first, checkpoint=path), first]
    with pytest.warns(UserWarning, match="training ended with 2 micro-batch"):
        _quiet_trainer(callbacks=callbacks, accumulate_grad_batches=1).fit(TinyLM(0))
    callbacks = [GradientAccumulationScheduler({0: cases.N}), GradAccumulation(weight=cases.tokens)]
    with pytest.raises(RuntimeError, match=r"GradientAccumulationScheduler at an epoch's start only.*between windows"):
        _quiet_trainer(callbacks=callbacks, accumulate_grad_batches=1).fit(TinyLM(0), ckpt_path=path)


def test_a_training_step_that_takes_the_dataloader_iterator_is_refused() -> None:
    """training_step(self, dataloader_iter): Lightning hands on_train_batch_start the batch before, so the callback
    could tell neither where windows begin nor each batch's weight (it refused the second batch, naming causes that
    had not happened). Refused when the fit starts."""
    _, TinyLM, _ = cases._lightning_classes()

    class Iterating(TinyLM):
        def training_step(self, dataloader_iter: Any) -> torch.Tensor:
            return super().training_step(next(dataloader_iter), 0)

    _fit_refused(Iterating(0), RuntimeError, r"training_step takes dataloader_iter.*training_step\(self, batch")


def test_a_freed_lightning_optimizer_wrapper_leaves_the_accumulator_alone() -> None:
    """LightningOptimizer's class subclasses the wrapped optimizer's and forwards attribute reads to it: when a
    wrapper goes, the accumulator's __del__ runs on it, and must not remove the live accumulator's hooks or
    release its finished gradients."""
    from lightning.pytorch.core.optimizer import LightningOptimizer

    model = torch.nn.Linear(4, 4)
    accumulator = gafused.GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 1)
    accumulator.backward(model(torch.randn(3, 4)).sum())
    accumulator.step()
    hooks, published = len(accumulator._hooks._handles), len(accumulator._published_hooks)
    assert hooks > 0 and published > 0
    wrapper = LightningOptimizer(accumulator)
    assert isinstance(wrapper, gafused.GradAccumulator)
    assert repr(wrapper) == repr(accumulator) and repr(wrapper).startswith("GradAccumulator(SGD, ")
    with pytest.raises(AttributeError, match="micro_step"):
        wrapper.micro_step = 0  # read-only on the accumulator, through the wrapper too
    del wrapper
    assert (len(accumulator._hooks._handles), len(accumulator._published_hooks)) == (hooks, published)
    assert all(p.grad is not None for p in model.parameters())


def test_the_callbacks_options_reach_the_accumulator() -> None:
    """accum_dtype, backend and bucket_bytes are the accumulator's; the run is still the float64 big batch."""
    _, TinyLM, _ = cases._lightning_classes()
    callback = GradAccumulation(
        weight=cases.tokens, max_grad_norm=cases.MAX_NORM, accum_dtype=torch.float64, backend="reference",
        bucket_bytes=4096,
    )  # fmt: skip
    module = TinyLM(0)
    _quiet_trainer(callbacks=[callback]).fit(module)
    accumulator = callback.accumulator
    assert accumulator.accum_dtype == torch.float64 and accumulator.backend == "reference"
    assert accumulator.max_grad_norm == cases.MAX_NORM
    assert callback._module is None and callback._plugin is None  # nothing of the fit is held but the accumulator
    assert all(len(buffer.bucket_ranges) > 1 for buffer in accumulator.buffers)  # 4 KiB buckets: several
    truth_params, initial, _ = cases.truth(1)
    assert cases.error([p.detach() for p in module.model.parameters()], truth_params, initial) < FP32_ERROR


def test_stopping_with_one_micro_batch_in_the_window_warns() -> None:
    """The fit stops right after the first batch of the second window: that micro-batch was never applied (as with
    Lightning's own accumulation), and the callback says so."""
    _, TinyLM, _ = cases._lightning_classes()

    class Stopping(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if args[-1] == cases.N:  # batch_idx: the second window's first batch
                trainer.should_stop = True

    callback = GradAccumulation(weight=cases.tokens)
    with pytest.warns(UserWarning, match=r"training ended with 1 micro-batch\(es\) in a window Lightning did not step"):
        _quiet_trainer(callbacks=[Stopping(), callback]).fit(TinyLM(0))
    assert callback.accumulator.micro_step == 1


def test_a_fit_that_raises_gives_the_precision_plugin_its_backward_back() -> None:
    """Lightning runs no teardown hook when fit raises mid-training: the plugin's own backward comes back anyway,
    and the callback lets go of the module."""
    _, TinyLM, _ = cases._lightning_classes()
    callback = GradAccumulation(weight=lambda batch: -1.0)
    trainer = _quiet_trainer(callbacks=[callback], limit_train_batches=2)
    with pytest.raises(ValueError, match="weight"):
        trainer.fit(TinyLM(0))
    assert "backward" not in trainer.precision_plugin.__dict__
    assert callback._plugin is None and callback._module is None


@pytest.mark.parametrize("hook", ["on_after_backward", "on_before_optimizer_step"])
def test_an_error_after_a_windows_last_backward_leaves_the_users_error_and_a_checkpoint(hook: str, tmp_path) -> None:
    """An error raised between a window's last backward and Lightning's optimizer step (a failing check in
    on_after_backward or on_before_optimizer_step, a Ctrl-C): that micro-batch cannot end, so the window is discarded,
    as Lightning's own accumulation loses it. state_dict() refused a micro-batch half ended, so OnExceptionCheckpoint
    wrote nothing and its RuntimeError replaced the user's error."""
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    _, TinyLM, _ = cases._lightning_classes()

    class FailingCheck(pl.Callback):
        def __init__(self) -> None:
            self.calls = {"on_after_backward": 0, "on_before_optimizer_step": 0}

        def _count(self, name: str, at: int) -> None:
            self.calls[name] += 1
            if name == hook and self.calls[name] == at:
                raise RuntimeError("the user's check failed")

        def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self._count("on_after_backward", 2 * cases.N)  # the second window's last batch

        def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
            self._count("on_before_optimizer_step", 2)

    callback = GradAccumulation(weight=cases.tokens)
    checkpoint = OnExceptionCheckpoint(str(tmp_path), filename="on_exception")
    trainer = _quiet_trainer(
        callbacks=[FailingCheck(), callback, checkpoint], default_root_dir=str(tmp_path), enable_checkpointing=True
    )
    module = TinyLM(0)
    with pytest.raises(RuntimeError, match="the user's check failed") as raised:
        trainer.fit(module)
    assert any("the window was discarded" in note for note in getattr(raised.value, "__notes__", []))
    assert callback.accumulator.micro_step == 0 and all(p.grad is None for p in module.parameters())
    saved = torch.load(tmp_path / "on_exception.ckpt", weights_only=False)
    assert saved["optimizer_states"][0]["gafused"]["micro_step"] == 0
    assert saved["global_step"] == 1  # the first window stepped, the second did not
    assert all(torch.equal(value, module.state_dict()[name]) for name, value in saved["state_dict"].items())


def test_reduce_dtype_reaches_the_accumulator_under_ddp() -> None:
    """DDP on one gloo process, in this one: reduce_dtype is DDP's buckets' wire dtype."""
    _, TinyLM, _ = cases._lightning_classes()
    callback = GradAccumulation(weight=cases.tokens, reduce_dtype=torch.bfloat16)
    environ = dict(os.environ)
    try:
        trainer = _quiet_trainer(
            callbacks=[callback], strategy=pl.strategies.DDPStrategy(process_group_backend="gloo"),
            limit_train_batches=cases.N,
        )  # fmt: skip
        trainer.fit(TinyLM(0))
        assert callback.accumulator._sync.world_size == 1  # DDP's (the strategy unwrapped its module at teardown)
        assert callback.accumulator._sync.reduce_dtype == torch.bfloat16
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)


def test_a_checkpoint_between_windows_holds_no_rank_windows() -> None:
    """Under DDP the callback's state gathers the ranks' open windows only when one is open: a checkpoint taken
    between windows holds none (and resumes on any number of ranks). Several ranks stand in by _world_size here: the
    gather would need their process group."""
    _, TinyLM, _ = cases._lightning_classes()
    callback = GradAccumulation(weight=cases.tokens)
    _quiet_trainer(callbacks=[callback], limit_train_batches=cases.N).fit(TinyLM(0))
    assert callback.accumulator.micro_step == 0
    callback._world_size = 2
    assert callback.state_dict() == {"version": 1, "windows": None}


def test_gradient_clip_val_zero_is_no_clipping_and_is_accepted() -> None:
    _, TinyLM, _ = cases._lightning_classes()
    module = TinyLM(0)
    callback = GradAccumulation(weight=cases.tokens, max_grad_norm=cases.MAX_NORM)
    _quiet_trainer(callbacks=[callback], gradient_clip_val=0.0).fit(module)
    truth_params, initial, _ = cases.truth(1)
    assert cases.error([p.detach() for p in module.model.parameters()], truth_params, initial) < FP32_ERROR


def test_fp16_loss_scaling_is_refused() -> None:
    from lightning.pytorch.plugins.precision import MixedPrecision

    _, TinyLM, _ = cases._lightning_classes()
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    _fit_refused(TinyLM(0), RuntimeError, r'does not support precision="16-mixed"', plugins=[plugin])


def test_a_strategy_other_than_single_device_or_ddp_is_refused() -> None:
    """FSDP needs a GPU in Lightning: the check is called with it directly."""
    from types import SimpleNamespace

    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.strategies import FSDPStrategy

    from gafused.integrations.lightning import _check_trainer

    _, TinyLM, _ = cases._lightning_classes()
    real = _quiet_trainer()
    fake = SimpleNamespace(
        fit_loop=real.fit_loop, gradient_clip_val=None, strategy=FSDPStrategy(), precision_plugin=Precision()
    )
    with pytest.raises(RuntimeError, match="supports the single-device strategy and DDP; got FSDPStrategy"):
        _check_trainer(fake, TinyLM(0))


def test_stepping_the_accumulator_by_hand_is_refused() -> None:
    _, TinyLM, _ = cases._lightning_classes()
    callback = GradAccumulation(weight=cases.tokens)
    _quiet_trainer(callbacks=[callback], limit_train_batches=cases.N).fit(TinyLM(0))
    for kwargs in ({}, {"weight": 2.0}, {"end_window": True}):
        with pytest.raises(RuntimeError, match="Do not step it yourself"):
            callback.accumulator.step(**kwargs)
    assert callback.accumulator.micro_step == 0


def test_a_ctrl_c_after_a_windows_last_backward_leaves_a_checkpoint(tmp_path) -> None:
    """A KeyboardInterrupt (Ctrl-C) between a window's last backward and Lightning's optimizer step: Lightning calls
    on_exception (OnExceptionCheckpoint saves) and exits with SystemExit. The window is discarded as for any error,
    so the checkpoint holds no micro-batch half ended (state_dict() would refuse it and its RuntimeError would
    replace Lightning's exit)."""
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    _, TinyLM, _ = cases._lightning_classes()

    class CtrlC(pl.Callback):
        calls = 0

        def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            CtrlC.calls += 1
            if CtrlC.calls == 2 * cases.N:  # the second window's last batch
                raise KeyboardInterrupt

    callback = GradAccumulation(weight=cases.tokens)
    checkpoint = OnExceptionCheckpoint(str(tmp_path), filename="on_exception")
    trainer = _quiet_trainer(
        callbacks=[CtrlC(), callback, checkpoint], default_root_dir=str(tmp_path), enable_checkpointing=True
    )
    module = TinyLM(0)
    handler = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit):  # Lightning's graceful shutdown after a KeyboardInterrupt
            trainer.fit(module)
    finally:
        signal.signal(signal.SIGINT, handler)  # Lightning ignores SIGINT from then on
    assert callback.accumulator.micro_step == 0 and all(p.grad is None for p in module.parameters())
    saved = torch.load(tmp_path / "on_exception.ckpt", weights_only=False)
    assert saved["optimizer_states"][0]["gafused"]["micro_step"] == 0
    assert saved["global_step"] == 1  # the first window stepped, the second did not
