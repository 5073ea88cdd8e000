"""Expert parallelism over 'e', expert tensor parallelism over 't', and gradient sync over 'd', 'e'.

    layer = shardmoe.MoE(H, F, E, k, mesh=shardmoe.Mesh(dp=2, ep=2, tp=1))   # this rank's shards
    y = layer(x)                                    # x: this rank's tokens (any number, zero too)
    loss.backward(); shardmoe.parallel.sync_grads(model, mesh); optimizer.step()

Modules: dispatch (counts, global capacity, splits), exchange (rows over 'e': P2P shared memory
within a node, collectives across nodes), symmetric_heap (the shared memory), expert_parallel
(the expert-parallel dispatcher and placement), expert_tensor (shards and psums over 't'), sync
(sync_grads, clip_grad_norm_), consistency (ranks that must agree: settings, t-peers' tokens,
replicated parameters), dtensors (a rank's shard as a DTensor of the whole tensor, and back;
replicate_plain_parameters, for a model with plain modules beside the layers),
pipeline (schedules over the mesh's 'p' axis, on torch.distributed.pipelining), shardops (collectives
written as named-axis transitions, each with its autograd dual: the experts' psums over 't' and the
dense layers' all-gathers and reduce-scatters, shardmoe/model/). Its benchmark is a
measurement tool: shardmoe/tools/bench/distributed.py. docs/parallel.md has the decisions.
"""
from shardmoe.moe.placement import register_mesh_placement
from shardmoe.parallel.consistency import RankMismatchError
from shardmoe.parallel.dtensors import replicate_plain_parameters
from shardmoe.parallel.expert_parallel import ExpertParallel, MeshPlacement
from shardmoe.parallel.sync import clip_grad_norm_, mark_grad_sync, sync_grads

# shardmoe.MoE(mesh=...) places its parameters and picks its dispatcher through this
register_mesh_placement(MeshPlacement)

__all__ = ["ExpertParallel", "RankMismatchError", "clip_grad_norm_", "mark_grad_sync", "replicate_plain_parameters",
           "sync_grads"]
