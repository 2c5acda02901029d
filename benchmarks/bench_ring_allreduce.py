"""Benchmark: the from-scratch ring all-reduce of lesson 03 against dist.all_reduce.

Runs 4 ranks (gloo on CPU, NCCL with one GPU per rank) and times, at 16 MiB and 64 MiB of float32:
  - the plain ring (one batched send+receive and one add per step; lesson 03's first version),
  - the pipelined ring (the same ring schedule with each chunk cut into pieces, so that sending and
    adding may overlap; lesson 03's section 8),
  - dist.all_reduce, the baseline, measured in the same run.
Each repetition starts after a barrier and its time is the slowest rank's. The versions run in rounds, one
of each per round, in an order rotated from round to round (utils.timing.rotated_rounds), after a warm-up
round that is not kept. For each size it prints every version's median time with its spread (quartiles,
min–max), the time ratio to dist.all_reduce within each round (median and quartiles over rounds), and
utils.timing.compare's verdicts, which call a difference whose interquartile ranges overlap "no measurable
difference here". Takes well under a minute on 2 cores.

    .venv/bin/python benchmarks/bench_ring_allreduce.py [--rounds 15] [--sizes-mb 16 64] [--piece-kb 1024]

The ring functions are copies of the lesson's cells (the benchmark imports nothing from notebooks).
"""
import argparse
import time

import torch
import torch.distributed as dist

import utils
from utils.timing import Spread, compare, rotated_rounds


# ------------------------------------------------------------------ the lesson's rings (copies)

def exchange(outgoing, dst, incoming, src):
    # Send `outgoing` to rank dst and receive `incoming` from rank src, posted together as one batch so
    # that neither waits for the other (a blocking send first would deadlock the ring, and on NCCL so can
    # an isend followed by a recv); returns once both are done.
    requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, outgoing, dst),
                                       dist.P2POp(dist.irecv, incoming, src)])
    for request in requests:
        request.wait()


def ring_all_reduce(tensor):
    # Sum `tensor` over all ranks, in place, by passing chunks around a ring (any length, any N).
    rank, n = dist.get_rank(), dist.get_world_size()
    if n == 1:
        return tensor
    right, left = (rank + 1) % n, (rank - 1) % n
    chunks = tensor.view(-1).tensor_split(n)   # n contiguous views into tensor; chunk 0 is the largest
    inbox = torch.empty_like(chunks[0])        # on the tensor's device, like every buffer we create
    for step in range(n - 1):                  # reduce-scatter: add the left neighbour's partial sum
        outgoing, incoming = chunks[(rank - step) % n], chunks[(rank - step - 1) % n]
        exchange(outgoing, right, inbox[:incoming.numel()], left)
        incoming += inbox[:incoming.numel()]
    for step in range(n - 1):                  # all-gather: pass the finished chunks on
        outgoing, incoming = chunks[(rank - step + 1) % n], chunks[(rank - step) % n]
        exchange(outgoing, right, incoming, left)
    return tensor


def pipelined_ring_all_reduce(tensor, piece_bytes=1 << 20):
    # The ring of ring_all_reduce with every chunk cut into pieces. Step g (of 2(n-1)) sends chunk
    # (rank-g) % n to the right and receives chunk (rank-g-1) % n from the left: added to ours in the
    # reduce-scatter steps (g < n-1), kept as is in the all-gather steps. Each piece is one exchange,
    # posted as soon as the piece it sends is ready: a whole chunk's worth of pieces is on the way at once.
    rank, n = dist.get_rank(), dist.get_world_size()
    if n == 1:
        return tensor
    right, left = (rank + 1) % n, (rank - 1) % n
    chunks = tensor.view(-1).tensor_split(n)
    n_pieces = max(1, -(-chunks[0].numel() * tensor.element_size() // piece_bytes))
    pieces = [chunk.tensor_split(n_pieces) for chunk in chunks]
    inboxes = [torch.empty_like(chunks[0]) for _ in range(2)]   # the reduce-scatter steps use them in turn

    def start(g, k):                               # post piece k of step g; return its requests and inbox
        incoming = (rank - g - 1) % n
        if g < n - 1:                              # reduce-scatter: into an inbox, added once it is in
            target = inboxes[g % 2][:chunks[incoming].numel()].tensor_split(n_pieces)[k]
        else:                                      # all-gather: straight into our copy of the chunk
            target = pieces[incoming][k]
        requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, pieces[(rank - g) % n][k], right),
                                           dist.P2POp(dist.irecv, target, left)])
        return requests, target

    transfers = [(g, k) for g in range(2 * (n - 1)) for k in range(n_pieces)]
    posted = [start(*transfer) for transfer in transfers[:n_pieces]]   # step 0: our own chunk, every piece
    for i, (g, k) in enumerate(transfers):
        requests, target = posted[i]
        for request in requests:
            request.wait()
        if g < n - 1:
            pieces[(rank - g - 1) % n][k].add_(target)
        if i + n_pieces < len(transfers):          # step g+1 sends this very piece on: post it now
            posted.append(start(*transfers[i + n_pieces]))
    return tensor


