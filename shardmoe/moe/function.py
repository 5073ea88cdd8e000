"""FusedMoE: the autograd.Function of one MoE layer, with an explicit backward.

Forward (S tokens, H hidden, E experts, k top-k, N kept pairs; on the kernel path,
kernels.fused_path, the gather, y and the combine live inside two fused GEMMs and backward's
stages 1-3 fuse likewise: shardmoe/kernels/layer_path.py):
  route x [S, H] -> weights w [S, k], pairs sorted by expert (row_pair [N])
  xs = x[token of each row]                      [N, H]   (gathered, not saved)
  y  = expert_forward(xs)                        [N, H]
  out_t = sum_j w_tj y_j(x_t)                    [S, H]
  out_t += s_t shared(x_t)                       [S, H]   (shared_ffn_size > 0: moe/shared_experts.py)
  loss  = aux_coef * aux + z_coef * z            scalar

Backward, the six stages of design.md section 4, in order:
  1 grad_combine   2 grad_gate_combine   3 grad_post_gemm   4 grad_pre_gemm
  5 grad_input_combine   6 grad_gate_gemm
The shared expert's own stages 3, 2, 4 and its gate's gradient run beside 3-5 and add into dx.

Saved for backward (all through ctx.save_for_backward, so saved-tensor hooks see them):
  x [S, H]; routing: probs [S, E], logsumexp [S], top_idx [S, k] int64, top_prob [S, k],
  weight [S, k] (acc dtype), per-expert counts [E] x2, row_pair [N] int64, and the router
  options' extras (routing.Routing: empty unless a sigmoid z loss or the sequence-wise loss asks);
  "glu": h [N, 2F];  "mlp": z1 [N, P], z2 [N, H];  shared expert: h_shared [S, 2Fs], s [S].
  Per token that is H + k*2F (glu) elements of the input dtype plus 4E + 4 + 24k bytes of
  routing state (fp32 acc): see docs/moe.md. The expert output y is not saved:
  "glu" takes the gate dot product as (g Wdown) . a, "mlp" recomputes act_out(z2).
"""
from __future__ import annotations

import functools
from dataclasses import fields

import torch

from shardmoe.moe import backends
from shardmoe.moe import experts as ex
from shardmoe.moe import shared_experts as shared_ex
from shardmoe.moe.config import MoEConfig
from shardmoe.moe.routing import Routing, balance_loss, grad_gate_from_rows, route
from shardmoe.moe.workspace import Workspace, empty_rows


def expert_param_names(config: MoEConfig) -> tuple[str, ...]:
    """Names of the expert parameters, in the order FusedMoE.apply takes them (the glu biases only
    with config.bias; the "mlp" b1, b2 always, None without bias)."""
    if config.expert == "glu":
        return ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias") if config.bias \
            else ("gate_up_proj", "down_proj")
    return ("w1", "b1", "w2", "b2")


class _SecondDerivative(torch.autograd.Function):
    """Identity on a first backward's gradients, whose own backward (the second derivative) raises."""

    @staticmethod
    def forward(ctx, where: str, *grads):
        ctx.where = where
        return grads

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(
            f"{ctx.where}: the fused MoE backward is not twice differentiable: its explicit backward is "
            "not built from autograd ops, so a double backward through shardmoe.MoE (a gradient penalty, "
            "torch.autograd.grad(..., create_graph=True) then backward) has no correct result")


def not_twice_differentiable(backward):
    """Decorator for an explicit autograd.Function backward that has no second derivative.

    Like torch.autograd.function.once_differentiable, the backward runs without recording a graph
    and, under create_graph=True, its gradients come out of a node that raises when differentiated.
    Unlike it, the node is attached whenever the Function had an input needing a gradient, not only
    when the incoming gradients require grad: the first-order gradients depend on the saved inputs
    and weights, so a penalty on them would otherwise get a silently wrong (zero) second derivative."""

    @functools.wraps(backward)
    def wrapper(ctx, *grad_outputs):
        with torch.no_grad():
            grads = backward(ctx, *grad_outputs)
        if not torch.is_grad_enabled() or not any(ctx.needs_input_grad):
            return grads
        tensors = [i for i, g in enumerate(grads) if g is not None]
        # detached leaves that require grad, so the raising node gets an edge to hang on
        wrapped = _SecondDerivative.apply(backward.__qualname__,
                                          *(grads[i].detach().requires_grad_() for i in tensors))
        out = list(grads)
        for i, g in zip(tensors, wrapped):
            out[i] = g
        return tuple(out)

    return wrapper


def expert_groups(counts: torch.Tensor, dtype: torch.dtype, workspace: Workspace | None) -> ex.Groups:
    """The expert groups of counts [E] kept rows, tile-padded (ex.Groups.row_tile) when the rows
    live in workspace buffers, which carry the slack: the workspace's row_tile, or when that is
    None the measured rule ex.row_tile_for."""
    if workspace is None:
        return ex.Groups.from_counts(counts)
    tile = workspace.row_tile if workspace.row_tile is not None else ex.row_tile_for(dtype, counts)
    return ex.Groups.from_counts(counts, tile)


def gather_rows(tokens: torch.Tensor, row_token: torch.Tensor, workspace: Workspace | None) -> torch.Tensor:
    """tokens[row_token]: [S, D], [N] -> [N, D], into a workspace buffer when one is given."""
    out = empty_rows(workspace, (row_token.shape[0], tokens.shape[1]), tokens)
    return torch.index_select(tokens, 0, row_token, out=out)


