"""End-to-end: one optimizer step of a GPT, big batch against micro-batches x N.

Four recipes reach the same global batch:
- ``big batch``: one forward/backward over the whole batch, ``clip_grad_norm_``, ``optimizer.step()``;
- ``plain accumulation``: N micro-batches with ``(loss / N).backward()`` accumulating in ``.grad``, then
  ``clip_grad_norm_`` and ``optimizer.step()`` (the PyTorch recipe);
- ``gafused`` (fold at step): N micro-batches with ``loss.backward(); acc.step(); acc.zero_grad()``;
- ``gafused backward`` (fold during backward): N micro-batches with ``acc.backward(loss); acc.step();
  acc.zero_grad()``, the loop that keeps peak memory at plain PyTorch's.

On a GPU the model is GPT-2 124M at sequence 1024, micro-batch 1, N = 8, under bf16 autocast with fp32 weights:
transformers' ``GPT2LMHeadModel`` from its default config (random init) when transformers is importable, else
``TinyGPT`` with the same shapes (the results name which). Each recipe gets a fresh model from the same seed and
a fresh AdamW. Times are per optimizer step; peak memory is ``torch.cuda.max_memory_allocated`` over one step on
GPU and is not measured on CPU (the process's peak RSS never goes down, so a delta over it would not be a
per-recipe number). That figure counts the caching allocator's blocks (requests rounded up to 512 bytes, and a
cached block handed out whole when the rest would be small), so two recipes' peaks can differ by a few MiB with
the same tensors alive; the peak of the bytes requested (``requested_bytes.all.peak`` of
``torch.cuda.memory_stats``) is kept beside it, free of that rounding.

Both peaks are reported net of the harness: what was allocated before the recipe's model was built (the timer's
256 MiB cache-flush buffer, the token batch) is subtracted, so ``peak_memory_mb`` is the recipe's own model,
optimizer state, accumulator and step. Not the allocation at the peak reset: that holds each recipe's persistent
state (gafused's buffer, AdamW's moments), which differs between recipes and belongs in the comparison. The raw
figures (``peak_memory_raw_mb``, ``peak_requested_raw_mb``) and what the harness held (``harness_mb``) are kept
beside them; results written before this change have only the raw figure, as ``peak_memory_mb``.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from progress import ProgressFactory, open_bar
from timing import Timer
from torch import nn

import gafused

__all__ = ["TinyGPTConfig", "TinyGPT", "HFGPT2", "Setup", "setup", "run_e2e"]


# A GPU window of the full model takes about half a second and its time varies by tens of ms between windows (5
# windows per recipe left every 20%-80% range overlapping the next): take at least this many per recipe.
E2E_MIN_REPS_GPU = 15


@dataclass(frozen=True)
class TinyGPTConfig:
    """Model and batch sizes of the end-to-end benchmark."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    seq_len: int
    batch: int
    accumulation_steps: int

    @property
    def micro_batch(self) -> int:
        return self.batch // self.accumulation_steps


class _Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln_2 = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.fc_proj = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(hidden, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, hidden // self.heads).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, seq, hidden))
        return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x))))


class TinyGPT(nn.Module):
    """A GPT-2-shaped decoder (learned positions, pre-LayerNorm blocks, head tied to the embedding)."""

    def __init__(self, config: TinyGPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab, config.hidden)
        self.wpe = nn.Embedding(config.seq_len, config.hidden)
        self.blocks = nn.ModuleList(_Block(config.hidden, config.heads) for _ in range(config.layers))
        self.ln_f = nn.LayerNorm(config.hidden)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        if logits.dtype in (torch.bfloat16, torch.float16):
            logits = logits.float()  # the loss in fp32 under autocast; a float64 model stays float64
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


