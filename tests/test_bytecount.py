"""utils.bytecount: exact point-to-point counts, nominal collective counts, forbidding collectives."""
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d
from torch.distributed import all_reduce as all_reduce_imported_before  # bound before any patching

import utils
from utils import bytecount

# Ship this module's functions by value, exactly as functions defined in a notebook cell travel.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


# ------------------------------------------------------------------ rank functions (run by utils.launch)
# Every tensor lives on utils.device(): the CPU under gloo, this rank's GPU under NCCL (which moves GPU
# tensors only), so the counts are checked on whatever backend `launch` picks.

def _known_pattern():
    """Rank 0 sends 10 float32 (blocking) and 3 float64 (isend) to rank 1; rank 1 answers with 5 int8."""
    rank, device = dist.get_rank(), utils.device()
    with bytecount.count_bytes() as counter:
        if rank == 0:
            dist.send(torch.zeros(10, device=device), 1)
            dist.isend(torch.zeros(3, dtype=torch.float64, device=device), dst=1).wait()
            dist.recv(torch.zeros(5, dtype=torch.int8, device=device), 1)
        else:
            dist.recv(torch.zeros(10, device=device), 0)
            dist.irecv(torch.zeros(3, dtype=torch.float64, device=device), src=0).wait()
            dist.send(torch.zeros(5, dtype=torch.int8, device=device), 0)
    outside = torch.zeros(7, device=device)  # after the block nothing is counted any more
    if rank == 0:
        dist.send(outside, 1)
    else:
        dist.recv(outside, 0)
    return counter.summary()


def _ring_shift(numel):
    """Every rank passes numel float16 to its right neighbour, send and receive posted as one batch."""
    rank, n = dist.get_rank(), dist.get_world_size()
    device = utils.device()
    outgoing = torch.full((numel,), float(rank), dtype=torch.float16, device=device)
    incoming = torch.empty(numel, dtype=torch.float16, device=device)
    with bytecount.count_bytes() as counter, bytecount.forbid_collectives():
        requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, outgoing, (rank + 1) % n),
                                           dist.P2POp(dist.irecv, incoming, (rank - 1) % n)])
        for request in requests:
            request.wait()
    return counter.summary(), incoming


def _builtin_collectives():
    """Each built-in collective once; their counts are nominal."""
    n, device = dist.get_world_size(), utils.device()

    def ones(numel):
        return torch.ones(numel, device=device)

    out = {}
    for name, call in [
        ("all_reduce", lambda: dist.all_reduce(ones(12))),                                  # M = 48
        ("broadcast", lambda: dist.broadcast(ones(12), src=1)),                             # M = 48
        ("reduce", lambda: dist.reduce(ones(12), dst=0)),                                   # M = 48
        ("all_gather_single", lambda: utils.compat.all_gather_single(ones(3 * n), ones(3))),
        ("reduce_scatter_single", lambda: utils.compat.reduce_scatter_single(ones(3), ones(3 * n))),
        ("barrier", lambda: dist.barrier()),
    ]:
        with bytecount.count_bytes() as counter:
            call()
        out[name] = counter.summary()
    return out


def _forbidden_inside_launch():
    device = utils.device()
    caught = []
    with bytecount.forbid_collectives():
        for call in (lambda: dist.all_reduce(torch.ones(2, device=device)), lambda: dist.barrier()):
            try:
                call()
            except bytecount.CollectiveForbiddenError as err:
                caught.append(str(err))
    dist.all_reduce(torch.ones(2, device=device))  # works again afterwards
    return caught


def _send_to_missing_peers():
    """Each way of naming a peer that does not exist: refused with a ValueError before gloo sees it."""
    rank, n, device = dist.get_rank(), dist.get_world_size(), utils.device()
    messages = []
    with bytecount.count_bytes() as counter:
        for call in (lambda: dist.send(torch.ones(1, device=device), n),
                     lambda: dist.isend(torch.ones(1, device=device), dst=-1),
                     lambda: dist.irecv(torch.ones(1, device=device), group_src=n + 5),
                     lambda: dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(1, device=device),
                                                                rank + n)])):
            try:
                call()
            except ValueError as err:
                messages.append(str(err))
    return messages, counter.summary()["messages_sent"]


