"""Pieces the multi-process case scripts and the tests share (tests/*_cases.py, tests/test_*.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, NoReturn

import torch


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, for a process group's rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def case_script_target(argv: list[str]) -> str | None:
    """What a ``*_cases.py`` script was asked for: None for ``--report`` (run the cases, print the report), else the
    file its ranks save their results to (what ``run_case_script`` passes); anything else stops it with its usage,
    before a rank starts (an option such as ``--help`` would otherwise be taken for a file name)."""
    if argv == ["--report"]:
        return None
    if len(argv) == 1 and not argv[0].startswith("-"):
        return argv[0]
    script = Path(sys.argv[0]).name
    raise SystemExit(f"usage: python {script} --report   (or: python {script} RESULTS_FILE, as the tests run it)")


def run_case_script(script: str, out: Path) -> Any:
    """Run a ``*_cases.py`` script (it spawns its ranks) with ``out`` as its argument; what it saved there."""
    script_path = Path(script)
    done = subprocess.run(
        [sys.executable, str(script_path), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=script_path.parent,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(out, weights_only=False)


def tanh_mlp(sizes: tuple[int, int, int] = (5, 4, 3), seed: int = 0, dtype: torch.dtype = torch.float64) -> Any:
    """Linear -> Tanh -> Linear with widths ``sizes``, initialized from ``torch.manual_seed(seed)``, in ``dtype``: the
    small smooth model the single-process tests train and compare in float64."""
    torch.manual_seed(seed)
    first, hidden, last = sizes
    return torch.nn.Sequential(torch.nn.Linear(first, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, last)).to(dtype)


def leave_spawned_rank() -> NoReturn:
    """End a rank process started by ``mp.spawn`` once its results are saved, skipping interpreter shutdown.

    A gloo worker thread releases a collective's work after the caller has already moved on; when the work holds a
    tensor that has a Python object, the thread takes the GIL to drop it. If the interpreter is finalizing by then,
    CPython ends that thread with a forced unwind through a noexcept destructor, and std::terminate aborts the rank
    (SIGABRT after every result is in). A forked rank never finalizes (multiprocessing ends it with ``os._exit``);
    this ends a spawned one the same way. Call it on success only: an exception has to reach ``mp.spawn``.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def tiny_gpt2_config(vocab_size: int, n_positions: int = 32, **overrides: Any) -> Any:
    """A two-layer GPT-2 of width 16 without dropout (random init is the caller's): exact comparisons need no
    randomness in the forward."""
    from transformers import GPT2Config

    settings = dict(
        vocab_size=vocab_size,
        n_positions=n_positions,
        n_embd=16,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    settings.update(overrides)
    return GPT2Config(**settings)


def micro_batch(opt: Any, loss: Any, loop: str, weight: Any = None, end_window: bool = False) -> None:
    """One micro-batch through either loop of a GradAccumulator: ``"backward"``, ``opt.backward(loss, weight=w,
    end_window=e); opt.step()``, or ``"step"``, ``loss.backward(); opt.step(weight=w, end_window=e)``."""
    if loop == "backward":
        opt.backward(loss, weight=weight, end_window=end_window)
        opt.step()
    else:
        loss.backward()
        opt.step(weight=weight, end_window=end_window)


def own_scalar_case(backend: str, device: str, numel: int) -> None:
    """A 0-d view of the buffer as the scalar of ``scale_``, ``fold_`` and ``fold_finish_`` (two segments of ``numel``
    elements), and one of ``out`` as the coefficient of ``scale_`` into it: each op must use the value it held when
    the op was called, though the op writes it."""
    from gafused import FlatGradBuffer, ops

    buffer = FlatGradBuffer([torch.empty(numel, device=device), torch.empty(numel, device=device)], torch.float32)

    def full(value: float) -> torch.Tensor:
        return torch.full((numel,), value, device=device)

    ops.fold_(buffer, [full(2.0), full(3.0)], 1.0, first=True, backend="reference")
    ops.scale_(buffer, buffer.data[0], backend=backend)  # coef 2
    assert torch.equal(buffer.segment(0), full(4.0)) and torch.equal(buffer.segment(1), full(6.0))
    ops.fold_(buffer, [full(1.0), full(1.0)], buffer.data[0], first=False, backend=backend)  # weight 4
    assert torch.equal(buffer.segment(0), full(8.0)) and torch.equal(buffer.segment(1), full(10.0))
    scale = buffer.data[0]  # 8
    total, nonfinite = ops.fold_finish_(buffer, [full(1.0), full(1.0)], 1.0, scale, first=False, backend=backend)
    assert torch.equal(buffer.segment(0), full(72.0)) and torch.equal(buffer.segment(1), full(88.0))
    assert float(total) == numel * (72.0**2 + 88.0**2)  # every partial sum of these squares is exact in float32
    assert not bool(nonfinite)
    out = torch.full((buffer.numel,), 0.5, device=device)
    ops.scale_(buffer, out[buffer.offsets[1]], out=out, backend=backend)  # coef 0.5, in the memory out is written
    assert torch.equal(out[buffer.offsets[0] : buffer.offsets[0] + numel], full(36.0))
    assert torch.equal(out[buffer.offsets[1] : buffer.offsets[1] + numel], full(44.0))
