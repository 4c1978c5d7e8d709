"""Kernel sweep: each gafused op on one buffer of growing size, against the copy bandwidth of the same size.

This is the measurement behind the goal of docs/design.md section 3 (each fused kernel at >= 90% of the
device-to-device copy bandwidth on buffers of 256 MB and up): the ops are called directly through
``gafused.ops``, without the wrapper's per-parameter host work, on an fp32 buffer of 8 equal segments.

| op | what runs | minimum bytes per element (bf16 / fp32 grads) |
| --- | --- | --- |
| ``fold`` | ``ops.fold_``, a middle micro-batch | read g, read + write acc: 10 / 12 |
| ``fold_finish`` | ``ops.fold_finish_``, the last micro-batch (scale, sum of squares, flag) | 10 / 12 |
| ``scale_cast`` | ``ops.scale_`` into a bf16 ``out``: clip, hand over the finished grad | read acc, write out: 6 |
| ``sum_of_squares`` | ``ops.sum_of_squares`` | read acc: 4 |

The copy bandwidth of each size is a ``copy_`` of the buffer's own bytes (read + write), timed in the same
run with the same timer. Each row also keeps the median host time of its calls (``host_ms``: how long the call kept
the Python thread busy, gafused's checks and tables and the kernel launcher) beside the copy's (``copy_host_ms``):
on a GPU every sample starts from an idle device, so the kernel cannot start before most of that host work is done.

Everything the sweep allocates (buffer, gradients, the bf16 ``out``) is written before the timed calls. An op
that makes temporaries of its own (the reference backend upcasts a bf16 gradient, or computes ``scale_``'s
product, one segment at a time) may get them fresh from the OS on every call: at large sizes glibc maps such
allocations and unmaps them when freed, and every first touch of a page is a page fault inside the timed call.
A row whose median call takes ``FIRST_TOUCH_FAULTS`` page faults or more (256 KiB of 4 KiB pages; a call on
memory already touched takes none) is kept out of the figures it would distort (status ``dropped: ...``, with
the faults and times it measured): it times the OS's page handling, not the op's bandwidth.
"""

from __future__ import annotations

import torch
import traffic
from progress import ProgressFactory, open_bar
from timing import Timer, copy_bandwidth_gbps, page_size

import gafused
from gafused import ops

__all__ = [
    "KERNEL_OPS",
    "FIRST_TOUCH_FAULTS",
    "sweep_sizes",
    "SEGMENTS",
    "GRAD_DTYPES",
    "op_call",
    "run_kernel_sweep",
    "first_touch_status",
    "format_kernel_table",
]

KERNEL_OPS = traffic.OP_NAMES
# The sweep's buffer: one fp32 buffer of this many equal segments, folded with gradients of these dtypes.
SEGMENTS = 8
_MB = 2**20
GRAD_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# A row whose median timed call takes this many page faults or more is dropped (module doc).
FIRST_TOUCH_FAULTS = 64


_SIZES_MB = {
    "cuda": {"quick": (256, 1024), "default": (256, 1024, 4096), "full": (256, 512, 1024, 2048, 4096)},
    "cpu": {"quick": (4,), "default": (4, 16, 64), "full": (4, 16, 64, 256)},
}


def sweep_sizes(device_type: str, mode: str) -> list[int]:
    """Accumulator sizes in bytes for a run ``mode`` ("quick", "default", "full"): 256 MB to 4 GB on a GPU."""
    return [m * _MB for m in _SIZES_MB["cuda" if device_type == "cuda" else "cpu"][mode]]


def _ops_for(dtype_name: str) -> list[str]:
    # scale_cast and sum_of_squares read only the buffer: one row per size (with the bf16 grads) is enough.
    return [op for op in KERNEL_OPS if dtype_name == "bf16" or op in ("fold", "fold_finish")]


def _fits(device: torch.device, acc_bytes: int) -> bool:
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    # acc, fp32 grads, a bf16 out, the reference backend's temporaries and the timer's cache flush.
    return 3.5 * acc_bytes + 512 * _MB < free


def op_call(op: str, buffer: gafused.FlatGradBuffer, grads: list[torch.Tensor], out: torch.Tensor, backend: str):
    """The call that ``op`` times. Weight and scale are 1, so repeated calls neither vanish nor overflow."""
    one = torch.ones((), device=buffer.device)
    if op == "fold":
        return lambda: ops.fold_(buffer, grads, one, first=False, backend=backend)
    if op == "fold_finish":
        return lambda: ops.fold_finish_(buffer, grads, one, one, first=False, backend=backend)
    if op == "scale_cast":
        return lambda: ops.scale_(buffer, one, out=out, backend=backend)
    return lambda: ops.sum_of_squares(buffer, backend=backend)


