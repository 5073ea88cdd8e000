"""MoEConfig: the options of one MoE layer, validated once, before any work.

Every error names the argument, the expected value and the actual one, so a
bad configuration fails at construction rather than deep inside a GEMM.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from shardmoe.expert_kinds import ACTIVATIONS, EXPERT_KINDS, GLU, ExpertKind, expert_kind
from shardmoe.moe.activations import ClampedSwiGLU

GLU_ACTIVATIONS = GLU.activations  # every activation name: ACTIVATIONS and the clamped SwiGLU
SCORE_FUNCS = ("softmax", "sigmoid")
FLOAT32_MAX = 3.4028234663852886e38  # the largest float32: options the kernels take as float32 scalars


def _check_int(name: str, value, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    if value < low or (high is not None and value > high):
        span = f">= {low}" if high is None else f"in {low}..{high}"
        raise ValueError(f"{name}: expected an int {span}, got {value}")


def is_finite_number(value) -> bool:
    """Whether value is an int or a float (not a bool) with a finite float value: an int beyond the
    float range (a JSON file may hold one) makes math.isfinite raise OverflowError instead."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def check_bool(name: str, value) -> None:
    # a string such as "false" is truthy: taken as a flag it would switch the option on
    if not isinstance(value, bool):
        raise ValueError(f"{name}: expected a bool, got {value!r}")


def check_bool_fields(config) -> None:
    """check_bool on every field of the dataclass `config` annotated `bool` (the switches)."""
    for f in dataclasses.fields(config):
        if f.type == "bool":  # annotations are strings here (from __future__ import annotations)
            check_bool(f.name, getattr(config, f.name))


def _check_choice(name: str, value, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(choices)}, got {value!r}")


