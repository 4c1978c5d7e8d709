"""Pieces the multi-process case scripts and the GPT-2 tests share (tests/*_cases.py, tests/test_correctness.py)."""

from __future__ import annotations

import socket
from typing import Any


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, for a process group's rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tiny_gpt2_config(vocab_size: int, n_positions: int = 32, **overrides: Any) -> Any:
    """A two-layer GPT-2 of width 16 without dropout (random init is the caller's): exact comparisons need no
    randomness in the forward."""
    from transformers import GPT2Config

    settings = dict(
        vocab_size=vocab_size,
        n_positions=n_positions,
        n_embd=16,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    settings.update(overrides)
    return GPT2Config(**settings)
