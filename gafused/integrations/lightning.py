"""Lightning: ``Trainer(accumulate_grad_batches=N)`` with gafused's exact, fused accumulation, one callback added.

    from gafused.integrations.lightning import GradAccumulation

    def loss_tokens(batch):                                          # at module level: "ddp_spawn" pickles it
        return (batch["labels"][..., 1:] != -100).sum()

    trainer = L.Trainer(
        accumulate_grad_batches=4,                                   # Lightning's own recipe, unchanged
        callbacks=[GradAccumulation(weight=loss_tokens, max_grad_norm=1.0)],  # the added line
    )

How Lightning 2.x drives automatic optimization (``lightning/pytorch/loops/optimization/automatic.py``,
``_AutomaticOptimization.run``), and what the callback does at each point:

- ``configure_optimizers`` returns the user's optimizer; after the strategy set it up (DDP-wrapped the model first),
  ``on_fit_start`` wraps it into a GradAccumulator with *driven* windows (``accumulation_steps=None``) and puts
  that in ``trainer.optimizers`` (a public setter). With DDP, ``model=`` is the strategy's DDP module, so gafused
  owns the gradient sync (DDP's all-reduce is turned off; one reduction per bucket per window). LR schedulers
  built on the user's optimizer keep working: the accumulator's ``param_groups`` are that optimizer's.
- Each batch Lightning divides the ``training_step`` loss by ``accumulate_grad_batches``
  (``ClosureResult.from_training_step_output``) and backpropagates it through ``strategy.backward`` ->
  ``precision.backward`` -> ``LightningModule.backward``. The callback takes over the precision plugin's
  ``backward`` (on the plugin instance, for the fit only; Lightning's ``on_before_backward`` and
  ``on_after_backward`` hooks run around it as before; the LightningModule itself is left untouched, so it can be
  copied or saved during fit) and calls ``GradAccumulator.backward(loss * N, weight=w, end_window=sync)``:
  gradients are folded during backward; multiplying by the same N undoes Lightning's division exactly (the
  gradient seed is N / N = 1), since gafused weighs micro-batches itself. ``w`` is ``weight(batch)``, computed in
  ``on_train_batch_start``. ``sync`` is Lightning's own decision, ``fit_loop._should_accumulate()`` (the N-th batch
  of a window or the last batch of the epoch: the partial last window).
- On batches that only accumulate, Lightning runs the closure and never calls the optimizer: the callback ends
  the micro-batch right after its backward. On the window's last batch Lightning calls ``optimizer.step(closure)``
  through the precision plugin; the accumulator runs the closure (forward, the backward above, then Lightning's
  ``on_before_optimizer_step`` and gradient-clipping hooks) and finishes the window: weighted mean, global norm,
  ``max_grad_norm`` clipping, inner step. Lightning then steps ``interval="step"`` schedulers once: per window.
- Lightning's ``gradient_clip_val`` would clip ``p.grad`` inside the closure, before the window is finished (there
  is nothing there: gradients are folded into the buffer), so it is refused: pass ``max_grad_norm`` instead.
- Checkpoints: Lightning saves ``optimizer.state_dict()``, which for the accumulator holds the open window, and
  loads it into the accumulator on resume. Under DDP only rank 0 writes the file, so the callback's own state
  carries the other ranks' open windows (gathered when a checkpoint is taken mid-window) and gives each rank its
  own back in ``on_train_start``.

The callback checks Lightning's decisions against its own reading: a window that Lightning steps where the callback
saw no end, or one it declared over that Lightning does not step, raises rather than train on.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler
    from lightning.pytorch.plugins.precision import MixedPrecision, Precision
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
    from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
except ImportError as error:  # pragma: no cover - exercised only without lightning
    raise ImportError(
        "gafused.integrations.lightning needs Lightning 2.x (import lightning.pytorch): "
        'pip install "gafused[lightning]"'
    ) from error

from gafused.accumulator import GradAccumulator, _add_note, check_options
from gafused.buffer import DEFAULT_BUCKET_BYTES

__all__ = ["GradAccumulation"]

_STATE_VERSION = 1


class _LightningAccumulator(GradAccumulator):
    """A GradAccumulator whose ``step(closure)`` is Lightning's call on the last batch of a window.

    Lightning calls ``optimizer.step(closure)`` only on a window's last batch; the closure runs that batch's
    ``training_step`` and backward (the callback's, which declares the window's end). If ``training_step`` returned
    None there, no backward ran: the window is finished with the micro-batches it holds, as Lightning steps on the
    gradients accumulated so far.
    """

    _lightning_in_step = False  # inside Lightning's step(closure): a backward now must be a window's last
    _lightning_end_declared = False  # a backward declared the window's end; its step() has not come yet

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused, as for any GradAccumulator, with what a Lightning user can do about it."""
        raise RuntimeError(
            "add_param_group(): under GradAccumulation the optimizer is a GradAccumulator, whose buffers are laid out "
            "for the parameters it was built with, so a group cannot be added during fit (as Lightning's "
            "BaseFinetuning / BackboneFinetuning callbacks do when they unfreeze). Put every parameter in the "
            "optimizer from configure_optimizers (a frozen one, requires_grad=False, takes no gradient until it is "
            "unfrozen), or train without GradAccumulation"
        )

    @torch._disable_dynamo
    def step(
        self,
        closure: Callable[[], Any] | None = None,
        *,
        weight: float | torch.Tensor | None = None,
        end_window: bool = False,
    ) -> Any:
        if closure is None or weight is not None or end_window:
            raise RuntimeError(
                "step(): under GradAccumulation, Lightning steps the accumulator (optimizer.step(closure) on the last "
                "batch of each window); it takes no weight or end_window. Do not step it yourself"
            )
        self._lightning_in_step = True
        try:
            with torch.enable_grad():
                result = closure()
        except BaseException as error:
            if self._micro is not None:
                # The window's last backward ran (its buckets are finished in place), its step will not: a checkpoint
                # taken on this exception (OnExceptionCheckpoint) could not hold a micro-batch half ended.
                self._lightning_end_declared = False
                self._discard_window()
                _add_note(
                    error,
                    "gafused: the window was discarded (its last batch's backward had run, Lightning's optimizer step "
                    "had not), as Lightning's own accumulation loses it",
                )
            raise
        finally:
            self._lightning_in_step = False
        if self._lightning_end_declared:
            self._lightning_end_declared = False
            GradAccumulator.step(self)  # ends the micro-batch whose backward declared the window's end
        else:
            self.flush()  # training_step returned None on the window's last batch: finish the window without it
        return result

    @torch._disable_dynamo
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Lightning restores rank 0's optimizer state on every rank; another rank's open window is not loaded here
        (GradAccumulation.on_train_start loads each rank's own window from the callback's state)."""
        window = state_dict.get("gafused") if isinstance(state_dict, dict) else None
        # Another rank's window of a run on as many ranks: this rank's own comes from the callback's state. One of a
        # run on another number of ranks is loaded as it is, so that every rank refuses it alike (rank 0 alone
        # refusing would leave the others waiting for it in Lightning's next barrier).
        if (
            isinstance(window, dict)
            and window.get("rank", self._sync.rank) != self._sync.rank
            and window.get("world_size", 1) == self._sync.world_size
        ):
            closed = {**window, "micro_step": 0, "rank": self._sync.rank, "weight_sum": None, "bad_weight": None}
            closed["buffers"] = [
                {key: value for key, value in entry.items() if key != "segments"} if isinstance(entry, dict) else entry
                for entry in window.get("buffers") or []
            ]
            state_dict = {**state_dict, "gafused": closed}
        GradAccumulator.load_state_dict(self, state_dict)


class GradAccumulation(Callback):
    """Make ``Trainer(accumulate_grad_batches=N)`` accumulate with gafused: token-weighted, exact partial windows,
    global-norm clipping of the finished gradient, checkpoints that carry the open window, on one process or DDP.

    Add it to the Trainer's callbacks and keep the recipe: ``configure_optimizers`` returns the plain optimizer (and
    schedulers), ``training_step`` returns the micro-batch's mean loss. Lightning keeps deciding where windows end
    (every N batches and at the end of each epoch), counting ``global_step`` per window and stepping
    ``interval="step"`` schedulers once per window.

    Supported: automatic optimization, the single-device strategy and DDP (``"ddp"``, ``"ddp_spawn"``, ...;
    ``model=`` is the strategy's DDP module), precisions other than ``"16-mixed"``. Refused with an error: manual
    optimization (use GradAccumulator directly there), ``gradient_clip_val`` (use ``max_grad_norm``), fp16 loss
    scaling, strategies that accumulate themselves or shard (DeepSpeed, FSDP), a LightningModule that overrides
    ``backward`` or ``configure_gradient_clipping``, a precision plugin that overrides ``backward``, and a
    ``configure_optimizers`` that returns a GradAccumulator.

    Args:
        weight: a callable taking the batch (as ``training_step`` receives it) and returning its weight: a
            non-negative number or 0-d tensor (returning None is refused), e.g. the loss tokens
            ``(batch["labels"][..., 1:] != -100).sum()``. Under ``"ddp_spawn"`` Lightning pickles the callback: a
            function defined at module level, not a lambda or a nested function. None weighs every batch 1 (the
            mean of the micro-batch losses, exact on partial windows).
        max_grad_norm: clip each window's finished gradient to this global L2 norm (what
            ``torch.nn.utils.clip_grad_norm_`` does on the big batch); None disables clipping.
        accum_dtype: as in GradAccumulator: ``torch.float32`` (default) or ``torch.float64``.
        backend: as in GradAccumulator.
        bucket_bytes: as in GradAccumulator.
        reduce_dtype: as in GradAccumulator, under DDP only.
    """

    def __init__(
        self,
        weight: Callable[[Any], float | torch.Tensor] | None = None,
        max_grad_norm: float | None = None,
        *,
        accum_dtype: torch.dtype = torch.float32,
        backend: str = "auto",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        reduce_dtype: torch.dtype | None = None,
    ) -> None:
        if weight is not None and not callable(weight):
            raise TypeError(
                f"weight must be a callable taking the batch and returning its weight, or None; got "
                f"{type(weight).__name__}"
            )
        check_options(
            max_grad_norm=max_grad_norm,
            accum_dtype=accum_dtype,
            backend=backend,
            bucket_bytes=bucket_bytes,
            reduce_dtype=reduce_dtype,
        )
        self.weight = weight
        self.max_grad_norm = max_grad_norm
        self._options = {"accum_dtype": accum_dtype, "backend": backend, "bucket_bytes": bucket_bytes}
        self._reduce_dtype = reduce_dtype
        self._accumulator: _LightningAccumulator | None = None
        self._module: pl.LightningModule | None = None
        self._plugin: Precision | None = None  # the precision plugin whose backward is routed here during fit
        self._batch_weight: float | torch.Tensor | None = None
        self._loaded_windows: list[dict[str, Any] | None] | None = None
        # Micro-batches of the open window a resumed fit started with, until its first batch starts.
        self._resumed_open = 0
        self._process_group: Any = None  # DDP's, when the strategy is DDP
        self._world_size = 1

    @property
    def accumulator(self) -> GradAccumulator | None:
        """The GradAccumulator this callback drives (``trainer.optimizers[0]`` during fit), None before fit."""
        return self._accumulator

    # --- set-up --------------------------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            _check_trainer(trainer, pl_module)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _check_trainer(trainer, pl_module)  # again: the strategy and the precision plugin are final now
        optimizers = trainer.optimizers
        if len(optimizers) != 1:
            raise RuntimeError(
                f"GradAccumulation: configure_optimizers returned {len(optimizers)} optimizers; automatic optimization "
                "with gafused takes exactly one"
            )
        inner = optimizers[0]
        if isinstance(inner, GradAccumulator):
            raise TypeError(
                "GradAccumulation: configure_optimizers returned a GradAccumulator; return the plain optimizer "
                "instead: the callback wraps it (driven by Lightning's windows, with DDP's module as model=)"
            )
        model = trainer.strategy.model
        distributed = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        if self._reduce_dtype is not None and not distributed:
            raise ValueError("GradAccumulation: reduce_dtype is for DDP's buckets; the strategy here is not DDP")
        self._accumulator = _LightningAccumulator(
            inner,
            None,
            self.max_grad_norm,
            model=model if distributed else None,
            reduce_dtype=self._reduce_dtype if distributed else None,
            **self._options,
        )
        trainer.optimizers = [self._accumulator]
        self._process_group = model.process_group if distributed else None
        self._world_size = torch.distributed.get_world_size(self._process_group) if distributed else 1
        self._attach(trainer.strategy.precision_plugin, pl_module)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """After Lightning restored the optimizers: give each rank its own open window from the checkpoint."""
        windows, self._loaded_windows = self._loaded_windows, None
        self._resumed_open = 0
        if windows is not None:
            self._load_windows(trainer, windows)
        if trainer.ckpt_path is not None:
            self._resumed_open = self._require_accumulator().micro_step

    def _load_windows(self, trainer: pl.Trainer, windows: list[dict[str, Any] | None]) -> None:
        if len(windows) != trainer.world_size:
            raise ValueError(
                f"GradAccumulation: the checkpoint holds an open window of {len(windows)} ranks; this run has "
                f"{trainer.world_size}. Resume on the same number of ranks, or from a checkpoint taken between windows"
            )
        window = windows[trainer.global_rank]
        if window is not None:  # rank 0's window came with Lightning's optimizer_states
            accumulator = self._require_accumulator()
            accumulator.load_state_dict({**accumulator.optimizer.state_dict(), "gafused": window})

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        accumulator = self._require_accumulator()
        if accumulator.micro_step != 0:
            warnings.warn(
                f"GradAccumulation: training ended with {accumulator.micro_step} micro-batch(es) in a window Lightning "
                "did not step (stopped mid-window, or the data ran out before the length it announced); they were not "
                "applied, as with Lightning's own accumulation. The window is in the accumulator's state_dict()",
                UserWarning,
                stacklevel=2,
            )

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._detach()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._detach()  # Lightning calls no teardown hook when fit raises

    def _attach(self, plugin: Precision, pl_module: pl.LightningModule) -> None:
        """Route the precision plugin's backward through the accumulator (an instance attribute of the plugin,
        removed at teardown), rather than the LightningModule's: user code may copy or pickle the module during
        fit (an EMA or SWA copy, ``torch.save``), and a copy must not carry a route into this fit's accumulator."""
        self._detach()
        plugin.backward = self._backward
        self._plugin = plugin
        self._module = pl_module

    def _detach(self) -> None:
        if self._plugin is not None:
            self._plugin.__dict__.pop("backward", None)
            self._plugin = None
        self._module = None

    # --- every batch ---------------------------------------------------------------------------------------

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        accumulator = self._require_accumulator()
        resumed, self._resumed_open = self._resumed_open, 0
        if batch_idx % trainer.accumulate_grad_batches == 0 and accumulator.micro_step != 0:
            if resumed and batch_idx == 0:
                # Lightning's windows end with their epoch: an epoch's first batch begins the resumed fit, so the
                # checkpoint was taken at an epoch's end after a fit stopped mid-window (should_stop, as EarlyStopping
                # sets it), and Lightning resumes without that window's micro-batches.
                warnings.warn(
                    f"GradAccumulation: the checkpoint holds {accumulator.micro_step} micro-batch(es) of a window "
                    "Lightning did not step (the fit it was saved from stopped mid-window); Lightning resumes at the "
                    f"start of epoch {trainer.current_epoch}, where its windows begin again, so they are dropped, as "
                    "Lightning drops its own unstepped gradients",
                    UserWarning,
                    stacklevel=2,
                )
                accumulator._discard_window()
            else:
                raise RuntimeError(self._misaligned(trainer, batch_idx, accumulator.micro_step, bool(resumed)))
        if self.weight is None:
            self._batch_weight = None
            return
        weight = self.weight(batch)
        if weight is None:  # weight=None weighs a batch 1: a function that forgot to return must not do that
            raise TypeError(
                f"GradAccumulation(weight={self.weight!r}) returned None for batch {batch_idx}; it must return the "
                "batch's weight, a non-negative number or 0-d tensor"
            )
        self._batch_weight = weight

    @staticmethod
    def _misaligned(trainer: pl.Trainer, batch_idx: int, open_micro: int, resumed: bool) -> str:
        """The refusal of a batch where Lightning starts a window while gafused's is still open."""
        said = (
            f"GradAccumulation: Lightning starts a new window at batch {batch_idx} (accumulate_grad_batches="
            f"{trainer.accumulate_grad_batches}), but {open_micro} micro-batch(es) of the previous one were never "
            "stepped"
        )
        if resumed and any(isinstance(callback, GradientAccumulationScheduler) for callback in trainer.callbacks):
            return (
                f"{said}: this fit resumed mid-epoch, from a checkpoint taken inside a window, and Lightning applies "
                "a GradientAccumulationScheduler at an epoch's start only, so until this epoch ends it steps after "
                f"every {trainer.accumulate_grad_batches} batch(es), not as the window was cut. Resume from a "
                "checkpoint taken between windows (or at an epoch's end)"
            )
        if resumed:
            return (
                f"{said}: this fit resumed from a checkpoint saved during a batch (OnExceptionCheckpoint's, say), "
                "after which Lightning's batches and windows no longer line up. Lightning would drop their gradients; "
                "gafused does not drop them silently: resume from a checkpoint taken between windows"
            )
        return (
            f"{said} (on_train_batch_start returned -1 in the middle of a window, ending the epoch there). Lightning "
            "would drop their gradients; gafused does not drop them silently: return -1 at a window's first batch "
            "only (batch_idx % accumulate_grad_batches == 0)"
        )

    def _backward(
        self, loss: torch.Tensor, model: pl.LightningModule, optimizer: Any, *args: Any, **kwargs: Any
    ) -> None:
        """The precision plugin's ``backward(tensor, model, optimizer, ...)`` during fit: fold this micro-batch into
        the window, in place of the ``LightningModule.backward`` call the plugin would make (an override of it is
        refused, so nothing is skipped)."""
        accumulator = self._require_accumulator()
        if model is not self._module:
            raise RuntimeError(
                f"GradAccumulation: Lightning ran a backward for {type(model).__name__}, not the module being fit"
            )
        if args:
            raise TypeError(
                "GradAccumulation: the backward got positional arguments beyond the loss; pass "
                "retain_graph/create_graph/inputs by keyword"
            )
        trainer = model.trainer
        sync = not trainer.fit_loop._should_accumulate()
        if accumulator._lightning_in_step and not sync:
            raise RuntimeError(
                "GradAccumulation: Lightning stepped the optimizer on a batch its accumulation rule says only "
                "accumulates; the callback does not know this Lightning version's windows"
            )
        if accumulator._lightning_end_declared:
            raise RuntimeError(
                "GradAccumulation: the previous batch ended a window but Lightning did not step the optimizer"
            )
        if sync and not accumulator._lightning_in_step:
            raise RuntimeError(
                "GradAccumulation: this batch ends a window by Lightning's rule, but its backward runs outside "
                "optimizer.step(closure). If your LightningModule.optimizer_step calls optimizer_closure() itself, "
                "pass it to the step instead: optimizer.step(closure=optimizer_closure) (gafused then skips a "
                "non-finite window on its own); otherwise the callback does not know this Lightning version's windows"
            )
        # Lightning divided the loss by accumulate_grad_batches; gafused weighs the micro-batches itself.
        scaled = loss * trainer.accumulate_grad_batches
        try:
            accumulator.backward(scaled, weight=self._batch_weight, end_window=sync, **kwargs)
        except (TypeError, ValueError) as error:
            if self.weight is not None and "weight" in str(error):
                _add_note(
                    error, f"gafused: the weight came from GradAccumulation(weight={self.weight!r}) on this batch"
                )
            raise
        if sync:
            accumulator._lightning_end_declared = True
        else:
            GradAccumulator.step(accumulator)  # end the micro-batch: Lightning calls no optimizer method here

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._batch_weight = None
        accumulator = self._require_accumulator()
        if accumulator._lightning_end_declared:
            accumulator._lightning_end_declared = False
            raise RuntimeError(
                "GradAccumulation: this batch ended a window by Lightning's rule but Lightning did not step the "
                "optimizer; the callback does not know this Lightning version's windows"
            )

    # --- checkpoints ---------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Under DDP with a window open, every rank's window (Lightning writes only rank 0's optimizer state).

        Collective then: Lightning builds a checkpoint on every rank (``trainer.save_checkpoint`` is called on all).
        """
        accumulator = self._accumulator
        state: dict[str, Any] = {"version": _STATE_VERSION, "windows": None}
        if accumulator is None or accumulator.micro_step == 0 or self._world_size == 1:
            return state  # every rank takes this branch alike: ranks run the same micro-steps
        window = _to_cpu(accumulator.state_dict()["gafused"])
        gathered: list[Any] = [None] * self._world_size
        torch.distributed.all_gather_object(gathered, window, group=self._process_group)
        gathered[0] = None  # rank 0's window is in Lightning's optimizer_states
        state["windows"] = gathered
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not isinstance(state_dict, dict) or state_dict.get("version") != _STATE_VERSION:
            raise ValueError(
                f"GradAccumulation.load_state_dict: expected a dict with version {_STATE_VERSION}, got {state_dict!r}"
            )
        windows = state_dict.get("windows")
        if windows is not None and not isinstance(windows, list):
            raise ValueError(f"GradAccumulation state 'windows': expected None or a list, got {type(windows).__name__}")
        self._loaded_windows = windows

    def _require_accumulator(self) -> _LightningAccumulator:
        if self._accumulator is None:
            raise RuntimeError("GradAccumulation: no accumulator yet; it is built in on_fit_start")
        return self._accumulator


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, list):
        return [_to_cpu(item) for item in value]
    if isinstance(value, dict):
        return {key: _to_cpu(item) for key, item in value.items()}
    return value


def _check_trainer(trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
    """Refuse the configurations the callback cannot make exact, each with the reason and what to do instead."""
    if not callable(getattr(trainer.fit_loop, "_should_accumulate", None)):
        raise RuntimeError(
            f"GradAccumulation needs Lightning's fit_loop._should_accumulate() (Lightning 2.x) to know its windows; "
            f"this Lightning ({pl.__version__}) has none"
        )
    if is_param_in_hook_signature(pl_module.training_step, "dataloader_iter", explicit=True):
        raise RuntimeError(
            f"GradAccumulation: {type(pl_module).__name__}.training_step takes dataloader_iter and fetches its batches "
            "itself; Lightning then hands on_train_batch_start the batch before (or None), so the callback can tell "
            "neither where windows begin nor each batch's weight. Take the batch: training_step(self, batch, "
            "batch_idx)"
        )
    if not pl_module.automatic_optimization:
        raise RuntimeError(
            "GradAccumulation works with automatic optimization; with manual optimization return "
            "gafused.GradAccumulator from configure_optimizers and drive it from training_step (opt = "
            "self.optimizers(); opt.backward(loss, weight=w, end_window=self.trainer.is_last_batch); opt.step(); "
            "opt.zero_grad()) with Trainer(accumulate_grad_batches=1); global_step then counts micro-batches"
        )
    clip = trainer.gradient_clip_val
    if clip is not None and clip > 0:
        raise ValueError(
            f"Trainer(gradient_clip_val={clip}) with GradAccumulation: Lightning would clip p.grad before the window "
            "is finished, where gafused has already folded it; pass GradAccumulation(max_grad_norm=...) instead, which "
            "clips the finished gradient by its global norm (as clip_grad_norm_ on the big batch)"
        )
    for hook in ("backward", "configure_gradient_clipping"):
        if getattr(type(pl_module), hook) is not getattr(pl.LightningModule, hook):
            raise RuntimeError(
                f"GradAccumulation: {type(pl_module).__name__} overrides LightningModule.{hook}; the callback runs the "
                "backward itself (gafused folds gradients during backward, so p.grad is empty when Lightning's "
                "clipping hook runs). Remove the override (clip with GradAccumulation(max_grad_norm=...))"
            )
    strategy = trainer.strategy
    if strategy.handles_gradient_accumulation or not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)):
        raise RuntimeError(
            f"GradAccumulation supports the single-device strategy and DDP; got {type(strategy).__name__}"
        )
    precision = trainer.precision_plugin
    if type(precision).backward is not Precision.backward:
        raise RuntimeError(
            f"GradAccumulation: the precision plugin {type(precision).__name__} overrides Precision.backward; the "
            "callback runs the backward itself during fit, so that override would not run"
        )
    if isinstance(precision, MixedPrecision) and precision.scaler is not None:
        raise RuntimeError(
            'GradAccumulation does not support precision="16-mixed" (Lightning\'s GradScaler would step and unscale '
            'the accumulator); use "bf16-mixed", or gafused.GradAccumulator(grad_scaler=...) with manual optimization'
        )
