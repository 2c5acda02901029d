"""utils.labchecks.lab2: the reference wrapper passes; wrong wrappers fail with a useful message.

The reference is read from labs/lab2_ddp.ipynb (its import cell and its solution cell), so the lab and these
tests cannot drift apart. Each wrong wrapper below has one typical mistake and is otherwise a correct
bucketed wrapper.
"""
import contextlib
import sys
from pathlib import Path

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from utils.labchecks import handles, lab2
from labtesting import fails as _fails, lab_class

# Ship this module's classes by value, exactly as classes defined in a notebook cell travel.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
SUBMISSIONS = Path(__file__).resolve().parent / "fixtures" / "lab2_submissions.py"


def _lab_class(student=False):
    return lab_class("lab2_ddp", "DDPBucketed", student)


def submissions():
    """tests/fixtures/lab2_submissions.py run as a solution cell runs (its classes travel by value)."""
    namespace = {"__name__": "lab2_submissions"}
    exec(compile(SUBMISSIONS.read_text(), str(SUBMISSIONS), "exec"), namespace)
    return namespace


# ------------------------------------------------------------------ a correct wrapper, with knobs to break it

class Wrapper(torch.nn.Module):
    """A bucketed wrapper (arrival order, launched from the hook), with one switch per typical mistake."""
    average = True           # False: sums the gradients
    launch_in_hook = True    # False: every bucket launched in finish_gradient_synchronization()
    names_with_duplicates = False   # True: counts a tied parameter under both its names

    def __init__(self, module, bucket_size_mb):
        super().__init__()
        self.module = module
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t, src=0)
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.expected = (sum(p.requires_grad for _, p in module.named_parameters(remove_duplicate=False))
                         if self.names_with_duplicates else len(self.params))
        self.cap = bucket_size_mb * 2**20
        self.filling, self.filled, self.ready, self.in_flight, self.pending = [], 0, 0, [], []
        self.quiet = False
        for p in self.params:
            p.register_post_accumulate_grad_hook(self.ready_hook)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        self.quiet = True
        yield
        self.quiet = False

    def ready_hook(self, p):
        if self.quiet:
            return
        self.filling.append(p.grad)
        self.filled += p.grad.numel() * p.grad.element_size()
        self.ready += 1
        if self.filled >= self.cap or self.ready == self.expected:
            self.close_bucket()

    def close_bucket(self):
        if self.launch_in_hook:
            self.launch(self.filling)
        else:
            self.pending.append(self.filling)
        self.filling, self.filled = [], 0

    def launch(self, grads):
        flat = torch.cat([g.flatten() for g in grads])
        if self.average:
            flat.div_(dist.get_world_size())
        self.in_flight.append((dist.all_reduce(flat, async_op=True), flat, grads))

    def finish_gradient_synchronization(self):
        if not self.names_with_duplicates and self.filling:
            self.close_bucket()
        for grads in self.pending:
            self.launch(grads)
        for work, flat, grads in self.in_flight:
            work.wait()
            for g, averaged in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(averaged.view_as(g))
        self.in_flight, self.pending, self.ready, self.filling, self.filled = [], [], 0, [], 0


class Sums(Wrapper):
    average = False


class NeverOverlaps(Wrapper):
    launch_in_hook = False


class TiedCountedTwice(Wrapper):
    """Expects one gradient per parameter *name*: waits for the tied parameter's second use, which never comes
    (autograd calls the hook once, after both uses), so the last bucket is never sent."""
    names_with_duplicates = True


class OneTinyEarlyBucket(Wrapper):
    """Sends the first gradient (the 4 KB head) at once, everything else after backward."""

    def ready_hook(self, p):
        if self.ready == 0:
            self.ready += 1
            self.launch([p.grad])
            return
        self.ready += 1
        self.pending.append([p.grad])


class HooksOnBothNames(Wrapper):
    """Registers a hook under every name of a parameter: the tied one is added to its bucket twice."""

    def __init__(self, module, bucket_size_mb):
        super().__init__(module, bucket_size_mb)
        names = dict(module.named_parameters())
        for name, p in module.named_parameters(remove_duplicate=False):
            if name not in names and p.requires_grad:
                p.register_post_accumulate_grad_hook(self.ready_hook)
                self.expected += 1