def _send_to_itself():
    """Each way of naming the calling rank as the peer: refused with a ValueError before gloo sees it."""
    rank, device = dist.get_rank(), utils.device()
    messages = []
    with bytecount.count_bytes() as counter:
        for call in (lambda: dist.send(torch.ones(1, device=device), rank),
                     lambda: dist.irecv(torch.ones(1, device=device), src=rank),
                     lambda: dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(1, device=device), rank)]),
                     lambda: dist.group.WORLD.send([torch.ones(1, device=device)], rank, 0)):
            try:
                call()
            except ValueError as err:
                messages.append(str(err))
    return messages, counter.summary()["messages_sent"]


def _group_methods_are_counted():
    """Rank 0 sends 3 float32 to rank 1 through the process group's own methods, past dist.send."""
    rank, device = dist.get_rank(), utils.device()
    group = dist.group.WORLD
    with bytecount.count_bytes() as counter:
        if rank == 0:
            group.send([torch.ones(3, device=device)], 1, 0).wait()
            dist.send(torch.ones(2, device=device), 1)  # counted once, as dist.send
        else:
            group.recv([torch.empty(3, device=device)], 0, 0).wait()
            dist.recv(torch.empty(2, device=device), 0)
    return counter.summary()


def _every_route_to_a_collective_is_forbidden():
    """A built-in collective reached past dist.<name>: each raises inside forbid_collectives()."""
    device = utils.device()
    t = torch.ones(2, device=device)
    group = dist.group.WORLD
    caught = {}
    with bytecount.forbid_collectives():
        for name, call in [
            ("imported before", lambda: all_reduce_imported_before(t)),
            ("group method", lambda: group.allreduce([t])),
            ("backend method", lambda: group._get_backend(device).allreduce([t])),
            ("barrier method", lambda: group.barrier()),
            ("functional", lambda: funcol.all_reduce(t, "sum", group)),
            ("operator", lambda: torch.ops.c10d.allreduce_),
            ("operator send", lambda: torch.ops.c10d.send),
        ]:
            try:
                call = call()
                if name.startswith("operator"):
                    call([t], group, 0, 0)  # the patched operator raises before it reads its arguments
            except bytecount.CollectiveForbiddenError as err:
                caught[name] = str(err).split(" was called", 1)[0]
    group.allreduce([t]).wait()  # everything works again afterwards
    assert torch.ops.c10d.allreduce_ is not None and dist.group.WORLD.allreduce is not None
    return caught, t.tolist()