def run_kernel_sweep(
    device: torch.device,
    mode: str,
    timer: Timer,
    progress: ProgressFactory | None = None,
    rows: list[dict] | None = None,
) -> list[dict]:
    """Time every op of every gafused backend that runs on ``device`` at every sweep size.

    Args:
        device: where to run; every backend ``gafused.available_backends(device)`` lists, except Triton off a
            GPU (its interpreter is not a benchmark).
        mode: "quick", "default" or "full": which sizes (``sweep_sizes``).
        timer: the run's timer.
        progress: the run's progress factory (see progress.py), or None.
        rows: the list each row is appended to as soon as it is measured (so a caller whose run is stopped keeps
            the rows already measured); a new one by default. Returned.
    """
    backends = [b for b in gafused.available_backends(device) if not (b == "triton" and device.type != "cuda")]
    sizes = sweep_sizes(device.type, mode)
    per_size = len(backends) * sum(len(_ops_for(name)) for name in GRAD_DTYPES)
    rows = [] if rows is None else rows
    with open_bar(progress, "kernel sweep (ops vs copy_)", total=len(sizes) * per_size) as bar:
        for acc_bytes in sizes:
            if not _fits(device, acc_bytes):
                rows.append({"acc_mb": acc_bytes // _MB, "status": "skipped: not enough free device memory"})
                bar.update(per_size)
                continue
            numel = acc_bytes // 4
            segment = numel // SEGMENTS
            # Stand-ins for parameters: the buffer needs their shape, dtype and device, not their memory.
            params = [torch.empty((), device=device).expand(segment) for _ in range(SEGMENTS)]
            copy_gbps, copy_timing = copy_bandwidth_gbps(timer, acc_bytes)
            for backend in backends:
                buffer = gafused.FlatGradBuffer(params)
                buffer.data.normal_()
                out = torch.zeros(buffer.numel, dtype=torch.bfloat16, device=device)  # touched before timing
                for dtype_name, dtype in GRAD_DTYPES.items():
                    grads = [torch.randn(segment, device=device).to(dtype) for _ in range(SEGMENTS)]
                    for op in _ops_for(dtype_name):
                        timing = timer.measure(op_call(op, buffer, grads, out, backend))
                        moved = traffic.op_bytes_per_element(op, dtype) * segment * SEGMENTS
                        gbps = moved / (timing.median_ms * 1e-3) / 1e9
                        rows.append({
                            "status": first_touch_status(timing.page_faults), "acc_mb": acc_bytes // _MB,
                            "backend": backend, "op": op,
                            "grad_dtype": dtype_name if op in ("fold", "fold_finish") else "-",
                            "median_ms": timing.median_ms, "q20_ms": timing.q20_ms, "q80_ms": timing.q80_ms,
                            "reps": timing.reps, "host_ms": timing.host_ms, "gbps": gbps, "copy_gbps": copy_gbps,
                            "copy_host_ms": copy_timing.host_ms,
                            "fraction_of_copy_bw": gbps / copy_gbps, "page_faults": timing.page_faults,
                        })  # fmt: skip
                        bar.update()
                    del grads
                del buffer, out
    return rows


def first_touch_status(page_faults: float | None) -> str:
    """A row's status: ``ok``, or why it is dropped (its timed calls first touched memory; module doc)."""
    if page_faults is None or page_faults < FIRST_TOUCH_FAULTS:
        return "ok"
    return (
        f"dropped: {page_faults:.0f} page faults per call (at least {page_faults * page_size() / _MB:.1f} MiB "
        f"first touched inside the timed call), so the time is page handling, not bandwidth"
    )


def format_kernel_table(rows: list[dict]) -> str:
    """One line per (size, backend, op, grad dtype)."""
    header = (
        f"{'acc MB':>7} {'backend':10} {'op':15} {'grads':5} {'ms':>9} {'[q20, q80]':>19} {'host ms':>8} {'GB/s':>8} "
        f"{'of copy':>8}"
    )
    lines = ["kernel sweep (fp32 buffer, 8 segments; GB/s by minimum bytes; copy of the same size, same run)", header]
    for row in rows:
        if row["status"] != "ok":
            where = f" {row['backend']:10} {row['op']:15} {row['grad_dtype']:5}" if "op" in row else ""
            lines.append(f"{row['acc_mb']:>7}{where} {row['status']}")
            continue
        quantiles = f"[{row['q20_ms']:.3f}, {row['q80_ms']:.3f}]"
        lines.append(
            f"{row['acc_mb']:>7} {row['backend']:10} {row['op']:15} {row['grad_dtype']:5} {row['median_ms']:9.3f} "
            f"{quantiles:>19} {row['host_ms']:8.3f} {row['gbps']:8.1f} {row['fraction_of_copy_bw']:8.1%}"
        )
    return "\n".join(lines)
