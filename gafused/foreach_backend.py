"""Foreach backend: the gafused.ops contracts as ``torch._foreach_*`` ops over the segment views.

A multi-tensor op per step instead of a Python loop per segment: on CPU that is what makes a micro-step over
thousands of small parameters cost about one ``torch._foreach_add_``; on a GPU without the fused backends it is
a few multi-tensor launches per op instead of several launches per parameter. The reference backend stays the
oracle; this one is tested against it.

Agreement with the reference (``gafused/reference.py``):
- ``fold_``, ``scale_``: bitwise (a nan may carry another sign or payload). On CPU a middle fold is
  ``add_(grad, alpha=weight)`` per segment, as the reference's CPU path (neighbouring small segments take one
  ``add_`` of their concatenated gradients over their run of the buffer: the same add per element,
  ``SMALL_SEGMENT_BYTES``); elsewhere the weight stays on the device and the rounding is ``acc + (grad * weight)``
  with the product in the buffer's dtype, as the reference's device path.
- sums of squares: 2-norms are computed in float64 and squared there, as the reference adds its squares in
  float64: per segment when asked for per segment; for the total, per run of segments (below; on CPU a float32
  buffer's runs in pieces of at most half its longest segment, or of 256 elements). For a float32 buffer the results
  are within a few float32 ulps of each other; for a float64 one they are float64 sums in different orders, apart by
  their rounding, which grows with the element count (27 float64 ulps for a million normal values).
  They are deterministic: the same inputs give the same bits.

Segment views are made once per buffer and kept (a view per segment costs more host time than the add it
feeds); they are shaped like the gradients of the call, which ``torch._foreach_*`` needs, and rebuilt only when
those shapes change. Ops that treat every element alike (the window scale, ``scale_``, a first fold's weight, the
total sum of squares) take instead one view per run of segments that follow one another with no padding between
them (cut at ``RUN_ELEMENTS``, or at the longest segment where that is longer): segments whose sizes are multiples
of the alignment (most of a transformer's) make long runs, so those ops cost a few tensors per buffer instead of
one per parameter, and padding is never read or written. Gradients from ``gafused.ops.check_grads`` carry their
shapes, shared by every call with the same layout, so most calls see by identity that the views still fit.

Memory: folds and scales work in place. What needs a temporary (a gradient converted to the buffer's dtype on CPU,
the weighted products off the CPU, the float64 copy a CPU norm makes, the products ``scale_`` casts into ``out``)
gets one of at most ``CHUNK_BYTES`` (``DEVICE_CHUNK_BYTES`` off the CPU) at a time, longer segments in pieces, so
the backend's peak memory stays within a few MB of the reference's whatever the model's size. On CPU the two made
at a window's end are smaller still: the products cast into ``out`` no longer than the buffer's longest segment (a
cast per segment makes that much), the float64 copies of the norm no bigger than it in bytes (either way, or than
``END_PIECE_BYTES``, 2 KB, where that is more), so a window's end costs no more than Megatron-style accumulation's,
whose peak is there too (``python bench/memory.py --quick``), but for those few KB on a model of small layers.
Scaling by 1 (a window not clipped) casts the runs into ``out`` with no product at all.
"""

from __future__ import annotations

import math

import torch

from ._tensor_cache import TensorKeyCache
from .buffer import check_layout

__all__ = ["fold_", "fold_finish_", "scale_", "sum_of_squares", "unavailable_reason"]

