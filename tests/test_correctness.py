"""Correct accumulation beyond 1/N: token weights, mixed precision, GradScaler, LR schedulers, model checks.

The headline proof trains a tiny causal LM from ``transformers`` (random init, nothing downloaded) on padded
micro-batches of very different token counts: token-weighted accumulation reproduces one big batch per step in
float64, and the common ``loss / N`` recipe does not. Every accumulator test runs for each backend that can
run here (the Triton backend through its interpreter on CPU).
"""

import copy
import math
import warnings

import pytest
import torch

from gafused import GradAccumulator, check_model

from casekit import tanh_mlp, tiny_gpt2_config

# --- a tiny causal LM and padded token batches ------------------------------------------------------------

_VOCAB = 50
_PAD = 0


def _tiny_gpt2(dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """Two layers, width 16, random init. GPT-2's learned positions keep a float64 forward float64 throughout;
    rotary models compute their angles in float32, whose rounding varies with the padded width."""
    transformers = pytest.importorskip("transformers")
    config = tiny_gpt2_config(_VOCAB, pad_token_id=_PAD, bos_token_id=1, eos_token_id=2, attn_implementation="eager")
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config).to(dtype)


def _token_batch(lengths: list[int], generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Right-padded sequences of the given lengths; labels are -100 at padding, as a collator would make them."""
    width = max(lengths)
    input_ids = torch.randint(1, _VOCAB, (len(lengths), width), generator=generator)
    real = torch.arange(width) < torch.tensor(lengths)[:, None]
    input_ids[~real] = _PAD
    return {"input_ids": input_ids, "attention_mask": real.long(), "labels": input_ids.masked_fill(~real, -100)}


def _concat(batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One big batch: every micro-batch right-padded to the longest, then stacked."""
    width = max(batch["input_ids"].shape[1] for batch in batches)
    fill = {"input_ids": _PAD, "attention_mask": 0, "labels": -100}
    return {
        key: torch.cat(
            [
                torch.nn.functional.pad(batch[key], (0, width - batch[key].shape[1]), value=fill[key])
                for batch in batches
            ]
        )
        for key in fill
    }


def _lm_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's own causal-LM loss (shift by one, token mean, -100 ignored) in the logits' dtype.

    ``transformers`` computes its ``loss`` in float32 even for a float64 model, which would cap the float64
    comparisons below at float32 rounding; this is the same loss without that cast.
    """
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), batch["labels"][:, 1:].reshape(-1), ignore_index=-100
    )


def _tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Tokens that carry loss: the model shifts labels left by one, so the first label never counts."""
    return (batch["labels"][..., 1:] != -100).sum()


# Token counts per micro-batch differ by more than 10x; the last window is partial (2 of 3) and ends in flush().
_WINDOW_LENGTHS = [
    [[2, 3], [24, 31, 17], [5]],
    [[30, 28], [4, 2, 6], [12, 9]],
    [[3], [29, 31]],
]
_STEPS = 3


def _token_windows(seed: int = 1) -> list[list[dict[str, torch.Tensor]]]:
    generator = torch.Generator().manual_seed(seed)
    return [[_token_batch(lengths, generator) for lengths in window] for window in _WINDOW_LENGTHS]


def _big_batch_run(model, optimizer, windows):
    """One optimizer step per window on all its tokens at once (token-mean loss): the definition of correct."""
    norms = []
    for window in windows:
        optimizer.zero_grad()
        _lm_loss(model, _concat(window)).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf))
        optimizer.step()
    return norms


def _max_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(float((pa - pb).detach().abs().max()) for pa, pb in zip(a.parameters(), b.parameters(), strict=True))


