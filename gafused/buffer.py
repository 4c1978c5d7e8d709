"""FlatGradBuffer: where accumulated gradients live.

Layout only: the parameters of one device are laid end to end in one flat tensor of the accumulation
dtype, each segment starting on an aligned boundary so kernels can use wide loads. Segments are grouped into
buckets, contiguous runs of a bounded size in reverse registration order (the order backward produces
gradients in most models), so a bucket can be folded as soon as its gradients exist. The buffer knows nothing
about windows, weights or backends.

A segment holds its parameter's elements in the parameter's *memory* order: a channels_last parameter's
segment is laid out channels_last, and the view handed out as ``p.grad`` has the parameter's strides (fused
optimizers walk a gradient's memory as if it were the parameter's).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

__all__ = ["FlatGradBuffer", "ACCUM_DTYPES"]

# Wider-than-parameter accumulation is the point of the buffer; narrower ones would lose bits.
ACCUM_DTYPES = (torch.float32, torch.float64)
# Parameter (and gradient) dtypes the ops fold.
PARAM_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


DEFAULT_BUCKET_BYTES = 32 * 2**20
_T = TypeVar("_T")


def by_device_and_dtype(items: list[_T], key: Callable[[_T], torch.Tensor]) -> list[list[_T]]:
    """``items`` split by the (device, dtype) of their parameter (``key``), each kind in the order first met, each
    item in its order: the parameters of each buffer (one per kind), and the buffers in order."""
    kinds: dict[tuple[torch.device, torch.dtype], list[_T]] = {}
    for item in items:
        param = key(item)
        kinds.setdefault((param.device, param.dtype), []).append(item)
    return list(kinds.values())


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def memory_order_strides(tensor: torch.Tensor) -> tuple[int, ...]:
    """The strides a segment for ``tensor`` uses: its own when they cover its elements densely (contiguous,
    channels_last, any permutation), else the contiguous ones."""
    if not tensor.is_contiguous() and _dense(tensor.shape, tensor.stride()):
        return tuple(tensor.stride())
    return _contiguous_strides(tensor.shape)


def _dense(shape: torch.Size, strides: tuple[int, ...]) -> bool:
    """Whether the elements fill one block of memory with no gaps or overlaps (some permutation of row-major)."""
    expected = 1
    for stride, size in sorted((stride, size) for size, stride in zip(shape, strides, strict=True) if size != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))


def check_layout(offsets: Sequence[int], numels: Sequence[int], acc_numel: int) -> None:
    """Refuse a layout a backend cannot run: segments must be in order, disjoint, and inside ``acc``.

    ``FlatGradBuffer`` only builds such layouts; this guards the backends' own entry points, where overlapping
    segments would be folded by concurrent blocks (a race on a GPU) or scaled twice.
    """
    if len(offsets) != len(numels):
        raise ValueError(f"offsets and numels must have the same length, got {len(offsets)} and {len(numels)}")
    end = 0
    for index, (start, numel) in enumerate(zip(offsets, numels, strict=True)):
        if start < 0 or numel < 0:
            raise ValueError(f"segment {index} has a negative offset or numel ({start}, {numel})")
        if start < end:
            raise ValueError(
                f"segment {index} starts at {start}, before segment {index - 1} ends at {end}: segments must be "
                "ordered and non-overlapping"
            )
        end = start + numel
        if end > acc_numel:
            raise ValueError(f"segment {index} [{start}, {end}) lies outside acc of {acc_numel} elements")


def _bucket_ranges(numels: list[int], element_size: int, bucket_bytes: int) -> list[range]:
    """Contiguous runs of segments of about ``bucket_bytes``, cut from the last segment backwards (backward
    produces the last layers' gradients first, as DDP assumes); returned in that order, last segments first."""
    ranges: list[range] = []
    stop = len(numels)
    size = 0
    for index in range(len(numels) - 1, -1, -1):
        size += numels[index] * element_size
        if size >= bucket_bytes or index == 0:
            ranges.append(range(index, stop))
            stop, size = index, 0
    return ranges


class FlatGradBuffer:
    """One contiguous accumulation buffer for the parameters of one device.

    Segment ``i`` holds parameter ``i``'s gradient at ``data[offsets[i] : offsets[i] + numels[i]]``.
    Offsets are Python ints (64-bit by construction: a 7B model has more than 2**31 elements) and are
    mirrored on the device as an int64 tensor for kernels. Padding between segments is zero when the
    buffer is created and no op ever writes it, so reductions over ``data`` as a whole are exact.

    Args:
        params: parameters of one device, in the order the segments are laid out.
        accum_dtype: dtype of the buffer, ``torch.float32`` or ``torch.float64``.
        alignment_bytes: every segment starts at a multiple of this many bytes (at least 16, a power of two).
        bucket_bytes: buckets are runs of consecutive segments, cut from the last segment backwards as soon as a
            run reaches this many bytes of the buffer: each holds at least that many (all but the one with segment
            0), and less than that many plus the bytes of its own first segment (a segment larger than
            ``bucket_bytes`` closes the run of smaller segments after it).
    """

    # Built under torch.inference_mode(), its tensors would be inference tensors, which no fold may update later.
    @torch.inference_mode(False)
    def __init__(
        self,
        params: Sequence[torch.Tensor],
        accum_dtype: torch.dtype = torch.float32,
        alignment_bytes: int = 64,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        if isinstance(params, torch.Tensor):  # list() would make its rows the parameters
            raise TypeError("FlatGradBuffer: params must be a sequence of tensors, got one tensor: pass [tensor]")
        params = list(params)
        if not params:
            raise ValueError("FlatGradBuffer: params must hold at least one tensor")
        if accum_dtype not in ACCUM_DTYPES:
            raise ValueError(f"FlatGradBuffer: accum_dtype must be one of {ACCUM_DTYPES}, got {accum_dtype}")
        if (
            isinstance(alignment_bytes, bool)
            or not isinstance(alignment_bytes, numbers.Integral)
            or alignment_bytes < 16
            or alignment_bytes & (alignment_bytes - 1)
        ):
            raise ValueError(f"FlatGradBuffer: alignment_bytes must be a power of two >= 16, got {alignment_bytes}")
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, numbers.Integral) or bucket_bytes < 1:
            raise ValueError(f"FlatGradBuffer: bucket_bytes must be a positive int, got {bucket_bytes!r}")
        bucket_bytes = int(bucket_bytes)  # (a NumPy integer passes the check)
        for i, p in enumerate(params):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"FlatGradBuffer: params[{i}] must be a torch.Tensor, got {type(p).__name__}")
            if p.dtype not in PARAM_DTYPES:
                raise ValueError(
                    f"FlatGradBuffer: params[{i}] must be float16, bfloat16, float32 or float64 (the gradient dtypes "
                    f"the ops fold), got {p.dtype}"
                )
            if p.layout != torch.strided:
                raise ValueError(f"FlatGradBuffer: params[{i}] must be a dense (strided) tensor, got {p.layout}")
            if torch.finfo(p.dtype).bits > torch.finfo(accum_dtype).bits:
                raise ValueError(
                    f"FlatGradBuffer: accum_dtype {accum_dtype} is narrower than params[{i}]'s dtype {p.dtype}"
                )
        devices = {p.device for p in params}
        if len(devices) != 1:
            raise ValueError(f"FlatGradBuffer: params must share one device, got {sorted(map(str, devices))}")

        self.params: list[torch.Tensor] = params
        self.device: torch.device = params[0].device
        self.accum_dtype: torch.dtype = accum_dtype
        self.alignment_bytes: int = int(alignment_bytes)
        self.shapes: list[torch.Size] = [p.shape for p in params]
        self.numels: list[int] = [p.numel() for p in params]
        self.strides: list[tuple[int, ...]] = [memory_order_strides(p) for p in params]
        # Segments whose memory order is not row-major (channels_last and other permutations).
        self.permuted: frozenset[int] = frozenset(
            i for i, p in enumerate(params) if self.strides[i] != _contiguous_strides(p.shape)
        )

        element_size = torch.empty((), dtype=accum_dtype).element_size()
        align_elems = alignment_bytes // element_size
        offsets: list[int] = []
        cursor = 0
        for numel in self.numels:
            offsets.append(cursor)
            cursor = _round_up(cursor + numel, align_elems)
        self.offsets: list[int] = offsets
        self.numel: int = cursor
        self.data: torch.Tensor = torch.zeros(cursor, dtype=accum_dtype, device=self.device)
        self._offsets_tensor: torch.Tensor | None = None
        self._numels_tensor: torch.Tensor | None = None
        self.bucket_ranges: list[range] = _bucket_ranges(self.numels, element_size, bucket_bytes)
        self._buckets: list[FlatGradBuffer] | None = None
        self._is_bucket = False

    @property
    def buckets(self) -> list[FlatGradBuffer]:
        """One buffer per bucket, in ``bucket_ranges`` order: same layout rules, ``data`` a view of this buffer.

        Every op takes a bucket wherever it takes a buffer; segment ``j`` of bucket ``b`` is segment
        ``bucket_ranges[b][j]`` of this buffer.
        """
        if self._buckets is None:
            if self._is_bucket:  # its one bucket is itself: a list made per call, not kept (a reference cycle
                return [self]  # would keep the buffer alive after its owner drops it, until a gc pass)
            self._buckets = [self._sub_buffer(indices) for indices in self.bucket_ranges]
        return self._buckets

    def _sub_buffer(self, indices: range) -> FlatGradBuffer:
        sub = object.__new__(FlatGradBuffer)
        start = self.offsets[indices.start]
        end = self.offsets[indices.stop] if indices.stop < len(self) else self.numel
        sub.params = self.params[indices.start : indices.stop]
        sub.device, sub.accum_dtype, sub.alignment_bytes = self.device, self.accum_dtype, self.alignment_bytes
        sub.shapes = self.shapes[indices.start : indices.stop]
        sub.numels = self.numels[indices.start : indices.stop]
        sub.strides = self.strides[indices.start : indices.stop]
        sub.permuted = frozenset(i - indices.start for i in self.permuted if i in indices)
        sub.offsets = [offset - start for offset in self.offsets[indices.start : indices.stop]]
        sub.numel = end - start
        sub.data = self.data[start:end]
        sub._offsets_tensor = sub._numels_tensor = None
        sub.bucket_ranges = [range(len(sub.numels))]
        sub._buckets = None
        sub._is_bucket = True
        return sub

    def __len__(self) -> int:
        return len(self.params)

    def __repr__(self) -> str:
        return (
            f"FlatGradBuffer(segments={len(self)}, numel={self.numel}, accum_dtype={self.accum_dtype}, "
            f"device={self.device}, alignment_bytes={self.alignment_bytes})"
        )

    @property
    def offsets_tensor(self) -> torch.Tensor:
        """Segment start offsets as an int64 tensor on the buffer's device (made once, then cached)."""
        if self._offsets_tensor is None:
            self._offsets_tensor = torch.tensor(self.offsets, dtype=torch.int64, device=self.device)
        return self._offsets_tensor

    @property
    def numels_tensor(self) -> torch.Tensor:
        """Segment lengths as an int64 tensor on the buffer's device (made once, then cached)."""
        if self._numels_tensor is None:
            self._numels_tensor = torch.tensor(self.numels, dtype=torch.int64, device=self.device)
        return self._numels_tensor

    def segment(self, index: int) -> torch.Tensor:
        """Flat view of segment ``index`` (no copy)."""
        start = self.offsets[index]
        return self.data[start : start + self.numels[index]]

    def view(self, index: int, data: torch.Tensor | None = None) -> torch.Tensor:
        """Segment ``index`` shaped like its parameter, a view into ``data`` (default: the buffer itself).

        ``data`` may be any flat tensor with this buffer's layout, e.g. a lower-precision copy of it.
        """
        source = self._checked_source(data, "view")
        # The segment holds the parameter's memory order: the view has the parameter's strides.
        return source.as_strided(self.shapes[index], self.strides[index], source.storage_offset() + self.offsets[index])

    def views(self, data: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Every segment shaped like its parameter (see ``view``)."""
        source = self._checked_source(data, "views")
        base = source.storage_offset()
        return [
            source.as_strided(shape, strides, base + offset)
            for shape, strides, offset in zip(self.shapes, self.strides, self.offsets, strict=True)
        ]

    def _checked_source(self, data: torch.Tensor | None, caller: str) -> torch.Tensor:
        source = self.data if data is None else data
        if source.dim() != 1 or source.numel() != self.numel or not source.is_contiguous():
            raise ValueError(
                f"FlatGradBuffer.{caller}: data must be flat and contiguous with {self.numel} elements, "
                f"got shape {tuple(source.shape)}"
            )
        return source
