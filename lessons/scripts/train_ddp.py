"""The standard DDP recipe, written once: DistributedDataParallel + DistributedSampler
(set_epoch every epoch) + gradient clipping + AdamW, on the course's synthetic data.

Run it on 4 local ranks from Python (lesson 02 does this through utils.launch):

    python lessons/scripts/train_ddp.py --nproc 4 --steps 200

or, unchanged, under torchrun (one process per rank; add --nnodes/--rdzv-endpoint for several machines):

    torchrun --standalone --nproc_per_node 4 lessons/scripts/train_ddp.py --steps 200

Each rank ends by printing one line; the last line (rank 0) says whether every replica holds the
same parameters.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

_CHECKOUT = Path(__file__).resolve().parents[2]
if (_CHECKOUT / "utils" / "__init__.py").is_file():  # in a checkout of the course: its own utils, installed or not
    sys.path.insert(0, str(_CHECKOUT))
import utils
from utils.core_bound import machine_busy_seconds
from utils.data import MarkovSource
from utils.model import GPT, GPTConfig
from utils.timing import throughput


def parameter_checksum(model: torch.nn.Module) -> tuple[float, str]:
    """(sum of all parameters in float64, sha256 of their bytes): equal digests = bitwise-equal replicas."""
    digest = hashlib.sha256()
    total = 0.0
    for p in model.parameters():
        data = p.detach().cpu().contiguous()
        digest.update(data.numpy().tobytes())
        total += data.double().sum().item()
    return total, digest.hexdigest()[:16]




def cpu_quota_cores(root: str = "/") -> float | None:
    """The cores a cgroup CPU quota lets this process's cgroup use (Docker's --cpus, a Kubernetes CPU limit): quota
    over period, the smallest set on its cgroup or an ancestor (cgroup v2: cpu.max; v1: cpu.cfs_quota_us and
    cpu.cfs_period_us), as listed in /proc/self/cgroup; None where no quota is set or Linux's files are missing.
    `root` stands for / (the tests pass a fake tree). The affinity set does not show such a quota."""
    base = Path(root)
    try:
        entries = (base / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    quotas = []
    for entry in entries:
        _, controllers, path = entry.split(":", 2)
        if controllers and "cpu" not in controllers.split(","):
            continue
        mount = base / "sys/fs/cgroup" / controllers        # v2 (no controllers listed): /sys/fs/cgroup itself
        parts = Path(path.lstrip("/")).parts
        for depth in range(len(parts), -1, -1):             # the cgroup, then its ancestors up to the mount's root
            folder = mount.joinpath(*parts[:depth])
            try:
                if controllers:
                    quota = int((folder / "cpu.cfs_quota_us").read_text())
                    period = int((folder / "cpu.cfs_period_us").read_text())
                else:
                    quota, period = (folder / "cpu.max").read_text().split()
                    quota, period = (-1 if quota == "max" else int(quota)), int(period)
            except (OSError, ValueError):
                continue
            if quota > 0 and period > 0:
                quotas.append(quota / period)
    return min(quotas, default=None)


def timed_allreduce_hook(seconds: list, bucket):  # no return annotation: DDP checks it, and this module postpones annotations
    """DDP comm hook: average one gradient bucket with a blocking all-reduce, adding its duration to seconds[-1].

    The duration includes any wait for the slowest rank to reach the all-reduce. Written for gloo on CPUs (where
    the lesson runs it). Not run on a GPU: there the synchronize below would also wait for backward kernels still
    queued when the hook fires (so the time includes compute), and with several buckets the blocking hook would
    serialise them, removing the overlap with backward that DDP's own hook allows."""
    buffer = bucket.buffer()
    start = time.perf_counter()
    dist.all_reduce(buffer)
    if buffer.is_cuda:
        torch.cuda.synchronize(buffer.device)  # NCCL returns before the GPU is done
    seconds[-1] += time.perf_counter() - start
    future = torch.futures.Future()
    future.set_result(buffer.div_(dist.get_world_size()))
    return future