def _relative_error(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    flat_a = torch.cat([x.double().reshape(-1) for x in a])
    flat_b = torch.cat([x.double().reshape(-1) for x in b])
    return float((flat_a - flat_b).norm() / flat_b.norm())


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


@pytest.mark.parametrize("loop", ["step", "backward"])
def test_token_weighted_llm_matches_big_batch(backend, loop):
    model = _tiny_gpt2(torch.float64)
    reference = copy.deepcopy(model)
    windows = _token_windows()
    # Small buckets, so the backward loop folds several buckets per micro-batch.
    opt = GradAccumulator(_adamw(model), accumulation_steps=_STEPS, backend=backend, bucket_bytes=2**14)
    norms = []
    for window in windows:
        for batch in window:
            if loop == "backward":
                opt.backward(_lm_loss(model, batch), weight=_tokens(batch))
                opt.step()
            else:
                _lm_loss(model, batch).backward()
                opt.step(weight=_tokens(batch))
            opt.zero_grad()
        if len(window) < _STEPS:
            assert opt.micro_step == len(window) and opt.flush()
        assert opt.stepped
        norms.append(opt.grad_norm)
    reference_norms = _big_batch_run(reference, _adamw(reference), windows)
    assert _max_difference(model, reference) < 1e-12
    # grad_norm is the norm of the token-mean gradient, the same number the big batch's clip_grad_norm_ sees
    for norm, reference_norm in zip(norms, reference_norms, strict=True):
        torch.testing.assert_close(norm, reference_norm, rtol=1e-12, atol=0)


def test_loss_over_n_recipe_is_not_the_big_batch():
    """The control: the usual plain-PyTorch recipe weights every micro-batch alike, whatever its token count."""
    model = _tiny_gpt2(torch.float64)
    windows = _token_windows()
    batch = windows[0][1]
    torch.testing.assert_close(_lm_loss(model, batch), model(**batch).loss.double(), rtol=1e-6, atol=0)
    big = copy.deepcopy(model)
    _lm_loss(big, _concat(windows[0])).backward()

    optimizer = _adamw(model)
    for index, window in enumerate(windows):
        for batch in window:
            (_lm_loss(model, batch) / _STEPS).backward()
        if index == 0:
            recipe_error = _relative_error([p.grad for p in model.parameters()], [p.grad for p in big.parameters()])
        optimizer.step()
        optimizer.zero_grad()
    assert recipe_error > 0.05

    replayed = _tiny_gpt2(torch.float64)
    _big_batch_run(replayed, _adamw(replayed), windows)
    # GradAccumulator with token weights matches this replay to 1e-12 (test_token_weighted_llm_matches_big_batch)
    assert _max_difference(model, replayed) > 1e-4


# --- mixed precision ------------------------------------------------------------------------------------------


def _weighted_mean_of_micro_grads(model, window, autocast_dtype):
    """sum(w_i g_i) / sum(w_i) in float64, each g_i from its own backward under the same autocast."""
    total = [torch.zeros(p.shape, dtype=torch.float64) for p in model.parameters()]
    weight_sum = 0
    for batch in window:
        with torch.autocast("cpu", dtype=autocast_dtype):
            loss = model(**batch).loss
        grads = torch.autograd.grad(loss, list(model.parameters()))
        weight = int(_tokens(batch))
        weight_sum += weight
        for t, g in zip(total, grads, strict=True):
            t += weight * g.double()
    return [t / weight_sum for t in total]


def _rounding_tolerance(dtype: torch.dtype) -> float:
    """Relative error allowed between a mixed-precision gradient and its fp32 counterpart."""
    return 2 * torch.finfo(dtype).eps


@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_autocast_token_weighted_window(backend, autocast_dtype):
    """Under autocast the buffer holds the exact weighted mean of what backward produced (fp32 rounding); that
    mean is the fp32 big-batch gradient up to the autocast dtype's rounding."""
    model = _tiny_gpt2(torch.float32)
    window = _token_windows(seed=2)[0]
    expected = _weighted_mean_of_micro_grads(model, window, autocast_dtype)
    big = copy.deepcopy(model)
    big(**_concat(window)).loss.backward()

    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=_STEPS, backend=backend)
    for batch in window:
        with torch.autocast("cpu", dtype=autocast_dtype):
            loss = model(**batch).loss
        loss.backward()
        opt.step(weight=_tokens(batch))
    assert opt.stepped
    finished = [p.grad for p in model.parameters()]
    for grad, e in zip(finished, expected, strict=True):
        torch.testing.assert_close(grad.double(), e, rtol=1e-5, atol=1e-7)
    assert _relative_error(finished, [p.grad for p in big.parameters()]) < _rounding_tolerance(autocast_dtype)


# --- GradScaler -----------------------------------------------------------------------------------------------


def _mlp(device, seed=3):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Linear(8, 3)).to(device)


def _mlp_windows(device, count, steps, overflow_window, seed=4):
    generator = torch.Generator().manual_seed(seed)
    windows = []
    for index in range(count):
        window = []
        for micro in range(steps if index < count - 1 else steps - 1):  # the last window is partial
            x = torch.randn(5, 6, generator=generator)
            if index == overflow_window and micro == 1:
                x = x * 1e6  # the fp16 forward overflows: a real overflow, not a planted inf
            window.append((x.to(device), torch.randn(5, 3, generator=generator).to(device)))
        windows.append(window)
    return windows


