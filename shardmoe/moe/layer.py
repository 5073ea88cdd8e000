"""MoE: the Mixture-of-Experts nn.Module (gate, dispatch, expert FFNs, combine).

  y = MoE(H, F, E, k)(x)         x [..., H] -> y [..., H]
  layer.aux_loss                 weighted aux + z + sequence-wise loss of the last forward, for
                                 logging: its gradient rides on y's backward (aux_loss_scale)
  layer.aux_loss_scale           dL/d(aux_loss) that y's backward applies: 1.0 (default) trains
                                 L = f(y) + aux_loss; 1/N when f is divided by N (gradient
                                 accumulation); None: aux_loss is a graph node the caller adds
  layer.balance_scope            None, or the whole batch the balance losses average over when a
                                 forward sees a micro-batch of it (moe/function.py BalanceScope)
  layer.stats                    tokens_per_expert, selected_per_expert (both summed over the mesh),
                                 rank_selected_per_expert (this rank's tokens' choices), dropped_tokens,
                                 capacity, workspace_bytes (resident bytes of the workspace)
  layer.workspace                the pool of large row buffers reused across steps
                                 (shardmoe/moe/cpu.py); None allocates them fresh every step;
                                 workspace.release() frees it, and .to() does
  y = layer(x, sequence_starts)  where sequences begin, for the sequence-wise loss (default:
                                 each [T] row of x [..., T, H] when x has 3+ dims, else one)
  layer.update_correction_bias(load)   after the optimizer step, with the step's global loads

Parameters: gate_weight [H, E], gate_bias [E] (router_bias, else None);
buffer correction_bias [E] float32 (correction_bias, else None); "glu": gate_up_proj [E, 2F, H],
down_proj [E, H, F]; "mlp": w1 [E, P, H], b1 [E, P], w2 [E, H, P], b2 [E, H]; with shared_ffn_size
Fs > 0: shared_gate_up_proj [2Fs, H], shared_down_proj [H, Fs], and with shared_gate
shared_gate_weight [H] (shardmoe/moe/shared_experts.py).
Why the balance losses ride on y: a side tensor is lost to any recomputation that replays the
forward under no_grad (reentrant activation checkpointing returns y's graph, not aux_loss's), so
the gate silently missed the losses' gradient. y's backward is the one the caller always runs.
Under torch.autocast the router stays float32 and the experts compute in the autocast dtype
(shardmoe/moe/precision.py).
Forward and backward are the MoE operators (shardmoe/moe/function.py), with the
layer's gate as the router and its dispatcher: LOCAL on one process (mesh None or of one rank); with a
mesh, parameters hold this rank's shard (experts split over 'e' in contiguous blocks, the
intermediate dim over 't': shardmoe/parallel/expert_tensor.py), x holds this rank's tokens, and
the dispatcher is expert parallelism's; both come from the placement that shardmoe.parallel
registers (moe/placement.py), so this package imports nothing of it.
"""
from __future__ import annotations

import functools
import math

import torch
from torch import nn

from shardmoe.moe import shared_experts as shared_ex
from shardmoe.moe.config import MoEConfig, check_bool
from shardmoe.mesh import EXPERT, GRAD_SYNC_ATTRIBUTE, REPLICATED, as_mesh, mark_grad_sync
from shardmoe.moe import composition, function, precision
from shardmoe.moe.placement import placement
from shardmoe.moe.function import MoEContext
from shardmoe.moe.routing import GateRouter, corrected_bias, token_sequence_ids
from shardmoe.moe.cpu import Workspace

# MoEConfig's router fields, which MoE takes as keyword options
ROUTER_OPTIONS = ("score_func", "router_bias", "correction_bias", "bias_update_rate", "n_group", "topk_group",
                  "renormalize_epsilon", "routed_scaling_factor", "seq_aux_loss_coef")
# MoEConfig's expert-activation constants (activation="clamped_swiglu"), also keyword options
ACTIVATION_OPTIONS = ("swiglu_limit", "swiglu_alpha")
# MoEConfig's shared-expert fields, also keyword options
SHARED_OPTIONS = ("shared_ffn_size", "shared_gate")

