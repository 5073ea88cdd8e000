"""The assembled Mixtral-like MoE transformer, sharded over the mesh axes d, e and t.

Dims: B rows, L tokens, M d_model, V vocab, K kv heads, Q query heads per kv head, D head dim,
E experts, F expert intermediate size. Tokens are split over d and e ('B/d/e', each (d, e) rank
has its own rows) and replicated over t. On every rank:

    x[B/d/e L M/t]  = Embedding(ids)
    for each block:
        x          += Attention(RMSNorm(x))          heads over t, weights FSDP over d
        nx[B L M]   = RMSNorm(x)                     replicated over t
        y[B L M]    = MoE(nx)                        experts over e, F over t; y whole on each t rank
        x          += block_t(y)                     this t rank's slice of M
    loss = CE(Unembedding(RMSNorm(x)), targets) + sum over blocks of the MoE aux loss

Weights (local shard specs): embedding and unembedding 'V/t M/d', norm gains 'M/t/d', w_q and
w_o 'M/d Q K/t D', w_kv '2 M/d K/t D' (docs/model.md); MoE gate 'H E' (replicated), gate_up_proj
'E/e 2F/t H', down_proj 'E/e H F/t', with expert_bias gate_up_proj_bias 'E/e 2F/t' and
down_proj_bias 'E/e H' (shardmoe/parallel/expert_tensor.py); with shared_ffn_size the shared
expert's shared_gate_up_proj '2 Fs/t H' and shared_down_proj 'H Fs/t' (sliced over t like one
expert, replicated over d and e: the MoE layer computes it on each rank's own tokens) and
shared_gate_weight 'H' (replicated, like the gate). With a mesh of more than one rank every
parameter is a DTensor of the whole tensor whose local tensor is this rank's shard (the dense
ones on the mesh's DeviceMesh, parallel/dtensors.py parameter; the MoE layers' on their
'ep' x 'tp' mesh), so that torch's optimizers, their distributed checkpoints and full_tensor()
see the whole model; the modules compute on the local tensors.

Gradient placement. The dense layers reduce-scatter their weight gradients over d (the duals of
their FSDP gathers), but with tokens also split over e those sums miss the other e ranks' tokens:
the dense parameters are marked for shardmoe.parallel.sync_grads over ('e',), next to the MoE's
own marks (gate over ('d', 'e'), experts over ('d',)), and their DTensor gradients are Partial()
over 'ep' until it sums them. `Transformer.sync_grads()` runs it.

The MoE seam over t: the MoE hands back a whole input gradient on every t rank, while the
RMSNorm before it sums partial gradients over t, so `whole_to_partial_grad` keeps it on t rank 0
only; and the MoE needs the whole output gradient, so `keep_block` all-gathers the slices' grads.

Initialisation draws every FULL weight from `seed` (identically on every rank, in float64, then
cast) and keeps this rank's shard, so a model's values do not depend on the mesh layout.

Device: every parameter, buffer and tensor a forward makes lives on the model's `device` (the
weights are drawn on the CPU, as the mesh layout does not change them, and copied there). The
attention's fused core (attention.py) takes the packed documents' mask as one additive bias per
forward (context()), shared by every block.

Activation checkpointing (CHECKPOINTING): "none" keeps every block's residuals for the backward;
"moe" keeps each block's MoE input only and runs its MoE layer again in the backward; "block"
keeps each block's input only and runs the whole block again. The recomputation runs inside the
backward (Recompute, an autograd.Function whose forward runs without a graph and whose backward
runs the forward again with one, under the forward's autocast state) and computes bitwise what
the first forward did, so the gradients are those of "none" bit for bit.

A pipeline rank holds a Part of the model (its blocks by their global index, the embedding on the
first stage's rank, the final norm and unembedding on the last's: shardmoe/model/stages.py cuts
the layers): its parameters keep the whole model's names ("blocks.5.moe.gate_weight" on whichever
rank holds block 5), so checkpoints and optimizer states are keyed by layer, not by stage, and load
into any pipeline layout. The stage modules run the pieces (embed, context, run_block, head,
loss); forward() runs the whole model and needs a model holding every part.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor, nn

from shardmoe.parallel import shardops
from shardmoe.moe import composition
from shardmoe.moe.config import MoEConfig, check_bool
from shardmoe.moe.layer import MoE
from shardmoe.moe.cpu import share as share_workspace
from shardmoe.moe.routing import corrected_bias
from shardmoe.notation import MESH_AXES, global_shape, parse_spec
from shardmoe.parallel import dtensors
from shardmoe.parallel import expert_tensor as etp
from shardmoe.mesh import GRAD_SYNC_ATTRIBUTE
from shardmoe.parallel.sync import mark_grad_sync, sync_grads

from .attention import Attention, KVCache, attention_bias, default_core
from .config import DenseConfig, check_positive_int, check_positive_number
from .embedding import Embedding
from .residuals import autocast_state, check_backward_mode, restore_autocast
from .rmsnorm import RMSNorm
from .rope import RopeTable, rope_table
from .segments import packed_layout, sequence_starts
from .sharding import keep_block, whole_to_partial_grad
from .unembed import Unembedding

DENSE_GRAD_SYNC = ("e",)  # the dense layers already summed over d themselves
EXPERT_PARAMS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")
SHARED_PARAMS = ("shared_gate_up_proj", "shared_down_proj")  # laid out and sharded as expert_tensor says
GATE_SPEC = "H E"
GATE_BIAS_SPEC = "E"
ROUTER_STATE = ("gate_weight", "gate_bias", "correction_bias", "shared_gate_weight")  # replicated on every rank
CHECKPOINTING = ("none", "moe", "block")  # what a block recomputes in the backward (module docstring)


# The MoE layer every block holds, but for its options: it maps the d_model-wide residual stream
# (hidden_size is d_model), its experts are GLUs (full_shapes, the checkpoints and the Mixtral
# conversion lay them out so) and it renormalizes the top-k weights.
MOE_FIXED = {"expert": "glu", "output_activation": "identity", "renormalize": True}
# MoEConfig's fields that a model's flat options name otherwise: the experts' biases, beside the router's
FLAT_NAMES = {"bias": "expert_bias"}
# The MoE layer's options in a model's flat form (a config file's `model` table, a run's config.json,
# a checkpoint's settings), by flat name: MoEConfig's fields but those the model fixes.
MOE_OPTIONS = {FLAT_NAMES.get(f.name, f.name): f.name for f in dataclasses.fields(MoEConfig)
               if f.name != "hidden_size" and f.name not in MOE_FIXED}
DEFAULT_MOE = MoEConfig(hidden_size=96, ffn_size=192, num_experts=4, top_k=2, aux_loss_coef=0.01)


@dataclass(frozen=True)
class TransformerConfig:
    """Dims of the model and its blocks' MoE layer; validated at construction (every error names
    the option).

    vocab_size includes padding (the byte tokenizer's 257 ids padded to split evenly over t).
    moe: every block's MoE layer (shardmoe/moe/config.py MoEConfig documents each option: experts,
    load-balancing and z losses, router, expert biases and activation, shared expert), with
    hidden_size = d_model and the MOE_FIXED values; its seq_aux_loss_coef's sequences are the packed
    documents (a row's segments, is_seq_start), cut at row boundaries. Residual-branch outputs (w_o,
    down_proj) start at init_std / sqrt(2 n_layers) (GPT-2).

    to_dict and from_dict use the flat form config files take: the dims beside the MoE options by
    their MOE_OPTIONS names ({"d_model": 96, "num_experts": 4, "expert_bias": false, ...}), the
    MoE's hidden_size following d_model; as attributes the MoE options are read from moe
    (config.moe.num_experts).
    """

    vocab_size: int = 320
    d_model: int = 96
    n_layers: int = 3
    n_q_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 24
    moe: MoEConfig = DEFAULT_MOE
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02

    def __post_init__(self) -> None:
        self.dense()  # its own checks, with messages naming the option
        if not isinstance(self.moe, MoEConfig):
            raise ValueError(f"moe: expected a MoEConfig, got {type(self.moe).__name__}")
        if self.moe.hidden_size != self.d_model:
            raise ValueError(f"moe.hidden_size: expected d_model={self.d_model} (the MoE layer maps the residual "
                             f"stream), got {self.moe.hidden_size}")
        for name, value in MOE_FIXED.items():
            if getattr(self.moe, name) != value:
                raise ValueError(f"moe.{name}: expected {value!r} (every block's MoE layer has it), "
                                 f"got {getattr(self.moe, name)!r}")
        check_positive_int("n_layers", self.n_layers)
        check_positive_number("init_std", self.init_std)

    def dense(self) -> DenseConfig:
        return DenseConfig(self.vocab_size, self.d_model, self.n_q_heads, self.n_kv_heads, self.head_dim,
                           self.rope_theta, self.norm_eps)

    def to_dict(self) -> dict:
        """The flat form: every dim, and in moe's place its options by their MOE_OPTIONS names."""
        values = {}
        for f in dataclasses.fields(self):
            if f.name == "moe":
                values.update({flat: getattr(self.moe, name) for flat, name in MOE_OPTIONS.items()})
            else:
                values[f.name] = getattr(self, f.name)
        return values

    @classmethod
    def from_dict(cls, values: dict) -> "TransformerConfig":
        """The config of the flat form `values` (to_dict's); what it leaves out keeps its default."""
        known = set(cls().to_dict())
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"model: unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        dims = {name: value for name, value in values.items() if name not in MOE_OPTIONS}
        d_model = dims.get("d_model", cls.d_model)
        check_positive_int("d_model", d_model)  # before it becomes the MoE layer's hidden_size
        if "expert_bias" in values:  # here, by this name: MoEConfig knows it as bias
            check_bool("expert_bias", values["expert_bias"])
        options = {MOE_OPTIONS[flat]: value for flat, value in values.items() if flat in MOE_OPTIONS}
        return cls(**dims, moe=dataclasses.replace(DEFAULT_MOE, hidden_size=d_model, **options))


