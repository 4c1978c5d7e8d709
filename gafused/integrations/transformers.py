"""transformers' Trainer with gafused accumulation: ``GafusedTrainer``, a drop-in ``Trainer`` subclass.

The recipe keeps its ``TrainingArguments`` (``gradient_accumulation_steps``, ``max_grad_norm``, the scheduler,
``save_steps``) and changes the class:

    from gafused.integrations.transformers import GafusedTrainer
    trainer = GafusedTrainer(model=model, args=args, train_dataset=dataset, data_collator=collator)

How Trainer 5.x drives an optimizer, and what the subclass changes (README, "transformers' Trainer"):

- Trainer fetches a window's micro-batches up front, counts their loss items (``num_items_in_batch``, summed over
  the ranks when ``average_tokens_across_devices``), and marks the last micro-batch of the window (the
  ``gradient_accumulation_steps``-th, or the epoch's last: the partial window) as the sync step on Accelerate's
  gradient state. Each micro-batch runs ``training_step``, which ends in ``accelerator.backward(loss)``; at the sync
  step Trainer clips (``max_grad_norm``), calls ``optimizer.step()``, steps the scheduler unless the accelerator
  says the step was skipped, and zeroes the gradients. Checkpoints are written after a sync step, or at the end of
  a pass over an ``IterableDataset``, whose unfinished window Trainer carries into the next pass; a resume runs
  every micro-batch after the last optimizer step again.
- GafusedTrainer builds a *driven* ``GradAccumulator`` over Trainer's own optimizer once Accelerate has wrapped the
  model (``model=`` the DDP module under torch.distributed), and puts it inside Trainer's ``AcceleratedOptimizer``.
  ``training_step`` routes the backward to ``accumulator.backward(loss, weight=w, end_window=<sync step>)`` and
  ends the micro-batches before the sync step with ``accumulator.step()``; Trainer's own ``optimizer.step()`` at
  the sync step ends the last one, which finishes the window (collective under DDP) and steps the inner optimizer.
- Losses: when Trainer normalizes each micro-batch's loss over the whole window (the model takes
  ``num_items_in_batch``, or a ``compute_loss_func`` is set, or ``loss_is_scaled_for_ga=True``), the accumulator
  sums (``normalization="sum"``) with the weight 1 / world size: Trainer's DDP averages the ranks, gafused sums
  them (Trainer's multiplication by the world size, when it applies, is part of the loss in both). Otherwise each
  loss is a mean over its own micro-batch: ``normalization="mean"`` with the micro-batch's loss items
  (``loss_items``) as its weight, and Trainer's division by the window's micro-batch count
  (``current_gradient_accumulation_steps``, fewer in a partial window) is undone for the backward (the returned,
  logged loss keeps it). Which of the two is decided when training starts, from ``model_accepts_loss_kwargs``,
  ``compute_loss_func`` and ``loss_is_scaled_for_ga`` as they are then. A ``compute_loss`` of the user's that never
  uses ``num_items_in_batch`` (``_ignores_the_count``) is refused when training starts where Trainer would sum its
  loss, until ``loss_is_scaled_for_ga`` is set. An overridden ``loss_items`` is also Trainer's count
  (``num_items_in_batch``), except under label smoothing.
- Heads whose loss ignores ``num_items_in_batch``: Trainer takes a model whose ``forward`` accepts ``**kwargs`` to
  normalize its loss over the window, but transformers' losses for sequence, token, image, audio and video
  classification, question answering and detection (``LOSS_MAPPING`` entries without that argument) stay means
  over the micro-batch, and so do the losses heads compute themselves (BertForMaskedLM's ``CrossEntropyLoss()``,
  T5's, Bart's, Whisper's: the forward never calls ``self.loss_function``, whatever its ``loss_type``). For such a
  model (no ``accepts_loss_kwargs`` declared; the forward is read from its source, ``_forward_loss``) GafusedTrainer
  sets ``model_accepts_loss_kwargs = False``, so its losses are weighed as the per-micro-batch means they are; plain
  Trainer sums them (``gradient_accumulation_steps`` times too large). A loss the head computes itself is counted
  over the labels its forward keeps (after the shift only if the forward slices ``labels`` from 1), whatever its
  ``loss_type`` says. The model read is the one under ``torch.compile``'s and PEFT's wrappers. A question-answering
  loss (a batch of ``start_positions`` and ``end_positions``) is the mean of two means over the sequences: its
  items are the sequences whose positions lie inside them (the loss ignores a position beyond the sequence).
- CTC heads (``loss_type="ForCTC"``, Wav2Vec2ForCTC): the loss follows ``config.ctc_loss_reduction``. "mean"
  averages each sequence's loss over its target length, then over the sequences: weighed as a mean whose items
  are the sequences. "sum" is a plain sum over the sequences, which summing over the window makes the big batch's:
  Trainer's decision (``model_accepts_loss_kwargs``, from the forward's ``**kwargs``) stands and the accumulator
  sums; weighed as a per-micro-batch mean it is refused (no weight makes a mean of sums a sum).
- Causal LMs: a model whose ``loss_type`` is unset (GPT2LMHeadModel, a subclass of it, any model whose forward calls
  ``self.loss_function``, which falls back to the causal-LM loss) still computes the shifted causal-LM loss, but
  Trainer 5.x counts its items before the shift (one per sequence too many). GafusedTrainer counts them after the
  shift, as Trainer does for models that declare ``loss_type="ForCausalLM"``.
- The two rules above read the model because its loss is the training loss. With ``label_smoothing_factor`` or a
  ``compute_loss_func``, Trainer pops the labels and computes the loss itself, and GafusedTrainer follows Trainer,
  not the forward: Trainer's LabelSmoother takes ``num_items_in_batch`` whenever Trainer passes it (so Trainer's
  ``model_accepts_loss_kwargs`` stands) and scores ``labels``, never a batch's ``shift_labels``, after the shift
  exactly when the class of the model ``compute_loss`` unwraps (torch.compile's wrapper kept, PEFT's
  ``base_model.model``) is a causal LM of transformers' auto mapping; its items, per micro-batch and in
  ``num_items_in_batch``, are counted so. A ``compute_loss_func`` gets ``num_items_in_batch`` counted after the
  shift for a causal LM (Trainer's count for ``loss_type="ForCausalLM"``, and the causal LMs above without one).
- Clipping: Trainer's ``max_grad_norm`` is handed to the accumulator, which clips the finished gradient by its global
  norm; Trainer's own clipping does not run. The logged ``grad_norm`` is the accumulator's.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import textwrap
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch

try:
    import transformers
    from accelerate.optimizer import AcceleratedOptimizer
    from transformers.loss.loss_utils import LOSS_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from transformers.trainer_utils import _is_peft_model, unwrap_peft_model
except ImportError as error:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        f"gafused.integrations.transformers needs transformers and accelerate ({error}); install them with: "
        'pip install "gafused[transformers,accelerate]"'
    ) from error

from gafused.accumulator import GradAccumulator, check_options
from gafused.integrations import TRANSFORMERS_MIN_VERSION

__all__ = ["GafusedTrainer"]

# What the accumulator_options of GafusedTrainer may set; the rest is decided by the Trainer's configuration.
_OPTIONS = ("max_grad_norm", "accum_dtype", "backend", "bucket_bytes", "reduce_dtype")
_DECIDED = {
    "accumulation_steps": "windows end at Trainer's sync steps (gradient_accumulation_steps and the epoch's end)",
    "normalization": "it follows how Trainer normalizes the loss (num_items_in_batch or a per-micro-batch mean)",
    "model": "it is the module Accelerate wrapped (DDP under torch.distributed)",
    "grad_scaler": "fp16 loss scaling is not supported by GafusedTrainer",
}
# Trainer internals the subclass builds on (transformers 5.x): methods it overrides or calls, attributes Trainer's
# __init__ sets. Checked at construction, so a Trainer that lacks one fails loudly instead of training without gafused.
_TRAINER_METHODS = (
    "_prepare_for_training",
    "_get_num_items_in_batch",
    "_load_optimizer_and_scheduler",
    "_load_scaler",
    "_clip_grad_norm",
    "_get_grad_norm",
)
_TRAINER_ATTRIBUTES = (
    "_loss_shifts_labels",
    "model_accepts_loss_kwargs",
    "compute_loss_func",
    "loss_is_scaled_for_ga",
    "label_smoother",
)


_NOTHING = object()


class GafusedTrainer(transformers.Trainer):
    """``transformers.Trainer`` whose gradient accumulation is a gafused ``GradAccumulator``.

    Takes every argument of ``Trainer``; the window is Trainer's own (``gradient_accumulation_steps``
    micro-batches per optimizer step, the partial last window of an epoch included), and the finished gradient is
    the one big batch would give: token-weighted over every micro-batch and rank, clipped by its global norm with
    ``args.max_grad_norm``. The LR scheduler steps once per window; a window the accumulator skips (non-finite
    gradient) does not step it. Checkpoints (``save_steps``, ``resume_from_checkpoint``) hold the accumulator's
    state as of the last optimizer step (Trainer writes them there, but for one at the end of a pass over an
    ``IterableDataset``, mid-window, whose micro-batches a resume runs again), so they resume exactly. A
    ``training_step`` of your own must call ``super().training_step``: it sends the backward to the accumulator.

    Args:
        accumulator_options: keyword arguments for ``GradAccumulator``: ``accum_dtype``, ``backend``,
            ``bucket_bytes``, ``reduce_dtype`` and ``max_grad_norm`` (the last only where ``args.max_grad_norm``
            does not clip: 0 or inf; clipping is configured in one place). The window, the normalization and
            ``model=`` follow the Trainer.
        *args, **kwargs: as for ``transformers.Trainer``. ``optimizers=(inner, scheduler)`` takes the inner
            optimizer (a plain ``torch.optim.Optimizer``); GafusedTrainer wraps it.

    Not supported (refused with an error at construction or when training starts): fp16 loss scaling (bf16
    works), DeepSpeed, FSDP, tensor or context parallelism, ``torch.nn.DataParallel`` (several GPUs in one
    process), SageMaker model parallelism.
    """

    def __init__(self, *args: Any, accumulator_options: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        options = _check_options(accumulator_options)
        optimizers = kwargs.get("optimizers")
        if optimizers is not None and isinstance(optimizers[0], GradAccumulator):
            raise TypeError(
                "optimizers: pass the inner optimizer, optimizers=(torch.optim.X(...), scheduler_or_None); "
                "GafusedTrainer builds the GradAccumulator itself, around the model Accelerate wraps"
            )
        _check_trainer_internals(transformers.Trainer, _TRAINER_METHODS)
        # Refusals that the arguments alone decide come before Trainer builds anything.
        given = kwargs["args"] if "args" in kwargs else (args[1] if len(args) > 1 else None)
        if given is None and options.get("reduce_dtype") is not None:
            # The TrainingArguments Trainer would make, made here: whether there are ranks to reduce across is checked
            # before Trainer seeds the global RNG and builds its Accelerator.
            given = transformers.TrainingArguments(output_dir="tmp_trainer")
            if "args" in kwargs or len(args) <= 1:
                kwargs["args"] = given
            else:
                args = (args[0], given, *args[2:])
        _clipping(given, dict(options))  # refused now if configured twice; read again when training starts
        if given is not None:
            _check_arguments(given)
            if options.get("reduce_dtype") is not None and given.world_size <= 1:
                raise ValueError(
                    "accumulator_options['reduce_dtype'] is the dtype DDP's buckets are all-reduced in; this Trainer "
                    "runs in one process (launch with torchrun or accelerate launch for DDP)"
                )
        super().__init__(*args, **kwargs)
        _check_trainer_internals(self, _TRAINER_ATTRIBUTES)
        self._options = options
        self._check_supported()
        # What the model's own loss averages over, read once from the model under torch.compile's and PEFT's wrappers
        # (module docstring); who computes the training loss is decided again when training starts (_decide_loss).
        inspected = unwrap_peft_model(self.accelerator.unwrap_model(self.model, keep_torch_compile=False))
        self._trainer_shifts_labels = self._loss_shifts_labels  # Trainer's rule: loss_type="ForCausalLM"
        self._causal_lm = _computes_causal_lm_loss(inspected)
        self._own_shifts_labels = _own_loss_shifts_labels(type(inspected).forward)
        self._ctc_reduction = _ctc_reduction(inspected)
        # Trainer's LabelSmoother scores a batch's "labels": a head whose forward takes none (question answering's
        # start and end positions) is never smoothed, and computes its loss itself.
        self._smoothable = "labels" in _parameters(type(inspected).forward)
        # A head that takes **kwargs but whose loss is a mean over its own micro-batch (sequence classification, a
        # loss the head computes itself, ...): Trainer would treat that loss as normalized over the window and sum
        # the means. Its loss is what it is, so it is weighed as one (unless Trainer computes the loss itself).
        if (
            self.compute_loss_func is None
            and not (self.label_smoother is not None and self._smoothable)
            and self.model_accepts_loss_kwargs
            and _loss_ignores_item_count(inspected)
        ):
            self.model_accepts_loss_kwargs = False
        self._decide_loss(self.model, starting=False)
        self.accumulator: GradAccumulator | None = None
        self._norm: torch.Tensor | None = None
        # Whether training_step sent the backward of the window's last micro-batch to the accumulator (checked before
        # Trainer's optimizer.step(), reset after it).
        self._last_backward_routed = False
        self.add_callback(_AroundOptimizerStep(self))

    # --- configuration ----------------------------------------------------------------------------------

    def _check_supported(self) -> None:
        """What the arguments and Accelerate's configuration (launcher, environment) enable, once Trainer is built."""
        _check_arguments(self.args)
        if self.is_deepspeed_enabled:
            raise ValueError("deepspeed: GafusedTrainer does not support DeepSpeed (it accumulates gradients itself)")
        if self.is_fsdp_enabled or getattr(self, "is_fsdp_xla_enabled", False):
            raise ValueError("fsdp: GafusedTrainer does not support FSDP through Trainer yet; DDP is supported")
        if self.get_tp_size() > 1 or self.get_cp_size() > 1 or self.get_sp_size() > 1:
            raise ValueError("parallelism_config: GafusedTrainer supports data parallelism (DDP) only")

    def _decide_loss(self, model: torch.nn.Module, starting: bool = True) -> None:
        """Who computes the training loss, with the Trainer configured as it is now (``model_accepts_loss_kwargs`` and
        ``compute_loss_func`` may be set after construction, as Trainer reads them at each step): what a
        micro-batch's items are, and whether the accumulator sums the losses or averages them (module docstring).
        ``model``: the one ``compute_loss`` gets; ``starting``: training starts (a subclass's own ``__init__`` has
        set its flags by then). Refused configurations change nothing."""
        smoothed = self.compute_loss_func is None and self.label_smoother is not None and self._smoothable
        sums = self._loss_normalized_over_window()
        if not smoothed and self.compute_loss_func is None and self._ctc_reduction == "sum" and not sums:
            raise ValueError(
                "ctc_loss_reduction='sum': the CTC loss is a sum over the micro-batch's sequences, which "
                "GafusedTrainer would weigh as a per-micro-batch mean (model_accepts_loss_kwargs is False), and no "
                "weight (loss_items) makes a mean of sums their sum; keep model_accepts_loss_kwargs=True (Trainer's "
                "decision for the model's forward) so the window sums them, or use ctc_loss_reduction='mean'"
            )
        # Trainer counts num_items_in_batch for these two only; a loss of the user's it does not count for is
        # normalized the same on every rank, whatever average_tokens_across_devices says.
        counted = bool(self.model_accepts_loss_kwargs) or self.compute_loss_func is not None
        if sums and counted and self.args.world_size > 1 and not self.args.average_tokens_across_devices:
            raise ValueError(
                "average_tokens_across_devices=False: each rank would normalize its loss by its own item count "
                "(num_items_in_batch), which no accumulation can turn into the big batch's; keep TrainingArguments' "
                "default average_tokens_across_devices=True"
            )
        if (
            starting
            and sums
            and self.loss_is_scaled_for_ga is None
            and _defined_by(type(self), "compute_loss") not in (GafusedTrainer, transformers.Trainer)
            and _ignores_the_count(type(self).compute_loss)
        ):
            raise ValueError(
                f"loss_is_scaled_for_ga: {type(self).__name__}.compute_loss computes a loss of its own without "
                "num_items_in_batch, and loss_is_scaled_for_ga is unset, so Trainer takes that loss as normalized "
                "over the window (the model takes loss kwargs, or a compute_loss_func is set) and the window sums "
                "it; set loss_is_scaled_for_ga before train(): False for a mean over its own micro-batch "
                "(GafusedTrainer weighs it by loss_items), True for a loss you normalized over the whole window "
                "yourself (or model_accepts_loss_kwargs = False, as for a model whose loss takes no count)"
            )
        self._smoothed, self._sums = smoothed, sums
        if smoothed:
            self._loss_shifts_labels = _label_smoother_shifts(self.accelerator, model)
        elif self.compute_loss_func is None and self._own_shifts_labels is not None:
            self._loss_shifts_labels = self._own_shifts_labels  # the head's own loss: the labels its forward keeps
        else:
            # transformers' loss function, or a compute_loss_func: over a causal LM's labels (copies of the inputs)
            # such a loss shifts them, so its items are counted after the shift (Trainer's count for
            # loss_type="ForCausalLM", and also for causal LMs that leave loss_type unset: GPT2LMHeadModel).
            self._loss_shifts_labels = self._trainer_shifts_labels or self._causal_lm

    def _loss_normalized_over_window(self) -> bool:
        """Whether Trainer normalizes each micro-batch's loss over the window (its rule in ``training_step``)."""
        if self.loss_is_scaled_for_ga is not None:
            return bool(self.loss_is_scaled_for_ga)
        return bool(self.model_accepts_loss_kwargs) or self.compute_loss_func is not None

    # --- the accumulator --------------------------------------------------------------------------------

    def _prepare_for_training(self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: str | None):
        # Trainer wraps the model (DDP) and prepares the optimizer here, then loads the checkpoint's optimizer state.
        # The accumulator needs the wrapped model, so it is built in between and the checkpoint loaded into it.
        self._decide_loss(self.model)  # refused before Trainer wraps anything
        model, train_dataloader = super()._prepare_for_training(max_steps, train_dataloader, None)
        if self._smoothed:  # the model compute_loss gets, compiled here when args.torch_compile
            self._loss_shifts_labels = _label_smoother_shifts(self.accelerator, model)
        self._install_accumulator(model)
        if resume_from_checkpoint is not None:
            # A GafusedTrainer checkpoint holds the window; a plain Trainer one (saved after a window's step only)
            # is the inner optimizer's state, which the accumulator loads with an empty window.
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
            self._load_scaler(resume_from_checkpoint)
        return model, train_dataloader

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # Trainer's resume runs every micro-batch after the last optimizer step again, so a checkpoint written with a
        # window open (a pass over an IterableDataset ending mid-window, at save_strategy="epoch") holds the state as
        # of that window's start, as plain Trainer's does (p.grad is not saved): with the window, its micro-batches
        # would fold twice.
        accumulator = self.accumulator
        if accumulator is None or not accumulator.micro_step:
            super()._save_optimizer_and_scheduler(output_dir)
            return
        accumulator.state_dict = functools.partial(accumulator._state_dict, with_window=False)
        try:
            super()._save_optimizer_and_scheduler(output_dir)
        finally:
            del accumulator.state_dict

    def _install_accumulator(self, model: torch.nn.Module) -> None:
        accelerated = self.optimizer
        if not isinstance(accelerated, AcceleratedOptimizer):
            raise RuntimeError(
                f"GafusedTrainer expected Accelerate to wrap the optimizer, got {type(accelerated).__name__}"
            )
        if self.accelerator.scaler is not None:
            raise ValueError("mixed_precision: GafusedTrainer does not support fp16 loss scaling; use bf16")
        inner = accelerated.optimizer
        if isinstance(inner, GradAccumulator):  # Trainer's loop starts again: build anew around the wrapped model
            # A loop that stopped mid-window (auto_find_batch_size retrying after an out-of-memory error, an
            # interrupted train()) leaves its window open; Trainer drops its p.grad as the loop starts, so it goes.
            inner._discard_window()
            inner = inner.optimizer
        # TrainingArguments as they are now: hyperparameter_search sets a trial's fields after construction.
        _check_arguments(self.args)
        options = dict(self._options)
        max_grad_norm = _clipping(self.args, options)
        wrapped = None
        if self.args.world_size > 1:
            model = getattr(model, "_orig_mod", model)  # torch_compile: Accelerate compiles the DDP module last
            if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
                raise ValueError(
                    f"GafusedTrainer supports DistributedDataParallel across ranks; Trainer wrapped the model in "
                    f"{type(model).__name__}"
                )
            wrapped = model
        self.accumulator = GradAccumulator(
            inner,
            None,
            max_grad_norm,
            model=wrapped,
            normalization="sum" if self._sums else "mean",
            **options,
        )
        accelerated.optimizer = self.accumulator

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> torch.Tensor | int | None:
        # Trainer counts a batch's shift_labels when it has them, but its LabelSmoother scores the labels it pops
        # (after its own shift for causal LMs), never shift_labels: count those, as loss_items does.
        if self._smoothed:
            batch_samples = [_without_shift_labels(batch) for batch in batch_samples]
        counted = super()._get_num_items_in_batch(batch_samples, device)
        if counted is None or self._smoothed or not self._counts_its_own_items():
            # (Under label smoothing the loss is Trainer's LabelSmoother's, whose labels Trainer counts above.)
            return counted
        # A loss_items of the user's says what a micro-batch's items are (a model of their own around a causal LM,
        # which Trainer counts before the shift): the window's count is its sum, over the ranks as Trainer's is.
        items = torch.stack([_item_count(self.loss_items(batch), device) for batch in batch_samples]).sum()
        if self.args.average_tokens_across_devices and self.args.world_size > 1:
            items = self.accelerator.gather(items).sum()
        return items

    def _counts_its_own_items(self) -> bool:
        """Whether ``loss_items`` is the user's: overridden in a subclass or set on the trainer."""
        return "loss_items" in vars(self) or _defined_by(type(self), "loss_items") is not GafusedTrainer

    def loss_items(self, inputs: Mapping[str, Any]) -> torch.Tensor:
        """The number of items a micro-batch's mean loss averages over: its weight when losses are per-micro-batch
        means (models that take no ``num_items_in_batch``).

        The labels that are not -100 (``shift_labels`` when the batch has them; for causal LMs, ``labels[..., 1:]``:
        the first label of each sequence is never predicted). With ``label_smoothing_factor``, Trainer's
        LabelSmoother scores ``labels``, after the shift when the model's class is a causal LM of transformers'
        auto mapping. A CTC head with ``ctc_loss_reduction="mean"`` averages over the sequences (``labels``' rows);
        a question-answering batch (``start_positions``, ``end_positions``, no labels) over the sequences whose
        positions lie inside them. Override it for losses that average over something else; overridden, it also
        counts the items of losses normalized over the window: Trainer's ``num_items_in_batch`` is then its sum over
        the window's micro-batches (and the ranks, with ``average_tokens_across_devices``), except under label
        smoothing, whose LabelSmoother loss is counted as Trainer counts it.
        """
        if self._smoothed and "labels" in inputs:
            labels = inputs["labels"][..., 1:] if self._loss_shifts_labels else inputs["labels"]
        elif self._ctc_reduction == "mean" and self.compute_loss_func is None and "labels" in inputs:
            # Each sequence's CTC loss over its target length, then the mean over the sequences.
            sequences = _tensor(inputs, "labels").shape[0]
            return torch.tensor(sequences, device=inputs["labels"].device)
        elif "shift_labels" in inputs:
            labels = inputs["shift_labels"]
        elif "labels" in inputs:
            labels = inputs["labels"][..., 1:] if self._loss_shifts_labels else inputs["labels"]
        elif "start_positions" in inputs and "end_positions" in inputs:
            return _answer_items(inputs)
        else:
            raise ValueError(
                "inputs: the micro-batch has no 'labels', so its loss items (the weight of its mean loss) are "
                "unknown; override GafusedTrainer.loss_items(inputs) to count them"
            )
        if not isinstance(labels, torch.Tensor):
            raise TypeError(f"inputs['labels'] must be a tensor to count loss items, got {type(labels).__name__}")
        return labels.ne(-100).sum()

    def training_step(
        self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        accumulator = self.accumulator
        if accumulator is None:
            raise RuntimeError("training_step(): the GradAccumulator is built by train(); call trainer.train()")
        last = bool(self.accelerator.sync_gradients)  # Trainer's sync step: the window's last micro-batch
        # Trainer's rule (training_step) for a loss already normalized over the window.
        if self.loss_is_scaled_for_ga is not None:
            normalized_over_window = bool(self.loss_is_scaled_for_ga)
        else:
            takes_count = self.model_accepts_loss_kwargs and num_items_in_batch is not None
            normalized_over_window = bool(takes_count) or self.compute_loss_func is not None
        if normalized_over_window != self._sums:
            raise RuntimeError(
                "training_step(): this micro-batch's loss is "
                + ("normalized over the window" if normalized_over_window else "a mean over the micro-batch")
                + " but the accumulator was built for "
                + ("losses normalized over the window" if self._sums else "per-micro-batch means")
                + " (a batch without 'labels' gives Trainer no num_items_in_batch)"
            )
        if self._sums:
            # Trainer's DDP averages the ranks' gradients and gafused sums them, so every loss normalized over the
            # window weighs 1 / world size, whether Trainer multiplied it by the world size (num_items_in_batch,
            # average_tokens_across_devices) or not (a compute_loss of the user's, no num_items_in_batch).
            weight: float | torch.Tensor = 1.0 / self.accelerator.num_processes
        else:
            weight = self.loss_items(inputs)
        called = []

        def backward(loss: torch.Tensor, **kwargs: Any) -> None:
            if kwargs:
                raise RuntimeError(f"accelerator.backward() got options GafusedTrainer cannot honor: {sorted(kwargs)}")
            called.append(True)
            if not self._sums:
                # Trainer divided this per-micro-batch mean by the window's micro-batch count (the partial window's
                # own); the accumulator weighs the undivided mean by its items. The returned, logged loss keeps it.
                loss = loss * self.current_gradient_accumulation_steps
            accumulator.backward(loss, weight=weight, end_window=last)
            self._last_backward_routed = last

        with _routed_backward(self.accelerator, backward):
            loss = super().training_step(model, inputs, num_items_in_batch)
        if not called:
            raise RuntimeError("training_step(): Trainer ran no accelerator.backward for this micro-batch")
        if not last:
            accumulator.step()  # the window's last micro-batch is ended by Trainer's optimizer.step()
        return loss

    # --- clipping and the logged norm -------------------------------------------------------------------

    def _clip_grad_norm(self, model: torch.nn.Module) -> torch.Tensor:
        # The gradient is finished (and clipped by its global norm) inside optimizer.step(); nothing to clip here.
        return self._get_grad_norm(model)

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> torch.Tensor:
        # Known only once optimizer.step() finishes the window: filled in by _AroundOptimizerStep, before Trainer logs.
        # In the accumulator's norm dtype (float64 where a buffer accumulates in float64), as clip_grad_norm_ gives it.
        buffers = [] if self.accumulator is None else self.accumulator.buffers
        dtype = torch.float64 if any(buffer.accum_dtype == torch.float64 for buffer in buffers) else torch.float32
        self._norm = torch.full((), float("nan"), dtype=dtype, device=self.args.device)
        return self._norm


class _AroundOptimizerStep(transformers.TrainerCallback):
    """Before Trainer's optimizer.step(): whether GafusedTrainer's training_step sent the window's backward to the
    accumulator. After it: the window's norm for the log, and whether the step was skipped (then Trainer does not
    step the scheduler, as after an fp16 overflow)."""

    def __init__(self, trainer: GafusedTrainer) -> None:
        self._trainer = weakref.ref(trainer)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self._trainer()
        if trainer is None or trainer.accumulator is None or trainer._last_backward_routed:
            return
        raise RuntimeError(
            f"{type(trainer).__name__}: the backward of this window's last micro-batch did not go through "
            "GafusedTrainer.training_step, which sends accelerator.backward(loss) to the accumulator; a training_step "
            "of your own must call super().training_step(model, inputs, num_items_in_batch) (put your code around "
            "it, or in compute_loss). The optimizer did not step"
        )

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self._trainer()
        if trainer is None or trainer.accumulator is None:
            return
        trainer._last_backward_routed = False
        accumulator = trainer.accumulator
        if accumulator.micro_step:
            raise RuntimeError(
                f"optimizer.step() did not finish the window ({accumulator.micro_step} micro-batches are open)"
            )
        trainer.optimizer._is_overflow = not accumulator.stepped
        if trainer._norm is not None and accumulator.grad_norm is not None:
            trainer._norm.copy_(accumulator.grad_norm)


@contextlib.contextmanager
def _routed_backward(accelerator: Any, backward: Any) -> Iterator[None]:
    """Trainer's training_step ends in ``accelerator.backward(loss)``: send it to the accumulator for one call."""
    shadowed = accelerator.__dict__.get("backward", _NOTHING)
    accelerator.backward = backward
    try:
        yield
    finally:
        if shadowed is _NOTHING:
            del accelerator.backward
        else:
            accelerator.backward = shadowed


def _loss_ignores_item_count(model: torch.nn.Module) -> bool:
    """Whether the model's loss is a mean over the micro-batch whatever ``num_items_in_batch`` Trainer passes.

    A model that declares ``accepts_loss_kwargs`` says for itself (Trainer takes it at its word too). Otherwise its
    ``forward`` is read (``_forward_loss``): a loss it computes itself never sees the count (BertForMaskedLM's
    ``CrossEntropyLoss()`` over its masked tokens, T5's, Bart's); transformers' loss function for its ``loss_type``
    sees it when that loss takes ``num_items_in_batch`` (or when the loss function was replaced: it says for itself).
    A forward that names the count, hands ``labels`` on together with ``**kwargs``, or cannot be read keeps
    Trainer's decision unless its ``loss_type`` names a loss without the count. A CTC head's loss is a mean unless
    its ``ctc_loss_reduction`` is "sum"."""
    if hasattr(model, "accepts_loss_kwargs"):
        return False
    reduction = _ctc_reduction(model)
    if reduction is not None:
        # CTC's "sum" is a plain sum over the sequences: summed over the window, as Trainer does, it is the big
        # batch's. Its "mean" is one over the micro-batch's sequences.
        return reduction != "sum"
    how = _forward_loss(type(model).forward)
    if how == "own":
        return True
    if how == "count" or hasattr(model, "_loss_function"):
        return False
    loss = LOSS_MAPPING.get(getattr(model, "loss_type", None))
    return loss is not None and "num_items_in_batch" not in inspect.signature(loss).parameters


def _ctc_reduction(model: torch.nn.Module) -> str | None:
    """``config.ctc_loss_reduction`` of a CTC head whose loss is transformers' (``loss_type="ForCTC"``, or a class
    named ``...ForCTC``: Wav2Vec2ForCTC, HubertForCTC, ...); None for any other model or a replaced loss function."""
    if getattr(model, "loss_type", None) != "ForCTC" and not type(model).__name__.endswith("ForCTC"):
        return None
    if hasattr(model, "_loss_function"):  # a loss function of the user's says for itself
        return None
    return getattr(getattr(model, "config", None), "ctc_loss_reduction", None)


def _tensor(inputs: Mapping[str, Any], key: str) -> torch.Tensor:
    value = inputs[key]
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"inputs[{key!r}] must be a tensor to count loss items, got {type(value).__name__}")
    return value


