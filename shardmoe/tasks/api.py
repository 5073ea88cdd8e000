"""run_forward / run_backward: one MoE layer's pass as tile tasks on simulated devices.

    fwd = run_forward(layer, x, peers=4, ranks_per_node=2)          # fwd.output == layer(x)
    bwd = run_backward(layer, x, grad_out, forward=fwd)             # == the layer's explicit backward
    bwd.grad_input, bwd.grads["w1"], bwd.counts["gradPreGEMM"], bwd.trace.save_png("b.png")

Routing is the layer's own (shardmoe.moe.routing.route, capacity included), so the runtime
reproduces the single-process layer; x [..., H] is flattened to S tokens as the layer does.
A shared expert (shared_ffn_size > 0) is dense and routes nothing, so it runs beside the schedule,
on the same stage functions as the MoE layer (shardmoe/moe/shared_experts.py): its output is
added to the tasks' combined output, its input gradient to theirs, both before the one rounding.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from shardmoe.moe import shared_experts as shared_ex
from shardmoe.moe.experts import TORCH_OPS
from shardmoe.moe.reference import parameter_shapes
from shardmoe.moe.routing import Routing, balance_loss, route
from shardmoe.tasks.emitters import Emitters
from shardmoe.tasks.kernels import KernelContext
from shardmoe.tasks.memory import Memory
from shardmoe.tasks.plan import GATE_DEPENDENCIES, Plan, Ref, TaskType, backward_task_counts, forward_task_counts
from shardmoe.tasks.protocol import BackwardProtocol, ForwardProtocol
from shardmoe.tasks.queues import ScheduleError
from shardmoe.tasks.runtime import Ledger, build_queues, run_schedule
from shardmoe.tasks.schedulers import make_scheduler
from shardmoe.tasks.trace import Trace


@dataclass
class ForwardResult:
    """output [x.shape]; aux_loss (weighted aux + z loss); counts: task type -> number run;
    shared_saved: what the shared expert's backward keeps (empty without one)."""

    output: torch.Tensor
    aux_loss: torch.Tensor
    counts: dict[str, int]
    trace: Trace
    plan: Plan
    memory: Memory
    shared_saved: tuple = ()


@dataclass
class BackwardResult:
    """grad_input [x.shape]; grads: parameter name -> gradient (the layer's names and shapes)."""

    grad_input: torch.Tensor
    grads: dict[str, torch.Tensor]
    counts: dict[str, int]
    trace: Trace
    forward: ForwardResult


def _params(layer, shared: bool = False) -> dict[str, torch.Tensor | None]:
    """The layer's parameters (the router's and routed experts', or with `shared` the shared
    expert's), detached; they must be whole (the runtime splits the experts over its simulated
    devices itself, so a layer holding one rank's shard is refused)."""
    c = layer.config
    whole = parameter_shapes(c)
    params = {}
    names = c.shared_param_names if shared else ("gate_weight", "gate_bias", *c.expert_param_names)
    for name in names:
        p = getattr(layer, name)
        if p is not None and tuple(p.shape) != whole[name]:
            raise ValueError(f"layer.{name}: expected the whole parameter {list(whole[name])}, got {list(p.shape)} "
                             "(a sharded layer; the task runtime simulates the devices itself)")
        params[name] = None if p is None else p.detach()
    return params


def _counted(ledger: Ledger) -> dict[str, int]:
    """Task type -> number written (and, the ledger has checked, run once), in TaskType order."""
    kinds = [str(task.type) for task in ledger.tasks]
    return {str(kind): kinds.count(str(kind)) for kind in TaskType if str(kind) in kinds}


def _check_counts(got: dict[str, int], want: dict, name: str) -> None:
    for kind, number in want.items():
        if got.get(str(kind), 0) != number:
            raise ScheduleError(f"{name}: {got.get(str(kind), 0)} {kind} tasks ran, the closed form gives {number}")


def run_forward(layer, x: torch.Tensor, *, peers: int = 1, ranks_per_node: int | None = None, processors: int = 4,
                scheduler: str = "random", seed: int = 0, block_m: int = 8, block_n: int = 8) -> ForwardResult:
    """The layer's forward as tile tasks: preGEMM, postGEMM, combine."""
    config = layer.config
    xf = x.detach().reshape(-1, config.hidden_size)
    gate_bias = None if layer.gate_bias is None else layer.gate_bias.detach()
    routing: Routing = route(xf, layer.gate_weight.detach(), config, gate_bias, layer.correction_bias,
                             layer.token_sequence(x, None))
    plan = Plan(config, routing, xf.shape[0], peers=peers, ranks_per_node=ranks_per_node,
                block_m=block_m, block_n=block_n)
    ledger, memory = Ledger(), Memory()
    queues = build_queues(plan, False, ledger)
    protocol = ForwardProtocol(plan, memory, Emitters(plan, queues))
    trace = run_schedule(plan, queues, ledger, protocol, KernelContext(plan, memory, _params(layer)),
                         make_scheduler(scheduler, seed), processors, "forward", lambda: protocol.start(xf))
    counts = _counted(ledger)
    _check_counts(counts, forward_task_counts(plan), "forward")
    output = torch.cat([memory[Ref(d, "out")] for d in range(plan.peers)])
    shared_saved = ()
    if config.shared_ffn_size:
        shared_out, shared_saved = shared_ex.forward(TORCH_OPS, xf, _params(layer, shared=True), config)
        output = output + shared_out
    output = output.to(x.dtype).view(x.shape)
    return ForwardResult(output, balance_loss(routing, config), counts, trace, plan, memory, shared_saved)


