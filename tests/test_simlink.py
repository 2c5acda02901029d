"""utils.simlink: FIFO timing (α + bytes/bandwidth per message), ring all-reduce cost, sync start, no busy wait."""
import sys
import time

import cloudpickle
import pytest
import torch
import torch.distributed as dist

import utils
from utils.simlink import SimulatedLink, allreduce_hook, ring_messages

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # rank functions travel by value, as from a notebook

MiB = 2**20


def test_two_back_to_back_messages_take_two_alphas_and_two_transfers():
    link = SimulatedLink(alpha=0.02, bandwidth=100 * MiB)      # 1 MiB = 10 ms
    start = time.perf_counter()
    first = link.send(MiB, async_op=True)
    second = link.send(MiB, async_op=True)
    second.wait()
    elapsed = time.perf_counter() - start
    link.close()
    assert first.end - first.start == pytest.approx(0.03, abs=1e-9)
    assert second.start == first.end                          # FIFO: the second waits for the first
    assert second.end - first.start == pytest.approx(2 * 0.02 + 2 * 0.01, abs=1e-9)
    assert 0.06 <= elapsed < 0.06 + 0.5                       # really waited (generous on a loaded machine)


def test_an_idle_link_starts_a_message_when_it_is_issued():
    link = SimulatedLink(alpha=0.05, bandwidth=1e9)           # 50 ms: room for a late worker thread on a busy machine
    link.send(1000)
    time.sleep(0.1)                                           # link idle for 100 ms
    before = time.perf_counter()
    work = link.send(1000, async_op=True)
    work.wait()
    link.close()
    assert work.start >= before                               # no credit for idle time
    # perf_counter is float seconds since boot: its rounding grows with uptime (4e-12 after 9 h)
    assert work.end - work.start == pytest.approx(0.05 + 1e-6, abs=1e-9)


def test_waiting_on_the_link_burns_no_cpu():
    link = SimulatedLink(alpha=0.3, bandwidth=1e9)
    cpu = time.process_time()
    link.send(0)
    used = time.process_time() - cpu
    link.close()
    assert used < 0.05, f"{used:.3f} s of CPU while waiting 0.3 s"


def test_ring_messages():
    assert ring_messages(1200, 4) == [300.0] * 6
    assert ring_messages(1200, 1) == []
    with pytest.raises(ValueError):
        ring_messages(10, 0)


def test_bad_link_settings_are_refused():
    with pytest.raises(ValueError):
        SimulatedLink(alpha=-1, bandwidth=1)
    with pytest.raises(ValueError):
        SimulatedLink(alpha=0, bandwidth=0)


def _ring(late_rank_delay):
    rank, world = dist.get_rank(), dist.get_world_size()
    link = SimulatedLink(alpha=0.005, bandwidth=10 * MiB)
    t = torch.full((MiB // 4,), float(rank + 1))              # 1 MiB of float32
    if rank == world - 1:
        time.sleep(late_rank_delay)
    issued = time.perf_counter()
    work = link.all_reduce(t, async_op=True)
    work.wait()
    link.close()
    return {"sum": t[0].item(), "start": work.start, "end": work.end, "issued": issued, "done": time.perf_counter()}


def test_all_reduce_is_exact_costs_the_ring_and_starts_with_the_last_rank():
    runs = utils.launch(_ring, 0.1, world_size=2)
    expected = 2 * (2 - 1) * (0.005 + (MiB / 2) / (10 * MiB))   # 2(N−1)(α + M/N/bw) = 110 ms
    last_issue = max(r["issued"] for r in runs)
    for r in runs:
        assert r["sum"] == 3.0
        assert r["end"] - r["start"] == pytest.approx(expected, abs=1e-9)
        assert r["start"] >= last_issue                       # nobody finishes before the late rank joined
        assert r["done"] >= r["end"]


def _ddp_through_link():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    link = SimulatedLink(alpha=0.05, bandwidth=1e9)
    ddp.register_comm_hook(link, allreduce_hook)
    x = torch.full((2, 8), float(dist.get_rank() + 1))
    start = time.perf_counter()
    ddp(x).sum().backward()
    elapsed = time.perf_counter() - start
    link.close()
    return model.weight.grad.clone(), elapsed


def test_ddp_comm_hook_averages_through_the_link():
    (g0, t0), (g1, t1) = utils.launch(_ddp_through_link, world_size=2)
    expected = torch.full((4, 8), 2 * (1.0 + 2.0) / 2)       # d/dW sum(Wx) = sum over the 2 rows of x; averaged
    assert torch.equal(g0, expected) and torch.equal(g1, expected)
    assert min(t0, t1) >= 2 * 0.05                            # one bucket, ring of 2: 2 messages of α each at least


def _late_real_all_reduce(real_seconds):
    # the real collective takes `real_seconds` longer than the link's rule: its handle's wait() is slowed down
    real_all_reduce = dist.all_reduce

    class Late:
        def __init__(self, work):
            self.work = work

        def wait(self):
            time.sleep(real_seconds)
            return self.work.wait()

    def slow_data(tensor, *args, **kwargs):
        work = real_all_reduce(tensor, *args, **kwargs)
        return Late(work) if tensor.dtype == torch.float32 else work   # the float64 issue clock stays fast

    link = SimulatedLink(alpha=0.05, bandwidth=1e9)          # 100 ms: room for a descheduled rank
    dist.all_reduce = slow_data
    try:
        first = link.all_reduce(torch.ones(4), async_op=True)
        second = link.send(1000, async_op=True)                # queued right behind it
        first.wait()
        done = time.perf_counter()
    finally:
        dist.all_reduce = real_all_reduce
    second.wait()
    link.close()
    return {"start": first.start, "end": first.end, "handle_done": first.done, "done": done,
            "next_start": second.start, "next_done": second.done}


def test_a_late_real_operation_delays_its_waiters_but_not_the_links_schedule():
    for r in utils.launch(_late_real_all_reduce, 0.4, world_size=2):
        assert r["end"] - r["start"] == pytest.approx(2 * (0.05 + 8 / 1e9), abs=1e-9)    # the record: the rule's
        assert r["handle_done"] - r["start"] >= 0.4           # but wait() returned only after the real 400 ms
        assert r["handle_done"] <= r["done"]                  # recorded before wait() returned
        assert r["next_start"] == r["end"]                    # the network's FIFO: behind the rule's end,
        assert r["next_done"] >= r["handle_done"]             # not behind the host's lateness; done in order