class NoBufferBroadcast(Wrapper):
    def __init__(self, module, bucket_size_mb):
        shift = module.shift.clone()
        super().__init__(module, bucket_size_mb)
        module.shift.copy_(shift)


class BlocksInTheHook(Wrapper):
    """Launches each bucket from the hook, but with a blocking all-reduce: backward waits for every one."""

    def launch(self, grads):
        flat = torch.cat([g.flatten() for g in grads]).div_(dist.get_world_size())
        dist.all_reduce(flat)  # no async_op=True
        for g, averaged in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(averaged.view_as(g))


class WaitsInTheHook(Wrapper):
    """async_op=True, then waits for the handle right there in the hook: backward waits for every bucket."""
    how = "work.wait()"

    def launch(self, grads):
        super().launch(grads)
        work = self.in_flight[-1][0]
        if self.how == "work.wait()":
            work.wait()
        elif self.how == "future.wait()":
            work.get_future().wait()
        else:
            torch.futures.wait_all([work.get_future()])


class FutureWaitInTheHook(WaitsInTheHook):
    how = "future.wait()"


class WaitAllInTheHook(WaitsInTheHook):
    how = "wait_all"


class RingInTheHook(Wrapper):
    """Averages each bucket from the hook with a ring of blocking dist.send/dist.recv."""

    def launch(self, grads):
        flat = torch.cat([g.flatten() for g in grads]).div_(dist.get_world_size())
        self.in_flight.append((submissions()["ring_all_reduce_blocking"](flat), flat, grads))


class WaitsForTheEarlierBucket(Wrapper):
    """Launches each bucket asynchronously from the hook, but first waits for the bucket before it: backward
    waits for every bucket but the last, though each handle is first waited for after a later gradient."""

    def launch(self, grads):
        if self.in_flight:
            self.in_flight[-1][0].wait()
        super().launch(grads)


class BarrierAfterLaunch(Wrapper):
    """An asynchronous launch, then dist.barrier() in the hook: on gloo the barrier waits for the all-reduce."""

    def launch(self, grads):
        super().launch(grads)
        dist.barrier()


class OnePerParameter(Wrapper):
    """Ignores bucket_size_mb: one asynchronous all-reduce per gradient, launched at once (overlaps fine)."""

    def __init__(self, module, bucket_size_mb):
        super().__init__(module, bucket_size_mb)
        self.cap = 0


class OneBucket(Wrapper):
    """Ignores bucket_size_mb: every gradient in one bucket, launched by the last gradient's hook."""

    def __init__(self, module, bucket_size_mb):
        super().__init__(module, bucket_size_mb)
        self.cap = float("inf")


class DividesByMicroBatches(Wrapper):
    """Accumulates quietly in no_sync(), then divides by the number of micro-batches too (lesson 04's habit)."""
    micro = 1

    @contextlib.contextmanager
    def no_sync(self):
        self.micro += 1
        with super().no_sync():
            yield

    def launch(self, grads):
        flat = torch.cat([g.flatten() for g in grads]).div_(dist.get_world_size() * self.micro)
        self.in_flight.append((dist.all_reduce(flat, async_op=True), flat, grads))

    def finish_gradient_synchronization(self):
        super().finish_gradient_synchronization()
        self.micro = 1


class NeverSilent(Wrapper):
    """no_sync() that does nothing: every micro-batch communicates (the gradients still come out right)."""

    @contextlib.contextmanager
    def no_sync(self):
        yield


class LastMicroBatchOnly(Wrapper):
    """Zeroes the gradients when no_sync() ends: only the last micro-batch's gradient is averaged."""

    @contextlib.contextmanager
    def no_sync(self):
        with super().no_sync():
            yield
        for p in self.params:
            p.grad = None


class ForgetsToWait(Wrapper):
    """Never waits, never copies the averages back: each rank keeps its own gradient."""

    def finish_gradient_synchronization(self):
        self.in_flight, self.pending, self.ready, self.filling, self.filled = [], [], 0, [], 0


# ------------------------------------------------------------------ the reference passes, stubs are named

def test_reference_passes_every_check(capsys):
    Reference = _lab_class()
    lab2.check_construction(Reference)
    lab2.check_training(Reference)
    lab2.check_overlap(Reference)
    lab2.check_accumulation(Reference)
    out = capsys.readouterr().out
    assert out.count("✓") == 8, out


