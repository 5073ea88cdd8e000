"""FSDP2 composed with expert parallelism the way torchtitan composes it, on gloo, float64.

A 2-rank world (job mesh ep2) and a 4-rank world (dp2 x ep2, ep2 x tp2 and ep4), job meshes
("dp", "ep", "tp"). A toy model: a dense nn.Linear, fully_shard-ed
over all four ranks, then a shardmoe.MoE on the job mesh (experts split over 'ep' and sliced over 'tp', aux,
z and sequence-wise losses, a router bias, a correction bias, a shared expert), fully_shard-ed
over 'dp' (one rank in the last two). Each rank holds an equal share of the batch and its loss is the mean over its own tokens
plus layer.aux_loss; torch.optim.AdamW steps the DTensor parameters; the correction bias moves
from the global loads. Three steps equal one process on the whole batch (loss = mean over every
token + aux) to 1e-10: outputs, and every parameter after each step, with no gradient rescaling
by the user (the layer sets FSDP's divide factor and sums its replicated gradients over 'e').
"""
import math

import pytest
import torch
import torch.distributed as dist

import shardmoe
from shardmoe.mesh import Mesh
from shardmoe.testing import run_distributed

H, F, E, K = 8, 12, 8, 2
ROWS, T = 2, 3  # rows per rank, tokens per row: each row is a sequence of the sequence-wise loss
# every kind of parameter: biased glu experts (down_proj_bias is whole over 'tp'), the router's bias,
# a gated shared expert (its gate weight is whole over 'tp')
OPTIONS = dict(aux_loss_coef=0.05, z_loss_coef=0.01, seq_aux_loss_coef=0.1, router_bias=True, correction_bias=True,
               bias_update_rate=0.01, bias=True, shared_ffn_size=6, shared_gate=True, dtype=torch.float64)
NUM_PARAMS = 11  # proj weight and bias; gate weight and bias; 4 expert tensors; 3 shared-expert tensors
STEPS = 3
TOL = 1e-10


class Toy(torch.nn.Module):
    def __init__(self, mesh):
        super().__init__()
        torch.manual_seed(0)  # every rank and the single process draw the same whole tensors
        self.proj = torch.nn.Linear(H, H, dtype=torch.float64)
        self.moe = shardmoe.MoE(H, F, E, K, mesh=mesh, **OPTIONS)

    def forward(self, x):
        return self.moe(self.proj(x))


def _batch(shards: int):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(shards * ROWS, T, H, generator=gen, dtype=torch.float64)
    return x, torch.randn(x.shape, generator=gen, dtype=torch.float64)


def _train(model, x, g, whole):
    """STEPS AdamW steps on loss = mean over x's tokens of y . g + aux_loss: the first output, and
    per step every gradient before the update and every parameter after it, as `whole` gives a
    tensor. The gradients are compared too: AdamW's update would hide a gradient off by a constant
    factor (a missing sum or division over a mesh axis)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    after, first = [], None
    for _ in range(STEPS):
        optimizer.zero_grad()
        y = model(x)
        first = y.detach() if first is None else first
        ((y * g).sum() / (x.numel() // H) + model.moe.aux_loss).backward()
        snapshot = {f"grad {n}": whole(p.grad) for n, p in model.named_parameters()}
        optimizer.step()
        model.moe.update_correction_bias(model.moe.stats["selected_per_expert"])
        snapshot.update({n: whole(p.detach()) for n, p in model.named_parameters()})
        snapshot["moe.correction_bias"] = model.moe.correction_bias.clone()
        after.append(snapshot)
    return first, after


LAYOUTS = {"ep2": (1, 2, 1), "dp2 x ep2": (2, 2, 1), "ep2 x tp2": (1, 2, 2), "ep4": (1, 4, 1)}


def _world(tmp: str, labels: list[str]) -> dict:
    return {label: _layout(LAYOUTS[label], f"{tmp}/{label.replace(' ', '')}") for label in labels}


def _layout(sizes, checkpoint: str) -> dict:
    """Train on the job mesh ("dp", "ep", "tp") of these sizes against one process."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    job = init_device_mesh("cpu", sizes, mesh_dim_names=("dp", "ep", "tp"))
    model = Toy(job)
    fully_shard(model.moe, mesh=job["dp"])
    every_rank = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(model, mesh=every_rank)
    mesh = Mesh.from_device_mesh(job)
    token_rank = mesh.coord(("d", "e"))
    x_all, g_all = _batch(mesh.size(("d", "e")))
    rows = slice(token_rank * ROWS, (token_rank + 1) * ROWS)

    # every parameter and gradient is a DTensor of the whole tensor: FSDP's over 'dp', joined for the
    # MoE's with the layer's own over 'ep' and 'tp'
    first, after = _train(model, x_all[rows], g_all[rows], lambda t: t.full_tensor().clone())
    reference = Toy(None)
    ref_first, ref_after = _train(reference, x_all, g_all, lambda t: t.clone())
    errors = {"output": _rel(first, ref_first[rows])}
    for step, (mine, theirs) in enumerate(zip(after, ref_after), start=1):
        for name, value in mine.items():
            errors[f"step {step} {name}"] = _rel(value, theirs[name])
    out = {"errors": errors}
    # one more backward of the trained models, then the whole model's gradient norm, clipped to 0.05
    for net, xs, gs in ((model, x_all[rows], g_all[rows]), (reference, x_all, g_all)):
        net.zero_grad()
        ((net(xs) * gs).sum() / (xs.numel() // H) + net.moe.aux_loss).backward()
    want = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05))
    got = shardmoe.parallel.clip_grad_norm_(model, 0.05)
    out["norm"] = (got, want)
    for name, p in model.named_parameters():
        errors[f"clipped grad {name}"] = _rel(p.grad.full_tensor(), reference.get_parameter(name).grad)
    # torch.distributed.checkpoint of the FSDP model, loaded into the single-process model on every rank
    import torch.distributed.checkpoint as dcp

    dcp.save(model.state_dict(), checkpoint_id=checkpoint)
    loaded = Toy(None)
    state = loaded.state_dict()
    dcp.load(state, checkpoint_id=checkpoint)
    loaded.load_state_dict(state)
    out["checkpoint"] = {n: _rel(p.detach(), reference.get_parameter(n).detach()) for n, p in loaded.named_parameters()}
    # and back into a fresh FSDP model of this layout
    again = Toy(job)
    fully_shard(again.moe, mesh=job["dp"])
    fully_shard(again, mesh=every_rank)
    state = again.state_dict()
    dcp.load(state, checkpoint_id=checkpoint)
    again.load_state_dict(state)
    out["checkpoint"].update({f"back {n}": _rel(p.full_tensor(), q.full_tensor()) for (n, p), q in
                              zip(again.named_parameters(), model.parameters())})
    try:
        shardmoe.parallel.sync_grads(model.moe, mesh)
        out["sync_grads"] = None
    except ValueError as err:
        out["sync_grads"] = str(err)
    return out