def check_layout(config: TransformerConfig, dp: int = 1, ep: int = 1, tp: int = 1) -> None:
    """Raise ValueError when a dp x ep x tp mesh cannot split the model evenly; no communication,
    so a launcher calls it before creating any process group."""
    moe = config.moe
    needs = [("vocab_size", config.vocab_size, tp, "the vocabulary is split over t"),
             ("n_kv_heads", config.n_kv_heads, tp, "key/value heads are split over t"),
             ("d_model", config.d_model, tp * dp, "norm gains are split over t and d"),
             ("ffn_size", moe.ffn_size, tp, "each expert's intermediate dim is split over t"),
             ("shared_ffn_size", moe.shared_ffn_size, tp, "the shared expert's intermediate dim is split over t"),
             ("num_experts", moe.num_experts, ep, "experts are split over e")]
    for name, value, multiple, why in needs:
        if value % multiple:
            raise ValueError(f"{name}: expected a multiple of {multiple} on a mesh d={dp}, e={ep}, t={tp} "
                             f"({why}), got {value}")


def full_shapes(config: TransformerConfig) -> dict[str, tuple[int, ...]]:
    """Name -> unsharded shape of every parameter, in the model's parameter order, then of the
    state that is not a parameter: each block's MoE correction bias (a float32 buffer)."""
    V, M, K, D, moe = config.vocab_size, config.d_model, config.n_kv_heads, config.head_dim, config.moe
    Q, E, F = config.n_q_heads // config.n_kv_heads, moe.num_experts, moe.ffn_size
    shapes = {"embedding.weight": (V, M)}
    for i in range(config.n_layers):
        shapes.update({f"blocks.{i}.attn_norm.weight": (M,), f"blocks.{i}.attention.w_q": (M, Q, K, D),
                       f"blocks.{i}.attention.w_kv": (2, M, K, D), f"blocks.{i}.attention.w_o": (M, Q, K, D),
                       f"blocks.{i}.ffn_norm.weight": (M,), f"blocks.{i}.moe.gate_weight": (M, E),
                       f"blocks.{i}.moe.gate_up_proj": (E, 2 * F, M), f"blocks.{i}.moe.down_proj": (E, M, F)})
        if moe.bias:
            shapes.update({f"blocks.{i}.moe.gate_up_proj_bias": (E, 2 * F), f"blocks.{i}.moe.down_proj_bias": (E, M)})
        if moe.router_bias:
            shapes[f"blocks.{i}.moe.gate_bias"] = (E,)
        if moe.shared_ffn_size:
            Fs = moe.shared_ffn_size
            shapes.update({f"blocks.{i}.moe.shared_gate_up_proj": (2 * Fs, M),
                           f"blocks.{i}.moe.shared_down_proj": (M, Fs)})
        if moe.shared_gate:
            shapes[f"blocks.{i}.moe.shared_gate_weight"] = (M,)
    shapes.update({"final_norm.weight": (M,), "unembedding.weight": (V, M)})
    if moe.correction_bias:
        shapes.update({f"blocks.{i}.moe.correction_bias": (E,) for i in range(config.n_layers)})
    return shapes


