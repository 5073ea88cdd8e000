"""shardmoe: Mixture-of-Experts layers with an exact explicit backward, sharded on torch.distributed."""
