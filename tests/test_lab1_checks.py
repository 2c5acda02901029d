"""utils.labchecks.lab1: the reference solution passes; wrong solutions fail with a useful message.

The reference solutions are read from labs/lab1_collectives.ipynb (its solution cells and the `exchange`
helper they use), so the lab and these tests cannot drift apart. Wrong solutions are written here, each with
one typical mistake and otherwise as the lab asks: buffers on the input's device, every simultaneous send and
receive posted together, so that each fails the same way on gloo and on NCCL (one GPU per rank).
"""
import math
import sys
import time
from pathlib import Path

import cloudpickle
import nbformat
import pytest
import torch
import torch.distributed as dist

import utils
from utils.labchecks import harness, lab1
from utils.tools.grade import reference as reference_formulas
from labtesting import LABS, fails as _fails, stubbed

# Ship this module's functions by value, exactly as functions defined in a notebook cell travel.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

LAB = LABS / "lab1_collectives.ipynb"


def _solution_namespace(student=False):
    """Exec the lab's exchange() and solution cells; student=True turns each solution region into a stub."""
    namespace = {"__name__": "lab1_student" if student else "lab1_reference",
                 "math": math, "torch": torch, "dist": dist}
    nb = nbformat.read(str(LAB), as_version=4)
    helpers = [c for c in nb.cells if c.cell_type == "code" and c.source.startswith("def exchange(")]
    assert len(helpers) == 1, "lab 1 defines exchange() once, in a cell of its own"
    exec(compile(helpers[0].source, "<exchange>", "exec"), namespace)
    cells = [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("solution")]
    assert len(cells) == 4, "lab 1 has four solution cells"
    for cell in cells:
        source = cell.source
        if student:
            source = stubbed(source)
            assert "BEGIN SOLUTION" not in source
        exec(compile(source, f"<{cell.metadata['nbgrader']['grade_id']}>", "exec"), namespace)
    return namespace


@pytest.fixture(scope="module")
def reference():
    return _solution_namespace()


def exchange(outgoing, dst, incoming, src):
    """Send and receive as one batch, as the lab's exchange() does."""
    requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, outgoing, dst),
                                       dist.P2POp(dist.irecv, incoming, src)])
    for request in requests:
        request.wait()


ON_NCCL = utils.backend_for(3) == "nccl"  # 3 ranks, the size of the deadlock tests below, run on NCCL here


# ------------------------------------------------------------------ the reference passes everything

def test_reference_solution_passes_every_check(reference, capsys):
    lab1.check_reduce_scatter(reference["reduce_scatter"])
    lab1.check_all_gather(reference["all_gather"])
    lab1.check_halving_doubling(reference["all_reduce_halving_doubling"], world_sizes=(2, 3, 4, 5, 6, 7, 8))
    lab1.check_cost_model(reference["ring_time"], reference["halving_doubling_time"],
                              reference["crossover_bytes"])
    printed = capsys.readouterr().out
    for n in (2, 3, 4):
        assert f"✓ reduce_scatter at N={n}" in printed and f"✓ all_gather at N={n}" in printed


def test_student_copy_fails_fast_with_not_implemented(reference):
    stub = _solution_namespace(student=True)
    started = time.monotonic()
    for check, fn in ((lab1.check_reduce_scatter, stub["reduce_scatter"]),
                      (lab1.check_all_gather, stub["all_gather"]),
                      (lab1.check_halving_doubling, stub["all_reduce_halving_doubling"])):
        _fails(r"not implemented yet.*NotImplementedError", check, fn, timeout=20)
    _fails(r"ring_time is not implemented yet", lab1.check_cost_model,
           stub["ring_time"], stub["halving_doubling_time"], stub["crossover_bytes"])
    _fails(r"crossover_bytes is not implemented yet", lab1.check_cost_model,
           reference["ring_time"], reference["halving_doubling_time"], stub["crossover_bytes"])
    limit = 40 if utils.backend_for(2) == "nccl" else 15  # on NCCL each launch also starts CUDA and NCCL
    assert time.monotonic() - started < limit, "a stub must fail at once, not after a timeout"


def test_inputs_live_on_the_rank_device(reference):
    reduce_scatter = reference["reduce_scatter"]

    def reduce_scatter_checking_device(tensor):
        assert tensor.device == utils.device(), f"input on {tensor.device}, not on {utils.device()}"
        return reduce_scatter(tensor)

    lab1.check_reduce_scatter(reduce_scatter_checking_device, world_sizes=(2,), lengths=(6,),
                                  dtypes=(torch.float32,))