def init_full_weights(config: TransformerConfig, seed: int, dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
    """Every full weight drawn from `seed`: norm gains 1, router, correction and expert biases 0 (the
    correction bias in float32), the rest N(0, std^2) with std = init_std, or
    init_std / sqrt(2 n_layers) for the residual-branch outputs w_o, down_proj and shared_down_proj."""
    generator = torch.Generator().manual_seed(seed)
    residual_std = config.init_std / math.sqrt(2 * config.n_layers)
    weights = {}
    for name, shape in full_shapes(config).items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape, dtype=dtype)
            continue
        if name.endswith(("gate_bias", "correction_bias", "proj_bias")):
            weights[name] = torch.zeros(shape, dtype=torch.float32 if name.endswith("correction_bias") else dtype)
            continue
        std = residual_std if name.endswith(("w_o", "down_proj")) else config.init_std
        weights[name] = (torch.randn(shape, generator=generator, dtype=torch.float64) * std).to(dtype)
    return weights


class Losses(NamedTuple):
    """This rank's terms of the objective. total = ce + aux is what backward starts from.

    ce is summed over d (the cross-entropy psums it) but is a partial sum over e; aux is this
    rank's share of the global aux loss (a partial sum over d and e). Transformer.global_losses
    sums them for logging."""

    total: Tensor
    ce: Tensor
    aux: Tensor


