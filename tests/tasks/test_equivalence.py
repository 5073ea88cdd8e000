"""The tile-task runtime equals the MoE layer (float64, 1e-12 relative) under every schedule:
11 configurations x 52 schedules (FIFO, LIFO, 50 seeded random orders with 1 to 5 processors per
device) = 572 backward schedules, plus 5 forward schedules per configuration."""
import pytest
import torch

import shardmoe
from shardmoe.tasks import run_backward, run_forward
from shardmoe.tasks.plan import backward_task_counts, forward_task_counts

# (layer options, top_k, experts, tokens (a count, or the leading shape of x), schedule options)
CASES = {
    "mlp-k1-single": (dict(expert="mlp", activation="relu"), 1, 4, 12, dict(peers=1, block_m=4, block_n=4)),
    "mlp-k2-bias-p2p": (dict(expert="mlp", bias=True, activation="gelu", output_activation="silu"), 2, 4, 12,
                        dict(peers=2, block_m=3, block_n=4)),
    "mlp-k3-drops-aux-z-mixed": (dict(expert="mlp", bias=True, activation="silu", capacity_factor=0.5,
                                      aux_loss_coef=0.3, z_loss_coef=0.2), 3, 8, 16,
                                 dict(peers=4, ranks_per_node=2, block_m=2, block_n=4)),
    "mlp-k4-no-renorm-remote": (dict(expert="mlp", activation="gelu_tanh", renormalize=False, capacity_factor=1.0,
                                     aux_loss_coef=0.1), 4, 4, 12, dict(peers=4, ranks_per_node=1, block_m=2,
                                                                        block_n=3)),
    "glu-k2-remote": (dict(expert="glu", activation="silu"), 2, 4, 12, dict(peers=2, ranks_per_node=1, block_m=3,
                                                                             block_n=4)),
    "glu-k4-drops-aux-z-mixed": (dict(expert="glu", activation="gelu_tanh", capacity_factor=0.4, aux_loss_coef=0.2,
                                      z_loss_coef=0.1), 4, 8, 16, dict(peers=4, ranks_per_node=2, block_m=2,
                                                                       block_n=4)),
    "glu-k1-no-renorm-z": (dict(expert="glu", activation="relu", renormalize=False, z_loss_coef=0.3), 1, 4, 12,
                           dict(peers=4, block_m=2, block_n=8)),
    "mlp-k2-uneven-nodes": (dict(expert="mlp", activation="identity", output_activation="gelu", bias=True,
                                 capacity_factor=0.3, aux_loss_coef=0.5), 2, 4, 13,
                            dict(peers=4, ranks_per_node=3, block_m=3, block_n=5)),
    "glu-k3-three-peers": (dict(expert="glu", activation="gelu", z_loss_coef=0.05), 3, 6, 14,
                           dict(peers=3, ranks_per_node=2, block_m=4, block_n=3)),
    # every router option: sigmoid, both biases, 4 groups choose 2, epsilon, scaling, all three losses
    # over 2 sequences of 8 tokens, drops
    "glu-k2-sigmoid-groups-mixed": (dict(expert="glu", activation="silu", score_func="sigmoid", router_bias=True,
                                         correction_bias=True, n_group=4, topk_group=2, renormalize_epsilon=1e-20,
                                         routed_scaling_factor=2.5, capacity_factor=0.8, aux_loss_coef=0.2,
                                         z_loss_coef=0.1, seq_aux_loss_coef=0.3), 2, 8, (2, 8),
                                    dict(peers=4, ranks_per_node=2, block_m=3, block_n=4)),
    # GPT-OSS's experts: both glu biases, the clamped SwiGLU (limit 1.5 against h ~ N(0, 8): both clamps
    # act), its router bias; two column tiles each way, so only column tile 0 may commit the bias gradients
    "glu-k2-bias-clamped-remote": (dict(expert="glu", bias=True, activation="clamped_swiglu", swiglu_limit=1.5,
                                       router_bias=True, capacity_factor=0.8, aux_loss_coef=0.1), 2, 4, 10,
                                  dict(peers=2, ranks_per_node=1, block_m=3, block_n=4)),
    # sigmoid, group-limited, correction bias, a gated shared expert (beside the schedule)
    "glu-k2-sigmoid-groups-shared": (dict(expert="glu", activation="silu", score_func="sigmoid", correction_bias=True,
                                          n_group=4, topk_group=2, routed_scaling_factor=2.5, aux_loss_coef=0.2,
                                          shared_ffn_size=10, shared_gate=True), 2, 8, 12,
                                     dict(peers=2, ranks_per_node=1, block_m=3, block_n=4)),
}
SCHEDULES = [("fifo", 0, 4), ("lifo", 0, 2)] + [("random", seed, 1 + seed % 5) for seed in range(50)]
HIDDEN, FFN = 8, 6