def test_another_structure_passes_every_check(capsys):
    """Buckets planned in reverse definition order, ReduceOp.AVG, futures, a class for no_sync(): passes, also on
    the model whose gradients arrive out of definition order, and keeps its overlap."""
    Other = submissions()["DDPBucketed"]
    lab2.check_construction(Other, world_sizes=(2,))
    lab2.check_training(Other, world_sizes=(2,), models=(lab2.TIED, lab2.SHUFFLED))
    lab2.check_overlap(Other, world_sizes=(2,))
    lab2.check_accumulation(Other, world_sizes=(2,))
    assert capsys.readouterr().out.count("✓") == 4


def test_the_knob_wrapper_is_correct():
    lab2.check_training(Wrapper, world_sizes=(2,), models=(lab2.TIED,), bucket_sizes_mb=(1 / 128,))
    lab2.check_overlap(Wrapper, world_sizes=(2,))
    lab2.check_accumulation(Wrapper, world_sizes=(2,), models=(lab2.TIED,))


def test_stubs_say_not_implemented():
    Student = _lab_class(student=True)
    for check in (lab2.check_construction, lab2.check_training, lab2.check_overlap, lab2.check_accumulation):
        _fails(r"your DDP wrapper is not implemented yet: it raised NotImplementedError", check, Student,
               world_sizes=(2,))


# ------------------------------------------------------------------ wrong wrappers

def test_sum_instead_of_average():
    _fails(r"rank 0, step 0, wte\.weight: the SUM over the 2 ranks, not the average: divide by the world size "
           r"\(max \|diff\| .* expected .*, got ", lab2.check_training, Sums, world_sizes=(2,),
           models=(lab2.PLAIN,), bucket_sizes_mb=(1 / 128,))


def test_never_overlapping_wrapper():
    _fails(r"rank 0, last step: 0 of 141,312 gradient bytes \(0%\) were still in flight when a later gradient "
           r"became ready; at least 50% must\. Seen: 5 calls \(141,312 B\) issued once the last gradient was ready.*"
           r"Start each bucket's all-reduce with async_op=True from the hook.*"
           r"Your calls: 37,376 B after gradient 18/18, 33,280 B after gradient 18/18",
           lab2.check_overlap, NeverOverlaps, world_sizes=(2,))
    lab2.check_training(NeverOverlaps, world_sizes=(2,), models=(lab2.TIED,))  # right gradients, just late


STALLED = r"rank 0, last step: backward was made to wait for communication (\d+) times before its last gradient was ready: "


@pytest.mark.parametrize("Blocking, seen", [
    (BlocksInTheHook, r"dist\.all_reduce\(\) without async_op=True after gradient 5/18 \(it returns only once it is "
                      r"done\)"),
    (WaitsInTheHook, r"work\.wait\(\) after gradient 5/18 on the handle of a call issued after gradient 5/18 \(right "
                     r"after the call\)"),
    (FutureWaitInTheHook, r"future\.wait\(\) after gradient 5/18 on the handle of a call issued after gradient 5/18"),
    (WaitAllInTheHook, r"future\.wait\(\) after gradient 5/18 on the handle of a call issued after gradient 5/18"),
    (RingInTheHook, r"a blocking dist\.(send|recv)\(\) after gradient 5/18 \(it returns once its data has moved\)"),
    (WaitsForTheEarlierBucket, r"work\.wait\(\) after gradient 9/18 on the handle of a call issued after gradient "
                               r"5/18 \(an earlier bucket's\)"),
    (BarrierAfterLaunch, r"a blocking dist\.barrier\(\) after gradient 5/18 \(a barrier waits for the other ranks, "
                         r"and on gloo for every collective issued before it\)"),
])
def test_a_hook_that_stalls_backward_does_not_overlap(Blocking, seen):
    # Each launches from the hook. A blocking call, a wait() right after an asynchronous call, a wait for an earlier
    # bucket before launching the next (which looked in flight: first waited after a later gradient) and a
    # barrier after an asynchronous launch each make backward wait: each is seen as what it is.
    message = _fails(STALLED + seen + r".*Overlap means backward never waits", lab2.check_overlap, Blocking,
                     world_sizes=(2,))
    assert "in flight" not in message


