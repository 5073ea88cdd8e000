"""ExpertParallel: the expert-parallel dispatcher of the MoE Function, over a dp x ep x tp mesh.

The layer's one autograd Function (shardmoe/moe/function.py) routes, calls this dispatcher to
move rows between ranks and run the local experts, and does the shared expert, the losses and
stage 6 itself; this module holds what is particular to the mesh.

Each token-parallel rank (d, e) routes its own S tokens; experts are split over 'e' in
contiguous blocks; ranks along 't' hold the same tokens and one slice of every expert's
intermediate dim (expert_tensor). Forward, on rank (d, e, t):

  route          x 'S H' -> dropless top-k routing, locally                     (routing.route)
  plan           all-gather counts over (d, e): global capacity, splits          (dispatch)
  dispatch       rows xs = x[token of each kept pair] 'N_send H', grouped by destination peer,
                 to the peers along 'e' -> 'N_recv H' (P2P or remote path)      (exchange)
  experts        the layer's expert math on the local experts' rows, psum over 't'
  combine        rows y back along 'e' (reverse splits) -> out_t = sum_j w_tj y_j(x_t)
  shared expert  on this rank's own tokens (dense: no exchange), its intermediate dim split over 't'
                 like the routed experts': z psummed over 't', s z added to the combine (shared_experts)
  aux loss       this rank's share of the global aux + z + sequence-wise loss (global counts of
                 selections, tokens and sequences; a sequence lies on one rank)

Backward, the six stages with the exchanges in between:
  token side     g rows and their weights w go to the experts         (dispatch, reverse of combine)
  expert side    stage 1 grad_combine, 2 grad_gate_combine, 3 grad_post_gemm, 4 grad_pre_gemm;
                 psum over 't' of the input gradient (and of the glu gate dots)
  token side     dx rows and gate dots dw come back                   (combine, reverse of dispatch)
                 stage 5 grad_input_combine, stage 6 grad_gate_gemm
  shared expert  stages 3, 2, 4 on this rank's tokens; psum over 't' of its dx (and of its gate dot
                 g . z, before the gate's sigmoid Jacobian); dx added to stage 5's

Results: the outputs and input gradients are the single-process layer's on the concatenation of
all token-parallel ranks' tokens; gate_weight.grad is the gradient of this rank's share of the
loss (its tokens' outputs and its share of the aux loss); expert shard gradients cover the tokens
of this rank's d slice. sync_grads completes both. Every rank of the mesh must run the forward and
the backward of every layer, in the same order (they exchange rows with each other).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import time

import torch

from shardmoe.parallel import shardops
from shardmoe.moe.activations import activate
from shardmoe.moe.config import MoEConfig
from shardmoe.moe.dispatch import LOCAL
from shardmoe.moe.placement import whole_entry
from shardmoe.moe.routing import Routing
from shardmoe.notation import MESH_AXES
from shardmoe.parallel import consistency
from shardmoe.parallel import expert_tensor as etp
from shardmoe.parallel.dispatch import DispatchPlan, peer_tokens, plan_dispatch, plan_from_table
from shardmoe.parallel.exchange import RowExchange, pack_rows, select_rows, shared_exchange, unpack_rows
from shardmoe.rows import Groups

PHASES = ("route", "dispatch", "experts", "combine")


class ExpertParallel:
    """The expert-parallel dispatcher (moe/dispatch.py's protocol) of one layer: config, mesh and
    the exchange along 'e'. Its state for one forward is an _Step (the plan, the order of the
    received rows, the phase clock)."""

    def __init__(self, config: MoEConfig, mesh):
        etp.check_layout(config, mesh)
        self.config, self.mesh = config, mesh
        self.exchange = shared_exchange(mesh, "e")
        # the layer's name in the handshakes, the same on every rank that builds the same model
        self.number = consistency.layer_number(mesh)
        self.forwards = 0  # forwards run: the settings and replicas are compared at the first and every
        # consistency.REPLICA_CHECK_EVERY-th after
        self.seconds = dict.fromkeys(PHASES, 0.0)  # the last forward's phase times (forward and backward)

    def guard(self):
        return self.exchange.tell_peers_on_failure()

    @contextlib.contextmanager
    def timed(self, step: "_Step", phase: str):
        yield
        step.clock.lap(phase)

    def prepare(self, config: MoEConfig, x: torch.Tensor, router_tensors: tuple, shared: dict) -> None:
        """The handshake of the forward's collectives (naming this layer), then, at the first forward
        and every consistency.REPLICA_CHECK_EVERY-th after, the agreement check."""
        consistency.handshake(self.mesh, "forward", [self.number])
        if self.forwards % consistency.REPLICA_CHECK_EVERY == 0:
            gate_weight, gate_bias, correction_bias, _ = router_tensors
            self.check_agreement(x.dtype, gate_weight, gate_bias, correction_bias, shared)
        self.forwards += 1

    def check_agreement(self, dtype: torch.dtype, gate_weight: torch.Tensor, gate_bias=None,
                        correction_bias=None, shared: dict | None = None) -> None:
        """Before the first forward (and at intervals): one fixed-size all-gather of the settings and the checksums of
        the replicated router tensors (gate_weight, gate_bias, correction_bias) over the mesh, and of
        the shared expert's tensors (`shared`: name -> this rank's slice, the same along 'd', 'e');
        RankMismatchError on every rank when they differ. (Each forward's counts row carries the
        settings again, but has E + 2 words: ranks that disagree on E could not share it.)"""
        settings = consistency.layer_settings(self.config, self.mesh, dtype)
        replicas = [(n, t, MESH_AXES) for n, t in (("gate_weight", gate_weight), ("gate_bias", gate_bias),
                                                   ("correction_bias", correction_bias)) if t is not None]
        replicas += [(n, t, ("d", "e")) for n, t in (shared or {}).items()]  # sliced over 't'
        sums = torch.tensor([consistency.checksum(t) for _, t, _ in replicas])
        row = torch.cat([consistency.settings_words(settings), sums])
        table = consistency.gather_table(row.to(gate_weight.device), self.mesh, "MoE layer agreement check")
        consistency.check_settings(table[:, : -len(replicas)], list(settings), "MoE layer settings", self.mesh)
        consistency.check_replicas([(n, axes) for n, _, axes in replicas], table[:, -len(replicas):], self.mesh,
                                   "MoE layer")

    def route(self, router, x, router_tensors):
        """Dropless local routing, then the global plan (which applies the global capacity). The
        phase clock starts here; the backward of this forward adds its time to the same seconds
        (the last forward's, when several forwards run before their backwards)."""
        self.seconds = dict.fromkeys(PHASES, 0.0)
        clock = _Clock(self.seconds)
        routing = router.route(x, router_tensors, dropless=True)
        plan, routing = plan_dispatch(x, routing, self.config, self.mesh, correction_bias=router_tensors[2])
        clock.lap("route")
        return routing, _Step(plan, plan.expert_major_order(), clock)

    def restore(self, config, dispatched):
        """The forward's state from what it saved, after the handshake of the backward's collectives:
        the plan from the counts table (no communication), the received rows' order, a clock for the
        backward's phases."""
        consistency.handshake(self.mesh, "backward", [self.number])
        table, order = dispatched[:2]
        return _Step(plan_from_table(table, config, self.mesh), order, _Clock(self.seconds))

    def forward(self, ops, config, x, routing, step, params):
        """Dispatch the rows along 'e', the local experts' forward (psums over 't'), the rows back,
        combine. Keeps (order, xs, *expert saved) for backward."""
        plan, order, clock = step.plan, step.order, step.clock
        row_token, weight_rows = routing.rows(config.top_k)
        (xs,) = _to_experts(self.exchange, plan, order, x.index_select(0, row_token))
        clock.lap("dispatch")
        groups = Groups.from_counts(plan.rows_per_local_expert)
        y, saved = _experts_forward(ops, config, self.mesh, xs, params, groups)
        clock.lap("experts")
        (y_send,) = _to_tokens(self.exchange, plan, order, y)
        out = ops.combine(y_send, weight_rows, routing.row_pair, x.shape[0], config.top_k)
        clock.lap("combine")
        return out, (plan.table, order, xs, *saved)

    def backward(self, ops, config, grad_out, x, routing, step, dispatched, params):
        """The unscaled output gradient rows and their combine weights go to the experts (the glu
        expert applies w after its Wdown GEMM so that stage 2 can reuse that GEMM), stages 1-4 run
        there, dx rows and the gate dots come back, stage 5 sums dx per token."""
        plan, clock = step.plan, step.clock
        _, order, xs, *expert_saved = dispatched
        row_token, weight_rows = routing.rows(config.top_k)
        grad_rows, weight_recv = _to_experts(self.exchange, plan, order, grad_out.index_select(0, row_token),
                                             weight_rows)
        clock.lap("dispatch")
        groups = Groups.from_counts(plan.rows_per_local_expert)
        grad_xs, grad_dots, grads = _experts_backward(ops, config, self.mesh, grad_rows, weight_recv, xs,
                                                      tuple(expert_saved), params, groups)
        clock.lap("experts")
        grad_xs, grad_dots = _to_tokens(self.exchange, plan, order, grad_xs, grad_dots)
        grad_x = ops.grad_input_combine(grad_xs, routing.row_pair, x.shape[0], config.top_k)
        clock.lap("combine")
        return grad_x, grad_dots, grads

    def fake_forward(self, config, x, routing):
        raise NotImplementedError("torch.compile of an expert-parallel MoE layer (a mesh of more than one rank) is not "
                                  "supported yet: compile the model around it, or run the layer eagerly")

    def loss_scope(self, routing, step):
        return global_counts(routing, step.plan), step.plan.global_tokens, step.plan.global_sequences

    def stats(self, config, routing, step, num_tokens):
        return {**step.plan.stats(), "rank_selected_per_expert": routing.selected_per_expert,
                "rows": _row_stats(routing, step.plan, self.exchange), "seconds": step.clock.seconds}

    def reduce_shared(self, what):
        """Wsd contracts Fs/t: the shared expert's z, dx and gate dot are psummed over 't' like the
        routed rows (separate all-reduces of [S, H] and [S])."""
        if what == "output":
            return _psum_t("N H", etp.reduce_expert_output, self.mesh)
        if what == "input":
            return _psum_t("N H", etp.reduce_input_grad, self.mesh)
        return _psum_t("N", etp.reduce_gate_dot, self.mesh)


class MeshPlacement:
    """A layer's placement on a mesh (moe/placement.py's Placement): experts split over 'e' in
    contiguous blocks and their intermediate dim over 't' (expert_tensor), the expert-parallel
    dispatcher when the mesh has more than one rank. Refuses a layout the mesh cannot split, before
    any communication."""

    def __init__(self, config: MoEConfig, mesh):
        etp.check_layout(config, mesh)
        self.config, self.mesh, self.sharded = config, mesh, etp.is_sharded(mesh)
        self.dispatcher = ExpertParallel(config, mesh) if mesh.size() > 1 else LOCAL

    def __deepcopy__(self, memo) -> "MeshPlacement":
        """The placement of a copied layer (copy.deepcopy, torch.optim.swa_utils.AveragedModel): on the
        same mesh, sharing its process groups and exchange, with a dispatcher of its own (the copy's
        layer number and forward count)."""
        return MeshPlacement(copy.deepcopy(self.config, memo), self.mesh)

    def shard_shape(self, name, shape):
        return etp.shard_shape(name, shape, self.mesh)

    def layout(self, name):
        if self.mesh.parameter_mesh is None:
            return None
        return self.mesh.parameter_mesh, etp.parameter_placements(name, self.mesh)

    def parameter(self, name, local, shape):
        """A DTensor on mesh.parameter_mesh (expert_tensor.parameter_placements) when 'e' or 't'
        splits parameters, so that every tool that walks the parameters (optimizers and their
        distributed checkpoints, clip_grad_norm_, FSDP2) sees the whole tensor; else local."""
        if self.layout(name) is None:
            return local
        from torch.distributed.tensor import DTensor

        device_mesh, placements = self.layout(name)
        return DTensor.from_local(local, device_mesh, placements, run_check=False, shape=shape,
                                  stride=torch.empty(shape, device="meta").stride())

    def compute_view(self, name, param, summed_over_e):
        if self.mesh.parameter_mesh is None:
            return param
        return param.to_local(grad_placements=etp.gradient_placements(name, self.mesh, summed_over_e))

    def shard(self, name, whole):
        return etp.shard_expert_param(name, whole, self.mesh)

    def gather(self, name, local):
        if etp.is_sharded(self.mesh):
            consistency.handshake(self.mesh, "gather", [self.dispatcher.number])
        return etp.gather_expert_param(name, local, self.mesh)

    def state_entry(self, name, local):
        return etp.state_entry(name, local, self.mesh)

    def load_entry(self, key, name, value, shape):
        """A DTensor of state_entry's layout gives its local shard as it is (no communication);
        any other whole tensor is cut to this rank's shard (whole_entry)."""
        own = etp.own_state_entry(name, value, shape, self.mesh)
        return own if own is not None else self.shard(name, whole_entry(key, name, value, shape))


@dataclasses.dataclass
class _Step:
    """One forward's dispatch state: the plan, the expert-major order of the received rows, and the
    clock that accumulates each phase's wall time into stats['seconds'] (forward and backward)."""

    plan: DispatchPlan
    order: torch.Tensor
    clock: "_Clock"


class _Clock:
    """Wall time per phase, accumulated into stats['seconds'] (forward and backward together)."""

    def __init__(self, seconds: dict):
        self.seconds, self.last = seconds, time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] += now - self.last
        self.last = now


