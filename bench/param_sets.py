"""Parameter sets the benchmarks run on: shapes only, filled with random data when a benchmark builds them.

Each set names the model it mirrors. On CPU the same structures are built at a smaller hidden size (same
tensor count, far fewer elements) and the name says so, so a CPU row can never pass for the real model.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

__all__ = ["MODES", "ParamSet", "gpt2", "llama", "many_small", "single", "default_sets"]

MODES = ("quick", "default", "full")


@dataclass(frozen=True)
class ParamSet:
    """A list of parameter shapes plus where they come from.

    Args:
        name: short id used in tables, files and ``--sets``.
        shapes: one shape per parameter tensor.
        description: what the set mirrors, including any scaling.
    """

    name: str
    shapes: tuple[tuple[int, ...], ...]
    description: str
    numels: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "numels", tuple(math.prod(shape) for shape in self.shapes))

    @property
    def count(self) -> int:
        """Number of tensors."""
        return len(self.shapes)

    @property
    def numel(self) -> int:
        """Total number of elements over every tensor."""
        return sum(self.numels)


def gpt2(
    hidden: int = 768, layers: int = 12, vocab: int = 50257, positions: int = 1024, name: str = "gpt2-124m"
) -> ParamSet:
    """GPT-2 (HF layout, Conv1D weights stored in x out): 2 embeddings + 12 per layer + final LayerNorm."""
    shapes: list[tuple[int, ...]] = [(vocab, hidden), (positions, hidden)]
    for _ in range(layers):
        # fmt: off
        shapes += [
            (hidden,), (hidden,),  # ln_1 weight, bias
            (hidden, 3 * hidden), (3 * hidden,),  # attn.c_attn
            (hidden, hidden), (hidden,),  # attn.c_proj
            (hidden,), (hidden,),  # ln_2
            (hidden, 4 * hidden), (4 * hidden,),  # mlp.c_fc
            (4 * hidden, hidden), (hidden,),  # mlp.c_proj
        ]
        # fmt: on
    shapes += [(hidden,), (hidden,)]  # ln_f
    description = f"GPT-2 layout: vocab {vocab}, {positions} positions, hidden {hidden}, {layers} layers"
    return ParamSet(name, tuple(shapes), description)


def llama(
    hidden: int = 4096, layers: int = 32, intermediate: int = 11008, vocab: int = 32000, name: str = "llama-7b"
) -> ParamSet:
    """LLaMA (HF layout): embeddings, 9 tensors per layer (q, k, v, o, gate, up, down, 2 RMSNorms), norm, lm_head."""
    shapes: list[tuple[int, ...]] = [(vocab, hidden)]
    for _ in range(layers):
        shapes += [(hidden, hidden)] * 4  # q_proj, k_proj, v_proj, o_proj
        shapes += [(intermediate, hidden), (intermediate, hidden), (hidden, intermediate)]  # gate, up, down
        shapes += [(hidden,), (hidden,)]  # input_layernorm, post_attention_layernorm
    shapes += [(hidden,), (vocab, hidden)]  # norm, lm_head
    description = f"LLaMA layout: vocab {vocab}, hidden {hidden}, intermediate {intermediate}, {layers} layers"
    return ParamSet(name, tuple(shapes), description)


def many_small(count: int, max_numel: int, seed: int = 0, name: str = "many-small") -> ParamSet:
    """Thousands of small tensors (biases, norms, adapters): the case where per-tensor launches dominate.

    Sizes are log-uniform in [1, max_numel] from a fixed seed, so odd sizes are included and runs compare.
    """
    rng = random.Random(seed)
    shapes = tuple((max(1, int(math.exp(rng.uniform(0.0, math.log(max_numel))))),) for _ in range(count))
    return ParamSet(name, shapes, f"{count} tensors, log-uniform sizes 1..{max_numel} (seed {seed})")


def single(numel: int, name: str = "single-big") -> ParamSet:
    """One large tensor: the bandwidth-bound case with no per-tensor overhead at all."""
    return ParamSet(name, ((numel,),), f"one tensor of {numel} elements")


def default_sets(device_type: str, mode: str) -> list[ParamSet]:
    """The sets a run uses on ``device_type`` ("cuda" or "cpu").

    Args:
        device_type: "cuda" or "cpu".
        mode: "quick" (CI smoke run), "default" (a few minutes at most) or "full" (every set).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if device_type == "cuda":
        if mode == "full":
            return [gpt2(), llama(), many_small(4096, 65536), single(1 << 28)]
        if mode == "default":
            return [gpt2(), many_small(4096, 65536), single(1 << 28)]
        return [gpt2(), many_small(1024, 16384), single(1 << 24)]
    # CPU: same tensor counts as the GPU sets where it matters, hidden sizes scaled down.
    if mode == "quick":
        return [
            gpt2(hidden=64, vocab=4096, positions=256, name="gpt2-124m-cpu-h64"),
            many_small(512, 1024),
            single(1 << 20),
        ]
    if mode == "default":
        return [
            gpt2(hidden=128, vocab=8192, positions=512, name="gpt2-124m-cpu-h128"),
            many_small(2048, 4096),
            single(1 << 22),
        ]
    return [
        gpt2(hidden=256, vocab=8192, positions=512, name="gpt2-124m-cpu-h256"),
        llama(hidden=128, intermediate=344, vocab=4096, name="llama-7b-cpu-h128"),
        many_small(2048, 4096),
        single(1 << 23),
    ]