def test_blocking_hooks_train_right():
    for Blocking in (WaitsInTheHook, RingInTheHook):   # right gradients, no overlap
        lab2.check_training(Blocking, world_sizes=(2, 4), models=(lab2.TIED,), bucket_sizes_mb=(1 / 128,))


def test_one_tiny_early_bucket_does_not_pass():
    _fails(r"4,096 of 141,312 gradient bytes \(3%\) were still in flight.*"
           r"Your calls: 4,096 B after gradient 1/18 \(waited after gradient 18/18\), 256 B after gradient 18/18",
           lab2.check_overlap, OneTinyEarlyBucket, world_sizes=(2,))


@pytest.mark.parametrize("Ignores, says", [
    (OnePerParameter, r"buckets of 4,194,304 bytes, more than all [\d,]+ bytes of trainable gradients, must give one "
                      r"all-reduce; seen \d+ all-reduces of"),
    (OneBucket, r"buckets of 10 bytes, smaller than any of the \d+ trainable gradients, must give one all-reduce per "
                r"gradient \(\d+\); seen 1 all-reduce of"),
])
def test_a_wrapper_that_ignores_the_bucket_size_fails_training(Ignores, says):
    _fails(r"rank 0, last step: " + says, lab2.check_training, Ignores, world_sizes=(2,), models=(lab2.PLAIN,))


def test_dividing_by_the_micro_batches_is_diagnosed():
    _fails(r"rank 0, step 0, wte\.weight: the expected gradient divided by 3, the number of micro-batches per step: "
           r"\.grad must hold the SUM", lab2.check_accumulation, DividesByMicroBatches, world_sizes=(2,),
           models=(lab2.PLAIN,))


def test_no_sync_that_sends_fails_accumulation():
    _fails(r"rank 0, step 0, micro-batch 1 of 3 \(inside no_sync\(\)\): \d+ communication calls, [\d,]+ bytes "
           r"\(nominal\) sent; inside no_sync\(\) backward must only accumulate",
           lab2.check_accumulation, NeverSilent, world_sizes=(2,), models=(lab2.PLAIN,))


def test_no_sync_that_drops_the_micro_batches_fails_accumulation():
    _fails(r"rank 0, step 0, wte\.weight: the average of the last micro-batch's gradient only",
           lab2.check_accumulation, LastMicroBatchOnly, world_sizes=(2,), models=(lab2.PLAIN,))


def test_a_wrapper_without_no_sync_is_told_to_add_it():
    class NoNoSync(Wrapper):
        no_sync = None
    _fails(r"NoNoSync has no no_sync\(\) method: add one", lab2.check_accumulation, NoNoSync, world_sizes=(2,),
           models=(lab2.PLAIN,))


def test_tied_parameter_waited_for_twice():
    _fails(r"rank 0, step 0, wte\.weight \(tied: also head\.weight\): this rank's own gradient, never averaged",
           lab2.check_training, TiedCountedTwice, world_sizes=(2,), models=(lab2.TIED,),
           bucket_sizes_mb=(1 / 128,))
    lab2.check_training(TiedCountedTwice, world_sizes=(2,), models=(lab2.PLAIN,))  # only tying breaks it


def test_tied_parameter_sent_twice():
    _fails(r"rank 0, step 0: sent 12,544 bytes \(nominal\), expected 10,496 = 2\(N-1\)/N × 10,496 bytes of trainable "
           r"gradients, each once; more: a gradient communicated twice",
           lab2.check_training, HooksOnBothNames, world_sizes=(2,), models=(lab2.TIED,), bucket_sizes_mb=(4.0,))


def test_buffers_not_broadcast():
    _fails(r"rank 1, buffer shift: not rank 0's value after construction .*broadcast every parameter and buffer",
           lab2.check_construction, NoBufferBroadcast, world_sizes=(2,))


def test_not_waiting_leaves_local_gradients():
    _fails(r"rank 0, step 0, wte\.weight: this rank's own gradient, never averaged",
           lab2.check_training, ForgetsToWait, world_sizes=(2,), models=(lab2.PLAIN,), bucket_sizes_mb=(4.0,))


