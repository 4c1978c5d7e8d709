"""Exact peak memory of the end-to-end recipes, on CPU: every tensor byte, without an allocator's rounding.

    python bench/e2e_memory.py                 # bench/e2e.py's CPU model under bf16 autocast, like its GPU run
    python bench/e2e_memory.py --no-autocast   # fp32 throughout
    python bench/e2e_memory.py --quick         # the tiny model

On a GPU, ``bench/e2e.py`` reports ``torch.cuda.max_memory_allocated``, which counts the caching allocator's blocks
(requests rounded up to 512 bytes, a cached block handed out whole when what would be left is small), so two
recipes with the same tensors alive can differ there by a few MiB. This script runs the same recipes
(``e2e.setup``: each with a fresh model from one seed and a fresh AdamW) with ``bench/memory.py``'s CPU tracker,
which sees every allocation and free at its exact size: one optimizer step first (AdamW's state appears), then
the peak of live bytes over a second step, everything the recipe allocated included (the model is built inside
the tracker; the data, shared by all recipes, is not). Printed: peak bytes per recipe and each one's difference
to plain accumulation.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import e2e  # noqa: E402 - bench/ modules are imported as siblings, after the path is set
import memory  # noqa: E402

__all__ = ["main", "rows"]


def rows(mode: str = "default", autocast: bool = True) -> list[dict[str, object]]:
    """Peak live tensor bytes over one optimizer step of each end-to-end recipe on CPU.

    Args:
        mode: ``e2e.config_for``'s mode: "default" (the CPU model) or "quick" (the tiny one).
        autocast: run forward under bf16 autocast with fp32 weights, as the GPU run does.

    Returns:
        One dict per recipe: ``recipe``, ``peak_bytes`` (the most bytes alive at once during the step, those alive
        at its start included) and ``over_plain_bytes`` (``peak_bytes`` minus the plain accumulation recipe's).
    """
    run = e2e.setup(torch.device("cpu"), mode, autocast=autocast)
    results = []
    for label, _, make_step in run.recipes:
        with memory.track_peak(torch.device("cpu")) as tracker:
            model, optimizer = run.build()  # built inside: parameters, AdamW's state and buffers all count
            step = make_step(model, optimizer)
            step()  # AdamW's state appears, the accumulator's buffers are written: as from then on in training
            tracker.mark()
            step()
            del model, optimizer, step
        results.append({"recipe": label, "peak_bytes": tracker.peak_after_mark()})
        gc.collect()
    plain = next(row["peak_bytes"] for row in results if str(row["recipe"]).startswith("plain"))
    for row in results:
        row["over_plain_bytes"] = row["peak_bytes"] - plain
    return results


def main(argv: list[str] | None = None) -> None:
    """Print the peak of each recipe and its difference to plain accumulation."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny model of bench/run.py --quick")
    parser.add_argument("--no-autocast", action="store_true", help="fp32 forward instead of bf16 autocast")
    args = parser.parse_args(argv)
    mode = "quick" if args.quick else "default"
    run = e2e.setup(torch.device("cpu"), mode, autocast=not args.no_autocast)
    c = run.config
    print(
        f"end-to-end peak memory on CPU, exact: {run.model_name}, hidden {c.hidden}, {c.layers} layers, "
        f"seq {c.seq_len}, micro-batch {c.micro_batch} x {c.accumulation_steps}, "
        f"bf16 autocast {not args.no_autocast}, AdamW, torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(f"{'recipe':<48} {'peak bytes':>14} {'over plain':>12}")
    for row in rows(mode, autocast=not args.no_autocast):
        print(f"{row['recipe']:<48} {row['peak_bytes']:>14,} {row['over_plain_bytes']:>+12,}")


if __name__ == "__main__":
    main()