# ------------------------------------------------------------------ timing on every rank

BASELINE = "dist.all_reduce"


def _time_all(sizes_mb, rounds, piece_bytes):
    device = utils.device()
    rank = dist.get_rank()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    variants = {
        "ring (plain)": ring_all_reduce,
        "ring (pipelined)": lambda t: pipelined_ring_all_reduce(t, piece_bytes),
        BASELINE: dist.all_reduce,
    }
    results = {}
    for size_mb in sizes_mb:
        numel = size_mb * (1 << 20) // 4
        generator = torch.Generator().manual_seed(rank)
        data = torch.randn(numel, generator=generator).to(device)
        expected = data.clone()
        dist.all_reduce(expected)
        for name, op in variants.items():  # correctness first
            work = data.clone()
            op(work)
            if not torch.allclose(work, expected, rtol=1e-4, atol=1e-4):
                raise AssertionError(f"{name} gave a wrong sum at {size_mb} MiB on rank {rank}")
        times = {name: [] for name in variants}
        work = data.clone()
        for rep, name in rotated_rounds(list(variants), rounds):
            work.copy_(data)
            dist.barrier()
            sync()
            start = time.perf_counter()
            variants[name](work)
            sync()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the collective ends with its slowest rank
            if rep >= 0:                                     # rep < 0: the warm-up round
                times[name].append(elapsed.item())
        results[size_mb] = times
    return results


def pieces_per_chunk(size_mb, world_size, piece_bytes):
    """How the pipelined ring cuts the largest chunk (1: not at all, the plain ring's messages)."""
    chunk_bytes = -(-(size_mb * (1 << 20) // 4) // world_size) * 4
    return max(1, -(-chunk_bytes // piece_bytes))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[16, 64], help="sizes in MiB")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--piece-kb", type=int, default=1024, help="piece size of the pipelined ring, KiB")
    args = parser.parse_args()
    backend = utils.backend_for(args.world_size)
    piece_bytes = args.piece_kb * 1024
    print(f"{args.world_size} ranks, backend {backend}, float32, {args.rounds} rounds in rotated order "
          f"(plus one warm-up round), time of the slowest rank; pipelined ring: pieces of {args.piece_kb} KiB")
    started = time.perf_counter()
    results = utils.launch(_time_all, args.sizes_mb, args.rounds, piece_bytes,
                           world_size=args.world_size, timeout=600)[0]
    for size_mb, times in results.items():
        pieces = pieces_per_chunk(size_mb, args.world_size, piece_bytes)
        print(f"\n{size_mb} MiB ({pieces} piece{'s' if pieces > 1 else ''} per chunk in the pipelined ring"
              + (", i.e. the plain ring's messages)" if pieces == 1 else ")"))
        for name, t in times.items():
            print(f"  {name:<18} {Spread.of(t).format()}")
        base = times[BASELINE]
        for name in ("ring (plain)", "ring (pipelined)"):
            # the versions ran in the same round, so each round gives one ratio
            ratio = Spread.of([a / b for a, b in zip(times[name], base)])
            print(f"  {name} / {BASELINE}: {ratio.median:.2f}x within a round "
                  f"(IQR {ratio.q1:.2f}–{ratio.q3:.2f}, min–max {ratio.low:.2f}–{ratio.high:.2f})")
        for name in ("ring (plain)", "ring (pipelined)"):
            print(f"  verdict: {compare(base, times[name], BASELINE, name)}")
        print(f"  verdict: {compare(times['ring (plain)'], times['ring (pipelined)'], 'ring (plain)', 'ring (pipelined)')}")
    print(f"\ntook {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