def test_judges_are_pure_functions_of_plain_data():
    case = lab2.make_case(lab2.TIED, 1 / 128, steps=1)
    reference = lab2.reference_run(case, 2)
    grads = reference["grads"]
    fine = dict(state=reference["init"], module_ok=True, outputs=(reference["outputs"][0], reference["outputs"][0]),
                grads=grads, params=reference["params"], bytes=[7168], events=[[("grad", "head", 0, 0.0)]])
    second = {**fine, "outputs": (reference["outputs"][1], reference["outputs"][1])}
    assert lab2.judge_construction(case, 2, [fine, second], reference) == []
    assert lab2.judge_training(case, 2, [fine, fine], reference) == []
    summed = {**fine, "grads": [{k: None if v is None else 2 * v for k, v in grads[0].items()}]}
    assert "SUM" in lab2.judge_training(case, 2, [summed, fine], reference)[0]
    events = [("grad", "a", 0, 1.0, -1), ("comm", "all_reduce", 300, 1.1, 0), ("grad", "b", 0, 2.0, -1),
              ("comm", "all_reduce", 100, 2.1, 1), ("wait", "work.wait()", 0, 2.2, 0),
              ("wait", "work.wait()", 0, 2.3, 1)]
    assert lab2.overlap_share(events) == (300, 400)


def test_fates_tell_every_way_a_call_can_end():
    events = [("grad", "a", 0, 0, -1),
              ("comm", "send", 10, 0, -1),                                   # blocking
              ("comm", "all_reduce", 20, 0, 0), ("wait", "work.wait()", 0, 0, 0),   # waited at once
              ("comm", "all_reduce", 30, 0, 1),                              # in flight over gradient b
              ("comm", "all_reduce", 40, 0, 2),                              # never waited
              ("grad", "b", 0, 0, -1),
              ("comm", "all_reduce", 50, 0, 3),                              # after backward
              ("wait", "future.wait()", 0, 0, 1), ("wait", "work.wait()", 0, 0, 3)]
    assert [fate for _, fate, *_ in handles.fates(events)] == [
        handles.BLOCKING, handles.WAITED_AT_ONCE, handles.IN_FLIGHT, handles.NEVER_WAITED, handles.AFTER_BACKWARD]
    assert lab2.overlap_share(events) == (30, 150)
    results = [dict(events=[events])]
    assert "1 of the 5 calls returned a handle that was never waited for (40 B)" in lab2.judge_waits({}, 2, results)[0]
    problem = lab2.judge_overlap({}, 2, results)[1]
    assert "backward was made to wait for communication 2 times" in problem, problem
    assert "dist.send() after gradient 1/2" in problem and "work.wait() after gradient 1/2 on the handle of a " \
        "call issued after gradient 1/2 (right after the call)" in problem, problem


def test_stalls_are_events_between_the_first_gradient_and_the_last():
    """Waits and blocking calls before the first gradient (forward) or after the last (finishing) are no stalls;
    a poll that answered True is no wait."""
    events = [("comm", "broadcast", 8, 0, -1), ("grad", "a", 0, 0, -1), ("comm", "all_reduce", 8, 0, 0),
              ("wait", "work.is_completed()", 0, 0, 0), ("grad", "b", 0, 0, -1), ("comm", "all_reduce", 8, 0, 1),
              ("wait", "work.wait()", 0, 0, 1), ("comm", "barrier", 0, 0, -1)]
    assert handles.stalls(events) == []
    assert handles.stalls(events[:4] + [("comm", "barrier", 0, 0, -1)] + events[4:]) == [("barrier", 1, None)]


def test_every_way_of_waiting_is_seen():
    """work.wait(), a future's wait() (also chained by then() or combined by collect_all/wait_all) and a True
    is_completed()/done() each count as a wait; a handle left alone does not."""
    def rank():
        import torch.distributed as dist
        from utils import bytecount
        from utils.labchecks import handles
        events = []
        with bytecount.count_bytes() as counter:
            add = counter.add
            counter.add = lambda op, sent=0, *a, **k: (events.append(("comm", op, int(sent), 0, -1)),
                                                     add(op, sent, *a, **k))
            with handles.track(events):
                works = [dist.all_reduce(torch.ones(4), async_op=True) for _ in range(6)]
                works[0].wait()
                works[1].get_future().wait()
                works[2].get_future().then(lambda f: None).wait()
                torch.futures.wait_all([works[3].get_future()])
                works[5].wait()           # so that works[4] surely completes, and...
                while not works[4].is_completed():
                    pass
                dist.all_reduce(torch.ones(4))      # blocking: no handle
                dist.barrier()
                left = dist.all_reduce(torch.ones(4), async_op=True)
        left.wait()
        return [(e[0], e[4]) for e in events]
    from utils import launch
    got = launch(rank, world_size=2)[0]
    comm = [h for kind, h in got if kind == "comm"]
    waited = [h for kind, h in got if kind == "wait"]
    assert len(comm) == 9 and comm[6] == comm[7] == -1 and len(set(comm[:6] + comm[8:])) == 7, got
    assert sorted(waited) == sorted(comm[:6]), got


