"""Gradient sync per accumulation window across ranks: DDP and FSDP2 recipes against gafused (2 gloo ranks, CPU).

    python bench/distributed.py                 # GPT-2 small's 124M fp32 parameters, N = 4: ~3 min on 2 cores
    python bench/distributed.py --plain-fsdp2   # plus plain FSDP2 for reference (~2 min more): the committed file
    python bench/distributed.py --quick         # a 2-layer GPT at hidden 64 (smoke test, seconds)
    python bench/distributed.py --recipes gafused-ddp,gafused-ddp-bf16 --no-memory --out /tmp/distributed.json

Two processes (gloo, one torch thread each) train the same model from the same seed, one recipe after the
other, on different tokens per rank and micro-batch: 8 tokens per micro-batch, N = 4 micro-batches per window,
weight 1 each, clip to norm 1.0, SGD. The model is ``bench/e2e.py``'s GPT-2-shaped decoder at GPT-2 small's
sizes (vocab 50257, 1024 positions, hidden 768, 12 layers: 124,439,808 parameters, the tensors of
``param_sets.gpt2()``; its Linear weights are stored out x in, HF's Conv1D in x out). A handful of tokens keeps
forward and backward cheap while backward still produces every gradient through autograd.

The recipes (row names):
- ``ddp``: (a) DDP all-reducing every micro-batch: ``(loss / N).backward()``, ``clip_grad_norm_``, inner step;
- ``ddp-no_sync``: (b) the same with ``ddp.no_sync()`` on the first N - 1 micro-batches;
- ``gafused-ddp``: (c) ``GradAccumulator(inner, N, model=ddp)``, ``opt.backward(loss, weight=1); opt.step()``;
- ``gafused-ddp-bf16``: (d) the same with ``reduce_dtype=torch.bfloat16``;
- ``gafused-fsdp2``, ``gafused-fsdp2-no_sync``: ``fully_shard`` on each block and the root, the gafused loop,
  FSDP reduce-scattering every micro-batch, or only the last after the user's
  ``model.set_requires_gradient_sync(False)`` on the others;
- ``fsdp2``, ``fsdp2-no_sync`` (``--plain-fsdp2``): the same two ways with the plain recipe.

Per recipe: a warm-up window (also the exactness check), a window under the memory tracker, then the timed
windows (3; 2 with ``--quick``) without it. Measured per window, every window and both ranks agreeing:
- collectives and their bytes. DDP's own bucket all-reduces are counted by a comm hook that does what DDP's
  default does (divide by the world size, all-reduce); whatever goes through ``torch.distributed`` (gafused's
  all-reduces; FSDP2's ``reduce_scatter_single`` and ``all_gather_single``, which it calls from Python in torch
  2.13, ``reduce_scatter_tensor`` / ``all_gather_into_tensor`` in older releases) by patching those functions.
  ``MB`` is the payload handed to the collectives (an all-reduce's tensor, a reduce-scatter's input, an
  all-gather's output); ``sent MB`` what each rank sends under a ring algorithm: 2 (W - 1) / W of an all-reduce,
  (W - 1) / W of a reduce-scatter or all-gather. Not counted: plain FSDP2's ``clip_grad_norm_`` reduces its
  norm through DTensor's functional collectives (a scalar).
- wall time of a window on rank 0 after a barrier: median, min and max over the timed windows;
- peak live CPU tensor bytes of a rank over the memory window, the larger rank (each rank's in
  ``peak_bytes_per_rank``, JSON only): every tensor alive in the process (parameters, gradients, DDP buckets,
  FSDP2 buffers, the accumulator), exactly, from the CPU allocator's own count (``bench/memory.py``'s tracker
  with ``count_every_thread``: gloo's worker threads free some buffers, which the profiler's events alone would
  miss);
- exactness after the warm-up window: each recipe's parameters against a float64 window (the same fp32
  micro-batch gradients summed, averaged, clipped and stepped in float64, then rounded to fp32) and against
  ``ddp``'s, as ``||p - p_ref|| / ||p_ref - p_0||``; and the window's grad norm against float64's.

The ranks keep freed memory for reuse (``RANK_ENVIRONMENT``). JSON (``--out``) with the torch version, CPU, date,
world size and N, and a CSV beside it. Without ``--out`` only the run that makes the committed file
(``--plain-fsdp2`` alone) writes ``bench/results/distributed-cpu.json``; any other run (``--quick``, ``--recipes``,
``--no-memory``, or no ``--plain-fsdp2``) writes ``distributed-quick.json`` or ``distributed-cpu.json`` under
``~/.cache/gafused/bench`` (``$XDG_CACHE_HOME/gafused/bench``), so a run by hand never overwrites the committed one.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import gc
import json
import math
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import param_sets  # noqa: E402 - bench/ modules are imported as siblings, after the path is set
import provenance  # noqa: E402
from e2e import TinyGPT, TinyGPTConfig  # noqa: E402
from memory import count_every_thread, track_peak  # noqa: E402

import gafused  # noqa: E402

WORLD = 2
ACCUMULATION_STEPS = 4
TOKENS = 8  # per micro-batch and rank
MAX_GRAD_NORM = 1.0
LR = 1.0  # a large step keeps the parameter change well above the rounding of p + change (the exactness check)
# Bounds on ||p - p_float64|| / ||p_float64 - p_0|| after one window: fp32 rounding of the sums in another order
# (tests/test_distributed.py holds its recipes to the same 2e-5), and a bf16 all-reduce, which rounds each summed
# gradient to 8 bits of mantissa.
FP32_BOUND = 2e-5
BF16_BOUND = 2.0**-8
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "distributed-cpu.json"  # the committed results


@dataclass(frozen=True)
class Recipe:
    """One way of running a window across ranks."""

    name: str
    wrapper: str  # "ddp" or "fsdp2"
    accumulator: bool  # gafused.GradAccumulator(model=...) owns the sync
    no_sync: bool  # the user's no_sync() / set_requires_gradient_sync(False) on the first N - 1 micro-batches
    reduce_dtype: str | None
    what: str
    default: bool = True  # in a run without --recipes / --plain-fsdp2


RECIPES = (
    Recipe("ddp", "ddp", False, False, None, "(a) DDP all-reduces every micro-batch"),
    Recipe("ddp-no_sync", "ddp", False, True, None, "(b) DDP, no_sync() on the first N-1"),
    Recipe("gafused-ddp", "ddp", True, False, None, "(c) gafused, one all-reduce per bucket per window"),
    Recipe("gafused-ddp-bf16", "ddp", True, False, "bfloat16", "(d) as (c), buckets all-reduced in bf16"),
    # Plain FSDP2 for reference: two more minutes on 2 cores (gloo's all-gather and reduce-scatter are slow).
    Recipe("fsdp2", "fsdp2", False, False, None, "FSDP2 reduce-scatters every micro-batch", default=False),
    Recipe("fsdp2-no_sync", "fsdp2", False, True, None, "FSDP2, set_requires_gradient_sync(False) on N-1", False),
    Recipe("gafused-fsdp2", "fsdp2", True, False, None, "gafused, FSDP2 reduce-scatters every micro-batch"),
    Recipe("gafused-fsdp2-no_sync", "fsdp2", True, True, None, "gafused, set_requires_gradient_sync(False) on N-1"),
)


@dataclass(frozen=True)
class Config:
    """Sizes of a run."""

    model: TinyGPTConfig
    timed_windows: int
    ddp_bucket_cap_mb: float
    gafused_bucket_bytes: int


def config_for(quick: bool) -> Config:
    """GPT-2 small's sizes; ``quick``: a 2-layer GPT at hidden 64 (vocab 512), with buckets small enough to be
    several."""
    if quick:
        model = TinyGPTConfig(vocab=512, hidden=64, layers=2, heads=2, seq_len=64, batch=4, accumulation_steps=4)
        return Config(model, timed_windows=2, ddp_bucket_cap_mb=0.1, gafused_bucket_bytes=128 * 2**10)
    model = TinyGPTConfig(vocab=50257, hidden=768, layers=12, heads=12, seq_len=1024, batch=4, accumulation_steps=4)
    # DDP's and gafused's default bucket sizes.
    bucket_bytes = gafused.buffer.DEFAULT_BUCKET_BYTES
    return Config(model, timed_windows=3, ddp_bucket_cap_mb=25, gafused_bucket_bytes=bucket_bytes)


def _param_set(config: TinyGPTConfig) -> param_sets.ParamSet:
    return param_sets.gpt2(hidden=config.hidden, layers=config.layers, vocab=config.vocab, positions=config.seq_len)


def build_model(config: TinyGPTConfig) -> torch.nn.Module:
    """The GPT-2-shaped decoder with GPT-2's initialization (normal(0, 0.02) weights, zero biases, unit norms)."""
    torch.manual_seed(0)
    model = TinyGPT(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.02)
            elif name.endswith("weight"):
                param.fill_(1.0)
            else:
                param.zero_()
    return model


