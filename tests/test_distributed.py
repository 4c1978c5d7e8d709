"""Across ranks: 2 gloo processes on CPU against a float64 single process that trains on every rank's data.

The cases run once, in a subprocess (tests/distributed_cases.py: model, data, recipes); each test reads the
results of both ranks. Data: token counts that differ across ranks and micro-batches, three windows of which
the last is partial (flush), clipping active, SGD so that any scale error shows in the parameters.
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import gafused

import distributed_cases as cases
from casekit import case_script_target, run_case_script

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
)

# Parameter error |p - p_truth| / |p_truth - p0| of fp32 training against the float64 truth: float32 rounding
# of forward, backward and the sums (plain fp32 PyTorch on the same big batch is measured beside it).
FP32_ERROR = 2e-5
# A bfloat16 all-reduce rounds each summed gradient to 8 bits of mantissa (relative 2^-8).
BF16_ERROR = 2.0**-8

EXACT_CASES = [
    name for name, case in cases.CASES.items() if case.get("reduce_dtype") is None and case.get("pass_model", True)
]
WITHOUT_MODEL = [name for name, case in cases.CASES.items() if not case.get("pass_model", True)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_case_script(cases.__file__, tmp_path_factory.mktemp("distributed") / "results.pt")


def _error(params: list[torch.Tensor], truth: list[torch.Tensor], initial: list[torch.Tensor]) -> float:
    return max(float((p.double() - t).norm() / (t - i).norm()) for p, t, i in zip(params, truth, initial, strict=True))


@pytest.fixture(scope="module")
def truths() -> dict[bool, tuple]:
    return {weighted: cases.truth(weighted) for weighted in (True, False)}


def _result(ranks: list[dict], name: str, rank: int = 0) -> dict:
    result = ranks[rank][name]
    assert "error" not in result, f"{name} on rank {rank}: {result['error']}"
    return result


def test_plain_fp32_baseline_is_within_the_bound(truths: dict[bool, tuple]) -> None:
    """The bound is fp32 rounding: plain PyTorch fp32 on the same big batch lands inside it too."""
    truth_params, _, initial = truths[True]
    model = cases.make_model()
    for window, count in enumerate(cases.WINDOWS):
        model.zero_grad()
        total, weight_sum = 0.0, 0
        for rank in range(cases.WORLD):
            for micro in range(count):
                x, y = cases.micro_batch(rank, window, micro)
                total = total + cases.token_losses(model, x, y).sum()
                weight_sum += x.shape[0]
        (total / weight_sum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cases.MAX_NORM)
        with torch.no_grad():
            for p in model.parameters():
                p -= cases.LR * p.grad
    baseline = _error([p.detach() for p in model.parameters()], truth_params, initial)
    assert 0 < baseline < FP32_ERROR


@pytest.mark.parametrize("name", EXACT_CASES)
def test_matches_float64_big_batch(ranks: list[dict], truths: dict[bool, tuple], name: str) -> None:
    weighted = cases.CASES[name].get("weighted", True)
    truth_params, truth_norms, initial = truths[weighted]
    for rank in range(cases.WORLD):
        result = _result(ranks, name, rank)
        assert _error(result["params"], truth_params, initial) < FP32_ERROR
        for norm, truth_norm in zip(result["norms"], truth_norms, strict=True):
            assert norm == pytest.approx(truth_norm, rel=1e-5)
    # The clip threshold is below every window's norm: clipping was exercised.
    assert all(norm > cases.MAX_NORM for norm in truth_norms)


@pytest.mark.parametrize("name", ["ddp-backward-f64", "fsdp-backward-f64"])
def test_a_float64_model_is_float64_across_ranks(ranks: list[dict], truths: dict[bool, tuple], name: str) -> None:
    """Weights inexact in float32, a float64 model: weight sums, buffers and norms stay float64 over the wire, so
    the result is the float64 truth's to float64 rounding (a float32 weight sum would be 1e-8 off)."""
    truth_params, truth_norms, initial = truths[True]
    for rank in range(cases.WORLD):
        result = _result(ranks, name, rank)
        assert _error(result["params"], truth_params, initial) < 1e-12
        for norm, truth_norm in zip(result["norms"], truth_norms, strict=True):
            assert norm == pytest.approx(truth_norm, rel=1e-13)


@pytest.mark.parametrize("name", WITHOUT_MODEL)
def test_the_data_expose_a_missing_model(ranks: list[dict], truths: dict[bool, tuple], name: str) -> None:
    """Without model= (DDP averaging per micro-batch, or no_sync folding unreduced gradients, and per-rank weight
    sums) the same data land far from the truth: the exact cases' agreement is not an accident of the data."""
    truth_params, _, initial = truths[True]
    assert _error(_result(ranks, name)["params"], truth_params, initial) > 0.05


@pytest.mark.parametrize("name", [name for name in cases.CASES if name not in WITHOUT_MODEL])
def test_ranks_agree_bitwise(ranks: list[dict], name: str) -> None:
    """DDP replicas stay bitwise identical; every rank reports the same global grad_norm (FSDP2: same full params)."""
    first, second = _result(ranks, name, 0), _result(ranks, name, 1)
    assert first["norms"] == second["norms"]
    for a, b in zip(first["params"], second["params"], strict=True):
        assert torch.equal(a, b)


