"""The PNG figures of a benchmark run, drawn from the rows the run writes to its JSON.

- ``memory``: peak bytes per parameter of each recipe, as bars (one panel per parameter dtype);
- ``correctness``: relative error of each recipe's gradient against float64, as bars on a log scale;
- ``ms``: time per micro-batch of each provider on each parameter set (log scale);
- ``kernels``: each op's bandwidth against the buffer size, with the copy bandwidth of the same sizes.

Every function returns the path it wrote, or None when it had nothing to draw. ``python bench/run.py
--plot-only FILE.json`` redraws all of them from a results file.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["write_all", "memory", "correctness", "micro_ms", "kernels"]

_MOMENTS = ("middle", "last")
_DPI = 110


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _backends(rows: list[dict]) -> str:
    """The gafused backends that ran in ``rows``, as words for a title."""
    names = list(dict.fromkeys(r["backend"] for r in rows if r.get("backend")))
    return f"{' and '.join(names)} backend{'s' if len(names) > 1 else ''}" if names else "gafused"


def _save(figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=_DPI)
    _pyplot().close(figure)
    return path


def memory(rows: list[dict] | None, path: Path, device_label: str) -> Path | None:
    """Horizontal bars of peak bytes per parameter, one panel per parameter dtype, values written on the bars."""
    if not rows:
        return None
    plt = _pyplot()
    dtypes = list(dict.fromkeys(r["param_dtype"] for r in rows))
    most = max(len([r for r in rows if r["param_dtype"] == d]) for d in dtypes)
    figure, axes = plt.subplots(len(dtypes), 1, figsize=(8, 0.9 + 0.55 * most * len(dtypes)), squeeze=False)
    top = max(r["peak_bytes_per_param"] for r in rows)
    for axis, dtype in zip(axes[:, 0], dtypes, strict=True):
        group = [r for r in rows if r["param_dtype"] == dtype]
        names = [r["recipe"] for r in group]
        values = [r["peak_bytes_per_param"] for r in group]
        colors = ["tab:green" if "gafused" in name else "tab:gray" for name in names]
        bars = axis.barh(range(len(group)), values, color=colors)
        axis.bar_label(bars, labels=[f"{v:.1f} B" for v in values], padding=3, fontsize=8)
        axis.set_yticks(range(len(group)), names, fontsize=8)
        axis.invert_yaxis()
        axis.set_xlim(0, top * 1.18)
        axis.set_title(f"{dtype} parameters", fontsize=9)
        axis.grid(True, axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("peak memory per parameter (bytes): lower is better")
    figure.suptitle(f"Peak memory per parameter during a training step - {device_label}", fontsize=10)
    return _save(figure, path)


def correctness(result: dict | None, path: Path) -> Path | None:
    """Grouped horizontal bars (log scale): relative error of each recipe in each scenario."""
    if not result or not result.get("scenarios"):
        return None
    plt = _pyplot()
    scenarios = result["scenarios"]
    recipes = [row["recipe"] for row in scenarios[0]["rows"]]
    figure, axis = plt.subplots(figsize=(8, 1.2 + 0.75 * len(recipes)))
    height = 0.8 / len(scenarios)
    for index, scenario in enumerate(scenarios):
        errors = {row["recipe"]: row["relative_error"] for row in scenario["rows"]}
        ys = [i + (index - (len(scenarios) - 1) / 2) * height for i in range(len(recipes))]
        values = [max(errors[r], 1e-17) for r in recipes]
        bars = axis.barh(ys, values, height, label=scenario["scenario"])
        labels = [f"{v:.0%}" if v >= 1e-3 else f"{v:.0e}" for v in values]
        axis.bar_label(bars, labels=labels, padding=3, fontsize=7)
    axis.set_xscale("log")
    axis.set_xlim(1e-9, 10)
    axis.axvline(2**-23, color="black", linewidth=0.8, linestyle="--", label="float32 rounding (2^-23)")
    axis.set_yticks(range(len(recipes)), recipes, fontsize=8)
    axis.invert_yaxis()
    axis.set_xlabel("relative error of the finished gradient vs a float64 big batch (token-mean loss): lower is better")
    axis.set_title("Is the accumulated gradient the big batch's gradient?", fontsize=10)
    axis.grid(True, axis="x", which="major", alpha=0.3)
    axis.legend(fontsize=7, loc="lower right")
    return _save(figure, path)


_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def micro_ms(rows: list[dict] | None, path: Path, device_label: str, provider_order: list[str]) -> Path | None:
    """ms per micro-batch per set (sets ordered by size), a marker per provider side by side; a panel per (dtype,
    moment).

    Markers, not lines: the sets differ in structure, not only in size, so a line through them would suggest a
    sweep that was not run. Not bars either: on the log axis a bar's height would not be proportional to its time.
    """
    ok = [r for r in rows or [] if r["status"] == "ok"]
    if not ok:
        return None
    plt = _pyplot()
    from matplotlib import ticker

    sets = sorted({(r["elements"], r["set"], r["tensors"]) for r in ok})
    names = sorted({r["provider"] for r in ok}, key=lambda n: provider_order.index(n) if n in provider_order else 99)
    dtypes = list(dict.fromkeys(r["grad_dtype"] for r in ok))
    width = 0.8 / len(names)
    figure, axes = plt.subplots(
        len(dtypes), len(_MOMENTS), figsize=(6 * len(_MOMENTS), 3.6 * len(dtypes)), squeeze=False
    )
    for row_axes, dtype_name in zip(axes, dtypes, strict=True):
        for axis, moment in zip(row_axes, _MOMENTS, strict=True):
            for offset, name in enumerate(names):
                values = {
                    r["set"]: r["median_ms"]
                    for r in ok
                    if r["provider"] == name and r["grad_dtype"] == dtype_name and r["moment"] == moment
                }
                shift = (offset - (len(names) - 1) / 2) * width
                xs = [i + shift for i, (_, s, _) in enumerate(sets) if s in values]
                axis.plot(xs, [values[s] for _, s, _ in sets if s in values], linestyle="none",
                          marker=_MARKERS[offset % len(_MARKERS)], markersize=6, label=name)  # fmt: skip
            axis.set_xticks(range(len(sets)))
            axis.set_xticklabels([f"{s}\n{t} tensors\n{n / 1e6:.2g}M elements" for n, s, t in sets], fontsize=7)
            axis.set_yscale("log")
            axis.yaxis.set_major_formatter(ticker.FuncFormatter(lambda value, _: f"{value:g}"))
            axis.yaxis.set_minor_formatter(ticker.FuncFormatter(lambda value, _: f"{value:g}"))
            axis.tick_params(axis="y", which="both", labelsize=7)
            axis.set_title(f"{dtype_name} grads -> fp32 accumulator, {moment} micro-batch", fontsize=9)
            axis.set_ylabel("ms per micro-batch (lower is better)", fontsize=8)
            axis.grid(True, axis="y", which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    note = f" (CPU: gafused's {_backends(ok)}, not the GPU kernels)" if device_label.startswith("CPU") else ""
    figure.suptitle(f"Time per micro-batch - {device_label}{note}", fontsize=10)
    return _save(figure, path)


_COLORS = tuple(f"tab:{name}" for name in ("blue", "orange", "green", "red", "purple", "brown", "pink", "gray",
                                             "olive", "cyan"))  # fmt: skip
_LINESTYLES = ("-", "--", ":", "-.")


def _series_styles(keys: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """A (colour, line style, marker) for each (backend, op, grad dtype) series, no two alike: the colour says the op
    and grad dtype, the line style and marker the backend (the marker moves on again for every ten ops)."""
    backends = list(dict.fromkeys(key[0] for key in keys))
    ops = list(dict.fromkeys(key[1:] for key in keys))
    styles = []
    for backend, *op in keys:
        b, o = backends.index(backend), ops.index(tuple(op))
        style = b + len(backends) * (o // len(_COLORS))
        styles.append((_COLORS[o % len(_COLORS)], _LINESTYLES[b % len(_LINESTYLES)], _MARKERS[style % len(_MARKERS)]))
    return styles


def kernels(rows: list[dict] | None, path: Path, device_label: str, cpu: bool) -> Path | None:
    """GB/s of each (backend, op, grad dtype) against the buffer size, with the copy_ bandwidth of each size."""
    ok = [r for r in rows or [] if r["status"] == "ok"]
    if not ok:
        return None
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(10, 4.8))
    copy = sorted({(r["acc_mb"], r["copy_gbps"]) for r in ok})
    axis.plot([c[0] for c in copy], [c[1] for c in copy], color="black", linewidth=2.2, marker="s",
              label="copy_ of the same size")  # fmt: skip
    if not cpu:
        axis.plot([c[0] for c in copy], [0.9 * c[1] for c in copy], color="black", linewidth=0.8, linestyle="--",
                  label="goal: 90% of copy")  # fmt: skip
    keys = list(dict.fromkeys((r["backend"], r["op"], r["grad_dtype"]) for r in ok))
    for key, (color, linestyle, marker) in zip(keys, _series_styles(keys), strict=True):
        points = sorted((r["acc_mb"], r["gbps"]) for r in ok if (r["backend"], r["op"], r["grad_dtype"]) == key)
        label = f"{key[0]} {key[1]}" + (f" ({key[2]} grads)" if key[2] != "-" else "")
        axis.plot([p[0] for p in points], [p[1] for p in points], color=color, linestyle=linestyle, marker=marker,
                  label=label)  # fmt: skip
    axis.set_xscale("log", base=2)
    axis.set_xticks([c[0] for c in copy], [f"{c[0]} MB" for c in copy])
    axis.set_ylim(bottom=0)
    axis.set_xlabel("fp32 accumulation buffer")
    axis.set_ylabel("GB/s (minimum bytes / time): higher is better")
    where = f"CPU path ({_backends(ok)}, not the GPU kernels)" if cpu else "GPU kernels"
    axis.set_title(f"gafused ops vs copy_ bandwidth - {where}\n{device_label}", fontsize=9)
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(figure, path)


def write_all(results: dict, stem: Path, provider_order: list[str]) -> list[Path]:
    """Every figure of a results dict (the run's JSON) next to ``stem``: ``<stem>-<figure>.png``."""
    meta = results["meta"]
    label = meta["device"]
    cpu = meta.get("device_type") == "cpu"
    written = [
        memory(results.get("memory"), stem.with_name(f"{stem.name}-memory.png"), label),
        correctness(results.get("correctness"), stem.with_name(f"{stem.name}-correctness.png")),
        micro_ms(results.get("micro"), stem.with_name(f"{stem.name}-ms.png"), label, provider_order),
        kernels(results.get("kernels"), stem.with_name(f"{stem.name}-kernels.png"), label, cpu),
    ]
    return [path for path in written if path is not None]