def _scaler_state(scaler):
    return scaler.get_scale(), int(scaler._get_growth_tracker())


@pytest.mark.parametrize("device_type", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_grad_scaler_matches_plain_amp_recipe(backend, device_type):
    """Scale, growth tracker, skips and parameters follow PyTorch's AMP accumulation recipe window by window."""
    device = torch.device(device_type)
    steps = 4
    # The recipe's fp16 backward sees loss / steps, the accumulator's the full loss: a scale low enough for
    # neither to overflow except where the data makes both overflow keeps their found-inf flags the same.
    settings = {"init_scale": 2.0**8, "growth_interval": 2}
    windows = _mlp_windows(device, count=7, steps=steps, overflow_window=2)

    model = _mlp(device)
    reference = copy.deepcopy(model)
    scaler = torch.amp.GradScaler(device_type, **settings)
    reference_scaler = torch.amp.GradScaler(device_type, **settings)
    opt = GradAccumulator(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), steps, grad_scaler=scaler, backend=backend
    )
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)

    history = []
    for index, window in enumerate(windows):
        before = [p.detach().clone() for p in model.parameters()]
        for x, y in window:
            with torch.autocast(device_type, dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            opt.step()
            opt.zero_grad()
        if len(window) < steps:
            opt.flush()

        for x, y in window:  # the recipe: loss / (micro-batches in the window), one scaler.step + update
            with torch.autocast(device_type, dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(reference(x).float(), y)
            reference_scaler.scale(loss / len(window)).backward()
        reference_scaler.step(reference_opt)
        reference_scaler.update()
        reference_opt.zero_grad()

        state = _scaler_state(scaler)
        assert state == _scaler_state(reference_scaler), f"window {index}"
        assert opt.stepped == (index != 2)
        if index == 2:
            assert not math.isfinite(float(opt.grad_norm))
            for p, b in zip(model.parameters(), before, strict=True):
                assert torch.equal(p.detach(), b)
        # fp16 tolerance: the recipe's backward rounds loss / len(window), the accumulator's the full loss
        for p, r in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p, r, rtol=2e-3, atol=1e-4)
        history.append(state[0])
    assert opt.skipped_steps == 1
    scale_moves = [b / a for a, b in zip([settings["init_scale"], *history], history, strict=False)]
    assert 2.0 in scale_moves and 0.5 in scale_moves  # growth and backoff both happened


def test_grad_scaler_scale_moves_only_at_window_end(backend):
    """An overflow in the first micro-batch backs the scale off once, when the window ends: the later
    micro-batches of the window are scaled and unscaled with the same scale as the first."""
    model = _mlp("cpu")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 3, grad_scaler=scaler, backend=backend)
    window = _mlp_windows("cpu", count=2, steps=3, overflow_window=None)[0]
    window[0] = (window[0][0] * 1e6, window[0][1])
    for x, y in window:
        assert scaler.get_scale() == 2.0**10
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        opt.step()
    assert not opt.stepped and opt.skipped_steps == 1
    assert scaler.get_scale() == 2.0**10 * scaler.get_backoff_factor()


def test_grad_scaler_without_a_scale_raises():
    model = _mlp("cpu")
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, grad_scaler=torch.amp.GradScaler("cpu"))
    x, y = _mlp_windows("cpu", count=1, steps=2, overflow_window=None)[0][0]
    torch.nn.functional.mse_loss(model(x), y).backward()  # the loss was not scaled
    with pytest.raises(RuntimeError, match=r"scaler.scale\(loss\)"):
        opt.step()


def test_disabled_grad_scaler_is_plain_accumulation(backend):
    model = _mlp("cpu")
    reference = copy.deepcopy(model)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, grad_scaler=scaler, backend=backend)
    reference_opt = GradAccumulator(torch.optim.SGD(reference.parameters(), lr=0.1), 2, backend=backend)
    for x, y in _mlp_windows("cpu", count=1, steps=3, overflow_window=None)[0]:
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        opt.step()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        reference_opt.step()
    assert opt.stepped
    assert _max_difference(model, reference) == 0.0


