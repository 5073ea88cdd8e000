"""The dense layers on a spawned gloo world of 4 ranks (d = 2 FSDP x t = 2 Megatron), float64.

Each rank shards the same full weights and batch, runs embedding -> RMSNorm -> attention ->
residual -> final RMSNorm -> unembedding + cross-entropy with the explicit backward and with
plain autograd through shardops' collectives, gathers the gradient shards back and compares them
with a single-process float64 autograd run of the same model.
"""
import torch

from shardmoe.mesh import Mesh
from shardmoe.model import (Attention, attention, embed, packed_layout, rms_norm, rope_table,
                            unembed_cross_entropy)
from shardmoe.notation import parse_spec
from shardmoe.parallel.shardops import all_gather, shard
from shardmoe.testing import run_distributed

V, M, Q, K, D, EPS, THETA = 16, 8, 2, 2, 4, 1e-5, 10000.0
SPECS = {"embed": "V/t M/d", "norm": "M/t/d", "w_q": "M/d Q K/t D", "w_kv": "2 M/d K/t D",
         "w_o": "M/d Q K/t D", "final_norm": "M/t/d", "unembed": "V/t M/d"}
UNSHARDED = {k: " ".join(parse_spec(spec).names) for k, spec in SPECS.items()}  # 'V/t M/d' -> 'V M'


def full_weights_and_batch():
    gen = torch.Generator().manual_seed(0)

    def randn(*shape, std):
        return torch.randn(*shape, dtype=torch.float64, generator=gen) * std

    weights = {"embed": randn(V, M, std=1.0), "norm": 1 + randn(M, std=0.3),
               "w_q": randn(M, Q, K, D, std=0.5), "w_kv": randn(2, M, K, D, std=0.5),
               "w_o": randn(M, Q, K, D, std=0.3), "final_norm": 1 + randn(M, std=0.3),
               "unembed": randn(V, M, std=0.5)}
    ids = torch.randint(0, V, (4, 9), generator=gen)
    targets = torch.randint(0, V, (4, 9), generator=gen)
    is_seq_start = torch.zeros(4, 9, dtype=torch.bool)
    is_seq_start[:, 0] = True
    is_seq_start[[0, 0, 1, 2, 3], [3, 4, 6, 2, 8]] = True
    return weights, ids, targets, is_seq_start


def loss_of(weights, ids, targets, is_seq_start, mesh, backward):
    layout = packed_layout(is_seq_start)
    rope = rope_table(layout.positions, D, THETA, torch.float64)
    x = embed(ids, weights["embed"], mesh, backward)
    nx = rms_norm(x, weights["norm"], EPS, mesh, backward)
    x = x + attention(nx, weights["w_q"], weights["w_kv"], weights["w_o"], layout.segment_ids, rope, mesh, backward)
    final = rms_norm(x, weights["final_norm"], EPS, mesh, backward)
    return unembed_cross_entropy(final, weights["unembed"], targets, mesh=mesh, backward=backward)


def relative_error(actual, expected):
    return ((actual - expected).norm() / expected.norm()).item()


def compare_on_rank():
    mesh = Mesh(dp=2, tp=2)
    weights, ids, targets, is_seq_start = full_weights_and_batch()
    reference = {k: w.clone().requires_grad_() for k, w in weights.items()}
    expected_loss = loss_of(reference, ids, targets, is_seq_start, None, "autograd")
    expected_loss.backward()

    local_batch = [shard("B L -> B/d L", t, mesh) for t in (ids, targets, is_seq_start)]
    errors = {}
    for backward in ("explicit", "autograd"):
        local = {k: shard(f"{UNSHARDED[k]} -> {SPECS[k]}", w, mesh).clone().requires_grad_()
                 for k, w in weights.items()}
        loss = loss_of(local, *local_batch, mesh, backward)
        loss.backward()
        errors[(backward, "loss")] = abs(loss.item() - expected_loss.item()) / expected_loss.item()
        with torch.no_grad():
            for k, w in local.items():
                grad = all_gather(f"{SPECS[k]} -> {UNSHARDED[k]}", w.grad, mesh)
                errors[(backward, k)] = relative_error(grad, reference[k].grad)
    module = Attention(M, Q * K, K, D, mesh=mesh)  # DTensors of the whole weights, this rank's blocks local
    shapes = {"whole": (tuple(module.w_q.shape), tuple(module.w_kv.shape)),
              "local": (tuple(module.w_q.to_local().shape), tuple(module.w_kv.to_local().shape))}
    return errors, shapes


def test_dp2_tp2_matches_single_process_float64():
    results = run_distributed(compare_on_rank, 4, timeout=240)
    for errors, shapes in results:
        assert shapes == {"whole": ((M, Q, K, D), (2, M, K, D)),
                          "local": ((M // 2, Q, K // 2, D), (2, M // 2, K // 2, D))}
        for (backward, name), err in errors.items():
            assert err <= 1e-10, (backward, name, err)
