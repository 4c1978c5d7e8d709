"""Providers: the ways of running one accumulation window that the benchmarks compare.

Every provider computes the same thing per micro-batch: read each ``p.grad`` (assigned from pre-made random
gradients, as backward would), fold it into fp32 accumulators, release it; on the N-th micro-batch also
scale by 1/N, take the global L2 norm, clip to ``max_grad_norm`` exactly like
``torch.nn.utils.clip_grad_norm_``, and leave the finished gradient in ``p.grad`` in the parameter's dtype.
Weights are 1 (the default of ``GradAccumulator.step``). gafused also checks the finished gradient for inf/nan and
skips such a window; the other providers do not (as ``clip_grad_norm_`` with ``error_if_nonfinite=False``).

- ``naive``: the per-parameter loop written today: ``main_grad += p.grad.float()``, then per-parameter
  scaling, clipping and a cast back into ``p.grad``.
- ``foreach``: the same math with torch's multi-tensor ``_foreach_*`` ops.
- ``compiled``: the ``foreach`` functions under ``torch.compile``.
- ``gafused-<backend>``: ``gafused.GradAccumulator`` over a no-op inner optimizer, one backend each.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

import gafused

__all__ = ["NoopOptimizer", "Provider", "PROVIDERS", "provider_names", "unavailable_reason", "make_provider"]

_EPS = 1e-6  # the epsilon of torch.nn.utils.clip_grad_norm_


class Provider:
    """One way of accumulating; ``prepare(moment)`` (untimed) then ``step()`` (timed) measures one micro-batch.

    Args:
        params: the parameters whose ``.grad`` is read.
        grad_pool: one or more lists of gradients (one per parameter), assigned in turn before each step.
        accumulation_steps: micro-batches per window (N >= 3, so the window has a middle).
        max_grad_norm: the clip threshold.
    """

    name = "provider"

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        grad_pool: Sequence[Sequence[torch.Tensor]],
        accumulation_steps: int,
        max_grad_norm: float,
    ) -> None:
        if accumulation_steps < 3:
            raise ValueError(f"accumulation_steps must be >= 3 to have a middle micro-batch, got {accumulation_steps}")
        self.params = list(params)
        self.grad_pool = grad_pool
        self.accumulation_steps = accumulation_steps
        self.max_grad_norm = max_grad_norm
        self._next_grads = 0

    def position(self) -> int:
        """Micro-batches already folded into the open window (0 .. N-1)."""
        raise NotImplementedError

    def step(self) -> None:
        """Consume every ``p.grad`` as one micro-batch; the N-th call finishes the window."""
        raise NotImplementedError

    def _assign_grads(self) -> None:
        grads = self.grad_pool[self._next_grads]
        self._next_grads = (self._next_grads + 1) % len(self.grad_pool)
        for param, grad in zip(self.params, grads, strict=True):
            param.grad = grad

    def prepare(self, moment: str) -> None:
        """Advance the window until the next ``step()`` is the ``moment`` micro-batch, then assign fresh grads.

        Args:
            moment: ``"first"``, ``"middle"`` (the second micro-batch) or ``"last"``.
        """
        target = {"first": 0, "middle": 1, "last": self.accumulation_steps - 1}[moment]
        while self.position() != target:
            self._assign_grads()
            self.step()
        self._assign_grads()


class _ManualWindow(Provider):
    """Window bookkeeping shared by the hand-written providers: fp32 main grads, one per parameter."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.main_grads = [torch.zeros(p.shape, dtype=torch.float32, device=p.device) for p in self.params]
        # Finished gradients for parameters narrower than fp32; fp32 parameters get the main grad itself.
        self.finished = [
            None if p.dtype == torch.float32 else torch.empty(p.shape, dtype=p.dtype, device=p.device)
            for p in self.params
        ]
        self.micro_step = 0

    def position(self) -> int:
        return self.micro_step

    def step(self) -> None:
        grads = [p.grad for p in self.params]
        for param in self.params:
            param.grad = None
        if self.micro_step == 0:
            self._zero()
        last = self.micro_step + 1 == self.accumulation_steps
        if last:
            self._fold_and_finish(grads)
            for param, main, finished in zip(self.params, self.main_grads, self.finished, strict=True):
                param.grad = main if finished is None else finished
            self.micro_step = 0
        else:
            self._fold(grads)
            self.micro_step += 1

    def _zero(self) -> None:
        raise NotImplementedError

    def _fold(self, grads: list[torch.Tensor]) -> None:
        raise NotImplementedError

    def _fold_and_finish(self, grads: list[torch.Tensor]) -> None:
        raise NotImplementedError


class Naive(_ManualWindow):
    """The loop users write today, one tensor at a time."""

    name = "naive"

    def _zero(self) -> None:
        for main in self.main_grads:
            main.zero_()

    def _fold(self, grads: list[torch.Tensor]) -> None:
        for main, grad in zip(self.main_grads, grads, strict=True):
            main += grad.float()

    def _fold_and_finish(self, grads: list[torch.Tensor]) -> None:
        self._fold(grads)
        for main in self.main_grads:
            main.mul_(1.0 / self.accumulation_steps)
        # clip_grad_norm_(..., foreach=False) reads p.grad, which is the bf16 gradient here; its two halves
        # are applied to the fp32 main grads instead, with the same math.
        total = torch.nn.utils.get_total_norm(self.main_grads, 2.0, foreach=False)
        coef = (self.max_grad_norm / (total + _EPS)).clamp(max=1.0)
        for main in self.main_grads:
            main.mul_(coef)
        for main, finished in zip(self.main_grads, self.finished, strict=True):
            if finished is not None:
                finished.copy_(main)


