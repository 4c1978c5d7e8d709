"""Two gloo ranks on CPU against one float64 process that trains on every rank's data (tests/test_distributed.py).

    python tests/distributed_cases.py OUT.pt      # runs every case on 2 ranks, saves both ranks' results to OUT.pt
    python tests/distributed_cases.py --report    # the same, printed as a table against the float64 truth

Each case trains the same small model for a few windows with unequal token counts across ranks and
micro-batches, a partial last window (``flush()``) and clipping, through one recipe (DDP or FSDP2, either
loop, with or without the user's own ``no_sync()``, counted or driven windows, token weights or losses
normalized over the window), and reports the final parameters, each window's ``grad_norm`` and what went over
the wire. ``truth()`` computes the same training in float64 on one process.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable
from typing import Any

import torch

from casekit import case_script_target, free_port, leave_spawned_rank

WORLD = 2
N = 3  # micro-batches per window
WINDOWS = (3, 3, 2)  # micro-batches run in each window; the last is partial and ends with flush()
LR = 0.1
MAX_NORM = 0.5
BUCKET_BYTES = 256  # several buckets on a 6-parameter model


def window_sums_bytes(params: int, buckets: int) -> int:
    """The float64 all-reduce that ends a window: weight sum, bad-weight flag, micro-step count and its square, the
    settings' two codes and their squares, then one had-gradient flag per parameter and, where gafused reduces
    buckets (DDP; pass 0 for FSDP2), one folded-late flag per bucket."""
    return 8 * (8 + params + buckets)


def make_model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)
    ).to(dtype)


def tokens(rank: int, window: int, micro: int, weighted: bool = True) -> int:
    """Tokens in a micro-batch: unequal across ranks and micro-batches (equal when not ``weighted``)."""
    return 1 + (7 * rank + 3 * window + 5 * micro) % 9 if weighted else 4


def micro_batch(
    rank: int, window: int, micro: int, weighted: bool = True, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + 100 * window + micro)
    n = tokens(rank, window, micro, weighted)
    x = torch.randn(n, 6, generator=generator, dtype=torch.float64)
    y = torch.randn(n, 3, generator=generator, dtype=torch.float64)
    return x.to(dtype), y.to(dtype)


def token_losses(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).sum(-1)


def truth(weighted: bool = True) -> tuple[list[torch.Tensor], list[float], list[torch.Tensor]]:
    """Float64, one process: each window's step on the token-weighted big batch of every rank's micro-batches
    (with ``weighted=False``, the mean of the micro-batch means). Returns final params, norms, initial params."""
    model = make_model(torch.float64)
    initial = [p.detach().clone() for p in model.parameters()]
    norms = []
    for window, count in enumerate(WINDOWS):
        model.zero_grad()
        total = torch.zeros((), dtype=torch.float64)
        weight_sum = 0
        for rank in range(WORLD):
            for micro in range(count):
                x, y = micro_batch(rank, window, micro, weighted, torch.float64)
                per_token = token_losses(model, x, y)
                total = total + (per_token.sum() if weighted else per_token.mean())
                weight_sum += x.shape[0] if weighted else 1
        (total / weight_sum).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        norms.append(float(norm))
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
    return [p.detach().clone() for p in model.parameters()], norms, initial


# --- the ranks ------------------------------------------------------------------------------------------------


class _Wire:
    """Counts the collectives gafused calls (torch.distributed.all_reduce) and their bytes."""

    def __init__(self) -> None:
        self.calls = 0
        self.bytes = 0
        self._all_reduce = None

    def __enter__(self) -> _Wire:
        import torch.distributed as dist

        self._all_reduce = dist.all_reduce

        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            self.bytes += tensor.numel() * tensor.element_size()
            return self._all_reduce(tensor, *args, **kwargs)

        dist.all_reduce = counted
        return self

    def __exit__(self, *exc: object) -> None:
        import torch.distributed as dist

        dist.all_reduce = self._all_reduce


DDP_OWN_ALL_REDUCES = [0]  # bucket all-reduces DDP itself ran (its comm hook counts them)


def _counting_allreduce_hook(state, bucket):  # noqa: ANN001, ANN202 - DDP checks the annotations
    import torch.distributed as dist

    DDP_OWN_ALL_REDUCES[0] += 1
    tensor = bucket.buffer()
    return dist.all_reduce(tensor.div_(WORLD), async_op=True).get_future().then(lambda fut: fut.value()[0])


def _wrap(
    kind: str, rank: int, bucket_view: bool = False, dtype: torch.dtype = torch.float32, mp_policy: Any = None
) -> torch.nn.Module:
    """The model under DDP or FSDP2 (every Linear sharded on its own; ``mp_policy``: FSDP2's MixedPrecisionPolicy)."""
    model = make_model(dtype)
    if kind == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=bucket_view)
        ddp.register_comm_hook(None, _counting_allreduce_hook)
        return ddp
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = {"mp_policy": mp_policy or MixedPrecisionPolicy()}
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=cpu_mesh(), **policy)
    return fully_shard(model, mesh=cpu_mesh(), **policy)


def cpu_mesh() -> Any:
    """The ranks as a CPU device mesh, made once: FSDP2's default mesh is the accelerator's where there is one
    (CUDA on a GPU machine), and these runs keep their models on the CPU under gloo."""
    if _CPU_MESH:
        return _CPU_MESH[0]
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    _CPU_MESH.append(init_device_mesh("cpu", (dist.get_world_size(),)))
    return _CPU_MESH[0]


_CPU_MESH: list[Any] = []


def _resumed_through_dcp(model: torch.nn.Module, opt: Any, build: Callable[[], tuple]) -> tuple:
    """Save model and accumulator with torch.distributed.checkpoint, as FSDP2 users do, and load them into a new
    ``build()`` (DCP fills a template state dict of the new objects in place)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = [tempfile.mkdtemp(prefix="gafused-dcp-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path)
    model_state, optim_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path[0])
    model, opt = build()
    model_state, optim_state = get_state_dict(model, opt)
    loaded = {"model": model_state, "optim": optim_state}
    dcp.load(loaded, checkpoint_id=path[0])
    set_state_dict(model, opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path[0])
    return model, opt


def _full(param: torch.Tensor) -> torch.Tensor:
    return (param.full_tensor() if hasattr(param, "full_tensor") else param).detach().clone()


def run_case(
    rank: int,
    kind: str,
    loop: str,
    no_sync: bool = False,
    weighted: bool = True,
    reduce_dtype: torch.dtype | None = None,
    checkpoint_at: tuple[int, int] | None = None,
    bucket_view: bool = False,
    pass_model: bool = True,
    driven: str | None = None,
    normalization: str = "mean",
    sync_off_once: bool = False,
    built_in_no_sync: bool = False,
    through_dcp: bool = False,
    bucket_bytes: int = BUCKET_BYTES,
    dtype: torch.dtype = torch.float32,
    weight_scale: float = 1.0,
    rank_order: bool = False,
) -> dict[str, Any]:
    """Train WINDOWS on this rank through one recipe; return the final (full) params, norms and wire counts.

    ``checkpoint_at=(window, micro)``: after that micro-batch's step(), every rank saves model, optimizer and
    accumulator state, builds everything anew from it and goes on (``through_dcp``: with
    torch.distributed.checkpoint's ``get_state_dict``, ``save``, ``load`` and ``set_state_dict``, at a window's
    end, after its step). ``driven``: ``accumulation_steps=None``, every window (the partial one too) ended by
    ``end_window=True`` given to the last micro-batch's ``"backward"`` or ``"step"``. ``normalization="sum"``: each
    loss is divided by the window's tokens over every rank and given no weight, as transformers'
    ``num_items_in_batch`` does. ``sync_off_once``: FSDP2's
    ``set_requires_gradient_sync(False)`` once, after building; ``opt.backward()`` turns it on for each window's
    last micro-batch only (``reduce_grads`` in the result: FSDP's flags after each window). ``built_in_no_sync``:
    the accumulator is built inside DDP's ``no_sync()``, whose exit turns DDP's own all-reduce back on.
    ``rank_order``: rank 1's optimizer lists the parameters in reverse order (optimizer groups built from a set of
    names list them in another order on every process); DDP and FSDP2 reduce in the model's order.
    """
    import gafused

    def build(state: dict[str, Any] | None = None) -> tuple[torch.nn.Module, gafused.GradAccumulator]:
        model = _wrap(kind, rank, bucket_view, dtype)
        params = list(model.parameters())
        inner = torch.optim.SGD(params[::-1] if rank_order and rank == 1 else params, lr=LR)
        with model.no_sync() if built_in_no_sync else contextlib.nullcontext():
            opt = gafused.GradAccumulator(
                inner,
                None if driven else N,
                max_grad_norm=MAX_NORM,
                bucket_bytes=bucket_bytes,
                model=model if pass_model else None,
                reduce_dtype=reduce_dtype,
                normalization=normalization,
            )
        if state is not None:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
        if sync_off_once:
            model.set_requires_gradient_sync(False)
        return model, opt

    model, opt = build()
    DDP_OWN_ALL_REDUCES[0] = 0
    norms, wire_per_window, wire_before_last, reduce_grads = [], [], [], []
    wire_at_build = None
    # All-reduces already started when backward reaches the first layer's weight, per micro-batch.
    seen_by_first_layer: list[int] = []
    for window, count in enumerate(WINDOWS):
        with _Wire() as wire:
            window_tokens = sum(tokens(r, window, m, weighted) for r in range(WORLD) for m in range(count))
            first_weight = next(model.parameters())
            probe = first_weight.register_hook(lambda grad: seen_by_first_layer.append(wire.calls))
            for micro in range(count):
                last = micro == count - 1  # the last of a partial window too: FSDP must sync it
                if last and (count == N or driven):
                    wire_before_last.append(wire.calls)
                x, y = micro_batch(rank, window, micro, weighted, dtype)
                weight = x.shape[0] * weight_scale if weighted and normalization == "mean" else None
                end = {"end_window": True} if last and driven else {}
                quiet = (
                    (model.no_sync() if kind == "ddp" else _fsdp_no_sync(model))
                    if no_sync and not last
                    else contextlib.nullcontext()
                )
                with quiet:
                    losses = token_losses(model, x, y)
                    loss = losses.mean() if normalization == "mean" else losses.sum() / window_tokens
                    if loop == "backward":
                        opt.backward(loss, weight=weight, **(end if driven == "backward" else {}))
                    else:
                        loss.backward()
                if loop == "backward":
                    opt.step(**(end if driven == "step" else {}))
                else:
                    opt.step(weight=weight, **end)
                opt.zero_grad()
                if checkpoint_at == (window, micro) and not through_dcp:
                    state = {"model": model.state_dict(), "opt": opt.state_dict()}
                    # The new accumulator's construction check is its own all-reduce, kept out of the window's.
                    before = wire.calls, wire.bytes
                    model, opt = build(state)
                    wire_at_build = wire.calls - before[0], wire.bytes - before[1]
                    wire.calls, wire.bytes = before
            if count < N and not driven:
                wire_before_last.append(wire.calls)
                assert opt.flush()
            probe.remove()
        assert opt.stepped
        norms.append(opt.grad_norm.item())
        wire_per_window.append((wire.calls, wire.bytes))
        if kind == "fsdp":
            reduce_grads.append(_fsdp_reduce_flags(model))
        if through_dcp and checkpoint_at == (window, count - 1):
            model, opt = _resumed_through_dcp(model, opt, build)
    return {
        "params": [_full(p) for p in model.parameters()],
        "norms": norms,
        "wire": wire_per_window,
        "wire_before_last": wire_before_last,
        "wire_at_build": wire_at_build,  # (calls, bytes) of building the accumulator anew mid-window
        # What the construction check compares across ranks.
        "settings": len(opt._settings(reduce_dtype, {id(p): i for i, p in enumerate(model.parameters())})),
        "ddp_own_all_reduces": DDP_OWN_ALL_REDUCES[0],
        "seen_by_first_layer": seen_by_first_layer,
        "buckets": sum(len(buffer.bucket_ranges) for buffer in opt.buffers),
        "managed_params": sum(len(buffer) for buffer in opt.buffers),
        "reduce_grads": reduce_grads,
        "bucket_bytes": sum(buffer.numel * buffer.data.element_size() for buffer in opt.buffers),
    }


def _fsdp_reduce_flags(model: torch.nn.Module) -> list[bool]:
    """The distinct values of FSDP2's per-group gradient sync flag (set by set_requires_gradient_sync)."""
    from torch.distributed.fsdp import FSDPModule

    flags = set()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None)
            for group in groups if groups is not None else [state._fsdp_param_group]:
                if group is not None:
                    flags.add(group.reduce_grads)
    return sorted(flags)