def _tokens(config: TinyGPTConfig, rank: int, window: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(10_000 * rank + 100 * window + micro)
    tokens = torch.randint(0, config.vocab, (1, TOKENS + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


# --- counting collectives ---------------------------------------------------------------------------------


class Wire:
    """Collectives of the current window by kind: calls, payload bytes, bytes a rank sends under a ring."""

    # kind -> fraction of the payload each rank sends under a ring algorithm, as a function of the world size
    RING = {
        "ddp all-reduce": lambda world: 2 * (world - 1) / world,
        "all-reduce": lambda world: 2 * (world - 1) / world,
        "reduce-scatter": lambda world: (world - 1) / world,
        "all-gather": lambda world: (world - 1) / world,
    }

    def __init__(self) -> None:
        self.counts: dict[str, list[int]] = {}
        self.original_all_reduce = dist.all_reduce

    def reset(self) -> None:
        self.counts = {kind: [0, 0] for kind in self.RING}

    def add(self, kind: str, tensor: torch.Tensor) -> None:
        self.counts[kind][0] += 1
        self.counts[kind][1] += tensor.numel() * tensor.element_size()

    def install(self) -> None:
        """Patch the ``torch.distributed`` functions gafused and FSDP2 call; DDP's hook calls the original."""
        patches = {
            "all_reduce": ("all-reduce", 0),
            "reduce_scatter_single": ("reduce-scatter", 1),  # (output, input): the input is the payload
            "reduce_scatter_tensor": ("reduce-scatter", 1),
            "all_gather_single": ("all-gather", 0),  # (output, input): the gathered output is the payload
            "all_gather_into_tensor": ("all-gather", 0),
        }
        keywords = {0: ("tensor", "output_tensor", "output"), 1: ("input", "input_tensor")}
        for name, (kind, position) in patches.items():
            original = getattr(dist, name, None)
            if original is None:
                continue

            def counted(*args: Any, _original=original, _kind=kind, _position=position, **kwargs: Any) -> Any:
                if len(args) > _position:
                    payload = args[_position]
                else:
                    payload = next(kwargs[key] for key in keywords[_position] if key in kwargs)
                self.add(_kind, payload)
                return _original(*args, **kwargs)

            setattr(dist, name, counted)
        self.reset()

    def summary(self, world: int) -> dict[str, Any]:
        collectives = {kind: calls for kind, (calls, _) in self.counts.items() if calls}
        return {
            "collectives": sum(collectives.values()),
            "collectives_by_kind": collectives,
            "bytes": sum(nbytes for _, nbytes in self.counts.values()),
            "bytes_by_kind": {kind: nbytes for kind, (calls, nbytes) in self.counts.items() if calls},
            "sent_bytes_per_rank": round(sum(self.RING[kind](world) * b for kind, (_, b) in self.counts.items())),
        }


WIRE = Wire()


def _counting_allreduce_hook(state, bucket):  # noqa: ANN001, ANN202 - DDP checks the hook's signature
    """DDP's default all-reduce (divide by the world size, sum), counted."""
    tensor = bucket.buffer()
    WIRE.add("ddp all-reduce", tensor)
    tensor.div_(dist.get_world_size())
    return WIRE.original_all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()[0])


# --- the recipes ------------------------------------------------------------------------------------------


def _wrap(recipe: Recipe, model: torch.nn.Module, config: Config) -> torch.nn.Module:
    if recipe.wrapper == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=config.ddp_bucket_cap_mb)
        ddp.register_comm_hook(None, _counting_allreduce_hook)
        return ddp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # These runs are gloo on CPU: FSDP2's default mesh would be the accelerator's on a machine that has one.
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


@contextlib.contextmanager
def _quiet(recipe: Recipe, model: torch.nn.Module, last: bool) -> Iterator[None]:
    """The user's own way of skipping a micro-batch's sync, on the first N - 1 micro-batches of no_sync recipes."""
    if not recipe.no_sync or last:
        yield
    elif recipe.wrapper == "ddp":
        with model.no_sync():
            yield
    else:
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)