def test_bf16_reduction_is_within_bf16_rounding(ranks: list[dict], truths: dict[bool, tuple]) -> None:
    truth_params, truth_norms, initial = truths[True]
    result = _result(ranks, "ddp-backward-bf16")
    error = _error(result["params"], truth_params, initial)
    assert FP32_ERROR < error < BF16_ERROR  # rounded like bf16, and no worse
    for norm, truth_norm in zip(result["norms"], truth_norms, strict=True):
        assert norm == pytest.approx(truth_norm, rel=BF16_ERROR)


def test_a_checkpoint_in_the_optimizers_order_loads_in_the_models(ranks: list[dict]) -> None:
    """Version 3 laid a model='s buffers out in the optimizer's order: such a mid-window checkpoint, of an optimizer
    that lists the parameters in reverse, restores each parameter's part of the window (the buffers bitwise). This
    version's checkpoint, whose positions are in the model's order, loads whatever order the resumed optimizer lists
    the parameters in; one of version 5, whose positions are in the optimizer's order, loads only in that order. One
    laid out in the model's order does not load into an accumulator without model=, nor the reverse."""
    for rank in range(cases.WORLD):
        said = ranks[rank]["old layout checkpoint"]
        assert said == {
            "this version": True,
            "this version, the optimizer's order changed": True,
            "version 5": True,
            "version 3, the optimizer's order": True,
            "version 5, the optimizer's order changed: refused": True,
            "saved with model=, loaded without: refused": True,
            "saved without model=, loaded with: refused": True,
        }, said


def test_an_earlier_checkpoint_loaded_with_model_is_rearranged_only_when_it_is_one(ranks: list[dict]) -> None:
    """With model= and the optimizer's order reversed: a version-4 window (already in the model's order) over
    parameters of one size loads as laid out; a version-1 or 3 window whose fields do not describe this layout, and
    one without world_size (a single process's) on two ranks, are refused naming the field, nothing changed."""
    for rank in range(cases.WORLD):
        said = ranks[rank]["old layout refusals"]
        assert said == {
            "version 4, parameters of one size: loads as laid out": True,
            "version 1, numels of other parameters: refused": True,
            "version 3, segments one element longer: refused": True,
            "version 3, had_grad one longer: refused": True,
            "version 3, shapes one longer: refused": True,
            "version 3, micro_step None: refused": True,
            "version 3, no segments: refused": True,
            "version 3, a buffer entry more: refused": True,
            "no world_size: refused": True,
        }, said