@contextlib.contextmanager
def _fsdp_no_sync(model: torch.nn.Module):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


CASES: dict[str, dict[str, Any]] = {
    "ddp-backward": {"kind": "ddp", "loop": "backward"},
    "ddp-backward-no_sync": {"kind": "ddp", "loop": "backward", "no_sync": True},
    "ddp-step": {"kind": "ddp", "loop": "step"},
    "ddp-step-no_sync": {"kind": "ddp", "loop": "step", "no_sync": True},
    "ddp-backward-bucket_view": {"kind": "ddp", "loop": "backward", "bucket_view": True},
    "ddp-step-bucket_view": {"kind": "ddp", "loop": "step", "bucket_view": True},
    "ddp-backward-bf16": {"kind": "ddp", "loop": "backward", "reduce_dtype": torch.bfloat16},
    "ddp-backward-checkpoint": {"kind": "ddp", "loop": "backward", "checkpoint_at": (1, 0)},
    "ddp-step-checkpoint": {"kind": "ddp", "loop": "step", "checkpoint_at": (1, 1)},
    # Not exact, on purpose: what the same data give without model= (the tests check they are far off).
    "ddp-backward-without-model": {"kind": "ddp", "loop": "backward", "pass_model": False},
    "ddp-backward-no_sync-without-model": {"kind": "ddp", "loop": "backward", "no_sync": True, "pass_model": False},
    "fsdp-backward": {"kind": "fsdp", "loop": "backward"},
    "fsdp-backward-no_sync": {"kind": "fsdp", "loop": "backward", "no_sync": True},
    "fsdp-step-unweighted": {"kind": "fsdp", "loop": "step", "weighted": False},
    # Saved and loaded through torch.distributed.checkpoint at the first window's end (the inner SGD is stateless:
    # DCP steps it with zero gradients there, which must not open a window).
    "fsdp-backward-dcp": {"kind": "fsdp", "loop": "backward", "checkpoint_at": (0, N - 1), "through_dcp": True},
    "ddp-step-dcp": {"kind": "ddp", "loop": "step", "checkpoint_at": (0, N - 1), "through_dcp": True},
    "fsdp-step-unweighted-no_sync": {"kind": "fsdp", "loop": "step", "weighted": False, "no_sync": True},
    # Driven windows: ended by end_window=True, declared before the last backward or only at its step().
    "ddp-backward-driven": {"kind": "ddp", "loop": "backward", "driven": "backward"},
    "ddp-backward-driven-at_step": {"kind": "ddp", "loop": "backward", "driven": "step"},
    "ddp-step-driven": {"kind": "ddp", "loop": "step", "driven": "step"},
    "fsdp-backward-driven-no_sync": {"kind": "fsdp", "loop": "backward", "driven": "backward", "no_sync": True},
    "fsdp-backward-driven-at_step": {"kind": "fsdp", "loop": "backward", "driven": "step"},
    "fsdp-backward-driven-sync_off_once": {
        "kind": "fsdp",
        "loop": "backward",
        "driven": "backward",
        "sync_off_once": True,
    },
    # Losses normalized over the whole window (every rank's tokens), accumulated as a plain sum.
    "ddp-step-built_in_no_sync": {"kind": "ddp", "loop": "step", "built_in_no_sync": True},
    "ddp-backward-built_in_no_sync": {"kind": "ddp", "loop": "backward", "built_in_no_sync": True},
    "ddp-backward-sum": {"kind": "ddp", "loop": "backward", "normalization": "sum"},
    "ddp-step-sum": {"kind": "ddp", "loop": "step", "normalization": "sum"},
    "fsdp-backward-sum": {"kind": "fsdp", "loop": "backward", "normalization": "sum"},
    # A float64 model with weights inexact in float32 (tokens / 10, the same weighted mean): float64 throughout,
    # across ranks too.
    "ddp-backward-f64": {"kind": "ddp", "loop": "backward", "dtype": torch.float64, "weight_scale": 0.1},
    "fsdp-backward-f64": {"kind": "fsdp", "loop": "backward", "dtype": torch.float64, "weight_scale": 0.1},
    # The last layer's shards are 2x8 + 2 on rank 0 and 1x8 + 1 on rank 1: 64-byte buckets cut 3 and 2 of them.
    "fsdp-backward-uneven_buckets": {"kind": "fsdp", "loop": "backward", "bucket_bytes": 64},
    # The ranks' optimizers list the parameters in different orders.
    "ddp-backward-rank_order": {"kind": "ddp", "loop": "backward", "rank_order": True},
    "ddp-step-rank_order": {"kind": "ddp", "loop": "step", "rank_order": True},
    "fsdp-backward-rank_order": {"kind": "fsdp", "loop": "backward", "rank_order": True},
}


# --- models whose gradients arrive irregularly ---------------------------------------------------------------


class Branchy(torch.nn.Module):
    """``inp``, then ``shared`` applied twice (optionally in two reentrant checkpoints, so its gradient lands
    twice in one backward), then ``extra`` where the caller asks for it (only some ranks), then ``out``."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(6, 8)
        self.shared = torch.nn.Linear(8, 8)
        self.extra = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 3)
        self.to(dtype)

    def _block(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.shared(h))

    def forward(self, x: torch.Tensor, use_extra: bool, reentrant: bool) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = torch.tanh(self.inp(x))
        for _ in range(2):
            h = checkpoint(self._block, h, use_reentrant=True) if reentrant else self._block(h)
        if use_extra:
            h = h + torch.tanh(self.extra(h))
        return self.out(h)


# name -> (extra used on which ranks, shared weight under reentrant checkpoints, extra frozen at construction)
IRREGULAR: dict[str, tuple[tuple[int, ...], bool, bool]] = {
    "used on one rank only": ((1,), False, False),
    "shared in two reentrant checkpoints": ((), True, False),
    "unfrozen after construction": ((0, 1), False, True),
}
IRREGULAR_WINDOWS = 2


def irregular_truth(name: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Float64, one process, every rank's micro-batches in one big batch per window: (final, initial) params."""
    extra_on, _, _ = IRREGULAR[name]
    model = Branchy(torch.float64)
    initial = [p.detach().clone() for p in model.parameters()]
    for window in range(IRREGULAR_WINDOWS):
        model.zero_grad()
        total, weight_sum = torch.zeros((), dtype=torch.float64), 0
        for rank in range(WORLD):
            for micro in range(N):
                x, y = micro_batch(rank, window, micro, dtype=torch.float64)
                total = total + ((model(x, rank in extra_on, False) - y) ** 2).sum()
                weight_sum += x.shape[0]
        (total / weight_sum).backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], MAX_NORM)
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= LR * p.grad
    return [p.detach().clone() for p in model.parameters()], initial


def run_irregular(rank: int, name: str, interrupted: bool = False) -> list[torch.Tensor]:
    """DDP + opt.backward() on a Branchy model (buckets of one tensor or so); the final params of this rank.

    ``interrupted``: the first window's last micro-batch runs its backward (buckets on the wire, late parts
    folded), then, instead of its step(), the accumulator is loaded from the checkpoint taken before it and the
    micro-batch runs again: the result must not depend on it.
    """
    import gafused

    extra_on, reentrant, frozen = IRREGULAR[name]
    model = Branchy()
    if frozen:
        model.extra.weight.requires_grad_(False)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = gafused.GradAccumulator(
        torch.optim.SGD(model.parameters(), lr=LR), N, max_grad_norm=MAX_NORM, bucket_bytes=BUCKET_BYTES, model=ddp
    )
    if frozen:  # no gradient hook at construction: the first backward hooks it
        model.extra.weight.requires_grad_(True)
    for window in range(IRREGULAR_WINDOWS):
        for micro in range(N):
            x, y = micro_batch(rank, window, micro)
            if interrupted and (window, micro) == (0, N - 1):
                state = opt.state_dict()
                opt.backward(((ddp(x, rank in extra_on, reentrant) - y) ** 2).sum(-1).mean(), weight=x.shape[0])
                opt.load_state_dict(state)  # over the open micro-batch (zero_grad() would refuse it: it is folded)
            loss = ((ddp(x, rank in extra_on, reentrant) - y) ** 2).sum(-1).mean()
            opt.backward(loss, weight=x.shape[0])
            opt.step()
            opt.zero_grad()
        assert opt.stepped
    return [p.detach().clone() for p in model.parameters()]


# --- a backward that fails alike on every rank (DDP) ----------------------------------------------------------------

DDP_FAILED_MICRO_BATCHES = 4 * N  # then flush()
# name -> the micro-batch (counted from the first) whose backward fails on every rank
DDP_FAILED_BACKWARD = {"a window's middle micro-batch": N + 1, "a window's last micro-batch": 2 * N - 1}


class _Injected(RuntimeError):
    pass


