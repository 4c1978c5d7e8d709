"""What ``GradAccumulator.state_dict()`` looks like to code that is not gafused, and what it loads.

``state_dict()`` is the inner optimizer's ``state_dict()`` with one key more, ``"gafused"`` (the window), so code
that reads an optimizer checkpoint (``"state"``, ``"param_groups"``) reads it, and a plain optimizer loads it. The
accumulator loads its own checkpoints, those of the earlier ``{"optimizer": ..., "gafused": ...}`` layout, and a
plain optimizer's (between windows only: it holds no window). torch.distributed.checkpoint (DCP), which keeps only
``"state"`` and ``"param_groups"``, round-trips between windows and refuses mid-window, changing nothing.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, get_state_dict, set_state_dict

from gafused import GradAccumulator

from casekit import tanh_mlp

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # DCP in one process

N = 3


def _build(inner: str = "adamw") -> tuple[torch.nn.Module, GradAccumulator]:
    model = tanh_mlp()
    if inner == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    else:  # stateless: torch.distributed.checkpoint steps it with zero gradients to look for state
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, GradAccumulator(optimizer, N, max_grad_norm=0.5)


def _batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(5)
    sizes = [2 + index % 3 for index in range(count)]
    return [
        (
            torch.randn(n, 5, generator=generator, dtype=torch.float64),
            torch.randn(n, 3, generator=generator, dtype=torch.float64),
        )
        for n in sizes
    ]


def _train(model: torch.nn.Module, opt: GradAccumulator, batches: list) -> None:
    for x, y in batches:
        opt.backward(torch.nn.functional.mse_loss(model(x), y, reduction="sum"), weight=x.shape[0])
        opt.step()
        opt.zero_grad()


def _uninterrupted(batches: list, inner: str = "adamw") -> list[torch.Tensor]:
    model, opt = _build(inner)
    _train(model, opt, batches)
    return [p.detach().clone() for p in model.parameters()]


def _assert_same(model: torch.nn.Module, expected: list[torch.Tensor]) -> None:
    for param, value in zip(model.parameters(), expected, strict=True):
        assert torch.equal(param.detach(), value)


def _window(opt: GradAccumulator) -> tuple:
    """What a refused call must leave as it was: position, weight sum, the buffers' bytes, p.grad, learning rates."""
    weight_sum = None if opt._weight_sum is None else opt._weight_sum.clone()
    return (
        opt.micro_step,
        weight_sum,
        [buffer.data.clone() for buffer in opt.buffers],
        [p.grad for group in opt.param_groups for p in group["params"]],
        [group["lr"] for group in opt.param_groups],
    )


def _assert_window(opt: GradAccumulator, before: tuple) -> None:
    micro_step, weight_sum, data, grads, lrs = _window(opt)
    assert micro_step == before[0] and torch.equal(weight_sum, before[1])
    assert all(torch.equal(a, b) for a, b in zip(data, before[2], strict=True))
    assert grads == before[3] and lrs == before[4]


def test_state_dict_is_the_inner_optimizers_plus_the_window() -> None:
    model, opt = _build()
    _train(model, opt, _batches(N + 1))  # one window stepped, one micro-batch into the next
    state = opt.state_dict()
    inner = opt.optimizer.state_dict()
    assert set(state) == set(inner) | {"gafused"} and state["gafused"]["micro_step"] == 1
    assert state["param_groups"] == inner["param_groups"]
    # A plain optimizer loads it as its own (the window is not its business).
    plain = torch.optim.AdamW(tanh_mlp().parameters(), lr=0.5)
    plain.load_state_dict(state)
    assert plain.param_groups[0]["lr"] == 0.1
    for index, values in inner["state"].items():
        loaded = plain.state_dict()["state"][index]
        assert all(torch.equal(loaded[key], value) for key, value in values.items())


