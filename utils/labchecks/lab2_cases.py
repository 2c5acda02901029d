"""Lab 2's cases as plain data: the models, the batches each rank trains on, and the reference run.

A case (`make_case`) is a dict that travels as JSON: a model spec, a bucket size, the number of steps and of
micro-batches per step, a seed. `rank_inputs` gives one rank its own initial weights and batch shards;
`reference_run` trains one process on the whole batch from the case alone (no student code). lab2.py runs the
student's wrapper on the cases, lab2_judges.py compares.
"""
from __future__ import annotations

import itertools

import torch

MiB = 2**20
LR = 0.1                 # plain SGD: parameters after k steps differ from the reference only by round-off
RTOL, ATOL = 1e-4, 1e-6  # float32 sums in another order agree far closer; a sum instead of a mean is ×N off
EARLY_SHARE = 0.5        # at least this share of a step's gradient bytes must be in flight while later gradients come


# ------------------------------------------------------------------ the models (plain-data specs)

class LabModel(torch.nn.Module):
    """A tiny language model: embedding (+ a fixed `shift` buffer), tanh layers, a head; loss = cross-entropy.

    spec: vocab, widths (embedding width, then each layer's output width), tied (head weight = embedding),
    frozen (names of parameters with requires_grad=False), order (the layers' indices in the order forward
    applies them; default: as defined; needs equal widths).
    """

    def __init__(self, spec):
        super().__init__()
        widths = spec["widths"]
        self.wte = torch.nn.Embedding(spec["vocab"], widths[0])
        self.register_buffer("shift", torch.randn(widths[0]))
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:]))
        self.order = list(spec.get("order", range(len(self.layers))))
        self.head = torch.nn.Linear(widths[-1], spec["vocab"], bias=False)
        if spec.get("tied"):
            self.head.weight = self.wte.weight  # one Parameter, used twice
        for name, p in self.named_parameters():
            if name in spec.get("frozen", ()):
                p.requires_grad_(False)

    def forward(self, x, y):
        h = self.wte(x) + self.shift
        for i in self.order:
            h = torch.tanh(self.layers[i](h))
        logits = self.head(h)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


# The models of the visible checks. In all but SHUFFLED every parameter's gradient is ready in the reverse of
# the order the parameters are defined in (the embedding last), so buckets filled in arrival order and buckets
# planned in reverse definition order are the same. SHUFFLED applies its layers in another order than it
# defines them: its gradients arrive out of definition order (judged on correctness only: right gradients, no
# hang; the overlap model keeps reverse definition order, so a plan fixed that way keeps its overlap).
PLAIN = dict(name="plain", vocab=16, widths=[32, 32, 32, 32])
FROZEN = dict(name="frozen", vocab=16, widths=[32, 32, 32, 32], frozen=["layers.0.weight", "layers.0.bias",
                                                                       "layers.2.bias"])
TIED = dict(name="tied", vocab=16, widths=[32, 32, 32], tied=True)
OVERLAP = dict(name="eight equal layers", vocab=16, widths=[64] * 9)   # 8 layers of 16.6 KB, 4 KB head
SHUFFLED = dict(name="shuffled", vocab=16, widths=[32] * 5, order=[2, 0, 3, 1])
MODELS = (PLAIN, FROZEN, TIED, SHUFFLED)
# bucket sizes in MiB: smaller than any parameter (a 32-float bias is 128 bytes), medium, larger than the model
BUCKET_SIZES_MB = (1e-5, 1 / 128, 4.0)
OVERLAP_BUCKET_MB = 1 / 32   # 32 KiB: about two of OVERLAP's layers per bucket
ACCUMULATION = 3             # micro-batches per step in the no_sync() check


def make_case(model, bucket_size_mb, steps=3, batch=12, seq_len=6, seed=0, accumulation=1):
    """One case, as plain data. accumulation = k: each step is k micro-batches, the first k−1 in no_sync()."""
    return dict(model=dict(model), bucket_size_mb=bucket_size_mb, steps=steps, batch=batch, seq_len=seq_len,
                seed=seed, accumulation=accumulation)


