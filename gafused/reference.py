"""Reference backend: the contracts of gafused.ops in plain PyTorch.

This is the oracle every other backend is tested against (``backend="reference"``; ``"auto"`` picks the
foreach backend on CPU). It is written for clarity, one segment at a time; speed is the other backends' job.
Every function works on a flat accumulation tensor ``acc`` and its layout (``offsets``, ``numels``): segment
``i`` is ``acc[offsets[i] : offsets[i] + numels[i]]``. Elements outside segments (alignment padding) are never
read or written.

Math happens in ``acc.dtype`` (float32, or float64 for float64 buffers): gradients are converted to it before
they are weighted, whatever their own dtype. One exception, on CPU: a middle fold of float64 gradients into a
float32 buffer is ``add_``'s type promotion, computed in float64 and rounded once into float32 (the foreach
backend on CPU does the same; triton, cuda and foreach off the CPU round the gradient first: they may differ by
one float32 ulp, and where the gradient itself is beyond float32's range, by more: inf against a finite product,
or 0 against a tiny one; a first fold rounds the gradient first everywhere). Sums of squares add in float64 and
round once to ``acc.dtype``.

On CPU, where reading a 0-d tensor costs no device sync (``_host_scalars``), a middle fold is one fused
``add_(grad, alpha=weight)`` pass and the non-finite check is skipped when the sums of squares show every
value finite; on other devices the rounding is exactly ``acc + (weight * grad)``, which the CUDA backend's
tests hold bit for bit.

Temporaries are segment-sized and live one segment at a time: a fold of float32 gradients on CPU allocates
none, gradients of another dtype are upcast into one first (inside ``add_``), the off-CPU fold builds
``weight * grad`` and the non-finite check, when it runs, builds masks of the segment. The foreach backend is
the one that bounds its temporaries (``gafused/foreach_backend.py``).
"""

from __future__ import annotations

import torch

from .buffer import check_layout

__all__ = ["fold_", "fold_finish_", "sum_of_squares", "scale_"]


def _host_scalars(device: torch.device) -> bool:
    """Whether reading a 0-d tensor of ``device`` costs no device sync (then the weight can be a Python number).

    The one place that picks the CPU path over the other devices' path; tests replace it to run the latter on CPU.
    """
    return device.type == "cpu"


def _segments(acc: torch.Tensor, offsets: list[int], numels: list[int]) -> list[torch.Tensor]:
    check_layout(offsets, numels, acc.numel())
    return [acc[start : start + numel] for start, numel in zip(offsets, numels, strict=True)]


def fold_(
    acc: torch.Tensor,
    grads: list[torch.Tensor | None],
    offsets: list[int],
    numels: list[int],
    weight: torch.Tensor,
    first: bool,
) -> None:
    """acc[seg] = (0 if first else acc[seg]) + weight * grads[i]; a missing grad contributes zero."""
    w = weight.to(acc.dtype)
    host_weight = w.item() if _host_scalars(acc.device) else None
    for segment, grad in zip(_segments(acc, offsets, numels), grads, strict=True):
        if grad is None:
            if first:
                segment.zero_()
            continue
        flat = grad.reshape(-1)
        if first:
            segment.copy_(flat)  # exact upcast, then one rounding: the same as (flat * w)
            segment.mul_(w)
        elif host_weight is not None:
            segment.add_(flat, alpha=host_weight)
        else:
            segment.add_(flat.to(acc.dtype) * w)


def fold_finish_(
    acc: torch.Tensor,
    grads: list[torch.Tensor | None],
    offsets: list[int],
    numels: list[int],
    weight: torch.Tensor,
    scale: torch.Tensor,
    first: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fold_``, then every segment *= scale; returns (sum of squares, any non-finite) of the result.

    The sum of squares has ``acc.dtype`` and the flag is a 0-d bool tensor, both on ``acc``'s device.
    """
    fold_(acc, grads, offsets, numels, weight, first)
    s = scale.to(acc.dtype)
    segments = _segments(acc, offsets, numels)
    for segment in segments:
        segment.mul_(s)
    return _sum_of_squares_and_flag(segments, acc)


def _sum_of_squares_and_flag(segments: list[torch.Tensor], acc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if not segments:
        return acc.new_zeros(()), torch.zeros((), dtype=torch.bool, device=acc.device)
    total = _per_segment_sum_of_squares(segments).sum().to(acc.dtype)
    if _host_scalars(acc.device) and bool(torch.isfinite(total)):
        # A finite sum of squares means every value is finite (inf squares to inf, nan propagates).
        return total, torch.zeros((), dtype=torch.bool, device=acc.device)
    nonfinite = torch.stack([(~torch.isfinite(segment)).any() for segment in segments]).any()
    return total, nonfinite


# Elements per piece of a segment's sum of squares: bounds the float64 copy each piece makes.
_SQUARES_PIECE = 1 << 22


def _per_segment_sum_of_squares(segments: list[torch.Tensor]) -> torch.Tensor:
    """Each segment's sum of squares, added in float64 piece by piece (float64; the callers round once).

    (A float32 sum drifts on long segments, by 4e-4 at 1e8 elements, and ``torch.dot`` past 2**31 elements adds
    one square at a time and stops growing; the oracle must be better than the kernels it checks.)
    """
    sums = []
    for segment in segments:
        total = torch.zeros((), dtype=torch.float64, device=segment.device)
        for piece in segment.split(_SQUARES_PIECE):
            wide = piece.double()
            total += torch.dot(wide, wide)
        sums.append(total)
    return torch.stack(sums)


def sum_of_squares(acc: torch.Tensor, offsets: list[int], numels: list[int], per_segment: bool) -> torch.Tensor:
    """Sum of squares of all segments (0-d), or of each segment (shape [len(offsets)]), in ``acc.dtype``."""
    segments = _segments(acc, offsets, numels)
    stacked = _per_segment_sum_of_squares(segments) if segments else acc.new_zeros((0,), dtype=torch.float64)
    return (stacked if per_segment else stacked.sum()).to(acc.dtype)


def scale_(
    acc: torch.Tensor,
    offsets: list[int],
    numels: list[int],
    coef: torch.Tensor,
    out: torch.Tensor | None,
) -> None:
    """Every segment times ``coef``, written into ``out`` (cast to its dtype) or, when ``out`` is None, into acc."""
    c = coef.to(acc.dtype)
    if out is None:
        for segment in _segments(acc, offsets, numels):
            segment.mul_(c)
        return
    for source, target in zip(_segments(acc, offsets, numels), _segments(out, offsets, numels), strict=True):
        torch.mul(source, c, out=target)  # computed in acc.dtype, rounded once into out.dtype