def run_backward(layer, x: torch.Tensor, grad_out: torch.Tensor, *, peers: int = 1, ranks_per_node: int | None = None,
                 processors: int = 4, scheduler: str = "random", seed: int = 0, block_m: int = 8, block_n: int = 8,
                 grad_loss: float | torch.Tensor | None = 1.0, gate_dependency: str = "token",
                 final_gate_combine: bool = False, forward: ForwardResult | None = None) -> BackwardResult:
    """The layer's backward as tile tasks; gradients equal the MoE layer's.

    grad_loss: dL/d(layer.aux_loss). 1.0 (default) is the training objective
    (out * grad_out).sum() + layer.aux_loss; pass 0.0 or None for (out * grad_out).sum() alone.
    gate_dependency: "token" (exact: gradGateGEMM waits for every kept pair of its tokens) or
    "row_tile" (FlashMoE's per-row-tile threshold; racy for top_k > 1, kept to demonstrate it).
    final_gate_combine: also emit gradGateCombine from the final decoders (FlashMoE's backward forbids it;
    the counters then raise ScheduleError).
    forward: a run_forward result for the same layer and x, whose saved activations are reused;
    its plan must have been made with the same peers, ranks_per_node, block_m and block_n.
    """
    if gate_dependency not in GATE_DEPENDENCIES:
        raise ValueError(f"gate_dependency: expected one of {', '.join(GATE_DEPENDENCIES)}, got {gate_dependency!r}")
    config = layer.config
    if forward is None:
        forward = run_forward(layer, x, peers=peers, ranks_per_node=ranks_per_node, processors=processors,
                              scheduler=scheduler, seed=seed, block_m=block_m, block_n=block_n)
    plan = forward.plan
    asked = dict(peers=peers, ranks_per_node=ranks_per_node or peers, block_m=block_m, block_n=block_n)
    for name, value in asked.items():
        if getattr(plan, name) != value:
            raise ValueError(f"{name}: the forward result was planned with {getattr(plan, name)}, got {value}")
    xf = x.detach().reshape(-1, config.hidden_size)
    gf = grad_out.detach().reshape(-1, config.hidden_size).contiguous()
    if gf.shape != xf.shape:
        raise ValueError(f"grad_out: expected shape {list(x.shape)} (x's), got {list(grad_out.shape)}")
    params = _params(layer)
    acc = plan.routing.probs.dtype
    grad_loss_t = None if grad_loss is None else torch.as_tensor(grad_loss, dtype=acc)
    ledger, memory = Ledger(), Memory()
    queues = build_queues(plan, True, ledger, gate_dependency)
    emitters = Emitters(plan, queues, gate_dependency, final_gate_combine)
    protocol = BackwardProtocol(plan, memory, emitters, gate_dependency)
    expert_shapes = {n: tuple(p.shape[1:]) for n, p in params.items()
                     if n not in ("gate_weight", "gate_bias") and p is not None}
    trace = run_schedule(plan, queues, ledger, protocol, KernelContext(plan, memory, params, grad_loss_t),
                         make_scheduler(scheduler, seed), processors, "backward",
                         lambda: protocol.start(xf, gf, forward.memory, expert_shapes))
    counts = _counted(ledger)
    _check_counts(counts, backward_task_counts(plan, gate_dependency, final_gate_combine), "backward")
    devices = range(plan.peers)
    grad_input = torch.cat([memory[Ref(d, "grad_x")] for d in devices])
    shared_grads = {}
    if config.shared_ffn_size:
        grad_x_shared, shared_grads = shared_ex.backward(TORCH_OPS, gf, xf, forward.shared_saved,
                                                         _params(layer, shared=True),
                                                         config)
        grad_input = grad_input + grad_x_shared
    grad_input = grad_input.to(x.dtype).view(x.shape)
    grads = {"gate_weight": sum(memory[Ref(d, "gate_weight_grad")] for d in devices).to(params["gate_weight"].dtype)}
    if params["gate_bias"] is not None:
        grads["gate_bias"] = sum(memory[Ref(d, "gate_bias_grad")] for d in devices).to(params["gate_bias"].dtype)
    for name, shape in expert_shapes.items():
        grads[name] = torch.cat([memory[Ref(d, "expert_grad", name)] for d in devices]).to(params[name].dtype)
    grads.update(shared_grads)
    return BackwardResult(grad_input, grads, counts, trace, forward)
