"""Routing that looks like training, for the simulator: expert popularity, then a routed batch.

Popularity p [E] (sums to 1), by name:
  uniform        p_e = 1 / E
  zipf:A         p_e proportional to (rank_e + 1)^-A, ranks a fixed random permutation of the
                 experts (so the hot experts are not all on device 0)
  replay:PATH    the loads a real run logged: PATH is a `shardmoe train` metrics.jsonl; its rows'
                 `expert_tokens[l][j]` (pairs layer l sent to expert j) are summed over steps and
                 layers and sorted; a file with another expert count is resampled to E points
                 by linear interpolation of that sorted load profile (the skew carries over, the
                 identity of the experts cannot), then permuted like zipf.

A routed batch: each of S tokens draws k distinct experts from p (torch.multinomial without
replacement, seeded), weights 1/k. It is a duck-typed Routing with the three fields Plan reads
(top_idx [S, k], row_pair [N] sorted by expert then pair, weight [S, k]); there are no capacity
drops (the dropless case the paper measures).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch


def popularity(spec: str, num_experts: int, seed: int = 0) -> torch.Tensor:
    """p [E] float64 from "uniform", "zipf:A" or "replay:PATH" (module docstring)."""
    kind, _, arg = spec.partition(":")
    if kind == "uniform" and not arg:
        return torch.full((num_experts,), 1.0 / num_experts, dtype=torch.float64)
    if kind == "zipf":
        try:
            exponent = float(arg)
        except ValueError:
            raise ValueError(f"--routing: zipf expects zipf:EXPONENT with a number, got {spec!r}") from None
        if not math.isfinite(exponent) or exponent < 0:  # NaN passes a < 0 check
            raise ValueError(f"--routing: the zipf exponent must be a finite number >= 0, got {arg!r}")
        profile = torch.arange(1, num_experts + 1, dtype=torch.float64) ** -exponent
    elif kind == "replay" and arg:
        profile = _replayed_profile(Path(arg), num_experts)
    else:
        raise ValueError(f"--routing: expected uniform, zipf:EXPONENT or replay:METRICS_JSONL, got {spec!r}")
    permutation = torch.randperm(num_experts, generator=torch.Generator().manual_seed(seed))
    p = torch.empty_like(profile)
    p[permutation] = profile / profile.sum()
    return p


def _replayed_profile(path: Path, num_experts: int) -> torch.Tensor:
    """The summed expert loads of a metrics.jsonl, sorted descending, resampled to num_experts."""
    if not path.is_file():
        raise ValueError(f"--routing replay: no file {path}")
    loads = None
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if "expert_tokens" not in row:
            continue
        step = torch.tensor(row["expert_tokens"], dtype=torch.float64).sum(0)  # over layers
        loads = step if loads is None else loads + step
    if loads is None or loads.sum() <= 0:
        raise ValueError(f"--routing replay: {path} has no rows with expert_tokens (a shardmoe train metrics.jsonl)")
    profile = loads.sort(descending=True).values
    if profile.numel() == num_experts:
        return profile
    source = torch.linspace(0, 1, profile.numel(), dtype=torch.float64)
    target = torch.linspace(0, 1, num_experts, dtype=torch.float64)
    index = torch.searchsorted(source, target).clamp(1, profile.numel() - 1)
    lo, hi = source[index - 1], source[index]
    t = (target - lo) / (hi - lo)
    return profile[index - 1] * (1 - t) + profile[index] * t


@dataclass
class SyntheticRouting:
    """What Plan reads of a Routing: top_idx [S, k], row_pair [N], weight [S, k]."""

    top_idx: torch.Tensor
    row_pair: torch.Tensor
    weight: torch.Tensor


def routed_batch(p: torch.Tensor, num_tokens: int, top_k: int, seed: int = 0) -> SyntheticRouting:
    """Each token picks top_k distinct experts with odds p (seeded); rows sorted by expert, then pair."""
    if top_k > int((p > 0).sum()):
        raise ValueError(f"top_k {top_k} exceeds the {int((p > 0).sum())} experts with non-zero popularity")
    generator = torch.Generator().manual_seed(seed)
    top_idx = torch.multinomial(p.expand(num_tokens, -1), top_k, replacement=False, generator=generator)
    pairs = torch.arange(num_tokens * top_k)
    row_pair = pairs[torch.argsort(top_idx.reshape(-1) * (num_tokens * top_k) + pairs)]
    return SyntheticRouting(top_idx, row_pair, torch.full((num_tokens, top_k), 1.0 / top_k, dtype=torch.float64))
