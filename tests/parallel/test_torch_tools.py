"""PyTorch's own tools on a sharded MoE layer, whose parameters are DTensors of the whole tensors.

One spawned 4-rank gloo world, float64, a layer with every kind of parameter (biased glu experts,
router bias, gated shared expert) and every balance loss, against one process on the whole batch:

  optimizer checkpoints  torch.optim.AdamW, then get_state_dict(model, optimizer) -> dcp.save ->
                         dcp.load -> set_state_dict into a model seeded otherwise: every moment
                         (exp_avg, exp_avg_sq) and step of every parameter equals the saved one,
                         at the same layout (FSDP2 dp2 x ep2; Mesh(dp=2, ep=2) with sync_grads)
                         and across layouts (dp2 x ep2 -> ep4 -> one process). Plain local
                         shards had saved one rank's moments under the whole tensor's key.
  clipping               torch.nn.utils.clip_grad_norm_ on the FSDP-only-MoE model and after
                         sync_grads: the one process's norm on every rank, and after the clipped
                         AdamW step the one process's parameters, the router's replicas equal
                         (each 'ep' group had clipped by its own norm, and the replicas drifted).
  transformer            the sharded transformer, dense parameters DTensors too, built on the meta
                         device (to_empty, reset_parameters, .double(): sync_grads had refused its
                         dense parameters after them, and after load_state_dict(assign=True)):
                         torch's AdamW state round-trips through get_state_dict and DCP; shardmoe's
                         clip_grad_norm_ equals the model's own global norm.
  drift                  replicas made to drift (one rank's router nudged) are caught within the
                         check interval: sync_grads' check_every, the forward's REPLICA_CHECK_EVERY.
  tensor parallel        ep2 x tp2: torch's clipping and AdamW as one process; DCP refuses the
                         optimizer's gate_up_proj moments by key (two blocks per rank).
  calls                  one rank in sync_grads while the others run the next forward: the same
                         RankMismatchError on every rank, naming both calls and their ranks.
  plain beside           an nn.Linear before the layer, its parameters made DTensors by
                         replicate_plain_parameters: torch's clip_grad_norm_ (foreach on and off)
                         and AdamW (foreach on and off) on dp2 x ep2 and ep2 x tp2 as one process
                         (torch refused the mix: "mixed torch.Tensor and DTensor"); a plain state
                         dict loads; a raising forward leaves the parameters in place; a layer
                         under fully_shard and a gradient already there are refused.
  partial gradients      ep2 x tp2: shardmoe's clip_grad_norm_ before sync_grads (the router's and
                         the Linear's gradients Partial over 'ep') gives the one-process norm;
                         sync_grads leaves no gradient Partial; a second sync_grads with no backward
                         in between is refused on every rank (it summed again) and changes nothing.
  copies                 copy.deepcopy and AveragedModel of a model on dp2 x ep2 and ep2 x tp2 (it
                         raised "cannot pickle ProcessGroup"): the same mesh, the original's forward
                         bit for bit, gradients of its own, update_parameters averaging.
  assign                 load_state_dict(assign=True): the loaded model trains as the one it came
                         from (its forward blamed fully_shard, never called); with a replicated
                         plain Linear beside the layer too, its source moved by .double() (sync_grads
                         refused both as FSDP's).
"""
import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import shardmoe
from shardmoe.mesh import Mesh
from shardmoe.moe.composition import local
from shardmoe.parallel import consistency, sync_grads
from shardmoe.testing import run_distributed

H, F, E, K = 8, 12, 8, 2
TOKENS = 6  # per token-parallel rank
OPTIONS = dict(aux_loss_coef=0.05, z_loss_coef=0.01, router_bias=True, bias=True, shared_ffn_size=6,
               shared_gate=True, dtype=torch.float64)
TOL = 1e-10
MAX_NORM = 0.05  # below every norm here: the clip scales


class Model(torch.nn.Module):
    """The layer under a name, as a user's model holds it (state-dict keys 'moe.*')."""

    def __init__(self, mesh, seed: int):
        super().__init__()
        torch.manual_seed(seed)  # every rank and the one process draw the same whole tensors
        self.moe = shardmoe.MoE(H, F, E, K, mesh=mesh, **OPTIONS)

    def forward(self, x):
        return self.moe(x)