@pytest.mark.parametrize("loop", ["backward", "step"])
def test_checkpoint_mid_window_resumes_bitwise(ranks: list[dict], loop: str) -> None:
    resumed, straight = _result(ranks, f"ddp-{loop}-checkpoint"), _result(ranks, f"ddp-{loop}")
    assert resumed["norms"] == straight["norms"]
    for a, b in zip(resumed["params"], straight["params"], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", [name for name in EXACT_CASES if name.startswith("ddp")] + ["ddp-backward-bf16"])
def test_ddp_one_collective_per_bucket_per_window(ranks: list[dict], name: str) -> None:
    """Nothing goes over the wire before a window's last micro-batch; then each bucket once, plus the window's
    window sums (window_sums_bytes); DDP's own bucket all-reduce never runs."""
    result = _result(ranks, name)
    assert result["buckets"] > 1
    assert result["wire_before_last"] == [0] * len(cases.WINDOWS)
    element = 2 if cases.CASES[name].get("reduce_dtype") == torch.bfloat16 else 4
    window_sums = cases.window_sums_bytes(result["managed_params"], result["buckets"])
    wire_bytes = result["bucket_bytes"] // 4 * element + window_sums
    assert result["wire"] == [(result["buckets"] + 1, wire_bytes)] * len(cases.WINDOWS)
    assert result["ddp_own_all_reduces"] == 0


@pytest.mark.parametrize("loop", ["backward", "step"])
def test_building_the_accumulator_checks_the_ranks_agree_in_one_collective(ranks: list[dict], loop: str) -> None:
    """Construction with model= is one all-reduce of two int64 per setting (a digest and its negation); the case
    resumed from a mid-window checkpoint builds its accumulator inside a window, where it is counted."""
    result = _result(ranks, f"ddp-{loop}-checkpoint")
    assert result["wire_at_build"] == (1, 16 * result["settings"])
    assert _result(ranks, f"ddp-{loop}")["wire_at_build"] is None


def test_ddp_reduction_overlaps_the_last_backward(ranks: list[dict]) -> None:
    """With the weight up front, a bucket's all-reduce starts as soon as it is folded: the last layers' bucket is
    on the wire before backward reaches the first layer (and nothing is, on the earlier micro-batches)."""
    seen = _result(ranks, "ddp-backward")["seen_by_first_layer"]
    per_window = [seen[:3], seen[3:6]]  # two full windows of N = 3 micro-batches (the checkpoint case aside)
    for counts in per_window:
        assert counts[:2] == [0, 0] and counts[2] >= 1
    step_loop = _result(ranks, "ddp-step")["seen_by_first_layer"]
    assert step_loop[:3] == [0, 0, 0]  # the loss.backward() loop reduces at step()


def test_driven_window_reduces_during_the_last_backward_when_declared_there(ranks: list[dict]) -> None:
    """end_window=True given to the last backward() starts the bucket all-reduces during it, as on a counted
    window's N-th micro-batch; declared only at step(), nothing is on the wire before that step()."""
    starts = [sum(cases.WINDOWS[:window]) for window in range(len(cases.WINDOWS) + 1)]
    declared = _result(ranks, "ddp-backward-driven")["seen_by_first_layer"]
    for window, count in enumerate(cases.WINDOWS):
        counts = declared[starts[window] : starts[window + 1]]
        assert counts[: count - 1] == [0] * (count - 1) and counts[-1] >= 1
    assert _result(ranks, "ddp-backward-driven-at_step")["seen_by_first_layer"] == [0] * starts[-1]


@pytest.mark.parametrize("name", [name for name in cases.CASES if name.startswith("fsdp")])
def test_fsdp_sends_only_the_window_sums_and_the_norm(ranks: list[dict], name: str) -> None:
    """FSDP2 reduce-scatters the gradients itself; gafused adds two small all-reduces per window, of the same size
    on every rank (no per-bucket flags: buckets are cut from each rank's shards, their number differs)."""
    result = _result(ranks, name)
    assert result["wire_before_last"] == [0] * len(cases.WINDOWS)
    window_sums = cases.window_sums_bytes(result["managed_params"], 0)
    assert result["wire"] == [(2, window_sums + 16)] * len(cases.WINDOWS)


def test_fsdp_ranks_whose_shards_cut_different_bucket_counts_end_their_windows(ranks: list[dict]) -> None:
    """Uneven shards give the ranks different bucket counts; the window's all-reduces must still match in size (a
    gloo abort, an NCCL hang before), and the case is exact like the others (tests above)."""
    counts = [_result(ranks, "fsdp-backward-uneven_buckets", rank)["buckets"] for rank in range(cases.WORLD)]
    assert len(set(counts)) > 1, counts


@pytest.mark.parametrize("name", list(cases.IRREGULAR))
def test_irregular_gradients_match_float64_and_ranks_agree(ranks: list[dict], name: str) -> None:
    """A parameter used on one rank only is stepped on every rank (as DDP does); gradients that land after
    their bucket's all-reduce started (a weight shared by two reentrant checkpoints) are reduced too, and a
    parameter unfrozen after the accumulator was built is hooked by the next backward: every rank ends equal, at
    the float64 big batch's result."""
    results = [ranks[rank][f"irregular: {name}"] for rank in range(cases.WORLD)]
    for rank, result in enumerate(results):
        assert not isinstance(result, dict), f"{name} on rank {rank}: {result['error']}"
    assert all(torch.equal(a, b) for a, b in zip(results[0], results[1], strict=True))
    truth, initial = cases.irregular_truth(name)
    for index, (param, want, start) in enumerate(zip(results[0], truth, initial, strict=True)):
        if torch.equal(want, start):  # no gradient anywhere (extra, when no rank uses it): not stepped
            assert torch.equal(param.double(), start), index
        else:
            assert float((param.double() - want).norm() / (want - start).norm()) < FP32_ERROR, index


def test_a_checkpoint_loaded_over_an_interrupted_last_micro_batch_drops_its_reductions(ranks: list[dict]) -> None:
    """The interrupted micro-batch's bucket reductions and late parts belong to no window after the load: the
    run ends exactly where the uninterrupted one does."""
    for rank in range(cases.WORLD):
        result = ranks[rank]["irregular interrupted"]
        plain = ranks[rank]["irregular: shared in two reentrant checkpoints"]
        assert not isinstance(result, dict), f"rank {rank}: {result['error']}"
        assert all(torch.equal(a, b) for a, b in zip(result, plain, strict=True)), rank


@pytest.mark.parametrize("name", list(cases.DDP_FAILED_BACKWARD))
def test_ddp_backward_failing_on_every_rank_discards_the_window_and_goes_on(ranks: list[dict], name: str) -> None:
    """The same micro-batch's backward fails on every rank after later layers' buckets were folded (on a window's
    last micro-batch, after their all-reduces were launched): every rank discards the window with a note, the
    reductions in flight are waited for and forgotten, and the later windows match the float64 truth of the same
    schedule, the replicas bitwise equal."""
    results = [_result(ranks, f"ddp failed backward: {name}", rank) for rank in range(cases.WORLD)]
    last = cases.DDP_FAILED_BACKWARD[name] % cases.N == cases.N - 1
    for result in results:
        assert "backward failed" in result["said"] and "window was discarded" in result["said"]
        assert result["micro_step"] == 0
        assert (result["all-reduces launched"] > 0) == last
    assert all(torch.equal(a, b) for a, b in zip(results[0]["params"], results[1]["params"], strict=True))
    truth, initial = cases.ddp_failed_backward_truth(name)
    assert _error(results[0]["params"], truth, initial) < FP32_ERROR


def test_module_buffers_are_broadcast_once_per_window_as_under_no_sync(ranks: list[dict]) -> None:
    """DDP broadcasts rank 0's buffers (BatchNorm statistics) at the forward after a synchronized backward: with
    gafused as with plain DDP and no_sync(), the ranks hold rank 0's statistics after it."""
    for accumulate in ("gafused", "no_sync"):
        stats = [ranks[rank]["batchnorm"][accumulate] for rank in range(cases.WORLD)]
        assert all(torch.equal(a, b) for a, b in zip(stats[0], stats[1], strict=True)), accumulate
    gafused_stats, plain_stats = ranks[0]["batchnorm"]["gafused"], ranks[0]["batchnorm"]["no_sync"]
    for ours, plain in zip(gafused_stats, plain_stats, strict=True):
        torch.testing.assert_close(ours, plain, rtol=1e-5, atol=1e-6)


def test_module_buffers_are_broadcast_at_the_forwards_no_sync_broadcasts_them(ranks: list[dict]) -> None:
    """Inside a window each rank keeps its own BatchNorm statistics; rank 0's reach the others once per window, at
    the forward after the window's synchronized backward, as with plain DDP and no_sync(): every rank's statistics
    after every micro-batch's forward are plain DDP's (a broadcast at every forward would give rank 1 rank 0's)."""
    for rank in range(cases.WORLD):
        ours, plain = ranks[rank]["batchnorm trace"]["gafused"], ranks[rank]["batchnorm trace"]["no_sync"]
        assert len(ours) == len(plain) == 2 * cases.N
        for micro, (a, b) in enumerate(zip(ours, plain, strict=True)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"rank {rank}, micro-batch {micro}")


def test_fsdp_cast_overflow_in_one_shard_skips_the_window_on_every_rank(ranks: list[dict]) -> None:
    """fp16 parameters summed past 65504 in rank 0's shard only: every rank skips that window (its parameters stay
    zero) and steps the next, so the shards stay one model."""
    for rank in range(cases.WORLD):
        result = ranks[rank]["fsdp fp16 overflow"]
        assert "error" not in result, f"rank {rank}: {result.get('error')}"
        assert result["skipped"] == 1 and result["stepped"], rank
        skipped, stepped = result["shards"]
        assert torch.equal(skipped, torch.zeros_like(skipped)), rank
        # The second window: row 0's gradient sums to 2 ranks x 2 micro-batches x 2.0, the others' to x 0.5.
        row = 8.0 if rank == 0 else 2.0
        assert torch.equal(stepped, torch.full_like(stepped, -row)), rank


@pytest.mark.parametrize("case", list(cases.SYNC_OFF_RECORDS))
def test_fsdp_sync_off_records_count_each_micro_batch_as_its_backward_did(ranks: list[dict], case: str) -> None:
    """FSDP2 with its sync off holds the early micro-batches' gradients itself (no p.grad shows them); what an
    accumulator learns of another's backward must follow what FSDP holds of its own parameters. A micro-batch the
    first accumulator dropped after its weighted backward and ran again unweighted counts 1 for both, not the dropped
    weight; the first dropping its own micro-batch leaves what FSDP holds of the second's; a CPU weight tensor the
    loop refills before step() is the count its backward took. Every call goes through and the window lands on the
    float64 truth of those weights."""
    truth = cases.sync_off_records_truth(case)
    initial = [p.detach() for p in cases.make_model(torch.float64).parameters()]
    for rank in range(cases.WORLD):
        result = _result(ranks, f"sync off records: {case}", rank)
        assert set(result["said"].values()) == {"no error"}, result["said"]
        assert all(result["stepped"])
        assert _error(result["params"], truth, initial) < FP32_ERROR
    first, second = (_result(ranks, f"sync off records: {case}", rank)["params"] for rank in range(cases.WORLD))
    assert all(map(torch.equal, first, second))


def test_fsdp_sync_off_conflict_past_the_first_micro_batch_is_left_by_loading_a_checkpoint(ranks: list[dict]) -> None:
    """Two micro-batches of another accumulator in what FSDP (its sync off) holds of the second's parameters, past
    its window's first micro-batch: step() and zero_grad() refuse and name the way out, loading every accumulator
    over the model with the state_dict() it gave between windows, which drops the window; the next two windows go
    through on every rank and land on the float64 truth of those two."""
    truth = cases.dropped_first_window_truth()
    initial = [p.detach() for p in cases.make_model(torch.float64).parameters()]
    results = [_result(ranks, "sync off way out", rank) for rank in range(cases.WORLD)]
    for result in results:
        said = result["said"]
        for case in ("conflict step", "conflict zero_grad"):
            assert "load every accumulator over the model with the state_dict() it gave" in said[case], said[case]
        assert "more than one micro-batch" in said["conflict step"], said["conflict step"]
        assert said["load"] == "no error" and said["micro_steps after the load"] == "[0, 0]"
        assert {message for case, message in said.items() if case.startswith("step ")} == {"no error"}, said
        assert all(result["stepped"])
        assert _error(result["params"], truth, initial) < FP32_ERROR
    assert all(map(torch.equal, results[0]["params"], results[1]["params"]))


@pytest.mark.parametrize(
    ("case", "sync_off"),
    [
        ("failed backward, sync off False", False),
        ("failed backward, sync off True", True),
        ("failed backward before fsdp reduced", False),
    ],
)
def test_fsdp_backward_failing_on_every_rank_discards_the_window_everywhere(
    ranks: list[dict], case: str, sync_off: bool
) -> None:
    """A backward failing at one point on every rank, after FSDP2 reduced part of its gradients: one rank had
    folded a bucket of its shards and the other had not, and both discard the window (the one that had not used to
    keep it, so the ranks ran different windows from then on: a gloo timeout, an NCCL hang). backward() and step()
    then refuse until FSDP's reset_iter_state(), which the failure's note names; after it two windows go through on
    every rank and land on the float64 truth of those two. Also where it fails before FSDP reduced anything of it,
    its sync on (nothing of the call reached the buffers), once FSDP holds the call's gradients of the last layer
    unreduced: they go with the window."""
    truth = cases.dropped_first_window_truth()
    initial = [p.detach() for p in cases.make_model(torch.float64).parameters()]
    results = [_result(ranks, case, rank) for rank in range(cases.WORLD)]
    for result in results:
        said = result["said"]
        failed = said["failed"]
        assert "bad batch" in failed and "the open accumulation window was discarded" in failed, failed
        assert "call model.reset_iter_state() on the root fully_shard module" in failed, failed
        assert said["micro_step after the failure"] == "0"
        assert said["unreduced after the failure"] == "False"  # what FSDP held (sync off) went with the window
        for call in ("backward", "step"):
            refused = said[f"before the reset: {call}"]
            assert refused.startswith(f"{call}(): FSDP2 is still inside a backward that failed"), refused
            assert "nothing changed; call model.reset_iter_state()" in refused, refused
        assert {message for case, message in said.items() if case.startswith(("step ", "backward "))} == {"no error"}
        assert result["stepped"]
        assert _error(result["params"], truth, initial) < FP32_ERROR
    assert all(map(torch.equal, results[0]["params"], results[1]["params"]))


@pytest.mark.parametrize(("sync_off", "micro"), [(False, 1), (True, 1), (True, cases.N - 1)])
def test_fsdp_backward_failing_on_every_rank_puts_back_what_it_gave_another_accumulator(
    ranks: list[dict], sync_off: bool, micro: int
) -> None:
    """Two accumulators over one FSDP2 model: the first's backward fails on every rank after FSDP reduced the
    second's gradients into its p.grad (sync on), before anything reached the first's buffers: they are put back
    (none), where they used to stay, and the micro-batch run again was folded into the second's window twice,
    silently. Now the windows go on, on the float64 truth. FSDP held them unreduced instead (sync off): that cannot
    be put back, and the second's step() refuses it, naming the way out; after both load their state_dict() from
    before the window, two windows land on the float64 truth of those two. Also at the window's last micro-batch
    (sync off), where FSDP reduced what it held of the earlier micro-batches into the second's p.grad with the failed
    call's part: putting those back to none lost the earlier micro-batches, silently; they stay, and are refused.
    Ranks bitwise equal."""
    truth = cases.dropped_first_window_truth(dropped=sync_off)
    initial = [p.detach() for p in cases.make_model(torch.float64).parameters()]
    name = f"split failed backward, sync off {sync_off}, micro-batch {micro}"
    results = [_result(ranks, name, rank) for rank in range(cases.WORLD)]
    for result in results:
        said = result["said"]
        assert "bad batch" in said["failed"], said["failed"]
        assert said["second's gradients after the failure"] == str([micro == cases.N - 1] * 4)
        assert said["micro_steps after the failure"] == str([micro, micro])
        if sync_off:
            assert "other accumulator(s) over this loss" in said["failed"], said["failed"]
            refused = said["second step after the failure"]
            assert refused.startswith(
                "step(): gradients it would fold hold part of another accumulator's backward() that failed"
            ), refused
            assert "load every accumulator over the model with the state_dict() it gave" in refused, refused
        assert {message for case, message in said.items() if case.startswith("step ")} == {"no error"}, said
        assert all(result["stepped"])
        assert _error(result["params"], truth, initial) < FP32_ERROR
    assert all(map(torch.equal, results[0]["params"], results[1]["params"]))


def test_fsdp_backward_failing_before_fsdp_held_more_leaves_another_accumulator_unrecorded(ranks: list[dict]) -> None:
    """Two accumulators over one FSDP2 model, its sync off: the first's backward fails on every rank in a hook on the
    loss, before FSDP added anything to what it holds unreduced of the second's parameters. The second is not made
    to refuse them: the micro-batch runs again and the windows land on the float64 truth. Ranks bitwise equal."""
    truth = cases.dropped_first_window_truth(dropped=False)
    initial = [p.detach() for p in cases.make_model(torch.float64).parameters()]
    results = [_result(ranks, "split failed before fsdp held more", rank) for rank in range(cases.WORLD)]
    for result in results:
        said = result["said"]
        assert "bad batch" in said["failed"], said["failed"]
        assert said["second's record after the failure"] == "False"
        assert {message for case, message in said.items() if case.startswith("step ")} == {"no error"}, said
        assert all(result["stepped"])
        assert _error(result["params"], truth, initial) < FP32_ERROR
    assert all(map(torch.equal, results[0]["params"], results[1]["params"]))


@pytest.mark.parametrize("how", ["interrupt", "loss hook"])
def test_fsdp_backward_failing_before_fsdp_held_more_keeps_the_window(ranks: list[dict], how: str) -> None:
    """FSDP2 with its sync off: a backward() failing on every rank before FSDP added anything of it to what it holds
    unreduced (a Ctrl-C before autograd ran, a hook on the loss) leaves the window and the first micro-batch's
    gradients FSDP holds as they were; retrying the micro-batch trains bitwise as without the failure, on every
    rank."""
    results = [_result(ranks, f"failed before fsdp held more: {how}", rank) for rank in range(cases.WORLD)]
    for result in results:
        said = result["said"]
        assert said["failed"].startswith("KeyboardInterrupt"), said["failed"]
        assert "discarded" not in said["failed"] and "reset_iter_state" not in said["failed"], said
        assert said["micro_step after the failure"] == "1"
        assert said["unreduced after the failure"] == "True"
        assert all(map(torch.equal, result["params"], result["without the failure"]))
    assert all(map(torch.equal, results[0]["params"], results[1]["params"]))


def test_fsdp_sync_switched_off_once_stays_off_after_each_window(ranks: list[dict]) -> None:
    """opt.backward() turns FSDP's gradient sync on for a window's last micro-batch only: the user's
    set_requires_gradient_sync(False) holds again for the next window's micro-batches (the case itself is exact,
    checked with the others)."""
    assert _result(ranks, "fsdp-backward-driven-sync_off_once")["reduce_grads"] == [[False]] * len(cases.WINDOWS)
    assert _result(ranks, "fsdp-backward")["reduce_grads"] == [[True]] * len(cases.WINDOWS)


def micro_batch_size(rank: int) -> int:
    return cases.micro_batch(rank, 0, 0)[0].shape[0]


def test_misuse_is_never_silent(ranks: list[dict]) -> None:
    for rank in range(cases.WORLD):
        said = ranks[rank]["misuse"]
        assert "model=" in said["no model"] and "2 ranks" in said["no model"]
        assert "parameter 6" in said["stray param"] and "not a parameter of model" in said["stray param"]
        assert "opt.backward(loss, weight=w)" in said["fsdp step weight"]
        assert said["fsdp step weight micro_step"] == "0"  # the refused step changed nothing
        assert "end_window=True" in said["fsdp no_sync end at step"]
        assert "cuda" in said["refused construction"]
        assert said["ddp sync after a refused construction"] == "True"  # a refused construction changed nothing
        for setting in ("max_grad_norm", "bucket_bytes", "normalization"):
            refused = said[f"ddp ranks differ in {setting}"]
            assert f"with different {setting} (rank {rank}: {setting}=" in refused, refused
        assert said["ddp sync after ranks differ"] == "True"  # refused before the accumulator took DDP's sync over
        refused = said["ddp ranks cross parameters"]
        assert (
            f"with different model positions (rank {rank}: model positions=[[{2 * rank}, {2 * rank + 1}]])" in refused
        )
        assert "the model's same ones" in refused, refused
        refused = said["fsdp ranks differ in max_grad_norm"]
        assert f"with different max_grad_norm (rank {rank}: max_grad_norm=" in refused, refused
        assert "join() (uneven inputs) is not supported" in said["ddp join"], said["ddp join"]
        assert said["ddp join micro_step"] == "0" and said["ddp after join refused micro_step"] == "1"
        assert said["ddp join disabled"] == "no error"
        assert said["ddp sync while the accumulator lives"] == "False"
        assert said["ddp sync after the accumulator is dropped"] == "True"  # DDP synchronizes again on its own
        assert f"different micro-steps (this rank: {rank + 1})" in said["window ends apart"]
        assert "discarded" in said["window ends apart"] and said["window ends apart micro_step"] == "0"
        refused = said["flush refused on one rank"]
        assert ("not folded by step()" if rank == 1 else "another rank refused flush()") in refused, refused
        assert said["flush refused on one rank micro_step"] == "1" and said["flush after the refusal"] == "True"
        refused = said["flush with a backward() awaiting step()"]
        assert ("without step()" if rank == 1 else "another rank refused flush()") in refused, refused
        assert said["flush with a backward() awaiting step() micro_step"] == "1"
        for call in ("flush with settings apart", "window end with settings apart"):
            assert "different max_grad_norm or normalization" in said[call], said[call]
            assert f"max_grad_norm={cases.MAX_NORM * (rank + 1)!r}" in said[call], said[call]
        assert "nothing changed" in said["flush with settings apart"]
        assert "window was discarded" in said["window end with settings apart"]
        assert said["flush with settings apart micro_step"] == "1"
        assert said["window end with settings apart micro_step"] == "0" and said["settings alike again"] == "True"
        refused = said["window end with colliding first codes"]
        assert f"max_grad_norm={6.95 if rank == 1 else 0.5!r}" in refused and "window was discarded" in refused, refused
        refused = said["second backward on the last micro-batch"]
        assert "takes one backward() call" in refused and "the window was discarded" in refused, refused
        assert said["second backward on the last micro-batch micro_step"] == "0"
        assert said["window after the second backward"] == "True"
        assert said["checkpoint rank"] == str(rank)
        assert "['rank']" in said["other rank's checkpoint"] and "each rank's own" in said["other rank's checkpoint"]
        assert "float16" in said["fsdp fp16 loss weight"] and "loss.float()" in said["fsdp fp16 loss weight"]
        assert said["fsdp fp16 loss weight micro_step"] == "0"
        norms = said["fsdp norms over divide factors"].split()
        assert len(norms) == 3 and len(set(norms)) == 1, norms  # the factor is undone whatever it is
        assert said["fsdp bf16 loss weight as carried"] == "True"
        assert said["two accumulators equal one"] == "True"
        # A weight float32 rounds (the loss carries it): the second counts it as the first's backward did.
        assert said["fsdp fractional split backward equals one"] == "True"
        # Each accumulator's own loss and weight under FSDP2 with its sync off: neither takes the other's for its own.
        assert said["fsdp sync off split own losses"] == "True", said["fsdp sync off split own losses"]
        refused = said["fsdp sync off auxiliary loss step()"]  # the first's weight, though FSDP holds more since
        assert f"backward(loss, weight={micro_batch_size(rank)})" in refused and "(got None;" in refused, refused
        assert said["fsdp sync off auxiliary loss step(weight)"] == "no error"
        assert said["fsdp sync off auxiliary loss micro_step"] == "1"
        # The first's backward reached the first layer alone: the second's own gradients count 1, as its backward did.
        untouched = said["fsdp split untouched gradients step()"]
        assert untouched == "no error", untouched
        assert said["fsdp split untouched gradients micro_step"] == "1"
        # A backward() under FSDP2 failing after FSDP reduced part of it discards the window with every held
        # gradient (four of them half-updated in place), as on every rank failing there.
        failed = said["fsdp failed backward over held gradients"]
        assert "hook failed" in failed and "the open accumulation window was discarded" in failed, failed
        assert said["fsdp failed backward over held gradients kept"] == " ".join(["dropped"] * 6)
        assert said["fsdp failed backward over held gradients micro_step"] == "0"
        # A plain loss.backward() that failed leaves FSDP mid-backward too: refused until FSDP's reset.
        assert said["fsdp plain backward failed"] == "hook failed"
        for call in ("backward()", "step()"):
            refused = said[f"fsdp plain backward failed, then {call}"]
            assert refused.startswith(f"{call}: FSDP2 is still inside a backward that failed"), refused
            assert "call model.reset_iter_state()" in refused, refused
        assert said["fsdp plain backward failed, after the reset"] == "no error"
        assert said["fsdp plain backward failed, micro_step"] == "0"  # the micro-batch is open, not ended
        for kind in ("ddp", "fsdp"):  # one rank discarded a window the other stepped: the next end says so on both
            failed = said.get(f"{kind} window end failed on one rank, window 0", "no error")
            assert ("pre-hook failed" in failed) == (rank == 0), failed
            refused = said[f"{kind} window end failed on one rank, window 1"]
            assert "after a different number of windows" in refused, refused
            assert f"this rank: {rank} since it was built or loaded" in refused, refused
            assert said[f"{kind} window end failed on one rank, micro_step"] == "0"
        for kind in ("ddp", "fsdp"):  # two micro-batches in the second's gradients: no weight counts them as one
            refusals = [message for case, message in said.items() if case.startswith(f"{kind} left-out micro-batch s")]
            assert len(refusals) == (2 if rank == 0 else 3), refusals
            assert all("more than one micro-batch" in message for message in refusals), refusals
            assert said[f"{kind} left-out micro-batch micro_step"] == "0"
        for case in ("ddp", "fsdp", "fsdp sync off"):
            assert said[f"{case} split backward equals one"] == "True"
            refused = said[f"{case} split step without the weight"]
            assert "come from another accumulator's backward(loss, weight=" in refused, refused
            assert "give this step() the same weight" in refused and "(got None;" in refused, refused
            assert said[f"{case} split step without the weight micro_step"] == "1"
        assert "4 parameter(s) of the DDP model" in said["plain second optimizer"]
        assert "e.g. 2.weight" in said["plain second optimizer"]
        assert said["plain second optimizer micro_step"] == str(cases.N - 1)
        assert said["plain second optimizer params"] == "True"
        assert said["params ddp ignores"] == "no error"
        refused = said["accumulating params ddp ignores"]
        assert "parameter 4 of the optimizer (4.weight)" in refused and "DDP ignores" in refused, refused
        assert said["ddp sync after refusing them"] == "True"
        refused = said["accumulating a root parameter ddp ignores"]
        assert "DDP ignores" in refused and "(weight)" in refused, refused
        assert "static_graph=False" in said["static graph"]
        assert said["static graph sync"] == "True"
        assert "_counting_allreduce_hook" in said["comm hook"] and "will not run" in said["comm hook"]
        assert "FSDP holds this window's gradients unreduced" in said["fsdp sync off state_dict"]
        refused = said["fsdp sync off flush"]
        assert "FSDP holds" in refused and "end_window=True" in refused, refused  # on every rank
        assert "already folded" in said["fsdp sync off zero_grad later"]
        assert said["fsdp sync off micro_step"] == "2"  # the refusals changed nothing
        # It left FSDP too, also FSDP's separate unsharded gradient under bf16 parameters.
        assert said["fsdp sync off zero_grad first (backward loop, bf16 parameters)"] == "True"
        for loop in ("backward", "step"):
            assert said[f"fsdp sync off zero_grad first ({loop} loop)"] == "True", loop
            refused = said[f"fsdp sync off step twice ({loop} loop)"]
            assert "no parameter of the accumulator received a gradient" in refused, (loop, refused)
            refused = said[f"fsdp sync off zero_grad later ({loop} loop)"]
            assert ("already folded" if loop == "backward" else "FSDP holds") in refused, (loop, refused)
            refused = said[f"fsdp sync off zero_grad last ({loop} loop)"]
            assert ("already folded" if loop == "backward" else "FSDP reduced") in refused, (loop, refused)
        assert said["ddp synchronizes after a drop inside no_sync"] == "True"
        assert said["ddp no_sync after a drop"] == "True" and said["ddp uneven no_sync after a drop"] == "True"


def test_unreduced_gradients_are_told_apart_by_tags_no_later_tensor_repeats() -> None:
    """What FSDP holds unreduced is fingerprinted by tag, not id: the next gradient often lands at the address of one
    freed before it, which gives it the same id; a tag stays its own tensor's."""
    from gafused.distributed import _tag

    kept = torch.zeros(4)
    assert _tag(kept) == _tag(kept)
    tags_by_id: dict[int, int] = {}
    repeated = 0
    for _ in range(200):
        tensor = torch.zeros(4)
        tag = _tag(tensor)
        if id(tensor) in tags_by_id:
            repeated += 1
            assert tag != tags_by_id[id(tensor)]
        tags_by_id[id(tensor)] = tag
        del tensor
    assert repeated > 0  # CPython hands a freed tensor's address to the next one: the case above was exercised
    assert _tag(kept) == _tag(kept) and len(set(tags_by_id.values())) == len(tags_by_id)


def test_settings_that_share_one_code_are_told_apart_by_the_other() -> None:
    from gafused import distributed

    first, second = distributed.settings_codes((6.95, "mean")), distributed.settings_codes((0.5, "mean"))
    assert len(first) == distributed.SETTINGS_CODES == 2 and all(0 <= code < 4096 for code in first + second)
    assert first[0] == second[0] and first != second
    assert distributed.settings_codes((6.95, "mean")) == first  # the same in every process: a digest, not hash()


def test_fsdp_ranks_whose_bucket_cuts_differ_are_built_alike(ranks: list[dict]) -> None:
    """FSDP2's uneven shards cut different buckets on each rank, which the construction check must not compare."""
    cuts = [ranks[rank]["misuse"]["fsdp bucket cuts"] for rank in range(cases.WORLD)]
    assert all(cut.startswith("[[(") for cut in cuts), cuts  # built, no error
    assert len(set(cuts)) == cases.WORLD, cuts


def test_no_warning_without_distributed() -> None:
    model = cases.make_model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gafused.GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2)