@dataclass(frozen=True)
class Part:
    """The pieces of the model one rank holds: blocks `layers` (global indices, ascending), the
    embedding when `embedding`, the final norm and the unembedding when `head`."""

    layers: tuple[int, ...]
    embedding: bool = True
    head: bool = True

    @classmethod
    def whole(cls, n_layers: int) -> "Part":
        return cls(tuple(range(n_layers)))

    def holds(self, name: str) -> bool:
        """Whether a parameter or state name of the whole model ("blocks.3.moe.down_proj") is in this part."""
        if name.startswith("blocks."):
            return int(name.split(".")[1]) in self.layers
        return self.embedding if name.startswith("embedding.") else self.head


class BlockInputs(NamedTuple):
    """What every block of one forward reads besides the residual stream, from is_seq_start."""

    segment_ids: Tensor
    rope: RopeTable
    sequence_starts: Tensor | None
    attention_bias: Tensor | None  # the fused attention core's mask (None: the reference core's float64)


def check_checkpointing(option: str) -> str:
    if option not in CHECKPOINTING:
        raise ValueError(f"activation_checkpointing: expected one of {', '.join(CHECKPOINTING)}, got {option!r}")
    return option


class Recompute(torch.autograd.Function):
    """out = run(x), keeping only x for the backward: the forward runs without a graph, the backward
    runs run(x) again with one, under the forward's autocast state, and backpropagates through it
    (the parameters run() uses get their gradients there, x its own)."""

    @staticmethod
    def forward(ctx, run, x):
        ctx.run, ctx.autocast = run, autocast_state(x.device.type)
        ctx.save_for_backward(x)
        return run(x)

    @staticmethod
    def backward(ctx, grad):
        x = ctx.saved_tensors[0].detach().requires_grad_()
        with torch.enable_grad(), restore_autocast(ctx.autocast):
            out = ctx.run(x)
        torch.autograd.backward(out, grad)
        return None, x.grad


