"""The op surface of gafused and its backend dispatch.

Three in-place ops and a reduction over a FlatGradBuffer, one contract each (docs/design.md section 2),
implemented by every backend (``reference``, ``foreach``, ``triton``, ``cuda``):

- ``fold_``: acc[seg] = (0 if first else acc[seg]) + weight * grad, math in the buffer's dtype;
  a missing grad (None) contributes zero.
- ``fold_finish_``: ``fold_``, then every segment *= scale, returning the sum of squares of the result
  and a non-finite flag, all in the same pass where the backend can fuse it.
- ``sum_of_squares`` / ``norm``: deterministic reductions, global (0-d) or per segment.
- ``scale_``: every segment *= coef, in place, or written cast into ``out`` (a flat tensor with the
  buffer's layout, e.g. bf16 gradients the inner optimizer reads).

Scalars (weight, scale, coef) may be Python numbers or 0-d tensors; tensors stay on the device, so no op
here synchronizes with the host. Either form is rounded into the buffer's dtype (a value beyond its range becomes
inf), and a scalar in the buffer's own memory is read before the op writes it. Alignment padding between
segments is never read or written.

Each op is registered with ``torch.library.custom_op`` (namespace ``gafused``) so a compiled training step
can call it; the backend is an argument of the op, resolved here from ``"auto"`` before dispatch. In eager mode
the ops call the backend directly: a custom op's dispatcher round trip costs about 2 us per gradient tensor on
the host, as much as the kernels of a large model's micro-step. The custom op is used only while torch.compile
traces (or a dispatch mode such as FakeTensorMode is active), where it is what the compiler needs.

The ops are tagged ``cudagraph_unsafe`` and refuse to run while a CUDA graph is being captured: backends build
tables on the host each call (gradient addresses change from one micro-batch to the next), which a replayed
graph would not repeat. torch.compile leaves them out of the graphs it captures.
"""

from __future__ import annotations

import math
import numbers
import os
import warnings
import weakref
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from gafused.buffer import ACCUM_DTYPES, PARAM_DTYPES, FlatGradBuffer

__all__ = [
    "BACKENDS",
    "CheckedGrads",
    "GRAD_DTYPES",
    "available_backends",
    "backend_unavailable_reason",
    "check_grads",
    "fold_",
    "fold_finish_",
    "norm",
    "resolve_backend",
    "scale_",
    "sum_of_squares",
]

BACKENDS = ("reference", "foreach", "triton", "cuda")
_BACKEND_CHOICES = ("auto", *BACKENDS)
ENV_BACKEND = "GAFUSED_BACKEND"

INSTALL_HINTS = {
    "reference": "",
    "foreach": "",
    "triton": "pip install triton  (needs an NVIDIA GPU, or TRITON_INTERPRET=1 for CPU tensors)",
    "cuda": (
        "GAFUSED_FORCE_CUDA=1 pip install --no-build-isolation --no-deps -e .  "
        "(from a gafused checkout, on a machine with CUDA torch and nvcc)"
    ),
}

_loaded: dict[str, ModuleType] = {}
# Each failed import's error as text, made when it failed: a message built from it while torch.compile traces
# (an op whose backend does not import, under fullgraph=True) cannot call the error's __repr__.
_import_errors: dict[str, str] = {}


def _load(name: str) -> ModuleType | None:
    """Import a backend module once; remember the import error so it can be reported when asked for."""
    if name in _loaded:
        return _loaded[name]
    if name in _import_errors:
        return None
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    try:
        # Import statements, which torch.compile runs while it traces: an op whose backend is first loaded inside a
        # compiled function does not break its graph there (importlib is a function Dynamo leaves to eager Python).
        # An optional backend may fail to import in any way; every such failure is remembered for the report.
        if name == "reference":
            from gafused import reference as module
        elif name == "foreach":
            from gafused import foreach_backend as module
        elif name == "triton":
            from gafused import triton_backend as module
        else:
            from gafused import cuda_backend as module
    except Exception as error:  # noqa: BLE001 - any import failure makes the backend unavailable; kept for the report
        _import_errors[name] = repr(error)
        return None
    _loaded[name] = module
    return module


def _device_arg(caller: str, device: Any, expected: str = "a torch.device, a str or an index") -> torch.device:
    """``device`` as a torch.device (an index is a CUDA device's, as in torch.cuda); TypeError or ValueError naming
    ``caller`` when it is none."""
    if type(device) is torch.device:  # the ops' own calls: no check to make
        return device
    if isinstance(device, bool) or not isinstance(device, (torch.device, str, int)):
        raise TypeError(f"{caller}(): device must be {expected}, got {type(device).__name__}")
    try:
        return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except RuntimeError as error:
        raise ValueError(f"{caller}(): device {device!r} names no device here: {error}") from None


