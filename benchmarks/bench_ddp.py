"""Benchmark: lesson 04's bucketed DDP (version (d)) against torch's DistributedDataParallel.

Runs 4 ranks (gloo on CPU, NCCL with one GPU per rank) on the lesson's model and data. Both wrappers train
their own copy of the model from the same weights, with the same bucket cap; each wrapper runs two untimed
samples of `--steps` steps first, which takes torch's DDP past its bucket rebuild (after its first step). Torch's
DDP is built with forward_sync_buffers=False: the lesson's wrapper broadcasts buffers once, when built, while
DDP by default broadcasts them again in every forward. No simulated link: this is the real backend.
Each timed sample is `--steps` training steps (forward, backward, gradient averaging, AdamW step), started
after a barrier; its time is the slowest rank's. The two wrappers run in rounds, one of each per round, in an
order rotated from round to round (utils.timing.rotated_rounds), after a warm-up round that is not kept.
Prints each one's median with its spread, the ratio lesson/torch within each round (median, quartiles,
min–max over rounds) and utils.timing.compare's verdict. The bar: the median ratio ≤ 1.15. Under 2 minutes
on 2 cores.

    .venv/bin/python benchmarks/bench_ddp.py [--rounds 9] [--steps 5] [--bucket-mb 0.25] [--world-size 4]

The wrapper is a copy of the lesson's cells (the benchmark imports nothing from notebooks); it all-reduces
with dist.all_reduce here, where the lesson goes through its simulated link.
"""
import argparse
import time

import torch
import torch.distributed as dist

import utils
from utils.data import MarkovSource
from utils.model import GPT, GPTConfig
from utils.timing import Spread, compare, rotated_rounds

MiB = 2**20
SEED, PER_RANK, SEQ_LEN = 0, 4, 32
source = MarkovSource(seed=SEED)
config = GPTConfig(vocab_size=source.vocab_size, block_size=SEQ_LEN, n_layer=4, n_head=4, n_embd=64)


# ------------------------------------------------------------------ the lesson's version (d), a copy

class Bucketed:
    # gradients go into the current bucket in the order they become ready; a bucket holding at least
    # bucket_mb MiB (or the last gradient) is all-reduced at once, asynchronously, as one flat buffer
    def __init__(self, module, bucket_mb):
        self.module, self.world = module, dist.get_world_size()
        self.params = [p for p in module.parameters() if p.requires_grad]
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor, src=0)
        self.cap = bucket_mb * MiB
        self.filling, self.filled_bytes, self.ready, self.in_flight = [], 0, 0, []
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _grad_ready(self, p):
        self.filling.append(p.grad)
        self.filled_bytes += p.grad.numel() * p.grad.element_size()
        self.ready += 1
        if self.filled_bytes >= self.cap or self.ready == len(self.params):
            self._launch()

    def _launch(self):
        flat = torch.cat([g.flatten() for g in self.filling]).div_(self.world)
        self.in_flight.append((dist.all_reduce(flat, async_op=True), flat, self.filling))
        self.filling, self.filled_bytes = [], 0

    def finish_gradient_synchronization(self):
        if self.filling:
            self._launch()
        for work, flat, grads in self.in_flight:
            work.wait()
            for g, averaged in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(averaged.view_as(g))
        self.in_flight, self.ready = [], 0


class TorchDDP:
    def __init__(self, module, bucket_mb):
        self.module = module
        # forward_sync_buffers=False: our versions broadcast buffers once, when built (this model's buffers are
        # constant causal masks); by default DDP broadcasts them again in every forward
        self.ddp = utils.compat.ddp(
            module, bucket_cap_mb=bucket_mb, forward_sync_buffers=False,
            device_ids=[utils.device()] if utils.device().type == "cuda" else None)

    def __call__(self, *args, **kwargs):
        return self.ddp(*args, **kwargs)

    def finish_gradient_synchronization(self):
        pass


# ------------------------------------------------------------------ timing

def bench(rounds, steps, bucket_mb):
    rank, world, device = dist.get_rank(), dist.get_world_size(), utils.device()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    wrappers = {}
    for name, make in (("lesson (d)", Bucketed), ("torch DDP", TorchDDP)):
        torch.manual_seed(SEED)
        model = GPT(config).to(device)
        wrappers[name] = (make(model, bucket_mb), torch.optim.AdamW(model.parameters(), lr=1e-3))
    batches = [tuple(t.to(device) for t in source.batch(s, PER_RANK, SEQ_LEN, rank=rank, world_size=world))
               for s in range(steps)]

    def run(name):
        wrapper, optimizer = wrappers[name]
        dist.barrier()
        sync()
        start = time.perf_counter()
        for x, y in batches:
            wrapper(x, y).backward()
            wrapper.finish_gradient_synchronization()
            optimizer.step()
            optimizer.zero_grad()
        sync()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return elapsed.item() / steps

    for name in wrappers:                      # two untimed samples each: torch DDP rebuilds its buckets after step 1
        for _ in range(2):
            run(name)
    samples = {name: [] for name in wrappers}
    for rep, name in rotated_rounds(list(wrappers), rounds):
        seconds = run(name)
        if rep >= 0:
            samples[name].append(seconds)
    same = all(torch.equal(a, b) for a, b in zip(wrappers["lesson (d)"][0].module.parameters(),
                                                  wrappers["torch DDP"][0].module.parameters()))
    return samples, same


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=5, help="training steps per timed sample")
    parser.add_argument("--bucket-mb", type=float, default=0.25)
    parser.add_argument("--world-size", type=int, default=4)
    args = parser.parse_args()
    started = time.perf_counter()
    samples, same = utils.launch(bench, args.rounds, args.steps, args.bucket_mb, world_size=args.world_size,
                                 timeout=600)[0]
    lesson, torch_ddp = samples["lesson (d)"], samples["torch DDP"]
    print(f"{args.world_size} ranks ({utils.backend_for(args.world_size)}), {args.bucket_mb:g} MiB buckets, "
          f"{args.steps} steps per sample, {args.rounds} rounds; per-step time of the slowest rank:")
    for name, values in samples.items():
        print(f"  {name:11s} {Spread.of(values).format()}")
    ratios = Spread.of([a / b for a, b in zip(lesson, torch_ddp)])
    print(f"  ratio lesson / torch DDP per round: median {ratios.median:.3f} (IQR {ratios.q1:.3f}–{ratios.q3:.3f}, "
          f"min–max {ratios.low:.3f}–{ratios.high:.3f})")
    print("  " + compare(torch_ddp, lesson, "torch DDP", "lesson (d)"))
    verdict = "meets" if ratios.median <= 1.15 else "misses"
    print(f"  {verdict} the bar: median ratio {ratios.median:.3f} {'≤' if ratios.median <= 1.15 else '>'} 1.15")
    print(f"  (parameters after training: {'bitwise identical' if same else 'not bitwise identical'} between the two; "
          f"took {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