def global_counts(routing: Routing, plan: DispatchPlan) -> Routing:
    """This rank's routing with the batch's selection counts C_e, so that balance_loss and
    grad_gate_gemm with num_tokens=S_g give this rank's share of the global losses,
        aux = coef E sum_e (C_e / S_g) (sum_t p_te) / S_g,   z = zcoef sum_t lse_t^2 / S_g,
    summed over its tokens t; the shares sum, over the token-parallel ranks, to the
    single-process loss of the concatenation."""
    return dataclasses.replace(routing, selected_per_expert=plan.selected.sum(0))


def _psum_t(spec: str, reduce, mesh):
    """The sum over 't' of a partial tensor 'spec' (the shared expert contracts Fs/t), by `reduce`
    (one of expert_tensor's reductions)."""
    return lambda t: reduce(shardops.unreduced(spec, t, "t"), mesh)


def _experts_forward(ops, config: MoEConfig, mesh, xs, params, groups):
    """y 'N H' (whole over 't') for rows xs of the local experts, and what backward keeps:
    "glu": (h,) with h 'N 2F/t'; "mlp": (z1, z2) with z1 'N P/t' and z2 'N H' (whole)."""
    kind = config.kind
    if mesh.size("t") == 1:
        y, saved = ops.expert_forward(kind, config.expert_activation, config.output_activation, xs, params,
                                          groups)
        return etp.reduce_expert_output(shardops.unreduced("N H", y, "t"), mesh), saved  # Wdown contracts F/t
    # The down bias (whole on every t rank) and act_out need the whole z2: run the GEMMs without
    # the bias, psum, then add the bias once and apply act_out.
    z2_partial, saved = ops.expert_forward(kind, config.expert_activation, "identity", xs,
                                               {**params, kind.down_bias: None}, groups)
    z2 = etp.reduce_expert_output(shardops.unreduced("N H", z2_partial, "t"), mesh)
    if params.get(kind.down_bias) is not None:
        z2 = z2 + params[kind.down_bias][groups.row_expert(z2.device)]
    return activate(config.output_activation, z2), kind.saved(saved[0], z2)