def backend_unavailable_reason(name: str, device: torch.device | str | int) -> str | None:
    """Why backend ``name`` cannot run on ``device`` (None when it can)."""
    if not isinstance(name, str) or name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    device = _device_arg("backend_unavailable_reason", device)
    module = _load(name)
    if module is None:
        return f"gafused backend {name!r} failed to import: {_import_errors[name]}"
    reason = getattr(module, "unavailable_reason", None)
    return reason(device) if reason is not None else None


def available_backends(device: torch.device | str | None = None) -> list[str]:
    """Backends that can run on ``device`` (default: the current CUDA device if there is one, else CPU): none on a
    CUDA device where torch sees none. (The ops themselves still take CUDA tensors there under FakeTensorMode.)"""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = _device_arg("available_backends", device, "a torch.device, a str, an index or None")
    if device.type == "cuda" and not torch.cuda.is_available():
        return []
    return [name for name in BACKENDS if backend_unavailable_reason(name, device) is None]


def resolve_backend(backend: str, device: torch.device | str | int) -> str:
    """Turn ``backend`` (``"auto"`` or a name) into the backend that will run on ``device``.

    ``"auto"`` takes ``$GAFUSED_BACKEND`` when set; otherwise it picks cuda, then triton, then foreach for GPU
    tensors (warning when no fused backend can run) and foreach for CPU tensors. A named backend that cannot
    run raises RuntimeError with the reason (and, when it does not import, the command that installs it).

    Args:
        backend: ``"auto"`` or a name from ``BACKENDS``.
        device: the device of the buffer the ops will run on (an index is a CUDA device's).
    """
    device = _device_arg("resolve_backend", device)
    if not isinstance(backend, str) or backend not in _BACKEND_CHOICES:
        raise ValueError(f"backend must be one of {_BACKEND_CHOICES}, got {backend!r}")
    if backend == "auto":
        forced = os.environ.get(ENV_BACKEND, "").strip()
        if forced:
            if forced not in BACKENDS:
                raise ValueError(f"${ENV_BACKEND} must be one of {BACKENDS}, got {forced!r}")
            backend = forced
        elif device.type == "cuda":
            for candidate in ("cuda", "triton"):
                if backend_unavailable_reason(candidate, device) is None:
                    return candidate
            warnings.warn(
                f"gafused: no fused backend can run on {device}; using the foreach backend "
                f"(cuda: {backend_unavailable_reason('cuda', device)}; "
                f"triton: {backend_unavailable_reason('triton', device)})",
                RuntimeWarning,
                stacklevel=2,
            )
            return "foreach"
        else:
            return "foreach"
    reason = backend_unavailable_reason(backend, device)
    if reason is not None:
        hint = f". To install it: {INSTALL_HINTS[backend]}" if backend in _import_errors else ""
        raise RuntimeError(f"{reason}{hint}")
    return backend


def _module(backend: str) -> ModuleType:
    module = _load(backend)
    if module is None:
        raise RuntimeError(
            f"gafused backend {backend!r} failed to import: {_import_errors[backend]}. "
            f"To install it: {INSTALL_HINTS[backend]}"
        )
    return module


def _eager(acc: torch.Tensor) -> bool:
    """Whether an op on ``acc`` may call its backend directly: not while torch.compile traces, not on tensor
    subclasses (FakeTensor, FunctionalTensor) and not under a dispatch mode (make_fx), which need the custom op."""
    return type(acc) is torch.Tensor and not torch.compiler.is_compiling() and _get_current_dispatch_mode() is None


def _capturing(device: torch.device) -> bool:
    # torch.cuda.is_current_stream_capturing() asks about the current device's stream, not the buffer's.
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()


def _backend_for(acc: torch.Tensor, backend: str) -> ModuleType:
    """The backend module, after refusing CUDA graph capture (see the module docstring)."""
    if acc.is_cuda and _capturing(acc.device):
        raise RuntimeError(
            "gafused ops cannot be captured in a CUDA graph: they build tables on the host for every call. "
            "Run the accumulator's step outside the captured region."
        )
    return _module(backend)


# --- torch.library registration -------------------------------------------------------------------------

# Host-built tables per call: a replayed CUDA graph would not rebuild them (see the module docstring).
_TAGS = (torch.Tag.cudagraph_unsafe,)


@torch.library.custom_op("gafused::fold_", mutates_args=("acc",), tags=_TAGS)
def _fold_op(
    acc: torch.Tensor,
    grads: list[torch.Tensor | None],
    offsets: list[int],
    numels: list[int],
    weight: torch.Tensor,
    first: bool,
    backend: str,
) -> None:
    _check_lengths(grads, offsets, numels)
    _check_op_tensors(acc, grads, numels)
    (weight,) = _op_scalars(acc, None, weight=weight)
    _backend_for(acc, backend).fold_(acc, _resolved(grads), offsets, numels, weight, first)


