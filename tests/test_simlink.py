"""utils.simlink: FIFO timing (α + bytes/bandwidth per message), ring all-reduce cost, last-issuer start, exact
results, async and queued handles, the DDP hook, no busy wait, no shared memory left behind, bad input."""
import math
import os
import sys
import time

import cloudpickle
import pytest
import torch
import torch.distributed as dist

import utils
from utils.launching import LaunchError
from utils.simlink import SimulatedLink, all_gather_messages, allreduce_hook, ring_messages
from utils.simlink.table import PREFIX as _PREFIX

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
    assert all_gather_messages(300, 4) == [300] * 3 and all_gather_messages(300, 1) == []


def test_bad_input_is_refused_with_a_clear_error():
    for alpha, bandwidth in [(-1, 1), (0, 0), (math.nan, 1), (math.inf, 1), (0, -5)]:
        with pytest.raises(ValueError, match="alpha"):
            SimulatedLink(alpha=alpha, bandwidth=bandwidth)
    with pytest.raises(TypeError, match="number"):
        SimulatedLink(alpha="1ms", bandwidth=1e9)
    link = SimulatedLink(alpha=0.0, bandwidth=1e9)
    for nbytes in (-1, math.nan, "10"):
        with pytest.raises(ValueError, match="nbytes"):
            link.send(nbytes)
    with pytest.raises(TypeError, match="torch.Tensor"):
        link.all_reduce([1.0, 2.0])
    with pytest.raises(RuntimeError, match="utils.launch"):
        link.all_reduce(torch.ones(2))                    # no process group in this process
    link.alpha = -0.5                                     # changed between operations: checked at the next one
    with pytest.raises(ValueError, match="alpha"):
        link.send(10)
    link.alpha = 0.0
    link.close()
    link.close()                                          # closing twice is harmless
    with pytest.raises(RuntimeError, match="closed"):
        link.send(10)


def test_queued_handles_complete_in_order_no_sooner_than_their_end():
    link = SimulatedLink(alpha=0.02, bandwidth=1e9)
    works = [link.send(1000, async_op=True) for _ in range(3)]
    completed = works[0].is_completed()                   # 20 ms to go, unless a busy machine paused this test
    assert not completed or time.perf_counter() >= works[0].end, "completed before its modelled end"
    works[2].wait()                                       # waiting the last completes the earlier ones too
    link.close()
    for before, after in zip(works, works[1:]):
        assert after.start == before.end
    for w in works:
        assert w.is_completed() and w.done >= w.end


def test_a_future_outside_backward_completes_at_the_modelled_end():
    link = SimulatedLink(alpha=0.05, bandwidth=1e9)
    work = link.send(0, async_op=True)
    future = work.get_future()                            # completed by the link's helper thread
    future.wait()
    done = time.perf_counter()
    link.close()
    assert future.value() is None                         # a send carries no data
    assert work.end - work.start == pytest.approx(0.05, abs=1e-9)
    assert work.end <= work.done <= done


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


def _gathers(late):
    # each rank contributes its own shard; rank 1 issues `late` seconds later; then a queued pair, issued together
    rank = dist.get_rank()
    link = SimulatedLink(alpha=0.005, bandwidth=10 * MiB)
    if rank == 1:
        time.sleep(late)
    out, shard = torch.empty(2 * 1000), torch.full((1000,), float(rank + 1))
    issued = time.perf_counter()
    work = link.all_gather(out, shard, async_op=True)
    work.wait()
    dist.barrier()
    more = [link.all_gather(torch.empty(2 * 1000), shard, async_op=True) for _ in range(2)]
    for w in more:
        w.wait()
    with pytest.raises(ValueError, match="output must hold"):
        link.all_gather(torch.empty(3), shard)
    link.close()
    return {"issued": issued, "gathered": out.tolist(), "op": (work.start, work.end, work.done),
            "more": [(w.start, w.end) for w in more]}


def test_all_gather_is_exact_costs_the_ring_and_waits_for_the_last_rank():
    runs = utils.launch(_gathers, 0.1, world_size=2)
    expected = (2 - 1) * (0.005 + 4000 / (10 * MiB))            # (N−1)(α + S/bw)
    last_issue = max(r["issued"] for r in runs)
    for r in runs:
        assert r["gathered"] == [1.0] * 1000 + [2.0] * 1000    # rank order
        start, end, done = r["op"]
        assert end - start == pytest.approx(expected, abs=1e-9)
        assert start >= last_issue                            # the early rank's gather waits for the late one
        assert done >= end
        (s0, e0), (s1, e1) = r["more"]
        assert s1 == e0 and e1 - s1 == pytest.approx(expected, abs=1e-9)   # queued behind each other
    assert runs[0]["op"][:2] == runs[1]["op"][:2]               # both ranks agree on the schedule


