"""Helpers for testing shardmoe, shipped with the package so that downstream tests can use them."""

from shardmoe.testing.distributed import RankFailed, run_distributed

__all__ = ["RankFailed", "run_distributed"]
