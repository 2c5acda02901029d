"""How long does it take to start 4 ranks, all-reduce once and tear down?

Compares utils.launch (forkserver with torch preloaded) with torch.multiprocessing.spawn doing the
same work, both measured in this run, and prints the medians and their ratio.

    .venv/bin/python benchmarks/bench_launch.py [--world-size 4] [--repeats 15]
"""
import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import utils


def one_all_reduce():
    t = torch.ones(1024)
    dist.all_reduce(t)
    return t[0].item()


def spawned_rank(rank, world_size, port):
    """The same work, set up by hand the way a torch.multiprocessing.spawn script does it."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(utils.default_threads(world_size))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    one_all_reduce()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--spawn-repeats", type=int, default=3)
    args = parser.parse_args()
    n = args.world_size

    utils.launch(one_all_reduce, world_size=n)  # the first launch starts the forkserver: not "warm"
    ours = timed(lambda: utils.launch(one_all_reduce, world_size=n), args.repeats)
    spawn = timed(lambda: mp.spawn(spawned_rank, args=(n, free_port()), nprocs=n, join=True),
                  args.spawn_repeats)

    ours_median, spawn_median = statistics.median(ours), statistics.median(spawn)
    print(f"{n} ranks: start, init_process_group, one all_reduce, tear down ({os.cpu_count()} cores)")
    print(f"utils.launch (warm)            median {ours_median:7.3f} s over {len(ours)} runs "
          f"(min {min(ours):.3f}, max {max(ours):.3f})")
    print(f"torch.multiprocessing.spawn    median {spawn_median:7.3f} s over {len(spawn)} runs")
    print(f"ratio spawn / launch           {spawn_median / ours_median:7.1f}x")
    print(f"target: warm launch median <= 0.3 s: {'met' if ours_median <= 0.3 else 'NOT met'}")


if __name__ == "__main__":
    main()
