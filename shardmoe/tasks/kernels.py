"""The processors' task bodies: what one tile task computes, on real tensors.

Every formula is the MoE layer's own (shardmoe.moe): a task calls the stage function on its
tile's slices, on torch's own row primitives (experts.TORCH_OPS). Column tile n covers
cols = [n*block_n, (n+1)*block_n) of the tiled dim; a row tile has m rows of one expert e (local
index le on its device), so the one-expert weight slice W[e:e+1] with Groups((m,)) turns the
grouped stage functions into tile functions. preGEMM and postGEMM call experts.pre_gemm and
experts.post_gemm, the two halves expert_forward composes, with the weight rows (and bias entries)
of their columns: expert_forward itself runs both GEMMs of whole rows, while a preGEMM tile owns
only columns c of z1.

A kernel is called when its task starts: it reads its inputs then and computes, and returns a
Commit that writes its outputs when the task ends. So a value that lands while a task runs is
not seen by it, as on a GPU (the gate-dependency race depends on this).

  preGEMM   n over P:  z1[:, c] = x W1[e, c]^T + b1[e, c];  a1[:, c] = act(z1[:, c])
            ("glu": h[:, c], h[:, F+c] from Wgu and bgu, a[:, c] = act(hg) * hu or the clamped SwiGLU)
  postGEMM  n over H:  z2[:, c] = a1 W2[e, c]^T + b2[e, c];  y[:, c] = act_out(z2[:, c])  ("glu": Wdown, bdown)
  combine   n over H:  out[t, c] += w * y[:, c]
  gradCombine      n over H:  ge[:, c] = w g[:, c]                           (stage 1)
  gradGateCombine  one per row tile:  dw = g . act_out(z2)  [m]             (stage 2)
  gradPostGEMM     n over P:  da1[:, c], dW2[e][:, c], db2[e] (n = 0)        (stage 3; glu: dbdown[e])
  gradPreGEMM      n over H:  dx[:, c], dW1[e][:, c], db1[e] (n = 0)         (stage 4; glu: dbgu[e])
The glu's stage-2 dot g . y includes bdown by itself here: gradGateCombine reads y (stored as z2).
  gradInputCombine n over H:  grad_x[t, c] += dx[:, c]                       (stage 5)
  gradGateGEMM     n over H:  dlogits of the tile's tokens; grad_x[t, c] += dlogits Wg[c]^T,
                              dWg[c] += x[t, c]^T dlogits                    (stage 6)
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable

import torch

from shardmoe.expert_kinds import GLU, MLP
from shardmoe.moe import combine as comb
from shardmoe.moe import experts as ex
from shardmoe.moe.experts import TORCH_OPS
from shardmoe.moe.activations import activate
from shardmoe.moe.routing import Routing, grad_gate_gemm
from shardmoe.tasks.memory import Memory
from shardmoe.tasks.plan import Plan, Ref, Task, TaskType

Commit = Callable[[], None]  # a task's writes, applied when it ends


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


def _expert_rows(weight: torch.Tensor | None, expert: int, parts: tuple[slice, ...]) -> torch.Tensor | None:
    """Rows `parts` of expert `expert`'s weight [E, U, ...] (or bias [E, U]) as a one-expert
    [1, rows, ...] tensor: a view of one part, a copy of several joined (a glu's two halves)."""
    if weight is None:
        return None
    if len(parts) == 1:
        return weight[expert:expert + 1, parts[0]]
    return torch.cat([weight[expert:expert + 1, part] for part in parts], dim=1)


def _write_rows_and_expert_grads(ctx: KernelContext, op: dict[str, Ref], cols: slice, rows: torch.Tensor,
                                 local_expert: int, grads: list) -> Commit:
    """The commit of gradPostGEMM and gradPreGEMM: their rows go to columns `cols` of op["out"], and
    each (name, index, value) of `grads` is added to that weight's gradient of the local expert."""
    def commit():
        ctx.memory[op["out"]][:, cols] = rows
        for name, index, value in grads:
            ref = op["dw"]
            ctx.memory[Ref(ref.device, ref.name, name)][local_expert][index] += value
    return commit


# --- forward ---------------------------------------------------------------------------------------
def pre_gemm(task: Task, ctx: KernelContext) -> Commit:
    cfg, tile, mem, op = ctx.plan.config, ctx.plan.row_tile_of(task), ctx.memory, task.operands
    cols = ctx.plan.columns(task.tile_idx, cfg.ffn_size)
    kind, e = cfg.kind, tile.expert
    z_cols = kind.up_columns(cols, cfg.ffn_size)  # the tile's columns of each half ("glu": [hg | hu])
    params = {kind.up: _expert_rows(ctx.params[kind.up], e, z_cols),
              kind.up_bias: _expert_rows(ctx.params.get(kind.up_bias), e, z_cols)}
    a, z = ex.pre_gemm(TORCH_OPS, kind, cfg.expert_activation, mem[op["x"]], params, _one_expert(tile.size))

    def commit():
        for part, dest in zip(z.chunk(len(z_cols), dim=1), z_cols):
            mem[op["z"]][:, dest] = part
        mem[op["a"]][:, cols] = a
    return commit


def post_gemm(task: Task, ctx: KernelContext) -> Commit:
    cfg, tile, mem, op = ctx.plan.config, ctx.plan.row_tile_of(task), ctx.memory, task.operands
    cols = ctx.plan.columns(task.tile_idx, cfg.hidden_size)
    kind, e = cfg.kind, tile.expert
    params = {kind.down: _expert_rows(ctx.params[kind.down], e, (cols,)),
              kind.down_bias: _expert_rows(ctx.params.get(kind.down_bias), e, (cols,))}
    y, z2 = ex.post_gemm(TORCH_OPS, kind, cfg.output_activation, mem[op["a"]], params, _one_expert(tile.size))

    def commit():
        mem[op["z2"]][:, cols] = z2
        mem[op["y"]][:, cols] = y
    return commit


def combine(task: Task, ctx: KernelContext) -> Commit:
    tile, mem, op = ctx.plan.row_tile_of(task), ctx.memory, task.operands
    cols = ctx.plan.columns(task.tile_idx, ctx.plan.config.hidden_size)
    rows = ctx.plan.local_tokens(tile.tokens, task.peer)
    scaled = TORCH_OPS.scale_rows(mem[op["y"]][:, cols], tile.weight)

    def commit():
        mem[op["out"]][rows, cols] += scaled
    return commit


# --- backward ----------------------------------------------------------------------------------
def grad_combine(task: Task, ctx: KernelContext) -> Commit:
    tile, mem, op = ctx.plan.row_tile_of(task), ctx.memory, task.operands
    cols = ctx.plan.columns(task.tile_idx, ctx.plan.config.hidden_size)
    ge = comb.grad_combine(TORCH_OPS, mem[op["g"]][:, cols], tile.weight)

    def commit():
        mem[op["out"]][:, cols] = ge
    return commit


def grad_gate_combine(task: Task, ctx: KernelContext) -> Commit:
    """Writes the tile's dots into the token device's gate_dots (P2P store) or into the expert's
    gate_rows cell, which the protocol puts into the token device's heap (remote)."""
    cfg, tile, mem, op = ctx.plan.config, ctx.plan.row_tile_of(task), ctx.memory, task.operands
    dots = comb.grad_gate_combine(TORCH_OPS, mem[op["g"]], activate(cfg.output_activation, mem[op["z2"]]))

    def commit():
        if op["out"].name == "gate_dots":
            mem[op["out"]][ctx.plan.local_tokens(tile.tokens, task.peer), tile.pairs % cfg.top_k] = dots
        else:
            mem[op["out"]] = dots
    return commit


def grad_post_gemm(task: Task, ctx: KernelContext) -> Commit:
    cfg, tile, mem, op = ctx.plan.config, ctx.plan.row_tile_of(task), ctx.memory, task.operands
    cols = ctx.plan.columns(task.tile_idx, cfg.ffn_size)
    kind, e, le, groups = cfg.kind, tile.expert, tile.local_expert, _one_expert(tile.size)
    has_bias = ctx.params.get(kind.down_bias) is not None and task.tile_idx == 0
    grad_a, grad_down, grad_bias = _GRAD_POST_GEMM[kind](mem[op["ge"]], mem[op["z2"]], mem[op["a"]][:, cols],
                                                         ctx.params[kind.down][e:e + 1, :, cols], has_bias, groups,
                                                         cfg.output_activation)
    grads = [(kind.down, (slice(None), cols), grad_down[0])]
    grads += [(kind.down_bias, slice(None), grad_bias[0])] if has_bias else []
    return _write_rows_and_expert_grads(ctx, op, cols, grad_a, le, grads)


def grad_pre_gemm(task: Task, ctx: KernelContext) -> Commit:
    cfg, tile, mem, op = ctx.plan.config, ctx.plan.row_tile_of(task), ctx.memory, task.operands
    cols = ctx.plan.columns(task.tile_idx, cfg.hidden_size)
    kind, e, le, groups = cfg.kind, tile.expert, tile.local_expert, _one_expert(tile.size)
    has_bias = ctx.params.get(kind.up_bias) is not None and task.tile_idx == 0
    grad_x, grad_up, grad_bias = _GRAD_PRE_GEMM[kind](mem[op["grad"]], mem[op["z"]], mem[op["x"]][:, cols],
                                                      ctx.params[kind.up][e:e + 1, :, cols], has_bias, groups,
                                                      cfg.expert_activation)
    grads = [(kind.up, (slice(None), cols), grad_up[0])]
    grads += [(kind.up_bias, slice(None), grad_bias[0])] if has_bias else []
    return _write_rows_and_expert_grads(ctx, op, cols, grad_x, le, grads)


def _glu_grad_post_gemm(ge, z2, a, down_proj, has_bias, groups, output_activation):
    """Stage 3 for "glu" in grad_post_gemm_mlp's signature: (dA, dWdown, dbdown or None) from ge.
    ge already carries w, so the stage function gets unit weights: w (g Wdown) = (w g) Wdown."""
    grad_a, grad_down, _, grad_bias = ex.grad_post_gemm_glu(TORCH_OPS, ge, ge.new_ones(ge.shape[0]), a, down_proj,
                                                            groups, has_bias)
    return grad_a, grad_down, grad_bias


def _glu_grad_pre_gemm(grad_a, h, xs, gate_up_proj, has_bias, groups, activation):
    """Stage 4 for "glu" in grad_pre_gemm_mlp's signature: (dx, dWgu, dbgu or None), act(hg) from h."""
    _, act_gate = ex.glu_activation(TORCH_OPS, h, activation)
    return ex.grad_pre_gemm_glu(TORCH_OPS, grad_a, h, act_gate, xs, gate_up_proj, groups, activation, has_bias)


# a tile's stage 3 and stage 4 for each kind, in grad_post_gemm_mlp's and grad_pre_gemm_mlp's signatures
_GRAD_POST_GEMM = {GLU: _glu_grad_post_gemm, MLP: functools.partial(ex.grad_post_gemm_mlp, TORCH_OPS)}
_GRAD_PRE_GEMM = {GLU: _glu_grad_pre_gemm, MLP: functools.partial(ex.grad_pre_gemm_mlp, TORCH_OPS)}


def grad_input_combine(task: Task, ctx: KernelContext) -> Commit:
    """Pure accumulation: gradCombine already applied w (no probability scaling here)."""
    tile, mem, op = ctx.plan.row_tile_of(task), ctx.memory, task.operands
    cols = ctx.plan.columns(task.tile_idx, ctx.plan.config.hidden_size)
    dx = mem[op["src"]][:, cols].clone()

    def commit():
        mem[op["out"]][ctx.plan.local_tokens(tile.tokens, task.peer), cols] += dx
    return commit


def _token_routing(routing: Routing, tokens: torch.Tensor) -> Routing:
    """The routing rows of a token subset; per-expert and per-sequence counts stay global (the
    balance losses use them)."""
    per_token = ("probs", "logsumexp", "top_idx", "top_prob", "weight", "z_probs", "token_sequence")
    return dataclasses.replace(routing, row_pair=routing.row_pair[:0],
                               **{name: getattr(routing, name)[tokens] for name in per_token})


def grad_gate_gemm_tile(task: Task, ctx: KernelContext) -> Commit:
    """Column tile n of the gate backward for the tokens in operands["tokens"] (global indices, all
    homed on task.peer); reads their gate dots at its start, which must hold every kept pair's dw.
    The router bias gradient does not depend on the column, so column tile 0 commits it."""
    plan, mem, op = ctx.plan, ctx.memory, task.operands
    tokens = op["tokens"]
    if tokens.numel() == 0:
        return lambda: None
    cols = plan.columns(task.tile_idx, plan.config.hidden_size)
    rows = plan.local_tokens(tokens, task.peer)
    grad_x, grad_gate, grad_bias = grad_gate_gemm(mem[op["x"]][rows][:, cols], ctx.params["gate_weight"][cols],
                                       _token_routing(plan.routing, tokens), mem[op["dots"]][rows],
                                       ctx.grad_loss, plan.config, num_tokens=plan.num_tokens)

    def commit():
        mem[op["out"]][rows, cols] += grad_x.to(mem[op["out"]].dtype)
        mem[op["dwg"]][cols] += grad_gate.to(mem[op["dwg"]].dtype)
        if grad_bias is not None and task.tile_idx == 0:
            mem[op["dwb"]] += grad_bias.to(mem[op["dwb"]].dtype)
    return commit


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
