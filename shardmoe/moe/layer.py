"""MoE: the Mixture-of-Experts nn.Module (gate, dispatch, expert FFNs, combine).

  y = MoE(H, F, E, k)(x)         x [..., H] -> y [..., H]
  layer.aux_loss                 weighted aux + z loss of the last forward (differentiable)
  layer.stats                    tokens_per_expert, selected_per_expert, dropped_tokens, capacity

Parameters (design.md section 3): gate_weight [H, E]; "glu": gate_up_proj [E, 2F, H],
down_proj [E, H, F]; "mlp": w1 [E, P, H], b1 [E, P], w2 [E, H, P], b2 [E, H].
The forward and backward are FusedMoE (shardmoe/moe/function.py).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from shardmoe.moe.config import MoEConfig
from shardmoe.moe.function import FusedMoE, expert_param_names

# shardmoe activation name <-> transformers ACT2FN name
_MIXTRAL_ACT = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu"}


class MoE(nn.Module):
    def __init__(self, hidden_size: int, ffn_size: int, num_experts: int, top_k: int, *,
                 expert: str = "glu", activation: str = "silu", output_activation: str = "identity",
                 bias: bool = False, renormalize: bool = True, capacity_factor: float | None = None,
                 aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0, mesh=None,
                 dtype: torch.dtype | None = None, device=None):
        super().__init__()
        self.config = MoEConfig(hidden_size, ffn_size, num_experts, top_k, expert=expert,
                                activation=activation, output_activation=output_activation, bias=bias,
                                renormalize=renormalize, capacity_factor=capacity_factor,
                                aux_loss_coef=aux_loss_coef, z_loss_coef=z_loss_coef)
        if mesh is not None and (mesh.size("e") > 1 or mesh.size("t") > 1):
            raise ValueError(f"mesh: expert or tensor parallelism (e={mesh.size('e')}, t={mesh.size('t')}) "
                             "is not available in this build; expected a mesh with e=1 and t=1")
        self.mesh = mesh
        H, F, E = hidden_size, ffn_size, num_experts
        kw = {"dtype": dtype, "device": device}
        self.gate_weight = nn.Parameter(torch.empty(H, E, **kw))
        if expert == "glu":
            self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * F, H, **kw))
            self.down_proj = nn.Parameter(torch.empty(E, H, F, **kw))
        else:
            self.w1 = nn.Parameter(torch.empty(E, F, H, **kw))
            self.w2 = nn.Parameter(torch.empty(E, H, F, **kw))
            self.b1 = nn.Parameter(torch.empty(E, F, **kw)) if bias else None
            self.b2 = nn.Parameter(torch.empty(E, H, **kw)) if bias else None
        self.reset_parameters()
        self.aux_loss: torch.Tensor | None = None
        self.stats: dict = {}

    def reset_parameters(self) -> None:
        """Uniform(+-1/sqrt(fan_in)) for every matrix, as nn.Linear; zero biases."""
        for name in ("gate_weight", *expert_param_names(self.config)):
            p = getattr(self, name)
            if p is None:
                continue
            if name in ("b1", "b2"):
                nn.init.zeros_(p)
            else:
                fan_in = p.shape[0] if name == "gate_weight" else p.shape[-1]
                bound = 1.0 / math.sqrt(fan_in)
                nn.init.uniform_(p, -bound, bound)

    def expert_parameters(self) -> list[torch.Tensor | None]:
        return [getattr(self, n) for n in expert_param_names(self.config)]

    def _check_input(self, x: torch.Tensor) -> None:
        H = self.config.hidden_size
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"x: expected a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 1 or x.shape[-1] != H:
            raise ValueError(f"x: expected shape [..., {H}] (hidden_size), got {list(x.shape)}")
        w = self.gate_weight
        if x.dtype != w.dtype:
            raise ValueError(f"x: expected dtype {w.dtype} (the parameters' dtype), got {x.dtype}")
        if x.device != w.device:
            raise ValueError(f"x: expected device {w.device} (the parameters' device), got {x.device}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        stats: dict = {}
        out, loss = FusedMoE.apply(x.reshape(-1, x.shape[-1]), self.config, stats, self.gate_weight,
                                   *self.expert_parameters())
        self.aux_loss, self.stats = loss, stats
        return out.view(x.shape)

    def extra_repr(self) -> str:
        c = self.config
        return (f"hidden={c.hidden_size}, ffn={c.ffn_size}, experts={c.num_experts}, top_k={c.top_k}, "
                f"expert={c.expert}, activation={c.activation}")

    # --- transformers interop -------------------------------------------------------------
    @classmethod
    def from_mixtral(cls, block, mesh=None, **overrides) -> "MoE":
        """A MoE holding the weights of a transformers MixtralSparseMoeBlock.

        The block's router (weight [E, H]) becomes gate_weight [H, E]; its experts'
        gate_up_proj [E, 2F, H] and down_proj [E, H, F] are copied as they are. Mixtral
        always renormalises its top-k weights; `overrides` replace constructor options."""
        router, experts = block.gate, block.experts
        act = getattr(getattr(experts, "config", None), "hidden_act", "silu")
        by_mixtral_name = {v: k for k, v in _MIXTRAL_ACT.items()}
        if act not in by_mixtral_name:
            raise ValueError(f"block: expected hidden_act in {sorted(by_mixtral_name)}, got {act!r}")
        E, two_f, H = experts.gate_up_proj.shape
        options = dict(expert="glu", activation=by_mixtral_name[act], renormalize=True,
                       dtype=experts.gate_up_proj.dtype, device=experts.gate_up_proj.device)
        options.update(overrides)
        layer = cls(H, two_f // 2, E, router.top_k, mesh=mesh, **options)
        with torch.no_grad():
            layer.gate_weight.copy_(router.weight.t())
            layer.gate_up_proj.copy_(experts.gate_up_proj)
            layer.down_proj.copy_(experts.down_proj)
        return layer

    def to_mixtral_state_dict(self) -> dict[str, torch.Tensor]:
        """State dict of the equivalent MixtralSparseMoeBlock ('gate.weight', 'experts.*')."""
        c = self.config
        if c.expert != "glu" or c.activation not in _MIXTRAL_ACT or not c.renormalize:
            raise ValueError("to_mixtral_state_dict: expected expert='glu', renormalize=True and activation in "
                             f"{sorted(_MIXTRAL_ACT)}, got expert={c.expert!r}, renormalize={c.renormalize}, "
                             f"activation={c.activation!r}")
        return {"gate.weight": self.gate_weight.detach().t().contiguous(),
                "experts.gate_up_proj": self.gate_up_proj.detach().clone(),
                "experts.down_proj": self.down_proj.detach().clone()}
