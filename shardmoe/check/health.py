"""Gradient health: per-parameter gradient norms, flagged when exploding or vanishing.

Call it after backward and before the optimizer step:

    report = gradient_health(model.named_parameters())
    if not report.healthy:
        print(report.table())

For each parameter with gradient g the report holds ||g||_2 and max|g|
(both accumulated in float64 so a bf16 gradient's norm does not overflow or
round away) and one status:

  exploding   ||g|| > explode_threshold, or g holds inf/nan
  vanishing   ||g|| < vanish_threshold (an all-zero gradient included: an
              expert that received no tokens shows up here)
  missing     g is None although the parameter requires grad (the loss never
              reached it: usually a disconnected graph)
  ok          otherwise

The default thresholds (100 and 1e-7) are the classic warning levels; they
are absolute, so pass thresholds suited to the model's scale where needed.

Under a mesh each rank holds shards, and a shard's norm says little about the
parameter (a zero shard of a healthy gradient looks vanishing). Pass
replicas=model.replicas: then, over the default process group,

    ||g||^2 = sum over ranks of ||g_shard||^2 / replicas(name)

(replicas counts the ranks holding the same shard, so each shard counts once),
max|g| is the max over ranks, and a gradient missing on any rank is missing.
Every rank gets the same report of the full gradients, flags from every rank
included; the call is then collective.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardmoe.moe.composition import local

OK, EXPLODING, VANISHING, MISSING = "ok", "exploding", "vanishing", "missing"


@dataclass(frozen=True)
class ParameterHealth:
    """Gradient statistics of one parameter (norm and max_abs are nan when missing; shape is this
    rank's shard when sharded)."""

    name: str
    shape: tuple[int, ...]
    norm: float
    max_abs: float
    status: str


@dataclass(frozen=True)
class HealthReport:
    """The per-parameter entries, in the order given, and the thresholds used."""

    entries: tuple[ParameterHealth, ...]
    explode_threshold: float
    vanish_threshold: float

    @property
    def flagged(self) -> tuple[ParameterHealth, ...]:
        """Entries whose status is not ok."""
        return tuple(e for e in self.entries if e.status != OK)

    @property
    def healthy(self) -> bool:
        return not self.flagged

    @property
    def total_norm(self) -> float:
        """sqrt(sum of squared norms) over parameters that have a gradient (what clip_grad_norm_ sees)."""
        present = [e.norm for e in self.entries if e.status != MISSING]
        return math.sqrt(sum(n * n for n in present)) if present else 0.0

    def table(self) -> str:
        """A fixed-width table: one row per parameter, then the total norm and a summary."""
        rows = [("parameter", "shape", "grad norm", "max |grad|", "status")]
        for e in self.entries:
            shape = "x".join(map(str, e.shape)) or "scalar"
            rows.append((e.name, shape, f"{e.norm:.3e}", f"{e.max_abs:.3e}", e.status))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        summary = f"{len(self.flagged)} of {len(self.entries)} flagged" if self.flagged else "all ok"
        lines.append(
            f"total norm {self.total_norm:.3e}; {summary} "
            f"(exploding > {self.explode_threshold:g} or non-finite, vanishing < {self.vanish_threshold:g})"
        )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _classify(norm: float, explode_threshold: float, vanish_threshold: float) -> str:
    if not math.isfinite(norm) or norm > explode_threshold:
        return EXPLODING
    if norm < vanish_threshold:
        return VANISHING
    return OK


def gradient_health(
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
    explode_threshold: float = 100.0,
    vanish_threshold: float = 1e-7,
    replicas: Callable[[str], int] | None = None,
    group=None,
) -> HealthReport:
    """Health report of the gradients held in .grad of each (name, parameter).

    Parameters with requires_grad=False are skipped: they are frozen on purpose.
    replicas: name -> ranks holding the same shard (Transformer.replicas); given, and with a
    default process group of more than one rank, the statistics are of the full gradients,
    reduced over all ranks (module doc). Collective then: every rank calls it with the same names.
    group: the process group the statistics are reduced over (default: the default group; a
    pipeline stage's mesh, whose ranks hold the same parameters).
    """
    if not 0 <= vanish_threshold < explode_threshold:
        raise ValueError(
            f"thresholds: expected 0 <= vanish_threshold < explode_threshold, "
            f"got vanish_threshold={vanish_threshold}, explode_threshold={explode_threshold}"
        )
    params = [(name, p) for name, p in named_parameters if p.requires_grad]
    # Per parameter: [squared norm, max|g|, missing] in float64, on this rank.
    stats = torch.zeros(len(params), 3, dtype=torch.float64)
    for i, (name, param) in enumerate(params):
        if param.grad is None:
            stats[i, 2] = 1.0
            continue
        grad = local(param.grad).detach().to(torch.float64)  # this rank's block; replicas count the rest
        # A single inf or nan makes the norm non-finite, which _classify reports as exploding.
        stats[i, 0] = torch.linalg.vector_norm(grad).square()
        stats[i, 1] = grad.abs().max() if grad.numel() else 0.0
    if replicas is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        stats[:, 0] /= torch.tensor([float(replicas(name)) for name, _ in params], dtype=torch.float64)
        sums, maxima = stats[:, [0, 2]].contiguous(), stats[:, 1].contiguous()
        dist.all_reduce(sums, group=group)
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
        stats[:, [0, 2]], stats[:, 1] = sums, maxima
    entries = []
    for (name, param), (square, max_abs, missing) in zip(params, stats.tolist()):
        shape = tuple(param.shape)
        if missing:
            entries.append(ParameterHealth(name, shape, math.nan, math.nan, MISSING))
            continue
        norm = math.sqrt(square)
        entries.append(ParameterHealth(name, shape, norm, max_abs, _classify(norm, explode_threshold, vanish_threshold)))
    return HealthReport(tuple(entries), explode_threshold, vanish_threshold)
