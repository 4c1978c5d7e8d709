"""GradAccumulator: the drop-in optimizer wrapper.

The user's loop keeps calling ``backward`` / ``step`` / ``zero_grad`` every micro-batch. Each ``step()`` folds
the micro-batch's gradients into flat accumulation buffers and releases them; the N-th call (or ``flush()``)
finishes the window: scale by 1 / sum of weights, global norm, non-finite check, clip, then the inner
optimizer's step. The math is docs/design.md section 1; the window is a small state machine:

    micro_step == 0  --step()-->  micro_step == 1  ...  --step() (the N-th) or flush()-->  finished
                                                                                          (inner step or skip)
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from gafused import ops
from gafused.buffer import ACCUM_DTYPES, FlatGradBuffer

__all__ = ["GradAccumulator"]

_BACKEND_CHOICES = ("auto", *ops.BACKENDS)
_STATE_VERSION = 1


@dataclass
class _Group:
    """One flat buffer and the parameters (one device, one dtype) that accumulate into it."""

    buffer: FlatGradBuffer
    names: list[str]
    backend: str
    # Host-side record of which parameters got a gradient in the open window: known without a sync.
    had_grad: list[bool] = field(default_factory=list)
    # Finished gradients cast to the parameters' dtype, when that differs from the accumulation dtype.
    finished: torch.Tensor | None = None

    @property
    def params(self) -> list[torch.Tensor]:
        return self.buffer.params

    @property
    def param_dtype(self) -> torch.dtype:
        return self.buffer.params[0].dtype


def _check_positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _check_max_norm(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"max_grad_norm must be None or a positive finite number, got {value!r}")
    return float(value)


class GradAccumulator:
    """Wrap an optimizer so that N micro-batches make one optimizer step, with fused, correctly scaled math.

    The finished gradient of a window of k micro-batches is ``sum(w_i * g_i) / sum(w_i)`` (k = N, or fewer
    on ``flush()``), accumulated in ``accum_dtype`` whatever the parameters' dtype. Its global L2 norm is
    reported as ``grad_norm`` and, with ``max_grad_norm``, it is clipped exactly like
    ``torch.nn.utils.clip_grad_norm_``. A non-finite finished gradient skips the inner step.

    Args:
        optimizer: any ``torch.optim.Optimizer``; every parameter of its ``param_groups`` is managed.
        accumulation_steps: micro-batches per optimizer step (N >= 1).
        max_grad_norm: clip the finished gradient to this global L2 norm; None disables clipping.
        accum_dtype: accumulation dtype, ``torch.float32`` (default) or ``torch.float64``. float64
            parameters always accumulate in float64: the buffer is never narrower than the parameter.
        backend: ``"auto"``, ``"reference"``, ``"triton"`` or ``"cuda"``. ``"auto"`` takes
            ``$GAFUSED_BACKEND`` when set, else the fastest backend that runs on each device.
        grad_scaler: an enabled ``torch.amp.GradScaler`` for fp16 loss scaling. Call
            ``scaler.scale(loss).backward()`` and nothing else of the scaler: the accumulator folds
            1 / scale into each micro-batch's weight, keeps the scale fixed within a window, and updates
            the scaler once per window, exactly as ``scaler.step`` / ``scaler.update`` would.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        accumulation_steps: int,
        max_grad_norm: float | None = None,
        accum_dtype: torch.dtype = torch.float32,
        backend: str = "auto",
        grad_scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, GradAccumulator):
            raise TypeError("optimizer must be the inner torch.optim.Optimizer, not another GradAccumulator")
        self.accumulation_steps: int = _check_positive_int(accumulation_steps, "accumulation_steps")
        self.max_grad_norm: float | None = _check_max_norm(max_grad_norm)
        if accum_dtype not in ACCUM_DTYPES:
            raise ValueError(f"accum_dtype must be one of {ACCUM_DTYPES}, got {accum_dtype!r}")
        if not isinstance(backend, str) or backend not in _BACKEND_CHOICES:
            raise ValueError(f"backend must be one of {_BACKEND_CHOICES}, got {backend!r}")
        if grad_scaler is not None and not isinstance(grad_scaler, torch.amp.GradScaler):
            raise TypeError(f"grad_scaler must be a torch.amp.GradScaler or None, got {type(grad_scaler).__name__}")

        self.optimizer: torch.optim.Optimizer = optimizer
        self.accum_dtype: torch.dtype = accum_dtype
        self.grad_scaler = grad_scaler if grad_scaler is not None and grad_scaler.is_enabled() else None
        self._groups: list[_Group] = self._build_groups(optimizer, accum_dtype, backend)
        self._home: torch.device = self._groups[0].buffer.device
        self._managed_count: int = sum(len(group.params) for group in self._groups)

        self.micro_step: int = 0
        self.stepped: bool = False
        self.skipped_steps: int = 0
        self.grad_norm: torch.Tensor | None = None
        self._weight_sum: torch.Tensor | None = None  # float64, home device
        self._bad_weight: torch.Tensor | None = None  # bool, home device: a device weight failed its check
        self._inv_loss_scale: torch.Tensor | None = None  # 1 / GradScaler scale, fixed for the window
        self._window_lrs: list[Any] | None = None
        self._warned_lr_change = False

    # --- construction -----------------------------------------------------------------------------------

    @staticmethod
    def _build_groups(optimizer: torch.optim.Optimizer, accum_dtype: torch.dtype, backend: str) -> list[_Group]:
        by_key: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[str]]] = {}
        for group_index, param_group in enumerate(optimizer.param_groups):
            for param_index, param in enumerate(param_group["params"]):
                name = f"param_groups[{group_index}]['params'][{param_index}] (shape {tuple(param.shape)})"
                if param.is_complex() or not param.is_floating_point():
                    raise ValueError(f"{name}: parameters must be real floating point, got {param.dtype}")
                if param.layout != torch.strided:
                    raise ValueError(f"{name}: parameters must be dense (strided), got layout {param.layout}")
                params, names = by_key.setdefault((param.device, param.dtype), ([], []))
                params.append(param)
                names.append(name)
        if not by_key:
            raise ValueError("optimizer has no parameters to manage")
        groups = []
        for (device, dtype), (params, names) in by_key.items():
            buffer_dtype = torch.float64 if dtype == torch.float64 else accum_dtype
            buffer = FlatGradBuffer(params, accum_dtype=buffer_dtype)
            chosen = ops.resolve_backend(backend, device)
            groups.append(_Group(buffer=buffer, names=names, backend=chosen, had_grad=[False] * len(params)))
        return groups

    # --- public attributes ------------------------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's param groups (an LR scheduler reads and writes them there)."""
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        """The inner optimizer's per-parameter state."""
        return self.optimizer.state

    @property
    def backend(self) -> str:
        """The backend that runs the ops; ``"cuda,reference"``-style when buffers on different devices differ."""
        return ",".join(dict.fromkeys(group.backend for group in self._groups))

    @property
    def buffers(self) -> list[FlatGradBuffer]:
        """The flat accumulation buffers, one per (device, parameter dtype)."""
        return [group.buffer for group in self._groups]

    def __repr__(self) -> str:
        return (
            f"GradAccumulator({type(self.optimizer).__name__}, accumulation_steps={self.accumulation_steps}, "
            f"max_grad_norm={self.max_grad_norm}, accum_dtype={self.accum_dtype}, backend={self.backend!r}, "
            f"micro_step={self.micro_step})"
        )

    # --- the loop ---------------------------------------------------------------------------------------

    def step(self, weight: float | torch.Tensor | None = None) -> None:
        """Fold this micro-batch's gradients in; the N-th call of a window finishes it and steps the optimizer.

        Args:
            weight: this micro-batch's weight (a sample or token count), a non-negative finite Python number or
                a 0-d tensor (default 1). A tensor stays on its device: no host sync. A CPU tensor or number
                is checked here; a device tensor is checked on the device and a bad value raises at the end of
                the window (where the one host sync of the step happens), discarding that window.
        """
        self._check_param_set()
        w, bad = self._weight_tensor(weight)
        grads = self._collect_grads()  # every check happens before anything changes
        self._check_lr_unchanged()

        first = self.micro_step == 0
        last = self.micro_step + 1 == self.accumulation_steps
        if first:
            self._start_window()
        if bad is not None:
            self._bad_weight = bad if self._bad_weight is None else self._bad_weight | bad
        weight_sum = w if first else self._weight_sum + w
        fold_weight = w if self._inv_loss_scale is None else w * self._inv_loss_scale

        results = []
        for group, group_grads in zip(self._groups, grads, strict=True):
            group_weight = fold_weight.to(group.buffer.device, non_blocking=True)
            if last:
                scale = weight_sum.reciprocal().to(group.buffer.device, non_blocking=True)
                results.append(
                    ops.fold_finish_(
                        group.buffer, group_grads, group_weight, scale, first=first, backend=group.backend, check=False
                    )
                )
            else:
                ops.fold_(group.buffer, group_grads, group_weight, first=first, backend=group.backend, check=False)
            group.had_grad = [had or grad is not None for had, grad in zip(group.had_grad, group_grads, strict=True)]
            for param in group.params:
                param.grad = None  # folded: release the memory now
        self._weight_sum = weight_sum
        self.micro_step += 1
        self.stepped = False
        if last:
            self._finish(results)

    def flush(self) -> bool:
        """Finish the open (partial) window now, e.g. at the end of an epoch; returns ``stepped``.

        The finished gradient is the weighted mean over the micro-batches folded so far. Does nothing (and
        returns False) when no micro-batch is open. Raises if parameters hold gradients that ``step()`` has not
        folded yet, rather than drop or silently include them.
        """
        self._check_param_set()
        if self.micro_step == 0:
            self.stepped = False
            return False
        unfolded = [
            name
            for group in self._groups
            for param, name in zip(group.params, group.names, strict=True)
            if param.grad is not None
        ]
        if unfolded:
            raise RuntimeError(
                f"flush(): {len(unfolded)} parameter(s) hold gradients not folded by step(), e.g. {unfolded[0]}; "
                "call step() to include them or zero_grad() to drop them first"
            )
        scale = self._weight_sum.reciprocal()
        zero = torch.zeros((), dtype=torch.float64, device=self._home)
        results = [
            ops.fold_finish_(
                group.buffer,
                [None] * len(group.params),
                zero.to(group.buffer.device),
                scale.to(group.buffer.device, non_blocking=True),
                first=False,
                backend=group.backend,
            )
            for group in self._groups
        ]
        self._finish(results)
        return self.stepped

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Release every managed ``p.grad`` (the accumulator owns them; gradients are always set to None).

        Args:
            set_to_none: accepted for drop-in compatibility; gradients are released either way, since a
                zero-filled ``p.grad`` would only be folded as zeros.
        """
        for group in self._groups:
            for param in group.params:
                param.grad = None
            group.finished = None

    # --- window internals -------------------------------------------------------------------------------

    def _check_param_set(self) -> None:
        count = sum(len(param_group["params"]) for param_group in self.optimizer.param_groups)
        if count != self._managed_count:
            raise RuntimeError(
                f"the inner optimizer now has {count} parameters, GradAccumulator was built for "
                f"{self._managed_count}; build a new GradAccumulator after add_param_group()"
            )

    def _weight_tensor(self, weight: float | torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight as a float64 0-d tensor on the home device, and a device flag for unchecked tensor values."""
        if weight is None:
            return torch.ones((), dtype=torch.float64, device=self._home), None
        if isinstance(weight, torch.Tensor):
            if weight.dim() != 0:
                raise ValueError(f"weight must be a number or a 0-d tensor, got shape {tuple(weight.shape)}")
            if weight.dtype == torch.bool or weight.is_complex():
                raise ValueError(f"weight must be a real number, got a tensor of dtype {weight.dtype}")
            if weight.requires_grad:
                weight = weight.detach()
            if weight.device.type == "cpu":  # checking costs no device sync
                self._check_weight_value(weight.item())
                return weight.to(device=self._home, dtype=torch.float64), None
            w = weight.to(device=self._home, dtype=torch.float64, non_blocking=True)
            return w, ~torch.isfinite(w) | (w < 0)
        if isinstance(weight, bool) or not isinstance(weight, int | float):
            raise TypeError(f"weight must be None, a number or a 0-d tensor, got {type(weight).__name__}")
        self._check_weight_value(weight)
        return torch.full((), float(weight), dtype=torch.float64, device=self._home), None

    @staticmethod
    def _check_weight_value(value: float) -> None:
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"weight must be a non-negative finite number, got {value!r}")

    def _collect_grads(self) -> list[list[torch.Tensor | None]]:
        """Every group's gradients, checked before any buffer changes (so a refused step changes nothing)."""
        return [
            ops.check_grads(group.buffer, [param.grad for param in group.params], group.names)
            for group in self._groups
        ]

    def _start_window(self) -> None:
        for group in self._groups:
            group.had_grad = [False] * len(group.params)
            group.finished = None
        self._weight_sum = None
        self._bad_weight = None
        self._window_lrs = [param_group.get("lr") for param_group in self.optimizer.param_groups]
        if self.grad_scaler is not None:
            scale = self.grad_scaler._get_scale_async()
            if scale is None:
                raise RuntimeError(
                    "grad_scaler has no scale yet: call scaler.scale(loss).backward() before step()"
                )
            self._inv_loss_scale = scale.to(device=self._home, dtype=torch.float64).reciprocal()
        else:
            self._inv_loss_scale = None

    def _check_lr_unchanged(self) -> None:
        """Warn once if the learning rate moves inside a window: a scheduler stepped per micro-batch."""
        if self.micro_step == 0 or self._warned_lr_change or self._window_lrs is None:
            return
        lrs = [param_group.get("lr") for param_group in self.optimizer.param_groups]
        if lrs != self._window_lrs:
            self._warned_lr_change = True
            warnings.warn(
                "the learning rate changed inside an accumulation window: step LR schedulers once per optimizer "
                "step, i.e. `if opt.stepped: scheduler.step()`",
                UserWarning,
                stacklevel=3,
            )

    def _finish(self, results: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Norm, non-finite check (the step's one host sync), clip, inner step; then a new window."""
        wide = any(group.buffer.accum_dtype == torch.float64 for group in self._groups)
        norm_dtype = torch.float64 if wide else torch.float32
        total = torch.stack([s.to(self._home, torch.float64, non_blocking=True) for s, _ in results]).sum()
        norm = total.sqrt().to(norm_dtype)
        found_inf = torch.stack([flag.to(self._home, non_blocking=True) for _, flag in results]).any()
        bad_weight = self._bad_weight if self._bad_weight is not None else torch.zeros_like(found_inf)
        self.grad_norm = norm

        nonfinite, bad = torch.stack([found_inf, bad_weight]).tolist()
        if bad:  # a refused window leaves the loss scaler as it was
            self._discard_window()
            raise ValueError(
                "weight: a tensor weight given to step() in this window was negative, nan or inf; the window "
                "was discarded and the inner optimizer did not step"
            )
        if self.grad_scaler is not None:
            self._update_grad_scaler(found_inf)
        if nonfinite:
            self.skipped_steps += 1
            self._discard_window()
            return

        coef = None
        if self.max_grad_norm is not None:
            coef = (self.max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
        for group in self._groups:
            self._publish_grads(group, coef)
        self.optimizer.step()
        self.stepped = True
        self.micro_step = 0

    def _publish_grads(self, group: _Group, coef: torch.Tensor | None) -> None:
        """Apply the clip coefficient and hand the finished gradient to the inner optimizer as ``p.grad``."""
        buffer = group.buffer
        group_coef = None if coef is None else coef.to(buffer.device, non_blocking=True)
        if group.param_dtype == buffer.accum_dtype:
            if group_coef is not None:
                ops.scale_(buffer, group_coef, backend=group.backend)
            source = buffer.data
        else:
            group.finished = torch.empty(buffer.numel, dtype=group.param_dtype, device=buffer.device)
            one = torch.ones((), dtype=buffer.accum_dtype, device=buffer.device)
            ops.scale_(buffer, one if group_coef is None else group_coef, out=group.finished, backend=group.backend)
            source = group.finished
        for index, (param, had_grad) in enumerate(zip(group.params, group.had_grad, strict=True)):
            # A parameter with no gradient in the whole window keeps None, as plain PyTorch would.
            param.grad = buffer.view(index, source) if had_grad else None

    def _discard_window(self) -> None:
        self.zero_grad()
        self.stepped = False
        self.micro_step = 0
        self._weight_sum = None
        self._bad_weight = None

    def _update_grad_scaler(self, found_inf: torch.Tensor) -> None:
        """What ``GradScaler.update`` does after ``GradScaler.step`` found (or did not find) inf in the grads."""
        scaler = self.grad_scaler
        scale, growth_tracker = scaler._check_scale_growth_tracker("update")
        torch._amp_update_scale_(
            scale,
            growth_tracker,
            found_inf.to(device=scale.device, dtype=torch.float32),
            scaler._growth_factor,
            scaler._backoff_factor,
            scaler._growth_interval,
        )

    # --- checkpoints ------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state plus the open window (buffers, weights, position)."""
        window: dict[str, Any] = {
            "version": _STATE_VERSION,
            "accumulation_steps": self.accumulation_steps,
            "micro_step": self.micro_step,
            "skipped_steps": self.skipped_steps,
            "weight_sum": None if self._weight_sum is None else self._weight_sum.clone(),
            "bad_weight": None if self._bad_weight is None else self._bad_weight.clone(),
            "inv_loss_scale": None if self._inv_loss_scale is None else self._inv_loss_scale.clone(),
            "window_lrs": None if self._window_lrs is None else list(self._window_lrs),
            "buffers": [],
        }
        for group in self._groups:
            entry: dict[str, Any] = {"numels": list(group.buffer.numels), "had_grad": list(group.had_grad)}
            if self.micro_step > 0:  # a finished or empty window's buffer holds nothing worth saving
                entry["segments"] = torch.cat([group.buffer.segment(i) for i in range(len(group.params))])
            window["buffers"].append(entry)
        return {"optimizer": self.optimizer.state_dict(), "gafused": window}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what ``state_dict()`` saved; a checkpoint taken mid-window resumes that window exactly.

        Args:
            state_dict: a dict from ``state_dict()`` of an accumulator over the same parameters.
        """
        if not isinstance(state_dict, dict) or "optimizer" not in state_dict or "gafused" not in state_dict:
            raise ValueError("state_dict must come from GradAccumulator.state_dict() (keys 'optimizer', 'gafused')")
        window = state_dict["gafused"]
        if window.get("version") != _STATE_VERSION:
            raise ValueError(f"state_dict: unknown gafused state version {window.get('version')!r}")
        saved = window["buffers"]
        if len(saved) != len(self._groups) or any(
            entry["numels"] != group.buffer.numels for entry, group in zip(saved, self._groups, strict=True)
        ):
            raise ValueError("state_dict: its buffers do not match this accumulator's parameters")
        micro_step = window["micro_step"]
        if micro_step >= self.accumulation_steps:
            raise ValueError(
                f"state_dict: saved mid-window at micro_step {micro_step}, which does not fit "
                f"accumulation_steps={self.accumulation_steps}"
            )
        self.optimizer.load_state_dict(state_dict["optimizer"])

        def restore(value: torch.Tensor | None) -> torch.Tensor | None:
            return None if value is None else value.to(self._home)

        self.micro_step = micro_step
        self.skipped_steps = window["skipped_steps"]
        self._weight_sum = restore(window["weight_sum"])
        self._bad_weight = restore(window["bad_weight"])
        self._inv_loss_scale = restore(window["inv_loss_scale"])
        self._window_lrs = window["window_lrs"]
        self.stepped = False
        for entry, group in zip(saved, self._groups, strict=True):
            group.had_grad = list(entry["had_grad"])
            group.finished = None
            if micro_step > 0:
                segments = entry["segments"].to(group.buffer.device, group.buffer.accum_dtype)
                for index, start in enumerate(_running_starts(group.buffer.numels)):
                    group.buffer.segment(index).copy_(segments[start : start + group.buffer.numels[index]])


def _running_starts(numels: list[int]) -> Iterator[int]:
    start = 0
    for numel in numels:
        yield start
        start += numel
