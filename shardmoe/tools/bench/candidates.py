"""The candidates timed side by side, each a step() running one forward + backward.

  transformers  transformers' MixtralSparseMoeBlock with experts_implementation="grouped_mm"
                (its fastest one on CPU; "batched_mm" gathers a [S*k, 2F, H] weight copy)
  loop          loop_moe: a per-expert-loop autograd baseline
  dense         dense_candidate: plain matmuls of the same FLOPs and shapes into preallocated
                buffers (the ceiling)
  dense+alloc   the same matmuls allocating their outputs, as autograd does (allocator cost)
  shardmoe      shardmoe.MoE (the MoE operators, explicit backward)

and, only when asked for (--candidates), ablations of shardmoe for before/after measurements:
  shardmoe:no-workspace  layer.workspace = None: every row buffer allocated fresh (grouped_mm)

All of them hold the same weights (_init_weights) and see the same inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

from shardmoe.tools.bench.flops import Shape

CANDIDATES = ("transformers", "loop", "dense", "dense+alloc", "shardmoe")
VARIANTS = ("shardmoe:no-workspace",)


def _init_weights(s: Shape, seed: int, device="cpu"):
    """The benchmark's weights, in transformers' layouts: router [E, H], gate_up_proj
    [E, 2F, H], down_proj [E, H, F]; router and gate_up ~ N(0, 1/H), down ~ N(0, 1/F), so
    activations stay O(1) in bf16. Drawn on `device` by its own generator (a GPU builds the
    Mixtral shape's 1.4 G weights in milliseconds where a CPU takes most of a minute; the values
    differ from the CPU's)."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    draw = dict(generator=gen, device=device)
    router = torch.randn(s.experts, s.hidden, **draw) / s.hidden ** 0.5
    gate_up = torch.randn(s.experts, 2 * s.ffn, s.hidden, **draw) / s.hidden ** 0.5
    down = torch.randn(s.experts, s.hidden, s.ffn, **draw) / s.ffn ** 0.5
    return router, gate_up, down


def _mixtral_block(s: Shape, weights, dtype, device):
    """A MixtralSparseMoeBlock from a local config (no downloads) with
    experts_implementation="grouped_mm", holding `weights` (see _init_weights)."""
    import torch
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(hidden_size=s.hidden, intermediate_size=s.ffn, num_local_experts=s.experts,
                           num_experts_per_tok=s.top_k, hidden_act="silu", router_jitter_noise=0.0,
                           experts_implementation="grouped_mm")
    with torch.device(device):  # allocated where it runs: on a GPU, no CPU-side init of the weights
        block = MixtralSparseMoeBlock(config)
    router, gate_up, down = weights
    with torch.no_grad():
        block.gate.weight.copy_(router)
        block.experts.gate_up_proj.copy_(gate_up)
        block.experts.down_proj.copy_(down)
    return block.to(device=device, dtype=dtype)


def loop_moe(x, gate_weight, gate_up_proj, down_proj, top_k: int):
    """Per-expert-loop MoE in plain autograd: x [S, H] -> [S, H].

    Routing as Mixtral (softmax in fp32, top-k, renormalise); then for each expert,
    gather its tokens, run the SwiGLU FFN with F.linear, scale by the combine weight and
    index_add into the output."""
    import torch
    import torch.nn.functional as F

    probs = torch.softmax((x @ gate_weight).float(), dim=-1)
    top_prob, top_idx = torch.topk(probs, top_k, dim=-1)
    weight = (top_prob / top_prob.sum(-1, keepdim=True)).to(x.dtype)
    out = torch.zeros_like(x)
    # unbind, not gate_up_proj[e]: indexing a [E, ...] parameter per expert makes autograd
    # add E full-size zero-padded gradients (O(E^2) work); unbind stacks them once
    for e, (w_gate_up, w_down) in enumerate(zip(gate_up_proj.unbind(0), down_proj.unbind(0))):
        token, slot = torch.where(top_idx == e)
        if token.numel() == 0:
            continue
        xs = x.index_select(0, token)
        gate, up = F.linear(xs, w_gate_up).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w_down)
        out.index_add_(0, token, y * weight[token, slot, None])
    return out


@dataclass
class Candidate:
    name: str
    step: object                 # () -> None: one forward + backward
    reset: object                # () -> None: drop gradients (outside the timed region)
    params: tuple = ()
    forward: object = None       # () -> output with graph (for saved bytes / checks)
    grads: object = None         # () -> dict of gradients after a step (for checks)
    flops: int | None = None     # GEMM FLOPs of one step, where the candidate knows them exactly
    layer: object = None         # the shardmoe.MoE behind a shardmoe candidate (its workspace, if any)

    @property
    def workspace(self):
        """The layer's workspace, None without a layer or without a pool."""
        return None if self.layer is None else self.layer.workspace


