"""GradAccumulator: the drop-in optimizer wrapper.

Two loops feed it. The recommended one gives each micro-batch's weight up front,
``opt.backward(loss, weight=w); opt.step(); opt.zero_grad()``: gradients are folded into the flat buffers
during backward, one bucket at a time as soon as its gradients exist, and released at once (ingest.py), so
the buffer costs no more memory than the ``p.grad`` set it replaces. The other,
``loss.backward(); opt.step(weight=w)``, folds every gradient at ``step()``. Either way the window's last
``step()`` (or ``flush()``) finishes the window: scale by 1 / sum of weights (``normalization="mean"``) or by 1
(``"sum"``), global norm, non-finite check, clip, then the inner optimizer's step. The math is docs/design.md
section 1; the window is a small state machine:

    micro_step == 0  --step()-->  micro_step == 1  ...  --the window's last step(), or flush()-->  finished
                                                                                             (inner step or skip)

A window's last micro-batch is the N-th (``accumulation_steps=N``, a *counted* window) or the one the caller
declares with ``end_window=True`` on its ``backward()`` or ``step()`` (any window; with
``accumulation_steps=None``, a *driven* window, the only way besides ``flush()``). Within a micro-batch,
``backward()`` may be called several times (several losses); the micro-batch ends at ``step()``. On the last
micro-batch of a window each bucket's fold also applies the window scale and measures the bucket (the fused
finish), so finishing costs no extra pass over the buffer; a window declared over only at ``step()``, after
its buckets were folded, takes one extra pass, as ``flush()`` does.

GradAccumulator is a ``torch.optim.Optimizer`` whose ``param_groups``, ``state`` and ``defaults`` are the inner
optimizer's, so LR schedulers and training frameworks take it. Its public methods run outside torch.compile
(``torch._disable_dynamo``, as torch's own ``Optimizer.zero_grad`` does): a compiled train step breaks its graph
once per call into the accumulator and never traces the window's bookkeeping (which would specialize on, and
recompile for, every micro-step).
"""

from __future__ import annotations

import collections.abc
import contextlib
import functools
import itertools
import math
import numbers
import operator
import sys
import uuid
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.amp.grad_scaler import OptState

from gafused import checkpoint, distributed, ops
from gafused.buffer import ACCUM_DTYPES, DEFAULT_BUCKET_BYTES, PARAM_DTYPES, FlatGradBuffer, by_device_and_dtype
from gafused.checkpoint import NORMALIZATIONS, STATE_VERSION, by_identity, running_starts
from gafused.ingest import BucketHooks

__all__ = ["GradAccumulator"]

_BACKEND_CHOICES = ("auto", *ops.BACKENDS)
# float16 is not one: a bucket holds sum(w * g) over the window's micro-batches (weights such as token counts),
# which overflows float16's range (65504) long before float32's.
_REDUCE_DTYPES = (torch.float32, torch.bfloat16, torch.float64)
# The attributes a user may set (each a checked property below).
_SETTINGS = ("accumulation_steps", "normalization", "max_grad_norm")
# Inner optimizers that cannot run on a finished dense gradient handed over as p.grad.
_UNSUPPORTED_OPTIMIZERS = {
    torch.optim.LBFGS: "it re-evaluates the loss through a closure, which a window of micro-batches cannot give",
    torch.optim.SparseAdam: "it needs sparse gradients, and accumulated gradients are dense",
}


# Every accumulator built and not yet collected (a new one over the same parameters releases what they handed out).
_LIVE_ACCUMULATORS: weakref.WeakSet[GradAccumulator] = weakref.WeakSet()


@dataclass
class _Group:
    """One flat buffer and the parameters (one device, one dtype) that accumulate into it."""

    buffer: FlatGradBuffer
    # The optimizer's parameters, whose .grad is read and written (FSDP2: sharded DTensors; the buffer lays
    # out their local shards, buffer.params).
    params: list[torch.Tensor]
    names: list[str]
    backend: str
    # Host-side record of which parameters got a gradient in the open window: known without a sync.
    had_grad: list[bool] = field(default_factory=list)
    # Finished gradients cast to the parameters' dtype, when that differs from the accumulation dtype.
    finished: torch.Tensor | None = None
    # The views handed out as p.grad by the last inner step; released before the next backward adds to them.
    published: list[torch.Tensor | None] | None = None
    # The version of the views' memory once the inner step and its post-hooks were done with them.
    published_version: int | None = None
    # Whether each published view has a release hook (its parameter required grad when it was handed out).
    hooked: list[bool] = field(default_factory=list)
    # Whether each view's release hook found it still in p.grad (a backward reached the parameter since): in eager
    # mode the view is gone from p.grad then; under compiled autograd the release comes after the accumulation.
    release_ran: list[bool] = field(default_factory=list)
    # Buckets folded in the open micro-batch (the first fold of a window's first micro-batch overwrites).
    bucket_touched: list[bool] = field(default_factory=list)
    # (sum of squares, non-finite flag) of each bucket finished during the last micro-batch of a window.
    bucket_results: list[tuple[torch.Tensor, torch.Tensor] | None] = field(default_factory=list)
    # This micro-batch's fold weight and (on a window's last micro-batch) the window scale, on the buffer's device.
    fold_weight: torch.Tensor | None = None
    scale: torch.Tensor | None = None

    @property
    def param_dtype(self) -> torch.dtype:
        return self.buffer.params[0].dtype


def _whole_number(value: Any) -> int | None:
    """``value`` as an int if it is an integer (Python or NumPy, not bool), else None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


def _check_positive_int(value: Any, name: str) -> int:
    number = _whole_number(value)
    if number is None or number < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return number


def _real_number(value: Any) -> float | None:
    """``value`` as a float if it is a real number (Python or NumPy, not bool) that fits a float, else None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or type(value).__name__ == "bool_":
        return None
    try:
        return float(value)
    except OverflowError:
        return math.inf


