"""Work decomposition shared by the Triton kernels: block tables per layout, gradient tables per call.

Every kernel runs one program per *block*: a run of at most ``block_size`` elements inside one segment.
The block table maps a program id to its segment and to its start within that segment, so one launch
covers every segment of a buffer, however many there are, and alignment padding between segments is
never touched (each block masks at its segment's end). The table depends only on the layout, so it is
built once per (device, offsets, numels) and cached.

Gradients are separate tensors. A launch reaches all gradients of one dtype through one base pointer
(the lowest-addressed gradient of that dtype) plus a per-segment int64 table of element offsets
``(grad.data_ptr() - base.data_ptr()) // itemsize``. That is plain pointer arithmetic inside the
kernel, so the same kernel code runs on a GPU and under TRITON_INTERPRET=1 on CPU tensors (where the
interpreter computes addresses over real host memory). The table is rebuilt on every call because the
gradients are new tensors each micro-batch: one small host-to-device copy, no synchronization.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Sentinels in a gradient table; real entries are element offsets >= 0 from the launch's base pointer.
NO_GRAD = -1  # the segment has no gradient: handled (zeroed / scaled / measured) by the first launch
OTHER_LAUNCH = -2  # the segment's gradient has another dtype: a different launch handles it

# Elements one program of the second (reduction) stage adds per loop iteration.
REDUCE_BLOCK = 1024


@triton.jit
def block_position(block_segment_ptr, block_start_ptr, segment_offset_ptr, segment_numel_ptr, BLOCK: tl.constexpr):
    """Where this program's block sits: (its block id, segment, segment's offset in acc, element indices within
    the segment, segment length), all int64. Every kernel starts here; masks are ``index < numel`` or tighter."""
    block = tl.program_id(0).to(tl.int64)
    segment = tl.load(block_segment_ptr + block)
    base = tl.load(segment_offset_ptr + segment)
    index = tl.load(block_start_ptr + block) + tl.arange(0, BLOCK).to(tl.int64)
    numel = tl.load(segment_numel_ptr + segment)
    return block, segment, base, index, numel


@dataclass(frozen=True)
class BlockTable:
    """Program -> (segment, start within segment) for one layout, on the layout's device.

    Attributes:
        block_size: elements per block (a power of two), also the kernels' BLOCK.
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
    num_warps: int
    n_blocks: int
    block_segment: torch.Tensor
    block_start: torch.Tensor
    segment_offset: torch.Tensor
    segment_numel: torch.Tensor
    segment_first_block: torch.Tensor


def launch_config(numels: tuple[int, ...]) -> tuple[int, int]:
    """(block size, warps) for a layout: a small heuristic keyed on the buffer's size.

    Small buffers get small blocks so that few lanes are masked off; large ones get 4096-element blocks
    (16 KB of fp32 per program), enough work per program to stream at memory bandwidth. The result
    depends only on the layout, so a layout's reductions always use the same blocks (determinism).
    """
    total = sum(numels)
    if total >= 1 << 20:
        return 4096, 8
    return 1024, 4


@functools.lru_cache(maxsize=64)
def _block_table(device: torch.device, acc_numel: int, offsets: tuple[int, ...], numels: tuple[int, ...]) -> BlockTable:
    if len(offsets) != len(numels):
        raise ValueError(f"offsets and numels must have the same length, got {len(offsets)} and {len(numels)}")
    for start, numel in zip(offsets, numels, strict=True):
        if start < 0 or numel < 0 or start + numel > acc_numel:
            raise ValueError(f"segment [{start}, {start + numel}) lies outside acc of {acc_numel} elements")
    block_size, num_warps = launch_config(numels)
    numel_cpu = torch.tensor(numels, dtype=torch.int64)
    blocks_per_segment = (numel_cpu + block_size - 1) // block_size
    first_block = torch.zeros(len(numels) + 1, dtype=torch.int64)
    torch.cumsum(blocks_per_segment, dim=0, out=first_block[1:])
    n_blocks = int(first_block[-1])
    block_segment = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int64), blocks_per_segment)
    block_start = (torch.arange(n_blocks, dtype=torch.int64) - first_block[block_segment]) * block_size
    return BlockTable(
        block_size=block_size,
        num_warps=num_warps,
        n_blocks=n_blocks,
        block_segment=block_segment.to(device),
        block_start=block_start.to(device),
        segment_offset=torch.tensor(offsets, dtype=torch.int64).to(device),
        segment_numel=numel_cpu.to(device),
        segment_first_block=first_block.to(device),
    )


def block_table(acc: torch.Tensor, offsets: list[int], numels: list[int]) -> BlockTable:
    """The cached block table of this layout on ``acc``'s device (built and checked on first use)."""
    return _block_table(acc.device, acc.numel(), tuple(offsets), tuple(numels))


def _to_device(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    table = torch.tensor(rows, dtype=torch.int64)
    if device.type == "cuda":
        # Pinned source + non_blocking: the copy is queued on the stream and the host does not wait.
        return table.pin_memory().to(device, non_blocking=True)
    return table.to(device)


def grad_tables(
    acc: torch.Tensor, grads: list[torch.Tensor | None]
) -> tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor]]:
    """Group gradients by dtype, one launch per group.

    Returns:
        (bases, table, keep_alive): ``bases[k]`` is the base pointer tensor of launch ``k``, ``table[k]``
        its int64 row of per-segment element offsets (or ``NO_GRAD`` / ``OTHER_LAUNCH``), and
        ``keep_alive`` the contiguous copies made here, to hold until the launches are queued.
        Segments without a gradient (or with no elements) are handled by launch 0; when no segment has
        a gradient there is one launch whose base is ``acc`` itself, never read through.
    """
    keep_alive: list[torch.Tensor] = []
    groups: dict[torch.dtype, list[int]] = {}
    flat: list[torch.Tensor | None] = []
    for index, grad in enumerate(grads):
        if grad is None or grad.numel() == 0:
            flat.append(None)
            continue
        if grad.device != acc.device:
            raise ValueError(f"grads[{index}] is on {grad.device}, acc on {acc.device}")
        if not grad.is_contiguous():
            grad = grad.contiguous()
            keep_alive.append(grad)
        if grad.data_ptr() % grad.element_size():
            # An element offset from the base must be exact; a copy is aligned to its dtype.
            grad = grad.clone()
            keep_alive.append(grad)
        flat.append(grad)
        groups.setdefault(grad.dtype, []).append(index)

    n_segments = len(grads)
    if not groups:
        return [acc], _to_device([[NO_GRAD] * n_segments], acc.device), keep_alive

    no_grad = [i for i, grad in enumerate(flat) if grad is None]
    bases: list[torch.Tensor] = []
    rows: list[list[int]] = []
    for group_index, members in enumerate(groups.values()):
        row = [OTHER_LAUNCH] * n_segments
        if group_index == 0:
            for i in no_grad:
                row[i] = NO_GRAD
        base = min((flat[i] for i in members), key=lambda t: t.data_ptr())
        base_ptr, itemsize = base.data_ptr(), base.element_size()
        for i in members:
            row[i] = (flat[i].data_ptr() - base_ptr) // itemsize
        bases.append(base)
        rows.append(row)
    return bases, _to_device(rows, acc.device), keep_alive
