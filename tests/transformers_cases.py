"""transformers' Trainer, on its own and with GafusedTrainer, against a float64 token-weighted big batch.

    python tests/transformers_cases.py OUT.pt      # every case on 1 process and on 2 gloo ranks, saved to OUT.pt
    python tests/transformers_cases.py --report    # the same, printed as a table against the float64 truth

The recipe is the one people copy: ``TrainingArguments(per_device_train_batch_size=1,
gradient_accumulation_steps=4)``, a tiny GPT-2 built from a config (nothing downloaded), sequences of very uneven
lengths (so a window's micro-batches carry very different token counts), an epoch that ends in a partial window,
SGD (a scale error shows in the parameters), Trainer's linear LR schedule and clipping by ``max_grad_norm``.
Every micro-batch the model sees is recorded with the optimizer step it belongs to; ``truth()`` replays those
windows in float64 on one process: one step per window on the token-mean loss of all its micro-batches (every
rank's), clipped by the global norm, at the window's learning rate of the linear schedule.
"""

from __future__ import annotations

import os
import sys
import tempfile
import warnings
from typing import Any

import torch

from casekit import case_script_target, free_port, leave_spawned_rank, tiny_gpt2_config

WORLD = 2
GA = 4
LR = 0.5
MAX_GRAD_NORM = 0.7  # clips some windows and not others (the tests check both happen)
VOCAB = 50
PAD = 0
SEQUENCES = 22  # 1 process: windows of 4, 4, 4, 4, 4, 2; 2 ranks: 11 each, windows of 4, 4, 3 per rank
SAVE_AT = 2  # the resumed case starts from the checkpoint written after this many windows


def make_model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Two layers, width 16, random init, no dropout; GPT2LMHeadModel leaves ``loss_type`` unset."""
    import transformers

    config = tiny_gpt2_config(VOCAB, pad_token_id=PAD, bos_token_id=1, eos_token_id=2, attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).to(dtype)


def lengths() -> list[int]:
    """Sequence lengths from 2 to 31: a window's token counts differ by more than 10x."""
    return [2 + (7 * i * i + 13 * i) % 30 for i in range(SEQUENCES)]


class Sequences(torch.utils.data.Dataset):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(1)
        self.items = [torch.randint(1, VOCAB, (n,), generator=generator) for n in lengths()]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.items[index]}


def collate(examples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad to the longest; labels are the inputs, -100 at padding (as DataCollatorForLanguageModeling)."""
    width = max(len(example["input_ids"]) for example in examples)
    input_ids = torch.full((len(examples), width), PAD)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, example in enumerate(examples):
        n = len(example["input_ids"])
        input_ids[row, :n] = example["input_ids"]
        mask[row, :n] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": input_ids.masked_fill(mask == 0, -100)}


def pad_cat(batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    width = max(batch["input_ids"].shape[1] for batch in batches)
    fill = {"input_ids": PAD, "attention_mask": 0, "labels": -100}
    return {
        key: torch.cat(
            [torch.nn.functional.pad(batch[key], (0, width - batch[key].shape[1]), value=value) for batch in batches]
        )
        for key, value in fill.items()
    }


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """The causal-LM loss (shift by one; mean or sum over the tokens that carry loss) in the logits' dtype."""
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100, reduction=reduction
    )


def token_mean_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The causal-LM loss (shift by one, mean over the tokens that carry loss) in the logits' dtype."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return causal_lm_loss(logits, batch["labels"])


def window_loss(
    model: torch.nn.Module, window: list[dict[str, torch.Tensor]], loss: str = "num_items", world: int = 1
) -> torch.Tensor:
    """The loss whose gradient a window's step takes. By default (and for "unscaled_counted") the token mean of the
    window's micro-batches at once: the big batch. For the losses a ``compute_loss`` of the user's declares scaled
    for GA (``user_loss``), what plain Trainer + DDP computes: the sum of every rank's micro-batch losses, divided by
    the world size (DDP averages the ranks; nothing multiplies these losses by it): "scaled", each micro-batch's
    token mean / ``GA``; "scaled_current", its token mean / its rank's micro-batch count in the window (the partial
    window's own), i.e. the mean of the window's token means; "scaled_counted", its token sum / the window's
    tokens, i.e. the big batch's token mean."""
    if loss == "scaled":
        return sum(token_mean_loss(model, batch) for batch in window) / (GA * world)
    if loss == "scaled_current":
        return sum(token_mean_loss(model, batch) for batch in window) / len(window)  # every rank's micro-batches
    big_batch = token_mean_loss(model, pad_cat(window))
    return big_batch / world if loss == "scaled_counted" else big_batch


