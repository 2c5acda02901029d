"""Memory accounting: known sizes, storages counted once, tied embeddings, activations, ZeRO formulas."""

import pytest
import torch
import torch.nn as nn

from utils.memory import (format_bytes, gradient_bytes, memory_by_category, naive_bytes,
                          optimizer_state_bytes, parameter_bytes, saved_activations,
                          unique_storage_bytes, zero_model_state_bytes)
from utils.model import GPT, GPTConfig


def test_known_tensor_sizes():
    assert unique_storage_bytes([torch.zeros(1000)]) == 4000
    assert unique_storage_bytes([torch.zeros(1000, dtype=torch.float16)]) == 2000
    assert unique_storage_bytes([torch.zeros(10, 10, dtype=torch.float64)]) == 800
    assert unique_storage_bytes([torch.zeros(1000), torch.zeros(1000)]) == 8000   # two storages


def test_views_share_one_storage():
    x = torch.zeros(1000)
    view = x[10:20]
    assert unique_storage_bytes([x, view, x.view(10, 100), x]) == 4000
    assert naive_bytes([x, view]) == 4040
    assert unique_storage_bytes([view]) == 4000      # a view keeps its whole storage alive


def test_parameters_gradients_and_adamw_state_of_a_linear_layer():
    torch.manual_seed(0)
    layer = nn.Linear(10, 20)                        # 200 + 20 = 220 floats
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    assert parameter_bytes(layer) == 880
    assert gradient_bytes(layer) == 0 and optimizer_state_bytes(opt) == 0
    layer(torch.randn(3, 10)).sum().backward()
    assert gradient_bytes(layer) == 880
    opt.step()
    # exp_avg + exp_avg_sq per parameter, plus one float32 `step` scalar per tensor
    assert optimizer_state_bytes(opt) == 2 * 880 + 2 * 4
    opt.zero_grad(set_to_none=True)
    assert gradient_bytes(layer) == 0


def test_tied_embeddings_are_counted_once():
    cfg = dict(vocab_size=50, block_size=16, n_layer=1, n_head=2, n_embd=32)
    torch.manual_seed(0)
    tied = GPT(GPTConfig(**cfg, tie_embeddings=True))
    torch.manual_seed(0)
    untied = GPT(GPTConfig(**cfg, tie_embeddings=False))
    shared = 50 * 32 * 4
    assert parameter_bytes(tied) == 4 * tied.num_params()
    # state_dict lists the shared matrix twice; numel x bytes double-counts it
    assert naive_bytes(tied.state_dict().values()) == parameter_bytes(tied) + shared
    assert unique_storage_bytes(tied.state_dict().values()) == parameter_bytes(tied)
    assert parameter_bytes(untied) - parameter_bytes(tied) == shared


def test_saved_activations_skip_parameters_and_count_each_storage_once():
    torch.manual_seed(0)
    layer = nn.Linear(100, 10)
    x = torch.randn(32, 100, requires_grad=True)
    with saved_activations(layer) as acts:
        layer(x)                                     # saves x (for the weight gradient) and the weight (for x's)
    assert acts.num_saved == 2
    assert acts.bytes == 32 * 100 * 4                # the weight is a parameter, not an activation
    with saved_activations() as everything:
        layer(x)
    assert everything.bytes == 32 * 100 * 4 + 10 * 100 * 4

    a = torch.randn(256, requires_grad=True)
    with saved_activations() as acts:
        y = a.exp()                                  # exp saves its output y
        y.sin() + y.cos()                            # both save their input y: still one storage
    assert acts.num_saved == 3
    assert acts.bytes == 256 * 4


def test_memory_by_category_and_format():
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.zeros(2, 8, dtype=torch.long)
    with saved_activations(model) as acts:
        loss = model(x, x)
    loss.backward()
    opt.step()
    mem = memory_by_category(model, opt, acts.bytes)
    n = model.num_params()
    assert mem["parameters"] == mem["gradients"] == 4 * n
    assert mem["optimizer state"] == 8 * n + 4 * len(list(model.parameters()))
    assert mem["activations"] == acts.bytes > 0
    assert mem["buffers"] == 2 * 32 * 32             # one bool causal mask per layer
    assert format_bytes(512) == "512 B" and format_bytes(1536) == "1.50 KiB"
    assert format_bytes(3 * 2**30) == "3.00 GiB"


def test_saved_activations_by_dtype():
    torch.manual_seed(0)
    emb, layer = nn.Embedding(10, 4), nn.Linear(4, 3)
    ids = torch.zeros(5, dtype=torch.long)
    with saved_activations(emb, layer) as acts:
        layer(emb(ids))                              # embedding saves the int64 ids, linear its float input
    assert acts.bytes_by_dtype == {"int64": 5 * 8, "float32": 5 * 4 * 4}
    assert sum(acts.bytes_by_dtype.values()) == acts.bytes


def test_zero_model_state_bytes_hand_computed():
    # Ψ = 1000 parameters on N = 8 ranks, mixed-precision Adam (2 + 2 + 12 bytes per parameter)
    assert zero_model_state_bytes(1000, 8, 0) == 16_000                 # DDP: 16 Ψ
    assert zero_model_state_bytes(1000, 8, 1) == 4_000 + 1_500          # 4Ψ + 12Ψ/8
    assert zero_model_state_bytes(1000, 8, 2) == 2_000 + 1_750          # 2Ψ + 14Ψ/8
    assert zero_model_state_bytes(1000, 8, 3) == 2_000                  # 16Ψ/8
    # the ZeRO paper's example: 7.5B parameters on 64 GPUs -> 120 GB, 31.4 GB, 16.6 GB, 1.875 GB
    psi = 7_500_000_000
    assert zero_model_state_bytes(psi, 64, 0) == 120e9
    assert zero_model_state_bytes(psi, 64, 1) == 30e9 + 1.40625e9
    assert zero_model_state_bytes(psi, 64, 2) == 15e9 + 1.640625e9
    assert zero_model_state_bytes(psi, 64, 3) == 1.875e9
    # fp32 Adam on a CPU (4 + 4 + 8), N = 4, a size N does not divide
    fp32 = dict(param_bytes=4, grad_bytes=4, optimizer_bytes_per_param=8)
    assert zero_model_state_bytes(10, 4, 0, **fp32) == 160
    assert zero_model_state_bytes(10, 4, 1, **fp32) == 80 + 20
    assert zero_model_state_bytes(10, 4, 2, **fp32) == 40 + 30
    assert zero_model_state_bytes(10, 4, 3, **fp32) == 40
    # one rank: nothing to shard, every stage is DDP
    assert {zero_model_state_bytes(1000, 1, s) for s in range(4)} == {16_000}


def test_zero_model_state_bytes_rejects_bad_arguments():
    with pytest.raises(ValueError):
        zero_model_state_bytes(1000, 8, 4)
    with pytest.raises(ValueError):
        zero_model_state_bytes(1000, 0, 1)
