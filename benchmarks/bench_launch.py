"""How long does it take to start 4 ranks, all-reduce once and tear down?

Compares utils.launch (forkserver with torch preloaded) with torch.multiprocessing.spawn doing the
same work, the baseline, both measured in this run. The two run in rounds, one of each per round, in an
order rotated from round to round (utils.timing.rotated_rounds), after a warm-up round that is not kept
(it also starts utils.launch's forkserver). It prints each one's median time with its spread (quartiles,
min–max), the ratio spawn / launch within each round, and utils.timing.compare's verdict, which calls a
difference whose interquartile ranges overlap "no measurable difference here". Takes about half a
minute on 2 cores (more on a busy machine), nearly all of it in spawn; 5 rounds, since quartiles need 4.

Then the first launch of a session, each in a fresh interpreter, made 5 s after `import utils` (a
lesson's first launch comes a few cells after its setup cell): with the forkserver warm-up that
`import utils` starts in a notebook (utils/warmup.py), and without it. Alternated, 3 of each (about
another minute).

    .venv/bin/python benchmarks/bench_launch.py [--world-size 4] [--rounds 5] [--first-rounds 3]
"""
import argparse
import os
import socket
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import utils
from utils.timing import Spread, compare, rotated_rounds

TARGET_SECONDS = 0.3  # the launcher's target for a warm launch of 4 ranks on 2 cores


def one_all_reduce():
    t = torch.ones(1024, device=utils.device())
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


FIRST_LAUNCH = """
import sys, time
import torch, torch.distributed as dist
import utils
if sys.argv[1] == "warm":
    utils.warmup.start()                   # what `import utils` does by itself in a notebook kernel
time.sleep(5)
def one_all_reduce():
    t = torch.ones(1024, device=utils.device())
    dist.all_reduce(t)
start = time.perf_counter()
utils.launch(one_all_reduce, world_size=int(sys.argv[2]))
print(time.perf_counter() - start)
"""


def first_launch(warm: bool, world_size: int) -> float:
    """Seconds of the first launch in a fresh interpreter, made 5 s after `import utils`."""
    out = subprocess.run([sys.executable, "-c", FIRST_LAUNCH, "warm" if warm else "cold", str(world_size)],
                         capture_output=True, text=True, check=True, cwd=os.path.dirname(os.path.dirname(
                             os.path.abspath(__file__))))
    return float(out.stdout.split()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--first-rounds", type=int, default=3)
    args = parser.parse_args()
    n = args.world_size
    runs = {
        "utils.launch": lambda: utils.launch(one_all_reduce, world_size=n),
        "torch.multiprocessing.spawn": lambda: mp.spawn(spawned_rank, args=(n, free_port()), nprocs=n, join=True),
    }
    times = {name: [] for name in runs}
    for rep, name in rotated_rounds(list(runs), args.rounds):
        start = time.perf_counter()
        runs[name]()
        if rep >= 0:                       # rep < 0: the warm-up round (it starts the forkserver)
            times[name].append(time.perf_counter() - start)

    ours, spawn = times["utils.launch"], times["torch.multiprocessing.spawn"]
    print(f"{n} ranks: start, init_process_group, one all_reduce, tear down ({os.cpu_count()} cores), "
          f"{args.rounds} rounds in rotated order")
    for name, t in times.items():
        print(f"{name:<29} {Spread.of(t).format(scale=1, unit='s')}")
    ratio = Spread.of([b / a for a, b in zip(ours, spawn)])   # one ratio per round
    print(f"spawn / launch within a round:  {ratio.median:.1f}x "
          f"(IQR {ratio.q1:.1f}–{ratio.q3:.1f}, min–max {ratio.low:.1f}–{ratio.high:.1f})")
    print(f"verdict: {compare(spawn, ours, 'torch.multiprocessing.spawn', 'utils.launch', scale=1, unit='s')}")
    s = Spread.of(ours)
    if s.q3 <= TARGET_SECONDS:
        target = "met (the whole interquartile range is below it)"
    elif s.q1 > TARGET_SECONDS:
        target = "NOT met (the whole interquartile range is above it)"
    else:
        target = "undecided: the target lies inside the interquartile range"
    print(f"target: warm launch <= {TARGET_SECONDS} s: {target}")

    firsts = {"warm-up at import": [], "no warm-up": []}
    for _, name in rotated_rounds(list(firsts), args.first_rounds, warmup=0):
        firsts[name].append(first_launch(name == "warm-up at import", n))
    print(f"first launch of a session, 5 s after import utils, fresh interpreters, {args.first_rounds} of each:")
    for name, t in firsts.items():
        print(f"{name:<29} {Spread.of(t).format(scale=1, unit='s')}")
    print(f"verdict: {compare(firsts['no warm-up'], firsts['warm-up at import'], 'no warm-up', 'warm-up at import', scale=1, unit='s')}")


if __name__ == "__main__":
    main()
