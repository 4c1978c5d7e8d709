"""Accelerate's gradient-accumulation recipe, with and without gafused, against a float64 token-weighted big batch.

    python tests/accelerate_cases.py OUT.pt       # every case on 2 gloo ranks (Accelerate's MULTI_CPU), saved to OUT.pt
    python tests/accelerate_cases.py --report     # every case on 1 process and on 2 ranks, printed as a table

The data: a tiny GPT-2 built from a config (no download), micro-batches of 2 sequences whose lengths differ a lot
(padding labelled -100), so micro-batches carry very different numbers of loss tokens (``"uneven"``; ``"even"``: every
sequence 16 tokens long). A prepared dataloader gives each process 10 micro-batches per epoch and
``Accelerator(gradient_accumulation_steps=4)`` makes windows of 4, 4 and a partial 2 (Accelerate syncs at the end of
the dataloader; the data sets without ``"partial"`` give 8 micro-batches: two full windows). SGD, so that any scale
error shows in the parameters, and an LR scheduler (``LambdaLR``) prepared by Accelerate. ``truth()`` trains a float64
copy on one process: each window's step on the big batch of every process's micro-batches of that window, loss = sum
of the token losses / number of loss tokens, clipped like ``clip_grad_norm_`` when the case clips.
Error = |p - p_truth| / |p_truth - p0| over all parameters.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import tempfile
import warnings
from collections.abc import Callable
from typing import Any

import torch

from casekit import case_script_target, free_port, tiny_gpt2_config

GA = 4  # Accelerator(gradient_accumulation_steps=GA)
# Data sets: (every sequence the same length, micro-batches per process per epoch). 10 makes windows 4, 4, 2.
DATA = {"uneven-partial": (False, 10), "uneven": (False, 8), "even-partial": (True, 10), "even": (True, 8)}
MAIN = "uneven-partial"
SEQUENCES = 2  # sequences per micro-batch
LR = 0.5
MAX_NORM = 0.2  # below every window's norm: clipping is exercised
CHECKPOINT_AFTER = 5  # micro-batches run before the mid-window save_state (window 1, after its first micro-batch)
BUCKET_BYTES = 4096  # several buckets on the tiny model


def lr_lambda(step: int) -> float:
    return 1.0 / (1.0 + 0.25 * step)


def windows(batches: int) -> list[range]:
    """Each process's micro-batch indices of each window: GA at a time, the last one partial."""
    return [range(start, min(start + GA, batches)) for start in range(0, batches, GA)]


def make_model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import GPT2LMHeadModel

    config = tiny_gpt2_config(64)
    torch.manual_seed(0)
    return GPT2LMHeadModel(config).to(dtype)


def sequence_length(index: int, even: bool) -> int:
    """Uneven: lengths from 2 to 31, so a micro-batch holds from 2 to 60 loss tokens."""
    return 16 if even else 2 + (index * 11 + (index * index) % 7) % 30


class Sequences(torch.utils.data.Dataset):
    """The sequences of every process of a run: ``world * batches`` micro-batches."""

    def __init__(self, data: str, world: int) -> None:
        even, batches = DATA[data]
        generator = torch.Generator().manual_seed(1234)
        self.items = [
            torch.randint(0, 64, (sequence_length(i, even),), generator=generator)
            for i in range(world * batches * SEQUENCES)
        ]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor]:
        return index, self.items[index]


