"""AdamW on sharded parameters, the warm-up + cosine learning rate, global-norm gradient clipping.

AdamW (decoupled weight decay), per element of every parameter shard p with gradient g, step n:
    m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g^2
    p = p - lr (m / (1 - b1^n)) / (sqrt(v / (1 - b2^n)) + eps) - lr wd p      (wd: matrices only)
Every term is elementwise, so a sharded run updates each shard exactly as a single process
updates that block of the full tensor. Norm gains (1-D) get no weight decay.

The gradient norm is global: sum over parameters of ||g||^2 over the WHOLE tensor. A rank holds a
shard of each parameter, and the same shard lives on `replicas` ranks (e.g. a dense weight on every
e rank), so each rank adds ||g_shard||^2 / replicas and one all-reduce over all ranks sums them.

Everything here runs on this rank's shards: a MoE layer's DTensor parameters (and gradients) by
their local tensors, the model's dense parameters as the plain shards they are.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from shardmoe.moe.composition import local


def learning_rate(step: int, peak: float, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """lr of optimizer step `step` (1-based): linear warm-up to `peak` over warmup_steps, then cosine
    decay to min_ratio * peak at total_steps (held there afterwards)."""
    if step <= warmup_steps:
        return peak * step / warmup_steps
    span = max(total_steps - warmup_steps, 1)
    progress = min((step - warmup_steps) / span, 1.0)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class AdamW:
    """AdamW over named parameter shards; state_dict() holds the moments, this rank's shards of
    them, by parameter name."""

    def __init__(self, named_parameters, *, betas: tuple[float, float], eps: float, weight_decay: float):
        self.params = dict(named_parameters)
        self.betas, self.eps, self.weight_decay = betas, eps, weight_decay
        self.exp_avg = {n: torch.zeros_like(local(p)) for n, p in self.params.items()}
        self.exp_avg_sq = {n: torch.zeros_like(local(p)) for n, p in self.params.items()}
        self.step_count = 0

    @torch.no_grad()
    def step(self, lr: float) -> None:
        self.step_count += 1
        b1, b2 = self.betas
        bias1, bias2 = 1 - b1 ** self.step_count, 1 - b2 ** self.step_count
        for name, param in self.params.items():
            if param.grad is None:
                continue
            p, grad = local(param), local(param.grad)
            m, v = self.exp_avg[name], self.exp_avg_sq[name]
            m.lerp_(grad, 1 - b1)
            v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
            if p.dim() >= 2 and self.weight_decay:
                p.mul_(1 - lr * self.weight_decay)
            denom = (v / bias2).sqrt_().add_(self.eps)
            p.addcdiv_(m, denom, value=-lr / bias1)

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None

    def state_dict(self) -> dict:
        """{'step': int, 'exp_avg': {name: shard}, 'exp_avg_sq': {name: shard}}."""
        return {"step": self.step_count, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        for key in ("exp_avg", "exp_avg_sq"):
            if set(state[key]) != set(self.params):
                raise ValueError(f"optimizer state: {key} names differ from the model's parameters")
            for name, target in getattr(self, key).items():
                target.copy_(state[key][name])
        self.step_count = int(state["step"])


@torch.no_grad()
def global_grad_norm(grads: list[tuple[Tensor, int]], group=None) -> Tensor:
    """sqrt(sum ||g||^2) [] of the full gradients from (local shard gradient, replicas) pairs, on
    the gradients' device (float64; nothing is read on the host).

    Accumulated in float64. Collective over `group` (None: the default group, when initialised)."""
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    total = sum(local(g).double().square().sum() / replicas for g, replicas in grads)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    return total.sqrt()


@torch.no_grad()
def clip_grads(grads: list[Tensor], norm: Tensor, max_norm: float) -> Tensor:
    """Scale the gradients in place so their global norm [] is at most max_norm; returns the factor
    [] (on the device: every gradient is multiplied by it, 1 when the norm is within max_norm).

    max_norm 0 disables clipping. A non-finite norm is left alone (the step is then reported)."""
    if max_norm <= 0:
        return torch.ones((), dtype=torch.float64)
    factor = max_norm / (norm + 1e-6)
    factor = torch.where(torch.isfinite(norm) & (norm > max_norm), factor, torch.ones_like(factor))
    for g in grads:
        local(g).mul_(factor)
    return factor