def build_candidates(s: Shape, dtype, device, names, seed: int = 0, fresh_inputs: int = 0):
    """Candidates on the same weights and inputs. With fresh_inputs=R > 0 each module
    candidate cycles through R + 1 different inputs (so routing, and each expert's row
    count, change every step, as in training); input 0 serves forward() (the check pass),
    steps use inputs 1..R. Every candidate steps once per round, so all see the same input
    in the same round."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    x_base = torch.randn(1, s.tokens, s.hidden, generator=gen).to(device=device, dtype=dtype)
    grad_out = (torch.randn(1, s.tokens, s.hidden, generator=gen) / s.hidden ** 0.5).to(device=device, dtype=dtype)
    x_pool = [x_base] + [torch.randn(1, s.tokens, s.hidden, generator=gen).to(device=device, dtype=dtype)
                         for _ in range(fresh_inputs)]
    cands: dict[str, Candidate] = {}
    weights = _init_weights(s, seed, device)
    shardmoes = [n for n in ("shardmoe", *VARIANTS) if n in names]
    block = _mixtral_block(s, weights, dtype, device) if "transformers" in names or shardmoes else None

    def module_candidate(name, module, params, x_shape, gate_transposed=False):
        """gate_transposed: params[0] is [H, E] (the router holds [E, H]); its gradient
        is compared transposed."""
        xs = [xb.reshape(x_shape).clone().requires_grad_() for xb in x_pool]
        x = xs[0]
        g = grad_out.reshape(x_shape)
        turn = [0]

        def forward():
            return module(x)

        def step():
            xi = x if len(xs) == 1 else xs[1 + turn[0] % (len(xs) - 1)]
            turn[0] += 1
            module(xi).backward(g)

        def reset():
            for xi in xs:
                xi.grad = None
            for p in params:
                p.grad = None

        def grads():
            out = {"x": x.grad.reshape(1, s.tokens, s.hidden),
                   **{f"p{i}": p.grad for i, p in enumerate(params)}}
            if gate_transposed:
                out["p0"] = out["p0"].t()
            return out

        return Candidate(name, step, reset, tuple(params), forward, grads), x

    inputs = {}
    if "transformers" in names:
        params = (block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj)
        cands["transformers"], inputs["transformers"] = module_candidate(
            "transformers", block, params, (1, s.tokens, s.hidden))
    for name in shardmoes:
        from shardmoe.hf import from_block

        layer = from_block(block)
        if name == "shardmoe:no-workspace":
            layer.workspace = None
        params = (layer.gate_weight, layer.gate_up_proj, layer.down_proj)
        cands[name], inputs[name] = module_candidate(name, layer, params, (1, s.tokens, s.hidden),
                                                     gate_transposed=True)
        cands[name].layer = layer
        cands[name].reset = _dropping_last_step_state(cands[name].reset, layer)
    if "loop" in names:
        wg, wgu, wd = (w.to(device=device, dtype=dtype).requires_grad_()
                       for w in (weights[0].t().contiguous(), weights[1], weights[2]))
        params = (wg, wgu, wd)
        cands["loop"], inputs["loop"] = module_candidate(
            "loop", lambda x: loop_moe(x, wg, wgu, wd, s.top_k), params, (s.tokens, s.hidden),
            gate_transposed=True)
    for name in ("dense", "dense+alloc"):
        if name in names:
            cands[name] = dense_candidate(s, dtype, device, preallocated=(name == "dense"), name=name)
    return {n: cands[n] for n in names if n in cands}, inputs


def _dropping_last_step_state(reset, layer):
    """reset, then the layer's stats and aux_loss of its last step: replaced inside the next step,
    they would be freed inside its memory profile, blocks the profiler saw no allocation of (it
    warns "Memory block of unknown size was allocated before the profiling started")."""
    def drop():
        reset()
        layer.stats, layer.aux_loss = {}, None

    return drop


def dense_candidate(s: Shape, dtype, device, preallocated: bool, name: str) -> Candidate:
    """The GEMMs of a dropless MoE forward + backward as if all M = S*k rows went to one
    expert: the same FLOPs (total_flops) in the same operand shapes and layouts.

    Experts:  h  = X Wgu^T    [M,H]x[H,2F]     y   = A Wd^T   [M,F]x[F,H]
              dA = dY Wd      [M,H]x[H,F]      dWd = dY^T A   [H,M]x[M,F]
              dX = dH Wgu     [M,2F]x[2F,H]    dWgu= dH^T X   [2F,M]x[M,H]
    Router:   L  = Xs Wg      [S,H]x[H,E]      dXs = dL Wg^T  [S,E]x[E,H]   dWg = Xs^T dL  [H,S]x[S,E]
    With preallocated=True every product lands in a buffer made once (out=), so only the
    GEMM kernels are timed; otherwise each allocates its output as autograd would."""
    import torch

    S, H, F, E, k = s.tokens, s.hidden, s.ffn, s.experts, s.top_k
    M = S * k
    gen = torch.Generator().manual_seed(7)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    X, A, dY, dH = rnd(M, H), rnd(M, F), rnd(M, H), rnd(M, 2 * F)
    Wgu, Wd = rnd(2 * F, H), rnd(H, F)
    Xs, Wg, dL = rnd(S, H), rnd(H, E), rnd(S, E)
    products = [
        (X, Wgu.t()), (A, Wd.t()),              # forward
        (dY, Wd), (dY.t(), A),                  # down-projection backward
        (dH, Wgu), (dH.t(), X),                 # gate/up backward
        (Xs, Wg), (dL, Wg.t()), (Xs.t(), dL),   # router forward + backward
    ]
    if preallocated:
        outs = [torch.empty(a.shape[0], b.shape[1], device=device, dtype=dtype) for a, b in products]

        def step():
            for (a, b), o in zip(products, outs):
                torch.mm(a, b, out=o)
    else:
        def step():
            for a, b in products:
                torch.mm(a, b)

    flops = sum(2 * a.shape[0] * a.shape[1] * b.shape[1] for a, b in products)
    return Candidate(name, step, lambda: None, flops=flops)