def _rel(actual, expected) -> float:
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-300)).item()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Per rank of the larger world, {layout: results}; the 2-rank world's ranks merged into ranks 0, 1."""
    tmp = str(tmp_path_factory.mktemp("dcp"))
    outs = run_distributed(_world, 4, args=(tmp, [k for k, v in LAYOUTS.items() if math.prod(v) == 4]), timeout=240,
                           collective_timeout=60)
    pair = run_distributed(_world, 2, args=(tmp, [k for k, v in LAYOUTS.items() if math.prod(v) == 2]), timeout=120,
                           collective_timeout=60)
    for rank, results in enumerate(pair):
        outs[rank].update(results)
    return outs


def _ranks_of(world, layout) -> list:
    """(rank, results) of the ranks that ran `layout`: all of its world's."""
    ranks = [(rank, outs) for rank, outs in enumerate(world) if layout in outs]
    assert len(ranks) == math.prod(LAYOUTS[layout]), (layout, len(ranks))
    return ranks


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fsdp_over_dp_with_experts_over_ep_trains_as_one_process(world, layout):
    for rank, outs in _ranks_of(world, layout):
        errors = outs[layout]["errors"]
        bad = {k: v for k, v in errors.items() if not v <= TOL}
        assert not bad, (rank, sorted(bad.items())[:40])
        # output; per step every parameter's gradient and value, the bias; the clipped gradients
        assert len(errors) == 1 + STEPS * (2 * NUM_PARAMS + 1) + NUM_PARAMS


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_distributed_checkpoint_of_the_fsdp_model_reshards_exactly(world, layout):
    """dcp.save of the trained FSDP model; dcp.load into the single-process model (equal to the
    single process's own trained weights) and into a fresh FSDP model of the layout (equal to the
    saved one), bit for bit."""
    for rank, outs in _ranks_of(world, layout):
        errors = outs[layout]["checkpoint"]
        assert len(errors) == 2 * NUM_PARAMS and not {k: v for k, v in errors.items() if v > 1e-12}, (rank, errors)
        assert all(v == 0 for k, v in errors.items() if k.startswith("back")), (rank, errors)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_clip_grad_norm_gives_the_whole_models_norm(world, layout):
    """torch.nn.utils.clip_grad_norm_ refuses DTensors on two meshes; shardmoe.parallel's counts each
    block of every parameter once, experts split over 'ep' and 'tp' included (the clipped gradients
    are in the test above)."""
    for _, outs in _ranks_of(world, layout):
        got, want = outs[layout]["norm"]
        assert want > 0.05 and abs(got - want) <= 1e-12 * want, (layout, got, want)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sync_grads_refuses_parameters_fsdp_manages(world, layout):
    for _, outs in _ranks_of(world, layout):
        assert outs[layout]["sync_grads"] == (
            "sync_grads: expected parameters that shardmoe reduces, got 'gate_weight' as a DTensor it did not make "
            "(torch.distributed.fsdp.fully_shard manages it and reduces its gradient itself): call sync_grads only "
            "on modules FSDP does not manage (docs/parallel.md)")
