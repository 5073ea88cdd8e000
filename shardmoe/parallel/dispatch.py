"""DispatchPlan: who sends which (token, expert) rows where, decided from one exchange of counts.

Token-parallel ranks are the (d, e) coordinates, numbered r = coord(('d', 'e')) = d * ep + e;
ranks along 't' hold the same tokens and make the same plan. Before any row moves, every rank
all-gathers over the whole mesh one int64 row: its layer settings (consistency.settings_words),
its token count, checksums of its tokens and its top-k choices (tp > 1 only), its number of
sequences (for the sequence-wise loss) and its per-expert selection counts. The
settings and the t-peers' rows are checked against each other (consistency); the t = 0 rows give
the [R, E] selections and [R] token counts, from which each rank derives, without further
communication:

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

from shardmoe.moe.routing import Routing, keep_first
from shardmoe.parallel import consistency


@dataclass
class DispatchPlan:
    """One forward's global routing counts and this rank's view of them.

    table [R, 4 + E] the token-parallel ranks' rows of the counts exchange, from which the rest is
    derived (plan_from_table); tokens [R] tokens per token-parallel rank; sequences [R] sequences of the sequence-wise loss
    per token-parallel rank (0 when it is off); selected [R, E] top-k choices before capacity;
    kept [R, E] pairs kept; capacity EC or None (dropless); rank r and peer index (e coord) of
    this rank; experts per peer El. counts is the [G, G] split matrix of this rank's e-group,
    recv_per_expert [G, El] the rows this rank's experts receive from each peer.
    """

    table: torch.Tensor
    tokens: torch.Tensor
    sequences: torch.Tensor
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
    def global_sequences(self) -> int:
        return int(self.sequences.sum())

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


def plan_dispatch(x: torch.Tensor, routing: Routing, config, mesh,
                  correction_bias: torch.Tensor | None = None) -> tuple[DispatchPlan, Routing]:
    """Exchange counts over the mesh and apply the global capacity to this rank's dropless routing.

    x 'S H' are this rank's tokens; routing comes from route() without capacity. Returns the plan
    and the routing whose row_pair and kept_per_expert hold only the kept pairs. Collective over
    the whole mesh; raises RankMismatchError on every rank, before any row moves, when the ranks
    disagree on the layer's settings or ranks along 't' hold different tokens (consistency).
    """
    num_tokens = routing.probs.shape[0]
    settings = consistency.layer_settings(config, mesh, x.dtype)
    # the selection-only bias is replicated and moves every step: one that drifted apart on one rank
    # (updated from its local load, or nudged) would route with other biases for the rest of the run
    settings[CORRECTION_BIAS_CHECK] = 0 if correction_bias is None else consistency.checksum(correction_bias)
    # The t-peers' tokens and routing must agree; with tp = 1 there is nothing to compare.
    t_peers = mesh.size("t") > 1
    checksums = [consistency.checksum(x), consistency.checksum(routing.top_idx)] if t_peers else [0, 0]
    sequences = routing.sequence_tokens.numel()
    mine = torch.cat([consistency.settings_words(settings), torch.tensor([num_tokens, *checksums, sequences]),
                      routing.selected_per_expert.cpu()]).to(routing.probs.device)
    full = consistency.gather_table(mine, mesh, "expert-parallel counts exchange")
    consistency.check_settings(full[:, : 2 * len(settings)], list(settings), "MoE layer settings", mesh)
    full = full[:, 2 * len(settings) :]
    consistency.check_t_peers(full, mesh)
    # The token-parallel ranks (d, e) are the t = 0 rows (the table is in mesh index order, t fastest).
    plan = plan_from_table(full[:: mesh.size("t")].contiguous(), config, mesh)
    if plan.capacity is not None:
        # routing is dropless: row_pair already holds every pair grouped by expert, token order within
        row_pair, kept_here = keep_first(routing.row_pair, routing.top_idx.reshape(-1)[routing.row_pair],
                                         routing.selected_per_expert, plan.kept[plan.rank])
        routing = dataclasses.replace(routing, row_pair=row_pair, kept_per_expert=kept_here)
    return plan, routing


CORRECTION_BIAS_CHECK = ("correction_bias (checksum of the buffer; update it on every rank from the same global "
                         "load, MoE.update_correction_bias)")


def plan_from_table(table: torch.Tensor, config, mesh) -> DispatchPlan:
    """The plan of the token-parallel ranks' rows [R, 4 + E] of the counts exchange (tokens, two
    checksums, sequences, selections per expert), on this rank of `mesh`: no communication, so the
    backward rebuilds the forward's plan from the saved table."""
    tokens, sequences, selected = table[:, 0], table[:, 3], table[:, 4:]
    rank = mesh.coord(("d", "e"))
    capacity = config.capacity(int(tokens.sum()))
    if capacity is None:
        kept = selected
    else:
        earlier = torch.cumsum(selected, 0) - selected
        kept = torch.minimum(selected, (capacity - earlier).clamp(min=0))
    ep, peer = mesh.size("e"), mesh.coord("e")
    local = config.num_experts // ep
    slice_rows = kept[rank - peer : rank - peer + ep]  # the token ranks of this d slice, in e order
    per_peer = slice_rows.view(ep, ep, local).sum(-1)  # [source, destination block]
    return DispatchPlan(table, tokens, sequences, selected, kept, capacity, rank, peer, local, per_peer.tolist(),
                        slice_rows[:, peer * local : (peer + 1) * local])


def peer_tokens(routing: Routing, plan: DispatchPlan) -> int:
    """Distinct (token, peer) pairs among this rank's kept rows bound for other peers: the rows a
    dispatch must move at least (a token going to two experts of one peer needs to travel once)."""
    k = routing.top_idx.shape[1]
    tokens = routing.row_pair // k
    peers = routing.top_idx.reshape(-1)[routing.row_pair] // plan.local_experts
    away = peers != plan.peer
    return int(torch.unique(tokens[away] * len(plan.counts) + peers[away]).numel())

