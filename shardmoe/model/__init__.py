"""Dense layers of the Mixtral-like transformer, each with an explicit backward.

Every layer exposes `<layer>_forward(...) -> (out, residuals)` and
`<layer>_backward(residuals, grad_out) -> (grad_in, grads)` with NamedTuple residuals and grads,
an autograd.Function running that backward, a functional entry point taking
`backward="explicit" | "autograd"`, and an nn.Module whose `SPECS` give each weight's named-axis
spec. All take `mesh=None` (single process) or a shardmoe.Mesh (FSDP over d, Megatron over t).
See docs/model.md for the formulas and layouts. The assembled MoE transformer is
`Transformer` (transformer.py); transformers interop (a MixtralForCausalLM as a Transformer) is
in shardmoe/hf/mixtral.py.
"""
from .attention import Attention, AttentionGrads, AttentionResiduals, attention, attention_backward, attention_forward
from .config import DenseConfig
from .embedding import Embedding, EmbeddingGrads, EmbeddingResiduals, embed, embedding_backward, embedding_forward
from .rmsnorm import RMSNorm, RMSNormGrads, RMSNormResiduals, rms_norm, rms_norm_backward, rms_norm_forward
from .rope import RopeTable, apply_rope, rope_backward, rope_forward, rope_table
from .segments import PackedLayout, attention_mask, packed_layout
from .transformer import Losses, Transformer, TransformerConfig
from .unembed import (CrossEntropyGrads, CrossEntropyResiduals, Unembedding, cross_entropy_backward,
                      cross_entropy_forward, unembed_cross_entropy, unembed_logits)

__all__ = [
    "Attention", "AttentionGrads", "AttentionResiduals", "attention", "attention_backward", "attention_forward",
    "DenseConfig",
    "Embedding", "EmbeddingGrads", "EmbeddingResiduals", "embed", "embedding_backward", "embedding_forward",
    "RMSNorm", "RMSNormGrads", "RMSNormResiduals", "rms_norm", "rms_norm_backward", "rms_norm_forward",
    "RopeTable", "apply_rope", "rope_backward", "rope_forward", "rope_table",
    "PackedLayout", "attention_mask", "packed_layout",
    "Losses", "Transformer", "TransformerConfig",
    "CrossEntropyGrads", "CrossEntropyResiduals", "Unembedding", "cross_entropy_backward",
    "cross_entropy_forward", "unembed_cross_entropy", "unembed_logits",
]