def recompute(run, x: Tensor) -> Tensor:
    """run(x) through Recompute where a backward will reach x; else run(x) as it is (under no_grad,
    or an x that needs no gradient: Recompute would leave run's parameters without theirs)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return Recompute.apply(run, x)
    return run(x)


class Blocks(nn.Module):
    """The blocks a model holds, named by their global index (so "blocks.5..." on any pipeline
    layout); iterates over the blocks in order, [i] is block i."""

    def __init__(self, blocks: dict[int, nn.Module]):
        super().__init__()
        for i, block in blocks.items():
            self.add_module(str(i), block)

    def __iter__(self):
        return iter(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, index: int) -> nn.Module:
        return self._modules[str(index)]


class Block(nn.Module):
    """x[B L M/t] -> x + Attention(RMSNorm(x)) -> x + MoE(RMSNorm(x)) sliced to M/t; `checkpointing`
    (CHECKPOINTING) says what the backward recomputes."""

    def __init__(self, config: TransformerConfig, mesh, backward: str, dtype: torch.dtype, device=None,
                 checkpointing: str = "none"):
        super().__init__()
        kw = dict(mesh=mesh, backward=backward, dtype=dtype, device=device)
        self.mesh, self.checkpointing = mesh, check_checkpointing(checkpointing)
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps, **kw)
        self.attention = Attention(config.d_model, config.n_q_heads, config.n_kv_heads, config.head_dim, **kw)
        self.ffn_norm = RMSNorm(config.d_model, config.norm_eps, **kw)
        # MoE takes MoEConfig's fields
        self.moe = MoE(**dataclasses.asdict(config.moe), mesh=mesh, dtype=dtype, device=device)

    def forward(self, x: Tensor, segment_ids: Tensor, rope: RopeTable, sequence_starts: Tensor | None,
                attention_bias: Tensor | None = None) -> Tensor:
        def block(x):
            x = x + self.attention(self.attn_norm(x), segment_ids, rope, attention_bias)
            nx = whole_to_partial_grad(self.ffn_norm(x), self.mesh, "t")
            if self.checkpointing == "moe":
                y = recompute(lambda nx: self.moe(nx, sequence_starts), nx)
            else:
                y = self.moe(nx, sequence_starts)
            return x + keep_block("B L M -> B L M/t", y, self.mesh)

        return recompute(block, x) if self.checkpointing == "block" else block(x)

    def decode(self, x: Tensor, rope: RopeTable, cache: KVCache) -> Tensor:
        """x[B n M/t] of n new tokens after the cache's (one document) -> the block's output."""
        x = x + self.attention.decode(self.attn_norm(x), rope, cache)
        return x + keep_block("B L M -> B L M/t", self.moe(self.ffn_norm(x)), self.mesh)


class Transformer(nn.Module):
    """The model on this rank: parameters hold local shards (see the module docstring).

    backward: "explicit" (the dense layers' hand-written backward) or "autograd" (autograd through
    their forward and shardops' collectives); the MoE layer always runs its explicit backward.
    device: where the parameters, buffers and every tensor of a forward live (None: torch's default).
    activation_checkpointing: CHECKPOINTING (the module docstring).
    """

    def __init__(self, config: TransformerConfig, *, mesh=None, backward: str = "explicit",
                 dtype: torch.dtype = torch.float32, seed: int = 0, part: Part | None = None, device=None,
                 activation_checkpointing: str = "none"):
        super().__init__()
        sizes = [1 if mesh is None else mesh.size(a) for a in MESH_AXES]
        check_layout(config, *sizes)
        part = Part.whole(config.n_layers) if part is None else part
        if any(not 0 <= i < config.n_layers for i in part.layers) or list(part.layers) != sorted(set(part.layers)):
            raise ValueError(f"part: expected ascending distinct block indices in 0..{config.n_layers - 1}, "
                             f"got {part.layers}")
        self.config, self.mesh, self.dtype, self.part, self.seed = config, mesh, dtype, part, seed
        backward = check_backward_mode(backward)
        checkpointing = check_checkpointing(activation_checkpointing)
        kw = dict(mesh=mesh, backward=backward, dtype=dtype, device=device)
        self.embedding = Embedding(config.vocab_size, config.d_model, **kw) if part.embedding else None
        self.blocks = Blocks({i: Block(config, mesh, backward, dtype, device, checkpointing) for i in part.layers})
        # One pool of row buffers for every MoE layer: each layer's saved blocks stay lent until its
        # backward, and one layer's scratch buffers serve the next, so the pool holds the layers'
        # saved blocks plus one layer's scratch rather than n_layers working sets (moe/cpu.py Workspace).
        share_workspace(block.moe for block in self.blocks)
        self.final_norm = RMSNorm(config.d_model, config.norm_eps, **kw) if part.head else None
        self.unembedding = Unembedding(config.vocab_size, config.d_model, **kw) if part.head else None
        self.specs = self._local_specs()
        for name, param in self.named_parameters():
            if self._kind(name) == "dense":
                mark_grad_sync(param, DENSE_GRAD_SYNC)
        dtensors.prepare(self.specs.values(), mesh)  # a collective: the DeviceMeshes state_dict() needs
        self.register_state_dict_post_hook(_whole_dense_entries)
        self.register_load_state_dict_pre_hook(_local_dense_entries)
        self.register_load_state_dict_post_hook(_mark_assigned_dense)
        self.reset_parameters()

    @property
    def device(self) -> torch.device:
        """Where the parameters live (the constructor's device, or where to_empty() put them)."""
        return next(self.parameters()).device

    def _apply(self, fn, recurse=True):
        """As nn.Module._apply (.to(), .double(), to_empty(), ...), and the parameters' grad-sync marks
        put back: a DTensor parameter is converted by swapping in a new Parameter
        (torch.utils.swap_tensors), which drops its attributes, and sync_grads refuses an unmarked
        DTensor as FSDP's."""
        marks = {n: getattr(p, GRAD_SYNC_ATTRIBUTE) for n, p in self.named_parameters()
                 if hasattr(p, GRAD_SYNC_ATTRIBUTE)}
        module = super()._apply(fn, recurse)
        for name, axes in marks.items():
            mark_grad_sync(self.get_parameter(name), axes)
        return module

    def reset_parameters(self) -> None:
        """Every parameter and buffer this rank holds drawn again from the model's seed
        (init_full_weights): built on the meta device and materialised with to_empty(), the model
        then holds what one built eagerly with the same seed holds, the MoE layers' correction
        biases included. It sets the blocks' MoE layers too, so call it on the model, after any
        per-module MoE.reset_parameters (module.apply's order is right: children first)."""
        weights = init_full_weights(self.config, self.seed, self.dtype)  # all of them: a part's values are the whole model's
        self.load_full_state_dict({name: w for name, w in weights.items() if self.part.holds(name)})

    # -- layout ------------------------------------------------------------------------------

    def _local_specs(self) -> dict[str, str]:
        specs = {}
        for module_name, module in self.named_modules():
            for param_name, spec in getattr(module, "SPECS", {}).items():
                specs[f"{module_name}.{param_name}"] = spec
        for i in self.part.layers:
            specs[f"blocks.{i}.moe.gate_weight"] = GATE_SPEC
            specs[f"blocks.{i}.moe.gate_bias"] = GATE_BIAS_SPEC
            for short in EXPERT_PARAMS + SHARED_PARAMS + ("shared_gate_weight",):
                specs[f"blocks.{i}.moe.{short}"] = etp.SHARD_SPECS[short][1]
        return {name: specs[name] for name, _ in self.named_parameters()}

    @staticmethod
    def _kind(name: str) -> str:
        short = name.rsplit(".", 1)[-1]
        return "expert" if short in EXPERT_PARAMS + SHARED_PARAMS else "gate" if short in ROUTER_STATE else "dense"

    def replicas(self, name: str) -> int:
        """Number of ranks holding the same shard of parameter `name` (its gradient norm counts once)."""
        if self.mesh is None:
            return 1
        sharded = parse_spec(self.specs[name]).axes
        return math.prod(self.mesh.size(a) for a in MESH_AXES if a not in sharded)

    def shard_full(self, name: str, full: Tensor) -> Tensor:
        """This rank's shard of a full tensor laid out like parameter `name` (no communication)."""
        kind = self._kind(name)
        if self.mesh is None or kind == "gate":
            return full
        if kind == "expert":
            return etp.shard_expert_param(name.rsplit(".", 1)[-1], full, self.mesh)
        spec = self.specs[name]
        return shardops.shard(f"{_unsharded(spec)} -> {spec}", full, self.mesh)

    def gather_full(self, name: str, local: Tensor) -> Tensor:
        """The full tensor from every rank's shard laid out like parameter `name` (`local`: the shard,
        or a MoE layer's DTensor parameter or gradient, whose local tensor it is). Collective."""
        local = composition.local(local)
        kind = self._kind(name)
        if self.mesh is None or kind == "gate":
            return local
        if kind == "expert":
            return etp.gather_expert_param(name.rsplit(".", 1)[-1], local, self.mesh)
        spec = self.specs[name]
        return shardops.all_gather(f"{spec} -> {_unsharded(spec)}", local.contiguous(), self.mesh)

    def whole_entry(self, name: str, local: Tensor) -> Tensor:
        """The whole tensor of which `local` is this rank's shard laid out like parameter `name`, as
        state_dict() presents it: a DTensor sharing local's storage when the mesh splits it
        (shardmoe/parallel/dtensors.py; an expert's in the MoE layer's packed view), else local.
        No communication: a distributed checkpoint saves and loads through it."""
        kind = self._kind(name)
        if kind == "expert":
            module, short = name.rsplit(".", 1)
            return self.get_submodule(module).placement.state_entry(short, local)
        return local if kind == "gate" else dtensors.whole(self.specs[name], local, self.mesh)

    def _correction_biases(self) -> dict[str, Tensor]:
        return {name: b for name, b in self.named_buffers() if name.endswith(".correction_bias")}

    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        """full_shapes of the state this model holds (its part's)."""
        return {name: shape for name, shape in full_shapes(self.config).items() if self.part.holds(name)}

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, Tensor]:
        """Unsharded parameters and correction biases by name (equal on every rank of the mesh; of
        this model's part). Collective: every rank of the mesh calls it."""
        state = {name: self.gather_full(name, p.detach()).clone() for name, p in self.named_parameters()}
        state.update({name: b.clone() for name, b in self._correction_biases().items()})
        return state

    @torch.no_grad()
    def update_correction_biases(self, loads: list[Tensor] | None = None) -> None:
        """Each block's MoE.update_correction_bias from the step's global loads [E] of every block of
        the whole model, by global index (default: each block's last forward's, the selections
        summed over the mesh, equal on every rank; with micro-batches, their sum); call it after the
        optimizer step."""
        for i, block in zip(self.part.layers, self.blocks):
            bias = block.moe.correction_bias
            if bias is not None:  # the layers' own counts: MoE.update_correction_bias's host checks of a caller's
                load = block.moe.stats["selected_per_expert"] if loads is None else loads[i]  # loads would wait
                bias.copy_(corrected_bias(bias, load.to(bias.device), block.moe.config.bias_update_rate))

    def moe_layers(self) -> list:
        """The MoE layers of the blocks this model holds, in order."""
        return [block.moe for block in self.blocks]

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, Tensor]) -> None:
        """Load unsharded parameters, keeping this rank's shards; names (this model's part's) and
        shapes must match."""
        shapes = self.full_shapes()
        if set(state) != set(shapes):
            missing, extra = sorted(set(shapes) - set(state)), sorted(set(state) - set(shapes))
            raise ValueError(f"state dict: missing {missing or 'nothing'}, unexpected {extra or 'nothing'}")
        for name, param in self.named_parameters():
            if tuple(state[name].shape) != shapes[name]:
                raise ValueError(f"state dict: {name} has shape {list(state[name].shape)}, "
                                 f"expected {list(shapes[name])}")
            composition.local(param).copy_(self.shard_full(name, state[name].to(param.dtype)))
        for name, buffer in self._correction_biases().items():
            if tuple(state[name].shape) != shapes[name]:
                raise ValueError(f"state dict: {name} has shape {list(state[name].shape)}, "
                                 f"expected {list(shapes[name])}")
            buffer.copy_(state[name])

    # -- forward -----------------------------------------------------------------------------

    def context(self, is_seq_start: Tensor) -> BlockInputs:
        """What every block reads from the rows' document starts: segment ids, RoPE table, the
        sequence-wise loss's sequences and the fused attention core's bias, in the dtype the
        attention computes in (autocast's, when it is on) (a pure function of is_seq_start: each
        stage computes it)."""
        layout = packed_layout(is_seq_start)
        rope = rope_table(layout.positions, self.config.head_dim, self.config.rope_theta, self.dtype)
        starts = sequence_starts(layout.segment_ids) if self.config.moe.seq_aux_loss_coef else None
        bias = None
        if default_core(self.dtype) == "fused":
            _, autocast, dtype = autocast_state(is_seq_start.device.type)
            bias = attention_bias(layout.segment_ids, dtype if autocast else self.dtype)
        return BlockInputs(layout.segment_ids, rope, starts, bias)

    def embed(self, ids: Tensor) -> Tensor:
        """x[B L M/t] of the token ids (the first stage's)."""
        return self.embedding(ids)

    def run_block(self, index: int, x: Tensor, inputs: BlockInputs) -> Tensor:
        """x[B L M/t] after block `index` (global)."""
        return self.blocks[index](x, *inputs)

    def head(self, x: Tensor) -> Tensor:
        """The final norm of x[B L M/t]: nx[B L M], replicated over t (the last stage's output)."""
        return self.final_norm(x)

    def loss(self, nx: Tensor, targets: Tensor, num_tokens: int) -> Tensor:
        """This rank's cross-entropy of the final-normed rows (summed over d, partial over e),
        divided by num_tokens."""
        return self.unembedding(nx, targets, num_tokens)

    def _trunk(self, ids: Tensor, is_seq_start: Tensor) -> Tensor:
        """x[B L M/t] after the blocks."""
        if self.part != Part.whole(self.config.n_layers):
            raise ValueError(f"forward: expected a model holding every part, got {self.part}: a pipeline stage's "
                             "model runs through its stages (shardmoe/model/stages.py)")
        inputs = self.context(is_seq_start)
        x = self.embed(ids)
        for i in self.part.layers:
            x = self.run_block(i, x, inputs)
        return x

    def forward(self, ids: Tensor, is_seq_start: Tensor, targets: Tensor, num_tokens: int | None = None) -> Losses:
        """ids, is_seq_start, targets [B/d/e L] -> this rank's Losses: the cross-entropy summed over its
        tokens and divided by num_tokens, the global batch's (default: every rank's B L, so a
        micro-batch passes the whole step's count and the parts' losses sum to the step's mean).
        aux is the MoE layers' balance losses, for logging: their gradients ride on the layers'
        outputs (MoE.aux_loss_scale)."""
        x = self._trunk(ids, is_seq_start)
        token_shards = 1 if self.mesh is None else self.mesh.size(("d", "e"))
        ce = self.loss(self.head(x), targets, targets.numel() * token_shards if num_tokens is None else num_tokens)
        aux = sum(block.moe.aux_loss for block in self.blocks)
        return Losses(ce + aux, ce, aux)

    @torch.no_grad()
    def logits(self, ids: Tensor, is_seq_start: Tensor) -> Tensor:
        """logits[B L V] (gathered over t) in the compute dtype, for evaluation and sampling."""
        return self.head_logits(self.head(self._trunk(ids, is_seq_start)))

    def new_caches(self, capacity: int) -> list[KVCache]:
        """One empty KVCache of `capacity` tokens per block, for decode."""
        return [KVCache(capacity) for _ in self.blocks]

    @torch.no_grad()
    def decode(self, ids: Tensor, caches: list[KVCache]) -> Tensor:
        """logits[B n V] (gathered over t) of n new tokens ids[B n] of one document after the tokens
        the caches hold (new_caches; their RoPE positions follow on), whose keys and values join
        the caches: each block's attention runs only the new queries, over the cached keys."""
        if self.part != Part.whole(self.config.n_layers):
            raise ValueError(f"decode: expected a model holding every part, got {self.part}")
        start, new = caches[0].length, ids.shape[1]
        positions = torch.arange(start, start + new, device=ids.device).expand(ids.shape[0], new)
        rope = rope_table(positions, self.config.head_dim, self.config.rope_theta, self.dtype)
        x = self.embed(ids)
        for block, cache in zip(self.blocks, caches):
            x = block.decode(x, rope, cache)
        return self.head_logits(self.head(x))

    @torch.no_grad()
    def head_logits(self, nx: Tensor) -> Tensor:
        """logits[B L V] (gathered over t) of the final-normed rows."""
        local = self.unembedding.logits(nx)
        return local if self.mesh is None else shardops.all_gather("B L V/t -> B L V", local, self.mesh)

    def moe_stats(self) -> list[dict]:
        """Each block's MoE routing statistics of the last forward (global over the mesh)."""
        return [block.moe.stats for block in self.blocks]

    # -- distributed bookkeeping -------------------------------------------------------------

    def sync_grads(self) -> None:
        """Complete every gradient over the axes whose ranks saw other tokens. Collective."""
        sync_grads(self, self.mesh)

    @torch.no_grad()
    def global_losses(self, losses: Losses) -> tuple[Tensor, Tensor]:
        """(cross-entropy, aux loss) [] of the whole global batch, equal on every rank, on the model's
        device (nothing is read on the host). Collective."""
        ce, aux = losses.ce.detach().reshape(1), losses.aux.detach().reshape(1).to(losses.ce.dtype)
        if self.mesh is not None:
            if self.mesh.size("e") > 1:
                ce = shardops.psum("1 -> 1", ce, self.mesh, axes="e")
            if self.mesh.size(("d", "e")) > 1:
                aux = shardops.psum("1 -> 1", aux, self.mesh, axes=("d", "e"))
        return ce[0], aux[0]


