"""The two expert kinds of an MoE layer, GLU and MLP: what differs between them.

Per expert e, on dispatched rows x [N, H]:
  "glu"  gate_up_proj [E, 2F, H] (rows 0:F gate, F:2F up), down_proj [E, H, F]; with bias also
         gate_up_proj_bias [E, 2F], down_proj_bias [E, H] (GPT-OSS's names)
         h = x Wgu_e^T + bgu_e = [hg | hu]  [N, 2F];  a = act(hg) * hu  [N, F];  y = a Wdown_e^T + bdown_e
         saves h
  "mlp"  w1 [E, P, H], b1 [E, P], w2 [E, H, P], b2 [E, H] (b1, b2 None without bias)
         z1 = x W1_e^T + b1_e  [N, P];  a1 = act(z1);  z2 = a1 W2_e^T + b2_e  [N, H];  y = act_out(z2)
         saves z1, z2

Both have the same four parameters under their own names: an up projection [E, U, H] and its bias
[E, U] (U = 2F for "glu", P for "mlp"), a down projection [E, H, F or P] and its bias [E, H].
MoEConfig.expert names the kind and config.kind is its object (GLU or MLP), which the stage
functions take. A kind holds its names, whole and shard shapes, accepted activations and what its
forward saves. The kernels (kernels/stages.py) need only these, and import nothing of moe/, so
this module is a leaf; it therefore holds no stage function itself: where the computation differs,
each implementation has one function per kind beside its other stage functions (moe/experts.py,
moe/triton_ops.py, the tile bodies of tasks/kernels.py), looked up by these two objects.
"""
from __future__ import annotations

import abc

import torch

# the elementwise activations (moe/activations.py): every kind's act, and the mlp's act_out
ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu", "identity")


class ExpertKind(abc.ABC):
    """The parameter names, widths and saved tensors of one expert kind. GLU and MLP are its only
    instances: the stage implementations key their per-kind functions by them."""

    name: str
    up: str  # [E, U, H]
    up_bias: str  # [E, U]
    down: str  # [E, H, F or P]
    down_bias: str  # [E, H]
    gated: bool  # the up projection is [gate | up] and a = act(hg) * hu (the kernels' GLU epilogue)
    activations: tuple[str, ...]  # the `activation` names it takes
    output_activations: tuple[str, ...]  # the `output_activation` names it takes
    # {name: (spec of the whole tensor, spec of a rank's shard)} in shardmoe/notation.py's notation:
    # experts split over 'e', the intermediate dim over 't' (shardmoe/parallel/expert_tensor.py)
    shard_specs: dict[str, tuple[str, str]]
    # whether the forward keeps the down projection's output z2 beside the up projection's z
    keeps_z2: bool
    # whether the gate dot g . y is taken over the intermediate dim, as (g Wdown) . a, without the
    # down bias's term g . bdown: a partial sum when that dim is split over 't'
    partial_gate_dot: bool

    @property
    def bias_names(self) -> tuple[str, str]:
        return self.up_bias, self.down_bias

    @abc.abstractmethod
    def up_width(self, ffn: int) -> int:
        """U, the up projection's output width for intermediate size F (or P)."""

    @abc.abstractmethod
    def up_columns(self, cols: slice, ffn: int) -> tuple[slice, ...]:
        """The columns of the up projection's output (the rows of its weight) that make columns
        `cols` of the activation a [N, F]."""

    @abc.abstractmethod
    def param_names(self, bias: bool) -> tuple[str, ...]:
        """The expert parameters in the MoE operators' order."""

    @abc.abstractmethod
    def whole_shapes(self, hidden: int, ffn: int, experts: int) -> dict[str, tuple[int, ...]]:
        """{name: whole shape} of every expert parameter, biases included, in the order the layer
        registers them."""

    def saved(self, z: torch.Tensor, z2: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """What the expert forward keeps for backward, of its up projection's output z [N, U] and
        its down projection's output z2 [N, H]."""
        return (z, z2) if self.keeps_z2 else (z,)

    def saved_widths(self, ffn: int, hidden: int) -> tuple[int, ...]:
        """The widths of the tensors saved(z, z2) keeps, each [N, width]."""
        return (self.up_width(ffn), hidden) if self.keeps_z2 else (self.up_width(ffn),)

    def __repr__(self) -> str:
        return self.name.upper()


class GluExpert(ExpertKind):
    """a = act(hg) * hu on h = [hg | hu]; y = a Wdown^T + bdown; saves h [N, 2F]."""

    name = "glu"
    up, up_bias, down, down_bias = "gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"
    gated = True
    activations = ACTIVATIONS + ("clamped_swiglu",)  # GPT-OSS's: (clamp(hu) + 1) f(min(hg, L))
    output_activations = ("identity",)
    # gate_up_proj and its bias in their [E, 2, F, H] and [E, 2, F] views: 't' splits the gate and up rows alike
    shard_specs = {up: ("E 2 F H", "E/e 2 F/t H"), down: ("E H F", "E/e H F/t"), up_bias: ("E 2 F", "E/e 2 F/t"),
                   down_bias: ("E H", "E/e H")}
    keeps_z2 = False  # the gate dot is (g Wdown) . a, and a comes back from h
    partial_gate_dot = True

    def up_width(self, ffn):
        return 2 * ffn

    def up_columns(self, cols, ffn):
        return cols, slice(ffn + cols.start, ffn + cols.stop)  # the gate's, then the up's

    def param_names(self, bias):
        return (self.up, self.up_bias, self.down, self.down_bias) if bias else (self.up, self.down)

    def whole_shapes(self, hidden, ffn, experts):
        return {self.up: (experts, 2 * ffn, hidden), self.up_bias: (experts, 2 * ffn),
                self.down: (experts, hidden, ffn), self.down_bias: (experts, hidden)}


class MlpExpert(ExpertKind):
    """a1 = act(z1); y = act_out(z2); saves z1 [N, P], z2 [N, H]."""

    name = "mlp"
    up, up_bias, down, down_bias = "w1", "b1", "w2", "b2"
    gated = False
    activations = ACTIVATIONS
    output_activations = ACTIVATIONS
    shard_specs = {up: ("E P H", "E/e P/t H"), up_bias: ("E P", "E/e P/t"), down: ("E H P", "E/e H P/t"),
                   down_bias: ("E H", "E/e H")}
    keeps_z2 = True  # for act_out'(z2) and the gate dot g . act_out(z2)
    partial_gate_dot = False  # g . act_out(z2), from the whole z2

    def up_width(self, ffn):
        return ffn

    def up_columns(self, cols, ffn):
        return (cols,)

    def param_names(self, bias):
        return self.up, self.up_bias, self.down, self.down_bias  # the biases None without bias

    def whole_shapes(self, hidden, ffn, experts):
        return {self.up: (experts, ffn, hidden), self.down: (experts, hidden, ffn), self.up_bias: (experts, ffn),
                self.down_bias: (experts, hidden)}


GLU, MLP = GluExpert(), MlpExpert()
KINDS = {kind.name: kind for kind in (GLU, MLP)}
EXPERT_KINDS = tuple(KINDS)  # the names MoEConfig.expert takes


def expert_kind(name: str) -> ExpertKind:
    """The kind called `name` ("glu" or "mlp")."""
    return KINDS[name]
