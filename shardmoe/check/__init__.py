"""Gradient checking and gradient health.

  cases       the configurations checked: float64 matrix, quick subset, precision set
  inputs      random inputs kept clear of top-k ties and relu kinks
  compare     the MoE layer vs the float64 reference: relative error per tensor, tolerances
  gradcheck   finite differences on the MoE layer (torch.autograd.gradcheck)
  health      per-parameter gradient norms with exploding / vanishing flags
  command     the `shardmoe check` subcommand
"""
from shardmoe.check.compare import TOLERANCES, compare_with_reference, relative_error
from shardmoe.check.gradcheck import layer_gradcheck
from shardmoe.check.health import HealthReport, gradient_health

__all__ = ["TOLERANCES", "HealthReport", "compare_with_reference", "layer_gradcheck", "gradient_health",
           "relative_error"]
