"""transformers' Trainer: GafusedTrainer against a float64 token-weighted big batch, on 1 process and 2 gloo ranks.

The training runs happen once, in a subprocess (tests/transformers_cases.py: the Trainer recipe
``per_device_train_batch_size=1, gradient_accumulation_steps=4`` on a tiny GPT-2 built from a config, sequences of
2 to 31 tokens, an epoch ending in a partial window, SGD, the linear schedule, clipping), and record every
micro-batch the model saw with its optimizer step; the truth replays those windows in float64. The tests below
read the results; the last ones check refusals and a skipped window in this process.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from gafused.integrations import TRANSFORMERS_MIN_VERSION  # imports no framework

pytest.importorskip("transformers", minversion=TRANSFORMERS_MIN_VERSION)
pytest.importorskip("accelerate")

import transformers  # noqa: E402
import transformers_cases as cases  # noqa: E402

import gafused  # noqa: E402
from gafused.integrations.transformers import GafusedTrainer  # noqa: E402

from casekit import run_case_script, tiny_gpt2_config  # noqa: E402

# |p - p_truth| / |p_truth - p0| over the whole model, fp32 training against the float64 truth after 6 windows
# (3 on 2 ranks): float32 rounding of the forward, backward and sums. Plain fp32 PyTorch on the same big batches
# measures 1.2e-6 (asserted below to be inside the bound too); a gradient scaled by 1 + 1e-4 would already exceed it.
FP32_ERROR = 1e-5
# grad_norm logged by the Trainer against the float64 norm of the same window (relative): fp32 rounding.
NORM_ERROR = 1e-5
GAFUSED = [cases.GAFUSED, "GafusedTrainer, per-micro-batch mean loss", cases.COMPILED]
TRAINER = ["Trainer, num_items_in_batch", "Trainer, per-micro-batch mean loss"]
RESUMED = f"GafusedTrainer, resumed from checkpoint-{cases.SAVE_AT} (AdamW)"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run_case_script(cases.__file__, tmp_path_factory.mktemp("transformers") / "results.pt")


def _runs(saved: dict, name: str) -> list[tuple[str, list[dict]]]:
    single, ranks = cases.runs_of(saved, name)
    for results in (single, ranks):
        for rank, result in enumerate(results):
            assert not isinstance(result.get("error"), str), f"{name}, rank {rank}: {result['error']}"
    return [("1 process", single), ("2 ranks", ranks)]


@pytest.fixture(scope="module")
def measured(saved: dict) -> dict:
    """Each case compared with its float64 truth once: name -> [(where, comparison)] for 1 process and 2 ranks."""
    return {
        name: [(where, cases.compare(results)) for where, results in _runs(saved, name)] for name in cases.ALL_CASES
    }


@pytest.mark.parametrize("name", GAFUSED)
def test_gafused_trainer_equals_the_token_weighted_big_batch(measured: dict, name: str) -> None:
    for where, comparison in measured[name]:
        assert comparison["error"] <= FP32_ERROR, (where, comparison)
        assert comparison["fp32_big_batch_error"] <= FP32_ERROR, (where, comparison)
        assert comparison["norm_error"] <= NORM_ERROR, (where, comparison)
        assert comparison["ranks_equal"], where


@pytest.mark.parametrize("name", TRAINER)
def test_trainer_own_accumulation_is_off_on_the_same_data(measured: dict, name: str) -> None:
    """The same comparison fails for Trainer's own accumulation: the data make the test able to fail."""
    for where, comparison in measured[name]:
        assert comparison["error"] > 1e-2, (where, comparison)


@pytest.mark.parametrize("name", list(cases.SCALED_CASES))
def test_compute_loss_scaled_for_ga_equals_plain_trainer_with_ddp(measured: dict, name: str) -> None:
    """A compute_loss of the user's that declares loss_is_scaled_for_ga=True, with num_items_in_batch or without
    (the model takes no loss kwargs), on 1 process and 2 ranks: the truth is what plain Trainer + DDP computes with
    that loss, the ranks' micro-batch losses summed and averaged over the ranks (Trainer's runs are held to it too).
    Nothing multiplies such a loss by the world size, so GafusedTrainer, which sums the ranks, weighs it by
    1 / world size (on 2 ranks it once took twice the gradient). Declared False, the loss is a per-micro-batch mean
    and GafusedTrainer gives the token-weighted big batch whether or not num_items_in_batch is given."""
    for where, comparison in measured[name]:
        assert comparison["error"] <= FP32_ERROR, (where, comparison)
        assert comparison["norm_error"] <= NORM_ERROR, (where, comparison)
        assert comparison["ranks_equal"], where


def test_trainer_counting_after_the_shift_is_exact_too(measured: dict) -> None:
    """Trainer's own num_items_in_batch path is exact for a model that declares loss_type="ForCausalLM": what
    GafusedTrainer corrects for GPT2LMHeadModel is the count, nothing else."""
    for where, comparison in measured['Trainer, num_items_in_batch, loss_type="ForCausalLM" declared']:
        assert comparison["error"] <= FP32_ERROR, (where, comparison)


def test_the_data_have_uneven_tokens_a_partial_window_and_clipping(saved: dict, measured: dict) -> None:
    for (where, results), (_, comparison) in zip(_runs(saved, cases.GAFUSED), measured[cases.GAFUSED], strict=True):
        windows = cases.windows_of([result["records"] for result in results])
        full = cases.GA * len(results)
        sizes = [len(window) for window in windows]
        assert sizes[:-1] == [full] * (len(sizes) - 1) and 0 < sizes[-1] < full, (where, sizes)
        tokens = [int((batch["labels"][:, 1:] != -100).sum()) for window in windows for batch in window]
        assert max(tokens) >= 10 * min(tokens), (where, tokens)
        assert 0 < comparison["clipped"] < len(windows), (where, comparison)


def test_scheduler_steps_once_per_window(saved: dict) -> None:
    for where, results in _runs(saved, cases.GAFUSED):
        windows = len(cases.windows_of([result["records"] for result in results]))
        for result in results:
            assert result["global_step"] == result["scheduler_steps"] == windows, where
            expected = [cases.LR * (windows - step) / windows for step in range(windows)]
            assert result["lrs"] == pytest.approx(expected, rel=1e-12), where


def test_resume_from_a_checkpoint_is_bitwise(measured: dict) -> None:
    """Trainer checkpoints after a window's optimizer step only (``_maybe_log_save_evaluate`` runs at sync steps),
    so the accumulator's window is empty there; the resumed run (AdamW: its state must come back) is bitwise
    equal to the uninterrupted one, on every rank."""
    for where, comparison in measured[RESUMED]:
        assert comparison["bitwise"], where


def test_sum_normalized_losses_need_the_global_token_count(saved: dict) -> None:
    """Refused where Trainer counts num_items_in_batch on each rank alone (the model takes it); a loss Trainer counts
    nothing for (a compute_loss of the user's, the model without loss kwargs) is the same on every rank: accepted."""
    for rank in saved["ranks"]:
        said = rank["misuse"]["average_tokens_across_devices=False"]
        assert "average_tokens_across_devices" in said, said
        assert rank["misuse"]["average_tokens_across_devices=False, nothing counted"] == "no error"


# --- in this process --------------------------------------------------------------------------------------------


def _trainer(tmp_path: Path, cls: type = GafusedTrainer, model: torch.nn.Module | None = None, **kwargs):
    options = kwargs.pop("accumulator_options", None)
    extra = {"accumulator_options": options} if options is not None else {}
    optimizers = kwargs.pop("optimizers", None)
    if optimizers is not None:
        extra["optimizers"] = optimizers
    return cls(
        model=model if model is not None else cases.make_model(),
        args=cases._arguments(str(tmp_path), **kwargs),
        train_dataset=cases.Sequences(),
        data_collator=cases.collate,
        **extra,
    )


def test_average_tokens_across_devices_off_is_accepted_in_one_process(tmp_path: Path) -> None:
    """Across ranks GafusedTrainer needs the token counts of every rank (average_tokens_across_devices); in one
    process there is nothing to average, and turning it off is accepted."""
    trainer = _trainer(tmp_path, average_tokens_across_devices=False, max_steps=1)
    assert trainer.args.average_tokens_across_devices is False and trainer.args.world_size == 1


def test_causal_lm_items_are_counted_after_the_shift(tmp_path: Path) -> None:
    """GPT2LMHeadModel leaves loss_type unset; its loss still shifts the labels. Trainer 5.x counts its items
    before the shift (one per sequence too many); GafusedTrainer after it, like its loss does."""
    assert cases.make_model().loss_type is None
    assert not _trainer(tmp_path, transformers.Trainer)._loss_shifts_labels
    trainer = _trainer(tmp_path)
    batch = cases.collate([{"input_ids": torch.arange(1, 6)}, {"input_ids": torch.arange(1, 3)}])
    assert int(trainer.loss_items(batch)) == 4 + 1


class _Labelled(torch.utils.data.Dataset):
    """Sequences of 2 to 9 tokens, each with a class label, for a sequence-classification head."""

    def __init__(self, count: int = 4) -> None:
        generator = torch.Generator().manual_seed(3)
        lengths = torch.randint(2, 10, (count,), generator=generator).tolist()
        self.items = [
            {
                "input_ids": torch.randint(3, cases.VOCAB, (n,), generator=generator),
                "labels": torch.randint(0, 3, (), generator=generator),
            }
            for n in lengths
        ]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        return self.items[index]


