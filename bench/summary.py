"""The closing screen of ``python bench/run.py``: what the run found, in words a newcomer can follow.

``render(results, files)`` takes the run's results (what goes into its JSON) and the files it wrote, and
returns the text: memory, correctness, launches and host time per micro-step, kernels against copy bandwidth,
end to end, then where the files are. Every number on it comes from ``results``; the detailed tables are in the
``-tables.txt`` file beside the JSON.
"""

from __future__ import annotations

from pathlib import Path

from correctness import format_correctness_table

__all__ = ["render", "readme_tables", "default_backend", "FILE_ROLES"]

_WIDTH = 100

# What each file of a run holds, by the suffix after the run's stem; README's file list says the same.
FILE_ROLES = {
    "-summary.txt": "this screen",
    "-tables.txt": "every table in full (quantiles, GB/s, speedups)",
    ".json": "every number, with device, versions and timer settings",
    "-micro.csv": "accumulation micro-benchmark rows",
    "-kernels.csv": "kernel sweep rows",
    "-memory.png": "peak bytes per parameter by recipe (bar chart)",
    "-correctness.png": "relative error of each recipe (bar chart, log scale)",
    "-ms.png": "time per micro-batch by provider and parameter set",
    "-kernels.png": "bandwidth of each op vs buffer size, with the copy_ line",
}


# What each gafused backend is, for the screen's words (which backend ran always comes from the results).
_BACKEND_WORDS = {
    "reference": "plain PyTorch, one segment at a time: the oracle the tests hold every backend to",
    "foreach": "torch._foreach_* ops over the buffer's segment views",
    "triton": "fused Triton kernels",
    "cuda": "the fused CUDA extension's kernels",
}


def _names(backends: list[str]) -> str:
    quoted = [f"`{b}`" for b in backends]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " and " + quoted[-1]


def _backends(rows: list[dict] | None) -> list[str]:
    """The gafused backends that ran in ``rows``, in order of appearance."""
    return list(dict.fromkeys(r["backend"] for r in rows or [] if r.get("backend")))


def default_backend(results: dict) -> str | None:
    """The backend gafused's ``backend="auto"`` ran in this run: recorded in the meta, else the end-to-end
    gafused row's (results written before the meta recorded it); None when neither says."""
    recorded = results["meta"].get("default_backend")
    if recorded:
        return recorded
    return next(iter(_backends((results.get("e2e") or {}).get("rows"))), None)


def _heading(title: str) -> str:
    return f"\n{title}"


def _wrap(text: str, indent: str = "  ") -> list[str]:
    lines, line = [], indent
    for word in text.split():
        if len(line) + len(word) + 1 > _WIDTH and line.strip():
            lines.append(line.rstrip())
            line = indent
        line += word + " "
    if line.strip():
        lines.append(line.rstrip())
    return lines


def _memory(results: dict) -> list[str]:
    lines = [_heading("MEMORY  peak bytes per parameter during a training step (lower is better)")]
    rows = results.get("memory")
    if rows is None and not results.get("memory_status"):  # the part did not run (--kernels-only)
        return lines + ["  not run"]
    if not rows:
        return lines + [f"  memory: {results.get('memory_status') or 'no rows'}"]
    lines.append(f"  {'recipe':<38} {'params':<9} {'bytes/param':>11}  note")
    for row in rows:
        lines.append(
            f"  {row['recipe']:<38} {row['param_dtype']:<9} {row['peak_bytes_per_param']:>11.1f}  {row['note']}"
        )
    return lines