def truth(
    windows: list[list[dict[str, torch.Tensor]]],
    dtype: torch.dtype = torch.float64,
    loss: str = "num_items",
    world: int = 1,
) -> dict[str, Any]:
    """One SGD step per window on all its micro-batches at once (``window_loss``: the token mean unless the case's
    ``loss`` says otherwise), clipped by the global norm, at the linear schedule's learning rate.
    ``dtype=torch.float32`` is plain fp32 PyTorch on the same big batches."""
    model = make_model().to(dtype)
    initial = [p.detach().clone() for p in model.parameters()]
    norms = []
    for step, window in enumerate(windows):
        model.zero_grad()
        window_loss(model, window, loss, world).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)))
        lr = LR * (len(windows) - step) / len(windows)
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
    return {"params": [p.detach().clone() for p in model.parameters()], "norms": norms, "initial": initial}


# --- the runs ---------------------------------------------------------------------------------------------------


def _arguments(output_dir: str, **overrides: Any):
    import transformers

    settings = dict(
        output_dir=output_dir,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=GA,
        num_train_epochs=1,
        learning_rate=LR,
        optim="sgd",
        max_grad_norm=MAX_GRAD_NORM,
        lr_scheduler_type="linear",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
    )
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        settings["ddp_backend"] = "gloo"
    settings.update(overrides)
    return transformers.TrainingArguments(**settings)


def user_loss(base: type, loss: str) -> type:
    """``base`` (Trainer or GafusedTrainer) with a ``compute_loss`` of the user's that declares
    ``loss_is_scaled_for_ga``; Trainer's own ``compute_loss`` (its multiplication by the world size) does not run.

    "scaled": ``True``, each micro-batch's token mean / ``gradient_accumulation_steps``, on a model that takes no
    loss kwargs (no ``num_items_in_batch``). "scaled_current": the token mean / Trainer's
    ``current_gradient_accumulation_steps`` (the window's micro-batch count, fewer in the partial window).
    "scaled_counted": ``True``, the token sum / ``num_items_in_batch`` (the window's tokens over every rank).
    "unscaled_counted": ``False``, the token mean, with a ``num_items_in_batch`` it leaves unused (Trainer divides
    the loss by the window's micro-batch count)."""

    class UserLoss(base):
        loss_is_scaled_for_ga = loss != "unscaled_counted"

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if (num_items_in_batch is None) != (loss in ("scaled", "scaled_current")):
                raise RuntimeError(f"{loss}: compute_loss got num_items_in_batch={num_items_in_batch}")
            outputs = model(**inputs)
            if loss == "scaled_counted":
                value = causal_lm_loss(outputs.logits, inputs["labels"], "sum") / num_items_in_batch
            else:
                value = causal_lm_loss(outputs.logits, inputs["labels"])
                if loss == "scaled":
                    value = value / self.args.gradient_accumulation_steps
                elif loss == "scaled_current":
                    value = value / self.current_gradient_accumulation_steps
            return (value, outputs) if return_outputs else value

    return UserLoss