def test_a_head_whose_loss_ignores_the_item_count_is_averaged_not_summed(tmp_path: Path) -> None:
    """GPT2ForSequenceClassification's forward takes **kwargs, so Trainer treats its loss as normalized over the
    window, but the loss is a cross-entropy mean over its own micro-batch: summing four of them makes the gradient
    4x too large. GafusedTrainer weighs them as means: one window of 4 one-sequence micro-batches (SGD, lr 1, no
    clipping) must step by the mean of the 4 gradients, computed here in float64."""
    config = tiny_gpt2_config(cases.VOCAB, num_labels=3, pad_token_id=cases.PAD, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.GPT2ForSequenceClassification(config)
    assert model.loss_type == "ForSequenceClassification" and not hasattr(model, "accepts_loss_kwargs")
    start = {name: p.detach().double().clone() for name, p in model.named_parameters()}
    truth = copy.deepcopy(model).double()
    data = _Labelled()
    grads = {name: torch.zeros_like(p) for name, p in start.items()}
    for item in data.items:
        truth.zero_grad()
        truth(input_ids=item["input_ids"][None], labels=item["labels"][None]).loss.backward()
        for name, p in truth.named_parameters():
            grads[name] += p.grad / len(data)

    trainer = GafusedTrainer(
        model=model,
        args=cases._arguments(str(tmp_path), learning_rate=1.0, max_grad_norm=0.0, lr_scheduler_type="constant"),
        train_dataset=data,
        data_collator=lambda items: {key: torch.stack([item[key] for item in items]) for key in items[0]},
    )
    assert trainer.model_accepts_loss_kwargs is False and trainer.accumulator is None
    trainer.train()
    assert trainer.state.global_step == 1 and trainer.accumulator.normalization == "mean"
    error = _step_error(model, start, grads)  # summing the means would give 3
    assert error < 1e-5, error


def _big_batch_gradient(model: torch.nn.Module, **inputs: Any) -> tuple[dict, dict]:
    """The model's parameters now, and the float64 gradient of its loss on ``inputs`` (the whole window at once),
    both by name: what ``_step_error`` compares a step with."""
    start = {name: p.detach().double().clone() for name, p in model.named_parameters()}
    truth = copy.deepcopy(model).double()
    truth(**inputs).loss.backward()
    grads = {name: p.grad if p.grad is not None else torch.zeros_like(p) for name, p in truth.named_parameters()}
    return start, grads


def _step_error(model: torch.nn.Module, start: dict, grads: dict) -> float:
    """|step - step64| / |step64| over the whole model (SGD, lr 1: the step is start - now), as the module's other
    bounds."""
    step_error = sum(
        float((start[name] - p.detach().double() - grads[name]).square().sum()) for name, p in model.named_parameters()
    )
    return (step_error / sum(float(g.square().sum()) for g in grads.values())) ** 0.5


class _Masked(torch.utils.data.Dataset):
    """Sequences of 4 to 15 tokens with 1 to 9 of them masked (labels -100 elsewhere), for a masked-LM head: the
    micro-batches' loss tokens differ by up to 9x, so the mean of their means is far from their token mean."""

    def __init__(self, count: int = 4) -> None:
        generator = torch.Generator().manual_seed(5)
        self.items = []
        for index in range(count):
            tokens = torch.randint(3, cases.VOCAB, (4 + (5 * index) % 12,), generator=generator)
            masked = torch.randperm(len(tokens), generator=generator)[: 1 + (4 * index) % 9]
            labels = torch.full_like(tokens, -100)
            labels[masked] = tokens[masked]
            self.items.append({"input_ids": tokens.masked_fill(labels != -100, 1), "labels": labels})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        return self.items[index]


def _stacked(items: list[dict]) -> dict[str, torch.Tensor]:
    return {key: torch.stack([item[key] for item in items]) for key in items[0]}


def _sgd_trainer(
    cls: type,
    module: torch.nn.Module,
    folder: Path,
    data: torch.utils.data.Dataset,
    compiled: bool,
    compute_loss_func: Any = None,
    data_collator: Any = None,
    **arguments: Any,
) -> transformers.Trainer:
    """A Trainer (or GafusedTrainer) over ``data``, with SGD at lr 1, no clipping, a constant rate: its one step is
    the negative finished gradient; ``arguments`` override the TrainingArguments. The collator stacks the items'
    tensors unless ``data_collator`` is given."""
    return cls(
        model=torch.compile(module, backend="eager") if compiled else module,
        args=cases._arguments(
            str(folder),
            learning_rate=1.0,
            max_grad_norm=0.0,
            lr_scheduler_type="constant",
            remove_unused_columns=not compiled,  # Trainer reads the columns off the wrapper's forward
            **arguments,
        ),
        train_dataset=data,
        data_collator=data_collator or _stacked,
        compute_loss_func=compute_loss_func,
    )


def _tiny_bert(**overrides: Any) -> transformers.BertConfig:
    """A BERT small enough for a CPU test, without dropout (the float64 references replay its forward)."""
    options: dict[str, Any] = dict(
        vocab_size=cases.VOCAB,
        hidden_size=16,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.BertConfig(**{**options, **overrides})


@pytest.mark.parametrize("compiled", [False, True])
def test_a_head_that_computes_its_own_loss_is_averaged_not_summed(tmp_path: Path, compiled: bool) -> None:
    """BertForMaskedLM's forward takes **kwargs, and its loss_type ("ForMaskedLM") names a loss that takes
    num_items_in_batch, but the head computes CrossEntropyLoss() itself: a mean over its own micro-batch's masked
    tokens, whatever Trainer passes. GafusedTrainer weighs the means by their tokens: one window of 4 one-sequence
    micro-batches (SGD, lr 1, no clipping) must step by the token-weighted mean gradient, computed here in float64.
    Under torch.compile (whose wrapper's forward is only *args, **kwargs) the head's own forward is the one read."""
    config = _tiny_bert(num_hidden_layers=2, pad_token_id=cases.PAD)
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(config)
    assert model.loss_type == "ForMaskedLM" and not hasattr(model, "accepts_loss_kwargs")
    start = {name: p.detach().double().clone() for name, p in model.named_parameters()}
    truth = copy.deepcopy(model).double()
    data = _Masked()
    tokens = [int((item["labels"] != -100).sum()) for item in data.items]
    assert max(tokens) >= 5 * min(tokens), tokens
    grads = {name: torch.zeros_like(p) for name, p in start.items()}
    for item, count in zip(data.items, tokens, strict=True):
        truth.zero_grad()
        truth(input_ids=item["input_ids"][None], labels=item["labels"][None]).loss.backward()
        for name, p in truth.named_parameters():
            if p.grad is not None:
                grads[name] += p.grad * count / sum(tokens)

    def build(cls: type) -> transformers.Trainer:
        return _sgd_trainer(cls, model, tmp_path, data, compiled)

    assert build(transformers.Trainer).model_accepts_loss_kwargs is True  # Trainer's rule: the forward's **kwargs
    trainer = build(GafusedTrainer)
    assert trainer.model_accepts_loss_kwargs is False
    trainer.train()
    assert trainer.state.global_step == 1 and trainer.accumulator.normalization == "mean"
    error = _step_error(model, start, grads)
    assert error < 1e-5, error


class _Head(transformers.PreTrainedModel):
    """A stand-in masked-LM head (loss_type "ForMaskedLM", whose loss takes num_items_in_batch): the subclasses
    differ only in how their forward computes the loss."""

    config_class = transformers.PretrainedConfig

    def __init__(self) -> None:
        super().__init__(transformers.PretrainedConfig())
        self.score = torch.nn.Linear(2, 3)

    def forward(self, x, labels=None, **kwargs):
        raise NotImplementedError


class OwnForMaskedLM(_Head):
    def forward(self, x, labels=None, **kwargs):
        return torch.nn.functional.cross_entropy(self.score(x), labels)  # a mean: the count is never seen


class LossFunctionForMaskedLM(_Head):
    def forward(self, x, labels=None, **kwargs):
        return self.loss_function(self.score(x), labels, vocab_size=3, **kwargs)


class CountingForMaskedLM(_Head):
    def forward(self, x, labels=None, **kwargs):
        loss = torch.nn.functional.cross_entropy(self.score(x), labels, reduction="sum")
        return loss / kwargs["num_items_in_batch"]


class DelegatingForMaskedLM(_Head):
    def forward(self, x, labels=None, **kwargs):
        return LossFunctionForMaskedLM.forward(self, x, labels=labels, **kwargs)  # the callee may use the count


class OwnForSequenceClassification(_Head):
    def forward(self, x, labels=None, **kwargs):
        return self.loss_function(self.score(x), labels, config=self.config, **kwargs)


class _CustomGPT2(transformers.GPT2LMHeadModel):
    """A user's subclass of a causal LM of the auto mapping: the same forward and loss, another class name."""


class _UnmappedLossFunctionLM(_Head):
    """A model of no auto mapping whose forward calls ``self.loss_function`` and whose loss_type is unset:
    transformers falls back to the causal-LM loss, which shifts the labels."""

    def forward(self, x, labels=None, **kwargs):
        return self.loss_function(self.score(x), labels, vocab_size=3, **kwargs)


class _OwnLossFunctionAttribute(torch.nn.Module):
    """A plain module with a ``loss_function`` of its own (no shift): not transformers' fallback."""

    def __init__(self) -> None:
        super().__init__()
        self.score = torch.nn.Linear(4, 3)
        self.loss_function = torch.nn.CrossEntropyLoss()

    def forward(self, x, labels=None, **kwargs):
        return self.loss_function(self.score(x), labels)


def test_a_subclass_of_a_causal_lm_is_counted_after_the_shift(tmp_path: Path) -> None:
    """The class name alone missed a subclass of GPT2LMHeadModel (Trainer's count, one item per sequence too many);
    the classes it derives from are read too, and so is a forward calling transformers' loss function, which
    falls back to the causal-LM loss for a model without a loss_type."""
    from gafused.integrations.transformers import _computes_causal_lm_loss

    model = _CustomGPT2(cases.make_model().config)
    assert model.loss_type is None
    trainer = _trainer(tmp_path, model=model)
    batch = cases.collate([{"input_ids": torch.arange(1, 6)}, {"input_ids": torch.arange(1, 3)}])
    assert int(trainer.loss_items(batch)) == 4 + 1
    unmapped = _UnmappedLossFunctionLM()
    unmapped.loss_type = None
    assert _computes_causal_lm_loss(unmapped)
    assert not _computes_causal_lm_loss(_OwnLossFunctionAttribute())


def _bart_causal_lm() -> transformers.BartForCausalLM:
    """A tiny BartForCausalLM (no dropout): it declares loss_type="ForCausalLM" but computes CrossEntropyLoss()
    over every label itself, and its class is a causal LM of transformers' auto mapping."""
    config = transformers.BartConfig(
        vocab_size=cases.VOCAB,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=32,
        is_decoder=True,
        is_encoder_decoder=False,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        decoder_layerdrop=0.0,
    )
    torch.manual_seed(0)
    return transformers.BartForCausalLM(config)


def test_a_causal_head_with_its_own_unshifted_loss_counts_every_label(tmp_path: Path) -> None:
    """BartForCausalLM declares loss_type="ForCausalLM" (Trainer would count labels[..., 1:]) but its forward
    scores every label with CrossEntropyLoss(): each micro-batch's weight is all of its labels that are not -100."""
    model = _bart_causal_lm()
    assert model.loss_type == "ForCausalLM"
    assert _trainer(tmp_path, transformers.Trainer, model=model)._loss_shifts_labels  # Trainer's rule
    trainer = _trainer(tmp_path, model=model)
    assert trainer.model_accepts_loss_kwargs is False and trainer._loss_shifts_labels is False
    labels = torch.tensor([[5, 6, -100, 7], [8, -100, -100, -100]])
    assert int(trainer.loss_items({"labels": labels})) == 4  # the first label counts: it is scored


def _wav2vec2_ctc(reduction: str) -> transformers.Wav2Vec2ForCTC:
    """A tiny Wav2Vec2ForCTC (no dropout, no time or feature masking: an exact forward) with ``ctc_loss_reduction``."""
    config = transformers.Wav2Vec2Config(
        vocab_size=12,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        conv_dim=(8, 8),
        conv_kernel=(10, 3),
        conv_stride=(5, 2),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2,
        feat_extract_norm="layer",
        mask_time_prob=0.0,
        mask_feature_prob=0.0,
        layerdrop=0.0,
        hidden_dropout=0.0,
        activation_dropout=0.0,
        attention_dropout=0.0,
        feat_proj_dropout=0.0,
        final_dropout=0.0,
        ctc_loss_reduction=reduction,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.Wav2Vec2ForCTC(config)


class _Speech(torch.utils.data.Dataset):
    """Five clips of 400 samples (39 frames) transcribed by 1 to 14 tokens: in batches of 2 (the last of 1), the
    micro-batches' sequences (2, 2, 1) and label tokens differ."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(1)
        self.items = [
            {
                "input_values": torch.randn(400, generator=generator),
                "labels": torch.randint(1, 12, (n,), generator=generator),
            }
            for n in (2, 14, 1, 9, 5)
        ]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        return self.items[index]

    @staticmethod
    def collate(items: list[dict]) -> dict[str, torch.Tensor]:
        """The clips stacked, the transcripts right-padded with -100."""
        labels = torch.nn.utils.rnn.pad_sequence([item["labels"] for item in items], True, -100)
        return {"input_values": torch.stack([item["input_values"] for item in items]), "labels": labels}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_ctc_losses_are_weighed_by_their_reduction(tmp_path: Path, reduction: str) -> None:
    """Wav2Vec2ForCTC's loss (loss_type "ForCTC") takes no num_items_in_batch and follows ctc_loss_reduction: "mean"
    averages each sequence's loss over its target length, then over the sequences, so a micro-batch's mean weighs
    its sequences; "sum" is a plain sum, which summed over the window (Trainer's decision for the forward's
    **kwargs) is the big batch's. Weighed by label tokens, either was off (1.7e-1 and 9e-1). One window of 2, 2 and
    1 clips (SGD, lr 1, no clipping) must step by the float64 gradient of the CTC loss of all 5 clips at once."""
    model = _wav2vec2_ctc(reduction)
    data = _Speech()
    batch = _Speech.collate(data.items)
    start, grads = _big_batch_gradient(model, input_values=batch["input_values"].double(), labels=batch["labels"])

    trainer = _sgd_trainer(
        GafusedTrainer,
        model,
        tmp_path,
        data,
        False,
        data_collator=_Speech.collate,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=3,
    )
    trainer.train()
    error = _step_error(model, start, grads)
    assert error < 1e-5, error
    assert trainer.state.global_step == 1 and trainer.model_accepts_loss_kwargs is (reduction == "sum")
    assert trainer.accumulator.normalization == ("sum" if reduction == "sum" else "mean")


def test_a_ctc_sum_weighed_as_a_mean_is_refused(tmp_path: Path) -> None:
    """No weight makes a mean of sums their sum: ctc_loss_reduction="sum" with model_accepts_loss_kwargs False
    (declared on the model, or set on the Trainer before train()) is refused, and the refused train() builds
    nothing."""
    model = _wav2vec2_ctc("sum")
    model.accepts_loss_kwargs = False
    with pytest.raises(ValueError, match=r"ctc_loss_reduction='sum'.*\(loss_items\)"):
        _sgd_trainer(GafusedTrainer, model, tmp_path, _Speech(), False, data_collator=_Speech.collate)
    del model.accepts_loss_kwargs
    trainer = _sgd_trainer(GafusedTrainer, model, tmp_path, _Speech(), False, data_collator=_Speech.collate)
    trainer.model_accepts_loss_kwargs = False
    with pytest.raises(ValueError, match=r"ctc_loss_reduction='sum'.*model_accepts_loss_kwargs=True"):
        trainer.train()
    assert trainer.accumulator is None and trainer.state.global_step == 0


class _Answers(torch.utils.data.Dataset):
    """Five 12-token passages with answer spans; the fourth's start and end lie beyond the passage (position 12),
    which transformers' question-answering loss ignores."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(2)
        spans = [(1, 3), (4, 9), (0, 0), (12, 12), (7, 11)]
        self.items = [
            {
                "input_ids": torch.randint(3, cases.VOCAB, (12,), generator=generator),
                "start_positions": torch.tensor(start),
                "end_positions": torch.tensor(end),
            }
            for start, end in spans
        ]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        return self.items[index]


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_question_answering_losses_are_weighed_by_their_scored_sequences(tmp_path: Path, smoothing: float) -> None:
    """BertForQuestionAnswering's batches carry start_positions and end_positions, no labels (GafusedTrainer once
    refused them); its loss is the mean of a cross-entropy mean over the start positions and one over the end
    positions, each without the positions beyond the passage. One window of 3 and 2 passages (SGD, lr 1, no
    clipping), one of them unscored, must step by the float64 gradient of the loss of all 5 at once; a
    label_smoothing_factor changes nothing (Trainer smooths "labels" only: it failed at the first micro-batch). A
    passage with only one of its two positions scored has no exact weight, nor has a position past the text of a
    batch with an image (whose logits may cover image patches): refused, naming loss_items."""
    config = _tiny_bert(num_hidden_layers=1)
    torch.manual_seed(0)
    model = transformers.BertForQuestionAnswering(config)
    data = _Answers()
    start, grads = _big_batch_gradient(
        model, **{key: torch.stack([item[key] for item in data.items]) for key in data.items[0]}
    )

    trainer = _sgd_trainer(
        GafusedTrainer,
        model,
        tmp_path,
        data,
        False,
        per_device_train_batch_size=3,
        gradient_accumulation_steps=2,
        label_smoothing_factor=smoothing,
    )
    trainer.train()
    assert trainer.state.global_step == 1 and trainer.accumulator.normalization == "mean"
    error = _step_error(model, start, grads)
    assert error < 1e-5, error
    half_scored = {
        "input_ids": torch.ones(2, 12),
        "start_positions": torch.tensor([2, 12]),
        "end_positions": torch.tensor([3, 5]),
    }
    with pytest.raises(ValueError, match=r"start and end positions.*loss_items"):
        trainer.loss_items(half_scored)
    past_the_text = {**half_scored, "end_positions": torch.tensor([3, 12]), "pixel_values": torch.zeros(2, 3, 4, 4)}
    with pytest.raises(ValueError, match=r"'pixel_values' has a start or end position past the text.*loss_items"):
        trainer.loss_items(past_the_text)


class _TwoSequences(torch.utils.data.Dataset):
    """One sequence of 3 tokens and one of 12 (one label -100): one window of 2 micro-batches whose items differ
    4x, and by one per sequence whether the first label counts (2 + 10 after the shift, 3 + 11 without)."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(1)
        self.items = []
        for n in (3, 12):
            tokens = torch.randint(3, cases.VOCAB, (n,), generator=generator)
            labels = tokens.clone()
            if n > 3:
                labels[5] = -100
            self.items.append({"input_ids": tokens, "labels": labels})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        return self.items[index]


def _smoothed_sum(logits: torch.Tensor, labels: torch.Tensor, epsilon: float, shift: bool) -> torch.Tensor:
    """The label-smoothed cross-entropy summed over the labels that are not -100 (after the shift by one when
    ``shift``): (1 - epsilon) * nll + epsilon * the mean over the vocabulary of -log p, per scored label."""
    if shift:
        logits, labels = logits[..., :-1, :], labels[..., 1:]
    log_p = torch.log_softmax(logits, dim=-1)
    scored = labels != -100
    nll = -log_p.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return ((1 - epsilon) * nll - epsilon * log_p.mean(-1))[scored].sum()


def _causal_loss_func(outputs, labels, num_items_in_batch=None):
    """A compute_loss_func of the user's: the causal-LM cross-entropy summed after the shift, over Trainer's count."""
    return _smoothed_sum(outputs.logits, labels, 0.0, shift=True) / num_items_in_batch


def _smoothed_truth(
    model: torch.nn.Module, data: Any, epsilon: float, shift: bool
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The model's float64 start, and the gradient of the token mean of the label-smoothed loss (labels shifted or
    not) over every sequence of ``data`` at once."""
    start = {name: p.detach().double().clone() for name, p in model.named_parameters()}
    truth = copy.deepcopy(model).double()
    items = sum(int((item["labels"][1:] if shift else item["labels"]).ne(-100).sum()) for item in data.items)
    total = sum(
        _smoothed_sum(truth(input_ids=item["input_ids"][None]).logits, item["labels"][None], epsilon, shift)
        for item in data.items
    )
    (total / items).backward()
    return start, {name: p.grad if p.grad is not None else torch.zeros_like(p) for name, p in truth.named_parameters()}


@pytest.mark.parametrize(
    ("how", "compiled", "shift", "gpt2"),
    [
        ("label_smoothing", False, True, False),
        ("label_smoothing", True, False, False),
        ("compute_loss_func", False, True, False),
        ("compute_loss_func", False, True, True),
    ],
    ids=["label-smoothing", "label-smoothing-compiled", "compute-loss-func", "compute-loss-func-gpt2"],
)
def test_a_loss_trainer_computes_is_counted_like_trainer_counts_it(
    tmp_path: Path, how: str, compiled: bool, shift: bool, gpt2: bool
) -> None:
    """With label_smoothing_factor or a compute_loss_func, Trainer pops the labels and computes the loss itself,
    whatever the model's forward does with them (BartForCausalLM's own loss keeps every label). Its LabelSmoother
    shifts the labels for a class of transformers' causal-LM auto mapping, read off the model compute_loss gets
    (under torch.compile its wrapper's class, which is none: no shift); a compute_loss_func divides by Trainer's
    num_items_in_batch, counted after the shift for loss_type="ForCausalLM". One window of a 3-token and a
    12-token micro-batch (SGD, lr 1, no clipping) must step by the float64 gradient of the window's token mean of
    that loss, like plain Trainer does; counting the items the way the model's own loss would (3 : 12 for a
    13-item loss) is 1e-1 off. A GPT2LMHeadModel leaves loss_type unset: plain Trainer counts its items before
    the shift, and a compute_loss_func over its labels, which shifts them, is divided by one item per sequence
    too many there; GafusedTrainer counts after the shift."""
    epsilon = 0.1 if how == "label_smoothing" else 0.0
    data = _TwoSequences()
    model = cases.make_model() if gpt2 else _bart_causal_lm()
    start, grads = _smoothed_truth(model, data, epsilon, shift)

    def build(cls: type, module: torch.nn.Module) -> transformers.Trainer:
        return _sgd_trainer(
            cls,
            module,
            tmp_path,
            data,
            compiled,
            compute_loss_func=_causal_loss_func if how == "compute_loss_func" else None,
            gradient_accumulation_steps=2,
            label_smoothing_factor=epsilon,
        )

    if not compiled:  # plain Trainer is exact here too (compiled, it counts after the shift the smoother skips)
        plain = copy.deepcopy(model)
        build(transformers.Trainer, plain).train()
        assert (_step_error(plain, start, grads) < 1e-5) is not gpt2  # GPT-2: plain counts before the shift
    trainer = build(GafusedTrainer, model)
    trainer.train()
    assert trainer.state.global_step == 1
    error = _step_error(model, start, grads)
    assert error < 1e-5, error
    assert trainer._loss_shifts_labels is shift


@pytest.mark.parametrize("causal", [True, False])
def test_label_smoothing_counts_the_labels_the_smoother_scores(tmp_path: Path, causal: bool) -> None:
    """The LabelSmoother scores ``labels`` (after the shift for a causal LM of the auto mapping, before it for
    BertForMaskedLM), never a batch's ``shift_labels``: both the per-micro-batch weight (loss_items) and the window's
    num_items_in_batch Trainer hands it count those."""
    if causal:
        model = _bart_causal_lm()
    else:
        config = transformers.BertConfig(
            vocab_size=cases.VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
        )
        model = transformers.BertForMaskedLM(config)
    trainer = _trainer(tmp_path, model=model, label_smoothing_factor=0.1)
    labels = torch.tensor([[5, 6, -100, 7], [8, -100, -100, -100]])
    batch = {"input_ids": labels.clamp(min=0), "labels": labels, "shift_labels": torch.full_like(labels, -100)}
    expected = 2 if causal else 4
    assert int(trainer.loss_items(batch)) == expected
    assert int(trainer._get_num_items_in_batch([batch, batch], torch.device("cpu"))) == 2 * expected


class OwnShiftingForCausalLM(_Head):
    def forward(self, x, labels=None, **kwargs):
        logits = self.score(x)
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


class OwnShiftingWithoutKwargs(_Head):
    """A hand-written causal LM as nanoGPT writes it: no ``**kwargs`` (Trainer passes it no count), its own loss."""

    def forward(self, x, attention_mask=None, labels=None):
        logits = self.score(x)
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


class HandingLabelsOn(_Head):
    """A wrapper that hands ``labels`` to another model: its loss is that model's, not its own."""

    def forward(self, x, labels=None):
        return OwnShiftingWithoutKwargs.forward(self, x, labels=labels)


class HandingLabelsOnWithKwargs(_Head):
    """The same with ``**kwargs`` in its signature, kept to itself (the count never reaches the other model)."""

    def forward(self, x, labels=None, **kwargs):
        return OwnShiftingWithoutKwargs.forward(self, x, labels=labels)


@pytest.mark.parametrize(
    ("head", "shifts"),
    [
        (OwnForMaskedLM, False),
        (OwnShiftingForCausalLM, True),
        (OwnShiftingWithoutKwargs, True),
        (LossFunctionForMaskedLM, None),
        (HandingLabelsOn, None),
        (HandingLabelsOnWithKwargs, None),
    ],
)
def test_an_own_loss_is_counted_over_the_labels_its_forward_keeps(head: type, shifts: bool | None) -> None:
    """After the shift only when the forward slices labels from 1, with or without ``**kwargs`` in its signature;
    None (Trainer's rule) for transformers' loss, or for labels handed to another module."""
    from gafused.integrations.transformers import _own_loss_shifts_labels

    assert _own_loss_shifts_labels(head.forward) is shifts


def test_an_unreadable_forward_keeps_trainers_decision() -> None:
    """A forward whose __wrapped__ chain is a cycle (inspect.unwrap raises ValueError) cannot be read."""
    from gafused.integrations.transformers import _forward_loss

    def forward(self, x, labels=None, **kwargs):
        return x

    forward.__wrapped__ = forward
    assert _forward_loss(forward) == "unknown"


@pytest.mark.parametrize(
    ("head", "ignores"),
    [
        (OwnForMaskedLM, True),
        (LossFunctionForMaskedLM, False),
        (CountingForMaskedLM, False),
        (DelegatingForMaskedLM, False),
        (OwnForSequenceClassification, True),  # transformers' loss for it takes no num_items_in_batch
    ],
)
def test_which_losses_ignore_the_item_count(head: type, ignores: bool) -> None:
    """Read from the forward: a loss it computes itself never sees num_items_in_batch; transformers' loss function
    does when the loss for its loss_type takes it; a forward that names the count, or hands labels on together with
    **kwargs, may use it. A declared accepts_loss_kwargs decides, as in Trainer."""
    from gafused.integrations.transformers import _loss_ignores_item_count

    model = head()
    assert _loss_ignores_item_count(model) is ignores
    model.accepts_loss_kwargs = True
    assert _loss_ignores_item_count(model) is False


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"accumulator_options": {"max_grad_norm": 1.0}}, ValueError, "max_grad_norm is configured twice"),
        ({"accumulator_options": {"normalization": "sum"}}, ValueError, r"accumulator_options\['normalization'\]"),
        ({"accumulator_options": {"bucket": 1}}, ValueError, r"accumulator_options\['bucket'\]: unknown"),
        ({"accumulator_options": ["backend"]}, TypeError, "accumulator_options must be a mapping"),
        ({"fp16": True}, ValueError, "fp16=True: GafusedTrainer does not support fp16 loss scaling"),
        # Refused at construction as GradAccumulator would refuse them, before Trainer wraps the model.
        ({"accumulator_options": {"backend": "nope"}}, ValueError, "accumulator_options: backend must be one of"),
        ({"accumulator_options": {"bucket_bytes": -1}}, ValueError, "accumulator_options: bucket_bytes must be"),
        ({"accumulator_options": {"accum_dtype": torch.float16}}, ValueError, "accumulator_options: accum_dtype"),
        (
            {"accumulator_options": {"reduce_dtype": torch.bfloat16}},
            ValueError,
            r"accumulator_options\['reduce_dtype'\] is the dtype DDP's buckets .* one process",
        ),
    ],
    ids=[
        "clipping-twice",
        "decided-option",
        "unknown-option",
        "not-a-mapping",
        "fp16",
        "backend",
        "bucket_bytes",
        "accum_dtype",
        "reduce_dtype-one-process",
    ],
)
def test_bad_configuration_is_refused(tmp_path: Path, kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        _trainer(tmp_path, **kwargs)


def test_a_gradaccumulator_as_the_optimizer_is_refused(tmp_path: Path) -> None:
    model = cases.make_model()
    accumulator = gafused.GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), None)
    with pytest.raises(TypeError, match="pass the inner optimizer"):
        _trainer(tmp_path, model=model, optimizers=(accumulator, None))