def _ddp_through_link():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Linear(64, 4))
    ddp = utils.compat.ddp(model, bucket_cap_mb=1e-4, forward_sync_buffers=False)   # tiny cap (after step 1)
    link = SimulatedLink(0.02, 1e9)
    link.log, issue = [], link.all_reduce                 # keep the handles the hook's all-reduces return
    link.all_reduce = lambda *args, **kwargs: link.log.append(issue(*args, **kwargs)) or link.log[-1]
    ddp.register_comm_hook(link, allreduce_hook)
    steps = []
    for step in range(2):                                 # DDP rebuilds its buckets after the first step
        link.log.clear()
        x = torch.full((2, 8), float(dist.get_rank() + 1 + step))
        ddp(x).sum().backward()
        returned = time.perf_counter()
        steps.append({"returned": returned, "ops": [(w.start, w.end, w.done) for w in link.log],
                      "grads": [p.grad.clone() for p in model.parameters()]})
        model.zero_grad()
    link.close()
    return steps


def _reference_grads(step):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Linear(64, 4))
    x = torch.cat([torch.full((2, 8), float(rank + 1 + step)) for rank in range(2)])
    (model(x).sum() / 2).backward()                       # the average of the 2 ranks' gradients
    return [p.grad for p in model.parameters()]


def test_ddp_comm_hook_averages_through_the_link_no_sooner_than_the_model():
    runs = utils.launch(_ddp_through_link, world_size=2)
    for step in range(2):
        expected = _reference_grads(step)
        for r in runs:
            s = r[step]
            for got, want in zip(s["grads"], expected):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            assert len(s["ops"]) >= (1 if step == 0 else 2)   # one initial bucket; rebuilt: several
            for (start, end, done), (next_start, _, _) in zip(s["ops"], s["ops"][1:]):
                assert next_start >= end                  # FIFO
            for start, end, done in s["ops"]:
                assert end - start == pytest.approx(2 * 0.02, abs=1e-5)   # 2 messages of α (+ a few bytes)
                assert done >= end                        # the future completed no sooner than the model
            assert s["returned"] >= max(end for _, end, _ in s["ops"])
    for a, b in zip(runs[0][1]["grads"], runs[1][1]["grads"]):
        assert torch.equal(a, b)                          # the same averaged gradient on both ranks


def _ddp_static_graph():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    ddp = utils.compat.ddp(model, static_graph=True, forward_sync_buffers=False)
    link = SimulatedLink(0.005, 1e9)
    ddp.register_comm_hook(link, allreduce_hook)
    for step in range(2):                                 # step 0 all-reduces from inside a final callback
        ddp(torch.full((2, 8), float(dist.get_rank() + 1))).sum().backward()
        grad = model[1].weight.grad.clone()
        model.zero_grad()
    link.close()
    return grad


def test_ddp_static_graph_does_not_hang():
    g0, g1 = utils.launch(_ddp_static_graph, world_size=2, timeout=60)
    assert torch.equal(g0, g1)


def _late_real_all_reduce(real_seconds):
    # the real collective takes `real_seconds` longer than the link's rule: it is not complete until then
    real_all_reduce = dist.all_reduce

    class Late:
        def __init__(self, work):
            self.work, self.ready = work, time.perf_counter() + real_seconds

        def is_completed(self):
            return time.perf_counter() >= self.ready and self.work.is_completed()

        def wait(self):
            time.sleep(max(0.0, self.ready - time.perf_counter()))
            return self.work.wait()

    link = SimulatedLink(alpha=0.05, bandwidth=1e9)
    dist.all_reduce = lambda *args, **kwargs: Late(real_all_reduce(*args, **kwargs))
    try:
        first = link.all_reduce(torch.ones(4), async_op=True)
        second = link.send(1000, async_op=True)           # queued right behind it
        first.wait()
        done = time.perf_counter()
    finally:
        dist.all_reduce = real_all_reduce
    second.wait()
    link.close()
    return {"issued": first.issued, "start": first.start, "end": first.end, "handle_done": first.done, "done": done,
            "next_start": second.start, "next_done": second.done}


