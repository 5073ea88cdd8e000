"""The configurations the checker runs: the float64 matrix, its quick subset, the precision set.

A CheckCase is one MoE configuration plus the token layout it is fed. The
matrix crosses every option that changes the math:

  expert kind x activation (x output activation and bias for "mlp")
  x renormalize on/off x capacity on/off x top_k = 1..E

on S = 13 tokens, with the aux and z losses switched on in half of the cases
(alternating, so each other option is seen both with and without them), and
adds the edge cases: an expert that receives no tokens (dropless and with
capacity), S = 1, S = 0, and tokens with more than one leading dim. The router
matrix crosses the router families (ROUTERS: sigmoid, router and correction
biases, groups, epsilon, scaling) with capacity x top_k x the losses (aux, z and
sequence-wise, on 3 sequences of 5 tokens), and adds ties in the selection scores. The
expert-option matrix crosses the glu's GPT-OSS options (biases, the clamped SwiGLU, both)
with the plain softmax router and every router family, x capacity x top_k the same way. The
shared matrix crosses the shared expert (plain, and gated as Qwen2-MoE's) with the plain and the
DeepSeek-V3 router x capacity x top_k, beside mlp experts and with tied scores.

Shapes are tiny (H=8, F=6, E=4) so that the full matrix runs in seconds on a CPU.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

from shardmoe.moe.config import MoEConfig

HIDDEN, FFN, EXPERTS, TOKENS = 8, 6, 4, 13

# Capacity factor used whenever capacity is on: below 1 so that some pairs are always
# dropped (E * EC ~ 0.5 * S * k < S * k), which exercises the dropped-pair paths.
CAPACITY_FACTOR = 0.5
AUX_LOSS_COEF, Z_LOSS_COEF = 0.5, 0.1

GLU_ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu", "identity")
# "mlp" (activation, output activation) pairs: every activation with identity on the
# output, and every activation once as the output activation.
MLP_ACTIVATIONS = (
    ("relu", "identity"), ("gelu", "identity"), ("gelu_tanh", "identity"), ("silu", "identity"),
    ("identity", "identity"), ("relu", "gelu"), ("gelu", "gelu_tanh"), ("gelu_tanh", "silu"),
    ("silu", "relu"), ("identity", "silu"),
)


@dataclass(frozen=True)
class CheckCase:
    """One configuration to check.

    tokens_shape: leading dims of x (S = their product), x is [*tokens_shape, H].
    empty_expert: an expert the inputs are built to route no token to, or None.
    seed: seeds the random inputs (see inputs.make_inputs).
    """

    config: MoEConfig
    tokens_shape: tuple[int, ...] = (TOKENS,)
    empty_expert: int | None = None
    seed: int = 0
    tie: bool = False  # expert 1's gate column (and correction bias) copies expert 0's: tied scores

    @property
    def num_tokens(self) -> int:
        return math.prod(self.tokens_shape)

    @property
    def name(self) -> str:
        c = self.config
        parts = [c.expert, c.activation if c.expert == "glu" else f"{c.activation}>{c.output_activation}"]
        if c.activation == "clamped_swiglu":
            parts.append(f"L{c.swiglu_limit:g}a{c.swiglu_alpha:g}")
        if c.bias:
            parts.append("bias")
        if (c.hidden_size, c.ffn_size) != (HIDDEN, FFN):
            parts.append(f"H{c.hidden_size}F{c.ffn_size}")
        parts.append(f"k{c.top_k}")
        parts.append("renorm" if c.renormalize else "raw")
        if c.capacity_factor is not None:
            parts.append(f"cap{c.capacity_factor:g}")
        parts += _router_tags(c)
        if c.shared_ffn_size:
            parts.append(f"shared{c.shared_ffn_size}" + ("gate" if c.shared_gate else ""))
        if c.aux_loss_coef or c.z_loss_coef or c.seq_aux_loss_coef:
            parts.append("aux")
        if self.tie:
            parts.append("tie")
        if self.empty_expert is not None:
            parts.append(f"empty{self.empty_expert}")
        parts.append("S=" + "x".join(map(str, self.tokens_shape)))
        return "-".join(parts)


# Router families, as MoEConfig options (E = 4: groups of 2, or of 1 expert).
ROUTERS = (
    dict(score_func="sigmoid"),
    dict(score_func="sigmoid", correction_bias=True, n_group=2, topk_group=1, renormalize_epsilon=1e-20,
         routed_scaling_factor=2.5),  # DeepSeek-V3
    dict(router_bias=True),  # GPT-OSS
    dict(correction_bias=True, n_group=4, topk_group=2),
    dict(score_func="sigmoid", router_bias=True, renormalize=False, routed_scaling_factor=1.5),
)
SEQ_AUX_LOSS_COEF = 0.3
ROUTER_TOKENS = (3, 5)  # 3 sequences of 5 tokens for the sequence-wise loss


def _router_tags(c: MoEConfig) -> list[str]:
    tags = [] if c.score_func == "softmax" else [c.score_func]
    tags += [tag for tag, on in (("rbias", c.router_bias), ("cbias", c.correction_bias)) if on]
    if c.n_group > 1:
        tags.append(f"g{c.topk_group}of{c.n_group}")
    if c.renormalize_epsilon:
        tags.append(f"eps{c.renormalize_epsilon:g}")
    if c.routed_scaling_factor != 1.0:
        tags.append(f"x{c.routed_scaling_factor:g}")
    return tags


def _router_config(router: dict, *, top_k: int = 2, capacity: bool = False, aux: bool = False) -> MoEConfig:
    return dataclasses.replace(_config("glu", "silu", top_k=top_k, capacity=capacity, aux=aux),
                               seq_aux_loss_coef=SEQ_AUX_LOSS_COEF if aux else 0.0, **router)


def router_matrix() -> list[CheckCase]:
    """Every router family x capacity x top_k = 1, 2 (the losses on in half, alternating), glu
    experts on 3 sequences of 5 tokens; plus each family with tied scores (k = 2, losses on)."""
    cases = []
    for router in ROUTERS:
        for capacity, top_k in itertools.product((False, True), (1, 2)):
            config = _router_config(router, top_k=top_k, capacity=capacity, aux=(top_k + capacity) % 2 == 1)
            cases.append(CheckCase(config, tokens_shape=ROUTER_TOKENS))
    cases += [CheckCase(_router_config(router, aux=True), tokens_shape=ROUTER_TOKENS, tie=True) for router in ROUTERS]
    return cases


# The glu's expert options (GPT-OSS), crossed with the routers. h ~ N(0, 1) by inputs.py's draw, so
# a limit of 1 clamps ~16% of the gate and ~32% of the up entries.
CLAMP_LIMIT = 1.0
EXPERT_OPTIONS = (
    dict(bias=True),
    dict(activation="clamped_swiglu", swiglu_limit=CLAMP_LIMIT),
    dict(bias=True, activation="clamped_swiglu", swiglu_limit=CLAMP_LIMIT),
)


def _expert_option_config(options: dict, router: dict, *, top_k: int = 2, capacity: bool = False,
                          aux: bool = False) -> MoEConfig:
    return dataclasses.replace(_router_config(router, top_k=top_k, capacity=capacity, aux=aux), **options)


def expert_option_matrix() -> list[CheckCase]:
    """Every expert option x (the plain softmax router and every router family) x capacity x
    top_k = 1, 2 (the losses on in half, alternating), on 3 sequences of 5 tokens."""
    cases = []
    for options, router in itertools.product(EXPERT_OPTIONS, ({}, *ROUTERS)):
        for capacity, top_k in itertools.product((False, True), (1, 2)):
            config = _expert_option_config(options, router, top_k=top_k, capacity=capacity,
                                           aux=(top_k + capacity) % 2 == 1)
            cases.append(CheckCase(config, tokens_shape=ROUTER_TOKENS))
    return cases


SHARED_FFN = 4  # another width than the routed F = 6
SHARED = (dict(shared_ffn_size=SHARED_FFN), dict(shared_ffn_size=SHARED_FFN, shared_gate=True))


def shared_matrix() -> list[CheckCase]:
    """Each shared expert of SHARED x {the softmax router, DeepSeek-V3's (ROUTERS[1])} x capacity x
    top_k = 1, 2 (the losses on in half, alternating), glu experts on 3 sequences of 5 tokens; plus
    the gated one beside biased "mlp" experts, and with tied scores under the DeepSeek-V3 router."""
    cases = []
    for shared, router in itertools.product(SHARED, ({}, ROUTERS[1])):
        for capacity, top_k in itertools.product((False, True), (1, 2)):
            config = _router_config(router, top_k=top_k, capacity=capacity, aux=(top_k + capacity) % 2 == 1)
            cases.append(CheckCase(dataclasses.replace(config, **shared), tokens_shape=ROUTER_TOKENS))
    gated = SHARED[1]
    cases.append(CheckCase(dataclasses.replace(_config("mlp", "gelu", bias=True, capacity=True, aux=True), **gated)))
    tied = dataclasses.replace(_router_config(ROUTERS[1], aux=True), **gated)
    cases.append(CheckCase(tied, tokens_shape=ROUTER_TOKENS, tie=True))
    return cases


def _config(expert: str, activation: str, output_activation: str = "identity", *, bias: bool = False,
            top_k: int = 2, renormalize: bool = True, capacity: bool = False, aux: bool = False) -> MoEConfig:
    return MoEConfig(
        HIDDEN, FFN, EXPERTS, top_k, expert=expert, activation=activation,
        output_activation=output_activation, bias=bias, renormalize=renormalize,
        capacity_factor=CAPACITY_FACTOR if capacity else None,
        aux_loss_coef=AUX_LOSS_COEF if aux else 0.0, z_loss_coef=Z_LOSS_COEF if aux else 0.0,
    )


def _expert_variants() -> list[tuple[str, str, str, bool]]:
    """(expert, activation, output activation, bias) for every expert kind."""
    glu = [("glu", act, "identity", False) for act in GLU_ACTIVATIONS]
    mlp = [("mlp", act, out, bias) for act, out in MLP_ACTIVATIONS for bias in (False, True)]
    return glu + mlp


def core_matrix() -> list[CheckCase]:
    """Every expert variant x renormalize x capacity x top_k on S tokens."""
    cases = []
    for expert, act, out, bias in _expert_variants():
        for renormalize, capacity, top_k in itertools.product((True, False), (False, True), range(1, EXPERTS + 1)):
            aux = (top_k + renormalize + capacity) % 2 == 1
            config = _config(expert, act, out, bias=bias, top_k=top_k, renormalize=renormalize,
                             capacity=capacity, aux=aux)
            cases.append(CheckCase(config))
    return cases


def edge_cases() -> list[CheckCase]:
    """An expert with no tokens, S = 1, S = 0 and multi-dim token layouts, for both expert kinds."""
    kinds = [("glu", "silu", "identity", False), ("mlp", "gelu", "relu", True)]
    cases = []
    for expert, act, out, bias in kinds:
        for renormalize, capacity in itertools.product((True, False), (False, True)):
            # top_k = E would select every expert, so an empty expert needs k < E.
            for top_k in range(1, EXPERTS):
                config = _config(expert, act, out, bias=bias, top_k=top_k, renormalize=renormalize,
                                 capacity=capacity, aux=True)
                cases.append(CheckCase(config, empty_expert=EXPERTS - 1))
            for top_k in (1, EXPERTS):
                config = _config(expert, act, out, bias=bias, top_k=top_k, renormalize=renormalize,
                                 capacity=capacity, aux=True)
                cases += [CheckCase(config, tokens_shape=shape) for shape in ((1,), (0,), (1, 1), (2, 0))]
        cases.append(CheckCase(_config(expert, act, out, bias=bias, capacity=True, aux=True), tokens_shape=(3, 5)))
    return cases


def full_matrix() -> list[CheckCase]:
    return core_matrix() + edge_cases() + router_matrix() + expert_option_matrix() + shared_matrix()


def quick_matrix() -> list[CheckCase]:
    """A subset of full_matrix touching every option: each expert variant once, rotating
    through the routing settings (renormalize x capacity x top_k), plus one case of each
    edge-case kind, and each router family once (rotating through capacity x top_k x losses)
    plus one tie, each expert option once (rotating through the routers and those settings), and
    three shared-expert cases (plain with DeepSeek-V3's router, gated with capacity, gated with ties)."""
    core, variants = core_matrix(), len(_expert_variants())
    per_variant = len(core) // variants
    # A stride coprime with per_variant (16) visits every routing setting in turn.
    cases = [core[v * per_variant + (5 * v) % per_variant] for v in range(variants)]
    seen = set()
    for case in edge_cases():
        kind = (case.config.expert, case.empty_expert is not None, case.tokens_shape)
        if kind not in seen:
            seen.add(kind)
            cases.append(case)
    routers = router_matrix()
    per_router = 4
    cases += [routers[r * per_router + r % per_router] for r in range(len(ROUTERS))]
    cases.append(routers[len(ROUTERS) * per_router + 1])
    options = expert_option_matrix()
    per_option = len(options) // len(EXPERT_OPTIONS)
    # stride 7 (coprime with 24) gives router 1, 3, 4 and all four (capacity, top_k) settings in turn
    cases += [options[o * per_option + (7 * o + 5) % per_option] for o in range(len(EXPERT_OPTIONS))]
    shared = shared_matrix()
    return cases + [shared[5], shared[10], shared[-1]]


def unit_size_cases() -> list[CheckCase]:
    """hidden_size 1, ffn_size 1 and both, for each expert kind: a size-1 dim makes a matrix's two
    strides both 1, the layout that grouped_mm's 16-byte stride rule has to be read correctly on.

    "mlp" with H = F = 1 draws seed 1: on seed 0's draw b1's gradient is a sum of ~6 scalars that
    cancels, and a plain bf16 autograd run of the float64 reference itself errs by 3.9e-2 there
    (shardmoe.MoE 4.8e-2), so that draw measures the sum's conditioning, not the layer."""
    cases = []
    for expert, act, out, bias in (("glu", "silu", "identity", False), ("mlp", "gelu", "silu", True)):
        for hidden, ffn in ((1, FFN), (HIDDEN, 1), (1, 1)):
            config = dataclasses.replace(_config(expert, act, out, bias=bias, top_k=2, aux=True),
                                         hidden_size=hidden, ffn_size=ffn)
            cases.append(CheckCase(config, seed=int(expert == "mlp" and hidden == ffn == 1)))
    return cases


def precision_cases() -> list[CheckCase]:
    """Configurations compared at fp32 and bf16 against float64: each expert kind with
    smooth and kinked activations, capacity, raw weights and the losses, and the unit sizes."""
    return [
        CheckCase(_config("glu", "silu", top_k=2)),
        CheckCase(_config("glu", "gelu", top_k=1, capacity=True, aux=True)),
        CheckCase(_config("glu", "relu", top_k=3, renormalize=False, aux=True)),
        CheckCase(_config("mlp", "gelu_tanh", "silu", bias=True, top_k=2, renormalize=False, capacity=True, aux=True)),
        CheckCase(_config("mlp", "relu", "identity", bias=True, top_k=3)),
        CheckCase(_config("mlp", "identity", "gelu", top_k=EXPERTS, aux=True)),
    ] + unit_size_cases() + [CheckCase(_router_config(router, aux=True), tokens_shape=ROUTER_TOKENS)
                             for router in ROUTERS[1:4]] + [
        # GPT-OSS whole (biased clamped SwiGLU, router bias) and the biased glu with DeepSeek-V3's router
        CheckCase(_expert_option_config(EXPERT_OPTIONS[2], ROUTERS[2], aux=True), tokens_shape=ROUTER_TOKENS),
        CheckCase(_expert_option_config(EXPERT_OPTIONS[0], ROUTERS[1], capacity=True, aux=True),
                  tokens_shape=ROUTER_TOKENS)]


def gradcheck_cases() -> list[CheckCase]:
    """Small float64 cases for finite differences (every input element costs two forwards)."""
    small = dict(hidden_size=4, ffn_size=3, num_experts=3)
    glu = dataclasses.replace(_config("glu", "silu", top_k=2, capacity=True, aux=True), **small)
    mlp = dataclasses.replace(_config("mlp", "gelu", "gelu_tanh", bias=True, top_k=2, renormalize=False, aux=True),
                              **small)
    mlp_relu = dataclasses.replace(_config("mlp", "relu", "identity", bias=True, top_k=3, capacity=True), **small)
    clamped = dataclasses.replace(_expert_option_config(EXPERT_OPTIONS[2], ROUTERS[2], aux=True), **small)
    return [CheckCase(config, tokens_shape=(5,)) for config in (glu, mlp, mlp_relu, clamped)]