def _window_runner(recipe: Recipe, model: torch.nn.Module, config: Config, rank: int) -> tuple[Callable, Any]:
    """``run(window) -> grad norm`` for one window of ``recipe``; and the GradAccumulator (or None)."""
    n = ACCUMULATION_STEPS
    inner = torch.optim.SGD(model.parameters(), lr=LR)
    opt = None
    if recipe.accumulator:
        reduce_dtype = getattr(torch, recipe.reduce_dtype) if recipe.reduce_dtype else None
        opt = gafused.GradAccumulator(
            inner,
            n,
            max_grad_norm=MAX_GRAD_NORM,
            bucket_bytes=config.gafused_bucket_bytes,
            model=model,
            reduce_dtype=reduce_dtype,
        )

    def run(window: int) -> float:
        for micro in range(n):
            x, y = _tokens(config.model, rank, window, micro)
            with _quiet(recipe, model, last=micro == n - 1):
                loss = model(x, y)
                if opt is None:
                    (loss / n).backward()
                else:
                    opt.backward(loss, weight=1)
            del loss
            if opt is not None:
                opt.step()
                opt.zero_grad()
        if opt is not None:
            assert opt.stepped, f"{recipe.name}: the window did not step"
            return float(opt.grad_norm)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        inner.step()
        inner.zero_grad(set_to_none=True)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    return run, opt