def test_clipping_configured_in_the_accumulator_options(tmp_path: Path) -> None:
    """max_grad_norm given in accumulator_options (TrainingArguments' off) clips every window: the run equals plain
    Trainer clipping at the same norm (every window clipped, so Trainer's item count, a per-window factor, drops out
    of the direction)."""
    options = {"max_grad_norm": 0.25, "backend": "reference"}
    trainer = _trainer(tmp_path / "gafused", max_grad_norm=0.0, max_steps=2, accumulator_options=options)
    trainer.train()
    assert trainer.accumulator.max_grad_norm == 0.25 and trainer.accumulator.backend == "reference"
    norms = [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]
    assert len(norms) == 2 and min(norms) > 0.25  # every window is above the threshold
    plain = _trainer(tmp_path / "plain", transformers.Trainer, max_grad_norm=0.25, max_steps=2)
    plain.train()
    start = [p.detach() for p in cases.make_model().parameters()]
    ours, theirs = list(trainer.model.parameters()), list(plain.model.parameters())
    moved = sum(float((p - s).square().sum()) for p, s in zip(theirs, start, strict=True))
    apart = sum(float((p - q).square().sum()) for p, q in zip(ours, theirs, strict=True))
    assert (apart / moved) ** 0.5 < FP32_ERROR


