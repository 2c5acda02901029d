"""Measurements on a real shaped link (utils.tools.cluster): ranks placed on namespace "nodes", all-reduce times
fitted to the α–β model, and the cross-node bytes of a flat ring against a hierarchical all-reduce.

    with Cluster(nodes=2, rate="200mbit") as cluster:
        results = run_ranks(cluster, [0, 0, 1, 1], "utils.tools.linkbench:allreduce_times",
                            sizes=[2**18, 2**20], repeats=5)          # ranks 0, 1 on node 0; ranks 2, 3 on node 1
        alpha, bandwidth = fit_alpha_beta(sizes, medians, n=4)

`run_ranks` starts one process per rank in its node's namespace (gloo over the node's eth0; ranks of one node reach
each other through its loopback, unshaped), calls FUNCTION(**kwargs) there with the default group initialised,
and returns the ranks' JSON results in rank order. FUNCTION is `module:name` or `path/to/file.py:name`.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["run_ranks", "allreduce_times", "hierarchical_vs_flat", "fit_alpha_beta", "node_tx_bytes"]

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- host side
def run_ranks(cluster, placement: list[int], function: str, timeout: float = 300, port: int = 29600,
              **kwargs) -> list:
    """Run FUNCTION(**kwargs) on len(placement) ranks, rank r in node placement[r]; their results in rank order."""
    world = len(placement)
    with tempfile.TemporaryDirectory(prefix="dpfs-linkbench-") as folder:
        procs = []
        for rank, node in enumerate(placement):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world),
                       LOCAL_RANK=str(placement[:rank].count(node)), MASTER_ADDR=cluster.address(placement[0]),
                       MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1",
                       PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
            err = open(Path(folder) / f"rank{rank}.err", "w")
            procs.append(cluster.popen(node, [sys.executable, "-m", "utils.tools.linkbench", function,
                                              json.dumps(kwargs), folder], env=env, cwd=ROOT,
                                       stdout=subprocess.DEVNULL, stderr=err))
            err.close()
        deadline = time.monotonic() + timeout
        failed = None
        for rank, proc in enumerate(procs):
            try:
                if proc.wait(max(0.1, deadline - time.monotonic())) != 0 and failed is None:
                    failed = rank
            except subprocess.TimeoutExpired:
                failed = rank if failed is None else failed
                break
        if failed is not None:
            errors = "\n".join(f"rank {r}: {(Path(folder) / f'rank{r}.err').read_text()[-1500:]}"
                               for r in range(world))
            raise RuntimeError(f"{function} failed or ran past {timeout} s on rank {failed}\n{errors}")
        return [json.loads((Path(folder) / f"rank{r}.json").read_text()) for r in range(world)]


def fit_alpha_beta(sizes: list[float], seconds: list[float], n: int,
                   nonnegative: bool = False) -> tuple[float, float]:
    """Least-squares line through (size, seconds) read as a ring all-reduce on n ranks,
    t = 2(n−1)·α + 2(n−1)/n · size / bandwidth; returns (α in seconds, bandwidth in bytes per second).

    The free line's intercept can come out negative (a shaped link's token bucket lets the smallest message through
    faster than the rate, or noise outweighs a latency far below the transfer times); it is returned as it is, for a
    caller that reads its sign (lesson 03). With nonnegative=True the fit is constrained to α ≥ 0 (what a simulated
    link accepts): then a negative intercept gives the line through the origin, the best fit with α ≥ 0, and α = 0."""
    if len(sizes) != len(seconds) or len(set(sizes)) < 2:
        raise ValueError(f"fit_alpha_beta needs at least two distinct sizes, one time per size; got sizes={sizes}, "
                         f"seconds={seconds}")
    if n < 2:
        raise ValueError(f"fit_alpha_beta reads the times as a ring all-reduce on n >= 2 ranks; got n={n}")
    mean_x, mean_y = statistics.fmean(sizes), statistics.fmean(seconds)
    slope = (sum((x - mean_x) * (y - mean_y) for x, y in zip(sizes, seconds))
             / sum((x - mean_x) ** 2 for x in sizes))
    intercept = mean_y - slope * mean_x
    if nonnegative and intercept < 0:
        slope, intercept = sum(x * y for x, y in zip(sizes, seconds)) / sum(x * x for x in sizes), 0.0
    if slope <= 0:
        raise ValueError(f"fit_alpha_beta: the times do not grow with the size (slope {slope:.3g} s/byte), so they "
                         f"give no bandwidth; measure larger sizes or more repeats. sizes={sizes}, seconds={seconds}")
    return intercept / (2 * (n - 1)), 2 * (n - 1) / n / slope


# ---------------------------------------------------------------- rank side (run through run_ranks)
def node_tx_bytes() -> int:
    """Bytes this rank's node has sent on its link (eth0) so far; the namespace's own /sys."""
    return int(Path("/sys/class/net/eth0/statistics/tx_bytes").read_text())


def _timed(fn) -> float:
    """Seconds fn() takes on the slowest rank, started together after a barrier."""
    import torch
    import torch.distributed as dist
    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def allreduce_times(sizes: list[int], repeats: int = 5) -> dict:
    """Seconds of a float32 all-reduce of each size in bytes (slowest rank): {size: [repeats, ...]}; the sizes
    interleaved, in an order rotated every round, after one warm-up round."""
    import torch
    import torch.distributed as dist
    from utils.timing import rotated_rounds
    tensors = {size: torch.ones(size // 4) for size in sizes}
    times = {size: [] for size in sizes}
    for rep, size in rotated_rounds(sizes, repeats):
        seconds = _timed(lambda: dist.all_reduce(tensors[size]))
        if rep >= 0:
            times[size].append(seconds)
    return {str(size): values for size, values in times.items()}


def hierarchical_vs_flat(nbytes: int, repeats: int = 5, per_node: int = 2) -> dict:
    """A flat ring all-reduce against a hierarchical one (reduce-scatter inside the node, all-reduce of each shard
    across nodes, all-gather inside the node), interleaved: seconds (slowest rank) and bytes the node sent on its
    link per all-reduce (counted on each node's first rank; None elsewhere); and whether both give the same sum."""
    import torch
    import torch.distributed as dist
    from utils import compat
    from utils.timing import rotated_rounds
    rank, world = dist.get_rank(), dist.get_world_size()
    node, local = divmod(rank, per_node)
    intra = [dist.new_group([n * per_node + i for i in range(per_node)]) for n in range(world // per_node)]
    inter = [dist.new_group([n * per_node + i for n in range(world // per_node)]) for i in range(per_node)]
    mine_intra, mine_inter = intra[node], inter[local]
    data = torch.arange(nbytes // 4, dtype=torch.float32) % 97 * (rank + 1)

    def flat():
        out = data.clone()
        dist.all_reduce(out)
        return out

    def hierarchical():
        shard = torch.empty(data.numel() // per_node)
        compat.reduce_scatter_single(shard, data.clone(), group=mine_intra)
        dist.all_reduce(shard, group=mine_inter)
        out = torch.empty_like(data)
        compat.all_gather_single(out, shard, group=mine_intra)
        return out

    variants = {"flat": flat, "hierarchical": hierarchical}
    seconds, sent = {name: [] for name in variants}, {name: [] for name in variants}
    for rep, name in rotated_rounds(list(variants), repeats):
        dist.barrier()
        before = node_tx_bytes()
        seconds_one = _timed(variants[name])
        dist.barrier()
        after = node_tx_bytes()
        if rep >= 0:
            seconds[name].append(seconds_one)
            sent[name].append(after - before if local == 0 else None)
    same = torch.equal(flat(), hierarchical())
    return {"seconds": seconds, "node_tx_bytes": sent, "same_result": same}


def _load(function: str):
    where, name = function.rsplit(":", 1)
    if where.endswith(".py"):
        spec = importlib.util.spec_from_file_location(Path(where).stem, where)
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(Path(where).resolve().parent))
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    return getattr(module, name)


def _rank_main(function: str, kwargs: str, folder: str) -> None:
    import torch
    import torch.distributed as dist
    from utils import compat
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    result = _load(function)(**json.loads(kwargs))
    (Path(folder) / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    compat.end_group_before_exit()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    _rank_main(*sys.argv[1:])