def _batch(shards: int):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(shards * TOKENS, H, generator=gen, dtype=torch.float64)
    return x, torch.randn(x.shape, generator=gen, dtype=torch.float64)


def _whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, torch.distributed.tensor.DTensor) else t).detach().clone()


def _rel(actual, expected) -> float:
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-300)).item()


def _step(model, optimizer, x, g, mean: bool, sync: bool, clip: bool = False) -> float | None:
    """One AdamW step on L = sum(y g) (/ tokens when `mean`: FSDP's convention) + aux; sync_grads
    first when `sync`; torch's clip_grad_norm_ to MAX_NORM when `clip` (its norm returned)."""
    optimizer.zero_grad()
    y = model(x)
    ((y * g).sum() / (x.shape[0] if mean else 1) + model.moe.aux_loss).backward()
    if sync:
        sync_grads(model, model.moe.mesh)
    norm = None
    if clip:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        norm = float(_whole(norm))
    optimizer.step()
    return norm


def _moments(model, optimizer) -> dict:
    """Every parameter's AdamW state, whole: {'<name> exp_avg': ..., '<name> step': ...}."""
    out = {}
    for name, p in model.named_parameters():
        for key, value in optimizer.state[p].items():
            out[f"{name} {key}"] = _whole(value)
    return out


def _differ(a: dict, b: dict) -> list[str]:
    """Keys whose tensors are not bitwise equal (missing keys included)."""
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k]))


def _fsdp_model(job, seed: int):
    from torch.distributed.fsdp import fully_shard

    model = Model(job, seed)
    fully_shard(model.moe, mesh=job["dp"])  # the model's only sharded module is the MoE layer
    return model