def _answer_items(inputs: Mapping[str, Any]) -> torch.Tensor:
    """The items of transformers' question-answering loss: the mean of a cross-entropy mean over the sequences'
    start positions and one over their end positions, each without the positions beyond the sequence (ignored)."""
    start = _tensor(inputs, "start_positions").reshape(-1)
    end = _tensor(inputs, "end_positions").reshape(-1)
    tokens = next((inputs[key] for key in ("input_ids", "attention_mask") if key in inputs), None)
    if not isinstance(tokens, torch.Tensor):
        raise ValueError(
            "inputs: a question-answering micro-batch without 'input_ids' or 'attention_mask' does not tell which "
            "positions its loss ignores (those beyond the sequence); override GafusedTrainer.loss_items(inputs) to "
            "count its items"
        )
    start_scored, end_scored = start < tokens.shape[-1], end < tokens.shape[-1]
    if "pixel_values" in inputs and not bool((start_scored & end_scored).all()):
        # A head that also reads an image (LayoutLMv3) may score positions past the text (its image patches): the
        # loss then ignores positions past its logits, whose length the inputs do not tell.
        raise ValueError(
            "inputs: a question-answering micro-batch with 'pixel_values' has a start or end position past the text "
            "('input_ids'); the loss ignores only positions past its logits, which may cover image patches too, so "
            "its items cannot be counted from the inputs; override GafusedTrainer.loss_items(inputs) to count them"
        )
    if bool((start_scored != end_scored).any()):
        raise ValueError(
            "inputs: a sequence has one of its start and end positions beyond the sequence, which the "
            "question-answering loss ignores, and the other inside it: its two means then average over different "
            "sequences and no weight (loss_items) makes the window's loss exact; point unanswerable questions at "
            "the CLS token (position 0) for both, or override GafusedTrainer.loss_items(inputs)"
        )
    return start_scored.sum()


