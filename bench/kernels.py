"""Kernel sweep: each gafused op on one buffer of growing size, against the copy bandwidth of the same size.

This is the measurement behind the goal of DESIGN.md section 3 (each fused kernel at >= 90% of the
device-to-device copy bandwidth on buffers of 256 MB and up): the ops are called directly through
``gafused.ops``, without the wrapper's per-parameter host work, on an fp32 buffer of 8 equal segments.

| op | what runs | minimum bytes per element (bf16 / fp32 grads) |
| --- | --- | --- |
| ``fold`` | ``ops.fold_``, a middle micro-batch | read g, read + write acc: 10 / 12 |
| ``fold_finish`` | ``ops.fold_finish_``, the last micro-batch (scale, sum of squares, flag) | 10 / 12 |
| ``scale_cast`` | ``ops.scale_`` into a bf16 ``out``: clip, hand over the finished grad | read acc, write out: 6 |
| ``sum_of_squares`` | ``ops.sum_of_squares`` | read acc: 4 |

The copy bandwidth of each size is a ``copy_`` of the buffer's own bytes (read + write), timed in the same
run with the same timer.
"""

from __future__ import annotations

import torch
import traffic
from timing import Timer, copy_bandwidth_gbps

import gafused
from gafused import ops

__all__ = ["KERNEL_OPS", "sweep_sizes", "run_kernel_sweep", "format_kernel_table", "write_kernel_plot"]

KERNEL_OPS = traffic.OP_NAMES
_SEGMENTS = 8
_MB = 2**20
_GRAD_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def sweep_sizes(device_type: str, quick: bool) -> list[int]:
    """Accumulator sizes in bytes: 256 MB to 4 GB on a GPU; small ones on CPU and in quick runs."""
    if device_type == "cuda":
        return [256 * _MB, 1024 * _MB] if quick else [m * _MB for m in (256, 512, 1024, 2048, 4096)]
    return [4 * _MB] if quick else [16 * _MB, 64 * _MB, 256 * _MB]


def _fits(device: torch.device, acc_bytes: int) -> bool:
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    # acc, fp32 grads, a bf16 out, the reference backend's temporaries and the timer's cache flush.
    return 3.5 * acc_bytes + 512 * _MB < free


def _work(op: str, buffer: gafused.FlatGradBuffer, grads: list[torch.Tensor], out: torch.Tensor, backend: str):
    """The call that ``op`` times. Weight and scale are 1, so repeated calls neither vanish nor overflow."""
    one = torch.ones((), device=buffer.device)
    if op == "fold":
        return lambda: ops.fold_(buffer, grads, one, first=False, backend=backend)
    if op == "fold_finish":
        return lambda: ops.fold_finish_(buffer, grads, one, one, first=False, backend=backend)
    if op == "scale_cast":
        return lambda: ops.scale_(buffer, one, out=out, backend=backend)
    return lambda: ops.sum_of_squares(buffer, backend=backend)


def run_kernel_sweep(device: torch.device, quick: bool, timer: Timer, progress: bool = True) -> list[dict]:
    """Time every op of every gafused backend that runs on ``device`` at every sweep size.

    Args:
        device: where to run; the Triton interpreter is not a benchmark, so CPU runs the reference backend.
        quick: the small sizes of a smoke run.
        timer: the run's timer.
        progress: print a line per size.
    """
    backends = [b for b in gafused.available_backends(device) if not (b == "triton" and device.type != "cuda")]
    rows: list[dict] = []
    for acc_bytes in sweep_sizes(device.type, quick):
        if not _fits(device, acc_bytes):
            rows.append({"acc_mb": acc_bytes // _MB, "status": "skipped: not enough free device memory"})
            continue
        numel = acc_bytes // 4
        segment = numel // _SEGMENTS
        # Stand-ins for parameters: the buffer needs their shape, dtype and device, not their memory.
        params = [torch.empty((), device=device).expand(segment) for _ in range(_SEGMENTS)]
        copy_gbps, _ = copy_bandwidth_gbps(timer, acc_bytes)
        for backend in backends:
            buffer = gafused.FlatGradBuffer(params)
            buffer.data.normal_()
            out = torch.empty(buffer.numel, dtype=torch.bfloat16, device=device)
            for dtype_name, dtype in _GRAD_DTYPES.items():
                grads = [torch.randn(segment, device=device).to(dtype) for _ in range(_SEGMENTS)]
                for op in KERNEL_OPS:
                    if op in ("scale_cast", "sum_of_squares") and dtype_name != "bf16":
                        continue  # these read only the buffer: one row per size is enough
                    timing = timer.measure(_work(op, buffer, grads, out, backend))
                    moved = traffic.op_bytes_per_element(op, dtype) * segment * _SEGMENTS
                    gbps = moved / (timing.median_ms * 1e-3) / 1e9
                    rows.append({
                        "status": "ok", "acc_mb": acc_bytes // _MB, "backend": backend, "op": op,
                        "grad_dtype": dtype_name if op in ("fold", "fold_finish") else "-",
                        "median_ms": timing.median_ms, "q20_ms": timing.q20_ms, "q80_ms": timing.q80_ms,
                        "reps": timing.reps, "gbps": gbps, "copy_gbps": copy_gbps,
                        "fraction_of_copy_bw": gbps / copy_gbps,
                    })  # fmt: skip
                del grads
            del buffer, out
        if progress:
            print(f"[kernels] {acc_bytes // _MB} MB done (copy {copy_gbps:.1f} GB/s)", flush=True)
    return rows


def format_kernel_table(rows: list[dict]) -> str:
    """One line per (size, backend, op, grad dtype)."""
    header = (
        f"{'acc MB':>7} {'backend':10} {'op':15} {'grads':5} {'ms':>9} {'[q20, q80]':>19} {'GB/s':>8} {'of copy':>8}"
    )
    lines = ["kernel sweep (fp32 buffer, 8 segments; GB/s by minimum bytes; copy of the same size, same run)", header]
    for row in rows:
        if row["status"] != "ok":
            lines.append(f"{row['acc_mb']:>7} {row['status']}")
            continue
        quantiles = f"[{row['q20_ms']:.3f}, {row['q80_ms']:.3f}]"
        lines.append(
            f"{row['acc_mb']:>7} {row['backend']:10} {row['op']:15} {row['grad_dtype']:5} {row['median_ms']:9.3f} "
            f"{quantiles:>19} {row['gbps']:8.1f} {row['fraction_of_copy_bw']:8.1%}"
        )
    return "\n".join(lines)


def write_kernel_plot(rows: list[dict], path: str, device_label: str) -> str | None:
    """Fraction of copy bandwidth against buffer size, one line per (backend, op, grad dtype)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return None
    figure, axis = plt.subplots(figsize=(8, 4.5))
    for key in dict.fromkeys((r["backend"], r["op"], r["grad_dtype"]) for r in ok):
        points = sorted(
            (r["acc_mb"], r["fraction_of_copy_bw"]) for r in ok if (r["backend"], r["op"], r["grad_dtype"]) == key
        )
        label = f"{key[0]} {key[1]}" + (f" ({key[2]} grads)" if key[2] != "-" else "")
        axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    axis.set_xscale("log", base=2)
    axis.axhline(0.9, color="black", linewidth=0.8, linestyle="--", label="goal: 90% of copy")
    axis.set_xlabel("fp32 accumulation buffer (MB)")
    axis.set_ylabel("fraction of copy bandwidth")
    axis.set_title(f"gafused ops vs copy_ of the same size - {device_label}", fontsize=10)
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
