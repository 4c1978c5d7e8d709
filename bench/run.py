"""Benchmarks of gafused against the ways gradients are accumulated today.

    python bench/run.py            # full run: GPU sizes on a GPU, scaled-down sets on CPU
    python bench/run.py --quick    # smoke run (CI): small sets, short budgets

Prints a table, and writes JSON, CSV and PNG plots named after the device and the date under ``--out``
(default ``bench/results``). What each column means is in bench/README.md.

The pieces: ``param_sets`` (shapes), ``providers`` (what is compared), ``traffic`` (minimum bytes),
``timing`` (how a number is measured), ``e2e`` (a training step). This file only wires them together.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import functools
import gc
import json
import platform
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import e2e  # noqa: E402 - bench/ modules are imported as siblings, after the path is set
import kernels  # noqa: E402
import param_sets  # noqa: E402
import providers  # noqa: E402
import timing  # noqa: E402
import traffic  # noqa: E402

import gafused  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
MEASURED_MOMENTS = ("middle", "last")


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"CPU {line.split(':', 1)[1].strip()}"
    except OSError:
        pass
    return f"CPU {platform.processor() or platform.machine()}"


def _sanitize(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sets and short budgets (CI smoke run)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results", help="output dir")
    parser.add_argument("--sets", help="comma-separated set names (default: every set for the device)")
    parser.add_argument("--providers", help=f"comma-separated, from {', '.join(providers.PROVIDERS)}")
    parser.add_argument("--dtypes", default="bf16,fp32", help="gradient dtypes, from bf16, fp32")
    parser.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--accumulation-steps", type=int, default=4, help="N (>= 3)")
    parser.add_argument(
        "--compile-max-tensors",
        type=int,
        help="skip `compiled` on sets with more tensors (compile time grows with the count); "
        "default 512; in --quick only the set with the fewest tensors, first dtype, is compiled",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads for torch (default 1: on a shared machine more threads than free cores make "
        "timings swing by 100x; the count is recorded with the results)",
    )
    parser.add_argument("--no-e2e", action="store_true", help="skip the end-to-end training step")
    parser.add_argument("--no-kernels", action="store_true", help="skip the kernel sweep (ops vs buffer size)")
    parser.add_argument(
        "--kernels-only", action="store_true", help="run only the kernel sweep: 256 MB to 4 GB buffers on a GPU"
    )
    parser.add_argument("--no-plots", action="store_true", help="write no PNG files")
    parser.add_argument("--plot-only", type=Path, metavar="JSON", help="redraw the PNGs of a results file and exit")
    return parser.parse_args(argv)


def _memory_needed(param_set: param_sets.ParamSet, dtype: torch.dtype) -> int:
    """Bytes alive at once for one provider: params, one grad set, fp32 accumulators, finished grads."""
    size = torch.empty((), dtype=dtype).element_size()
    return param_set.numel * (size + size + 4 + size)


def _compile_skip_reason(args, sets, dtype_index: int, param_set) -> str | None:
    fewest = min(sets, key=lambda s: s.count)
    if args.quick and (param_set is not fewest or dtype_index != 0):
        return f"skipped in --quick: only {fewest.name} with the first dtype is compiled (compile time)"
    limit = 512 if args.compile_max_tensors is None else args.compile_max_tensors
    if param_set.count > limit:
        return f"skipped: {param_set.count} tensors > --compile-max-tensors {limit} (compile time)"
    return None


def _measure_provider(name, params, pool, args, device, timer) -> dict:
    """Middle and last micro-batch of one provider: timings and launch counts, or the reason it did not run."""
    result = {}
    provider = providers.make_provider(name, params, pool, args.accumulation_steps, max_grad_norm=1.0)
    result["backend"] = getattr(getattr(provider, "accumulator", None), "backend", None)
    for moment in MEASURED_MOMENTS:
        prepare = functools.partial(provider.prepare, moment)
        result[moment] = (
            timer.measure(provider.step, prepare),
            timing.count_launches(provider.step, prepare, device),
        )
    return result


def run_micro(args, device: torch.device, timer: timing.Timer, copy_gbps: float) -> list[dict]:
    """Every (set, dtype, provider, moment) row of the accumulation micro-benchmark."""
    sets = param_sets.default_sets(device.type, args.quick)
    if args.sets:
        wanted = args.sets.split(",")
        sets = [s for s in sets if s.name in wanted]
        if not sets:
            raise SystemExit(f"--sets: none of {wanted} exists on {device.type}; choose from "
                             f"{[s.name for s in param_sets.default_sets(device.type, args.quick)]}")  # fmt: skip
    names = providers.provider_names(device)
    if args.providers:
        unknown = set(args.providers.split(",")) - set(providers.PROVIDERS)
        if unknown:
            raise SystemExit(f"--providers: unknown {sorted(unknown)}; choose from {providers.PROVIDERS}")
        missing = [n for n in args.providers.split(",") if n not in names]
        for name in missing:
            reason = gafused.ops.backend_unavailable_reason(name.removeprefix("gafused-"), device)
            print(f"--providers: {name} cannot run on {device.type}: {reason or 'not timed there'}", file=sys.stderr)
        names = [n for n in names if n in args.providers.split(",")]
    dtypes = args.dtypes.split(",")
    if set(dtypes) - set(DTYPES):
        raise SystemExit(f"--dtypes must be a subset of {list(DTYPES)}, got {args.dtypes}")

    rows: list[dict] = []
    total = len(sets) * len(dtypes) * len(names)
    done = 0
    for param_set in sets:
        for dtype_index, dtype_name in enumerate(dtypes):
            dtype = DTYPES[dtype_name]
            base = {
                "set": param_set.name,
                "tensors": param_set.count,
                "elements": param_set.numel,
                "grad_dtype": dtype_name,
                "param_dtype": dtype_name,
            }
            skip_all = None
            if device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(device)
                needed = _memory_needed(param_set, dtype)
                if needed > 0.9 * free:
                    skip_all = f"skipped: needs ~{needed / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
            params = pool = None
            if skip_all is None:
                params = [torch.nn.Parameter(torch.empty(s, dtype=dtype, device=device)) for s in param_set.shapes]
                # One gradient set suffices: caches are flushed before every sample (see timing.py).
                pool = [[torch.randn(s, dtype=dtype, device=device) for s in param_set.shapes]]
            for name in names:
                done += 1
                status = skip_all
                if status is None and name == "compiled":
                    status = _compile_skip_reason(args, sets, dtype_index, param_set)
                started = time.perf_counter()
                measured = None
                if status is None:
                    try:
                        measured = _measure_provider(name, params, pool, args, device, timer)
                        status = "ok"
                    except Exception as error:  # noqa: BLE001 - a provider that fails is reported, not fatal
                        status = f"failed: {type(error).__name__}: {str(error).splitlines()[0][:200]}"
                    gc.collect()
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                summary = status
                for moment in MEASURED_MOMENTS:
                    row = {**base, "provider": name, "moment": moment, "status": status}
                    if measured is not None:
                        row.update(_row_numbers(measured[moment], moment, param_set, dtype, copy_gbps))
                        row["backend"] = measured["backend"]
                        summary = ", ".join(f"{m} {measured[m][0].median_ms:.3f} ms" for m in MEASURED_MOMENTS)
                    rows.append(row)
                print(
                    f"[{done}/{total}] {param_set.name} {dtype_name} {name}: {summary} "
                    f"({time.perf_counter() - started:.1f}s)",
                    file=sys.stderr,
                    flush=True,
                )
            del params, pool
            gc.collect()
    _add_speedups(rows)
    return rows


def _row_numbers(measured, moment, param_set, dtype, copy_gbps) -> dict:
    timed, launches = measured
    nbytes = traffic.min_bytes(moment, param_set.numel, dtype)
    gbps = nbytes / (timed.median_ms * 1e-3) / 1e9
    return {
        "median_ms": timed.median_ms,
        "q20_ms": timed.q20_ms,
        "q80_ms": timed.q80_ms,
        "reps": timed.reps,
        "min_bytes": nbytes,
        "gbps": gbps,
        "fraction_of_copy_bw": gbps / copy_gbps,
        "launches": launches,
    }


def _add_speedups(rows: list[dict]) -> None:
    """speedup_vs_X = X's median time / this row's, within the same set, dtype and moment."""
    reference = {
        (r["set"], r["grad_dtype"], r["moment"], r["provider"]): r["median_ms"] for r in rows if r["status"] == "ok"
    }
    for row in rows:
        for baseline in ("naive", "foreach"):
            base = reference.get((row["set"], row["grad_dtype"], row["moment"], baseline))
            ok = row["status"] == "ok" and base is not None
            row[f"speedup_vs_{baseline}"] = base / row["median_ms"] if ok else None


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_micro_table(rows: list[dict], unit: str) -> str:
    header = (
        f"{'set':<20} {'dtype':<5} {'moment':<6} {'provider':<18} {'ms':>9} {'[q20, q80]':>19} {'GB/s':>8} "
        f"{'of copy':>7} {'launch':>6} {'vs naive':>8} {'vs foreach':>10}"
    )
    lines = [f"launch = {unit} per micro-batch", header, "-" * len(header)]
    for r in sorted(rows, key=lambda r: (r["set"], r["grad_dtype"], r["moment"] == "last")):
        if r["status"] != "ok":
            lines.append(f"{r['set']:<20} {r['grad_dtype']:<5} {r['moment']:<6} {r['provider']:<18} {r['status']}")
            continue
        quantiles = f"[{r['q20_ms']:.3f}, {r['q80_ms']:.3f}]"
        lines.append(
            f"{r['set']:<20} {r['grad_dtype']:<5} {r['moment']:<6} {r['provider']:<18} {r['median_ms']:>9.3f} "
            f"{quantiles:>19} {r['gbps']:>8.2f} {r['fraction_of_copy_bw']:>7.1%} {r['launches']:>6} "
            f"{_fmt(r['speedup_vs_naive'], '.2f'):>8} {_fmt(r['speedup_vs_foreach'], '.2f'):>10}"
        )
    return "\n".join(lines)


def format_e2e_table(result: dict, device_label: str) -> str:
    c = result["config"]
    lines = [
        f"end-to-end on {device_label}: GPT ({c['parameters']:,} parameters, hidden {c['hidden']}, {c['layers']} "
        f"layers, seq {c['seq_len']}, bf16 autocast {c['autocast_bf16']}), AdamW, clip 1.0",
        f"{'recipe':<42} {'ms/step':>9} {'[q20, q80]':>19} {'samples/s':>10} {'peak MiB':>10}",
    ]
    for r in result["rows"]:
        peak = "not measured (CPU)" if r["peak_memory_mb"] is None else f"{r['peak_memory_mb']:.0f}"
        quantiles = f"[{r['q20_ms']:.2f}, {r['q80_ms']:.2f}]"
        lines.append(
            f"{r['recipe']:<42} {r['ms_per_step']:>9.2f} {quantiles:>19} {r['samples_per_s']:>10.1f} {peak:>10}"
        )
    return "\n".join(lines)


def write_plots(rows: list[dict], path_stem: Path, device_label: str) -> list[Path]:
    """ms and fraction of copy bandwidth per set (sets ordered by size), grouped bars per provider.

    One panel per (dtype, moment). Bars, not lines: the sets differ in structure, not only in size, so a
    line through them would suggest a sweep that was not run.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return []
    sets = sorted({(r["elements"], r["set"], r["tensors"]) for r in ok})
    names = sorted({r["provider"] for r in ok}, key=providers.PROVIDERS.index)
    dtypes = list(dict.fromkeys(r["grad_dtype"] for r in ok))
    width = 0.8 / len(names)
    written = []
    for metric, label, log_y in (("median_ms", "ms per micro-batch", True),
                                 ("fraction_of_copy_bw", "fraction of copy bandwidth", False)):  # fmt: skip
        figure, axes = plt.subplots(
            len(dtypes), len(MEASURED_MOMENTS), figsize=(6 * len(MEASURED_MOMENTS), 3.6 * len(dtypes)), squeeze=False
        )
        for row_axes, dtype_name in zip(axes, dtypes, strict=True):
            for axis, moment in zip(row_axes, MEASURED_MOMENTS, strict=True):
                for offset, name in enumerate(names):
                    values = {
                        r["set"]: r[metric]
                        for r in ok
                        if r["provider"] == name and r["grad_dtype"] == dtype_name and r["moment"] == moment
                    }
                    shift = (offset - (len(names) - 1) / 2) * width
                    xs = [i + shift for i, (_, s, _) in enumerate(sets) if s in values]
                    axis.bar(xs, [values[s] for _, s, _ in sets if s in values], width, label=name)
                axis.set_xticks(range(len(sets)))
                axis.set_xticklabels([f"{s}\n{n:.2g} el, {t} t" for n, s, t in sets], fontsize=7)
                if log_y:
                    axis.set_yscale("log")
                else:
                    axis.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
                axis.set_title(f"{dtype_name} grads -> fp32 accumulator, {moment} micro-batch", fontsize=9)
                axis.set_ylabel(label, fontsize=8)
                axis.grid(True, axis="y", which="both", alpha=0.3)
        axes[0][0].legend(fontsize=7)
        figure.suptitle(f"{label} - {device_label} (el = elements, t = tensors)", fontsize=10)
        figure.tight_layout()
        path = path_stem.with_name(f"{path_stem.name}-{'ms' if metric == 'median_ms' else 'copy-fraction'}.png")
        figure.savefig(path, dpi=110)
        plt.close(figure)
        written.append(path)
    return written