@dataclass(frozen=True)
class MoEConfig:
    """Shape and routing options of an MoE layer.

    hidden_size H, ffn_size F ("glu") or P ("mlp"), num_experts E, top_k k.
    capacity_factor None means dropless; otherwise each expert keeps its first
    EC = min(S, ceil(S / E * capacity_factor * k)) tokens in token order
    bias adds b1 [E, P], b2 [E, H] ("mlp") or gate_up_proj_bias [E, 2F], down_proj_bias [E, H]
    ("glu", GPT-OSS's names, in the layer's [gate | up] layout, not GPT-OSS's interleaved one).
    (An expert can receive at most S tokens, so any capacity factor >= E / k keeps every pair.)

    activation="clamped_swiglu" (expert="glu" only) is GPT-OSS's: gc = min(hg, swiglu_limit),
    uc = clamp(hu, -swiglu_limit, swiglu_limit), a = (uc + 1) * gc * sigmoid(swiglu_alpha * gc)
    (shardmoe/moe/activations.ClampedSwiGLU); another activation refuses a non-default constant.

    Router options (formulas in shardmoe/moe/routing.py and docs/moe.md): score_func "softmax"
    (Mixtral, Qwen, GPT-OSS) or "sigmoid" (DeepSeek-V3); router_bias, a learnable [E] bias added
    to the logits (GPT-OSS); correction_bias, a selection-only [E] buffer moved by
    b_e += bias_update_rate * sign(mean load - load_e) (DeepSeek-V3 aux-loss-free balancing);
    group-limited selection over n_group groups of E / n_group experts, keeping the topk_group
    groups with the largest sums of their two best scores; renormalize_epsilon added to the
    renormalisation's denominator (DeepSeek-V3: 1e-20); routed_scaling_factor multiplying the
    combine weights; seq_aux_loss_coef weighting the DeepSeek-V3 sequence-wise balance loss.

    Shared experts (shardmoe/moe/shared_experts.py): shared_ffn_size Fs > 0 adds an always-on dense
    GLU expert of width Fs in the layer's activation (DeepSeek's n_shared experts of width I are
    Fs = n_shared * I); shared_gate scales its output per token by sigmoid(x . shared_gate_weight)
    (Qwen2-MoE).
    """

    hidden_size: int
    ffn_size: int
    num_experts: int
    top_k: int
    expert: str = "glu"
    activation: str = "silu"
    output_activation: str = "identity"
    bias: bool = False
    renormalize: bool = True
    capacity_factor: float | None = None
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    score_func: str = "softmax"
    router_bias: bool = False
    correction_bias: bool = False
    bias_update_rate: float = 0.001
    n_group: int = 1
    topk_group: int = 1
    renormalize_epsilon: float = 0.0
    routed_scaling_factor: float = 1.0
    seq_aux_loss_coef: float = 0.0
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    shared_ffn_size: int = 0
    shared_gate: bool = False

    def __post_init__(self) -> None:
        _check_int("hidden_size", self.hidden_size, 1)
        _check_int("ffn_size", self.ffn_size, 1)
        _check_int("num_experts", self.num_experts, 1)
        _check_int("top_k", self.top_k, 1, self.num_experts)
        _check_choice("expert", self.expert, EXPERT_KINDS)
        check_bool_fields(self)
        kind = self.kind
        if self.activation == "clamped_swiglu" and self.activation not in kind.activations:
            raise ValueError(f"activation: 'clamped_swiglu' expects expert='glu', got expert={self.expert!r}")
        _check_choice("activation", self.activation, kind.activations)
        for name, default in (("swiglu_limit", 7.0), ("swiglu_alpha", 1.702)):
            v = getattr(self, name)
            if not is_finite_number(v) or not 0 < v <= FLOAT32_MAX:  # a float32 scalar of the kernels
                raise ValueError(f"{name}: expected a finite number > 0 (at most float32's {FLOAT32_MAX:.6g}), got {v!r}")
            if v != default and self.activation != "clamped_swiglu":  # it would be silently ignored
                raise ValueError(f"{name}: expected the default {default} with activation={self.activation!r} "
                                 f"(only 'clamped_swiglu' uses it), got {v!r}")
        _check_choice("output_activation", self.output_activation, ACTIVATIONS)
        if self.output_activation not in kind.output_activations:
            raise ValueError(f"output_activation: expected {' or '.join(map(repr, kind.output_activations))} for "
                             f"expert={self.expert!r}, got {self.output_activation!r}")
        if self.capacity_factor is not None:
            cf = self.capacity_factor
            if not is_finite_number(cf) or cf <= 0:
                raise ValueError(f"capacity_factor: expected None or a positive finite number, got {cf!r}")
        for name in ("aux_loss_coef", "z_loss_coef", "seq_aux_loss_coef", "bias_update_rate", "renormalize_epsilon"):
            v = getattr(self, name)
            if not is_finite_number(v) or v < 0:
                raise ValueError(f"{name}: expected a finite number >= 0, got {v!r}")
        self._check_router()
        self._check_shared()

    def _check_shared(self) -> None:
        _check_int("shared_ffn_size", self.shared_ffn_size, 0)
        if self.shared_gate and not self.shared_ffn_size:
            raise ValueError("shared_gate: expected False without a shared expert (shared_ffn_size=0), got True")
        # no model family pairs GPT-OSS's clamped SwiGLU with shared experts: refuse rather than guess
        if self.shared_ffn_size and self.activation == "clamped_swiglu":
            raise ValueError(f"activation: expected an activation other than 'clamped_swiglu' with shared experts "
                             f"(shared_ffn_size={self.shared_ffn_size}), got 'clamped_swiglu'")

    def _check_router(self) -> None:
        _check_choice("score_func", self.score_func, SCORE_FUNCS)
        v = self.routed_scaling_factor
        if not is_finite_number(v) or v <= 0:
            raise ValueError(f"routed_scaling_factor: expected a finite number > 0, got {v!r}")
        _check_int("n_group", self.n_group, 1, self.num_experts)
        if self.num_experts % self.n_group:
            raise ValueError(f"n_group: expected a divisor of num_experts={self.num_experts}, got {self.n_group}")
        _check_int("topk_group", self.topk_group, 1, self.n_group)
        reachable = self.topk_group * (self.num_experts // self.n_group)
        if reachable < self.top_k:
            raise ValueError(f"topk_group: expected topk_group * experts per group >= top_k={self.top_k}, got "
                             f"{self.topk_group} * {self.num_experts // self.n_group} = {reachable}")

    @property
    def kind(self) -> ExpertKind:
        """The expert kind `expert` names (shardmoe/expert_kinds.py): GLU or MLP."""
        return expert_kind(self.expert)

    @property
    def expert_param_names(self) -> tuple[str, ...]:
        """The routed experts' parameters, in the order the MoE operators take them: the kind's,
        its biases only with bias (glu), always (mlp: b1, b2, None without bias)."""
        return self.kind.param_names(self.bias)

    @property
    def shared_param_names(self) -> tuple[str, ...]:
        """The shared expert's parameters, in the order the MoE operators take them after the
        routed experts' (none when shared_ffn_size is 0; its gate's with shared_gate)."""
        if not self.shared_ffn_size:
            return ()
        return ("shared_gate_up_proj", "shared_down_proj") + (("shared_gate_weight",) if self.shared_gate else ())

    @property
    def expert_activation(self) -> str | ClampedSwiGLU:
        """The `activation` the expert stage functions (moe/experts.py) take: the name, or for
        "clamped_swiglu" a ClampedSwiGLU holding the two constants."""
        if self.activation == "clamped_swiglu":
            return ClampedSwiGLU(float(self.swiglu_limit), float(self.swiglu_alpha))
        return self.activation

    @property
    def can_drop(self) -> bool:
        """Whether a capacity may drop a pair: an expert receives at most S pairs (a token picks k
        distinct experts), so a factor with cf * k >= E keeps every one (decided without S: the
        product S / E * cf * k overflows to inf for a huge finite factor)."""
        return self.capacity_factor is not None and self.capacity_factor * self.top_k < self.num_experts

    def capacity(self, num_tokens: int) -> int | None:
        """Expert capacity EC for S tokens, or None when dropless."""
        if self.capacity_factor is None:
            return None
        if not self.can_drop:
            return num_tokens
        return math.ceil(num_tokens / self.num_experts * self.capacity_factor * self.top_k)