class FusedMoE(torch.autograd.Function):
    """apply(x [S, H], config, stats: dict, workspace or None, correction_bias [E] or None,
    token_sequence [S] or None, gate_weight [H, E], gate_bias [E] or None, *expert params,
    *shared params) -> (out [S, H], loss [])

    `stats` is filled in place with this forward's routing statistics. `workspace`
    (shardmoe/moe/workspace.py) supplies the large row buffers of forward and backward, None
    allocates them fresh. correction_bias and token_sequence steer the selection and the
    sequence-wise loss and get no gradient. The stages run on the backend backends.select() picks
    here, and backward uses the same one."""

    @staticmethod
    def forward(ctx, x, config: MoEConfig, stats: dict, workspace: Workspace | None, correction_bias, token_sequence,
                gate_weight, gate_bias, *weights):
        num_tokens, k = x.shape[0], config.top_k
        backend = backends.select(config, x, workspace)
        routing = route(x, gate_weight, config, gate_bias, correction_bias, token_sequence)
        expert_weights, shared_weights = split_weights(config, weights)
        params = dict(zip(expert_param_names(config), expert_weights))
        groups = expert_groups(routing.kept_per_expert, x.dtype, backend.workspace)
        row_token, weight_rows = routing.rows(k)
        if backend.fused_gather:  # no x[row_token], no stored y: kernels/layer_path.py
            out, saved = backend.expert_forward_combine(config.expert, config.expert_activation,
                                                        config.output_activation, x, row_token, weight_rows,
                                                        routing.row_pair, params, groups, k)
        else:
            y, saved = backend.expert_forward(config.expert, config.expert_activation, config.output_activation,
                                              gather_rows(x, row_token, backend.workspace), params, groups)
            out = backend.combine(y, weight_rows, routing.row_pair, num_tokens, k)
        shared_saved = ()
        if shared_weights:
            shared = shared_ex.named_shared_params(config, shared_weights)
            shared_out, shared_saved = shared_ex.forward(x, shared, config)
            out = out + shared_out  # both in the acc dtype: one rounding below
        out = out.to(x.dtype)
        loss = balance_loss(routing, config)
        stats.update(
            tokens_per_expert=routing.kept_per_expert,
            selected_per_expert=routing.selected_per_expert,
            dropped_tokens=routing.dropped_pairs,
            capacity=config.capacity(num_tokens),
        )
        ctx.config, ctx.backend = config, backend
        ctx.save_for_backward(
            x, gate_weight, gate_bias, *weights,
            *routing.tensors(), *shared_saved, *saved,
        )
        return out, loss

    @staticmethod
    @not_twice_differentiable
    def backward(ctx, grad_out, grad_loss):
        config: MoEConfig = ctx.config
        backend = ctx.backend
        n_weights = len(expert_param_names(config)) + len(shared_ex.shared_param_names(config))
        x, gate_weight, gate_bias, *rest = ctx.saved_tensors
        (expert_weights, shared_weights), rest = split_weights(config, rest[:n_weights]), rest[n_weights:]
        n_routing = len(fields(Routing))
        routing, rest = Routing(*rest[:n_routing]), rest[n_routing:]
        shared_saved, saved = (rest[:2], rest[2:]) if shared_weights else ((), rest)
        params = dict(zip(expert_param_names(config), expert_weights))
        num_tokens, k = x.shape[0], config.top_k
        groups = expert_groups(routing.kept_per_expert, x.dtype, backend.workspace)
        row_token, weight_rows = routing.rows(k)
        # stages 1-4 (for "glu": 1 and 3 with w on both sides of the Wdown GEMM, 2 on (g Wdown, a))
        if backend.fused_gather:  # the kernels read grad_out and x through row_token: no gathered copies
            grad_xs, grad_weight_rows, grads = backend.expert_backward(
                config.expert, config.expert_activation, config.output_activation, grad_out.contiguous(),
                weight_rows, x, saved, params, groups, row_index=row_token)
        else:
            grad_xs, grad_weight_rows, grads = backend.expert_backward(
                config.expert, config.expert_activation, config.output_activation,
                gather_rows(grad_out.contiguous(), row_token, backend.workspace), weight_rows,
                gather_rows(x, row_token, backend.workspace), saved, params, groups)
        grad_x = backend.grad_input_combine(grad_xs, routing.row_pair, num_tokens, k)
        grad_x_gate, grad_gate, grad_gate_bias = grad_gate_from_rows(x, gate_weight, routing, grad_weight_rows,
                                                                     grad_loss, config)
        grad_x = grad_x + grad_x_gate
        shared_grads = []
        if shared_weights:
            shared_params = shared_ex.named_shared_params(config, shared_weights)
            grad_x_shared, named = shared_ex.backward(grad_out.contiguous(), x, shared_saved, shared_params, config)
            grad_x = grad_x + grad_x_shared
            shared_grads = [named[n] for n in shared_params]
        grad_x = grad_x.to(x.dtype)
        expert_grads = [None if g is None else g.to(p.dtype)
                        for g, p in zip((grads[n] for n in expert_param_names(config)), expert_weights)]
        grad_gate_bias = None if gate_bias is None else grad_gate_bias.to(gate_bias.dtype)
        return (grad_x, None, None, None, None, None, grad_gate.to(gate_weight.dtype), grad_gate_bias,
                *expert_grads, *shared_grads)


def split_weights(config: MoEConfig, weights) -> tuple[tuple, tuple]:
    """(routed expert weights, shared expert weights) of the weights FusedMoE.apply takes."""
    n_expert = len(expert_param_names(config))
    return tuple(weights[:n_expert]), tuple(weights[n_expert:])
