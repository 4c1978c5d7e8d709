"""Lightning's ``accumulate_grad_batches`` against a float64 token-weighted big batch (test_integration_lightning.py).

    python tests/lightning_cases.py OUT.pt      # 2 gloo ranks (Lightning's DDP strategy): every case, saved to OUT.pt
    python tests/lightning_cases.py --report    # 1 process and 2 ranks, printed as a table against the float64 truth

A tiny GPT-2 (from a config, no download) trains for one epoch of ``BATCHES`` micro-batches per rank, N = 3, so the
windows hold 3, 3, 3 and 2 micro-batches (the last one partial, ended by Lightning at the end of the epoch). Sequence
lengths differ across micro-batches and ranks (padding labelled -100), the optimizer is SGD (a scale error shows in
the parameters), a LambdaLR schedule with ``interval="step"`` (lr / (1 + window)), and the global
norm is clipped. Each case is one recipe:

- ``lightning``: Lightning's own accumulation (loss / N per micro-batch, ``gradient_clip_val``);
- ``gafused``: the same module and Trainer with ``callbacks=[GradAccumulation(weight=tokens, max_grad_norm=...)]``;
- ``gafused-unweighted``: the same without ``weight=`` (every micro-batch weighs 1), against the mean of the
  micro-batch means, where the partial window is the only difference from Lightning's own accumulation;
- ``*-resumed``: the same run, stopped after batch ``CHECKPOINT_AFTER`` (mid-window) by ``trainer.save_checkpoint``
  in one fit, and resumed with ``trainer.fit(..., ckpt_path=...)`` in a fresh Trainer and module.

``truth()`` trains the same model in float64 on one process: each window is one step on the token-mean loss of
every rank's micro-batches of that window, clipped with ``clip_grad_norm_``.
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
N = 3  # accumulate_grad_batches
BATCHES = 11  # micro-batches per rank in the epoch: windows of 3, 3, 3 and 2
CHECKPOINT_AFTER = 4  # 0-based batch after which the resumed cases checkpoint: the 2nd window holds 2 of its 3
LR = 0.5
MAX_NORM = 0.7  # below some windows' norms and above others, on 1 process and on 2 ranks
ROWS, MAX_LEN, VOCAB = 2, 12, 32
# One epoch, and none of the logging, checkpointing, progress or sanity-check runs a comparison has no use for.
ONE_QUIET_EPOCH = dict(
    max_epochs=1,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    num_sanity_val_steps=0,
)


def lr_factor(window: int) -> float:
    """The LambdaLR schedule, per optimizer step (= per window)."""
    return 1.0 / (1.0 + window)


def make_model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import GPT2LMHeadModel

    config = tiny_gpt2_config(VOCAB, MAX_LEN, attn_implementation="eager")
    torch.manual_seed(0)
    return GPT2LMHeadModel(config).to(dtype)


def micro_batch(rank: int, index: int) -> dict[str, torch.Tensor]:
    """Micro-batch ``index`` of ``rank``: ROWS sequences of different lengths, right-padded, padding labelled -100."""
    generator = torch.Generator().manual_seed(1000 * rank + index)
    lengths = [2 + (5 * rank + 7 * index + 3 * row) % (MAX_LEN - 1) for row in range(ROWS)]
    input_ids = torch.randint(0, VOCAB, (ROWS, MAX_LEN), generator=generator)
    mask = torch.arange(MAX_LEN)[None, :] < torch.tensor(lengths)[:, None]
    labels = input_ids.masked_fill(~mask, -100)
    return {"input_ids": input_ids, "attention_mask": mask.long(), "labels": labels}


def tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The loss tokens of a batch: GPT-2 shifts the labels by one."""
    return (batch["labels"][..., 1:] != -100).sum()


def epoch_windows(batches: int = BATCHES, n: int = N) -> list[list[int]]:
    """The batch indices of each window of an epoch, as Lightning cuts them: every n, and the rest."""
    return [list(range(start, min(start + n, batches))) for start in range(0, batches, n)]


def truth(
    world: int,
    skip: frozenset[int] | set[int] = frozenset(),
    weighted: bool = True,
    windows: list[list[int]] | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[float]]:
    """Float64, one process: a step per window on the token-weighted big batch of ``world`` ranks' micro-batches
    (``weighted=False``: the mean of the micro-batch means), leaving out the batch indices in ``skip``. ``windows``:
    the batch indices of each window (default: one epoch of ``BATCHES``, N = ``N``). Returns the final parameters,
    the initial ones and each window's gradient norm (before clipping)."""
    model = make_model(torch.float64)
    initial = [p.detach().clone() for p in model.parameters()]
    norms = []
    for window, indices in enumerate(epoch_windows() if windows is None else windows):
        model.zero_grad()
        total = torch.zeros((), dtype=torch.float64)
        weight_sum = 0
        for rank in range(world):
            for index in indices:
                if index in skip:
                    continue
                batch = micro_batch(rank, index)
                weight = int(tokens(batch)) if weighted else 1
                total = total + model(**batch).loss * weight  # weighted: the micro-batch's token sum of the loss
                weight_sum += weight
        (total / weight_sum).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * lr_factor(window) * p.grad
    return [p.detach().clone() for p in model.parameters()], initial, norms


