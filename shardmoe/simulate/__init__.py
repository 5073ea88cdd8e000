"""The tile-task schedule without tensors: the plan, emitters, queues, counters, protocol and event
loop of shardmoe.tasks, with task bodies that compute nothing, so a schedule's timeline can be
produced under any Scheduler (durations and latencies) at sizes whose tensors would not fit."""
from shardmoe.simulate.tileless import simulate_backward, simulate_forward

__all__ = ["simulate_forward", "simulate_backward"]
