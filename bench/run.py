"""Benchmarks of gafused against the ways gradients are accumulated today.

    python bench/run.py            # the default run: every part, small sizes, about 1-2 minutes on 2 CPU cores
    python bench/run.py --full     # every set, both gradient dtypes, longer timings (GPU sizes on a GPU)
    python bench/run.py --quick    # smoke run (CI): tiny sets, short budgets

Shows a progress bar per part on stderr, then one summary screen on stdout: memory, correctness, launches and
host time per micro-step, kernels against copy bandwidth, end to end, and where the files went. Files (JSON,
CSV, the full tables, PNG plots) go to ``--out`` (default: ~/.cache/gafused/bench, outside the checkout). What
each column means is in bench/README.md.

The pieces: ``param_sets`` (shapes), ``providers`` (what is compared), ``traffic`` (minimum bytes),
``timing`` (how a number is measured), ``e2e`` (a training step), ``kernels`` (ops vs buffer size),
``correctness`` (recipes vs float64), ``memory`` (peak bytes per parameter), ``triton_launches`` (kernel
counts without a GPU), ``progress`` (bars), ``plots`` and ``summary``. This file only wires them together.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import functools
import gc
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import correctness  # noqa: E402 - bench/ modules are imported as siblings, after the path is set
import e2e  # noqa: E402
import interrupt  # noqa: E402
import kernels  # noqa: E402
import param_sets  # noqa: E402
import plots  # noqa: E402
import progress as progress_bars  # noqa: E402
import provenance  # noqa: E402
import providers  # noqa: E402
import summary  # noqa: E402
import timing  # noqa: E402
import traffic  # noqa: E402
import triton_launches  # noqa: E402

import gafused  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
MEASURED_MOMENTS = ("middle", "last")
# Timer settings per mode: (seconds of timed calls per measurement, min reps, max reps, warmup calls).
_TIMER = {"quick": (0.1, 3, 15, 1), "default": (0.25, 5, 40, 1), "full": (1.0, 5, 100, 2)}
_DEFAULT_DTYPES = {"quick": "bf16,fp32", "default": "bf16", "full": "bf16,fp32"}
# memory.run's quick argument per mode: the ~100 MB model (about a minute on CPU) only with --full, the small
# one keeps the default run short.
MEMORY_QUICK = {"quick": True, "default": True, "full": False}


def default_out() -> Path:
    """Where results go without ``--out``: ``$XDG_CACHE_HOME/gafused/bench`` (``~/.cache/gafused/bench``)."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "gafused" / "bench"