# The most bytes of temporaries alive at once (see the module docstring). Off the CPU each chunk of a middle fold
# costs a few launches, so chunks are larger there: a few MB would make a large model's fold launch-bound.
CHUNK_BYTES = 4 * 2**20
DEVICE_CHUNK_BYTES = 64 * 2**20
# On CPU the temporaries made at a window's end (the products scale_ casts into out, the float64 copies of the total
# norm) are kept to about the buffer's longest segment, so that end holds no more than Megatron-style accumulation's
# (module docstring), or to this many bytes where that is more: a model of small layers is then not cast or measured
# a call per segment, for a few KB.
END_PIECE_BYTES = 2048
# A run of segments (``_runs``) is cut into pieces of at most this many elements, or of the longest segment where
# that is longer: no tensor handed to an op is larger than both (a 32-bit element index covers each).
RUN_ELEMENTS = 2**30
# On CPU a middle fold adds the gradients of neighbouring small segments (at most this many bytes each in the buffer)
# with one ``torch.cat`` of them and one ``add_`` over their run of the buffer: torch's CPU foreach add is one op per
# tensor, whose dispatch costs more than adding a few KB (1024 gradients of 64 fp32 elements: 100 us against 360 us
# for ``torch._foreach_add_``), while above about 16 KB the copy that ``cat`` makes costs more than the op it saves.
SMALL_SEGMENT_BYTES = 8192
# On CPU a window's end takes the float64 norm of a piece of at least this many elements through one scratch tensor
# reused piece after piece (``_cpu_float64_norms``); smaller pieces, whose temporaries the allocator keeps, in one
# foreach call.
SCRATCH_ELEMENTS = 16384


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
        self._longer_than: dict[int, list[int]] = {}
        self.longest = max(self.numels, default=0)
        self.run_bounds = _runs(self.offsets, self.numels, max(self.longest, RUN_ELEMENTS))
        self.runs = _split_runs(acc.detach(), self.run_bounds)
        self._run_pieces: dict[int, list[torch.Tensor]] = {}
        # The small runs of a middle fold on CPU (``_small_runs``), for the gradient layout of ``small_runs_for``.
        self.small_runs_for: list[torch.Size | None] | None = None
        self.small_runs: _SmallRuns | None = None

    def longer_than(self, limit: int) -> list[int]:
        """Indices of the segments with more than ``limit`` elements (made once per limit)."""
        indices = self._longer_than.get(limit)
        if indices is None:
            indices = self._longer_than[limit] = [i for i, numel in enumerate(self.numels) if numel > limit]
        return indices

    def run_pieces(self, limit: int) -> list[torch.Tensor]:
        """``runs`` cut into pieces of at most ``limit`` elements (made once per limit)."""
        pieces = self._run_pieces.get(limit)
        if pieces is None:
            pieces = self._run_pieces[limit] = _cut_runs(self.runs, limit)
        return pieces


def _runs(offsets: list[int], numels: list[int], cap: int) -> list[tuple[int, int]]:
    """(start, elements) of each run of segments that follow one another with no padding between them, in order,
    cut into pieces of at most ``cap`` elements; runs without elements are left out. Elementwise ops and sums over
    all segments can take one view per run instead of one per segment: on CPU an op per tensor, so a layout of
    thousands of small segments (which need no padding when their sizes are multiples of the alignment) costs a few
    ops instead of thousands."""
    runs: list[tuple[int, int]] = []
    start = end = None
    for offset, numel in zip(offsets, numels, strict=True):
        if offset != end:
            if end is not None and end > start:
                runs.append((start, end - start))
            start = offset
        end = offset + numel
    if end is not None and end > start:
        runs.append((start, end - start))
    return [
        (begin, min(cap, start + numel - begin)) for start, numel in runs for begin in range(start, start + numel, cap)
    ]


def _split_runs(data: torch.Tensor, runs: list[tuple[int, int]]) -> list[torch.Tensor]:
    """1-D views of flat ``data`` over ``runs`` (``_runs``)."""
    return [data[start : start + numel] for start, numel in runs]


def _cut_runs(runs: list[torch.Tensor], limit: int) -> list[torch.Tensor]:
    """The 1-D ``runs`` cut into consecutive pieces of at most ``limit`` elements."""
    return [piece for run in runs for piece in run.split(limit)]


def _split(data: torch.Tensor, offsets: list[int], numels: list[int]) -> list[torch.Tensor]:
    """1-D views of the segments of flat ``data``: one split call, padding pieces dropped."""
    check_layout(offsets, numels, data.numel())
    sizes: list[int] = []
    cursor = 0
    for start, numel in zip(offsets, numels, strict=True):
        sizes.append(start - cursor)
        sizes.append(numel)
        cursor = start + numel
    sizes.append(data.numel() - cursor)
    return list(data.split_with_sizes(sizes)[1:-1:2])


