"""The checkpoint of an accumulator's open window: its format, its versions, and the checks a loaded one passes.

``GradAccumulator.state_dict()`` adds a ``"gafused"`` entry to the inner optimizer's state_dict: the window's
position and weights, and per buffer its parameters' sizes, shapes, positions and accumulated segments (each in
its parameter's row-major order). ``load_state_dict()`` takes it apart here (``split``), checks it whole against
the accumulator before anything changes (``check_groups_match``, ``validated_window``) and then restores it. A
refused checkpoint changes nothing; a bad field raises ValueError naming it.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from gafused.buffer import ACCUM_DTYPES, by_device_and_dtype

if TYPE_CHECKING:
    from gafused.accumulator import GradAccumulator

# Version 2 is unchanged by driven windows and normalization: their fields are optional ("accumulation_steps" may be
# None; "normalization" is absent from older checkpoints, which were all "mean").
# 3: segments in each parameter's row-major order, with the shapes; 2: in the buffer's memory order; 1: as 3, no shapes.
# 4: as 3, and with model= the buffers laid out in the model's parameter order (before: the optimizer's, as without).
# 5: as 4, and each buffer's parameters by their position in the optimizer's order ("positions"), checked on loading.
# 6: as 5, the positions in the order the buffers were laid out from: the model's with model= (the optimizer's may
# differ from process to process), else the optimizer's; which one, in "layout" ("model" or "optimizer").
STATE_VERSION = 6
# How a window is finished: divided by its sum of weights, or not. An open window is resumed only as it was saved.
NORMALIZATIONS = ("mean", "sum")


def check_groups_match(inner: dict[str, Any], groups: list[dict[str, Any]]) -> None:
    """The inner optimizer's own checks on its groups (``groups``: its ``param_groups``), made before the window's
    fields are checked against those groups, so that a checkpoint of other groups is refused as that and not as a bad
    window field."""
    saved = inner.get("param_groups")
    if not isinstance(saved, list):
        return  # the inner optimizer's load_state_dict refuses it
    if len(saved) != len(groups):
        raise ValueError(
            f"state_dict['param_groups']: the checkpoint has {len(saved)} parameter groups, the optimizer "
            f"{len(groups)} (loaded state dict has a different number of parameter groups)"
        )
    for index, (entry, group) in enumerate(zip(saved, groups, strict=True)):
        params = entry.get("params") if isinstance(entry, dict) else None
        if isinstance(params, list) and len(params) != len(group["params"]):
            raise ValueError(
                f"state_dict['param_groups'][{index}]: the checkpoint's group has {len(params)} parameters, the "
                f"optimizer's {len(group['params'])} (loaded state dict contains a parameter group that doesn't "
                "match the size of optimizer's group)"
            )


def split(acc: GradAccumulator, state_dict: Any) -> tuple[dict[str, Any], Any]:
    """(the inner optimizer's state_dict, the window) of a checkpoint: ``state_dict()``'s own layout, the
    earlier ``{"optimizer": ..., "gafused": ...}`` layout, or a plain optimizer's state_dict (from a run
    without gafused, or from torch.distributed.checkpoint), which holds no window: it loads between windows."""
    if not isinstance(state_dict, dict):
        raise ValueError(f"state_dict must be a dict from state_dict(), got {type(state_dict).__name__}")
    if "param_groups" not in state_dict and "optimizer" in state_dict:  # the earlier layout
        inner = state_dict["optimizer"]
        if not isinstance(inner, dict):
            raise ValueError(f"state_dict['optimizer'] must be a dict, got {type(inner).__name__}")
        return inner, state_dict.get("gafused")
    if "param_groups" not in state_dict:
        raise ValueError(
            "state_dict must come from GradAccumulator.state_dict() or an optimizer's state_dict(); it has no "
            f"'param_groups' (keys: {sorted(map(str, state_dict))})"
        )
    inner = {key: value for key, value in state_dict.items() if key != "gafused"}
    if "gafused" in state_dict:
        return inner, state_dict["gafused"]
    if acc._micro_step > 0:
        raise RuntimeError(
            "load_state_dict(): the checkpoint is a plain optimizer state (no 'gafused' entry: saved without "
            "gafused, or through torch.distributed.checkpoint), which holds no window, but this accumulator has "
            f"an open window ({acc._micro_step} micro-batch{'es' if acc._micro_step > 1 else ''}). Load it between "
            "windows"
        )
    buffers = [{"numels": list(g.buffer.numels), "had_grad": [False] * len(g.params)} for g in acc._groups]
    return inner, {
        "version": STATE_VERSION,
        "micro_step": 0,
        "skipped_steps": acc._skipped_steps,
        "buffers": buffers,
    }


def in_model_order(acc: GradAccumulator, window: Any) -> Any:
    """An open window saved with ``model=`` before version 4, whose buffers followed the optimizer's parameter
    order, rearranged into this accumulator's layout (the model's order): each parameter's part goes with it.
    Anything else, or a window not shaped like that layout (then refused by ``validated_window``), as given."""
    if not (acc._global and isinstance(window, dict) and window.get("version") in (1, 2, 3)):
        return window
    if not isinstance(window.get("micro_step"), int) or window["micro_step"] <= 0:
        return window
    position = {id(param): (g, i) for g, group in enumerate(acc._groups) for i, param in enumerate(group.params)}
    # The layout _build_groups made without model_order: the optimizer's order, a buffer per (device, dtype).
    layouts = [
        [position[id(param)] for param in params]
        for params in by_device_and_dtype(list(acc._managed), key=lambda param: param)
    ]
    if layouts == [[(g, i) for i in range(len(group.params))] for g, group in enumerate(acc._groups)]:
        return window  # the optimizer lists the parameters in the model's order: nothing moved
    saved = window.get("buffers")
    if not isinstance(saved, list) or len(saved) != len(layouts):
        return window
    with_shapes = all(isinstance(entry, dict) and "shapes" in entry for entry in saved)
    parts: dict[tuple[int, int], tuple[int, Any, bool, torch.Tensor]] = {}
    for entry, layout in zip(saved, layouts, strict=True):
        if not isinstance(entry, dict):
            return window
        numels = [acc._groups[g].buffer.numels[i] for g, i in layout]
        segments, had_grad = entry.get("segments"), entry.get("had_grad")
        shapes = entry.get("shapes", [None] * len(layout))
        if (
            entry.get("numels") != numels
            or not isinstance(segments, torch.Tensor)
            or segments.dim() != 1
            or segments.numel() != sum(numels)
            or not isinstance(had_grad, list)
            or len(had_grad) != len(layout)
            or not isinstance(shapes, list)
            or len(shapes) != len(layout)
        ):
            return window
        for k, (key, start) in enumerate(zip(layout, running_starts(numels), strict=True)):
            parts[key] = (numels[k], shapes[k], had_grad[k], segments[start : start + numels[k]])
    buffers = []
    for g, group in enumerate(acc._groups):
        mine = [parts[(g, i)] for i in range(len(group.params))]
        rearranged = {
            "numels": [part[0] for part in mine],
            "had_grad": [part[2] for part in mine],
            "segments": torch.cat([part[3] for part in mine]),
        }
        if with_shapes:
            rearranged["shapes"] = [part[1] for part in mine]
        buffers.append(rearranged)
    return {**window, "buffers": buffers}


def validated_window(acc: GradAccumulator, window: Any) -> dict[str, Any]:
    """The window part of a checkpoint, checked field by field against this accumulator."""
    if not isinstance(window, dict):
        raise ValueError(f"state_dict['gafused'] must be a dict, got {type(window).__name__}")
    version = window.get("version")
    if type(version) is not int or version not in (1, 2, 3, 4, 5, 6):  # (True == 1, 1.0 == 1: no versions)
        raise ValueError(f"state_dict['gafused']['version']: unknown gafused state version {version!r}")

    def field_error(name: str, expected: str) -> ValueError:
        got = f"got {window[name]!r}" if name in window else "it is missing"
        return ValueError(f"state_dict['gafused']['{name}']: expected {expected}, {got}")

    micro_step = window.get("micro_step")
    if isinstance(micro_step, bool) or not isinstance(micro_step, int) or micro_step < 0:
        raise field_error("micro_step", "a non-negative int")
    if acc.accumulation_steps is not None and micro_step >= acc.accumulation_steps:
        raise field_error("micro_step", f"a position in a window of accumulation_steps={acc.accumulation_steps}")
    skipped = window.get("skipped_steps")
    if isinstance(skipped, bool) or not isinstance(skipped, int) or skipped < 0:
        raise field_error("skipped_steps", "a non-negative int")
    open_window = micro_step > 0
    normalization = window.get("normalization", "mean")  # checkpoints before normalization= were all "mean"
    if normalization not in NORMALIZATIONS:
        raise field_error("normalization", f"one of {NORMALIZATIONS}")
    if open_window and normalization != acc.normalization:
        raise ValueError(
            f"state_dict['gafused']['normalization']: the checkpoint's open window was accumulated to be finished "
            f"as {normalization!r}, and this accumulator has normalization={acc.normalization!r}: set "
            f"opt.normalization = {normalization!r} (between windows) before loading it, or load a checkpoint taken "
            "between windows"
        )
    for name, dtype, required in (
        ("weight_sum", torch.float64, open_window),
        ("bad_weight", torch.bool, False),
        ("inv_loss_scale", torch.float64, False),
    ):
        value = window.get(name)
        if value is None:
            if required:
                raise field_error(name, f"a 0-d {dtype} tensor (the window is open at micro_step {micro_step})")
        elif (
            not isinstance(value, torch.Tensor)
            or value.dim() != 0
            or value.dtype != dtype
            or value.layout != torch.strided
            or value.is_meta
        ):
            raise field_error(name, f"None or a dense 0-d {dtype} tensor holding data (not on the meta device)")
    weight_sum, bad_weight = window.get("weight_sum"), window.get("bad_weight")
    flagged = bad_weight is not None and bool(bad_weight)  # a device weight failed: the window's end refuses it
    if open_window and not flagged and not _possible_weight_sum(weight_sum.item(), acc._weight_range[0]):
        raise field_error(
            "weight_sum",
            f"a sum of micro-batch weights: 0, or at least {acc._weight_range[0]:.3g} (the smallest weight there is; "
            "inf where the weights overflowed, which the window's end refuses)",
        )
    world = window.get("world_size", 1)
    if open_window and world != acc._sync.world_size:
        raise field_error(
            "world_size",
            f"{acc._sync.world_size} (the open window holds this rank's part of a window of {world} ranks)",
        )
    rank = window.get("rank")  # absent from older checkpoints
    if open_window and rank is not None and rank != acc._sync.rank:
        raise field_error(
            "rank",
            f"{acc._sync.rank} (the open window holds rank {rank}'s part of the window: load each rank's own "
            "checkpoint)",
        )
    saved = window.get("buffers")
    if not isinstance(saved, list) or not all(
        isinstance(entry, dict)
        and isinstance(entry.get("numels"), list)
        and all(type(numel) is int for numel in entry["numels"])
        for entry in saved
    ):
        missing = " (it is missing)" if "buffers" not in window else ""
        raise ValueError(
            f"state_dict['gafused']['buffers']: expected a list of dicts with 'numels' (lists of ints){missing}"
        )
    if not open_window:
        # No window to restore: parameters may have moved between buffers since (a layer cast to another
        # dtype), but a checkpoint of parameters of other sizes is another model's.
        sizes = sorted(numel for entry in saved for numel in entry["numels"])
        if sizes != sorted(numel for group in acc._groups for numel in group.buffer.numels):
            raise ValueError(
                "state_dict['gafused']['buffers']: the checkpoint's parameter sizes ('numels') do not match this "
                "accumulator's parameters"
            )
        return window
    if len(saved) != len(acc._groups):
        raise ValueError(
            f"state_dict['gafused']['buffers']: expected {len(acc._groups)} buffer entries for this "
            f"accumulator's parameters (the window is open at micro_step {micro_step})"
        )
    if version >= 6 and window.get("layout") != acc._layout_kind:
        # Positions in one order can read as positions in the other (both count up from 0 within a buffer).
        raise field_error(
            "layout",
            f"{acc._layout_kind!r}, the order this accumulator lays its buffers out in ('model' with model=, "
            "'optimizer' without): an open window laid out in the other order would put parameters' parts into "
            "one another; resume it as it was saved (with or without model=), or load a checkpoint taken between "
            "windows",
        )
    expected_positions = acc._positions(version)
    if version >= 6 and acc._layout_kind == "model":
        order_name, order_hint = "model's parameter order", ""
    else:
        order_name, order_hint = "optimizer's order (its param_groups, flattened)", ", or listed in another order"
    for index, (entry, group, positions) in enumerate(zip(saved, acc._groups, expected_positions, strict=True)):
        where = f"state_dict['gafused']['buffers'][{index}]"
        if not isinstance(entry, dict) or entry.get("numels") != group.buffer.numels:
            raise ValueError(f"{where}: its 'numels' do not match this accumulator's parameters")
        shapes = [list(shape) for shape in group.buffer.shapes]
        if version >= 3 and entry.get("shapes") != shapes:
            raise ValueError(f"{where}['shapes']: expected this accumulator's parameters' shapes {shapes}")
        if version >= 5 and entry.get("positions") != positions:
            raise ValueError(
                f"{where}['positions']: expected {positions}, the positions of this buffer's parameters in the "
                f"{order_name}, got {entry.get('positions')!r}: the window was saved with the parameters in "
                "other buffers (a layer cast to another dtype or moved since, say)"
                f"{order_hint}; resume it as it was saved, or load a checkpoint taken between windows"
            )
        had_grad = entry.get("had_grad")
        if not isinstance(had_grad, list) or len(had_grad) != len(group.params):
            raise ValueError(f"{where}['had_grad']: expected a list of {len(group.params)} bools")
        if not all(isinstance(flag, bool) for flag in had_grad):
            raise ValueError(f"{where}['had_grad']: expected bools only")
        segments = entry.get("segments")
        total = sum(group.buffer.numels)
        if (
            not isinstance(segments, torch.Tensor)
            or segments.dim() != 1
            or segments.numel() != total
            or segments.dtype not in ACCUM_DTYPES
            or segments.layout != torch.strided
            or segments.is_meta
        ):
            raise ValueError(
                f"{where}['segments']: expected a dense flat float32 or float64 tensor of {total} elements "
                f"holding data, not on the meta device (the window is open at micro_step {micro_step})"
            )
    _check_sum_scalable(acc, window, flagged)
    # Checked after the buffers, which say first when the checkpoint is of other parameters.
    lrs = window.get("window_lrs")  # the open window's (between windows nothing reads them)
    if lrs is not None and (
        not isinstance(lrs, list)
        or len(lrs) != len(acc._optimizer.param_groups)
        or not all(lr is None or by_identity(lr) or _is_real(lr) for lr in lrs)
    ):
        raise field_error(
            "window_lrs", f"None or a list of {len(acc._optimizer.param_groups)} learning rates (numbers or None)"
        )
    return window


def running_starts(numels: list[int]) -> Iterator[int]:
    """Where each of ``numels``' parts starts when they are laid end to end (a checkpoint's segments)."""
    start = 0
    for numel in numels:
        yield start
        start += numel


def by_identity(value: Any) -> bool:
    """Whether a learning rate was recorded by identity, as a device tensor is (a tuple or, after a torch.save round
    trip, a list)."""
    return isinstance(value, (tuple, list)) and len(value) in (2, 3) and value[0] == "tensor"


def _check_sum_scalable(acc: GradAccumulator, window: dict[str, Any], flagged: bool) -> None:
    """With normalization="mean", refuse an open window whose weight sum the checkpoint's own buffers could scale by
    (1 / sum a normal number of their dtype) and this accumulator's cannot (a float64 window into float32 buffers):
    loaded, it would be refused at its end, with the micro-batches run since. A sum that no buffer of either could
    scale by loads: its own accumulator's window end refuses it too."""
    if acc.normalization != "mean" or flagged:
        return
    total = window["weight_sum"].item()
    saved_dtype = max((entry["segments"].dtype for entry in window["buffers"]), key=lambda d: torch.finfo(d).tiny)
    if acc._largest_mean_sum < total <= 1 / torch.finfo(saved_dtype).tiny:
        raise ValueError(
            f"state_dict['gafused']['weight_sum']: the open window's weights sum to {total:.4g}, which its "
            f"{saved_dtype} buffers can scale by 1 / sum (normalization='mean') and this accumulator's "
            f"{acc._weight_range[2]} buffers cannot (at most {acc._largest_mean_sum:.4g}): resume it with "
            f"accum_dtype={saved_dtype}, or load a checkpoint taken between windows"
        )


def _possible_weight_sum(value: float, tiny: float) -> bool:
    """Whether ``value`` can be the weight sum of an open window: every weight is 0 or at least ``tiny`` (and
    weights that are each finite can sum to inf)."""
    return value == 0 or value >= tiny  # (nan fails both)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