def _experts_backward(ops, config: MoEConfig, mesh, grad_rows, weight_rows, xs, saved, params, groups):
    """Stages 1-4 on the expert side: (dx rows 'N H', gate dots dw 'N', expert shard gradients).
    With F split over 't' the input-gradient rows are partial sums, and so are the glu dots (taken
    over F, kind.partial_gate_dot); the glu dot's bias term g . bdown is whole on every t rank, so
    it is added once, after the psum (dbdown = sum ge needs no reduce: ge is the same on every t
    rank)."""
    kind = config.kind
    once = kind.partial_gate_dot and mesh.size("t") > 1 and params.get(kind.down_bias) is not None
    grad_xs, grad_dots, grads = ops.expert_backward(kind, config.expert_activation, config.output_activation,
                                                        grad_rows, weight_rows, xs, saved,
                                                        {**params, kind.down_bias: None} if once else params, groups)
    if kind.partial_gate_dot:
        grad_dots = etp.reduce_gate_dot(shardops.unreduced("N", grad_dots, "t"), mesh)
    if once:
        row_bias = params[kind.down_bias][groups.row_expert(grad_rows.device)]
        grad_dots = grad_dots + ops.grad_gate_combine(grad_rows, row_bias)
    return etp.reduce_input_grad(shardops.unreduced("N H", grad_xs, "t"), mesh), grad_dots, grads


