"""How long does a trivial cell take on a warm pool of ranks, next to a one-shot %%distributed?

Both run in this process's IPython shell, in rounds, one of each per round, in an order rotated from
round to round (utils.timing.rotated_rounds), after a warm-up round that is not kept: `%%distributed`
on a running pool (`%dist start -n 4`, ranks alive across cells) and the same cell after `%dist stop`
would run it on fresh ranks (one-shot: start, init_process_group, run, tear down). The pool is stopped
and restarted around every one-shot cell, outside the timed region. The cell: `dist.get_rank()`, and
one with an all_reduce. Prints medians with their spread (quartiles, min–max), the one-shot / pool
ratio within each round, utils.timing.compare's verdict, and whether the pool's trivial cell meets
its goal of ≤ 20 ms. About a minute on 2 cores.

    .venv/bin/python benchmarks/bench_pool.py [--world-size 4] [--rounds 7]
"""
import argparse
import os
import time

from IPython.core.interactiveshell import InteractiveShell

from utils import pool
from utils.timing import Spread, compare, rotated_rounds

GOAL_SECONDS = 0.020   # a trivial cell on a warm pool of 4 ranks
CELLS = {"trivial": "dist.get_rank()",
         "all_reduce": "t = torch.ones(1024)\ndist.all_reduce(t)\nt[0].item()"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    n = args.world_size
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "utils")
    shell.run_cell("import torch, torch.distributed as dist")
    variants = [f"{how}: {cell}" for cell in CELLS for how in ("pool", "one-shot")]
    times = {v: [] for v in variants}
    shell.run_line_magic("dist", f"start -n {n}")
    for rep, variant in rotated_rounds(variants, args.rounds):
        how, cell = variant.split(": ")
        if how == "one-shot":
            pool.current().stop()
        start = time.perf_counter()
        shell.run_cell_magic("distributed", f"-n {n}", CELLS[cell])
        elapsed = time.perf_counter() - start
        if how == "one-shot":
            pool.Pool(n)
        if rep >= 0:
            times[variant].append(elapsed)
    pool.current().stop()

    print(f"{n} ranks, {os.cpu_count()} cores, {args.rounds} rounds in rotated order; one cell via %%distributed")
    for variant, samples in times.items():
        print(f"{variant:<22} {Spread.of(samples).format()}")
    for cell in CELLS:
        ours, one_shot = times[f"pool: {cell}"], times[f"one-shot: {cell}"]
        ratio = Spread.of([b / a for a, b in zip(ours, one_shot)])
        print(f"{cell}: one-shot / pool within a round {ratio.median:.0f}x "
              f"(IQR {ratio.q1:.0f}–{ratio.q3:.0f}, min–max {ratio.low:.0f}–{ratio.high:.0f})")
        print(f"  verdict: {compare(one_shot, ours, 'one-shot', 'pool')}")
    s = Spread.of(times["pool: trivial"])
    verdict = ("met (the whole interquartile range is below it)" if s.q3 <= GOAL_SECONDS else
               "NOT met (the whole interquartile range is above it)" if s.q1 > GOAL_SECONDS else
               "undecided: the goal lies inside the interquartile range")
    print(f"goal: trivial cell on a warm pool <= {GOAL_SECONDS * 1e3:g} ms: {verdict}")


if __name__ == "__main__":
    main()
