"""A whole MixtralForCausalLM <-> shardmoe's Transformer (weights and config).

Parameter names, with Q query heads per kv head, K kv heads, D head dim; a Mixtral checkpoint
numbers query head h = k Q + q (it uses kv head h // Q):

    model.embed_tokens.weight [V M]               embedding.weight [V M]
    layers.i.input_layernorm.weight [M]           blocks.i.attn_norm.weight
    layers.i.self_attn.q_proj.weight [QKD M]      w_q[m, q, k, d] = q_proj[(k Q + q) D + d, m]
    layers.i.self_attn.k_proj / v_proj [KD M]     w_kv[0 / 1, m, k, d] = k_proj / v_proj[k D + d, m]
    layers.i.self_attn.o_proj.weight [M QKD]      w_o[m, q, k, d] = o_proj[m, (k Q + q) D + d]
    layers.i.post_attention_layernorm.weight      blocks.i.ffn_norm.weight
    layers.i.mlp.gate.weight [E M]                blocks.i.moe.gate_weight [M E] (transposed)
    layers.i.mlp.experts.gate_up_proj [E 2F M]    blocks.i.moe.gate_up_proj (as is)
    layers.i.mlp.experts.down_proj [E M F]        blocks.i.moe.down_proj (as is)
    model.norm.weight                             final_norm.weight
    lm_head.weight [V M]                          unembedding.weight

Both models compute the same function (RMSNorm, rotate-half RoPE, D^-1/2 scaled GQA, softmax
top-k routing renormalised over the chosen experts, SwiGLU experts). One difference: Mixtral's
aux loss is one load-balancing loss over all layers' router logits concatenated, ours the sum of
per-layer losses, so only the language-model loss is comparable. Each sparse block is read by
shardmoe.hf.block_layer.read_block, the one reading of a transformers block: a block that does
not compute what the MoE layer does is refused by name before anything is built.
"""
from __future__ import annotations

import torch
from torch import Tensor

from shardmoe.hf.block_layer import read_block
from shardmoe.model.transformer import Transformer, TransformerConfig
from shardmoe.moe.config import MoEConfig


def config_from_mixtral(mixtral_config) -> TransformerConfig:
    """The TransformerConfig of a transformers MixtralConfig (sliding windows are not supported)."""
    c = mixtral_config
    if getattr(c, "sliding_window", None) is not None:
        raise ValueError(f"sliding_window: expected None (full causal attention), got {c.sliding_window}")
    if getattr(c, "tie_word_embeddings", False):
        raise ValueError("tie_word_embeddings: expected False (the unembedding is a separate weight), got True")
    if c.hidden_act != "silu":
        raise ValueError(f"hidden_act: expected 'silu', got {c.hidden_act!r}")
    rope = c.rope_parameters or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope_parameters: expected rope_type 'default', got {rope.get('rope_type')!r}")
    return TransformerConfig(
        vocab_size=c.vocab_size, d_model=c.hidden_size, n_layers=c.num_hidden_layers,
        n_q_heads=c.num_attention_heads, n_kv_heads=c.num_key_value_heads,
        head_dim=c.head_dim or c.hidden_size // c.num_attention_heads,
        moe=MoEConfig(c.hidden_size, c.intermediate_size, c.num_local_experts, c.num_experts_per_tok,
                      aux_loss_coef=c.router_aux_loss_coef),
        rope_theta=float(rope.get("rope_theta", 10000.0)), norm_eps=c.rms_norm_eps)


def check_mixtral_router(config: MoEConfig, what: str) -> None:
    """Raise ValueError unless config's router options are the defaults (Mixtral's router) and it
    has no shared expert, for `what`, an export to Mixtral that has nowhere to put the others."""
    defaults = MoEConfig(1, 1, 1, 1)
    for name in ("score_func", "router_bias", "correction_bias", "n_group", "topk_group", "renormalize_epsilon",
                 "routed_scaling_factor", "seq_aux_loss_coef"):
        if getattr(config, name) != getattr(defaults, name):
            raise ValueError(f"{what}: expected Mixtral's router ({name}={getattr(defaults, name)!r}), got "
                             f"{name}={getattr(config, name)!r}")
    if config.shared_ffn_size:  # Mixtral has no shared expert: exporting would drop it silently
        raise ValueError(f"{what}: expected no shared expert (shared_ffn_size=0, as Mixtral), got "
                         f"shared_ffn_size={config.shared_ffn_size}")


def check_mixtral_experts(config: TransformerConfig, what: str) -> None:
    """Raise ValueError unless the experts are Mixtral's (silu glu without biases), for `what`, an
    export that has nowhere to put the biases or the clamp."""
    if config.moe.bias:
        raise ValueError(f"{what}: expert_bias: expected False (Mixtral's experts have no biases), got True")
    if config.moe.activation != "silu":
        raise ValueError(f"{what}: activation: expected 'silu' (Mixtral's experts), got {config.moe.activation!r}")


