"""Helpers for the torchtitan interop tests: torchtitan's DeepSeek-V3 debug model shrunk, its MoE
alone, torchtitan's expert computation without its bf16 casts, weights with real routing margins.

torchtitan's GroupedExperts casts x and the weights to bf16 for its grouped GEMMs whatever their
dtype, and its combine multiplies in float32: exact_torchtitan replaces those two methods by the
same computation in the inputs' dtype (a per-expert loop: torch._grouped_mm takes no float64), so
that torchtitan's MoE is a float64 reference and the two modules differ by round-off alone."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("torchtitan")

from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm  # noqa: E402
from torchtitan.models.common import moe as titan_moe  # noqa: E402
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402
from torchtitan.models.common.config_utils import (make_ffn_config, make_moe_config,  # noqa: E402
                                                   make_routed_experts_config, make_router_config)
from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher  # noqa: E402
from torchtitan.models.deepseek_v3 import (_EMBEDDING_INIT, _NORM_INIT, _build_dsv3_layers,  # noqa: E402
                                           _output_linear_init)
from torchtitan.models.deepseek_v3.model import DeepSeekV3Model  # noqa: E402

VOCAB = 64
DIM = 32
EXPERTS = 8
HIDDEN = 24  # moe_hidden_dim: [E, 24, 32] experts, a shared expert of 2 x 24


def deepseek_v3_config(*, score_func: str = "softmax", top_k: int = 3, groups: tuple[int, int] | None = None,
                       route_norm: bool = False, route_scale: float = 1.0,
                       n_layers: int = 3) -> DeepSeekV3Model.Config:
    """torchtitan's DeepSeek-V3 "debugmodel" (models/deepseek_v3/__init__.py _debugmodel: one dense
    layer then MoE layers, 8 experts top-3 softmax, two shared experts, MLA, yarn RoPE, its inits),
    shrunk: dim 32, 3 layers, vocab 64, 2 heads. Attention is torch's SDPA (causal) instead of
    FlexAttention, which torchtitan compiles with inductor."""
    rope_dim = 8
    layers = _build_dsv3_layers(
        n_layers=n_layers, n_dense_layers=1, dim=DIM, n_heads=2, q_lora_rank=0, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=rope_dim, v_head_dim=8, mscale=0.70, dense_hidden_dim=64,
        moe_hidden_dim=HIDDEN, num_experts=EXPERTS, num_shared_experts=2, router_top_k=top_k,
        router_score_func=score_func, router_num_expert_groups=groups and groups[0],
        router_num_limited_groups=groups and groups[1], router_route_scale=route_scale,
        router_route_norm=route_norm, attn_backend="flex", moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=rope_dim, max_seq_len=64, theta=10000.0, scaling="yarn", rope_factor=40.0,
                                beta_fast=32.0, beta_slow=1.0, original_seq_len=32))
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return DeepSeekV3Model.Config(
        vocab_size=VOCAB, dim=DIM,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_output_linear_init(DIM)),
        layers=layers, mtp_layers=[])


def moe_module_config(*, score_func: str = "softmax", top_k: int = 3, groups: tuple[int, int] | None = None,
                      route_norm: bool = False, route_scale: float = 1.0, gate_bias: bool = False,
                      shared: bool = True, load_balance_coeff: float | None = 1e-3,
                      experts: int = EXPERTS) -> titan_moe.MoE.Config:
    """A torchtitan MoE.Config built as its model registries build one (config_utils)."""
    init = {"weight": torch.nn.init.normal_, "bias": torch.nn.init.zeros_}
    return make_moe_config(
        num_experts=experts, load_balance_coeff=load_balance_coeff,
        router=make_router_config(dim=DIM, num_experts=experts, gate_param_init=init, top_k=top_k,
                                  score_func=score_func, route_norm=route_norm, route_scale=route_scale,
                                  num_expert_groups=groups and groups[0], num_limited_groups=groups and groups[1],
                                  bias=gate_bias),
        routed_experts=make_routed_experts_config(
            dim=DIM, hidden_dim=HIDDEN, num_experts=experts, top_k=top_k, comm_backend="standard",
            param_init={"w1_EFD": torch.nn.init.normal_, "w2_EDF": torch.nn.init.normal_,
                        "w3_EFD": torch.nn.init.normal_}),
        shared_experts=make_ffn_config(dim=DIM, hidden_dim=2 * HIDDEN, w1_param_init=init, w2w3_param_init=init)
        if shared else None)


def randomize(module: torch.nn.Module, seed: int = 0, scale: float = 0.3) -> None:
    """Every parameter of `module` drawn N(0, scale^2), norm gains 1 + N(0, 0.01), and an MoE's
    expert_bias_E N(0, 0.05^2): routing is decided by real margins and the MoE layers move the loss
    (torchtitan's init gives experts of std 0.02, whose outputs the loss barely sees)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            if not t.is_floating_point() or name.endswith(("tokens_per_expert_E", "cache")):
                continue
            noise = torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.dtype)
            if "norm" in name:
                t.copy_(1 + 0.1 * noise)
            elif name.endswith("expert_bias_E"):
                t.copy_(0.05 * noise)
            else:
                t.copy_(scale * noise)


def _experts_forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    """GroupedExperts.forward in x's dtype: w2 (silu(w1 x) * (w3 x)) per expert's rows."""
    out, start = [], 0
    for e, n in enumerate(num_tokens_per_expert_E.tolist()):
        x = x_RD[start:start + int(n)]
        start += int(n)
        out.append((F.silu(x @ self.w1_EFD[e].t()) * (x @ self.w3_EFD[e].t())) @ self.w2_EDF[e].t())
    return torch.cat(out)


def _combine(self, routed_output_RD: torch.Tensor, metadata, x_TD: torch.Tensor) -> torch.Tensor:
    """LocalTokenDispatcher.combine with the score product in the rows' dtype (and index_add for its
    deterministic scatter_add, whose switching of torch's deterministic mode costs 0.2 s a call here)."""
    rows = routed_output_RD * metadata.topk_scores_experts_sorted_N.reshape(-1, 1)
    return torch.zeros_like(x_TD).index_add(0, metadata.token_indices_experts_sorted_N, rows)


@pytest.fixture
def exact_torchtitan(monkeypatch):
    """torchtitan's MoE computing in its inputs' dtype (the module docstring)."""
    monkeypatch.setattr(titan_moe.GroupedExperts, "forward", _experts_forward)
    monkeypatch.setattr(LocalTokenDispatcher, "combine", _combine)


def cast_parameters(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """module with its floating parameters cast to dtype and its buffers left as they are (torchtitan
    keeps expert_bias_E and tokens_per_expert_E in float32 whatever the weights' dtype)."""
    for param in module.parameters():
        param.data = param.data.to(dtype)
    return module


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))