def _full_params(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every parameter in full (FSDP2: gathered; collective), in registration order."""
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for p in model.parameters()]


class Reference:
    """What rank 0 compares each recipe's first window with, as ``||p - p_ref|| / ||p_ref - p_0||``: the float64
    window rounded to fp32 (0 when a recipe lands on the correctly rounded result) and ``ddp``'s window. Kept as
    NumPy arrays, outside torch's allocator, so no recipe's memory tracker counts them."""

    def __init__(self) -> None:
        self.initial: list[np.ndarray] = []
        self.float64: list[np.ndarray] = []
        self.float64_change = 0.0
        self.float64_norm = 0.0
        self.ddp: list[np.ndarray] = []
        self.ddp_change = 0.0

    @staticmethod
    def _distance(params: list[torch.Tensor], against: list[np.ndarray]) -> float:
        pairs = zip(params, against, strict=True)
        return math.sqrt(sum(float(torch.linalg.vector_norm(p - torch.from_numpy(a))) ** 2 for p, a in pairs))

    def errors(self, params: list[torch.Tensor]) -> tuple[float, float]:
        """Relative parameter error against the float64 window and against ``ddp``'s (the first caller's)."""
        if not self.ddp:
            self.ddp = [param.numpy().copy() for param in params]
            self.ddp_change = self._distance([torch.from_numpy(a) for a in self.ddp], self.initial)
        return (
            self._distance(params, self.float64) / self.float64_change,
            self._distance(params, self.ddp) / self.ddp_change,
        )


def float64_window(config: Config, rank: int, reference: Reference) -> None:
    """The first window with the same fp32 micro-batch gradients (same initial parameters and tokens), summed
    over micro-batches and ranks, averaged, clipped and stepped in float64: what an exact recipe computes.
    Rank 0 keeps the result in ``reference``."""
    world = dist.get_world_size()
    model = build_model(config.model)
    params = list(model.parameters())
    expected = _param_set(config.model).numels
    if sorted(param.numel() for param in params) != sorted(expected):
        raise RuntimeError(f"the model's parameters are not GPT-2's ({sum(expected):,} elements in {len(expected)})")
    sums = [torch.zeros_like(param, dtype=torch.float64) for param in params]
    for micro in range(ACCUMULATION_STEPS):
        model(*_tokens(config.model, rank, 0, micro)).backward()
        for total, param in zip(sums, params, strict=True):
            total.add_(param.grad)
            param.grad = None
    for total in sums:
        WIRE.original_all_reduce(total)
        total.div_(world * ACCUMULATION_STEPS)
    norm = math.sqrt(sum(float(total.square().sum()) for total in sums))
    coef = min(1.0, MAX_GRAD_NORM / (norm + 1e-6))
    if rank == 0:
        for param, total in zip(params, sums, strict=True):
            start = param.detach().double()
            after = start - LR * coef * total
            reference.float64_change += float((after - start).square().sum())
            reference.initial.append(param.detach().numpy().copy())
            reference.float64.append(after.float().numpy().copy())  # no torch storage behind it
        reference.float64_change = math.sqrt(reference.float64_change)
        reference.float64_norm = norm
    del model, params, sums
    gc.collect()


def _counted_window(run: Callable[[int], float], window: int, world: int) -> tuple[float, float, dict[str, Any]]:
    """Run one window after a barrier: its wall time, the process's CPU time (every thread) and its wire."""
    dist.barrier()
    WIRE.reset()
    started, cpu_started = time.perf_counter(), time.process_time()
    run(window)
    return time.perf_counter() - started, time.process_time() - cpu_started, WIRE.summary(world)


