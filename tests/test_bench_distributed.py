"""Smoke run of bench/distributed.py (``--quick --plain-fsdp2``: GPT-2's layout at hidden 64, 2 gloo ranks).

One run in a subprocess; the tests read its JSON. Timings are not checked; the collective counts, which are
exact, and the exactness column are.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from distributed_cases import window_sums_bytes

BENCH = Path(__file__).resolve().parents[1] / "bench" / "distributed.py"
sys.path.insert(0, str(BENCH.parent))

import distributed  # noqa: E402 - bench/ is not a package

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


# --- against the --quick --plain-fsdp2 run ------------------------------------------------------------------------


def test_fsdp2_payloads_are_reduce_scatter_inputs_and_all_gather_outputs(results: dict, rows: dict[str, dict]) -> None:
    params_bytes = 4 * results["meta"]["params"]  # fp32; the quick model's sizes all divide by 2 ranks: no padding
    assert rows["ddp-no_sync"]["bytes"] == params_bytes
    for name in ("fsdp2", "fsdp2-no_sync", "gafused-fsdp2", "gafused-fsdp2-no_sync"):
        by_kind = rows[name]["bytes_by_kind"]
        # one reduce-scatter of every full gradient per synced micro-batch (its input, not the shard it returns)
        synced = 1 if name.endswith("no_sync") else N
        assert by_kind["reduce-scatter"] == synced * params_bytes, name
        # every micro-batch's forward gathers every parameter in full, backward gathers the blocks' again
        assert N * params_bytes <= by_kind["all-gather"] < 2 * N * params_bytes, name


def test_bytes_and_sent_bytes_add_up_the_kinds(results: dict, rows: dict[str, dict]) -> None:
    world = results["meta"]["world_size"]
    for row in rows.values():
        by_kind = row["bytes_by_kind"]
        assert row["bytes"] == sum(by_kind.values()), row["recipe"]
        assert row["collectives"] == sum(row["collectives_by_kind"].values()), row["recipe"]
        ring = {"ddp all-reduce": 2 * (world - 1) / world, "all-reduce": 2 * (world - 1) / world,
                "reduce-scatter": (world - 1) / world, "all-gather": (world - 1) / world}  # fmt: skip
        assert row["sent_bytes_per_rank"] == round(sum(ring[kind] * b for kind, b in by_kind.items())), row["recipe"]
    assert rows["fsdp2"]["sent_bytes_per_rank"] == rows["fsdp2"]["bytes"] // 2  # 2 ranks: half of every payload


def test_windows_ranks_and_the_ddp_reference_as_the_columns_say(results: dict, rows: dict[str, dict]) -> None:
    meta = results["meta"]
    for row in rows.values():
        assert len(row["window_s"]) == meta["timed_windows"], row["recipe"]
        assert row["window_s_min"] == min(row["window_s"]) and row["window_s_max"] == max(row["window_s"])
        assert row["grad_norm_equal_across_ranks"], row["recipe"]
        assert row["peak_bytes_per_param"] == pytest.approx(row["peak_bytes"] / meta["params"])
    # --quick's DDP buckets are small enough to be several, as gafused's are.
    assert (
        rows["ddp-no_sync"]["collectives"] > 1 and rows["ddp"]["collectives"] == N * rows["ddp-no_sync"]["collectives"]
    )
    # ddp is the reference of the vs-ddp column: 0 for itself, not for a recipe that rounds differently.
    assert rows["ddp"]["param_error_vs_ddp"] == 0.0
    assert rows["gafused-ddp-bf16"]["param_error_vs_ddp"] > 1e-4
    assert all(0 < row["param_error_vs_ddp"] < row["error_bound"] for name, row in rows.items() if name != "ddp")


def test_every_rank_window_and_micro_batch_gets_tokens_of_its_own() -> None:
    """Identical data on the ranks would hide a recipe that never synchronizes: its replicas would agree anyway."""
    config = distributed.config_for(True).model
    batches = [
        distributed._tokens(config, rank, window, micro) for rank in (0, 1) for window in (0, 1) for micro in range(N)
    ]
    for x, y in batches:
        assert x.shape == y.shape == (1, distributed.TOKENS)
    assert len({tuple(x.flatten().tolist()) for x, _ in batches}) == len(batches)


def test_the_table_prints_each_rows_figures(results: dict, rows: dict[str, dict]) -> None:
    lines = {line.split()[0]: line for line in distributed.format_table(results).splitlines()[3:] if line.split()}
    for name, row in rows.items():
        figures = (
            f" {row['bytes'] / 1e6:>7.1f} {row['sent_bytes_per_rank'] / 1e6:>7.1f} {row['window_s_median']:>8.2f} "
        )
        assert figures in lines[name] and lines[name].endswith(row["check"]), name
    assert rows["fsdp2"]["bytes"] != rows["fsdp2"]["sent_bytes_per_rank"]


# --- without ranks: a row from what the ranks measured, the command line ------------------------------------------


def _wire(calls: int) -> dict:
    return {"collectives": calls, "collectives_by_kind": {"all-reduce": calls}, "bytes": 8 * calls,
            "bytes_by_kind": {"all-reduce": 8 * calls}, "sent_bytes_per_rank": 8 * calls}  # fmt: skip


def _measured(rank: int, norm: float, error: float | None = 1e-7, wires: list | None = None) -> dict:
    return {
        "times": [3.0, 1.0, 2.0, 10.0] if rank == 0 else [20.0, 30.0, 40.0, 50.0],
        "cpu_times": [1.0, 2.0, 9.0] if rank == 0 else [3.0, 4.0, 0.5],
        "wires": wires or [_wire(3), _wire(3)],
        "peak_bytes": 100 if rank == 0 else 300,
        "first_window_grad_norm": norm,
        "param_error_vs_float64": error if rank == 0 else None,
        "param_error_vs_ddp": 1e-7 if rank == 0 else None,
        "gafused_buckets": 2,
        "gafused_params": 3,
        "gafused_buffer_bytes": 400,
        "gafused_backend": "reference",
    }


def test_a_row_takes_rank_0s_times_the_larger_ranks_cpu_time_and_peak_and_checks_the_norm() -> None:
    recipe = {recipe.name: recipe for recipe in distributed.RECIPES}
    row = distributed._row(recipe["gafused-ddp"], [_measured(0, 2.0), _measured(1, 2.0)], 100, 2.0)
    assert (row["window_s"], row["window_s_median"], row["window_s_min"], row["window_s_max"]) == (
        [3.0, 1.0, 2.0, 10.0], 2.5, 1.0, 10.0)  # fmt: skip
    assert row["window_cpu_s_median"] == 3.0  # rank 1's median, the larger
    assert row["peak_bytes"] == 300 and row["peak_bytes_per_param"] == 3.0 and row["peak_bytes_per_rank"] == [100, 300]
    assert row["check"] == "ok" and row["error_bound"] == distributed.FP32_BOUND
    assert row["grad_norm_equal_across_ranks"] and row["counts_equal_every_window_and_rank"]
    assert row["collectives"] == 3 and row["bytes"] == 24
    # Parameters right, the norm 1e-3 high: only the norm shows it.
    row = distributed._row(recipe["gafused-ddp"], [_measured(0, 2.002), _measured(1, 2.002)], 100, 2.0)
    assert row["grad_norm_error_vs_float64"] == pytest.approx(1e-3) and row["check"] == "off: grad norm"
    # A step scaled by a clip coefficient off a wrong norm: the parameter error is the norm's.
    row = distributed._row(recipe["gafused-ddp"], [_measured(0, 2.002, 1e-3), _measured(1, 2.002)], 100, 2.0)
    assert row["check"] == "off: grad norm"
    row = distributed._row(recipe["gafused-ddp"], [_measured(0, 2.0, 1e-3), _measured(1, 2.0)], 100, 2.0)
    assert row["check"] == "off"
    # bf16 rows are held to their own bound; a norm or a count that differs on rank 1 is reported.
    row = distributed._row(recipe["gafused-ddp-bf16"], [_measured(0, 2.0, 1e-3), _measured(1, 2.0)], 100, 2.0)
    assert row["check"] == "ok" and row["error_bound"] == distributed.BF16_BOUND
    other = [_measured(0, 2.0), _measured(1, 2.0 + 1e-6, wires=[_wire(3), _wire(4)])]
    row = distributed._row(recipe["gafused-ddp"], other, 100, 2.0)
    assert not row["grad_norm_equal_across_ranks"] and not row["counts_equal_every_window_and_rank"]
    # Without the memory window: no peak.
    no_peak = [{**_measured(rank, 2.0), "peak_bytes": None} for rank in (0, 1)]
    row = distributed._row(recipe["ddp"], no_peak, 100, 2.0)
    assert row["peak_bytes"] is None and row["peak_bytes_per_param"] is None


def _fake_results(rows: list[dict]) -> dict:
    meta = {"seconds": 1.0, "cpu": "cpu", "date_utc": "now", "torch": "t"}
    return {"meta": meta, "rows": rows}


def test_main_refuses_unknown_recipes_and_fails_on_an_inexact_or_uneven_row(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(distributed, "DEFAULT_OUT", tmp_path / "results" / "distributed-cpu.json")
    monkeypatch.setattr(distributed, "format_table", lambda results: "")
    asked = []
    row = distributed._row(
        distributed.RECIPES[2], [_measured(0, 2.0), _measured(1, 2.0)], 100, 2.0
    )  # gafused-ddp, exact
    answer = [row]
    monkeypatch.setattr(distributed, "run", lambda quick, names, memory: asked.append(names) or _fake_results(answer))
    with pytest.raises(SystemExit) as refused:
        distributed.main(["--recipes", "gafused-ddp,gafused-dpp", "--out", str(tmp_path / "x.json")])
    assert refused.value.code == 2 and asked == []
    # An empty list ran the default recipes; a .csv --out was overwritten by the CSV written beside it.
    bad = [["--recipes", ""], ["--recipes", "gafused-ddp,"], ["--out", str(tmp_path / "x.csv")]]
    for argv in [*bad, ["--out", str(tmp_path / "x.CSV")]]:
        with pytest.raises(SystemExit) as refused:
            distributed.main(argv)
        assert refused.value.code == 2 and asked == [] and not list(tmp_path.glob("x.*"))
    out = tmp_path / "d.json"
    assert distributed.main(["--recipes", "gafused-ddp", "--out", str(out)]) == 0 and asked[-1] == ["gafused-ddp"]
    # The CSV holds the JSON's rows, one column per kind of collective.
    (written,) = csv.DictReader(out.with_suffix(".csv").open())
    assert written["recipe"] == "gafused-ddp" and written["cpu"] == "cpu"
    assert int(written["collectives_all-reduce"]) == 3 and int(written["bytes_all-reduce"]) == 24
    assert int(written["bytes"]) == 24 and written["check"] == "ok"
    answer[:] = [{**row, "check": "off"}]
    assert distributed.main(["--out", str(out)]) == 1
    answer[:] = [{**row, "counts_equal_every_window_and_rank": False}]
    assert distributed.main(["--out", str(out)]) == 1
    answer[:] = [{**row, "gafused": False, "check": "off"}]  # a plain recipe off float64 is a finding, not a failure
    assert distributed.main(["--out", str(out)]) == 0
    # Only --plain-fsdp2 alone writes the committed file: not with a subset of recipes.
    assert distributed.main(["--plain-fsdp2", "--recipes", "gafused-ddp"]) == 0
    assert asked[-1] == ["gafused-ddp", "fsdp2", "fsdp2-no_sync"]
    assert not distributed.DEFAULT_OUT.exists()
    assert (tmp_path / "cache" / "gafused" / "bench" / "distributed-cpu.json").exists()


def test_run_always_runs_ddp_first_the_reference_of_the_other_rows(monkeypatch) -> None:
    import torch.multiprocessing as mp

    spawned = []

    def spawn(fn, args, nprocs):  # noqa: ANN001, ANN202 - stands in for the ranks
        port, quick, names, memory, out = args
        spawned.append(names)
        per_rank = [{"float64_norm": 2.0 if rank == 0 else None, **{name: _measured(rank, 2.0) for name in names}}
                    for rank in range(nprocs)]  # fmt: skip
        Path(out).write_text(json.dumps(per_rank))

    monkeypatch.setattr(mp, "spawn", spawn)
    done = distributed.run(True, ["gafused-fsdp2", "gafused-ddp"], memory=False)
    assert spawned == [["ddp", "gafused-ddp", "gafused-fsdp2"]]
    assert [row["recipe"] for row in done["rows"]] == ["ddp", "gafused-ddp", "gafused-fsdp2"]
    assert done["meta"]["recipes"] == ["ddp", "gafused-ddp", "gafused-fsdp2"] and done["meta"]["memory_window"] is False
    default = distributed.run(True)
    assert spawned[-1] == [recipe.name for recipe in distributed.RECIPES if recipe.default]
    assert "fsdp2" not in spawned[-1] and len(default["rows"]) == len(spawned[-1])