def _foreach_fold(main_grads: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    torch._foreach_add_(main_grads, grads)


def _foreach_fold_and_finish(
    main_grads: list[torch.Tensor],
    grads: list[torch.Tensor],
    finished: list[torch.Tensor],
    inverse_steps: float,
    max_grad_norm: float,
) -> None:
    torch._foreach_add_(main_grads, grads)
    torch._foreach_mul_(main_grads, inverse_steps)
    total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(main_grads, 2.0)), 2.0)
    coef = (max_grad_norm / (total + _EPS)).clamp(max=1.0)
    torch._foreach_mul_(main_grads, coef)
    if finished:
        torch._foreach_copy_(finished, main_grads)


class Foreach(_ManualWindow):
    """The same math as ``naive`` with multi-tensor ops."""

    name = "foreach"
    _fold_fn: Callable = staticmethod(_foreach_fold)
    _finish_fn: Callable = staticmethod(_foreach_fold_and_finish)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # One _foreach_copy_ casts every finished gradient, so it needs all of them or none: one parameter dtype.
        if any(f is None for f in self.finished) and any(f is not None for f in self.finished):
            raise ValueError(f"{self.name}: parameters must share one dtype")
        self._cast_targets = [f for f in self.finished if f is not None]

    def _zero(self) -> None:
        torch._foreach_zero_(self.main_grads)

    def _fold(self, grads: list[torch.Tensor]) -> None:
        self._fold_fn(self.main_grads, grads)

    def _fold_and_finish(self, grads: list[torch.Tensor]) -> None:
        self._finish_fn(self.main_grads, grads, self._cast_targets, 1.0 / self.accumulation_steps, self.max_grad_norm)


class Compiled(Foreach):
    """``foreach`` under ``torch.compile``; the first call compiles (and raises here if compiling fails)."""

    name = "compiled"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._fold_fn = torch.compile(_foreach_fold, dynamic=False)
        self._finish_fn = torch.compile(_foreach_fold_and_finish, dynamic=False)


class NoopOptimizer(torch.optim.Optimizer):
    """An optimizer whose step does nothing, so a benchmark times the accumulation alone."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        super().__init__(params, {})

    def step(self, closure: Callable | None = None) -> None:
        return None


class Gafused(Provider):
    """``gafused.GradAccumulator`` with one named backend."""

    def __init__(self, *args, backend: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.name = f"gafused-{backend}"
        self.accumulator = gafused.GradAccumulator(
            NoopOptimizer(self.params),
            accumulation_steps=self.accumulation_steps,
            max_grad_norm=self.max_grad_norm,
            backend=backend,
        )

    def position(self) -> int:
        return self.accumulator.micro_step

    def step(self) -> None:
        self.accumulator.step()


# Every provider that can be asked for: the torch ones, then one per backend gafused knows (whether or not it
# runs here: ``provider_names`` says which do, ``unavailable_reason`` why the others do not).
PROVIDERS = ("naive", "foreach", "compiled", *(f"gafused-{backend}" for backend in gafused.ops.BACKENDS))


def provider_names(device: torch.device) -> list[str]:
    """Providers that can run on ``device``: the three torch ones plus every gafused backend that is available.

    Triton on CPU would run in its interpreter, which is a correctness tool, not something to time.
    """
    device = torch.device(device)
    backends = [b for b in gafused.available_backends(device) if not (b == "triton" and device.type != "cuda")]
    return ["naive", "foreach", "compiled", *(f"gafused-{b}" for b in backends)]


def unavailable_reason(name: str, device: torch.device) -> str | None:
    """Why provider ``name`` (one of ``PROVIDERS``) is not timed on ``device``; None when it is."""
    device = torch.device(device)
    if name in provider_names(device):
        return None
    if not name.startswith("gafused-"):
        raise ValueError(f"provider must be one of {PROVIDERS}, got {name!r}")
    backend = name.removeprefix("gafused-")
    reason = gafused.ops.backend_unavailable_reason(backend, device)
    if reason is not None:
        return reason
    return f"the {backend} backend runs on {device.type} only in its interpreter, which is not timed"


def make_provider(
    name: str,
    params: Sequence[torch.Tensor],
    grad_pool: Sequence[Sequence[torch.Tensor]],
    accumulation_steps: int,
    max_grad_norm: float,
) -> Provider:
    """Build provider ``name`` (one of ``PROVIDERS``) over ``params``; see ``Provider`` for the arguments."""
    args = (params, grad_pool, accumulation_steps, max_grad_norm)
    if name == "naive":
        return Naive(*args)
    if name == "foreach":
        return Foreach(*args)
    if name == "compiled":
        return Compiled(*args)
    if name.startswith("gafused-") and name.removeprefix("gafused-") in gafused.ops.BACKENDS:
        return Gafused(*args, backend=name.removeprefix("gafused-"))
    raise ValueError(f"provider must be one of {PROVIDERS}, got {name!r}")