def test_a_float64_model_logs_the_float64_norm(tmp_path: Path) -> None:
    """A float64 model's window norm is float64 (as clip_grad_norm_ gives it to plain Trainer); the log holds it
    unrounded, each window's equal to the float64 norm of the accumulator's finished gradient."""
    norms = []

    class _Norms(transformers.TrainerCallback):
        def on_optimizer_step(self, args, state, control, **kwargs):
            norms.append(trainer.accumulator.grad_norm.item())

    trainer = _trainer(tmp_path, model=cases.make_model().double(), max_grad_norm=0.0, max_steps=2)
    trainer.add_callback(_Norms())
    trainer.train()
    assert trainer.accumulator.grad_norm.dtype == torch.float64
    logged = [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]
    assert len(norms) == 2 and logged == norms
    assert any(norm != float(torch.tensor(norm, dtype=torch.float32)) for norm in norms)  # float32 would round them


def test_an_infinite_max_grad_norm_logs_the_norm_and_never_clips(tmp_path: Path) -> None:
    """TrainingArguments(max_grad_norm=inf), Trainer's way to log the norm without clipping, trains as max_grad_norm=0
    (bitwise) and logs every window's norm; it was refused when training started (the accumulator's must be finite)."""
    runs = {}
    for norm in (float("inf"), 0.0):
        trainer = _trainer(tmp_path / str(norm), max_grad_norm=norm, max_steps=2)
        trainer.train()
        assert trainer.accumulator.max_grad_norm is None
        norms = [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]
        runs[norm] = norms, [p.detach().clone() for p in trainer.model.parameters()]
    (norms, params), (norms_off, params_off) = runs[float("inf")], runs[0.0]
    assert len(norms) == 2 and all(0 < value < float("inf") for value in norms) and norms == norms_off
    assert all(torch.equal(p, q) for p, q in zip(params, params_off, strict=True))


