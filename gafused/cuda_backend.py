"""CUDA backend: the contracts of gafused.reference, run by the compiled extension ``gafused._C`` (csrc/).

Each op is one multi-tensor launch over the whole buffer (plus a small cleanup kernel for reductions; a fold
launches once per gradient dtype present): a per-call table of gradient pointers, offsets and sizes goes to
the device with the arguments, so the number of launches does not grow with the number of parameters.
Scalars stay on the device. The kernels write through raw pointers, so each op bumps the autograd version of
the tensor it writes, as torch's in-place ops do (a write to a tensor saved for backward is then reported).

Importing this module fails with ImportError when the extension was not built; gafused.ops remembers that
error and reports it with the command that builds the extension.
"""

from __future__ import annotations

import functools

import torch
from torch.autograd.graph import increment_version

try:
    from gafused import _C
except ImportError as error:
    raise ImportError(
        f"gafused._C, the CUDA extension behind the 'cuda' backend, is not built or does not load ({error})"
    ) from error

__all__ = ["unavailable_reason", "fold_", "fold_finish_", "sum_of_squares", "scale_"]


def unavailable_reason(device: torch.device) -> str | None:
    """Why this backend cannot run on ``device`` (None when it can: a CUDA device of a CUDA build of torch).

    Args:
        device: the device of the buffer.
    """
    if device.type != "cuda":
        return f"the cuda backend runs on CUDA devices only, got {device}"
    if torch.version.cuda is None:
        return f"the cuda backend needs a CUDA build of torch, found torch {torch.__version__}"
    if not torch.cuda.is_available():
        return "the cuda backend needs a visible CUDA device; torch.cuda.is_available() is False"
    index = torch.cuda.current_device() if device.index is None else device.index
    if not 0 <= index < torch.cuda.device_count():
        return f"the cuda backend needs a visible CUDA device; {device} is not one of {torch.cuda.device_count()}"
    error = _kernel_image_error(index)
    if error is None or error:
        major, minor = torch.cuda.get_device_capability(index)
        device_name = f"{torch.cuda.get_device_name(index)} (compute capability {major}.{minor})"
        problem = (
            f"gafused._C was built by an older gafused: it cannot tell whether it holds code for {device_name}"
            if error is None
            else f"gafused._C was built without code for {device_name}: {error}"
        )
        return (
            f"{problem}; rebuild it for this GPU with TORCH_CUDA_ARCH_LIST={major}.{minor} "
            "pip install --no-build-isolation -e ."
        )
    return None


@functools.cache
def _kernel_image_error(index: int) -> str | None:
    # Asked once per device: whether the build holds SASS for its architecture, or PTX it can compile ("" when it
    # does). None: an extension built before it could answer (no kernel_image_error), which must be rebuilt.
    check = getattr(_C, "kernel_image_error", None)
    return None if check is None else check(index)


def _stream(acc: torch.Tensor) -> int:
    # Kernels run on torch's current stream of the buffer's device, like any torch op would.
    if acc.device.type != "cuda":
        raise ValueError(f"the cuda backend needs acc on a CUDA device, got one on {acc.device}")
    return torch.cuda.current_stream(acc.device).cuda_stream


def _device_scalar(value: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    # The kernels read scalars of the buffer's dtype on its device; both casts are no-ops for gafused.ops callers.
    return value.to(device=acc.device, dtype=acc.dtype, non_blocking=True)


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
        acc: flat float32/float64 CUDA buffer.
        grads: one contiguous float32/float64/bfloat16/float16 gradient with numels[i] elements, or None, per segment.
        offsets: start of each segment in ``acc``.
        numels: elements of each segment.
        weight: 0-d tensor, the micro-batch weight.
        first: overwrite instead of adding.
    """
    _C.fold_(acc, list(grads), list(offsets), list(numels), _device_scalar(weight, acc), first, _stream(acc))
    increment_version(acc)


def fold_finish_(
    acc: torch.Tensor,
    grads: list[torch.Tensor | None],
    offsets: list[int],
    numels: list[int],
    weight: torch.Tensor,
    scale: torch.Tensor,
    first: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fold_``, then every segment *= scale, in one pass; returns (sum of squares, any non-finite) of the result.

    Args:
        acc: as in ``fold_``.
        grads: as in ``fold_``.
        offsets: as in ``fold_``.
        numels: as in ``fold_``.
        weight: as in ``fold_``.
        scale: 0-d tensor, applied to every segment (with or without a gradient).
        first: as in ``fold_``.

    Returns:
        (0-d sum of squares in ``acc.dtype``, 0-d bool flag), both on ``acc``'s device.
    """
    result = _C.fold_finish_(
        acc,
        list(grads),
        list(offsets),
        list(numels),
        _device_scalar(weight, acc),
        _device_scalar(scale, acc),
        first,
        _stream(acc),
    )
    increment_version(acc)
    return result


def sum_of_squares(acc: torch.Tensor, offsets: list[int], numels: list[int], per_segment: bool) -> torch.Tensor:
    """Deterministic sum of squares of all segments (0-d), or of each one (shape [len(offsets)]), in ``acc.dtype``.

    Args:
        acc: flat float32/float64 CUDA buffer.
        offsets: start of each segment in ``acc``.
        numels: elements of each segment.
        per_segment: one value per segment instead of the total.
    """
    return _C.sum_of_squares(acc, list(offsets), list(numels), per_segment, _stream(acc))


def scale_(
    acc: torch.Tensor,
    offsets: list[int],
    numels: list[int],
    coef: torch.Tensor,
    out: torch.Tensor | None,
) -> None:
    """Every segment times ``coef``, written into ``out`` (cast to its dtype) or, when ``out`` is None, into acc.

    Args:
        acc: flat float32/float64 CUDA buffer.
        offsets: start of each segment in ``acc`` (and in ``out``).
        numels: elements of each segment.
        coef: 0-d tensor.
        out: None, or a flat contiguous float tensor with ``acc``'s number of elements on its device.
    """
    _C.scale_(acc, list(offsets), list(numels), _device_scalar(coef, acc), out, _stream(acc))
    increment_version(acc if out is None else out)