def test_model_must_be_ddp_or_fsdp2() -> None:
    model = cases.make_model()
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        gafused.GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, model=model)


def test_fsdp1_is_refused() -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel

    model = cases.make_model()
    fsdp1 = FullyShardedDataParallel.__new__(FullyShardedDataParallel)  # the type is what is refused
    with pytest.raises(TypeError, match="FSDP1"):
        gafused.GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, model=fsdp1)


def test_float16_reduce_dtype_is_refused() -> None:
    """A bucket holds sum(w * g) over the window: float16's range (65504) is too small for token-count weights."""
    model = cases.make_model()
    with pytest.raises(ValueError, match="float16's range"):
        gafused.GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, reduce_dtype=torch.float16)


def test_reduce_dtype_needs_a_model() -> None:
    model = cases.make_model()
    with pytest.raises(ValueError, match="reduce_dtype is for the buckets of a DDP model: pass model="):
        gafused.GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, reduce_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"reduce_dtype must be None or one of .*got torch\.int8"):
        gafused.GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, reduce_dtype=torch.int8)


def test_token_counts_differ_across_ranks_and_micro_batches() -> None:
    """Weights matter in these data: a per-rank or per-micro-batch mean would be wrong."""
    for window, count in enumerate(cases.WINDOWS):
        per_rank = [[cases.tokens(rank, window, micro) for micro in range(count)] for rank in range(cases.WORLD)]
        assert per_rank[0] != per_rank[1]
        assert all(len(set(counts)) == count for counts in per_rank)