def test_arguments_changed_after_construction_are_the_ones_trained_with(tmp_path: Path) -> None:
    """hyperparameter_search sets a trial's TrainingArguments on a built Trainer: the accumulator is built from
    them when training starts, as plain Trainer reads them then, so both clip at the trial's max_grad_norm."""
    trained = {}
    for cls in (transformers.Trainer, GafusedTrainer):
        trainer = _trainer(tmp_path / cls.__name__, cls, max_steps=3)  # built with max_grad_norm=0.7
        trainer.args.max_grad_norm = 0.05
        trainer.train()
        norms = [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]
        assert len(norms) == 3 and min(norms) > 0.05  # every window clipped
        trained[cls] = [p.detach().clone() for p in trainer.model.parameters()]
    assert trainer.accumulator.max_grad_norm == 0.05
    start = [p.detach() for p in cases.make_model().parameters()]
    moved = sum(float((p - s).square().sum()) for p, s in zip(trained[transformers.Trainer], start, strict=True))
    apart = sum(
        float((p - q).square().sum())
        for p, q in zip(trained[GafusedTrainer], trained[transformers.Trainer], strict=True)
    )
    assert (apart / moved) ** 0.5 < FP32_ERROR
    trainer.args.fp16 = True  # and a trial's refused setting is refused when training starts
    with pytest.raises(ValueError, match="fp16=True: GafusedTrainer does not support fp16"):
        trainer.train()


