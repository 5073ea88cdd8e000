"""MoE: torchtitan's MoE module whose forward is shardmoe's MoE operator.

  moe = shardmoe.torchtitan.MoE.Config(**fields of torchtitan's MoE.Config).build()
  out_BLD = moe(x_BLD)                    x [B, L, D] -> [B, L, D]

It is torchtitan 0.3's MoE (torchtitan/models/common/moe.py), subclassed: the same children and
buffers under the same names (router.gate [E, D] (+ bias), routed_experts.inner_experts.w1_EFD,
w2_EDF, w3_EFD, shared_experts.w1/w2/w3, expert_bias_E (persistent), tokens_per_expert_E (not)),
the same Config, load_balance_coeff, init (init_states through torchtitan's Module protocol,
_init_self_buffers) and sharding configs. Only forward differs, and what forward needs:

  shardmoe's options      read from the module (moe_config), refused before anything runs when
                          the MoE layer cannot compute what torchtitan's does
  the weights it runs on  gate_weight = gate.weight^T [D, E] (a view), gate_up_proj =
                          cat(w1_EFD, w3_EFD) [E, 2F, D], down_proj = w2_EDF [E, D, F]; the shared
                          expert's cat(w1, w3) [2Fs, D] and w2 [D, Fs]; each the local tensor of a
                          DTensor parameter; the cats are autograd ops, so the gradients land in
                          w1_EFD and w3_EFD
  routing                 torchtitan's, in shardmoe's terms (routing.py): scores s =
                          softmax/sigmoid(x Wg^T (+ b)); selection on s + expert_bias_E, group-limited
                          (num_expert_groups / num_limited_groups: sum of a group's two best);
                          w = route_scale * s_sel / (sum s_sel + 1e-20) with route_norm, else
                          route_scale * s_sel; dropless; out = sum_j w_j y_j + shared(x)
  tokens_per_expert_E     += this rank's tokens' top-k choices per expert in training, as
                          torchtitan's forward counts them; torchtitan's hook moves expert_bias_E
  expert parallelism      parallelize() takes torchtitan's 'ep' mesh: experts split over it in
                          contiguous blocks (the Shard(0) of torchtitan's plan), rows exchanged by
                          shardmoe's expert-parallel dispatcher

What differs from torchtitan's forward: the experts compute in x's dtype (torchtitan's grouped GEMMs
cast to bf16 whatever the dtype; under FSDP's bf16 parameters both are bf16), the router in float32
(float64 for float64 x; torchtitan's float32 autocast is a no-op on CPU), and exact score ties go to
the lowest expert index where torch.topk's order is the kernel's (docs/torchtitan.md, "Ties").
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torchtitan.models.common import moe as titan_moe
from torchtitan.models.common.feed_forward import FeedForward
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher, LocalTokenDispatcher

from shardmoe.mesh import Mesh
from shardmoe.moe import composition, function, precision
from shardmoe.moe.config import MoEConfig
from shardmoe.moe.cpu import Workspace
from shardmoe.moe.function import MoEContext
from shardmoe.moe.placement import placement
from shardmoe.moe.routing import GateRouter

# the token dispatchers whose dispatch shardmoe's replaces with the same result: local, and the
# all-to-all over 'ep' ("standard"); the others are CUDA transports, HybridEP's with a capacity
DISPATCHERS = (LocalTokenDispatcher, AllToAllTokenDispatcher)
# torchtitan's route_norm: denominator sum + 1e-20
ROUTE_NORM_EPSILON = 1e-20


def _refuse(what: str, expected: str, got) -> ValueError:
    return ValueError(f"{what}: shardmoe.torchtitan.MoE computes torchtitan's MoE with {expected}, got {got}")


def _check_linear(name: str, linear, bias_allowed: bool) -> None:
    if type(linear) is not Linear:
        raise _refuse(name, "torchtitan's Linear", type(linear).__name__)
    if linear.bias is not None and not bias_allowed:
        raise _refuse(name, "no bias", "a bias")


def moe_config(moe: titan_moe.MoE) -> MoEConfig:
    """The MoEConfig computing what the built torchtitan MoE `moe` computes (any device, meta too).

    Refuses (ValueError naming the part and what it has) what the MoE layer does not compute:
    another experts class (GPT-OSS's, a quantized or fused one), router or shared-expert class, a
    token dispatcher other than the local and the all-to-all one, biases in the shared expert, the
    debug round-robin routing, a group-limited router with fewer than two experts per group."""
    router, routed = moe.router, moe.routed_experts
    if type(routed) is not titan_moe.RoutedExperts:
        raise _refuse("routed_experts", "RoutedExperts", type(routed).__name__)
    inner, dispatcher = routed.inner_experts, routed.token_dispatcher
    if type(inner) is not titan_moe.GroupedExperts:
        raise _refuse("routed_experts.inner_experts", "GroupedExperts (w1_EFD, w2_EDF, w3_EFD, SwiGLU)",
                      type(inner).__name__)
    if type(dispatcher) not in DISPATCHERS:
        raise _refuse("routed_experts.token_dispatcher", "the local or the all-to-all ('standard') dispatcher "
                      "(shardmoe's own exchange replaces it)", type(dispatcher).__name__)
    if type(router) is not titan_moe.TokenChoiceTopKRouter:
        raise _refuse("router", "TokenChoiceTopKRouter", type(router).__name__)
    _check_linear("router.gate", router.gate, bias_allowed=True)
    if router._debug_force_load_balance:
        raise _refuse("router._debug_force_load_balance", "routing by scores", "round-robin routing (True)")
    E, F, H = inner.w1_EFD.shape
    options = dict(expert="glu", activation="silu", score_func=router.score_func, renormalize=router.route_norm,
                   renormalize_epsilon=ROUTE_NORM_EPSILON if router.route_norm else 0.0,
                   routed_scaling_factor=router.route_scale, router_bias=router.gate.bias is not None)
    if router.num_expert_groups is not None:
        if router.num_limited_groups is None:
            raise _refuse("router.num_limited_groups", "a count of groups with num_expert_groups set", None)
        if router.num_experts % router.num_expert_groups or router.num_experts // router.num_expert_groups < 2:
            raise _refuse("router.num_expert_groups", f"a divisor of num_experts={router.num_experts} leaving at "
                          "least two experts per group (torchtitan's router requires it)", router.num_expert_groups)
        options.update(n_group=router.num_expert_groups, topk_group=router.num_limited_groups)
    if moe.load_balance_coeff is not None:
        options.update(correction_bias=True, bias_update_rate=moe.load_balance_coeff)
    shared = moe.shared_experts
    if shared is not None:
        if type(shared) is not FeedForward:
            raise _refuse("shared_experts", "FeedForward (SwiGLU w2(silu(w1 x) * w3 x))", type(shared).__name__)
        for name in ("w1", "w2", "w3"):
            _check_linear(f"shared_experts.{name}", getattr(shared, name), bias_allowed=False)
        options["shared_ffn_size"] = shared.w1.out_features
    return MoEConfig(H, F, E, router.top_k, **options)


class MoE(titan_moe.MoE):
    """torchtitan's MoE computed by shardmoe's MoE operator (module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(titan_moe.MoE.Config):
        pass

    def __init__(self, config: Config):
        super().__init__(config)
        self._attach()

    def _attach(self) -> None:
        """What the MoE operator needs beside torchtitan's state: the options, the handle the
        operator names this module by, the row-buffer pool, the dispatcher (local until parallelize
        gives an 'ep' mesh)."""
        self.moe_config = moe_config(self)
        self.stats: dict = {}
        self.workspace = Workspace()
        self.expert_mesh = None
        self._dispatcher = placement(self.moe_config, None).dispatcher
        self._router = GateRouter(self.moe_config)  # the module's gate, as the MoE operators route with it
        self._moe_handle = function.register(self)

    def parallelize(self, parallel_dims) -> None:
        """torchtitan's parallelize (its sharding configs: the experts Shard(0) over 'ep', the rest
        replicated), then the expert-parallel dispatcher over the 'ep' mesh. torchtitan's
        partial_dtensor backend only, without tensor or context parallelism (NotImplementedError
        before anything is distributed): the others hand the forward typed or sharded activations
        this module does not take."""
        if parallel_dims.spmd_backend != "partial_dtensor":
            raise NotImplementedError(f"parallelism.spmd_backend: shardmoe.torchtitan.MoE runs under 'partial_dtensor', "
                                      f"got {parallel_dims.spmd_backend!r}")
        if parallel_dims.tp > 1 or parallel_dims.cp > 1:
            raise NotImplementedError(f"parallelism: shardmoe.torchtitan.MoE runs with expert and data parallelism, "
                                      f"not tensor or context parallelism: got tp={parallel_dims.tp}, "
                                      f"cp={parallel_dims.cp}")
        super().parallelize(parallel_dims)
        self.set_expert_mesh(parallel_dims.get_optional_mesh("ep"))

    def set_expert_mesh(self, ep_mesh) -> None:
        """Split the experts over `ep_mesh` (a 1-D torch DeviceMesh named 'ep', or None for one
        process): w1_EFD, w2_EDF, w3_EFD hold this rank's contiguous block of E / ep experts (DTensors
        Shard(0), as torchtitan's plan lays them out) and the forward exchanges rows along 'ep'.
        Refuses a mesh that cannot split E (before any communication)."""
        self.expert_mesh = None if ep_mesh is None or ep_mesh.size() == 1 else Mesh.from_device_mesh(ep_mesh)
        self._dispatcher = placement(self.moe_config, self.expert_mesh).dispatcher

    def _weights(self) -> tuple[torch.Tensor | None, ...]:
        """gate_weight [D, E], gate_bias [E] or None, then the routed and shared experts' weights in
        shardmoe's layout (module docstring), from this rank's local tensors."""
        local = composition.local
        gate, inner, shared = self.router.gate, self.routed_experts.inner_experts, self.shared_experts
        gate_bias = None if gate.bias is None else local(gate.bias)
        weights = [local(gate.weight).t(), gate_bias,
                   torch.cat([local(inner.w1_EFD), local(inner.w3_EFD)], dim=1), local(inner.w2_EDF)]
        if shared is not None:
            weights += [torch.cat([local(shared.w1.weight), local(shared.w3.weight)]), local(shared.w2.weight)]
        return tuple(weights)

    def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:
        """x [..., D] (torchtitan's [B, L, D]) -> [..., D]; in training, tokens_per_expert_E += this
        rank's top-k choices per expert."""
        if not isinstance(x_BLD, torch.Tensor) or isinstance(x_BLD, composition.DTENSOR):
            raise ValueError("x_BLD: expected a torch.Tensor that is not a DTensor (tensor and context parallelism "
                             f"of shardmoe.torchtitan.MoE are not supported), got {type(x_BLD).__name__}")
        gate_weight, gate_bias, *experts = self._weights()
        autocast = precision.autocast_dtype(x_BLD, experts[0].dtype)
        self._check_input(x_BLD, experts[0], autocast)
        x, *experts = precision.cast((x_BLD, *experts), autocast)
        present, absent = function.operator_inputs((gate_weight, gate_bias, self.expert_bias_E, None, *experts))
        out, _, _ = torch.ops.shardmoe.moe_forward(self._moe_handle, x, present, absent)
        if self.training:
            with torch.no_grad():
                self.tokens_per_expert_E.add_(self.stats["rank_selected_per_expert"])
        return out

    def _check_input(self, x: torch.Tensor, weight: torch.Tensor, autocast: torch.dtype | None) -> None:
        H = self.moe_config.hidden_size
        if x.dim() < 1 or x.shape[-1] != H:
            raise ValueError(f"x_BLD: expected shape [..., {H}] (dim), got {list(x.shape)}")
        if autocast is None and x.dtype != weight.dtype:
            raise ValueError(f"x_BLD: expected dtype {weight.dtype} (the experts' dtype), got {x.dtype}")
        if x.device != weight.device:
            raise ValueError(f"x_BLD: expected device {weight.device} (the experts' device), got {x.device}")

    def moe_context(self, x: torch.Tensor, inputs: tuple) -> MoEContext:
        """What the MoE operators (moe/function.py) run this module's forward and backward with: its
        options, its gate as the router, its dispatcher and row buffers; the statistics land in
        self.stats. No balance loss: torchtitan's MoE balances with expert_bias_E alone."""
        return MoEContext(self.moe_config, self._router, self._dispatcher, self.workspace, self._keep_stats)

    def _keep_stats(self, stats: dict) -> None:
        self.stats = stats

    def _apply(self, fn, recurse=True):
        """As torchtitan's Module._apply (to_empty, .to(), ...), and the row buffers are released:
        they hold memory of the old device and dtype."""
        self.workspace.release()
        return super()._apply(fn, recurse)

    def __getstate__(self) -> dict:
        """State for copy.deepcopy and pickle: the last forward's statistics stay with the original, and
        the copy gets an empty pool of row buffers."""
        state = super().__getstate__()
        state.update(stats={}, workspace=self.workspace.empty_copy())
        return state

    def __setstate__(self, state: dict) -> None:
        """A copy is a module of its own: it gets its own handle."""
        super().__setstate__(state)
        self._moe_handle = function.register(self)

    def extra_repr(self) -> str:
        c = self.moe_config
        return (f"shardmoe fused: dim={c.hidden_size}, hidden_dim={c.ffn_size}, experts={c.num_experts}, "
                f"top_k={c.top_k}, score_func={c.score_func}"
                + ("" if self.expert_mesh is None else f", ep={self.expert_mesh.size('e')}"))