def _ddp_hooks_and_groups():
    """Plain DDP, DDP with an fp16 hook, a subgroup's all-reduce and (where this torch runs FSDP2 on the CPU)
    HSDP on a 2 × 2 mesh: what count_bytes sees of each, with and without cpp_calls."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 2))   # 54 + 14 = 68 parameters
    x = torch.randn(4, 8)
    out = {}
    with bytecount.count_bytes(cpp_calls=True) as counter:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
    out["built"] = counter.summary()
    for name, cpp_calls in (("plain", True), ("plain, Python only", False)):
        with bytecount.count_bytes(cpp_calls=cpp_calls) as counter:
            ddp(x).sum().backward()
        out[name] = counter.summary()
    ddp.register_comm_hook(dist.group.WORLD, default_hooks.fp16_compress_hook)
    with bytecount.count_bytes(cpp_calls=True) as counter:
        ddp(x).sum().backward()
    out["fp16 hook"] = counter.summary()
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    with bytecount.count_bytes(cpp_calls=True) as counter:
        dist.all_reduce(torch.ones(10), group=halves[rank // 2])
        dist.all_reduce(torch.ones(10))
    out["groups"] = counter.summary()
    if utils.compat.FEATURES["fsdp2_on_cpu"][0]:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        hsdp = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 2))
        fully_shard(hsdp, mesh=mesh)
        with bytecount.count_bytes(cpp_calls=True) as counter:
            hsdp(x).sum().backward()
        out["hsdp"] = counter.summary()
    return out


# ------------------------------------------------------------------ tests

def test_ddp_hooks_fsdp2_and_process_groups_are_counted():
    results = utils.launch(_ddp_hooks_and_groups, world_size=4, timeout=90)
    grad_bytes = 68 * 4
    for rank, out in enumerate(results):
        built = out["built"]["by_op"]["c10d.broadcast_"]   # rank 0's parameters (and DDP's own checks), when built
        assert built["sent" if rank == 0 else "received"] >= (3 * grad_bytes if rank == 0 else grad_bytes), built
        assert built["received" if rank == 0 else "sent"] == 0, built
        plain = out["plain"]
        assert plain["nominal_sent"] == plain["nominal_received"] == 2 * 3 * grad_bytes // 4, plain
        assert list(plain["by_op"]) == ["c10d.allreduce_"] and plain["sent"] == 0
        assert out["plain, Python only"]["nominal_sent"] == 0             # the reducer's C++ call: not seen
        hook = out["fp16 hook"]                                          # half the bytes, counted once
        assert hook["nominal_sent"] == plain["nominal_sent"] // 2, hook["by_op"]
        assert sum(entry["calls"] for entry in hook["by_op"].values()) == 1, hook["by_op"]
        mine = (0, 1) if rank < 2 else (2, 3)
        assert out["groups"]["by_group"] == {
            mine: dict(calls=1, sent=0, received=0, nominal_sent=40, nominal_received=40),
            (0, 1, 2, 3): dict(calls=1, sent=0, received=0, nominal_sent=60, nominal_received=60)}
        if "hsdp" in out:          # shard groups are mesh rows, replicate groups its columns
            groups = out["hsdp"]["by_group"]
            row, column = ((0, 1) if rank < 2 else (2, 3)), ((0, 2) if rank % 2 == 0 else (1, 3))
            assert set(groups) == {row, column}, groups
            ops = out["hsdp"]["by_op"]
            assert groups[column]["nominal_sent"] == 2 * 1 * (grad_bytes // 2) // 2, (groups, ops)

def test_exact_counts_on_a_known_pattern():
    zero, one = utils.launch(_known_pattern, world_size=2, timeout=60)
    assert (zero["sent"], zero["received"]) == (10 * 4 + 3 * 8, 5)
    assert (one["sent"], one["received"]) == (5, 10 * 4 + 3 * 8)
    assert (zero["messages_sent"], zero["messages_received"]) == (2, 1)
    assert zero["by_op"]["send"] == dict(calls=1, sent=40, received=0)
    assert zero["by_op"]["isend"] == dict(calls=1, sent=24, received=0)
    assert one["by_op"]["irecv"] == dict(calls=1, sent=0, received=24)
    assert zero["by_peer"] == {1: dict(sent=64, received=5)}
    assert one["by_peer"] == {0: dict(sent=5, received=64)}
    assert zero["nominal_sent"] == zero["nominal_received"] == 0


@pytest.mark.parametrize("world_size", [3])
def test_batched_ring_shift_counts_every_rank(world_size):
    results = utils.launch(_ring_shift, 7, world_size=world_size, timeout=60)
    for rank, (s, incoming) in enumerate(results):
        assert torch.equal(incoming, torch.full((7,), float((rank - 1) % 3), dtype=torch.float16)), rank
        assert (s["sent"], s["received"]) == (14, 14), rank
        assert (s["by_op"]["isend"]["calls"], s["by_op"]["irecv"]["calls"]) == (1, 1), s["by_op"]
        assert s["by_peer"] == {(rank + 1) % 3: dict(sent=14, received=0),
                                (rank - 1) % 3: dict(sent=0, received=14)}


def test_a_peer_that_does_not_exist_is_a_clear_error():
    for rank, (messages, sent) in enumerate(utils.launch(_send_to_missing_peers, world_size=2, timeout=60)):
        assert len(messages) == 4 and sent == 0, messages  # every call refused, nothing went out
        assert messages[0].startswith("dist.send with dst=2: there is no rank 2, the ranks are 0 … 1")
        assert "dst=-1: there is no rank -1" in messages[1]
        assert "src=7: there is no rank 7" in messages[2]
        assert f"dst={rank + 2}: there is no rank {rank + 2}" in messages[3]


def test_a_rank_sending_to_itself_is_a_clear_error():
    for rank, (messages, sent) in enumerate(utils.launch(_send_to_itself, world_size=2, timeout=60)):
        assert len(messages) == 4 and sent == 0, messages  # every call refused, nothing went out
        assert messages[0].startswith(f"dist.send with dst={rank}: rank {rank} sent to itself (gloo cannot: "
                                      "'Pair is not connected')")
        assert f"dist.irecv with src={rank}: rank {rank} received from itself" in messages[1]
        assert f"dist.isend with dst={rank}: rank {rank} sent to itself" in messages[2]  # as P2POp names it
        assert f"ProcessGroup.send with dstRank={rank}: rank {rank} sent to itself" in messages[3]


def test_a_non_contiguous_tensor_is_refused_as_on_gloo():
    # NCCL only warns and sends the wrong bytes; the counter refuses, before any backend (no group needed here)
    block = torch.arange(12.0).reshape(3, 4)[:, :2]
    with bytecount.count_bytes() as counter:
        for call in (lambda: dist.send(block, 1), lambda: dist.irecv(block, 1), lambda: dist.isend(block, 1)):
            with pytest.raises(ValueError, match=r"non-contiguous tensor \(shape \(3, 2\), stride \(4, 1\)\): gloo "
                                                 "refuses it and NCCL moves the wrong bytes"):
                call()
    assert counter.sent == 0 and counter.received == 0


def test_a_process_group_send_is_counted():
    zero, one = utils.launch(_group_methods_are_counted, world_size=2, timeout=60)
    assert (zero["sent"], zero["messages_sent"], one["received"], one["messages_received"]) == (20, 2, 20, 2)
    assert zero["by_op"] == {"group.send": dict(calls=1, sent=12, received=0),
                             "send": dict(calls=1, sent=8, received=0)}
    assert zero["by_peer"] == {1: dict(sent=20, received=0)} and one["by_peer"] == {0: dict(sent=0, received=20)}


def test_every_route_to_a_collective_is_forbidden():
    for caught, after in utils.launch(_every_route_to_a_collective_is_forbidden, world_size=2, timeout=60):
        assert caught == {"imported before": "ProcessGroup.allreduce", "group method": "ProcessGroup.allreduce",
                          "backend method": "Backend.allreduce", "barrier method": "ProcessGroup.barrier",
                          "functional": "torch.ops._c10d_functional.all_reduce",
                          "operator": "torch.ops.c10d.allreduce_", "operator send": "torch.ops.c10d.send"}
        assert after == [2.0, 2.0]


def test_builtin_collectives_are_nominal_and_counted_once():
    n = 4
    results = utils.launch(_builtin_collectives, world_size=n, timeout=60)
    for rank, out in enumerate(results):
        for name, s in out.items():
            assert s["sent"] == s["received"] == 0, (name, "collectives must not look like exact p2p bytes")
            calls = sum(entry["calls"] for entry in s["by_op"].values())
            assert calls == 1, (name, s["by_op"])  # the shim and the call inside it count once
        assert (out["all_reduce"]["nominal_sent"], out["all_reduce"]["nominal_received"]) == (72, 72)
        assert out["all_gather_single"]["nominal_sent"] == 3 * 4 * (n - 1)
        assert out["reduce_scatter_single"]["nominal_received"] == 3 * 4 * (n - 1)
        assert out["barrier"]["nominal_sent"] == 0
        broadcast = (out["broadcast"]["nominal_sent"], out["broadcast"]["nominal_received"])
        assert broadcast == ((3 * 48, 0) if rank == 1 else (0, 48))
        reduce = (out["reduce"]["nominal_sent"], out["reduce"]["nominal_received"])
        assert reduce == ((0, 3 * 48) if rank == 0 else (48, 0))


def test_forbid_collectives_inside_ranks():
    caught = utils.launch(_forbidden_inside_launch, world_size=2, timeout=60)
    for messages in caught:
        assert len(messages) == 2
        assert "dist.all_reduce" in messages[0] and "send/recv" in messages[0]
        assert "dist.barrier" in messages[1]


def test_forbid_collectives_without_a_process_group():
    original_send, original_all_reduce = dist.send, dist.all_reduce
    with bytecount.forbid_collectives():
        assert dist.send is original_send  # point-to-point stays untouched
        for call in (lambda: dist.all_reduce(torch.ones(1)), lambda: c10d.all_reduce(torch.ones(1)),
                     lambda: utils.compat.all_gather_single(torch.ones(2), torch.ones(1)),
                     lambda: utils.compat.reduce_scatter_single(torch.ones(1), torch.ones(2))):
            with pytest.raises(bytecount.CollectiveForbiddenError):
                call()
    assert dist.all_reduce is original_all_reduce and c10d.all_reduce is original_all_reduce


def test_patches_nest_and_restore_in_either_order():
    originals = {name: getattr(dist, name) for name in bytecount.POINT_TO_POINT + ("all_reduce", "broadcast")}
    with bytecount.forbid_collectives(), bytecount.count_bytes():
        assert dist.send is not originals["send"]
        with pytest.raises(bytecount.CollectiveForbiddenError):
            dist.all_reduce(torch.ones(1))
    with bytecount.count_bytes(), bytecount.forbid_collectives():
        # one wrapper under both names: P2POp and batch_isend_irecv compare op with c10d.isend by identity
        assert dist.isend is c10d.isend and dist.irecv is c10d.irecv
    for name, fn in originals.items():
        assert getattr(dist, name) is fn, name
        assert getattr(c10d, name) is fn, name
    assert bytecount._active_counters == []


def test_process_group_methods_and_operators_are_restored():
    group_class = torch._C._distributed_c10d.ProcessGroup
    methods = {name: vars(group_class)[name] for name in ("allreduce", "barrier", "send", "recv")}
    operator = torch.ops.c10d.allreduce_
    with bytecount.count_bytes(), bytecount.forbid_collectives():
        assert vars(group_class)["allreduce"] is not methods["allreduce"]
        assert vars(group_class)["send"] is not methods["send"]  # counted
        assert torch.ops.c10d.allreduce_ is not operator
    for name, method in methods.items():
        assert vars(group_class)[name] is method, name
    assert torch.ops.c10d.allreduce_ is operator


def test_counter_summary_totals():
    counter = bytecount.ByteCounter()
    counter.add("isend", sent=100, peer=2)
    counter.add("irecv", received=30, peer=1)
    counter.add("all_reduce", sent=7, received=7, nominal=True)
    s = counter.summary()
    assert (s["sent"], s["received"], s["nominal_sent"], s["nominal_received"]) == (100, 30, 7, 7)
    assert (s["messages_sent"], s["messages_received"]) == (1, 1)
    assert s["by_peer"] == {1: dict(sent=0, received=30), 2: dict(sent=100, received=0)}
    assert s["by_group"] == {None: dict(calls=3, sent=100, received=30, nominal_sent=7, nominal_received=7)}
    counter.add("all_reduce", sent=5, received=5, nominal=True, group=[0, 2])
    assert counter.summary()["by_group"][(0, 2)] == dict(calls=1, sent=0, received=0, nominal_sent=5,
                                                         nominal_received=5)
    counter.reset()
    assert counter.summary()["sent"] == 0
    assert bytecount.tensor_bytes(torch.zeros(3, 5, dtype=torch.bfloat16)) == 30