def ddp_failed_backward_truth(name: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Float64, one process: windows of N micro-batches over every rank's data, the failed micro-batch and the
    earlier ones of its window left out (the window is discarded), the next window starting after it; a partial
    last window (flush). Returns (final, initial) params."""
    failed = DDP_FAILED_BACKWARD[name]
    model = make_model(torch.float64)
    initial = [p.detach().clone() for p in model.parameters()]
    windows, window = [], []
    for micro in range(DDP_FAILED_MICRO_BATCHES):
        if micro == failed:
            window = []
            continue
        window.append(micro)
        if len(window) == N:
            windows.append(window)
            window = []
    windows += [window] if window else []
    for window in windows:
        model.zero_grad()
        total, weight_sum = torch.zeros((), dtype=torch.float64), 0
        for rank in range(WORLD):
            for micro in window:
                x, y = micro_batch(rank, 0, micro, dtype=torch.float64)
                total = total + token_losses(model, x, y).sum()
                weight_sum += x.shape[0]
        (total / weight_sum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
    return [p.detach().clone() for p in model.parameters()], initial


def run_ddp_failed_backward(rank: int, name: str) -> dict[str, Any]:
    """DDP + opt.backward() with 256-byte buckets; on every rank the same micro-batch's backward fails at the first
    layer's output (a tensor hook a forward hook registered), after the later layers' buckets were folded and, on a
    window's last micro-batch, their all-reduces launched. The loop catches it, calls zero_grad() and goes on."""
    import gafused

    model = _wrap("ddp", rank)
    opt = gafused.GradAccumulator(
        torch.optim.SGD(model.parameters(), lr=LR), N, max_grad_norm=MAX_NORM, bucket_bytes=BUCKET_BYTES, model=model
    )
    failing = [False]

    def raise_in_backward(grad: torch.Tensor) -> None:
        raise _Injected("backward failed")

    def forward_hook(module: torch.nn.Module, args: Any, output: torch.Tensor) -> None:
        if failing[0]:
            output.register_hook(raise_in_backward)

    model.module[0].register_forward_hook(forward_hook)
    result: dict[str, Any] = {}
    with _Wire() as wire:
        for micro in range(DDP_FAILED_MICRO_BATCHES):
            failing[0] = micro == DDP_FAILED_BACKWARD[name]
            calls = wire.calls
            x, y = micro_batch(rank, 0, micro)
            try:
                opt.backward(token_losses(model, x, y).mean(), weight=x.shape[0])
                opt.step()
                opt.zero_grad()
            except _Injected as error:
                result["said"] = " ".join([str(error), *getattr(error, "__notes__", [])])
                result["micro_step"] = opt.micro_step
                result["all-reduces launched"] = wire.calls - calls
                opt.zero_grad()
        opt.flush()
    result["params"] = [p.detach().clone() for p in model.module.parameters()]
    return result


def run_batchnorm(rank: int, accumulate: str, trace: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """A model with BatchNorm trained for two windows under DDP, by gafused or by plain DDP with ``no_sync()``,
    then one eval forward (where DDP broadcasts rank 0's buffers when due); this rank's running statistics."""
    import gafused

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    inner = torch.optim.SGD(model.parameters(), lr=LR)
    opt = gafused.GradAccumulator(inner, N, model=ddp) if accumulate == "gafused" else None
    for window in range(2):
        for micro in range(N):
            x, y = micro_batch(rank, window, micro)
            x = torch.cat([x, x + 1])  # BatchNorm needs two rows or more
            quiet = ddp.no_sync() if opt is None and micro < N - 1 else contextlib.nullcontext()
            with quiet:
                loss = ((ddp(x) - torch.cat([y, y])) ** 2).mean()
                if trace is not None:  # this rank's statistics after each micro-batch's forward
                    trace.append(model[1].running_mean.clone())
                if opt is not None:
                    opt.backward(loss)
                    opt.step()
                    opt.zero_grad()
                else:
                    (loss / N).backward()
            if opt is None and micro == N - 1:
                inner.step()
                inner.zero_grad()
    ddp.eval()
    with torch.no_grad():
        ddp(micro_batch(rank, 9, 0)[0])
    return [model[1].running_mean.clone(), model[1].running_var.clone()]


def run_fp16_overflow(rank: int) -> dict[str, Any]:
    """FSDP2, fp16 parameters, normalization="sum": a first window whose summed gradient overflows fp16 in rank 0's
    shard only, then a window that fits. Every rank must skip the first (the shards differ, the decision may not)
    and step the second; this rank's shard and counters."""
    from torch.distributed.fsdp import fully_shard

    import gafused

    model = torch.nn.Linear(4, WORLD, bias=False).to(torch.float16)
    with torch.no_grad():
        model.weight.zero_()
    fully_shard(model, mesh=cpu_mesh())
    opt = gafused.GradAccumulator(torch.optim.SGD(model.parameters(), lr=1.0), 2, model=model, normalization="sum")
    x = torch.ones(1, 4, dtype=torch.float16)
    shards = []
    for row_zero in (20000.0, 2.0):  # weight row 0's gradient sums 2 ranks x 2 micro-batches x row_zero
        for _ in range(2):
            coefficients = torch.tensor([[row_zero] + [0.5] * (WORLD - 1)])
            opt.backward((model(x).float() * coefficients).sum())
            opt.step()
            opt.zero_grad()
        shards.append(model.weight.to_local().detach().clone())
    return {"shards": shards, "skipped": opt.skipped_steps, "stepped": opt.stepped}


def _said(
    refused: type[Exception] | tuple[type[Exception], ...], call: Callable[..., object], *args: Any, **kwargs: Any
) -> str:
    """What ``call(*args, **kwargs)`` says: the message of the ``refused`` error it raises, or 'no error'."""
    try:
        call(*args, **kwargs)
    except refused as error:
        return str(error)
    return "no error"


def _misuse(rank: int) -> dict[str, str]:
    """What the accumulator says to recipes it refuses, as (case -> message or 'no error')."""
    import gafused

    said: dict[str, str] = {}
    model = make_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gafused.GradAccumulator(torch.optim.SGD(model.parameters(), lr=LR), N)
    said["no model"] = " | ".join(str(w.message) for w in caught)
    ddp = torch.nn.parallel.DistributedDataParallel(make_model())
    stray = torch.nn.Parameter(torch.zeros(3))
    sgd = torch.optim.SGD([*ddp.parameters(), stray], lr=LR)
    said["stray param"] = _said(ValueError, gafused.GradAccumulator, sgd, N, model=ddp)
    # Refused after the model was looked at: DDP must keep its own synchronization.
    sgd = torch.optim.SGD(ddp.parameters(), lr=LR)
    said["refused construction"] = _said(RuntimeError, gafused.GradAccumulator, sgd, N, model=ddp, backend="cuda")
    said["ddp sync after a refused construction"] = str(ddp.require_backward_grad_sync)
    fsdp = _wrap("fsdp", rank)
    opt = gafused.GradAccumulator(torch.optim.SGD(fsdp.parameters(), lr=LR), N, model=fsdp)
    x, y = micro_batch(rank, 0, 0)
    token_losses(fsdp, x, y).mean().backward()
    said["fsdp step weight"] = _said(ValueError, opt.step, weight=x.shape[0])
    said["fsdp step weight micro_step"] = str(opt.micro_step)
    opt.zero_grad()
    fsdp = _wrap("fsdp", rank)
    opt = gafused.GradAccumulator(torch.optim.SGD(fsdp.parameters(), lr=LR), None, model=fsdp)
    fsdp.set_requires_gradient_sync(False)
    opt.backward(token_losses(fsdp, x, y).mean(), weight=x.shape[0])
    # FSDP held the gradients back and the window's end comes too late to reduce them.
    said["fsdp no_sync end at step"] = _said(RuntimeError, opt.step, end_window=True)
    fsdp.set_requires_gradient_sync(True)
    # Ranks that build their accumulators differently: refused on every rank at construction, naming the setting,
    # before anything is attached (DDP keeps its own synchronization).
    for setting, ranks_values in {
        "max_grad_norm": (1.0, None),
        "bucket_bytes": (BUCKET_BYTES, 4 * BUCKET_BYTES),
        "normalization": ("mean", "sum"),
    }.items():
        sgd = torch.optim.SGD(ddp.parameters(), lr=LR)
        said[f"ddp ranks differ in {setting}"] = _said(
            ValueError, gafused.GradAccumulator, sgd, N, model=ddp, **{setting: ranks_values[rank]}
        )
    said["ddp sync after ranks differ"] = str(ddp.require_backward_grad_sync)
    # Two accumulators over one model whose parameters the ranks split differently (the same shapes): each rank's
    # first one would sum its parameters' gradients with another parameter's on the other rank.
    torch.manual_seed(0)
    twins = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)))
    crossed = list(twins.module[rank].parameters())
    said["ddp ranks cross parameters"] = _said(
        ValueError, gafused.GradAccumulator, torch.optim.SGD(crossed, lr=LR), N, model=twins
    )
    # FSDP2 cuts buckets from each rank's own (uneven) shards: the cuts differ across ranks, and may; clipping may not.
    fsdp = _wrap("fsdp", rank)
    sgd = torch.optim.SGD(fsdp.parameters(), lr=LR)
    try:
        built = gafused.GradAccumulator(sgd, N, model=fsdp, bucket_bytes=BUCKET_BYTES)
        said["fsdp bucket cuts"] = str([[(r.start, r.stop) for r in b.bucket_ranges] for b in built.buffers])
        del built
        gc.collect()
    except ValueError as error:
        said["fsdp bucket cuts"] = str(error)
    said["fsdp ranks differ in max_grad_norm"] = _said(
        ValueError, gafused.GradAccumulator, sgd, N, model=fsdp, max_grad_norm=(None, MAX_NORM)[rank]
    )
    # DDP's join() shadows DDP's collectives only: refused at the first forward under it, on every rank alike.
    joined = torch.nn.parallel.DistributedDataParallel(make_model())
    accumulator = gafused.GradAccumulator(torch.optim.SGD(joined.parameters(), lr=LR), N, model=joined)

    def forward_under_join(module: torch.nn.parallel.DistributedDataParallel) -> None:
        with module.join():
            token_losses(module, x, y)

    said["ddp join"] = _said(RuntimeError, forward_under_join, joined)
    said["ddp join micro_step"] = str(accumulator.micro_step)
    with joined.join(enable=False):  # joins nothing: DDP's own
        said["ddp join disabled"] = "no error"
    accumulator.backward(token_losses(joined, x, y).mean(), weight=x.shape[0])  # the model was left as it was
    accumulator.step()
    said["ddp after join refused micro_step"] = str(accumulator.micro_step)
    del accumulator, joined
    gc.collect()
    accumulator = gafused.GradAccumulator(torch.optim.SGD(ddp.parameters(), lr=LR), N, model=ddp)
    said["ddp sync while the accumulator lives"] = str(ddp.require_backward_grad_sync)
    del accumulator
    gc.collect()
    said["ddp sync after the accumulator is dropped"] = str(ddp.require_backward_grad_sync)
    # Ranks that end a window at different micro-steps (rank 0 after one, rank 1 after two): every rank raises,
    # naming its own count, and discards its window.
    opt = gafused.GradAccumulator(torch.optim.SGD(ddp.parameters(), lr=LR), None, model=ddp)

    def end_apart(opt: gafused.GradAccumulator) -> None:
        for micro in range(rank + 1):
            opt.backward(token_losses(ddp, x, y).mean(), weight=x.shape[0], end_window=micro == rank)
            opt.step()

    said["window ends apart"] = _said(RuntimeError, end_apart, opt)
    said["window ends apart micro_step"] = str(opt.micro_step)
    opt.zero_grad()
    # flush() refused on rank 1 alone (a stray loss.backward() left gradients no step() folded): every rank raises,
    # none waits for the others, nothing changed, and once rank 1 drops them every rank flushes alike.
    opt = gafused.GradAccumulator(torch.optim.SGD(ddp.parameters(), lr=LR), N, model=ddp)
    opt.backward(token_losses(ddp, x, y).mean(), weight=x.shape[0])
    opt.step()
    if rank == 1:
        token_losses(ddp, x, y).mean().backward()
    said["flush refused on one rank"] = _said(RuntimeError, opt.flush)
    said["flush refused on one rank micro_step"] = str(opt.micro_step)
    opt.zero_grad()
    said["flush after the refusal"] = str(opt.flush())
    # The same when rank 1's refusal is a backward() without its step(): checked before the collective too.
    opt = gafused.GradAccumulator(torch.optim.SGD(ddp.parameters(), lr=LR), None, model=ddp)
    opt.backward(token_losses(ddp, x, y).mean(), weight=x.shape[0])
    opt.step()
    if rank == 1:
        opt.backward(token_losses(ddp, x, y).mean(), weight=x.shape[0])
    said["flush with a backward() awaiting step()"] = _said(RuntimeError, opt.flush)
    said["flush with a backward() awaiting step() micro_step"] = str(opt.micro_step)
    if rank == 1:
        opt.step()  # ends the micro-batch awaiting it (zero_grad() refuses a window's later micro-batch)
    del opt
    gc.collect()
    # max_grad_norm changed on rank 1 alone mid-window: at the window's end every rank raises, flush() changing
    # nothing, a step() discarding the window; set alike again, the next window steps.
    opt = gafused.GradAccumulator(torch.optim.SGD(ddp.parameters(), lr=LR), 2, model=ddp, max_grad_norm=MAX_NORM)

    def micro_step(opt: gafused.GradAccumulator) -> None:
        opt.backward(token_losses(ddp, x, y).mean(), weight=x.shape[0])
        opt.step()

    micro_step(opt)
    if rank == 1:
        opt.max_grad_norm = 2 * MAX_NORM
    said["flush with settings apart"] = _said(RuntimeError, opt.flush)
    said["flush with settings apart micro_step"] = str(opt.micro_step)
    said["window end with settings apart"] = _said(RuntimeError, micro_step, opt)
    said["window end with settings apart micro_step"] = str(opt.micro_step)
    opt.max_grad_norm = MAX_NORM
    micro_step(opt)
    micro_step(opt)
    said["settings alike again"] = str(opt.stepped)
    # 6.95 and 0.5 share the first settings code (one 12-bit code let them pass); the second tells them apart.
    micro_step(opt)
    opt.max_grad_norm = 6.95 if rank == 1 else 0.5
    said["window end with colliding first codes"] = _said(RuntimeError, micro_step, opt)
    # A second backward() on a window's last micro-batch, on every rank: its first was reduced already, so the
    # window is discarded; the next one steps.
    opt.max_grad_norm = MAX_NORM
    micro_step(opt)
    losses = token_losses(ddp, x, y)
    opt.backward(losses[:1].sum() / x.shape[0], weight=x.shape[0], retain_graph=True)
    said["second backward on the last micro-batch"] = _said(RuntimeError, opt.backward, losses[1:].sum() / x.shape[0])
    said["second backward on the last micro-batch micro_step"] = str(opt.micro_step)
    micro_step(opt)
    micro_step(opt)
    said["window after the second backward"] = str(opt.stepped)
    del opt
    gc.collect()
    # A mid-window checkpoint holds this rank's part: loading another rank's is refused.
    opt = gafused.GradAccumulator(torch.optim.SGD(ddp.parameters(), lr=LR), N, model=ddp)
    opt.backward(token_losses(ddp, x, y).mean(), weight=x.shape[0])
    opt.step()
    state = opt.state_dict()
    said["checkpoint rank"] = str(state["gafused"]["rank"])
    state["gafused"]["rank"] = 1 - rank
    said["other rank's checkpoint"] = _said(ValueError, opt.load_state_dict, state)
    opt.zero_grad()
    del opt
    said.update(_fsdp_weight_cases(rank, x, y))
    said.update(_fsdp_sync_off_cases(rank))
    said.update(_fsdp_zero_grad_after_a_load(rank))
    said.update(_ddp_split_cases(rank))
    said.update(_split_backward_cases(rank))
    said.update(_fsdp_split_own_losses(rank))
    said.update(_split_left_out_micro_batch(rank))
    said.update(_fsdp_sync_off_auxiliary_loss(rank))
    said.update(_fsdp_split_untouched_gradients(rank))
    said.update(_ddp_dropped_inside_no_sync(rank))
    said.update(_fsdp_failed_backward_over_held_gradients(rank))
    said.update(_fsdp_plain_backward_failed(rank))
    said.update(_window_end_failed_on_one_rank(rank))
    return said


