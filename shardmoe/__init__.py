"""shardmoe: Mixture-of-Experts layers with an exact explicit backward, sharded on torch.distributed."""
from shardmoe.moe.layer import MoE

__all__ = ["MoE"]
