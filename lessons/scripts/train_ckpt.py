"""Training that survives a dead rank: checkpoint every few steps, resume from the last complete one.

Lesson 08 runs it under torchrun, which restarts every worker when one dies:

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 GLOO_SOCKET_IFNAME=lo \
    torchrun --standalone --nproc-per-node 2 --max-restarts 1 lessons/scripts/train_ckpt.py \
        --folder RUN --steps 12 --every 4 --die-at 7

(The first variable gives each attempt a fresh store: in the store torchrun shares with its workers, restarted
workers can read the dead ones' addresses and fail or hang forming their group, as reported in pytorch/pytorch#135712
(closed; whether a given torch still needs it is not tested here: a precaution). The second
keeps gloo on the loopback interface.) The group is gloo unless --backend says otherwise; with --backend nccl
(one GPU per local rank) the model, batches and gradients live on cuda:LOCAL_RANK, and digests and RNG states are
read back to the CPU.

With --die-at S, rank 1 kills itself with SIGKILL after S steps, the first time only (a marker file in --folder
remembers it died). The other rank's next all-reduce fails (gloo sees the closed connection); it logs that and
waits to be stopped, so the launcher always sees rank 1's death first and stops the others itself, as it stops
ranks stuck in a collective that never notices. Its SIGTERM is logged whenever it comes, also before that
all-reduce has failed. Each rank checkpoints its own state (model, AdamW, step, its
dropout RNG) into RUN/step<S>-rank<R>.pt (written durably: temporary file, fsync, rename, fsync of the folder); RUN/latest names
the last step that every rank finished writing.
Events (process launched, imports done, group formed, model built, resume, death, lost peer, stopped, end; wall-clock times) go to
RUN/events.log, one line each, for the lesson to measure redone steps and restart cost. Rank 0 ends by printing
the sha256 of the final parameters.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import sys
import time
from pathlib import Path

LAUNCHED = time.time()                                       # before `import torch`: part of a restart's cost

import torch
import torch.distributed as dist

try:
    import utils  # noqa: F401  (only to find the course's package)
except ImportError:  # running from a checkout that was not pip-installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from utils import compat
from utils.devices import backend_for, device
from utils.rank_process import _device_options
from utils.data import MarkovSource
from utils.model import GPT, GPTConfig
import torch._dynamo  # noqa: E402,F401  what the first torch.optim constructor would import (seconds): counted here

IMPORTED = time.time()                                       # torch, torch._dynamo and the course's modules loaded


def log(folder: Path, text: str) -> None:
    """Append one event line (wall-clock time first): appends of short lines from several ranks do not interleave."""
    with open(folder / "events.log", "a") as f:
        f.write(f"{time.time():.6f} rank{dist.get_rank()} {text}\n")


def parameter_digest(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().cpu().contiguous().numpy().tobytes())   # the same bytes from any device
    return digest.hexdigest()[:16]


def durable_replace(write, path: Path) -> None:
    """Write `path` through a temporary file: `write(file)` fills it, then fsync and rename.

    The rename alone makes the file complete or absent after a *process* dies; the fsync of the file (before the
    rename) and of its folder (after) make that hold after an OS crash or power loss too, when the page cache
    had not reached the disk (DCP's file writer syncs by default for the same reason)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def save(folder: Path, step: int, model, optimizer) -> None:
    rank = dist.get_rank()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
             "rng": torch.get_rng_state()}
    where = next(model.parameters()).device
    if where.type == "cuda":                                 # dropout on a GPU draws from the CUDA generator
        state["cuda_rng"] = torch.cuda.get_rng_state(where)
    durable_replace(lambda f: torch.save(state, f), folder / f"step{step}-rank{rank}.pt")
    dist.barrier()                                           # every rank has written step `step`
    if rank == 0:
        durable_replace(lambda f: f.write(str(step).encode()), folder / "latest")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, required=True, help="checkpoints, marker and events.log go here")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=4, help="checkpoint after every EVERY steps")
    parser.add_argument("--die-at", type=int, default=None, help="rank 1 kills itself after this many steps, the first time only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=("gloo", "nccl", "auto"), default="gloo",
                        help="gloo (default: a dead peer shows as a closed connection, which the lesson relies on); "
                             "nccl: one GPU per local rank; auto: nccl when each local rank has its own GPU")
    args = parser.parse_args()

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    with open(args.folder / "events.log", "a") as f:               # before the group: a hang there leaves a pid
        f.write(f"{LAUNCHED:.6f} rank{os.environ['RANK']} launched attempt={attempt} pid={os.getpid()}\n")
        f.write(f"{IMPORTED:.6f} rank{os.environ['RANK']} imported attempt={attempt}\n")
    backend = args.backend
    if backend == "auto":                                    # as utils.launch decides, per node
        backend = backend_for(int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])))
    # NCCL: set_device(cuda:LOCAL_RANK) and bind the group to it, as utils.rank_process does under torchrun
    dist.init_process_group(backend, **_device_options(backend, int(os.environ.get("LOCAL_RANK", 0))))
    log(args.folder, f"start attempt={attempt}")
    # Installed now, not when a peer is lost: torchrun's SIGTERM may come before this rank's all-reduce fails.
    signal.signal(signal.SIGTERM, lambda *_: (log(args.folder, "stopped by=SIGTERM"), os._exit(143)))
    digest = train(args.folder, args.steps, args.every, args.die_at, args.seed)
    if dist.get_rank() == 0:
        print(f"final parameters sha256 {digest}", flush=True)
    compat.end_group_before_exit()
    sys.stdout.flush()
    os._exit(0)                                              # no destructors: a gloo group's can hang (utils.compat)