def _window_end_failed_on_one_rank(rank: int) -> dict[str, str]:
    """A step pre-hook raises on rank 0 alone at the first window's end, after its collectives: rank 0 discards the
    window, rank 1 steps, and the loop goes on. The replicas are apart: the next window's end says so on every rank
    (they ended different numbers of windows), where it used to step on with no error."""
    import gafused

    said: dict[str, str] = {}
    window = [0]

    def pre_hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        if rank == 0 and window[0] == 0:
            raise RuntimeError("pre-hook failed")

    for kind in ("ddp", "fsdp"):
        model = _wrap(kind, rank)
        opt = gafused.GradAccumulator(torch.optim.SGD(model.parameters(), lr=LR), N, model=model)
        opt.register_step_pre_hook(pre_hook)
        for window[0] in range(2):
            for micro in range(N):
                x, y = micro_batch(rank, window[0], micro)
                opt.backward(token_losses(model, x, y).mean(), weight=x.shape[0])
                message = _said(RuntimeError, opt.step)
                if message != "no error":
                    said[f"{kind} window end failed on one rank, window {window[0]}"] = message
                opt.zero_grad()
        said[f"{kind} window end failed on one rank, micro_step"] = str(opt.micro_step)
        del opt
        gc.collect()
    return said


def _fsdp_plain_backward_failed(rank: int) -> dict[str, str]:
    """A plain loss.backward() fails on every rank after FSDP2 reduced the two later layers, and the loop drops its
    gradients with zero_grad(): FSDP is left mid-backward (it would neither reduce nor reshard again), so the next
    backward() and step() refuse, naming reset_iter_state(); after it a micro-batch goes through."""
    import gafused

    def explode(grad: torch.Tensor) -> None:
        raise RuntimeError("hook failed")

    model = _wrap("fsdp", rank)
    opt = gafused.GradAccumulator(torch.optim.SGD(model.parameters(), lr=LR), N, model=model)
    x, y = micro_batch(rank, 0, 0)
    handle = model[1].register_forward_hook(lambda module, args, out: [out.register_hook(explode)] and None)
    try:
        loss = token_losses(model, x, y).mean()
    finally:
        handle.remove()
    said = {"fsdp plain backward failed": _said(RuntimeError, loss.backward)}
    opt.zero_grad()
    said["fsdp plain backward failed, then backward()"] = _said(
        RuntimeError, opt.backward, token_losses(model, x, y).mean(), weight=x.shape[0]
    )
    said["fsdp plain backward failed, then step()"] = _said(RuntimeError, opt.step)
    model.reset_iter_state()
    said["fsdp plain backward failed, after the reset"] = _said(
        RuntimeError, opt.backward, token_losses(model, x, y).mean(), weight=x.shape[0]
    )
    said["fsdp plain backward failed, micro_step"] = str(opt.micro_step)
    return said


def _fsdp_failed_backward_over_held_gradients(rank: int) -> dict[str, str]:
    """FSDP2 adds a later backward's reduced gradient into the ``_local_tensor`` of the one a plain loss.backward()
    left, which leaves the DTensor's own version counter as it was. A backward(loss) failing after the last two
    layers were reduced discards the window, as on every rank failing there (some may have folded a bucket of their
    shards): every held gradient goes, the four half-updated ones with the first layer's."""
    import gafused

    def explode(grad: torch.Tensor) -> None:
        raise RuntimeError("hook failed")

    model = _wrap("fsdp", rank)
    opt = gafused.GradAccumulator(torch.optim.SGD(model.parameters(), lr=LR), N, model=model)
    x, y = micro_batch(rank, 0, 0)
    token_losses(model, x, y).mean().backward()
    held = [param.grad.to_local().clone() for param in model.parameters()]
    # The first layer's output gradient arrives after FSDP reduced the two later layers' gradients.
    handle = model[1].register_forward_hook(lambda module, args, out: [out.register_hook(explode)] and None)
    try:
        loss = token_losses(model, x, y).mean()
    finally:
        handle.remove()
    said = {"fsdp failed backward over held gradients": "no error"}
    try:
        opt.backward(loss, weight=1)
    except RuntimeError as error:
        said["fsdp failed backward over held gradients"] = " ".join([str(error), *getattr(error, "__notes__", [])])
    kept = [
        "dropped" if param.grad is None else str(torch.equal(param.grad.to_local(), grad))
        for param, grad in zip(model.parameters(), held, strict=True)
    ]
    said["fsdp failed backward over held gradients kept"] = " ".join(kept)
    said["fsdp failed backward over held gradients micro_step"] = str(opt.micro_step)
    return said


def _split_backward_cases(rank: int) -> dict[str, str]:
    """Two accumulators over one model (Muon and AdamW, say) in the backward loop: the first's backward(loss,
    weight=w) gives the second's parameters their gradients, so the second's step() takes the same weight, which
    under FSDP2 is in those gradients already (the loss was multiplied by it): counted, not applied again. Without
    it, that step() is refused, nothing changed (FSDP2 counted it 1: the window was off by the ratio of token counts
    to micro-batches). Either equals one accumulator over the whole model, bitwise; also under FSDP2 with its
    gradient sync off for the early micro-batches, whose gradients FSDP holds unreduced (no p.grad shows them)."""
    import gafused

    said: dict[str, str] = {}
    fraction = [0.0]

    def window(opts: list[gafused.GradAccumulator], model: torch.nn.Module, kind: str) -> None:
        first, *rest = opts
        for micro in range(N):
            x, y = micro_batch(rank, 0, micro)
            first.backward(token_losses(model, x, y).mean(), weight=x.shape[0] + fraction[0])
            first.step()
            for opt in rest:
                if micro == 1:
                    said[f"{kind} split step without the weight"] = _said(ValueError, opt.step)
                    said[f"{kind} split step without the weight micro_step"] = str(opt.micro_step)
                opt.step(weight=x.shape[0] + fraction[0])
            for opt in opts:
                opt.zero_grad()

    for case in ("ddp", "fsdp", "fsdp sync off", "fsdp fractional"):
        kind = case.split()[0]
        fraction[0] = 0.1 if case.endswith("fractional") else 0.0  # a weight float32 (the loss) rounds
        whole, two = _wrap(kind, rank), _wrap(kind, rank)
        if case == "fsdp sync off":  # opt.backward() turns it on for the window's last micro-batch
            whole.set_requires_gradient_sync(False)
            two.set_requires_gradient_sync(False)
        window([gafused.GradAccumulator(torch.optim.SGD(whole.parameters(), lr=LR), N, model=whole)], whole, case)
        params = list(two.parameters())
        parts = (params[:2], params[2:])
        window([gafused.GradAccumulator(torch.optim.SGD(part, lr=LR), N, model=two) for part in parts], two, case)
        equal = all(torch.equal(_full(a), _full(b)) for a, b in zip(two.parameters(), whole.parameters(), strict=True))
        said[f"{case} split backward equals one"] = str(equal)
        gc.collect()
    return said


def _fsdp_split_own_losses(rank: int) -> dict[str, str]:
    """Two accumulators over one FSDP2 model, its gradient sync off for the early micro-batches, each with its own
    backward(loss, weight=w) of a loss that reaches its own parameters alone, at different weights. What FSDP holds
    unreduced of the first's parameters is none of the second's: its step() was refused as if the first's backward
    had given it gradients. Each equals an accumulator run alone over its parameters, bitwise."""
    import gafused

    finished = []
    for which in ("both", "first", "second"):
        model = _wrap("fsdp", rank)
        model.set_requires_gradient_sync(False)  # opt.backward() turns it on for the window's last micro-batch
        params = list(model.parameters())
        parts = {"first": params[:2], "second": params[2:]}
        opts = {
            name: gafused.GradAccumulator(torch.optim.SGD(part, lr=LR), N, model=model)
            for name, part in parts.items()
            if which in ("both", name)
        }
        for micro in range(N):  # one window: the first layer's step comes after every micro-batch's losses
            x, _ = micro_batch(rank, 0, micro)
            losses = dict(zip(("first", "second"), _own_losses(model, x), strict=True))
            weights = {"first": x.shape[0], "second": x.shape[0] + 1 + micro}  # never equal: every rank alike
            for name, opt in opts.items():
                opt.backward(losses[name], weight=weights[name])
            for opt in opts.values():
                said_step = _said(ValueError, opt.step)
                if said_step != "no error":
                    return {"fsdp sync off split own losses": said_step}
        finished.append({name: [_full(param) for param in part] for name, part in parts.items()})
        gc.collect()
    both, alone = finished[0], {name: finished[index + 1][name] for index, name in enumerate(("first", "second"))}
    equal = all(all(map(torch.equal, both[name], alone[name])) for name in ("first", "second"))
    moved = all(not torch.equal(a, b) for a, b in zip(both["second"], finished[1]["second"], strict=True))
    return {"fsdp sync off split own losses": str(equal and moved)}


def _split_left_out_micro_batch(rank: int) -> dict[str, str]:
    """Two accumulators over one model: the second leaves a micro-batch out without zero_grad(), so the first's next
    backward adds into what its last gave the second's parameters. FSDP2 adds into the DTensor gradient's local
    tensor, which left the DTensor's version as it was: the record kept the first micro-batch's weight and
    step(weight=5) was taken for two micro-batches. Refused at every weight, on every rank (the ranks' weights
    differ), nothing changed."""
    import gafused

    said: dict[str, str] = {}
    for kind in ("ddp", "fsdp"):
        model = _wrap(kind, rank)
        params = list(model.parameters())
        first = gafused.GradAccumulator(torch.optim.SGD(params[:2], lr=LR), N, model=model)
        second = gafused.GradAccumulator(torch.optim.SGD(params[2:], lr=LR), N, model=model)
        weights = (5, 5 + rank)  # equal on rank 0, not on rank 1: every rank must decide alike
        for micro, weight in enumerate(weights):
            x, y = micro_batch(rank, 0, micro)
            first.backward(token_losses(model, x, y).mean(), weight=weight)
            first.step()
        for weight in sorted(set(weights)) + [None]:
            said[f"{kind} left-out micro-batch step({weight})"] = _said(ValueError, second.step, weight=weight)
        said[f"{kind} left-out micro-batch micro_step"] = str(second.micro_step)
        del first, second
        gc.collect()
    return said


