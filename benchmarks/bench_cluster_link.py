"""Benchmark: the course's cost models against a real shaped link between two namespace "nodes" (utils.tools.cluster).

Needs Linux and root (network namespaces, tc); elsewhere it prints one line saying so and exits 0. Three parts, on
2 nodes joined by a veth pair shaped with tbf to --rate in each direction (no added delay: this kernel has no netem):

1. All-reduce over sizes, N = 2 (1 rank per node) and N = 4 (2 per node; the ring 0→1→2→3→0 crosses the link
   once each way), sizes interleaved: the median time, the bus bandwidth 2(N−1)/N·M/t as a ratio of the shaped rate,
   and the α–β fit t = 2(N−1)α + 2(N−1)/N·M/B.
2. Lesson 04's bucketed DDP (version (d), bench_ddp.py's copy) and torch's DDP, 2 nodes × 2 ranks, against
   a compute-only step (no gradient sync) in the same run, interleaved; then the same three on 4 ranks of one node
   whose all-reduces go through utils.simlink at the fitted α and the shaped rate. Printed: real / simulator per
   wrapper, and the real step against utils.step_model's band (overlap 2/3 … 0) for the same α and bandwidth.
   The check, its tolerance fixed before the first run: real / simulator within 1 ± 0.30 for both wrappers. Also
   printed: what the link adds to a step (step − compute-only step of the same run), real against simulated.
3. A flat ring all-reduce against a hierarchical one (reduce-scatter in the node, all-reduce of each half across,
   all-gather in the node), 2 × 2 ranks: bytes each node sent on its link (the kernel's counter: payload and
   TCP/IP headers) as a multiple of M, and time. The ring model says 1.5 M against 1.0 M per node.

    .venv/bin/python benchmarks/bench_cluster_link.py [--rate 200mbit] [--repeats 7] [--rounds 5] [--steps 4]

About 2–3 minutes on 2 cores.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from utils import simlink, step_model                                              # noqa: E402
from utils.timing import Spread, rotated_rounds                                     # noqa: E402
from utils.tools.cluster import Cluster, unavailable                                # noqa: E402
from utils.tools.linkbench import fit_alpha_beta, run_ranks                         # noqa: E402

HERE = Path(__file__).resolve()
KiB, MiB = 2**10, 2**20
TOLERANCE = 0.30   # real / simulator step time within 1 ± TOLERANCE (fixed before the first run)


# ------------------------------------------------------------------ rank side of part 2
def ddp_steps(steps: int, rounds: int, bucket_mb: float, simulate=None) -> dict:
    """Per-step seconds (slowest rank) of a compute-only step, lesson (d) and torch DDP, interleaved; with
    simulate=(alpha, bandwidth) their all-reduces go through a SimulatedLink."""
    from bench_ddp import PER_RANK, SEED, SEQ_LEN, Bucketed, TorchDDP, config, source
    from utils.model import GPT
    rank, world = dist.get_rank(), dist.get_world_size()
    link = simlink.SimulatedLink(*simulate) if simulate else None

    class LinkBucketed(Bucketed):
        def _launch(self):
            flat = torch.cat([g.flatten() for g in self.filling]).div_(self.world)
            self.in_flight.append((link.all_reduce(flat, async_op=True), flat, self.filling))
            self.filling, self.filled_bytes = [], 0

    class ComputeOnly:
        def __init__(self, module, bucket_mb):
            self.module = module

        def __call__(self, *args, **kwargs):
            return self.module(*args, **kwargs)

        def finish_gradient_synchronization(self):
            pass

    def torch_ddp(module, bucket_mb):
        wrapper = TorchDDP(module, bucket_mb)
        if link:
            wrapper.ddp.register_comm_hook(link, simlink.allreduce_hook)
        return wrapper

    makers = {"compute only": ComputeOnly, "lesson (d)": LinkBucketed if link else Bucketed, "torch DDP": torch_ddp}
    wrappers = {}
    for name, make in makers.items():
        torch.manual_seed(SEED)
        model = GPT(config)
        wrappers[name] = (make(model, bucket_mb), torch.optim.AdamW(model.parameters(), lr=1e-3))
    batches = [source.batch(s, PER_RANK, SEQ_LEN, rank=rank, world_size=world) for s in range(steps)]
    grad_bytes = sum(p.numel() * p.element_size() for p in wrappers["compute only"][0].module.parameters())

    def run(name):
        wrapper, optimizer = wrappers[name]
        dist.barrier()
        start = time.perf_counter()
        for x, y in batches:
            wrapper(x, y).backward()
            wrapper.finish_gradient_synchronization()
            optimizer.step()
            optimizer.zero_grad()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return elapsed.item() / steps

    for name in wrappers:        # torch DDP rebuilds its buckets after its first step
        run(name)
    samples = {name: [] for name in wrappers}
    for rep, name in rotated_rounds(list(wrappers), rounds):
        seconds = run(name)
        if rep >= 0:
            samples[name].append(seconds)
    if link:
        link.close()
    return {"samples": samples, "grad_bytes": grad_bytes}


# ------------------------------------------------------------------ host side
def mb(x):
    return f"{x / 1e6:.1f} MB/s"


def part_allreduce(cluster, sizes, repeats):
    fits = {}
    for n, placement in ((2, [0, 1]), (4, [0, 0, 1, 1])):
        times = run_ranks(cluster, placement, "utils.tools.linkbench:allreduce_times", sizes=sizes,
                          repeats=repeats)[0]
        medians = [statistics.median(times[str(s)]) for s in sizes]
        alpha, bandwidth = fit_alpha_beta(sizes, medians, n, nonnegative=True)  # the simulator's α
        fits[n] = (alpha, bandwidth)
        print(f"\nall-reduce, N = {n} ({n // 2} rank(s) per node), {repeats} interleaved repeats per size:")
        print(f"  {'size':>9s}  {'median (min–max) ms':>22s}  {'bus bandwidth':>13s}  {'/ shaped':>8s}  "
              f"{'α–β fit':>8s}")
        for size, median in zip(sizes, medians):
            spread = Spread.of(times[str(size)])
            bus = 2 * (n - 1) / n * size / median
            fitted = step_model.ring_all_reduce_seconds(size, n, alpha, bandwidth)
            print(f"  {size // KiB:>5d} KiB  {median * 1e3:8.1f} ({spread.low * 1e3:.1f}–{spread.high * 1e3:.1f})"
                  f"  {mb(bus):>13s}  {bus / cluster.rate_bytes:8.2f}  {fitted * 1e3:6.1f} ms")
        bound = " (the free line's intercept was negative: α held at its bound 0)" if alpha == 0 else ""
        print(f"  fit: α = {alpha * 1e3:.3f} ms per message{bound}, bandwidth {mb(bandwidth)} = "
              f"{bandwidth / cluster.rate_bytes:.2f} × the shaped rate {mb(cluster.rate_bytes)}")
    return fits


def part_ddp(cluster, alpha, rounds, steps, bucket_mb):
    kwargs = dict(steps=steps, rounds=rounds, bucket_mb=bucket_mb)
    function = f"{HERE}:ddp_steps"
    real = run_ranks(cluster, [0, 0, 1, 1], function, timeout=600, **kwargs)[0]
    sim = run_ranks(cluster, [0, 0, 0, 0], function, timeout=600, simulate=(alpha, cluster.rate_bytes),
                    **kwargs)[0]
    grad_bytes = real["grad_bytes"]
    comm = step_model.bucketed_all_reduce_seconds(grad_bytes, bucket_mb * MiB, 4, alpha, cluster.rate_bytes)
    print(f"\nDDP step, 2 nodes × 2 ranks, {grad_bytes / MiB:.2f} MiB of gradients in {bucket_mb:g} MiB buckets, "
          f"{steps} steps per sample, {rounds} interleaved rounds; the simulator: 4 ranks of one node, "
          f"α = {alpha * 1e3:.3f} ms, {mb(cluster.rate_bytes)}; model comm {comm * 1e3:.1f} ms per step")
    print(f"  {'':12s}  {'real link ms':>24s}  {'simulated link ms':>24s}  {'real / sim':>10s}  model band ms")
    verdicts = []
    compute = statistics.median(real["samples"]["compute only"])
    for name in real["samples"]:
        r, s = Spread.of(real["samples"][name]), Spread.of(sim["samples"][name])
        line = (f"  {name:12s}  {r.median * 1e3:8.1f} ({r.low * 1e3:.1f}–{r.high * 1e3:.1f})".ljust(40)
                + f"  {s.median * 1e3:8.1f} ({s.low * 1e3:.1f}–{s.high * 1e3:.1f})".ljust(26)
                + f"  {r.median / s.median:10.2f}")
        if name != "compute only":
            low = step_model.step_seconds(compute, comm, 2 / 3)
            high = step_model.step_seconds(compute, comm, 0.0)
            line += f"  {low * 1e3:.1f} … {high * 1e3:.1f} (real / band: {r.median / low:.2f} … {r.median / high:.2f})"
            verdicts.append((name, r.median / s.median))
        print(line)
    # the compute-only step moves between the two runs (another process's load): compare what the link adds
    sim_compute = statistics.median(sim["samples"]["compute only"])
    for name in list(real["samples"])[1:]:
        added_real = statistics.median(real["samples"][name]) - compute
        added_sim = statistics.median(sim["samples"][name]) - sim_compute
        print(f"  {name}: step − compute-only step: real {added_real * 1e3:.1f} ms, simulated {added_sim * 1e3:.1f} ms "
              f"(ratio {added_real / added_sim:.2f}); model, no overlap: {comm * 1e3:.1f} ms")
    return verdicts


def part_hierarchy(cluster, nbytes, repeats):
    result = run_ranks(cluster, [0, 0, 1, 1], "utils.tools.linkbench:hierarchical_vs_flat", nbytes=nbytes,
                       repeats=repeats)
    print(f"\nflat ring vs hierarchical all-reduce of M = {nbytes // MiB} MiB, 2 nodes × 2 ranks, {repeats} "
          f"interleaved repeats:")
    seconds = result[0]["seconds"]
    per_node = {name: [sum(r["node_tx_bytes"][name][i] for r in result if r["node_tx_bytes"][name][i] is not None)
                       / 2 for i in range(repeats)] for name in seconds}
    model = {"flat": 1.5, "hierarchical": 1.0}
    for name in seconds:
        t, b = Spread.of(seconds[name]), Spread.of(per_node[name])
        print(f"  {name:12s}  bytes sent per node {b.median / nbytes:.3f} M (model {model[name]:.1f} M; "
              f"min–max {b.low / nbytes:.3f}–{b.high / nbytes:.3f})  time {t.median * 1e3:.1f} ms "
              f"({t.low * 1e3:.1f}–{t.high * 1e3:.1f})")
    ratio_bytes = statistics.median(per_node["hierarchical"]) / statistics.median(per_node["flat"])
    ratio_time = statistics.median(seconds["hierarchical"]) / statistics.median(seconds["flat"])
    print(f"  hierarchical / flat: bytes {ratio_bytes:.3f} (model 0.667), time {ratio_time:.2f}; "
          f"same sums: {all(r['same_result'] for r in result)}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="200mbit")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--bucket-mb", type=float, default=0.25)
    args = parser.parse_args()
    why = unavailable()
    if why:
        print(f"bench_cluster_link: skipped ({why})")
        return 0
    started = time.perf_counter()
    sizes = [64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB]
    with Cluster(nodes=2, rate=args.rate) as cluster:
        print(f"2 namespace nodes, one veth pair shaped by tbf to {args.rate} = {mb(cluster.rate_bytes)} each way")
        fits = part_allreduce(cluster, sizes, args.repeats)
        verdicts = part_ddp(cluster, fits[4][0], args.rounds, args.steps, args.bucket_mb)
        part_hierarchy(cluster, 4 * MiB, args.repeats)
    ok = all(abs(ratio - 1) <= TOLERANCE for _, ratio in verdicts)
    for name, ratio in verdicts:
        print(f"{name}: real / simulated step {ratio:.2f} {'within' if abs(ratio - 1) <= TOLERANCE else 'OUTSIDE'} "
              f"1 ± {TOLERANCE:.2f}")
    print(f"(took {time.perf_counter() - started:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