def _resumes_exactly(stop: int, checkpoint: Callable[[GradAccumulator], dict], micro_step: int) -> None:
    """Train the first ``stop`` micro-batches, load ``checkpoint(opt)`` (and the model) into a new model and
    accumulator, train the rest there: bitwise the uninterrupted run."""
    batches = _batches(3 * N)
    expected = _uninterrupted(batches)
    model, opt = _build()
    _train(model, opt, batches[:stop])
    resumed, resumed_opt = _build()
    resumed.load_state_dict(model.state_dict())
    resumed_opt.load_state_dict(checkpoint(opt))
    assert resumed_opt.micro_step == micro_step
    _train(resumed, resumed_opt, batches[stop:])
    _assert_same(resumed, expected)


def test_a_plain_optimizer_checkpoint_loads_between_windows() -> None:
    _resumes_exactly(N, lambda opt: opt.optimizer.state_dict(), micro_step=0)  # what a run without gafused saves


def test_a_plain_optimizer_checkpoint_is_refused_mid_window_and_changes_nothing() -> None:
    batches = _batches(3 * N)
    expected = _uninterrupted(batches)
    model, opt = _build()
    _train(model, opt, batches[: N + 1])
    before = _window(opt)
    with pytest.raises(RuntimeError, match=r"plain optimizer state .* open window \(1 micro-batch\)"):
        opt.load_state_dict(opt.optimizer.state_dict())
    _assert_window(opt, before)
    _train(model, opt, batches[N + 1 :])
    _assert_same(model, expected)


def test_the_earlier_layout_still_loads_mid_window() -> None:
    def earlier(opt: GradAccumulator) -> dict:
        state = opt.state_dict()
        return {
            "optimizer": {key: value for key, value in state.items() if key != "gafused"},
            "gafused": state["gafused"],
        }

    _resumes_exactly(N + 2, earlier, micro_step=2)


def test_an_inner_optimizer_state_with_an_optimizer_key_is_this_layout_not_the_earlier_one() -> None:
    """The earlier ``{"optimizer": ..., "gafused": ...}`` layout is told apart by having no 'param_groups'. An inner
    optimizer whose own state_dict() carries an "optimizer" entry (a wrapper keeping its base optimizer's state
    there, say) must still load as this layout: taken for the earlier one, its inner optimizer would get that entry
    alone and the window would be lost, or the load refused."""

    def with_optimizer_entry(optimizer: torch.optim.Optimizer) -> None:
        optimizer.register_state_dict_post_hook(lambda _, state: {**state, "optimizer": {"base": "kept"}})

    batches = _batches(3 * N)
    expected = _uninterrupted(batches)
    model, opt = _build()
    with_optimizer_entry(opt.optimizer)
    _train(model, opt, batches[: N + 2])
    state = opt.state_dict()
    assert state["optimizer"] == {"base": "kept"} and state["gafused"]["micro_step"] == 2
    resumed, resumed_opt = _build()
    with_optimizer_entry(resumed_opt.optimizer)
    resumed.load_state_dict(model.state_dict())
    resumed_opt.load_state_dict(state)
    assert resumed_opt.micro_step == 2
    _train(resumed, resumed_opt, batches[N + 2 :])
    _assert_same(resumed, expected)


def _conv_model(memory_format: torch.memory_format) -> torch.nn.Module:
    torch.manual_seed(3)
    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Tanh(), torch.nn.Conv2d(4, 2, 2)).double()
    return conv.to(memory_format=memory_format)


def _resume_conv(saved: str, loaded: str, checkpoint: Callable[[GradAccumulator], dict]) -> None:
    """Save a window one micro-batch in with the model in memory format ``saved`` (``checkpoint(opt)``), resume it in
    ``loaded``, and train on: asserts the result is the uninterrupted run's."""
    formats = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}
    generator = torch.Generator().manual_seed(4)
    xs = [torch.randn(2, 3, 6, 7, generator=generator, dtype=torch.float64) for _ in range(2 * N)]

    def train(model: torch.nn.Module, opt: GradAccumulator, inputs: list[torch.Tensor]) -> None:
        for x in inputs:
            opt.backward(model(x).square().mean(), weight=x.shape[0])
            opt.step()

    def build(memory_format: str) -> tuple[torch.nn.Module, GradAccumulator]:
        model = _conv_model(formats[memory_format])
        return model, GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), N)

    model, opt = build(saved)
    train(model, opt, xs)
    expected = [p.detach().clone() for p in model.parameters()]
    model, opt = build(saved)
    train(model, opt, xs[:1])
    resumed, resumed_opt = build(loaded)
    resumed.load_state_dict(model.state_dict())
    resumed_opt.load_state_dict(checkpoint(opt))
    assert resumed_opt.micro_step == 1
    train(resumed, resumed_opt, xs[1:])
    for param, value in zip(resumed.parameters(), expected, strict=True):
        torch.testing.assert_close(param.detach(), value, rtol=0, atol=1e-14)  # convolutions of either format