def _fsdp_sync_off_auxiliary_loss(rank: int) -> dict[str, str]:
    """FSDP2, its sync off: the first accumulator's backward(loss, weight=w) reaches the second's middle layer, then a
    plain backward of an auxiliary loss adds gradients of its last layer too. FSDP now held more than that backward
    left, so the record was taken for gone: step() counted the micro-batch 1 and step(weight=w) was refused."""
    import gafused

    model = _wrap("fsdp", rank)
    model.set_requires_gradient_sync(False)
    params = list(model.parameters())
    first = gafused.GradAccumulator(torch.optim.SGD(params[:2], lr=LR), N, model=model)
    second = gafused.GradAccumulator(torch.optim.SGD(params[2:], lr=LR), N, model=model)
    x, _ = micro_batch(rank, 0, 0)
    first.backward(model[2](torch.tanh(model[0](x))).square().mean(), weight=x.shape[0])
    first.step()
    with torch.no_grad():
        hidden = torch.tanh(model[0](x))
    (0.1 * model[4](torch.tanh(model[2](hidden))).abs().mean()).backward()
    said = {"fsdp sync off auxiliary loss step()": _said(ValueError, second.step)}
    said["fsdp sync off auxiliary loss step(weight)"] = _said(ValueError, second.step, weight=x.shape[0])
    said["fsdp sync off auxiliary loss micro_step"] = str(second.micro_step)
    return said


def _fsdp_split_untouched_gradients(rank: int) -> dict[str, str]:
    """FSDP2, two accumulators over one model: the second's p.grad from its own loss.backward(), then the first's
    backward(loss, weight=w) of a loss that reaches the first layer alone gave the second nothing, so its step()
    counts its own backward, unweighted (1). A DTensor gradient's version is its local tensor's: read from the
    wrapper before that backward and from the local tensor after it (or the other way round), the untouched
    gradients looked changed and the step() was refused."""
    import gafused

    model = _wrap("fsdp", rank)
    params = list(model.parameters())
    first = gafused.GradAccumulator(torch.optim.SGD(params[:2], lr=LR), N, model=model)
    second = gafused.GradAccumulator(torch.optim.SGD(params[2:], lr=LR), N, model=model)
    x, _ = micro_batch(rank, 0, 0)
    first_loss, second_loss = _own_losses(model, x)
    second_loss.backward()
    first.backward(first_loss, weight=x.shape[0])
    first.step()
    said = {"fsdp split untouched gradients step()": _said(ValueError, second.step)}
    said["fsdp split untouched gradients micro_step"] = str(second.micro_step)
    del first, second
    gc.collect()
    return said