# ------------------------------------------------------------------ reviewers' leftovers

class DividesButNeverWaits(Wrapper):
    """Divides every gradient by N in its hook, all-reduces a copy, and never waits nor copies back."""

    def launch(self, grads):
        for g in grads:
            g.div_(dist.get_world_size())
        self.in_flight.append((dist.all_reduce(torch.cat([g.flatten() for g in grads]), async_op=True), None, []))

    def finish_gradient_synchronization(self):
        if self.filling:
            self.close_bucket()
        self.in_flight, self.pending, self.ready, self.filling, self.filled = [], [], 0, [], 0


def test_a_started_but_unfinished_average_says_forgot_to_wait():
    _fails(r"rank 0, step 0, wte\.weight: this rank's own gradient divided by 2: the average was started but not "
           r"completed\. Did finish_gradient_synchronization\(\) forget to wait\(\)\?",
           lab2.check_training, DividesButNeverWaits, world_sizes=(2,), models=(lab2.PLAIN,), bucket_sizes_mb=(4.0,))


class BroadcastsBuffersInForward(Wrapper):
    """Broadcasts the buffers again in every forward, as torch DDP does by default: more bytes than the gradients."""

    def forward(self, *args, **kwargs):
        for b in self.module.buffers():
            dist.broadcast(b, src=0)
        return self.module(*args, **kwargs)


def test_more_bytes_names_a_buffer_broadcast_in_forward():
    _fails(r"rank 0, step 0: sent .* bytes \(nominal\), expected .*; more: .*a broadcast of the buffers in every "
           r"forward \(broadcast them once, when the wrapper is built\)",
           lab2.check_training, BroadcastsBuffersInForward, world_sizes=(2,), models=(lab2.PLAIN,),
           bucket_sizes_mb=(4.0,))


class WaitsForever(Wrapper):
    """Every rank waits for a message no rank sends: a hang, whatever its cause (the message names lab 2's)."""

    def finish_gradient_synchronization(self):
        dist.recv(torch.zeros(1), src=1 - dist.get_rank())
        super().finish_gradient_synchronization()


def test_a_hang_names_lab_2s_usual_causes():
    message = _fails(r"likely a deadlock.*a collective that some ranks skip or issue in another order.*gradient "
                     r"hooks firing a different number of times", lab2.check_training, WaitsForever,
                     world_sizes=(2,), models=(lab2.PLAIN,), bucket_sizes_mb=(4.0,), steps=1, timeout=8)
    assert "dist.send before its dist.recv" not in message          # lab 1's hint stays lab 1's


def test_rank_inputs_hold_only_that_ranks_shard():
    case = lab2.make_case(lab2.PLAIN, 1 / 128, steps=2, batch=12)
    mine = [lab2.rank_inputs(case, r, 4) for r in range(4)]
    x0, y0 = lab2.global_batch(case, 0)
    assert all(m["batches"][0][0].shape[0] == 3 for m in mine)
    assert torch.equal(torch.cat([m["batches"][0][0] for m in mine]), x0)
    assert not torch.equal(mine[0]["state"]["wte.weight"], mine[1]["state"]["wte.weight"])


def test_lab_1_keeps_its_send_recv_hint_by_default():
    import inspect
    from utils.labchecks import harness
    default = inspect.signature(harness.run_on_ranks).parameters["deadlock_hint"].default
    assert default is harness.SEND_RECV_DEADLOCK and "dist.send before its dist.recv" in default
    assert "dist.send" not in lab2.DEADLOCK