def _load(model, optimizer, path: str) -> None:
    """The torchtitan recipe: get_state_dict, dcp.load into it, set_state_dict."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _save(model, optimizer, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)


def _reference(x_all, g_all, mean: bool, clip: bool) -> tuple[Model, torch.optim.Optimizer, list]:
    model = Model(None, 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    norms = [_step(model, optimizer, x_all, g_all, mean, sync=False, clip=clip) for _ in range(2)]
    return model, optimizer, norms


def _checkpoints(tmp: str) -> dict:
    """Rows 'optimizer checkpoints' and 'clipping' of the module docstring."""
    from torch.distributed.device_mesh import init_device_mesh

    out = {}
    job = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    token_rank = Mesh.from_device_mesh(job).coord(("d", "e"))
    x_all, g_all = _batch(4)
    rows = slice(token_rank * TOKENS, (token_rank + 1) * TOKENS)
    for label, mean, build in (("fsdp dp2 x ep2", True, lambda seed: _fsdp_model(job, seed)),
                               ("sync_grads dp2 x ep2", False, lambda seed: Model(Mesh(dp=2, ep=2), seed))):
        model = build(0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        norms = [_step(model, optimizer, x_all[rows], g_all[rows], mean, sync=not mean, clip=True) for _ in range(2)]
        reference, ref_optimizer, ref_norms = _reference(x_all, g_all, mean, clip=True)
        out[label] = {
            "norms": (norms, ref_norms),
            "parameters": {n: _rel(_whole(p), reference.get_parameter(n).detach()) for n, p in model.named_parameters()},
            "moments": {k: _rel(v, w) for k, v, w in
                        ((k, v, _moments(reference, ref_optimizer)[k]) for k, v in _moments(model, optimizer).items())},
            # the router gathered from this rank's replicas, by checksum: equal on every rank unless they drifted
            "router checksums": [consistency.checksum(_whole(model.moe.gate_weight)),
                                 consistency.checksum(_whole(model.moe.gate_bias))],
        }
        path = f"{tmp}/{label.replace(' ', '-')}"
        _save(model, optimizer, path)
        saved = _moments(model, optimizer)
        again = build(7)
        again_optimizer = torch.optim.AdamW(again.parameters(), lr=1e-2)
        _load(again, again_optimizer, path)
        out[label]["same layout"] = _differ(_moments(again, again_optimizer), saved)
        if label.startswith("fsdp"):
            for other, mesh in (("ep4", Mesh(ep=4)), ("one process", None)):
                target = Model(mesh, 7)
                target_optimizer = torch.optim.AdamW(target.parameters(), lr=1e-2)
                _load(target, target_optimizer, path)
                out[label][f"-> {other}"] = _differ(_moments(target, target_optimizer), saved)
                out[label][f"-> {other} parameters"] = _differ(
                    {n: _whole(p) for n, p in target.named_parameters()},
                    {n: _whole(p) for n, p in model.named_parameters()})
    return out


def _tensor_parallel(tmp: str) -> dict:
    """ep2 x tp2 with sync_grads: torch's clipping and AdamW as one process; a distributed checkpoint
    of the optimizer refuses gate_up_proj's moments (two blocks of [E, 2F, H] per rank, one of its
    [E, 2, F, H] view: a DCP chunk is one block), and a full state dict holds them whole."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    mesh = Mesh(ep=2, tp=2)
    x_all, g_all = _batch(2)
    rows = slice(mesh.coord(("d", "e")) * TOKENS, (mesh.coord(("d", "e")) + 1) * TOKENS)
    model = Model(mesh, 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    norms = [_step(model, optimizer, x_all[rows], g_all[rows], mean=False, sync=True, clip=True) for _ in range(2)]
    reference, ref_optimizer, ref_norms = _reference(x_all, g_all, mean=False, clip=True)
    want = _moments(reference, ref_optimizer)
    out = {"norms": (norms, ref_norms),
           "moments": {k: _rel(v, want[k]) for k, v in _moments(model, optimizer).items()}}
    try:
        _save(model, optimizer, f"{tmp}/ep2-tp2")
        out["dcp"] = None
    except BaseException as err:  # DCP's CheckpointException
        out["dcp"] = str(err)
    _, full = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    out["full state dict"] = _rel(full["state"]["moe.gate_up_proj"]["exp_avg"], want["moe.gate_up_proj exp_avg"])
    return out


def _transformer(tmp: str) -> dict:
    """The sharded transformer on dp2 x ep2 trained with torch.optim.AdamW after its sync_grads:
    its dense parameters are DTensors too, so get_state_dict -> DCP -> set_state_dict gives every
    moment back, and shardmoe.parallel.clip_grad_norm_ (torch's refuses parameters on two meshes)
    equals the model's own global norm (train/optim.py)."""
    from shardmoe.model.transformer import Transformer, TransformerConfig
    from shardmoe.moe.config import MoEConfig
    from shardmoe.train.optim import global_grad_norm

    config = TransformerConfig(vocab_size=64, d_model=16, n_layers=2, n_q_heads=4, n_kv_heads=2, head_dim=4,
                               moe=MoEConfig(16, 8, 4, 2, aux_loss_coef=0.01))
    mesh = Mesh(dp=2, ep=2)
    gen = torch.Generator().manual_seed(mesh.coord(("d", "e")))
    ids = torch.randint(0, 64, (2, 8), generator=gen)
    starts = torch.zeros(2, 8, dtype=torch.bool)
    starts[:, 0] = True
    out = {}

    def build(seed, device=None):
        model = Transformer(config, mesh=mesh, dtype=torch.float64, seed=seed, device=device)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)

    # the meta-device idiom, then .double(): each swaps the DTensor parameters' contents (their
    # grad-sync marks with them), after which sync_grads refused the dense ones as FSDP's
    model = Transformer(config, mesh=mesh, dtype=torch.float64, device="meta")
    model.to_empty(device="cpu")
    model.reset_parameters()
    model.double()
    out["meta equals eager"] = _differ({n: _whole(p) for n, p in model.named_parameters()},
                                       {n: _whole(p) for n, p in build(0)[0].named_parameters()})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    for _ in range(2):
        optimizer.zero_grad()
        model(ids, starts, ids.roll(-1, 1)).total.backward()
        try:
            model.sync_grads()
        except ValueError as err:  # the world lives on: the parent's assertion names it
            out["error"] = str(err)
            return out
        own = global_grad_norm([(p.grad, model.replicas(n)) for n, p in model.named_parameters()])
        out["norms"] = (shardmoe.parallel.clip_grad_norm_(model, 1e9), own)
        optimizer.step()
    # assign=True puts the state dict's tensors in place (new Parameters: sync_grads had refused the
    # dense ones as FSDP's); the twin's step equals the model's
    twin = Transformer(config, mesh=mesh, dtype=torch.float64, seed=9)
    twin.load_state_dict(model.state_dict(), assign=True)
    steps = []
    for m in (model, twin):
        m.zero_grad()
        loss = m(ids, starts, ids.roll(-1, 1)).total
        loss.backward()
        try:
            m.sync_grads()
        except ValueError as err:
            out["error"] = str(err)
            return out
        steps.append((float(loss), {n: _whole(p.grad) for n, p in m.named_parameters()}))
    out["assigned"] = (steps[0][0] == steps[1][0], _differ(steps[0][1], steps[1][1]))
    _save(model, optimizer, f"{tmp}/transformer")
    saved = _moments(model, optimizer)
    again, again_optimizer = build(5)
    _load(again, again_optimizer, f"{tmp}/transformer")
    out["same layout"] = _differ(_moments(again, again_optimizer), saved)
    out["dense DTensors"] = sorted({type(p).__name__ for n, p in model.named_parameters() if ".moe." not in n})
    return out


