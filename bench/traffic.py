"""Byte math: the minimum memory traffic of each moment of a window (docs/design.md section 3).

Every GB/s figure in the benchmarks is these bytes divided by the measured time, so a provider that moves
more than the minimum shows up as a lower GB/s, never as a higher one.

Per parameter element, with ``g`` the gradient's bytes, ``p`` the parameter's bytes and a 4-byte fp32
accumulator:

- first micro-batch: read g + write acc                          = g + 4
- middle micro-batch: read g + read acc + write acc              = g + 8
- last micro-batch as the benchmarks time it: the fused fold + scale + sum of squares pass (g + 8),
  then clip and hand the finished gradient to the optimizer: read acc + write p.grad (4 + p).
  A clip folded into an optimizer's own grad scale would cost nothing; the benchmarks' inner optimizer is a
  no-op, so the finished gradient has to be written, and is counted (the last row of docs/design.md's table).
"""

from __future__ import annotations

import torch

__all__ = ["MOMENTS", "OP_NAMES", "bytes_per_element", "op_bytes_per_element", "min_bytes", "copy_bytes"]

MOMENTS = ("first", "middle", "last")
ACCUM_BYTES = 4


def bytes_per_element(moment: str, grad_dtype: torch.dtype, param_dtype: torch.dtype | None = None) -> int:
    """Minimum bytes moved per parameter element at ``moment`` (``"first"``, ``"middle"`` or ``"last"``).

    Args:
        moment: which micro-batch of the window.
        grad_dtype: dtype of the incoming gradients.
        param_dtype: dtype of the finished gradient written for the optimizer (default: ``grad_dtype``).
    """
    grad = torch.empty((), dtype=grad_dtype).element_size()
    param = torch.empty((), dtype=param_dtype or grad_dtype).element_size()
    if moment == "first":
        return grad + ACCUM_BYTES
    if moment == "middle":
        return grad + 2 * ACCUM_BYTES
    if moment == "last":
        return grad + 2 * ACCUM_BYTES + ACCUM_BYTES + param
    raise ValueError(f"moment must be one of {MOMENTS}, got {moment!r}")


OP_NAMES = ("fold", "fold_finish", "scale_cast", "sum_of_squares")


def op_bytes_per_element(op: str, grad_dtype: torch.dtype) -> int:
    """Minimum bytes per element of one gafused op on its own (the kernel sweep), fp32 buffer.

    ``fold`` and ``fold_finish`` move what a middle micro-batch does (read g, read and write acc; the finish's
    scale, sum of squares and flag ride along); ``scale_cast`` reads acc and writes a bf16 ``out``;
    ``sum_of_squares`` reads acc.
    """
    if op in ("fold", "fold_finish"):
        return bytes_per_element("middle", grad_dtype)
    if op == "scale_cast":
        return ACCUM_BYTES + 2
    if op == "sum_of_squares":
        return ACCUM_BYTES
    raise ValueError(f"op must be one of {OP_NAMES}, got {op!r}")


def min_bytes(moment: str, numel: int, grad_dtype: torch.dtype, param_dtype: torch.dtype | None = None) -> int:
    """Minimum bytes for ``numel`` parameter elements at ``moment`` (padding excluded: it is never touched)."""
    return numel * bytes_per_element(moment, grad_dtype, param_dtype)


def copy_bytes(nbytes: int) -> int:
    """Traffic of ``dst.copy_(src)`` for an ``nbytes`` tensor: every byte read once and written once."""
    return 2 * nbytes
