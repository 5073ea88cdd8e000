"""Expert tensor parallelism over mesh axis 't' (docs/parallel.md), and the expert shard layout.

Each expert's intermediate dim (F for "glu", P for "mlp") is split over 't'; experts are split
over 'e' in contiguous blocks. In notation, with gate_up_proj viewed as [E, 2, F, H] (its gate
rows, then its up rows):

    gate_up_proj  'E/e 2 F/t H'   this rank's gate rows, then the same slice of the up rows
    down_proj     'E/e H F/t'     the same slice of its last dim
    gate_up_proj_bias 'E/e 2 F/t' (its columns with their rows)   down_proj_bias 'E/e H' (whole on every t rank)
    w1 'E/e P/t H'   b1 'E/e P/t'   w2 'E/e H P/t'   b2 'E/e H' (whole on every t rank)
    gate_weight   'H E'           replicated
    shared_gate_up_proj '2 Fs/t H', shared_down_proj 'H Fs/t' (the shared expert, dense: replicated
    over 'e', sliced over 't' like one expert), shared_gate_weight 'H' replicated

On rows xs 'N H' that every rank of a t group holds alike (they come from the same tokens):
    h   = xs Wgu_t^T            'N 2F/t'   column-parallel: no communication
    a   = act(hg) * hu          'N F/t'
    y_t = a Wdown_t^T           'N H' unreduced over t (row-parallel: contracts F/t)
    y   = psum_t(y_t)           forward all-reduce; its backward is the identity
and for the input: identity forward, psum_t of the input gradient backward, because each rank's
dx = dh_t Wgu_t only covers its slice of F. The "glu" gate dot product g . y is taken as
(g Wdown_t) . a_t, which is also unreduced over t and summed the same way (one more all-reduce
in the backward, for the routing-weights gradient). For "mlp" the psum comes before b2 and
act_out, which need the whole z2; b2 is added once. The "glu" down_proj_bias is added once in
the same way, after the psum of y_t, and its term g . bdown of the gate dot is added once, after
the psum of the partial dots.

The contractions over F/t run in the layer's grouped GEMMs (shardmoe/moe/experts.py), not
in einsums: expert_parallel marks their results with shardops.unreduced (a wrapper, no copy), and
the reduce_* functions below take only such Unreduced values, so their results reach the caller
only through these psums and dropping one raises UnreducedError at the first use.
The expert weight gradients (sums over this rank's rows) leave through autograd as partial sums
over d, which sync_grads completes.

The layer's state dict holds each shard as a DTensor of the whole tensor in the packed view above
(state_entry: the shard spec's axes become Shard placements on the DeviceMesh's 'ep' and 'tp'
dims), which torch.distributed.checkpoint saves once and reshards to any layout (docs/parallel.md).
"""
from __future__ import annotations

import torch

from shardmoe.parallel import shardops
from shardmoe.expert_kinds import GLU, MLP
from shardmoe.moe.placement import PACKED, packed, unpacked
from shardmoe.notation import parse_spec
from shardmoe.parallel import dtensors

# parameter name -> (spec of the whole tensor, spec of this rank's shard): each expert kind's own
# (gate_up_proj and its bias in their [E, 2, F, H], [E, 2, F] views so that 't' splits the gate and
# the up rows alike), then the shared expert's
SHARD_SPECS = {
    **GLU.shard_specs,
    **MLP.shard_specs,
    # the shared expert is dense: one expert's layout, replicated over 'e', sliced over 't'
    "shared_gate_up_proj": ("2 F H", "2 F/t H"),
    "shared_down_proj": ("H F", "H F/t"),
    "shared_gate_weight": ("H", "H"),
}


def check_layout(config, mesh) -> None:
    """Raise ValueError, before any communication, when the mesh cannot split this layer."""
    if mesh is None:
        return
    ep, tp = mesh.size("e"), mesh.size("t")
    if config.num_experts % ep:
        raise ValueError(f"num_experts: expected a multiple of the mesh's ep = {ep} (experts are split over 'e'), "
                         f"got {config.num_experts}")
    if config.ffn_size % tp:
        raise ValueError(f"ffn_size: expected a multiple of the mesh's tp = {tp} (the expert intermediate dim is "
                         f"split over 't'), got {config.ffn_size}")
    if config.shared_ffn_size % tp:
        raise ValueError(f"shared_ffn_size: expected a multiple of the mesh's tp = {tp} (the shared expert's "
                         f"intermediate dim is split over 't'), got {config.shared_ffn_size}")


def is_sharded(mesh) -> bool:
    return mesh is not None and (mesh.size("e") > 1 or mesh.size("t") > 1)


def shard_shape(name: str, shape: tuple[int, ...], mesh) -> tuple[int, ...]:
    """Local shape of expert parameter `name` whose whole shape is `shape`: the shape of
    shard_expert_param's result on a meta tensor (no memory, no communication); the router's,
    replicated, is whole."""
    if name not in SHARD_SPECS:
        return tuple(shape)
    return tuple(shard_expert_param(name, torch.empty(shape, device="meta"), mesh).shape)


