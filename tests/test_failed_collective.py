"""A window-end bucket reduction that fails (collective error/timeout) discards the window, as documented."""

import datetime
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

import gafused


@pytest.fixture
def one_rank_group():
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("loop", ["backward", "step"])
def test_failed_bucket_reduction_discards_the_window(one_rank_group, loop):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3)).double()
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    opt = gafused.GradAccumulator(torch.optim.SGD(net.parameters(), lr=0.1), 2, bucket_bytes=64, model=ddp)
    saved = opt.state_dict()
    real_wait = opt._sync.wait_bucket

    def failing_wait(bucket, pending):
        real_wait(bucket, pending)
        raise RuntimeError("Timed out waiting 8000ms for recv operation to complete")  # what gloo raises

    def micro(i):
        x = torch.randn(3 + i, 4, dtype=torch.float64)
        loss = ddp(x).square().mean()
        if loop == "backward":
            opt.backward(loss, weight=x.shape[0])
            opt.step()
        else:
            loss.backward()
            opt.step(weight=x.shape[0])
        opt.zero_grad()

    micro(0)
    opt._sync.wait_bucket = failing_wait
    before = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(RuntimeError, match="Timed out") as info:
        micro(1)
    assert any("window was discarded" in note for note in getattr(info.value, "__notes__", []))
    assert opt.micro_step == 0 and not opt._pending and not opt.stepped
    assert all(torch.equal(a, p) for a, p in zip(before, net.parameters(), strict=True))
    opt._sync.wait_bucket = real_wait
    opt.load_state_dict(saved)  # the documented way back
    micro(0)
    micro(1)
    assert opt.stepped