def _load_average() -> float | None:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="tiny sets and short budgets (CI smoke run)")
    size.add_argument("--full", action="store_true", help="every set, both dtypes, 1 s budgets (~7-10 min on 2 cores)")
    parser.add_argument("--out", type=Path, help=f"output directory (default: {default_out()})")
    parser.add_argument("--sets", help="comma-separated set names (default: every set of the mode and device)")
    parser.add_argument("--providers", help=f"comma-separated, from {', '.join(providers.PROVIDERS)}")
    parser.add_argument("--dtypes", help="gradient dtypes, from bf16, fp32 (default: bf16; both in --quick/--full)")
    parser.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    parser.add_argument(
        "--accumulation-steps",
        type=int,
        default=4,
        help="the micro-benchmark's N (>= 3; end to end uses 4 on CPU, 8 on a GPU)",
    )
    parser.add_argument(
        "--compile-max-tensors",
        type=int,
        help="in --full, skip `compiled` on sets with more tensors (compile time grows with the count; default "
        "512); the default and --quick runs compile only the set with the fewest tensors, first dtype",
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
    parser.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    parser.add_argument("--verbose", action="store_true", help="print the full tables before the summary")
    parser.add_argument("--plot-only", type=Path, metavar="JSON", help="redraw the PNGs of a results file and exit")
    parser.add_argument("--table", type=Path, metavar="JSON", help="print the README's tables of a results file")
    return parser


def _refuse(message: str) -> NoReturn:
    """Refuse an option as argparse does (usage and message on stderr, exit status 2), whichever check finds it."""
    _parser().error(message)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.accumulation_steps < 3:
        steps = args.accumulation_steps
        parser.error(f"--accumulation-steps must be >= 3 (a first, a middle and a last micro-batch), got {steps}")
    if args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    if args.kernels_only and args.no_kernels:
        parser.error("--kernels-only with --no-kernels leaves nothing to run")
    if args.compile_max_tensors is not None and args.compile_max_tensors < 0:
        parser.error(f"--compile-max-tensors must be >= 0 (0 compiles no set), got {args.compile_max_tensors}")
    return args


def _mode(args: argparse.Namespace) -> str:
    return "quick" if args.quick else "full" if args.full else "default"


def _memory_needed(param_set: param_sets.ParamSet, dtype: torch.dtype, provider: str | None = None) -> int:
    """Bytes alive at once for one provider: params, one grad set, fp32 accumulators, finished grads; for
    ``compiled`` also an fp32 temporary of the accumulators' size (Inductor writes the scaled sums to a new buffer
    before it takes their norm: 1.4x the others' peak with bf16 gradients). None: what every provider needs."""
    size = torch.empty((), dtype=dtype).element_size()
    extra = 4 if provider == "compiled" else 0
    return param_set.numel * (size + size + 4 + size + extra)


def _memory_skip_reason(
    param_set: param_sets.ParamSet, dtype: torch.dtype, provider: str | None, free: int
) -> str | None:
    """Why ``provider`` (None: every provider) does not run on a set with ``free`` bytes of device memory."""
    needed = _memory_needed(param_set, dtype, provider)
    if needed > 0.9 * free:
        return f"skipped: needs ~{needed / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
    return None


def _compile_skip_reason(args, sets, dtype_index: int, param_set) -> str | None:
    fewest = min(sets, key=lambda s: s.count)
    if not args.full and (param_set is not fewest or dtype_index != 0):
        return (
            f"skipped outside --full: only {fewest.name} with the first dtype is compiled (compile time; "
            f"--full compiles every set up to --compile-max-tensors)"
        )
    limit = 512 if args.compile_max_tensors is None else args.compile_max_tensors
    if param_set.count > limit:
        return f"skipped: {param_set.count} tensors > --compile-max-tensors {limit} (compile time)"
    return None


def _measure_provider(name, params, pool, args, device, timer, progress, set_name) -> dict:
    """Middle and last micro-batch of one provider: timings and launch counts, or the reason it did not run.

    Whatever happens, every ``p.grad`` is released before it returns: a finished provider leaves its gradients
    there, and the next provider must not allocate its own while they are alive (``_memory_needed`` counts one
    provider's memory at a time).
    """
    result = {}
    try:
        provider = providers.make_provider(name, params, pool, args.accumulation_steps, max_grad_norm=1.0)
        if name == "compiled":
            # torch.compile builds one graph per function on its first call: the fold, then the finish. Their wall
            # time (a few untimed micro-steps with them) is recorded: the compile cost a user pays once.
            with progress_bars.open_bar(progress, f"compile warm-up ({set_name})", total=2) as bar:
                began = time.perf_counter()
                for moment in MEASURED_MOMENTS:
                    provider.prepare(moment)
                    provider.step()
                    bar.update()
                _synchronize(device)
                result["compile_warmup_s"] = time.perf_counter() - began
        result["backend"] = getattr(getattr(provider, "accumulator", None), "backend", None)
        for moment in MEASURED_MOMENTS:
            prepare = functools.partial(provider.prepare, moment)
            result[moment] = (
                timer.measure(provider.step, prepare),
                timing.count_launches(provider.step, prepare, device),
            )
        return result
    finally:
        for param in params:
            param.grad = None


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _copy_nbytes(param_set: param_sets.ParamSet, device: torch.device, quick: bool) -> int:
    """Bytes of the ``copy_`` a set's rows are compared with: the set's fp32 accumulator (its calls move 10-20 bytes
    per element, the copy 8), at least 1 GiB on a GPU or 64 MiB on CPU (a quarter of either in --quick), and on a
    GPU at most 40% of free memory per buffer (source and target)."""
    floor = (2**30 if device.type == "cuda" else 64 * 2**20) // (4 if quick else 1)
    nbytes = max(param_set.numel * 4, floor)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        nbytes = min(nbytes, int(0.4 * free))
    return nbytes


def _selected_device(args) -> torch.device:
    """``--device`` (cuda or cpu; the default: cuda when available), refused when torch cannot use it."""
    try:
        return provenance.selected_device(args.device)
    except ValueError as error:
        _refuse(f"--device: {error}")


def _selected_dtypes(args, mode: str) -> list[str]:
    """The gradient dtypes to time: ``--dtypes`` (each once, in order) or the mode's default."""
    dtypes = list(dict.fromkeys((_DEFAULT_DTYPES[mode] if args.dtypes is None else args.dtypes).split(",")))
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        _refuse(f"--dtypes: unknown {unknown} in {args.dtypes!r}; choose from {', '.join(DTYPES)}")
    return dtypes


def _selected_sets(args, device: torch.device, mode: str) -> list[param_sets.ParamSet]:
    """The sets to time: every set of the mode on ``device``, or those of ``--sets`` among them (a set of another
    mode or device is named on stderr and skipped; an unknown name, or no set left, is refused)."""
    sets = param_sets.default_sets(device.type, mode)
    if args.sets is None:
        return sets
    here = [s.name for s in sets]
    wanted = list(dict.fromkeys(args.sets.split(",")))
    known = {s.name for kind in ("cuda", "cpu") for m in param_sets.MODES for s in param_sets.default_sets(kind, m)}
    unknown = [name for name in wanted if name not in known]
    if unknown:
        _refuse(f"--sets: unknown {unknown}; a {mode} run on {device.type} has {', '.join(here)}")
    if not set(wanted) & set(here):
        _refuse(f"--sets: none of {wanted} is a set of a {mode} run on {device.type}; choose from "
                f"{', '.join(here)}")  # fmt: skip
    for name in wanted:
        if name not in here:
            print(f"--sets: {name} skipped: not a set of a {mode} run on {device.type}", file=sys.stderr)
    return [s for s in sets if s.name in wanted]


def _selected_providers(args, device: torch.device) -> list[str]:
    """The providers to time: every one that runs on ``device``, or those of ``--providers`` that do (each one
    that does not is named on stderr with the reason; when none does, the selection is refused)."""
    names = providers.provider_names(device)
    if args.providers is not None:
        wanted = list(dict.fromkeys(args.providers.split(",")))
        unknown = [name for name in wanted if name not in providers.PROVIDERS]
        if unknown:
            _refuse(f"--providers: unknown {unknown}; choose from {', '.join(providers.PROVIDERS)}")
        skipped = {name: providers.unavailable_reason(name, device) for name in wanted if name not in names}
        if not set(wanted) & set(names):
            reasons = "; ".join(f"{name}: {reason}" for name, reason in skipped.items())
            _refuse(f"--providers: none of {wanted} can be timed on {device.type} ({reasons}); choose "
                    f"from {', '.join(names)}")  # fmt: skip
        for name, reason in skipped.items():
            print(f"--providers: {name} skipped on {device.type}: {reason}", file=sys.stderr)
        names = [n for n in names if n in wanted]
    return names


def _selection(args, device: torch.device, mode: str) -> tuple[list[param_sets.ParamSet], list[str], list[str]]:
    """The micro-benchmark's (sets, providers, gradient dtypes), or the refusal naming the option at fault."""
    dtypes = _selected_dtypes(args, mode)
    return _selected_sets(args, device, mode), _selected_providers(args, device), dtypes


def run_micro(
    args,
    device: torch.device,
    timer: timing.Timer,
    progress,
    rows: list[dict] | None = None,
    where: dict | None = None,
    after_block: Callable[[], object] | None = None,
    selection: tuple[list[param_sets.ParamSet], list[str], list[str]] | None = None,
) -> list[dict]:
    """Every (set, dtype, provider, moment) row of the accumulation micro-benchmark.

    Args:
        rows: the list rows are appended to as they are measured, so a caller whose run is stopped keeps them; a
            new one by default. Returned, with the speedups filled in.
        where: a dict whose ``during`` names the set, dtype and provider being measured (for an interruption).
        after_block: called after each (set, dtype) block, e.g. to save what is measured so far.
        selection: ``_selection(args, device, mode)`` when the caller checked the options already; made here
            otherwise.
    """
    mode = _mode(args)
    sets, names, dtypes = selection if selection is not None else _selection(args, device, mode)

    rows = [] if rows is None else rows
    where = {} if where is None else where
    bar = progress_bars.open_bar(progress, "accumulation micro-benchmark", total=len(sets) * len(dtypes) * len(names))
    for param_set in sets:
        copy = None  # (GB/s, bytes moved) of this set's copy_, measured once for both dtypes
        for dtype_index, dtype_name in enumerate(dtypes):
            dtype = DTYPES[dtype_name]
            base = {
                "set": param_set.name,
                "tensors": param_set.count,
                "elements": param_set.numel,
                "grad_dtype": dtype_name,
                "param_dtype": dtype_name,
            }
            skip_all = free = None
            if device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(device)
                skip_all = _memory_skip_reason(param_set, dtype, None, free)
            if skip_all is None and copy is None:
                where["during"] = f"micro-benchmark: {param_set.name}, copy_ bandwidth"
                nbytes = _copy_nbytes(param_set, device, args.quick)
                copy = (timing.copy_bandwidth_gbps(timer, nbytes)[0], traffic.copy_bytes(nbytes))
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()  # the copy's buffers back to the device before the set's tensors
            params = pool = None
            if skip_all is None:
                params = [torch.nn.Parameter(torch.empty(s, dtype=dtype, device=device)) for s in param_set.shapes]
                # One gradient set suffices: caches are flushed before every sample (see timing.py).
                pool = [[torch.randn(s, dtype=dtype, device=device) for s in param_set.shapes]]
            for name in names:
                where["during"] = f"micro-benchmark: {param_set.name} {dtype_name} {name}"
                status = skip_all
                if status is None and free is not None:
                    status = _memory_skip_reason(param_set, dtype, name, free)
                if status is None and name == "compiled":
                    status = _compile_skip_reason(args, sets, dtype_index, param_set)
                measured = None
                if status is None:
                    try:
                        measured = _measure_provider(
                            name, params, pool, args, device, timer, progress, f"{param_set.name} {dtype_name}"
                        )
                        status = "ok"
                    except Exception as error:  # noqa: BLE001 - a provider that fails is reported, not fatal
                        status = f"failed: {type(error).__name__}: {str(error).splitlines()[0][:200]}"
                    gc.collect()
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                for moment in MEASURED_MOMENTS:
                    row = {**base, "provider": name, "moment": moment, "status": status}
                    if measured is not None:
                        row.update(_row_numbers(measured[moment], moment, param_set, dtype, copy))
                        row["backend"] = measured["backend"]
                        if "compile_warmup_s" in measured:
                            row["compile_warmup_s"] = measured["compile_warmup_s"]
                    rows.append(row)
                bar.update()
            del params, pool
            gc.collect()
            if after_block is not None:
                after_block()
    bar.close()
    _add_speedups(rows)
    return rows


def _row_numbers(measured, moment, param_set, dtype, copy) -> dict:
    timed, launches = measured
    copy_gbps, copy_bytes = copy
    nbytes = traffic.min_bytes(moment, param_set.numel, dtype)
    gbps = nbytes / (timed.median_ms * 1e-3) / 1e9
    return {
        "median_ms": timed.median_ms,
        "q20_ms": timed.q20_ms,
        "q80_ms": timed.q80_ms,
        "host_ms": timed.host_ms,
        "reps": timed.reps,
        "min_bytes": nbytes,
        "gbps": gbps,
        "fraction_of_copy_bw": gbps / copy_gbps,
        "copy_gbps": copy_gbps,
        "copy_bytes": copy_bytes,
        "launches": launches,
        "page_faults": timed.page_faults,
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
        f"{'set':<20} {'dtype':<5} {'moment':<6} {'provider':<18} {'ms':>9} {'[q20, q80]':>19} {'host ms':>8} "
        f"{'GB/s':>8} {'of copy':>7} {'launch':>6} {'vs naive':>8} {'vs foreach':>10}"
    )
    lines = [f"accumulation micro-benchmark; launch = {unit} per micro-batch", header, "-" * len(header)]
    for r in sorted(rows, key=lambda r: (r["set"], r["grad_dtype"], r["moment"] == "last")):
        if r["status"] != "ok":
            lines.append(f"{r['set']:<20} {r['grad_dtype']:<5} {r['moment']:<6} {r['provider']:<18} {r['status']}")
            continue
        quantiles = f"[{r['q20_ms']:.3f}, {r['q80_ms']:.3f}]"
        lines.append(
            f"{r['set']:<20} {r['grad_dtype']:<5} {r['moment']:<6} {r['provider']:<18} {r['median_ms']:>9.3f} "
            f"{quantiles:>19} {r['host_ms']:>8.3f} {r['gbps']:>8.2f} {r['fraction_of_copy_bw']:>7.1%} "
            f"{r['launches']:>6} {_fmt(r['speedup_vs_naive'], '.2f'):>8} {_fmt(r['speedup_vs_foreach'], '.2f'):>10}"
        )
    return "\n".join(lines)


def format_e2e_table(result: dict, device_label: str) -> str:
    c = result["config"]
    lines = [
        f"end-to-end on {device_label}: GPT ({c['parameters']:,} parameters, hidden {c['hidden']}, {c['layers']} "
        f"layers, seq {c['seq_len']}, bf16 autocast {c['autocast_bf16']}), AdamW, clip 1.0",
        f"{'recipe':<42} {'ms/step':>9} {'[q20, q80]':>19} {'samples/s':>10} {'peak MiB':>10} {'requested':>10}",
    ]
    for r in result["rows"]:
        peak = "not measured (CPU)" if r["peak_memory_mb"] is None else f"{r['peak_memory_mb']:.0f}"
        requested = r.get("peak_requested_mb")  # bytes asked for, without the allocator's rounding (newer results)
        requested = "" if requested is None else f"{requested:.3f}"
        quantiles = f"[{r['q20_ms']:.2f}, {r['q80_ms']:.2f}]"
        lines.append(
            f"{r['recipe']:<42} {r['ms_per_step']:>9.2f} {quantiles:>19} {r['samples_per_s']:>10.1f} {peak:>10} "
            f"{requested:>10}"
        )
    harness = sorted({round(r["harness_mb"]) for r in result["rows"] if r.get("harness_mb") is not None})
    if harness:  # newer results: peaks net of what the benchmark itself held (e2e.py's module doc)
        lines.append(f"peaks net of the harness's {'/'.join(map(str, harness))} MiB (raw peaks in the JSON)")
    return "\n".join(lines)


def run_memory(quick: bool, progress, device: torch.device) -> tuple[list[dict] | None, str | None]:
    """Rows of ``bench/memory.py`` (``memory.run(quick, progress, device)``), or None and why there are none."""
    try:
        import memory
    except ModuleNotFoundError as error:
        if error.name == "memory":
            return None, "not built yet"
        return None, f"failed to import: {error}"
    except ImportError as error:
        return None, f"failed to import: {error}"
    try:
        return memory.run(quick, progress, device), None
    except Exception as error:  # noqa: BLE001 - a failing part is reported on the summary, the others still run
        return None, f"failed: {type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"


def _write_csv(rows: list[dict], path: Path, device_label: str, date_utc: str) -> None:
    with path.open("w", newline="") as handle:
        fields = list(dict.fromkeys(key for row in rows for key in row))
        writer = csv.DictWriter(handle, fieldnames=["device", "date_utc", *fields])
        writer.writeheader()
        for row in rows:
            writer.writerow({"device": device_label, "date_utc": date_utc, **row})


def _status_line(meta: dict) -> str | None:
    """A results file that is not complete says so first: stopped (and where), or still being written."""
    stopped = meta.get("interrupted")
    if stopped:
        return (
            f"PARTIAL RESULTS: stopped by {stopped['signal']} after {stopped['after_s']:.0f} s, during "
            f"{stopped['during'] or 'setup'}; only the parts and rows below were measured"
        )
    if meta.get("complete") is False:
        return "PARTIAL RESULTS: the run was still measuring when this was written (killed, or not finished yet)"
    return None


def _tables(results: dict) -> str:
    """Every table of the run in full: the ``-tables.txt`` file (and stdout with ``--verbose``)."""
    meta = results["meta"]
    copies = {(r["set"], r["copy_gbps"], r["copy_bytes"]) for r in results.get("micro") or [] if "copy_gbps" in r}
    copy_lines = [
        f"copy bandwidth for {name}: {gbps:.1f} GB/s ({nbytes / 2 / 2**20:.0f} MiB copy_, read + write)"
        for name, gbps, nbytes in sorted(copies)
    ]
    parts = [
        "\n".join(
            line
            for line in (
                _status_line(meta),
                f"gafused {meta['gafused']} benchmarks on {meta['device']}, torch {meta['torch']}, "
                f"{meta['date_utc']}, {meta['mode']} run",
                *copy_lines,
            )
            if line
        )
    ]
    if results.get("memory"):
        parts.append("memory (peak bytes per parameter)\n" + "\n".join(
            f"{r['recipe']:<40} {r['param_dtype']:<9} {r['peak_bytes_per_param']:>8.2f}  {r['note']}"
            for r in results["memory"]
        ))  # fmt: skip
    elif results.get("memory_status"):  # not built, or failed; a --kernels-only run does not measure memory
        parts.append(f"memory: {results['memory_status']}")
    if results.get("correctness"):
        parts.append(
            "correctness (relative error vs float64 big batch)\n"
            + "\n".join(correctness.format_correctness_table(results["correctness"]))
        )
    if results.get("micro"):
        parts.append(format_micro_table(results["micro"], meta["launch_unit"]))
    if results.get("e2e"):
        parts.append(format_e2e_table(results["e2e"], meta["device"]))
    if results.get("kernels"):
        parts.append(kernels.format_kernel_table(results["kernels"]))
    return "\n\n".join(parts) + "\n"


def _atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file, so a process killed mid-write leaves the last version."""
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def _save(results: dict, stem: Path) -> list[Path]:
    """Write the JSON, the tables and the CSVs of ``results`` as they stand (called after every part and at the
    end); returns the paths, tables first."""
    _add_speedups(results["micro"])
    meta = results["meta"]
    tables = stem.with_name(f"{stem.name}-tables.txt")
    written = [tables, stem.with_suffix(".json")]
    _atomic_write(stem.with_suffix(".json"), json.dumps(results, indent=1))
    _atomic_write(tables, _tables(results))
    for name in ("micro", "kernels"):
        if results[name]:
            path = stem.with_name(f"{stem.name}-{name}.csv")
            _write_csv(results[name], path, meta["device"], meta["date_utc"])
            written.append(path)
    return written


def _run_parts(args, mode: str, device: torch.device, timer: timing.Timer, progress, results: dict, where: dict,
               save: Callable[[], object], selection: tuple | None) -> None:  # fmt: skip
    """Every part the arguments ask for, each result stored in ``results`` as it comes and saved after each part;
    ``selection``: the micro-benchmark's, from ``_selection``."""
    if not args.kernels_only:
        where["during"] = "memory and correctness"
        # The Triton count runs in a child process beside the untimed parts (memory, correctness).
        count = triton_launches.Count().start() if device.type == "cpu" else None
        results["memory"], results["memory_status"] = run_memory(MEMORY_QUICK[mode], progress, device)
        results["correctness"] = correctness.run_correctness(progress)
        results["triton_launches"] = count.result() if count is not None else None
        save()
        run_micro(
            args, device, timer, progress, rows=results["micro"], where=where, after_block=save, selection=selection
        )
    if not (args.no_e2e or args.kernels_only):
        where["during"] = "end to end"
        results["e2e"] = {}
        e2e.run_e2e(device, mode, timer, progress=progress, result=results["e2e"])
        save()
    if not args.no_kernels:
        where["during"] = "kernel sweep"
        kernels.run_kernel_sweep(device, mode, timer, progress, rows=results["kernels"])
    where["during"] = None


def _results_file(option: str, path: Path) -> dict:
    """The results JSON ``path`` names, or the refusal of ``option`` when it is not one."""
    try:
        results = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        _refuse(f"{option}: {path} is not a results JSON written by bench/run.py ({error})")
    meta = results.get("meta") if isinstance(results, dict) else None
    missing = [key for key in ("device_type", "device") if not isinstance(meta, dict) or key not in meta]
    if missing:
        _refuse(f"{option}: {path} is JSON, but not results written by bench/run.py (no meta.{missing[0]})")
    return results


def _refuse_run_options(args: argparse.Namespace) -> None:
    """``--table`` and ``--plot-only`` read a results file: a run's options (``--out``, ``--no-plots``, ``--sets``, the
    other of the two) would be ignored silently, so any given with them is refused."""
    defaults = vars(_parse_args([]))
    others = [
        "--" + name.replace("_", "-")
        for name, value in vars(args).items()
        if name not in ("table", "plot_only") and value != defaults[name]
    ]
    if args.table is not None and args.plot_only is not None:
        others.insert(0, "--plot-only")
    if others:
        option = "--table" if args.table is not None else "--plot-only"
        _refuse(f"{option} reads a results file and takes no other option, got {', '.join(others)}")


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    for option, path in (("--table", args.table), ("--plot-only", args.plot_only)):
        if path is not None and not path.is_file():
            _refuse(f"{option}: {path} is not a file (a results JSON written by bench/run.py)")
    if args.table:
        results = _results_file("--table", args.table)
        _refuse_run_options(args)
        # A stopped run's tables say so first, as its -tables.txt and summary do.
        status = _status_line(results["meta"])
        print((f"{status}\n\n" if status else "") + summary.readme_tables(results))
        return 0
    if args.plot_only:
        saved = _results_file("--plot-only", args.plot_only)
        _refuse_run_options(args)
        stem = args.plot_only.with_suffix("")
        print("wrote " + ", ".join(map(str, plots.write_all(saved, stem, list(providers.PROVIDERS)))))
        return 0
    started = time.perf_counter()
    load_before = _load_average()
    mode = _mode(args)
    # Refused before anything runs or is written, not after minutes of measuring.
    device = _selected_device(args)
    selection = None if args.kernels_only else _selection(args, device, mode)  # (the sweep takes none of them)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    device_label = provenance.device_name(device)
    if device.type == "cpu":
        device_label += f" ({torch.get_num_threads()} thread{'s' if torch.get_num_threads() > 1 else ''})"
    now = datetime.datetime.now(datetime.timezone.utc)
    out = args.out if args.out is not None else default_out()
    problem = provenance.out_problem(out)
    if problem is not None:
        _refuse(f"--out: {problem}")
    try:  # out_problem cannot foresee every refusal (/proc takes no new folder, even from root)
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        _refuse(f"--out: cannot create {out}: {error.strerror or error}")
    progress = progress_bars.factory(not args.no_progress)
    print(
        f"gafused {gafused.__version__}, {mode} run on {device_label}, torch {torch.__version__}; results to {out}",
        file=sys.stderr,
        flush=True,
    )
    torch.manual_seed(0)
    budget_s, min_reps, max_reps, warmup = _TIMER[mode]
    timer = timing.Timer(device, budget_s=budget_s, min_reps=min_reps, max_reps=max_reps, warmup=warmup)

    suffix = ("" if mode == "default" else f"-{mode}") + ("-kernels-only" if args.kernels_only else "")
    stem = out / f"{provenance.slug(device_label)}-{now:%Y%m%d-%H%M%S}{suffix}"
    meta = {
        "device": device_label,
        "device_type": device.type,
        "date_utc": now.isoformat(timespec="seconds"),
        "mode": mode,
        # False until every part asked for has run; "interrupted" says where a stopped run stopped (SIGTERM, e.g.
        # bench/gpu_check.sh's time limit, or Ctrl-C), None otherwise.
        "complete": False,
        "interrupted": None,
        "torch": torch.__version__,
        "gafused": gafused.__version__,
        "python": platform.python_version(),
        **provenance.facts(device),
        # The GPU end-to-end model is transformers' GPT-2 when transformers is importable (e2e.config.model).
        "transformers": provenance.package_version("transformers"),
        "cpu_threads": torch.get_num_threads(),
        # What backend="auto" runs here; each gafused-<backend> row and kernel row names its own backend.
        "default_backend": gafused.ops.resolve_backend("auto", device),
        "quick": args.quick,
        "accumulation_steps": args.accumulation_steps,
        "max_grad_norm": 1.0,
        "copy": (
            "micro rows: copy_gbps of a copy_ of the set's fp32 accumulator (at least 1 GiB on a GPU, 64 MiB on CPU; "
            "a quarter in --quick), copy_bytes read + written; kernel rows: a copy_ of the buffer's own size"
        ),
        "launch_unit": timing.launch_unit(device),
        "notes": (
            "CPU: no fused GPU kernel runs; copy_ also reads each destination line before writing it "
            "(write-allocate), in-place accumulation does not, so fractions above 1 are expected and do not "
            "compare with GPU figures"
            if device.type == "cpu"
            else "caches flushed before every sample; times include host launch overhead (device idle at start)"
        ),
        "timer": {
            "budget_s": timer.budget_s,
            "min_reps": timer.min_reps,
            "max_reps": timer.max_reps,
            "warmup": timer.warmup,
        },
        # Other work on the machine stretches times: the 1-minute load average at the run's start and end.
        "load_average_1min": [load_before, None],
        "sets": {s.name: s.description for s in param_sets.default_sets(device.type, mode)},
        "seconds": None,
    }
    results: dict = {"meta": meta, "memory": None, "memory_status": None, "correctness": None,
                     "triton_launches": None, "micro": [], "e2e": None, "kernels": []}  # fmt: skip

    def save() -> list[Path]:
        meta["seconds"] = round(time.perf_counter() - started, 1)
        return _save(results, stem)

    where: dict = {"during": None}
    stop = None
    with interrupt.sigterm_raises():
        try:
            _run_parts(args, mode, device, timer, progress, results, where, save, selection)
        except interrupt.STOPPED as stopped:
            stop = stopped
            meta["interrupted"] = {
                **interrupt.describe(stopped, where["during"]),
                "after_s": round(time.perf_counter() - started, 1),
            }
    with interrupt.sigterm_ignored():  # the last writes, complete or not, are not cut short by a (second) SIGTERM
        results["e2e"] = results["e2e"] or None  # a run stopped before the first recipe's config
        meta["complete"] = stop is None
        meta["load_average_1min"][1] = _load_average()
        summary_path = stem.with_name(f"{stem.name}-summary.txt")
        written = [summary_path, *save()]
        # A stopped run has little time before SIGKILL: the figures can be drawn later with --plot-only.
        if not args.no_plots and stop is None:
            written += plots.write_all(results, stem, list(providers.PROVIDERS))
        screen = summary.render(results, written, time.perf_counter() - started)
        summary_path.write_text(screen + "\n")
    if args.verbose:
        print(_tables(results))
    print(screen, flush=True)
    if stop is not None:
        info = meta["interrupted"]
        partial = f"partial: stopped by {info['signal']} during {info['during'] or 'setup'}"
        print(
            f"wrote {stem.with_suffix('.json')} ({partial}; --plot-only draws its figures)", file=sys.stderr, flush=True
        )
        return interrupt.exit_status(stop)
    print(f"wrote {stem.with_suffix('.json')}", file=sys.stderr, flush=True)
    failed = [r for r in results["micro"] + results["kernels"] if str(r.get("status", "ok")).startswith("failed")]
    if failed:
        print(f"{len(failed)} row(s) failed; see the status column of {written[1]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