def _correctness(results: dict) -> list[str]:
    result = results.get("correctness")
    lines = [_heading("CORRECTNESS  relative error of the finished gradient vs a float64 big batch (token-mean loss)")]
    if not result:
        return lines + ["  not run"]
    tokens = result["scenarios"][0]["loss_tokens_per_micro_batch"]
    lines.append(
        f"  {len(tokens)} micro-batches with {', '.join(map(str, tokens))} loss tokens; GPT of "
        f"{result['config']['parameters']:,} parameters in float32"
    )
    lines += format_correctness_table(result, indent="  ")
    errors = {(s["scenario"], r["recipe"]): r["relative_error"] for s in result["scenarios"] for r in s["rows"]}
    full = result["scenarios"][0]["scenario"]
    lines += _wrap(
        f"float32 rounding is about 1e-7, so the big batch itself is off by that much. Token weights "
        f"(opt.step(weight=tokens)) land at that floor; loss / N is off by "
        f"{errors[(full, 'loss / N')]:.0%}: every micro-batch weighs the same whatever its token count, and a "
        f"partial window is still divided by N. gafused's default weight 1 fixes the partial window's count, "
        f"not the token imbalance."
    )
    return lines


def _pick(rows: list[dict], prefix: str, dtype: str) -> str | None:
    names = sorted(
        {(r["elements"], r["set"]) for r in rows if r["set"].startswith(prefix) and r["grad_dtype"] == dtype}
    )
    return names[-1][1] if names else None


def _triton_counts(results: dict) -> list[str]:
    """The Triton kernels a micro-step launches, as a CPU run counts them under the interpreter (not timed)."""
    lines: list[str] = []
    cpu = results["meta"]["device_type"] == "cpu"
    triton = results.get("triton_launches")
    if cpu and triton:
        if "sets" in triton:
            counts = triton["sets"]
            middles = {len(c["middle"]) for c in counts.values()}
            lasts = {len(c["last"]) for c in counts.values()}
            tensors = " and ".join(str(c["tensors"]) for c in counts.values())
            lines += _wrap(
                f"gafused-triton (what a GPU runs; counted here under the Triton interpreter, not timed): "
                f"{'/'.join(map(str, sorted(middles)))} Triton kernel per middle micro-step and "
                f"{'/'.join(map(str, sorted(lasts)))} per last one, for {tensors} tensors alike: launches do not grow "
                f"with the parameter count (torch's own kernels for the 0-d weights and scales come on top: the GPU "
                f"rows' launches count both)."
            )
        else:
            lines.append(f"  gafused-triton launches: {triton['skipped']}")
    return lines