def _edits(a: str, b: str) -> int:
    """How many single-letter insertions, deletions, substitutions or swaps of neighbours turn ``a`` into ``b``."""
    previous, row = None, list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        before, previous, row = previous, row, [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            row[j] = min(previous[j] + 1, row[j - 1] + 1, previous[j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                row[j] = min(row[j], before[j - 2] + 1)
    return row[-1]


def _check_accumulation_steps(value: Any) -> int | None:
    if value is None:
        return None
    number = _whole_number(value)
    if number is None or number < 1:
        raise ValueError(
            f"accumulation_steps must be a positive int, or None for windows ended by the caller, got {value!r}"
        )
    return number


def _check_max_norm(value: Any) -> float | None:
    if value is None:
        return None
    number = _real_number(value)
    if number is None or not math.isfinite(number) or number <= 0:
        raise ValueError(f"max_grad_norm must be None or a positive finite number, got {ops.number_text(value)}")
    return number


def check_options(
    *,
    max_grad_norm: Any = None,
    accum_dtype: Any = torch.float32,
    backend: Any = "auto",
    bucket_bytes: Any = DEFAULT_BUCKET_BYTES,
    reduce_dtype: Any = None,
) -> None:
    """Refuse a value of these ``GradAccumulator`` arguments as its constructor would, naming it: for the adapters,
    which take them long before they build the accumulator."""
    _check_max_norm(max_grad_norm)
    if accum_dtype not in ACCUM_DTYPES:
        raise ValueError(f"accum_dtype must be one of {ACCUM_DTYPES}, got {accum_dtype!r}")
    if not isinstance(backend, str) or backend not in _BACKEND_CHOICES:
        raise ValueError(f"backend must be one of {_BACKEND_CHOICES}, got {backend!r}")
    _check_positive_int(bucket_bytes, "bucket_bytes")
    if reduce_dtype is not None and reduce_dtype not in _REDUCE_DTYPES:
        why = (
            " (a bucket holds the weighted sum of the window's gradients, beyond float16's range of 65504 for "
            "token-count weights; torch.bfloat16 halves the bytes with float32's range)"
            if reduce_dtype == torch.float16
            else ""
        )
        raise ValueError(f"reduce_dtype must be None or one of {_REDUCE_DTYPES}, got {reduce_dtype!r}{why}")


class GradAccumulator(torch.optim.Optimizer):
    """Wrap an optimizer so that a window of micro-batches makes one optimizer step, with fused, correctly scaled
    math.

    The finished gradient of a window of k micro-batches is ``sum(w_i * g_i) / sum(w_i)`` (k = N, or fewer when
    the window is ended early), or ``sum(w_i * g_i)`` with ``normalization="sum"``, accumulated in
    ``accum_dtype`` whatever the parameters' dtype. Its global L2 norm is reported as ``grad_norm`` and, with
    ``max_grad_norm``, it is clipped exactly like ``torch.nn.utils.clip_grad_norm_``. A non-finite finished
    gradient skips the inner step, as does one that overflows the parameters' dtype when cast to it.

    It is a ``torch.optim.Optimizer``: ``param_groups``, ``state`` and ``defaults`` are the inner optimizer's
    (read and written there), so LR schedulers build on it and change the inner optimizer's learning rate. Step
    hooks registered on it (``register_step_pre_hook`` / ``register_step_post_hook``) fire once per inner step,
    around it, as ``hook(accumulator, (), {})``; a skipped window fires none.

    Args:
        optimizer: any ``torch.optim.Optimizer`` that steps on ``p.grad`` (not LBFGS or SparseAdam); every
            parameter of its ``param_groups`` is managed, each listed once.
        accumulation_steps: micro-batches per optimizer step (N >= 1): the N-th ``step()`` of a window ends it.
            None makes *driven* windows, ended only by the caller: ``end_window=True`` on the last micro-batch's
            ``backward()`` or ``step()``, or ``flush()`` after it. ``end_window=True`` ends a counted window early
            too.
        max_grad_norm: clip the finished gradient to this global L2 norm; None disables clipping.
        accum_dtype: accumulation dtype, ``torch.float32`` (default) or ``torch.float64``. float64
            parameters always accumulate in float64: the buffer is never narrower than the parameter.
        backend: ``"auto"``, ``"reference"``, ``"foreach"``, ``"triton"`` or ``"cuda"``. ``"auto"`` takes
            ``$GAFUSED_BACKEND`` when set, else the fastest backend that runs on each device.
        grad_scaler: an enabled ``torch.amp.GradScaler`` for fp16 loss scaling. ``backward(loss)`` scales the
            loss itself; with ``loss.backward()`` loops call ``scaler.scale(loss).backward()``. Nothing else of
            the scaler: the accumulator folds 1 / scale (the scale the micro-batch's loss was scaled with) into
            each micro-batch's weight and updates the scaler once per window, as ``scaler.step`` /
            ``scaler.update`` would; a step after ``scaler.step(opt)`` or ``scaler.unscale_(opt)`` is refused. A
            scaler serves one live accumulator: another that uses it is refused.
        bucket_bytes: ``backward()`` folds gradients in buckets of about this many bytes of buffer, each as
            soon as backward has produced all its gradients; at most about one bucket of fresh gradients is
            alive beside the buffers.
        model: under torch.distributed, the ``DistributedDataParallel`` module or the module sharded with
            ``fully_shard`` (FSDP2) that computes the gradients. gafused then owns gradient synchronization:
            the finished gradient is the sum over ranks and micro-batches of ``w * g`` divided by the global
            weight sum, ``grad_norm`` is global, and each bucket is reduced once per window (DDP's own
            all-reduce is turned off, as under ``no_sync()``). ``step()`` on a window's last micro-batch and
            ``flush()`` are then collective: every rank calls them. See gafused/distributed.py.
        reduce_dtype: DDP only: the dtype buckets are all-reduced in (default: the accumulation dtype;
            ``torch.bfloat16`` halves the bytes and rounds the summed gradient to bfloat16).
        normalization: how a window's micro-batches combine. ``"mean"`` (default): the weighted mean
            ``sum(w_i * g_i) / sum(w_i)``, for losses mean-reduced over their own micro-batch. ``"sum"``: the plain
            sum ``sum(w_i * g_i)`` (weights default to 1), for losses a framework already normalized over the
            whole window (transformers' ``num_items_in_batch``); with ``model=`` the sum runs over the ranks too.
            May be changed between windows (the ``normalization`` property).
    """

    # A step() with no gradient since the last one and no weight is refused (a mistake that dilutes the window's
    # mean); an adapter whose framework counts such a micro-batch with weight 1 (Accelerate) sets this.
    _counts_empty_steps = False

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        accumulation_steps: int | None,
        max_grad_norm: float | None = None,
        accum_dtype: torch.dtype = torch.float32,
        backend: str = "auto",
        grad_scaler: torch.amp.GradScaler | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        *,
        model: torch.nn.Module | None = None,
        reduce_dtype: torch.dtype | None = None,
        normalization: str = "mean",
    ) -> None:
        # torch.optim.Optimizer.__init__ is not called: the parameter groups, state and defaults are the inner
        # optimizer's (properties below). These are the hook tables its register_* methods fill.
        self._optimizer_step_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        # A class is named as one (the instance is what was meant); an unsupported or wrapped optimizer, class or not,
        # says why it cannot be wrapped.
        kind = optimizer if isinstance(optimizer, type) else type(optimizer)
        if issubclass(kind, GradAccumulator):
            raise TypeError("optimizer must be the inner torch.optim.Optimizer, not another GradAccumulator")
        for unsupported, why in _UNSUPPORTED_OPTIMIZERS.items():
            if issubclass(kind, unsupported):
                raise TypeError(f"optimizer: {unsupported.__name__} cannot be wrapped: {why}")
        if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer instance, got the class {optimizer.__name__}: build it "
                f"first, e.g. GradAccumulator({optimizer.__name__}(model.parameters(), lr=...), ...)"
            )
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.accumulation_steps = accumulation_steps  # checked by the property setters below
        self.max_grad_norm = max_grad_norm
        self.normalization = normalization
        check_options(accum_dtype=accum_dtype, backend=backend, bucket_bytes=bucket_bytes, reduce_dtype=reduce_dtype)
        if grad_scaler is not None and not isinstance(grad_scaler, torch.amp.GradScaler):
            raise TypeError(f"grad_scaler must be a torch.amp.GradScaler or None, got {type(grad_scaler).__name__}")
        if model is None:
            if reduce_dtype is not None:
                raise ValueError("reduce_dtype is for the buckets of a DDP model: pass model= as well")
            distributed.warn_without_model()
            sync = distributed.Sync()
        else:
            params = [param for param_group in optimizer.param_groups for param in param_group["params"]]
            sync = distributed.for_model(model, params, reduce_dtype)

        self._optimizer: torch.optim.Optimizer = optimizer
        self._accum_dtype: torch.dtype = accum_dtype
        self._grad_scaler = grad_scaler if grad_scaler is not None and grad_scaler.is_enabled() else None
        self._sync: distributed.Sync = sync
        self._global: bool = model is not None  # windows end with collectives (every rank takes part)
        # Across ranks the buffers are laid out in the model's parameter order, the same on every rank whatever order
        # each rank's optimizer lists them in (groups built from a set of names, say): buckets and per-parameter
        # flags are reduced by position.
        model_order = None if model is None else {id(param): index for index, param in enumerate(model.parameters())}
        self._groups: list[_Group] = self._build_groups(
            optimizer, accum_dtype, backend, bucket_bytes, sync, model_order
        )
        _warn_of_frozen_parameters(self._groups)
        self._home: torch.device = self._groups[0].buffer.device
        # With model=, a collective: before anything is attached to the model or its parameters.
        sync.check_same_settings(self._settings(reduce_dtype, model_order), self._home)
        # The largest finite value of the narrowest parameter dtype whose finished gradient is cast down from the
        # buffer (fp16: 65504), or None: a finished value beyond it would reach the inner step as inf.
        self._cast_limit: float | None = min(
            (
                torch.finfo(group.param_dtype).max
                for group in self._groups
                if torch.finfo(group.param_dtype).max < torch.finfo(group.buffer.accum_dtype).max
            ),
            default=None,
        )
        # The weights a fold can carry: 0, or a normal number of the narrowest accumulation dtype (a float32 weight
        # beyond it would fold as inf or lose its precision to underflow).
        narrowest = min((group.buffer.accum_dtype for group in self._groups), key=lambda d: torch.finfo(d).max)
        self._weight_range: tuple[float, float, torch.dtype] = (
            torch.finfo(narrowest).tiny,
            torch.finfo(narrowest).max,
            narrowest,
        )
        # With normalization="mean" the window is scaled by 1 / its weight sum, a normal number of that dtype only while
        # the sum is at most 1 / tiny (float32: 8.5e37): beyond, the scale is subnormal (precision lost) or 0 (a sum
        # that overflowed), and the window would step with a wrong or an all-zero gradient.
        self._largest_mean_sum = 1 / torch.finfo(narrowest).tiny
        # In the inner optimizer's order: a parameter swapped there would be stepped with a gradient never folded.
        self._managed: tuple[torch.Tensor, ...] = tuple(
            param for param_group in optimizer.param_groups for param in param_group["params"]
        )
        # Each parameter's device, dtype, grad_dtype, shape and strides as the buffers were laid out for: checked at
        # window edges (strides may change where no element moves, see _same_memory_order).
        self._kinds = list(map(_KIND_OF, self._managed))
        self._strides = list(map(torch.Tensor.stride, self._managed))
        # Each parameter's tensor as autograd knows it when its hooks were attached, and this accumulator's mark in its
        # __dict__, which torch.utils.swap_tensors swaps away with the tensor (see _rearm_swapped): a random int, which
        # a Parameter saved with it loads with (torch.load's weights_only takes ints), in a dict of every live
        # accumulator's marks (set once construction can no longer fail).
        self._tensors = list(map(_TENSOR_OF, self._managed))
        self._hook_mark = uuid.uuid4().int

        self._micro_step: int = 0
        self._stepped: bool = False
        self._skipped_steps: int = 0
        # Windows ended (stepped or skipped) since the accumulator was built or loaded: compared across ranks with
        # the settings at each window's end, so a window whose end failed on some ranks only, after its collectives
        # (a step pre-hook or the inner step raising there), is seen at the next one instead of leaving the replicas
        # apart for good.
        self._windows_ended = 0
        self._grad_norm: torch.Tensor | None = None
        self._weight_sum: torch.Tensor | None = None  # float64, home device
        self._rank_mismatch: torch.Tensor | None = None  # bool, home device: ranks disagree on the window
        self._bad_weight: torch.Tensor | None = None  # bool, home device: a device weight failed its check
        self._inv_loss_scale: torch.Tensor | None = None  # 1 / GradScaler scale of the micro-batch last folded
        self._window_lrs: list[Any] | None = None
        self._warned_lr_change = False
        # The open micro-batch of the backward() loop: its weight (as given, and as a tensor) and whether it is
        # the window's last; None when no backward() call opened one.
        self._micro: _MicroBatch | None = None
        self._published_hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._managed_ids = frozenset(id(param) for param in self._managed)
        # The managed parameters in the order the buffers were laid out from (_build_groups): the model's with model=.
        self._layout_kind = "optimizer" if model_order is None else "model"
        self._layout_order: tuple[torch.Tensor, ...] = (
            self._managed
            if model_order is None
            else tuple(sorted(self._managed, key=lambda param: model_order[id(param)]))
        )
        # The other live accumulators over some of these parameters (usually none): each one's finished gradients
        # are not new gradients for the other.
        self._overlapping: weakref.WeakSet[GradAccumulator] = weakref.WeakSet()
        # The last backward() of another accumulator that gave some of these parameters their p.grad (two optimizers
        # over one loss): this one's step() or backward() must count that micro-batch with the same weight.
        self._weighted_elsewhere: _WeightedElsewhere | None = None
        self._hooks = BucketHooks(
            [group.buffer for group in self._groups], self, [group.params for group in self._groups]
        )
        # Across ranks: buckets reduced on a window's last micro-batch, launched in this fixed order on every
        # rank (collectives must match), each as soon as it and every bucket before it are folded.
        self._reduce_order: list[tuple[int, int]] = [
            (g, b) for g, group in enumerate(self._groups) for b in range(len(group.buffer.bucket_ranges))
        ]
        self._reducing = False  # folding the last micro-batch of a window whose buckets gafused reduces
        # Gradients the GradScaler unscaled in p.grad (a refused step()), by parameter, held weakly: while any is
        # still a p.grad, no step() or backward() may fold it.
        self._unscaled_grads: list[tuple[torch.Tensor, weakref.ref]] = []
        # Set while the step pre-hooks and the inner step run (the finished gradients in p.grad, the window not closed
        # yet): the calls that read or move the window are refused from there (_check_not_stepping).
        self._stepping = False
        self._ready: set[tuple[int, int]] = set()
        self._pending: dict[tuple[int, int], Any] = {}
        # Gradients that reached a bucket after its reduction had started (see _fold_late), per bucket.
        self._late: dict[tuple[int, int], FlatGradBuffer] = {}
        # Across ranks: per parameter, how many ranks gave it a gradient in the window, then per bucket, how many
        # folded late (float64, home device); read at the window's one host sync.
        self._rank_flags: torch.Tensor | None = None
        # What FSDP (its sync off) held unreduced when the last micro-batch ended (Sync.unreduced_fingerprint).
        self._unreduced_seen: Any = None
        self._model_hook: torch.utils.hooks.RemovableHandle | None = None
        if model is not None:
            self._model_hook = model.register_forward_pre_hook(_before_model_forward(self))
        sync.attach()  # last: a refused construction leaves the model's own synchronization as it was
        self._attached = True
        for param in self._managed:
            _mark(param, self._hook_mark)
        # Finished gradients an earlier accumulator over these parameters handed out are views of its buffers, not
        # new gradients: released, or the first step() here would fold them again.
        for other in list(_LIVE_ACCUMULATORS):
            if not self._managed_ids.isdisjoint(other._managed_ids):
                other._release_published()
                other._overlapping.add(self)
                self._overlapping.add(other)
        self._inner_hook = optimizer.register_step_pre_hook(_refuse_direct_inner_step(weakref.ref(self)))
        _LIVE_ACCUMULATORS.add(self)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Lightning's ``LightningOptimizer`` (what ``self.optimizers()`` returns) makes its class a subclass of
        the wrapped optimizer's and forwards reads of attributes it lacks to it; a method of the accumulator found
        on the wrapper's class would run on the wrapper and keep the window's state there, where the accumulator
        never sees it. On such a class every attribute the accumulator's classes define, and the wrapper's class
        does not, is the accumulator's (its ``repr`` too): ``self.optimizers().backward(...)`` runs ``backward`` of
        the accumulator."""
        super().__init_subclass__(**kwargs)
        wrapper = next((base for base in cls.__mro__ if base.__name__ == "LightningOptimizer"), None)
        if wrapper is None:
            return
        for base in cls.__mro__:
            if issubclass(base, GradAccumulator):
                for name in vars(base):
                    forwarded = not name.startswith("__") or name == "__repr__"  # (repr names the inner optimizer)
                    if forwarded and name not in vars(wrapper) and name not in vars(cls):
                        setattr(cls, name, _OnTheWrapped(name))

    def __del__(self, _finalizing: Callable[[], bool] = sys.is_finalizing) -> None:
        # At interpreter exit there is nothing to undo, and this module's globals may be None already (Python clears
        # modules in an order that can leave an accumulator of the user's script to be collected after this module).
        if _finalizing():
            return
        # What this object built, read from its own attributes: a wrapper whose class subclasses this one and
        # forwards attribute reads to an accumulator (Lightning's LightningOptimizer) must not tear that one down.
        state = vars(self)
        hooks = state.get("_hooks")
        if hooks is not None:
            hooks.remove()
        mark = state.get("_hook_mark")
        for param in state.get("_managed", ()) if mark is not None else ():
            _unmark(param, mark)
        if "_groups" in state and "_published_hooks" in state:
            # The finished gradients are views of buffers about to go: an accumulator built next over the same
            # parameters would take them for new gradients and fold them again.
            self._release_published()
        for hook in (state.get("_model_hook"), state.get("_inner_hook")):
            if hook is not None:
                hook.remove()
        if state.get("_attached", False) and not any(
            other is not self and other._sync.same_model(self._sync)
            for other in list(_LIVE_ACCUMULATORS or ())  # None once the module is torn down at interpreter exit
        ):
            self._sync.detach()  # DDP synchronizes its own backward again, unless a newer accumulator owns it

    # --- construction -----------------------------------------------------------------------------------

    def _settings(self, reduce_dtype: torch.dtype | None, model_order: dict[int, int] | None) -> dict[str, Any]:
        """What every rank's accumulator over one model must share: its arguments, and per buffer the parameters'
        dtype, shapes and places in the model (``model_order``: id -> position), the backend and (where gafused
        all-reduces the buckets, DDP) the bucket cuts. Devices differ across ranks (cuda:0, cuda:1) and so, under
        FSDP2, do the local shards and their buckets."""
        settings: dict[str, Any] = {
            "accumulation_steps": None if self.accumulation_steps is None else int(self.accumulation_steps),
            "max_grad_norm": self.max_grad_norm,  # a float: 1 and 1.0 are alike
            "normalization": self.normalization,
            "accum_dtype": self._accum_dtype,
            "grad_scaler": self._grad_scaler is not None,
            "reduce_dtype": reduce_dtype,
            "parameters": [
                (group.buffer.device.type, group.param_dtype, [tuple(param.shape) for param in group.params])
                for group in self._groups
            ],
            "backend": [group.backend for group in self._groups],
        }
        if model_order is not None:  # two accumulators over one model, their parameters crossed between ranks
            settings["model positions"] = [[model_order[id(param)] for param in group.params] for group in self._groups]
        if self._sync.reduces_buckets:
            settings["bucket_bytes"] = [
                [(r.start, r.stop) for r in group.buffer.bucket_ranges] for group in self._groups
            ]
        return settings

    @staticmethod
    def _build_groups(
        optimizer: torch.optim.Optimizer,
        accum_dtype: torch.dtype,
        backend: str,
        bucket_bytes: int,
        sync: distributed.Sync,
        model_order: dict[int, int] | None = None,
    ) -> list[_Group]:
        """One buffer per (device, dtype) of the optimizer's parameters, in the optimizer's order, or with
        ``model_order`` (id -> position in the model) in the model's: the buffers' parameters, and the buffers by
        their first parameter."""
        listed: list[tuple[torch.Tensor, str]] = []  # (parameter, its name in errors), in the optimizer's order
        seen: dict[int, str] = {}
        for group_index, param_group in enumerate(optimizer.param_groups):
            for param_index, param in enumerate(param_group["params"]):
                if torch.nn.parameter.is_lazy(param):
                    raise ValueError(
                        f"param_groups[{group_index}]['params'][{param_index}]: parameters must have a shape, got an "
                        "uninitialized one of a lazy module; run one forward (or the module's initialize_parameters) "
                        "before building GradAccumulator"
                    )
                name = f"param_groups[{group_index}]['params'][{param_index}] (shape {tuple(param.shape)})"
                if id(param) in seen:
                    raise ValueError(
                        f"{name} is the same tensor as {seen[id(param)]}: each parameter must be listed once, "
                        "or its gradient would be counted twice"
                    )
                seen[id(param)] = name
                if param.dtype not in PARAM_DTYPES:
                    raise ValueError(
                        f"{name}: parameters must be float16, bfloat16, float32 or float64, got {param.dtype}"
                    )
                if param.layout != torch.strided:
                    raise ValueError(f"{name}: parameters must be dense (strided), got layout {param.layout}")
                if param.is_meta:
                    raise ValueError(
                        f"{name}: parameters must hold data, got one on the meta device; build GradAccumulator after "
                        "the model is materialized (model.to_empty(device=...), then its initialization)"
                    )
                if not param.is_leaf:
                    raise ValueError(
                        f"{name}: parameters must be leaf tensors (autograd gives them .grad), got the result of an "
                        f"operation ({type(param.grad_fn).__name__}); a differentiable step through non-leaf "
                        "tensors is not supported (the accumulator folds gradients' values)"
                    )
                grad_dtype = getattr(param, "grad_dtype", None)
                if grad_dtype is not None and grad_dtype != param.dtype:
                    raise ValueError(
                        f"{name}: grad_dtype is {grad_dtype}, not the parameter's dtype {param.dtype}. GradAccumulator "
                        "accumulates in its own buffer (accum_dtype) and gives the inner optimizer gradients in the "
                        "parameter's dtype: leave grad_dtype at its default"
                    )
                listed.append((param, name))
        if not listed:
            raise ValueError("optimizer has no parameters to manage")
        if model_order is not None:
            listed.sort(key=lambda pair: model_order[id(pair[0])])
        groups = []
        for pairs in by_device_and_dtype(listed, key=lambda pair: pair[0]):
            params, names = [param for param, _ in pairs], [name for _, name in pairs]
            device, dtype = params[0].device, params[0].dtype
            buffer_dtype = torch.float64 if dtype == torch.float64 else accum_dtype
            local = [sync.local_tensor(param) for param in params]
            buffer = FlatGradBuffer(local, accum_dtype=buffer_dtype, bucket_bytes=bucket_bytes)
            chosen = ops.resolve_backend(backend, device)
            group = _Group(buffer=buffer, params=params, names=names, backend=chosen, had_grad=[False] * len(params))
            group.bucket_touched = [False] * len(buffer.bucket_ranges)
            group.bucket_results = [None] * len(buffer.bucket_ranges)
            groups.append(group)
        return groups

    # --- public attributes ------------------------------------------------------------------------------

    def __setattr__(self, name: str, value: Any) -> None:
        # A new public attribute is legal (GradScaler sets optimizer.grad_scale), but one at most two edits from a
        # setting is a typo that would leave the setting as it was: opt.max_grad_nrom = 0.5 would never clip.
        if name[:1] != "_" and name not in self.__dict__ and not hasattr(type(self), name):
            meant = [setting for setting in _SETTINGS if _edits(name, setting) <= 2]
            if meant:
                raise AttributeError(
                    f"GradAccumulator has no setting {name!r}: did you mean {meant[0]!r}? (the settings are "
                    f"{', '.join(_SETTINGS)})"
                )
        object.__setattr__(self, name, value)

    @property
    def accumulation_steps(self) -> int | None:
        """Micro-batches per optimizer step (None: driven windows). May be changed between micro-batches, to a
        count above the open window's ``micro_step``."""
        return self._accumulation_steps

    @accumulation_steps.setter
    def accumulation_steps(self, value: int | None) -> None:
        steps = _check_accumulation_steps(value)
        if getattr(self, "_micro", None) is not None:
            raise RuntimeError(
                "accumulation_steps: backward() opened a micro-batch; change it after that micro-batch's step()"
            )
        micro_step = getattr(self, "_micro_step", 0)
        if steps is not None and steps <= micro_step:
            raise ValueError(
                f"accumulation_steps must be above the open window's micro_step ({micro_step}), got {steps}: the "
                "window could never end; flush() it first"
            )
        self._accumulation_steps = steps

    @property
    def normalization(self) -> str:
        """``"mean"`` or ``"sum"`` (see the constructor); may be changed between windows."""
        return self._normalization

    @normalization.setter
    def normalization(self, value: str) -> None:
        if not isinstance(value, str) or value not in NORMALIZATIONS:
            raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {value!r}")
        current = getattr(self, "_normalization", value)
        if value != current and (getattr(self, "_micro_step", 0) or getattr(self, "_micro", None) is not None):
            raise RuntimeError(
                f"normalization: the open window is accumulated to be finished as {current!r}; change it between "
                "windows (after the window's last step(), or after flush())"
            )
        self._normalization = value

    @property
    def max_grad_norm(self) -> float | None:
        """The global L2 norm the finished gradient is clipped to (None: no clipping); may be changed any time."""
        return self._max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value: float | None) -> None:
        self._max_grad_norm = _check_max_norm(value)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's param groups (an LR scheduler reads and writes them there)."""
        return self._optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._optimizer.param_groups = value

    @property
    def state(self) -> Any:
        """The inner optimizer's per-parameter state."""
        return self._optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self._optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        """The inner optimizer's defaults (frameworks and schedulers such as OneCycleLR read them)."""
        return self._optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self._optimizer.defaults = value

    # Read-only: the accumulator's state, changed only by its own calls (setting one would desynchronize the window).
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The inner optimizer, stepped once per window."""
        return self._optimizer

    @property
    def micro_step(self) -> int:
        """Micro-batches folded into the open window (0 between windows)."""
        return self._micro_step

    @property
    def stepped(self) -> bool:
        """Whether the last ``step()`` (or ``flush()``) ran the inner optimizer's step."""
        return self._stepped

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """Global L2 norm of the last finished window's gradient, before clipping (0-d tensor; None before one)."""
        return self._grad_norm

    @property
    def skipped_steps(self) -> int:
        """Windows not stepped: the finished gradient held inf or nan, its sum of squares overflowed the
        accumulation dtype, its weights summed to zero, or its cast to the parameters' dtype overflowed."""
        return self._skipped_steps

    @property
    def accum_dtype(self) -> torch.dtype:
        """The accumulation dtype asked for: gradients of float64 parameters accumulate in float64 whatever it is
        (``buffers`` hold each buffer's own)."""
        return self._accum_dtype

    @property
    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """The GradScaler whose scale the folds undo (None without one, or when the one given is disabled)."""
        return self._grad_scaler

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
            f"GradAccumulator({type(self._optimizer).__name__}, accumulation_steps={self.accumulation_steps}, "
            f"normalization={self.normalization!r}, max_grad_norm={self.max_grad_norm}, "
            f"accum_dtype={self._accum_dtype}, backend={self.backend!r}, micro_step={self._micro_step})"
        )

    def register_step_pre_hook(self, hook: Callable[..., Any]) -> torch.utils.hooks.RemovableHandle:
        """Register ``hook(optimizer, args, kwargs) -> None``, called once per inner step, just before it, with the
        finished, clipped gradient in ``p.grad`` (never on a micro-step that only folds, nor on a skipped window).

        Unlike ``torch.optim.Optimizer``'s, the hook cannot change the step's arguments: the inner step takes none.
        It is called with ``()`` and ``{}`` and must return None (or those, unchanged); any other result raises
        at the window's end, discarding the window.

        Returns:
            A handle whose ``remove()`` unregisters the hook.
        """
        return super().register_step_pre_hook(_callable_hook(hook, "register_step_pre_hook"))

    # torch.optim.Optimizer registers any object; one that cannot be called would fail only when it runs (a window
    # discarded at its end, a load_state_dict() that loaded everything and then raised): refused here instead.
    def register_step_post_hook(self, hook: Callable[..., Any]) -> torch.utils.hooks.RemovableHandle:
        return super().register_step_post_hook(_callable_hook(hook, "register_step_post_hook"))

    def register_state_dict_pre_hook(
        self, hook: Callable[..., Any], prepend: bool = False
    ) -> torch.utils.hooks.RemovableHandle:
        return super().register_state_dict_pre_hook(_callable_hook(hook, "register_state_dict_pre_hook"), prepend)

    def register_state_dict_post_hook(
        self, hook: Callable[..., Any], prepend: bool = False
    ) -> torch.utils.hooks.RemovableHandle:
        return super().register_state_dict_post_hook(_callable_hook(hook, "register_state_dict_post_hook"), prepend)

    def register_load_state_dict_pre_hook(
        self, hook: Callable[..., Any], prepend: bool = False
    ) -> torch.utils.hooks.RemovableHandle:
        return super().register_load_state_dict_pre_hook(
            _callable_hook(hook, "register_load_state_dict_pre_hook"), prepend
        )

    def register_load_state_dict_post_hook(
        self, hook: Callable[..., Any], prepend: bool = False
    ) -> torch.utils.hooks.RemovableHandle:
        return super().register_load_state_dict_post_hook(
            _callable_hook(hook, "register_load_state_dict_post_hook"), prepend
        )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused: the buffers are laid out for the parameters the accumulator was built with.

        Add the group to the inner optimizer before building the GradAccumulator, or build a new one after.
        """
        raise RuntimeError(
            "add_param_group(): GradAccumulator's buffers are laid out for the parameters it was built with; add the "
            "group to the inner optimizer and build a new GradAccumulator"
        )

    def __getstate__(self) -> dict[str, Any]:
        # torch.optim.Optimizer pickles (and deep-copies) its groups and state only; the accumulator also holds
        # hooks on the model's parameters and views of their gradients, which a copy would not carry over.
        raise TypeError(
            "GradAccumulator cannot be pickled or copied: it holds hooks on the model's parameters. Save "
            "state_dict() and load it into a GradAccumulator built over the new parameters"
        )

    # --- the loop ---------------------------------------------------------------------------------------

    @torch._disable_dynamo  # host bookkeeping around autograd: one graph break, never traced (module docstring)
    def backward(
        self,
        loss: torch.Tensor,
        weight: float | torch.Tensor | None = None,
        *,
        end_window: bool = False,
        retain_graph: bool | None = None,
        create_graph: bool = False,
        inputs: Sequence[torch.Tensor] | None = None,
    ) -> None:
        """Backpropagate ``loss`` and fold its gradients into the buffers during backward, bucket by bucket.

        The recommended loop is ``opt.backward(loss, weight=w); opt.step(); opt.zero_grad()``. A micro-batch may
        call ``backward`` several times (several losses, ``retain_graph``); it ends at ``step()``. Gradients of
        managed parameters are released as they are folded, so ``p.grad`` is None afterwards. With
        ``create_graph=True`` the gradients' values are folded (their graphs are dropped).

        If backward fails after this call folded gradients, the open window cannot be separated from the partial
        micro-batch: it is discarded (``micro_step`` back to 0) and the error is raised. If it fails before folding
        anything (autograd refused the graph, say), the gradients it left are dropped and the window, with what
        earlier ``backward`` calls of the micro-batch folded, is as it was. Under FSDP2 the window is discarded as
        soon as FSDP handed over a reduced gradient of the call or the call changed what FSDP holds unreduced (what
        one rank's buckets of its shards folded by then, another's may not have); where FSDP is left mid-backward,
        the note names ``model.reset_iter_state()`` (FSDP's recovery), without which ``backward()`` and ``step()``
        refuse.

        Args:
            loss: the micro-batch's loss (mean-reduced as usual; never divided by N): a one-element tensor that
                requires grad. With ``grad_scaler`` set, the accumulator scales it.
            weight: this micro-batch's weight (a sample or token count), as for ``step(weight=...)``; default 1.
                Give it to the first ``backward`` of a micro-batch; later ones may repeat it or pass None. Where
                another accumulator's ``backward`` gave these parameters gradients still in ``p.grad`` (two optimizers
                over one loss), this backward would add into them: refused unless the micro-batch's weight is that
                backward's (as for ``step()``).
            end_window: this micro-batch is the window's last: its ``step()`` finishes the window and steps the
                inner optimizer, whatever ``accumulation_steps`` says (a framework's sync step, the partial last
                window of an epoch). Given to the micro-batch's first ``backward``, the buckets are finished as
                they are folded; given later, ``step()`` finishes the window with one more pass over the buffers.
            retain_graph: as in ``torch.autograd.backward``.
            create_graph: as in ``torch.autograd.backward``.
            inputs: as in ``torch.autograd.backward``.
        """
        self._check_not_stepping("backward()")
        self._sync.check_backward_recovered("backward()")
        ops.check_bool(end_window, "end_window")
        _check_loss(loss)
        inputs = _check_autograd_options(retain_graph, create_graph, inputs)
        if self._unscaled_grads and self._holds_unscaled_grads():
            raise RuntimeError(
                "backward(): p.grad holds gradients the grad_scaler unscaled (a step() was refused for it), to which "
                "autograd would add this loss's; drop them with opt.zero_grad() first"
            )
        self._check_param_set(identity=self._micro is None and self._micro_step == 0, before_backward=True)
        micro = self._micro
        if micro is None:
            w, bad = self._weight_tensor(weight)
        elif weight is not None and not _same_weight(weight, micro.given):
            raise ValueError(
                f"weight: this micro-batch's weight was given as {micro.given!r} by an earlier backward(); "
                f"got {weight!r} (pass an equal number or CPU tensor, the same GPU tensor, or None; call step() to "
                "end the micro-batch)"
            )
        elif micro.last and self._sync.reduces_buckets:
            # The first call's gradients were reduced across ranks as they were folded: stepping without this loss
            # would leave part of the micro-batch out, so the window cannot end well any more.
            self._discard_window()
            raise RuntimeError(
                "backward(): with model=, a window's last micro-batch takes one backward() call (its buckets are "
                "reduced across ranks as they are folded, so the first call's are reduced already); the window was "
                "discarded (micro_step is 0 again), as on every rank that makes this call: sum the losses and call "
                "backward() once"
            )
        self._check_lr_unchanged()
        # Gradients another accumulator's backward gave these parameters: this backward adds into them and folds them
        # with its micro-batch's weight, so they must have been given it.
        self._check_weight_from_elsewhere(weight if micro is None else micro.given, "backward()")
        if self._grad_scaler is not None:
            loss = self._grad_scaler.scale(loss)
        if micro is None and self._sync.weight_in_loss:
            # FSDP2 sums the ranks' gradients during backward: the weight must be in the loss already. Rounded to
            # the loss's dtype (the dtype backward carries it in), it is the weight counted in the window's sum too.
            bad = self._check_weight_fits_loss(weight, w, bad, loss.dtype)
            w = w.to(loss.dtype).to(torch.float64)
            loss = loss * w.to(loss.dtype)
        elif micro is not None and self._sync.weight_in_loss:
            loss = loss * micro.weight.to(loss.dtype)
        # The last step's finished gradients go before autograd runs: no bucket may take one for a new gradient,
        # and a cast copy's memory is free for this backward (also when the call fails). So do those another live
        # accumulator over some of these parameters handed out.
        self._release_published()
        for other in self._others_publishing():
            other._release_published_of(self._managed_ids)
        opened = micro is None
        ended_before = None if opened else micro.ends_window
        # What p.grad held before this call (usually None): restored if the call fails before folding anything.
        held_before = [_grads_and_versions(group.params) for group in self._groups]
        unreduced_before = self._sync.unreduced_fingerprint()  # what FSDP2 holds unreduced (usually None)
        others_before: dict[GradAccumulator, _OthersBefore] = {}
        autograd_ran = False
        # From here on a failure (an interrupt too, which lands as any call returns) is undone below: the micro-batch
        # this call opened or declared the last, and the wrapper's sync setting, go back to what they were.
        try:
            if opened:
                micro = self._open_micro_batch(weight, w, bad, end_window)
            elif end_window:
                micro.ends_window = True
            micro.folded_in_call = False
            others_before = self._others_grads()
            self._hooks.start()
            try:
                self._sync.before_backward(micro.ends_window)
                autograd_ran = True
                torch.autograd.backward(loss, retain_graph=retain_graph, create_graph=create_graph, inputs=inputs)
            finally:
                self._sync.after_backward()
            self._hooks.stop()
            self._fold_held_buckets(self._held_grads())
        except BaseException as error:
            self._hooks.stop(learn=False)
            lost = autograd_ran and self._sync.loses_window(self._hooks.landed_any(), unreduced_before)
            discarded = micro is not None and (micro.folded_in_call or lost)
            if discarded:
                # Part of this micro-batch is in the buffers and cannot be told apart from the rest of the window; or
                # (FSDP2) it may be on another rank, which discards the window.
                self._discard_window()
                _add_note(
                    error,
                    "gafused: the open accumulation window was discarded (micro_step is 0 again)"
                    + (
                        ""
                        if not lost
                        else ": FSDP2 had reduced gradients of this backward or added to those it holds unreduced, so "
                        "every rank whose backward failed at this point discards it, whatever its own buckets folded"
                    ),
                )
            else:
                # Nothing of this call was folded: drop the gradients it left behind, so the window (and the open
                # micro-batch, if an earlier backward() folded into it) is exactly as before the call.
                changed = self._restore_grads(held_before)
                if changed:
                    _add_note(
                        error,
                        f"gafused: {changed} gradient(s) held from an earlier loss.backward() were added to in place "
                        "by the failed call and were dropped",
                    )
                if opened:
                    self._close_micro_batch()  # also one that failed while opening
                else:
                    micro.ends_window = ended_before
            if others_before:
                kept, reached = self._undo_for_others(others_before, micro)
                if kept:
                    _add_note(
                        error,
                        f"gafused: the failed call added to gradients held by {kept} other accumulator(s) over this "
                        "loss (in place in p.grad, or to what FSDP held unreduced, or FSDP reduced that into new "
                        "p.grad): their step() and backward() refuse those until they are dropped; the other "
                        "gradients it gave their parameters were put back",
                    )
                open_elsewhere = [other.micro_step for other in reached if other._micro_step or other._micro]
                if discarded and open_elsewhere:
                    _add_note(
                        error,
                        f"gafused: {len(open_elsewhere)} other accumulator(s) over this loss keep their open windows "
                        f"(micro_step {', '.join(map(str, open_elsewhere))}), now out of step with this one's; to drop "
                        "theirs too, load each with the state_dict() it gave between windows",
                    )
            advice = self._sync.backward_failed() if autograd_ran else None
            if advice is not None:
                _add_note(error, f"gafused: {advice}")
            raise
        micro.folded = micro.folded or micro.folded_in_call
        if others_before:
            self._tell_others(others_before, micro)

    def _undo_for_others(
        self, before: dict[GradAccumulator, _OthersBefore], micro: _MicroBatch
    ) -> tuple[int, list[GradAccumulator]]:
        """After a failed backward(): put back the ``p.grad`` it gave the other accumulators' parameters (a finished
        gradient handed out stays released, as the backward's hook left it, also on success). A held gradient it added
        to in place cannot be taken apart any more, nor what FSDP held unreduced for them if the call added to it or
        reduced it into ``p.grad`` (its sync turned on for a window's last micro-batch: those stay): a record makes
        that accumulator refuse them until they are dropped. Returns how many accumulators have one, and the others
        whose parameters the call reached."""
        published = {
            id(view)
            for accumulator in list(_LIVE_ACCUMULATORS or ())
            for group in accumulator._groups
            for view in group.published or ()
            if view is not None
        }
        kept, reached = 0, []
        for other, (params, unreduced_before, earlier) in before.items():
            unreduced = other._sync.unreduced_fingerprint()
            moved = unreduced != unreduced_before  # FSDP held more of them, or reduced what it held
            # FSDP reduced some of what it held into p.grad (its sync on): a new p.grad may hold earlier micro-batches.
            held_in_grads = not set(_held_tags(unreduced_before) or ()).issubset(_held_tags(unreduced) or ())
            changed: list[weakref.ref] = []
            touched = moved
            for param, grad, version in params:
                if id(param) in self._managed_ids:
                    continue  # this accumulator's own parameter: put back or dropped above
                if param.grad is not grad:
                    touched = True
                    if not held_in_grads:
                        param.grad = None if grad is not None and id(grad) in published else grad
                if param.grad is not None and (param.grad is not grad or _grad_version(param.grad) != version):
                    touched = True
                    changed.append(weakref.ref(param.grad))
            if touched:
                reached.append(other)
            held = _held_tags(unreduced if unreduced is not None else unreduced_before) if moved else None
            if not changed and held is None:
                continue
            record = _WeightedElsewhere(
                micro.counted, micro.weight, changed, held, conflict=True, failed=True, source=(id(self), micro.serial)
            )
            if earlier is not None:  # what it recorded is in those gradients too
                record.produced += earlier.produced
                record.unreduced = record.unreduced or earlier.unreduced
            other._weighted_elsewhere = record
            kept += 1
        return kept, reached

    def _others_grads(self) -> dict[GradAccumulator, _OthersBefore]:
        """Every other live accumulator's parameters with their ``p.grad`` and its version, what FSDP (its sync
        off) holds unreduced of them, and its record of another backward() that gave them (none when this is the
        only accumulator, the usual case): what a backward() over a loss they share changes. The record is read
        before: a backward that turns FSDP's sync on reduces what FSDP held into ``p.grad``, where the record no
        longer finds it."""
        return {
            other: (
                [
                    (param, param.grad, 0 if param.grad is None else _grad_version(param.grad))
                    for group in other._groups
                    for param in group.params
                ],
                other._sync.unreduced_fingerprint(),
                other._weight_from_elsewhere(),
            )
            for other in list(_LIVE_ACCUMULATORS or ())
            if other is not self
        }

    def _tell_others(self, before: dict[GradAccumulator, _OthersBefore], micro: _MicroBatch) -> None:
        """After a backward(): the other accumulators whose parameters it gave gradients learn its weight (given or
        not), and so do those over the same FSDP2 model while FSDP holds the gradients unreduced (its sync off),
        which no ``p.grad`` shows yet. Where an earlier backward at another weight, or of another micro-batch of
        this accumulator, gave some of the gradients still held, the record says they conflict: no weight counts
        them as one micro-batch."""
        given = micro.counted  # a GPU tensor by identity
        for other, (params, unreduced_before, earlier) in before.items():
            produced = [
                weakref.ref(param.grad)
                for param, grad, version in params
                if param.grad is not None and (param.grad is not grad or _grad_version(param.grad) != version)
            ]
            unreduced = other._sync.unreduced_fingerprint()  # of its parameters: moved if this backward reached them
            held = _held_tags(unreduced) if unreduced is not None and unreduced != unreduced_before else None
            if not produced and held is None:
                continue
            record = _WeightedElsewhere(given, micro.weight, produced, held, source=(id(self), micro.serial))
            # Still held from another micro-batch of this accumulator (the other left one out without zero_grad()):
            # two micro-batches summed, which no step() counts as one, whatever the weights (every rank alike).
            again = earlier is not None and earlier.source[0] == id(self) and earlier.source[1] != micro.serial
            if earlier is not None and (earlier.conflict or again or not _same_given(earlier.given, given)):
                record.conflict = True
                record.failed = earlier.failed
                record.produced += earlier.produced
                record.unreduced = record.unreduced or earlier.unreduced
            other._weighted_elsewhere = record

    def _weight_from_elsewhere(self) -> _WeightedElsewhere | None:
        """The backward() of another accumulator that gave some ``p.grad`` this step() or backward() would fold, if
        any."""
        record = self._weighted_elsewhere
        if record is None:
            return None
        # By identity: a plain backward that added into them since (an auxiliary loss) leaves them that micro-batch's,
        # as the other accumulator folds its own such gradients with the micro-batch's weight.
        held = {id(param.grad) for group in self._groups for param in group.params if param.grad is not None}
        for ref in record.produced:
            grad = ref()
            if grad is not None and id(grad) in held:
                return record
        # What FSDP held of these parameters after that backward, some still held (a plain backward of an auxiliary
        # loss may add more): that micro-batch's, unless this accumulator's step() counted it since.
        held_now = _held_tags(self._sync.unreduced_fingerprint())
        if record.unreduced is not None and held_now is not None and not set(record.unreduced).isdisjoint(held_now):
            if self._unreduced_since_step():
                return record
        self._weighted_elsewhere = None  # its gradients were folded, released or replaced since
        return None

    def _check_weight_from_elsewhere(self, given: Any, call: str) -> _WeightedElsewhere | None:
        """Refuse folding gradients another accumulator's backward() gave these parameters with another weight than
        that backward's (``given``: this micro-batch's, as its caller gave it). None for None (counted 1), the same
        value otherwise: a None against a weight of 1 is refused, so that every rank decides alike, whatever its own
        weight. Returns the record of that backward, if any."""
        elsewhere = self._weight_from_elsewhere()
        if elsewhere is None:
            return None
        if elsewhere.unreduced is None:
            drop = "drop them first (p.grad = None on this accumulator's parameters)"
            if call == "backward()":  # not too late for the next micro-batch
                drop += " or keep that backward off them (its inputs=, or requires_grad_(False) meanwhile)"
        else:
            drop = (
                "FSDP holds or held them unreduced (its gradient sync off), summed with any earlier micro-batch of "
                "the window: zero_grad() drops them at the window's first micro-batch; past it, " + _DROP_WINDOW
            )
        if elsewhere.failed:
            raise RuntimeError(
                f"{call}: gradients it would fold hold part of another accumulator's backward() that failed, added "
                "to what they held, which cannot be taken out of them (nothing changed); "
                + (
                    "drop them (p.grad = None on this accumulator's parameters, or zero_grad()) and run what they "
                    "held again"
                    if elsewhere.unreduced is None
                    else drop
                )
            )
        if elsewhere.conflict:
            raise ValueError(
                f"weight: gradients this {call} would fold hold more than one micro-batch of other accumulators' "
                "backward() calls (one left out here without zero_grad(), or two weights added together), which no "
                "weight counts as one micro-batch (nothing changed); " + drop
            )
        if not _same_given(given, elsewhere.given):
            if self._micro is not None:
                how = f"this micro-batch's own backward() gave {given!r}, so " + drop
                how += ", then call step() again" if call == "step()" else ""
            elif call == "step()":
                how = "give this step() the same weight, step(weight=w)"
            else:
                how = "give this backward() the same weight, or count them first with step(weight=w), or " + drop
            raise ValueError(
                f"weight: gradients this {call} would fold come from another accumulator's backward(loss, "
                f"weight={elsewhere.given!r}), which counts that micro-batch with its weight; {how}; so both count it "
                f"alike (got {given!r}; None where it gave none, else an equal number or CPU tensor, or the same GPU "
                "tensor)"
            )
        return elsewhere

    def _check_weight_fits_loss(
        self, given: Any, w: torch.Tensor, bad: torch.Tensor | None, loss_dtype: torch.dtype
    ) -> torch.Tensor | None:
        """With the weight in the loss (FSDP2), it must be finite in the loss's dtype, which backward carries it
        in (float16: up to 65504). A host weight is refused here; a device weight or'ed into its device flag."""
        top = torch.finfo(loss_dtype).max
        if top >= self._weight_range[1]:
            return bad
        value = _host_weight(given)
        if value is None:
            over = w > top
            return over if bad is None else bad | over
        if value > top:
            raise ValueError(
                f"weight: with an FSDP2 model the weight multiplies the loss, and {given!r} does not fit the loss's "
                f"{loss_dtype} (largest {top:g}); compute the loss in float32 (loss.float()) or rescale the weights"
            )
        return bad

    def _restore_grads(self, held_before: list[tuple[list[torch.Tensor | None], list[int] | None]]) -> int:
        """Put back the ``p.grad`` a failed backward() found; returns how many held gradients it had changed in
        place (those are dropped: their earlier value is gone)."""
        changed = 0
        for group, (grads, versions) in zip(self._groups, held_before, strict=True):
            for index, (param, grad) in enumerate(zip(group.params, grads, strict=True)):
                if param.grad is not grad:
                    param.grad = grad
                elif grad is not None and _grad_version(grad) != versions[index]:
                    param.grad = None
                    changed += 1
        return changed

    @torch._disable_dynamo  # the window's state machine: one graph break, never traced (module docstring)
    def step(
        self,
        closure: Callable[[], Any] | None = None,
        *,
        weight: float | torch.Tensor | None = None,
        end_window: bool = False,
    ) -> Any:
        """End this micro-batch; a window's last call finishes the window and steps the inner optimizer.

        The last call is the N-th of a counted window (``accumulation_steps=N``), or the one whose micro-batch
        was declared the last with ``end_window`` (here or on its ``backward()``). After ``backward()``, ``step()``
        folds only what is left (gradients of parameters that got none during backward are zero for this
        micro-batch). After a plain ``loss.backward()``, it folds every gradient now (one launch per buffer) and
        releases them.

        Args:
            closure: as in ``torch.optim.Optimizer.step``: a callable that runs this micro-batch's forward and
                backward (``loss.backward()`` or ``opt.backward(loss, ...)``) and returns the loss. It is called
                first, with gradients enabled; ``step()`` then ends the micro-batch as without one and returns
                what the closure returned. A refusal after it leaves its gradients (or its open micro-batch), so
                ``step()`` can be called again without it.
            weight: this micro-batch's weight (a sample or token count) for the ``loss.backward()`` loop, a
                non-negative finite number (Python or NumPy) or a 0-d tensor (default 1), 0 or a normal number of
                the accumulation dtype (float32: 1.2e-38 to 3.4e38), also once divided by ``grad_scaler``'s scale
                (checked on the device, like a device tensor); refused after ``backward()``, which takes it. After
                another accumulator's ``backward(loss, weight=w)`` gave these parameters their gradients (two
                optimizers over one model), it must be that ``w`` (None after a ``backward(loss)`` without one). With
                ``normalization="mean"`` the window's weights must sum to at most 1 / the dtype's smallest normal
                number (float32: 8.5e37), so that the scale 1 / sum is a normal number: a weight above it is
                refused, a window whose sum goes beyond it is refused at its end.
                Keyword only. A tensor stays on its device: no host sync. A CPU tensor or number is checked here; a
                device tensor is checked on the device and a bad value raises at the end of the window (where the
                one host sync of the step happens), discarding that window. A step() with no gradient since the
                last one and no weight is refused (it would count an empty micro-batch of weight 1: a step() called
                twice, or ``step(end_window=True)`` where ``flush()`` was meant); ``weight=0`` counts one on purpose.
            end_window: this micro-batch is the window's last, whatever ``accumulation_steps`` says: the window is
                finished now (a framework's sync step, the partial last window of an epoch).

        Returns:
            The closure's result, or None without a closure.
        """
        self._check_not_stepping("step()")
        if self._grad_scaler is None and _called_from(_GRAD_SCALER_MODULE, "_maybe_opt_step"):
            raise RuntimeError(
                "step(): called by GradScaler.step(opt), but the GradAccumulator was built without grad_scaler=: the "
                "scaler would skip the step() of a micro-batch whose gradients overflowed (dropping it from the "
                "window, and shifting every later window by one) and change its scale per micro-batch. Build the "
                "GradAccumulator with grad_scaler=scaler and call opt.step(), not scaler.step(opt) or "
                f"scaler.update(). Nothing was folded; {_SCALER_UNSCALED}"
            )
        if closure is not None and not callable(closure):
            raise TypeError(
                f"step(): closure must be callable or None, got {type(closure).__name__}; a micro-batch weight is "
                "passed by keyword: step(weight=w)"
            )
        ops.check_bool(end_window, "end_window")
        self._sync.check_backward_recovered("step()")
        self._check_not_unscaled()
        if closure is None and _called_from(_DCP_MODULE, "_init_optim_state"):
            self._init_inner_state_for_dcp()
            return None
        if closure is None:
            self._check_param_set(identity=self._at_window_edge(end_window))
            self._end_micro_batch(weight, end_window)
            return None
        self._check_param_set(identity=False)
        if weight is not None:
            self._weight_tensor(weight)  # refuse a bad weight before the closure runs
        with torch.enable_grad():
            result = closure()
        self._check_not_unscaled()  # the closure may have unscaled the gradients it made
        # After the closure: its backward() may have declared the window's end.
        self._check_param_set(identity=self._at_window_edge(end_window))
        self._end_micro_batch(weight, end_window)
        return result

    def _check_not_unscaled(self) -> None:
        """Refuse a step the GradScaler unscaled the gradients for (``scaler.step(opt)`` or ``scaler.unscale_(opt)``:
        the AMP recipe around a plain optimizer): the accumulator divides by the scale itself, so the gradients
        would be divided twice. The scaler's record of it is dropped (the scaler goes on with the next window); where
        the unscaled gradients are still in ``p.grad`` (not folded yet), every step() is refused until they are
        released (``zero_grad()``), since the same call again would fold them."""
        scaler = self._grad_scaler
        if scaler is None:
            return
        # Every optimizer's record, not only this one's: the scaler serves this accumulator alone
        # (_claim_grad_scaler), and a wrapper standing for it (Lightning's, from self.optimizers()) has another id.
        states = scaler._per_optimizer_states
        unscaled = [key for key, state in states.items() if state.get("stage") is not OptState.READY]
        if not unscaled and not self._holds_unscaled_grads():
            return
        for key in unscaled:
            del states[key]
        if self._micro is not None:
            remedy = "backward() already folded this micro-batch's gradients, unscaled once, so call opt.step() again"
        else:
            self._unscaled_grads = [
                (param, weakref.ref(param.grad)) for param in self._managed if param.grad is not None
            ]
            remedy = (
                "First drop this micro-batch's unscaled gradients with opt.zero_grad() (step() is refused until then: "
                "it would fold them) and run its backward again"
            )
        raise RuntimeError(
            "step(): the grad_scaler unscaled this optimizer's gradients (scaler.step(opt) or "
            "scaler.unscale_(opt)); with grad_scaler= the accumulator unscales and updates the scaler itself, so "
            f"the gradients would be divided by the scale twice. {remedy}. Call opt.step() and nothing of the scaler "
            "but scaler.scale(loss) (or opt.backward(loss), which scales it)"
        )

    def _holds_unscaled_grads(self) -> bool:
        """Whether a gradient a refused step() left unscaled is still a ``p.grad``: released by ``zero_grad()``, or
        replaced some other way (``model.zero_grad()`` and a new backward), none can be folded any more. (Zeroed in
        place, ``model.zero_grad(set_to_none=False)``, it is the same tensor and still refused.)"""
        held = self._unscaled_grads
        if held and not any(grad() is not None and param.grad is grad() for param, grad in held):
            self._unscaled_grads = []
        return bool(self._unscaled_grads)

    def _init_inner_state_for_dcp(self) -> None:
        """torch.distributed.checkpoint (``get_state_dict``, ``set_state_dict``, ...) creates an optimizer's state by
        setting every ``p.grad`` to zeros and every learning rate to 0 and calling ``step()``. That is meant for the
        inner optimizer: stepping it so leaves the parameters as they are and gives it the state tensors DCP saves
        or loads into. Folded into the window, the zeros would be a micro-batch of weight 1 (a diluted mean, windows
        shifted by one), so the window is not touched. With a window or a micro-batch open nothing is stepped: the
        state_dict() or load_state_dict() DCP calls next refuses, since DCP keeps no window."""
        if self._micro_step == 0 and self._micro is None:
            with _inner_step(self._optimizer):
                self._optimizer.step()

    def _at_window_edge(self, end_window: bool) -> bool:
        """Whether the micro-batch that step() is about to end starts or ends a window."""
        micro = self._micro
        ending = end_window or self._counted_last() or (micro is not None and micro.ends_window)
        return self._micro_step == 0 or ending

    def _end_micro_batch(self, weight: float | torch.Tensor | None, end_window: bool) -> None:
        micro = self._micro
        if micro is not None and weight is not None:
            raise ValueError(
                "weight: this micro-batch's weight was already given to backward(); call step() without it"
                if micro.given is not None
                else "weight: backward() opened this micro-batch without a weight (it counts 1); a micro-batch's "
                "weight goes to its backward(loss, weight=w), not to step(): call step() without it"
            )
        elsewhere = self._check_weight_from_elsewhere(weight if micro is None else micro.given, "step()")
        if micro is None:
            if weight is not None and self._sync.weight_in_loss and elsewhere is None:
                raise ValueError(
                    "weight: with an FSDP2 model, FSDP sums the ranks' gradients during backward, so a weight "
                    "given after it cannot be applied per rank; pass it up front: opt.backward(loss, weight=w)"
                )
            w, bad = self._weight_tensor(weight)
            if elsewhere is not None and self._sync.weight_in_loss:
                # The weight is in those gradients already (the other backward multiplied the loss by it, rounded to
                # the loss's dtype): counted as that backward counted it, folded with FSDP's divide factor only.
                w = ops.to_device(elsewhere.weight, self._home, torch.float64)
        grads = self._held_grads()  # every check happens before anything changes
        # No weight given (so it counts 1), and no gradient since the last step(): plain loss.backward() reached no
        # parameter, or backward() folded nothing (its loss reached only other tensors).
        unweighted = weight is None if micro is None else micro.given is None and not micro.folded
        if (
            unweighted
            and all(grad is None for group in grads for grad in group)
            and not self._counts_empty_steps
            # A window of frozen parameters has no gradients to give (plain PyTorch's step() does nothing then).
            and any(param.requires_grad for group in self._groups for param in group.params)
            and not self._unreduced_since_step()  # FSDP with its sync off keeps them itself
        ):
            raise RuntimeError(
                "step(): no parameter of the accumulator received a gradient since the last step(): it would count "
                "an empty micro-batch of weight 1, diluting the window's mean (a step() called twice, or "
                "step(end_window=True) where flush() was meant, or a backward() whose loss reached none of its "
                "parameters, or a model whose parameters were replaced since the accumulator was built, by "
                "load_state_dict(assign=True) or a new nn.Parameter: the optimizer still holds the old ones). Run "
                "this micro-batch's backward first; to count a micro-batch without gradients on "
                + (
                    "purpose, give its weight: step(weight=w)"
                    if micro is None
                    else "purpose, give its weight to its backward: drop this one with zero_grad(), then "
                    "backward(loss, weight=w)"
                )
                + " (a window whose weights are all 0 is skipped)"
            )
        self._check_lr_unchanged()

        if micro is not None:
            last = micro.ends_window or end_window
            # Declared over after its buckets were folded without the window scale: one finishing pass follows.
            late = last and not micro.last
        else:
            last = end_window or self._counted_last()
            late = False
        if last and self._global:
            if late:
                self._check_window_end()
            else:
                self._check_ready_to_reduce(micro, grads)
        if micro is None and self._micro_step == 0:
            self._start_window()  # may refuse (a grad scaler without a scale yet): before anything changes
        elif micro is None:
            self._check_loss_scale()  # the fold reads it (a resumed window's scaler may have none yet)
        # Every check came before: what raises now is a fold that failed or was interrupted (an interrupt lands as
        # an op returns), after some buffers may have changed. Retrying would fold them twice.
        # One block from the fold to the window's end: an interrupt landing between them would leave the micro-batch
        # counted with its step() raised, and a counted window past its last micro-batch never ends.
        with self._discarded_on_failure("step() failed while folding") as failure:
            if micro is not None:
                self._fold_held_buckets(grads)
                del grads
                self._weight_sum = micro.weight_sum
                self._record_bad_weight(micro.bad_weight)
                results = [r for group in self._groups for r in self._finish_untouched_buckets(group, micro.last)]
                self._micro = None
            else:
                results = self._fold_all(grads, w, bad, last)
                del grads  # the last micro-batch's gradients must not outlive the fold (memory)
            self._micro_step += 1
            self._stepped = False
            self._unreduced_seen = self._sync.unreduced_fingerprint()
            if elsewhere is not None:
                self._weighted_elsewhere = None  # counted: what FSDP holds next is another micro-batch's
            if last:
                failure.ending()
                if self._global:
                    self._finish_across_ranks(self._reduced_window_sums(self._micro_step))
                elif late:
                    self._finish(self._finishing_pass())
                else:
                    self._finish(results)

    @contextlib.contextmanager
    def _discarded_on_failure(self, what: str, unless_ended: bool = False) -> Iterator[_OnFailure]:
        """Discard the window (with a note saying ``what``) if the block raises: a fold, or a window's end
        (``unless_ended``, or from the block's ``ending()`` on: unless the window was finished or discarded before
        the error, ``micro_step`` 0 again). A window's end kept after an interrupt at its host sync or a failed
        collective would sit past its last micro-batch (a counted window would never end again) with its buffers
        perhaps scaled already."""
        failure = _OnFailure(what, unless_ended)
        try:
            yield failure
        except BaseException as error:
            if not (failure.unless_ended and self._micro_step == 0):
                self._discard_window()
                _add_note(error, f"gafused: {failure.what}; the open accumulation window was discarded")
            raise

    @torch._disable_dynamo
    def flush(self) -> bool:
        """Finish the open window now, after its last ``step()``; returns ``stepped``.

        For a window whose end is known only after its last micro-batch ended (the end of an epoch); when it is
        known before, ``end_window=True`` on that micro-batch saves flush's extra pass over the buffers. The
        finished gradient combines the micro-batches ended by ``step()`` so far (weighted mean, or sum with
        ``normalization="sum"``). Does nothing (and returns False) when no micro-batch is open. Raises if
        parameters hold gradients that no ``step()`` has folded, or a ``backward()`` has no ``step()`` yet, rather
        than drop or silently include them.

        With ``model=`` it is a collective call: every rank calls it, after the same number of micro-batches, and a
        refusal on one rank makes every rank raise.
        """
        self._check_not_stepping("flush()")
        refusal: Exception | None = None
        try:
            self._check_param_set(identity=True)
        except RuntimeError as error:
            refusal = error
        if refusal is None and self._micro is not None:
            refusal = RuntimeError("flush(): backward() was called without step(); call step() to end the micro-batch")
        unfolded = self._unfolded_names() if refusal is None else []
        if unfolded:
            refusal = RuntimeError(
                f"flush(): {len(unfolded)} parameter(s) hold gradients not folded by step(), e.g. {unfolded[0]}; "
                + (
                    "the grad_scaler unscaled them (a step() was refused for it): drop them with zero_grad() first"
                    if self._holds_unscaled_grads()
                    else "call step() to include them or zero_grad() to drop them first"
                )
            )
        if self._global:
            if refusal is None and self._micro_step > 0 and self._sync.holds_unreduced():
                refusal = RuntimeError(
                    "flush(): FSDP holds this window's gradients unreduced (set_requires_gradient_sync(False)), and "
                    "only a backward reduces them; nothing changed. Declare a partial window's last micro-batch at "
                    "its backward: opt.backward(loss, weight=w, end_window=True), which turns the sync on for it"
                )
            if refusal is None:
                try:
                    self._check_window_end()
                except RuntimeError as error:
                    refusal = error
            # A rank that refuses still joins the window sums, with an impossible count (-1), so that every rank
            # raises here rather than wait in the collective for it; nothing has changed on any rank.
            sums = self._reduced_window_sums(-1 if refusal is not None else self._micro_step)
            if refusal is not None:
                raise refusal
            host_sums = sums[:_SUMS_FLAGS].tolist()
            count, squares = host_sums[2:4]
            if _ranks_differ(count, squares, self._sync.world_size):
                raise RuntimeError(
                    f"flush(): the ranks are at different micro-steps (this rank: {self._micro_step}), or another "
                    "rank refused flush() (its error says why); nothing changed. Every rank must run the same "
                    "number of micro-batches before flush()"
                )
            if _settings_differ_across(host_sums, self._sync.world_size):
                raise RuntimeError(self._settings_differ("flush()") + "; nothing changed")
            if count == 0:
                self._stepped = False
                return False
            with self._discarded_on_failure("the window's end failed", unless_ended=True):
                self._finish_across_ranks(sums)
            return self._stepped
        if refusal is not None:
            raise refusal
        if self._micro_step == 0:
            self._stepped = False
            return False
        with self._discarded_on_failure("the window's end failed", unless_ended=True):
            self._finish(self._finishing_pass())
        return self._stepped

    def _finishing_pass(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Scale and measure every buffer of a window whose micro-batches are all folded (one pass each)."""
        scale = self._window_scale(self._weight_sum)
        zero = torch.zeros((), dtype=torch.float64, device=self._home)
        return [
            ops.fold_finish_(
                group.buffer,
                [None] * len(group.params),
                ops.to_device(zero, group.buffer.device),
                ops.to_device(scale, group.buffer.device),
                first=False,
                backend=group.backend,
            )
            for group in self._groups
        ]

    def _window_scale(self, weight_sum: torch.Tensor) -> torch.Tensor:
        """What the window's folded sum is multiplied by: 1 / sum of weights ("mean"), or 1 ("sum")."""
        return weight_sum.reciprocal() if self.normalization == "mean" else torch.ones_like(weight_sum)

    def _counted_last(self) -> bool:
        """Whether the micro-batch now being ended is the N-th of a counted window."""
        return self.accumulation_steps is not None and self._micro_step + 1 == self.accumulation_steps

    @torch._disable_dynamo
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Release every managed ``p.grad`` (the accumulator owns them; gradients are always set to None).

        Gradients a ``step()`` has not folded yet are dropped; what is folded stays in the window. Between
        ``backward()`` and ``step()`` it drops that micro-batch, as ``zero_grad()`` drops a batch in a plain loop,
        when the micro-batch is the window's first (the window is discarded) or its backward folded nothing; a later
        micro-batch is already folded into the window's sum and is refused (RuntimeError), as is a window's last
        under DDP (``model=``), whose buckets are being reduced: leave a batch out with ``weight=0``.

        Args:
            set_to_none: accepted for drop-in compatibility; gradients are released either way, since a
                zero-filled ``p.grad`` would only be folded as zeros.
        """
        self._check_not_stepping("zero_grad()")
        micro = self._micro
        # torch.distributed.checkpoint releases the zeros it stepped the inner optimizer with: not the user's call.
        if micro is not None and not _called_from(_DCP_MODULE, "_init_optim_state"):
            # FSDP with its sync off holds the micro-batch's gradients, summed with the window's earlier ones.
            folded = micro.folded or self._sync.holds_unreduced()
            if folded and (self._micro_step > 0 or self._reducing):
                where = (
                    f"micro-batch {self._micro_step + 1} of the window"
                    if self._micro_step > 0
                    else "a window's last micro-batch, whose buckets are being reduced across ranks"
                )
                raise RuntimeError(
                    f"zero_grad(): backward() already folded this micro-batch ({where}) into the window's sum, where "
                    "it cannot be told apart from the rest; nothing changed. To leave a batch out, pass weight=0 to "
                    "its backward(), or end it with step()"
                )
            if folded:
                self._discard_window()  # the window is this micro-batch alone
                return
            self._close_micro_batch()
        elif self._unreduced_since_step():  # loss.backward() under FSDP with its sync off: the gradients are FSDP's
            if self._micro_step > 0:
                raise RuntimeError(
                    f"zero_grad(): FSDP holds this micro-batch's gradients (micro-batch {self._micro_step + 1} of the "
                    "window, its sync off) summed with the window's earlier ones, where they cannot be told apart; "
                    "nothing changed. End it with step(), or " + _DROP_WINDOW
                )
            self._discard_window()  # the window's first: FSDP holds it alone
            return
        elif self._micro_step > 0 and self._reduced_with_earlier():
            raise RuntimeError(
                f"zero_grad(): FSDP reduced this micro-batch's gradients (micro-batch {self._micro_step + 1} of the "
                "window) summed with the window's earlier ones, which it held unreduced (its sync off), where they "
                "cannot be told apart; nothing changed. End it with step(), or " + _DROP_WINDOW
            )
        self._release_grads()

    def _drop_unreduced(self) -> None:
        """Forget what FSDP (its sync off) holds of a discarded or replaced window, and that it was seen."""
        self._sync.drop_unreduced()
        self._unreduced_seen = None

    def _reduced_with_earlier(self) -> bool:
        """Whether ``p.grad`` holds what FSDP held unreduced (its sync off) when the last ``step()`` counted a
        micro-batch: a backward with the sync on reduced it with its own gradients."""
        if self._unreduced_seen is None or self._sync.holds_unreduced():
            return False
        return any(param.grad is not None for group in self._groups for param in group.params)

    def _unreduced_since_step(self) -> bool:
        """Whether FSDP (its sync off) holds gradients that arrived since the last ``step()``: a micro-batch whose
        ``loss.backward()`` ran, though no parameter's ``.grad`` shows it."""
        held = self._sync.unreduced_fingerprint()
        return held is not None and held != self._unreduced_seen

    def _release_grads(self) -> None:
        self._unscaled_grads = []
        self._release_published()
        for group in self._groups:
            for param in group.params:
                param.grad = None

    def _close_micro_batch(self) -> None:
        """Forget an open micro-batch that folded nothing: what _open_micro_batch set up goes with it."""
        self._micro = None
        self._reducing = False
        for group in self._groups:
            group.fold_weight = group.scale = None

    # --- folding ----------------------------------------------------------------------------------------

    def _open_micro_batch(
        self, given: float | torch.Tensor | None, w: torch.Tensor, bad: torch.Tensor | None, end_window: bool
    ) -> _MicroBatch:
        """Start a micro-batch of the backward() loop: its fold weight and, on a window's last, the window scale."""
        first = self._micro_step == 0
        last = end_window or self._counted_last()
        if first:
            self._start_window()
        weight_sum = w if first else self._weight_sum + w
        fold_weight, bad = self._fold_weight(w, bad)
        # Across ranks the window is scaled once its buckets are summed: at step(), not while folding.
        scale = self._window_scale(weight_sum) if last and not self._global else None
        self._reducing = last and self._sync.reduces_buckets
        for group in self._groups:
            group.fold_weight = ops.to_device(fold_weight, group.buffer.device)
            group.scale = None if scale is None else ops.to_device(scale, group.buffer.device)
            group.bucket_touched = [False] * len(group.bucket_touched)
            group.bucket_results = [None] * len(group.bucket_results)
        self._micro = _MicroBatch(
            given=given,
            weight=w,
            weight_sum=weight_sum,
            last=last,
            ends_window=last,
            bad_weight=bad,
            # A CPU tensor's value now, as counted (the caller may change the tensor before a later backward).
            counted=_host_weight(given) if isinstance(given, torch.Tensor) and given.device.type == "cpu" else given,
            serial=next(_MICRO_SERIALS),
        )
        return self._micro

    def _fold_weight(self, w: torch.Tensor, bad: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A micro-batch's fold weight: ``w`` (or, when the weight is in the loss, FSDP's divide factor), times
        1 / loss scale; and ``bad``, or'ed on the device with whether that product left the accumulation dtype's
        normal range (a weight checked on the host can still underflow once divided by the loss scale)."""
        if self._sync.weight_in_loss:
            w = torch.full_like(w, self._sync.fold_factor)
        if self._grad_scaler is not None:  # the scale this micro-batch's loss was scaled with, read as it is folded
            self._inv_loss_scale = self._read_inv_loss_scale()
        if self._inv_loss_scale is None:
            return w, bad
        fold = w * self._inv_loss_scale
        tiny, top, _ = self._weight_range
        outside = ~((fold == 0) | ((fold >= tiny) & (fold <= top)))
        return fold, outside if bad is None else bad | outside

    def on_bucket_ready(self, group_index: int, bucket_index: int) -> None:
        """Called by the backward hooks when every gradient of a bucket exists: fold it and release them."""
        group = self._groups[group_index]
        indices = group.buffer.bucket_ranges[bucket_index]
        grads = [param.grad for param in group.params[indices.start : indices.stop]]
        if self._sync.shards:
            grads = [self._sync.local_grad(grad) for grad in grads]
        names = group.names[indices.start : indices.stop]
        self._fold_bucket(group, bucket_index, ops.check_grads(group.buffer.buckets[bucket_index], grads, names))

    def _fold_bucket(self, group: _Group, bucket_index: int, grads: list[torch.Tensor | None]) -> None:
        """Fold one bucket's gradients with the micro-batch's weight (finishing it on a window's last micro-batch),
        then release them. A bucket finished earlier in the same micro-batch (a second backward) gets w * scale
        times the new gradients and is measured again."""
        bucket = group.buffer.buckets[bucket_index]
        touched = group.bucket_touched[bucket_index]
        first = self._micro_step == 0 and not touched
        if self._micro is not None:
            # Set before the op: one that raises after it started (an interrupt lands as it returns) may have
            # changed the bucket, and the window is then discarded rather than kept with part of this call in it.
            self._micro.folded_in_call = True
        if group.scale is None:
            ops.fold_(bucket, grads, group.fold_weight, first=first, backend=group.backend, check=False)
        elif not touched:
            group.bucket_results[bucket_index] = ops.fold_finish_(
                bucket, grads, group.fold_weight, group.scale, first=first, backend=group.backend, check=False
            )
        else:
            one = torch.ones((), dtype=bucket.accum_dtype, device=bucket.device)
            group.bucket_results[bucket_index] = ops.fold_finish_(
                bucket, grads, group.fold_weight * group.scale, one, first=False, backend=group.backend, check=False
            )
        group.bucket_touched[bucket_index] = True
        if self._reducing:
            self._bucket_folded(self._groups.index(group), bucket_index)
        self._release_folded(group, group.buffer.bucket_ranges[bucket_index], grads)

    @staticmethod
    def _release_folded(group: _Group, indices: range, grads: list[torch.Tensor | None]) -> None:
        params, had_grad = group.params, group.had_grad
        for index, grad in zip(indices, grads, strict=True):
            if grad is not None:
                had_grad[index] = True
                params[index].grad = None  # folded: release the memory now

    def _fold_held_buckets(self, grads: list[list[torch.Tensor | None]]) -> None:
        """Fold every bucket that still holds gradients (parameters unused by, or seen twice in, a backward)."""
        for group_index, (group, group_grads) in enumerate(zip(self._groups, grads, strict=True)):
            for bucket_index, indices in enumerate(group.buffer.bucket_ranges):
                bucket_grads = group_grads[indices.start : indices.stop]
                if _any_given(bucket_grads):
                    if self._reducing and (group_index, bucket_index) in self._pending:
                        self._fold_late(group_index, bucket_index, bucket_grads)
                    else:
                        self._fold_bucket(group, bucket_index, bucket_grads)

    def _fold_late(self, group_index: int, bucket_index: int, grads: list[torch.Tensor | None]) -> None:
        """Gradients for a bucket already on the wire (the counters said it was complete, but a parameter got a
        second gradient, e.g. used twice under reentrant checkpointing, or has no hook, e.g. made trainable while
        this backward ran): fold them into a zeroed copy of the bucket's layout, which every rank reduces and
        adds when the window ends (_reduce_late)."""
        group = self._groups[group_index]
        bucket = group.buffer.buckets[bucket_index]
        part = self._late.get((group_index, bucket_index))
        if part is None:
            part = self._late[(group_index, bucket_index)] = _zeros_like_layout(bucket)
        if self._micro is not None:
            self._micro.folded_in_call = True  # the late part is the window's too
        ops.fold_(part, grads, group.fold_weight, first=False, backend=group.backend, check=False)
        self._release_folded(group, group.buffer.bucket_ranges[bucket_index], grads)

    def _finish_untouched_buckets(self, group: _Group, last: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """At step(): a bucket no gradient reached is zeroed (window's first micro-batch) or finished (last)."""
        for bucket_index, touched in enumerate(group.bucket_touched):
            if not touched and (self._micro_step == 0 or last):
                self._fold_bucket(group, bucket_index, [None] * len(group.buffer.bucket_ranges[bucket_index]))
        results = list(group.bucket_results) if last else []
        group.fold_weight = group.scale = None
        group.bucket_results = [None] * len(group.bucket_results)
        return results

    def _fold_all(
        self, grads: list[list[torch.Tensor | None]], w: torch.Tensor, bad: torch.Tensor | None, last: bool
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The loss.backward() loop: fold every buffer at once (one launch per buffer) and release the gradients."""
        first = self._micro_step == 0  # (the window was started by the caller)
        weight_sum = w if first else self._weight_sum + w
        fold_weight, bad = self._fold_weight(w, bad)
        self._record_bad_weight(bad)
        results = []
        for group, group_grads in zip(self._groups, grads, strict=True):
            group_weight = ops.to_device(fold_weight, group.buffer.device)
            if last and not self._global:
                scale = ops.to_device(self._window_scale(weight_sum), group.buffer.device)
                results.append(
                    ops.fold_finish_(
                        group.buffer, group_grads, group_weight, scale, first=first, backend=group.backend, check=False
                    )
                )
            else:
                ops.fold_(group.buffer, group_grads, group_weight, first=first, backend=group.backend, check=False)
            if not all(group.had_grad):  # usually all True after a window's first micro-batch: nothing to add
                group.had_grad = [had or g is not None for had, g in zip(group.had_grad, group_grads, strict=True)]
            for param in group.params:
                param.grad = None  # folded: release the memory now
        self._weight_sum = weight_sum
        if last and self._sync.reduces_buckets:
            self._launch_reductions(len(self._reduce_order))
        return results

    # --- across ranks (model=) ---------------------------------------------------------------------------

    def _bucket_folded(self, group_index: int, bucket_index: int) -> None:
        """A bucket of a window's last micro-batch is complete: reduce it, and any ready buckets after it."""
        self._ready.add((group_index, bucket_index))
        launched = len(self._pending)
        while launched < len(self._reduce_order) and self._reduce_order[launched] in self._ready:
            launched += 1
        self._launch_reductions(launched)

    def _launch_reductions(self, upto: int) -> None:
        """Start the reductions of ``_reduce_order[:upto]`` not started yet, in that order (the same on every
        rank, so that the collectives match)."""
        for key in self._reduce_order[len(self._pending) : upto]:
            group_index, bucket_index = key
            self._pending[key] = self._sync.start_bucket(self._groups[group_index].buffer.buckets[bucket_index])

    def _drop_reductions(self) -> None:
        """Wait for reductions in flight (they write into the buffers), then forget them. One that failed (a
        collective error or timeout, which its ``wait()`` raises again at every call) is over and dropped too, so
        that discarding a window, or loading a checkpoint, after a failed collective does not fail on it again."""
        for key, pending in list(self._pending.items()):
            group_index, bucket_index = key
            try:
                self._sync.wait_bucket(self._groups[group_index].buffer.buckets[bucket_index], pending)
            except Exception:  # noqa: BLE001 - failed: nothing more will be written; its values are dropped
                pass
            del self._pending[key]
        self._pending.clear()
        self._ready.clear()
        self._late.clear()
        self._reducing = False

    def _check_ready_to_reduce(self, micro: _MicroBatch | None, grads: list[list[torch.Tensor | None]]) -> None:
        """Before the last micro-batch's step() changes anything: no gradient may arrive after its bucket's
        reduction started, and FSDP must have reduced what it held back."""
        if micro is not None and self._sync.reduces_buckets and any(g is not None for gs in grads for g in gs):
            raise RuntimeError(
                "step(): with model=, gradients from a plain backward() cannot join a window's last micro-batch "
                "after opt.backward() reduced its buckets; sum the losses into one opt.backward() call"
            )
        self._check_window_end()

    def _check_window_end(self) -> None:
        """Before a window is reduced across ranks: the wrapper holds nothing back (FSDP2), and no parameter of a
        DDP model holds a gradient that no accumulator over the model reduces (DDP's own all-reduce is off)."""
        self._sync.check_window_end()
        if not self._sync.reduces_buckets:
            return
        held = set().union(*(o._managed_ids for o in list(_LIVE_ACCUMULATORS) if o._sync.same_model(self._sync)))
        unreduced = self._sync.unreduced_grads(held)
        if unreduced:
            raise RuntimeError(
                f"model: {len(unreduced)} parameter(s) of the DDP model hold gradients that no GradAccumulator over "
                f"it holds, e.g. {unreduced[0]}; gafused turned DDP's all-reduce off, so those gradients are this "
                "rank's alone and an optimizer stepping them would let the replicas drift apart. Wrap every "
                "optimizer of the model in GradAccumulator(optimizer, N, model=model), or set requires_grad=False "
                "on parameters no optimizer updates"
            )

    def _reduced_window_sums(self, count: int) -> torch.Tensor:
        """All-reduce (weight sum, bad-weight flag, micro-batch count, count squared, each of the settings' codes and
        its square, then a had-gradient flag per parameter and, where gafused reduces buckets (DDP), a folded-late
        flag per bucket) over the ranks. Buckets are cut from each rank's own elements, so under FSDP2 (uneven shards)
        their number differs across ranks: the flags then stop at the parameters, whose number every rank shares.
        The codes are of the settings a window's end uses that setters change (``max_grad_norm``,
        ``normalization``), which the check at construction cannot see changed on some ranks only, and of the number
        of windows ended since the accumulator was built or loaded."""
        flags = [float(had) for group in self._groups for had in group.had_grad]
        if self._sync.reduces_buckets:
            flags += [float(key in self._late) for key in self._reduce_order]
        codes = distributed.settings_codes((self.max_grad_norm, self.normalization, self._windows_ended))
        # Pinned and non-blocking on a GPU: a copy from pageable memory would wait for the device (a host sync).
        host = torch.tensor(
            [0.0, 0.0, 0.0, 0.0, *(value for code in codes for value in (code, code * code)), *flags],
            dtype=torch.float64,
            pin_memory=self._home.type == "cuda",
        )
        local = host.to(self._home, non_blocking=True)
        if count > 0:
            local[0] = self._weight_sum
            if self._bad_weight is not None:
                local[1] = self._bad_weight.to(torch.float64)
        local[2] = count
        local[3] = count * count
        return self._sync.reduce_window(local)

    def _settings_differ(self, call: str) -> str:
        """What a window's end across ranks says when the ranks' ``max_grad_norm``, ``normalization`` or number of
        windows ended differ."""
        return (
            f"{call}: the ranks end this window after a different number of windows (this rank: {self._windows_ended} "
            "since it was built or loaded), or with different max_grad_norm or normalization (this rank: "
            f"max_grad_norm={self.max_grad_norm!r}, normalization={self.normalization!r}). The first: an earlier "
            "window's end failed on some ranks only, after its collectives (a step pre-hook or the inner step raising "
            "there), and the replicas are apart; resume every rank from the same checkpoint. The second: changed "
            "through a setter on some ranks only, they would clip or scale the replicas apart; set them alike on "
            "every rank"
        )

    def _finish_across_ranks(self, sums: torch.Tensor) -> None:
        """End a window whose micro-batches are folded: sum the buckets over the ranks (DDP), scale them by the
        global weight sum and measure them, then finish as one process would."""
        if self._sync.reduces_buckets:
            self._launch_reductions(len(self._reduce_order))
        self._sync.window_ended()
        self._weight_sum = sums[0]
        self._bad_weight = sums[1] > 0
        self._rank_flags = sums[_SUMS_FLAGS:]
        # (micro-batch counts differ, settings' codes differ) across ranks, read at the window end's one host sync
        ranks = self._sync.world_size
        self._rank_mismatch = torch.stack(
            [_ranks_differ(sums[2], sums[3], ranks), _settings_differ_across(sums, ranks)]
        )
        scale = self._window_scale(self._weight_sum)
        zero = torch.zeros((), dtype=torch.float64, device=self._home)
        results = []
        for group_index, group in enumerate(self._groups):
            group_zero = ops.to_device(zero, group.buffer.device)
            group_scale = ops.to_device(scale, group.buffer.device)
            for bucket_index, bucket in enumerate(group.buffer.buckets):
                pending = self._pending.get((group_index, bucket_index))
                if pending is not None:
                    self._sync.wait_bucket(bucket, pending)
                results.append(
                    ops.fold_finish_(
                        bucket, [None] * len(bucket), group_zero, group_scale, first=False, backend=group.backend
                    )
                )
            group.fold_weight = group.scale = None
        self._pending.clear()
        self._ready.clear()
        self._reducing = False
        self._finish(results)

    # --- window internals -------------------------------------------------------------------------------

    def _check_param_set(self, identity: bool, before_backward: bool = False) -> None:
        """Refuse an inner optimizer whose parameters changed: their number on every call, and (``identity``, at
        a window's first and last micro-batch, where it costs about a microsecond per parameter) which tensors they
        are and whether their layout changed. Also refuse a ``grad_scaler`` that another live accumulator uses
        (``_claim_grad_scaler``). ``before_backward``: called by ``backward()`` before autograd runs (see
        ``_rearm_swapped``)."""
        if self._grad_scaler is not None:
            self._claim_grad_scaler()
        self._check_param_count()
        if not identity:
            return
        groups = self._optimizer.param_groups
        current = itertools.chain.from_iterable(param_group["params"] for param_group in groups)
        if (
            all(map(operator.is_, current, self._managed))
            and list(map(_KIND_OF, self._managed)) == self._kinds
            and list(map(torch.Tensor.stride, self._managed)) == self._strides
            and list(map(_TENSOR_OF, self._managed)) == self._tensors
            and all(_marked(param, self._hook_mark) for param in self._managed)
        ):
            return
        positions = [
            (g, i, param) for g, param_group in enumerate(groups) for i, param in enumerate(param_group["params"])
        ]
        for index, (g, i, param) in enumerate(positions):
            managed, kind, strides = self._managed[index], self._kinds[index], self._strides[index]
            if param is not managed:
                raise RuntimeError(
                    f"the inner optimizer's param_groups[{g}]['params'][{i}] is not the parameter "
                    "GradAccumulator was built with; build a new GradAccumulator after changing the inner "
                    "optimizer's parameters"
                )
            changes = [
                f"{name} {now}, built for {then}"
                for name, now, then in zip(_KIND_FIELDS, _KIND_OF(param), kind, strict=True)
                if now != then
            ]
            if not changes and param.stride() != strides:
                if _same_memory_order(param.shape, param.stride(), strides):
                    self._strides[index] = param.stride()  # no element moved: accepted from now on
                else:
                    changes.append(f"strides {param.stride()}, built for {strides}")
            if changes:
                raise RuntimeError(
                    f"param_groups[{g}]['params'][{i}] changed since GradAccumulator was built: "
                    f"{'; '.join(changes)}. Build a new GradAccumulator after moving, casting or converting the "
                    "model (model.to(...), model.double(), model.to(memory_format=...)) or changing a "
                    "parameter's grad_dtype"
                )
        self._rearm_swapped(before_backward)

    def _rearm_swapped(self, before_backward: bool) -> None:
        """Re-attach the hooks of parameters whose tensor was swapped in place since (``torch.utils.swap_tensors``,
        which ``model.load_state_dict()`` and ``model.to()`` use under
        ``torch.__future__.set_swap_module_params_on_conversion(True)``).

        A swapped parameter keeps its hook tables, but autograd runs the tables attached to the tensor it held before:
        the accumulator's hooks (folding during backward, releasing a finished gradient before autograd adds into
        it) and the user's alike would never run again. Setting each table again attaches it to the tensor held now.
        Refused, changing nothing, where a swapped parameter's ``p.grad`` may hold the last window's finished
        gradient with a new one added (the release hook did not run): it is still the view handed out and was written
        since that step (autograd added into it in place), or it is a new tensor with a graph (under
        ``create_graph=True`` autograd adds out of place, and the sum cannot be told from a gradient made after the
        swap), or it is still the view object but in new memory (``model.to()`` swaps a ``p.grad`` too: a conversion
        that ends where it began, ``model.half().float()``, moves it off the buffer) written since the conversion made
        it. Such a moved view that nobody wrote (a parameter this micro-batch did not use, or any of them when
        ``before_backward``: ``backward()`` asks before autograd runs) is the finished gradient it was, released as
        one.
        """
        # The tensor's address alone could miss a second swap that reused a freed tensor's address; the mark alone,
        # a swap whose new tensor was given the old one's __dict__.
        swapped = {
            id(param)
            for param, tensor in zip(self._managed, self._tensors, strict=True)
            if _TENSOR_OF(param) != tensor or not _marked(param, self._hook_mark)
        }
        held_views = []  # swapped parameters whose p.grad is still their view, in a buffer written since
        moved_views = []  # swapped parameters whose p.grad is still their view object, no longer on the buffer
        for group in self._groups:
            if group.published is None or group.published_version is None:
                continue
            source = _published_source(group)
            written = source._version != group.published_version
            for index, param in enumerate(group.params):
                view, grad = group.published[index], param.grad
                if id(param) not in swapped or view is None or not group.hooked[index] or grad is None:
                    continue
                # Added into in place, or out of place (a new p.grad with a graph) under create_graph=True; a new
                # p.grad without one is a gradient of its own (the swap dropped the finished one, as load_state_dict).
                if grad is view and not _in_memory_of(grad, source):
                    # A conversion makes the new memory with a version of 0; autograd adding into it raises that.
                    if not before_backward and _grad_version(grad) != 0:
                        moved_views.append(group.names[index])
                elif grad is view and written:
                    held_views.append(group.names[index])
                elif grad is not view and grad.requires_grad:
                    raise _swapped_grad_error(
                        f"{group.names[index]}: its p.grad may be",
                        "under create_graph=True a new p.grad made from it cannot be told from one made after the swap",
                    )
        if moved_views:
            raise _swapped_grad_error(
                f"{moved_views[0]}: its p.grad may be"
                if len(moved_views) == 1
                else f"{', '.join(moved_views)}: the p.grad of one or more of these may be",
                "the swap moved that p.grad too (model.to() converts a p.grad by swapping it as well: the same tensor "
                "object, in new memory), where autograd may have added into it since",
            )
        if held_views:
            # The views share their buffer's version counter: which of them was written cannot be told.
            raise _swapped_grad_error(
                f"{held_views[0]}: its p.grad may be"
                if len(held_views) == 1
                else f"{', '.join(held_views)}: the p.grad of one or more of these may be",
                "a p.grad still holding its view was written in place since (autograd added into it; its buffer's "
                "views share one version counter, so which of them cannot be told)",
            )
        for index, param in enumerate(self._managed):
            if id(param) in swapped:
                for table in ("_backward_hooks", "_post_accumulate_grad_hooks"):
                    hooks = getattr(param, table)
                    if hooks is not None:
                        setattr(param, table, hooks)  # setting a table attaches it to the tensor held now
                self._tensors[index] = _TENSOR_OF(param)
                _mark(param, self._hook_mark)

    def _check_param_count(self) -> None:
        """Refuse an inner optimizer that gained or lost parameters (``add_param_group`` on it, say)."""
        count = sum(len(param_group["params"]) for param_group in self._optimizer.param_groups)
        if count != len(self._managed):
            raise RuntimeError(
                f"the inner optimizer now has {count} parameters, GradAccumulator was built for "
                f"{len(self._managed)}: its parameters changed (add_param_group(), or params added to or removed from "
                "a param group); build a new GradAccumulator after changing them. An open window is lost then: to "
                "finish or save it first, take the change back (optimizer.param_groups.pop() after "
                "add_param_group())"
            )

    def _claim_grad_scaler(self) -> None:
        """One GradScaler per live accumulator. Each accumulator updates its scaler at its own window's end, while
        another one sharing it may hold gradients scaled by the old scale (a window still open, or a backward its
        step has not folded yet): they would be unscaled by the new one, silently off by the growth or backoff
        factor. The first accumulator to use a scaler owns it until that accumulator is garbage-collected."""
        scaler = self._grad_scaler
        owner_ref = _SCALER_OWNERS.get(scaler)
        owner = None if owner_ref is None else owner_ref()
        if owner is self:
            return
        if owner is not None:
            raise RuntimeError(
                "grad_scaler is used by another GradAccumulator that is still alive: a shared scaler's scale changes "
                "at one accumulator's window end while the other holds gradients scaled by the old scale. Give each "
                "GradAccumulator its own torch.amp.GradScaler (or put the parameters in one optimizer's param "
                "groups); an accumulator built to replace an old one can use its scaler once the old one is dropped"
            )
        _SCALER_OWNERS[scaler] = weakref.ref(self)

    def _weight_tensor(self, weight: float | torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight as a float64 0-d tensor on the home device, and a device flag for unchecked tensor values."""
        if weight is None:
            return torch.ones((), dtype=torch.float64, device=self._home), None
        if isinstance(weight, torch.Tensor):
            if weight.dim() != 0:
                raise ValueError(f"weight must be a number or a 0-d tensor, got shape {tuple(weight.shape)}")
            if weight.dtype == torch.bool or weight.is_complex():
                raise ValueError(f"weight must be a real number, got a tensor of dtype {weight.dtype}")
            if weight.layout != torch.strided:
                raise ValueError(f"weight must be a dense tensor, got layout {weight.layout}")
            if weight.is_meta:
                raise ValueError("weight must hold a value, got a tensor on the meta device")
            if weight.requires_grad:
                weight = weight.detach()
            # Copies (copy=True): a float64 tensor on the home device would otherwise be kept as it is, and the
            # caller's later in-place change (a reused token counter) would change this micro-batch's weight.
            if _checked_on_host(weight.device):
                value = weight.item()
                self._check_weight_value(value)
                # From the value read: a copy of the CPU tensor to a GPU would wait for the device (a host sync).
                return torch.full((), value, dtype=torch.float64, device=self._home), None
            w = ops.to_device(weight, self._home, torch.float64, copy=True)
            tiny, top, _ = self._weight_range
            return w, ~((w == 0) | ((w >= tiny) & (w <= top)))  # nan fails every comparison
        number = _real_number(weight)
        if number is None:
            raise TypeError(f"weight must be None, a number or a 0-d tensor, got {type(weight).__name__}")
        self._check_weight_value(number, weight)
        return torch.full((), number, dtype=torch.float64, device=self._home), None

    def _record_bad_weight(self, bad: torch.Tensor | None) -> None:
        if bad is not None:
            self._bad_weight = bad if self._bad_weight is None else self._bad_weight | bad

    def _check_weight_value(self, value: float, given: Any = None) -> None:
        if not math.isfinite(value) or value < 0:
            shown = ops.number_text(value if given is None else given)
            raise ValueError(f"weight must be a non-negative finite number, got {shown}")
        tiny, top, dtype = self._weight_range
        if value != 0 and not tiny <= value <= top:
            shown = ops.number_text(value if given is None else given)
            raise ValueError(
                f"weight must be 0 or between {tiny:.4g} and {top:.4g} (normal numbers of the {dtype} accumulation), "
                f"got {shown}; rescale the weights (with normalization='mean' only their ratios matter)"
            )
        if self.normalization == "mean" and value > self._largest_mean_sum:
            shown = ops.number_text(value if given is None else given)
            name = str(dtype).removeprefix("torch.")
            raise ValueError(
                f"weight must be at most {self._largest_mean_sum:.4g} with normalization='mean', got {shown}: the "
                f"window is scaled by 1 / the sum of its weights, which must be a normal {name} number; rescale the "
                "weights (only their ratios matter)"
            )

    def _held_grads(self) -> list[list[torch.Tensor | None]]:
        """Every group's unfolded gradients, checked before any buffer changes (a refused step changes nothing).

        A ``p.grad`` that is still the view an inner step was handed is not a new gradient: it counts as None; so
        does one that another live accumulator over the same parameter handed out.
        """
        foreign = self._foreign_views()
        self._check_released_in_time()
        held = []
        for group in self._groups:
            grads = [param.grad for param in group.params]
            if group.published is not None or foreign:
                grads = [None if _handed_out(group, i, grad, foreign) else grad for i, grad in enumerate(grads)]
            if not _any_given(grads):  # the usual case after backward(): nothing to check
                held.append(ops.CheckedGrads(grads))
                continue
            if self._sync.shards:
                grads = [self._sync.local_grad(grad) for grad in grads]
            held.append(ops.check_grads(group.buffer, grads, group.names))
        return held

    def _check_released_in_time(self) -> None:
        """Refuse a finished gradient handed out (``p.grad`` still the view) that a backward added into in place.

        The hook on each such parameter releases its view before autograd accumulates, so in eager mode a view the
        hook found in ``p.grad`` is gone from it once the backward returns. Under compiled autograd the release takes
        effect only after the traced backward, which accumulated into the view: the new gradient is then inside the
        finished one and cannot be taken out. Refused before anything changes."""
        written = [
            group.names[index]
            for group in self._groups
            if group.published is not None
            for index, param in enumerate(group.params)
            if group.release_ran[index] and _is_published(group, index, param.grad)
        ]
        if written:
            raise RuntimeError(
                f"step(): the p.grad of {', '.join(written[:3])}{' and others' if len(written) > 3 else ''} is still "
                "the finished gradient handed to the last step, and a backward added into it: under compiled "
                "autograd the hook that releases it before autograd accumulates takes effect too late. Its new "
                "gradient cannot be taken apart from the old one: drop it with opt.zero_grad() and run this "
                "micro-batch's backward again; call opt.zero_grad() after every step() under compiled autograd. "
                "Nothing changed"
            )

    def _others_publishing(self) -> list[GradAccumulator]:
        """The other live accumulators over some of these parameters whose last step's gradients are handed out
        (usually none: one accumulator per model)."""
        if not self._overlapping:
            return []
        return [
            other for other in list(self._overlapping) if any(group.published is not None for group in other._groups)
        ]

    def _release_published_of(self, ids: frozenset[int]) -> None:
        """Drop the finished gradients handed out for the parameters whose ids are in ``ids`` (another
        accumulator's backward over them is about to run); the others stay readable."""
        self._drop_views(lambda group, index: id(group.params[index]) in ids)
        if all(view is None for group in self._groups for view in group.published or ()):
            self._release_published()  # none left: the hooks and a cast copy go too

    def _unfolded_names(self) -> list[str]:
        """The parameters holding a gradient no ``step()`` has folded (not a finished one handed out, by this
        accumulator or another live one over the parameter)."""
        foreign = self._foreign_views()
        return [
            name
            for group in self._groups
            for index, (param, name) in enumerate(zip(group.params, group.names, strict=True))
            if param.grad is not None and not _handed_out(group, index, param.grad, foreign)
        ]

    def _foreign_views(self) -> set[int]:
        """The ids of the gradients other live accumulators over these parameters handed out."""
        return {
            id(view)
            for other in self._others_publishing()
            for group in other._groups
            for view in group.published or ()
            if view is not None
        }

    def _release_published(self) -> None:
        """Drop the finished gradients handed to the last inner step, so no backward adds into the buffer."""
        for handle in self._published_hooks:
            handle.remove()
        self._published_hooks.clear()
        for group in self._groups:
            if group.published is not None:
                for index, param in enumerate(group.params):
                    if _is_published(group, index, param.grad):
                        param.grad = None
                group.published = None
            group.finished = None

    def _release_unhooked(self) -> None:
        """After the inner step: drop the finished gradients of parameters that did not require grad when they
        were handed out. No hook can release them before a backward (once they are unfrozen) would add into them,
        in place or, with ``create_graph``, into a new tensor that could not be told from a new gradient."""
        self._drop_views(lambda group, index: not group.hooked[index])

    def _drop_views(self, where: Callable[[_Group, int], bool]) -> None:
        """Forget the published views at the (group, index) pairs ``where`` accepts; a ``p.grad`` still one of
        them is set to None. Their hooks stay, harmless (they release only their own view)."""
        for group in self._groups:
            if group.published is None:
                continue
            for index, param in enumerate(group.params):
                view = group.published[index]
                if view is not None and where(group, index):
                    if param.grad is view:
                        param.grad = None
                    group.published[index] = None

    def _start_window(self) -> None:
        self._sync.window_started()
        for group in self._groups:
            group.had_grad = [False] * len(group.params)
        self._release_published()
        self._weight_sum = None
        self._bad_weight = None
        self._window_lrs = [_lr_value(param_group.get("lr")) for param_group in self._optimizer.param_groups]
        self._inv_loss_scale = self._read_inv_loss_scale()

    def _read_inv_loss_scale(self) -> torch.Tensor | None:
        """1 / the GradScaler's scale (float64, home device), or None without a scaler."""
        if self._grad_scaler is None:
            return None
        self._check_loss_scale()
        return self._grad_scaler._get_scale_async().to(device=self._home, dtype=torch.float64).reciprocal()

    def _check_loss_scale(self) -> None:
        """Refuse a GradScaler without a scale yet (no ``scaler.scale()`` since it was made or loaded)."""
        if self._grad_scaler is not None and self._grad_scaler._get_scale_async() is None:
            raise RuntimeError("grad_scaler has no scale yet: call scaler.scale(loss).backward() before step()")

    def _check_lr_unchanged(self) -> None:
        """Warn once if the learning rate moves inside a window: a scheduler stepped per micro-batch."""
        if self._micro_step == 0 or self._warned_lr_change or self._window_lrs is None:
            return
        lrs = [_lr_value(param_group.get("lr")) for param_group in self._optimizer.param_groups]
        if lrs != self._window_lrs:
            self._warned_lr_change = True
            warnings.warn(
                "the learning rate changed inside an accumulation window: step LR schedulers once per optimizer "
                "step, i.e. `if opt.stepped: scheduler.step()`",
                UserWarning,
                stacklevel=3,
            )

    def _check_not_stepping(self, call: str) -> None:
        """Refuse ``call`` from a step pre-hook or the inner optimizer's step: the window is being finished (its
        gradients scaled and handed to ``p.grad``, ``micro_step`` still its last), so a call that reads or moves it
        would step it twice, release what the inner step is about to read, or save a half-finished window."""
        if self._stepping:
            raise RuntimeError(
                f"{call}: called while the window's inner step runs (from a step pre-hook or the inner optimizer's "
                "step); the window is not closed until that step returns: call it from a step post-hook or after "
                "step() returns"
            )

    def _finish(self, results: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Norm, non-finite check (the step's one host sync), clip, inner step; then a new window.

        The step pre-hooks registered on the accumulator run just before the inner step (the finished gradients
        are in ``p.grad``), the post-hooks just after. If a pre-hook or the inner step raises, the window is
        discarded (its gradients released, ``micro_step`` back to 0) and the error reaches the caller; training can
        go on with the next micro-batch.
        """
        norm, found_inf = self._measure(results)
        coef = self._clip_coef(norm)
        bad_weight = self._bad_weight if self._bad_weight is not None else torch.zeros_like(found_inf)
        if self.normalization == "mean":
            bad_weight = bad_weight | self._sum_beyond_scale()
        # (micro-batch counts differ, settings differ) across ranks
        mismatch = self._rank_mismatch if self._rank_mismatch is not None else found_inf.new_zeros(2)
        self._rank_mismatch = None
        checks = torch.cat([torch.stack([found_inf, bad_weight, self._may_overflow(norm, coef)]), mismatch])
        rank_flags, self._rank_flags = self._rank_flags, None
        if rank_flags is not None:  # the same one sync also reads which parameters and buckets the ranks touched
            checks = torch.cat([checks.to(torch.float64), rank_flags])
        values = checks.tolist()
        nonfinite, bad, may_overflow, counts_differ, settings_differ = (bool(value) for value in values[:5])
        if counts_differ or settings_differ:
            micro_step = self._micro_step  # before the discard resets it
            self._discard_window()
            if counts_differ:
                raise RuntimeError(
                    f"step(): the ranks ended a window at different micro-steps (this rank: {micro_step}); "
                    "every rank must run the same number of micro-batches per window; the window was discarded"
                )
            raise RuntimeError(self._settings_differ("step()") + "; the window was discarded")
        if rank_flags is not None:
            late = self._adopt_rank_flags(values[5:])
            if late:  # rare (see _fold_late): a second sync, for the norm of the completed buckets
                norm, found_inf = self._measure(self._reduce_late(results, late))
                coef = self._clip_coef(norm)
                again = torch.stack([found_inf, self._may_overflow(norm, coef)]).tolist()
                nonfinite, may_overflow = (bool(value) for value in again)
        self._grad_norm = norm
        if bad:  # a refused window leaves the loss scaler as it was
            cause = self._refused_weights_cause()
            self._discard_window()
            raise ValueError(f"weight: {cause}; the window was discarded and the inner optimizer did not step")
        if nonfinite:
            self._skip_window(found_inf)
            return
        try:
            for group in self._groups:
                self._publish_grads(group, coef)
            if may_overflow and self._cast_overflowed():  # rare: a second sync, only when the norm allows overflow
                # The finished gradient is unscaled already: a smaller loss scale would not shrink it, so the loss
                # scaler is left as it is.
                self._skip_window(None)
                return
            self._stepping = True
            try:
                for pre_hook in list(self._optimizer_step_pre_hooks.values()):
                    if not _no_new_step_arguments(pre_hook(self, (), {})):
                        raise RuntimeError(
                            "a GradAccumulator step pre-hook must return None (or the empty arguments it was given): "
                            "it runs before the inner step, which takes no arguments to change"
                        )
                with _inner_step(self._optimizer):
                    self._optimizer.step()
            finally:
                self._stepping = False
        except BaseException as error:
            self._discard_window()
            _add_note(
                error,
                "gafused: the window was discarded; handing the finished gradients to p.grad, a step pre-hook or the "
                "inner optimizer's step raised",
            )
            raise  # the loss scaler stays as it was, as GradScaler.update() is not reached when scaler.step() raises
        self._stepped = True
        self._micro_step = 0
        self._windows_ended += 1
        try:  # the window stepped: what fails from here on (the loss scaler's update, a post-hook) leaves it stepped
            if self._grad_scaler is not None:
                self._update_grad_scaler(found_inf)
            for post_hook in list(self._optimizer_step_post_hooks.values()):
                post_hook(self, (), {})
        finally:
            self._release_unhooked()
            for group in self._groups:
                if group.published is not None:
                    group.published_version = _published_source(group)._version

    def _clip_coef(self, norm: torch.Tensor) -> torch.Tensor | None:
        """The factor ``clip_grad_norm_`` would scale the finished gradient by, or None without clipping."""
        if self.max_grad_norm is None:
            return None
        return (self.max_grad_norm / (norm + 1e-6)).clamp(max=1.0)

    def _may_overflow(self, norm: torch.Tensor, coef: torch.Tensor | None) -> torch.Tensor:
        """Whether some finished value could exceed the range of a parameter dtype it is cast to: no value is
        larger than the norm, so only a norm beyond that range calls for the exact check, _cast_overflowed."""
        if self._cast_limit is None:
            return torch.zeros((), dtype=torch.bool, device=norm.device)
        bound = norm if coef is None else norm.to(torch.float64) * coef
        return bound > self._cast_limit

    def _cast_overflowed(self) -> bool:
        """Whether a finished gradient cast to its parameters' dtype holds inf (its fp32 value was finite): the
        window is then skipped as a non-finite one. Collective with FSDP2, whose ranks hold different shards."""
        # Segment by segment: the cast copy's alignment padding is never written (rare path: one launch each).
        flags = [
            torch.isinf(group.finished.narrow(0, offset, numel)).any().to(self._home)
            for group in self._groups
            if group.finished is not None
            for offset, numel in zip(group.buffer.offsets, group.buffer.numels, strict=True)
        ]
        overflow = torch.stack(flags).any()
        _, overflow = self._sync.reduce_norm(torch.zeros((), dtype=torch.float64, device=self._home), overflow)
        return bool(overflow)

    def _skip_window(self, found_inf: torch.Tensor | None) -> None:
        """Skip the inner step of a window whose finished gradient is not finite; the loss scaler backs off
        (``found_inf`` None: it is left as it is)."""
        self._skipped_steps += 1
        self._windows_ended += 1  # before what may fail on one rank only: every rank skipped this window
        if self._grad_scaler is not None and found_inf is not None:
            self._update_grad_scaler(found_inf)
        self._discard_window()

    def _sum_beyond_scale(self) -> torch.Tensor:
        """Whether the window's weight sum is beyond what its scale 1 / sum can be taken from (a device flag)."""
        return ~(self._weight_sum <= self._largest_mean_sum)  # an infinite sum too

    def _refused_weights_cause(self) -> str:
        """Why a window's end refused its weights (an error path: reading the flags may cost more syncs)."""
        tiny, top, dtype = self._weight_range
        name = str(dtype).removeprefix("torch.")
        causes = []
        if self._bad_weight is not None and bool(self._bad_weight):
            cause = (
                f"a weight of this window was refused at its end: one given as a device tensor was negative, nan, inf "
                f"or outside {name}'s normal range ({tiny:.3g} to {top:.3g})"
            )
            inverse = None if self._inv_loss_scale is None else self._inv_loss_scale.item()
            if self._grad_scaler is not None and inverse != 0:  # (0: an infinite scale takes every weight to 0)
                cause += ", or one divided by grad_scaler's loss scale left that range"
                if inverse is not None:  # the weights that fit both the range and the range once divided
                    scale = 1 / inverse
                    low, high = max(tiny, tiny * scale), min(top, top * scale)
                    cause += f" (at the loss scale {scale:g}: 0, or {low:.3g} to {high:.3g})"
            causes.append(cause)
        total = self._weight_sum.item()  # (nan where a bad device weight made it: said above)
        if self.normalization == "mean" and total > self._largest_mean_sum:
            causes.append(
                f"this window's weights sum to {total:.4g}, beyond {self._largest_mean_sum:.4g}: "
                f"with normalization='mean' the window is scaled by 1 / that sum, which must be a normal {name} "
                "number; rescale the weights (only their ratios matter)"
            )
        return "; ".join(causes)

    def _measure(self, results: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The window's global norm and non-finite flag from the (sum of squares, flag) of its finished pieces."""
        # The parts come one per bucket (or buffer) in their buffer's accumulation dtype, and are summed per dtype in
        # float64: every rank lists the same dtypes (FSDP2 all-reduces the sums). The norm takes the widest.
        dtypes = sorted({group.buffer.accum_dtype for group in self._groups}, key=lambda dtype: torch.finfo(dtype).bits)
        norm_dtype = dtypes[-1]
        parts: dict[torch.dtype, list[torch.Tensor]] = {dtype: [] for dtype in dtypes}
        for sum_sq, _ in results:
            parts[sum_sq.dtype].append(ops.to_device(sum_sq, self._home, torch.float64))
        sums = torch.stack(
            [
                torch.stack(parts[dtype]).sum()
                if parts[dtype]
                else torch.zeros((), dtype=torch.float64, device=self._home)
                for dtype in dtypes
            ]
        )
        found_inf = torch.stack([ops.to_device(flag, self._home) for _, flag in results]).any()
        sums, found_inf = self._sync.reduce_norm(sums, found_inf)  # FSDP2: every rank's shards
        # A window whose weights sum to zero holds no data: skipped in either normalization (with "mean" every
        # finished value would be nan, but an all-empty buffer has no value to show it).
        empty_window = self._weight_sum <= 0
        # Finite values whose squares overflow their dtype's sum (beyond ~1.8e19 in float32) leave the norm unknown:
        # clipping by an infinite norm would zero the gradient, so such a window is skipped as a non-finite one. Each
        # dtype's sum is held to that dtype's range, so a sum spread over several buckets or buffers overflows as
        # one buffer's single part does.
        held = [
            torch.where(part > torch.finfo(dtype).max, math.inf, part) for part, dtype in zip(sums, dtypes, strict=True)
        ]
        total = functools.reduce(operator.add, held)
        norm = torch.where(empty_window, math.nan, total.sqrt()).to(norm_dtype)
        return norm, found_inf | empty_window | torch.isinf(norm)

    def _adopt_rank_flags(self, values: list[float]) -> list[tuple[int, int]]:
        """Take the window's all-reduced flags: a parameter that got a gradient on any rank gets the finished
        gradient on every rank (as DDP does); returns the buckets some rank folded late, in reduction order."""
        position = 0
        for group in self._groups:
            count = len(group.params)
            group.had_grad = [ranks > 0 for ranks in values[position : position + count]]
            position += count
        if not self._sync.reduces_buckets:
            return []  # nothing is folded late where the wrapper reduces (FSDP2)
        late = values[position:]
        return [key for key, ranks in zip(self._reduce_order, late, strict=True) if ranks > 0]

    def _reduce_late(
        self, results: list[tuple[torch.Tensor, torch.Tensor]], late: list[tuple[int, int]]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Complete the buckets some rank folded late: every rank reduces its late part (zeros if it has none),
        in the same order, and adds it, scaled, to the finished bucket, which is measured again."""
        scale = self._window_scale(self._weight_sum)
        results = list(results)
        for key in late:
            group_index, bucket_index = key
            group = self._groups[group_index]
            bucket = group.buffer.buckets[bucket_index]
            part = self._late.pop(key, None)
            if part is None:
                part = _zeros_like_layout(bucket)
            self._sync.wait_bucket(part, self._sync.start_bucket(part))
            one = torch.ones((), dtype=bucket.accum_dtype, device=bucket.device)
            results[self._reduce_order.index(key)] = ops.fold_finish_(
                bucket, part.views(), ops.to_device(scale, bucket.device), one, first=False, backend=group.backend
            )
        self._late.clear()
        return results

    def _publish_grads(self, group: _Group, coef: torch.Tensor | None) -> None:
        """Apply the clip coefficient and hand the finished gradient to the inner optimizer as ``p.grad``.

        Each ``p.grad`` is a view of the buffer (or of its cast copy) with ``p``'s strides. A hook releases it
        before the next backward would add into it; until then it can be read, as plain PyTorch's can. A
        parameter that does not require grad now can take no hook: its view is released once the inner step and
        the step post-hooks returned (``_release_unhooked``).
        """
        buffer = group.buffer
        group_coef = None if coef is None else ops.to_device(coef, buffer.device)
        if group.param_dtype == buffer.accum_dtype:
            if group_coef is not None:
                ops.scale_(buffer, group_coef, backend=group.backend)
        else:
            group.finished = torch.empty(buffer.numel, dtype=group.param_dtype, device=buffer.device)
            one = torch.ones((), dtype=buffer.accum_dtype, device=buffer.device)
            ops.scale_(buffer, one if group_coef is None else group_coef, out=group.finished, backend=group.backend)
        source = _published_source(group)
        published: list[torch.Tensor | None] = []
        hooked: list[bool] = []
        release_ran = [False] * len(group.params)
        wrap_grad, handles = self._sync.wrap_grad, self._published_hooks
        for param, had_grad, segment in zip(group.params, group.had_grad, buffer.views(source), strict=True):
            # A parameter with no gradient in the whole window keeps None, as plain PyTorch would.
            view = wrap_grad(param, segment) if had_grad else None
            param.grad = view
            published.append(view)
            hooked.append(view is not None and param.requires_grad)
            if hooked[-1]:
                hook = _release_before_accumulation(param, view, release_ran, len(hooked) - 1)
                handles.append(_register_grad_hook(param, hook))
        group.published = published
        group.hooked = hooked
        group.release_ran = release_ran

    def _discard_window(self) -> None:
        self._drop_reductions()
        self._drop_unreduced()
        self._release_grads()
        self._weighted_elsewhere = None  # what it recorded went with the gradients
        self._micro = None
        for group in self._groups:
            group.fold_weight = group.scale = None
            group.bucket_touched = [False] * len(group.bucket_touched)
            group.bucket_results = [None] * len(group.bucket_results)
        self._stepped = False
        self._micro_step = 0
        self._weight_sum = None
        self._bad_weight = None
        self._rank_flags = None

    def _update_grad_scaler(self, found_inf: torch.Tensor) -> None:
        """What ``GradScaler.update`` does after ``GradScaler.step`` found (or did not find) inf in the grads."""
        scaler = self._grad_scaler
        if scaler._scale is None:  # loaded and not used since (a resumed window finished by flush()): its loaded scale
            scaler._lazy_init_scale_growth_tracker(found_inf.device)
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

    @torch._disable_dynamo
    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state plus the open window (buffers, weights, position).

        Take it between micro-batches (after ``step()``), not between ``backward()`` and ``step()``. State-dict
        hooks registered on the accumulator run as ``torch.optim.Optimizer.state_dict`` runs them, around this
        whole dict.
        """
        return self._state_dict(with_window=True)

    def _state_dict(self, with_window: bool) -> dict[str, Any]:
        """``state_dict()``, or with ``with_window`` False the state as it was when the open window began: the inner
        optimizer's (which has not stepped since) and an empty window, for a caller that runs that window's
        micro-batches again after loading it (Trainer's resume does)."""
        self._check_not_stepping("state_dict()")
        if self._micro is not None:
            raise RuntimeError("state_dict(): backward() was called without step(); call step() first")
        # A checkpoint of a window laid out for other parameters than the inner optimizer's would load nowhere.
        self._check_param_count()
        open_window = with_window and self._micro_step > 0
        if open_window and self._sync.holds_unreduced():
            raise RuntimeError(
                "state_dict(): FSDP holds this window's gradients unreduced (set_requires_gradient_sync(False)), "
                "outside the accumulator's buffers, so a checkpoint would lose them. Take it at a window's end (when "
                "opt.stepped is True), or keep FSDP's sync on in windows that may be checkpointed"
            )
        if open_window and _called_from(_DCP_MODULE, "_get_optim_state_dict"):
            folded = f"{self._micro_step} micro-batch{'es' if self._micro_step > 1 else ''} folded"
            raise RuntimeError(
                f"state_dict(): torch.distributed.checkpoint keeps only an optimizer state_dict's 'state' and "
                f"'param_groups', so the open window ({folded}) would be lost. Take DCP "
                "checkpoints between windows (when opt.stepped is True), or save opt.state_dict() of every rank with "
                "torch.save"
            )
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        # Between windows the last window's sums and learning rates stay (read by nothing once it ended); the state
        # of a window's start (``with_window`` False) holds none, as before a first window.
        kept = with_window or self._micro_step == 0
        window: dict[str, Any] = {
            "version": STATE_VERSION,
            "accumulation_steps": self.accumulation_steps,
            "normalization": self.normalization,
            "micro_step": self._micro_step if with_window else 0,
            "skipped_steps": self._skipped_steps,
            "weight_sum": None if self._weight_sum is None or not kept else self._weight_sum.clone(),
            "bad_weight": None if self._bad_weight is None or not kept else self._bad_weight.clone(),
            "inv_loss_scale": None if self._inv_loss_scale is None or not kept else self._inv_loss_scale.clone(),
            "window_lrs": None if self._window_lrs is None or not kept else list(self._window_lrs),
            "world_size": self._sync.world_size,
            "rank": self._sync.rank,
            "layout": self._layout_kind,
            "buffers": [],
        }
        for group, positions in zip(self._groups, self._positions(), strict=True):
            entry: dict[str, Any] = {
                "numels": list(group.buffer.numels),
                "shapes": [list(shape) for shape in group.buffer.shapes],
                "positions": positions,
                "had_grad": list(group.had_grad) if kept else [False] * len(group.had_grad),
            }
            if open_window:  # a finished or empty window's buffer holds nothing worth saving
                # Each segment in its parameter's row-major order, whatever the memory format: the checkpoint loads
                # into the model in either (model.to(memory_format=...) before or after resuming).
                # Copied into one tensor view by view: a permuted segment's reshape would be a copy of its own.
                buffer = group.buffer
                segments = buffer.data.new_empty(sum(buffer.numels))
                for index, start in enumerate(running_starts(buffer.numels)):
                    view = buffer.view(index)
                    segments[start : start + view.numel()].view(view.shape).copy_(view)
                entry["segments"] = segments
            window["buffers"].append(entry)
        state_dict = {**self._optimizer.state_dict(), "gafused": window}
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    @torch._disable_dynamo
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what ``state_dict()`` saved; a checkpoint taken mid-window resumes that window exactly.

        The window is checked whole before anything changes: a refused checkpoint raises ValueError naming the bad
        field (RuntimeError for a plain optimizer's state while a window is open) and leaves the accumulator and
        the inner optimizer as they were. Loading rolls back to the checkpoint:
        the open window is replaced, and with it a ``backward()`` awaiting its ``step()`` and every gradient no
        ``step()`` folded (``p.grad`` is released), as after an interrupted micro-batch, which it recovers from.
        The inner optimizer's part goes to its own ``load_state_dict``, which checks what torch checks.
        Load-state-dict hooks registered on the accumulator run as ``torch.optim.Optimizer.load_state_dict`` runs
        them.

        Args:
            state_dict: a dict from ``state_dict()`` of an accumulator over the same parameters, or a plain
                optimizer's ``state_dict()`` over them (between windows only: it holds no window).
        """
        self._check_not_stepping("load_state_dict()")
        if isinstance(state_dict, dict):
            state_dict = state_dict.copy()  # shallow, as torch.optim.Optimizer does: hooks may replace entries
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        inner, window = checkpoint.split(self, state_dict)
        checkpoint.check_groups_match(inner, self._optimizer.param_groups)
        window = checkpoint.validated_window(self, checkpoint.in_model_order(self, window))
        micro_step = window["micro_step"]

        # Every tensor restored is made here, before anything changes (a failing copy to the device changes
        # nothing); detached: a saved tensor with a graph must not attach one to the buffers.
        def restore(value: torch.Tensor | None) -> torch.Tensor | None:
            return None if value is None else value.detach().to(self._home)

        weight_sum, bad_weight = restore(window.get("weight_sum")), restore(window.get("bad_weight"))
        restored_segments = [
            None
            if micro_step == 0  # between windows the buffers hold nothing of the checkpoint's (whose layout may differ)
            else window["buffers"][index]["segments"]
            .detach()
            .to(group.buffer.device, group.buffer.accum_dtype)
            .contiguous()
            for index, group in enumerate(self._groups)
        ]
        self._optimizer.load_state_dict(inner)  # validates its own groups before changing

        self._release_published()
        self._drop_reductions()  # an interrupted last micro-batch's reductions and late parts: not this window's
        self._drop_unreduced()  # nor what FSDP holds back of the window open before
        self._weighted_elsewhere = None  # another accumulator's weight for gradients released here
        for group in self._groups:
            for param in group.params:
                param.grad = None
        self._unscaled_grads = []
        self._micro = None
        self._micro_step = micro_step
        self._skipped_steps = window["skipped_steps"]
        self._windows_ended = 0  # every rank loads a checkpoint of the same point
        self._weight_sum = weight_sum
        self._bad_weight = bad_weight
        # The rest of the window's losses are scaled by this accumulator's scaler (or not at all): its scale, read
        # at the next fold, unscales them. The folded part of the buffer is unscaled already.
        self._inv_loss_scale = None
        saved_lrs = window.get("window_lrs") if micro_step > 0 else None  # a new window records its own
        if saved_lrs is not None:
            # A device-tensor learning rate was recorded by identity, which means nothing in another accumulator:
            # the loaded optimizer's own tensor stands for it.
            current = [_lr_value(param_group.get("lr")) for param_group in self._optimizer.param_groups]
            saved_lrs = [now if by_identity(lr) else lr for lr, now in zip(saved_lrs, current, strict=True)]
        self._window_lrs = saved_lrs
        self._stepped = False
        self._grad_norm = None  # not in the checkpoint: the norm of the window that ends next
        for index, (group, segments) in enumerate(zip(self._groups, restored_segments, strict=True)):
            group.had_grad = [False] * len(group.params)  # what a window's start sets
            if segments is None:
                continue
            group.had_grad = list(window["buffers"][index]["had_grad"])
            buffer = group.buffer
            # Version 2: the buffer's memory order, which it does not record: taken to be this buffer's (a checkpoint
            # of that version resumes in the memory format it was saved in). Otherwise each parameter's row-major.
            in_memory_order = window["version"] == 2
            for param_index, start in enumerate(running_starts(buffer.numels)):
                saved = segments[start : start + buffer.numels[param_index]]
                if in_memory_order:
                    buffer.segment(param_index).copy_(saved)
                else:
                    buffer.view(param_index).copy_(saved.view(buffer.shapes[param_index]))
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _positions(self, version: int = STATE_VERSION) -> list[list[int]]:
        """Per buffer, where each of its parameters sits in the order the buffers were laid out from (version 6: the
        model's parameters with model=, else the optimizer's param_groups flattened; version 5: the optimizer's)."""
        order = self._managed if version < 6 else self._layout_order
        position = {id(param): index for index, param in enumerate(order)}
        return [[position[id(param)] for param in group.params] for group in self._groups]


# What the buffer's layout of a parameter was built from, with its strides: its device, dtype, where torch has it
# grad_dtype (the dtype autograd gives its gradient), and shape.
_KIND_FIELDS = ("device", "dtype", *(("grad_dtype",) if hasattr(torch.Tensor, "grad_dtype") else ()), "shape")
_KIND_OF = operator.attrgetter(*_KIND_FIELDS)
# Which tensor a parameter holds as autograd sees it: changed by torch.utils.swap_tensors, the Python object kept.
_TENSOR_OF = operator.attrgetter("_cdata")
# The key of the marks the accumulators leave in their parameters' __dict__ (swapped away with the tensor).
_HOOK_MARK = "_gafused_hooks"


def _marked(param: torch.Tensor, mark: int) -> bool:
    marks = vars(param).get(_HOOK_MARK)
    return isinstance(marks, dict) and mark in marks


def _mark(param: torch.Tensor, mark: int) -> None:
    marks = vars(param).get(_HOOK_MARK)
    if not isinstance(marks, dict):
        marks = vars(param)[_HOOK_MARK] = {}
    marks[mark] = True


def _unmark(param: torch.Tensor, mark: int) -> None:
    marks = vars(param).get(_HOOK_MARK)
    if isinstance(marks, dict):
        marks.pop(mark, None)
        if not marks:
            del vars(param)[_HOOK_MARK]


def _ranks_differ(total: Any, squares: Any, ranks: int) -> Any:
    """Whether the ranks' values differ, from their all-reduced sum and sum of squares (floats, or 0-d tensors on the
    device, where no host sync is wanted): by Cauchy-Schwarz, ``ranks * sum(c^2) == (sum c)^2`` exactly when every
    rank's ``c`` is the same (integers whose sums float64 holds exactly)."""
    return squares * ranks != total * total


# The window sums (_reduced_window_sums): weight sum, bad-weight flag, micro-step count and its square, then each of
# the settings' codes and its square; the rank flags start after them.
_SUMS_FLAGS = 4 + 2 * distributed.SETTINGS_CODES


def _settings_differ_across(sums: Any, ranks: int) -> Any:
    """Whether the ranks' settings codes differ, from the window sums (floats, or a tensor on the device)."""
    differ = [_ranks_differ(sums[4 + 2 * i], sums[5 + 2 * i], ranks) for i in range(distributed.SETTINGS_CODES)]
    return torch.stack(differ).any() if isinstance(sums, torch.Tensor) else any(differ)


def _swapped_grad_error(subject: str, how: str) -> RuntimeError:
    """The refusal of ``GradAccumulator._rearm_swapped``: ``subject`` (the parameter or parameters, and "may be"), the
    finished gradient with a new one added, and ``how`` the new one came to be there."""
    return RuntimeError(
        f"{subject} the finished gradient the last window's step handed out with a new gradient added to it: the "
        "parameter's tensor was swapped since (torch.utils.swap_tensors, which model.load_state_dict() and model.to() "
        "use under torch.__future__.set_swap_module_params_on_conversion(True)), so the hook that releases that "
        f"gradient before a backward did not run, and {how}; nothing changed. Call opt.zero_grad() after step() (or "
        "after swapping, before the next backward) and run this micro-batch again"
    )


def _same_memory_order(shape: torch.Size, strides: tuple[int, ...], built: tuple[int, ...]) -> bool:
    """Whether two stride tuples of one shape place every element alike: they may differ only on dimensions of size 1
    (channels_last on a 1x1 convolution's weight), which no element moves along."""
    return all(size == 1 or a == b for size, a, b in zip(shape, strides, built, strict=True))


# GradScaler -> the accumulator that uses it (GradAccumulator._claim_grad_scaler); weak both ways, and kept off the
# scaler itself so that the scaler still pickles.
_SCALER_OWNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _called_from(module: str, function: str) -> bool:
    """Whether ``module``'s ``function`` (torch.distributed.checkpoint's, GradScaler's) is among the few callers
    above the method asking."""
    frame = sys._getframe(2)
    for _ in range(16):  # wrappers of the method (torch's, an LR scheduler's, a subclass's), then the caller
        if frame is None:
            return False
        if frame.f_code.co_name == function and frame.f_globals.get("__name__") == module:
            return True
        frame = frame.f_back
    return False


_DCP_MODULE = "torch.distributed.checkpoint.state_dict"
_GRAD_SCALER_MODULE = "torch.amp.grad_scaler"
# What a refusal of a step GradScaler.step() made leaves: the scaler's unscale_ ran before.
_SCALER_UNSCALED = (
    "the scaler unscaled the gradients in p.grad already: drop them (zero_grad()) and run this micro-batch again"
)

# The inner optimizers (by id) an accumulator is stepping now: any other step of one of them is refused
# (_refuse_direct_inner_step).
_INNER_STEPPING: set[int] = set()


@contextlib.contextmanager
def _inner_step(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    _INNER_STEPPING.add(id(optimizer))
    try:
        yield
    finally:
        _INNER_STEPPING.discard(id(optimizer))


def _refuse_direct_inner_step(accumulator: weakref.ref) -> Callable[..., None]:
    """A step pre-hook for the inner optimizer: stepped by the user (``optimizer.step()``, ``scaler.step(optimizer)``
    on the optimizer that was wrapped, still in scope), it would step on one micro-batch's gradient, outside the
    window, silently. Refused while the accumulator lives, except its own step and torch.distributed.checkpoint's
    zero step that creates the optimizer's state (lr 0)."""

    def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if id(optimizer) in _INNER_STEPPING or accumulator() is None:
            return
        if _called_from(_DCP_MODULE, "_init_optim_state"):
            return
        changed = _SCALER_UNSCALED if _called_from(_GRAD_SCALER_MODULE, "_maybe_opt_step") else "nothing changed"
        raise RuntimeError(
            f"{type(optimizer).__name__}.step() was called on the optimizer a GradAccumulator wraps: it would step "
            f"on one micro-batch's gradient, outside the accumulation window ({changed}). Call step() of the "
            "GradAccumulator, which steps this optimizer once per window (with a GradScaler: give it as "
            "grad_scaler= and call no scaler.step)"
        )

    return hook


class _OnTheWrapped:
    """An attribute of a forwarding wrapper's class (GradAccumulator.__init_subclass__) that reads, writes and calls
    the wrapped accumulator's (``wrapper._optimizer``)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __get__(self, wrapper: Any, owner: type | None = None) -> Any:
        if wrapper is None:
            return self
        return getattr(wrapper._optimizer, self._name)

    def __set__(self, wrapper: Any, value: Any) -> None:
        setattr(wrapper._optimizer, self._name, value)

    def __delete__(self, wrapper: Any) -> None:
        delattr(wrapper._optimizer, self._name)


@dataclass
class _MicroBatch:
    """The open micro-batch of the backward() loop."""

    given: float | torch.Tensor | None  # the weight as the caller gave it (to compare later backward calls)
    weight: torch.Tensor  # the weight as a float64 0-d tensor (home device)
    weight_sum: torch.Tensor  # the window's weight sum including this micro-batch (float64, home device)
    last: bool  # opened as the window's last micro-batch: buckets are finished as they are folded
    ends_window: bool  # the window ends at this micro-batch's step() (declared at its first backward, or later)
    bad_weight: torch.Tensor | None = None  # device flag for a tensor weight checked on the device
    folded: bool = False  # an earlier backward() of this micro-batch folded something
    folded_in_call: bool = False  # the running backward() folded something
    counted: float | torch.Tensor | None = None  # given, a CPU tensor as its value at the opening
    serial: int = 0  # which micro-batch, unique in the process


@dataclass
class _OnFailure:
    """What ``_discarded_on_failure`` says of a failure in its block, and whether it keeps a window that ended."""

    what: str
    unless_ended: bool = False

    def ending(self) -> None:
        """The block goes on to end the window."""
        self.what, self.unless_ended = "the window's end failed", True


@dataclass
class _WeightedElsewhere:
    """Another accumulator's backward() that gave some of this one's parameters their ``p.grad``."""

    given: float | torch.Tensor | None  # the weight as its caller gave it (a CPU tensor: its value then; None: 1)
    weight: torch.Tensor  # as that backward counted it (float64 0-d; FSDP2: rounded to the loss's dtype)
    produced: list[weakref.ref]  # the gradients it gave this accumulator's parameters
    unreduced: tuple[int, ...] | None = None  # FSDP2, its sync off: the tags of what FSDP held unreduced after it
    conflict: bool = False  # added to gradients an earlier backward gave, still held (another micro-batch or weight)
    failed: bool = False  # a failed backward added to gradients held (in place: they cannot be put back)
    source: tuple[int, int] = (0, 0)  # (id of the accumulator whose backward gave them, its micro-batch's serial)


_MICRO_SERIALS = itertools.count(1)
# The way out where FSDP (its sync off) summed what no call can drop alone. Every accumulator: one loaded alone would
# run out of step with the others' windows, and a backward ending theirs would reduce in the middle of its own.
_DROP_WINDOW = (
    "drop the whole window: load every accumulator over the model with the state_dict() it gave at one point between "
    "windows (its own state_dict(): a torch.distributed.checkpoint load is refused while a window is open)"
)
# What another accumulator's backward() may change of one accumulator: (param, p.grad, its version) for each of its
# parameters, what FSDP holds unreduced of them (an unreduced_fingerprint), and its _WeightedElsewhere record.
_OthersBefore = tuple[list[tuple[torch.Tensor, torch.Tensor | None, int]], Any, "_WeightedElsewhere | None"]


def _grad_version(grad: torch.Tensor) -> int:
    """A gradient's version; a DTensor's is its local tensor's (FSDP2 adds into ``_local_tensor`` in place, which
    leaves the wrapper's own counter as it was)."""
    return getattr(grad, "_local_tensor", grad)._version


def _held_tags(fingerprint: Any) -> tuple[int, ...] | None:
    """The tensors of an ``unreduced_fingerprint`` (pairs of tag and version), by tag alone (a tag, unlike an id, is
    never another tensor's, even after the first is freed)."""
    return None if fingerprint is None else tuple(tag for tag, _ in fingerprint)


def _same_given(weight: Any, given: Any) -> bool:
    """Whether two weights as callers gave them count alike: None (1) only as None, else as ``_same_weight``."""
    return (weight is None) == (given is None) and _same_weight(weight, given)


def _same_weight(weight: Any, given: Any) -> bool:
    """Whether a later backward() of a micro-batch repeats the weight its first one gave."""
    if weight is given:
        return True
    first, again = _host_weight(given), _host_weight(weight)
    return first is not None and first == again


def _host_weight(value: Any) -> float | None:
    """A weight's value if it is known on the host (None: 1), else None (a device tensor: no read without a sync)."""
    if value is None:
        return 1.0
    if isinstance(value, torch.Tensor):
        return float(value.item()) if value.device.type == "cpu" and value.dim() == 0 else None
    return _real_number(value)


def _zeros_like_layout(bucket: FlatGradBuffer) -> FlatGradBuffer:
    """A zeroed buffer with ``bucket``'s segments at the same offsets (a bucket starts at an aligned offset)."""
    copy = FlatGradBuffer(bucket.params, bucket.accum_dtype, bucket.alignment_bytes, bucket_bytes=1 << 62)
    assert copy.offsets == bucket.offsets and copy.numel == bucket.numel, "bucket layout not reproducible"
    return copy


def _any_given(grads: list[torch.Tensor | None]) -> bool:
    """Whether some entry is not None: ``any(g is not None for g in grads)`` in one C-level pass (``list.count(None)``
    would compare each tensor to None with ``Tensor.__eq__``)."""
    return any(map(operator.is_not, grads, itertools.repeat(None)))


def _grads_and_versions(params: list[torch.Tensor]) -> tuple[list[torch.Tensor | None], list[int] | None]:
    """Each parameter's ``p.grad`` and its version counter (``_grad_version``; 0 for None); versions None when every
    one is None (the usual case: nothing to read)."""
    grads = [param.grad for param in params]
    if not _any_given(grads):
        return grads, None
    return grads, [0 if grad is None else _grad_version(grad) for grad in grads]


def _published_source(group: _Group) -> torch.Tensor:
    """The memory the group's published views are views of: the buffer, or its cast copy."""
    return group.buffer.data if group.finished is None else group.finished


def _in_memory_of(grad: torch.Tensor, source: torch.Tensor) -> bool:
    """Whether ``grad`` (a DTensor: its shard) lies in ``source``'s memory. A handed-out view swapped in place
    (``torch.utils.swap_tensors``) is the same object in new memory."""
    local = getattr(grad, "_local_tensor", grad)
    return local.untyped_storage().data_ptr() == source.untyped_storage().data_ptr()


def _is_published(group: _Group, index: int, grad: torch.Tensor | None) -> bool:
    return grad is not None and group.published is not None and grad is group.published[index]


def _handed_out(group: _Group, index: int, grad: torch.Tensor | None, foreign: set[int]) -> bool:
    """Whether ``grad`` is a finished gradient, not a new one: this accumulator's published view, or one of the
    ``foreign`` ids another live accumulator over the parameter handed out (``_foreign_views``)."""
    return _is_published(group, index, grad) or id(grad) in foreign


def _before_model_forward(owner: GradAccumulator):
    """A forward pre-hook for ``model``: keep the wrapper's own gradient synchronization off (DDP decides at its
    forward), and drop the published gradients (FSDP2 writes gradients without the tensor hooks that release
    them otherwise)."""
    owner_ref = weakref.ref(owner)

    def hook(module: torch.nn.Module, args: Any) -> None:
        accumulator = owner_ref()
        if accumulator is None:
            return
        accumulator._sync.before_forward()
        if accumulator._published_hooks:
            accumulator._release_published()

    return hook


def _register_grad_hook(param: torch.Tensor, hook: Callable[[torch.Tensor], Any]) -> torch.utils.hooks.RemovableHandle:
    """``param.register_hook(hook)``, for a plain leaf parameter that has a hook table already without the checks
    and lookups of ``Tensor.register_hook`` (half its host time): what it does for such a tensor, entry and handle."""
    table = param._backward_hooks if type(param) is torch.nn.Parameter and param.grad_fn is None else None
    if table is None:
        return param.register_hook(hook)
    handle = torch.utils.hooks.RemovableHandle(table)
    table[handle.id] = hook
    return handle


def _release_before_accumulation(param: torch.Tensor, view: torch.Tensor, ran: list[bool], index: int):
    """A gradient hook that drops ``param.grad`` if it is still ``view`` before autograd accumulates into it, and
    notes in ``ran[index]`` that it did (``_check_released_in_time``)."""

    def hook(grad: torch.Tensor) -> None:
        if param.grad is view:
            param.grad = None
            ran[index] = True

    return hook


def _lr_value(lr: Any) -> Any:
    """A learning rate as a comparable value: tensors on the CPU by value (no device sync), others by identity and
    version (schedulers change a tensor learning rate in place, which bumps its version counter)."""
    if isinstance(lr, torch.Tensor):
        return lr.item() if _checked_on_host(lr.device) and lr.numel() == 1 else ("tensor", id(lr), lr._version)
    return lr


def _check_loss(loss: Any) -> None:
    """What ``backward()`` backpropagates: a one-element tensor with a graph (refused before anything changes)."""
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"backward(): loss must be a tensor, got {type(loss).__name__}")
    if not loss.is_floating_point():
        raise TypeError(f"backward(): loss must be a real floating-point tensor, got {loss.dtype}")
    if loss.numel() != 1:
        raise ValueError(
            f"backward(): loss must have one element (reduce it with mean() or sum()), got shape {tuple(loss.shape)}"
        )
    if not loss.requires_grad:
        raise ValueError(
            "backward(): loss does not require grad: it was computed under torch.no_grad() or inference_mode(), "
            "or from no parameter that requires grad"
        )


def _callable_hook(hook: Any, method: str) -> Callable[..., Any]:
    """``hook`` for ``method``, refused unless it can be called."""
    if not callable(hook):
        raise TypeError(f"{method}(): hook must be callable, got {type(hook).__name__}")
    return hook


def _check_autograd_options(retain_graph: Any, create_graph: Any, inputs: Any) -> Any:
    """``backward()``'s options for ``torch.autograd.backward``, refused by name before anything changes."""
    if retain_graph is not None:
        ops.check_bool(retain_graph, "backward(): retain_graph")
    ops.check_bool(create_graph, "backward(): create_graph")
    if inputs is None or isinstance(inputs, (torch.Tensor, torch.autograd.graph.GradientEdge)):
        return inputs
    if isinstance(inputs, (str, bytes)) or not isinstance(inputs, collections.abc.Iterable):
        raise TypeError(
            f"backward(): inputs must be None, a tensor or an iterable of tensors, got {type(inputs).__name__}"
        )
    inputs = tuple(inputs)  # as torch.autograd.backward does: a ParameterList, dict values, ...
    if not inputs:
        raise ValueError("backward(): inputs must not be empty (None backpropagates into every leaf)")
    for index, item in enumerate(inputs):
        if not isinstance(item, (torch.Tensor, torch.autograd.graph.GradientEdge)):
            raise TypeError(f"backward(): inputs[{index}] must be a tensor, got {type(item).__name__}")
    return inputs


def _warn_of_frozen_parameters(groups: list[_Group]) -> None:
    """Every parameter of the optimizer gets its segment of the buffer, also one that does not require grad now
    (it may be unfrozen later); plain PyTorch spends nothing on it. Said once, at construction, with the cost."""
    frozen = [(name, group.buffer.numels[index] * group.buffer.data.element_size())
              for group in groups for index, (param, name) in enumerate(zip(group.params, group.names, strict=True))
              if not param.requires_grad]  # fmt: skip
    if frozen:
        mib = sum(size for _, size in frozen) / 2**20
        warnings.warn(
            f"GradAccumulator: {len(frozen)} parameter(s) of the optimizer do not require grad (the first: "
            f"{frozen[0][0]}); their segments of the accumulation buffer, {mib:.1f} MiB, are kept in case they are "
            "unfrozen. Give the optimizer only the trainable parameters to save that memory (then build a new "
            "accumulator to train ones unfrozen later).",
            UserWarning,
            stacklevel=3,
        )


def _checked_on_host(device: torch.device) -> bool:
    """Whether a tensor weight on ``device`` is checked when it is given, where reading it costs no device sync
    (CPU), rather than flagged on the device and checked at the window's end, with the step's one host sync."""
    return device.type == "cpu"


def _no_new_step_arguments(result: Any) -> bool:
    """Whether a step pre-hook's result leaves the inner step's arguments as they were (none): None, or the empty
    ``(args, kwargs)`` it was called with, which a hook written for any optimizer may hand back."""
    if result is None:
        return True
    return (
        isinstance(result, (tuple, list))
        and len(result) == 2
        and isinstance(result[0], (tuple, list))
        and len(result[0]) == 0
        and isinstance(result[1], dict)
        and not result[1]
    )


def _add_note(error: BaseException, note: str) -> None:
    if hasattr(error, "add_note"):
        error.add_note(note)
