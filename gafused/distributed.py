"""Across ranks: GradAccumulator owns gradient synchronization for a DDP or FSDP2 model (``model=``).

The finished gradient of a window is ``sum over ranks and micro-batches of w * g``, divided by the GLOBAL sum
of weights (docs/design.md section 6). How the sum over ranks is made depends on the wrapper:

- DDP (``DistributedDataParallel``): DDP's own all-reduce is turned off for good (as under ``no_sync()``), so
  the micro-batches of a window send nothing; after each window DDP's next forward broadcasts the module
  buffers, as it does after a synchronized micro-batch. On the window's last micro-batch each bucket of the flat buffer
  is all-reduced once, in bucket order, as soon as it is folded (during backward when the weight came up
  front). Every rank then holds the same summed buffer, scales it by 1 / global weight sum and measures it:
  the norm is global without another collective, and the replicas stay bitwise identical.
- FSDP2 (``fully_shard``): FSDP reduce-scatters each micro-batch's gradients itself (or, after the user's
  ``set_requires_gradient_sync(False)``, once at the window's last micro-batch); the buffers hold the local
  shards. Since FSDP sums the ranks' gradients before gafused sees them, a micro-batch's weight multiplies
  its loss (``backward(loss, weight=w)``), and the reduced shard is folded with FSDP's divide factor. The norm
  is the all-reduced sum of the shards' squares.

Either way one small all-reduce per window carries the weight sum (float64, exact for any token count), the
bad-weight flag, the micro-step count (to catch ranks that disagree on where the window is), and per parameter
whether the rank gave it a gradient (one that got a gradient on any rank is stepped on every rank, as under DDP)
and per bucket whether the rank folded gradients after the bucket's reduction had started (see
``GradAccumulator._fold_late``).
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import itertools
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from gafused.buffer import FlatGradBuffer

__all__ = ["Sync", "DDPSync", "FSDPSync", "for_model", "warn_without_model"]


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def warn_without_model() -> None:
    """Warn when torch.distributed runs with several ranks and the accumulator was given no ``model=``."""
    world = _world_size()
    if world > 1:
        warnings.warn(
            f"torch.distributed is initialized with {world} ranks but GradAccumulator got no model=: gradients are "
            "accumulated per rank and nothing is reduced across ranks by gafused. Pass model=<the DDP or "
            "fully_shard module> to accumulate exactly across ranks (global token weights, global norm).",
            UserWarning,
            stacklevel=3,
        )


class Sync:
    """What differs across ranks: the default (single process) does nothing.

    Attributes:
        weight_in_loss: the micro-batch's weight multiplies the loss (the wrapper sums ranks during backward).
        fold_factor: the fold weight of a reduced gradient (undoes the wrapper's own division by world size).
        reduces_buckets: buckets are reduced by gafused on a window's last micro-batch.
        shards: parameters are sharded DTensors; the buffers hold their local shards.
    """

    weight_in_loss = False
    fold_factor = 1.0
    reduces_buckets = False
    shards = False
    group: Any = None
    world_size = 1
    rank = 0
    name = "local"

    def local_tensor(self, param: torch.Tensor) -> torch.Tensor:
        """The tensor the buffer lays out for ``param`` (FSDP2: the local shard)."""
        return param

    def local_grad(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        return grad

    def wrap_grad(self, param: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
        """``view`` (a piece of the buffer) as ``param.grad``."""
        return view

    def reduce_window(self, values: torch.Tensor) -> torch.Tensor:
        """Sum a small float64 vector over the ranks (blocking)."""
        return values

    def start_bucket(self, bucket: FlatGradBuffer) -> Any:
        return None

    def wait_bucket(self, bucket: FlatGradBuffer, pending: Any) -> None:
        return None

    def reduce_norm(self, sum_sq: torch.Tensor, nonfinite: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum ``sum_sq`` (float64, one sum of squares per accumulation dtype) and or ``nonfinite`` over the ranks
        whose shards hold parts of the gradient (FSDP2)."""
        return sum_sq, nonfinite

    def check_same_settings(self, settings: dict[str, Any], device: torch.device) -> None:
        """Raise on every rank if the ranks built their accumulators over the model differently (``settings``: name
        -> a value whose ``repr`` is the same on every rank that built it alike).

        Ranks whose buckets differ would pair one rank's bucket with another's in the all-reduces (a gloo abort,
        an NCCL hang or a sum of unrelated gradients), and ranks that clip or normalize differently would let the
        replicas drift apart with no error. One all-reduce (MAX) of a 62-bit digest of each setting and of its
        negation gives every rank the largest and the smallest digest: they differ exactly where a rank
        differs (up to a digest collision)."""
        if self.world_size == 1:
            return
        names = list(settings)
        digests = [_digest(settings[name]) for name in names]
        both = torch.tensor(digests + [-digest for digest in digests], dtype=torch.int64, device=device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
        values = both.tolist()
        differ = [name for i, name in enumerate(names) if values[i] != -values[len(names) + i]]
        if differ:
            here = "; ".join(f"{name}={_short(settings[name])}" for name in differ)
            raise ValueError(
                f"model: the ranks built their GradAccumulators over this model with different {', '.join(differ)} "
                f"(rank {self.rank}: {here}); every rank must pass the same arguments and the same parameters "
                "(the model's same ones, of the same dtypes and shapes) and pick the same backend, or their buckets "
                "and clipping would not match. Nothing was attached to the model"
            )

    def attach(self) -> None:
        """Take over the wrapper's gradient synchronization (once the accumulator is built)."""
        return None

    def detach(self) -> None:
        """Hand the wrapper's gradient synchronization back (the accumulator is gone), in the state the wrapper
        keeps outside its own context managers (DDP: synchronizing)."""
        return None

    def same_model(self, other: Sync) -> bool:
        """Whether ``other`` synchronizes the same wrapped model."""
        model = getattr(self, "_model", None)
        return model is not None and model is getattr(other, "_model", None)

    def window_started(self) -> None:
        """A new window opens: read what the wrapper may have changed between windows."""
        return None

    def window_ended(self) -> None:
        """A window's gradients were reduced across ranks."""
        return None

    def before_forward(self) -> None:
        """The wrapped model's forward is about to run (a forward pre-hook)."""
        return None

    def before_backward(self, last: bool) -> None:
        return None

    def after_backward(self) -> None:
        return None

    def check_window_end(self) -> None:
        """Raise if gradients of the window are still held back by the wrapper at its last micro-batch."""
        return None

    def loses_window(self, landed: bool, unreduced_before: Any) -> bool:
        """Whether a backward that failed once autograd ran discards the open window whatever it folded on this rank
        (``landed``: a gradient of it reached the buffers' hooks; ``unreduced_before``: ``unreduced_fingerprint()``
        as the call began), so that every rank failing there does alike."""
        return False

    def backward_failed(self) -> str | None:
        """After a backward that failed once autograd ran: what to do before the next forward (None: nothing)."""
        return None

    def check_backward_recovered(self, what: str) -> None:
        """Raise (``what`` names the call) if the wrapper is still inside a backward that failed."""
        return None

    def holds_unreduced(self) -> bool:
        """Whether the wrapper holds gradients of the window outside the buffers, not reduced yet (FSDP2 after
        ``set_requires_gradient_sync(False)``)."""
        return False

    def drop_unreduced(self) -> None:
        """Forget what ``holds_unreduced`` found (the window it belongs to is discarded)."""
        return None

    def unreduced_fingerprint(self) -> Any:
        """What the wrapper holds unreduced, as a value that changes when a backward adds to it (None: nothing)."""
        return None

    def unreduced_grads(self, held: set[int]) -> list[str]:
        """The names of the model's parameters holding a gradient that the wrapper would have reduced but, with
        its synchronization taken over, nothing reduces: those whose ids are not in ``held`` (the parameters of
        the accumulators over this model)."""
        return []


def _digest(value: Any) -> int:
    """A 62-bit digest of ``repr(value)``, the same in every process (unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little") >> 2


SETTINGS_CODES = 2  # codes per window: two settings collide in all of them 1 time in 4096^2


def settings_codes(value: Any) -> list[int]:
    """``SETTINGS_CODES`` 12-bit codes of ``repr(value)`` (distinct bits of its digest), the same in every process.
    Each summed, and squared and summed, over the ranks in float64, both sums stay exact integers up to 2^14 ranks,
    so ``ranks * sum(c^2) == sum(c)^2`` tells whether every rank's code is the same. Two different values give the
    same codes 1 time in 4096^2 (one 12-bit code let max_grad_norm=6.95 pass for 0.5)."""
    digest = _digest(value)
    return [(digest >> (12 * index)) % 4096 for index in range(SETTINGS_CODES)]


def _short(value: Any, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _ddp_reduced(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, parameter) of what DDP itself all-reduces: the parameters not in its ignore list
    (``_ddp_params_and_buffers_to_ignore``), matched by either name DDP matches."""
    ignored = model.parameters_to_ignore
    skipped = {
        id(param)
        for prefix, module in model.module.named_modules()
        for name, param in module.named_parameters(recurse=False)
        if f"{prefix}.{name}" in ignored
    }
    return [
        (name, param)
        for name, param in model.module.named_parameters()
        if name not in ignored and id(param) not in skipped
    ]


_JOIN_REFUSED = (
    "model: DDP's join() (uneven inputs) is not supported with GradAccumulator(model=): its join hook shadows DDP's "
    "own all-reduces, not the accumulator's, so a rank that ran out of inputs would leave the others' window "
    "collectives unmatched (an abort or a hang). Give every rank the same number of micro-batches (weight=0 for "
    "padding ones)."
)


class _JoinRefused:
    """DDP's ``join()`` on a model whose synchronization accumulators took over (an instance attribute while they
    live): refused before it changes anything, on every rank (those out of inputs too); ``enable=False``, which
    joins nothing, goes on as DDP's."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model = self._model
        bound = inspect.signature(type(model).join).bind(model, *args, **kwargs)
        if bound.arguments.get("enable", True):
            raise RuntimeError(_JOIN_REFUSED)
        return type(model).join(model, *args, **kwargs)


class _NoSyncHandingBack:
    """DDP's ``no_sync()`` on a model whose synchronization accumulators took over (an instance attribute while
    they live): after the block, synchronizing again if they handed it back meanwhile, since the block's exit
    restored the value it saved when it was entered, off."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        model = self._model
        with type(model).no_sync(model):
            yield
        if vars(model).get("no_sync") is not self:  # removed by DDPSync.detach
            model.require_backward_grad_sync = True


class DDPSync(Sync):
    """DDP: gafused all-reduces each bucket once per window, in bucket order, on the last micro-batch."""

    reduces_buckets = True
    name = "ddp"

    def __init__(self, model: torch.nn.Module, params: list[torch.Tensor], reduce_dtype: torch.dtype | None) -> None:
        self._reduced = _ddp_reduced(model)  # (name, parameter) of what DDP itself would all-reduce
        reduced = {id(param) for _, param in self._reduced}
        for index, param in enumerate(params):
            if id(param) not in reduced:
                name = next(name for name, owned in model.module.named_parameters() if owned is param)
                raise ValueError(
                    f"model: parameter {index} of the optimizer ({name}) is one DDP ignores "
                    "(_ddp_params_and_buffers_to_ignore): DDP leaves its gradient to each rank, while an accumulator "
                    "with model= sums every gradient it holds over the ranks; step it with a separate optimizer"
                )
        if model.static_graph:
            raise ValueError(
                "model: DistributedDataParallel(static_graph=True) is not supported: gafused turns DDP's gradient "
                "synchronization off and reduces the buckets itself, which a static-graph reducer cannot follow "
                "(it fails with an internal assert); build the DDP module with static_graph=False"
            )
        if getattr(model, "_comm_hooks", None):
            hook = model._comm_hooks[0][0]
            warnings.warn(
                f"model: the DDP module has a communication hook ({getattr(hook, '__name__', type(hook).__name__)}, "
                "from register_comm_hook or Lightning's DDPStrategy(ddp_comm_hook=...)) that will not run: gafused "
                "turns DDP's all-reduce off and all-reduces each bucket itself once per window "
                "(reduce_dtype=torch.bfloat16 halves its bytes)",
                stacklevel=4,
            )
        self._model = model
        self.group = model.process_group
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.reduce_dtype = reduce_dtype
        self._attached = False

    def attach(self) -> None:
        # Off while the accumulator lives: the window's micro-batches send nothing.
        model = self._model
        model.require_backward_grad_sync = False
        self._attached = True
        # A no_sync() block entered now saves that value (off) and puts it back at its exit: if the accumulator is
        # handed back inside the block, the exit would leave DDP unsynchronized for good. The instance's no_sync
        # turns it on again after such an exit; it goes when the last accumulator over the model does.
        if "no_sync" not in vars(model):
            model.no_sync = _NoSyncHandingBack(model)
        if "join" not in vars(model):
            model.join = _JoinRefused(model)

    def before_forward(self) -> None:
        # DDP decides at its forward whether the backward all-reduces. Off again before each one: the exit of a
        # no_sync() block entered before the accumulator was built restores the value it saw then (on).
        if self._attached:
            join = getattr(self._model, "_join_config", None)
            if join is not None and join.enable:
                # Join([model]) entered directly, or a join entered before the accumulator was built (model.join()
                # is refused while it lives): every rank raises here, before DDP's first collective.
                raise RuntimeError(
                    f"{_JOIN_REFUSED} A DDP module once used under join() keeps its join collectives after the "
                    "block: wrap the model in a new DDP"
                )
            self._model.require_backward_grad_sync = False

    def detach(self) -> None:
        if not self._attached:
            return
        self._attached = False
        model = self._model
        model.require_backward_grad_sync = True  # DDP's own setting outside no_sync()
        if isinstance(vars(model).get("no_sync"), _NoSyncHandingBack):
            del model.no_sync
        if isinstance(vars(model).get("join"), _JoinRefused):
            del model.join

    def unreduced_grads(self, held: set[int]) -> list[str]:
        return [
            name
            for name, param in self._reduced
            if param.requires_grad and param.grad is not None and id(param) not in held
        ]

    def window_ended(self) -> None:
        # What a synchronized backward leaves behind in DDP: its next forward broadcasts rank 0's module buffers
        # (BatchNorm statistics; unless broadcast_buffers=False), once per window as with no_sync().
        self._model.require_forward_param_sync = True

    def reduce_window(self, values: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(values, group=self.group)
        return values

    def start_bucket(self, bucket: FlatGradBuffer) -> Any:
        data = bucket.data
        if self.reduce_dtype is not None and self.reduce_dtype != data.dtype:
            wire = data.to(self.reduce_dtype)
        else:
            wire = data
        return wire, dist.all_reduce(wire, group=self.group, async_op=True)

    def wait_bucket(self, bucket: FlatGradBuffer, pending: Any) -> None:
        wire, work = pending
        work.wait()
        if wire is not bucket.data:
            bucket.data.copy_(wire)


class FSDPSync(Sync):
    """FSDP2: FSDP reduce-scatters the gradients; the buffers hold the local shards."""

    weight_in_loss = True
    shards = True
    name = "fsdp2"

    def __init__(self, model: torch.nn.Module, params: list[torch.Tensor]) -> None:
        from torch.distributed.tensor import DTensor, Shard

        self._model = model
        meshes = set()
        for index, param in enumerate(params):
            if not isinstance(param, DTensor):
                raise ValueError(
                    f"model: parameter {index} of the optimizer (shape {tuple(param.shape)}) is not sharded by "
                    "fully_shard (not a DTensor)"
                )
            if param.device_mesh.ndim != 1 or len(param.placements) != 1 or not isinstance(param.placements[0], Shard):
                raise NotImplementedError(
                    f"model: parameter {index} has placements {param.placements} on a {param.device_mesh.ndim}-D "
                    "mesh; gafused supports fully_shard over a 1-D mesh (no HSDP or tensor parallelism yet)"
                )
            meshes.add(param.device_mesh)
        if len(meshes) != 1:
            raise NotImplementedError("model: the parameters live on more than one device mesh")
        self.mesh = meshes.pop()
        self.group = self.mesh.get_group()
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.fold_factor = self._divide_factor()
        self._dtensor = DTensor
        # What FSDP holds unreduced is read for these parameters alone: another accumulator over the same model has
        # its own (two optimizers over one model).
        self._param_ids = frozenset(id(param) for param in params)
        self._own: list[Any] | None = None
        self._user_sync: list[tuple[Any, bool, bool]] = []  # FSDP param groups' sync flags before a last backward

    def window_started(self) -> None:
        # set_gradient_divide_factor() may have been called since the last window.
        self.fold_factor = self._divide_factor()

    def _divide_factor(self) -> float:
        """What FSDP divides the reduce-scattered sum by: its gradient divide factor, else the world size."""
        factors = set()
        for param_group in self._param_groups():
            if not hasattr(param_group, "gradient_divide_factor"):
                raise NotImplementedError(
                    f"model: this torch ({torch.__version__}) does not expose FSDP2's gradient divide factor"
                )
            factors.add(param_group.gradient_divide_factor)
        if len(factors) > 1:
            raise ValueError(f"model: the fully_shard modules use different gradient divide factors {factors}")
        factor = factors.pop() if factors else None
        return float(self.world_size if factor is None else factor)

    def local_tensor(self, param: torch.Tensor) -> torch.Tensor:
        return param.to_local()

    def local_grad(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        if grad is None or not isinstance(grad, self._dtensor):
            return grad  # a plain tensor is checked (and refused) by ops.check_grads like any bad gradient
        return grad.to_local()

    def wrap_grad(self, param: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
        return self._dtensor.from_local(
            view, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )

    def reduce_window(self, values: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(values, group=self.group)
        return values

    def reduce_norm(self, sum_sq: torch.Tensor, nonfinite: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        both = torch.cat([sum_sq.to(torch.float64).reshape(-1), nonfinite.to(torch.float64).reshape(1)])
        dist.all_reduce(both, group=self.group)
        return both[:-1], both[-1] > 0

    def _param_groups(self) -> list[Any]:
        from torch.distributed.fsdp import FSDPModule

        groups = []
        for module in self._model.modules():
            if isinstance(module, FSDPModule):
                state = module._get_fsdp_state()
                several = getattr(state, "_fsdp_param_groups", None)  # newer torch: several groups per module
                one = None if several is not None else getattr(state, "_fsdp_param_group", None)
                groups.extend(several if several is not None else [] if one is None else [one])
        return groups

    def before_backward(self, last: bool) -> None:
        # The window's last micro-batch must reach the shards, whatever the user set for the earlier ones; what
        # the user set comes back after it (set_requires_gradient_sync(False) once keeps the next windows quiet).
        if last:
            self._user_sync = [(group, group.reduce_grads, group.all_reduce_grads) for group in self._param_groups()]
            self._model.set_requires_gradient_sync(True)

    def after_backward(self) -> None:
        for group, reduce_grads, all_reduce_grads in self._user_sync:
            group.reduce_grads, group.all_reduce_grads = reduce_grads, all_reduce_grads
        self._user_sync = []

    def _fsdp_params(self) -> Iterator[Any]:
        for param_group in self._param_groups():  # every group of a module that has several (newer torch)
            yield from getattr(param_group, "fsdp_params", ())

    def _own_fsdp_params(self) -> list[Any]:
        # FSDP's FSDPParam objects live as long as the model: found once (a walk of every module), found again if
        # one of them holds another parameter since.
        own = self._own
        if own is None or any(id(fsdp_param.sharded_param) not in self._param_ids for fsdp_param in own):
            own = self._own = [
                fsdp_param for fsdp_param in self._fsdp_params() if id(fsdp_param.sharded_param) in self._param_ids
            ]
        return own

    def _held(self) -> Iterator[torch.Tensor]:
        # What FSDP's post-backward reduce-scatters when the sync is on: an accumulated unsharded gradient, or the
        # unsharded parameter's own.
        for fsdp_param in self._own_fsdp_params():
            accumulated = getattr(fsdp_param, "unsharded_accumulated_grad", None)
            if accumulated is not None:
                yield accumulated
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None and unsharded.grad is not None:
                yield unsharded.grad

    def holds_unreduced(self) -> bool:
        return next(self._held(), None) is not None

    def unreduced_fingerprint(self) -> Any:
        # A backward adds to a held gradient in place (its version moves) or gives a new one (its tag).
        held = tuple((_tag(grad), grad._version) for grad in self._held())
        return held or None

    def drop_unreduced(self) -> None:
        for fsdp_param in self._own_fsdp_params():
            if getattr(fsdp_param, "unsharded_accumulated_grad", None) is not None:
                fsdp_param.unsharded_accumulated_grad = None
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None:
                unsharded.grad = None

    def loses_window(self, landed: bool, unreduced_before: Any) -> bool:
        # Each rank cuts its buckets from its own shards, so a backward failing at one point on every rank may have
        # completed a bucket (folded it into the window) on one rank and not on another. FSDP reduces and hands over
        # the same parameters' gradients on every rank (empty shards too), and adds to what it holds unreduced alike
        # (its reset_iter_state() does not drop those).
        return landed or self.unreduced_fingerprint() != unreduced_before

    def _recovery(self) -> str:
        if hasattr(self._model, "reset_iter_state"):
            return (
                "call model.reset_iter_state() on the root fully_shard module (FSDP2's recovery after a failed "
                "backward) and run the next forward after it"
            )
        return (
            f"this torch ({torch.__version__}) has no FSDPModule.reset_iter_state() to recover with: resume from a "
            "checkpoint in new processes"
        )

    def _stuck(self) -> bool:
        # FSDP queues its backward's final callback (which reduces what is left, reshards and resets its state) as
        # the first of its modules' backward starts; a backward that fails never runs it, and FSDP's next backward
        # neither queues it again nor reduces anything. Between backwards the flag is set only after one that failed
        # (this accumulator's or a plain loss.backward()), or after a compiled-autograd backward that succeeded.
        context = getattr(self._model._get_fsdp_state(), "_state_ctx", None)
        return bool(getattr(context, "post_backward_final_callback_queued", False)) and not _compiled_autograd()

    def backward_failed(self) -> str | None:
        if not self._stuck():
            return None
        return f"FSDP2's state is left mid-backward: {self._recovery()}"

    def check_backward_recovered(self, what: str) -> None:
        if not self._stuck():
            return
        raise RuntimeError(
            f"{what}: FSDP2 is still inside a backward that failed (its state was not reset, so it would neither "
            f"reduce nor reshard); nothing changed; {self._recovery()}"
        )

    def check_window_end(self) -> None:
        if self.holds_unreduced():
            raise RuntimeError(
                "step(): FSDP still holds unreduced gradients at the window's last micro-batch (after "
                "set_requires_gradient_sync(False)); call model.set_requires_gradient_sync(True) before "
                "the last micro-batch's backward, or use opt.backward(loss, weight=w), which does (given "
                "end_window=True on a driven window's last micro-batch)"
                + (f"; after a backward that failed, {self._recovery()}" if self._stuck() else "")
            )


def _compiled_autograd() -> bool:
    """Whether backward may run under compiled autograd (looked up without importing torch._dynamo)."""
    compiled = sys.modules.get("torch._dynamo.compiled_autograd")
    dynamo = sys.modules.get("torch._dynamo")
    return bool(getattr(compiled, "compiled_autograd_enabled", False)) or bool(
        getattr(getattr(dynamo, "config", None), "compiled_autograd", False)
    )


_TAGS = itertools.count(1)
_TAGGED = WeakIdKeyDictionary()


def _tag(tensor: torch.Tensor) -> int:
    """A number no other tensor gets, even after this one is freed: ``id`` would be reused by a tensor allocated
    later (FSDP's next unreduced gradient often lands at the address of the one dropped before it)."""
    tag = _TAGGED.get(tensor)
    if tag is None:
        tag = _TAGGED[tensor] = next(_TAGS)
    return tag


def for_model(model: torch.nn.Module, params: list[torch.Tensor], reduce_dtype: torch.dtype | None) -> Sync:
    """The synchronization for ``model``; checks that every optimizer parameter belongs to it."""
    from torch.nn.parallel import DistributedDataParallel

    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    except ImportError:  # torch built without distributed support
        FSDPModule = FullyShardedDataParallel = ()  # noqa: N806

    if FullyShardedDataParallel and isinstance(model, FullyShardedDataParallel):
        raise TypeError(
            "model: FullyShardedDataParallel (FSDP1) is not supported: its gradient norm is per shard and its "
            "flat parameters hide the layout; shard the model with torch.distributed.fsdp.fully_shard (FSDP2)"
        )
    is_ddp = isinstance(model, DistributedDataParallel)
    is_fsdp = bool(FSDPModule) and isinstance(model, FSDPModule)
    if not (is_ddp or is_fsdp):
        compiled = getattr(model, "_orig_mod", None)  # what torch.compile(module) returns wraps the module
        hint = (
            f" (torch.compile's wrapper of a {type(compiled).__name__}: pass the module it compiled, model._orig_mod)"
            if isinstance(compiled, torch.nn.Module)
            else ""
        )
        raise TypeError(
            "model must be a DistributedDataParallel module or a module sharded with "
            f"torch.distributed.fsdp.fully_shard, got {type(model).__name__}{hint}"
        )
    owned = {id(param) for param in model.parameters()}
    for index, param in enumerate(params):
        if id(param) not in owned:
            raise ValueError(
                f"model: parameter {index} of the optimizer (shape {tuple(param.shape)}) is not a parameter of "
                "model; gafused would accumulate it without reducing it across ranks"
            )
    if is_fsdp:
        if reduce_dtype is not None:
            raise ValueError(
                "reduce_dtype applies to DDP models; FSDP2 reduces in the dtype of its own "
                "MixedPrecisionPolicy(reduce_dtype=...)"
            )
        return FSDPSync(model, params)
    return DDPSync(model, params, reduce_dtype)