def _launches(results: dict) -> list[str]:
    rows = [r for r in results.get("micro") or [] if r["status"] == "ok"]
    cpu = results["meta"]["device_type"] == "cpu"
    lines = [_heading("LAUNCHES AND HOST TIME  per micro-step (middle: fold only; last: fold, 1/sum(w), norm, clip)")]
    if not rows:
        return lines + ["  not run"]
    dtype = "bf16" if any(r["grad_dtype"] == "bf16" for r in rows) else rows[0]["grad_dtype"]
    sets = [name for name in (_pick(rows, "gpt2", dtype), _pick(rows, "many-small", dtype)) if name]
    if not sets:
        measured = ", ".join(dict.fromkeys(r["set"] for r in rows))
        return (
            lines
            + _wrap(
                f"no table: it compares the largest gpt2* and many-small sets, and this run measured neither "
                f"(only {measured}; --sets chooses them). -tables.txt has every row of the micro-benchmark."
            )
            + _triton_counts(results)
        )
    by_key = {(r["set"], r["provider"], r["moment"]): r for r in rows if r["grad_dtype"] == dtype}
    providers = list(dict.fromkeys(r["provider"] for r in rows if r["grad_dtype"] == dtype and r["set"] in sets))
    unit = "aten ops" if cpu else "kernels"
    columns = ("ms middle", "ms last") if cpu else ("ms middle", "host ms", "ms last")
    cell_width = 9 + 10 * len(columns)
    lines.append(f"  {dtype + ' grads':<18}" + "".join(f"   {name[:cell_width]:<{cell_width}}" for name in sets))
    lines.append(f"  {'provider':<18}" + "".join(f"   {unit:>9}" + "".join(f"{c:>10}" for c in columns) for _ in sets))
    for provider in providers:
        cells = []
        for set_name in sets:
            middle, last = by_key.get((set_name, provider, "middle")), by_key.get((set_name, provider, "last"))
            if middle is None or last is None:
                cells.append(f"   {'-':>9}" + "".join(f"{'-':>10}" for _ in columns))
                continue
            values = [middle["median_ms"], last["median_ms"]] if cpu else [
                middle["median_ms"], middle["host_ms"], last["median_ms"]]  # fmt: skip
            launches = "-" if middle.get("launches") is None else str(middle["launches"])
            cells.append(f"   {launches:>9}" + "".join(f"{v:>10.3g}" for v in values))
        lines.append(f"  {provider:<18}" + "".join(cells))
    for set_name in sets:
        example = next(r for r in rows if r["set"] == set_name)
        lines.append(f"  {set_name}: {example['tensors']} tensors, {example['elements']:,} elements")
    lines.append(f"  {unit}: dispatched per middle micro-step.")
    lines += _triton_counts(results)
    if cpu:
        text = (
            "On CPU an 'aten op' is the unit of work torch dispatches: every path here does about one or two per "
            "tensor (torch's _foreach_* ops loop over tensors on CPU), so CPU times are host times and the ranking "
            "on CPU says nothing about a GPU."
        )
        if "gafused-reference" in providers:
            text += (
                " gafused-reference is the test oracle, a per-segment loop by design, not a fast path: its ratio to "
                "the others above is its cost."
            )
        lines += _wrap(text)
    else:
        lines += _wrap(
            "host ms: how long a middle micro-step kept the Python thread busy: its launches, without waiting for "
            "the kernels. A last micro-step's host time (in -tables.txt) is not launch time alone: gafused's waits "
            "for the device once, reading the norm back (.tolist())."
        )
    return lines


def _kernels(results: dict) -> list[str]:
    rows = [r for r in results.get("kernels") or [] if r["status"] == "ok"]
    dropped = [r for r in results.get("kernels") or [] if r["status"].startswith("dropped")]
    cpu = results["meta"]["device_type"] == "cpu"
    backends = _backends(rows)
    ran = f"the {_names(backends)} backend{'s' if len(backends) > 1 else ''}" if backends else "gafused"
    where = f"CPU path: {ran}" if cpu else "GPU kernels"
    lines = [_heading(f"KERNELS VS COPY BANDWIDTH  ({where}, one fp32 buffer)")]
    if not rows:
        return lines + ["  not run"]
    size = max(r["acc_mb"] for r in rows)
    at_size = [r for r in rows if r["acc_mb"] == size]
    lines.append(f"  {size} MB buffer; copy_ of the same size: {at_size[0]['copy_gbps']:.1f} GB/s")
    for backend in dict.fromkeys(r["backend"] for r in at_size):
        cells = []
        for r in at_size:
            if r["backend"] != backend:
                continue
            label = r["op"] + (f" {r['grad_dtype']}" if r["grad_dtype"] != "-" else "")
            cells.append(f"{label} {r['gbps']:.1f} GB/s ({r['fraction_of_copy_bw']:.0%})")
        lines += _wrap(f"{backend}: " + "; ".join(cells))
    explanation = (
        "GB/s counts only the bytes an op must move (fold with bf16 grads: read 2 + read 4 + write 4 = 10 bytes "
        "per element); the percentage divides it by a copy_ of the same buffer timed in the same run, the "
        "ceiling a memory-bound op can reach. "
    )
    if cpu:
        explanation += (
            f"On CPU copy_ also reads every destination line before writing it (write-allocate) while in-place "
            f"ops do not, so more than 100% can happen; these are CPU figures of {ran} and say nothing about the "
            f"GPU goal (each fused kernel at >= 90% of copy on buffers of 256 MB and up), which this same command "
            f"measures on a GPU machine."
        )
    else:
        explanation += "The goal: each fused kernel at >= 90% of copy on buffers of 256 MB and up."
    lines += _wrap(explanation)
    if dropped:
        cells = [
            f"{r['acc_mb']} MB {r['backend']} {r['op']}" + (f" {r['grad_dtype']}" if r["grad_dtype"] != "-" else "")
            for r in dropped
        ]
        lines += _wrap(
            f"Left out: {'; '.join(cells)}. Their timed calls first touched memory the op allocated itself (page "
            f"faults), so their times are page handling, not bandwidth; -tables.txt lists them."
        )
    return lines


