"""Foreach backend: the gafused.ops contracts as ``torch._foreach_*`` ops over the segment views.

A multi-tensor op per step instead of a Python loop per segment: on CPU that is what makes a micro-step over
thousands of small parameters cost about one ``torch._foreach_add_``; on a GPU without the fused backends it is
a few multi-tensor launches per op instead of several launches per parameter. The reference backend stays the
oracle; this one is tested against it.

Agreement with the reference (``gafused/reference.py``):
- ``fold_``, ``scale_``: bitwise. On CPU a middle fold is ``add_(grad, alpha=weight)`` per segment, as the
  reference's CPU path; elsewhere the weight stays on the device and the rounding is ``acc + (grad * weight)``
  with the product in the buffer's dtype, as the reference's device path.
- sums of squares: the per-segment 2-norms are computed in float64 and squared there, so the result is within
  a few float32 ulps of the reference's float32 dot products (float64 buffers: within a few float64 ulps).
  They are deterministic: the same inputs give the same bits.

Segment views are made once per buffer and kept (a view per segment costs more host time than the add it
feeds); they are shaped like the gradients of the call, which ``torch._foreach_*`` needs, and rebuilt only when
those shapes change. Gradients from ``gafused.ops.check_grads`` carry their shapes, shared by every call with the
same layout, so most calls see by identity that the views still fit.
"""

from __future__ import annotations

import math

import torch
from torch.utils.weak import WeakTensorKeyDictionary

__all__ = ["fold_", "fold_finish_", "scale_", "sum_of_squares", "unavailable_reason"]

# Off the CPU, a middle fold needs the products weight * grad in the buffer's dtype before adding them; they
# are made this many elements at a time, so the extra memory stays bounded whatever the model's size.
DEVICE_CHUNK_ELEMENTS = 1 << 24


def unavailable_reason(device: torch.device) -> str | None:
    """Why these ops cannot run on ``device`` (None: torch's foreach ops run on every device torch supports).

    Args:
        device: the device of the buffer the ops would run on.
    """
    return None


class _Views:
    """Segment views of one accumulation tensor, for one layout."""

    def __init__(self, acc: torch.Tensor, offsets: list[int], numels: list[int]) -> None:
        self.data_ptr = acc.data_ptr()
        self.offsets = list(offsets)
        self.numels = list(numels)
        self.flat = _split(acc.detach(), offsets, numels)
        self.shapes: list[torch.Size | None] = []
        self.shaped: list[torch.Tensor] = []
        self.missing = False  # whether the gradients of ``shapes`` include None


def _split(data: torch.Tensor, offsets: list[int], numels: list[int]) -> list[torch.Tensor]:
    """1-D views of the segments of flat ``data``: one split call, padding pieces dropped."""
    sizes: list[int] = []
    cursor = 0
    for start, numel in zip(offsets, numels, strict=True):
        if start < cursor or numel < 0:
            raise ValueError("foreach backend: segments must be ordered, non-overlapping and of non-negative size")
        sizes.append(start - cursor)
        sizes.append(numel)
        cursor = start + numel
    if cursor > data.numel():
        raise ValueError(f"segment ending at {cursor} lies outside acc of {data.numel()} elements")
    sizes.append(data.numel() - cursor)
    return list(data.split_with_sizes(sizes)[1:-1:2])


# Keyed weakly by the accumulation tensor: a buffer that is dropped takes its views with it. The views are cut from
# a detached alias, which does not keep the tensor itself alive.
_views_cache: WeakTensorKeyDictionary = WeakTensorKeyDictionary()


def _views(acc: torch.Tensor, offsets: list[int], numels: list[int]) -> _Views:
    views = _views_cache.get(acc)
    if views is None or views.data_ptr != acc.data_ptr() or views.offsets != offsets or views.numels != numels:
        views = _views_cache[acc] = _Views(acc, offsets, numels)
    return views