def run_recipe(recipe: Recipe, config: Config, rank: int, reference: Reference, memory: bool) -> dict[str, Any]:
    """One recipe on this rank: a warm-up window (checked against float64 and ``ddp``), a window under the memory
    tracker (with ``memory``), then the timed windows without it."""
    world = dist.get_world_size()
    gc.collect()
    model = _wrap(recipe, build_model(config.model), config)
    run, opt = _window_runner(recipe, model, config, rank)
    first_norm = run(0)
    params = _full_params(model)
    errors = reference.errors(params) if rank == 0 else (None, None)
    del params
    wires, peak = [], None
    if memory:
        with track_peak(torch.device("cpu")) as tracker:  # collects garbage first: no leftover of the set-up
            tracker.mark()
            wires.append(_counted_window(run, 1, world)[2])
        peak = tracker.live_peak_after_mark()
    times, cpu_times = [], []
    first_timed = 2 if memory else 1
    for window in range(first_timed, first_timed + config.timed_windows):
        seconds, cpu_seconds, wire = _counted_window(run, window, world)
        times.append(seconds)
        cpu_times.append(cpu_seconds)
        wires.append(wire)
    dist.barrier()
    result = {
        "times": times,
        "cpu_times": cpu_times,
        "wires": wires,
        "peak_bytes": peak,
        "first_window_grad_norm": first_norm,
        "param_error_vs_float64": errors[0],
        "param_error_vs_ddp": errors[1],
        "gafused_buckets": sum(len(buffer.bucket_ranges) for buffer in opt.buffers) if opt is not None else None,
        "gafused_params": sum(len(buffer) for buffer in opt.buffers) if opt is not None else None,
        "gafused_buffer_bytes": sum(b.numel * b.data.element_size() for b in opt.buffers) if opt is not None else None,
        "gafused_backend": opt.backend if opt is not None else None,
    }
    del run, opt, model
    gc.collect()
    return result