def test_cpu_tensor_on_nccl_is_explained(monkeypatch):
    # What a rank reports when it hands NCCL a CPU tensor (torch.empty(n) without device=...).
    def launch_with_cpu_tensor(*args, **kwargs):
        raise utils.LaunchError("rank 1 failed: ValueError: Tensors must be CUDA and dense")

    monkeypatch.setattr(harness, "launch", launch_with_cpu_tensor)
    _fails(r"all_gather at N=2 handed a CPU tensor to NCCL.*device=tensor\.device.*Tensors must be CUDA",
           lab1.check_all_gather, ag_returns_none, world_sizes=(2,))


def test_a_hang_on_nccl_says_where_the_stacks_point(monkeypatch):
    # On NCCL a rank's Python has moved past the send that hangs: the report says so (only there).
    def launch_that_hangs(*args, **kwargs):
        raise utils.LaunchTimeout("no result. Where each rank is stuck (most recent call last):\n[rank 0] in got.cpu()")

    monkeypatch.setattr(harness, "launch", launch_that_hangs)
    for backend, said in (("nccl", True), ("gloo", False)):
        monkeypatch.setattr(harness, "backend_for", lambda world_size, backend=backend: backend)
        message = _fails(r"likely a deadlock.*Where each rank was waiting.*\[rank 0\] in got\.cpu\(\)",
                         lab1.check_all_gather, ag_returns_none, world_sizes=(2,))
        assert ("On NCCL (these ranks run on GPUs)" in message) == said


# ------------------------------------------------------------------ wrong reduce-scatters

def rs_returns_next_chunk(tensor):
    """Lesson 03's reduce-scatter phase as is: rank r ends with chunk r+1."""
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = [c.clone() for c in tensor.tensor_split(n)]
    inbox = torch.empty_like(chunks[0])
    for step in range(n - 1):
        outgoing, incoming = chunks[(rank - step) % n], chunks[(rank - step - 1) % n]
        exchange(outgoing, (rank + 1) % n, inbox[:incoming.numel()], (rank - 1) % n)
        incoming += inbox[:incoming.numel()]
    return chunks[(rank + 1) % n]


def rs_floor_chunks(tensor):
    """Chunks of length // n, the remainder all in the last chunk: wrong boundaries for uneven lengths."""
    rank, n = dist.get_rank(), dist.get_world_size()
    size = tensor.numel() // n
    bounds = [(r * size, (r + 1) * size if r < n - 1 else tensor.numel()) for r in range(n)]
    total = tensor.clone()
    for peer in range(n):  # exchange full tensors: correct sums, wrong chunking
        if peer != rank:
            inbox = torch.empty_like(tensor)
            exchange(tensor, peer, inbox, peer)
            total += inbox
    start, stop = bounds[rank]
    return total[start:stop]


def rs_hub(tensor):
    """Correct chunks, but everything goes through rank 0: rank 0 receives (N-1)·M."""
    rank, n = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        total = tensor.clone()
        inbox = torch.empty_like(tensor)
        for peer in range(1, n):
            dist.recv(inbox, peer)
            total += inbox
        chunks = total.tensor_split(n)
        for peer in range(1, n):
            dist.send(chunks[peer].contiguous(), peer)
        return chunks[0]
    dist.send(tensor, 0)
    mine = torch.empty_like(tensor.tensor_split(n)[rank])
    dist.recv(mine, 0)
    return mine