@pytest.mark.parametrize("saved, loaded", [("channels_last", "contiguous"), ("contiguous", "channels_last")])
def test_a_mid_window_checkpoint_resumes_in_another_memory_format(saved: str, loaded: str) -> None:
    """The window is saved in each parameter's row-major order: resuming after ``model.to(memory_format=...)`` (or
    without it) is exact; saved in the buffer's memory order, the segments were scrambled (an error of 1e-2)."""
    _resume_conv(saved, loaded, GradAccumulator.state_dict)


def _as_version(opt: GradAccumulator, version: int) -> dict:
    """``opt``'s checkpoint as gafused wrote it at ``version`` 1 (each segment row-major) or 2 (each segment in the
    buffer's memory order): neither recorded shapes, positions or the layout."""
    state = opt.state_dict()
    window = {key: value for key, value in state["gafused"].items() if key != "layout"}
    window["version"] = version
    entries = []
    for buffer, entry in zip(opt.buffers, window["buffers"], strict=True):
        entry = {key: value for key, value in entry.items() if key not in ("shapes", "positions")}
        if version == 2:
            entry["segments"] = torch.cat([buffer.segment(index).reshape(-1) for index in range(len(buffer))])
        entries.append(entry)
    window["buffers"] = entries
    return {**state, "gafused": window}


@pytest.mark.parametrize(
    "version, saved, loaded",
    [(1, "contiguous", "channels_last"), (1, "channels_last", "channels_last"), (2, "channels_last", "channels_last")],
)
def test_a_mid_window_checkpoint_of_an_earlier_version_resumes_in_its_own_order(
    version: int, saved: str, loaded: str
) -> None:
    """Version 1 saved each segment row-major, as now: it resumes in either memory format. Version 2 saved the
    buffer's memory order without recording it: it resumes in the memory format it was saved in."""
    _resume_conv(saved, loaded, lambda opt: _as_version(opt, version))


def test_a_mid_window_checkpoint_of_other_shapes_is_refused() -> None:
    """Parameters of the same sizes but other shapes: the window's segments would land transposed."""
    saver_model = torch.nn.Linear(4, 6, bias=False)
    saver = GradAccumulator(torch.optim.SGD(saver_model.parameters(), lr=0.1), N)
    saver.backward(saver_model(torch.randn(2, 4)).sum())
    saver.step()
    loader_model = torch.nn.Linear(6, 4, bias=False)
    loader = GradAccumulator(torch.optim.SGD(loader_model.parameters(), lr=0.1), N)
    with pytest.raises(ValueError, match=r"\['buffers'\]\[0\]\['shapes'\]: expected .* \[\[4, 6\]\]"):
        loader.load_state_dict(saver.state_dict())
    assert loader.micro_step == 0


def test_a_checkpoint_between_windows_loads_into_a_model_cast_since() -> None:
    """Between windows the checkpoint holds no window: a layer cast to another dtype since (its parameters now in
    a buffer of their own) loads; parameters of other sizes (as many of them, so that no group check sees it) are
    another model's and are refused for their sizes, changing nothing."""
    model, opt = _build()
    _train(model, opt, _batches(N))
    opt._skipped_steps = 2  # (as two skipped windows would leave it)
    state = opt.state_dict()
    cast = tanh_mlp()
    cast[0].float()
    loader = GradAccumulator(torch.optim.AdamW(cast.parameters(), lr=0.1), N)
    assert len(loader.buffers) == len(opt.buffers) + 1
    loader.load_state_dict(state)
    assert (loader.micro_step, loader.skipped_steps) == (0, 2)
    resized = tanh_mlp((5, 3, 3))  # 4 parameters, as the saved model, of other sizes
    other = GradAccumulator(torch.optim.AdamW(resized.parameters(), lr=0.1), N)
    message = "state_dict['gafused']['buffers']: the checkpoint's parameter sizes ('numels') do not match"
    with pytest.raises(ValueError, match=re.escape(message)):
        other.load_state_dict(state)
    assert other.skipped_steps == 0 and not other.optimizer.state


