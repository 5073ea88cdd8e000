"""The tile-task runtime: an executable specification of the FlashMoE schedule
(docs/tasks.md). It plans a layer's forward and backward as tile tasks on simulated
devices, runs them under a scheduler with checked invariants, and records a trace."""
from shardmoe.tasks.api import BackwardResult, ForwardResult, run_backward, run_forward
from shardmoe.tasks.queues import ScheduleError

__all__ = ["run_forward", "run_backward", "ForwardResult", "BackwardResult", "ScheduleError"]