def plain_fp32(world: int) -> list[torch.Tensor]:
    """Plain fp32 PyTorch on the same big batches: the rounding a float32 run cannot avoid."""
    model = make_model()
    for window, indices in enumerate(epoch_windows()):
        model.zero_grad()
        batches = [micro_batch(rank, i) for rank in range(world) for i in indices]
        weights = [int(tokens(batch)) for batch in batches]
        total = sum(model(**batch).loss * weight for batch, weight in zip(batches, weights, strict=True))
        (total / sum(weights)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * lr_factor(window) * p.grad
    return [p.detach().clone() for p in model.parameters()]


def error(params: list[torch.Tensor], truth_params: list[torch.Tensor], initial: list[torch.Tensor]) -> float:
    """|p - p_truth| / |p_truth - p0| over the whole parameter vector. (Per tensor, the LayerNorm weights, which start
    at 1 and move by about 1e-4, would only measure how float32 represents 1 + 1e-4.)"""
    flat = torch.cat([p.double().flatten() for p in params])
    truth_flat = torch.cat([t.flatten() for t in truth_params])
    initial_flat = torch.cat([i.flatten() for i in initial])
    return float((flat - truth_flat).norm() / (truth_flat - initial_flat).norm())


# --- the Lightning side ------------------------------------------------------------------------------------------


def _lightning_classes() -> tuple[type, type, type]:
    """Defined on first use: importing this file must not import Lightning (the tests skip without it)."""
    import lightning.pytorch as pl

    class Batches:
        """One rank's micro-batches as a sized, resumable iterable: each iteration starts at 0, or where the state
        Lightning loaded from a checkpoint says (as torchdata's StatefulDataLoader does)."""

        def __init__(self, rank: int) -> None:
            self.rank = rank
            self.position = 0
            self.resume_at: int | None = None

        def __len__(self) -> int:
            return BATCHES

        def __iter__(self):
            self.position, self.resume_at = self.resume_at or 0, None
            while self.position < BATCHES:
                index = self.position
                self.position += 1
                yield micro_batch(self.rank, index)

        def state_dict(self) -> dict[str, int]:
            return {"position": self.position}

        def load_state_dict(self, state: dict[str, int]) -> None:
            self.resume_at = state["position"]

    class TinyLM(pl.LightningModule):
        """The recipe people copy: training_step returns the micro-batch's mean loss, configure_optimizers the
        optimizer and a per-step schedule."""

        def __init__(self, rank: int) -> None:
            super().__init__()
            self.model = make_model()
            self.rank = rank
            self.lrs: list[float] = []  # the learning rate of every optimizer step

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return self.model(**batch).loss

        def configure_optimizers(self) -> dict[str, Any]:
            optimizer = torch.optim.SGD(self.parameters(), lr=LR)
            optimizer.register_step_pre_hook(lambda opt, args, kwargs: self.lrs.append(opt.param_groups[0]["lr"]))
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

        def train_dataloader(self) -> Batches:
            return Batches(self.rank)

    class Recorder(pl.Callback):
        """Each window's grad_norm; optionally a checkpoint after one batch, then the fit stops there."""

        def __init__(self, accumulation: Any = None, checkpoint: str | None = None) -> None:
            self.accumulation = accumulation
            self.checkpoint = checkpoint
            self.norms: list[float] = []
            self.micro_step_at_checkpoint: int | None = None

        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
            accumulator = None if self.accumulation is None else self.accumulation.accumulator
            if accumulator is not None and accumulator.stepped:
                self.norms.append(float(accumulator.grad_norm))
            if self.checkpoint is not None and idx == CHECKPOINT_AFTER:
                trainer.save_checkpoint(self.checkpoint)
                if accumulator is not None:
                    self.micro_step_at_checkpoint = accumulator.micro_step
                trainer.should_stop = True

    return Batches, TinyLM, Recorder


def run(recipe: str, rank: int, world: int, folder: str) -> dict[str, Any]:
    """One recipe on this rank: ``lightning`` or ``gafused``, optionally ``-resumed``. Returns the final parameters,
    the learning rates of the optimizer steps, each window's norm (gafused) and what the checkpoint held."""
    import lightning.pytorch as pl

    from gafused.integrations.lightning import GradAccumulation

    _, TinyLM, Recorder = _lightning_classes()
    gafused = recipe.startswith("gafused")
    resumed = recipe.endswith("-resumed")

    def trainer(callbacks: list[Any]) -> pl.Trainer:
        return pl.Trainer(
            accelerator="cpu",
            devices=world,
            strategy=pl.strategies.DDPStrategy(process_group_backend="gloo") if world > 1 else "auto",
            accumulate_grad_batches=N,
            gradient_clip_val=None if gafused else MAX_NORM,
            **ONE_QUIET_EPOCH,
            use_distributed_sampler=False,
            callbacks=callbacks,
        )

    def accumulation() -> GradAccumulation | None:
        if not gafused:
            return None
        return GradAccumulation(weight=None if "unweighted" in recipe else tokens, max_grad_norm=MAX_NORM)

    result: dict[str, Any] = {}
    lrs: list[float] = []
    norms: list[float] = []
    if resumed:
        path = os.path.join(folder, f"{recipe}.ckpt")
        first = accumulation()
        recorder = Recorder(first, checkpoint=path)
        module = TinyLM(rank)
        trainer([recorder] + ([first] if first else [])).fit(module)
        lrs += module.lrs
        norms += recorder.norms
        result["micro_step_at_checkpoint"] = recorder.micro_step_at_checkpoint
        checkpoint = torch.load(path, weights_only=False)
        result["checkpoint_callback_states"] = list(checkpoint.get("callbacks", {}))
        ckpt_path: str | None = path
    else:
        ckpt_path = None
    second = accumulation()
    recorder = Recorder(second)
    module = TinyLM(rank)
    trainer([recorder] + ([second] if second else [])).fit(module, ckpt_path=ckpt_path)
    result["params"] = [p.detach().clone() for p in module.model.parameters()]
    result["lrs"] = lrs + module.lrs
    result["norms"] = norms + recorder.norms
    return result


RECIPES = ["lightning", "gafused", "gafused-unweighted", "lightning-resumed", "gafused-resumed"]
# The recipes to compare with the mean of the micro-batch means (every micro-batch weighs 1) too.
UNWEIGHTED = {"lightning", "gafused-unweighted"}


def run_all(rank: int, world: int, folder: str) -> dict[str, dict[str, Any]]:
    results = {}
    for recipe in RECIPES:
        try:
            results[recipe] = run(recipe, rank, world, folder)
        except Exception as exc:  # reported per case, so that one failure does not hide the others
            import traceback

            results[recipe] = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
    return results


def _rank(rank: int, port: int, folder: str, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(WORLD),
        RANK=str(rank),
        LOCAL_RANK=str(rank),  # Lightning then takes the processes as launched externally and launches none
        NODE_RANK="0",
    )
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        results = run_all(rank, WORLD, folder)
        gathered: list[Any] = [None] * WORLD
        dist.all_gather_object(gathered, results)
        if rank == 0:
            torch.save(gathered, out)
    finally:
        dist.destroy_process_group()
    leave_spawned_rank()


def spawn_ranks(out: str) -> None:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_rank, args=(free_port(), folder, out), nprocs=WORLD)


