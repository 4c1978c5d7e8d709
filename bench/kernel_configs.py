"""Kernel time alone, and the Triton kernels' block size and warps: what the kernel sweep cannot separate.

The kernel sweep (``kernels.py``) times each call from an idle device, so a sample holds the call's host work
(argument checks, the segment table) as well as the kernel; at 256 MB that host work is a visible share. This
script times every op two ways on the same buffer:

- ``idle``: as the sweep does (``timing.Timer``: caches flushed, device idle at the start, CUDA events);
- ``queued``: the device is kept busy (``torch.cuda._sleep``) while the host issues the call, so the events
  around it measure the kernels alone, as in a training step whose launches run ahead of the device.

Each column is compared with a ``copy_`` of the buffer timed the same way (an idle-started copy pays its own
launch, which at 256 MB is several percent of it).

and repeats the Triton folds with each (block size, warps) of ``--configs`` in place of
``gafused.triton_backend._layout.launch_config``'s choice, to find the configuration that streams fastest.

    python bench/kernel_configs.py --out DIR                 # a GPU: 256 MB and 4 GB, both backends
    python bench/kernel_configs.py --sizes-mb 256 --configs 4096x8,8192x8

Writes ``<device>-<date>-kernel-configs.json`` and ``-kernel-configs.txt`` (the table) to ``--out``. GB/s counts
the bytes an op must move (``traffic.op_bytes_per_element``) against ``copy_`` of the buffer in the same run.
Stopped by SIGTERM (bench/gpu_check.sh's time limit) or Ctrl-C, it writes the rows measured so far, marked
partial (``meta.interrupted``, ``meta.complete``), and exits with 143 (130).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import interrupt  # noqa: E402 - bench/ modules are imported as siblings, after the path is set
import provenance  # noqa: E402
import traffic  # noqa: E402
from kernels import GRAD_DTYPES, SEGMENTS, op_call  # noqa: E402
from timing import Timer, copy_bandwidth_gbps  # noqa: E402

import gafused  # noqa: E402

_MB = 2**20
_FOLDS = ("fold", "fold_finish")
_DEFAULT_CONFIGS = "2048x4,4096x4,4096x8,8192x8,8192x16,16384x16"
# Cycles the device sleeps before a queued sample: long enough for the host to issue any op here (~2 ms at 1.9 GHz).
_SLEEP_CYCLES = 4_000_000


def parse_configs(text: str) -> list[tuple[int, int]]:
    """``"4096x8,8192x16"`` -> [(4096, 8), (8192, 16)]: block size (a power of two) x warps (1 to 32)."""
    configs = []
    for item in text.split(","):
        match = re.fullmatch(r"\s*(\d+)x(\d+)\s*", item)
        if match is None:
            raise ValueError(f"--configs: expected BLOCKxWARPS items like 4096x8, got {item!r}")
        block, warps = int(match[1]), int(match[2])
        if block < 128 or block & (block - 1) or warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"--configs: block must be a power of two >= 128 and warps 1-32 (a power of two), "
                             f"got {item!r}")  # fmt: skip
        configs.append((block, warps))
    return configs


def parse_sizes(text: str) -> list[int]:
    """``"256,4096"`` -> [256, 4096]: fp32 buffer sizes in whole MB, each at least 1."""
    sizes = []
    for item in text.split(","):
        if re.fullmatch(r"\s*\d+\s*", item) is None or int(item) < 1:
            raise ValueError(f"--sizes-mb: expected whole MB >= 1 separated by commas (like 256,4096), got {item!r}")
        sizes.append(int(item))
    return sizes


def _option(parse: Callable[[str], list]) -> Callable[[str], list]:
    """``parse`` as an argparse type: its ValueError becomes argparse's refusal, which names the option."""

    def parsed(text: str) -> list:
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error).split(": ", 1)[-1]) from None

    return parsed


def queued_ms(run: Callable[[], object], flush: torch.Tensor, reps: int) -> float | None:
    """Median ms of ``run``'s kernels alone: each sample is issued while the device sleeps (None off a GPU)."""
    if not flush.is_cuda:
        return None
    samples = []
    for index in range(reps + 1):  # the first sample warms up
        flush.add_(1)
        torch.cuda._sleep(_SLEEP_CYCLES)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        if index:
            samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def queued_copy_gbps(nbytes: int, flush: torch.Tensor, reps: int) -> float | None:
    """``copy_`` bandwidth (read + write) of ``nbytes`` timed as ``queued_ms`` times an op (None off a GPU): the
    ceiling of the queued column, since an idle-started copy pays its own launch."""
    source = torch.empty(nbytes, dtype=torch.uint8, device=flush.device).random_(0, 255)
    target = torch.empty_like(source)
    ms = queued_ms(lambda: target.copy_(source), flush, reps)
    return None if ms is None else 2 * nbytes / (ms * 1e-3) / 1e9


class _Config:
    """Within the block, every Triton kernel runs the blocks and warps of ``config`` (None: the heuristics' own
    choice, ``_layout.launch_config`` and ``fold.fold_num_warps``)."""

    def __init__(self, config: tuple[int, int] | None) -> None:
        from gafused.triton_backend import _layout, fold

        self._config = config
        self._saved = (_layout.launch_config, fold.fold_num_warps)
        self._layout, self._fold = _layout, fold

    def __enter__(self) -> None:
        if self._config is not None:
            config = self._config
            self._layout.launch_config = lambda numels, itemsize=4: config
            self._fold.fold_num_warps = lambda num_warps, acc_itemsize, grad_itemsize: num_warps

    def __exit__(self, *exc: object) -> None:
        self._layout.launch_config, self._fold.fold_num_warps = self._saved


