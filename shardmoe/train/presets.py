"""Architecture presets (`shardmoe train --arch NAME`, `arch = "NAME"` in a config file).

A preset is a row of overrides of the training settings, written like a config file: top-level
TrainConfig settings and a `model` table of the model's options (TransformerConfig's flat form).
A run's settings are

    TrainConfig defaults  <  ARCH_PRESETS[arch]  <  the config file  <  command-line flags

each layer replacing the settings it names; the `model` tables merge field by field, so a file
that sets `model.d_model` keeps the preset's experts. The defaults of TrainConfig and
TransformerConfig are the Mixtral-like model, so its row is empty. Another architecture is one
more row; a row naming an unknown setting fails like a config file would (tests/train/test_presets.py
resolves every row).

deepseek: DeepSeek-V3's MoE at the tiny default's scale. Fine-grained experts: 16 of width 64
instead of 4 of 192, top-4 instead of top-2, plus one always-on shared expert of the routed width
(V3's n_shared_experts=1), so a token uses 4 * 64 + 64 = 320 expert columns against Mixtral-like's
2 * 192 = 384 (similar step cost) from 16 * 64 + 64 = 1088 (more, finer-grained specialists).
Sigmoid scores, group-limited selection (4 groups of 4 experts, the best 2 groups; a group scores
the sum of its two best), renormalised with V3's +1e-20; balance from the correction bias alone
(V3's aux-loss-free update, rate 0.001 per step, V3's gamma), every auxiliary loss off.

mixtral-1gpu: the Mixtral-like model sized for one 80 GB GPU (`--device cuda`): d_model 2048, 4
blocks of 16 query heads over 8 kv heads of 128, 8 SwiGLU experts of 7168 (Mixtral's F / M of
3.5), top-2; 1.46 B parameters, 21.8 GiB of fp32 weights, gradients and AdamW moments, then
the activations of 4 rows of 4096 tokens in bf16 autocast. Learning rate and warm-up of a model
of that size (3e-4 over 100 steps). The lease's train stage measures it
(shardmoe/tools/gpu_check/train.py).
"""
from __future__ import annotations

DEFAULT_ARCH = "mixtral"

ARCH_PRESETS: dict[str, dict] = {
    "mixtral": {},  # softmax top-2 of 4 SwiGLU experts, aux-loss balancing: the defaults
    "deepseek": {"model": {"num_experts": 16, "top_k": 4, "ffn_size": 64, "shared_ffn_size": 64,
                           "score_func": "sigmoid", "n_group": 4, "topk_group": 2, "renormalize_epsilon": 1e-20,
                           "correction_bias": True, "bias_update_rate": 0.001, "aux_loss_coef": 0.0,
                           "z_loss_coef": 0.0}},
    "mixtral-1gpu": {"dtype": "bfloat16", "seq_len": 4096, "batch_size": 4, "lr": 3e-4, "warmup_steps": 100,
                     "steps": 2000, "eval_every": 200, "checkpoint_every": 500, "sample_every": 500,
                     "model": {"d_model": 2048, "n_layers": 4, "n_q_heads": 16, "n_kv_heads": 8, "head_dim": 128,
                               "num_experts": 8, "top_k": 2, "ffn_size": 7168}},
}


def check_arch(name, argument: str = "arch") -> str:
    """`name` if it is a preset; otherwise ValueError naming `argument` and listing the presets."""
    if not isinstance(name, str) or name not in ARCH_PRESETS:
        raise ValueError(f"{argument}: expected one of the presets {', '.join(ARCH_PRESETS)}, got {name!r}")
    return name


def with_preset(values: dict) -> dict:
    """Config-file values over the preset they name (`arch`, default DEFAULT_ARCH); `model` merged
    field by field. Returns the values for TrainConfig.from_dict, `arch` included."""
    arch = check_arch(values.get("arch", DEFAULT_ARCH))
    preset = ARCH_PRESETS[arch]
    merged = {**preset, **values, "arch": arch}
    if isinstance(preset.get("model"), dict) and isinstance(values.get("model", {}), dict):
        merged["model"] = {**preset["model"], **values.get("model", {})}
    return merged
