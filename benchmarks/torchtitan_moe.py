"""torchtitan's MoE against the swapped module (shardmoe.torchtitan.MoE): exactness and speed on CPU.

--exactness: one forward and backward of each router option (softmax, sigmoid, route_norm and
route_scale, a gate bias, expert groups, shared experts) in float64, float32 and bf16, each module
against the same module in float64 with torchtitan's bf16 casts taken out of its experts and
combine (its "exact" form): the largest, over the output and every gradient (input and each
parameter), of |error| / |reference| in Frobenius norm. torchtitan as shipped computes its experts in
bf16 whatever the dtype; the swapped module computes in the input's dtype.

--speed: forward + backward of torchtitan's MoE as shipped and of the swapped module holding the
same weights, on the layer bench's shapes e8 (E=8 top-2, F=1024) and fine (E=64 top-8, F=128),
H=512, softmax routing with torchtitan's expert bias and no shared expert, fp32 and bf16. The two
take turns in a random order each round (seeded), a step each, in one process; the first round is
not counted. Printed: median ms per step and the median of the per-round ratios torchtitan / swapped
(above 1, the swapped module is faster).

  python benchmarks/torchtitan_moe.py --exactness
  python benchmarks/torchtitan_moe.py --speed --threads 2 --rounds 10 [--tokens 4096]
"""
from __future__ import annotations

import argparse
import copy
import random
import statistics
import time

import torch
import torch.nn.functional as F
from torchtitan.models.common import moe as titan_moe
from torchtitan.models.common.config_utils import (make_ffn_config, make_moe_config, make_routed_experts_config,
                                                   make_router_config)
from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

import shardmoe.torchtitan
from shardmoe.tools.bench.flops import SHAPES

ROUTERS = {
    "softmax top-3": dict(),
    "sigmoid": dict(score_func="sigmoid"),
    "route_norm, route_scale 2.5": dict(score_func="sigmoid", route_norm=True, route_scale=2.5),
    "gate bias": dict(gate_bias=True),
    "groups 4, limited 2": dict(score_func="sigmoid", groups=(4, 2), route_norm=True),
    "no shared expert, top-2": dict(shared=False, top_k=2),
}


def moe_config(dim: int, hidden: int, experts: int, top_k: int = 3, score_func: str = "softmax",
               route_norm: bool = False, route_scale: float = 1.0, groups=None, gate_bias: bool = False,
               shared: bool = True) -> titan_moe.MoE.Config:
    init = {"weight": torch.nn.init.normal_, "bias": torch.nn.init.zeros_}
    experts_init = dict.fromkeys(("w1_EFD", "w2_EDF", "w3_EFD"), torch.nn.init.normal_)
    return make_moe_config(
        num_experts=experts,
        router=make_router_config(dim=dim, num_experts=experts, gate_param_init=init, top_k=top_k,
                                  score_func=score_func, route_norm=route_norm, route_scale=route_scale,
                                  num_expert_groups=groups and groups[0], num_limited_groups=groups and groups[1],
                                  bias=gate_bias),
        routed_experts=make_routed_experts_config(dim=dim, hidden_dim=hidden, num_experts=experts, top_k=top_k,
                                                  param_init=experts_init, comm_backend="standard"),
        shared_experts=make_ffn_config(dim=dim, hidden_dim=2 * hidden, w1_param_init=init, w2w3_param_init=init)
        if shared else None)


def built(config: titan_moe.MoE.Config, dtype: torch.dtype, seed: int = 0) -> titan_moe.MoE:
    """torchtitan's MoE with weights N(0, 1/fan_in) (gate N(0, 1): real routing margins) and an expert
    bias N(0, 0.05^2), parameters of `dtype`, buffers float32."""
    module = config.build()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in [*module.named_parameters(), *module.named_buffers()]:
            if name == "tokens_per_expert_E":
                continue
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            scale = 0.05 if name == "expert_bias_E" else 1.0 if "gate" in name else p.shape[-1] ** -0.5
            p.copy_(scale * noise)
    for p in module.parameters():
        p.data = p.data.to(dtype)
    return module


def exact_experts(self, x, counts):
    out, start = [], 0
    for e, n in enumerate(counts.tolist()):
        rows = x[start:start + n]
        start += n
        out.append((F.silu(rows @ self.w1_EFD[e].t()) * (rows @ self.w3_EFD[e].t())) @ self.w2_EDF[e].t())
    return torch.cat(out)


def exact_combine(self, y, metadata, x):
    rows = y * metadata.topk_scores_experts_sorted_N.reshape(-1, 1)
    return torch.zeros_like(x).index_add(0, metadata.token_indices_experts_sorted_N, rows)