class HFGPT2(nn.Module):
    """transformers' GPT2LMHeadModel from its default config (GPT-2 124M, random init), with TinyGPT's loss."""

    def __init__(self, config: TinyGPTConfig) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        hf_config = GPT2Config(
            vocab_size=config.vocab, n_positions=config.seq_len, n_embd=config.hidden, n_layer=config.layers,
            n_head=config.heads,
        )  # fmt: skip
        self.model = GPT2LMHeadModel(hf_config)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=tokens).logits.float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def _model_class(device: torch.device, mode: str) -> type[nn.Module]:
    """HFGPT2 for the GPU run when transformers is importable, else TinyGPT (same shapes)."""
    if device.type == "cuda" and mode != "quick":
        try:
            import transformers  # noqa: F401
        except ImportError:
            return TinyGPT
        return HFGPT2
    return TinyGPT


def config_for(device: torch.device, mode: str) -> TinyGPTConfig:
    """GPT-2 124M at sequence 1024, N = 8 on GPU; a small model on CPU, a tiny one in ``--quick``."""
    quick = mode == "quick"
    if device.type == "cuda" and not quick:
        return TinyGPTConfig(vocab=50257, hidden=768, layers=12, heads=12, seq_len=1024, batch=8, accumulation_steps=8)
    if quick:
        return TinyGPTConfig(vocab=512, hidden=64, layers=2, heads=2, seq_len=64, batch=4, accumulation_steps=4)
    return TinyGPTConfig(vocab=2048, hidden=128, layers=4, heads=4, seq_len=128, batch=4, accumulation_steps=4)


@dataclass
class Setup:
    """What every recipe of one end-to-end run shares: sizes, data, the model factory and the recipes.

    ``recipes`` holds (label, micro-batches per optimizer step, make_step); ``make_step(model, optimizer)`` returns a
    callable that runs one optimizer step (a whole window) and carries the gafused backend as ``.backend``.
    """

    config: TinyGPTConfig
    model_class: type[nn.Module]
    use_autocast: bool
    build: Callable[[], tuple[nn.Module, torch.optim.Optimizer]]
    recipes: list[tuple[str, int, Callable[..., Callable[[], None]]]]

    @property
    def model_name(self) -> str:
        """The model as results name it."""
        return "transformers GPT2LMHeadModel" if self.model_class is HFGPT2 else "TinyGPT"


def setup(device: torch.device, mode: str, max_grad_norm: float = 1.0, autocast: bool | None = None) -> Setup:
    """The model, data and recipes of an end-to-end run on ``device`` in ``mode`` (see ``config_for``); bf16
    autocast with fp32 weights when ``autocast`` says so (default: on a GPU only)."""
    device = torch.device(device)
    config = config_for(device, mode)
    generator = torch.Generator(device="cpu").manual_seed(0)
    tokens = torch.randint(0, config.vocab, (config.batch, config.seq_len + 1), generator=generator).to(device)
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    micro = config.micro_batch
    micro_batches = [(inputs[i : i + micro], targets[i : i + micro]) for i in range(0, config.batch, micro)]
    # GPU: fp32 master weights under bf16 autocast, the usual mixed-precision recipe. CPU: plain fp32.
    use_autocast = device.type == "cuda" if autocast is None else autocast

    def forward(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_autocast):
            return model(x, y)

    model_class = _model_class(device, mode)

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = model_class(config).to(device)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)

    def big_batch(model, optimizer) -> Callable[[], None]:
        def step() -> None:
            forward(model, inputs, targets).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step

    def plain_accumulation(model, optimizer) -> Callable[[], None]:
        def step() -> None:
            for x, y in micro_batches:
                (forward(model, x, y) / config.accumulation_steps).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step

    def with_gafused(model, optimizer, fold_in_backward: bool = False) -> Callable[[], None]:
        accumulator = gafused.GradAccumulator(optimizer, config.accumulation_steps, max_grad_norm=max_grad_norm)

        def step() -> None:
            for x, y in micro_batches:
                if fold_in_backward:
                    accumulator.backward(forward(model, x, y))
                else:
                    forward(model, x, y).backward()
                accumulator.step()
                accumulator.zero_grad()
            if not accumulator.stepped:
                raise RuntimeError("gafused: the window did not finish after accumulation_steps micro-batches")

        step.backend = accumulator.backend
        return step

    recipes = [
        (f"big batch {config.batch}", 1, big_batch),
        (f"plain: batch {micro} x accumulation {config.accumulation_steps}", config.accumulation_steps,
         plain_accumulation),
        (f"gafused: batch {micro} x accumulation {config.accumulation_steps}", config.accumulation_steps,
         with_gafused),
        (f"gafused backward: batch {micro} x accumulation {config.accumulation_steps}", config.accumulation_steps,
         functools.partial(with_gafused, fold_in_backward=True)),
    ]  # fmt: skip
    return Setup(config, model_class, use_autocast, build, recipes)