def micro_batches(case):
    return case.get("accumulation", 1)


def build_model(spec, seed):
    """The case's model, initialised from `seed` (ranks use different seeds: the wrapper must broadcast)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LabModel(spec)


def rank_seed(case, rank):
    return 1000 * case["seed"] + 17 * rank + 1


def global_batch(case, step, micro=0):
    """(x, y): the whole batch of a step's micro-batch; rank r trains on rows r·B/N … (r+1)·B/N − 1."""
    generator = torch.Generator().manual_seed(7919 * case["seed"] + step + 1_000_003 * micro)
    shape = (case["batch"], case["seq_len"])
    vocab = case["model"]["vocab"]
    return (torch.randint(0, vocab, shape, generator=generator),
            torch.randint(0, vocab, shape, generator=generator))


def shard(tensor, rank, world_size):
    return tensor.tensor_split(world_size)[rank]


def trainable_names(spec):
    """Names (deduplicated, as named_parameters() gives them) of the parameters that get gradients."""
    return [name for name, p in build_model(spec, 0).named_parameters() if p.requires_grad]


def label(spec, name):
    """A parameter's name, with what is special about it."""
    if spec.get("tied") and name == "wte.weight":
        return "wte.weight (tied: also head.weight)"
    if name in spec.get("frozen", ()):
        return f"{name} (frozen)"
    return name


def gradient_bytes(spec):
    """Bytes of the gradients that must be synchronised: trainable parameters, a tied one once."""
    model = build_model(spec, 0)
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def _state(module):
    return {name: t.detach().clone().cpu() for name, t in
            itertools.chain(module.named_parameters(), module.named_buffers())}


def rank_inputs(case, rank, world_size):
    """What rank `rank` trains on, and nothing more: its initial parameters and buffers (different per rank: the
    wrapper must broadcast rank 0's), and its shard (x, y) of every step's micro-batches, in order (step 0's
    first also for forward)."""
    state = _state(build_model(case["model"], rank_seed(case, rank)))
    batches = [tuple(shard(t, rank, world_size) for t in global_batch(case, step, micro))
               for step in range(max(case["steps"], 1)) for micro in range(micro_batches(case))]
    return dict(state=state, batches=batches)



# ------------------------------------------------------------------ the reference (no student code)

def reference_run(case, world_size):
    """Single-process training on the whole batch, from rank 0's initial weights.

    Returns dict(init={name: tensor} rank 0's parameters and buffers before broadcast, outputs=[loss of rank
    r's shard at init], grads=[{name: grad} per step, summed over its micro-batches], params={name: tensor}
    after the last step, local=[{name: grad} of rank r's shard alone at step 0, summed over its micro-batches],
    last={name: grad} of step 0's last micro-batch alone, when a step has several).
    """
    spec, k = case["model"], micro_batches(case)
    model = build_model(spec, rank_seed(case, 0))
    init = _state(model)
    outputs, local = [], []

    def gradients():
        return {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}

    for r in range(world_size):
        model.zero_grad(set_to_none=True)
        for micro in range(k):
            x, y = global_batch(case, 0, micro)
            loss = model(shard(x, r, world_size), shard(y, r, world_size))
            loss.backward()
            if micro == 0:
                outputs.append(loss.detach())
        local.append({name: g for name, g in gradients().items() if g is not None})
    extra = {}
    if k > 1:
        model.zero_grad(set_to_none=True)
        model(*global_batch(case, 0, k - 1)).backward()
        extra["last"] = gradients()
    model.zero_grad(set_to_none=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    grads = []
    for step in range(case["steps"]):
        for micro in range(k):   # autograd adds each micro-batch's gradient to .grad
            model(*global_batch(case, step, micro)).backward()
        grads.append(gradients())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return dict(init=init, outputs=outputs, local=local, grads=grads, **extra,
                params={name: p.detach().clone() for name, p in model.named_parameters()})

