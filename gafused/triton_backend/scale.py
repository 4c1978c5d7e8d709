"""Scale every segment by a device scalar: in place, or cast into another flat tensor of the same layout."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.graph import increment_version

from gafused.triton_backend._layout import block_position, block_table, on_acc_device

__all__ = ["scale_"]


@triton.jit
def _scale_kernel(
    acc_ptr,
    out_ptr,
    block_segment_ptr,
    block_start_ptr,
    segment_offset_ptr,
    segment_numel_ptr,
    coef_ptr,
    BLOCK: tl.constexpr,
    OFFSET_ALIGN: tl.constexpr,
):
    _, _, base, start, numel = block_position(
        block_segment_ptr, block_start_ptr, segment_offset_ptr, segment_numel_ptr, BLOCK, OFFSET_ALIGN
    )
    lanes = tl.arange(0, BLOCK)
    # out_ptr is acc_ptr for the in-place form; out has acc's layout, so both share the offsets and their hints.
    acc_pointers = acc_ptr + base + start + lanes
    out_pointers = out_ptr + base + start + lanes
    coef = tl.load(coef_ptr)
    if start + BLOCK <= numel:
        _scale_values(acc_pointers, out_pointers, coef, None, False)  # a full block: no mask, 16-byte accesses
    else:
        _scale_values(acc_pointers, out_pointers, coef, start + lanes < numel, True)


@triton.jit
def _scale_values(acc_pointers, out_pointers, coef, mask, MASKED: tl.constexpr):
    # The product is taken in acc's dtype, then cast on store.
    if MASKED:
        value = tl.load(acc_pointers, mask=mask, other=0.0) * coef
    else:
        value = tl.load(acc_pointers) * coef
    if out_pointers.dtype.element_ty != tl.float64:
        # Narrowing goes through float32, as torch's own float64 -> bf16/fp16 casts do: same rounding.
        value = value.to(tl.float32)
    if out_pointers.dtype.element_ty == tl.bfloat16:
        value = _to_bfloat16(value)
    else:
        value = value.to(out_pointers.dtype.element_ty)
    if MASKED:
        tl.store(out_pointers, value, mask=mask)
    else:
        tl.store(out_pointers, value)


@triton.jit
def _to_bfloat16(value):
    # Round to nearest even on the bits, as torch does. Spelled out because Triton's interpreter
    # truncates float32 -> bfloat16, and the CPU tests must check the rounding a GPU performs.
    bits = value.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(value != value, 0x7FC0, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@on_acc_device
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
    table = block_table(acc, offsets, numels)
    if out is not None and (out.dim() != 1 or out.numel() != acc.numel() or out.device != acc.device):
        raise ValueError(f"out must be flat with {acc.numel()} elements on {acc.device}, got {tuple(out.shape)}")
    if out is not None and not out.is_contiguous():
        raise ValueError("out must be contiguous")
    if table.n_blocks == 0:
        return
    _scale_kernel[(table.n_blocks,)](
        acc,
        acc if out is None else out,
        table.block_segment,
        table.block_start,
        table.segment_offset,
        table.segment_numel,
        coef.to(device=acc.device, dtype=acc.dtype),
        BLOCK=table.block_size,
        OFFSET_ALIGN=table.offset_align,
        num_warps=table.num_warps,
        enable_fp_fusion=False,
    )
    increment_version(acc if out is None else out)  # as a torch in-place op would: autograd then sees the write
