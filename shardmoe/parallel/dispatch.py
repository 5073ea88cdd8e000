"""DispatchPlan: who sends which (token, expert) rows where, decided from one exchange of counts.

Token-parallel ranks are the (d, e) coordinates, numbered r = coord(('d', 'e')) = d * ep + e;
ranks along 't' hold the same tokens and make the same plan. Before any row moves, every rank
all-gathers over (d, e) its per-expert selection counts and its token count ([E + 1] int64s).
From that [R, E + 1] table each rank derives, without further communication:

  capacity   EC = ceil(S_global / E * capacity_factor * k) over the global token count, and the
             pairs each rank keeps: expert j keeps its first EC pairs in the order of the
             concatenation of all ranks' tokens (rank r's before rank r+1's), so rank r keeps
             min(selected[r, j], max(EC - sum_{r' < r} selected[r', j], 0)) pairs of expert j;
  splits     counts[s][q]: rows that e-peer s sends to e-peer q (experts are split over 'e' in
             contiguous blocks of E/ep, so q owns experts [q*E/ep, (q+1)*E/ep));
  expert-major order of the received rows (by local expert, then source, then token), which
             groups them for the grouped GEMMs;
  global statistics and the aux-loss counts.

Shapes: S tokens on this rank, E experts, El = E/ep local experts, G = ep peers, R = dp*ep.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from shardmoe import shardops
from shardmoe.moe.routing import Routing, keep_first
from shardmoe.parallel.exchange import ExchangeError


@dataclass
class DispatchPlan:
    """One forward's global routing counts and this rank's view of them.

    tokens [R] tokens per token-parallel rank; selected [R, E] top-k choices before capacity;
    kept [R, E] pairs kept; capacity EC or None (dropless); rank r and peer index (e coord) of
    this rank; experts per peer El. counts is the [G, G] split matrix of this rank's e-group,
    recv_per_expert [G, El] the rows this rank's experts receive from each peer.
    """

    tokens: torch.Tensor
    selected: torch.Tensor
    kept: torch.Tensor
    capacity: int | None
    rank: int
    peer: int
    local_experts: int
    counts: list[list[int]]
    recv_per_expert: torch.Tensor

    @property
    def global_tokens(self) -> int:
        return int(self.tokens.sum())

    @property
    def rows_per_local_expert(self) -> torch.Tensor:
        """[El] rows each local expert processes."""
        return self.recv_per_expert.sum(0)

    def expert_major_order(self) -> torch.Tensor:
        """[N_recv] index into the received rows (source-major) giving them expert-major."""
        c = self.recv_per_expert
        lengths = c.t().reshape(-1)  # (local expert, source) blocks in expert-major order
        source_major_start = (torch.cumsum(c.reshape(-1), 0) - c.reshape(-1)).view(c.shape).t().reshape(-1)
        expert_major_start = torch.cumsum(lengths, 0) - lengths
        total = int(lengths.sum())
        shift = torch.repeat_interleave(source_major_start - expert_major_start, lengths, output_size=total)
        return torch.arange(total, device=c.device) + shift

    def stats(self) -> dict:
        """Global statistics, equal on every rank (the keys of the single-process layer's stats)."""
        return dict(
            tokens_per_expert=self.kept.sum(0),
            selected_per_expert=self.selected.sum(0),
            dropped_tokens=int(self.selected.sum() - self.kept.sum()),
            capacity=self.capacity,
        )


def plan_dispatch(routing: Routing, config, mesh) -> tuple[DispatchPlan, Routing]:
    """Exchange counts over (d, e) and apply the global capacity to this rank's dropless routing.

    routing comes from route() without capacity. Returns the plan and the routing whose row_pair
    and kept_per_expert hold only the kept pairs. Collective over the (d, e) group.
    """
    E, num_tokens = config.num_experts, routing.probs.shape[0]
    mine = torch.cat([routing.selected_per_expert, torch.tensor([num_tokens], device=routing.probs.device)]).view(1, E + 1)
    try:
        table = shardops.all_gather("R/d/e C -> R C", mine, mesh)
    except RuntimeError as err:
        raise ExchangeError(
            f"expert-parallel counts exchange over mesh axes ('d', 'e') failed on rank {mesh.rank}: a peer failed, "
            f"hung or left; cause: {err}"
        ) from err
    selected, tokens = table[:, :E], table[:, E]
    rank = mesh.coord(("d", "e"))
    capacity = config.capacity(int(tokens.sum()))
    if capacity is None:
        kept = selected
    else:
        earlier = torch.cumsum(selected, 0) - selected
        kept = torch.minimum(selected, (capacity - earlier).clamp(min=0))
        # routing is dropless: row_pair already holds every pair grouped by expert, token order within
        row_pair, kept_here = keep_first(routing.row_pair, routing.top_idx.reshape(-1)[routing.row_pair],
                                         routing.selected_per_expert, kept[rank])
        routing = dataclasses.replace(routing, row_pair=row_pair, kept_per_expert=kept_here)

    ep, peer = mesh.size("e"), mesh.coord("e")
    local = E // ep
    slice_rows = kept[rank - peer : rank - peer + ep]  # the token ranks of this d slice, in e order
    per_peer = slice_rows.view(ep, ep, local).sum(-1)  # [source, destination block]
    plan = DispatchPlan(tokens, selected, kept, capacity, rank, peer, local, per_peer.tolist(),
                        slice_rows[:, peer * local : (peer + 1) * local])
    return plan, routing


def peer_tokens(routing: Routing, plan: DispatchPlan) -> int:
    """Distinct (token, peer) pairs among this rank's kept rows bound for other peers: the rows a
    dispatch must move at least (a token going to two experts of one peer needs to travel once)."""
    k = routing.top_idx.shape[1]
    tokens = routing.row_pair // k
    peers = routing.top_idx.reshape(-1)[routing.row_pair] // plan.local_experts
    away = peers != plan.peer
    return int(torch.unique(tokens[away] * len(plan.counts) + peers[away]).numel())