def run_case(
    folder: str, trainer: str, loss: str = "num_items", resume: bool = False, **argument_overrides: Any
) -> dict[str, Any]:
    """Train one epoch through one recipe; return the final params, the recorded windows and the logged norms.

    ``trainer``: "own" (``transformers.Trainer``) or "gafused" (``GafusedTrainer``). ``loss``: "num_items", the
    model takes ``num_items_in_batch`` (Trainer normalizes each loss over the window); "declared", the same with
    ``model.loss_type = "ForCausalLM"`` declared (Trainer then counts the items after the shift); "mean", the model
    declares ``accepts_loss_kwargs = False`` (each loss is a mean over its micro-batch); "scaled", "scaled_current",
    "scaled_counted", "unscaled_counted": a ``compute_loss`` of the user's (``user_loss``). ``resume``: train with a
    checkpoint every ``SAVE_AT`` windows, then train again from the first checkpoint in a new Trainer.
    ``folder``: Trainer's output_dir, the same on every rank (rank 0 writes the checkpoints every rank loads).
    """
    import transformers

    from gafused.integrations.transformers import GafusedTrainer

    cls = GafusedTrainer if trainer == "gafused" else transformers.Trainer
    if loss in ("scaled", "scaled_current", "scaled_counted", "unscaled_counted"):
        cls = user_loss(cls, loss)
    records: list[tuple[int, dict[str, torch.Tensor]]] = []

    def build(output_dir: str, **overrides: Any):
        model = make_model()
        if loss in ("mean", "scaled", "scaled_current"):
            model.accepts_loss_kwargs = False
        elif loss in ("declared", "scaled_counted", "unscaled_counted"):
            model.loss_type = "ForCausalLM"  # Trainer and GafusedTrainer count num_items_in_batch after the shift
        built = cls(
            model=model,
            args=_arguments(output_dir, **{**argument_overrides, **overrides}),
            train_dataset=Sequences(),
            data_collator=collate,
        )

        def record(module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
            if module.training:
                batch = {key: kwargs[key].detach().clone() for key in ("input_ids", "attention_mask", "labels")}
                records.append((built.state.global_step, batch))

        model.register_forward_pre_hook(record, with_kwargs=True)
        return built

    if resume:
        first = build(folder, save_strategy="steps", save_steps=SAVE_AT)
        first.train()
        straight = [p.detach().clone() for p in first.model.parameters()]
        records.clear()  # the resumed run records what it trains on after the checkpoint
        built = build(folder, save_strategy="steps", save_steps=SAVE_AT)
        built.train(resume_from_checkpoint=os.path.join(folder, f"checkpoint-{SAVE_AT}"))
    else:
        built = build(folder)
        built.train()
        straight = None
    logged = [entry["grad_norm"] for entry in built.state.log_history if "grad_norm" in entry]
    lrs = [entry["learning_rate"] for entry in built.state.log_history if "learning_rate" in entry]
    return {
        "loss": loss,
        "params": [p.detach().clone() for p in built.model.parameters()],
        "straight": straight,
        "records": records,
        "norms": logged,
        "lrs": lrs,
        "global_step": built.state.global_step,
        "scheduler_steps": built.lr_scheduler.last_epoch,
    }


GAFUSED = "GafusedTrainer, num_items_in_batch"
COMPILED = "GafusedTrainer, num_items_in_batch, torch_compile"
CASES: dict[str, dict[str, Any]] = {
    "Trainer, num_items_in_batch": {"trainer": "own"},
    'Trainer, num_items_in_batch, loss_type="ForCausalLM" declared': {"trainer": "own", "loss": "declared"},
    "Trainer, per-micro-batch mean loss": {"trainer": "own", "loss": "mean"},
    GAFUSED: {"trainer": "gafused"},
    "GafusedTrainer, per-micro-batch mean loss": {"trainer": "gafused", "loss": "mean"},
    # Accelerate compiles last: on 2 ranks the model is torch.compile's wrapper around the DDP module.
    COMPILED: {"trainer": "gafused", "torch_compile": True, "torch_compile_backend": "eager"},
    # AdamW, whose state the checkpoint must carry for the resumed run to be bitwise equal.
    f"GafusedTrainer, resumed from checkpoint-{SAVE_AT} (AdamW)": {
        "trainer": "gafused",
        "resume": True,
        "optim": "adamw_torch",
        "learning_rate": 1e-2,
    },
}
# A compute_loss of the user's that declares loss_is_scaled_for_ga (``user_loss``), on 1 process and 2 ranks; the
# truth is what plain Trainer + DDP computes with that loss (``window_loss``), which Trainer's runs are held to too.
# Not in the README's table (``report``), whose truth is the token-weighted big batch.
SCALED = "GafusedTrainer, compute_loss scaled for GA, no num_items_in_batch"
SCALED_CASES: dict[str, dict[str, Any]] = {
    "Trainer, compute_loss scaled for GA, no num_items_in_batch": {"trainer": "own", "loss": "scaled"},
    SCALED: {"trainer": "gafused", "loss": "scaled"},
    # Divided by Trainer's current_gradient_accumulation_steps, which GafusedTrainer once reported as 1 to every
    # compute_loss (a gradient up to GA times too large).
    "Trainer, compute_loss scaled for GA by current_gradient_accumulation_steps": {
        "trainer": "own",
        "loss": "scaled_current",
    },
    "GafusedTrainer, compute_loss scaled for GA by current_gradient_accumulation_steps": {
        "trainer": "gafused",
        "loss": "scaled_current",
    },
    "Trainer, compute_loss scaled for GA by num_items_in_batch": {"trainer": "own", "loss": "scaled_counted"},
    "GafusedTrainer, compute_loss scaled for GA by num_items_in_batch": {
        "trainer": "gafused",
        "loss": "scaled_counted",
    },
    # Not scaled: a per-micro-batch mean, which GafusedTrainer weighs by its tokens (the token-weighted big batch).
    "GafusedTrainer, compute_loss not scaled for GA, num_items_in_batch given": {
        "trainer": "gafused",
        "loss": "unscaled_counted",
    },
}
ALL_CASES = {**CASES, **SCALED_CASES}


def run_all(folder: str) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    for index, (name, case) in enumerate(ALL_CASES.items()):
        try:
            results[name] = run_case(os.path.join(folder, str(index)), **case)
        except Exception as error:  # reported by the tests, named
            results[name] = {"error": f"{type(error).__name__}: {error}"}
    return results


def _misuse(folder: str) -> dict[str, str]:
    """What GafusedTrainer says to configurations it refuses across ranks, as (case -> message or 'no error').

    "average_tokens_across_devices=False": the model takes num_items_in_batch, which Trainer would count per rank.
    "..., nothing counted": a compute_loss of the user's (``user_loss``, "scaled") on a model that takes no loss
    kwargs: Trainer counts no items, so the argument changes nothing and is accepted."""
    from gafused.integrations.transformers import GafusedTrainer

    said = {}
    for case, cls, accepts in (
        ("average_tokens_across_devices=False", GafusedTrainer, None),
        ("average_tokens_across_devices=False, nothing counted", user_loss(GafusedTrainer, "scaled"), False),
    ):
        model = make_model()
        if accepts is not None:
            model.accepts_loss_kwargs = accepts
        try:
            cls(
                model=model,
                args=_arguments(os.path.join(folder, "misuse"), average_tokens_across_devices=False),
                train_dataset=Sequences(),
                data_collator=collate,
            )
            said[case] = "no error"
        except ValueError as error:
            said[case] = str(error)
    return said


def _rank(rank: int, port: int, folder: str) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    results = run_all(folder)
    results["misuse"] = _misuse(folder)
    import torch.distributed as dist

    gathered: list[Any] = [None] * WORLD
    dist.all_gather_object(gathered, results)
    if rank == 0:
        torch.save(gathered, os.path.join(folder, "ranks.pt"))
    dist.destroy_process_group()
    leave_spawned_rank()


def run(out: str) -> None:
    """Every case on one process, then on WORLD gloo ranks; saves {"single": results, "ranks": [per rank]}."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        single = run_all(os.path.join(folder, "single"))
        mp.spawn(_rank, args=(free_port(), os.path.join(folder, "ranks")), nprocs=WORLD)
        ranks = torch.load(os.path.join(folder, "ranks", "ranks.pt"), weights_only=False)
    torch.save({"single": single, "ranks": ranks}, out)


# --- against the truth ------------------------------------------------------------------------------------------


def windows_of(per_rank_records: list[list[tuple[int, dict[str, torch.Tensor]]]]) -> list[list[dict]]:
    """The micro-batches of every rank grouped by the optimizer step they belong to."""
    steps: dict[int, list[dict[str, torch.Tensor]]] = {}
    for records in per_rank_records:
        for step, batch in records:
            steps.setdefault(step, []).append(batch)
    return [steps[step] for step in sorted(steps)]


def error(params: list[torch.Tensor], reference: dict[str, Any]) -> float:
    """|p - p_truth| / |p_truth - p0| over every parameter of the model (one flat vector).

    Over the whole model, not per tensor: a LayerNorm weight (ones) moves by about 1e-4 in these few steps, so
    storing it in fp32 alone (resolution 6e-8) is 1e-3 of its own update, for any recipe."""
    flat = [
        torch.cat([x.double().reshape(-1) for x in xs]) for xs in (params, reference["params"], reference["initial"])
    ]
    return float((flat[0] - flat[1]).norm() / (flat[1] - flat[2]).norm())


_TRUTHS: dict[tuple, dict[str, Any]] = {}


def _cached_truth(
    windows: list[list[dict[str, torch.Tensor]]], dtype: torch.dtype, loss: str = "num_items", world: int = 1
) -> dict[str, Any]:
    """``truth()``, computed once per distinct sequence of windows and loss (the cases see the same data in the same
    order)."""
    if loss not in ("scaled", "scaled_current", "scaled_counted"):
        loss, world = "num_items", 1  # the token-weighted big batch, whatever the world size
    labels = tuple(tuple(tuple(batch["labels"].reshape(-1).tolist()) for batch in window) for window in windows)
    key = (dtype, loss, world, labels)
    if key not in _TRUTHS:
        _TRUTHS[key] = truth(windows, dtype, loss, world)
    return _TRUTHS[key]


def compare(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One case's errors against the truth of the windows it trained on (every rank's records; one result per
    rank, so the world size is ``len(results)``)."""
    first = results[0]
    if first.get("straight") is not None:
        pairs = [pair for result in results for pair in zip(result["params"], result["straight"], strict=True)]
        return {"bitwise": all(torch.equal(a, b) for a, b in pairs)}
    windows = windows_of([result["records"] for result in results])
    loss, world = first.get("loss", "num_items"), len(results)
    reference = _cached_truth(windows, torch.float64, loss, world)
    fp32 = _cached_truth(windows, torch.float32, loss, world)
    norm_error = (
        max(abs(logged - exact) / exact for logged, exact in zip(first["norms"], reference["norms"], strict=True))
        if len(first["norms"]) == len(reference["norms"])
        else float("nan")
    )
    return {
        "error": error(first["params"], reference),
        "fp32_big_batch_error": error(fp32["params"], reference),
        "norm_error": norm_error,
        "windows": [len(window) for window in windows],
        "clipped": sum(norm > MAX_GRAD_NORM for norm in reference["norms"]),
        "ranks_equal": all(
            torch.equal(a, b) for result in results[1:] for a, b in zip(first["params"], result["params"], strict=True)
        ),
    }


def runs_of(saved: dict[str, Any], name: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A case's results on 1 process and on every rank."""
    return [saved["single"][name]], [rank[name] for rank in saved["ranks"]]


def report(saved: dict[str, Any]) -> str:
    """A markdown table: each case's parameter error against the float64 truth, on 1 process and on 2 ranks."""
    lines = [
        "| recipe | param error, 1 process | param error, 2 ranks | logged grad_norm error, 1 process / 2 ranks "
        "| ranks bitwise equal |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name in CASES:
        runs = runs_of(saved, name)
        failed = [results[0]["error"] for results in runs if isinstance(results[0].get("error"), str)]
        if failed:
            lines.append(f"| {name} | {failed[0]} | | | |")
            continue
        single, ranks = (compare(results) for results in runs)
        if "bitwise" in single:
            cells = ["bitwise equal to uninterrupted" if m["bitwise"] else "NOT bitwise equal" for m in (single, ranks)]
            lines.append(f"| {name} | {cells[0]} | {cells[1]} | | |")
            continue
        equal = "yes" if ranks["ranks_equal"] else "NO"
        norms = f"{single['norm_error']:.1e} / {ranks['norm_error']:.1e}"
        lines.append(f"| {name} | {single['error']:.1e} | {ranks['error']:.1e} | {norms} | {equal} |")
    baseline = [compare(results)["fp32_big_batch_error"] for results in runs_of(saved, GAFUSED)]
    lines.append(f"| plain fp32 PyTorch, one big batch per window | {baseline[0]:.1e} | {baseline[1]:.1e} | | |")
    return "\n".join(lines)


if __name__ == "__main__":
    target = case_script_target(sys.argv[1:])
    if target is None:
        with tempfile.TemporaryDirectory() as folder:
            out = os.path.join(folder, "results.pt")
            run(out)
            print(report(torch.load(out, weights_only=False)))
    else:
        run(target)