def _write_csv(rows: list[dict], path: Path, device_label: str, date_utc: str) -> None:
    with path.open("w", newline="") as handle:
        fields = list(dict.fromkeys(key for row in rows for key in row))
        writer = csv.DictWriter(handle, fieldnames=["device", "date_utc", *fields])
        writer.writeheader()
        for row in rows:
            writer.writerow({"device": device_label, "date_utc": date_utc, **row})


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.plot_only:
        saved = json.loads(args.plot_only.read_text())
        stem = args.plot_only.with_suffix("")
        print("wrote " + ", ".join(map(str, write_plots(saved["micro"], stem, saved["meta"]["device"]))))
        return 0
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    device_label = _device_name(device)
    if device.type == "cpu":
        device_label += f" ({torch.get_num_threads()} thread{'s' if torch.get_num_threads() > 1 else ''})"
    now = datetime.datetime.now(datetime.timezone.utc)
    torch.manual_seed(0)
    if args.quick:
        timer = timing.Timer(device, budget_s=0.1, min_reps=3, max_reps=15, warmup=1)
    else:
        timer = timing.Timer(device, budget_s=1.0, min_reps=5, max_reps=100, warmup=2)
    copy_nbytes = (256 if device.type == "cuda" else 64) * 2**20 // (4 if args.quick else 1)
    copy_gbps, copy_timing = timing.copy_bandwidth_gbps(timer, copy_nbytes)
    unit = timing.launch_unit(device)
    print(
        f"gafused {gafused.__version__} benchmarks on {device_label} ({device.type}), torch {torch.__version__}, "
        f"{now:%Y-%m-%d %H:%M} UTC{', --quick' if args.quick else ''}\n"
        f"copy bandwidth: {copy_gbps:.1f} GB/s ({copy_nbytes / 2**20:.0f} MiB copy_, read + write)",
        flush=True,
    )

    rows = [] if args.kernels_only else run_micro(args, device, timer, copy_gbps)
    if rows:
        print(format_micro_table(rows, unit), flush=True)
    e2e_result = None
    if not (args.no_e2e or args.kernels_only):
        e2e_result = e2e.run_e2e(device, args.quick, timer)
        print(format_e2e_table(e2e_result, device_label), flush=True)
    kernel_rows = [] if args.no_kernels else kernels.run_kernel_sweep(device, args.quick, timer)
    if kernel_rows:
        print(kernels.format_kernel_table(kernel_rows), flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    suffix = ("-quick" if args.quick else "") + ("-kernels-only" if args.kernels_only else "")
    stem = args.out / f"{_sanitize(device_label)}-{now:%Y%m%d}{suffix}"
    meta = {
        "device": device_label,
        "device_type": device.type,
        "date_utc": now.isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "gafused": gafused.__version__,
        "python": platform.python_version(),
        "cpu_threads": torch.get_num_threads(),
        "quick": args.quick,
        "accumulation_steps": args.accumulation_steps,
        "max_grad_norm": 1.0,
        "copy_bandwidth_gbps": copy_gbps,
        "copy_bytes": traffic.copy_bytes(copy_nbytes),
        "launch_unit": unit,
        "notes": (
            "CPU: copy_ also reads each destination line before writing it (write-allocate), in-place "
            "accumulation does not, so fractions above 1 are expected and do not compare with GPU figures"
            if device.type == "cpu"
            else "caches flushed before every sample; times include host launch overhead (device idle at start)"
        ),
        "timer": {"budget_s": timer.budget_s, "min_reps": timer.min_reps, "max_reps": timer.max_reps},
        "sets": {s.name: s.description for s in param_sets.default_sets(device.type, args.quick)},
    }
    results = {"meta": meta, "micro": rows, "e2e": e2e_result, "kernels": kernel_rows}
    stem.with_suffix(".json").write_text(json.dumps(results, indent=1))
    written = [stem.with_suffix(".json")]
    for table, path in ((rows, stem.with_suffix(".csv")), (kernel_rows, stem.with_name(f"{stem.name}-kernels.csv"))):
        if table:
            _write_csv(table, path, device_label, meta["date_utc"])
            written.append(path)
    if not args.no_plots:
        written += write_plots(rows, stem, device_label)
        kernel_plot = stem.with_name(f"{stem.name}-kernels.png")
        if kernels.write_kernel_plot(kernel_rows, str(kernel_plot), device_label):
            written.append(kernel_plot)
    print("wrote " + ", ".join(str(p) for p in written))
    failed = [r for r in rows if r["status"].startswith("failed")]
    if failed:
        print(f"{len(failed)} row(s) failed; see the status column", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