def _e2e(results: dict) -> list[str]:
    result = results.get("e2e")
    if not result:
        return []
    c = result["config"]
    lines = [
        _heading(
            f"END TO END  one optimizer step: {c.get('model', 'TinyGPT')} of {c['parameters']:,} parameters, seq "
            f"{c['seq_len']}, batch {c['batch']}, AdamW, clip 1.0"
        )
    ]
    lines.append("  median over the timed steps [20%, 80% quantiles]: ranges that overlap establish no difference")
    for row in result["rows"]:
        peak = "" if row["peak_memory_mb"] is None else f"   peak {row['peak_memory_mb']:.0f} MiB"
        if row.get("peak_requested_mb") is not None:
            peak += f" ({row['peak_requested_mb']:.3f} MiB requested)"
        spread = f" [{row['q20_ms']:.1f}, {row['q80_ms']:.1f}]" if row.get("q20_ms") is not None else ""
        lines.append(f"  {row['recipe']:<48} {row['ms_per_step']:>8.1f} ms per optimizer step{spread}{peak}")
    harness = {round(row["harness_mb"]) for row in result["rows"] if row.get("harness_mb") is not None}
    if harness:
        lines += _wrap(
            f"Peaks: torch.cuda.max_memory_allocated over one step, less what the benchmark itself held before the "
            f"recipe's model existed ({'/'.join(map(str, sorted(harness)))} MiB: the timer's cache-flush buffer "
            f"and the batch); the raw peaks are in the JSON."
        )
    return lines


def render(results: dict, files: list[Path], elapsed_s: float | None = None) -> str:
    """The summary screen of a run.

    Args:
        results: the run's results (``meta``, ``memory``, ``correctness``, ``micro``, ``kernels``, ...).
        files: the files the run wrote (the summary file itself included), all in one directory.
        elapsed_s: the run's wall time, shown in the title line when given.
    """
    meta = results["meta"]
    took = f" in {elapsed_s // 60:.0f}m{elapsed_s % 60:02.0f}s" if elapsed_s is not None else ""
    lines = [
        "=" * _WIDTH,
        f"gafused {meta['gafused']} benchmark summary: {meta['mode']} run{took}",
        f"{meta['device']}, torch {meta['torch']}, {meta['date_utc'].replace('T', ' ')[:16]} UTC",
    ]
    stopped = meta.get("interrupted")
    if stopped:
        lines += _wrap(
            f"PARTIAL RESULTS: stopped by {stopped['signal']} after {stopped['after_s']:.0f} s, during "
            f"{stopped['during'] or 'setup'}. Only the parts and rows below were measured; the rest did not run.",
            indent="",
        )
    if meta["device_type"] == "cpu":
        default = default_backend(results)
        timed = [b for b in _backends(results.get("micro")) if b != default]
        text = "No GPU here: "
        if default:
            text += f"gafused ran its default CPU backend, `{default}` ({_BACKEND_WORDS.get(default, 'gafused')})"
            if timed:
                text += "; the micro-benchmark also times " + "; ".join(
                    f"`{b}` ({_BACKEND_WORDS.get(b, 'gafused')})" for b in timed
                )
        elif timed:
            text += "gafused ran " + "; ".join(f"`{b}` ({_BACKEND_WORDS.get(b, 'gafused')})" for b in timed)
        text += ". The fused Triton and CUDA kernels need a GPU; on a GPU machine this same command times them."
        lines += _wrap(text, indent="")
    lines += _memory(results) + _correctness(results) + _launches(results) + _kernels(results) + _e2e(results)
    if files:
        folder = files[0].parent
        lines.append(_heading(f"FILES  in {folder}/"))
        width = max(len(path.name) for path in files)
        for path in files:
            role = next((text for suffix, text in FILE_ROLES.items() if path.name.endswith(suffix)), "")
            lines.append(f"  {path.name:<{width}}  {role}")
    if meta["mode"] != "full":
        lines.append("\nEvery set, both gradient dtypes, longer timings: python bench/run.py --full")
    lines.append("=" * _WIDTH)
    return "\n".join(line.rstrip() for line in lines)