def _drift() -> dict:
    """Rank 3 nudges its router replica; the next check names it, whichever comes first."""
    out = {}
    mesh = Mesh(dp=2, ep=2)
    x, g = (torch.randn(TOKENS, H, dtype=torch.float64) for _ in range(2))
    model = Model(mesh, 0)
    caught = None
    for call in range(6):
        model.zero_grad()
        (model(x) * g).sum().backward()
        if call == 1 and dist.get_rank() == 3:
            with torch.no_grad():
                local(model.moe.gate_weight)[0, 0] += 1e-3
        try:
            sync_grads(model, mesh, check_every=4)
        except consistency.RankMismatchError as err:
            caught = (call, str(err))
            break
    out["sync_grads"] = caught
    model, caught = Model(mesh, 0), None
    consistency.REPLICA_CHECK_EVERY, every = 3, consistency.REPLICA_CHECK_EVERY
    try:
        for forward in range(6):
            if forward == 1 and dist.get_rank() == 3:
                with torch.no_grad():
                    local(model.moe.gate_weight)[0, 0] += 1e-3
            try:
                model(x).sum().backward()
            except consistency.RankMismatchError as err:
                caught = (forward, str(err))
                break
    finally:
        consistency.REPLICA_CHECK_EVERY = every
    out["forward"] = caught
    return out


def _one_rank_syncs() -> tuple[int, str | None]:
    """After a step, rank 0 alone calls sync_grads; the others run their next forward. Returns the
    layer's number and the message."""
    mesh = Mesh(dp=2, ep=2)
    model = Model(mesh, 0)
    x = torch.randn(TOKENS, H, dtype=torch.float64)
    model(x).sum().backward()
    try:
        if dist.get_rank() == 0:
            sync_grads(model, mesh)
        model(x).sum().backward()
    except consistency.RankMismatchError as err:
        return model.moe.placement.dispatcher.number, str(err)
    return model.moe.placement.dispatcher.number, None


class PlainBeside(torch.nn.Module):
    """A plain nn.Linear before the layer, as a user's model holds one; with a mesh its parameters
    are made DTensors by replicate_plain_parameters."""

    def __init__(self, mesh, seed: int):
        super().__init__()
        torch.manual_seed(seed)  # every rank and the one process draw the same whole tensors
        self.proj = torch.nn.Linear(H, H, dtype=torch.float64)
        self.moe = shardmoe.MoE(H, F, E, K, mesh=mesh, **OPTIONS)
        if mesh is not None:
            shardmoe.parallel.replicate_plain_parameters(self)

    def forward(self, x):
        return self.moe(self.proj(x))


LAYOUTS = {"dp2 x ep2": dict(dp=2, ep=2), "ep2 x tp2": dict(ep=2, tp=2)}


def _rows(mesh) -> slice:
    """This rank's tokens of the batch: its (d, e) coordinate's (the t-peers share them)."""
    return slice(mesh.coord(("d", "e")) * TOKENS, (mesh.coord(("d", "e")) + 1) * TOKENS)


