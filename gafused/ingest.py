"""How gradients enter the buffers during backward: one hook per parameter, one fold per bucket.

A post-accumulate-grad hook on every parameter counts, per bucket, the gradients that backward has finished.
When the last one of a bucket lands, the bucket is handed to the accumulator, which folds it and releases
those gradients at once, so at most about one bucket of fresh gradients is alive beside the buffer (DDP and
Megatron-core use the same idea for their communication buckets). Counting is only a trigger: parameters
that get no gradient, or a gradient twice in one backward (a parameter used inside and outside a reentrant
checkpoint), are caught by the accumulator's pass over the parameters at the end of the backward call.

How many gradients a bucket waits for is learned from the backward before (as DDP's static graph does): a
parameter frozen after the accumulator was built, or one the forward does not use, would otherwise keep its
bucket waiting to the end of backward, with every gradient of the bucket alive. When more gradients land than
the last call gave, the bucket was handed over early: the gradients that land after it are folded by the
end-of-backward pass, exactly, at the cost of their memory (and, on a window's last micro-batch across ranks,
of one more reduction and host sync at ``step()``). Such a bucket then waits for all its hooked parameters
until its count has stayed the same for ``RELEARN_CALLS`` calls in a row, and from then on for that count;
each further early hand-over doubles the calls it needs, so a bucket whose use keeps changing (routed experts,
a loss term every few micro-batches) soon waits for all its parameters for good, while one change (a single
micro-batch that used more) costs one early hand-over and a few calls of waiting.

Hooks a user registers on a parameter after the accumulator's run after it, and may read or change ``p.grad``
in place; torch runs a parameter's hooks one after another, so a bucket whose last gradient belongs to such a
parameter is handed over when the next gradient of its buffer lands (or folded by the end-of-backward pass),
after those hooks are done, never under them.

The hooks hold the accumulator weakly and do nothing outside ``GradAccumulator.backward``.
"""

from __future__ import annotations

import itertools
import operator
import weakref
from collections.abc import Callable

import torch

from gafused.buffer import FlatGradBuffer

__all__ = ["BucketHooks", "RELEARN_CALLS"]

# Calls in a row with one gradient count after which a bucket that was handed over early waits for that count again
# (doubled each time the bucket is handed over early again).
RELEARN_CALLS = 2