def shard_expert_param(name: str, whole: torch.Tensor, mesh) -> torch.Tensor:
    """This rank's shard of a whole expert parameter (a contiguous copy; no communication)."""
    if not is_sharded(mesh):
        return whole
    source, target = SHARD_SPECS[name]
    local = shardops.shard(f"{source} -> {target}", packed(name, whole), mesh)
    return unpacked(name, local).contiguous()


def gather_expert_param(name: str, local: torch.Tensor, mesh) -> torch.Tensor:
    """The whole expert parameter from every rank's shard. Collective over ('e', 't') (none for a
    parameter whole on every rank, shared_gate_weight)."""
    source, target = SHARD_SPECS[name]
    if not is_sharded(mesh) or source == target:
        return local
    whole = shardops.all_gather(f"{target} -> {source}", packed(name, local), mesh)
    return unpacked(name, whole)


def state_entry(name: str, local: torch.Tensor, mesh) -> torch.Tensor:
    """The state-dict entry of expert parameter `name` from this rank's shard `local`: its packed
    view (moe/placement.py: gate_up_proj as [E, 2, F, H]) as the whole tensor of its packed shard
    spec, a DTensor when the mesh splits it (shardmoe/parallel/dtensors.py), else the plain view
    (a distributed checkpoint takes a plain tensor for a replicated one). Shares local's storage."""
    return dtensors.whole(SHARD_SPECS[name][1], packed(name, local), mesh)


def own_state_entry(name: str, value, shape: tuple[int, ...], mesh) -> torch.Tensor | None:
    """This rank's shard, in the parameter's shape, when `value` is a DTensor of the whole parameter
    `name` (whole shape `shape`) laid out as state_entry lays it out on this mesh (what a distributed
    checkpoint loaded into); else None."""
    whole = tuple(packed(name, torch.empty(shape, device="meta")).shape)
    local = dtensors.own_local(SHARD_SPECS[name][1], value, mesh) if tuple(value.shape) == whole else None
    return None if local is None else unpacked(name, local)


def parameter_placements(name: str, mesh) -> tuple:
    """The DTensor placements, one per dim of mesh.parameter_mesh ('ep', then 'tp', those of more
    than one rank), of the layer's parameter `name` in its own shape: Shard(i) where the axis
    splits dim i of its shard spec, Replicate() elsewhere (the router everywhere). gate_up_proj
    [E, 2F, H] (its bias, the shared expert's likewise) splits F over 't' as its [E, 2, F, H] view
    does: a rank holds a slice of the gate rows and the same slice of the up rows, which is
    _StridedShard(1, split_factor=2), torch's placement for a dim cut in `split_factor` blocks
    before the mesh splits each (full_tensor, norms and the optimizer's math take it; a
    distributed checkpoint refuses it, as two blocks per rank: docs/parallel.md)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    dims = parse_spec(SHARD_SPECS[name][1]).dims if name in SHARD_SPECS else ()
    pair = next((i for i, d in enumerate(dims) if d.name == "2"), None) if name in PACKED else None
    out = []
    for dim_name in mesh.parameter_mesh.mesh_dim_names:
        axis = dtensors.AXIS_OF[dim_name]
        split = next((i for i, d in enumerate(dims) if axis in d.axes), None)
        if split is None:
            out.append(Replicate())
        elif pair is None or split < pair:
            out.append(Shard(split))
        elif split == pair + 1:  # the F of [.., 2, F, ..]: the 2F dim of the parameter, in two blocks
            out.append(_StridedShard(pair, split_factor=2))
        else:
            out.append(Shard(split - 1))
    return tuple(out)


def gradient_placements(name: str, mesh, summed_over_e: bool) -> tuple:
    """The placements of parameter `name`'s gradient as the layer's backward leaves it: the
    parameter's, except that a parameter replicated over 'e' (router, shared expert) holds the
    gradient of this rank's tokens only, Partial() on 'ep', unless the backward `summed_over_e`
    itself (the FSDP composition, composition.fully_sharded_over_d). Over 't' every gradient is
    already whole or this rank's slice; over 'd' (not on the parameter mesh) sync_grads or FSDP
    sums."""
    from torch.distributed.tensor import Partial

    placements = list(parameter_placements(name, mesh))
    replicated_over_e = name not in SHARD_SPECS or "e" not in parse_spec(SHARD_SPECS[name][1]).axes
    if replicated_over_e and not summed_over_e and "ep" in mesh.parameter_mesh.mesh_dim_names:
        placements[mesh.parameter_mesh.mesh_dim_names.index("ep")] = Partial()
    return tuple(placements)


def reduce_expert_output(partial: shardops.Unreduced, mesh) -> torch.Tensor:
    """psum over 't' of row-parallel partial outputs 'N H' (forward; backward is the identity)."""
    return shardops.psum("N H -> N H", partial, mesh)


def reduce_input_grad(partial: shardops.Unreduced, mesh) -> torch.Tensor:
    """psum over 't' of the expert-input gradient 'N H' (the backward of the identity at the
    column-parallel input)."""
    return shardops.psum("N H -> N H", partial, mesh)


def reduce_gate_dot(partial: shardops.Unreduced, mesh) -> torch.Tensor:
    """psum over 't' of the "glu" gate dot products 'N', (g Wdown_t) . a_t."""
    return shardops.psum("N -> N", partial, mesh)