# Keyed weakly by the accumulation tensor: a buffer that is dropped takes its views with it. The views are cut from
# a detached alias, which does not keep the tensor itself alive.
_views_cache: TensorKeyCache[_Views] = TensorKeyCache()


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


def _chunk_elements(device: torch.device, bytes_per_element: int) -> int:
    """How many elements a chunk may hold when each needs ``bytes_per_element`` bytes of temporaries."""
    budget = CHUNK_BYTES if device.type == "cpu" else DEVICE_CHUNK_BYTES
    return max(1, budget // bytes_per_element)


def _end_piece_elements(views: _Views, acc: torch.Tensor, bytes_per_element: int) -> int:
    """How many elements a piece of a window's end may hold on CPU when each needs ``bytes_per_element`` bytes of
    temporaries: no more bytes than the longest segment holds in ``acc`` (or END_PIECE_BYTES), within a chunk."""
    most = max(views.longest * acc.element_size(), END_PIECE_BYTES) // bytes_per_element
    return min(_chunk_elements(acc.device, bytes_per_element), max(1, most))


def _chunks(tensors: list[torch.Tensor], limit: int) -> list[slice]:
    """Consecutive ranges of ``tensors`` of at most ``limit`` elements (a bigger tensor gets a range of its own)."""
    ranges, start, total = [], 0, 0
    for index, tensor in enumerate(tensors):
        if total and total + tensor.numel() > limit:
            ranges.append(slice(start, index))
            start, total = index, 0
        total += tensor.numel()
    ranges.append(slice(start, len(tensors)))
    return ranges


def _cut(
    segments: list[torch.Tensor], others: list[torch.Tensor | None], indices: list[int], limit: int
) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """``segments`` and ``others`` (equal element counts, pair by pair) with each pair at ``indices`` cut into flat
    pieces of at most ``limit`` elements, the same cuts in both; a None in ``others`` stays one entry."""
    if not indices:
        return segments, others
    cut_segments: list[torch.Tensor] = []
    cut_others: list[torch.Tensor | None] = []
    start = 0
    for index in indices:
        cut_segments += segments[start:index]
        cut_others += others[start:index]
        segment, other = segments[index], others[index]
        if other is None:
            cut_segments.append(segment)
            cut_others.append(None)
        else:
            flat_segment, flat_other = segment.reshape(-1), other.reshape(-1)
            for begin in range(0, flat_segment.numel(), limit):
                cut_segments.append(flat_segment[begin : begin + limit])
                cut_others.append(flat_other[begin : begin + limit])
        start = index + 1
    cut_segments += segments[start:]
    cut_others += others[start:]
    return cut_segments, cut_others


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
    w = weight.to(acc.dtype)
    if first:
        if views.missing:
            torch._foreach_zero_([segment for segment, grad in zip(segments, grads, strict=True) if grad is None])
            segments, grads = _present(segments, grads)
        # An exact upcast, then one rounding: the same as (grad * w). One copy per gradient dtype: torch's
        # multi-tensor copy takes its one-launch path only when every source has the same dtype.
        for indices in _by_dtype(grads).values():
            torch._foreach_copy_([segments[i] for i in indices], [grads[i] for i in indices])
        # Without a missing gradient the runs cover exactly the segments just written (with one, the zeros written
        # stay zeros whatever the weight, as the reference writes them); no elements, nothing to multiply.
        weighted = segments if views.missing else views.runs
        if weighted:
            torch._foreach_mul_(weighted, w)
    elif _host_scalars(acc.device):
        # add_ converts a gradient of another dtype into a temporary as large as the gradient: long ones in pieces.
        # A float64 gradient into a float32 buffer is added in float64: the buffer's piece and the sum converted too,
        # 16 bytes per element (looked for among the segments long enough to need cutting at that rate only).
        wide_limit = _chunk_elements(acc.device, 16)
        wide = acc.dtype == torch.float32 and any(
            grads[i] is not None and grads[i].dtype == torch.float64 for i in views.longer_than(wide_limit)
        )
        limit = wide_limit if wide else _chunk_elements(acc.device, acc.element_size())
        converted = [i for i in views.longer_than(limit) if grads[i] is not None and grads[i].dtype != acc.dtype]
        alpha = w.item()
        small = _small_runs(views, grads, acc)
        if small is not None:
            # The same add_ per element, over a run of the buffer at once (SMALL_SEGMENT_BYTES): the same bits.
            for target, start, stop in small.runs:
                target.add_(torch.cat(grads[start:stop]), alpha=alpha)
            segments, grads = [segments[i] for i in small.rest], [grads[i] for i in small.rest]
            converted = [small.position[i] for i in converted]  # (a run's segments are never cut)
        segments, grads = _cut(segments, grads, converted, limit)
        if views.missing:
            segments, grads = _present(segments, grads)
        if grads:
            torch._foreach_add_(segments, grads, alpha=alpha)
    else:
        limit = _chunk_elements(acc.device, acc.element_size())  # a product per element, in acc's dtype
        segments, grads = _cut(segments, grads, views.longer_than(limit), limit)
        if views.missing:
            segments, grads = _present(segments, grads)
        for part in _chunks(grads, limit) if grads else ():
            # The weight stays on the device: products in acc's dtype, then one add.
            products = _products(grads[part], segments[part], w, acc)
            torch._foreach_add_(segments[part], products)
            del products  # before the next chunk's: one chunk of temporaries at a time


class _SmallRuns:
    """How a CPU middle fold adds the gradients of one layout: ``runs`` of neighbouring small segments, each a
    ``(target, start, stop)``: the buffer's elements of segments ``start`` to ``stop - 1`` (no padding between them,
    gradients of one dtype and one shape but the first dimension, so that ``torch.cat`` lays them end to end),
    shaped as their concatenation; ``rest``, the indices of the other segments, in order, and ``position``, where
    each of them is in ``rest``."""

    def __init__(self, runs: list[tuple[torch.Tensor, int, int]], rest: list[int]) -> None:
        self.runs = runs
        self.rest = rest
        self.position = {index: position for position, index in enumerate(rest)}


def _small_runs(views: _Views, grads: list[torch.Tensor | None], acc: torch.Tensor) -> _SmallRuns | None:
    """The small runs of a CPU middle fold of ``grads`` (``_SmallRuns``), or None where there are none or the layout
    is not known: made once per layout, that of gradients from ``gafused.ops.check_grads`` whose ``shapes`` list is
    the one the views were last shaped for (its gradients' dtypes and missing entries are the same on every call
    with that list); other gradient lists are added per segment."""
    known = getattr(grads, "shapes", None)  # (``_shaped_like`` has just made it ``views.shapes``)
    if known is None:
        return None
    if views.small_runs_for is known:
        return views.small_runs
    small_numel = SMALL_SEGMENT_BYTES // acc.element_size()
    data = acc.detach()
    runs: list[tuple[torch.Tensor, int, int]] = []
    rest: list[int] = []
    # The open run: segments start..index-1, ending at element end, gradients of dtype and of shapes [*, *inner].
    start = end = dtype = inner = None
    total = limit = 0

    def close(stop: int) -> None:
        if start is None:
            return
        if stop - start > 1:
            runs.append((data[views.offsets[start] : end].view(-1, *inner), start, stop))
        else:
            rest.append(start)

    for index, (grad, shape, offset, numel) in enumerate(zip(grads, known, views.offsets, views.numels, strict=True)):
        if grad is None or numel == 0 or numel > small_numel or len(shape) == 0:
            close(index)
            start = None
            rest.append(index)
            continue
        if (
            start is not None
            and offset == end
            and grad.dtype == dtype
            and shape[1:] == inner
            and total + numel <= limit
        ):
            end, total = offset + numel, total + numel
            continue
        close(index)
        start, end, dtype, inner, total = index, offset + numel, grad.dtype, shape[1:], numel
        # The run's temporaries: the concatenated gradients, in another dtype also what add_ converts: the gradients
        # into the buffer's dtype, or for float64 gradients into a float32 buffer the buffer's run and the sum in
        # float64 (8 + 16 bytes an element). Another dtype counts at least 16 bytes an element, the middle fold's
        # least limit for cutting a converted gradient, so a run's segments are never cut.
        limit = _chunk_elements(
            acc.device, grad.element_size() if dtype == acc.dtype else 24 if dtype == torch.float64 else 16
        )
    close(len(grads))
    small = _SmallRuns(runs, rest) if runs else None
    views.small_runs_for, views.small_runs = known, small
    return small


def _by_dtype(tensors: list[torch.Tensor]) -> dict[torch.dtype, list[int]]:
    """The indices of ``tensors``, grouped by dtype (in order of first appearance)."""
    groups: dict[torch.dtype, list[int]] = {}
    for index, tensor in enumerate(tensors):
        groups.setdefault(tensor.dtype, []).append(index)
    return groups


def _products(
    grads: list[torch.Tensor], segments: list[torch.Tensor], w: torch.Tensor, acc: torch.Tensor
) -> list[torch.Tensor]:
    """``grad * w`` in ``acc``'s dtype for each gradient, as new tensors (``segments`` give their shapes).

    A gradient of another dtype is first upcast, exactly, into a temporary: one multi-tensor copy per source dtype
    (torch's copy takes its one-launch path only when the sources share a dtype), not a conversion per gradient;
    the temporaries are then multiplied in place. Gradients of ``acc``'s dtype are multiplied directly.
    """
    groups = _by_dtype(grads)
    if list(groups) == [acc.dtype]:
        return torch._foreach_mul(grads, w)
    products: list[torch.Tensor] = list(grads)  # every entry is replaced below
    upcast: list[torch.Tensor] = []
    for dtype, indices in groups.items():
        sources = [grads[i] for i in indices]
        if dtype == acc.dtype:
            made = torch._foreach_mul(sources, w)
        else:
            made = _temporaries([segments[i] for i in indices], acc)
            torch._foreach_copy_(made, sources)
            upcast += made
        for index, tensor in zip(indices, made, strict=True):
            products[index] = tensor
    torch._foreach_mul_(upcast, w)
    return products


def _temporaries(like: list[torch.Tensor], acc: torch.Tensor) -> list[torch.Tensor]:
    """Uninitialized tensors shaped like ``like`` (contiguous tensors), in ``acc``'s dtype and device, cut from one
    allocation.

    One ``as_strided`` per tensor: half the host time of splitting the allocation and viewing each piece in shape
    (two calls per tensor), which a middle fold of many small gradients pays on every call.
    """
    sizes = [tensor.numel() for tensor in like]
    flat = torch.empty(sum(sizes), dtype=acc.dtype, device=acc.device)
    made, offset = [], 0
    for tensor, size in zip(like, sizes, strict=True):
        made.append(flat.as_strided(tensor.shape, tensor.stride(), offset))
        offset += size
    return made


def _present(
    segments: list[torch.Tensor], grads: list[torch.Tensor | None]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The segments that have a gradient, and those gradients."""
    pairs = [(segment, grad) for segment, grad in zip(segments, grads, strict=True) if grad is not None]
    return [segment for segment, _ in pairs], [grad for _, grad in pairs]


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
    views = _views(acc, offsets, numels)
    if views.runs:  # (no elements: nothing to scale; foreach ops refuse empty lists)
        torch._foreach_mul_(views.runs, scale.to(acc.dtype))
    total = _total_squares(views, acc)
    return total.to(acc.dtype), _nonfinite(views.runs, total, acc)


def _total_squares(views: _Views, acc: torch.Tensor) -> torch.Tensor:
    """The sum of squares of every segment, in float64 (0-d): the 2-norms of the runs (``_runs``) in float64,
    squared and summed; on CPU a float32 buffer's runs in pieces, since a float64 norm there first copies its
    input to float64."""
    if not views.runs:
        return torch.zeros((), dtype=torch.float64, device=acc.device)
    pieces = views.runs
    if acc.device.type == "cpu" and acc.dtype != torch.float64:
        # Pieces of at most half the longest segment (END_PIECE_BYTES at least): a piece's float64 copy is no
        # bigger than that segment, a temporary as large as a cast of one gradient makes (within CHUNK_BYTES too).
        # Folding at step() measures while the last micro-batch's gradients are still alive, so a bigger copy would
        # raise the window's peak.
        pieces = views.run_pieces(_end_piece_elements(views, acc, 8))
        return torch.stack(_cpu_float64_norms(pieces)).square().sum()
    return torch.stack(torch._foreach_norm(pieces, 2, dtype=torch.float64)).square().sum()


def _cpu_float64_norms(pieces: list[torch.Tensor]) -> list[torch.Tensor]:
    """The float64 2-norm of each CPU piece (not float64), in order: the small pieces' in one foreach call, the
    others' each copied into one float64 scratch tensor, made once per call and reused piece after piece (the same
    bits as a norm in float64 converting its input itself, which makes a new temporary per piece: one as large as
    ``SCRATCH_ELEMENTS`` and up often comes fresh from the OS, whose pages are then touched for the first time, while
    the scratch's are touched once per call)."""
    small, large = [], []
    for index, piece in enumerate(pieces):
        (large if piece.numel() >= SCRATCH_ELEMENTS else small).append(index)
    if not large:
        return list(torch._foreach_norm(pieces, 2, dtype=torch.float64))
    norms: list[torch.Tensor | None] = [None] * len(pieces)
    if small:
        small_norms = torch._foreach_norm([pieces[i] for i in small], 2, dtype=torch.float64)
        for index, norm in zip(small, small_norms, strict=True):
            norms[index] = norm
    scratch = torch.empty(max(pieces[index].numel() for index in large), dtype=torch.float64)
    for index in large:
        norms[index] = torch.linalg.vector_norm(scratch[: pieces[index].numel()].copy_(pieces[index]))
    return norms


def _squares(views: _Views, acc: torch.Tensor) -> torch.Tensor:
    """Per-segment sums of squares in float64, shape [number of segments]."""
    segments = views.flat
    if not segments:
        return torch.zeros(0, dtype=torch.float64, device=acc.device)
    if acc.device.type != "cpu" or acc.dtype == torch.float64:
        return torch.stack(torch._foreach_norm(segments, 2, dtype=torch.float64)).square()
    # A CPU norm in float64 first copies its whole input to float64: long segments in pieces.
    limit = _chunk_elements(acc.device, 8)
    long = views.longer_than(limit)
    if not long:
        return torch.stack(_cpu_float64_norms(segments)).square()
    pieces, _ = _cut(segments, segments, long, limit)
    squares = torch.stack(_cpu_float64_norms(pieces)).square()
    # Back to one value per segment: a long segment's pieces are consecutive; sum them in order.
    parts, start, piece = [], 0, 0
    for index in long:
        count = -(-views.numels[index] // limit)
        parts.append(squares[piece : piece + index - start])
        piece += index - start
        parts.append(squares[piece : piece + count].sum().reshape(1))
        piece += count
        start = index + 1
    parts.append(squares[piece:])
    return torch.cat(parts)


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
    views = _views(acc, offsets, numels)
    return (_squares(views, acc) if per_segment else _total_squares(views, acc)).to(acc.dtype)


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
    views = _views(acc, offsets, numels)
    c = coef.to(acc.dtype)
    if not views.runs:
        return
    if out is None:
        torch._foreach_mul_(views.runs, c)
        return
    if _host_scalars(acc.device) and c.item() == 1:
        # Times 1 is exact: one cast of each run into out, no product (the finished gradient of an unclipped window).
        torch._foreach_copy_(_split_runs(out, views.run_bounds), views.runs)
        return
    limit = _chunk_elements(acc.device, acc.element_size())
    if acc.device.type == "cpu":
        # No product longer than the longest segment (or END_PIECE_BYTES), which a cast per segment (the reference's
        # torch.mul(..., out=), which CPU computes into a temporary in acc's dtype) makes anyway.
        limit = _end_piece_elements(views, acc, acc.element_size())
    # out has acc's layout: the same runs, cut into the same pieces.
    segments = views.run_pieces(limit)
    targets = _cut_runs(_split_runs(out, views.run_bounds), limit)
    for part in _chunks(segments, limit):
        # The product in acc's dtype, then one cast into out's dtype: what torch.mul(..., out=target) rounds to.
        torch._foreach_copy_(targets[part], torch._foreach_mul(segments[part], c))