def _setup(name):
    options, top_k, experts, tokens, schedule = CASES[name]
    torch.manual_seed(sum(map(ord, name)))
    layer = shardmoe.MoE(HIDDEN, FFN, experts, top_k, dtype=torch.float64, **options)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_()
        if layer.correction_bias is not None:
            layer.correction_bias.normal_(0, 0.2)
    shape = (*tokens, HIDDEN) if isinstance(tokens, tuple) else (tokens, HIDDEN)
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(shape, dtype=torch.float64)
    return layer, x, grad_out, schedule


def _close(got, want, what):
    scale = want.abs().max().item()
    diff = (got - want).abs().max().item()
    assert diff <= 1e-12 * scale, f"{what}: max difference {diff:.3e} at scale {scale:.3e}"


@pytest.mark.parametrize("name", list(CASES))
def test_forward_and_backward_equal_the_layer_under_every_schedule(name):
    layer, x, grad_out, schedule = _setup(name)
    out = layer(x)
    params = dict(layer.named_parameters())
    want = torch.autograd.grad((out * grad_out).sum() + layer.aux_loss, [x, *params.values()])
    want = dict(zip(["grad_input", *params], want))
    forward = None
    for scheduler, seed, processors in SCHEDULES[:5]:
        fwd = run_forward(layer, x, scheduler=scheduler, seed=seed, processors=processors, **schedule)
        _close(fwd.output, out.detach(), f"output ({scheduler} {seed})")
        assert fwd.counts == {str(k): v for k, v in forward_task_counts(fwd.plan).items()}
        forward = forward or fwd
    assert forward.aux_loss.item() == pytest.approx(layer.aux_loss.item(), rel=1e-14, abs=0)
    for scheduler, seed, processors in SCHEDULES:
        bwd = run_backward(layer, x, grad_out, scheduler=scheduler, seed=seed, processors=processors,
                           forward=forward, **schedule)
        tag = f"{name} {scheduler} seed={seed} processors={processors}"
        _close(bwd.grad_input, want["grad_input"], f"grad_input ({tag})")
        assert bwd.grads.keys() == params.keys()
        for pname in params:
            _close(bwd.grads[pname], want[pname], f"{pname} ({tag})")
        assert bwd.counts == {str(k): v for k, v in backward_task_counts(forward.plan).items()}


def test_configurations_cover_drops_fully_dropped_tokens_and_both_paths():
    """The cases above exercise what they claim: capacity drops (including tokens that lose every
    pair and so get only the aux/z-loss gate gradient), P2P-only and remote peers, both clamps."""
    layer, x, _, schedule = _setup("mlp-k2-uneven-nodes")
    plan = run_forward(layer, x, **schedule).plan
    assert plan.routing.dropped_pairs > 0 and bool((plan.kept_pairs == 0).any())
    remote_share = {}
    for name in CASES:
        layer, x, _, schedule = _setup(name)
        plan = run_forward(layer, x, **schedule).plan
        remote_share[name] = sum(plan.is_remote(t.device, t.peer) for t in plan.row_tiles) / len(plan.row_tiles)
    assert remote_share["mlp-k1-single"] == remote_share["mlp-k2-bias-p2p"] == remote_share["glu-k1-no-renorm-z"] == 0
    assert remote_share["mlp-k4-no-renorm-remote"] >= 0.5 and remote_share["glu-k2-remote"] >= 0.25
    assert 0 < remote_share["mlp-k3-drops-aux-z-mixed"] < 1 and 0 < remote_share["glu-k3-three-peers"] < 1
    layer, x, _, _ = _setup("glu-k2-bias-clamped-remote")
    h = torch.einsum("sh,efh->sef", x.detach(), layer.gate_up_proj.detach()) + layer.gate_up_proj_bias.detach()
    assert (h[..., :FFN] > 1.5).any() and (h[..., FFN:].abs() > 1.5).any() and (h.abs() < 1.5).any()


def test_run_backward_without_a_forward_result_and_without_the_aux_term():
    """The one-call API plans its own forward; grad_loss=0 drops the aux/z term from the objective."""
    layer, x, grad_out, schedule = _setup("mlp-k3-drops-aux-z-mixed")
    layer.aux_loss_scale = 0.0  # the layer's objective without the aux term too
    out = layer(x)
    params = dict(layer.named_parameters())
    want = torch.autograd.grad((out * grad_out).sum(), [x, *params.values()])
    bwd = run_backward(layer, x.view(2, 8, HIDDEN), grad_out.view(2, 8, HIDDEN), grad_loss=0.0, seed=7, **schedule)
    assert bwd.grad_input.shape == (2, 8, HIDDEN)
    _close(bwd.grad_input.view(-1, HIDDEN), want[0], "grad_input")
    for pname, w in zip(params, want[1:]):
        _close(bwd.grads[pname], w, pname)
    with pytest.raises(ValueError, match="block_m: the forward result was planned with 2, got 8"):
        run_backward(layer, x, grad_out, forward=bwd.forward, peers=4, ranks_per_node=2)