def _shaped_like(views: _Views, grads: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """The segment views shaped like ``grads`` (a segment without a gradient stays 1-D); ``views.missing`` then says
    whether a gradient is None."""
    known = getattr(grads, "shapes", None)  # set by gafused.ops.check_grads: one list object per layout
    if known is not None and known is views.shapes:
        return views.shaped
    shapes = known if known is not None else [None if grad is None else grad.shape for grad in grads]
    if shapes != views.shapes:
        pairs = zip(views.flat, shapes, strict=True)
        views.shaped = [flat if shape is None else flat.view(shape) for flat, shape in pairs]
        views.missing = any(shape is None for shape in shapes)
    views.shapes = shapes
    return views.shaped


def _host_scalars(device: torch.device) -> bool:
    """Whether reading a 0-d tensor of ``device`` costs no device sync (then the weight can be a Python number)."""
    return device.type == "cpu"


def _chunks(grads: list[torch.Tensor], limit: int) -> list[slice]:
    """Consecutive ranges of ``grads`` of at most ``limit`` elements (a bigger gradient gets a range of its own)."""
    ranges, start, total = [], 0, 0
    for index, grad in enumerate(grads):
        if total and total + grad.numel() > limit:
            ranges.append(slice(start, index))
            start, total = index, 0
        total += grad.numel()
    ranges.append(slice(start, len(grads)))
    return ranges


def fold_(
    acc: torch.Tensor,
    grads: list[torch.Tensor | None],
    offsets: list[int],
    numels: list[int],
    weight: torch.Tensor,
    first: bool,
) -> None:
    """acc[seg] = (0 if first else acc[seg]) + weight * grads[i]; a missing grad contributes zero.

    Args:
        acc: flat accumulation buffer (float32 or float64), updated in place.
        grads: one gradient (any float dtype, the segment's number of elements) or None per segment.
        offsets: start of each segment in ``acc``.
        numels: elements of each segment.
        weight: 0-d tensor on ``acc``'s device, the micro-batch weight.
        first: overwrite instead of adding (a segment without a gradient is then written with zeros).
    """
    views = _views(acc, offsets, numels)
    segments = _shaped_like(views, grads)
    if views.missing:
        if first:
            torch._foreach_zero_([segment for segment, grad in zip(segments, grads, strict=True) if grad is None])
        segments = [segment for segment, grad in zip(segments, grads, strict=True) if grad is not None]
        grads = [grad for grad in grads if grad is not None]
    if not grads:
        return
    w = weight.to(acc.dtype)
    if first:
        torch._foreach_copy_(segments, grads)  # exact upcast, then one rounding: the same as (grad * w)
        torch._foreach_mul_(segments, w)
    elif _host_scalars(acc.device):
        torch._foreach_add_(segments, grads, alpha=w.item())
    else:
        for part in _chunks(grads, DEVICE_CHUNK_ELEMENTS):
            # The weight stays on the device: products in acc's dtype (upcast first), then one add.
            upcast = [grad if grad.dtype == acc.dtype else grad.to(acc.dtype) for grad in grads[part]]
            torch._foreach_add_(segments[part], torch._foreach_mul(upcast, w))


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

    Args:
        acc: as in ``fold_``.
        grads: as in ``fold_``.
        offsets: as in ``fold_``.
        numels: as in ``fold_``.
        weight: as in ``fold_``.
        scale: 0-d tensor on ``acc``'s device; every segment is scaled, with or without a gradient.
        first: as in ``fold_``.

    Returns:
        (sum of squares as a 0-d tensor of ``acc.dtype``, 0-d bool tensor), both on ``acc``'s device.
    """
    fold_(acc, grads, offsets, numels, weight, first)
    segments = _views(acc, offsets, numels).flat
    torch._foreach_mul_(segments, scale.to(acc.dtype))
    squares = _squares(segments, acc)
    total = squares.sum()
    return total.to(acc.dtype), _nonfinite(segments, total, acc)


def _squares(segments: list[torch.Tensor], acc: torch.Tensor) -> torch.Tensor:
    """Per-segment sums of squares in float64, shape [len(segments)]."""
    if not segments:
        return torch.zeros(0, dtype=torch.float64, device=acc.device)
    return torch.stack(torch._foreach_norm(segments, 2, dtype=torch.float64)).square()


def _nonfinite(segments: list[torch.Tensor], total: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """Whether any segment holds inf or nan, given ``total``, their float64 sum of squares."""
    if acc.dtype == torch.float32:
        # Squares of float32 values summed in float64 cannot overflow: the sum is finite exactly when every value is.
        return ~torch.isfinite(total)
    if _host_scalars(acc.device) and bool(torch.isfinite(total)):
        return torch.zeros((), dtype=torch.bool, device=acc.device)
    # float64 values can overflow their sum of squares: look at the largest magnitudes (nan propagates through max).
    nonempty = [segment for segment in segments if segment.numel()]
    if not nonempty:
        return torch.zeros((), dtype=torch.bool, device=acc.device)
    return ~torch.isfinite(torch.stack(torch._foreach_norm(nonempty, math.inf)).max())


def sum_of_squares(acc: torch.Tensor, offsets: list[int], numels: list[int], per_segment: bool) -> torch.Tensor:
    """Sum of squares of all segments (0-d), or of each segment (shape [len(offsets)]), in ``acc.dtype``.

    Args:
        acc: flat accumulation buffer.
        offsets: start of each segment in ``acc``.
        numels: elements of each segment.
        per_segment: one value per segment instead of the total.
    """
    squares = _squares(_views(acc, offsets, numels).flat, acc)
    return (squares if per_segment else squares.sum()).to(acc.dtype)


def scale_(
    acc: torch.Tensor,
    offsets: list[int],
    numels: list[int],
    coef: torch.Tensor,
    out: torch.Tensor | None,
) -> None:
    """Every segment times ``coef``, written into ``out`` (cast to its dtype) or, when ``out`` is None, into acc.

    Args:
        acc: flat accumulation buffer.
        offsets: start of each segment in ``acc``.
        numels: elements of each segment.
        coef: 0-d tensor on ``acc``'s device.
        out: None, or a contiguous flat tensor with ``acc``'s layout and any float dtype (acc is then unchanged).
    """
    segments = _views(acc, offsets, numels).flat
    c = coef.to(acc.dtype)
    if out is None:
        torch._foreach_mul_(segments, c)
        return
    targets = _split(out, offsets, numels)
    for part in _chunks(segments, DEVICE_CHUNK_ELEMENTS):
        # The product in acc's dtype, then one cast into out's dtype: what torch.mul(..., out=target) rounds to.
        torch._foreach_copy_(targets[part], torch._foreach_mul(segments[part], c))