def _rank(rank: int, port: int, quick: bool, names: list[str], memory: bool, out: str) -> None:
    import warnings

    # Before any tensor exists: gloo's worker threads free some of the collectives' buffers (memory.py says why).
    count_every_thread()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*FSDP.*")
    config = config_for(quick)
    WIRE.install()
    reference = Reference()
    started = time.perf_counter()
    float64_window(config, rank, reference)
    measured: dict[str, Any] = {"float64_norm": reference.float64_norm if rank == 0 else None}
    recipes = [recipe for recipe in RECIPES if recipe.name in names]
    if rank == 0:
        print(f"[0/{len(recipes)}] float64 window: {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    for index, recipe in enumerate(recipes):
        started = time.perf_counter()
        measured[recipe.name] = run_recipe(recipe, config, rank, reference, memory)
        if rank == 0:
            print(
                f"[{index + 1}/{len(recipes)}] {recipe.name}: {time.perf_counter() - started:.1f} s",
                file=sys.stderr,
                flush=True,
            )
    gathered: list[Any] = [None] * WORLD
    dist.all_gather_object(gathered, measured)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()
    # End the rank now, as a forked process ends, without interpreter shutdown: a gloo worker thread may still be
    # releasing the gather's work, whose tensors need the GIL to drop; taking the GIL from a finalizing interpreter
    # ends the thread by a forced unwind through a noexcept destructor, and std::terminate aborts the rank
    # (tests/casekit.py's leave_spawned_rank says the same).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --- rows, table, files -----------------------------------------------------------------------------------


def _row(recipe: Recipe, per_rank: list[dict[str, Any]], numel: int, float64_norm: float) -> dict[str, Any]:
    first = per_rank[0]
    wires = [wire for measured in per_rank for wire in measured["wires"]]
    times = first["times"]
    peaks = [measured["peak_bytes"] for measured in per_rank]
    peak = None if None in peaks else max(peaks)
    bound = BF16_BOUND if recipe.reduce_dtype == "bfloat16" else FP32_BOUND
    error, norm_error = first["param_error_vs_float64"], first["first_window_grad_norm"] / float64_norm - 1
    # The window is clipped (its norm is far above MAX_GRAD_NORM), which hides a gradient off by a constant factor
    # from the parameters: the norm, measured before clipping, must be right too.
    if error < bound and abs(norm_error) < bound:
        check = "ok"
    elif error < bound or abs(error - abs(norm_error)) < bound:  # a step scaled by a clip coefficient off a wrong norm
        check = "off: grad norm"
    else:
        check = "off"
    return {
        "recipe": recipe.name,
        "what": recipe.what,
        "wrapper": recipe.wrapper,
        "gafused": recipe.accumulator,
        "user_no_sync": recipe.no_sync,
        "reduce_dtype": recipe.reduce_dtype or "float32",
        **wires[0],
        "counts_equal_every_window_and_rank": all(wire == wires[0] for wire in wires),
        "window_s_median": statistics.median(times),
        "window_s_min": min(times),
        "window_s_max": max(times),
        "window_s": times,
        # CPU time of a rank's process over a window (median; the larger rank): steadier than wall time on a
        # shared machine, and blind to waiting on the other rank.
        "window_cpu_s_median": max(statistics.median(m["cpu_times"]) for m in per_rank),
        "peak_bytes": peak,
        "peak_bytes_per_rank": peaks,
        "peak_bytes_per_param": None if peak is None else peak / numel,
        "grad_norm": first["first_window_grad_norm"],
        "grad_norm_error_vs_float64": norm_error,
        "grad_norm_equal_across_ranks": len({m["first_window_grad_norm"] for m in per_rank}) == 1,
        "param_error_vs_float64": error,
        "param_error_vs_ddp": first["param_error_vs_ddp"],
        "error_bound": bound,
        "check": check,
        "gafused_buckets": first["gafused_buckets"],
        "gafused_params": first["gafused_params"],
        "gafused_buffer_bytes": first["gafused_buffer_bytes"],
        "gafused_backend": first["gafused_backend"],
    }


def _fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    width = spec.split(".")[0].lstrip("+")
    return format("-", f">{width}") if value is None else format(value * scale, spec)


def format_table(results: dict[str, Any]) -> str:
    meta = results["meta"]
    lines = [
        f"gradient sync per window: {meta['world_size']} gloo ranks on CPU ({meta['cpu']}, {meta['threads_per_rank']} "
        f"thread per rank), {meta['params']:,} fp32 parameters, N = {meta['accumulation_steps']}, torch "
        f"{meta['torch']}; grad norm of the first window in float64: {meta['float64_grad_norm']:.6f}",
        f"{'recipe':<22} {'collectives':<44} {'MB':>7} {'sent MB':>7} {'s/window':>8} {'[min, max]':>13} "
        f"{'CPU s':>6} {'peak MB':>7} {'B/param':>7} {'norm err':>9} {'vs f64':>8} {'vs ddp':>8}  check",
    ]
    lines.append("-" * len(lines[-1]))
    for row in results["rows"]:
        kinds = ", ".join(f"{calls} {kind}" for kind, calls in row["collectives_by_kind"].items()) or "none"
        spread = f"[{row['window_s_min']:.2f}, {row['window_s_max']:.2f}]"
        lines.append(
            f"{row['recipe']:<22} {kinds:<44} {row['bytes'] / 1e6:>7.1f} {row['sent_bytes_per_rank'] / 1e6:>7.1f} "
            f"{row['window_s_median']:>8.2f} {spread:>13} {row['window_cpu_s_median']:>6.2f} "
            f"{_fmt(row['peak_bytes'], '7.0f', 1e-6)} "
            f"{_fmt(row['peak_bytes_per_param'], '7.2f')} {row['grad_norm_error_vs_float64']:>+9.1e} "
            f"{row['param_error_vs_float64']:>8.1e} {row['param_error_vs_ddp']:>8.1e}  {row['check']}"
        )
    lines.append(
        "MB: payload per window (all-reduce tensors, reduce-scatter inputs, all-gather outputs); sent MB: what a "
        "rank sends (ring); s/window: rank 0's wall time; CPU s: a rank's CPU time (median, the larger rank); "
        "peak: live tensor bytes on a rank; norm err: first window's grad norm vs float64; "
        "vs f64 / vs ddp: ||p - p_ref|| / ||p_ref - p_0|| after it; check: vs f64 within "
        f"{meta['fp32_bound']:.0e} (bf16 rows {meta['bf16_bound']:.1e})"
    )
    bad = [row["recipe"] for row in results["rows"] if not row["counts_equal_every_window_and_rank"]]
    if bad:
        lines.append(f"collective counts differ across windows or ranks in: {', '.join(bad)}")
    return "\n".join(lines)


def _write_csv(rows: list[dict[str, Any]], path: Path, meta: dict[str, Any]) -> None:
    flat = []
    for row in rows:
        flat.append({
            **{key: value for key, value in row.items() if not isinstance(value, dict | list)},
            **{f"collectives_{kind}": calls for kind, calls in row["collectives_by_kind"].items()},
            **{f"bytes_{kind}": nbytes for kind, nbytes in row["bytes_by_kind"].items()},
        })  # fmt: skip
    fields = list(dict.fromkeys(key for row in flat for key in row))
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["cpu", "date_utc", "torch", *fields])
        writer.writeheader()
        for row in flat:
            writer.writerow({"cpu": meta["cpu"], "date_utc": meta["date_utc"], "torch": meta["torch"], **row})


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# glibc hands every block over 32 MB back to the OS on free, so each micro-batch's 154 MB embedding gradient
# would be faulted in afresh (seconds of system time per window on 2 cores, and as much noise). The ranks keep
# freed memory for reuse instead, as PyTorch's caching allocator does on a GPU; set these yourself to override.
RANK_ENVIRONMENT = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**40)}