def collate(items: list[tuple[int, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right padding; padded positions carry no loss (label -100) and are masked."""
    longest = max(len(tokens) for _, tokens in items)
    input_ids = torch.zeros(len(items), longest, dtype=torch.long)
    labels = torch.full((len(items), longest), -100, dtype=torch.long)
    mask = torch.zeros(len(items), longest, dtype=torch.long)
    for row, (_, tokens) in enumerate(items):
        input_ids[row, : len(tokens)] = tokens
        labels[row, : len(tokens)] = tokens
        mask[row, : len(tokens)] = 1
    ids = torch.tensor([index for index, _ in items])
    return {"input_ids": input_ids, "labels": labels, "attention_mask": mask, "ids": ids}


def loss_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Tokens that carry loss: the model shifts labels by one."""
    return int((batch["labels"][..., 1:] != -100).sum())


def global_batch(world: int, rank: int, micro: int) -> list[int]:
    """The sample indices of a process's micro-batch: Accelerate hands batch ``micro * world + rank`` to ``rank``."""
    start = (micro * world + rank) * SEQUENCES
    return list(range(start, start + SEQUENCES))


def token_loss_sum(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), batch["labels"][:, 1:].reshape(-1), reduction="sum"
    )


def truth(world: int, clip: bool, data: str = MAIN, dtype: torch.dtype = torch.float64) -> dict[str, Any]:
    """Float64, one process: each window's SGD step on the token-weighted big batch of every process's micro-batches,
    at the learning rate Accelerate's scheduler gives that window (it steps ``world`` times per optimizer step).
    ``dtype=torch.float32`` gives plain fp32 PyTorch on the same big batch: the rounding a bound must allow."""
    model = make_model(dtype)
    dataset = Sequences(data, world)
    initial = [p.detach().clone() for p in model.parameters()]
    norms, lrs = [], []
    for index, window in enumerate(windows(DATA[data][1])):
        model.zero_grad()
        total = torch.zeros((), dtype=dtype)
        tokens = 0
        for micro in window:
            for rank in range(world):
                batch = collate([dataset[i] for i in global_batch(world, rank, micro)])
                total = total + token_loss_sum(model, batch)
                tokens += loss_tokens(batch)
        (total / tokens).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM if clip else float("inf"))
        norms.append(float(norm))
        lr = LR * lr_lambda(world * index)
        lrs.append(lr)
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
    return {"params": [p.detach().clone() for p in model.parameters()], "norms": norms, "lrs": lrs, "initial": initial}


def error(params: list[torch.Tensor], reference: dict[str, Any]) -> float:
    """|p - p_truth| / |p_truth - p0| over all parameters at once."""
    flat = torch.cat([p.double().flatten() for p in params])
    truth_flat = torch.cat([p.flatten() for p in reference["params"]])
    initial = torch.cat([p.flatten() for p in reference["initial"]])
    return float((flat - truth_flat).norm() / (truth_flat - initial).norm())


# --- one process of a run ------------------------------------------------------------------------------------------

# Accelerate's own recipe: accelerator.backward(loss) divides by GA, DDP averages the ranks' accumulated gradients.
# gafused: the same recipe through gafused.integrations.accelerate.prepare, token weights given to accelerator.backward.
CASES: dict[str, dict[str, Any]] = {
    **{
        f"{recipe}/{data}": {"recipe": recipe, "clip": False, "data": data}
        for recipe in ("accelerate", "gafused")
        for data in DATA
    },
    f"accelerate-clip/{MAIN}": {"recipe": "accelerate", "clip": True},
    f"gafused-clip/{MAIN}": {"recipe": "gafused", "clip": True},
    # loss.backward(); optimizer.step(weight=w): the fold at step().
    f"gafused-step-clip/{MAIN}": {"recipe": "gafused-step", "clip": True},
    # save_state mid-window, then everything built anew, load_state, skip_first_batches: must equal gafused-clip.
    f"gafused-checkpoint-clip/{MAIN}": {"recipe": "gafused", "clip": True, "checkpoint": True},
    # every accelerator.backward under accelerator.trigger_sync_in_backward(model): must equal gafused-clip.
    f"gafused-trigger-clip/{MAIN}": {"recipe": "gafused", "clip": True, "trigger": True},
    # Accelerator(dynamo_backend="eager"): the model prepare() returns is torch.compile's wrapper (around DDP on
    # several processes): must equal gafused-clip within fp32 rounding.
    f"gafused-compiled-clip/{MAIN}": {"recipe": "gafused", "clip": True, "compiled": True},
}


def _shared_state() -> Any:
    """Accelerate's process-wide PartialState, made with cpu=True wherever this module may make it: on a GPU machine
    PartialState() binds it to CUDA, and every later Accelerator(cpu=True) is then refused."""
    from accelerate.state import PartialState

    return PartialState(cpu=True)


def _reset_accelerator_state() -> None:
    """Forget the process-wide AcceleratorState (the process group, PartialState, stays): an Accelerator built next
    takes its own dynamo_backend, where it would otherwise inherit the first one's."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=False)


def _build(recipe: str, clip: bool, data: str, world: int, compiled: bool = False) -> tuple[Any, ...]:
    from accelerate import Accelerator

    import gafused.integrations.accelerate as gafused_accelerate

    if compiled:
        _reset_accelerator_state()
    accelerator = Accelerator(gradient_accumulation_steps=GA, cpu=True, dynamo_backend="eager" if compiled else "no")
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    loader = torch.utils.data.DataLoader(Sequences(data, world), batch_size=SEQUENCES, collate_fn=collate)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    if recipe != "accelerate":
        optimizer = gafused_accelerate.prepare(
            accelerator, model, optimizer, max_grad_norm=MAX_NORM if clip else None, bucket_bytes=BUCKET_BYTES
        )
    return accelerator, model, optimizer, loader, scheduler


def run_case(
    recipe: str,
    clip: bool,
    data: str = MAIN,
    checkpoint: bool = False,
    trigger: bool = False,
    folder: str | None = None,
    compiled: bool = False,
) -> dict[str, Any]:
    """Train one epoch through one recipe on this process; return the final params, the ids each micro-batch held,
    the learning rate of each inner step, and gafused's norms."""
    world = _shared_state().num_processes
    batches = DATA[data][1]
    accelerator, model, optimizer, loader, scheduler = _build(recipe, clip, data, world, compiled)
    if compiled:
        assert isinstance(model, torch._dynamo.eval_frame.OptimizedModule)
    inner = optimizer.optimizer if recipe == "accelerate" else optimizer.accumulator.optimizer
    lrs: list[float] = []
    inner.register_step_pre_hook(lambda opt, args, kwargs: lrs.append(opt.param_groups[0]["lr"]))
    seen: list[list[int]] = []
    norms: list[float] = []
    done = 0
    stream = iter(loader)
    while done < batches:
        batch = next(stream)
        with accelerator.accumulate(model):
            seen.append(batch["ids"].tolist())
            inputs = {key: batch[key] for key in ("input_ids", "attention_mask", "labels")}
            loss = model(**inputs).loss  # mean over this micro-batch's loss tokens
            if recipe == "accelerate":
                accelerator.backward(loss)
                if clip and accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
                optimizer.step()
            elif recipe == "gafused":
                # Accelerate's trigger would switch DDP's all-reduce on for this backward, on top of gafused's.
                with accelerator.trigger_sync_in_backward(model) if trigger else contextlib.nullcontext():
                    accelerator.backward(loss, weight=loss_tokens(batch))
                optimizer.step()
            else:
                loss.backward()
                optimizer.step(weight=loss_tokens(batch))
            scheduler.step()
            optimizer.zero_grad()
            if recipe != "accelerate" and optimizer.stepped:
                norms.append(optimizer.grad_norm.item())
        done += 1
        if checkpoint and done == CHECKPOINT_AFTER:
            accelerator.save_state(folder)
            accelerator.wait_for_everyone()
            del stream
            accelerator, model, optimizer, loader, scheduler = _build(recipe, clip, data, world)
            inner = optimizer.accumulator.optimizer
            inner.register_step_pre_hook(lambda opt, args, kwargs: lrs.append(opt.param_groups[0]["lr"]))
            accelerator.load_state(folder)
            stream = iter(accelerator.skip_first_batches(loader, done))
    module = accelerator.unwrap_model(model)
    if compiled:
        _reset_accelerator_state()  # the recipes after this one build uncompiled models
    return {
        "params": [p.detach().clone() for p in module.parameters()],
        "seen": seen,
        "lrs": lrs,
        "norms": norms,
        "micro_step": optimizer.micro_step if recipe != "accelerate" else None,
    }


def _small() -> tuple[Any, ...]:
    """Accelerator(gradient_accumulation_steps=GA) over a 3x2 linear model and SGD (DDP on several processes), its
    optimizer handed to gafused, and GA micro-batches for this process."""
    from accelerate import Accelerator

    import gafused.integrations.accelerate as gafused_accelerate

    accelerator = Accelerator(gradient_accumulation_steps=GA, cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    optimizer = gafused_accelerate.prepare(accelerator, model, optimizer)
    rank = _shared_state().process_index
    data = [torch.randn(4, 3, generator=torch.Generator().manual_seed(100 * rank + i)) for i in range(GA)]
    return accelerator, model, optimizer, data


def _small_recipe(accelerator: Any, model: torch.nn.Module, optimizer: Any, data: list[torch.Tensor]) -> list:
    """One window of the accumulate() recipe; the parameters after it."""
    for x in data:
        with accelerator.accumulate(model):
            accelerator.backward(model(x).square().mean())
            optimizer.step()
            optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def refuse_without_accumulate() -> dict[str, Any]:
    """The loop without accumulate(): backward every micro-batch and step every GA-th (plain Accelerate divides each
    loss by GA). Its first accelerator.backward is refused, changing nothing: the accumulate() recipe then run on
    the same objects ends bitwise where a fresh one does."""
    fresh = _small_recipe(*_small())
    accelerator, model, optimizer, data = _small()
    refusal = None
    try:
        accelerator.backward(model(data[0]).square().mean())
    except RuntimeError as error:
        refusal = str(error)
    after = {"micro_step": optimizer.micro_step, "grads": [p.grad is not None for p in model.parameters()]}
    then = _small_recipe(accelerator, model, optimizer, data)
    return {"refusal": refusal, "after": after, "then": then, "fresh": fresh}


def refuse_trigger_on_the_class() -> dict[str, Any]:
    """``Accelerator.trigger_sync_in_backward(model)``, the static method called on the class, not through the
    accelerator, around a backward whose forward ran before it (Accelerate's documented use): under DDP it primes
    DDP's reducer behind the adapter, and the backward inside it is refused."""
    from accelerate import Accelerator

    accelerator, model, optimizer, data = _small()
    refusal, sync = None, None
    try:
        with accelerator.accumulate(model):
            sync = accelerator.sync_gradients  # False: a window's first block of GA, not a sync step
            loss = model(data[0]).square().mean()
            with Accelerator.trigger_sync_in_backward(model):
                accelerator.backward(loss)
    except RuntimeError as error:
        refusal = str(error)
    return {"refusal": refusal, "micro_step": optimizer.micro_step, "sync": sync}


def refuse_checkpoint_without_window_files() -> dict[str, Any]:
    """save_state after one micro-batch of a window, each process's gafused_window_<rank>.bin deleted, load_state on
    fresh objects: on several processes optimizer.bin holds rank 0's part of the window alone, and every process
    refuses it; on one process it is the whole window, and it loads."""
    import shutil

    accelerator, model, optimizer, data = _small()
    folders: list[Any] = [tempfile.mkdtemp() if accelerator.is_main_process else None]
    if accelerator.num_processes > 1:
        import torch.distributed as dist

        dist.broadcast_object_list(folders, src=0)
    folder = folders[0]
    with accelerator.accumulate(model):
        accelerator.backward(model(data[0]).square().mean())
        optimizer.step()
    assert optimizer.micro_step == 1  # mid-window
    accelerator.save_state(folder)
    accelerator.wait_for_everyone()
    import gafused.integrations.accelerate as gafused_accelerate

    os.remove(os.path.join(folder, gafused_accelerate.WINDOW_FILE.format(rank=accelerator.process_index)))
    accelerator.wait_for_everyone()
    accelerator, model, optimizer, data = _small()
    refusal = None
    try:
        accelerator.load_state(folder)
    except ValueError as error:
        refusal = str(error)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shutil.rmtree(folder)
    return {"refusal": refusal, "micro_step": optimizer.micro_step}


REFUSALS: dict[str, Callable[[], dict[str, Any]]] = {
    "refusal/checkpoint-without-window-files": refuse_checkpoint_without_window_files,
    "refusal/without-accumulate": refuse_without_accumulate,
    "refusal/trigger-on-the-class": refuse_trigger_on_the_class,
}


def run_all() -> dict[str, Any]:
    """Every case on this process (every process of the run calls it); errors are reported by name."""
    warnings.filterwarnings("ignore", message=".*OMP_NUM_THREADS.*")
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as scratch:
        # Every process must save into, and load from, the same folder: rank 0's name.
        folders: list[Any] = [scratch]
        if _shared_state().num_processes > 1:
            import torch.distributed as dist

            dist.broadcast_object_list(folders, src=0)
        for name, case in CASES.items():
            try:
                results[name] = run_case(**case, folder=os.path.join(folders[0], name))
            except Exception as failure:  # reported by the test, named
                results[name] = {"error": f"{type(failure).__name__}: {failure}"}
        from accelerate.state import GradientState

        for name, check in REFUSALS.items():  # last: a refused trigger leaves its model's DDP reducer primed
            # The cases leave a prepared dataloader active at its end (their last next() was not past it), which
            # makes every accumulate() block a sync step: a fresh GradientState counts windows of GA again.
            GradientState._reset_state()
            try:
                results[name] = check()
            except Exception as failure:
                results[name] = {"error": f"{type(failure).__name__}: {failure}"}
        if _shared_state().num_processes > 1:
            _shared_state().wait_for_everyone()  # rank 0's scratch folder outlives every rank's load_state
    return results


def _rank(rank: int, world: int, port: int, out: str) -> None:
    """One process of a run. With ``world > 1``, the variables Accelerate's PartialState reads make it MULTI_CPU on
    gloo (``torchrun`` sets the same ones); with 1, none are set and Accelerate runs one plain process."""
    if world > 1:
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    # A rank still running after 240 s (the whole run takes about 20 s on 2 CPU cores) writes every thread's stack
    # to stderr and exits: a hang fails the run with where it hung, within the test's 300 s.
    faulthandler.dump_traceback_later(240, exit=True)
    import torch.distributed as dist

    _shared_state()
    results = run_all()
    if world == 1:
        torch.save([results], out)
        return
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        torch.save(gathered, out)
    dist.destroy_process_group()


def run_ranks(out: str, world: int = 2) -> None:
    """Run every case on ``world`` processes, forked from this one after the slow imports (transformers, accelerate:
    seconds each), which they then share. Nothing here has started a thread pool or a process group yet."""
    import accelerate  # noqa: F401
    import torch.multiprocessing as mp
    import transformers.models.gpt2  # noqa: F401

    mp.start_processes(_rank, args=(world, free_port(), out), nprocs=world, start_method="fork")


DESCRIPTIONS = {
    "uneven-partial": "uneven tokens, partial last window",
    "uneven": "uneven tokens, full windows",
    "even-partial": "equal tokens, partial last window",
    "even": "equal tokens, full windows",
}


LABELS = {
    "accelerate": "Accelerate's own",
    "gafused": "Accelerate + gafused",
    "accelerate-clip": "Accelerate's own, `clip_grad_norm_` at the sync step",
    "gafused-clip": "Accelerate + gafused, `max_grad_norm`",
    "gafused-step-clip": "Accelerate + gafused, `loss.backward(); optimizer.step(weight=w)`",
    "gafused-checkpoint-clip": "Accelerate + gafused, `save_state` mid-window, resumed",
    "gafused-trigger-clip": "Accelerate + gafused, backward under `trigger_sync_in_backward`",
    "gafused-compiled-clip": 'Accelerate + gafused, `Accelerator(dynamo_backend="eager")`',
}


def report(by_world: dict[int, list[dict[str, Any]]]) -> str:
    """A markdown table: each recipe's error against the float64 truth, on 1 process and on 2 ranks, and below, the
    rounding floor: plain fp32 PyTorch on the same big batches."""
    worlds = sorted(by_world)
    header = " | ".join(f"{w} process{'es' if w > 1 else ''}" for w in worlds)
    lines = [f"| recipe | data | clipping | {header} |", "| --- | --- | --- |" + " --- |" * len(worlds)]
    truths: dict[tuple[int, bool, str], dict[str, Any]] = {}

    def row(label: str, clip: bool, data: str, params_of: Callable[[int], list[torch.Tensor] | str]) -> str:
        cells = []
        for w in worlds:
            key = (w, clip, data)
            if key not in truths:
                truths[key] = truth(*key)
            params = params_of(w)
            cells.append(params if isinstance(params, str) else f"{error(params, truths[key]):.1e}")
        clipping = f"max norm {MAX_NORM}" if clip else "none"
        return f"| {label} | {DESCRIPTIONS[data]} | {clipping} | {' | '.join(cells)} |"

    def run_params(name: str) -> Callable[[int], list[torch.Tensor] | str]:
        return lambda w: by_world[w][0][name].get("error") or by_world[w][0][name]["params"]

    floors = {}
    for name, case in CASES.items():
        data = case.get("data", MAIN)
        lines.append(row(LABELS[name.split("/")[0]], case["clip"], data, run_params(name)))
        floors[case["clip"], data] = None
    for clip, data in floors:
        lines.append(
            row(
                "plain fp32 PyTorch, one big batch per window",
                clip,
                data,
                lambda w, clip=clip, data=data: truth(w, clip, data, torch.float32)["params"],
            )
        )
    return "\n".join(lines)


if __name__ == "__main__":
    # Every rank is a gloo CPU process, forked after the imports: a parent that had initialized the CUDA driver
    # (Accelerate or transformers asking whether a GPU is there) would fork children that hang in their first
    # CUDA call. With no GPU visible nothing initializes one.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    target = case_script_target(sys.argv[1:])
    if target is None:
        with tempfile.TemporaryDirectory() as scratch:
            out = os.path.join(scratch, "results.pt")
            run_ranks(out, 1)
            one = torch.load(out, weights_only=False)
            run_ranks(out, 2)
            two = torch.load(out, weights_only=False)
        print(report({1: one, 2: two}))
    else:
        run_ranks(target)