def _plain_beside() -> dict:
    """Row 'plain beside' of the module docstring: two clipped AdamW steps per layout and foreach."""
    out = {}
    for label, layout in LAYOUTS.items():
        mesh = Mesh(**layout)
        x_all, g_all = _batch(mesh.size(("d", "e")))
        for foreach in (True, False):
            results, models = {}, {"mesh": PlainBeside(mesh, 0), "one process": PlainBeside(None, 0)}
            for name, model, x, g in (("mesh", models["mesh"], x_all[_rows(mesh)], g_all[_rows(mesh)]),
                                      ("one process", models["one process"], x_all, g_all)):
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=foreach)
                norms = []
                for _ in range(2):
                    optimizer.zero_grad()
                    ((model(x) * g).sum() + model.moe.aux_loss).backward()
                    if name == "mesh":
                        sync_grads(model, mesh)
                    norms.append(float(_whole(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM,
                                                                              foreach=foreach))))
                    optimizer.step()
                results[name] = (norms, {n: _whole(p) for n, p in model.named_parameters()})
            (norms, params), (ref_norms, ref_params) = results["mesh"], results["one process"]
            out[f"{label}, foreach={foreach}"] = {
                "norms": (norms, ref_norms), "parameters": {n: _rel(params[n], ref_params[n]) for n in ref_params},
                "kinds": sorted({type(p).__name__ for p in PlainBeside(mesh, 0).parameters()})}
        # a forward that raises inside the module leaves its parameter in place, not the local view
        weight = models["mesh"].proj.weight
        try:
            models["mesh"].proj(torch.zeros(2, H + 1, dtype=torch.float64))
        except RuntimeError:
            pass
        out[f"{label}, restored"] = isinstance(weight, DTensor) and models["mesh"].proj.weight is weight
        # the one process's plain state dict (every entry whole) loads into a replicated model
        loaded = PlainBeside(mesh, 7)
        loaded.load_state_dict({n: p.detach() for n, p in models["one process"].state_dict().items()})
        out[f"{label}, loaded"] = _differ({n: _whole(p) for n, p in loaded.named_parameters()}, ref_params)
    return out


