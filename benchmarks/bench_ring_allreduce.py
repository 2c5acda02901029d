"""Benchmark: the from-scratch ring all-reduce of lesson 03 against dist.all_reduce.

Runs 4 ranks (gloo on CPU, NCCL with one GPU per rank) and times, at 16 MB and 64 MB of float32:
  - the plain ring (one isend/recv/add per step; lesson 03's first version),
  - the pipelined ring (the same ring schedule, each chunk cut into sub-chunks so that sending,
    receiving and adding overlap; lesson 03's fast version),
  - dist.all_reduce.
Each repetition starts after a barrier and its time is the slowest rank's. The three run back to back in
every round, so a load change on a shared machine hits them alike; the ratio ring / dist.all_reduce is taken
within each round and its median over rounds is printed (with the range), next to the median times.

    .venv/bin/python benchmarks/bench_ring_allreduce.py [--reps 7] [--sizes-mb 16 64]

The ring functions are copies of the lesson's cells (the benchmark imports nothing from notebooks).
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist

import utils


# ------------------------------------------------------------------ the lesson's rings (copies)

def ring_all_reduce(tensor):
    # Sum `tensor` over all ranks, in place, by passing chunks around a ring (any length, any N).
    rank, n = dist.get_rank(), dist.get_world_size()
    if n == 1:
        return tensor
    right, left = (rank + 1) % n, (rank - 1) % n
    chunks = tensor.view(-1).tensor_split(n)   # n contiguous views into tensor; chunk 0 is the largest
    inbox = torch.empty_like(chunks[0])
    for step in range(n - 1):                  # reduce-scatter: add the left neighbour's partial sum
        outgoing, incoming = chunks[(rank - step) % n], chunks[(rank - step - 1) % n]
        request = dist.isend(outgoing, dst=right)  # non-blocking: a blocking send here deadlocks
        dist.recv(inbox[:incoming.numel()], src=left)
        incoming += inbox[:incoming.numel()]
        request.wait()
    for step in range(n - 1):                  # all-gather: pass the finished chunks on
        outgoing, incoming = chunks[(rank - step + 1) % n], chunks[(rank - step) % n]
        request = dist.isend(outgoing, dst=right)
        dist.recv(incoming, src=left)
        request.wait()
    return tensor


def pipelined_ring_all_reduce(tensor, piece_bytes=1 << 20):
    # The ring of ring_all_reduce, with every chunk cut into pieces that are received, added and
    # forwarded independently. 2(n-1) steps: at step g we receive chunk (rank-g-1) % n from the left,
    # add it (reduce-scatter, g < n-1) or keep it (all-gather), and forward it piece by piece.
    rank, n = dist.get_rank(), dist.get_world_size()
    if n == 1:
        return tensor
    right, left = (rank + 1) % n, (rank - 1) % n
    chunks = tensor.view(-1).tensor_split(n)
    n_pieces = max(1, -(-chunks[0].numel() * tensor.element_size() // piece_bytes))
    pieces = [chunk.tensor_split(n_pieces) for chunk in chunks]
    inboxes = [torch.empty_like(chunks[0]) for _ in range(2)]
    steps = 2 * (n - 1)
    sending = {}                                   # chunk index -> its pending isend requests

    def send_piece(index, k):
        sending.setdefault(index, []).append(dist.isend(pieces[index][k], dst=right))

    def post_receives(g):
        index = (rank - g - 1) % n
        if g < n - 1:                              # reduce-scatter: into an inbox, to be added
            targets = inboxes[g % 2][:chunks[index].numel()].tensor_split(n_pieces)
        else:                                      # all-gather: straight into the chunk ...
            for request in sending.pop(index, []):
                request.wait()                     # ... once nobody is still sending from it
            targets = pieces[index]
        return index, targets, [dist.irecv(t, src=left) for t in targets]

    for k in range(n_pieces):                      # step 0 sends our own chunk
        send_piece(rank, k)
    index, targets, receives = post_receives(0)
    for g in range(steps):
        upcoming = post_receives(g + 1) if g + 1 < steps else None
        for k in range(n_pieces):
            receives[k].wait()
            if g < n - 1:
                pieces[index][k].add_(targets[k])
            if g + 1 < steps:
                send_piece(index, k)               # forward at once: step g+1 sends this chunk
        if upcoming:
            index, targets, receives = upcoming
    for requests in sending.values():
        for request in requests:
            request.wait()
    return tensor


# ------------------------------------------------------------------ timing on every rank

def _time_all(sizes_mb, reps, warmup, piece_bytes):
    device = utils.device()
    rank, n = dist.get_rank(), dist.get_world_size()
    variants = {
        "ring (plain)": ring_all_reduce,
        "ring (pipelined)": lambda t: pipelined_ring_all_reduce(t, piece_bytes),
        "dist.all_reduce": dist.all_reduce,
    }
    results = {}
    for size_mb in sizes_mb:
        numel = size_mb * (1 << 20) // 4
        generator = torch.Generator().manual_seed(rank)
        data = torch.randn(numel, generator=generator).to(device)
        expected = data.clone()
        dist.all_reduce(expected)
        for name, op in variants.items():  # correctness first, and warm-up
            for _ in range(warmup):
                work = data.clone()
                op(work)
            if not torch.allclose(work, expected, rtol=1e-4, atol=1e-4):
                raise AssertionError(f"{name} gave a wrong sum at {size_mb} MB on rank {rank}")
        times = {name: [] for name in variants}
        work = data.clone()
        for _ in range(reps):
            for name, op in variants.items():
                work.copy_(data)
                dist.barrier()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                op(work)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the collective ends with its slowest rank
                times[name].append(elapsed.item())
        results[size_mb] = times
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--piece-kb", type=int, default=1024)
    args = parser.parse_args()
    backend = utils.backend_for(args.world_size)
    print(f"{args.world_size} ranks, backend {backend}, float32, {args.reps} repetitions "
          f"(median of the slowest rank), pieces of {args.piece_kb} KB")
    results = utils.launch(_time_all, args.sizes_mb, args.reps, args.warmup, args.piece_kb * 1024,
                           world_size=args.world_size, timeout=600)[0]
    for size_mb, times in results.items():
        base = times["dist.all_reduce"]
        print(f"{size_mb:>4} MB: " + "   ".join(
            f"{name} {1e3 * statistics.median(t):8.2f} ms" for name, t in times.items()))
        for name in ("ring (plain)", "ring (pipelined)"):
            # ratio within each round (the variants ran back to back), then the median over rounds
            ratios = sorted(a / b for a, b in zip(times[name], base))
            print(f"        {name} / dist.all_reduce = {statistics.median(ratios):.2f}x "
                  f"(rounds: {ratios[0]:.2f}x … {ratios[-1]:.2f}x)")

if __name__ == "__main__":
    main()