def test_checkpoint_of_another_world_size_is_refused() -> None:
    """A mid-window checkpoint holds one rank's unreduced part: it cannot resume on another world size."""
    model = cases.make_model()
    opt = gafused.GradAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 3)
    x, y = cases.micro_batch(0, 0, 0)
    opt.backward(cases.token_losses(model, x, y).mean(), weight=x.shape[0])
    opt.step()
    state = opt.state_dict()
    assert state["gafused"]["world_size"] == 1
    state["gafused"]["world_size"] = 2
    before = [buffer.data.clone() for buffer in opt.buffers]
    with pytest.raises(ValueError, match=r"\['world_size'\]"):
        opt.load_state_dict(state)
    assert opt.micro_step == 1
    assert all(torch.equal(a, b.data) for a, b in zip(before, opt.buffers, strict=True))


def test_case_scripts_take_a_results_file_or_report_and_refuse_anything_else(tmp_path):
    """``python tests/distributed_cases.py --help`` once took ``--help`` for the results file and wrote one by that
    name after running every case; the four case scripts now share one reading of their arguments."""
    assert case_script_target(["--report"]) is None
    assert case_script_target(["out/results.pt"]) == "out/results.pt"
    for argv in ([], ["--help"], ["-h"], ["a.pt", "b.pt"], ["--report", "x.pt"]):
        with pytest.raises(SystemExit, match="usage: python .* --report"):
            case_script_target(argv)
    script = Path(cases.__file__)
    done = subprocess.run([sys.executable, str(script), "--help"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 1 and "usage: python distributed_cases.py --report" in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_fsdp_modules_dividing_by_different_factors_are_refused(ranks: list[dict]) -> None:
    """One fold factor undoes FSDP's division only when every fully_shard module divides alike: modules set apart
    are refused, at the next window as at construction, on every rank."""
    for rank in range(cases.WORLD):
        said = ranks[rank]["misuse"]
        for when in ("at a window", "at construction"):
            refused = said[f"fsdp divide factors apart {when}"]
            assert "the fully_shard modules use different gradient divide factors" in refused, (when, refused)


def test_fsdp_zero_grad_right_after_loading_a_mid_window_checkpoint_goes_on(ranks: list[dict]) -> None:
    """Nothing is held by FSDP after a load (its sync on): the loop's zero_grad() before the next backward is no
    micro-batch FSDP summed, and the window resumes at the micro-step it was saved at."""
    for rank in range(cases.WORLD):
        said = ranks[rank]["misuse"]
        after_load = said["fsdp zero_grad after a mid-window load"]
        assert after_load == "no error", after_load
        assert said["fsdp zero_grad after a mid-window load micro_step"] == "1"


def test_fsdp_refuses_reduce_dtype_and_weights_every_backward_of_a_micro_batch(ranks: list[dict]) -> None:
    """reduce_dtype is DDP's (FSDP2 reduces in its MixedPrecisionPolicy's dtype): refused rather than ignored. A
    micro-batch whose loss takes two backward() calls carries its weight in both losses, as one call does."""
    for rank in range(cases.WORLD):
        said = ranks[rank]["misuse"]
        assert "reduce_dtype applies to DDP models" in said["fsdp reduce_dtype"], said["fsdp reduce_dtype"]
        assert said["fsdp two backward calls equal one"] == "True"
