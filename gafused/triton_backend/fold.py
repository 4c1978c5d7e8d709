"""Fold a micro-batch of gradients into the flat buffer, for every segment in one launch.

``_fold_kernel`` computes ``acc = (0 if FIRST else acc) + w * g`` over one block of one segment. With
FINISH (last micro-batch) the same pass also multiplies by the window scale and writes the block's sum
of squares and non-finite flag of the result, which ``norm.reduce_partials`` then reduces in a fixed
order. One launch per distinct gradient dtype (see ``_layout.grad_tables``); every launch covers all
blocks, and a block whose segment belongs to another launch does no memory traffic at all.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.graph import increment_version

from gafused.triton_backend._layout import (
    OTHER_LAUNCH,
    block_position,
    block_table,
    fold_num_warps,
    grad_tables,
    on_acc_device,
)
from gafused.triton_backend.norm import reduce_partials

__all__ = ["fold_", "fold_finish_"]

_OTHER_LAUNCH = tl.constexpr(OTHER_LAUNCH)


@triton.jit
def _fold_values(acc_ptrs, grad_ptrs, weight, scale_ptr, mask, grad_mask, has_grad, FIRST, FINISH, MASKED):
    """Fold one block and store it; returns the stored values (0 on lanes outside the segment).

    MASKED=False is the full-block path: no masks at all, so the compiler can issue 16-byte accesses.
    The rounding is the reference's: (0 or acc) + (grad * weight), then * scale, each rounded on its own
    (launches pass enable_fp_fusion=False, so no multiply-add is contracted into an fma)."""
    compute = acc_ptrs.dtype.element_ty
    if MASKED:
        grad = tl.load(grad_ptrs, mask=grad_mask, other=0.0).to(compute)
        # A missing gradient contributes nothing, even when the weight is inf or nan: its segment keeps
        # its values bit for bit (no "+ 0.0", which would turn -0.0 into +0.0).
        if FIRST:
            value = tl.where(has_grad, grad * weight, 0.0)
        else:
            old = tl.load(acc_ptrs, mask=mask, other=0.0)
            value = tl.where(has_grad, old + grad * weight, old)
    else:
        value = tl.load(grad_ptrs).to(compute) * weight
        if not FIRST:
            value = tl.load(acc_ptrs) + value
    if FINISH:
        value = value * tl.load(scale_ptr)
    if MASKED:
        tl.store(acc_ptrs, value, mask=mask)
        value = tl.where(mask, value, 0.0)
    else:
        tl.store(acc_ptrs, value)
    return value


@triton.jit
def _fold_kernel(
    acc_ptr,
    grad_base_ptr,
    grad_offset_ptr,
    block_segment_ptr,
    block_start_ptr,
    segment_offset_ptr,
    segment_numel_ptr,
    weight_ptr,
    scale_ptr,
    partial_ptr,
    flag_ptr,
    FIRST: tl.constexpr,
    FINISH: tl.constexpr,
    BLOCK: tl.constexpr,
    OFFSET_ALIGN: tl.constexpr,
    GRAD_ALIGN: tl.constexpr,
):
    block, segment, base, start, numel = block_position(
        block_segment_ptr, block_start_ptr, segment_offset_ptr, segment_numel_ptr, BLOCK, OFFSET_ALIGN
    )
    grad_offset = tl.load(grad_offset_ptr + segment)
    # Sentinels (negative) are NO_GRAD (this launch handles the segment without a gradient) and
    # OTHER_LAUNCH (a launch for another gradient dtype handles it).
    has_grad = grad_offset >= 0
    mine = grad_offset != _OTHER_LAUNCH
    # Scalar conditions shrink the segment's bound instead of joining the block mask: a block that is
    # not this launch's (or has no gradient to read) then masks every lane.
    limit = tl.where(mine, numel, 0)
    if not (FIRST or FINISH):
        # A middle micro-batch leaves a segment without a gradient untouched: no read, no write.
        limit = tl.where(has_grad, limit, 0)
    grad_limit = tl.where(has_grad, limit, 0)

    lanes = tl.arange(0, BLOCK)
    weight = tl.load(weight_ptr)
    acc_block_ptr = acc_ptr + base + start
    if start + BLOCK <= grad_limit:
        # A full block with a gradient of this launch: the offset is >= 0 here, so its alignment hint holds.
        grad_block_ptr = grad_base_ptr + tl.multiple_of(grad_offset, GRAD_ALIGN) + start
        value = _fold_values(
            acc_block_ptr + lanes, grad_block_ptr + lanes, weight, scale_ptr, None, None, has_grad,
            FIRST, FINISH, False,
        )  # fmt: skip
    else:
        index = start + lanes
        value = _fold_values(
            acc_block_ptr + lanes, grad_base_ptr + grad_offset + start + lanes, weight, scale_ptr,
            index < limit, index < grad_limit, has_grad, FIRST, FINISH, True,
        )  # fmt: skip

    if FINISH:
        nonfinite = (value != value) | (tl.abs(value) == float("inf"))
        tl.store(partial_ptr + block, tl.sum(value * value, axis=0), mask=mine)
        tl.store(flag_ptr + block, tl.max(nonfinite.to(tl.int32), axis=0).to(tl.uint8), mask=mine)


def _launch(
    acc: torch.Tensor,
    grads: list[torch.Tensor | None],
    offsets: list[int],
    numels: list[int],
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    first: bool,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    # Gradient counts, devices and element counts are gafused.ops.check_grads's job, done once per call upstream.
    table = block_table(acc, offsets, numels)
    finish = scale is not None
    weight = weight.to(device=acc.device, dtype=acc.dtype)
    scale = scale.to(device=acc.device, dtype=acc.dtype) if finish else weight
    partials = torch.empty(table.n_blocks if finish else 0, dtype=acc.dtype, device=acc.device)
    flags = torch.empty(table.n_blocks if finish else 0, dtype=torch.uint8, device=acc.device)
    if table.n_blocks:
        tables = grad_tables(acc, grads)
        for launch, base in enumerate(tables.bases):
            warps = fold_num_warps(table.num_warps, acc.element_size(), base.element_size())
            _fold_kernel[(table.n_blocks,)](
                acc,
                base,
                tables.table[launch],
                table.block_segment,
                table.block_start,
                table.segment_offset,
                table.segment_numel,
                weight,
                scale,
                partials,
                flags,
                FIRST=first,
                FINISH=finish,
                BLOCK=table.block_size,
                OFFSET_ALIGN=table.offset_align,
                GRAD_ALIGN=tables.aligns[launch],
                num_warps=warps,
                enable_fp_fusion=False,
            )
        del tables  # copies made for the launches: the stream orders their reuse after the kernels
        increment_version(acc)  # as a torch in-place op would: autograd then sees the write
    if not finish:
        return None
    total, flag = reduce_partials(partials, flags, table, per_segment=False)
    return total, flag


@on_acc_device
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
    _launch(acc, grads, offsets, numels, weight, None, first)


@on_acc_device
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
    result = _launch(acc, grads, offsets, numels, weight, scale, first)
    assert result is not None  # FINISH launches always measure
    return result