def _memory_now(device: torch.device) -> tuple[int, int | None]:
    """(bytes allocated, bytes requested) on ``device`` now; requested is None where the allocator has no count."""
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device), torch.cuda.memory_stats(device).get("requested_bytes.all.current")


def step_peak(step: Callable[[], None], device: torch.device, harness: tuple[int, int | None]) -> dict:
    """Peak memory of one call of ``step`` on a GPU, net of ``harness`` (``_memory_now`` before the recipe existed)
    and raw, in MiB (see the module doc)."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    requested = torch.cuda.memory_stats(device).get("requested_bytes.all.peak")
    harness_allocated, harness_requested = harness
    net_requested = None if requested is None or harness_requested is None else requested - harness_requested
    return {
        "peak_memory_mb": (peak - harness_allocated) / 2**20,
        "peak_requested_mb": None if net_requested is None else net_requested / 2**20,
        "peak_memory_raw_mb": peak / 2**20,
        "peak_requested_raw_mb": None if requested is None else requested / 2**20,
        "harness_mb": harness_allocated / 2**20,
    }


def run_e2e(
    device: torch.device,
    mode: str,
    timer: Timer,
    max_grad_norm: float = 1.0,
    progress: ProgressFactory | None = None,
    result: dict | None = None,
) -> dict:
    """Time one optimizer step of each recipe; returns the config and one row per recipe.

    Args:
        device: where the model trains.
        mode: "quick" (a tiny model, the smoke run), "default" or "full" (see ``config_for``).
        timer: the run's timer (its budget and repetitions apply to whole optimizer steps; on a GPU at least
            ``E2E_MIN_REPS_GPU`` of them).
        max_grad_norm: clip threshold of every recipe.
        progress: the run's progress factory (see progress.py), or None.
        result: filled in place and returned (``config`` first, then a ``rows`` entry per finished recipe), so a
            caller whose run is stopped part-way keeps the recipes that finished; a new dict by default.
    """
    device = torch.device(device)
    min_reps = E2E_MIN_REPS_GPU if device.type == "cuda" else None
    run = setup(device, mode, max_grad_norm)
    config = run.config
    result = {} if result is None else result
    result["config"] = {
        **config.__dict__,
        "parameters": sum(p.numel() for p in run.model_class(config).parameters()),
        "autocast_bf16": run.use_autocast,
        "model": run.model_name,
    }
    result["rows"] = rows = []
    bar = open_bar(progress, "end to end (training steps)", total=len(run.recipes))
    for label, accumulation, make_step in run.recipes:
        harness = _memory_now(device) if device.type == "cuda" else None
        model, optimizer = run.build()
        step = make_step(model, optimizer)
        timing = timer.measure(step, min_reps=min_reps)
        peaks = {"peak_memory_mb": None, "peak_requested_mb": None}
        if device.type == "cuda":
            peaks = step_peak(step, device, harness)
        rows.append(
            {
                "recipe": label,
                "accumulation_steps": accumulation,
                "backend": getattr(step, "backend", None),
                "ms_per_step": timing.median_ms,
                "q20_ms": timing.q20_ms,
                "q80_ms": timing.q80_ms,
                "reps": timing.reps,
                "samples_per_s": config.batch / (timing.median_ms * 1e-3),
                **peaks,
            }
        )
        del model, optimizer, step
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        bar.update()
    bar.close()
    return result