def _own_losses(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two losses over one model: the first reaches the first layer alone, the second the two later layers alone."""
    with torch.no_grad():
        hidden = torch.tanh(model[0](x))
    return model[0](x).square().mean(), model[4](torch.tanh(model[2](hidden))).square().mean()


SYNC_OFF_RECORDS = {
    # Two accumulators over one loss (the first layer, the rest): the first's backward(loss, weight=w) of a window's
    # first micro-batch is dropped by zero_grad(), and that micro-batch is run again by loss.backward() (counted 1).
    "split, a dropped micro-batch run again unweighted": "split",
    # Each accumulator its own loss and weights: the first drops its first micro-batch (zero_grad() after its
    # backward) and runs it again, while the second keeps its own, which FSDP holds unreduced meanwhile.
    "own losses, the first drops its first micro-batch": "own",
    # One accumulator whose weight is a CPU tensor the loop refills with the next count before step().
    "one accumulator, a CPU weight tensor refilled before step()": "one",
}


def sync_off_records_weights(case: str, rank: int, micro: int) -> tuple[float, float]:
    """The weights a SYNC_OFF_RECORDS case counts for a rank's micro-batch: the first accumulator's, the second's."""
    count = float(tokens(rank, 0, micro))
    kind = SYNC_OFF_RECORDS[case]
    if kind == "split":
        return (1.0, 1.0) if micro == 0 else (count, count)
    if kind == "own":
        return count, count + 1 + micro
    return count, count


def sync_off_records_truth(case: str) -> list[torch.Tensor]:
    """Float64, one process: the one window of a SYNC_OFF_RECORDS case over every rank's micro-batches (weighted
    means; with own losses, each layer's own loss alone)."""
    model = make_model(torch.float64)
    own = SYNC_OFF_RECORDS[case] == "own"
    totals = [torch.zeros((), dtype=torch.float64) for _ in range(2)]
    sums = [0.0, 0.0]
    for rank in range(WORLD):
        for micro in range(N):
            x, y = micro_batch(rank, 0, micro, dtype=torch.float64)
            losses = _own_losses(model, x) if own else (token_losses(model, x, y).mean(),) * 2
            for index, weight in enumerate(sync_off_records_weights(case, rank, micro)):
                totals[index] = totals[index] + weight * losses[index]
                sums[index] += weight
    (totals[0] / sums[0] + totals[1] / sums[1] if own else totals[0] / sums[0]).backward()
    with torch.no_grad():
        for param in model.parameters():
            param -= LR * param.grad
    return [param.detach().clone() for param in model.parameters()]


def run_sync_off_records(rank: int, case: str) -> dict[str, Any]:
    """One window of N micro-batches under FSDP2 with its gradient sync off but for the last (opt.backward() turns it
    on there; the unweighted loss.backward() of the split case comes first): what each step() and zero_grad() said,
    and the final (full) parameters."""
    import gafused

    kind = SYNC_OFF_RECORDS[case]
    model = _wrap("fsdp", rank)
    model.set_requires_gradient_sync(False)
    params = list(model.parameters())
    parts = [params] if kind == "one" else [params[:2], params[2:]]
    opts = [gafused.GradAccumulator(torch.optim.SGD(part, lr=LR), N, model=model) for part in parts]
    said: dict[str, str] = {}

    def said_by(name: str, call: Callable[..., object], *args: Any, **kwargs: Any) -> None:
        said[name] = _said((ValueError, RuntimeError), call, *args, **kwargs)

    if kind == "split":
        x, y = micro_batch(rank, 1, 0)
        opts[0].backward(token_losses(model, x, y).mean(), weight=x.shape[0] + 100)
        for index, opt in enumerate(opts):
            said_by(f"zero_grad {index} of the dropped micro-batch", opt.zero_grad)
    count = torch.tensor(0.0)
    for micro in range(N):
        x, y = micro_batch(rank, 0, micro)
        first, second = sync_off_records_weights(case, rank, micro)
        if kind == "split":
            loss = token_losses(model, x, y).mean()
            if micro == 0:
                loss.backward()
            else:
                opts[0].backward(loss, weight=first)
            said_by(f"step 0 of {micro}", opts[0].step)
            said_by(f"step 1 of {micro}", opts[1].step, **({} if micro == 0 else {"weight": second}))
        elif kind == "own":
            losses = _own_losses(model, x)
            opts[1].backward(losses[1], weight=second)
            if micro == 0:
                opts[0].backward(losses[0], weight=first + 100)
                said_by("zero_grad 0 of the dropped micro-batch", opts[0].zero_grad)
                losses = _own_losses(model, x)
            opts[0].backward(losses[0], weight=first)
            for index, opt in enumerate(opts):
                said_by(f"step {index} of {micro}", opt.step)
        else:
            count.fill_(first)
            opts[0].backward(token_losses(model, x, y).mean(), weight=count)
            if micro + 1 < N:
                count.fill_(sync_off_records_weights(case, rank, micro + 1)[0])  # the next micro-batch's count
            said_by(f"step 0 of {micro}", opts[0].step)
        for opt in opts:
            opt.zero_grad()
    return {"said": said, "stepped": [opt.stepped for opt in opts], "params": [_full(param) for param in params]}


WAY_OUT_WINDOWS = 3  # the first window's conflict, then two windows run through


def _split_over_fsdp(
    rank: int, sync_off: bool
) -> tuple[torch.nn.Module, list[torch.Tensor], list[Any], list[dict[str, Any]]]:
    """An FSDP2 model with two accumulators over it (the first layer, the rest), and the state_dict() each gave
    before the first window."""
    import gafused

    model = _wrap("fsdp", rank)
    if sync_off:
        model.set_requires_gradient_sync(False)
    params = list(model.parameters())
    opts = [gafused.GradAccumulator(torch.optim.SGD(part, lr=LR), N, model=model) for part in (params[:2], params[2:])]
    return model, params, opts, [opt.state_dict() for opt in opts]


def run_sync_off_way_out(rank: int) -> dict[str, Any]:
    """FSDP2, its sync off, two accumulators over one loss (the first layer, the rest): the second steps the first
    micro-batch, then misses the second's step(), so the third leaves two micro-batches in what FSDP holds of its
    parameters. Nothing counts them as one; the way out is loading both accumulators with the state_dict() each gave
    between windows, before the first's step() ends its window. Then two windows run through."""
    model, params, opts, saved = _split_over_fsdp(rank, sync_off=True)
    first, second = opts
    said: dict[str, str] = {}
    for window in range(WAY_OUT_WINDOWS):
        for micro in range(N):
            x, y = micro_batch(rank, window, micro)
            first.backward(token_losses(model, x, y).mean(), weight=x.shape[0])
            if window == 0 and micro == N - 1:
                said["conflict step"] = _said(ValueError, second.step, weight=x.shape[0])
                said["conflict zero_grad"] = _said(RuntimeError, second.zero_grad)
                for opt, state in zip(opts, saved, strict=True):
                    said["load"] = _said(ValueError, opt.load_state_dict, state)
                said["micro_steps after the load"] = str([opt.micro_step for opt in opts])
                continue
            first.step()
            if window > 0 or micro == 0:
                said[f"step {window} {micro}"] = _said((ValueError, RuntimeError), second.step, weight=x.shape[0])
    return {"said": said, "stepped": [opt.stepped for opt in opts], "params": [_full(param) for param in params]}


def dropped_first_window_truth(dropped: bool = True) -> list[torch.Tensor]:
    """Float64, one process, ``WAY_OUT_WINDOWS`` windows of ``N``: the first window is dropped (unless not
    ``dropped``); the others step every layer."""
    model = make_model(torch.float64)
    for window in range(WAY_OUT_WINDOWS):
        total, weight_sum = torch.zeros((), dtype=torch.float64), 0.0
        for rank in range(WORLD):
            for micro in range(N):
                x, y = micro_batch(rank, window, micro, dtype=torch.float64)
                total = total + x.shape[0] * token_losses(model, x, y).mean()
                weight_sum += x.shape[0]
        if window == 0 and dropped:
            continue
        model.zero_grad()
        (total / weight_sum).backward()
        with torch.no_grad():
            for param in model.parameters():
                param -= LR * param.grad
    return [param.detach().clone() for param in model.parameters()]


def run_failed_backward(rank: int, sync_off: bool, last_layer_input: bool = False) -> dict[str, Any]:
    """FSDP2: the first window's second backward fails on every rank at one point (a hook on the first layer's output
    gradient raises, after FSDP reduced the two later layers' gradients; with ``sync_off``, after FSDP added them to
    what it holds unreduced of the first micro-batch). Each rank cuts its buckets from its own shards, so one rank
    had folded a bucket by then and the other had not: both discard the window. Until the loop calls FSDP's
    reset_iter_state(), backward() and step() refuse; after it, the loop starts the next window and two windows run
    through on every rank. With ``last_layer_input``, the hook is on the last layer's input gradient instead: it
    raises after autograd gave that layer's unsharded parameters their gradients and before FSDP reduced them (its
    sync on, FSDP held nothing as the call began), so nothing reached the buffers and FSDP holds the failed call's
    gradients unreduced: the window is discarded all the same, with what FSDP holds."""
    import gafused

    def explode(grad: torch.Tensor) -> None:
        raise RuntimeError("bad batch")

    model = _wrap("fsdp", rank)
    if sync_off:
        model.set_requires_gradient_sync(False)
    opt = gafused.GradAccumulator(torch.optim.SGD(model.parameters(), lr=LR), N, bucket_bytes=BUCKET_BYTES, model=model)
    failing = [False]

    def arm(module: torch.nn.Module, args: Any, out: torch.Tensor) -> None:
        if failing[0]:
            out.register_hook(explode)

    def arm_input(module: torch.nn.Module, args: Any) -> None:
        if failing[0]:
            args[0].register_hook(explode)

    if last_layer_input:
        model[4].register_forward_pre_hook(arm_input)
    else:
        model[0].register_forward_hook(arm)
    said: dict[str, str] = {}
    for window in range(WAY_OUT_WINDOWS):
        for micro in range(N):
            x, y = micro_batch(rank, window, micro)
            failing[0] = (window, micro) == (0, 1)
            loss = token_losses(model, x, y).mean()
            try:
                opt.backward(loss, weight=x.shape[0])
                failed = "no error"
            except RuntimeError as error:
                failed = " ".join([str(error), *getattr(error, "__notes__", [])])
            if failing[0]:
                said["failed"] = failed
                said["micro_step after the failure"] = str(opt.micro_step)
                said["unreduced after the failure"] = str(opt._sync.holds_unreduced())
                x, y = micro_batch(rank, window, micro + 1)
                said["before the reset: backward"] = _said(
                    RuntimeError, opt.backward, token_losses(model, x, y).mean(), weight=x.shape[0]
                )
                said["before the reset: step"] = _said(RuntimeError, opt.step)
                model.reset_iter_state()
                break  # the window is gone: the loop starts the next one
            said[f"backward {window} {micro}"] = failed
            said[f"step {window} {micro}"] = _said(RuntimeError, opt.step)
            opt.zero_grad()
    return {"said": said, "stepped": opt.stepped, "params": [_full(param) for param in model.parameters()]}


def run_split_failed_backward(rank: int, sync_off: bool, failing_micro: int = 1) -> dict[str, Any]:
    """FSDP2, two accumulators over one loss (the first layer, the rest), the second stepped with the first's weight:
    the first's backward of the first window's second micro-batch fails on every rank after FSDP reduced the later
    layers' gradients into the second's ``p.grad`` (its sync on) or added them to what it holds unreduced of the
    first micro-batch (sync off), before the first layer's: the first keeps its window. The gradients it gave the
    second are put back (none), and after FSDP's reset_iter_state() the micro-batch runs again and the windows go
    on. What FSDP holds unreduced cannot be put back: the second's step() refuses it, and both accumulators leave
    the window by loading the state_dict() each gave before it; two windows then run through. With ``failing_micro``
    the window's last (sync off): the wrapper turns FSDP's sync on for it, and FSDP reduces what it held of the
    earlier micro-batches into the second's ``p.grad`` with the failed call's part; those stay, refused alike."""

    def explode(grad: torch.Tensor) -> None:
        raise RuntimeError("bad batch")

    failing = [False]

    def arm(module: torch.nn.Module, args: Any, out: torch.Tensor) -> None:
        if failing[0]:
            out.register_hook(explode)

    model, params, opts, saved = _split_over_fsdp(rank, sync_off)
    model[0].register_forward_hook(arm)
    first, second = opts
    said: dict[str, str] = {}
    for window in range(WAY_OUT_WINDOWS):
        for micro in range(N):
            x, y = micro_batch(rank, window, micro)
            failing[0] = (window, micro) == (0, failing_micro)
            if failing[0]:
                try:
                    first.backward(token_losses(model, x, y).mean(), weight=x.shape[0])
                    said["failed"] = "no error"
                except RuntimeError as error:
                    said["failed"] = " ".join([str(error), *getattr(error, "__notes__", [])])
                said["second's gradients after the failure"] = str([param.grad is not None for param in params[2:]])
                said["micro_steps after the failure"] = str([opt.micro_step for opt in opts])
                model.reset_iter_state()
                failing[0] = False
                if sync_off:
                    said["second step after the failure"] = _said(RuntimeError, second.step, weight=x.shape[0])
                    for opt, state in zip(opts, saved, strict=True):
                        opt.load_state_dict(state)
                    break  # the window is gone: the loop starts the next one
            first.backward(token_losses(model, x, y).mean(), weight=x.shape[0])
            first.step()
            said[f"step {window} {micro}"] = _said((ValueError, RuntimeError), second.step, weight=x.shape[0])
    return {"said": said, "stepped": [opt.stepped for opt in opts], "params": [_full(param) for param in params]}


def run_split_failed_before_fsdp_held_more(rank: int) -> dict[str, Any]:
    """FSDP2, its sync off, two accumulators over one loss (the first layer, the rest): the first's backward of the
    first window's second micro-batch fails on every rank in a hook on the loss, before FSDP added anything to what
    it holds unreduced of the second's parameters (the first micro-batch's, counted by the second's step()). Nothing
    of the failed call is in them: the second keeps no record of it, the micro-batch runs again and the windows go
    on as if nothing failed."""

    def explode(grad: torch.Tensor) -> None:
        raise RuntimeError("bad batch")

    model, params, opts, _ = _split_over_fsdp(rank, sync_off=True)
    first, second = opts
    said: dict[str, str] = {}
    for window in range(WAY_OUT_WINDOWS):
        for micro in range(N):
            x, y = micro_batch(rank, window, micro)
            if (window, micro) == (0, 1):
                loss = token_losses(model, x, y).mean()
                loss.register_hook(explode)
                said["failed"] = _said(RuntimeError, first.backward, loss, weight=x.shape[0])
                said["second's record after the failure"] = str(second._weighted_elsewhere is not None)
            first.backward(token_losses(model, x, y).mean(), weight=x.shape[0])
            first.step()
            said[f"step {window} {micro}"] = _said((ValueError, RuntimeError), second.step, weight=x.shape[0])
    return {"said": said, "stepped": [opt.stepped for opt in opts], "params": [_full(param) for param in params]}


def run_failed_before_fsdp_held_more(rank: int, how: str) -> dict[str, Any]:
    """FSDP2, its sync off: the first window's second backward() fails on every rank before FSDP added anything of
    it to the first micro-batch's gradients it holds unreduced: a Ctrl-C before autograd ran (as the wrapper's sync
    setting is read: ``how="interrupt"``), or a hook on the loss, the first thing autograd runs (``how="loss
    hook"``). The window is kept (``micro_step`` 1, what FSDP holds with it), and retrying the micro-batch trains
    bitwise as a run where nothing failed."""
    import gafused

    def explode(grad: torch.Tensor) -> None:
        raise KeyboardInterrupt

    said: dict[str, str] = {}
    runs = []
    for failing in (False, True):
        model = _wrap("fsdp", rank)
        model.set_requires_gradient_sync(False)
        opt = gafused.GradAccumulator(
            torch.optim.SGD(model.parameters(), lr=LR), N, bucket_bytes=BUCKET_BYTES, model=model
        )
        for window in range(WAY_OUT_WINDOWS):
            for micro in range(N):
                x, y = micro_batch(rank, window, micro)
                if failing and (window, micro) == (0, 1):
                    original = opt._sync.before_backward
                    loss = token_losses(model, x, y).mean()
                    if how == "interrupt":

                        def before_backward(last: bool) -> None:
                            raise KeyboardInterrupt

                        opt._sync.before_backward = before_backward
                    else:
                        loss.register_hook(explode)
                    try:
                        opt.backward(loss, weight=x.shape[0])
                        said["failed"] = "no error"
                    except KeyboardInterrupt as error:
                        said["failed"] = " ".join(["KeyboardInterrupt", *getattr(error, "__notes__", [])])
                    opt._sync.before_backward = original
                    said["micro_step after the failure"] = str(opt.micro_step)
                    said["unreduced after the failure"] = str(opt._sync.holds_unreduced())
                opt.backward(token_losses(model, x, y).mean(), weight=x.shape[0])
                opt.step()
                opt.zero_grad()
        runs.append([_full(param) for param in model.parameters()])
    return {"said": said, "params": runs[1], "without the failure": runs[0]}


def _fsdp_zero_grad_after_a_load(rank: int) -> dict[str, str]:
    """A mid-window checkpoint loaded, then the loop's zero_grad() before the next backward: FSDP (its sync on)
    holds nothing of the window, so zero_grad() releases gradients and the window goes on where it was saved."""
    import gafused

    fsdp = _wrap("fsdp", rank)
    opt = gafused.GradAccumulator(torch.optim.SGD(fsdp.parameters(), lr=LR), N, model=fsdp)
    x, y = micro_batch(rank, 0, 0)
    opt.backward(token_losses(fsdp, x, y).mean(), weight=x.shape[0])
    opt.step()
    opt.load_state_dict(opt.state_dict())
    said = {"fsdp zero_grad after a mid-window load": _said(RuntimeError, opt.zero_grad)}
    said["fsdp zero_grad after a mid-window load micro_step"] = str(opt.micro_step)
    return said


def _fsdp_sync_off_cases(rank: int) -> dict[str, str]:
    """FSDP2 with set_requires_gradient_sync(False) keeps a window's gradients itself, outside the buffers: a
    mid-window checkpoint would lose them and flush() cannot reduce them (both refused, nothing changed); a
    micro-batch dropped by zero_grad() must leave FSDP too (the window's first: it is the whole window), or a later
    one is refused, since FSDP summed it with the earlier ones (and the last backward reduced that sum)."""
    import gafused

    said: dict[str, str] = {}
    fsdp = _wrap("fsdp", rank)
    opt = gafused.GradAccumulator(torch.optim.SGD(fsdp.parameters(), lr=LR), N, model=fsdp)
    fsdp.set_requires_gradient_sync(False)
    x, y = micro_batch(rank, 0, 0)
    opt.backward(token_losses(fsdp, x, y).mean(), weight=x.shape[0])
    opt.step()
    said["fsdp sync off state_dict"] = _said(RuntimeError, opt.state_dict)
    said["fsdp sync off flush"] = _said(RuntimeError, opt.flush)
    x, y = micro_batch(rank, 0, 1)
    opt.backward(token_losses(fsdp, x, y).mean(), weight=x.shape[0])
    said["fsdp sync off zero_grad later"] = _said(RuntimeError, opt.zero_grad)
    opt.step()
    said["fsdp sync off micro_step"] = str(opt.micro_step)
    del opt

    from torch.distributed.fsdp import MixedPrecisionPolicy

    def window(loop: str, dropped_first: bool, mixed: bool = False) -> tuple[list[torch.Tensor], float]:
        """A window of 3 with FSDP's sync off but for the last backward (the step loop unweighted), after a first
        micro-batch dropped by zero_grad() between its backward and step(), or not. ``mixed``: bf16 parameters in
        forward and backward, fp32 reductions, so FSDP keeps the unsynchronized gradients apart from ``.grad``."""
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else None
        fsdp = _wrap("fsdp", rank, mp_policy=policy)
        opt = gafused.GradAccumulator(torch.optim.SGD(fsdp.parameters(), lr=LR), 3, model=fsdp)

        def backward(micro: int) -> None:
            x, y = micro_batch(rank, 1, micro, weighted=loop == "backward")
            if loop == "backward":
                fsdp.set_requires_gradient_sync(False)  # opt.backward turns it on for the window's last
                opt.backward(token_losses(fsdp, x, y).mean(), weight=x.shape[0])
            else:
                fsdp.set_requires_gradient_sync(micro == 3)
                token_losses(fsdp, x, y).mean().backward()

        if dropped_first:
            backward(0)
            opt.zero_grad()
        for micro in (1, 2, 3):
            backward(micro)
            if micro == 2 and dropped_first:
                said[f"fsdp sync off zero_grad later ({loop} loop)"] = _said(RuntimeError, opt.zero_grad)
            if micro == 3 and dropped_first:  # the last backward reduced FSDP's held gradients with its own
                said[f"fsdp sync off zero_grad last ({loop} loop)"] = _said(RuntimeError, opt.zero_grad)
                if said[f"fsdp sync off zero_grad last ({loop} loop)"] == "no error":
                    return [], float("nan")  # the window's gradients went with it: nothing to step or compare
            opt.step()
            if micro == 1 and dropped_first:  # nothing since: FSDP holds the gradients, no p.grad shows them
                said[f"fsdp sync off step twice ({loop} loop)"] = _said(RuntimeError, opt.step)
        assert opt.stepped
        return [_full(param) for param in fsdp.parameters()], float(opt.grad_norm)

    for loop, mixed in (("backward", False), ("step", False), ("backward", True)):
        params, norm = window(loop, dropped_first=True, mixed=mixed)
        clean_params, clean_norm = window(loop, dropped_first=False, mixed=mixed)
        equal = norm == clean_norm and all(torch.equal(a, b) for a, b in zip(params, clean_params, strict=True))
        said[f"fsdp sync off zero_grad first ({loop} loop{', bf16 parameters' if mixed else ''})"] = str(equal)
    return said


def _ddp_dropped_inside_no_sync(rank: int) -> dict[str, str]:
    """An accumulator dropped inside a no_sync() block entered while it lived: the block's exit puts back the value
    it saved (off); DDP synchronizes again from the next forward on (the replicas' gradients are equal)."""
    import torch.distributed as dist

    import gafused

    ddp = torch.nn.parallel.DistributedDataParallel(make_model())
    opt = gafused.GradAccumulator(torch.optim.SGD(ddp.parameters(), lr=LR), N, model=ddp)
    with ddp.no_sync():
        del opt
        gc.collect()
    x, y = micro_batch(rank, 0, 0)

    def replicas_equal() -> str:
        grads = torch.cat([param.grad.reshape(-1) for param in ddp.parameters()])
        gathered = [torch.empty_like(grads) for _ in range(WORLD)]
        dist.all_gather(gathered, grads)
        return str(all(torch.equal(g, grads) for g in gathered))

    token_losses(ddp, x, y).mean().backward()
    said = {"ddp synchronizes after a drop inside no_sync": replicas_equal()}
    # Dropped outside a block, nothing of the accumulator stays: plain DDP then accumulates inside no_sync() as it
    # likes, also with uneven local counts (rank 0 two micro-batches, rank 1 one), and synchronizes at the end.
    ddp.zero_grad()
    opt = gafused.GradAccumulator(torch.optim.SGD(ddp.parameters(), lr=LR), N, model=ddp)
    del opt
    gc.collect()
    said["ddp no_sync after a drop"] = str("no_sync" not in vars(ddp))
    with ddp.no_sync():
        for _ in range(rank + 1):
            token_losses(ddp, x, y).mean().backward()
    token_losses(ddp, x, y).mean().backward()
    said["ddp uneven no_sync after a drop"] = replicas_equal()
    return said


def _ddp_split_cases(rank: int) -> dict[str, str]:
    """A DDP model whose parameters are split over two optimizers: gafused turns DDP's all-reduce off for the
    whole model, so both must be accumulators over it (then the window equals one accumulator over all of it);
    a plain second optimizer is refused at the window's end, before the last micro-batch changes anything.
    Parameters DDP itself ignores are no concern. ``static_graph=True`` is refused at construction."""
    import gafused

    said: dict[str, str] = {}

    def window(opts: list[torch.optim.Optimizer], ddp: torch.nn.Module) -> None:
        for micro in range(N):
            x, y = micro_batch(rank, 0, micro)
            token_losses(ddp, x, y).mean().backward()
            for opt in opts:
                opt.step(weight=x.shape[0])
            for opt in opts:
                opt.zero_grad()

    def split(ddp: torch.nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        params = list(ddp.parameters())
        return params[:2], params[2:]

    whole = torch.nn.parallel.DistributedDataParallel(make_model())
    window([gafused.GradAccumulator(torch.optim.SGD(whole.parameters(), lr=LR), N, model=whole)], whole)
    two = torch.nn.parallel.DistributedDataParallel(make_model())
    first, rest = split(two)
    opts = [gafused.GradAccumulator(torch.optim.SGD(part, lr=LR), N, model=two) for part in (first, rest)]
    window(opts, two)
    said["two accumulators equal one"] = str(all(map(torch.equal, two.parameters(), whole.parameters())))
    del opts

    plain = torch.nn.parallel.DistributedDataParallel(make_model())
    first, rest = split(plain)
    opt = gafused.GradAccumulator(torch.optim.SGD(first, lr=LR), N, model=plain)
    before = [param.detach().clone() for param in plain.parameters()]
    other = torch.optim.SGD(rest, lr=LR)  # meant to step once per window, after the accumulator

    def both_step(opt: gafused.GradAccumulator) -> None:
        window([opt], plain)
        other.step()

    said["plain second optimizer"] = _said(RuntimeError, both_step, opt)
    said["plain second optimizer micro_step"] = str(opt.micro_step)  # the refused last step changed nothing
    said["plain second optimizer params"] = str(all(map(torch.equal, plain.parameters(), before)))
    opt.zero_grad()
    del opt

    module = make_model()
    module._ddp_params_and_buffers_to_ignore = ["4.weight", "4.bias"]  # DDP never reduces these either
    ignoring = torch.nn.parallel.DistributedDataParallel(module)
    opt = gafused.GradAccumulator(torch.optim.SGD(list(module.parameters())[:4], lr=LR), N, model=ignoring)
    said["params ddp ignores"] = _said(RuntimeError, window, [opt], ignoring)
    del opt
    gc.collect()
    # In the accumulator itself they are refused: DDP leaves their gradients to each rank, gafused would sum them.
    sgd = torch.optim.SGD(module.parameters(), lr=LR)
    said["accumulating params ddp ignores"] = _said(ValueError, gafused.GradAccumulator, sgd, N, model=ignoring)
    said["ddp sync after refusing them"] = str(ignoring.require_backward_grad_sync)
    # A parameter of the wrapped module itself, which DDP names ".weight" in its ignore list (f"{prefix}.{name}").
    root = torch.nn.Linear(3, 2)
    root._ddp_params_and_buffers_to_ignore = [".weight"]
    root_ddp = torch.nn.parallel.DistributedDataParallel(root)
    sgd = torch.optim.SGD(root.parameters(), lr=LR)
    said["accumulating a root parameter ddp ignores"] = _said(
        ValueError, gafused.GradAccumulator, sgd, N, model=root_ddp
    )

    hooked = _wrap("ddp", rank)  # a communication hook, which gafused's own reduction bypasses
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = gafused.GradAccumulator(torch.optim.SGD(hooked.parameters(), lr=LR), N, model=hooked)
    said["comm hook"] = " | ".join(str(w.message) for w in caught)
    del opt

    static = torch.nn.parallel.DistributedDataParallel(make_model(), static_graph=True)
    sgd = torch.optim.SGD(static.parameters(), lr=LR)
    said["static graph"] = _said(ValueError, gafused.GradAccumulator, sgd, N, model=static)
    said["static graph sync"] = str(static.require_backward_grad_sync)
    return said


def _fsdp_weight_cases(rank: int, x: torch.Tensor, y: torch.Tensor) -> dict[str, str]:
    """FSDP2 carries the weight in the loss: a weight a float16 loss cannot hold is refused, a gradient divide
    factor set between windows is the one folded with (same data, lr 0: the same finished gradient), and a weight a
    bfloat16 loss rounds is counted in the window's sum as rounded."""
    import gafused

    said: dict[str, str] = {}
    fsdp = _wrap("fsdp", rank)
    opt = gafused.GradAccumulator(torch.optim.SGD(fsdp.parameters(), lr=0.0), 1, model=fsdp)
    said["fsdp fp16 loss weight"] = _said(ValueError, opt.backward, token_losses(fsdp, x, y).mean().half(), weight=1e5)
    said["fsdp fp16 loss weight micro_step"] = str(opt.micro_step)
    from torch.distributed.fsdp import FSDPModule

    norms = []
    for factor in (None, 1.0, float(WORLD) * 4):
        if factor is not None:
            # Each fully_shard module divides its own parameters' gradients: the root holds none of them here. gloo
            # has no pre-multiplied sum, so the factor is applied after a plain sum.
            for module in fsdp.modules():
                if isinstance(module, FSDPModule):
                    module.set_gradient_divide_factor(factor)
                    module.set_force_sum_reduction_for_comms(True)
        opt.backward(token_losses(fsdp, x, y).mean(), weight=x.shape[0])
        opt.step()
        norms.append(repr(float(opt.grad_norm)))
    said["fsdp norms over divide factors"] = " ".join(norms)
    # Modules that divide by different factors cannot be undone by one fold factor: refused between windows (the
    # factors were alike when the accumulator was built) and when an accumulator is built, on every rank alike.
    sharded = [module for module in fsdp.modules() if isinstance(module, FSDPModule)]
    sharded[1].set_gradient_divide_factor(1.0)
    said["fsdp divide factors apart at a window"] = _said(
        ValueError, opt.backward, token_losses(fsdp, x, y).mean(), weight=x.shape[0]
    )
    said["fsdp divide factors apart at construction"] = _said(
        ValueError, gafused.GradAccumulator, torch.optim.SGD(fsdp.parameters(), lr=0.0), 1, model=fsdp
    )
    sharded[1].set_gradient_divide_factor(float(WORLD) * 4)
    # A bfloat16 loss carries the weight 257 as 256: the window's sum counts it as carried, so the finished gradient
    # is a weighted mean of the gradients (256 g0 + g1) / 257, not (256 g0 + g1) / 258. Every rank sees the same
    # data; the gradient of sum(W x) is x in every row of W, and SGD with lr 1 moves W by it.
    from torch.distributed.fsdp import fully_shard

    linear = torch.nn.Linear(4, 2, bias=False)
    start = linear.weight.detach().clone()
    fully_shard(linear, mesh=cpu_mesh())
    opt = gafused.GradAccumulator(torch.optim.SGD(linear.parameters(), lr=1.0), 2, model=linear)
    inputs = [torch.ones(1, 4), 2 * torch.ones(1, 4)]
    for x, weight in zip(inputs, [257.0, 1.0], strict=True):
        opt.backward(linear(x).sum().to(torch.bfloat16), weight=weight)
        opt.step()
    moved = start - linear.weight.full_tensor().detach()
    expected = ((256 * inputs[0] + inputs[1]) / 257).expand(2, 4)
    said["fsdp bf16 loss weight as carried"] = str(torch.allclose(moved, expected, rtol=1e-6, atol=0))
    said["fsdp reduce_dtype"] = _said(
        ValueError,
        gafused.GradAccumulator,
        torch.optim.SGD(fsdp.parameters(), lr=0.0),
        1,
        model=fsdp,
        reduce_dtype=torch.bfloat16,
    )
    # A micro-batch's loss in two backward() calls (the weight given to the first) folds what one call does.
    models = []
    for split in (False, True):
        model = _wrap("fsdp", rank)
        opt = gafused.GradAccumulator(torch.optim.SGD(model.parameters(), lr=LR), 2, model=model)
        for micro in range(2):
            x, y = micro_batch(rank, 0, micro)
            half = x.shape[0] // 2
            if split and micro == 0:  # two forwards, two backward() calls
                opt.backward(token_losses(model, x[:half], y[:half]).sum() / x.shape[0], weight=x.shape[0])
                opt.backward(token_losses(model, x[half:], y[half:]).sum() / x.shape[0])
            else:
                opt.backward(token_losses(model, x, y).mean(), weight=x.shape[0])
            opt.step()
        models.append([_full(param) for param in model.parameters()])
    said["fsdp two backward calls equal one"] = str(
        all(float((a - b).abs().max()) <= 1e-6 * float(b.abs().max()) for a, b in zip(*models, strict=True))
    )
    return said


def run_old_layout_checkpoint(rank: int) -> dict[str, bool]:
    """A mid-window checkpoint of version 3 (buffers in the optimizer's order) loaded with model= where the optimizer
    lists the parameters in reverse (the layout is now the model's order): each parameter's part of the window goes
    with it. The version-3 window is made from this version's by reordering its parts, as version 3 laid them out.
    This version's checkpoint also loads where the resumed process's optimizer lists the parameters in the model's
    order (its positions are in the model's order), and one of version 5 (positions in the optimizer's order) where
    the optimizer's order is the one it was saved with."""
    import gafused

    def build(reverse: bool = True) -> tuple[torch.nn.Module, gafused.GradAccumulator]:
        model = _wrap("ddp", rank)
        params = list(model.parameters())
        inner = torch.optim.SGD(params[::-1] if reverse else params, lr=LR)
        return model, gafused.GradAccumulator(inner, N, bucket_bytes=BUCKET_BYTES, model=model)

    model, opt = build()
    x, y = micro_batch(rank, 0, 0)
    opt.backward(token_losses(model, x, y).mean(), weight=x.shape[0])
    opt.step()
    state = opt.state_dict()
    window = state["gafused"]
    (entry,) = window["buffers"]  # one fp32 buffer, in the model's order
    pieces = entry["segments"].split(entry["numels"])
    parts = list(zip(entry["numels"], entry["shapes"], entry["had_grad"], pieces, strict=True))
    parts.reverse()  # the optimizer's order
    window_v3 = {
        **window,
        "version": 3,
        "buffers": [
            {
                "numels": [part[0] for part in parts],
                "shapes": [part[1] for part in parts],
                "had_grad": [part[2] for part in parts],
                "segments": torch.cat([part[3] for part in parts]),
            }
        ],
    }
    count = len(entry["numels"])
    window_v5 = {
        **window,
        "version": 5,
        "buffers": [{**entry, "positions": [count - 1 - index for index in range(count)]}],  # the optimizer's order
    }
    results = {}
    for name, saved, reverse in (
        ("this version", window, True),
        ("this version, the optimizer's order changed", window, False),
        ("version 5", window_v5, True),
        ("version 3, the optimizer's order", window_v3, True),
    ):
        _, resumed = build(reverse)
        resumed.load_state_dict({**state, "gafused": saved})
        results[name] = resumed.micro_step == 1 and torch.equal(resumed.buffers[0].data, opt.buffers[0].data)
    _, resumed = build(reverse=False)
    try:
        resumed.load_state_dict({**state, "gafused": window_v5})
        results["version 5, the optimizer's order changed: refused"] = False
    except ValueError as error:
        results["version 5, the optimizer's order changed: refused"] = resumed.micro_step == 0 and (
            "listed in another order" in str(error)
        )
    results.update(_cross_layout_checkpoint(rank))
    return results


def run_old_layout_refusals(rank: int) -> dict[str, bool]:
    """Mid-window checkpoints of earlier versions loaded with model= where the optimizer lists the parameters in
    reverse. One of version 4 (laid out in the model's order already) over parameters of one size, which the numels
    cannot tell apart from the optimizer's order, loads as it is. A version-1 or 3 window that does not describe the
    optimizer's layout (numels of other parameters, a field longer than the layout, no segments, a micro_step that is
    no int, one buffer entry more), and a window without world_size (a single process's) on two ranks, are refused
    naming the field, nothing changed."""
    import gafused

    def build(module: torch.nn.Module) -> tuple[torch.nn.Module, gafused.GradAccumulator]:
        model = torch.nn.parallel.DistributedDataParallel(module)
        inner = torch.optim.SGD(list(module.parameters())[::-1], lr=LR)
        return model, gafused.GradAccumulator(inner, N, model=model)

    def square_layers() -> torch.nn.Module:
        torch.manual_seed(0)
        square = [torch.nn.Linear(6, 6, bias=False), torch.nn.Tanh(), torch.nn.Linear(6, 6, bias=False)]
        return torch.nn.Sequential(*square)

    def saved(make: Callable[[], torch.nn.Module]) -> tuple[dict, gafused.GradAccumulator]:
        model, opt = build(make())
        x, _ = micro_batch(rank, 0, 0)
        opt.backward(model(x).square().sum(), weight=x.shape[0])
        opt.step()
        return opt.state_dict(), opt

    def in_optimizer_order(window: dict, version: int) -> dict:
        """``window`` (this version's: one buffer, in the model's order) as versions 1 and 3 laid it out."""
        (entry,) = window["buffers"]
        pieces = entry["segments"].split(entry["numels"])
        parts = list(zip(entry["numels"], entry["shapes"], entry["had_grad"], pieces, strict=True))[::-1]
        buffer = {
            "numels": [part[0] for part in parts],
            "had_grad": [part[2] for part in parts],
            "segments": torch.cat([part[3] for part in parts]),
        }
        if version == 3:
            buffer["shapes"] = [part[1] for part in parts]
        earlier = {key: value for key, value in window.items() if key != "layout"}
        return {**earlier, "version": version, "buffers": [buffer]}

    def edited(window: dict, **fields: Any) -> dict:
        """``window`` with its one buffer entry's ``fields`` replaced."""
        return {**window, "buffers": [{**window["buffers"][0], **fields}]}

    results = {}
    state, opt = saved(square_layers)
    window = {key: value for key, value in state["gafused"].items() if key != "layout"}
    window_v4 = {**window, "version": 4, "buffers": [{**entry} for entry in window["buffers"]]}
    for entry in window_v4["buffers"]:
        del entry["positions"]
    _, resumed = build(square_layers())
    resumed.load_state_dict({**state, "gafused": window_v4})
    loaded = resumed.micro_step == 1 and torch.equal(resumed.buffers[0].data, opt.buffers[0].data)
    results["version 4, parameters of one size: loads as laid out"] = loaded

    state, _ = saved(make_model)
    v3, v1 = in_optimizer_order(state["gafused"], 3), in_optimizer_order(state["gafused"], 1)
    (entry,) = v3["buffers"]
    numels = entry["numels"]
    malformed = {
        "version 1, numels of other parameters": (
            edited(v1, numels=[numels[1], numels[0], *numels[2:]]),
            "'numels' do not match",
        ),
        "version 3, segments one element longer": (
            edited(v3, segments=torch.cat([entry["segments"], torch.ones(1)])),
            "'numels' do not match",
        ),
        "version 3, had_grad one longer": (edited(v3, had_grad=[*entry["had_grad"], True]), "'numels' do not match"),
        "version 3, shapes one longer": (edited(v3, shapes=[*entry["shapes"], [1]]), "'numels' do not match"),
        "version 3, micro_step None": ({**v3, "micro_step": None}, "['micro_step']: expected a non-negative int"),
        "version 3, no segments": (edited(v3, segments=None), "['buffers'][0]"),
        "version 3, a buffer entry more": ({**v3, "buffers": [entry, entry]}, "expected 1 buffer entries"),
        "no world_size": (
            {key: value for key, value in state["gafused"].items() if key != "world_size"},
            f"['world_size']: expected {WORLD}",
        ),
    }
    for name, (window, message) in malformed.items():
        _, resumed = build(make_model())
        try:
            resumed.load_state_dict({**state, "gafused": window})
            results[f"{name}: refused"] = False
        except ValueError as error:
            results[f"{name}: refused"] = resumed.micro_step == 0 and message in str(error)
        except Exception:  # refused, but not as a ValueError naming the field
            results[f"{name}: refused"] = False
    return results


def _cross_layout_checkpoint(rank: int) -> dict[str, bool]:
    """A mid-window checkpoint saved with model= and loaded without it, or the reverse, both over one rank (a DDP on
    a one-rank group): the positions in the model's order and in the optimizer's (here the reverse) both count up
    from 0, so only the window's "layout" tells them apart; refused either way, nothing changed."""
    import torch.distributed as dist

    import gafused

    solo = [dist.new_group([other]) for other in range(WORLD)][rank]  # every rank makes every group

    def build(with_model: bool) -> tuple[torch.nn.Module, gafused.GradAccumulator]:
        module = make_model()
        model = torch.nn.parallel.DistributedDataParallel(module, process_group=solo) if with_model else module
        inner = torch.optim.SGD(list(module.parameters())[::-1], lr=LR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # without model=, over an initialized process group
            return model, gafused.GradAccumulator(inner, N, model=model if with_model else None)

    results = {}
    x, y = micro_batch(rank, 0, 0)
    for saved_with, loaded_with in ((True, False), (False, True)):
        model, opt = build(saved_with)
        opt.backward(token_losses(model, x, y).mean(), weight=x.shape[0])
        opt.step()
        state = opt.state_dict()
        _, resumed = build(loaded_with)
        name = f"saved {'with' if saved_with else 'without'} model=, loaded {'with' if loaded_with else 'without'}"
        try:
            resumed.load_state_dict(state)
            results[name + ": refused"] = False
        except ValueError as error:
            results[name + ": refused"] = resumed.micro_step == 0 and "['layout']" in str(error)
    return results


def _recorded(results: dict[str, Any], name: str, run: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """``results[name] = run(*args, **kwargs)``, or the error it raised, which the test reports by name."""
    try:
        results[name] = run(*args, **kwargs)
    except Exception as error:
        results[name] = {"error": f"{type(error).__name__}: {error}"}


def _rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*FSDP.*")
    results: dict[str, Any] = {}
    for name, case in CASES.items():
        _recorded(results, name, run_case, rank, **case)
    results["misuse"] = _misuse(rank)
    _recorded(results, "old layout checkpoint", run_old_layout_checkpoint, rank)
    _recorded(results, "old layout refusals", run_old_layout_refusals, rank)
    for name in IRREGULAR:
        _recorded(results, f"irregular: {name}", run_irregular, rank, name)
    _recorded(
        results, "irregular interrupted", run_irregular, rank, "shared in two reentrant checkpoints", interrupted=True
    )
    for name in DDP_FAILED_BACKWARD:
        _recorded(results, f"ddp failed backward: {name}", run_ddp_failed_backward, rank, name)
    results["batchnorm"], results["batchnorm trace"] = {}, {}
    for accumulate in ("gafused", "no_sync"):
        trace: list[torch.Tensor] = []
        results["batchnorm"][accumulate] = run_batchnorm(rank, accumulate, trace)
        results["batchnorm trace"][accumulate] = trace
    for case in SYNC_OFF_RECORDS:
        _recorded(results, f"sync off records: {case}", run_sync_off_records, rank, case)
    _recorded(results, "sync off way out", run_sync_off_way_out, rank)
    for sync_off in (False, True):
        _recorded(results, f"failed backward, sync off {sync_off}", run_failed_backward, rank, sync_off)
    _recorded(results, "failed backward before fsdp reduced", run_failed_backward, rank, False, True)
    for sync_off, failing_micro in ((False, 1), (True, 1), (True, N - 1)):
        _recorded(
            results,
            f"split failed backward, sync off {sync_off}, micro-batch {failing_micro}",
            run_split_failed_backward,
            rank,
            sync_off,
            failing_micro,
        )
    for how in ("interrupt", "loss hook"):
        _recorded(results, f"failed before fsdp held more: {how}", run_failed_before_fsdp_held_more, rank, how)
    _recorded(results, "split failed before fsdp held more", run_split_failed_before_fsdp_held_more, rank)
    _recorded(results, "fsdp fp16 overflow", run_fp16_overflow, rank)
    gathered: list[Any] = [None] * WORLD
    dist.all_gather_object(gathered, results)
    if rank == 0:
        torch.save(gathered, out)
    dist.destroy_process_group()
    leave_spawned_rank()


def report(results: list[dict[str, Any]]) -> str:
    """A markdown table: each case's error against the float64 truth, norm error, rank agreement, wire."""
    lines = [
        "| recipe | param error vs float64 truth | grad_norm error | ranks bitwise equal | all-reduces "
        "(bytes), first window |",
        "| --- | --- | --- | --- | --- |",
    ]
    truths = {weighted: truth(weighted) for weighted in (True, False)}
    for name, case in CASES.items():
        first, second = results[0][name], results[1][name]
        if "error" in first:
            lines.append(f"| {name} | {first['error']} | | | |")
            continue
        truth_params, truth_norms, initial = truths[case.get("weighted", True)]
        error = max(
            float((p.double() - t).norm() / (t - i).norm())
            for p, t, i in zip(first["params"], truth_params, initial, strict=True)
        )
        norm_error = max(abs(a - b) / b for a, b in zip(first["norms"], truth_norms, strict=True))
        equal = first["norms"] == second["norms"] and all(
            torch.equal(a, b) for a, b in zip(first["params"], second["params"], strict=True)
        )
        calls, nbytes = first["wire"][0]
        lines.append(f"| {name} | {error:.1e} | {norm_error:.1e} | {'yes' if equal else 'NO'} | {calls} ({nbytes}) |")
    return "\n".join(lines)


if __name__ == "__main__":
    import tempfile

    import torch.multiprocessing as mp

    target = case_script_target(sys.argv[1:])
    if target is None:
        with tempfile.TemporaryDirectory() as folder:
            out = os.path.join(folder, "results.pt")
            mp.spawn(_rank, args=(free_port(), out), nprocs=WORLD)
            print(report(torch.load(out, weights_only=False)))
    else:
        mp.spawn(_rank, args=(free_port(), target), nprocs=WORLD)