def _recorder(trainer: transformers.Trainer, records: list) -> Any:
    """A forward pre-hook that records each training micro-batch with its optimizer step (labels rebuilt from the
    mask, as ``cases.collate`` builds them: Trainer pops them for a compute_loss_func)."""

    def record(module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if module.training:
            ids, mask = kwargs["input_ids"].detach().clone(), kwargs["attention_mask"].detach().clone()
            batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
            records.append((trainer.state.global_step, batch))

    return record


@pytest.mark.parametrize("changed", ["model_accepts_loss_kwargs", "compute_loss_func"])
def test_loss_settings_changed_after_construction_are_the_ones_trained_with(tmp_path: Path, changed: str) -> None:
    """Trainer reads model_accepts_loss_kwargs and compute_loss_func at each step; set on a built GafusedTrainer,
    they decide when training starts whether the accumulator sums or averages (it once failed at the first
    micro-batch). model_accepts_loss_kwargs=False on a model that takes num_items_in_batch: each loss is a token
    mean over its micro-batch, weighed by its tokens; a compute_loss_func (the token sum / num_items_in_batch) on
    a model that takes no loss kwargs: summed. Both train on the float64 big batches' token mean."""
    model = cases.make_model()
    if changed == "model_accepts_loss_kwargs":
        model.loss_type = "ForCausalLM"
    else:
        model.accepts_loss_kwargs = False
    trainer = _trainer(tmp_path, model=model, max_steps=2)
    if changed == "model_accepts_loss_kwargs":
        trainer.model_accepts_loss_kwargs = False
    else:
        trainer.compute_loss_func = _causal_loss_func
    records: list = []
    model.register_forward_pre_hook(_recorder(trainer, records), with_kwargs=True)
    trainer.train()
    assert trainer.accumulator.normalization == ("mean" if changed == "model_accepts_loss_kwargs" else "sum")
    reference = cases.truth(cases.windows_of([records]))
    assert cases.error([p.detach() for p in model.parameters()], reference) <= FP32_ERROR


def test_a_batch_size_retry_after_out_of_memory_drops_the_open_window(tmp_path: Path) -> None:
    """auto_find_batch_size=True: an out-of-memory error in a window's second micro-batch (batch size 4) makes
    Trainer start its loop again at batch size 3, dropping p.grad; the open window goes too (GafusedTrainer once
    refused the retry, naming a previous train() call). The run equals the float64 big batches of the windows
    trained after the retry."""
    model = cases.make_model()
    trainer = _trainer(tmp_path, model=model, auto_find_batch_size=True, per_device_train_batch_size=4)
    records: list = []
    record = _recorder(trainer, records)

    def out_of_memory(module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if module.training and kwargs["input_ids"].shape[0] == 4 and len(records) == 1:
            records.clear()  # the retried loop starts from the first window
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        record(module, args, kwargs)

    model.register_forward_pre_hook(out_of_memory, with_kwargs=True)
    trainer.train()
    windows = cases.windows_of([records])
    assert trainer._train_batch_size == 3 and [len(window) for window in windows] == [4, 4]
    reference = cases.truth(windows)
    assert cases.error([p.detach() for p in model.parameters()], reference) <= FP32_ERROR


def test_a_plain_trainer_checkpoint_resumes_in_gafused_trainer(tmp_path: Path) -> None:
    """Trainer's optimizer.pt holds the inner optimizer's state after a window's step: it loads with an empty window."""
    model = cases.make_model()
    plain = _trainer(
        tmp_path,
        transformers.Trainer,
        model=model,
        optim="adamw_torch",
        max_steps=2,
        save_steps=2,
        save_strategy="steps",
    )
    plain.train()
    trainer = _trainer(tmp_path, optim="adamw_torch", max_steps=3)
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    steps = {int(state["step"]) for state in trainer.accumulator.optimizer.state.values()}
    assert steps == {3} and trainer.state.global_step == 3  # 2 steps restored from the checkpoint, 1 more here


def test_a_gafused_trainer_checkpoint_resumes_in_plain_trainer(tmp_path: Path) -> None:
    """GafusedTrainer's optimizer.pt is the inner optimizer's state_dict plus a "gafused" entry: plain Trainer loads
    it as its own."""
    trainer = _trainer(tmp_path, optim="adamw_torch", max_steps=2, save_steps=2, save_strategy="steps")
    trainer.train()
    plain = _trainer(tmp_path, transformers.Trainer, model=cases.make_model(), optim="adamw_torch", max_steps=3)
    plain.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    steps = {int(state["step"]) for state in plain.optimizer.state.values()}
    assert steps == {3} and plain.state.global_step == 3


class _Stream(torch.utils.data.IterableDataset):
    """The first 6 sequences, as a stream: a pass of 6 micro-batches ends with a window of 4 half done."""

    def __iter__(self):
        return iter([cases.Sequences()[index] for index in range(6)])


class _OpenAtSave(transformers.TrainerCallback):
    """The accumulator's open micro-batches at each checkpoint Trainer writes."""

    def __init__(self) -> None:
        self.open: list[int] = []
        self.trainer: GafusedTrainer | None = None

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.open.append(self.trainer.accumulator.micro_step)


def _streamed(tmp_path: Path, name: str) -> tuple[GafusedTrainer, _OpenAtSave]:
    args = cases._arguments(str(tmp_path / name), max_steps=3, save_strategy="epoch", logging_strategy="no")
    trainer = GafusedTrainer(model=cases.make_model(), args=args, train_dataset=_Stream(), data_collator=cases.collate)
    seen = _OpenAtSave()
    seen.trainer = trainer
    trainer.add_callback(seen)
    return trainer, seen


def test_a_checkpoint_written_with_a_window_open_resumes_bitwise(tmp_path: Path) -> None:
    """At the end of a pass over an IterableDataset Trainer carries the open window into the next pass and writes its
    epoch checkpoint there; a resume runs that window's micro-batches again, so the checkpoint holds the state of the
    window's start (saved with the window, they would fold twice)."""
    full, seen = _streamed(tmp_path, "full")
    full.train()
    assert seen.open[0] == 2  # the first pass ended with 2 of the window's 4 micro-batches folded
    saved = torch.load(tmp_path / "full" / "checkpoint-1" / "optimizer.pt", weights_only=False)
    assert saved["gafused"]["micro_step"] == 0 and "segments" not in saved["gafused"]["buffers"][0]
    resumed, _ = _streamed(tmp_path, "resumed")
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-1"))
    assert resumed.state.global_step == full.state.global_step == 3
    for mine, theirs in zip(resumed.model.parameters(), full.model.parameters(), strict=True):
        assert torch.equal(mine, theirs)


def test_a_training_step_that_runs_its_own_backward_is_refused_before_the_optimizer_steps(tmp_path: Path) -> None:
    """A subclass's training_step that runs accelerator.backward without GafusedTrainer.training_step would leave
    the accumulator nothing to finish: refused at the window's optimizer.step(), naming the cause."""

    class OwnStep(GafusedTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = self.compute_loss(model, self._prepare_inputs(inputs), num_items_in_batch=num_items_in_batch)
            self.accelerator.backward(loss)
            return loss.detach()

    model = cases.make_model()
    before = copy.deepcopy(model.state_dict())
    trainer = _trainer(tmp_path, OwnStep, model=model, max_steps=1)
    with pytest.raises(RuntimeError, match=r"must call super\(\)\.training_step.*The optimizer did not step"):
        trainer.train()
    assert trainer.state.global_step == 0
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())


def test_loss_items_need_labels(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="override GafusedTrainer.loss_items"):
        _trainer(tmp_path).loss_items({"input_ids": torch.ones(1, 3, dtype=torch.long)})


def test_question_answering_loss_items_need_tensors_and_the_sequences_length(tmp_path: Path) -> None:
    """A question-answering batch is counted from tensors, and its positions beyond the sequence (which the loss
    ignores) are known only from 'input_ids' or 'attention_mask': without them, or with a position given as a list,
    loss_items refuses, naming what to override."""
    trainer = _trainer(tmp_path)
    with pytest.raises(TypeError, match=r"inputs\['start_positions'\] must be a tensor to count loss items, got list"):
        trainer.loss_items({"start_positions": [1, 2], "end_positions": torch.tensor([2, 3])})
    no_tokens = {"start_positions": torch.tensor([1, 2]), "end_positions": torch.tensor([2, 3])}
    with pytest.raises(
        ValueError, match=r"without 'input_ids' or 'attention_mask'.*override GafusedTrainer\.loss_items"
    ):
        trainer.loss_items(no_tokens)
    assert int(trainer.loss_items({**no_tokens, "attention_mask": torch.ones(2, 4, dtype=torch.long)})) == 2


def test_training_step_before_train_is_refused(tmp_path: Path) -> None:
    """The accumulator is built by train(): a training_step() called on its own has no window to fold into."""
    trainer = _trainer(tmp_path)
    with pytest.raises(RuntimeError, match=r"training_step\(\): the GradAccumulator is built by train\(\)"):
        trainer.training_step(trainer.model, {"labels": torch.ones(1, 3, dtype=torch.long)})
    assert trainer.accumulator is None


def test_a_non_finite_window_is_skipped_and_does_not_step_the_scheduler(tmp_path: Path) -> None:
    model = cases.make_model()
    trainer = _trainer(tmp_path, model=model, max_steps=4)
    weight = model.transformer.wte.weight
    seen: dict[int, torch.Tensor] = {}  # the weight at the first backward of each window

    def poison(grad: torch.Tensor) -> torch.Tensor:
        seen.setdefault(trainer.state.global_step, weight.detach().clone())
        if trainer.state.global_step == 1:  # every micro-batch of the second window
            return torch.full_like(grad, float("nan"))
        return grad

    weight.register_hook(poison)
    trainer.train()
    windows = trainer.state.global_step
    assert trainer.accumulator.skipped_steps == 1
    assert trainer.lr_scheduler.last_epoch == windows - 1  # the skipped window did not step it
    norms = [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]
    assert not torch.isfinite(torch.tensor(norms[1])) and all(torch.isfinite(torch.tensor(norms[:1] + norms[2:])))
    assert torch.equal(seen[1], seen[2]) and not torch.equal(seen[0], seen[1])  # the window changed nothing


def test_an_older_trainer_is_refused_naming_the_version_it_needs() -> None:
    from gafused.integrations.transformers import _check_trainer_internals

    class OldTrainer:  # a Trainer from before loss_is_scaled_for_ga
        compute_loss_func = None

    with pytest.raises(RuntimeError, match=rf"transformers >= {TRANSFORMERS_MIN_VERSION} .* loss_is_scaled_for_ga"):
        _check_trainer_internals(OldTrainer, ("compute_loss_func", "loss_is_scaled_for_ga"))
    # The extra that installs transformers asks for the same version.
    setup = (Path(__file__).resolve().parents[1] / "setup.py").read_text()
    assert f'"transformers>={TRANSFORMERS_MIN_VERSION}"' in setup


@pytest.mark.parametrize(
    ("arguments", "options", "match"),
    [
        ({"fp16": True}, None, "fp16=True: GafusedTrainer does not support fp16"),
        ({"fsdp": "full_shard"}, None, "fsdp: GafusedTrainer does not support FSDP"),
        ({"n_gpu": 2}, None, "n_gpu=2: GafusedTrainer does not support torch.nn.DataParallel"),
        (None, {"max_grad_norm": 0.5}, r"configured twice: TrainingArguments\(max_grad_norm=1.0\)"),
        (None, {"reduce_dtype": torch.bfloat16}, r"accumulator_options\['reduce_dtype'\] .* one process"),
    ],
    ids=["fp16", "fsdp", "dataparallel", "clipping-twice-without-args", "reduce_dtype-without-args"],
)
def test_refusals_the_arguments_decide_leave_the_rng_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arguments: dict | None, options: dict | None, match: str
) -> None:
    """Refused before Trainer builds anything (it seeds the global RNG): the refused call leaves the RNG as it was.
    Without args= Trainer makes its own TrainingArguments (clipping at 1.0): gafused makes the same ones first
    (reduce_dtype in one process was once refused only when training started, after Trainer's seeding)."""
    monkeypatch.chdir(tmp_path)  # where Trainer's default output_dir would go
    model = cases.make_model()
    extra: dict[str, Any] = {} if options is None else {"accumulator_options": options}
    if arguments is not None:
        arguments = dict(arguments)
        n_gpu = arguments.pop("n_gpu", None)
        extra["args"] = cases._arguments(str(tmp_path), **arguments)
        if n_gpu is not None:
            extra["args"]._n_gpu = n_gpu  # what TrainingArguments sets up with 2 visible GPUs: DataParallel
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    with pytest.raises(ValueError, match=match):
        GafusedTrainer(model=model, train_dataset=cases.Sequences(), data_collator=cases.collate, **extra)
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize(
    ("enabled", "match"),
    [
        ("is_fsdp_enabled", "fsdp: GafusedTrainer does not support FSDP"),
        ("is_deepspeed_enabled", "deepspeed: GafusedTrainer does not support DeepSpeed"),
        ("get_tp_size", "parallelism_config: GafusedTrainer supports data parallelism"),
        ("get_cp_size", "parallelism_config: GafusedTrainer supports data parallelism"),
        ("get_sp_size", "parallelism_config: GafusedTrainer supports data parallelism"),
    ],
)
def test_what_accelerates_configuration_enables_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, enabled: str, match: str
) -> None:
    """FSDP, DeepSpeed, tensor/context/sequence parallelism from Accelerate's configuration (not TrainingArguments)."""
    if enabled.startswith("get_"):
        monkeypatch.setattr(transformers.Trainer, enabled, lambda self: 2)
    else:
        create = transformers.Trainer.create_accelerator_and_postprocess

        def create_enabled(self: transformers.Trainer) -> None:
            create(self)
            setattr(self, enabled, True)

        monkeypatch.setattr(transformers.Trainer, "create_accelerator_and_postprocess", create_enabled)
    with pytest.raises(ValueError, match=match):
        _trainer(tmp_path)


