"""Deterministic sum of squares: per-block partials, then one fixed-order reduction.

Stage 1 writes one partial per block (``_block_sum_of_squares_kernel`` here, or the fused fold kernel on
the last micro-batch). Stage 2 (``_reduce_partials_kernel``) adds the partials of a range of blocks in
a fixed order inside one program: no float atomics, so the same inputs give bitwise the same result on
every run. The block decomposition depends only on the layout, so the order does too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gafused.triton_backend._layout import REDUCE_BLOCK, BlockTable, block_position, block_table, on_acc_device

__all__ = ["reduce_partials", "sum_of_squares"]


@triton.jit
def _block_sum_of_squares_kernel(
    acc_ptr,
    block_segment_ptr,
    block_start_ptr,
    segment_offset_ptr,
    segment_numel_ptr,
    partial_ptr,
    BLOCK: tl.constexpr,
    OFFSET_ALIGN: tl.constexpr,
):
    block, _, base, start, numel = block_position(
        block_segment_ptr, block_start_ptr, segment_offset_ptr, segment_numel_ptr, BLOCK, OFFSET_ALIGN
    )
    lanes = tl.arange(0, BLOCK)
    pointers = acc_ptr + base + start + lanes
    if start + BLOCK <= numel:
        values = tl.load(pointers)  # a full block: no mask, 16-byte loads
    else:
        values = tl.load(pointers, mask=start + lanes < numel, other=0.0)
    values = values.to(partial_ptr.dtype.element_ty)
    tl.store(partial_ptr + block, tl.sum(values * values, axis=0))


@triton.jit
def _reduce_partials_kernel(
    partial_ptr,
    flag_ptr,
    range_ptr,
    n_partials,
    out_ptr,
    out_flag_ptr,
    PER_SEGMENT: tl.constexpr,
    HAS_FLAG: tl.constexpr,
    REDUCE: tl.constexpr,
):
    # One program per output: the whole range when global, blocks of one segment when per segment.
    program = tl.program_id(0).to(tl.int64)
    if PER_SEGMENT:
        low = tl.load(range_ptr + program)
        high = tl.load(range_ptr + program + 1)
    else:
        low = 0
        high = n_partials
    lanes = tl.arange(0, REDUCE).to(tl.int64)
    # Each lane adds n_partials / REDUCE values one after another (over a thousand for a 7B-parameter float32
    # buffer): in float32 that drifts by up to ~1e-5 relative, so lanes add in float64 and round once at the end.
    total = tl.zeros((REDUCE,), dtype=tl.float64)
    flag = tl.zeros((REDUCE,), dtype=tl.int32)
    for chunk in range(low, high, REDUCE):
        index = chunk + lanes
        mask = index < high
        total += tl.load(partial_ptr + index, mask=mask, other=0.0).to(tl.float64)
        if HAS_FLAG:
            flag = tl.maximum(flag, tl.load(flag_ptr + index, mask=mask, other=0).to(tl.int32))
    tl.store(out_ptr + program, tl.sum(total, axis=0).to(out_ptr.dtype.element_ty))
    if HAS_FLAG:
        tl.store(out_flag_ptr + program, tl.max(flag, axis=0).to(out_flag_ptr.dtype.element_ty))


def reduce_partials(
    partials: torch.Tensor, flags: torch.Tensor | None, table: BlockTable, per_segment: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stage 2: the fixed-order sum of the per-block ``partials`` (and the OR of ``flags``).

    Args:
        partials: [n_blocks] per-block sums of squares (the result's dtype).
        flags: [n_blocks] uint8 per-block non-finite flags, or None.
        table: the layout's block table (gives the blocks of each segment).
        per_segment: one sum per segment (shape [n_segments]) instead of a 0-d total.

    Returns:
        (sums, flag): ``flag`` is a 0-d bool tensor when ``flags`` is given (global only), else None.
    """
    n_segments = table.segment_numel.numel()
    shape = (n_segments,) if per_segment else ()
    if per_segment and flags is not None:
        raise ValueError("reduce_partials: per-segment flags are not supported")
    if table.n_blocks == 0:
        flag = None if flags is None else torch.zeros((), dtype=torch.bool, device=partials.device)
        return partials.new_zeros(shape), flag
    sums = partials.new_empty(shape)
    flag_out = torch.empty((), dtype=torch.uint8, device=partials.device) if flags is not None else None
    grid = (n_segments if per_segment else 1,)
    if grid[0]:
        _reduce_partials_kernel[grid](
            partials,
            flags if flags is not None else partials,
            table.segment_first_block,
            table.n_blocks,
            sums,
            flag_out if flag_out is not None else sums,
            PER_SEGMENT=per_segment,
            HAS_FLAG=flags is not None,
            REDUCE=REDUCE_BLOCK,
            num_warps=4,
            enable_fp_fusion=False,
        )
    return sums, None if flag_out is None else flag_out.view(torch.bool)


@on_acc_device
def sum_of_squares(acc: torch.Tensor, offsets: list[int], numels: list[int], per_segment: bool) -> torch.Tensor:
    """Sum of squares of all segments (0-d), or of each segment (shape [len(offsets)]), in ``acc.dtype``.

    Args:
        acc: flat accumulation buffer.
        offsets: start of each segment in ``acc``.
        numels: elements of each segment.
        per_segment: one value per segment instead of the total.
    """
    table = block_table(acc, offsets, numels)
    partials = torch.empty(table.n_blocks, dtype=acc.dtype, device=acc.device)
    if table.n_blocks:
        _block_sum_of_squares_kernel[(table.n_blocks,)](
            acc,
            table.block_segment,
            table.block_start,
            table.segment_offset,
            table.segment_numel,
            partials,
            BLOCK=table.block_size,
            OFFSET_ALIGN=table.offset_align,
            num_warps=table.num_warps,
            enable_fp_fusion=False,
        )
    sums, _ = reduce_partials(partials, None, table, per_segment)
    return sums