def test_fp16_grad_scaler_llm_skips_overflow_and_matches_fp32(backend):
    """fp16 autocast + GradScaler against the fp32 run of the same token-weighted windows.

    One micro-batch of window 1 overflows in the fp16 backward: that window is skipped with the scale backed
    off; the fp32 run simply does not see it. Every other window matches fp32 within fp16 rounding.
    """
    fp32 = _tiny_gpt2(torch.float32)
    fp16 = copy.deepcopy(fp32)
    windows = _token_windows(seed=5)
    overflow_window = 1
    scaler = torch.amp.GradScaler("cpu")
    opt16 = GradAccumulator(
        torch.optim.SGD(fp16.parameters(), lr=0.5, momentum=0.9), _STEPS, grad_scaler=scaler, backend=backend
    )
    opt32 = GradAccumulator(torch.optim.SGD(fp32.parameters(), lr=0.5, momentum=0.9), _STEPS, backend=backend)

    for index, window in enumerate(windows):
        scale_before = scaler.get_scale()
        params_before = [p.detach().clone() for p in fp16.parameters()]
        for micro, batch in enumerate(window):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = fp16(**batch).loss
            if index == overflow_window and micro == 1:
                loss = loss * 1e6  # scaled by 65536 too, the logits' gradient no longer fits fp16
            scaler.scale(loss).backward()
            opt16.step(weight=_tokens(batch))
        if len(window) < _STEPS:
            opt16.flush()
        if index == overflow_window:
            assert not opt16.stepped and opt16.skipped_steps == 1
            assert scaler.get_scale() == scale_before * scaler.get_backoff_factor()
            assert int(scaler._get_growth_tracker()) == 0
            for p, b in zip(fp16.parameters(), params_before, strict=True):
                assert torch.equal(p.detach(), b)
            continue
        assert opt16.stepped and scaler.get_scale() == scale_before
        for batch in window:
            fp32(**batch).loss.backward()
            opt32.step(weight=_tokens(batch))
        if len(window) < _STEPS:
            opt32.flush()
        grads16 = [p.grad for p in fp16.parameters()]
        grads32 = [p.grad for p in fp32.parameters()]
        tolerance = _rounding_tolerance(torch.float16)
        assert _relative_error(grads16, grads32) < tolerance
        torch.testing.assert_close(opt16.grad_norm, opt32.grad_norm, rtol=tolerance, atol=0)
        opt16.zero_grad()
        opt32.zero_grad()
    assert int(scaler._get_growth_tracker()) == 1  # one clean window since the backoff
    for p16, p32 in zip(fp16.parameters(), fp32.parameters(), strict=True):
        torch.testing.assert_close(p16, p32, rtol=1e-2, atol=1e-3)


# --- LR schedulers --------------------------------------------------------------------------------------------


def _regression(seed=6):
    return tanh_mlp(seed=seed)


def _regression_windows(sizes, seed=7):
    generator = torch.Generator().manual_seed(seed)
    return [
        [
            (
                torch.randn(n, 5, generator=generator, dtype=torch.float64),
                torch.randn(n, 3, generator=generator, dtype=torch.float64),
            )
            for n in window
        ]
        for window in sizes
    ]


def test_scheduler_counts_taken_steps_through_flush_and_skips(backend):
    """``if opt.stepped: scheduler.step()``: a skipped window leaves the schedule where it was, a flushed one
    advances it, and every inner step runs with the LR the schedule gives that step."""
    sizes = [[3, 1, 4], [2, 5, 2], [6, 1, 3], [2, 2, 2], [4, 3]]
    skipped = 1
    windows = _regression_windows(sizes)
    model = _regression()
    reference = copy.deepcopy(model)

    def schedule(step):
        return 0.5 ** (step + 1)

    inner = torch.optim.AdamW(model.parameters(), lr=0.05)
    opt = GradAccumulator(inner, accumulation_steps=3, backend=backend)
    scheduler = torch.optim.lr_scheduler.LambdaLR(inner, schedule)
    reference_opt = torch.optim.AdamW(reference.parameters(), lr=0.05)
    reference_scheduler = torch.optim.lr_scheduler.LambdaLR(reference_opt, schedule)

    used_lrs = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no LR-changed-mid-window warning, no scheduler-order warning
        for index, window in enumerate(windows):
            for micro, (x, y) in enumerate(window):
                torch.nn.functional.mse_loss(model(x), y).backward()
                if index == skipped and micro == 0:
                    model[0].weight.grad[0, 0] = float("nan")
                lr = inner.param_groups[0]["lr"]
                opt.step(weight=x.shape[0])
                opt.zero_grad()
                if opt.stepped:
                    used_lrs.append(lr)
                    scheduler.step()
            if opt.flush():
                used_lrs.append(inner.param_groups[0]["lr"])
                scheduler.step()
            if index == skipped:
                continue
            reference_opt.zero_grad()
            x = torch.cat([x for x, _ in window])
            y = torch.cat([y for _, y in window])
            torch.nn.functional.mse_loss(reference(x), y).backward()
            reference_opt.step()
            reference_scheduler.step()
    assert opt.skipped_steps == 1
    assert used_lrs == [0.05 * schedule(step) for step in range(len(windows) - 1)]
    assert inner.param_groups[0]["lr"] == reference_opt.param_groups[0]["lr"]
    assert _max_difference(model, reference) < 1e-12


