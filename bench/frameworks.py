"""Each framework's own gradient accumulation, the same framework with gafused, and the float64 truth.

    python bench/frameworks.py              # every scenario, 1 process and 2 gloo ranks, under a minute on 2 CPU
                                            # cores: bench/results/frameworks-cpu.json and .csv, and the tables
    python bench/frameworks.py --quick      # smoke run, two small scenarios (default --out: ~/.cache/gafused/bench)
    python bench/frameworks.py --table      # the README tables, from the committed results file

Every framework trains the same tiny GPT-2 (built from a config, nothing downloaded) with SGD at a constant
learning rate on the same micro-batches, each in its own recipe (Accelerate's ``accumulate()`` loop,
``transformers.Trainer(gradient_accumulation_steps=N)``, Lightning's ``accumulate_grad_batches=N``), once as the
framework does it and once with gafused's adapter. The data are micro-batches of 2 sequences; rank r of W
processes gets micro-batches r, r + W, r + 2W, ... (Accelerate's batch sharding, Trainer with sequential sampling,
a per-rank loader in Lightning), so every framework makes the same windows, and the recorded windows are checked
against them. Scenarios:

- ``equal``: every sequence 16 tokens, full windows of N = 4: the case every recipe should get right;
- ``uneven``: sequence lengths drawn from 2 to 31 tokens (the smallest and largest loss-token count of a
  micro-batch are in the results' meta), full windows;
- ``partial``: equal tokens, 10 micro-batches per rank: windows of 4, 4 and a partial 2 (the epoch's end);
- ``uneven-partial``: both;
- ``bf16``: the model in bfloat16 (parameters and gradients), equal tokens, full windows of N = 32.

The truth is the token-weighted big batch: for each window, the loss summed over every token of every rank's
micro-batches of that window, divided by their number. Two errors per run:

- gradient error: for each window, the gradient the inner optimizer steps with (``p.grad`` at its step) against
  the float64 gradient of the window's big batch at the same parameters, ``|g - g64| / |g64|``, the worst
  window. This is the accumulation's own error, whatever happened in earlier windows.
- parameter error: after the epoch, ``|p - p64| / |p64 - p0|`` against float64 training from the same initial
  parameters, one step per window on the big batch. In bf16 this also holds the rounding of every update to the
  parameters' bf16.

``plain PyTorch`` is the floor: the window's micro-batches as one batch, one backward in the model's dtype (what
the framework would do if the big batch fit in memory).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import provenance  # noqa: E402 - bench/ modules are imported as siblings, after the path is set

import gafused  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "frameworks-cpu.json"
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gafused" / "bench"  # (set but empty: unset)
QUICK_OUT = CACHE / "frameworks-quick.json"  # a smoke run never overwrites the committed results
VOCAB = 64
SEQUENCES = 2  # per micro-batch
LR = 0.5  # SGD, constant: a scale error in the gradient shows in the parameters
WORLDS = (1, 2)
FRAMEWORKS = ("accelerate", "transformers", "lightning")
# A gafused row in fp32 whose gradient or parameter error exceeds this fails the run (plain fp32 PyTorch on the
# same big batches: about 2e-7 and 1e-6).
FP32_BOUND = 1e-5


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    equal_tokens: bool
    n: int  # micro-batches per window (gradient_accumulation_steps, accumulate_grad_batches)
    batches: int  # micro-batches per rank in the epoch
    dtype: str  # the model's parameters and gradients

    def windows(self) -> list[range]:
        """Each rank's micro-batch positions in each window: n at a time, the last one partial."""
        return [range(start, min(start + self.n, self.batches)) for start in range(0, self.batches, self.n)]

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