def test_a_state_dict_without_param_groups_is_refused() -> None:
    _, opt = _build()
    with pytest.raises(ValueError, match="no 'param_groups'"):
        opt.load_state_dict({"state": {}})


def _edited(opt: GradAccumulator, edit: Callable[[dict], None]) -> dict:
    """``opt.state_dict()`` with ``edit`` applied to its window (in place)."""
    state = opt.state_dict()
    edit(state["gafused"])
    return state


@pytest.mark.parametrize("field", ["rank", "window_lrs", "world_size", "normalization"])
def test_a_mid_window_checkpoint_without_a_later_field_resumes_exactly(field: str) -> None:
    """Fields added to the window over time are absent from older checkpoints, which resume exactly: no rank (one
    process's window), no window_lrs (the window's learning rates not recorded), no world_size (one process), no
    normalization ("mean")."""
    _resumes_exactly(N + 1, lambda opt: _edited(opt, lambda window: window.pop(field)), micro_step=1)


def test_a_checkpoint_between_windows_of_another_rank_and_world_size_loads() -> None:
    """Between windows the checkpoint holds no rank's part of a window: one taken on rank 1 of 2 resumes in a single
    process (rank and world size are checked only for an open window)."""

    def elsewhere(window: dict) -> None:
        window.update(world_size=2, rank=1)

    _resumes_exactly(N, lambda opt: _edited(opt, elsewhere), micro_step=0)


@pytest.mark.parametrize(
    "recorded", [("tensor", 140000000000, 0), ["tensor", 140000000000, 0], ["tensor", 140000000000]]
)
def test_a_learning_rate_recorded_by_identity_resumes_as_the_loaded_optimizers(recorded) -> None:
    """A device-tensor learning rate is recorded by identity (a tuple, a list after some round trips; two entries in
    older checkpoints): the loaded optimizer's own learning rate stands for it, so resuming the window neither is
    refused nor warns of a learning rate changed inside it."""

    def by_identity(window: dict) -> None:
        window["window_lrs"] = [recorded]

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*learning rate changed")
        _resumes_exactly(N + 1, lambda opt: _edited(opt, by_identity), micro_step=1)


def test_a_window_learning_rate_of_none_loads() -> None:
    """A param group without a learning rate is recorded as None: such a window loads."""
    model, opt = _build()
    _train(model, opt, _batches(N + 1))
    state = _edited(opt, lambda window: window.update(window_lrs=[None]))
    _, resumed_opt = _build()
    resumed_opt.load_state_dict(state)
    assert resumed_opt.micro_step == 1


@pytest.mark.parametrize("first", ["zero", "the smallest weight"])
def test_a_mid_window_checkpoint_at_the_edge_of_the_weights_resumes_exactly(first: str) -> None:
    """A window whose weights so far sum to 0 (a micro-batch of weight 0) or to the smallest weight there is (the
    smallest normal number of the accumulation dtype) is a window; checkpointed there, it resumes exactly."""
    batches = _batches(2 * N)

    def weights(opt: GradAccumulator) -> list[float]:
        edge = 0.0 if first == "zero" else torch.finfo(opt.buffers[0].accum_dtype).tiny
        return [x.shape[0] for x, _ in batches[:N]] + [edge] + [x.shape[0] for x, _ in batches[N + 1 :]]

    def train(model: torch.nn.Module, opt: GradAccumulator, start: int, stop: int) -> None:
        for (x, y), weight in list(zip(batches, weights(opt), strict=True))[start:stop]:
            opt.backward(torch.nn.functional.mse_loss(model(x), y, reduction="sum"), weight=weight)
            opt.step()
            opt.zero_grad()

    model, opt = _build()
    train(model, opt, 0, 2 * N)
    assert opt.stepped
    expected = [p.detach().clone() for p in model.parameters()]
    model, opt = _build()
    train(model, opt, 0, N + 1)
    state = opt.state_dict()
    assert state["gafused"]["weight_sum"].item() == weights(opt)[N]
    resumed, resumed_opt = _build()
    resumed.load_state_dict(model.state_dict())
    resumed_opt.load_state_dict(state)
    assert resumed_opt.micro_step == 1
    train(resumed, resumed_opt, N + 1, 2 * N)
    _assert_same(resumed, expected)