def run(
    device: torch.device,
    sizes_mb: list[float],
    configs: list[tuple[int, int]],
    reps: int,
    rows: list[dict] | None = None,
    where: dict | None = None,
) -> list[dict]:
    """One row per (size, backend, config, op, grad dtype); see the module docstring.

    Off a GPU (a smoke test: Triton under TRITON_INTERPRET=1) only the idle times are taken. ``rows``: the list each
    row is appended to as it is measured (a new one by default; returned), so a caller stopped part-way keeps them;
    ``where["during"]`` names the size, backend and configuration being measured.
    """
    timer = Timer(device, budget_s=0.25, min_reps=min(5, reps), max_reps=reps, warmup=2)
    flush = torch.empty(256 * _MB, dtype=torch.uint8, device=device)
    backends = [b for b in ("triton", "cuda") if b in gafused.available_backends(device)]
    if not backends:
        raise RuntimeError(f"neither fused backend runs on {device}: {gafused.available_backends(device)}")
    rows = [] if rows is None else rows
    where = {} if where is None else where
    for size_mb in sizes_mb:
        numel = int(size_mb * _MB) // 4
        segment = numel // SEGMENTS
        params = [torch.empty((), device=device).expand(segment) for _ in range(SEGMENTS)]
        copy_gbps, _ = copy_bandwidth_gbps(timer, numel * 4)
        copy_queued_gbps = queued_copy_gbps(numel * 4, flush, reps)
        grads = {name: [torch.randn(segment, device=device).to(dtype) for _ in range(SEGMENTS)]
                 for name, dtype in GRAD_DTYPES.items()}  # fmt: skip
        out = torch.zeros(numel, dtype=torch.bfloat16, device=device)
        plan = [(backend, None) for backend in backends]
        plan += [("triton", config) for config in configs if "triton" in backends]
        for backend, config in plan:
            where["during"] = f"{size_mb} MB, {backend}, config {'default' if config is None else config}"
            with _Config(config):
                buffer = gafused.FlatGradBuffer(params)  # a new buffer: its block table is built under the config
                buffer.data.normal_()
                for op in traffic.OP_NAMES:
                    for dtype_name in GRAD_DTYPES if op in _FOLDS else ("bf16",):
                        if config is not None and op not in _FOLDS:
                            continue
                        call = op_call(op, buffer, grads[dtype_name], out, backend)
                        idle = timer.measure(call)
                        queued = queued_ms(call, flush, reps)
                        moved = traffic.op_bytes_per_element(op, GRAD_DTYPES[dtype_name]) * segment * SEGMENTS
                        rows.append({
                            "acc_mb": size_mb, "backend": backend,
                            "config": "default" if config is None else f"{config[0]}x{config[1]}", "op": op,
                            "grad_dtype": dtype_name if op in _FOLDS else "-", "copy_gbps": copy_gbps,
                            "copy_queued_gbps": copy_queued_gbps,
                            "idle_ms": idle.median_ms, "idle_fraction": _fraction(moved, idle.median_ms, copy_gbps),
                            "queued_ms": queued, "queued_fraction": _fraction(moved, queued, copy_queued_gbps),
                        })  # fmt: skip
                del buffer
        del grads, out, params
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _fraction(moved: int, ms: float | None, copy_gbps: float | None) -> float | None:
    return None if ms is None or copy_gbps is None else moved / (ms * 1e-3) / 1e9 / copy_gbps


def _cell(value: float | None, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"


def format_table(rows: list[dict]) -> str:
    header = (f"{'MB':>5} {'backend':<7} {'config':<9} {'op':<15} {'grads':<5} {'idle ms':>9} {'of copy':>8} "
              f"{'queued ms':>10} {'of copy':>8}")  # fmt: skip
    lines = ["kernels alone (queued) and with host work (idle), fraction of the same run's copy_ bandwidth timed the "
             "same way", header]  # fmt: skip
    for r in rows:
        lines.append(
            f"{r['acc_mb']:>5} {r['backend']:<7} {r['config']:<9} {r['op']:<15} {r['grad_dtype']:<5} "
            f"{_cell(r['idle_ms'], '.3f', 9)} {_cell(r['idle_fraction'], '.0%', 8)} "
            f"{_cell(r['queued_ms'], '.3f', 10)} {_cell(r['queued_fraction'], '.0%', 8)}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("."), help="directory for the JSON and the table")
    parser.add_argument("--sizes-mb", type=_option(parse_sizes), default="256,4096",
                        help="fp32 buffer sizes in whole MB (default 256,4096)")  # fmt: skip
    parser.add_argument("--configs", type=_option(parse_configs), default=_DEFAULT_CONFIGS,
                        help=f"Triton BLOCKxWARPS (default {_DEFAULT_CONFIGS})")  # fmt: skip
    parser.add_argument("--reps", type=int, default=30, help="samples per measurement (default 30)")
    args = parser.parse_args(argv)
    if args.reps < 3:
        parser.error(f"--reps must be >= 3, got {args.reps}")
    provenance.check_out_option(parser, args.out)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device: it times GPU kernels")
    sizes, configs = args.sizes_mb, args.configs
    device = torch.device("cuda")
    rows: list[dict] = []
    where: dict = {"during": None}
    stop = None
    with interrupt.sigterm_raises():
        try:
            run(device, sizes, configs, args.reps, rows, where)
        except interrupt.STOPPED as stopped:
            stop = stopped
    with interrupt.sigterm_ignored():
        meta = {"reps": args.reps, "interrupted": None if stop is None else interrupt.describe(stop, where["during"])}
        provenance.save_report(args.out, device, torch.cuda.get_device_name(device), "kernel-configs",
                               {"meta": meta, "rows": rows}, format_table(rows))  # fmt: skip
    return 0 if stop is None else interrupt.exit_status(stop)


if __name__ == "__main__":
    raise SystemExit(main())