SCENARIOS = [
    Scenario("equal", "equal tokens, full windows", True, 4, 8, "float32"),
    Scenario("uneven", "uneven tokens, full windows", False, 4, 8, "float32"),
    Scenario("partial", "equal tokens, partial last window", True, 4, 10, "float32"),
    Scenario("uneven-partial", "uneven tokens, partial last window", False, 4, 10, "float32"),
    Scenario("bf16", "bf16 model, equal tokens, windows of 32", True, 32, 64, "bfloat16"),
]
QUICK_SCENARIOS = [
    Scenario("uneven-partial", "uneven tokens, partial last window", False, 4, 6, "float32"),
    Scenario("bf16", "bf16 model, equal tokens, windows of 8", True, 8, 8, "bfloat16"),
]

# (framework, recipe) -> the row's label. "own": the framework's accumulation as its docs show it.
RECIPES = {
    ("accelerate", "own"): "Accelerate's own",
    ("accelerate", "gafused"): "Accelerate + gafused",
    ("transformers", "own"): "Trainer's own",
    ("transformers", "own-declared"): 'Trainer\'s own, `loss_type="ForCausalLM"` declared',
    ("transformers", "gafused"): "GafusedTrainer",
    ("lightning", "own"): "Lightning's own",
    ("lightning", "gafused"): "Lightning + `GradAccumulation`",
}
FLOOR = "plain PyTorch, one big batch per window"


# --- model and data ---------------------------------------------------------------------------------------------


def make_model(dtype: torch.dtype) -> torch.nn.Module:
    """Two layers, width 16, no dropout, the same initial parameters in every process (rounded to ``dtype``)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=32,
        n_embd=16,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return GPT2LMHeadModel(config).to(dtype)


def micro_batches(scenario: Scenario, world: int) -> list[dict[str, torch.Tensor]]:
    """Every micro-batch of the epoch, all ranks: item ``j * world + r`` is rank r's j-th. Right padding,
    labelled -100 and masked."""
    generator = torch.Generator().manual_seed(1234)
    items = []
    for _ in range(world * scenario.batches):
        lengths = [16] * SEQUENCES if scenario.equal_tokens else torch.randint(2, 32, (SEQUENCES,), generator=generator)
        width = int(max(lengths))
        input_ids = torch.zeros(SEQUENCES, width, dtype=torch.long)
        mask = torch.zeros(SEQUENCES, width, dtype=torch.long)
        for row, length in enumerate(lengths):
            input_ids[row, :length] = torch.randint(3, VOCAB, (length,), generator=generator)
            mask[row, :length] = 1
        items.append({"input_ids": input_ids, "attention_mask": mask, "labels": input_ids.masked_fill(mask == 0, -100)})
    return items


def rank_items(items: list[dict[str, torch.Tensor]], world: int, rank: int) -> list[dict[str, torch.Tensor]]:
    return items[rank::world]


def window_items(scenario: Scenario, world: int) -> list[list[int]]:
    """The items of each window, every rank's."""
    return [[j * world + r for j in window for r in range(world)] for window in scenario.windows()]


def loss_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The tokens that carry loss after the causal-LM shift: the micro-batch's weight."""
    return (batch["labels"][..., 1:] != -100).sum()


def only_item(items: list[Any]) -> Any:
    """The collate function of a loader of batch size 1 whose items are whole micro-batches."""
    (item,) = items
    return item


# --- what every run records --------------------------------------------------------------------------------------