def _parameters(function: Any) -> set[str]:
    """The parameter names of ``function`` (none when its signature cannot be read)."""
    try:
        return set(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return set()


def _forward_loss(forward: Any) -> str:
    """How a ``forward(..., labels=None, **kwargs)`` computes its loss, read from its source.

    "count": it names ``num_items_in_batch``. "loss_function": it calls transformers' ``self.loss_function``.
    "own": neither, and ``labels`` reaches no call that also takes ``**kwargs``, so the count Trainer puts in
    ``kwargs`` never meets the labels: the loss it computes does without it. "unknown": no source, no ``labels``
    or ``**kwargs`` parameter, or ``labels`` handed on with ``**kwargs`` (to a submodule or ``super().forward``,
    whose loss may use the count).
    """
    function = _parsed(forward)
    if function is None or "labels" not in _argument_names(function) or function.args.kwarg is None:
        return "unknown"
    nodes = _body_nodes(function)
    if _names_the_count(nodes):
        return "count"
    if _calls_loss_function(nodes):
        return "loss_function"
    for node in nodes:
        if isinstance(node, ast.Call) and any(keyword.arg is None for keyword in node.keywords):
            given = node.args + [keyword.value for keyword in node.keywords]
            if any(isinstance(name, ast.Name) and name.id == "labels" for value in given for name in ast.walk(value)):
                return "unknown"
    return "own"


def _argument_names(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    arguments = function.args
    return {argument.arg for argument in arguments.posonlyargs + arguments.args + arguments.kwonlyargs}


def _body_nodes(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.AST]:
    """Every node of the function's body (not of its signature's defaults or decorators)."""
    return [node for statement in function.body for node in ast.walk(statement)]


def _names_the_count(nodes: list[ast.AST]) -> bool:
    return any(
        (isinstance(node, ast.Name) and node.id == "num_items_in_batch")
        or (isinstance(node, ast.Constant) and node.value == "num_items_in_batch")
        or (isinstance(node, ast.keyword) and node.arg == "num_items_in_batch")
        for node in nodes
    )


def _item_count(count: Any, device: torch.device) -> torch.Tensor:
    """One micro-batch's ``loss_items`` as a 0-d tensor on ``device``, or a TypeError naming ``loss_items``."""
    value = torch.as_tensor(count)
    if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
        raise TypeError(
            f"loss_items(inputs) must return one number (an int, or a one-element tensor) per micro-batch, got "
            f"{type(count).__name__} of shape {tuple(value.shape)}"
        )
    return value.reshape(()).to(device)


def _defined_by(cls: type, name: str) -> type | None:
    """The class of ``cls``'s method resolution order that defines ``name``."""
    return next((klass for klass in cls.__mro__ if name in vars(klass)), None)


def _ignores_the_count(compute_loss: Any) -> bool:
    """Whether a ``compute_loss`` of the user's never uses ``num_items_in_batch``: its body does not name it and does
    not hand on its own ``*args`` or ``**kwargs``, which may carry it (``model(**inputs)`` does not). False when its
    source cannot be read."""
    function = _parsed(compute_loss)
    if function is None:
        return False
    nodes = _body_nodes(function)
    rest = {argument.arg for argument in (function.args.vararg, function.args.kwarg) if argument is not None}
    hands_rest_on = any(isinstance(node, ast.Name) and node.id in rest for node in nodes)
    return not (_names_the_count(nodes) or hands_rest_on)


def _calls_loss_function(nodes: list[ast.AST]) -> bool:
    return any(isinstance(node, ast.Attribute) and node.attr == "loss_function" for node in nodes)


def _parsed(function: Any) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The syntax tree of ``function`` (decorators unwrapped), or None when its source cannot be read."""
    try:
        source = textwrap.dedent(inspect.getsource(inspect.unwrap(function)))
        tree = ast.parse(source).body[0]
    except (OSError, TypeError, ValueError, SyntaxError, IndexError):  # ValueError: a cycle of __wrapped__
        return None
    return tree if isinstance(tree, ast.FunctionDef | ast.AsyncFunctionDef) else None


def _own_loss_shifts_labels(forward: Any) -> bool | None:
    """For a forward that computes its loss itself: whether it drops each sequence's first label (slices ``labels``
    from 1, as ``labels[:, 1:]``); None when its loss is not its own or cannot be told.

    Such a loss is a mean over the labels it keeps, whatever ``loss_type`` says (BartForCausalLM's
    ``CrossEntropyLoss()`` over every label, under ``loss_type="ForCausalLM"``). Read with or without ``**kwargs``
    in the signature (a forward without them gets no count from Trainer, and its loss is a mean all the same). Not
    its own: a forward that names ``num_items_in_batch``, calls ``self.loss_function``, or hands ``labels`` to
    another module (as ``labels=...``, or in a call that also passes ``**kwargs``: ``super().forward``, a wrapped
    model), whose loss is that module's."""
    function = _parsed(forward)
    if function is None or "labels" not in _argument_names(function):
        return None
    nodes = _body_nodes(function)
    if _names_the_count(nodes) or _calls_loss_function(nodes):
        return None
    for node in nodes:
        if isinstance(node, ast.Call):
            handed = [keyword.value for keyword in node.keywords if keyword.arg in (None, "labels")]
            if any(keyword.arg is None for keyword in node.keywords):
                handed += node.args + [keyword.value for keyword in node.keywords]
            if any(isinstance(name, ast.Name) and name.id == "labels" for value in handed for name in ast.walk(value)):
                return None
    for node in nodes:
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "labels":
            pieces = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            if any(
                isinstance(piece, ast.Slice) and isinstance(piece.lower, ast.Constant) and piece.lower.value == 1
                for piece in pieces
            ):
                return True
    return False


def _label_smoother_shifts(accelerator: Any, model: torch.nn.Module) -> bool:
    """Whether Trainer's ``compute_loss`` calls its LabelSmoother with ``shift_labels=True`` for ``model``: when the
    class name of the model it unwraps (Accelerate's wrappers removed, torch.compile's kept; a PEFT model's
    ``base_model.model``) is a causal LM of transformers' auto mapping."""
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        # Trainer's unwrap_model keeps the compiled wrapper, whose class name is no causal LM's. (Asked here, it
        # would also point the wrapper at the module inside DDP, which Accelerate does when it keeps the wrapper.)
        return False
    unwrapped = accelerator.unwrap_model(model)
    if _is_peft_model(unwrapped):
        unwrapped = unwrapped.base_model.model
    return unwrapped._get_name() in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()


def _without_shift_labels(batch: Any) -> Any:
    """A labelled batch as the LabelSmoother sees it: without ``shift_labels``."""
    if isinstance(batch, Mapping) and "labels" in batch and "shift_labels" in batch:
        return {key: value for key, value in batch.items() if key != "shift_labels"}
    return batch


# PreTrainedModel's loss_function, which falls back to the causal-LM loss for a loss_type it does not know.
_LOSS_PROPERTY = inspect.getattr_static(transformers.PreTrainedModel, "loss_function", None)


def _computes_causal_lm_loss(model: torch.nn.Module) -> bool:
    """Whether a model whose ``loss_type`` names no loss of transformers' computes the shifted causal-LM loss: a
    causal LM of the auto mapping (Trainer's label smoother's list), or a subclass of one, and any model whose
    forward calls ``self.loss_function`` without a loss function of its own (``PreTrainedModel.loss_function``
    falls back to the causal-LM loss for a ``loss_type`` it does not know)."""
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False) or getattr(model, "loss_type", None) in LOSS_MAPPING:
        return False
    causal_lms = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    if any(cls.__name__ in causal_lms for cls in type(model).__mro__):
        return True
    if hasattr(model, "_loss_function") or inspect.getattr_static(model, "loss_function", None) is not _LOSS_PROPERTY:
        return False  # a loss function of the model's own (or of the user's) says nothing of a shift
    function = _parsed(type(model).forward)
    return function is not None and _calls_loss_function(_body_nodes(function))


