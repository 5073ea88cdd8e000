"""The transformers MoE families shardmoe.hf is tested against, and small random configs of them.

FAMILIES maps a family (transformers' model type) to its config class and sparse block class.
`small_config` builds a config of that family from shardmoe's sizes (hidden H, expert width F,
E experts, top-k), with every MoE feature the family has switched on: shared experts
(Qwen2-MoE, DeepSeek-V3), group-limited sigmoid routing with its scaling factor (DeepSeek-V3),
router biases and the clamped SwiGLU (GPT-OSS), the router aux loss (all but DeepSeek-V3, which
has none). Nothing is downloaded: the configs are built from their classes.
"""
from __future__ import annotations

# family -> (config class, sparse block class), both in transformers.models.<family>
FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralSparseMoeBlock"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeSparseMoeBlock"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeSparseMoeBlock"),
    "olmoe": ("OlmoeConfig", "OlmoeSparseMoeBlock"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3MoE"),
    "gpt_oss": ("GptOssConfig", "GptOssMLP"),
}


def check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"family: expected one of {', '.join(FAMILIES)}, got {family!r}")


def small_config(family: str, hidden_size: int = 16, ffn_size: int = 12, num_experts: int = 4, top_k: int = 2,
                 num_layers: int = 2, vocab_size: int = 64, heads: int = 2, aux_loss_coef: float = 0.02,
                 **config_options):
    """A config of `family` with these sizes (DeepSeek-V3: its first layer dense, the others MoE,
    num_experts in 2 groups of which 1 is kept); config_options override the config's fields
    (e.g. n_shared_experts=0)."""
    import transformers

    check_family(family)
    kw = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=heads,
              max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, num_experts_per_tok=top_k)
    if family == "deepseek_v3":
        kw.update(num_key_value_heads=heads, intermediate_size=2 * ffn_size, moe_intermediate_size=ffn_size,
                  n_routed_experts=num_experts, n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
                  routed_scaling_factor=2.5, q_lora_rank=None, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
                  v_head_dim=4)
    else:
        kw.update(num_key_value_heads=1, head_dim=hidden_size // heads, output_router_logits=True,
                  router_aux_loss_coef=aux_loss_coef)
    if family in ("mixtral", "gpt_oss"):
        kw.update(intermediate_size=ffn_size, num_local_experts=num_experts)
    if family == "gpt_oss":
        kw.update(layer_types=None)
    if family in ("qwen2_moe", "qwen3_moe"):
        kw.update(intermediate_size=2 * ffn_size, moe_intermediate_size=ffn_size, num_experts=num_experts,
                  norm_topk_prob=family == "qwen3_moe")
    if family == "qwen2_moe":
        kw.update(shared_expert_intermediate_size=ffn_size)
    if family == "olmoe":
        kw.update(intermediate_size=ffn_size, num_experts=num_experts, norm_topk_prob=False)
    kw.update(config_options)
    return getattr(transformers, FAMILIES[family][0])(**kw)