class Recorder:
    """On the model: the input ids of every training forward, with the number of inner optimizer steps taken so
    far (its window), and the parameters at each window's first forward (those the whole window runs with). On the
    inner optimizer: the gradient ``p.grad`` it stepped with, read in its step post-hook. (A pre-hook would be too
    early where the framework hands the step a closure that runs the window's last micro-batch, as Lightning does.)"""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.seen: list[tuple[int, torch.Tensor]] = []
        self.grads: list[torch.Tensor] = []
        self.params: list[torch.Tensor] = []
        model.register_forward_pre_hook(self._forward, with_kwargs=True)

    def watch(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.register_step_post_hook(self._after_step)

    def _flat(self, grad: bool = False) -> torch.Tensor:
        tensors = [p.grad if grad else p for p in self.model.parameters()]
        return torch.cat([t.detach().double().flatten() for t in tensors])

    def _forward(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if module.training and torch.is_grad_enabled():
            steps = len(self.grads)  # inner optimizer steps so far: the window this forward belongs to
            if len(self.params) == steps:
                self.params.append(self._flat())
            self.seen.append((steps, kwargs["input_ids"].detach().clone()))

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.grads.append(self._flat(grad=True))

    def result(self) -> dict[str, Any]:
        return {"seen": self.seen, "grads": self.grads, "params": self.params, "final": self._flat()}


# --- the framework runs (one rank) ---------------------------------------------------------------------------------


def run_accelerate(scenario: Scenario, recipe: str, world: int, rank: int, folder: str) -> dict[str, Any]:
    from accelerate import Accelerator

    import gafused.integrations.accelerate as gafused_accelerate

    accelerator = Accelerator(gradient_accumulation_steps=scenario.n, cpu=True)
    model = make_model(scenario.torch_dtype)
    recorder = Recorder(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    recorder.watch(optimizer)
    loader = torch.utils.data.DataLoader(micro_batches(scenario, world), batch_size=1, collate_fn=only_item)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if recipe == "gafused":
        optimizer = gafused_accelerate.prepare(accelerator, model, optimizer)
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            if recipe == "gafused":
                accelerator.backward(loss, weight=loss_tokens(batch))
            else:
                accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    return recorder.result()


def run_transformers(scenario: Scenario, recipe: str, world: int, rank: int, folder: str) -> dict[str, Any]:
    import transformers

    from gafused.integrations.transformers import GafusedTrainer

    model = make_model(scenario.torch_dtype)
    if recipe == "own-declared":
        model.loss_type = "ForCausalLM"
    recorder = Recorder(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    recorder.watch(optimizer)
    args = transformers.TrainingArguments(
        output_dir=os.path.join(folder, f"trainer-{scenario.name}-{recipe}"),
        per_device_train_batch_size=1,  # one item = one micro-batch of SEQUENCES sequences
        gradient_accumulation_steps=scenario.n,
        num_train_epochs=1,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        train_sampling_strategy="sequential",
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
        **({"ddp_backend": "gloo"} if world > 1 else {}),
    )
    cls = GafusedTrainer if recipe == "gafused" else transformers.Trainer
    trainer = cls(
        model=model,
        args=args,
        train_dataset=micro_batches(scenario, world),
        data_collator=only_item,
        optimizers=(optimizer, None),
    )
    trainer.train()
    return recorder.result()


def run_lightning(scenario: Scenario, recipe: str, world: int, rank: int, folder: str) -> dict[str, Any]:
    import lightning.pytorch as pl

    from gafused.integrations.lightning import GradAccumulation

    class LitLM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = make_model(scenario.torch_dtype)
            self.recorder = Recorder(self.model)

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return self.model(**batch).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            optimizer = torch.optim.SGD(self.parameters(), lr=LR)
            self.recorder.watch(optimizer)
            return optimizer

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            items = rank_items(micro_batches(scenario, world), world, rank)
            return torch.utils.data.DataLoader(items, batch_size=1, collate_fn=only_item)

    module = LitLM()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=pl.strategies.DDPStrategy(process_group_backend="gloo") if world > 1 else "auto",
        precision="bf16-true" if scenario.dtype == "bfloat16" else "32-true",
        accumulate_grad_batches=scenario.n,
        callbacks=[GradAccumulation(weight=loss_tokens)] if recipe == "gafused" else [],
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    trainer.fit(module)
    return module.recorder.result()


RUNNERS: dict[str, Callable[..., dict[str, Any]]] = {
    "accelerate": run_accelerate,
    "transformers": run_transformers,
    "lightning": run_lightning,
}


def _rank(rank: int, framework: str, world: int, port: int, scenarios: list[Scenario], folder: str) -> None:
    """One process of a run: every scenario and recipe of one framework; saves what it recorded. Its output (the
    frameworks' logs and warnings) goes to a log file beside the results, printed by ``run`` if the process fails."""
    log = os.open(os.path.join(folder, f"{framework}-{world}-{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    if world > 1:
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),  # Lightning: the processes are launched already
            LOCAL_WORLD_SIZE=str(world),
            NODE_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    if framework == "accelerate":
        from accelerate.state import PartialState

        PartialState(cpu=True)
    elif framework == "transformers":
        import transformers

        transformers.logging.set_verbosity_error()
    elif world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    results: dict[str, Any] = {}
    for scenario in scenarios:
        for fw, recipe in RECIPES:
            if fw != framework:
                continue
            try:
                results[f"{scenario.name}/{recipe}"] = RUNNERS[framework](scenario, recipe, world, rank, folder)
            except Exception as failure:
                if world > 1:  # the other ranks may wait in a collective: end the whole run (its log says why)
                    raise
                results[f"{scenario.name}/{recipe}"] = {"error": f"{type(failure).__name__}: {failure}"}
    torch.save(results, os.path.join(folder, f"{framework}-{world}-{rank}.pt"))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# --- against the truth ----------------------------------------------------------------------------------------------


def _token_loss_sum(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, VOCAB), batch["labels"][:, 1:].reshape(-1), reduction="sum"
    )


def _pad_cat(batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    width = max(batch["input_ids"].shape[1] for batch in batches)
    fill = {"input_ids": 0, "attention_mask": 0, "labels": -100}
    return {
        key: torch.cat(
            [torch.nn.functional.pad(batch[key], (0, width - batch[key].shape[1]), value=value) for batch in batches]
        )
        for key, value in fill.items()
    }


class Truth:
    """Float64 gradients and training on the token-weighted big batch of each window of one scenario and world."""

    def __init__(self, scenario: Scenario, world: int) -> None:
        self.scenario = scenario
        self.items = micro_batches(scenario, world)
        self.windows = [[self.items[i] for i in window] for window in window_items(scenario, world)]
        self.model = make_model(scenario.torch_dtype).double()
        self.initial = torch.nn.utils.parameters_to_vector(self.model.parameters()).detach().clone()
        self.final = self._train()

    def gradient(self, params: torch.Tensor, window: int) -> torch.Tensor:
        """The float64 gradient of window ``window``'s big batch at ``params`` (a flat vector)."""
        torch.nn.utils.vector_to_parameters(params.double(), self.model.parameters())
        self.model.zero_grad(set_to_none=True)
        batches = self.windows[window]
        tokens = sum(int(loss_tokens(batch)) for batch in batches)
        (sum(_token_loss_sum(self.model, batch) for batch in batches) / tokens).backward()
        return torch.cat([p.grad.flatten() for p in self.model.parameters()])

    def _train(self) -> torch.Tensor:
        """Float64 SGD from the initial parameters, one step per window; the final parameters."""
        params = self.initial.clone()
        for window in range(len(self.windows)):
            params = params - LR * self.gradient(params, window)
        return params

    def floor(self) -> dict[str, Any]:
        """Plain PyTorch in the model's dtype: each window as one batch, one backward, one SGD step."""
        model = make_model(self.scenario.torch_dtype)
        recorder = Recorder(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        recorder.watch(optimizer)
        for batches in self.windows:
            optimizer.zero_grad()
            model(**_pad_cat(batches)).loss.backward()
            optimizer.step()
        return recorder.result()

    def errors(self, run: dict[str, Any]) -> dict[str, float]:
        grad_errors = []
        for window, (grad, params) in enumerate(zip(run["grads"], run["params"], strict=True)):
            exact = self.gradient(params, window)
            grad_errors.append(float((grad - exact).norm() / exact.norm()))
        param_error = float((run["final"] - self.final).norm() / (self.final - self.initial).norm())
        return {"grad_error": max(grad_errors), "grad_errors": grad_errors, "param_error": param_error}


def check_windows(run: dict[str, Any], scenario: Scenario, world: int, rank: int) -> str | None:
    """None if the run's rank saw its micro-batches of each window in order and stepped once per window."""
    items = rank_items(micro_batches(scenario, world), world, rank)
    expected = [(index, items[j]["input_ids"]) for index, window in enumerate(scenario.windows()) for j in window]
    seen = run["seen"]
    if len(seen) != len(expected) or any(
        got[0] != want[0] or not torch.equal(got[1], want[1]) for got, want in zip(seen, expected, strict=True)
    ):
        return f"rank {rank} saw {len(seen)} micro-batches not in the expected windows"
    if len(run["grads"]) != len(scenario.windows()) or len(run["params"]) != len(scenario.windows()):
        return f"rank {rank}: {len(run['grads'])} optimizer steps for {len(scenario.windows())} windows"
    return None


# --- driver ---------------------------------------------------------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(quick: bool) -> dict[str, Any]:
    """Every framework on 1 process and on 2 gloo ranks, forked from this process after the imports (which they
    share); then the errors against the float64 truth, computed here."""
    import accelerate
    import lightning
    import torch.multiprocessing as mp
    import transformers

    scenarios = QUICK_SCENARIOS if quick else SCENARIOS
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    with tempfile.TemporaryDirectory() as folder:
        for framework in FRAMEWORKS:
            for world in WORLDS:
                try:
                    mp.start_processes(
                        _rank,
                        args=(framework, world, _free_port(), scenarios, folder),
                        nprocs=world,
                        start_method="fork",
                    )
                except Exception:
                    for rank in range(world):
                        log = Path(folder) / f"{framework}-{world}-{rank}.log"
                        print(f"--- {log.name}", log.read_text()[-4000:] if log.exists() else "", file=sys.stderr)
                    raise
        saved = {
            (framework, world): [
                torch.load(os.path.join(folder, f"{framework}-{world}-{rank}.pt"), weights_only=False)
                for rank in range(world)
            ]
            for framework in FRAMEWORKS
            for world in WORLDS
        }
    torch.set_num_threads(1)
    for scenario in scenarios:
        for world in WORLDS:
            truth = Truth(scenario, world)
            floor = truth.floor()
            rows.append(
                {
                    "framework": "pytorch",
                    "recipe": "big-batch",
                    "label": FLOOR,
                    "scenario": scenario.name,
                    "world": world,
                    **_public(truth.errors(floor)),
                    "ranks_equal": None,  # one process
                }
            )
            for (framework, recipe), label in RECIPES.items():
                per_rank = [results[f"{scenario.name}/{recipe}"] for results in saved[framework, world]]
                row = {
                    "framework": framework,
                    "recipe": recipe,
                    "label": label,
                    "scenario": scenario.name,
                    "world": world,
                }
                problem = next((r["error"] for r in per_rank if "error" in r), None)
                problem = problem or next(
                    (p for rank, r in enumerate(per_rank) if (p := check_windows(r, scenario, world, rank))), None
                )
                if problem:
                    failures.append(f"{label} / {scenario.name} / {world}: {problem}")
                    rows.append({**row, "error": problem})
                    continue
                row.update(_public(truth.errors(per_rank[0])))
                row["ranks_equal"] = all(torch.equal(r["final"], per_rank[0]["final"]) for r in per_rank)
                rows.append(row)
                if not row["ranks_equal"]:
                    failures.append(f"{label} / {scenario.name} / {world}: replicas differ")
                if recipe == "gafused" and scenario.dtype == "float32":
                    if max(row["grad_error"], row["param_error"]) > FP32_BOUND:
                        failures.append(f"{label} / {scenario.name} / {world}: off the truth by more than {FP32_BOUND}")
    meta = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
        "lightning": lightning.__version__,
        "gafused": gafused.__version__,
        "python": platform.python_version(),
        **provenance.facts("cpu"),
        "backend": "gloo",
        "threads_per_process": 1,
        "quick": quick,
        "scenarios": [asdict(scenario) for scenario in scenarios],
        # The loss tokens of the smallest and the largest micro-batch of each scenario, by world size.
        "loss_tokens_per_micro_batch": {
            scenario.name: {
                world: [f(int(loss_tokens(item)) for item in micro_batches(scenario, world)) for f in (min, max)]
                for world in WORLDS
            }
            for scenario in scenarios
        },
        "model": "GPT-2, 2 layers, width 16, vocabulary 64, no dropout",
        "sequences_per_micro_batch": SEQUENCES,
        "optimizer": f"SGD(lr={LR}), constant",
        "fp32_bound": FP32_BOUND,
        "seconds": time.perf_counter() - started,
        "failures": failures,
    }
    return {"meta": meta, "rows": rows}


def _public(errors: dict[str, Any]) -> dict[str, Any]:
    return {key: errors[key] for key in ("grad_error", "param_error", "grad_errors")}


# --- tables ---------------------------------------------------------------------------------------------------------


def _cell(rows: list[dict[str, Any]], key: str) -> str:
    by_world = {row["world"]: row for row in rows}
    values = []
    for world in WORLDS:
        row = by_world.get(world)
        values.append("-" if row is None else "error" if "error" in row else f"{row[key]:.1e}")
    return " / ".join(values)


def format_tables(results: dict[str, Any]) -> str:
    """Two markdown tables, the worst window's gradient error and the parameter error after the epoch; each cell is
    1 process / 2 ranks."""
    scenarios = results["meta"]["scenarios"]
    labels = [FLOOR, *RECIPES.values()]
    out = []
    for key, title in (
        ("grad_error", "gradient error, worst window"),
        ("param_error", "parameter error after the epoch"),
    ):
        header = " | ".join(scenario["description"] for scenario in scenarios)
        lines = [f"| {title} (1 process / 2 ranks) | {header} |", "| --- |" + " --- |" * len(scenarios)]
        for label in labels:
            cells = [
                _cell([row for row in results["rows"] if row["label"] == label and row["scenario"] == s["name"]], key)
                for s in scenarios
            ]
            lines.append(f"| {label} | {' | '.join(cells)} |")
        out.append("\n".join(lines))
    return "\n\n".join(out)


def _write_csv(results: dict[str, Any], path: Path) -> None:
    fields = ["framework", "recipe", "label", "scenario", "world", "grad_error", "param_error", "ranks_equal", "error"]
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(results["rows"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="two small scenarios (smoke run)")
    parser.add_argument("--out", type=Path, help=f"JSON file (default {DEFAULT_OUT}; with --quick, {QUICK_OUT})")
    parser.add_argument(
        "--table", action="store_true", help=f"print the tables of --out (default {DEFAULT_OUT}, also with --quick) "
        "and run nothing"
    )  # fmt: skip
    args = parser.parse_args(argv)
    out = args.out or (QUICK_OUT if args.quick and not args.table else DEFAULT_OUT)
    if args.table:
        try:
            print(format_tables(json.loads(out.read_text())))
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as error:
            parser.error(f"--table: cannot read the results of {out} ({type(error).__name__}: {error})")
        return 0
    provenance.check_out_option(parser, out, file=True)
    results = run(args.quick)
    args.out = out
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    _write_csv(results, args.out.with_suffix(".csv"))
    print(format_tables(results))
    print(f"wrote {args.out} and {args.out.with_suffix('.csv')} ({results['meta']['seconds']:.0f} s)")
    for failure in results["meta"]["failures"]:
        print(f"failed: {failure}", file=sys.stderr)
    return 1 if results["meta"]["failures"] else 0


if __name__ == "__main__":
    # The ranks are gloo CPU processes forked after the frameworks' imports; a parent whose CUDA driver one of them
    # initialized (asking whether a GPU is there) would fork children that hang in their first CUDA call. Nothing
    # here runs on a GPU: none is made visible.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    raise SystemExit(main())