def _check_trainer_internals(owner: Any, names: tuple[str, ...]) -> None:
    missing = [name for name in names if not hasattr(owner, name)]
    if missing:
        raise RuntimeError(
            f"GafusedTrainer builds on Trainer internals of transformers >= {TRANSFORMERS_MIN_VERSION} that "
            f"transformers {transformers.__version__} lacks: {', '.join(missing)} (pip install "
            f"'transformers>={TRANSFORMERS_MIN_VERSION}')"
        )


def _clipping(args: Any, options: dict[str, Any]) -> float | None:
    """The accumulator's max_grad_norm: TrainingArguments' (default 1.0), or accumulator_options' when that is 0.

    Trainer clips when it is above 0; at inf (a way to log the norm) its clipping never scales, as none here (the
    accumulator measures the norm it logs either way)."""
    trainer_norm = 1.0 if args is None else args.max_grad_norm  # Trainer's default TrainingArguments clip at 1.0
    clips = trainer_norm is not None and trainer_norm > 0 and trainer_norm != float("inf")
    trainer_norm = trainer_norm if clips else None
    if trainer_norm is not None and "max_grad_norm" in options:
        raise ValueError(
            f"max_grad_norm is configured twice: TrainingArguments(max_grad_norm={trainer_norm}) and "
            f"accumulator_options['max_grad_norm']={options['max_grad_norm']}; GafusedTrainer clips once, by the "
            "global norm of the finished gradient: keep one (TrainingArguments(max_grad_norm=0) to use the other)"
        )
    return options.pop("max_grad_norm", trainer_norm)