def rs_no_reduction(tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    return tensor.tensor_split(n)[rank].clone()


def rs_uses_all_reduce(tensor):
    total = tensor.clone()
    dist.all_reduce(total)
    return total.tensor_split(dist.get_world_size())[dist.get_rank()]


def rs_uses_the_group_method(tensor):
    """The process group's own allreduce, past dist.all_reduce."""
    total = tensor.clone()
    dist.group.WORLD.allreduce([total]).wait()
    return total.tensor_split(dist.get_world_size())[dist.get_rank()]


def rs_direct(tensor):
    """Every rank sends chunk j straight to rank j: right sums, the ring's bytes, but no ring."""
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = tensor.tensor_split(n)
    mine = chunks[rank].clone()
    inbox = torch.empty_like(mine)
    for shift in range(1, n):
        to, source = (rank + shift) % n, (rank - shift) % n
        exchange(chunks[to], to, inbox, source)  # chunk `to` has the size of the receiver's own chunk
        mine += inbox
    return mine


def test_off_by_one_chunk_is_named():
    message = _fails(r"rank 0.*returned chunk 1 of the sum, expected chunk 0.*off by one chunk",
                     lab1.check_reduce_scatter, rs_returns_next_chunk, world_sizes=(3,))
    assert "N=3" in message


def test_wrong_chunk_boundaries_show_expected_shape():
    _fails(r"rank 0, length 7.*returned shape \(2,\), expected \(3,\)",
           lab1.check_reduce_scatter, rs_floor_chunks, world_sizes=(3,))


def test_hub_reduce_scatter_fails_on_bytes():
    _fails(r"rank 0, length 3 \(M = 12 bytes\): received 24 bytes, expected 8.*"
           r"rank 0, length 3: received 12 bytes from rank 1; around a ring rank 0 sends only to rank 1",
           lab1.check_reduce_scatter, rs_hub, world_sizes=(3,), dtypes=(torch.float32,))


def test_a_direct_reduce_scatter_is_not_a_ring():
    # where N divides the length the bytes are the ring's (N-1)/N × M, so only the peers tell
    message = _fails(r"rank 0, length 3: sent 4 bytes to rank 2; around a ring rank 0 sends only to rank 1 "
                     r"\(r\+1\) and receives only from rank 2 \(r-1\)", lab1.check_reduce_scatter, rs_direct,
                     world_sizes=(3,), lengths=(3, 24, 240))
    assert "rank 0, length 3: received 4 bytes from rank 1; around a ring" in message
    assert "expected" not in message  # no byte count is wrong


def test_no_reduction_and_collectives_are_reported():
    _fails(r"returned its own input.*nothing was added", lab1.check_reduce_scatter, rs_no_reduction,
           world_sizes=(2,))
    _fails(r"called dist\.all_reduce, which the checks forbid", lab1.check_reduce_scatter,
           rs_uses_all_reduce, world_sizes=(2,))
    _fails(r"called ProcessGroup\.allreduce, which the checks forbid", lab1.check_reduce_scatter,
           rs_uses_the_group_method, world_sizes=(2,))


# ------------------------------------------------------------------ wrong all-gathers

def ag_forgets_a_chunk(chunk, length):
    """One step short: the chunk that should arrive last never does."""
    rank, n = dist.get_rank(), dist.get_world_size()
    out = torch.zeros(length, dtype=chunk.dtype, device=chunk.device)
    pieces = out.tensor_split(n)
    pieces[rank].copy_(chunk)
    for step in range(n - 2):
        exchange(pieces[(rank - step) % n], (rank + 1) % n, pieces[(rank - step - 1) % n], (rank - 1) % n)
    return out


def ag_blocking_ring(chunk, length):
    """Every rank sends (blocking) before it receives: the deadlock of lesson 03."""
    rank, n = dist.get_rank(), dist.get_world_size()
    out = torch.zeros(length, dtype=chunk.dtype, device=chunk.device)
    pieces = out.tensor_split(n)
    pieces[rank].copy_(chunk)
    for step in range(n - 1):
        dist.send(pieces[(rank - step) % n], (rank + 1) % n)
        dist.recv(pieces[(rank - step - 1) % n], (rank - 1) % n)
    return out


def ag_returns_none(chunk, length):
    return None


def ag_receives_from_anyone(chunk, length):
    """A correct ring whose receives name no source (gloo matches any sender)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    out = torch.zeros(length, dtype=chunk.dtype, device=chunk.device)
    pieces = out.tensor_split(n)
    pieces[rank].copy_(chunk)
    for step in range(n - 1):
        request = dist.isend(pieces[(rank - step) % n], (rank + 1) % n)
        dist.irecv(pieces[(rank - step - 1) % n]).wait()
        request.wait()
    return out


def test_all_gather_that_forgets_a_chunk():
    _fails(r"rank 0, length 3.*wrong gathered tensor.*wrong chunks: \[1\]", lab1.check_all_gather,
           ag_forgets_a_chunk, world_sizes=(3,))


@pytest.mark.skipif(ON_NCCL, reason="NCCL may complete small blocking sends from its buffers: no sure hang")
def test_deadlock_is_reported_as_such():
    message = _fails(r"no result after 5 s: likely a deadlock.*Where each rank was waiting",
                     lab1.check_all_gather, ag_blocking_ring, world_sizes=(3,), timeout=5)
    assert "ag_blocking_ring" in message  # the stack points at the student's function


@pytest.mark.skipif(ON_NCCL, reason="NCCL has no receive from any source")
def test_a_receive_from_an_unnamed_source_is_reported():
    # lengths with every chunk filled: gloo's any-source receive of an empty chunk crashes before any count
    _fails(r"rank 0, length 3: received 8 bytes from an unnamed source \(a receive without src\); around a "
           r"ring rank 0 sends only to rank 1", lab1.check_all_gather, ag_receives_from_anyone, world_sizes=(3,),
           lengths=(3, 7, 24))


def test_missing_return_value():
    _fails(r"returned NoneType, expected a tensor", lab1.check_all_gather, ag_returns_none,
           world_sizes=(2,))


# ------------------------------------------------------------------ wrong halving-doublings

def hd_power_of_two_only(tensor):
    """Textbook recursive halving-doubling with no rule for the extra ranks."""
    rank, n = dist.get_rank(), dist.get_world_size()
    result, inbox = tensor.clone(), torch.empty_like(tensor)
    lo, hi, history, distance = 0, result.numel(), [], n // 2
    while distance >= 1:
        partner = rank ^ distance
        mid = lo + (hi - lo) // 2
        keep, give = ((lo, mid), (mid, hi)) if rank & distance == 0 else ((mid, hi), (lo, mid))
        exchange(result[give[0]:give[1]], partner, inbox[keep[0]:keep[1]], partner)
        result[keep[0]:keep[1]] += inbox[keep[0]:keep[1]]
        history.append((lo, hi))
        lo, hi = keep
        distance //= 2
    distance = 1
    for outer_lo, outer_hi in reversed(history):
        partner = rank ^ distance
        other = (hi, outer_hi) if lo == outer_lo else (outer_lo, lo)
        exchange(result[lo:hi], partner, result[other[0]:other[1]], partner)
        lo, hi = outer_lo, outer_hi
        distance *= 2
    return result


def ring_all_reduce(tensor, gather_steps=None):
    """Lesson 03's ring: correct sums, but not halving-doubling."""
    rank, n = dist.get_rank(), dist.get_world_size()
    gather_steps = n - 1 if gather_steps is None else gather_steps
    tensor = tensor.clone()
    chunks = tensor.tensor_split(n)
    inbox = torch.empty_like(chunks[0])
    for step in range(n - 1):
        outgoing, incoming = chunks[(rank - step) % n], chunks[(rank - step - 1) % n]
        exchange(outgoing, (rank + 1) % n, inbox[:incoming.numel()], (rank - 1) % n)
        incoming += inbox[:incoming.numel()]
    for step in range(gather_steps):
        exchange(chunks[(rank - step + 1) % n], (rank + 1) % n, chunks[(rank - step) % n], (rank - 1) % n)
    return tensor


def ring_forgets_a_chunk(tensor):
    """Sums correctly, but the all-gather stops one step short: one chunk keeps a partial sum."""
    return ring_all_reduce(tensor, gather_steps=dist.get_world_size() - 2)


def test_power_of_two_only_solution_is_rejected():
    lab1.check_halving_doubling(hd_power_of_two_only, world_sizes=(2, 4))  # fine on powers of two
    # rank 2 exchanges with rank 3, which does not exist (on gloo that hangs or crashes with SIGSEGV):
    # the byte counter refuses the peer before the backend sees it
    _fails(r"failed at N=3:\n  N=3 is not a power of two \(p = 2, extra = 1\): the rank pairs \(0, 1\) fold"
           r".*then the ranks \[1, 2\] run halving-doubling"
           r".*dist.isend with dst=3: there is no rank 3, the ranks are 0 … 2",
           lab1.check_halving_doubling, hd_power_of_two_only, world_sizes=(3,), timeout=5)


def _halving_doubling(tensor, rank_at, position_of, round_up=False):
    """The lab's algorithm, with the position -> rank and rank -> position mappings passed in (round_up: split
    a range at its upper middle, another reasonable choice for lengths nobody divides)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    result = tensor.clone()
    p = 1 << (n.bit_length() - 1)
    extra = n - p
    if rank < 2 * extra and rank % 2 == 0:  # fold, wait for the sum
        dist.send(result, rank + 1)
        dist.recv(result, rank + 1)
        return result
    if rank < 2 * extra:
        inbox = torch.empty_like(result)
        dist.recv(inbox, rank - 1)
        result += inbox
    me = position_of(rank, extra)
    inbox = torch.empty_like(result)
    lo, hi, history, distance = 0, result.numel(), [], p // 2
    while distance >= 1:
        partner = rank_at(me ^ distance, extra)
        mid = lo + (hi - lo + round_up) // 2
        keep, give = ((lo, mid), (mid, hi)) if me & distance == 0 else ((mid, hi), (lo, mid))
        exchange(result[give[0]:give[1]], partner, inbox[keep[0]:keep[1]], partner)
        result[keep[0]:keep[1]] += inbox[keep[0]:keep[1]]
        history.append((lo, hi))
        lo, hi = keep
        distance //= 2
    distance = 1
    for outer_lo, outer_hi in reversed(history):
        partner = rank_at(me ^ distance, extra)
        other = (hi, outer_hi) if lo == outer_lo else (outer_lo, lo)
        exchange(result[lo:hi], partner, result[other[0]:other[1]], partner)
        lo, hi = outer_lo, outer_hi
        distance *= 2
    if rank < 2 * extra:
        dist.send(result, rank - 1)
    return result


def _lab_position(rank, extra):
    return rank // 2 if rank < 2 * extra else rank - extra


def hd_shifted_positions(tensor):
    """Position q taken to be rank q + extra for every q. While one pair folds (N = 3, 5) that is right:
    position 0 is rank 1 = 0 + 1. With two folded pairs (N = 6) position 0 becomes rank 2, a folded rank,
    instead of rank 1."""
    return _halving_doubling(tensor, lambda q, extra: q + extra, _lab_position)


def hd_position_as_rank(tensor):
    """The partner's position used as its rank: at N = 3 rank 1 (position 0) exchanges with "rank" 0 XOR 1."""
    return _halving_doubling(tensor, lambda q, extra: q, _lab_position)


SIX_RANKS_IN_ANOTHER_ORDER = [1, 4, 5, 3]  # the lab's rule gives positions to [1, 3, 4, 5]


def hd_positions_in_another_order(tensor):
    """Correct sums and bytes at N = 6, but positions given in another order than the lab's rule."""
    order = SIX_RANKS_IN_ANOTHER_ORDER
    return _halving_doubling(tensor, lambda q, extra: order[q], lambda rank, extra: order.index(rank))


def test_the_lab_mapping_passes():
    lab1.check_halving_doubling(
        lambda t: _halving_doubling(t, lambda q, e: 2 * q + 1 if q < e else q + e, _lab_position),
        world_sizes=(3, 6), dtypes=(torch.float32,))


def test_a_rank_mapping_right_for_one_folded_pair_fails_at_six():
    # N = 2, 3, 4 (and 5) cannot tell this mapping from the lab's; N = 6, in the visible check, can
    lab1.check_halving_doubling(hd_shifted_positions, world_sizes=(2, 3, 4, 5), dtypes=(torch.float32,))
    _fails(r"at N=6.*\n  N=6 is not a power of two \(p = 4, extra = 2\): the rank pairs \(0, 1\), \(2, 3\) fold"
           r".*then the ranks \[1, 3, 4, 5\] run halving-doubling, the q-th of them at position q",
           lab1.check_halving_doubling, hd_shifted_positions, world_sizes=(6,), timeout=10)
    assert 6 in lab1.HALVING_DOUBLING_WORLD_SIZES  # the notebook's visible check runs N = 6


def test_a_position_used_as_a_rank_is_named_before_gloo_sees_it():
    message = _fails(r"failed at N=3:\n  N=3 is not a power of two.*the ranks \[1, 2\] run halving-doubling.*"
                     r"never use a position as a rank number.*"
                     r"dist\.isend with dst=1: rank 1 sent to itself",
                     lab1.check_halving_doubling, hd_position_as_rank, world_sizes=(3,), timeout=10)
    assert "Pair is not connected ([" not in message  # refused before gloo's own error


def test_partners_out_of_the_lab_order_are_named():
    message = _fails(r"rank 1, length 6: sent \d+ bytes to rank 5; rank 1 is at position 0 of the ranks "
                     r"\[1, 3, 4, 5\] that run halving-doubling, so its partners are the ranks at positions "
                     r"0 XOR 2, 1: \[3, 4\], and rank 0",
                     lab1.check_halving_doubling, hd_positions_in_another_order, world_sizes=(6,))
    assert "expected" not in message  # sums and bytes are right: only the partners are not


def test_sum_missing_a_contribution_names_the_chunks():
    message = _fails(r"rank 0, length 4, float32: wrong sum: 1 of 4 elements wrong, first at element 2.*"
                     r"wrong chunks: \[2\]", lab1.check_halving_doubling, ring_forgets_a_chunk,
                     world_sizes=(4,))
    assert "rank 1, length 4, float32: wrong sum: 1 of 4 elements wrong, first at element 3" in message


def test_a_ring_is_not_halving_doubling():
    _fails(r"sent 6 messages, at most 4 expected", lab1.check_halving_doubling, ring_all_reduce,
           world_sizes=(4,))
    _fails(r"rank 0, length 3: sent 4 messages, at most 1 expected \(one send of the whole tensor to its odd "
           r"partner\).*rank 0, length 3: received 16 bytes from rank 2; rank 0 is folded: it exchanges only with "
           r"rank 1",
           lab1.check_halving_doubling, ring_all_reduce, world_sizes=(3,), dtypes=(torch.float32,))


# ------------------------------------------------------------------ wrong cost models

def test_wrong_cost_formulas_fail(reference):
    ring, hd = reference["ring_time"], reference["halving_doubling_time"]
    crossover = reference["crossover_bytes"]

    def ring_time(n, nbytes, alpha, beta):  # forgets that the all-gather phase doubles the steps
        return (n - 1) * (alpha + nbytes / n * beta)

    def halving_doubling_time(n, nbytes, alpha, beta):  # no cost for the fold
        p = 1 << (n.bit_length() - 1)
        return 2 * math.log2(p) * alpha + 2 * (p - 1) / p * nbytes * beta

    def crossover_bytes(n, alpha, beta):  # says "never" for powers of two the wrong way round
        return 0.0

    _fails(r"ring_time\(n=2, .*expected .*2\(N-1\) steps", lab1.check_cost_model, ring_time, hd, crossover)
    _fails(r"halving_doubling_time\(n=3, .*fold", lab1.check_cost_model, ring, halving_doubling_time,
           crossover)
    _fails(r"crossover_bytes\(n=2, .*expected math\.inf: N=2 is a power of two", lab1.check_cost_model, ring,
           hd, crossover_bytes)


def crossover_by_subtraction(n, alpha, beta, ring_time, halving_doubling_time, tolerant=False):
    """Solve ring = halving-doubling from the two cost functions, without a special case for equal slopes:
    at a power of two the slopes differ only by round-off, which leaves a huge number of either sign.
    tolerant=True compares the slopes with a tolerance instead (the lab's advice)."""
    saved = ring_time(n, 0, alpha, beta) - halving_doubling_time(n, 0, alpha, beta)
    lost = ((halving_doubling_time(n, 1, alpha, beta) - halving_doubling_time(n, 0, alpha, beta))
            - (ring_time(n, 1, alpha, beta) - ring_time(n, 0, alpha, beta)))
    if tolerant and lost <= 1e-9 * abs(ring_time(n, 1, alpha, beta) - ring_time(n, 0, alpha, beta)):
        return math.inf                      # equal slopes up to round-off, of either sign
    return math.inf if lost == 0 else max(0.0, saved / lost)


def test_crossover_in_whole_bytes_or_huge_for_never_is_accepted(reference, capsys):
    ring, hd, exact = reference["ring_time"], reference["halving_doubling_time"], reference["crossover_bytes"]
    for rounding in (math.floor, round, math.ceil):
        lab1.check_cost_model(ring, hd, lambda n, a, b: exact(n, a, b) if exact(n, a, b) == math.inf
                              else rounding(exact(n, a, b)))
    # on the lab's first link round-off leaves huge positive numbers (1.2e16 at N = 8): "never slower" too
    assert crossover_by_subtraction(8, 5e-6, 1 / 100e9, ring, hd) > 1e15
    # on the check's N = 16 case it leaves a huge negative one, clamped to 0.0: wrong, and the message says why
    assert crossover_by_subtraction(16, 2e-6, 1 / 25e9, ring, hd) == 0.0
    _fails(r"crossover_bytes\(n=16, alpha=2e-06, beta=4e-11\) = 0\.0, expected math\.inf: .*round-off",
           lab1.check_cost_model, ring, hd, lambda n, a, b: crossover_by_subtraction(n, a, b, ring, hd))
    # the same subtraction with a tolerance on the slopes is right, up to its cancellation (≈1e-5 relative)
    lab1.check_cost_model(ring, hd, lambda n, a, b: crossover_by_subtraction(n, a, b, ring, hd, tolerant=True))
    assert "crossover_bytes matches the α-β model on 12 (N, α, β) cases" in capsys.readouterr().out


def test_acceptance_rules():
    assert lab1.accept_crossover(math.inf, math.inf) and lab1.accept_crossover(1e15, math.inf)
    assert lab1.accept_crossover(5.9e15, math.inf) and not lab1.accept_crossover(1e14, math.inf)
    want = reference_formulas.lab1_crossover(6, 10e-6, 1 / 50e9)  # 1090909.09 bytes
    assert all(lab1.accept_crossover(got, want) for got in (1090909, 1090910, want, 1090909.5))
    assert not any(lab1.accept_crossover(got, want) for got in (1090790, 1091020, math.inf, float("nan"),
                                                                 True, "1090909", None))
    want = reference_formulas.lab1_crossover(1000, 5e-6, 1 / 100e9)  # 494971769.97 bytes: 1e-4 relative is 49,497
    assert lab1.accept_crossover(want + 49_000, want) and not lab1.accept_crossover(want + 50_000, want)
    assert lab1.accept_crossover(0, 0.0) and not lab1.accept_crossover(2.0, 0.0)
    assert lab1.accept_time(1e-5 * (1 + 1e-12), 1e-5) and not lab1.accept_time(1.001e-5, 1e-5)
    assert not lab1.accept_time(torch.tensor(1e-5), 1e-5) and not lab1.accept_time(math.nan, 1e-5)


def test_a_time_that_is_not_a_number_is_named(reference):
    def ring_time(n, nbytes, alpha, beta):
        return torch.tensor(reference["ring_time"](n, nbytes, alpha, beta))

    _fails(r"ring_time\(n=2, nbytes=1000, alpha=5e-06, beta=1e-11\) returned Tensor .*return a number",
           lab1.check_cost_model, ring_time, reference["halving_doubling_time"], reference["crossover_bytes"])


def test_halving_doubling_bytes_formula():
    # N = 6: p = 4, extra = 2 → ranks 0, 2 folded; 1, 3 carry the fold; 4, 5 plain.
    want = {r: lab1.halving_doubling_bytes(r, 6, 480)["sent"] for r in range(6)}
    assert want == {0: 480, 1: 720 + 480, 2: 480, 3: 720 + 480, 4: 720, 5: 720}
    assert lab1.halving_doubling_bytes(3, 8, 800)["max_messages"] == 6
    assert lab1.chunk_bounds(9, 4) == [(0, 3), (3, 5), (5, 7), (7, 9)]


def test_stored_cost_values_are_in_step_with_the_private_reference():
    """lab1_cost.py holds values for its fixed cases, generated by utils/tools/grade/reference.py (left out of the
    student distribution): regenerate with `python -m utils.tools.grade.reference` if this fails."""
    from utils.labchecks import lab1_cost
    times, crossings = reference_formulas.lab1_expected_tables(lab1.COST_CASES)
    assert lab1.EXPECTED_TIMES == times and lab1.EXPECTED_CROSSOVER == crossings
    source = Path(lab1_cost.__file__).read_text()
    assert reference_formulas.lab1_tables_source(lab1.COST_CASES) in source
    for formula in ("2 * (n - 1) * (alpha + nbytes / n * beta)", "latency_saved", "bandwidth_lost"):
        assert formula not in source, f"lab1.py (students receive it) holds a reference formula: {formula}"


# ------------------------------------------------------------------ traffic loopholes: right sums, wrong traffic

def rs_padded(tensor):
    """A ring reduce-scatter that pads every chunk to the largest: right sums, more bytes where N does not
    divide the length."""
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = tensor.tensor_split(n)
    rows = torch.zeros(n, chunks[0].numel(), dtype=tensor.dtype, device=tensor.device)
    for row, chunk in zip(rows, chunks):
        row[:chunk.numel()] = chunk
    inbox = torch.empty_like(rows[0])
    for step in range(n - 1):
        outgoing, incoming = rows[(rank - 1 - step) % n], rows[(rank - 2 - step) % n]
        exchange(outgoing, (rank + 1) % n, inbox, (rank - 1) % n)
        incoming += inbox
    return rows[rank][:chunks[rank].numel()]


def ag_in_two_messages(chunk, length):
    """A ring all-gather that sends every chunk as two messages: right result and bytes, twice the messages."""
    rank, n = dist.get_rank(), dist.get_world_size()
    out = torch.empty(length, dtype=chunk.dtype, device=chunk.device)
    pieces = out.tensor_split(n)
    pieces[rank].copy_(chunk)
    for step in range(n - 1):
        outgoing, incoming = pieces[(rank - step) % n], pieces[(rank - step - 1) % n]
        for a, b in zip(outgoing.tensor_split(2), incoming.tensor_split(2)):
            exchange(a, (rank + 1) % n, b, (rank - 1) % n)
    return out


def hd_padded(tensor):
    """The lab's halving-doubling on the tensor padded to a multiple of p: right sums, more bytes."""
    n = dist.get_world_size()
    p = 1 << (n.bit_length() - 1)
    padded = torch.zeros(-(-tensor.numel() // p) * p, dtype=tensor.dtype, device=tensor.device)
    padded[:tensor.numel()] = tensor
    lab_rank_at = lambda q, e: 2 * q + 1 if q < e else q + e
    return _halving_doubling(padded, lab_rank_at, _lab_position)[:tensor.numel()]


def hd_upper_middle(tensor):
    """The lab's algorithm splitting every range at its upper middle: another split, the same total bytes."""
    return _halving_doubling(tensor, lambda q, e: 2 * q + 1 if q < e else q + e, _lab_position, round_up=True)


def test_padding_every_chunk_fails_on_bytes_where_n_does_not_divide():
    lab1.check_reduce_scatter(rs_padded, world_sizes=(2, 4), lengths=(8, 24), dtypes=(torch.float32,))  # even
    _fails(r"reduce_scatter at N=3:.*\(M = \d+ bytes\): (sent|received) \d+ bytes, expected \d+ "
           r"\(M minus chunk",
           lab1.check_reduce_scatter, rs_padded, world_sizes=(3,))


def test_a_ring_in_more_messages_fails_on_messages():
    _fails(r"all_gather at N=3:.*rank 0, length \d+: sent [4-9] messages, at most 2 expected \(N-1 steps around "
           r"the ring", lab1.check_all_gather, ag_in_two_messages, world_sizes=(3,), dtypes=(torch.float32,))


def test_empty_chunks_are_part_of_the_contract(reference):
    for check, fn in ((lab1.check_reduce_scatter, reference["reduce_scatter"]),
                      (lab1.check_all_gather, reference["all_gather"]),
                      (lab1.check_halving_doubling, reference["all_reduce_halving_doubling"])):
        check(fn, world_sizes=(3, 4), lengths=(1, 2, 3), dtypes=(torch.float32,))


def test_halving_doubling_padding_fails_and_another_split_passes():
    lab1.check_halving_doubling(hd_upper_middle, world_sizes=(3, 4, 6), dtypes=(torch.float32,))
    _fails(r"length \d+ \(M = \d+ bytes\): all ranks together sent \d+ bytes \(per rank \[.*\]\), expected \d+",
           lab1.check_halving_doubling, hd_padded, world_sizes=(4,), dtypes=(torch.float32,))


def test_ring_bytes_formula():
    # N = 3, length 7: chunks of 3, 2, 2 elements (float32: 12, 8, 8 bytes), M = 28
    assert [lab1.ring_bytes("reduce_scatter", r, 3, 7, 4)["sent"] for r in range(3)] == [16, 20, 20]
    assert [lab1.ring_bytes("reduce_scatter", r, 3, 7, 4)["received"] for r in range(3)] == [20, 16, 20]
    assert [lab1.ring_bytes("all_gather", r, 3, 7, 4)["sent"] for r in range(3)] == [20, 20, 16]
    assert [lab1.ring_bytes("all_gather", r, 3, 7, 4)["received"] for r in range(3)] == [16, 20, 20]
    assert all(lab1.ring_bytes(k, r, 4, 24, 8)["sent"] == lab1.scatter_gather_bytes(r, 4, 192)["sent"]
               for k in ("reduce_scatter", "all_gather") for r in range(4))
    assert lab1.halving_doubling_total_bytes(3, 4800) == 4800 + 9600 + 4800
    assert lab1.halving_doubling_total_bytes(4, 4800) == 4 * 7200
