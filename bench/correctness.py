"""Correctness: how far each accumulation recipe's gradient is from the big batch it stands for.

A small GPT (``e2e.TinyGPT``, no dropout) sees micro-batches of padded sequences whose loss-token counts differ a
lot, as variable-length text does. The truth is one big batch over the same sequences in float64 with the
token-mean loss (every loss token weighs the same, whichever micro-batch it sits in). Each recipe runs in float32
and is scored by the relative error of its finished gradient, ``||G - G_64|| / ||G_64||`` over all parameters.

Recipes:
- ``loss / N``: the usual PyTorch recipe, ``(loss / N).backward()`` per micro-batch, gradients summed in
  ``.grad``. It weighs every micro-batch alike, and divides by N even when fewer micro-batches came;
- ``gafused, weight 1``: ``GradAccumulator`` with the default weights: the plain mean of the micro-batch
  gradients, divided by the number of micro-batches that actually came;
- ``gafused, token weights``: ``opt.step(weight=loss_tokens)``: the token-weighted mean, the big batch's gradient;
- ``big batch``: one float32 backward over every sequence: the float32 rounding floor the others are held to.

Scenarios: a full window of N uneven micro-batches, and a partial window (the first N - 1 micro-batches, then
``flush()``, as at the end of an epoch; the ``loss / N`` recipe still divides by N there).
"""

from __future__ import annotations

import torch
from e2e import TinyGPT, TinyGPTConfig
from progress import ProgressFactory, open_bar
from providers import NoopOptimizer

import gafused

__all__ = ["RECIPES", "run_correctness", "format_correctness_table"]

RECIPES = ("loss / N", "gafused, weight 1", "gafused, token weights", "big batch")
_IGNORE = -100  # F.cross_entropy's ignore_index: padding that carries no loss
_N = 4
_SEQUENCES_PER_MICRO_BATCH = 2
# Loss tokens per sequence: micro-batch i holds sequences 2i and 2i+1 (totals 44, 21, 33, 14: a 3x spread).
_LOSS_TOKENS = (24, 20, 12, 9, 18, 15, 6, 8)
_CONFIG = TinyGPTConfig(vocab=64, hidden=32, layers=2, heads=2, seq_len=24, batch=8, accumulation_steps=_N)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(14)
    tokens = torch.randint(0, _CONFIG.vocab, (len(_LOSS_TOKENS), _CONFIG.seq_len + 1), generator=generator)
    inputs, targets = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    for row, count in enumerate(_LOSS_TOKENS):
        targets[row, count:] = _IGNORE
    return inputs, targets


def _micro_batches(inputs: torch.Tensor, targets: torch.Tensor, count: int):
    step = _SEQUENCES_PER_MICRO_BATCH
    return [(inputs[i * step : (i + 1) * step], targets[i * step : (i + 1) * step]) for i in range(count)]


def _model(dtype: torch.dtype) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(_CONFIG).to(dtype)


def _gradient(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1).double() for p in model.parameters()])


def _big_batch(dtype: torch.dtype, micro_batches) -> torch.Tensor:
    model = _model(dtype)
    inputs = torch.cat([x for x, _ in micro_batches])
    targets = torch.cat([y for _, y in micro_batches])
    model(inputs, targets).backward()  # mean over every loss token of the window: the token-mean loss
    return _gradient(model)


def _loss_over_n(micro_batches) -> torch.Tensor:
    model = _model(torch.float32)
    for x, y in micro_batches:
        (model(x, y) / _N).backward()
    return _gradient(model)


def _gafused(micro_batches, token_weights: bool) -> torch.Tensor:
    model = _model(torch.float32)
    opt = gafused.GradAccumulator(NoopOptimizer(model.parameters()), accumulation_steps=_N)
    for x, y in micro_batches:
        model(x, y).backward()
        opt.step(weight=int((y != _IGNORE).sum()) if token_weights else None)
        if not opt.stepped:
            opt.zero_grad()
    if not opt.stepped:
        opt.flush()
    return _gradient(model)  # after the finishing call p.grad holds the finished gradient


def run_correctness(progress: ProgressFactory | None = None) -> dict:
    """Relative error of every recipe in both scenarios; see the module docstring.

    Args:
        progress: the run's progress factory (see progress.py), or None.
    """
    inputs, targets = _batch()
    scenarios = [("uneven micro-batches, full window", _N), (f"partial window ({_N - 1} of {_N}), flushed", _N - 1)]
    results = []
    with open_bar(progress, "correctness (float64 truth)", total=len(scenarios) * (1 + len(RECIPES))) as bar:
        for label, count in scenarios:
            micro_batches = _micro_batches(inputs, targets, count)
            truth = _big_batch(torch.float64, micro_batches)
            bar.update()
            gradients = {
                "loss / N": lambda mb=micro_batches: _loss_over_n(mb),
                "gafused, weight 1": lambda mb=micro_batches: _gafused(mb, token_weights=False),
                "gafused, token weights": lambda mb=micro_batches: _gafused(mb, token_weights=True),
                "big batch": lambda mb=micro_batches: _big_batch(torch.float32, mb),
            }
            rows = []
            for recipe in RECIPES:
                error = float((gradients[recipe]() - truth).norm() / truth.norm())
                rows.append({"scenario": label, "recipe": recipe, "relative_error": error})
                bar.update()
            tokens = [int((y != _IGNORE).sum()) for _, y in micro_batches]
            results.append({"scenario": label, "loss_tokens_per_micro_batch": tokens, "rows": rows})
    parameters = sum(p.numel() for p in _model(torch.float32).parameters())
    return {"config": {**_CONFIG.__dict__, "parameters": parameters}, "scenarios": results}


def format_correctness_table(result: dict, indent: str = "") -> list[str]:
    """One line per recipe, one column per scenario."""
    scenarios = result["scenarios"]
    widths = [max(len(s["scenario"]), 12) for s in scenarios]
    header = "".join(f"  {s['scenario']:>{w}}" for s, w in zip(scenarios, widths, strict=True))
    lines = [f"{indent}{'recipe (float32)':<26}{header}"]
    for index, recipe in enumerate(RECIPES):
        cells = "".join(
            f"  {s['rows'][index]['relative_error']:>{w}.1e}" for s, w in zip(scenarios, widths, strict=True)
        )
        lines.append(f"{indent}{recipe:<26}{cells}")
    return lines