def mixtral_config(config: TransformerConfig, **overrides):
    """A transformers MixtralConfig of the same model (overrides: extra MixtralConfig fields)."""
    from transformers import MixtralConfig

    check_mixtral_router(config.moe, "mixtral_config")
    check_mixtral_experts(config, "mixtral_config")
    options = dict(
        vocab_size=config.vocab_size, hidden_size=config.d_model, intermediate_size=config.moe.ffn_size,
        num_hidden_layers=config.n_layers, num_attention_heads=config.n_q_heads,
        num_key_value_heads=config.n_kv_heads, head_dim=config.head_dim, num_local_experts=config.moe.num_experts,
        num_experts_per_tok=config.moe.top_k, router_aux_loss_coef=config.moe.aux_loss_coef,
        rms_norm_eps=config.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta}, tie_word_embeddings=False)
    return MixtralConfig(**{**options, **overrides})


def _full_state_dict(hf_model, config: TransformerConfig) -> dict[str, Tensor]:
    """Our full (unsharded) state dict of a MixtralForCausalLM: its dense weights from its state
    dict, each layer's router and experts as read_block reads its sparse block."""
    state = {k: v.detach() for k, v in hf_model.state_dict().items()}
    blocks = [layer.mlp for layer in hf_model.model.layers]
    M, K, D = config.d_model, config.n_kv_heads, config.head_dim
    Q = config.n_q_heads // K
    full = {"embedding.weight": state["model.embed_tokens.weight"], "final_norm.weight": state["model.norm.weight"],
            "unembedding.weight": state["lm_head.weight"]}
    for i, block in zip(range(config.n_layers), blocks, strict=True):
        hf, ours = f"model.layers.{i}.", f"blocks.{i}."
        q = state[hf + "self_attn.q_proj.weight"].reshape(K, Q, D, M)
        k = state[hf + "self_attn.k_proj.weight"].reshape(K, D, M)
        v = state[hf + "self_attn.v_proj.weight"].reshape(K, D, M)
        o = state[hf + "self_attn.o_proj.weight"].reshape(M, K, Q, D)
        read = read_block(block)
        full.update({
            ours + "attn_norm.weight": state[hf + "input_layernorm.weight"],
            ours + "attention.w_q": q.permute(3, 1, 0, 2),
            ours + "attention.w_kv": torch.stack([k.permute(2, 0, 1), v.permute(2, 0, 1)]),
            ours + "attention.w_o": o.permute(0, 2, 1, 3),
            ours + "ffn_norm.weight": state[hf + "post_attention_layernorm.weight"],
            ours + "moe.gate_weight": read.gate_weight.detach(),
            ours + "moe.gate_up_proj": read.gate_up_proj.detach(),
            ours + "moe.down_proj": read.down_proj.detach(),
        })
    return {name: t.contiguous() for name, t in full.items()}


def to_mixtral_state_dict(full: dict[str, Tensor], config: TransformerConfig) -> dict[str, Tensor]:
    """A MixtralForCausalLM state dict from our full state dict (the inverse of _full_state_dict)."""
    check_mixtral_router(config.moe, "to_mixtral_state_dict")
    check_mixtral_experts(config, "to_mixtral_state_dict")
    M, K, D = config.d_model, config.n_kv_heads, config.head_dim
    Q = config.n_q_heads // K
    state = {"model.embed_tokens.weight": full["embedding.weight"], "model.norm.weight": full["final_norm.weight"],
             "lm_head.weight": full["unembedding.weight"]}
    for i in range(config.n_layers):
        hf, ours = f"model.layers.{i}.", f"blocks.{i}."
        w_kv = full[ours + "attention.w_kv"]
        state.update({
            hf + "input_layernorm.weight": full[ours + "attn_norm.weight"],
            hf + "self_attn.q_proj.weight": full[ours + "attention.w_q"].permute(2, 1, 3, 0).reshape(K * Q * D, M),
            hf + "self_attn.k_proj.weight": w_kv[0].permute(1, 2, 0).reshape(K * D, M),
            hf + "self_attn.v_proj.weight": w_kv[1].permute(1, 2, 0).reshape(K * D, M),
            hf + "self_attn.o_proj.weight": full[ours + "attention.w_o"].permute(0, 2, 1, 3).reshape(M, K * Q * D),
            hf + "post_attention_layernorm.weight": full[ours + "ffn_norm.weight"],
            hf + "mlp.gate.weight": full[ours + "moe.gate_weight"].t(),
            hf + "mlp.experts.gate_up_proj": full[ours + "moe.gate_up_proj"],
            hf + "mlp.experts.down_proj": full[ours + "moe.down_proj"],
        })
    return {name: t.contiguous() for name, t in state.items()}


def from_mixtral(hf_model, *, mesh=None, backward: str = "explicit", dtype: torch.dtype | None = None) -> Transformer:
    """A Transformer holding a MixtralForCausalLM's weights (this rank's shards under a mesh)."""
    config = config_from_mixtral(hf_model.config)
    full = _full_state_dict(hf_model, config)
    model = Transformer(config, mesh=mesh, backward=backward, dtype=dtype or full["unembedding.weight"].dtype)
    model.load_full_state_dict(full)
    return model


def export_mixtral(model: Transformer) -> dict[str, Tensor]:
    """The MixtralForCausalLM state dict of a Transformer. Collective under a mesh (gathers)."""
    return to_mixtral_state_dict(model.full_state_dict(), model.config)