def _to_experts(exchange: RowExchange, plan: DispatchPlan, order: torch.Tensor, *rows: torch.Tensor):
    """Token side -> experts: per-row tensors grouped by destination peer -> the local experts'
    rows, expert-major (one exchange of the packed rows, one gather of the received bytes)."""
    data, layout = pack_rows(*rows)
    return unpack_rows(select_rows(exchange.exchange(data, plan.counts), order), layout)


def _to_tokens(exchange: RowExchange, plan: DispatchPlan, order: torch.Tensor, *rows: torch.Tensor):
    """Experts -> token side, the reverse of _to_experts: expert-major rows back to source-major
    order, then along the transposed splits to the ranks that sent them."""
    data, layout = pack_rows(*rows)
    source_major = select_rows(data, _inverse(order))
    return unpack_rows(exchange.exchange(source_major, _transposed(plan.counts)), layout)


def _inverse(order: torch.Tensor) -> torch.Tensor:
    """The permutation p with p[order] = arange: rows[order][p] == rows."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return inverse


def _transposed(counts: list[list[int]]) -> list[list[int]]:
    return [list(column) for column in zip(*counts)]


def _row_stats(routing: Routing, plan: DispatchPlan, exchange: RowExchange) -> dict:
    """Rows this rank dispatches per path, and the distinct (token, peer) pairs the routing needs."""
    rows = {"self": 0, "p2p": 0, "remote": 0}
    for dest, count in enumerate(plan.counts[plan.peer]):
        rows[exchange.path(plan.peer, dest, routing.top_idx.device.type)] += count
    rows["min_to_peers"] = peer_tokens(routing, plan)
    rows["received"] = sum(row[plan.peer] for row in plan.counts)
    return rows