def test_a_plain_optimizer_checkpoint_keeps_the_accumulators_skipped_steps() -> None:
    """A plain optimizer's checkpoint holds no window and no count of skipped windows: the accumulator keeps its own."""
    model, opt = _build()
    _train(model, opt, _batches(N))
    opt._skipped_steps = 2  # (as two skipped windows would leave it)
    opt.load_state_dict(opt.optimizer.state_dict())
    assert (opt.micro_step, opt.skipped_steps) == (0, 2)


def test_the_inner_optimizer_loads_its_own_part_only() -> None:
    """The inner optimizer's load_state_dict gets the keys of its own state_dict(), not the window."""
    model, opt = _build()
    _train(model, opt, _batches(N + 1))
    state = opt.state_dict()
    seen = []
    opt.optimizer.register_load_state_dict_pre_hook(lambda optimizer, loaded: seen.append(set(loaded)))
    opt.load_state_dict(state)
    assert seen == [set(opt.optimizer.state_dict())]


def test_a_mid_window_checkpoint_of_version_3_of_other_shapes_is_refused() -> None:
    """Version 3 recorded the shapes too (with no positions or layout): one of other shapes is refused for them."""
    saver_model = torch.nn.Linear(4, 6, bias=False)
    saver = GradAccumulator(torch.optim.SGD(saver_model.parameters(), lr=0.1), N)
    saver.backward(saver_model(torch.randn(2, 4)).sum())
    saver.step()

    def version_3(window: dict) -> None:
        window["version"] = 3
        del window["layout"], window["buffers"][0]["positions"]

    state = _edited(saver, version_3)
    loader_model = torch.nn.Linear(6, 4, bias=False)
    loader = GradAccumulator(torch.optim.SGD(loader_model.parameters(), lr=0.1), N)
    with pytest.raises(ValueError, match=r"\['buffers'\]\[0\]\['shapes'\]: expected .* \[\[4, 6\]\]"):
        loader.load_state_dict(state)
    assert loader.micro_step == 0


# --- torch.distributed.checkpoint -----------------------------------------------------------------------------------