def _replicate_refusals() -> dict:
    """replicate_plain_parameters refuses, before changing anything, a model whose layer FSDP2
    manages (its DTensors on FSDP's mesh) and a plain parameter that already has a gradient."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    out = {}
    job = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    layer = shardmoe.MoE(H, F, E, K, mesh=job, **OPTIONS)
    fully_shard(layer, mesh=job["dp"])
    for label, model in (("fsdp", torch.nn.Sequential(torch.nn.Linear(H, H), layer)),
                         ("gradient", torch.nn.Sequential(torch.nn.Linear(H, H),
                                                          shardmoe.MoE(H, F, E, K, mesh=Mesh(ep=4), **OPTIONS)))):
        if label == "gradient":
            model[0].bias.grad = torch.zeros(H)
        try:
            shardmoe.parallel.replicate_plain_parameters(model)
            out[label] = None
        except ValueError as err:
            out[label] = (str(err), sorted({type(p).__name__ for p in model[0].parameters()}))
    return out


def _partial_gradients() -> dict:
    """Row 'partial gradients': ep2 x tp2 (dp = 1, so that sync_grads sums over 'e' only)."""
    mesh = Mesh(ep=2, tp=2)
    x_all, g_all = _batch(2)
    model, reference = PlainBeside(mesh, 0), PlainBeside(None, 0)
    ((model(x_all[_rows(mesh)]) * g_all[_rows(mesh)]).sum() + model.moe.aux_loss).backward()
    ((reference(x_all) * g_all).sum() + reference.moe.aux_loss).backward()
    partial = sorted(n for n, p in model.named_parameters() if any(q.is_partial() for q in p.grad.placements))
    norm = shardmoe.parallel.clip_grad_norm_(model, MAX_NORM)  # on the Partial gradients, scaling them
    ref_norm = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM))
    sync_grads(model, mesh)
    once = {n: _whole(p.grad) for n, p in model.named_parameters()}
    still_partial = sorted(n for n, p in model.named_parameters() if any(q.is_partial() for q in p.grad.placements))
    refusals = []
    for label in ("again", "again on ranks 1-3"):
        if label == "again on ranks 1-3" and dist.get_rank() == 0:
            model.proj.weight.grad.mul_(1.0)  # touched in place, as a backward's accumulation is
        try:
            sync_grads(model, mesh)
            refusals.append(None)
        except ValueError as err:  # RankMismatchError too
            refusals.append((type(err).__name__, str(err)))
    twice = {n: _whole(p.grad) for n, p in model.named_parameters()}
    return {"partial": partial, "norms": (norm, ref_norm), "still partial": still_partial, "refusals": refusals,
            "number": model.moe.placement.dispatcher.number,
            "twice": _differ(once, twice), "clipped": {n: _rel(once[n], p.grad) for n, p in reference.named_parameters()}}


def _copies() -> dict:
    """Row 'copies': after a step, deepcopy and AveragedModel of the model; each copy's forward and
    gradients against the original's, then the original steps and the average takes it."""
    from torch.optim.swa_utils import AveragedModel

    out = {}
    for label, layout in LAYOUTS.items():
        mesh = Mesh(**layout)
        x_all, g_all = _batch(mesh.size(("d", "e")))
        x, g = x_all[_rows(mesh)], g_all[_rows(mesh)]
        model = Model(mesh, 0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        _step(model, optimizer, x, g, mean=False, sync=True)
        twin, averaged = copy.deepcopy(model), AveragedModel(model)
        result = {"same mesh": twin.moe.mesh is mesh and averaged.module.moe.mesh is mesh,
                  "numbers": [m.moe.placement.dispatcher.number for m in (model, twin, averaged.module)]}
        grads = {}
        for name, m in (("original", model), ("deepcopy", twin), ("averaged", averaged.module)):
            m.zero_grad()
            y = m(x)
            (y * g).sum().backward()
            sync_grads(m, mesh)
            grads[name] = (y.detach(), {n: _whole(p.grad) for n, p in m.named_parameters()})
        result["forward"] = {n: torch.equal(grads[n][0], grads["original"][0]) for n in ("deepcopy", "averaged")}
        result["gradients"] = {n: _differ(grads[n][1], grads["original"][1]) for n in ("deepcopy", "averaged")}
        before = {n: _whole(p) for n, p in model.named_parameters()}
        optimizer.step()  # the original's parameters move, the copies' do not
        result["copies untouched"] = _differ({n: _whole(p) for n, p in twin.named_parameters()}, before)
        averaged.update_parameters(model)  # the first update takes the model's parameters as they are
        first = {n: _whole(p) for n, p in model.named_parameters()}
        optimizer.step()
        averaged.update_parameters(model)  # the running mean of the two
        result["average"] = {n: _rel(_whole(p), (first[n] + _whole(model.get_parameter(n))) / 2)
                             for n, p in averaged.module.named_parameters()}
        out[label] = result
    return out


def _assign(kind) -> dict:
    """Row 'assign': a model loads another's state dict with assign=True, then both take a step.
    For PlainBeside the source is also moved by .double() (a DTensor parameter's contents and
    attributes swapped), so both hold replicated parameters put in place after the call."""
    mesh = Mesh(dp=2, ep=2)
    x_all, g_all = _batch(4)
    x, g = x_all[_rows(mesh)], g_all[_rows(mesh)]
    model, source = kind(mesh, 0), kind(mesh, 7)
    model.load_state_dict(source.state_dict(), assign=True)
    if kind is PlainBeside:
        source.double()
    out = {"placements": [(n, list(p.placements)) for n, p in model.named_parameters()] ==
                         [(n, list(p.placements)) for n, p in source.named_parameters()]}
    results = []
    try:
        for m in (model, source):
            y = m(x)
            (y * g).sum().backward()
            sync_grads(m, mesh)
            results.append((y.detach(), {n: _whole(p.grad) for n, p in m.named_parameters()}))
    except ValueError as err:  # the world lives on: the parent's assertion names it
        out["error"] = str(err)
        return out
    out["forward"] = torch.equal(results[0][0], results[1][0])
    out["gradients"] = _differ(results[0][1], results[1][1])
    return out


def _world(tmp: str) -> dict:
    out = {"checkpoints": _checkpoints(tmp), "tensor parallel": _tensor_parallel(tmp),
           "transformer": _transformer(tmp), "drift": _drift(), "one rank syncs": _one_rank_syncs(),
           "plain beside": _plain_beside(), "replicate refusals": _replicate_refusals(),
           "partial gradients": _partial_gradients(), "copies": _copies(),
           "assign": _assign(Model), "assign, plain beside": _assign(PlainBeside)}
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return run_distributed(_world, 4, args=(str(tmp_path_factory.mktemp("dcp")),), timeout=240)


LABELS = ["fsdp dp2 x ep2", "sync_grads dp2 x ep2"]


@pytest.mark.parametrize("label", LABELS)
def test_training_equals_one_process_with_torch_clipping(world, label):
    for out in world:
        result = out["checkpoints"][label]
        norms, ref_norms = result["norms"]
        assert all(abs(a - b) <= 1e-12 * b and b > MAX_NORM for a, b in zip(norms, ref_norms)), (label, norms, ref_norms)
        bad = {k: v for k, v in {**result["parameters"], **result["moments"]}.items() if not v <= TOL}
        assert not bad and len(result["parameters"]) == 9 and len(result["moments"]) == 27, (label, bad)
    # replicas stay replicas: the router is the same on every rank after the clipped steps
    assert len({tuple(out["checkpoints"][label]["router checksums"]) for out in world}) == 1


@pytest.mark.parametrize("label", LABELS)
def test_optimizer_state_round_trips_through_a_distributed_checkpoint(world, label):
    for out in world:
        assert out["checkpoints"][label]["same layout"] == [], label


@pytest.mark.parametrize("other", ["ep4", "one process"])
def test_optimizer_state_reshards_across_layouts(world, other):
    for out in world:
        result = out["checkpoints"]["fsdp dp2 x ep2"]
        assert result[f"-> {other}"] == [] and result[f"-> {other} parameters"] == [], other


def test_tensor_parallel_trains_as_one_process_and_its_checkpoint_refuses_loudly(world):
    """With 't' splitting F, gate_up_proj is _StridedShard(1, split_factor=2) over 'tp': clipping
    and AdamW are exact; DCP, whose chunks are one block per rank, refuses its moments by key
    (the layer's own state dict holds the packed view and reshards: test_device_mesh.py)."""
    for out in world:
        result = out["tensor parallel"]
        norms, ref_norms = result["norms"]
        assert all(abs(a - b) <= 1e-12 * b for a, b in zip(norms, ref_norms)), (norms, ref_norms)
        bad = {k: v for k, v in result["moments"].items() if not v <= TOL}
        assert not bad and len(result["moments"]) == 27, bad
        assert result["dcp"] is not None and "optim.state.moe.gate_up_proj.exp_avg has overlapping chunks" in \
            result["dcp"], result["dcp"]
        assert result["full state dict"] <= TOL


def test_the_sharded_transformer_round_trips_torch_optimizer_state(world):
    for out in world:
        result = out["transformer"]
        assert "error" not in result, result.get("error")
        assert result["meta equals eager"] == []
        assert result["assigned"] == (True, []), result["assigned"]
        assert result["dense DTensors"] == ["DTensor"]
        assert result["same layout"] == []
        got, own = result["norms"]
        assert abs(got - own) <= 1e-12 * own, result["norms"]


def test_replicas_that_drift_are_caught_within_the_interval(world):
    for out in world:
        call, text = out["drift"]["sync_grads"]
        assert call == 4, out["drift"]  # nudged after call 1's backward; calls 0 and 4 check
        assert "sync_grads: parameter 'moe.gate_weight' must hold the same value on ranks" in text, text
        forward, text = out["drift"]["forward"]
        assert forward == 3, out["drift"]  # nudged before forward 1; forwards 0 and 3 check
        assert "MoE layer: parameter 'gate_weight' must hold the same value on ranks" in text, text
        assert "3" in text.split("must hold the same value on ranks")[1].split("(")[0]


def test_a_collective_only_some_ranks_call_is_named_on_every_rank(world):
    texts = {out["one rank syncs"] for out in world}
    assert len(texts) == 1, texts
    (number, text), = texts
    assert text.startswith(f"ranks are in different collective calls: rank 0 has 'sync_grads of a module holding MoE "
                           f"layer {number}', ranks 1, 2, 3 have 'the forward of MoE layer {number}': every rank of "
                           "the mesh must make the same shardmoe calls in the same order"), text


@pytest.mark.parametrize("label", [f"{layout}, foreach={foreach}" for layout in LAYOUTS for foreach in (True, False)])
def test_torch_tools_take_a_plain_linear_beside_the_layer_once_replicated(world, label):
    """torch's clip_grad_norm_ and AdamW (foreach=True is CUDA's default) raised 'mixed torch.Tensor
    and DTensor' on this model; replicate_plain_parameters makes every parameter a DTensor."""
    for out in world:
        result = out["plain beside"][label]
        assert result["kinds"] == ["DTensor"], result["kinds"]
        norms, ref_norms = result["norms"]
        assert all(abs(a - b) <= 1e-12 * b and b > MAX_NORM for a, b in zip(norms, ref_norms)), (norms, ref_norms)
        bad = {k: v for k, v in result["parameters"].items() if not v <= TOL}
        assert not bad and len(result["parameters"]) == 11, bad


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_replicated_model_loads_a_plain_state_dict_and_keeps_its_parameters_when_a_forward_raises(world, layout):
    for out in world:
        assert out["plain beside"][f"{layout}, loaded"] == [], out["plain beside"][f"{layout}, loaded"]
        assert out["plain beside"][f"{layout}, restored"]


def test_replicating_refuses_a_model_fsdp_manages_and_a_parameter_with_a_gradient(world):
    for out in world:
        result = out["replicate refusals"]
        text, kinds = result["fsdp"]
        assert text.startswith("model: expected every DTensor parameter on the DeviceMesh of its sharded MoE layers' "
                               "parameters (one mesh.parameter_mesh), got DTensor parameters on mesh dims "), text
        assert "fully_shard its plain modules too" in text and kinds == ["Parameter"], result
        text, kinds = result["gradient"]
        assert text.startswith("0.bias: expected a parameter without a gradient (call replicate_plain_parameters "
                               "before the first backward)"), text


def test_clipping_before_sync_sums_the_partial_gradients_and_a_second_sync_is_refused(world):
    """A second sync_grads with no backward in between summed the gradients over 'd' (and a plain
    tensor's over 'e') again, silently: it is refused on every rank and changes nothing; a rank
    whose gradients moved meanwhile while the others' did not is named."""
    for out in world:
        result = out["partial gradients"]
        assert result["still partial"] == [], result["still partial"]  # the sum is recorded: Replicate()
        again, mixed = result["refusals"]
        assert again is not None and again[0] == "ValueError", again
        assert again[1].startswith("sync_grads: expected a backward since the last sync_grads of this PlainBeside, "
                                   "got none: its gradients are summed already"), again
        assert mixed is not None and mixed[0] == "RankMismatchError", mixed
        number = out["partial gradients"]["number"]
        assert mixed[1].startswith(f"ranks are in different collective calls: rank 0 has 'sync_grads of a module "
                                   f"holding MoE layer {number}', ranks 1, 2, 3 have 'sync_grads of a module holding "
                                   f"MoE layer {number}, again with no backward since its last'"), mixed
        # the router's, the shared expert's and the Linear's gradients are each rank's tokens' share
        assert {"proj.weight", "proj.bias", "moe.gate_weight"} <= set(result["partial"]), result["partial"]
        norm, ref_norm = result["norms"]
        assert abs(norm - ref_norm) <= 1e-12 * ref_norm and ref_norm > MAX_NORM, result["norms"]
        bad = {k: v for k, v in result["clipped"].items() if not v <= TOL}
        assert not bad and len(result["clipped"]) == 11, bad
        assert result["twice"] == [], result["twice"]


@pytest.mark.parametrize("label", list(LAYOUTS))
def test_deep_copies_of_a_sharded_model_share_its_mesh_and_compute_as_it_does(world, label):
    for out in world:
        result = out["copies"][label]
        assert result["same mesh"]
        assert len(set(result["numbers"])) == 3, result["numbers"]  # each copy is a layer of its own
        assert result["forward"] == {"deepcopy": True, "averaged": True}, result["forward"]
        assert result["gradients"] == {"deepcopy": [], "averaged": []}, result["gradients"]
        assert result["copies untouched"] == []
        bad = {k: v for k, v in result["average"].items() if not v <= 1e-15}
        assert not bad and len(result["average"]) == 9, bad


@pytest.mark.parametrize("row", ["assign", "assign, plain beside"])
def test_a_state_dict_loaded_with_assign_trains_as_its_source(world, row):
    """With a plain Linear beside the layer, replicated, its parameters put in place by
    assign=True or .double() had lost their grad-sync marks: sync_grads refused them as FSDP's."""
    for out in world:
        result = out[row]
        assert "error" not in result, result.get("error")
        assert result["placements"] and result["forward"] and result["gradients"] == [], result
