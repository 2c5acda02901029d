"""Benchmark: the from-scratch ring all-reduce of lesson 03 against dist.all_reduce.

Runs 4 ranks (gloo on CPU, NCCL with one GPU per rank) and times, at 16 MB and 64 MB of float32:
  - the plain ring (one batched send+receive and one add per step; lesson 03's first version),
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

def _time_all(sizes_mb, reps, warmup, piece_bytes):
    device = utils.device()
    rank = dist.get_rank()
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
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
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