def _cell(row: dict | None) -> str:
    if row is None:
        return "-"
    if row["status"] == "ok":
        return f"{row['median_ms']:.2f}"
    return row["status"].split(":")[0] + (" (compile time)" if "compile time" in row["status"] else "")


def readme_tables(results: dict) -> str:
    """The README's tables of a results file (``python bench/run.py --table FILE.json``): every row of the
    micro-benchmark (median ms of each provider; aten ops, or kernels on a GPU, per micro-batch of the row's
    moment) and the end-to-end step, formatted as README quotes them."""
    rows = results.get("micro") or []
    names = list(dict.fromkeys(r["provider"] for r in rows))
    counted = [n for n in names if n == "naive" or n.startswith("gafused-")]
    unit = "aten ops" if results["meta"]["device_type"] == "cpu" else "kernels"
    by_key = {(r["set"], r["grad_dtype"], r["moment"], r["provider"]): r for r in rows}
    keys = sorted({(r["set"], r["grad_dtype"], r["moment"] == "last", r["moment"]) for r in rows})
    lines = [
        "| set | grads | moment | " + " | ".join(f"{n} ms" for n in names) + f" | {unit} "
        + " / ".join(counted) + " |",
        "| --- " * (4 + len(names)) + "|",
    ]  # fmt: skip
    described = set()
    for set_name, dtype, _, moment in keys:
        label = set_name
        if set_name not in described:
            described.add(set_name)
            first = next(r for r in rows if r["set"] == set_name)
            plural = "s" if first["tensors"] > 1 else ""
            label += f" ({first['tensors']} tensor{plural}, {first['elements'] / 1e6:.1f}M elements)"
        cells = [_cell(by_key.get((set_name, dtype, moment, n))) for n in names]
        launches = [by_key.get((set_name, dtype, moment, n), {}).get("launches") for n in counted]
        lines.append(
            f"| {label} | {dtype} | {moment} | " + " | ".join(cells) + " | "
            + " / ".join("-" if v is None else str(v) for v in launches) + " |"
        )  # fmt: skip
    tables = ["\n".join(lines)] if rows else []
    if rows and results["meta"]["device_type"] != "cpu":
        tables.append(_window_table(rows, results["meta"]["accumulation_steps"]))
    e2e = results.get("e2e")
    if e2e:
        peaks = any(row["peak_memory_mb"] is not None for row in e2e["rows"])  # measured on a GPU only
        requested = any(row.get("peak_requested_mb") is not None for row in e2e["rows"])  # newer results only
        # Newer results give peaks net of the harness (its flush buffer); older ones the raw peak only.
        net = " (harness excluded)" if any("peak_memory_raw_mb" in row for row in e2e["rows"]) else ""
        e2e_lines = [
            "| recipe | ms per optimizer step | gafused backend |"
            + (f" peak MiB{net} |" if peaks else "")
            + (f" peak MiB requested{net} |" if requested else ""),
            "| --- | --- | --- |" + (" --- |" if peaks else "") + (" --- |" if requested else ""),
        ]
        for row in e2e["rows"]:
            peak = f" {row['peak_memory_mb']:.0f} |" if peaks else ""
            if requested:
                value = row.get("peak_requested_mb")
                peak += " - |" if value is None else f" {value:.3f} |"
            e2e_lines.append(f"| {row['recipe']} | {row['ms_per_step']:.1f} | {row.get('backend') or '-'} |{peak}")
        tables.append("\n".join(e2e_lines))
    if results["meta"]["device_type"] != "cpu" and results.get("kernels"):
        tables.append(_kernel_table(results["kernels"]))
    return "\n\n".join(tables)


