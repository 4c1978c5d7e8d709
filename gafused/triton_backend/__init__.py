"""Triton backend: the gafused.ops contracts (see gafused/reference.py) as Triton kernels.

Each op covers every segment of a buffer in one launch (one per gradient dtype for ``fold_``; a reduction adds a
second, which sums the per-block partials in a fixed order), driven by
a block table built once per layout (``_layout.py``). Kernels run on CUDA tensors, and on CPU tensors under
TRITON_INTERPRET=1, which the test suite uses on machines without a GPU.

Triton's interpreter (3.9) reads some subnormal bfloat16 values wrongly (2.9e-39 as 0), so under TRITON_INTERPRET=1
such gradients do not fold as they would on a GPU, where the conversion to float32 is exact; the CPU tests use normal
values.

ROCm is refused: a launch reaches its gradients as int64 offsets from one base pointer, and Triton's AMD
backend turns loads from a pointer argument into buffer loads whose range is assumed to stay within 2 GB of it
(compiled for gfx942, the gradient loads are ``buffer_load_dwordx4``), while the offsets reach other
allocations anywhere in the address space. It would read wrong memory without a sign, so it does not run.
"""

from __future__ import annotations

import os

import torch
from triton.runtime.jit import JITFunction

from gafused.triton_backend.fold import _fold_kernel, fold_, fold_finish_
from gafused.triton_backend.norm import sum_of_squares
from gafused.triton_backend.scale import scale_

__all__ = ["fold_", "fold_finish_", "scale_", "sum_of_squares", "unavailable_reason"]

# TRITON_INTERPRET is read when a kernel is defined, so what matters is how this module's kernels were built
# (an InterpretedFunction otherwise; its module is not imported here: it needs numpy, compiled kernels do not).
_INTERPRETED = not isinstance(_fold_kernel, JITFunction)


def _interpreter_reason() -> str | None:
    """Why Triton's interpreter cannot run these kernels here (None when it can): Triton 3.6 and older turn a scalar
    argument used as a loop bound into an int with ``int()`` of a one-element NumPy array, which NumPy 2.4 refuses
    (``TypeError: only 0-dimensional arrays can be converted to Python scalars``); Triton 3.7 squeezes it first."""
    import numpy
    import triton

    def major_minor(version: str) -> tuple[int, ...]:
        return tuple(int(part) for part in version.split(".")[:2] if part.isdigit())

    if major_minor(triton.__version__) < (3, 7) and major_minor(numpy.__version__) >= (2, 4):
        return (
            f"Triton {triton.__version__}'s interpreter (TRITON_INTERPRET=1) cannot run with NumPy "
            f"{numpy.__version__}: pip install 'numpy<2.4', or Triton 3.7 or newer"
        )
    return None


_INTERPRETER_REASON = _interpreter_reason() if _INTERPRETED else None


def unavailable_reason(device: torch.device) -> str | None:
    """Why these kernels cannot run on ``device`` (None when they can).

    Args:
        device: the device of the buffer the ops would run on.
    """
    device = torch.device(device)
    if device.type == "cuda":
        if torch.version.hip is not None:
            return (
                "the triton backend does not support ROCm: its gradient tables are offsets from one base pointer, "
                "which AMD buffer loads assume stay within 2 GB of it"
            )
        if _INTERPRETED:
            # The interpreter copies each tensor argument to the host on its own; the gradient table
            # reaches gradients through pointer arithmetic from one base, which needs real host memory.
            return (
                "triton kernels were defined under TRITON_INTERPRET=1, which gafused supports for CPU tensors "
                "only; unset TRITON_INTERPRET to run them on CUDA tensors"
            )
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability(device)
            if major < 7:
                return f"Triton compiles for compute capability 7.0 and up; {device} has {major}.{minor}"
        return None
    if device.type == "cpu":
        if _INTERPRETED:
            return _INTERPRETER_REASON
        if os.environ.get("TRITON_INTERPRET") == "1":
            return "TRITON_INTERPRET=1 was set after gafused.triton_backend was imported; set it before importing"
    return "triton kernels need CUDA tensors, or TRITON_INTERPRET=1 for CPU tensors"
