"""GPU evidence without a GPU: every Triton kernel variant compiled ahead of time for sm_80 and sm_90.

``tests/triton_aot.py`` compiles each variant the launchers can launch (a separate process: the kernels must be
real JIT functions, and this suite defines them under TRITON_INTERPRET=1 on machines without a GPU) and reports
what the PTX and the cubin show. The checks:
- the full-block path of every elementwise kernel moves all its data with 128-bit loads and stores (exactly as
  many per thread as its bytes need: a stream that fell back to narrower accesses lowers the count);
- no ``fma`` in any kernel: fold and scale promise bitwise agreement with the reference's separate roundings;
- no spills (local memory or stack), read with the cuobjdump bundled with Triton.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed")

ARCHS = (80, 90)
_SCRIPT = Path(__file__).resolve().parent / "triton_aot.py"
# Interpreters whose Triton compiles the kernels: this one, plus those in $GAFUSED_AOT_PYTHONS (separated by the
# platform's path separator), e.g. a virtualenv with the Triton of the GPU machines (bench/triton_aot_check.sh).
_PYTHONS = [sys.executable, *filter(None, os.environ.get("GAFUSED_AOT_PYTHONS", "").split(os.pathsep))]


@pytest.fixture(
    scope="module", params=_PYTHONS, ids=lambda python: "this-python" if python == sys.executable else python
)
def compiled(request: pytest.FixtureRequest) -> list[dict]:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    command = [request.param, str(_SCRIPT)] + [argument for arch in ARCHS for argument in ("--arch", str(arch))]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    assert rows, "no kernel variant was compiled"
    return rows


def _label(row: dict) -> str:
    return f"{row['name']} sm_{row['arch']}"


def test_every_variant_compiles_for_each_architecture(compiled):
    names = {row["name"] for row in compiled}
    for arch in ARCHS:
        assert {row["name"] for row in compiled if row["arch"] == arch} == names
    kernels = {name.split()[0] for name in names}
    assert kernels == {"fold", "scale", "sum_of_squares", "reduce_partials"}


def test_full_blocks_use_128_bit_loads_and_stores(compiled):
    elementwise = [row for row in compiled if row["expected_wide_loads"] is not None]
    assert elementwise
    wrong = [
        f"{_label(row)}: {row['wide_loads']} of {row['expected_wide_loads']} loads and "
        f"{row['wide_stores']} of {row['expected_wide_stores']} stores are 128-bit"
        for row in elementwise
        if (row["wide_loads"], row["wide_stores"]) != (row["expected_wide_loads"], row["expected_wide_stores"])
    ]
    assert not wrong, "\n".join(wrong)


def test_no_fma_contraction(compiled):
    contracted = [f"{_label(row)}: {row['fma']} fma" for row in compiled if row["fma"]]
    assert not contracted, "\n".join(contracted)


def test_no_register_spills(compiled):
    if any(row["registers"] is None for row in compiled):
        pytest.skip("no cuobjdump (neither bundled with Triton nor on PATH): resource usage unknown")
    spilled = [
        f"{_label(row)}: {row['registers']} registers, stack {row['stack']}, local {row['local']}"
        for row in compiled
        if row["stack"] or row["local"]
    ]
    assert not spilled, "\n".join(spilled)


def test_fold_variants_run_the_warps_the_launcher_picks(compiled):
    from gafused.triton_backend._layout import fold_num_warps, launch_config

    # 16-bit gradients into a large fp32 buffer run 4 warps; fp32 gradients and fp64 buffers the table's 8.
    assert launch_config((1 << 20,), 4) == (4096, 8) and launch_config((1 << 20,), 8) == (2048, 8)
    assert [fold_num_warps(8, 4, g) for g in (2, 4)] == [4, 8] and fold_num_warps(8, 8, 2) == 8
    assert fold_num_warps(4, 4, 2) == 4  # small buffers already run 4
    names = {row["name"] for row in compiled}
    for finish in (False, True):
        assert f"fold acc=fp32 grad=bf16 first=False finish={finish} block=4096 warps=4" in names
        assert f"fold acc=fp32 grad=fp32 first=False finish={finish} block=4096 warps=8" in names
        assert f"fold acc=fp64 grad=bf16 first=False finish={finish} block=2048 warps=8" in names