def train(folder: Path, steps: int, every: int, die_at: int | None = None, seed: int = 0) -> str:
    """Train to `steps` on this process group, resuming from `folder`'s latest checkpoint; the parameters' digest.

    The lesson also calls it through utils.launch for the uninterrupted reference run."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)

    source = MarkovSource(seed=seed)
    config = GPTConfig(vocab_size=source.vocab_size, block_size=16, n_layer=1, n_head=2, n_embd=16, dropout=0.1)
    torch.manual_seed(seed)
    where = device()                                         # cuda:LOCAL_RANK under NCCL, else the CPU
    model = GPT(config).to(where)                            # built on the CPU first: the same weights anywhere
    torch.manual_seed(seed + 1 + rank)                       # each rank's own dropout stream
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    log(folder, "built")                                     # model and optimizer ready: the load is timed apart
    step = 0
    latest = folder / "latest"
    if latest.exists():
        step = int(latest.read_text())
        state = torch.load(folder / f"step{step}-rank{rank}.pt", map_location=where)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"].cpu())
        if "cuda_rng" in state:
            torch.cuda.set_rng_state(state["cuda_rng"].cpu(), where)
        log(folder, f"resumed step={step}")

    params = list(model.parameters())
    model.train()
    while step < steps:
        marker = folder / "died"
        if rank == 1 and step == die_at and not marker.exists():
            marker.write_text("")
            log(folder, f"killed step={step}")
            os.kill(os.getpid(), signal.SIGKILL)             # a real death: no exception, no cleanup
        inputs, targets = (t.to(where) for t in source.batch(step, 2, 16, rank, world))
        loss = model(inputs, targets)
        optimizer.zero_grad()
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params])   # one fixed layout: same sums every step
        try:
            dist.all_reduce(flat)
        except RuntimeError:                                 # a peer is gone: leave the ending to the launcher
            log(folder, f"lost-peer step={step}")
            time.sleep(120)                                  # main() logs torchrun's SIGTERM when it comes
            raise
        flat /= world
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        optimizer.step()
        step += 1
        if step % every == 0:
            save(folder, step, model, optimizer)
    log(folder, f"finished step={step}")
    return parameter_digest(model)


if __name__ == "__main__":
    main()
