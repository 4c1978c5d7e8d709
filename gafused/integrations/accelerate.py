"""Hugging Face Accelerate: gafused under ``with accelerator.accumulate(model):``, windows ended by Accelerate.

Accelerate's recipe keeps its shape; after ``accelerator.prepare(...)`` one call hands the optimizer to gafused:

    import gafused.integrations.accelerate

    accelerator = Accelerator(gradient_accumulation_steps=4)
    model, optimizer, dataloader, scheduler = accelerator.prepare(model, optimizer, dataloader, scheduler)
    optimizer = gafused.integrations.accelerate.prepare(accelerator, model, optimizer, max_grad_norm=1.0)
    for batch in dataloader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss                              # mean over this micro-batch's tokens
            accelerator.backward(loss, weight=num_tokens(batch))    # no division by gradient_accumulation_steps
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()

What Accelerate does, and what ``prepare`` changes (accelerate 1.x, ``accelerator.py`` / ``optimizer.py``):

- **The window.** ``accumulate()`` sets ``accelerator.sync_gradients`` (``_do_sync``): True every
  ``gradient_accumulation_steps``-th micro-batch and on the last batch of a prepared dataloader
  (``end_of_dataloader``, the partial window). gafused's window is *driven* by that flag (``accumulation_steps=None``,
  ``end_window=accelerator.sync_gradients``), so it cannot disagree with Accelerate's count: there is no second count.
- **backward.** ``Accelerator.backward`` divides the loss by ``gradient_accumulation_steps`` (a partial window still by
  N, every micro-batch weighted alike). ``prepare`` replaces it on this accelerator by gafused's ``backward``: no
  division, the micro-batch's ``weight`` (token count) is given, gradients are folded during backward. fp16 loss
  scaling goes through gafused (``grad_scaler=accelerator.scaler``).
- **step / zero_grad.** ``AcceleratedOptimizer.step`` runs the inner step only when ``sync_gradients``; gafused needs
  every micro-batch's ``step()`` to end it. A loop that calls ``step()`` only ``if accelerator.sync_gradients``
  (right for plain Accelerate) would fold a window's micro-batches as one: ``prepare`` counts the ``accumulate()``
  blocks (``Accelerator._do_sync``), and a ``backward`` or ``step()`` after a block that left gradients no ``step()``
  ended raises. A block that runs no backward (a skipped batch) leaves nothing, nor does one whose ``step()`` failed
  (the inner optimizer raised: gafused discarded the window), so the loop goes on; a refused ``step()`` changes
  nothing and can be made again. A second ``step()`` in one block with no backward since the first would end a
  micro-batch without gradients (at the sync step, a window of its own: a second inner step on a zero gradient):
  it is refused in every block. The optimizer returned here is an ``AcceleratedOptimizer`` whose
  ``step()`` always reaches the accumulator (the window's last finishes it) and whose ``step_was_skipped`` says
  whether gafused skipped a non-finite window, which ``AcceleratedScheduler`` reads; the optimizer it replaces
  refuses ``step()`` and ``zero_grad()`` (a loop that kept it would bypass gafused) until ``free_memory()``. A
  forward, backward or ``step()`` made after its block's exit (before the next block) belongs to that block's
  micro-batch.
- **Outside ``accumulate()``.** Plain Accelerate also runs a loop with no ``accumulate()`` block: ``sync_gradients``
  keeps its last value (True from the start), ``backward`` still divides each loss by ``gradient_accumulation_steps``
  and every ``step()`` steps on the sum since ``zero_grad()``. gafused cannot tell those micro-batches apart (every
  backward until ``step()`` would be one undivided micro-batch), so with no ``accumulate()`` block entered since the
  last ``step()``, ``accelerator.backward`` is refused when ``gradient_accumulation_steps`` > 1 (Accelerate asks for
  ``accumulate()`` then too), and ``accelerator.backward`` or ``step()`` while ``sync_gradients`` is False (set by
  hand, or a second micro-batch in a block before the sync step); a refused call changes nothing. Otherwise each
  ``step()`` is a window of its own: plain Accelerate's update (after ``loss.backward()``, its undivided sum).
- **The scheduler** (``AcceleratedScheduler``) steps only when ``sync_gradients`` (and, without ``split_batches``,
  ``num_processes`` times, Accelerate's convention): once per gafused window. ``prepare`` points the accelerator's
  schedulers at the returned optimizer, so a skipped window does not advance them.
- **Clipping.** ``accelerator.clip_grad_norm_`` would clip per micro-batch (or, at the sync step, see no gradients:
  gafused releases them as it folds). gafused clips the finished gradient by its global norm (``max_grad_norm=``);
  ``accelerator.clip_grad_norm_`` / ``clip_grad_value_`` on its parameters raise.
- **DDP.** ``prepare()`` wraps the model in ``DistributedDataParallel``; it is passed to gafused as ``model=``, which
  turns DDP's own all-reduce off and reduces each bucket once per window with the global weight sum. The
  ``no_sync()`` that ``accumulate()`` enters is harmless, and ``accelerator.trigger_sync_in_backward(model)`` does
  nothing for that model: gafused's one reduction per window already gives plain Accelerate's result with the
  trigger, and DDP's all-reduce would be folded on top of it. Do not call it on the class
  (``Accelerator.trigger_sync_in_backward``): that switches DDP's all-reduce on behind the adapter. A backward inside
  it whose forward ran before it (Accelerate's documented use) is refused; one whose forward ran inside it cannot be
  told from a plain backward and would be counted twice.
- **Checkpoints.** ``save_state`` saves the optimizer's ``state_dict()`` (gafused's open window included) from the
  main process only, and ``accelerator.step`` (Accelerate's position in the window) per process. Under DDP each rank's
  open window holds its own, unreduced, part, so a save-state hook writes every rank's window to
  ``gafused_window_<rank>.bin`` and a load-state hook gives it back to that rank: a checkpoint taken mid-window resumes
  bitwise. Call ``load_state`` after ``prepare``: before it, Accelerate's own optimizer would drop the open window, so
  ``prepare`` refuses an ``accelerator.step`` in the middle of a window (``free_memory()`` resets it).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

try:
    import accelerate
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.scheduler import AcceleratedScheduler
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError(
        'gafused.integrations.accelerate needs Hugging Face Accelerate: pip install "gafused[accelerate]"'
    ) from error

from gafused.accumulator import GradAccumulator
from gafused.buffer import DEFAULT_BUCKET_BYTES

__all__ = ["AcceleratedGradAccumulator", "prepare", "WINDOW_FILE"]

WINDOW_FILE = "gafused_window_{rank}.bin"  # one per process, beside Accelerate's optimizer.bin
# Process-wise DDP and one process: what gafused owns gradient sync for. Everything else is refused by name.
# (Names, not members: older Accelerate releases lack some of them.)
_SUPPORTED = frozenset(
    ("NO", "MULTI_CPU", "MULTI_GPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_MUSA", "MULTI_SDAA", "MULTI_HPU")
)
_BACKWARD_KWARGS = ("retain_graph", "create_graph", "inputs")
_STEP_EVERY_BLOCK = (
    "with gafused, call optimizer.step() and optimizer.zero_grad() in every accelerator.accumulate() block, not only "
    "when accelerator.sync_gradients: each step() ends its micro-batch (the inner optimizer runs at the sync step "
    "only), and without it the micro-batches would be summed as one"
)


def _outside_block(call: str, steps: int) -> str:
    """Why ``call``, made with no ``accumulate()`` block entered since the last ``step()``, is refused: Accelerate
    divides by ``steps`` (``accelerator.backward``, ``steps`` > 1), or ``sync_gradients`` is False."""
    if call.startswith("accelerator.backward") and steps != 1:
        why = (
            f"gradient_accumulation_steps is {steps}: plain Accelerate divides each loss by {steps} and steps with "
            "the sum of the divided gradients, while gafused does not divide: every backward until the next step() "
            f"would be folded into one micro-batch of weight 1, an update {steps} times plain Accelerate's"
        )
    else:
        why = (
            "accelerator.sync_gradients is False: plain Accelerate would not step here and would go on summing the "
            "gradients until a sync step, while gafused would end a micro-batch here and average the micro-batches "
            "at the window's end"
        )
    return (
        f"{call}: no accelerator.accumulate(model) block was entered since the last optimizer.step(), and {why}; "
        "gafused's windows are Accelerate's accumulate() windows: run each micro-batch in "
        "`with accelerator.accumulate(model):` and call optimizer.step() and optimizer.zero_grad() in every block"
    )


class AcceleratedGradAccumulator(AcceleratedOptimizer):
    """The optimizer ``prepare`` returns: Accelerate's optimizer wrapper around a driven ``GradAccumulator``.

    Every ``step()`` ends a micro-batch; the one where ``accelerator.sync_gradients`` is True (Accelerate's sync step,
    or the last batch of the dataloader) finishes the window and runs the inner optimizer. ``state_dict()`` is the
    accumulator's (the open window included). Build it with ``prepare``, not directly.

    Args:
        accumulator: a driven ``GradAccumulator`` (``accumulation_steps=None``) over the prepared optimizer.
        num_processes: the accelerator's processes; with several, an open window is loaded only from each process's
            own ``WINDOW_FILE``.

    Attributes:
        accumulator: the ``GradAccumulator`` (also ``self.optimizer``, as in ``AcceleratedOptimizer``).
    """

    def __init__(self, accumulator: GradAccumulator, num_processes: int = 1) -> None:
        # No device placement (prepare() placed the inner optimizer's state already) and no scaler: the accumulator
        # scales the loss and updates the scaler itself, once per window.
        super().__init__(accumulator, device_placement=False, scaler=None)
        self.accumulator = accumulator
        # A block that runs no backward and still calls step() is a micro-batch of weight 1, as Accelerate's
        # division by gradient_accumulation_steps counts it (a second such step() in a block is refused here).
        accumulator._counts_empty_steps = True
        self._is_accelerate_prepared = True
        self._num_processes = num_processes
        self._loaded_window: dict[str, Any] | None = None  # this rank's window, read by the load-state hook
        # accumulate() blocks entered on the accelerator (counted by _enter_block), and how many had been when step()
        # last ran (or when the blocks since left nothing to end) / when the open micro-batch's backward ran: every
        # block that runs a backward must end with its own step().
        self._blocks = 0
        self._blocks_at_step = 0
        self._blocks_at_backward = 0

    # What a gafused loop reads, from the accumulator.
    @property
    def stepped(self) -> bool:
        """Whether the last ``step()`` ran the inner optimizer (it finished a window that was not skipped)."""
        return self.accumulator.stepped

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """Global L2 norm of the last finished gradient, before clipping (None before the first window)."""
        return self.accumulator.grad_norm

    @property
    def micro_step(self) -> int:
        """Micro-batches in the open window."""
        return self.accumulator.micro_step

    @property
    def skipped_steps(self) -> int:
        """Windows skipped because their finished gradient was not finite."""
        return self.accumulator.skipped_steps

    def step(self, closure: Callable[[], Any] | None = None, *, weight: float | torch.Tensor | None = None) -> Any:
        """End this micro-batch; at Accelerate's sync step, finish the window and step the inner optimizer.

        Args:
            closure: as in ``torch.optim.Optimizer.step``.
            weight: for a loop that calls ``loss.backward()`` itself: this micro-batch's weight (token count). After
                ``accelerator.backward(loss, weight=w)`` it takes none.
        """
        if self._blocks - self._blocks_at_step > 1:
            raise RuntimeError(
                f"optimizer.step(): {self._blocks - self._blocks_at_step} accelerator.accumulate() blocks ran since "
                "the last optimizer.step(), and an earlier one left gradients no step() ended; " + _STEP_EVERY_BLOCK
            )
        if self._blocks == self._blocks_at_step and self._blocks > 0 and not self._holds_unended():
            raise RuntimeError(
                "optimizer.step(): this accelerator.accumulate() block's micro-batch was already ended by an earlier "
                "optimizer.step(), and no backward ran since: a second step() would end a micro-batch without "
                "gradients (at the sync step, a window of its own: the inner optimizer would step again on a zero "
                "gradient); call optimizer.step() once per accumulate() block"
            )
        sync = self.gradient_state.sync_gradients
        if not sync and self._blocks == self._blocks_at_step:
            raise RuntimeError(_outside_block("optimizer.step()", self.gradient_state.num_steps))
        # A refused call changes nothing (the same call can be made again in this block); a failed inner step
        # discards the window, and the next block finds nothing left to end (_enter_block).
        result = self.accumulator.step(closure, weight=weight, end_window=sync)
        self._blocks_at_step = self._blocks
        # What AcceleratedScheduler reads: a window that ended without an inner step was skipped (non-finite).
        self._is_overflow = sync and not self.accumulator.stepped
        return result

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Release the managed gradients, at every micro-batch (Accelerate's wrapper does it at sync steps only)."""
        self.accumulator.zero_grad()

    def _enter_block(self) -> None:
        """Count an ``accumulate()`` block. The blocks since the last ``step()`` are settled when they left nothing
        for a ``step()`` to end: they ran no backward, their gradients were dropped (``zero_grad()``), or a failed
        inner step discarded the window. Only a micro-batch or gradient still waiting makes a later ``step()`` (or
        ``accelerator.backward``) refuse."""
        if self._blocks != self._blocks_at_step and not self._holds_unended():
            self._blocks_at_step = self._blocks
        self._blocks += 1

    def _holds_unended(self) -> bool:
        """Whether an open micro-batch, or a managed gradient that no ``step()`` has folded, waits for a ``step()``
        (the finished gradient handed to the last inner step does not)."""
        accumulator = self.accumulator
        return accumulator._micro is not None or bool(accumulator._unfolded_names())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the accumulator's state; under ``load_state``, the open window is this process's own file's.

        A plain Accelerate checkpoint (the inner optimizer's state alone) loads with an empty window: plain
        Accelerate saves no gradients either, so a window it was saved in the middle of resumes without its earlier
        micro-batches in both."""
        window, self._loaded_window = self._loaded_window, None
        if window is not None and isinstance(state_dict, dict):
            # Every process is at the same position of a window: a file that disagrees belongs to another checkpoint.
            saved = state_dict.get("gafused")
            if saved is None and "param_groups" in state_dict:
                raise ValueError(
                    f"state_dict: a plain optimizer state beside a gafused window file ({WINDOW_FILE}): they come "
                    "from different checkpoints"
                )
            if isinstance(saved, dict) and saved.get("micro_step") != window.get("micro_step"):
                raise ValueError(
                    f"state_dict['gafused']['micro_step']: {saved.get('micro_step')!r}, but this process's window "
                    f"file ({WINDOW_FILE}) is at micro_step {window.get('micro_step')!r}: they come from different "
                    "checkpoints"
                )
            state_dict = {**state_dict, "gafused": window}
        elif isinstance(state_dict, dict) and _open_window(state_dict) and self._num_processes > 1:
            raise ValueError(
                "state_dict['gafused']: this checkpoint holds an open window of one process only; under "
                f"Accelerate each process's window is saved to {WINDOW_FILE} by accelerator.save_state(), "
                "called on every process"
            )
        self.accumulator.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.accumulator.add_param_group(param_group)  # refused, with the accumulator's reason


def _open_window(state_dict: dict[str, Any]) -> bool:
    window = state_dict.get("gafused")
    return isinstance(window, dict) and isinstance(window.get("micro_step"), int) and window["micro_step"] > 0


def prepare(
    accelerator: Accelerator,
    model: torch.nn.Module,
    optimizer: AcceleratedOptimizer,
    *,
    max_grad_norm: float | None = None,
    accum_dtype: torch.dtype = torch.float32,
    backend: str = "auto",
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    reduce_dtype: torch.dtype | None = None,
    normalization: str = "mean",
) -> AcceleratedGradAccumulator:
    """Hand the optimizer of a prepared Accelerate loop to gafused; call it right after ``accelerator.prepare``
    (before ``accelerator.load_state``: with ``accelerator.step`` in the middle of a window it raises).

    The window is Accelerate's: it ends where ``accelerator.sync_gradients`` is True (every
    ``gradient_accumulation_steps`` micro-batches inside ``accelerator.accumulate(model)``, and at the end of the
    dataloader). On this accelerator, ``accelerator.backward(loss, weight=w)`` then folds the micro-batch with weight
    ``w`` during backward (no division by ``gradient_accumulation_steps``), ``optimizer.step()`` ends every
    micro-batch, gafused clips the finished gradient (``accelerator.clip_grad_norm_`` on these parameters raises),
    and ``save_state`` / ``load_state`` carry each process's open window.

    Args:
        accelerator: the ``Accelerator`` that prepared ``model`` and ``optimizer`` (one process, or DDP).
        model: the model ``accelerator.prepare`` returned (under DDP, the ``DistributedDataParallel`` module:
            gafused owns its gradient sync).
        optimizer: the optimizer ``accelerator.prepare`` returned (an ``AcceleratedOptimizer`` around a plain
            ``torch.optim.Optimizer``, not around a ``GradAccumulator``). The accelerator's only optimizer.
        max_grad_norm: clip the window's finished gradient to this global L2 norm; None disables clipping.
        accum_dtype: as in ``GradAccumulator``.
        backend: as in ``GradAccumulator``.
        bucket_bytes: as in ``GradAccumulator``.
        reduce_dtype: as in ``GradAccumulator`` (DDP only).
        normalization: as in ``GradAccumulator``: ``"mean"`` for losses mean-reduced over their micro-batch (give
            the weight), ``"sum"`` for losses already normalized over the whole window and every process.

    Returns:
        The optimizer to use from now on (replacing ``optimizer`` in the accelerator and its schedulers).
    """
    if not isinstance(accelerator, Accelerator):
        raise TypeError(f"accelerator must be an accelerate.Accelerator, got {type(accelerator).__name__}")
    for name in ("_do_sync", "_optimizers", "_schedulers", "_models"):
        if not hasattr(accelerator, name):
            raise RuntimeError(
                f"accelerator: this Accelerate ({accelerate.__version__}) has no Accelerator.{name}, which gafused's "
                "adapter needs (accelerate 1.x)"
            )
    stale = [s for s in accelerator._schedulers if isinstance(s, AcceleratedScheduler) and not hasattr(s, "optimizers")]
    if stale:
        raise RuntimeError(
            f"accelerator: this Accelerate ({accelerate.__version__}) has no AcceleratedScheduler.optimizers, which "
            "gafused's adapter points at its optimizer so that a skipped window does not step the scheduler "
            "(accelerate 1.x)"
        )
    if getattr(accelerator, "_gafused_optimizer", None) is not None:
        raise RuntimeError(
            "accelerator: gafused.integrations.accelerate.prepare() was already called on it; to prepare another run "
            "on this accelerator, call accelerator.free_memory() first (it forgets the prepared objects, gafused's too)"
        )
    if isinstance(optimizer, AcceleratedGradAccumulator):
        raise RuntimeError("optimizer: already prepared by gafused.integrations.accelerate.prepare()")
    if not isinstance(optimizer, AcceleratedOptimizer) or not any(optimizer is opt for opt in accelerator._optimizers):
        raise TypeError(
            "optimizer must be the optimizer returned by accelerator.prepare() (an AcceleratedOptimizer), got "
            f"{type(optimizer).__name__}"
        )
    if isinstance(optimizer.optimizer, GradAccumulator):
        raise TypeError(
            "optimizer: accelerator.prepare() was given a GradAccumulator; give it the plain torch optimizer and let "
            "gafused.integrations.accelerate.prepare() build the accumulator (its window is Accelerate's)"
        )
    if len(accelerator._optimizers) != 1:
        raise NotImplementedError(
            f"optimizer: the accelerator prepared {len(accelerator._optimizers)} optimizers; gafused's Accelerate "
            "adapter takes over accelerator.backward() and supports one optimizer per Accelerator"
        )
    # Accelerate records the model it was given (the DDP wrapper is only returned); torch.compile wraps last, so
    # the module inside its wrapper is unwrapped (unwrap_model given the wrapper would point it at the module
    # inside DDP: the model would lose its DDP wrapper).
    inner = getattr(model, "_orig_mod", model)
    unwrapped = accelerator.unwrap_model(inner)
    if not any(prepared is model or prepared is unwrapped for prepared in accelerator._models):
        raise TypeError(f"model must be the model returned by accelerator.prepare(), got {type(model).__name__}")
    distributed_type = getattr(accelerator.distributed_type, "value", accelerator.distributed_type)
    if distributed_type not in _SUPPORTED:
        raise NotImplementedError(
            f"accelerator: distributed_type {distributed_type} is not supported by gafused's Accelerate adapter "
            "(one process, or DDP)"
        )
    wrapped = inner if accelerator.num_processes > 1 else None
    if reduce_dtype is not None and wrapped is None:
        raise ValueError(
            "reduce_dtype is the dtype DDP's buckets are all-reduced in; this accelerator runs in one process "
            "(launch with accelerate launch or torchrun for DDP)"
        )
    if wrapped is not None and not isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(
            f"model: with {accelerator.num_processes} processes accelerator.prepare() returns a "
            f"DistributedDataParallel module, got {type(model).__name__}"
        )
    # Mid-window before prepare: a checkpoint loaded by Accelerate's optimizer (which drops gafused's open window;
    # the window-file hook is not installed yet), or micro-batches Accelerate's own backward already divided.
    steps = accelerator.gradient_accumulation_steps
    if accelerator.step % steps != 0:
        raise RuntimeError(
            f"accelerator: accelerator.step is {accelerator.step}, in the middle of a window of "
            f"gradient_accumulation_steps={steps}: accelerator.load_state() was called before "
            "gafused.integrations.accelerate.prepare() (the checkpoint's open window would be lost), or training "
            "ran before it. Call prepare() right after accelerator.prepare(), and accelerator.load_state() after it"
        )
    accumulator = GradAccumulator(
        optimizer.optimizer,
        None,  # driven: Accelerate's sync_gradients ends the window
        max_grad_norm,
        accum_dtype,
        backend,
        accelerator.scaler,
        bucket_bytes,
        model=wrapped,
        reduce_dtype=reduce_dtype,
        normalization=normalization,
    )
    prepared = AcceleratedGradAccumulator(accumulator, accelerator.num_processes)
    accelerator._optimizers[accelerator._optimizers.index(optimizer)] = prepared
    for scheduler in accelerator._schedulers:
        if isinstance(scheduler, AcceleratedScheduler):
            scheduler.optimizers = [prepared if opt is optimizer else opt for opt in scheduler.optimizers]
    _install(accelerator, prepared, wrapped, optimizer)
    return prepared


def _install(
    accelerator: Accelerator,
    prepared: AcceleratedGradAccumulator,
    ddp: torch.nn.parallel.DistributedDataParallel | None,
    replaced: AcceleratedOptimizer,
) -> None:
    """Route this accelerator's backward through gafused, refuse its clipping of gafused's parameters, leave the
    gradient sync of ``ddp`` (the DDP module gafused reduces, if any) to gafused, carry every process's open
    window through save_state / load_state, and refuse ``step()`` / ``zero_grad()`` on ``replaced`` (the optimizer
    ``prepared`` replaces: a loop that kept it would bypass gafused)."""
    accumulator = prepared.accumulator
    managed = {id(param) for group in accumulator.param_groups for param in group["params"]}
    clip_norm, clip_value = accelerator.clip_grad_norm_, accelerator.clip_grad_value_

    def backward(loss: torch.Tensor, weight: float | torch.Tensor | None = None, **kwargs: Any) -> None:
        """gafused's backward for Accelerate's: folds ``loss``'s gradients with ``weight`` (a token count; default 1)
        into the window, which ends at Accelerate's sync step. The loss is not divided by gradient_accumulation_steps.
        """
        unknown = sorted(set(kwargs) - set(_BACKWARD_KWARGS))
        if unknown:
            raise TypeError(
                f"accelerator.backward(): with gafused it takes weight= and {', '.join(_BACKWARD_KWARGS)}; got "
                f"{', '.join(unknown)}"
            )
        if len(accelerator._optimizers) != 1 or accelerator._optimizers[0] is not prepared:
            raise RuntimeError(
                "accelerator.backward(): the accelerator now holds other optimizers than gafused's; gafused's "
                "Accelerate adapter supports one optimizer per Accelerator"
            )
        if accumulator._micro is not None and prepared._blocks != prepared._blocks_at_backward:
            raise RuntimeError(
                "accelerator.backward(): the micro-batch of an earlier accelerator.accumulate() block was not ended "
                "by optimizer.step(); " + _STEP_EVERY_BLOCK
            )
        sync = accelerator.gradient_state.sync_gradients
        steps = accelerator.gradient_state.num_steps
        # Outside accumulate() nothing tells one micro-batch from the next: every backward until step() is one
        # micro-batch. That is plain Accelerate's update only without its division (N = 1) and when step() steps.
        if prepared._blocks == prepared._blocks_at_step and (steps != 1 or not sync):
            raise RuntimeError(_outside_block("accelerator.backward()", steps))
        if ddp is not None and ddp.require_backward_grad_sync:
            raise RuntimeError(
                "accelerator.backward(): DDP's own gradient synchronization is on for this backward (Accelerate's "
                "trigger_sync_in_backward, called on the class, or require_backward_grad_sync set by hand); gafused "
                "reduces the window's gradients itself, and DDP's averaged gradients would be folded on top of them. "
                "The trigger has already set DDP's reducer to all-reduce this model's next backward, so this training "
                "cannot go on: restart it without the call (accelerator.trigger_sync_in_backward(model), on this "
                "accelerator, does nothing with gafused)"
            )
        accumulator.backward(loss, weight=weight, end_window=sync, **kwargs)
        prepared._blocks_at_backward = prepared._blocks

    def refuse_clipping(original: Callable[..., Any], name: str) -> Callable[..., Any]:
        def clip(parameters: torch.Tensor | Iterable[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
            params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            if any(id(param) in managed for param in params):
                configured = (
                    f"gafused already clips to max_grad_norm={accumulator.max_grad_norm}"
                    if accumulator.max_grad_norm is not None
                    else "pass max_grad_norm= to gafused.integrations.accelerate.prepare() instead"
                )
                raise RuntimeError(
                    f"accelerator.{name}(): gafused holds these parameters' gradients in its window (they are "
                    "released as they are folded) and clips the window's finished gradient by its global norm; "
                    f"{configured}, and drop this call (the norm is optimizer.grad_norm)"
                )
            return original(params, *args, **kwargs)

        return clip

    def save_window(models: Sequence[torch.nn.Module], weights: Sequence[Any], output_dir: str) -> None:
        rank = accelerator.process_index
        torch.save(accumulator.state_dict()["gafused"], os.path.join(output_dir, WINDOW_FILE.format(rank=rank)))

    def load_window(models: Sequence[torch.nn.Module], input_dir: str) -> None:
        path = os.path.join(input_dir, WINDOW_FILE.format(rank=accelerator.process_index))
        found = os.path.exists(path)
        prepared._loaded_window = torch.load(path, map_location="cpu", weights_only=True) if found else None

    trigger = accelerator.trigger_sync_in_backward

    @contextlib.contextmanager
    def trigger_sync_in_backward(model: torch.nn.Module) -> Any:
        """Accelerate's, except for the DDP module gafused reduces: nothing to trigger, gafused all-reduces the
        window's gradients once, at its end (DDP's all-reduce here would be counted on top of it)."""
        if ddp is not None and getattr(model, "_orig_mod", model) is ddp:
            yield
            return
        with trigger(model):
            yield

    do_sync = accelerator._do_sync  # what accumulate() calls once per block, to count the micro-batch

    def counted_do_sync() -> None:
        prepared._enter_block()
        do_sync()

    free_memory = accelerator.free_memory

    def free_memory_and_uninstall(*objects: Any) -> Any:
        """Accelerate's free_memory (also behind clear()), which forgets the prepared optimizer: gafused's
        routing goes with it, so the accelerator can prepare a new run, with gafused or without."""
        for restore in restores:
            restore()
        for handle in handles:
            handle.remove()
        return free_memory(*objects)

    def use_the_returned_optimizer(call: str) -> Callable[..., Any]:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(
                f"{call}: this optimizer was replaced by the one gafused.integrations.accelerate.prepare() returned "
                "(the accelerator and its schedulers use that one, and its step() ends each micro-batch); use the "
                "optimizer prepare() returned: optimizer = gafused.integrations.accelerate.prepare(accelerator, "
                "model, optimizer)"
            )

        return refuse

    patches = {
        "backward": backward,
        "trigger_sync_in_backward": trigger_sync_in_backward,
        "_do_sync": counted_do_sync,
        "clip_grad_norm_": refuse_clipping(clip_norm, "clip_grad_norm_"),
        "clip_grad_value_": refuse_clipping(clip_value, "clip_grad_value_"),
        "free_memory": free_memory_and_uninstall,
        "_gafused_optimizer": prepared,
    }
    handles = [
        accelerator.register_save_state_pre_hook(save_window),
        accelerator.register_load_state_pre_hook(load_window),
    ]
    restores = [
        _set_on_instance(accelerator, patches),
        _set_on_instance(
            replaced,
            {
                "step": use_the_returned_optimizer("optimizer.step()"),
                "zero_grad": use_the_returned_optimizer("optimizer.zero_grad()"),
            },
        ),
    ]


def _set_on_instance(obj: Any, values: dict[str, Any]) -> Callable[[], None]:
    """Set ``values`` on ``obj`` itself (not its class); the call returned puts back what the instance held under
    those names (or nothing, where the class's attribute showed through)."""
    held = {name: vars(obj)[name] for name in values if name in vars(obj)}
    for name, value in values.items():
        setattr(obj, name, value)

    def restore() -> None:
        for name in values:
            if name in held:
                vars(obj)[name] = held[name]
            else:
                vars(obj).pop(name, None)

    return restore
