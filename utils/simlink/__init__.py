"""A simulated network link per rank: communication takes α + bytes/bandwidth, so slow links show on a CPU.

On one machine, gloo moves bytes between processes over loopback TCP sockets, on the cores that also compute:
its timing is that of the CPU scheduler and the loopback, not that of a network between GPUs, and it scatters
with the machine's load. `SimulatedLink` gives each rank a link with a latency α and a bandwidth you choose:

    link = SimulatedLink(alpha=1e-3, bandwidth=100e6)      # 1 ms per message, 100 MB/s (bytes per second)
    link.all_reduce(grad)                                   # real all-reduce + the ring's time on this link
    link.all_gather(full, shard)                            # real all-gather + the ring's time on this link
    work = link.all_reduce(grad, async_op=True)             # returns at once; work.wait() blocks until done
    link.send(nbytes)                                       # occupy the link with one message (no data moved)
    print(link.measure_host_cost())                         # "host cost 0.04 ms vs α 1 ms per message ..."
    link.close()                                            # finish what was issued, free the shared table

The rules:
- Each rank's link is one FIFO channel. A message of b bytes finishes no sooner than α + b/bandwidth after
  the previous message on that link finished (or after it was issued, if the link was idle). So two
  back-to-back 1 MiB messages take 2α + 2 MiB/bandwidth.
- An all-reduce of M bytes on N ranks is a ring: 2(N−1) messages of M/N bytes each, i.e.
  2(N−1)·α + 2(N−1)/N·M/bandwidth. An all-gather of a shard of S bytes per rank is N−1 messages of S bytes:
  (N−1)·α + (N−1)·S/bandwidth. A collective starts when the *last* rank has issued it (it cannot finish
  before every rank has contributed), so a rank that issues early waits for the late one; the real
  `dist.all_reduce` / all-gather runs too, so results are exact.
- The link's schedule is the rule's alone: `work.start` and `work.end` are when the simulated network carries
  the operation, and the next one queues behind `work.end`. A handle completes no sooner than `work.end`
  *and* no sooner than the real operation: the link only ever adds time to what the ranks wait. `work.done`
  records when the handle really completed; `work.done − work.end` is host time the simulator itself took on
  top of the network (the real gloo call, waking up from sleep on a busy CPU). Late host work does not move
  the network's schedule, as a real network does not wait for another operation's host bookkeeping.
- Waiting sleeps: a waiting rank burns no CPU, so 4 ranks on 2 cores can wait without slowing each other.

How it is cheap (the simulator must cost far less than the α it models; `benchmarks/bench_simlink.py`):
- No extra collective and no worker thread per operation. On its first collective a link maps a small table
  in shared memory (`utils.simlink.table`). Each rank writes its issue time of each collective into its own
  column, then starts the real collective asynchronously and returns.
- The schedule is settled lazily, in issue order, when a handle is waited (or polled): once the real
  collective is done every rank has issued it, so every issue time is in the table; the start is the latest
  of them (or the end of the previous operation), and `wait()` sleeps until the end (`utils.simlink.link`).
- A handle's `get_future()` (what a DDP communication hook returns) completes no sooner than its `end`
  without stalling backward (`utils.simlink.futures`).

The simulated start of a collective uses the ranks' issue times on `time.perf_counter()`, one clock shared by all
processes of one machine (as `utils.trace` does): the link is for single-machine runs, not for multi-node jobs.

From a DDP communication hook (lesson 04): `ddp.register_comm_hook(link, simlink.allreduce_hook)` averages
each gradient bucket through the link and returns the future DDP expects.

The package, one concept per module: `link` (the schedule and the operations), `table` (issue times in shared
memory), `futures` (futures for hooks, and the hook).
"""
from .futures import allreduce_hook
from .link import HostCost, SimulatedLink, SimWork, all_gather_messages, rank_quantile, ring_messages

__all__ = ["SimulatedLink", "SimWork", "HostCost", "ring_messages", "all_gather_messages", "allreduce_hook", "rank_quantile"]