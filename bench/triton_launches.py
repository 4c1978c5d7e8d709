"""Triton kernel launches per micro-step, counted on a machine without a GPU.

The Triton backend runs on CPU tensors under ``TRITON_INTERPRET=1``: too slow to time, but it launches exactly
the kernels a GPU would. This counts them for one ``GradAccumulator.step()`` (a middle and a finishing
micro-batch, bf16 gradients, clipping on) on parameter sets with the layout of the timed ones at tiny sizes, so
the CPU summary can say what the fused path launches where the timed rows can only show the CPU backends
(foreach, reference).

The interpreter must be chosen before Triton kernels are defined, so the count runs in a child process:
``Count().start()`` runs ``python bench/triton_launches.py`` with ``TRITON_INTERPRET=1`` (it can run beside untimed
work), ``.result()`` waits for its JSON.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

__all__ = ["Count"]

_TIMEOUT_S = 120


def _sets():
    import param_sets

    # Same tensor counts as the CPU sets, a few elements per tensor: launches do not depend on sizes.
    return {
        "gpt2-124m": param_sets.gpt2(hidden=8, vocab=32, positions=16, name="gpt2-124m"),
        "many-small-512": param_sets.many_small(512, 4, name="many-small-512"),
    }


class Count:
    """A count running in a child process: ``start()`` it before untimed work, ``result()`` it afterwards."""

    def __init__(self) -> None:
        self._process: subprocess.Popen | None = None
        self._skipped: str | None = None
        if importlib.util.find_spec("triton") is None:
            self._skipped = "triton is not installed (pip install -e '.[triton]')"

    def start(self) -> Count:
        if self._skipped is None:
            env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
            command = [sys.executable, str(Path(__file__).resolve())]
            self._process = subprocess.Popen(
                command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        return self

    def result(self) -> dict:
        """``{"sets": {name: {"tensors": n, "middle": [kernel names], "last": [...]}}}`` or ``{"skipped": why}``."""
        if self._skipped is not None:
            return {"skipped": self._skipped}
        if self._process is None:
            raise RuntimeError("start() the count first")
        try:
            stdout, stderr = self._process.communicate(timeout=_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.communicate()
            return {"skipped": f"counting under the Triton interpreter took over {_TIMEOUT_S} s"}
        if self._process.returncode != 0:
            last = (stderr.strip().splitlines() or ["no output"])[-1]
            return {"skipped": f"counting failed: {last[:200]}"}
        return json.loads(stdout.strip().splitlines()[-1])


def _count_here() -> dict:
    import torch
    from providers import NoopOptimizer

    import gafused
    from gafused.triton_backend.fold import _fold_kernel

    launches: list[str] = []
    kernel_type = type(_fold_kernel)
    original_run = kernel_type.run

    def counting_run(self, *args, **kwargs):
        launches.append(self.fn.__name__)
        return original_run(self, *args, **kwargs)

    kernel_type.run = counting_run
    generator = torch.Generator().manual_seed(0)
    result = {}
    for name, param_set in _sets().items():
        params = [torch.nn.Parameter(torch.zeros(s, dtype=torch.bfloat16)) for s in param_set.shapes]
        opt = gafused.GradAccumulator(NoopOptimizer(params), 3, max_grad_norm=1.0, backend="triton")
        per_moment = {}
        for index in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=generator).to(torch.bfloat16)
            launches.clear()
            opt.step()
            moment = {1: "middle", 2: "last"}.get(index)
            if moment:
                per_moment[moment] = list(launches)
        result[name] = {"tensors": param_set.count, **per_moment}
    return {"sets": result}


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":  # (Count starts it so; by hand, say how)
        raise SystemExit(
            "bench/triton_launches.py counts launches under Triton's CPU interpreter: run it as "
            "TRITON_INTERPRET=1 python bench/triton_launches.py (bench/run.py does)"
        )
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    print(json.dumps(_count_here()))
