"""bench/frameworks.py: a smoke run (``--quick``: 2 scenarios, Accelerate, Trainer and Lightning on 1 process and on
2 gloo ranks, about 20 s) read back and checked against what the README says of the committed results; and the
README's tables rendered from the committed results file."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import frameworks  # noqa: E402 - bench/ is not a package

for package in ("accelerate", "transformers", "lightning"):
    pytest.importorskip(package, reason="needs the framework extras: pip install 'gafused[transformers,lightning]'")

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(
        not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
    ),
]

GAFUSED = {("accelerate", "gafused"), ("transformers", "gafused"), ("lightning", "gafused")}
# The recipes that accumulate each micro-batch's mean loss / N in p.grad (Accelerate's, Lightning's).
MEAN_OVER_N = {("accelerate", "own"), ("lightning", "own")}


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bench") / "frameworks.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "frameworks.py"), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert out.with_suffix(".csv").read_text().count("\n") == len(json.loads(out.read_text())["rows"]) + 1
    return json.loads(out.read_text())


def _rows(results: dict, scenario: str) -> dict[tuple[str, str, int], dict]:
    return {
        (row["framework"], row["recipe"], row["world"]): row for row in results["rows"] if row["scenario"] == scenario
    }


def test_every_recipe_ran_on_1_and_2_processes_in_the_expected_windows(quick: dict) -> None:
    assert quick["meta"]["failures"] == [] and quick["meta"]["quick"]
    expected = {("pytorch", "big-batch"), *frameworks.RECIPES}
    for scenario in frameworks.QUICK_SCENARIOS:
        rows = _rows(quick, scenario.name)
        assert set(rows) == {(*recipe, world) for recipe in expected for world in frameworks.WORLDS}
        for key, row in rows.items():
            assert "error" not in row, (key, row.get("error"))
            assert row["ranks_equal"], key
            assert len(row["grad_errors"]) == len(scenario.windows()), key


def test_gafused_is_the_float64_big_batch_within_fp32_rounding_where_the_frameworks_own_is_not(quick: dict) -> None:
    rows = _rows(quick, "uneven-partial")
    for world in frameworks.WORLDS:
        floor = rows["pytorch", "big-batch", world]
        assert floor["grad_error"] < 1e-6 and floor["param_error"] < 5e-6
        for recipe in GAFUSED:
            row = rows[(*recipe, world)]
            assert row["grad_error"] < 1e-5 and row["param_error"] < 1e-5, row["label"]
        # Uneven tokens and a window of 2 divided by 4: far off. Trainer's own is off by its label count.
        for recipe in MEAN_OVER_N:
            assert rows[(*recipe, world)]["grad_error"] > 0.3
        assert rows["transformers", "own", world]["grad_error"] > 1e-2
        assert rows["transformers", "own-declared", world]["grad_error"] < 1e-5


def test_bf16_accumulation_in_fp32_matches_a_bf16_big_batch_and_beats_bf16_sums(quick: dict) -> None:
    rows = _rows(quick, "bf16")
    for world in frameworks.WORLDS:
        floor = rows["pytorch", "big-batch", world]["grad_error"]
        assert 1e-3 < floor < 2e-2  # bf16 forward and backward: well above fp32 rounding
        for recipe in GAFUSED:
            assert rows[(*recipe, world)]["grad_error"] < 1.25 * floor, recipe
        for recipe in (*MEAN_OVER_N, ("transformers", "own-declared")):
            summed_in_bf16 = rows[(*recipe, world)]["grad_error"]
            assert summed_in_bf16 > 1.1 * max(rows[(*gafused, world)]["grad_error"] for gafused in GAFUSED), recipe


def test_the_readme_tables_are_the_committed_results() -> None:
    committed = json.loads(frameworks.DEFAULT_OUT.read_text())
    assert not committed["meta"]["quick"] and committed["meta"]["failures"] == []
    readme = (ROOT / "README.md").read_text()
    for table in frameworks.format_tables(committed).split("\n\n"):
        assert table in readme
    # The committed run's bf16 rows say what the README says of them.
    rows = _rows(committed, "bf16")
    for world in frameworks.WORLDS:
        assert rows["accelerate", "own", world]["grad_error"] > 1.3 * rows["accelerate", "gafused", world]["grad_error"]
    assert re.search(r"python bench/frameworks\.py\b", readme)