@contextlib.contextmanager
def _rank_environment() -> Iterator[dict[str, str]]:
    added = {key: value for key, value in RANK_ENVIRONMENT.items() if key not in os.environ}
    os.environ.update(added)
    try:
        yield {key: os.environ[key] for key in RANK_ENVIRONMENT}
    finally:
        for key in added:
            del os.environ[key]


def run(quick: bool, names: list[str] | None = None, memory: bool = True) -> dict[str, Any]:
    """Spawn the ranks and run the recipes; returns ``{"meta": ..., "rows": [...]}``.

    Args:
        quick: GPT-2's layout at hidden 64 instead of GPT-2 small's sizes.
        names: the recipes to run (default: those marked ``default``); ``ddp`` always runs (the other rows are
            compared with it).
        memory: measure peak memory, in a window of its own under torch.profiler before the timed ones.
    """
    import torch.multiprocessing as mp

    wanted = {recipe.name for recipe in RECIPES if recipe.default} if names is None else {*names, "ddp"}
    names = [recipe.name for recipe in RECIPES if recipe.name in wanted]
    config = config_for(quick)
    numel = _param_set(config.model).numel
    now = datetime.datetime.now(datetime.timezone.utc)
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, _rank_environment() as environment:
        out = Path(tmp) / "ranks.json"
        mp.spawn(_rank, args=(_free_port(), quick, names, memory, str(out)), nprocs=WORLD)
        per_rank = json.loads(out.read_text())
    float64_norm = per_rank[0]["float64_norm"]
    recipes = [recipe for recipe in RECIPES if recipe.name in names]
    rows = [_row(recipe, [measured[recipe.name] for measured in per_rank], numel, float64_norm) for recipe in recipes]
    meta = {
        "date_utc": now.isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "gafused": gafused.__version__,
        "python": platform.python_version(),
        "cpu": provenance.cpu_name(),
        "cpu_count": os.cpu_count(),
        **provenance.facts("cpu"),
        "threads_per_rank": 1,
        "backend": "gloo",
        "world_size": WORLD,
        "accumulation_steps": ACCUMULATION_STEPS,
        "quick": quick,
        "model": asdict(config.model),
        "params": numel,
        "param_dtype": "float32",
        "tokens_per_micro_batch": TOKENS,
        "weights": 1,
        "max_grad_norm": MAX_GRAD_NORM,
        "optimizer": f"SGD(lr={LR})",
        "float64_grad_norm": float64_norm,
        "warmup_windows": 1,
        "memory_window": memory,
        "timed_windows": config.timed_windows,
        "ddp_bucket_cap_mb": config.ddp_bucket_cap_mb,
        "gafused_bucket_bytes": config.gafused_bucket_bytes,
        "fp32_bound": FP32_BOUND,
        "bf16_bound": BF16_BOUND,
        "rank_environment": environment,
        "recipes": names,
        "seconds": time.perf_counter() - started,
        # Other work on the machine stretches wall times (not counts, bytes, memory or errors).
        "load_average_1min": [load_before, os.getloadavg()[0] if hasattr(os, "getloadavg") else None],
        "notes": (
            "per window. MB: payload handed to the collectives (all-reduce tensor, reduce-scatter input, "
            "all-gather output); sent MB: what each rank sends under a ring algorithm. peak: live tensor bytes on a "
            "rank over one window (exact: torch.profiler allocation events; the larger rank). Errors after the "
            "first window: ||p - p_ref|| / ||p_ref - p_0|| against a float64 run of it and against ddp. Plain "
            "FSDP2's clip_grad_norm_ reduces its norm through DTensor functional collectives, not counted."
        ),
    }
    return {"meta": meta, "rows": rows}