def test_a_late_real_operation_delays_its_waiters_but_not_the_links_schedule():
    for r in utils.launch(_late_real_all_reduce, 0.4, world_size=2):
        assert r["end"] - r["start"] == pytest.approx(2 * (0.05 + 8 / 1e9), abs=1e-9)    # the record: the rule's
        assert r["handle_done"] - r["issued"] >= 0.4      # but wait() returned only after the real 400 ms
        assert r["handle_done"] <= r["done"]              # recorded before wait() returned
        assert r["next_start"] == r["end"]                # the network's FIFO: behind the rule's end,
        assert r["next_done"] >= r["handle_done"]         # not behind the host's lateness; done in order


def _queued_collectives_and_sends():
    rank = dist.get_rank()
    link = SimulatedLink(alpha=0.01, bandwidth=1e9)
    tensors = [torch.full((1000,), float(rank + 1) * (i + 1)) for i in range(5)]
    if rank == 1:
        time.sleep(0.05)                                  # rank 1 issues everything 50 ms later
    issued = time.perf_counter()
    works = []
    for i, t in enumerate(tensors):
        works.append(link.all_reduce(t, async_op=True))
        if i == 2:
            works.append(link.send(4000, async_op=True))  # a message of this rank's own, in the queue
    polled = works[0].is_completed()
    for w in works:
        w.wait()
    link.close()
    return {"issued": issued, "polled": polled, "sums": [t[0].item() for t in tensors],
            "ops": [(w.start, w.end, w.done) for w in works]}


def test_queued_all_reduces_are_exact_fifo_and_start_with_the_last_issuer():
    runs = utils.launch(_queued_collectives_and_sends, world_size=2)
    last_issue = max(r["issued"] for r in runs)
    for r in runs:
        assert r["sums"] == [3.0 * (i + 1) for i in range(5)]
        assert not r["polled"]                            # 20 ms of link time were still ahead
        ops = r["ops"]
        assert ops[0][0] >= last_issue                    # the first all-reduce waits for the late rank
        for (start, end, done), (next_start, _, _) in zip(ops, ops[1:]):
            assert next_start == end                      # back to back: each queues behind the previous
        for i, (start, end, done) in enumerate(ops):
            own = 0.01 + 4000 / 1e9 if i == 3 else 2 * (0.01 + 2000 / 1e9)
            assert end - start == pytest.approx(own, abs=1e-9)
            assert done >= end
    assert runs[0]["ops"][0][:2] == runs[1]["ops"][0][:2]  # both ranks agree on the collective's schedule


def _many_in_flight(slots):
    import utils.simlink.table as table
    table.SLOTS = slots                                # a tiny table: its slots are reused many times over
    rank = dist.get_rank()
    link = SimulatedLink(alpha=0.0005, bandwidth=1e9)
    tensors = [torch.full((4,), float(i + rank)) for i in range(6 * slots)]
    works = []
    for i, t in enumerate(tensors):
        if rank == 1 and i % 5 == 0:
            time.sleep(0.003)                             # rank 1 lags, then catches up
        works.append(link.all_reduce(t, async_op=True))
    for w in works:
        w.wait()
    link.close()
    return [t[0].item() for t in tensors], [(w.start, w.end) for w in works]


def test_more_all_reduces_in_flight_than_table_slots():
    (sums, ops), (sums1, ops1) = utils.launch(_many_in_flight, 4, world_size=2)
    assert sums == sums1 == [2.0 * i + 1 for i in range(24)]
    assert ops == ops1                                    # the same schedule on both ranks
    for (start, end), (next_start, _) in zip(ops, ops[1:]):
        assert next_start >= end


def _shared_files(pid):
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
    return [] if folder is None else [n for n in os.listdir(folder) if n.startswith(f"{_PREFIX}{pid}-")]


def _link_then(die, pid_file):
    if dist.get_rank() == 0:
        with open(pid_file, "w") as f:
            f.write(str(os.getpid()))
    link = SimulatedLink(alpha=0.001, bandwidth=1e9)
    link.all_reduce(torch.ones(4))
    during = _shared_files(os.getpid())
    if die and dist.get_rank() == 1:
        os._exit(3)                                       # a rank dies with the link open
    if die:
        link.all_reduce(torch.ones(4))                    # rank 0 waits for the dead rank
    link.close()
    return during


def test_no_shared_memory_is_left_after_close_or_after_a_rank_dies(tmp_path):
    pid_file = tmp_path / "pid"
    runs = utils.launch(_link_then, False, str(pid_file), world_size=2)
    assert runs == [[], []]                               # removed as soon as both ranks mapped it
    assert _shared_files(pid_file.read_text()) == []
    with pytest.raises(LaunchError):
        utils.launch(_link_then, True, str(pid_file), world_size=2, timeout=60)
    assert _shared_files(pid_file.read_text()) == []