def train(steps: int = 200, batch_size: int = 8, seq_len: int = 32, lr: float = 6e-3,
          num_sequences: int = 4096, clip: float = 1.0, weight_decay: float = 0.0, seed: int = 0,
          n_layer: int = 2, n_embd: int = 64, n_head: int = 4, warmup_steps: int = 5,
          log_every: int = 0, time_allreduce: bool = False) -> dict:
    """Train the small GPT with DDP on this rank; every rank of the default group must call it.

    batch_size is per rank (the micro batch): the effective batch is batch_size x world_size.
    Returns this rank's summary: final loss (averaged over ranks and the last 20 steps),
    parameter checksum, tokens/s of the whole job, epochs started. Throughput is measured as in lesson 01:
    after `warmup_steps` steps, the job's tokens per step over the median step time (with its spread).
    time_allreduce=True averages the gradients through a timed comm hook (the same all-reduce, blocking)
    and adds this rank's medians, in ms over the timed steps: the whole step, the all-reduce, the rest;
    and, over all timed steps together, in seconds: the wall time, the time in the all-reduce, this process's
    CPU time (all its threads, gloo's included) and the CPU time all processes of the machine spent busy on
    the CPUs this rank may run on (None off Linux)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = utils.device()

    source = MarkovSource(seed=seed)
    dataset = source.dataset(num_sequences, seq_len)
    # Every rank gets a disjoint 1/world_size of the dataset; same length on every rank.
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)

    torch.manual_seed(seed)  # same init everywhere; DDP also broadcasts rank 0's weights when built
    config = GPTConfig(vocab_size=source.vocab_size, block_size=seq_len, n_layer=n_layer,
                       n_head=n_head, n_embd=n_embd)
    model = GPT(config).to(device)
    # The model's only buffers are its causal masks, constants equal on every rank: DDP need not broadcast them
    # before every forward (its default), so the gradient all-reduce is the step's one collective
    ddp_model = utils.compat.ddp(model, forward_sync_buffers=False,
                                 device_ids=[device.index] if device.type == "cuda" else None)
    # From here on each rank draws its own random numbers (lesson 02, 2d): with dropout > 0 the ranks' masks must
    # be independent, as a single process's would be. Reseeded only after the model is built, so the initial
    # weights stay the same on every rank. (This model's dropout is 0: below, only each `for ... in loader` draws
    # from it, a base seed for DataLoader workers, unused with 0 workers; the sampler shuffles with its own seed.)
    torch.manual_seed(seed + 1 + rank)
    allreduce_seconds = []  # per step: seconds spent in the gradient all-reduce (time_allreduce only)
    if time_allreduce:
        ddp_model.register_comm_hook(allreduce_seconds, timed_allreduce_hook)
    optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=lr, betas=(0.9, 0.95),
                                  weight_decay=weight_decay)

    losses, step_seconds, step, epoch = [], [], 0, 0
    last = time.perf_counter()
    # (wall, process CPU, machine busy) when the timed steps begin (time_allreduce only)
    window = (last, time.process_time(), machine_busy_seconds()) if time_allreduce and warmup_steps == 0 else None
    window_end = None  # (process CPU, machine busy) when the last step ends (time_allreduce only)
    while step < steps:
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same one on every rank
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            allreduce_seconds.append(0.0)  # the hook adds this step's all-reduce time
            optimizer.zero_grad(set_to_none=True)
            loss = ddp_model(x, y)
            loss.backward()  # DDP all-reduces (averages) the gradients during backward
            torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), clip)  # same norm on every rank
            optimizer.step()
            losses.append(loss.detach())
            if device.type == "cuda":
                torch.cuda.synchronize()  # a step's time ends when its GPU work does
            now = time.perf_counter()
            step_seconds.append(now - last)  # loading the batch included
            last = now
            step += 1
            if time_allreduce and step == warmup_steps:
                window = (now, time.process_time(), machine_busy_seconds())
            if time_allreduce and step == steps:  # the timed steps end here: read the CPU clocks with the wall one
                window_end = (time.process_time(), machine_busy_seconds())
            if log_every and rank == 0 and step % log_every == 0:
                print(f"step {step:4d}  loss {loss.item():.4f}")
            if step == steps:
                break
        epoch += 1

    final = torch.stack(losses[-20:]).mean()
    dist.all_reduce(final)  # the loss of the whole job, not of this rank's shard
    final = final.item() / world_size
    checksum, digest = parameter_checksum(model)
    tokens_per_step = batch_size * seq_len * world_size  # the whole job's
    rate = throughput(step_seconds, tokens_per_step, warmup_steps) if steps > warmup_steps else None
    timings = {}
    if time_allreduce and steps > warmup_steps:
        cpu_end, busy_end = window_end  # read at the last step's end, as `last` is: not after the final
        # all-reduce and the checksum below, which would stretch the CPU windows past the wall window
        timed = list(zip(step_seconds, allreduce_seconds))[warmup_steps:]
        median_ms = lambda values: 1e3 * statistics.median(values)
        timings = {"step_ms": median_ms([s for s, _ in timed]), "allreduce_ms": median_ms([a for _, a in timed]),
                   "outside_allreduce_ms": median_ms([s - a for s, a in timed]),
                   "timed_wall_s": last - window[0], "timed_allreduce_s": sum(a for _, a in timed),
                   "timed_cpu_s": cpu_end - window[1],
                   "machine_busy_s": None if busy_end is None else busy_end - window[2]}
    return {**timings,
        "rank": rank,
        "world_size": world_size,
        "final_loss": final,
        "loss_floor": source.loss_floor(seq_len),
        "checksum": checksum,
        "digest": digest,
        "tokens_per_s": rate.median if rate else float("nan"),
        "tokens_per_s_spread": tuple(rate) if rate else None,  # utils.timing.Spread fields
        "epochs": epoch,
        "steps": step,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4, help="ranks to start when not under torchrun")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--lr", type=float, default=6e-3)
    parser.add_argument("--log-every", type=int, default=50)
    args = parser.parse_args(argv)
    # Under torchrun launch() runs train() right here for this process's rank and gathers all
    # ranks' results; otherwise it starts --nproc ranks on this machine.
    results = utils.launch(train, world_size=args.nproc, timeout=3600, steps=args.steps,
                           batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                           log_every=args.log_every)
    if int(os.environ.get("RANK", 0)) != 0:
        return  # under torchrun every process has every result: let rank 0 report
    for r in results:
        print(f"rank {r['rank']}: final loss {r['final_loss']:.4f}  checksum {r['checksum']:.10f}  "
              f"digest {r['digest']}")
    first = results[0]
    same = all(r["digest"] == first["digest"] for r in results)
    print(f"world size {first['world_size']}: loss floor {first['loss_floor']:.4f}, "
          f"{first['tokens_per_s']:.0f} tokens/s, epochs {first['epochs']}, "
          f"replicas identical: {same}")


if __name__ == "__main__":
    main()