# the dtypes the layer computes in (float16 runs too, but torch's CPU float16 matmul has no fast kernel:
# the tests and benchmarks use float32, bfloat16 and float64)
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class MoE(nn.Module):
    def __init__(self, hidden_size: int, ffn_size: int, num_experts: int, top_k: int, *,
                 expert: str = "glu", activation: str = "silu", output_activation: str = "identity",
                 bias: bool = False, renormalize: bool = True, capacity_factor: float | None = None,
                 aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0, aux_loss_scale: float | None = 1.0,
                 mesh=None, dtype: torch.dtype | None = None, device=None, **router_options):
        """router_options: MoEConfig's router fields (score_func, router_bias, correction_bias,
        bias_update_rate, n_group, topk_group, renormalize_epsilon, routed_scaling_factor,
        seq_aux_loss_coef), swiglu_limit, swiglu_alpha for activation="clamped_swiglu", and the
        shared-expert fields (shared_ffn_size, shared_gate)."""
        super().__init__()
        options = ROUTER_OPTIONS + ACTIVATION_OPTIONS + SHARED_OPTIONS
        unknown = sorted(set(router_options) - set(options))
        if unknown:
            raise ValueError(f"router_options: expected names among {', '.join(options)}, "
                             f"got {unknown}")
        self.config = MoEConfig(hidden_size, ffn_size, num_experts, top_k, expert=expert,
                                activation=activation, output_activation=output_activation, bias=bias,
                                renormalize=renormalize, capacity_factor=capacity_factor,
                                aux_loss_coef=aux_loss_coef, z_loss_coef=z_loss_coef, **router_options)
        if dtype is not None and dtype not in DTYPES:
            raise ValueError(f"dtype: expected None or one of {', '.join(map(str, DTYPES))}, got {dtype!r}")
        # a torch DeviceMesh (a job's, or a slice of it) becomes the Mesh it names (shardmoe/mesh.py)
        mesh = as_mesh(mesh)
        # the shards of the parameters and the dispatcher (moe/placement.py); checks the layout first
        self.placement = placement(self.config, mesh)
        self.mesh = mesh
        kw = {"dtype": dtype, "device": device}
        H, F, E = hidden_size, ffn_size, num_experts
        self._whole_shapes = {"gate_weight": (H, E), **self.config.kind.whole_shapes(H, F, E)}
        self.gate_weight = self._parameter("gate_weight", (H, E), REPLICATED, kw)
        self.gate_bias = self._parameter("gate_bias", (E,), REPLICATED, kw) if self.config.router_bias else None
        # float32 whatever the layer's dtype: bf16 would round away updates of 1e-3 near |b| ~ 1
        self.register_buffer("correction_bias", torch.zeros(E, dtype=torch.float32, device=device)
                             if self.config.correction_bias else None)
        for name, shape in list(self._whole_shapes.items())[1:]:
            setattr(self, name, self._parameter(name, shape, EXPERT, kw)
                    if bias or name not in self.config.kind.bias_names else None)
        # shared expert: dense, so replicated over 'd' and 'e' (its gradient summed there like the gate's)
        self._whole_shapes.update(shared_ex.shared_param_shapes(self.config))
        for name, shape in shared_ex.shared_param_shapes(self.config).items():
            setattr(self, name, self._parameter(name, shape, REPLICATED, kw))
        self.reset_parameters()
        self.aux_loss: torch.Tensor | None = None
        self.aux_loss_scale = aux_loss_scale
        # the whole batch the balance losses average over, set around micro-batches (function.BalanceScope)
        self.balance_scope = None
        self.stats: dict = {}
        # the large row buffers of forward and backward, reused across steps (single process)
        self.workspace = Workspace()
        self._router = GateRouter(self.config)  # the layer's gate, as the MoE operators route with it
        self._moe_handle = function.register(self)  # the int the MoE operators name this layer by
        # state dicts describe the whole logical expert tensors, whatever the mesh (moe/composition.py)
        self.register_state_dict_post_hook(composition.state_entries)
        self.register_load_state_dict_pre_hook(composition.shard_entries)
        self.register_load_state_dict_post_hook(composition.mark_assigned)

    def _parameter(self, name: str, shape: tuple[int, ...], grad_sync: tuple[str, ...], kw: dict) -> nn.Parameter:
        """Parameter `name` of whole shape `shape`, uninitialised: this rank's shard, as a DTensor of
        the whole when the mesh splits parameters (Placement.parameter), marked with the mesh axes
        its gradient is summed over (sync_grads)."""
        local = torch.empty(self.placement.shard_shape(name, shape), **kw)
        param = nn.Parameter(self.placement.parameter(name, local, shape))
        mark_grad_sync(param, grad_sync)
        return param

    @property
    def local_experts(self) -> range:
        """Global indices of the experts whose parameters this rank holds."""
        ep = 1 if self.mesh is None else self.mesh.size("e")
        per_rank = self.config.num_experts // ep
        first = 0 if self.mesh is None else self.mesh.coord("e") * per_rank
        return range(first, first + per_rank)

    def reset_parameters(self) -> None:
        """Uniform(+-1/sqrt(fan_in)) for every matrix, as nn.Linear; zero biases and correction bias.

        Every parameter and buffer gets its value here, so a layer built on the meta device and
        materialised with to_empty() holds after reset_parameters() what one built eagerly holds
        under the same seed. With a sharded mesh each whole parameter is drawn (one at a time) and
        this rank keeps its shard, so ranks seeded alike hold exactly the shards of the
        single-process layer."""
        sharded = self.placement.sharded
        with torch.no_grad():
            if self.correction_bias is not None:
                self.correction_bias.zero_()
            if self.gate_bias is not None:
                nn.init.zeros_(self.gate_bias)  # as GPT-OSS: routing starts from the weights alone
            for name in ("gate_weight", *self.config.expert_param_names, *self.config.shared_param_names):
                if getattr(self, name) is None:
                    continue
                p = composition.local(getattr(self, name))
                shape = self._whole_shapes[name]
                whole = torch.empty(shape, dtype=p.dtype, device=p.device) if sharded and p.shape != shape else p
                if name in self.config.kind.bias_names:
                    nn.init.zeros_(whole)
                else:
                    fan_in = shape[0] if name in ("gate_weight", shared_ex.GATE_NAME) else shape[-1]
                    bound = 1.0 / math.sqrt(fan_in)
                    nn.init.uniform_(whole, -bound, bound)
                if whole is not p:
                    p.copy_(self.placement.shard(name, whole))

    def expert_parameters(self) -> list[torch.Tensor | None]:
        """The routed experts' parameters, then the shared expert's, in the order the MoE operators take them."""
        names = (*self.config.expert_param_names, *self.config.shared_param_names)
        return [getattr(self, n) for n in names]

    @property
    def aux_loss_scale(self) -> float | None:
        """dL/d(aux_loss) that the output's backward applies (None: aux_loss is differentiable and the
        caller adds it to the loss). Read when the backward runs."""
        return self._aux_loss_scale

    @aux_loss_scale.setter
    def aux_loss_scale(self, scale: float | None) -> None:
        if scale is None:
            self._aux_loss_scale = None
            return
        value = math.nan
        if isinstance(scale, (int, float)) and not isinstance(scale, bool):
            try:
                value = float(scale)
            except OverflowError:  # an int past float's range, such as 10**400
                value = math.inf
        if not math.isfinite(value):
            raise ValueError(f"aux_loss_scale: expected None or a finite number, got {scale!r}")
        self._aux_loss_scale = value

    def _check_input(self, x: torch.Tensor, autocast: torch.dtype | None) -> None:
        H = self.config.hidden_size
        if x.dim() < 1 or x.shape[-1] != H:
            raise ValueError(f"x: expected shape [..., {H}] (hidden_size), got {list(x.shape)}")
        w = self.gate_weight
        if autocast is None and x.dtype != w.dtype:
            raise ValueError(f"x: expected dtype {w.dtype} (the parameters' dtype), got {x.dtype}")
        if x.device != w.device:
            raise ValueError(f"x: expected device {w.device} (the parameters' device), got {x.device}")

    def token_sequence(self, x: torch.Tensor, sequence_starts: torch.Tensor | None) -> torch.Tensor | None:
        """[S] sequence of each token for the sequence-wise loss (None when it is off)."""
        if not self.config.seq_aux_loss_coef:
            if sequence_starts is not None:
                raise ValueError("sequence_starts: expected None with seq_aux_loss_coef=0 (nothing would use "
                                 f"them), got {sequence_starts!r}")
            return None
        num_tokens = x.numel() // x.shape[-1]
        if sequence_starts is None and x.dim() >= 3 and x.shape[-2]:
            # rows of x are the sequences: no offsets to check (nor data-dependent ints under compile)
            return torch.arange(num_tokens, device=x.device) // x.shape[-2]
        return token_sequence_ids(num_tokens, sequence_starts, x.device)

    def forward(self, x: torch.Tensor, sequence_starts: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., H] -> [..., H]. sequence_starts: offsets into the flattened tokens where the
        sequences of the sequence-wise loss begin (moe/routing.py token_sequence_ids)."""
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"x: expected a torch.Tensor, got {type(x).__name__}")
        if isinstance(x, composition.DTENSOR):  # the same tokens as its local blocks; the output laid out as x
            out = self.forward(composition.local_tokens(self, x), sequence_starts)
            return type(x).from_local(out, x.device_mesh, x.placements, run_check=False, shape=x.shape,
                                      stride=x.stride())
        gate_weight, gate_bias, *experts = self._compute_views()
        autocast = precision.autocast_dtype(x, self.gate_weight.dtype)
        self._check_input(x, autocast)
        token_sequence = self.token_sequence(x, sequence_starts)
        # the router's tensors keep their dtype (it computes in float32); x and the experts take autocast's
        x, *experts = precision.cast((x, *experts), autocast)
        # out has x's shape and is no view: an in-place op on it cannot cut its graph (FSDP2's hooks)
        present, absent = function.operator_inputs((gate_weight, gate_bias, self.correction_bias, token_sequence,
                                                    *experts))
        out, loss, _ = torch.ops.shardmoe.moe_forward(self._moe_handle, x, present, absent)
        self.aux_loss = loss if self.aux_loss_scale is None else loss.detach()
        return out

    def _compute_views(self) -> list[torch.Tensor | None]:
        """gate_weight, gate_bias, then the routed and shared experts' parameters as the forward
        computes on them: on one process the layer's own plain tensors; on a mesh, or where other code
        put DTensors in their place, after composition's checks of their layout, its local views
        (moe/composition.py compute_views)."""
        params = [self.gate_weight, self.gate_bias, *self.expert_parameters()]
        if self.mesh is None and not any(isinstance(p, composition.DTENSOR) for p in params):
            return params
        composition.check_parameters(self)
        if self.placement.sharded and not composition.fully_sharded_over_d(self):
            composition.check_own_shards(self)
        return composition.compute_views(self)

    @property
    def dispatcher(self):
        """How tokens reach the experts: all local, or exchanged along 'e' (moe/dispatch.py)."""
        return self.placement.dispatcher

    def moe_context(self, x: torch.Tensor, inputs: tuple) -> MoEContext:
        """What the MoE operators (moe/function.py) run this layer's forward and backward with: its config,
        its gate as the router, its dispatcher and workspace, aux_loss_scale and balance_scope; the
        forward's statistics land in self.stats (inside the operator, so they are current under
        torch.compile too)."""
        scale, reduce = self.aux_loss_scale, None
        if self.mesh is not None and composition.fully_sharded_over_d(self):  # FSDP's mean convention
            scale = None if scale is None else scale * self.mesh.size(("d", "e"))
            if self.mesh.size("e") > 1:
                reduce = functools.partial(composition.mean_over_e, self.mesh.group("e"), self.mesh.size("e"))
        return MoEContext(self.config, self._router, self.dispatcher, self.workspace, self._keep_stats, scale,
                          self.balance_scope, reduce)

    def _keep_stats(self, stats: dict) -> None:
        self.stats = stats

    def update_correction_bias(self, load: torch.Tensor, centred: bool = False) -> None:
        """b_e += u_e, u_e = bias_update_rate * sign(mean load - load_e) (DeepSeek-V3 aux-loss-free
        balancing); centred: u_e - mean u_e, torchtitan's rule, bit for bit (routing.corrected_bias);
        a no-op when correction_bias is off. load [E]: this step's tokens per expert summed over the
        mesh (stats['selected_per_expert'] is that for one forward), the same on every rank, so the
        replicas stay identical. Call it after the optimizer step."""
        check_bool("centred", centred)
        E = self.config.num_experts
        if not isinstance(load, torch.Tensor) or tuple(load.shape) != (E,):
            raise ValueError(f"load: expected a tensor of shape [{E}] (num_experts), got "
                             f"{list(load.shape) if isinstance(load, torch.Tensor) else type(load).__name__}")
        # token counts: a NaN load was a silent no-op (sign(NaN) = 0), a negative one moved the bias wrongly
        if load.dtype == torch.bool or load.is_complex():
            raise ValueError(f"load: expected an integer or real tensor of token counts, got dtype {load.dtype}")
        if load.is_floating_point() and not bool(torch.isfinite(load).all()):
            raise ValueError(f"load: expected finite token counts, got {load.tolist()}")
        if bool((load < 0).any()):
            raise ValueError(f"load: expected token counts >= 0, got {load.tolist()}")
        if self.correction_bias is None:
            return
        with torch.no_grad():
            self.correction_bias.copy_(corrected_bias(self.correction_bias, load.to(self.correction_bias.device),
                                                      self.config.bias_update_rate, centred))

    def _apply(self, fn, recurse=True):
        """As nn.Module._apply (.to(), .cuda(), .float(), ...), and the workspace's blocks are released:
        they hold memory of the old device and dtype. The correction bias stays float32 whatever
        the dtype moved to (bf16 would round its 1e-3 updates away near |b| ~ 1: docs/moe.md). A DTensor
        parameter is converted by swapping in a new Parameter (torch.utils.swap_tensors), which
        drops its attributes: the grad-sync marks are put back."""
        if self.workspace is not None:
            self.workspace.release()
        marks = {n: getattr(p, GRAD_SYNC_ATTRIBUTE) for n, p in self.named_parameters(recurse=False)
                 if hasattr(p, GRAD_SYNC_ATTRIBUTE)}
        module = super()._apply(fn, recurse)
        for name, axes in marks.items():
            mark_grad_sync(getattr(self, name), axes)
        if self.correction_bias is not None and self.correction_bias.dtype != torch.float32:
            self.correction_bias = self.correction_bias.float()
        return module

    def __getstate__(self) -> dict:
        """State for copy.deepcopy and pickle, without the last forward's results.

        aux_loss is a node of that forward's graph (not a leaf), which deepcopy refuses, and it
        belongs to the original's graph anyway: a copy (EMA, torch.optim.swa_utils.AveragedModel)
        starts as a layer that has not run a forward, aux_loss None and stats empty."""
        state = super().__getstate__()
        # a copy gets an empty pool of the same settings: blocks are this layer's scratch memory
        state.update(aux_loss=None, stats={}, balance_scope=None, workspace=None if self.workspace is None else self.workspace.empty_copy())
        return state

    def __setstate__(self, state: dict) -> None:
        """A copy is a layer of its own: it gets its own handle (the original's names the original)."""
        super().__setstate__(state)
        self._moe_handle = function.register(self)

    def extra_repr(self) -> str:
        c = self.config
        return (f"hidden={c.hidden_size}, ffn={c.ffn_size}, experts={c.num_experts}, top_k={c.top_k}, "
                f"expert={c.expert}, activation={c.activation}"
                + ("" if self.mesh is None else f", mesh={self.mesh!r}"))
