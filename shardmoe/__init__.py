"""shardmoe: Mixture-of-Experts layers with an exact explicit backward, sharded on torch.distributed."""
from shardmoe.mesh import Mesh
from shardmoe.moe.layer import MoE

__all__ = ["MoE", "Mesh"]