def step(module, x: torch.Tensor, grad: torch.Tensor) -> dict[str, torch.Tensor]:
    """Output, input gradient and parameter gradients of one forward and backward."""
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    out = module(x)
    out.backward(grad)
    return {"out": out.detach(), "x": x.grad, **{n: p.grad for n, p in module.named_parameters()}}


def worst(got: dict, expected: dict) -> float:
    """max over the tensors of |got - expected| / |expected| (Frobenius norms)."""
    return max(float(torch.linalg.vector_norm(got[k].double() - v) / torch.linalg.vector_norm(v))
               for k, v in expected.items())


def exactness() -> None:
    dim, hidden, experts, tokens = 64, 96, 8, 256
    print(f"max over output and gradients of |error| / |reference| (Frobenius) against torchtitan's MoE in "
          f"float64 with its bf16 casts taken out; H={dim}, F={hidden}, E={experts}, {tokens} tokens")
    print(f"  {'router':<30} {'swapped fp64':>12} {'swapped fp32':>12} {'swapped bf16':>12} "
          f"{'titan fp32':>12} {'titan bf16':>12}")
    gen = torch.Generator().manual_seed(1)
    for name, options in ROUTERS.items():
        config = moe_config(dim, hidden, experts, **options)
        x = torch.randn(2, tokens // 2, dim, generator=gen, dtype=torch.float64)
        grad = torch.randn(x.shape, generator=gen, dtype=torch.float64)
        shipped = (titan_moe.GroupedExperts.forward, LocalTokenDispatcher.combine)
        titan_moe.GroupedExperts.forward, LocalTokenDispatcher.combine = exact_experts, exact_combine
        try:
            reference = step(built(config, torch.float64), x, grad)
        finally:
            titan_moe.GroupedExperts.forward, LocalTokenDispatcher.combine = shipped
        row = []
        for dtype in (torch.float64, torch.float32, torch.bfloat16):
            fused = shardmoe.torchtitan.from_torchtitan(built(config, dtype))
            row.append(worst(step(fused, x.to(dtype), grad.to(dtype)), reference))
        for dtype in (torch.float32, torch.bfloat16):
            row.append(worst(step(built(config, dtype), x.to(dtype), grad.to(dtype)), reference))
        print(f"  {name:<30} " + " ".join(f"{e:12.1e}" for e in row))


def speed(threads: int, rounds: int, tokens: int | None) -> None:
    torch.set_num_threads(threads)
    print(f"forward + backward, {torch.get_num_threads()} threads, {rounds} rounds in random order (one process, "
          "interleaved); ratio = median over rounds of torchtitan / swapped")
    order = random.Random(0)
    for shape in ("e8", "fine"):
        S, H, F_, E, k = SHAPES[shape]
        S = tokens or S
        for dtype in (torch.float32, torch.bfloat16):
            titan = built(moe_config(H, F_, E, top_k=k, shared=False), dtype)
            fused = shardmoe.torchtitan.from_torchtitan(copy.deepcopy(titan))
            gen = torch.Generator().manual_seed(2)
            x = torch.randn(4, S // 4, H, generator=gen).to(dtype)
            grad = torch.randn(x.shape, generator=gen).to(dtype)
            times = {"torchtitan": [], "swapped": []}
            modules = {"torchtitan": titan, "swapped": fused}
            for r in range(rounds + 1):
                names = list(modules)
                order.shuffle(names)
                for name in names:
                    start = time.perf_counter()
                    step(modules[name], x, grad)
                    if r:
                        times[name].append(time.perf_counter() - start)
            ratio = statistics.median(a / b for a, b in zip(times["torchtitan"], times["swapped"]))
            ms = {n: 1e3 * statistics.median(t) for n, t in times.items()}
            print(f"  {shape:<5} S={S} H={H} F={F_} E={E} k={k} {str(dtype).removeprefix('torch.'):<9} "
                  f"torchtitan {ms['torchtitan']:8.1f} ms   swapped {ms['swapped']:8.1f} ms   ratio {ratio:5.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--exactness", action="store_true")
    parser.add_argument("--speed", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=None, help="tokens per step (default: the shape's, 4096)")
    args = parser.parse_args()
    if not (args.exactness or args.speed):
        parser.error("expected --exactness, --speed or both")
    if args.threads < 1 or args.rounds < 1 or (args.tokens is not None and (args.tokens < 4 or args.tokens % 4)):
        parser.error(f"expected --threads >= 1, --rounds >= 1 and --tokens a positive multiple of 4, got "
                     f"{args.threads}, {args.rounds} and {args.tokens}")
    if args.exactness:
        exactness()
    if args.speed:
        speed(args.threads, args.rounds, args.tokens)


if __name__ == "__main__":
    main()