def _unchanged(model: torch.nn.Module, start: list[torch.Tensor]) -> bool:
    return all(torch.equal(p, s) for p, s in zip(model.parameters(), start, strict=True))


def test_an_accelerator_with_a_grad_scaler_is_refused_when_training_starts(tmp_path: Path) -> None:
    model = cases.make_model()
    start = [p.detach().clone() for p in model.parameters()]
    trainer = _trainer(tmp_path, model=model, max_steps=1)
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu")  # fp16 from Accelerate's configuration
    with pytest.raises(ValueError, match="mixed_precision: GafusedTrainer does not support fp16 loss scaling"):
        trainer.train()
    assert trainer.accumulator is None and trainer.state.global_step == 0 and _unchanged(model, start)


class _BackwardOfItsOwn(transformers.Trainer):
    def training_step(self, model, inputs, num_items_in_batch=None):
        model.train()
        loss = self.compute_loss(model, self._prepare_inputs(inputs), num_items_in_batch=num_items_in_batch)
        loss.backward()  # not accelerator.backward
        return loss.detach()


def test_a_training_step_that_bypasses_accelerator_backward_is_refused(tmp_path: Path) -> None:
    class Mixed(GafusedTrainer, _BackwardOfItsOwn):
        pass

    model = cases.make_model()
    start = [p.detach().clone() for p in model.parameters()]
    trainer = _trainer(tmp_path, Mixed, model=model, max_steps=1)
    with pytest.raises(RuntimeError, match="Trainer ran no accelerator.backward for this micro-batch"):
        trainer.train()
    assert trainer.state.global_step == 0 and trainer.accumulator.micro_step == 0 and _unchanged(model, start)