def report(ranks: list[dict[str, Any]], single: dict[str, dict[str, Any]]) -> str:
    rows = [
        "| recipe | processes | truth | param error vs float64 truth | grad_norm error | learning rate per window "
        "as scheduled | ranks bitwise equal |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    expected_lrs = [LR * lr_factor(window) for window in range(len(epoch_windows()))]
    for world, results in ((1, [single]), (WORLD, ranks)):
        truths = {True: truth(world), False: truth(world, weighted=False)}
        floor = error(plain_fp32(world), *truths[True][:2])
        rows.append(f"| plain fp32 big batch (the rounding floor) | {world} | tokens | {floor:.1e} | - | - | - |")
        for recipe in RECIPES:
            first = results[0][recipe]
            if "error" in first:
                rows.append(f"| {recipe} | {world} | - | failed: {first['error'].splitlines()[0]} | - | - | - |")
                continue
            equal = all(
                all(torch.equal(a, b) for a, b in zip(first["params"], other[recipe]["params"], strict=True))
                for other in results[1:]
            )
            scheduled = "yes" if first["lrs"] == expected_lrs else "NO"
            bitwise = "-" if world == 1 else "yes" if equal else "NO"
            for weighted in (True, False):
                if (recipe in UNWEIGHTED) != (not weighted) and recipe != "lightning":
                    continue
                truth_params, initial, truth_norms = truths[weighted]
                norms = first["norms"]
                norm_error = (
                    f"{max(abs(n - t) / t for n, t in zip(norms, truth_norms, strict=True)):.1e}" if norms else "-"
                )
                rows.append(
                    f"| {recipe} | {world} | {'tokens' if weighted else 'mean of means'} "
                    f"| {error(first['params'], truth_params, initial):.1e} | {norm_error} | {scheduled} | {bitwise} |"
                )
    return "\n".join(rows)


if __name__ == "__main__":
    target = case_script_target(sys.argv[1:])
    if target is None:
        warnings.filterwarnings("ignore")
        with tempfile.TemporaryDirectory() as folder:
            out = os.path.join(folder, "ranks.pt")
            spawn_ranks(out)
            ranks = torch.load(out, weights_only=False)
            single = run_all(0, 1, folder)
        print(report(ranks, single))
    else:
        spawn_ranks(target)
