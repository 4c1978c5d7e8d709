"""Work decomposition shared by the Triton kernels: block tables per layout, gradient tables per call.

Every kernel runs one program per *block*: a run of at most ``block_size`` elements inside one segment.
The block table maps a program id to its segment and to its start within that segment, so one launch
covers every segment of a buffer, however many there are, and alignment padding between segments is
never touched (each block masks at its segment's end). The table depends only on the layout, so it is
built once per (accumulation tensor, stream, offsets, numels) and cached beside that tensor.

Devices and streams: a Triton launch runs on torch's *current* CUDA device and that device's current stream,
not on the device of its arguments. Every op is therefore wrapped in ``on_acc_device``, so a buffer on
``cuda:1`` is worked on by ``cuda:1`` on its current stream (the stream that produced its gradients and that
queued its table copies) whichever device is current, as a torch op on that buffer would be.

Gradients are separate tensors. A launch reaches all gradients of one dtype through one base pointer
(the lowest-addressed gradient of that dtype) plus a per-segment int64 table of element offsets
``(grad.data_ptr() - base.data_ptr()) // itemsize``. That is plain pointer arithmetic inside the
kernel, so the same kernel code runs on a GPU and under TRITON_INTERPRET=1 on CPU tensors (where the
interpreter computes addresses over real host memory). The caching allocator hands a training loop the
same gradient addresses micro-batch after micro-batch, so the device copy of a table is kept for the
last few address patterns (per stream) and reused: a repeated pattern costs no host-to-device copy at all.
Recognizing the pattern is the per-gradient host cost of a launch, so gradients that come from
``gafused.ops.check_grads`` with a known layout (``CheckedGrads.shapes``: dtypes, strides and missing entries
as in an earlier call) are looked up by their addresses alone; any other list by address and dtype.

Both caches are kept per accumulation tensor (a bucket's ``data``), weakly keyed on it: a model cut into many
buckets folds them one after another every micro-batch, and one cache shared by all of them would evict each
bucket's tables before its next use once the buckets outnumber its entries. A dropped buffer takes its tables
with it.

Wide loads: a full block (every lane inside its segment) takes an unmasked path, and the kernels tell
the compiler how its addresses are aligned through ``tl.multiple_of`` hints. The alignments are
computed here on the host, as the largest power of two up to ``ALIGN_LIMIT`` elements that divides
every segment offset (``BlockTable.offset_align``; FlatGradBuffer aligns segments to 64 bytes) and
every gradient offset of a launch (``GradTables.aligns``), and passed as constexprs. A hint is a
promise: each one here is true of every program that reads through it.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import triton
import triton.language as tl

from .._tensor_cache import TensorKeyCache
from ..buffer import check_layout

R = TypeVar("R")

# Sentinels in a gradient table; real entries are element offsets >= 0 from the launch's base pointer.
NO_GRAD = -1  # the segment has no gradient: handled (zeroed / scaled / measured) by the first launch
OTHER_LAUNCH = -2  # the segment's gradient has another dtype: a different launch handles it

# Elements one program of the second (reduction) stage adds per loop iteration.
REDUCE_BLOCK = 1024

# Alignment hints stop at 16 elements: enough for 16-byte accesses of every dtype here (4 fp32, 8 bf16), and few
# enough distinct values that kernels compile only a handful of variants.
ALIGN_LIMIT = 16

# Per accumulation tensor: gradient tables kept per address pattern (see grad_tables), a few to cover loops that
# alternate between patterns; block tables kept per (stream, layout), one per stream in practice.
GRAD_TABLE_CACHE_SIZE = 8
BLOCK_TABLE_CACHE_SIZE = 8


@triton.jit
def block_position(
    block_segment_ptr,
    block_start_ptr,
    segment_offset_ptr,
    segment_numel_ptr,
    BLOCK: tl.constexpr,
    OFFSET_ALIGN: tl.constexpr,
):
    """Where this program's block sits: (its block id, segment, segment's offset in acc, block's first element
    within the segment, segment length), all int64. Every kernel starts here. The offset is a multiple of
    OFFSET_ALIGN and the start of BLOCK (blocks are cut from each segment's start), which the hints pass on to
    the compiler so that full blocks load and store 16 bytes at a time."""
    block = tl.program_id(0).to(tl.int64)
    segment = tl.load(block_segment_ptr + block)
    base = tl.multiple_of(tl.load(segment_offset_ptr + segment), OFFSET_ALIGN)
    start = tl.multiple_of(tl.load(block_start_ptr + block), BLOCK)
    numel = tl.load(segment_numel_ptr + segment)
    return block, segment, base, start, numel


def alignment(values: list[int] | tuple[int, ...]) -> int:
    """The largest power of two up to ``ALIGN_LIMIT`` that divides every value (``ALIGN_LIMIT`` when empty)."""
    return math.gcd(ALIGN_LIMIT, *values)


@dataclass(frozen=True)
class BlockTable:
    """Program -> (segment, start within segment) for one layout, on the layout's device.

    Attributes:
        block_size: elements per block (a power of two), also the kernels' BLOCK.
        offset_align: ``alignment(offsets)``, the kernels' OFFSET_ALIGN.
        num_warps: warps per program for the elementwise kernels.
        n_blocks: number of blocks, the grid of the elementwise kernels (0 when every segment is empty).
        block_segment: int64 [n_blocks], segment of each block.
        block_start: int64 [n_blocks], first element of each block, relative to its segment's start.
        segment_offset: int64 [n_segments], start of each segment in the flat buffer.
        segment_numel: int64 [n_segments], elements of each segment.
        segment_first_block: int64 [n_segments + 1], blocks of segment i are
            ``segment_first_block[i] : segment_first_block[i + 1]`` (blocks are ordered by segment).
    """

    block_size: int
    offset_align: int
    num_warps: int
    n_blocks: int
    block_segment: torch.Tensor
    block_start: torch.Tensor
    segment_offset: torch.Tensor
    segment_numel: torch.Tensor
    segment_first_block: torch.Tensor


def launch_config(numels: tuple[int, ...], itemsize: int = 4) -> tuple[int, int]:
    """(block size, warps) for a layout: a small heuristic keyed on the buffer's size.

    Small buffers get small blocks so that few lanes are masked off; large ones get 16 KB blocks (4096 fp32 or
    2048 fp64 elements per program), enough work per program to stream at memory bandwidth. Blocks are cut by
    bytes, not elements, because 4096 fp64 elements per program spill registers on sm_80 with Triton 3.6. The
    result depends only on the layout and dtype, so a layout's reductions always use the same blocks
    (determinism).

    Args:
        numels: elements of each segment.
        itemsize: bytes per element of the accumulation buffer.
    """
    total = sum(numels)
    if total >= 1 << 20:
        return 16384 // itemsize, 8
    return 1024, 4


def fold_num_warps(num_warps: int, acc_itemsize: int, grad_itemsize: int) -> int:
    """Warps of a fold launch over a layout whose ``launch_config`` gave ``num_warps``.

    16-bit gradients into a large fp32 buffer run 4 warps instead of 8 (same blocks, so twice the elements per
    thread): on an H200 that brought the bf16 folds from 87% to 98% (fold) and from 71% to 84% (fold_finish) of
    copy bandwidth at 4 GB (bench/NOTES.md, version 2). fp32 gradients stream as fast either way and keep 8, and
    fp64 buffers were not measured: both keep 8, which also keeps every variant free of register spills on sm_80
    and sm_90 (tests/test_triton_aot.py).
    """
    if num_warps == 8 and acc_itemsize == 4 and grad_itemsize == 2:
        return 4
    return num_warps


def _block_table(
    device: torch.device,
    itemsize: int,
    acc_numel: int,
    offsets: tuple[int, ...],
    numels: tuple[int, ...],
) -> BlockTable:
    check_layout(offsets, numels, acc_numel)
    block_size, num_warps = launch_config(numels, itemsize)
    numel_cpu = torch.tensor(numels, dtype=torch.int64)
    blocks_per_segment = (numel_cpu + block_size - 1) // block_size
    first_block = torch.zeros(len(numels) + 1, dtype=torch.int64)
    torch.cumsum(blocks_per_segment, dim=0, out=first_block[1:])
    n_blocks = int(first_block[-1])
    block_segment = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int64), blocks_per_segment)
    block_start = (torch.arange(n_blocks, dtype=torch.int64) - first_block[block_segment]) * block_size
    return BlockTable(
        block_size=block_size,
        offset_align=alignment(offsets),
        num_warps=num_warps,
        n_blocks=n_blocks,
        block_segment=_to_device(block_segment, device),
        block_start=_to_device(block_start, device),
        segment_offset=_to_device(torch.tensor(offsets, dtype=torch.int64), device),
        segment_numel=_to_device(numel_cpu, device),
        segment_first_block=_to_device(first_block, device),
    )


def on_acc_device(op: Callable[..., R]) -> Callable[..., R]:
    """Run ``op(acc, ...)`` with ``acc``'s CUDA device current (unchanged for CPU tensors): see the module docstring."""

    @functools.wraps(op)
    def run(acc: torch.Tensor, *args: Any, **kwargs: Any) -> R:
        with torch.cuda.device(acc.device) if acc.is_cuda else contextlib.nullcontext():
            return op(acc, *args, **kwargs)

    return run


def _stream_key(acc: torch.Tensor) -> int | None:
    # Device tables are cached per stream: a cached table is read only on the stream that allocated it, so its
    # launches are ordered after its copy, and the allocator, which reuses a freed block once that stream is past
    # it, frees an evicted table safely.
    return torch.cuda.current_stream(acc.device).stream_id if acc.is_cuda else None


# A cached gradient table: (index into grads of each launch's base, -1 for acc; device table; alignments).
_GradEntry = tuple[tuple[int, ...], torch.Tensor, tuple[int, ...]]


@dataclass(frozen=True)
class _ByAddress:
    """Gradient tables of one known layout (a ``CheckedGrads.shapes`` list, held here so that it is never reused
    for another layout), by (stream, addresses of the ``present`` gradients): with dtypes, strides and missing
    entries fixed by the layout, the addresses alone determine the table. Replaced whole, never changed in place,
    so a thread that looked it up keeps a consistent (layout, entries) pair."""

    layout: list
    present: list[int]  # the indices of the layout's non-empty gradients
    entries: OrderedDict[tuple, _GradEntry] = field(default_factory=OrderedDict)


@dataclass
class _Cached:
    """The tables cached for one accumulation tensor (see the module docstring).

    Attributes:
        blocks: block tables by (stream, acc's numel, offsets, numels).
        grads: gradient tables by (stream, then per gradient: None, or its address and dtype).
        by_address: the same entries, for gradients of the last known layout, by address alone; or None.
    """

    blocks: OrderedDict[tuple, BlockTable] = field(default_factory=OrderedDict)
    grads: OrderedDict[tuple, _GradEntry] = field(default_factory=OrderedDict)
    by_address: _ByAddress | None = None


_cached: TensorKeyCache[_Cached] = TensorKeyCache()


def _cached_for(acc: torch.Tensor) -> _Cached:
    cached = _cached.get(acc)
    if cached is None:
        cached = _cached[acc] = _Cached()
    return cached


def _remember(cache: OrderedDict, key: tuple, value: Any, size: int) -> None:
    cache[key] = value
    if len(cache) > size:
        cache.popitem(last=False)


def _recall(cache: OrderedDict, key: tuple) -> Any:
    """The cached value (marked most recently used) or None. pop-then-insert: no KeyError if another thread
    evicted the entry between a lookup and a move."""
    value = cache.pop(key, None)
    if value is not None:
        cache[key] = value
    return value


def block_table(acc: torch.Tensor, offsets: list[int], numels: list[int]) -> BlockTable:
    """The cached block table of this layout on ``acc``'s device (built and checked on first use)."""
    cache = _cached_for(acc).blocks
    layout = (tuple(offsets), tuple(numels))
    key = (_stream_key(acc), acc.numel(), *layout)  # a tensor's dtype is fixed; resize_ could change its numel
    table = _recall(cache, key)
    if table is None:
        table = _block_table(acc.device, acc.element_size(), acc.numel(), *layout)
        _remember(cache, key, table, BLOCK_TABLE_CACHE_SIZE)
    return table


def _to_device(table: torch.Tensor | list[list[int]], device: torch.device) -> torch.Tensor:
    """An int64 host table on ``device``; on a GPU the copy is queued without the host waiting for it."""
    table = torch.as_tensor(table, dtype=torch.int64)
    if device.type == "cuda":
        # Pinned source + non_blocking: the copy is queued on the stream and the host does not wait (a copy from
        # pageable memory would wait for the stream to finish everything queued before it).
        return table.pin_memory().to(device, non_blocking=True)
    return table.to(device)


@dataclass(frozen=True)
class GradTables:
    """How the launches of one call reach the gradients.

    Attributes:
        bases: ``bases[k]`` is the tensor whose address launch ``k`` adds its offsets to.
        table: int64 [launches, segments] on the device: element offsets from the launch's base, or
            ``NO_GRAD`` / ``OTHER_LAUNCH``.
        aligns: ``aligns[k]`` is ``alignment`` of launch ``k``'s offsets, the fold kernel's GRAD_ALIGN.
        keep_alive: copies made for the call (non-contiguous or misaligned gradients), to hold until the
            launches are queued.
    """

    bases: list[torch.Tensor]
    table: torch.Tensor
    aligns: list[int]
    keep_alive: list[torch.Tensor]


def grad_tables(acc: torch.Tensor, grads: list[torch.Tensor | None]) -> GradTables:
    """Group gradients by dtype, one launch per group, and give each launch its table of offsets.

    Segments without a gradient (or with no elements) are handled by launch 0; when no segment has a
    gradient there is one launch whose base is ``acc`` itself, never read through. Gradients must be on
    ``acc``'s device with the segments' element counts (``gafused.ops.check_grads`` makes sure of both).
    """
    cached = _cached_for(acc)
    layout = getattr(grads, "shapes", None)  # set by gafused.ops.check_grads: one list object per layout
    known = None
    if layout is not None:
        known = cached.by_address
        if known is None or known.layout is not layout:
            present = [index for index, shape in enumerate(layout) if shape is not None and shape.numel()]
            known = cached.by_address = _ByAddress(layout, present)
        address_key = (_stream_key(acc), *[grads[index].data_ptr() for index in known.present])
        entry = _recall(known.entries, address_key)
        if entry is not None:  # cached only when nothing was copied: the bases are the gradients themselves
            return _tables(acc, grads, entry, [])
    tables, entry = _grad_tables(acc, grads, cached.grads)
    if known is not None and entry is not None:
        _remember(known.entries, address_key, entry, GRAD_TABLE_CACHE_SIZE)
    return tables


def _tables(
    acc: torch.Tensor, flat: list[torch.Tensor | None], entry: _GradEntry, keep_alive: list[torch.Tensor]
) -> GradTables:
    base_indices, table, aligns = entry
    bases = [acc if index < 0 else flat[index] for index in base_indices]
    return GradTables(bases, table, list(aligns), keep_alive)


def _grad_tables(
    acc: torch.Tensor, grads: list[torch.Tensor | None], cache: OrderedDict[tuple, _GradEntry]
) -> tuple[GradTables, _GradEntry | None]:
    """``grad_tables`` by address and dtype; also returns the entry for the given gradients' own addresses, or
    None when it made copies (their addresses are the copies', which may even hit an entry cached for earlier
    gradients that lived there)."""
    keep_alive: list[torch.Tensor] = []
    flat: list[torch.Tensor | None] = []
    # Address pattern -> entry. The key holds only integers and dtypes, never tensors, so a cached entry keeps no
    # gradient alive.
    key: list[object] = [_stream_key(acc)]
    for grad in grads:
        if grad is None or grad.numel() == 0:
            flat.append(None)
            key.append(None)
            continue
        if not grad.is_contiguous() or grad.data_ptr() % grad.element_size():
            # An element offset from the base must be exact; a contiguous copy is aligned to its dtype.
            grad = grad.contiguous() if not grad.is_contiguous() else grad.clone()
            keep_alive.append(grad)
        flat.append(grad)
        key.append(grad.data_ptr())
        key.append(grad.dtype)
    cache_key = tuple(key)
    entry = _recall(cache, cache_key)
    if entry is not None:
        return _tables(acc, flat, entry, keep_alive), None if keep_alive else entry

    groups: dict[torch.dtype, list[int]] = {}
    for index, grad in enumerate(flat):
        if grad is not None:
            groups.setdefault(grad.dtype, []).append(index)
    n_segments = len(grads)
    if not groups:
        base_indices: tuple[int, ...] = (-1,)
        rows = [[NO_GRAD] * n_segments]
        aligns: tuple[int, ...] = (ALIGN_LIMIT,)
    else:
        no_grad = [i for i, grad in enumerate(flat) if grad is None]
        indices, rows, align_list = [], [], []
        for group_index, members in enumerate(groups.values()):
            row = [OTHER_LAUNCH] * n_segments
            if group_index == 0:
                for i in no_grad:
                    row[i] = NO_GRAD
            base_index = min(members, key=lambda i: flat[i].data_ptr())
            base_ptr, itemsize = flat[base_index].data_ptr(), flat[base_index].element_size()
            for i in members:
                row[i] = (flat[i].data_ptr() - base_ptr) // itemsize
            indices.append(base_index)
            rows.append(row)
            align_list.append(alignment([row[i] for i in members]))
        base_indices, aligns = tuple(indices), tuple(align_list)
    entry = (base_indices, _to_device(rows, acc.device), aligns)
    if keep_alive:  # copies get new addresses every call: nothing to reuse
        return _tables(acc, flat, entry, keep_alive), None
    _remember(cache, cache_key, entry, GRAD_TABLE_CACHE_SIZE)
    return _tables(acc, flat, entry, keep_alive), entry
