"""FlatGradBuffer: where accumulated gradients live.

Layout only: the parameters of one device are laid end to end in one flat tensor of the accumulation
dtype, each segment starting on an aligned boundary so kernels can use wide loads. The buffer knows
nothing about windows, weights or backends.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["FlatGradBuffer", "ACCUM_DTYPES"]

# Wider-than-parameter accumulation is the point of the buffer; narrower ones would lose bits.
ACCUM_DTYPES = (torch.float32, torch.float64)


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


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
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        accum_dtype: torch.dtype = torch.float32,
        alignment_bytes: int = 64,
    ) -> None:
        params = list(params)
        if not params:
            raise ValueError("FlatGradBuffer: params must hold at least one tensor")
        if accum_dtype not in ACCUM_DTYPES:
            raise ValueError(f"FlatGradBuffer: accum_dtype must be one of {ACCUM_DTYPES}, got {accum_dtype}")
        if alignment_bytes < 16 or alignment_bytes & (alignment_bytes - 1):
            raise ValueError(f"FlatGradBuffer: alignment_bytes must be a power of two >= 16, got {alignment_bytes}")
        devices = {p.device for p in params}
        if len(devices) != 1:
            raise ValueError(f"FlatGradBuffer: params must share one device, got {sorted(map(str, devices))}")
        for p in params:
            if not p.is_floating_point():
                raise ValueError(f"FlatGradBuffer: params must be floating point, got {p.dtype}")
            if torch.finfo(p.dtype).bits > torch.finfo(accum_dtype).bits:
                raise ValueError(
                    f"FlatGradBuffer: accum_dtype {accum_dtype} is narrower than a parameter's dtype {p.dtype}"
                )

        self.params: list[torch.Tensor] = params
        self.device: torch.device = params[0].device
        self.accum_dtype: torch.dtype = accum_dtype
        self.alignment_bytes: int = alignment_bytes
        self.shapes: list[torch.Size] = [p.shape for p in params]
        self.numels: list[int] = [p.numel() for p in params]

        align_elems = alignment_bytes // torch.empty((), dtype=accum_dtype).element_size()
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
        source = self.data if data is None else data
        if source.dim() != 1 or source.numel() != self.numel:
            raise ValueError(f"FlatGradBuffer.view: data must be flat with {self.numel} elements, got {source.shape}")
        start = self.offsets[index]
        return source[start : start + self.numels[index]].view(self.shapes[index])

    def views(self, data: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Every segment shaped like its parameter (see ``view``)."""
        return [self.view(i, data) for i in range(len(self))]