@pytest.mark.parametrize("inner", ["adamw", "sgd"])
def test_dcp_round_trip_between_windows_is_bitwise(tmp_path, inner: str) -> None:
    batches = _batches(3 * N)
    expected = _uninterrupted(batches, inner)
    model, opt = _build(inner)
    _train(model, opt, batches[:N])
    model_state, optim_state = get_state_dict(model, opt)
    assert opt.micro_step == 0  # DCP's zero-gradient step (stateless SGD) did not open a window
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp_path))

    resumed, resumed_opt = _build(inner)
    model_state, optim_state = get_state_dict(resumed, resumed_opt)  # the template DCP loads into
    assert resumed_opt.micro_step == 0
    loaded = {"model": model_state, "optim": optim_state}
    dcp.load(loaded, checkpoint_id=str(tmp_path))
    set_state_dict(resumed, resumed_opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    assert resumed_opt.micro_step == 0
    _train(resumed, resumed_opt, batches[N:])
    _assert_same(resumed, expected)


@pytest.mark.parametrize("inner", ["adamw", "sgd"])
def test_dcp_given_the_inner_optimizer_may_make_its_state_with_its_zero_step(inner: str) -> None:
    """The inner optimizer refuses a step() outside the accumulator's, except DCP's zero step that creates its state
    (lr 0): a state dict taken of the inner optimizer itself (kept in scope, as an FSDP2 script may) before any
    window works, changes no parameter, opens no window, and leaves what a state dict taken through the accumulator
    leaves (DCP's zero step counts as a step of AdamW's, as in plain PyTorch)."""
    batches = _batches(2 * N)
    runs = []
    for given in ("accumulator", "inner"):
        model, opt = _build(inner)
        before = [p.detach().clone() for p in model.parameters()]
        state = get_optimizer_state_dict(model, opt if given == "accumulator" else opt.optimizer)
        assert set(state) >= {"state", "param_groups"} and opt.micro_step == 0 and opt._micro is None
        _assert_same(model, before)
        assert all(p.grad is None for p in model.parameters())
        _train(model, opt, batches)
        runs.append([p.detach().clone() for p in model.parameters()])
    _assert_same(model, runs[0])
    with pytest.raises(RuntimeError, match=r"step\(\) was called on the optimizer a GradAccumulator wraps"):
        opt.optimizer.step()


@pytest.mark.parametrize("inner", ["adamw", "sgd"])
def test_dcp_mid_window_is_refused_and_changes_nothing(inner: str) -> None:
    batches = _batches(3 * N)
    expected = _uninterrupted(batches, inner)
    model, opt = _build(inner)
    _train(model, opt, batches[: N + 1])
    before = _window(opt)
    with pytest.raises(RuntimeError, match=r"torch.distributed.checkpoint keeps only .* \(1 micro-batch folded\)"):
        get_optimizer_state_dict(model, opt)
    _assert_window(opt, before)
    plain_state = {key: value for key, value in opt.state_dict().items() if key != "gafused"}
    with pytest.raises(RuntimeError, match="open window"):
        set_state_dict(model, opt, model_state_dict={}, optim_state_dict=plain_state)
    _assert_window(opt, before)
    _train(model, opt, batches[N + 1 :])
    _assert_same(model, expected)


@pytest.mark.parametrize("inner", ["adamw", "sgd"])
def test_dcp_between_backward_and_step_changes_nothing(inner: str) -> None:
    """After opt.backward() the gradients are folded (p.grad is None), so DCP steps the optimizer to create its
    state: that step must not end the user's micro-batch; DCP's state_dict() then refuses the open micro-batch."""
    batches = _batches(3 * N)
    expected = _uninterrupted(batches, inner)
    model, opt = _build(inner)
    x, y = batches[0]
    opt.backward(torch.nn.functional.mse_loss(model(x), y, reduction="sum"), weight=x.shape[0])
    with pytest.raises(RuntimeError, match=r"backward\(\) was called without step\(\)"):
        get_optimizer_state_dict(model, opt)
    assert opt.micro_step == 0 and opt._micro is not None and not opt.optimizer.state
    opt.step()
    opt.zero_grad()
    _train(model, opt, batches[1:])
    _assert_same(model, expected)


def test_dcp_is_recognized_through_wrappers_of_step(tmp_path) -> None:
    """A subclass overriding step() and an LR scheduler (which wraps the optimizer's step) stand between DCP and
    the accumulator's step: DCP's zero-gradient step is still recognized, and the round trip is bitwise."""

    class Logged(GradAccumulator):
        def step(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
            return super().step(*args, **kwargs)

    def build() -> tuple[torch.nn.Module, GradAccumulator, torch.optim.lr_scheduler.LRScheduler]:
        model = tanh_mlp()
        opt = Logged(torch.optim.AdamW(model.parameters(), lr=0.1), N)
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda window: 1 / (1 + window))

    batches = _batches(3 * N)
    model, opt, scheduler = build()
    _train(model, opt, batches)
    expected = [p.detach().clone() for p in model.parameters()]
    model, opt, scheduler = build()
    _train(model, opt, batches[:N])
    model_state, optim_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp_path))
    resumed, resumed_opt, _ = build()
    model_state, optim_state = get_state_dict(resumed, resumed_opt)
    assert resumed_opt.micro_step == 0
    loaded = {"model": model_state, "optim": optim_state}
    dcp.load(loaded, checkpoint_id=str(tmp_path))
    set_state_dict(resumed, resumed_opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    _train(resumed, resumed_opt, batches[N:])
    _assert_same(resumed, expected)
