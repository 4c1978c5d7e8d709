"""Property-based tests: random models, weights, windows and faults against a float64 truth.

The truth is computed directly: micro-batch i's loss is ``sum_p (c_ip * p).sum() + 0.5 * (d_ip * p * p).sum()``,
so its gradient is ``c_ip + d_ip * p``; the window's gradient is the weighted mean, clipped like
``clip_grad_norm_``, and stepped by a copy of the inner optimizer. A window with a non-finite value or a zero
weight sum is skipped. Every backend that runs on CPU is drawn through the same examples: the CI profile runs
a few dozen, ``HYPOTHESIS_PROFILE=long`` many more:

    HYPOTHESIS_PROFILE=long python -m pytest tests/test_properties.py -q
"""

import io
import math
import os

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402 - after the import check
from hypothesis import strategies as st  # noqa: E402

from gafused import GradAccumulator, available_backends  # noqa: E402

settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True)
settings.register_profile("long", max_examples=500, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

SHAPES = st.lists(
    st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple),  # () is one element, a 0 an empty parameter
    min_size=1,
    max_size=5,
)
BACKENDS = available_backends("cpu")  # triton under the interpreter, where it is installed
OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
}


@st.composite
def scenarios(draw):
    shapes = draw(SHAPES)
    steps = draw(st.integers(1, 4))
    windows = []
    for _ in range(draw(st.integers(1, 3))):
        size = draw(st.integers(1, steps))  # size < steps: a partial window finished by flush()
        windows.append(
            [
                {
                    "weight": draw(st.sampled_from([1.0, 2.5, 7.0, 0.0])),
                    "seed": draw(st.integers(0, 2**16)),
                    "poison": draw(st.sampled_from([None] * 6 + [math.inf, math.nan])),
                }
                for _ in range(size)
            ]
        )
    return {
        "shapes": shapes,
        "steps": steps,
        "windows": windows,
        "optimizer": draw(st.sampled_from(sorted(OPTIMIZERS))),
        "max_norm": draw(st.sampled_from([0.05, None, 0.5, 100.0])),  # first: Hypothesis's simplest examples take it
        "loop": draw(st.sampled_from(["step", "backward"])),
        "bucket_bytes": draw(st.sampled_from([1, 64, 2**20])),
        "checkpoint_at": draw(st.integers(0, 6)),
    }


def _coefficients(shapes, seed):
    generator = torch.Generator().manual_seed(seed)
    return [(_randn(shape, generator), torch.rand(shape, generator=generator, dtype=torch.float64)) for shape in shapes]


def _randn(shape, generator):
    return torch.randn(shape, generator=generator, dtype=torch.float64)


def _loss(params, coefficients, poison):
    loss = sum((c * p).sum() + 0.5 * (d * p * p).sum() for p, (c, d) in zip(params, coefficients, strict=True))
    if poison is not None:
        big = next((p for p in params if p.numel() > 0), None)
        if big is not None:
            loss = loss + poison * big.reshape(-1)[0]  # a non-finite gradient for one element
    return loss


def _truth_step(params, optimizer, window, shapes, max_norm):
    """One optimizer step on the float64 weighted mean of the window's gradients, or a skip."""
    total = sum(micro["weight"] for micro in window)
    grads = [torch.zeros(p.shape, dtype=torch.float64) for p in params]
    for micro in window:
        for grad, p, (c, d) in zip(grads, params, _coefficients(shapes, micro["seed"]), strict=True):
            grad += micro["weight"] * (c + d * p.detach())
        if micro["poison"] is not None:
            big = next((g for g in grads if g.numel() > 0), None)
            if big is not None:
                big.view(-1)[0] += micro["weight"] * micro["poison"]
    if total == 0 or not all(torch.isfinite(g).all() for g in grads):
        return False
    for p, grad in zip(params, grads, strict=True):
        p.grad = grad / total
    torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm is not None else math.inf)
    optimizer.step()
    return True


def _resume(opt, params, make):
    """Checkpoint and resume into a fresh accumulator over the same parameters."""
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    fresh = GradAccumulator(make(params), opt.accumulation_steps, max_grad_norm=opt.max_grad_norm, backend=opt.backend)
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    return fresh


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the Triton interpreter's inf * 0
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@given(scenario=scenarios())
def test_random_windows_match_the_float64_truth(backend, scenario):
    shapes = scenario["shapes"]
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, dtype=torch.float64)) for shape in shapes]
    truth = [torch.nn.Parameter(p.detach().clone()) for p in params]
    make = OPTIMIZERS[scenario["optimizer"]]
    opt = GradAccumulator(
        make(params),
        scenario["steps"],
        max_grad_norm=scenario["max_norm"],
        bucket_bytes=scenario["bucket_bytes"],
        backend=backend,
    )
    truth_opt = make(truth)
    position = 0
    for window in scenario["windows"]:
        for micro in window:
            if position == scenario["checkpoint_at"]:
                opt = _resume(opt, params, make)
            position += 1
            loss = _loss(params, _coefficients(shapes, micro["seed"]), micro["poison"])
            if scenario["loop"] == "backward":
                opt.backward(loss, weight=micro["weight"])
                opt.step()
            else:
                loss.backward()
                opt.step(weight=micro["weight"])
            opt.zero_grad()
        if len(window) < scenario["steps"]:
            opt.flush()
        stepped = _truth_step(truth, truth_opt, window, shapes, scenario["max_norm"])
        assert opt.stepped == stepped
        assert opt.micro_step == 0
        for p, t in zip(params, truth, strict=True):
            torch.testing.assert_close(p.detach(), t.detach(), rtol=1e-10, atol=1e-12)
