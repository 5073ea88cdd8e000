"""The processors' task bodies: what one tile task computes, on real tensors.

Every formula is the fused layer's own (shardmoe.moe): a task calls the stage function on its
tile's slices. Column tile n covers cols = [n*block_n, (n+1)*block_n) of the tiled dim; a row
tile has m rows of one expert e (local index le on its device), so the one-expert weight slice
W[e:e+1] with Groups((m,)) turns the grouped stage functions into tile functions.

  preGEMM   n over P:  z1[:, c] = x W1[e, c]^T + b1[e, c];  a1[:, c] = act(z1[:, c])
            ("glu": h[:, c], h[:, F+c] from Wgu, a[:, c] = act(hg) * hu)
  postGEMM  n over H:  z2[:, c] = a1 W2[e, c]^T + b2[e, c];  y[:, c] = act_out(z2[:, c])
  combine   n over H:  out[t, c] += w * y[:, c]
  gradCombine      n over H:  ge[:, c] = w g[:, c]                           (stage 1)
  gradGateCombine  one per row tile:  dw = g . act_out(z2)  [m]             (stage 2)
  gradPostGEMM     n over P:  da1[:, c], dW2[e][:, c], db2[e] (n = 0)        (stage 3)
  gradPreGEMM      n over H:  dx[:, c], dW1[e][:, c], db1[e] (n = 0)         (stage 4)
  gradInputCombine n over H:  grad_x[t, c] += dx[:, c]                       (stage 5)
  gradGateGEMM     n over H:  dlogits of the tile's tokens; grad_x[t, c] += dlogits Wg[c]^T,
                              dWg[c] += x[t, c]^T dlogits                    (stage 6)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from shardmoe.moe import combine as comb
from shardmoe.moe import experts as ex
from shardmoe.moe.activations import activate
from shardmoe.moe.routing import Routing, grad_gate_gemm
from shardmoe.tasks.memory import Memory
from shardmoe.tasks.plan import Plan, Ref, Task, TaskType


@dataclass
class KernelContext:
    """What every task body may read besides its operands: the plan, the memory, the layer's
    parameters (detached, full [E, ...] tensors; a device touches only its experts' slices) and
    dL/d(aux loss)."""

    plan: Plan
    memory: Memory
    params: dict[str, torch.Tensor | None]
    grad_loss: torch.Tensor | None = None


def _one_expert(m: int) -> ex.Groups:
    return ex.Groups.from_counts(torch.tensor([m]))


def _add_expert_grad(ctx: KernelContext, ref: Ref, name: str, local_expert: int, index, value) -> None:
    ctx.memory[Ref(ref.device, ref.name, name)][local_expert][index] += value


# --- forward -----------------------------------------------------------------------------------
def pre_gemm(task: Task, ctx: KernelContext) -> None:
    cfg, tile, mem, op = ctx.plan.config, ctx.plan.row_tile_of(task), ctx.memory, task.operands
    cols = ctx.plan.columns(task.tile_idx, cfg.ffn_size)
    xs, e, groups = mem[op["x"]], tile.expert, _one_expert(tile.size)
    if cfg.expert == "glu":
        both = torch.cat([torch.arange(cfg.ffn_size)[cols], cfg.ffn_size + torch.arange(cfg.ffn_size)[cols]])
        h = ex.grouped_linear(xs, ctx.params["gate_up_proj"][e:e + 1, both], groups)
        a, _ = ex.glu_activation(h, cfg.activation)
        width = cols.stop - cols.start
        mem[op["z"]][:, cols] = h[:, :width]
        mem[op["z"]][:, cfg.ffn_size + cols.start:cfg.ffn_size + cols.stop] = h[:, width:]
    else:
        z1 = ex.grouped_linear(xs, ctx.params["w1"][e:e + 1, cols], groups)
        if ctx.params["b1"] is not None:
            z1 = z1 + ctx.params["b1"][e, cols]
        a = activate(cfg.activation, z1)
        mem[op["z"]][:, cols] = z1
    mem[op["a"]][:, cols] = a


def post_gemm(task: Task, ctx: KernelContext) -> None:
    cfg, tile, mem, op = ctx.plan.config, ctx.plan.row_tile_of(task), ctx.memory, task.operands
    cols = ctx.plan.columns(task.tile_idx, cfg.hidden_size)
    e, groups = tile.expert, _one_expert(tile.size)
    name, bias = ("down_proj", None) if cfg.expert == "glu" else ("w2", ctx.params["b2"])
    z2 = ex.grouped_linear(mem[op["a"]], ctx.params[name][e:e + 1, cols], groups)
    if bias is not None:
        z2 = z2 + bias[e, cols]
    mem[op["z2"]][:, cols] = z2
    mem[op["y"]][:, cols] = activate(cfg.output_activation, z2)


def combine(task: Task, ctx: KernelContext) -> None:
    tile, mem, op = ctx.plan.row_tile_of(task), ctx.memory, task.operands
    cols = ctx.plan.columns(task.tile_idx, ctx.plan.config.hidden_size)
    rows = ctx.plan.local_tokens(tile.tokens, task.peer)
    mem[op["out"]][rows, cols] += comb.scale_rows(mem[op["y"]][:, cols], tile.weight)


# --- backward ----------------------------------------------------------------------------------
def grad_combine(task: Task, ctx: KernelContext) -> None:
    tile, mem, op = ctx.plan.row_tile_of(task), ctx.memory, task.operands
    cols = ctx.plan.columns(task.tile_idx, ctx.plan.config.hidden_size)
    mem[op["out"]][:, cols] = comb.grad_combine(mem[op["g"]][:, cols], tile.weight)


def grad_gate_combine(task: Task, ctx: KernelContext) -> None:
    """Writes the tile's dots into the token device's gate_dots (P2P store) or into a heap cell
    that the token device's subscriber scatters (remote)."""
    cfg, tile, mem, op = ctx.plan.config, ctx.plan.row_tile_of(task), ctx.memory, task.operands
    dots = comb.grad_gate_combine(mem[op["g"]], activate(cfg.output_activation, mem[op["z2"]]))
    if op["out"].name == "gate_dots":
        mem[op["out"]][ctx.plan.local_tokens(tile.tokens, task.peer), tile.pairs % cfg.top_k] = dots
    else:
        mem[op["out"]] = dots


def grad_post_gemm(task: Task, ctx: KernelContext) -> None:
    cfg, tile, mem, op = ctx.plan.config, ctx.plan.row_tile_of(task), ctx.memory, task.operands
    cols = ctx.plan.columns(task.tile_idx, cfg.ffn_size)
    e, le, groups = tile.expert, tile.local_expert, _one_expert(tile.size)
    ge, a = mem[op["ge"]], mem[op["a"]][:, cols]
    if cfg.expert == "glu":
        # ge already carries w, so the stage function gets unit weights: w (g Wdown) = (w g) Wdown.
        grad_a, grad_down, _ = ex.grad_post_gemm_glu(ge, ge.new_ones(tile.size), a,
                                                     ctx.params["down_proj"][e:e + 1, :, cols], groups)
        _add_expert_grad(ctx, op["dw"], "down_proj", le, (slice(None), cols), grad_down[0])
    else:
        has_bias = ctx.params["b2"] is not None and task.tile_idx == 0
        grad_a, grad_w2, grad_b2 = ex.grad_post_gemm_mlp(ge, mem[op["z2"]], a, ctx.params["w2"][e:e + 1, :, cols],
                                                         has_bias, groups, cfg.output_activation)
        _add_expert_grad(ctx, op["dw"], "w2", le, (slice(None), cols), grad_w2[0])
        if has_bias:
            _add_expert_grad(ctx, op["dw"], "b2", le, slice(None), grad_b2[0])
    mem[op["out"]][:, cols] = grad_a


def grad_pre_gemm(task: Task, ctx: KernelContext) -> None:
    cfg, tile, mem, op = ctx.plan.config, ctx.plan.row_tile_of(task), ctx.memory, task.operands
    cols = ctx.plan.columns(task.tile_idx, cfg.hidden_size)
    e, le, groups = tile.expert, tile.local_expert, _one_expert(tile.size)
    grad_a, z, xs = mem[op["grad"]], mem[op["z"]], mem[op["x"]][:, cols]
    if cfg.expert == "glu":
        _, act_gate = ex.glu_activation(z, cfg.activation)
        grad_x, grad_gu = ex.grad_pre_gemm_glu(grad_a, z, act_gate, xs, ctx.params["gate_up_proj"][e:e + 1, :, cols],
                                               groups, cfg.activation)
        _add_expert_grad(ctx, op["dw"], "gate_up_proj", le, (slice(None), cols), grad_gu[0])
    else:
        has_bias = ctx.params["b1"] is not None and task.tile_idx == 0
        grad_x, grad_w1, grad_b1 = ex.grad_pre_gemm_mlp(grad_a, z, xs, ctx.params["w1"][e:e + 1, :, cols], has_bias,
                                                        groups, cfg.activation)
        _add_expert_grad(ctx, op["dw"], "w1", le, (slice(None), cols), grad_w1[0])
        if has_bias:
            _add_expert_grad(ctx, op["dw"], "b1", le, slice(None), grad_b1[0])
    mem[op["out"]][:, cols] = grad_x


def grad_input_combine(task: Task, ctx: KernelContext) -> None:
    """Pure accumulation: gradCombine already applied w (no probability scaling here)."""
    tile, mem, op = ctx.plan.row_tile_of(task), ctx.memory, task.operands
    cols = ctx.plan.columns(task.tile_idx, ctx.plan.config.hidden_size)
    mem[op["out"]][ctx.plan.local_tokens(tile.tokens, task.peer), cols] += mem[op["src"]][:, cols]


def _token_routing(routing: Routing, tokens: torch.Tensor) -> Routing:
    """The routing rows of a token subset; per-expert counts stay global (the aux loss uses them)."""
    return Routing(routing.probs[tokens], routing.logsumexp[tokens], routing.top_idx[tokens],
                   routing.top_prob[tokens], routing.weight[tokens], routing.selected_per_expert,
                   routing.kept_per_expert, routing.row_pair[:0])


def grad_gate_gemm_tile(task: Task, ctx: KernelContext) -> None:
    """Column tile n of the gate backward for the tokens in operands["tokens"] (global indices, all
    homed on task.peer); reads their gate dots, which must hold every kept pair's dw by now."""
    plan, mem, op = ctx.plan, ctx.memory, task.operands
    tokens = op["tokens"]
    if tokens.numel() == 0:
        return
    cols = plan.columns(task.tile_idx, plan.config.hidden_size)
    rows = plan.local_tokens(tokens, task.peer)
    grad_x, grad_gate = grad_gate_gemm(mem[op["x"]][rows][:, cols], ctx.params["gate_weight"][cols],
                                       _token_routing(plan.routing, tokens), mem[op["dots"]][rows],
                                       ctx.grad_loss, plan.config, num_tokens=plan.num_tokens)
    mem[op["out"]][rows, cols] += grad_x.to(mem[op["out"]].dtype)
    mem[op["dwg"]][cols] += grad_gate.to(mem[op["dwg"]].dtype)


KERNELS = {
    TaskType.preGEMM: pre_gemm,
    TaskType.postGEMM: post_gemm,
    TaskType.combine: combine,
    TaskType.gradCombine: grad_combine,
    TaskType.gradGateCombine: grad_gate_combine,
    TaskType.gradPostGEMM: grad_post_gemm,
    TaskType.gradPreGEMM: grad_pre_gemm,
    TaskType.gradInputCombine: grad_input_combine,
    TaskType.gradGateGEMM: grad_gate_gemm_tile,
}