_POST_ACCUMULATE_HOOKS = operator.attrgetter("_post_accumulate_grad_hooks")
_MORE_THAN_ONE = (1).__lt__


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
        self._owner_ref = weakref.ref(owner)
        self.active = False
        self._call = 0  # numbers the backward calls, to count each parameter once per call
        self._full: list[list[int]] = []  # per bucket: its hooked parameters
        self._expected: list[list[int]] = []  # per bucket: the gradients this call waits for
        self._remaining: list[list[int]] = []
        self._landed: list[list[int]] = []  # per bucket: distinct parameters whose gradient landed in this call
        self._variable: list[list[bool]] = []  # per bucket: waits for all its parameters until its count is stable
        self._stable: list[list[int]] = []  # per bucket: calls in a row that gave its last count (variable buckets)
        self._last: list[list[int]] = []  # per bucket: the count of its last call that gave any
        self._patience: list[list[int]] = []  # per bucket: the stable calls a variable bucket needs to relearn
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        # The hooked parameters and their hooks, and per parameter whether hooks registered after it run later: the
        # flags are read at each start(), on the parameter itself; inside backward the hook may see another tensor (a
        # graph input of compiled autograd) that has no hook table to read.
        self._watched: list[torch.Tensor] = []
        self._watched_hooks: list[Callable[[torch.Tensor], None]] = []
        self._followed: list[bool] = []
        # Per buffer: complete buckets whose last parameter has hooks after this one's, handed over at that buffer's
        # next hook, once those hooks have run (see the module docstring).
        self._deferred: list[list[int]] = [[] for _ in buffers]
        # (buffer, bucket, parameter) of parameters that did not require grad when last looked at: hooked by the
        # first start() that finds them trainable (a parameter unfrozen after the accumulator was built).
        self._unhooked: list[tuple[int, int, torch.Tensor]] = []
        if params is None:
            params = [buffer.params for buffer in buffers]
        for group_index, (buffer, targets) in enumerate(zip(buffers, params, strict=True)):
            full = []
            hooked = []
            for bucket_index, indices in enumerate(buffer.bucket_ranges):
                bucket_hooked = [targets[i] for i in indices if targets[i].requires_grad]
                self._unhooked += [
                    (group_index, bucket_index, targets[i]) for i in indices if not targets[i].requires_grad
                ]
                full.append(len(bucket_hooked))
                hooked += [(param, bucket_index) for param in bucket_hooked]
            self._full.append(full)
            self._expected.append(list(full))
            self._remaining.append(list(full))
            self._landed.append([0] * len(full))
            self._variable.append([False] * len(full))
            self._stable.append([0] * len(full))
            self._last.append([0] * len(full))
            self._patience.append([0] * len(full))
            for param, bucket_index in hooked:  # after the counters exist: each hook binds its buffer's lists
                self._hook(param, group_index, bucket_index)

    def _hook(self, param: torch.Tensor, group_index: int, bucket_index: int) -> None:
        """Count ``param``'s gradient for bucket ``bucket_index`` of buffer ``group_index``."""
        hook = self._make_hook(group_index, bucket_index, len(self._watched))
        self._handles.append(param.register_post_accumulate_grad_hook(hook))
        self._watched.append(param)
        self._watched_hooks.append(hook)
        self._followed.append(False)

    def _make_hook(self, group_index: int, bucket_index: int, index: int) -> Callable[[torch.Tensor], None]:
        owner_ref = self._owner_ref
        deferred = self._deferred[group_index]
        # The per-buffer count lists are only ever updated in place (start(), stop()): bound once here.
        counts = self._remaining[group_index]
        landed = self._landed[group_index]
        last_call = -1

        def hook(param: torch.Tensor) -> None:
            nonlocal last_call
            if not self.active:
                return
            if deferred:  # the hooks after a deferred bucket's last gradient are done now (unless it is this one)
                owner = owner_ref()
                ready = [b for b in deferred if b != bucket_index]
                deferred[:] = [b for b in deferred if b == bucket_index]
                if owner is not None:
                    for ready_index in ready:
                        owner.on_bucket_ready(group_index, ready_index)
            call = self._call
            if last_call != call:
                last_call = call
                landed[bucket_index] += 1
            counts[bucket_index] -= 1
            if counts[bucket_index] == 0:
                owner = owner_ref()
                if owner is None:
                    return
                if self._followed[index]:
                    deferred.append(bucket_index)  # hooks after this one still read p.grad
                else:
                    owner.on_bucket_ready(group_index, bucket_index)

        return hook

    def start(self) -> None:
        """Arm the counters for one backward call (hooking parameters unfrozen since the last one)."""
        if self._unhooked:
            self._hook_unfrozen()
        self._call += 1
        self._followed = self._read_followed()
        for remaining, expected, landed in zip(self._remaining, self._expected, self._landed, strict=True):
            remaining[:] = expected
            landed[:] = [0] * len(landed)
        for deferred in self._deferred:
            deferred.clear()
        self.active = True

    def landed_any(self) -> bool:
        """Whether a gradient landed in this (or the last) backward call."""
        return any(map(any, self._landed))

    def _read_followed(self) -> list[bool]:
        """Per hooked parameter: whether hooks registered after this accumulator's run after it. A hook table
        ({handle id: hook}, in running order) holding only this accumulator's hook needs no closer look: only
        tables of two or more entries are read one by one (usually none), the lengths in one C-level pass."""
        watched, own = self._watched, self._watched_hooks
        followed = [False] * len(watched)
        try:
            tables = list(map(_POST_ACCUMULATE_HOOKS, watched))
            several = (
                list(itertools.compress(range(len(tables)), map(_MORE_THAN_ONE, map(len, tables))))
                if tables and max(map(len, tables)) > 1
                else []
            )
        except (AttributeError, TypeError):  # a table missing or None (never, for torch tensors): every one read
            tables = [getattr(param, "_post_accumulate_grad_hooks", None) for param in watched]
            several = [i for i, hooks in enumerate(tables) if hooks]
        for i in several:
            followed[i] = next(reversed(tables[i].values())) is not own[i]
        return followed

    def _hook_unfrozen(self) -> None:
        """Hook the parameters that require grad now but did not when looked at before; each bucket then waits for
        one more gradient (or for all of them, if it waits for all)."""
        frozen = []
        for group_index, bucket_index, param in self._unhooked:
            if not param.requires_grad:
                frozen.append((group_index, bucket_index, param))
                continue
            self._hook(param, group_index, bucket_index)
            full, expected = self._full[group_index], self._expected[group_index]
            full[bucket_index] += 1
            if self._variable[group_index][bucket_index]:
                expected[bucket_index] = full[bucket_index]
            else:
                expected[bucket_index] += 1
        self._unhooked = frozen

    def stop(self, learn: bool = True) -> None:
        """End a backward call: learn how many gradients each bucket waits for in the next one (not from a call
        that failed midway); see the module docstring."""
        if not self.active:
            return
        self.active = False
        for deferred in self._deferred:  # still holding their gradients: the end-of-backward pass folds them
            deferred.clear()
        if not learn:
            return
        for buckets in zip(
            self._full, self._expected, self._landed, self._variable, self._stable, self._last, self._patience,
            strict=True,
        ):  # fmt: skip
            full, expected, landed, variable, stable, last, patience = buckets
            for b, count in enumerate(landed):
                if count == 0:
                    continue  # no gradient at all says nothing (another loss of the micro-batch, say)
                stable[b] = stable[b] + 1 if count == last[b] else 1
                last[b] = count
                if variable[b]:
                    if stable[b] >= patience[b]:  # the same count long enough: wait for it again
                        variable[b] = False
                        expected[b] = count
                elif count > expected[b]:  # more than the last call gave: this call handed the bucket over early
                    variable[b] = True
                    expected[b] = full[b]
                    patience[b] = max(RELEARN_CALLS, 2 * patience[b])
                else:
                    expected[b] = count

    def remove(self) -> None:
        """Take every hook off its parameter."""
        self.active = False
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._unhooked.clear()
        self._watched.clear()
        self._watched_hooks.clear()
        self._followed.clear()
