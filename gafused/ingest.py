"""How gradients enter the buffers during backward: one hook per parameter, one fold per bucket.

A post-accumulate-grad hook on every parameter counts, per bucket, the gradients that backward has finished.
When the last one of a bucket lands, the bucket is handed to the accumulator, which folds it and releases
those gradients at once, so at most about one bucket of fresh gradients is alive beside the buffer (DDP and
Megatron-core use the same idea for their communication buckets). Counting is only a trigger: parameters
that get no gradient, or a gradient twice in one backward (a parameter used inside and outside a reentrant
checkpoint), are caught by the accumulator's pass over the parameters at the end of the backward call.

The hooks hold the accumulator weakly and do nothing outside ``GradAccumulator.backward``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from gafused.buffer import FlatGradBuffer

__all__ = ["BucketHooks"]


class BucketHooks:
    """Per-bucket gradient counters fed by post-accumulate-grad hooks.

    Args:
        buffers: the accumulator's buffers; bucket ``b`` of buffer ``g`` is ``buffers[g].bucket_ranges[b]``.
        owner: the object whose ``on_bucket_ready(g, b)`` is called when a bucket's last gradient lands;
            held weakly.
        params: per buffer, the tensors whose gradients land there (default: the buffer's ``params``; an FSDP2
            buffer lays out local shards while the gradients land on the sharded parameters).
    """

    def __init__(
        self, buffers: list[FlatGradBuffer], owner: object, params: list[list[torch.Tensor]] | None = None
    ) -> None:
        owner_ref = weakref.ref(owner)
        self.active = False
        self._expected: list[list[int]] = []
        self._remaining: list[list[int]] = []
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        if params is None:
            params = [buffer.params for buffer in buffers]
        for group_index, (buffer, targets) in enumerate(zip(buffers, params, strict=True)):
            expected = []
            for bucket_index, indices in enumerate(buffer.bucket_ranges):
                hooked = [targets[i] for i in indices if targets[i].requires_grad]
                expected.append(len(hooked))
                for param in hooked:
                    hook = self._make_hook(owner_ref, group_index, bucket_index)
                    self._handles.append(param.register_post_accumulate_grad_hook(hook))
            self._expected.append(expected)
            self._remaining.append(list(expected))

    def _make_hook(self, owner_ref: weakref.ref, group_index: int, bucket_index: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            if not self.active:
                return
            counts = self._remaining[group_index]
            counts[bucket_index] -= 1
            if counts[bucket_index] == 0:
                owner = owner_ref()
                if owner is not None:
                    owner.on_bucket_ready(group_index, bucket_index)

        return hook

    def start(self) -> None:
        """Arm the counters for one backward call."""
        for remaining, expected in zip(self._remaining, self._expected, strict=True):
            remaining[:] = expected
        self.active = True

    def stop(self) -> None:
        self.active = False

    def remove(self) -> None:
        """Take every hook off its parameter."""
        self.active = False
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