class _Unlabelled(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.items = [{"x": row} for row in torch.randn(4, 4, generator=torch.Generator().manual_seed(2))]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        return self.items[index]


class _LossWithoutLabels(torch.nn.Module):
    """Takes **kwargs (Trainer: its loss is normalized by num_items_in_batch) but has no labels to count."""

    def __init__(self) -> None:
        super().__init__()
        self.score = torch.nn.Linear(4, 1)

    def forward(self, x, **kwargs):
        return {"loss": self.score(x).square().mean()}


def test_a_batch_without_labels_for_a_model_that_takes_the_count_is_refused(tmp_path: Path) -> None:
    """No labels: Trainer passes no num_items_in_batch and divides by the micro-batch count, a per-micro-batch
    mean the summing accumulator would add up. Refused before any backward."""
    model = _LossWithoutLabels()
    start = [p.detach().clone() for p in model.parameters()]
    trainer = _sgd_trainer(GafusedTrainer, model, tmp_path, _Unlabelled(), False, gradient_accumulation_steps=2)
    assert trainer.model_accepts_loss_kwargs is True
    with pytest.raises(RuntimeError, match="a batch without 'labels' gives Trainer no num_items_in_batch"):
        trainer.train()
    assert trainer.accumulator.micro_step == 0 and _unchanged(model, start)


def test_loss_items_count_a_batchs_shift_labels_and_a_ctc_heads_sequences_only_for_its_own_loss(
    tmp_path: Path,
) -> None:
    labels = torch.tensor([[5, 6, 7, 8], [9, 10, -100, -100]])
    shift_labels = torch.tensor([[6, -100, 8, -100], [10, -100, -100, -100]])
    batch = {"input_ids": labels.clamp(min=0), "labels": labels, "shift_labels": shift_labels}
    assert int(_trainer(tmp_path).loss_items(batch)) == 3  # not labels[..., 1:]: 4
    data = _Speech()
    speech = _Speech.collate(data.items[:2])  # transcripts of 2 and 14 tokens
    trainer = _sgd_trainer(GafusedTrainer, _wav2vec2_ctc("mean"), tmp_path, data, False, data_collator=_Speech.collate)
    assert int(trainer.loss_items(speech)) == 2  # ctc_loss_reduction="mean": the sequences
    trainer.compute_loss_func = lambda outputs, labels, num_items_in_batch=None: outputs.logits.sum()
    assert int(trainer.loss_items(speech)) == 16  # the user's loss: its labels


def test_label_smoothing_under_trainers_own_torch_compile_is_counted_like_trainer_counts_it(tmp_path: Path) -> None:
    """torch_compile=True: Accelerate compiles the model as training starts; compute_loss gets the compiled wrapper,
    no causal LM's class, so Trainer's LabelSmoother scores every label (no shift), unlike for the model as built."""
    epsilon, data, model = 0.1, _TwoSequences(), _bart_causal_lm()
    start, grads = _smoothed_truth(model, data, epsilon, False)
    trainer = _sgd_trainer(
        GafusedTrainer,
        model,
        tmp_path,
        data,
        False,
        gradient_accumulation_steps=2,
        label_smoothing_factor=epsilon,
        torch_compile=True,
        torch_compile_backend="eager",
    )
    assert trainer._loss_shifts_labels is True  # the model as built
    trainer.train()
    error = _step_error(model, start, grads)  # counted after the shift the smoother skips: 1.7e-1
    assert error < 1e-5, error
    assert trainer.state.global_step == 1 and trainer._loss_shifts_labels is False


def test_accelerator_backward_is_its_own_again_after_training_and_after_a_failed_step(tmp_path: Path) -> None:
    model = cases.make_model()
    trainer = _trainer(tmp_path, model=model, max_steps=1)
    trainer.train()
    assert "backward" not in vars(trainer.accelerator)
    model.zero_grad(set_to_none=True)
    trainer.accelerator.backward(model(**cases.collate([{"input_ids": torch.arange(1, 6)}])).loss)
    assert trainer.accumulator.micro_step == 0 and all(p.grad is not None for p in model.parameters())

    model = cases.make_model()
    trainer = _trainer(tmp_path / "failed", model=model, max_steps=2)

    def fail(module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if module.training:
            raise RuntimeError("a failing forward")

    model.register_forward_pre_hook(fail, with_kwargs=True)
    with pytest.raises(RuntimeError, match="a failing forward"):
        trainer.train()
    assert "backward" not in vars(trainer.accelerator)


def test_accumulator_options_are_the_ones_checked_at_construction(tmp_path: Path) -> None:
    options = {"backend": "reference"}
    trainer = _trainer(tmp_path, max_steps=1, accumulator_options=options)
    options["backend"] = "nope"  # the caller's mapping changed after the check
    options["normalization"] = "sum"
    trainer.train()
    assert trainer.accumulator.backend == "reference"


class _WrappedCausalLM(torch.nn.Module):
    """A model of the user's around a causal LM, handing the labels and Trainer's loss kwargs on: Trainer counts its
    items before the causal shift (it declares no loss_type), which its loss then divides by."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = cases.make_model()

    def forward(self, input_ids, attention_mask=None, labels=None, **kwargs):  # noqa: ANN001, ANN003, ANN201
        return self.lm(input_ids=input_ids, attention_mask=attention_mask, labels=labels, **kwargs)


class _CountingAfterTheShift(GafusedTrainer):
    def loss_items(self, inputs: dict) -> torch.Tensor:
        return inputs["labels"][..., 1:].ne(-100).sum()


def _first_window() -> torch.utils.data.Dataset:
    """cases.Sequences' first window: 4 sequences of 2 to 31 tokens, one window whatever order Trainer draws them in."""
    return torch.utils.data.Subset(cases.Sequences(), range(cases.GA))


def _first_window_truth(model: torch.nn.Module, lm: torch.nn.Module) -> tuple[dict, dict]:
    """The float64 token-mean gradient of the causal-LM loss over cases.Sequences' first window (``lm`` is the
    causal LM inside ``model``), by ``model``'s parameter names."""
    start = {name: p.detach().double().clone() for name, p in model.named_parameters()}
    window = [cases.collate([item]) for item in _first_window()]
    truth = copy.deepcopy(model).double()
    truth_lm = truth.lm if lm is not model else truth
    cases.token_mean_loss(truth_lm, cases.pad_cat(window)).backward()
    return start, {name: p.grad for name, p in truth.named_parameters()}


def test_a_loss_items_of_the_users_is_the_count_of_losses_normalized_over_the_window(tmp_path: Path) -> None:
    """A wrapper of the user's that hands **kwargs on gets num_items_in_batch from Trainer, counted before the shift
    (one item per sequence too many: the gradient 4-9% too small on these sequences, as plain Trainer's). The
    README's remedy is to override loss_items: it is the window's count too, not only a mean's weight, so one
    window (SGD, lr 1, no clipping) steps by the float64 token-mean gradient."""
    model = _WrappedCausalLM()
    start, grads = _first_window_truth(model, model.lm)
    plain = copy.deepcopy(model)
    _sgd_trainer(transformers.Trainer, plain, tmp_path, _first_window(), False, data_collator=cases.collate).train()
    assert _step_error(plain, start, grads) > 1e-2  # plain Trainer's count, before the shift
    trainer = _sgd_trainer(_CountingAfterTheShift, model, tmp_path, _first_window(), False, data_collator=cases.collate)
    trainer.train()
    assert trainer.state.global_step == 1 and trainer.accumulator.normalization == "sum"
    error = _step_error(model, start, grads)
    assert error < 1e-5, error


def _mean_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # noqa: ANN001, ANN202
    """A compute_loss of the user's: the micro-batch's token mean, ignoring num_items_in_batch."""
    outputs = model(**{key: value for key, value in inputs.items() if key != "labels"})
    loss = cases.causal_lm_loss(outputs.logits, inputs["labels"])
    return (loss, outputs) if return_outputs else loss


def _passing_the_count_on(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # noqa: ANN001, ANN202
    return GafusedTrainer.compute_loss(self, model, inputs, return_outputs, num_items_in_batch=num_items_in_batch)


def _passing_kwargs_on(self, model, inputs, return_outputs=False, **kwargs):  # noqa: ANN001, ANN003, ANN202
    return GafusedTrainer.compute_loss(self, model, inputs, return_outputs, **kwargs)


def test_a_compute_loss_of_the_users_that_ignores_the_count_must_say_how_its_loss_is_scaled(tmp_path: Path) -> None:
    """On a model that takes loss kwargs, Trainer takes any compute_loss's loss as normalized over the window unless
    loss_is_scaled_for_ga says otherwise, so a per-micro-batch mean is summed (the gradient 4x too large here, as
    plain Trainer's). GafusedTrainer's train() refuses such a compute_loss, changing nothing, until it is declared;
    declared False (on the class, or in the subclass's own __init__, as is model_accepts_loss_kwargs = False by
    trainers that compute their own loss), the means are weighed by their tokens and one window steps by the
    float64 token-mean gradient."""

    def trainer(compute_loss: Any, model: torch.nn.Module, base: type = GafusedTrainer, **declared: Any):  # noqa: ANN202
        cls = type("UserTrainer", (base,), {"compute_loss": compute_loss, **declared})
        return _sgd_trainer(cls, model, tmp_path, _first_window(), False, data_collator=cases.collate)

    refused = trainer(_mean_loss, cases.make_model())  # built: a subclass's __init__ may still set its flags
    before = [p.detach().clone() for p in refused.model.parameters()]
    with pytest.raises(ValueError, match=r"loss_is_scaled_for_ga: UserTrainer.compute_loss computes a loss of its own"):
        refused.train()
    assert refused.accumulator is None and all(map(torch.equal, before, refused.model.parameters()))
    for passing_on in (_passing_the_count_on, _passing_kwargs_on):  # the count reaches the model's loss
        passes = trainer(passing_on, cases.make_model())
        passes._decide_loss(passes.model)  # as train() does when it starts
        assert passes._sums
    declared_true = trainer(_mean_loss, cases.make_model(), loss_is_scaled_for_ga=True)
    declared_true._decide_loss(declared_true.model)  # declared: taken at its word
    assert declared_true._sums

    def sets_in_init(flag: str) -> Any:
        def __init__(self, *args: Any, **kwargs: Any) -> None:  # noqa: N807
            GafusedTrainer.__init__(self, *args, **kwargs)
            setattr(self, flag, False)

        return __init__

    for declared in ({"loss_is_scaled_for_ga": False}, {"__init__": sets_in_init("loss_is_scaled_for_ga")},
                     {"__init__": sets_in_init("model_accepts_loss_kwargs")}):  # fmt: skip
        model = cases.make_model()
        start, grads = _first_window_truth(model, model)
        works = trainer(_mean_loss, model, **declared)
        works.train()
        assert works.state.global_step == 1 and works.accumulator.normalization == "mean", declared
        error = _step_error(model, start, grads)
        assert error < 1e-5, (declared, error)
    # On a model that takes no loss kwargs, Trainer never sums: such a compute_loss is a mean, and nothing is refused.
    model = _WithoutLossKwargs()
    start, grads = _first_window_truth(model, model.lm)
    mean = trainer(_mean_loss, model, _CountingAfterTheShift)
    mean.train()
    assert mean.accumulator.normalization == "mean" and _step_error(model, start, grads) < 1e-5


class _WithoutLossKwargs(_WrappedCausalLM):
    def forward(self, input_ids, attention_mask=None, labels=None):  # noqa: ANN001, ANN201
        return self.lm(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def test_a_users_loss_items_must_count_one_number_per_micro_batch(tmp_path: Path) -> None:
    trainer = _sgd_trainer(GafusedTrainer, _WrappedCausalLM(), tmp_path, _first_window(), False,
                           data_collator=cases.collate)  # fmt: skip
    window = [cases.collate(list(_first_window())[:2])]
    trainer.loss_items = lambda inputs: inputs["labels"][..., 1:].ne(-100).sum(-1)  # per row: not one number
    with pytest.raises(TypeError, match=r"loss_items\(inputs\) must return one number .* shape \(2,\)"):
        trainer._get_num_items_in_batch(window, torch.device("cpu"))
    trainer.loss_items = lambda inputs: 3  # set on the trainer: counted too, as an int
    assert int(trainer._get_num_items_in_batch(window, torch.device("cpu"))) == 3 * len(window)


def test_under_label_smoothing_the_count_is_what_the_smoother_scores_not_loss_items(tmp_path: Path) -> None:
    """The LabelSmoother scores a wrapper's labels unshifted (its class is no causal LM of the auto mapping), and
    Trainer counts them so; a loss_items of the user's, written for the model's own loss, must not replace that."""
    model = _WrappedCausalLM()
    model.config = model.lm.config  # Trainer's label smoothing reads it
    trainer = _sgd_trainer(_CountingAfterTheShift, model, tmp_path, _first_window(), False,
                           data_collator=cases.collate, label_smoothing_factor=0.1)  # fmt: skip
    window = [cases.collate([item]) for item in _first_window()]
    every_label = sum(int(batch["labels"].ne(-100).sum()) for batch in window)
    assert trainer._smoothed and int(trainer._get_num_items_in_batch(window, torch.device("cpu"))) == every_label


def test_a_compute_loss_is_read_for_the_count_it_hands_on() -> None:
    from gafused.integrations.transformers import _ignores_the_count

    def positional(self, model, inputs, *args):  # noqa: ANN001, ANN002, ANN202
        return GafusedTrainer.compute_loss(self, model, inputs, *args)

    assert _ignores_the_count(_mean_loss)  # model(**inputs) carries no count
    assert not _ignores_the_count(_passing_the_count_on)
    assert not _ignores_the_count(_passing_kwargs_on)
    assert not _ignores_the_count(positional)
    assert not _ignores_the_count(lambda self, model, inputs: model(**inputs).loss)  # no source of its own to read


def test_a_loss_items_of_the_users_is_summed_over_the_ranks_as_trainers_count_is(monkeypatch, tmp_path: Path) -> None:
    """Under DDP with average_tokens_across_devices, Trainer's num_items_in_batch is the window's count over every
    rank; a loss_items of the user's replaces the count, so it is gathered and summed too (here two ranks faked:
    the gather hands back this rank's count and another rank's)."""
    trainer = _sgd_trainer(_CountingAfterTheShift, _WrappedCausalLM(), tmp_path, _first_window(), False,
                           data_collator=cases.collate)  # fmt: skip
    window = [cases.collate([item]) for item in _first_window()]
    mine = sum(int(batch["labels"][..., 1:].ne(-100).sum()) for batch in window)
    assert int(trainer._get_num_items_in_batch(window, torch.device("cpu"))) == mine
    monkeypatch.setattr(type(trainer.args), "world_size", property(lambda args: 2))
    monkeypatch.setattr(trainer.accelerator, "gather", lambda count: torch.stack([count, count + 7]))
    assert int(trainer._get_num_items_in_batch(window, torch.device("cpu"))) == 2 * mine + 7