def default_out(args: argparse.Namespace) -> Path:
    """Where results go without ``--out``: the committed file only from the run that makes it (``--plain-fsdp2``, at
    full size, every default recipe, the memory window), the cache for every other run (module doc)."""
    if args.plain_fsdp2 and not (args.quick or args.recipes or args.no_memory):
        return DEFAULT_OUT
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gafused" / "bench"
    return cache / ("distributed-quick.json" if args.quick else "distributed-cpu.json")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a 2-layer GPT at hidden 64 (a few seconds)")
    parser.add_argument(
        "--out",
        type=Path,
        help=f"JSON file (default: {DEFAULT_OUT} for --plain-fsdp2 alone, else distributed-*.json in the cache)",
    )
    names = ", ".join(recipe.name for recipe in RECIPES)
    parser.add_argument("--recipes", help=f"comma-separated, from {names} (ddp always runs)")
    parser.add_argument("--plain-fsdp2", action="store_true", help="add plain FSDP2 (fsdp2, fsdp2-no_sync) rows")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory window (torch.profiler)")
    args = parser.parse_args(argv)
    names = None if args.recipes is None else args.recipes.split(",")
    if names is not None and not all(names):
        parser.error(f"--recipes: a comma-separated list of recipe names, got {args.recipes!r}")
    if args.plain_fsdp2:
        names = [*(names or [recipe.name for recipe in RECIPES if recipe.default]), "fsdp2", "fsdp2-no_sync"]
    unknown = set(names or ()) - {recipe.name for recipe in RECIPES}
    if unknown:
        parser.error(f"--recipes: unknown {sorted(unknown)}")
    args.out = args.out or default_out(args)
    provenance.check_out_option(parser, args.out, file=True)
    results = run(args.quick, names, memory=not args.no_memory)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    csv_path = args.out.with_suffix(".csv")
    _write_csv(results["rows"], csv_path, results["meta"])
    print(format_table(results))
    print(f"wrote {args.out} and {csv_path} ({results['meta']['seconds']:.0f} s)")
    failed = [row["recipe"] for row in results["rows"] if row["gafused"] and row["check"] != "ok"]
    failed += [row["recipe"] for row in results["rows"] if not row["counts_equal_every_window_and_rank"]]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
