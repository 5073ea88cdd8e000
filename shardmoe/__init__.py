"""shardmoe: Mixture-of-Experts layers with an exact explicit backward, sharded on torch.distributed."""
from shardmoe import parallel  # noqa: F401  (registers expert parallelism for MoE(mesh=...))
from shardmoe.mesh import Mesh
from shardmoe.moe.layer import MoE

__all__ = ["MoE", "Mesh"]