def _whole_dense_entries(model: Transformer, state_dict: dict, prefix: str, local_metadata) -> None:
    """state_dict post-hook: each dense parameter's entry is its whole tensor (Transformer.whole_entry
    of its local shard: the parameter's own DTensor layout, or a plain tensor where no axis of more
    than one rank splits it, which a distributed checkpoint takes for a replicated one), as the MoE
    layers' hooks present their experts, so that DCP saves every block once."""
    for name in model.specs:
        if model._kind(name) == "dense" and prefix + name in state_dict:
            state_dict[prefix + name] = model.whole_entry(name, composition.local(state_dict[prefix + name]).detach())


def _local_dense_entries(model: Transformer, state_dict: dict, prefix: str, *args) -> None:
    """load_state_dict pre-hook: each dense parameter's entry (the whole tensor) becomes this rank's
    shard: a DTensor in the model's own layout gives its local tensor (no communication), another
    DTensor is gathered whole (a collective over its mesh) and cut like a plain tensor (shard_full);
    the shard is then laid out as the parameter (a DTensor of the same placements, sharing it).
    ValueError naming the key and both shapes for another shape."""
    from torch.distributed.tensor import DTensor

    if model.mesh is None:
        return
    params = dict(model.named_parameters())
    for name, spec in model.specs.items():
        key = prefix + name
        if model._kind(name) != "dense" or key not in state_dict:
            continue
        value = state_dict[key]
        expected = global_shape(spec, composition.local(params[name]).shape, model.mesh)
        if tuple(value.shape) != expected:
            raise ValueError(f"state dict: {key} has shape {list(value.shape)}, expected the whole tensor's "
                             f"{list(expected)}")
        own = dtensors.own_local(spec, value, model.mesh)
        if own is None:
            own = model.shard_full(name, value.full_tensor() if isinstance(value, DTensor) else value)
        state_dict[key] = dtensors.parameter(spec, own, model.mesh)  # laid out as the parameter it made


def _mark_assigned_dense(model: Transformer, incompatible_keys) -> None:
    """load_state_dict post-hook: a dense parameter that load_state_dict(assign=True) put in place (a
    new Parameter, laid out by _local_dense_entries as the one it replaces) gets the grad-sync mark
    the constructor gave (sync_grads refuses an unmarked DTensor as FSDP's)."""
    for name, param in model.named_parameters():
        if model._kind(name) == "dense" and not hasattr(param, GRAD_SYNC_ATTRIBUTE):
            mark_grad_sync(param, DENSE_GRAD_SYNC)


def _unsharded(spec: str) -> str:
    """'V/t M/d' -> 'V M'."""
    return " ".join(parse_spec(spec).names)
