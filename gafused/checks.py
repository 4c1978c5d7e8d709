"""What gradient accumulation cannot make equal to one big batch, found in a model before training.

``GradAccumulator`` makes the finished gradient the weighted mean of the micro-batch gradients, which is the
big-batch gradient exactly when each micro-batch's loss depends only on its own samples. Layers that look at
the whole batch break that premise: BatchNorm normalizes with each micro-batch's statistics, and dropout draws
new masks per micro-batch. ``check_model`` names such layers so the difference is a known choice, not a surprise.
"""

from __future__ import annotations

import warnings

import torch

__all__ = ["check_model"]

# Long models (a ResNet has dozens of BatchNorm layers) would drown the message; the count says the rest.
_NAMES_SHOWN = 5

_DROPOUT_TYPES = (
    torch.nn.Dropout,
    torch.nn.Dropout1d,
    torch.nn.Dropout2d,
    torch.nn.Dropout3d,
    torch.nn.AlphaDropout,
    torch.nn.FeatureAlphaDropout,
)


def _name_list(names: list[str]) -> str:
    shown = ", ".join(name or "<root>" for name in names[:_NAMES_SHOWN])
    rest = len(names) - _NAMES_SHOWN
    return shown if rest <= 0 else f"{shown} and {rest} more"


def _functional_dropout_rates(module: torch.nn.Module) -> list[str]:
    """Float attributes named like a dropout rate, valued in (0, 1], e.g. an attention module's ``attention_dropout``.

    Many attention implementations call ``torch.nn.functional.dropout`` with such a rate instead of holding an
    ``nn.Dropout`` module, so the module types alone would miss them.
    """
    found = []
    for attribute, value in vars(module).items():
        # A rate is a probability held as a float; an int named like one is a count or a seed, not a rate.
        if "dropout" not in attribute.lower() or not isinstance(value, float):
            continue
        if 0 < value <= 1:
            found.append(f"{attribute}={value:g}")
    return found


def check_model(model: torch.nn.Module, warn: bool = True) -> list[str]:
    """Name the layers whose training result differs between N micro-batches and one big batch.

    Found:

    - BatchNorm layers (``BatchNorm1d/2d/3d``, ``SyncBatchNorm``, lazy variants): in training mode they
      normalize with the mean and variance of the micro-batch they see, not of the whole window, and update
      their running statistics once per micro-batch. The accumulated gradient is therefore not the big-batch
      gradient. ``GroupNorm`` or ``LayerNorm`` normalize per sample and accumulate exactly; ``SyncBatchNorm``
      widens the statistics across data-parallel ranks but still not across micro-batches.
    - Dropout, as modules with ``p > 0`` or as float attributes named ``*dropout*`` in (0, 1] (rates passed to
      ``torch.nn.functional.dropout``): each micro-batch draws its own masks. The expected gradient is the same
      as the big batch's, but no run is bit-for-bit comparable to one; set the rate to 0 (or call ``eval()``)
      when checking accumulation against a big batch.

    Layers are reported whatever their current mode, since a model built in eval mode usually trains later.
    Losses that compare samples within a batch (in-batch negatives, batch-level auxiliary losses such as a
    mixture-of-experts load balance) cannot be found by inspecting modules; they differ in the same way.

    Args:
        model: the module to inspect, with all its submodules.
        warn: also emit each finding as a ``UserWarning``.

    Returns:
        One message per kind of finding, each naming the layers; empty when accumulation over micro-batches
        equals the big batch for every per-sample loss.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    batch_norms: list[str] = []
    dropouts: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            batch_norms.append(name)
        if isinstance(module, _DROPOUT_TYPES) and module.p > 0:
            dropouts.append(f"{name or '<root>'} (p={module.p:g})")
        dropouts.extend(f"{name or '<root>'} ({rate})" for rate in _functional_dropout_rates(module))

    messages = []
    if batch_norms:
        messages.append(
            f"{len(batch_norms)} BatchNorm layer(s) ({_name_list(batch_norms)}) normalize each micro-batch with its "
            "own statistics and update their running statistics once per micro-batch, so accumulated gradients "
            "differ from a big batch's; GroupNorm or LayerNorm accumulate exactly, SyncBatchNorm shares statistics "
            "across ranks but not across micro-batches"
        )
    if dropouts:
        messages.append(
            f"dropout is active in {len(dropouts)} place(s) ({_name_list(dropouts)}): each micro-batch draws its "
            "own masks, so the accumulated gradient equals a big batch's only in expectation; set the rates to 0 "
            "to compare runs exactly"
        )
    if warn:
        for message in messages:
            warnings.warn(message, UserWarning, stacklevel=2)
    return messages