@torch.library.custom_op("gafused::fold_finish_", mutates_args=("acc",), tags=_TAGS)
def _fold_finish_op(
    acc: torch.Tensor,
    grads: list[torch.Tensor | None],
    offsets: list[int],
    numels: list[int],
    weight: torch.Tensor,
    scale: torch.Tensor,
    first: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_lengths(grads, offsets, numels)
    _check_op_tensors(acc, grads, numels)
    weight, scale = _op_scalars(acc, None, weight=weight, scale=scale)
    return _backend_for(acc, backend).fold_finish_(acc, _resolved(grads), offsets, numels, weight, scale, first)


def _check_lengths(grads: list[torch.Tensor | None], offsets: list[int], numels: list[int]) -> None:
    """What the registered ops check themselves (a backend would read past the end of a shorter list); the tensors
    are ``_check_op_tensors``' and ``check_grads``' work, which ``gafused.ops``' functions run first."""
    if not len(grads) == len(offsets) == len(numels):
        raise ValueError(
            f"grads, offsets and numels must have one entry per segment, got {len(grads)}, {len(offsets)} and "
            f"{len(numels)}"
        )


def _check_op_tensors(
    acc: torch.Tensor,
    grads: Sequence[torch.Tensor | None] = (),
    numels: Sequence[int] = (),
    out: torch.Tensor | None = None,
) -> None:
    """What the registered ops check of their tensors, called directly: a backend addresses ``acc`` (and ``out``)
    as one run of memory and reads ``numels[i]`` elements of ``grads[i]`` on ``acc``'s device, so anything else would
    be written or read out of place. The rest of ``check_grads`` (a gradient that is a view of the buffer, names) is
    the caller's, as with ``check=False``."""
    if acc.layout != torch.strided or acc.dim() != 1 or not acc.is_contiguous() or acc.dtype not in ACCUM_DTYPES:
        strides = acc.stride() if acc.layout == torch.strided else acc.layout
        raise ValueError(
            f"acc must be a contiguous 1-D float32 or float64 tensor, got {acc.dtype} of shape {tuple(acc.shape)} "
            f"and strides {strides}"
        )
    if acc.data_ptr() % acc.element_size():
        raise ValueError(
            f"acc must start at a multiple of its {acc.element_size()}-byte element size, got a view of storage cut "
            "at an odd byte"
        )
    for index, (grad, numel) in enumerate(zip(grads, numels, strict=True)):
        if grad is None:
            continue
        if grad.layout != torch.strided or grad.dtype not in GRAD_DTYPES or grad.device != acc.device:
            raise ValueError(
                f"grads[{index}] must be a dense float16, bfloat16, float32 or float64 tensor on {acc.device}, got "
                f"{grad.layout} {grad.dtype} on {grad.device}"
            )
        if grad.numel() != numel:
            raise ValueError(f"grads[{index}] must have numels[{index}] = {numel} elements, got {grad.numel()}")
    if out is None:
        return
    if (
        out.layout != torch.strided
        or out.dim() != 1
        or not out.is_contiguous()
        or out.numel() != acc.numel()
        or out.dtype not in GRAD_DTYPES
        or out.device != acc.device
        or out.data_ptr() % out.element_size()
    ):
        raise ValueError(
            f"out must be a contiguous 1-D float16, bfloat16, float32 or float64 tensor of {acc.numel()} elements on "
            f"{acc.device}, aligned to its element size; got {out.dtype} of shape {tuple(out.shape)} on {out.device}"
        )
    _check_out_apart(out, acc)


def _check_out_apart(out: torch.Tensor | None, acc: torch.Tensor) -> None:
    """Refuse an ``out`` in ``acc``'s memory (the eager ``scale_`` and the registered op alike)."""
    if out is not None and _same_storage(out, acc):
        raise ValueError(
            "out shares memory with the buffer (a view of its storage): the op would write what it still reads; "
            "pass a tensor of its own, or no out to scale the buffer in place"
        )


def _op_scalars(acc: torch.Tensor, out: torch.Tensor | None, **scalars: torch.Tensor) -> list[torch.Tensor]:
    """The registered ops' scalars as a backend reads them: each a 0-d tensor of ``acc``'s dtype on its device (what
    ``_scalar`` makes; a backend reads one value of that dtype), copied where it is in the memory the op writes (a
    compiled call's ``_scalar`` could not copy it: no tensor had memory while tracing)."""
    checked = []
    for name, value in scalars.items():
        if value.layout != torch.strided or value.dim() != 0 or value.dtype != acc.dtype or value.device != acc.device:
            raise ValueError(
                f"{name} must be a dense 0-d {acc.dtype} tensor on {acc.device} (acc's dtype and device), got "
                f"{value.layout} {value.dtype} of shape {tuple(value.shape)} on {value.device}"
            )
        written = any(_same_storage(value, tensor) for tensor in (acc, out) if tensor is not None)
        checked.append(value.clone() if written else value)
    return checked


def _resolved(grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """The gradients a compiled graph hands a custom op, with a lazily negated view (``torch._neg_view``) resolved:
    ``check_grads`` resolves them in eager code, but while tracing no tensor is negated yet."""
    return [grad.resolve_neg() if grad is not None and grad.is_neg() else grad for grad in grads]


@_fold_finish_op.register_fake
def _(acc, grads, offsets, numels, weight, scale, first, backend):
    return acc.new_empty(()), torch.empty((), dtype=torch.bool, device=acc.device)


@torch.library.custom_op("gafused::sum_of_squares", mutates_args=(), tags=_TAGS)
def _sum_of_squares_op(
    acc: torch.Tensor, offsets: list[int], numels: list[int], per_segment: bool, backend: str
) -> torch.Tensor:
    _check_op_tensors(acc)
    return _backend_for(acc, backend).sum_of_squares(acc, offsets, numels, per_segment)


@_sum_of_squares_op.register_fake
def _(acc, offsets, numels, per_segment, backend):
    return acc.new_empty((len(offsets),) if per_segment else ())


@torch.library.custom_op("gafused::scale_", mutates_args=("acc", "out"), tags=_TAGS)
def _scale_op(
    acc: torch.Tensor,
    offsets: list[int],
    numels: list[int],
    coef: torch.Tensor,
    out: torch.Tensor | None,
    backend: str,
) -> None:
    _check_op_tensors(acc, out=out)
    (coef,) = _op_scalars(acc, out, coef=coef)
    _backend_for(acc, backend).scale_(acc, offsets, numels, coef, out)


# --- public ops -----------------------------------------------------------------------------------------

_INTEGER_DTYPES = (
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
)


def to_device(
    value: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None, *, copy: bool = False
) -> torch.Tensor:
    """``value`` on ``device`` (in ``dtype``) without a host sync where that is safe.

    A copy to a device is queued on the stream and the host goes on (from pageable CPU memory torch stages it, so
    the source may change right after). A copy from a device to the CPU is not: non-blocking, torch would return a
    pinned tensor before the data arrives, and the host would read whatever that memory held. Such copies wait.
    """
    return value.to(device=device, dtype=dtype, non_blocking=device.type != "cpu", copy=copy)


def number_text(value: numbers.Real) -> str:
    """How an error message shows a number: its repr, or, for an int or fraction of more than 50 digits, its sign and
    magnitude (Python refuses ``str()`` of an int of more than 4300 digits, and a long one helps no reader)."""
    if isinstance(value, numbers.Rational):
        numerator, denominator = int(value.numerator), int(value.denominator)
        if max(abs(numerator), denominator) >= 10**50:
            words = ("negative " if numerator < 0 else "") + (
                "int" if isinstance(value, numbers.Integral) else type(value).__name__
            )
            exponent = math.floor(math.log10(abs(numerator)) - math.log10(denominator))
            return f"{'an' if words[0] in 'aeiou' else 'a'} {words} of about 1e{exponent:+d}"
    return repr(value)


def _scalar(value: float | torch.Tensor, name: str, buffer: FlatGradBuffer, out: object = None) -> torch.Tensor:
    """A 0-d tensor on the buffer's device in its dtype; a tensor is moved without a host sync unless it goes from a
    device to a CPU buffer (see ``to_device``). A number is rounded into the dtype as a float64 tensor would be
    (beyond its range: inf). A tensor in the memory the op writes (the buffer's, or ``out``'s when that is a tensor)
    is copied: the op would read it while it writes."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0:
            raise ValueError(f"{name} must be a Python number or a 0-d tensor, got shape {tuple(value.shape)}")
        if value.layout != torch.strided:
            raise ValueError(f"{name} must be a dense tensor, got layout {value.layout}")
        if value.is_complex() or not (value.is_floating_point() or value.dtype in _INTEGER_DTYPES):
            raise ValueError(f"{name} must be a real number, got dtype {value.dtype}")
        if value.is_meta:
            raise ValueError(f"{name} must hold a value, got a tensor on the meta device")
        if value.requires_grad:  # its value only: a weight with a graph must not attach one to the buffer
            value = value.detach()
        scalar = to_device(value, buffer.device, buffer.accum_dtype)
        written = [buffer.data] if not isinstance(out, torch.Tensor) else [buffer.data, out]
        if (
            scalar is value
            and type(scalar) is torch.Tensor
            and _eager(buffer.data)
            and any(_same_storage(scalar, tensor) for tensor in written)
        ):
            scalar = scalar.clone()
        return scalar
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number or a 0-d tensor, got {type(value).__name__}")
    try:
        number = float(value)
    except OverflowError:
        raise ValueError(
            f"{name} is too large in magnitude for a float: {number_text(value)}; float64 ends near 1.8e+308"
        ) from None
    if abs(number) > torch.finfo(buffer.accum_dtype).max and math.isfinite(number):
        number = torch.tensor(number, dtype=torch.float64).to(buffer.accum_dtype).item()  # inf, or max if it rounds
    return torch.full((), number, dtype=buffer.accum_dtype, device=buffer.device)


def check_bool(value: object, name: str) -> bool:
    """Refuse anything but a Python bool for ``name``, naming the type with its module unless a builtin (NumPy's
    ``numpy.bool`` is not a Python ``bool``, though both are named "bool")."""
    if not isinstance(value, bool):
        kind = type(value)
        shown = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
        raise TypeError(f"{name} must be a bool, got {shown}")
    return value


GRAD_DTYPES = frozenset(PARAM_DTYPES)


class CheckedGrads(list):
    """What ``check_grads`` returns: the gradients, ready for a backend, and ``shapes`` when it knows them.

    ``shapes`` lists each entry's shape (None for a missing gradient). Calls whose gradients have the layout of the
    same earlier call share one ``shapes`` list object, so a backend that keeps views shaped like the gradients
    (the foreach backend) sees by identity that they still fit. None when ``check_grads`` did not record the layout.
    """

    shapes: list[torch.Size | None] | None = None


def _load_tensor_guards() -> type | None:
    """torch's C++ check of a list of tensors against recorded metadata (dynamo's TensorGuards), or None.

    A guard built from tensors records, per tensor, its Python type, dispatch keys (device type and layout), dtype,
    device index, requires_grad, sizes and strides; ``check(*tensors)`` is True when every tensor matches its
    record exactly (and no tensor is passed twice). That is everything ``check_grads`` decides on, at about 70 ns
    per tensor instead of the ~0.6 us that reading the same attributes costs in Python. The class is private to
    torch: it is used only if it is there and gives the expected answers below, else every call takes the Python
    path (same checks, slower).
    """
    try:
        from torch._C._dynamo.guards import TensorGuards
    except ImportError:
        return None
    try:
        guard = TensorGuards(torch.zeros(2, 3), dynamic_dims_sizes=None, dynamic_dims_strides=None)
        others = [
            torch.zeros(2, 3, dtype=torch.float64),
            torch.zeros(3, 2),
            torch.zeros(3, 2).t(),
            torch.zeros(6),
            torch.zeros(2, 3, requires_grad=True),
            torch.zeros(2, 3).to_sparse(),
            torch.nn.Parameter(torch.zeros(2, 3)),
            None,
        ]
        if guard.check(torch.ones(2, 3)) is not True or any(guard.check(other) is not False for other in others):
            return None
    except Exception:  # noqa: BLE001 - any failure means this torch's guards are not the ones checked for here
        return None
    return TensorGuards


_TensorGuards = _load_tensor_guards()


class _AcceptedLayout:
    """The metadata of a gradient list that ``check_grads`` accepted as it was (no copy, no detach).

    A later list whose tensors match it entry by entry (same types, dtypes, devices, layouts, requires_grad, sizes
    and strides, None in the same places) would pass every check the same way, so it is accepted at once.
    """

    def __init__(self, grads: list[torch.Tensor | None], permuted: frozenset[int], shapes: list) -> None:
        self.present = [index for index, grad in enumerate(grads) if grad is not None]
        self.missing = [index for index, grad in enumerate(grads) if grad is None]
        self.permuted = sorted(permuted.difference(self.missing))
        self.guard = _TensorGuards(
            *[grads[index] for index in self.present], dynamic_dims_sizes=None, dynamic_dims_strides=None
        )
        self.shapes = shapes

    def matches(self, grads: list[torch.Tensor | None]) -> bool:
        if not self.missing:
            return self.guard.check(*grads)
        for index in self.missing:
            if grads[index] is not None:
                return False
        return self.guard.check(*[grads[index] for index in self.present])


# The last layout each buffer (or bucket) accepted; weak, so a dropped buffer takes its record with it.
_accepted_layouts: weakref.WeakKeyDictionary[FlatGradBuffer, _AcceptedLayout] = weakref.WeakKeyDictionary()


def check_grads(
    buffer: FlatGradBuffer,
    grads: Sequence[torch.Tensor | None],
    names: Sequence[str] | None = None,
) -> CheckedGrads:
    """Check micro-batch gradients against the buffer's layout; returns them in each segment's memory order.

    Gradients come back contiguous, or, for a segment with a permuted memory order (a channels_last
    parameter, whose gradient must then have the parameter's shape), as a flat view of the gradient's memory in
    that order (a copy only when the strides differ); a gradient with a graph of its own (``create_graph=True``)
    comes back detached, a lazily negated one (``torch._neg_view``) resolved.

    This is the check ``fold_`` and ``fold_finish_`` run; a caller that runs it first (GradAccumulator does,
    for every buffer before folding any, so a refused step changes nothing) passes ``check=False`` to them.
    Its host cost per gradient is what bounds a fused micro-step, so gradients laid out like the last ones this
    buffer accepted as they were (the usual case: each micro-batch's gradients look like the previous one's) are
    matched in one C++ call; any other list is checked gradient by gradient, which names the first bad one and
    refuses a gradient that is a view of the buffer (the one-call match reads metadata only, not memory).

    Args:
        buffer: the accumulation buffer.
        grads: one gradient or None per segment.
        names: how to name segment ``i`` in an error (default ``grads[i]``).
    """
    _check_buffer(buffer)
    if isinstance(grads, (torch.Tensor, str)) or not isinstance(grads, Sequence):
        raise TypeError(f"grads must be a list with one gradient or None per segment, got {type(grads).__name__}")
    if names is not None and len(names) != len(grads):
        raise ValueError(f"names must name every entry of grads ({len(grads)}), got {len(names)}")
    grads = CheckedGrads(grads)
    if len(grads) != len(buffer):
        raise ValueError(f"grads must hold one entry per buffer segment ({len(buffer)}), got {len(grads)}")
    if _no_tracing():
        accepted = _accepted_layouts.get(buffer)
        if accepted is not None and accepted.matches(grads):
            for index in accepted.permuted:
                grads[index] = grads[index].as_strided((buffer.numels[index],), (1,))
            grads.shapes = accepted.shapes
            return grads
    return _check_each(buffer, grads, names)


def _check_buffer(buffer: object) -> None:
    if not isinstance(buffer, FlatGradBuffer):
        raise TypeError(f"buffer must be a gafused.FlatGradBuffer, got {type(buffer).__name__}")


def _no_tracing() -> bool:
    """Whether gradients are plain eager tensors: not while torch.compile traces or a dispatch mode is active."""
    return not torch.compiler.is_compiling() and _get_current_dispatch_mode() is None


def _check_each(buffer: FlatGradBuffer, grads: CheckedGrads, names: Sequence[str] | None) -> CheckedGrads:
    """``check_grads`` one gradient at a time; records the layout of a list accepted as it was given."""
    device, numels, permuted = buffer.device, buffer.numels, buffer.permuted
    eager, compiling = _no_tracing(), torch.compiler.is_compiling()
    given = list(grads)
    as_given = True
    for index, grad in enumerate(given):
        if grad is None:
            continue
        if (
            not isinstance(grad, torch.Tensor)
            or grad.dtype not in GRAD_DTYPES
            or grad.layout != torch.strided
            or grad.device != device
            or grad.numel() != numels[index]
            or (index in permuted and grad.shape != buffer.shapes[index])
        ):
            raise _bad_grad(buffer, index, grad, names)
        if eager and _shares_memory(grad, buffer):
            label = f"grads[{index}]" if names is None else names[index]
            raise ValueError(
                f"{label} shares memory with the buffer (a view of it, such as a finished gradient "
                "handed out as p.grad): the fold would read what it writes; pass a copy"
            )
        if grad.requires_grad:  # a gradient with a graph of its own (create_graph=True): fold its value
            grads[index] = grad = grad.detach()
            as_given = False
        # A lazily negated view (torch._neg_view): its memory holds the negated values. (While tracing, the custom
        # op resolves it: is_neg() would break the graph.)
        if not compiling and grad.is_neg():
            grads[index] = grad = grad.resolve_neg()
            as_given = False
        if index in permuted:
            as_given = as_given and grad.stride() == buffer.strides[index]
            grads[index] = _in_memory_order(grad, buffer.strides[index])
        elif not grad.is_contiguous():
            grads[index] = grad.contiguous()
            as_given = False
    if as_given and _TensorGuards is not None and eager:
        _record_layout(buffer, given, grads)
    return grads


def _shares_memory(grad: torch.Tensor, buffer: FlatGradBuffer) -> bool:
    """Whether eager ``grad`` is a view of the buffer's storage (tensors with memory only)."""
    return _same_storage(grad, buffer.data)


def _same_storage(tensor: torch.Tensor, other: torch.Tensor) -> bool:
    """Whether eager ``tensor`` and ``other`` are views of one storage (dense tensors with memory only)."""
    # (An empty tensor has no memory to share: its storage address may be 0, as the other's.)
    if not all(
        type(t) is torch.Tensor and t.layout == torch.strided and t.numel() and t.device.type != "meta"
        for t in (tensor, other)
    ):
        return False
    return tensor.untyped_storage().data_ptr() == other.untyped_storage().data_ptr()


def _record_layout(buffer: FlatGradBuffer, given: list[torch.Tensor | None], grads: CheckedGrads) -> None:
    """Remember the layout of ``given``, just accepted as it was (``grads`` is what it became), so that the next
    list laid out the same way is matched at once."""
    tensors = [grad for grad in given if grad is not None]
    if not tensors or any(type(grad) is not torch.Tensor for grad in tensors):
        return  # nothing to match on, or tensor subclasses, whose metadata need not tell everything
    if len({id(grad) for grad in tensors}) != len(tensors):
        return  # one tensor given for two segments: the guard never matches such a list
    grads.shapes = [None if grad is None else grad.shape for grad in grads]
    _accepted_layouts[buffer] = _AcceptedLayout(given, buffer.permuted, grads.shapes)


def _in_memory_order(grad: torch.Tensor, strides: tuple[int, ...]) -> torch.Tensor:
    """A flat tensor of ``grad``'s elements in the memory order of a segment with ``strides`` (e.g. channels_last):
    a view when the gradient already has those strides, as autograd gives a parameter's gradient."""
    if grad.stride() != strides:
        grad = torch.empty_strided(grad.shape, strides, dtype=grad.dtype, device=grad.device).copy_(grad)
    return grad.as_strided((grad.numel(),), (1,))


def _bad_grad(buffer: FlatGradBuffer, grads_index: int, grad: object, names: Sequence[str] | None) -> Exception:
    """The precise error for a gradient that failed ``check_grads``'s combined test."""
    label = f"grads[{grads_index}]" if names is None else names[grads_index]
    if not isinstance(grad, torch.Tensor):
        return TypeError(f"{label}: a gradient must be a tensor or None, got {type(grad).__name__}")
    if grad.layout != torch.strided:
        return ValueError(f"{label}: sparse gradients are not supported (layout {grad.layout})")
    if grad.dtype not in GRAD_DTYPES:
        return ValueError(f"{label}: gradients must be real floating point (fp16/bf16/fp32/fp64), got {grad.dtype}")
    if grad.device != buffer.device:
        return ValueError(f"{label}: the gradient is on {grad.device}, the buffer on {buffer.device}")
    if grad.numel() != buffer.numels[grads_index]:
        return ValueError(
            f"{label}: the gradient has {grad.numel()} elements, its segment {buffer.numels[grads_index]}"
        )
    return ValueError(
        f"{label}: the gradient has shape {tuple(grad.shape)}; its segment keeps the memory order of a parameter "
        f"of shape {tuple(buffer.shapes[grads_index])} (e.g. channels_last), so the gradient must have that shape"
    )


def _checked(buffer: FlatGradBuffer, grads: Sequence[torch.Tensor | None], check: bool) -> list[torch.Tensor | None]:
    """The gradients a backend gets: checked now, or as the caller's earlier ``check_grads`` returned them."""
    if check_bool(check, "check"):
        return check_grads(buffer, grads)
    _check_buffer(buffer)
    return grads if type(grads) is CheckedGrads else list(grads)


def fold_(
    buffer: FlatGradBuffer,
    grads: Sequence[torch.Tensor | None],
    weight: float | torch.Tensor = 1.0,
    *,
    first: bool,
    backend: str = "auto",
    check: bool = True,
) -> None:
    """Fold one micro-batch into the buffer: acc[seg] = (0 if first else acc[seg]) + weight * grads[seg].

    Args:
        buffer: the accumulation buffer.
        grads: one gradient (float16, bfloat16, float32 or float64; the segment's number of elements) or None per
            segment.
        weight: the micro-batch weight, a number or a 0-d tensor (stays on the device).
        first: the first micro-batch of a window overwrites instead of adding (no zeroing pass needed).
        backend: ``"auto"`` or a name from ``BACKENDS``.
        check: run ``check_grads`` (False only when the caller just ran it on the same grads).
    """
    check_bool(first, "first")
    checked = _checked(buffer, grads, check)
    w = _scalar(weight, "weight", buffer)
    name = resolve_backend(backend, buffer.device)
    if _eager(buffer.data):
        _backend_for(buffer.data, name).fold_(buffer.data, checked, buffer.offsets, buffer.numels, w, first)
    else:
        _fold_op(buffer.data, list(checked), buffer.offsets, buffer.numels, w, first, name)


def fold_finish_(
    buffer: FlatGradBuffer,
    grads: Sequence[torch.Tensor | None],
    weight: float | torch.Tensor,
    scale: float | torch.Tensor,
    *,
    first: bool,
    backend: str = "auto",
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold the last micro-batch, multiply every segment by ``scale``, and measure the result.

    Args:
        buffer: the accumulation buffer.
        grads: as in ``fold_``.
        weight: as in ``fold_``.
        scale: the window scale (1 / sum of weights), a number or 0-d tensor.
        first: as in ``fold_`` (a window of one micro-batch).
        backend: ``"auto"`` or a name from ``BACKENDS``.
        check: as in ``fold_``.

    Returns:
        (sum of squares of the finished segments as a 0-d tensor of the buffer's dtype,
        0-d bool tensor: any finished element is inf or nan), both on the buffer's device.
    """
    check_bool(first, "first")
    checked = _checked(buffer, grads, check)
    w = _scalar(weight, "weight", buffer)
    s = _scalar(scale, "scale", buffer)
    name = resolve_backend(backend, buffer.device)
    if _eager(buffer.data):
        module = _backend_for(buffer.data, name)
        return module.fold_finish_(buffer.data, checked, buffer.offsets, buffer.numels, w, s, first)
    return _fold_finish_op(buffer.data, list(checked), buffer.offsets, buffer.numels, w, s, first, name)


def sum_of_squares(buffer: FlatGradBuffer, *, per_segment: bool = False, backend: str = "auto") -> torch.Tensor:
    """Deterministic sum of squares of the buffer (0-d) or of each segment (shape [segments]).

    Args:
        buffer: the accumulation buffer.
        per_segment: one value per segment instead of the total.
        backend: ``"auto"`` or a name from ``BACKENDS``.
    """
    _check_buffer(buffer)
    check_bool(per_segment, "per_segment")
    name = resolve_backend(backend, buffer.device)
    if _eager(buffer.data):
        return _backend_for(buffer.data, name).sum_of_squares(buffer.data, buffer.offsets, buffer.numels, per_segment)
    return _sum_of_squares_op(buffer.data, buffer.offsets, buffer.numels, per_segment, name)


def norm(buffer: FlatGradBuffer, *, per_segment: bool = False, backend: str = "auto") -> torch.Tensor:
    """L2 norm of the buffer (0-d) or of each segment: the square root of ``sum_of_squares``."""
    return sum_of_squares(buffer, per_segment=per_segment, backend=backend).sqrt()


def scale_(
    buffer: FlatGradBuffer,
    coef: float | torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> None:
    """Multiply every segment by ``coef``: in place, or written cast into ``out``.

    Args:
        buffer: the accumulation buffer.
        coef: a number or 0-d tensor (e.g. the clip coefficient, kept on the device).
        out: optional flat tensor with the buffer's layout (same numel and device; float16, bfloat16, float32 or
            float64, aligned to its element size; memory of its own, not the buffer's); when given, the buffer is
            left as it is and ``out[seg] = (acc[seg] * coef).to(out.dtype)``. A ``coef`` in ``out``'s memory is
            read before the op writes.
        backend: ``"auto"`` or a name from ``BACKENDS``.
    """
    _check_buffer(buffer)
    c = _scalar(coef, "coef", buffer, out)
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
        if out.requires_grad:
            raise ValueError("out must not require grad: the op writes into it outside autograd (pass out.detach())")
        if out.dim() != 1 or out.numel() != buffer.numel or out.device != buffer.device:
            raise ValueError(
                f"out must be a flat tensor of {buffer.numel} elements on {buffer.device}, "
                f"got shape {tuple(out.shape)} on {out.device}"
            )
        if out.dtype not in GRAD_DTYPES or not out.is_contiguous():
            raise ValueError(
                f"out must be a contiguous float16, bfloat16, float32 or float64 tensor, got dtype {out.dtype}"
                + ("" if out.is_contiguous() else " (not contiguous)")
            )
    name = resolve_backend(backend, buffer.device)
    if _eager(buffer.data):
        if out is not None and out.data_ptr() % out.element_size():  # (a traced call has no address to check)
            raise ValueError(
                f"out must start at a multiple of its {out.element_size()}-byte element size, got a view of storage "
                "cut at an odd byte"
            )
        _check_out_apart(out, buffer.data)
        _backend_for(buffer.data, name).scale_(buffer.data, buffer.offsets, buffer.numels, c, out)
    else:
        _scale_op(buffer.data, buffer.offsets, buffer.numels, c, out, name)
