"""The benchmark providers compute what they claim: every one finishes a window with the same gradient.

Timing is not tested here (no timing assertions); ``python bench/run.py --quick`` is the smoke run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import param_sets  # noqa: E402 - bench/ is not a package; its modules import each other as siblings
import providers  # noqa: E402
import traffic  # noqa: E402

ACCUMULATION_STEPS = 4
MAX_GRAD_NORM = 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["naive", "foreach", "gafused-reference"])
def test_provider_finishes_the_window_like_float64(name: str, dtype: torch.dtype) -> None:
    param_set = param_sets.gpt2(hidden=8, layers=1, vocab=37, positions=5, name="tiny")
    generator = torch.Generator().manual_seed(1)
    # One gradient set per micro-batch, so the window folds each exactly once, in order.
    pool = [
        [torch.randn(shape, generator=generator).to(dtype) for shape in param_set.shapes]
        for _ in range(ACCUMULATION_STEPS)
    ]
    params = [torch.nn.Parameter(torch.empty(shape, dtype=dtype)) for shape in param_set.shapes]
    provider = providers.make_provider(name, params, pool, ACCUMULATION_STEPS, MAX_GRAD_NORM)

    provider.prepare("last")
    assert provider.position() == ACCUMULATION_STEPS - 1
    provider.step()
    assert provider.position() == 0

    mean = [sum(grads[i].double() for grads in pool) / ACCUMULATION_STEPS for i in range(len(params))]
    norm = torch.sqrt(sum(g.square().sum() for g in mean))
    assert norm > MAX_GRAD_NORM, "the clip must be active for this test to check it"
    coef = MAX_GRAD_NORM / (norm + 1e-6)
    for param, expected in zip(params, mean, strict=True):
        assert param.grad is not None and param.grad.dtype == dtype
        torch.testing.assert_close(param.grad, (expected * coef).to(dtype))


def test_traffic_matches_the_design_table() -> None:
    # docs/design.md section 3, bf16 grads into fp32: first 6, middle 10 bytes per element; fp32 grads add 2.
    assert traffic.bytes_per_element("first", torch.bfloat16) == 6
    assert traffic.bytes_per_element("middle", torch.bfloat16) == 10
    assert traffic.bytes_per_element("middle", torch.float32) == 12
    # last = the fused pass (10) + reading the buffer and writing the finished bf16 grad (4 + 2)
    assert traffic.bytes_per_element("last", torch.bfloat16) == 16
    with pytest.raises(ValueError, match="moment"):
        traffic.bytes_per_element("second", torch.bfloat16)


def test_kernel_sweep_traffic_matches_the_design_table() -> None:
    # docs/design.md section 3: fold and the fused finish move 10 bytes per element for bf16 grads (12 for fp32);
    # writing the finished bf16 gradient reads acc and writes 2 bytes; a norm alone reads acc.
    assert traffic.op_bytes_per_element("fold", torch.bfloat16) == 10
    assert traffic.op_bytes_per_element("fold_finish", torch.float32) == 12
    assert traffic.op_bytes_per_element("scale_cast", torch.bfloat16) == 6
    assert traffic.op_bytes_per_element("sum_of_squares", torch.bfloat16) == 4
    with pytest.raises(ValueError, match="op must be one of"):
        traffic.op_bytes_per_element("clip", torch.bfloat16)


def test_param_set_tensor_counts() -> None:
    assert param_sets.gpt2().count == 148
    assert param_sets.llama().count == 291
    assert param_sets.gpt2().numel == 124_439_808