def _check_arguments(args: Any) -> None:
    """Refuse the TrainingArguments GafusedTrainer cannot train with."""
    if args.fp16:
        raise ValueError(
            "fp16=True: GafusedTrainer does not support fp16 loss scaling yet; use bf16=True, or the plain Trainer"
        )
    if args.deepspeed:
        raise ValueError("deepspeed: GafusedTrainer does not support DeepSpeed (it accumulates gradients itself)")
    if args.fsdp:
        raise ValueError("fsdp: GafusedTrainer does not support FSDP through Trainer yet; DDP is supported")
    if args.n_gpu > 1:
        raise ValueError(
            f"n_gpu={args.n_gpu}: GafusedTrainer does not support torch.nn.DataParallel; launch one process per GPU "
            "(torchrun, accelerate launch) for DDP"
        )


def _check_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise TypeError(f"accumulator_options must be a mapping or None, got {type(options).__name__}")
    for key in options:
        if key in _DECIDED:
            raise ValueError(f"accumulator_options[{key!r}]: GafusedTrainer sets it: {_DECIDED[key]}")
        if key not in _OPTIONS:
            raise ValueError(f"accumulator_options[{key!r}]: unknown; GradAccumulator options allowed here: {_OPTIONS}")
    try:
        check_options(**options)
    except ValueError as error:
        raise ValueError(f"accumulator_options: {error}") from None
    return dict(options)