def window_ms(rows: list[dict], n: int) -> dict[tuple[str, str, str], float]:
    """Milliseconds per whole window of N micro-batches for each (set, grad dtype, provider) timed at both
    moments: N - 1 middle micro-batches and the last one. The first micro-batch is counted as a middle one; it
    writes the buffer without reading it, so this overstates every fused provider's window a little."""
    ms = {(r["set"], r["grad_dtype"], r["moment"], r["provider"]): r["median_ms"] for r in rows if r["status"] == "ok"}
    return {
        (set_name, dtype, provider): (n - 1) * middle + ms[(set_name, dtype, "last", provider)]
        for (set_name, dtype, moment, provider), middle in ms.items()
        if moment == "middle" and (set_name, dtype, "last", provider) in ms
    }


def _window_table(rows: list[dict], n: int) -> str:
    """ms per whole window (``window_ms``) of each provider, and how many times faster than ``naive``."""
    windows = window_ms(rows, n)
    names = list(dict.fromkeys(r["provider"] for r in rows))
    keys = list(dict.fromkeys((r["set"], r["grad_dtype"]) for r in rows))
    lines = [
        f"| set (window of N = {n}) | grads | " + " | ".join(f"{name} ms (x naive)" for name in names) + " |",
        "| --- " * (2 + len(names)) + "|",
    ]
    for set_name, dtype in keys:
        naive = windows.get((set_name, dtype, "naive"))
        cells = []
        for name in names:
            ms = windows.get((set_name, dtype, name))
            cells.append("-" if ms is None else f"{ms:.1f}" + ("" if naive is None else f" ({naive / ms:.1f}x)"))
        lines.append(f"| {set_name} | {dtype} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _kernel_table(rows: list[dict]) -> str:
    """The kernel sweep of a GPU run: each fused op's GB/s and share of the same run's copy bandwidth per buffer
    size, the goal being 90% from 256 MB up."""
    sizes = sorted({r["acc_mb"] for r in rows})
    # A size that did not fit has one row, its status, and no backend, op or copy.
    measured = [r for r in rows if "backend" in r]
    fused = [r for r in measured if r["backend"] in ("triton", "cuda")]
    keys = list(dict.fromkeys((r["backend"], r["op"], r["grad_dtype"]) for r in fused))
    by_key = {(r["backend"], r["op"], r["grad_dtype"], r["acc_mb"]): r for r in fused}
    copy = {r["acc_mb"]: f"{r['copy_gbps']:.0f}" for r in measured}
    skipped = {r["acc_mb"]: r["status"].split(":")[0] for r in rows if "backend" not in r}
    lines = [
        "| backend | op | grads | " + " | ".join(f"{size} MB: GB/s (of copy)" for size in sizes) + " |",
        "| --- " * (3 + len(sizes)) + "|",
        "| copy_ | - | - | " + " | ".join(copy.get(size) or skipped.get(size, "-") for size in sizes) + " |",
    ]
    for backend, op, dtype in keys:
        cells = []
        for size in sizes:
            row = by_key.get((backend, op, dtype, size))
            cells.append(
                "-" if row is None or row["status"] != "ok"
                else f"{row['gbps']:.0f} ({row['fraction_of_copy_bw']:.0%})"
            )  # fmt: skip
        lines.append(f"| {backend} | {op} | {dtype} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
