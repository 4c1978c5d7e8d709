"""Smoke run of bench/distributed.py (``--quick --plain-fsdp2``: GPT-2's layout at hidden 64, 2 gloo ranks).

One run in a subprocess; the tests read its JSON. Timings are not checked; the collective counts, which are
exact, and the exactness column are.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from distributed_cases import window_sums_bytes

BENCH = Path(__file__).resolve().parents[1] / "bench" / "distributed.py"
N = 4
NORM_BYTES = 16  # FSDP2: the float64 all-reduce of the shards' sum of squares and non-finite flag
ROWS = [
    "ddp",
    "ddp-no_sync",
    "gafused-ddp",
    "gafused-ddp-bf16",
    "fsdp2",
    "fsdp2-no_sync",
    "gafused-fsdp2",
    "gafused-fsdp2-no_sync",
]

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(
        not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
    ),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bench") / "distributed.json"
    done = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--plain-fsdp2", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert out.with_suffix(".csv").exists()
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def rows(results: dict) -> dict[str, dict]:
    return {row["recipe"]: row for row in results["rows"]}


def test_every_row_and_the_run_facts(results: dict, rows: dict[str, dict]) -> None:
    assert list(rows) == ROWS
    meta = results["meta"]
    assert meta["world_size"] == 2 and meta["accumulation_steps"] == N and meta["quick"]
    assert {"torch", "cpu", "date_utc"} <= set(meta)
    # The code and machine behind the figures; on these CPU ranks there is no driver to name.
    assert {"git_commit", "git_tracked_files_modified", "cpu_cores", "cuda_version", "triton"} <= set(meta)
    assert meta["cpu_cores"] >= 1 and meta["cuda_driver_version"] is None
    for row in rows.values():
        assert row["counts_equal_every_window_and_rank"], row["recipe"]
        assert row["peak_bytes"] > 0 and row["window_s_median"] > 0


@pytest.mark.parametrize("name", ["gafused-ddp", "gafused-ddp-bf16"])
def test_gafused_ddp_sends_one_all_reduce_per_bucket_per_window_plus_the_window_sums(
    rows: dict[str, dict], name: str
) -> None:
    row = rows[name]
    assert row["gafused_buckets"] > 1
    assert row["collectives_by_kind"] == {"all-reduce": row["gafused_buckets"] + 1}  # DDP's own: none
    element = 2 if name.endswith("bf16") else 4
    window_sums = window_sums_bytes(row["gafused_params"], row["gafused_buckets"])
    assert row["bytes"] == row["gafused_buffer_bytes"] // 4 * element + window_sums


@pytest.mark.parametrize("name", ["gafused-fsdp2", "gafused-fsdp2-no_sync"])
def test_gafused_fsdp2_adds_two_small_all_reduces_to_fsdp2s_own_traffic(rows: dict[str, dict], name: str) -> None:
    row, plain = rows[name], rows[name.removeprefix("gafused-")]
    assert row["collectives_by_kind"] == {**plain["collectives_by_kind"], "all-reduce": 2}
    window_sums = window_sums_bytes(row["gafused_params"], 0)  # no per-bucket flags over FSDP2
    assert row["bytes"] == plain["bytes"] + window_sums + NORM_BYTES


def test_reducing_every_micro_batch_costs_n_times_one_reduction_per_window(rows: dict[str, dict]) -> None:
    every, once = rows["ddp"], rows["ddp-no_sync"]
    assert every["collectives_by_kind"] == {"ddp all-reduce": N * once["collectives"]}
    assert every["bytes"] == N * once["bytes"]
    fsdp_every, fsdp_once = rows["fsdp2"]["collectives_by_kind"], rows["fsdp2-no_sync"]["collectives_by_kind"]
    assert fsdp_every["reduce-scatter"] == N * fsdp_once["reduce-scatter"]


def test_every_fp32_recipe_lands_within_fp32_rounding_of_float64(rows: dict[str, dict]) -> None:
    for row in rows.values():
        assert row["check"] == "ok", (row["recipe"], row["param_error_vs_float64"])
        # Clipped windows hide a gradient off by a factor from the parameters; the norm before clipping does not.
        assert abs(row["grad_norm_error_vs_float64"]) < row["error_bound"], row["recipe"]
    assert rows["gafused-ddp-bf16"]["param_error_vs_float64"] > rows["gafused-ddp"]["param_error_vs_float64"]
