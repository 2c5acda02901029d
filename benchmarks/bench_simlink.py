"""Benchmark: what utils.simlink's simulated link itself costs, against the α it models.

For each operation, the figure is how late its handle completes beyond the modelled end (α per message, 2(N−1)
messages per all-reduce), as a ratio to α, at α = 1 ms per message and a bandwidth at which 256 bytes cost
nothing. Cases, run in rounds with their order rotated from round to round (utils.timing.rotated_rounds),
after a warm-up round that is not kept:
  - idle, issue→wait: a 256-byte all-reduce issued asynchronously and waited at once;
  - idle, queued ×4: four issued back to back, then waited in order (each handle is a sample);
  - compute, issue→wait / queued ×4: the same with the rank doing matmuls between issue and wait, for
    half the first operation's modelled time (the link, gloo's real all-reduce and the compute share the cores);
  - DDP hook: torch's DDP with `allreduce_hook` and 4 buckets of 256 KiB, the link the bottleneck (DDP waits
    the hook's futures from C++: this is lesson 04's case). Two rows: the last bucket's future beyond its
    modelled end, and backward() returning beyond it (that adds DDP's own work after the wait).
Samples are every rank's handles. Prints median and 90th percentile per case, in ms and in α, and how often
the real all-reduce itself finished after the modelled end (then the handle must be late: results are exact),
beside the raw gloo 256-byte all-reduce time (dist.all_reduce, blocking; median over rounds and ranks) as the
baseline, and the load average (other processes on the cores show in the tail).
The bar: at most 0.25 α, median and p90, at N = 2 (the lessons' N), idle and under compute. N = 4 is
reported too: on 2 cores 4 ranks oversubscribe them, and the real all-reduce alone takes milliseconds there,
so it cannot meet that bar while the real collective runs. About a minute on 2 cores.

    .venv/bin/python benchmarks/bench_simlink.py [--rounds 40] [--world-sizes 2 4] [--alpha-ms 1]
"""
import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import utils
from utils.simlink import SimulatedLink, allreduce_hook
from utils.timing import rotated_rounds

CASES = ("idle, issue→wait", "idle, queued ×4", "compute, issue→wait", "compute, queued ×4", "DDP hook")
ROWS = CASES[:-1] + ("DDP: last bucket", "DDP: backward()")
BANDWIDTH = 1e12                   # bytes/s: 256 bytes cost 0.26 ns, so the model is 2(N−1)·α


def busy(until):
    # compute until `until` (perf_counter): small matmuls, so the core really works
    a = torch.randn(64, 64)
    while time.perf_counter() < until:
        a = torch.tanh(a @ a)


class LoggingLink(SimulatedLink):
    # the link, keeping the handles of its all-reduces (DDP's hook goes through all_reduce)
    def __init__(self, *args):
        super().__init__(*args)
        self.log = []

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, async_op=False):
        work = super().all_reduce(tensor, op, async_op=True)
        self.log.append(work)
        if async_op:
            return work
        work.wait()


def one_round(case, link, probe, ddp, x):
    dist.barrier()
    world = dist.get_world_size()
    if case == "DDP hook":
        link.log.clear()
        ddp(x).sum().backward()
        returned = time.perf_counter()
        last = max(link.log, key=lambda w: w.end)
        real_late = last._real_done > last.end
        return {"DDP: last bucket": [(last.done - last.end, real_late)],
                "DDP: backward()": [(returned - last.end, real_late)], "buckets": [len(link.log)]}
    count = 4 if "queued" in case else 1
    works = [link.all_reduce(probe, async_op=True) for _ in range(count)]
    if case.startswith("compute"):                           # until half the first one's modelled time
        busy(works[0].issued + 0.5 * 2 * (world - 1) * link.alpha)
    late = []
    for w in works:
        w.wait()
        late.append((w.done - w.end, w._real_done > w.end))
    return {case: late}


def ranks(rounds, alpha):
    torch.manual_seed(0)
    probe = torch.zeros(64)                                  # 256 bytes
    raw = []
    for _ in range(rounds):
        dist.barrier()
        begin = time.perf_counter()
        dist.all_reduce(probe)
        raw.append(time.perf_counter() - begin)
    link = LoggingLink(alpha, BANDWIDTH)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    ddp = utils.compat.ddp(model, bucket_cap_mb=0.25, forward_sync_buffers=False)
    ddp.register_comm_hook(link, allreduce_hook)
    x = torch.randn(8, 256)
    late = {row: [] for row in (*ROWS, "buckets")}
    for rep, case in rotated_rounds(CASES, rounds, warmup=2):   # DDP rebuilds its buckets after step 1
        for row, samples in one_round(case, link, probe, ddp, x).items():
            if rep >= 0:
                late[row] += samples
    link.close()
    return {"raw": raw, "late": late}


def quantile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--alpha-ms", type=float, default=1.0)
    args = parser.parse_args()
    alpha = args.alpha_ms * 1e-3
    print(f"simulated link at α = {args.alpha_ms:g} ms per message; lateness = handle complete − modelled end; "
          f"{args.rounds} rounds, samples pooled over ranks; load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores")
    for n in args.world_sizes:
        results = utils.launch(ranks, args.rounds, alpha, world_size=n, timeout=600, backend="gloo")  # gloo's, measured
        raw = statistics.median(t for r in results for t in r["raw"])
        buckets = sorted(set(results[0]["late"]["buckets"]))
        print(f"\nN = {n}: raw gloo 256-byte all-reduce {raw * 1e3:.3f} ms (median); modelled all-reduce "
              f"{2 * (n - 1) * args.alpha_ms:g} ms; DDP: {buckets} buckets per step")
        print(f"  {'case':22s} {'median':>16s} {'p90':>16s}   real all-reduce done after the modelled end")
        worst = 0.0
        for case in ROWS:
            pairs = [t for r in results for t in r["late"][case]]
            xs, real_late = [t for t, _ in pairs], sum(late for _, late in pairs) / len(pairs)
            med, p90 = statistics.median(xs), quantile(xs, 0.9)
            worst = max(worst, med / alpha, p90 / alpha)
            print(f"  {case:22s} {med * 1e3:7.3f} ms {med / alpha:5.2f} α {p90 * 1e3:7.3f} ms {p90 / alpha:5.2f} α"
                  f"   {real_late:4.0%} of handles")
        verdict = "meets" if worst <= 0.25 else "misses"
        print(f"  worst of median/p90: {worst:.2f} α: {verdict} the bar of 0.25 α"
              + ("" if n <= 2 else f" (not expected at N = {n} on 2 cores: the real all-reduce alone takes "
                                    f"{raw / alpha:.1f} α)"))


if __name__ == "__main__":
    main()