# --- what accumulation does not make equal --------------------------------------------------------------------


def _normalized_model(norm: str) -> torch.nn.Module:
    torch.manual_seed(8)
    layer = {"batch": torch.nn.BatchNorm1d(6), "layer": torch.nn.LayerNorm(6), "group": torch.nn.GroupNorm(2, 6)}
    return torch.nn.Sequential(torch.nn.Linear(5, 6), layer[norm], torch.nn.Tanh(), torch.nn.Linear(6, 3)).double()


@pytest.mark.parametrize("norm", ["batch", "layer", "group"])
def test_check_model_names_exactly_what_breaks_equality(backend, norm):
    """check_model's BatchNorm finding is real: the accumulated gradient differs from the big batch with
    BatchNorm and equals it with the per-sample normalizations it suggests."""
    model = _normalized_model(norm)
    big = copy.deepcopy(model)
    findings = check_model(model, warn=False)
    opt = GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.0), accumulation_steps=3, backend=backend)
    window = _regression_windows([[4, 4, 4]], seed=9)[0]
    for x, y in window:
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    torch.nn.functional.mse_loss(big(torch.cat([x for x, _ in window])), torch.cat([y for _, y in window])).backward()
    difference = _relative_error([p.grad for p in model.parameters()], [p.grad for p in big.parameters()])
    if norm == "batch":
        assert len(findings) == 1 and "1 BatchNorm layer(s) (1)" in findings[0]  # named by its Sequential index
        assert difference > 1e-3
    else:
        assert findings == []
        assert difference < 1e-12


def test_check_model_names_dropout_modules_and_functional_rates():
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 4),
        torch.nn.Dropout(0.1),
        torch.nn.Dropout(0.0),  # inactive: not reported
        torch.nn.MultiheadAttention(4, 2, dropout=0.2),  # functional dropout, held as a float rate
        torch.nn.AlphaDropout(0.3),
        torch.nn.FeatureAlphaDropout(0.4),
        torch.nn.Dropout2d(0.5),
    )
    findings = check_model(model, warn=False)
    assert len(findings) == 1
    assert "1 (p=0.1)" in findings[0] and "3 (dropout=0.2)" in findings[0] and "2 (" not in findings[0]
    assert "4 (p=0.3)" in findings[0] and "5 (p=0.4)" in findings[0] and "6 (p=0.5)" in findings[0]
    assert "5 place(s)" in findings[0]


def test_check_model_reads_only_float_rates_as_functional_dropout():
    module = torch.nn.Linear(4, 4)
    module.num_dropout_layers = 1  # a count named like a rate (1, as an int, is no rate either)
    module.dropout_seed = 1234  # a seed
    module.use_dropout = True  # a switch (bool is an int)
    module.dropout_scale = 2.5  # a float, but no probability
    module.attention_dropout = 0.0  # inactive
    assert check_model(module, warn=False) == []
    module.attention_dropout = 0.25
    findings = check_model(module, warn=False)
    assert len(findings) == 1 and "<root> (attention_dropout=0.25)" in findings[0] and "1 place(s)" in findings[0]
    module.attention_dropout = 1.0  # every value dropped: still a rate
    assert "<root> (attention_dropout=1)" in check_model(module, warn=False)[0]


def test_check_model_on_a_transformer():
    clean = _tiny_gpt2(torch.float32)
    assert check_model(clean, warn=False) == []
    clean.config.attn_pdrop = 0.1
    findings = check_model(type(clean)(clean.config), warn=False)
    assert len(findings) == 1 and "transformer.h.0.attn.attn_dropout (p=0.1)" in findings[0]
    assert "2 place(s)" in findings[0]  # one per layer


def test_check_model_warns_and_rejects_non_modules():
    model = torch.nn.Sequential(*[torch.nn.BatchNorm1d(3) for _ in range(8)])
    with pytest.warns(UserWarning, match=r"8 BatchNorm layer\(s\) \(0, 1, 2, 3, 4 and 3 more\)"):
        findings = check_model(model)
    assert len(findings) == 1
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        check_model([torch.nn.BatchNorm1d(3)])
