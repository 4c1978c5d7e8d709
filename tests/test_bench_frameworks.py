"""bench/frameworks.py: a smoke run (``--quick``: 2 scenarios, Accelerate, Trainer and Lightning on 1 process and on
2 gloo ranks, about 20 s) read back and checked against what the README says of the committed results; and the
README's tables rendered from the committed results file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import frameworks  # noqa: E402 - bench/ is not a package

from gafused.integrations import TRANSFORMERS_MIN_VERSION  # noqa: E402 - imports no framework

for package in ("accelerate", "transformers", "lightning"):
    pytest.importorskip(
        package,
        minversion=TRANSFORMERS_MIN_VERSION if package == "transformers" else None,
        reason="needs the framework extras: pip install 'gafused[transformers,lightning]'",
    )

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
    assert {"git_commit", "git_tracked_files_modified", "cpu_cores", "cuda_version", "triton"} <= set(quick["meta"])
    assert quick["meta"]["cpu_cores"] >= 1 and quick["meta"]["cuda_driver_version"] is None
    expected = {("pytorch", "big-batch"), *frameworks.RECIPES}
    for scenario in frameworks.QUICK_SCENARIOS:
        rows = _rows(quick, scenario.name)
        assert set(rows) == {(*recipe, world) for recipe in expected for world in frameworks.WORLDS}
        for key, row in rows.items():
            assert "error" not in row, (key, row.get("error"))
            assert row["ranks_equal"] is (None if key[0] == "pytorch" else True), key
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


def _figure(rows: dict[tuple[str, str, int], dict], recipe: tuple[str, str], world: int) -> str:
    """A row's gradient error as the README quotes it."""
    return f"{rows[(*recipe, world)]['grad_error']:.1e}"


def test_the_readme_tables_and_figures_are_the_committed_results() -> None:
    committed = json.loads(frameworks.DEFAULT_OUT.read_text())
    assert not committed["meta"]["quick"] and committed["meta"]["failures"] == []
    readme = (ROOT / "README.md").read_text()
    start = readme.index("### Each framework's own accumulation, with gafused, against the truth")
    section = " ".join(readme[start : readme.index("Each framework's section below", start)].split())
    for table in frameworks.format_tables(committed).split("\n\n"):
        assert " ".join(table.split()) in section
    uneven, partial = _rows(committed, "uneven"), _rows(committed, "partial")
    equal, bf16 = _rows(committed, "equal"), _rows(committed, "bf16")
    low, high = committed["meta"]["loss_tokens_per_micro_batch"]["uneven"]["1"]
    quoted = [
        f"micro-batches of {low} to {high} loss tokens",
        f"a micro-batch of {low} loss tokens weighs as much as one of {high}",
        f"({_figure(uneven, ('accelerate', 'own'), 1)} on 1 process, {_figure(uneven, ('accelerate', 'own'), 2)} on 2",
        f"half its size: {_figure(partial, ('accelerate', 'own'), 1)})",
        f"({_figure(equal, ('transformers', 'own'), 1)} with 16-token sequences)",
        f"`p.grad` ({_figure(bf16, ('accelerate', 'own'), 1)} / {_figure(bf16, ('accelerate', 'own'), 2)})",
        f"bf16 big batch ({_figure(bf16, ('pytorch', 'big-batch'), 1)} / {_figure(bf16, ('pytorch', 'big-batch'), 2)})",
    ]
    for text in quoted:
        assert text in section
    # The rows each quoted figure stands for agree with it.
    for scenario in (uneven, partial, bf16):
        for world in frameworks.WORLDS:
            assert _figure(scenario, ("lightning", "own"), world) == _figure(scenario, ("accelerate", "own"), world)
    assert _figure(partial, ("accelerate", "own"), 2) == _figure(partial, ("accelerate", "own"), 1)
    for world in frameworks.WORLDS:
        assert _figure(bf16, ("transformers", "own-declared"), world) == _figure(bf16, ("accelerate", "own"), world)
        gafused = {_figure(bf16, recipe, world) for recipe in GAFUSED}
        assert all(value in section for value in gafused)


@pytest.fixture(scope="module")
def exact_run() -> tuple[frameworks.Truth, dict]:
    """Plain PyTorch accumulation done right on the quick uneven, partial scenario (1 process): each micro-batch's
    summed token loss over the window's tokens, backward into p.grad, one SGD step per window; recorded as the
    frameworks' runs are."""
    scenario = frameworks.QUICK_SCENARIOS[0]
    truth = frameworks.Truth(scenario, 1)
    model = frameworks.make_model(scenario.torch_dtype)
    recorder = frameworks.Recorder(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=frameworks.LR)
    recorder.watch(optimizer)
    for batches in truth.windows:
        tokens = sum(int(frameworks.loss_tokens(batch)) for batch in batches)
        for batch in batches:
            logits = model(**batch).logits
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), reduction="sum"
            )
            (loss / tokens).backward()
        optimizer.step()
        optimizer.zero_grad()
    return truth, recorder.result()


def test_the_windows_check_refuses_a_run_fed_other_windows(exact_run: tuple[frameworks.Truth, dict]) -> None:
    truth, run = exact_run
    assert frameworks.check_windows(run, truth.scenario, 1, 0) is None
    shifted = {**run, "seen": [(step + (index == 0), ids) for index, (step, ids) in enumerate(run["seen"])]}
    assert frameworks.check_windows(shifted, truth.scenario, 1, 0) is not None
    swapped = {**run, "seen": [run["seen"][1], run["seen"][0], *run["seen"][2:]]}
    assert frameworks.check_windows(swapped, truth.scenario, 1, 0) is not None
    one_step_short = {**run, "grads": run["grads"][:-1]}
    assert frameworks.check_windows(one_step_short, truth.scenario, 1, 0) is not None


def test_the_errors_see_a_halved_gradient(exact_run: tuple[frameworks.Truth, dict]) -> None:
    truth, run = exact_run
    exact = truth.errors(run)
    assert exact["grad_error"] < 1e-6 and exact["param_error"] < 5e-6
    halved = truth.errors({**run, "grads": [grad / 2 for grad in run["grads"]]})
    assert halved["grad_error"] == pytest.approx(0.5, abs=1e-5)
    assert truth.errors({**run, "final": truth.initial})["param_error"] == pytest.approx(1.0)
