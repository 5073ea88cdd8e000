"""MoE on a torch DeviceMesh, and distributed checkpoints (torch.distributed.checkpoint) that reshard.

One spawned 4-rank gloo world carries every distributed check (spawning costs seconds):
  DeviceMesh  a job mesh ('dp', 'ep') of shape (2, 2), its 'ep' slice (two 2-rank layers), and a
              mesh numbered ep-major (('ep', 'dp'): global rank = e * dp + d), each against the
              single-process layer on the concatenation of its ranks' tokens (float64, 1e-10):
              outputs, input gradients, and every parameter gradient after sync_grads; one of
              their ranks holds no tokens. The Mesh of a DeviceMesh: coordinates, groups, cache.
  checkpoints dcp.save at one layout, then the recipe `sd = layer.state_dict(); dcp.load(sd);
              layer.load_state_dict(sd)` at another, into a layer seeded otherwise: every whole
              tensor (gathered) equals the saved layer's exactly. Layouts: ep=2 (the 'ep' slice)
              -> unsharded, unsharded -> ep=2, dp2 x ep2 -> ep=4, ep2 x tp2 -> ep=4 -> ep2 x tp2,
              ep2 x tp2 -> unsharded; a whole plain state dict into ep2 x tp2; wrong shapes.
  numbering   a DeviceMesh whose 'e' groups list their ranks in descending order, all pairs on the
              remote path: the exchange lays out the collective's splits in group rank order.
  DTensors    an input DTensor Shard(0) over the job mesh: the output is the DTensor of the plain
              call's output and x's gradient the plain call's, bit for bit; inputs laid out
              otherwise (Replicate over 'ep', H split, the ep-major mesh) and a parameter made a
              DTensor are refused with messages, before any work.
Single process: the refusals of DeviceMeshes with other dim names, and the state dict's layout.
"""
import re

import pytest
import torch
import torch.distributed as dist

import shardmoe
from shardmoe.mesh import Mesh
from shardmoe.moe.composition import local
from shardmoe.parallel import sync_grads
from shardmoe.testing import run_distributed

H, F, E, K = 8, 12, 8, 2
# biased glu, router and correction biases, a gated shared expert, aux loss: every kind of entry
OPTIONS = dict(bias=True, router_bias=True, correction_bias=True, shared_ffn_size=6, shared_gate=True,
               aux_loss_coef=0.05, dtype=torch.float64)
TOL = 1e-10


def _layer(mesh, seed: int, dtype=torch.float64) -> shardmoe.MoE:
    """A layer whose whole tensors (biases and correction bias included) are drawn from `seed`."""
    layer = shardmoe.MoE(H, F, E, K, mesh=mesh, **{**OPTIONS, "dtype": dtype})
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            whole = torch.randn(layer._whole_shapes.get(name, param.shape), generator=gen, dtype=param.dtype)
            local(param).copy_(whole if name in ("gate_weight", "gate_bias") else layer.placement.shard(name, whole))
        layer.correction_bias.copy_(torch.randn(E, generator=gen) * 0.1)
    return layer


def _whole(layer) -> dict:
    """Every whole tensor of the layer (a collective over the layer's 'e' and 't')."""
    out = {name: layer.placement.gather(name, local(p).detach()).clone() if name not in ("gate_weight", "gate_bias")
           else local(p).detach().clone() for name, p in layer.named_parameters()}
    out["correction_bias"] = layer.correction_bias.clone()
    return out


def _same(a: dict, b: dict) -> list[str]:
    """Names whose tensors differ (bitwise)."""
    return [n for n in b if not torch.equal(a[n], b[n])]


def _rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    if not expected.numel():
        return 0.0 if actual.shape == expected.shape else float("inf")
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-300)).item()


# -- the 4-rank world ----------------------------------------------------------------------------


def _forward_backward(layer, reference, counts: list[int], seed: int, autocast: bool = False) -> dict:
    """This rank's tokens (its token-parallel rank's rows of one batch) through `layer`, the whole
    batch through the single-process `reference`; max relative errors of this rank's outputs,
    input gradients, and (after sync_grads) every parameter gradient against the reference's."""
    gen = torch.Generator().manual_seed(seed)
    dtype = layer.gate_weight.dtype
    x_all = torch.randn(sum(counts), H, generator=gen, dtype=dtype)
    g_all = torch.randn(sum(counts), H, generator=gen, dtype=dtype)
    r = layer.mesh.coord(("d", "e"))
    rows = slice(sum(counts[:r]), sum(counts[: r + 1]))
    x = x_all[rows].clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = layer(x)
    (out.float() * g_all[rows]).sum().backward()
    sync_grads(layer, layer.mesh)
    x_ref = x_all.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y_ref = reference(x_ref)
    (y_ref.float() * g_all).sum().backward()
    errors = {"out": _rel(out.detach(), y_ref[rows].detach()), "grad_x": _rel(x.grad, x_ref.grad[rows])}
    for name, p in layer.named_parameters():
        expected = reference.get_parameter(name).grad
        if name not in ("gate_weight", "gate_bias"):
            expected = layer.placement.shard(name, expected)
        errors[f"grad {name}"] = _rel(local(p.grad), expected)
    return errors


def _mesh_facts(mesh: Mesh) -> dict:
    members = {}
    for axes in ("d", "e", ("d", "e")):
        group = mesh.group(axes)
        members[axes] = None if group is None else sorted(dist.get_process_group_ranks(group))
    return {"coords": mesh.coords(), "along_e": mesh.ranks_along("e"), "along_d": mesh.ranks_along("d"),
            "all": mesh.ranks_along(("d", "e", "t")), "members": members, "size": mesh.size()}


def _checkpoints(tmp: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    job = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    out = {}

    def save(layer, name):
        dcp.save(layer.state_dict(), checkpoint_id=f"{tmp}/{name}")

    def load(layer, name):
        state = layer.state_dict()
        dcp.load(state, checkpoint_id=f"{tmp}/{name}")
        layer.load_state_dict(state)
        return _whole(layer)

    reference = {seed: _whole(_layer(None, seed)) for seed in (10, 11, 12, 13)}
    ep2 = _layer(job["ep"], 10)
    out["ep2 entries"] = {k: (type(v).__name__, tuple(v.shape), str(getattr(v, "placements", "")))
                          for k, v in ep2.state_dict().items()}
    save(ep2, "ep2")
    out["ep2 -> unsharded"] = _same(load(_layer(None, 1), "ep2"), reference[10])
    save(_layer(None, 11), "unsharded")
    out["unsharded -> ep2"] = _same(load(_layer(job["ep"], 1), "unsharded"), reference[11])
    save(_layer(Mesh(dp=2, ep=2), 12), "dp2ep2")
    out["dp2 x ep2 -> ep4"] = _same(load(_layer(Mesh(ep=4), 1), "dp2ep2"), reference[12])
    save(_layer(Mesh(ep=2, tp=2), 13), "ep2tp2")
    ep4 = _layer(Mesh(ep=4), 1)
    out["ep2 x tp2 -> ep4"] = _same(load(ep4, "ep2tp2"), reference[13])
    save(ep4, "ep4")
    ep2tp2 = _layer(Mesh(ep=2, tp=2), 1)
    out["ep4 -> ep2 x tp2"] = _same(load(ep2tp2, "ep4"), reference[13])
    out["ep2 x tp2 -> unsharded"] = _same(load(_layer(None, 1), "ep2tp2"), reference[13])
    # its own state dict back, and a whole plain (unsharded, torch.save'd) one: this rank's shards
    ep2tp2.load_state_dict(ep2tp2.state_dict())
    out["own state dict"] = _same(_whole(ep2tp2), reference[13])
    plain = {k: v.detach().clone() for k, v in _layer(None, 12).named_parameters()}
    plain["correction_bias"] = reference[12]["correction_bias"]
    ep2tp2.load_state_dict(plain)
    out["plain whole -> ep2 x tp2"] = _same(_whole(ep2tp2), reference[12])
    wrong = {**plain, "down_proj": local(ep2tp2.down_proj).detach()}  # a local shard is not a whole tensor
    try:
        ep2tp2.load_state_dict(wrong)
    except ValueError as error:
        out["wrong shape"] = str(error)
    return out


def _fully_shard_refusals(job) -> dict:
    """fully_shard over an expert-parallel layer's shards where it cannot be right: on the layer over
    every rank, and on a module holding the layer over every rank. The forward's message, or None if
    it ran (then it would train on mixed experts with no error). Over 'dp' it composes:
    tests/parallel/test_fsdp.py."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    refusals = {}
    # over 'dp' on a module holding the layer: FSDP composes with the DTensors, the layer refuses
    module = fully_shard(torch.nn.Sequential(_layer(job, 5)), mesh=job["dp"])
    try:
        module(torch.randn(3, H, dtype=torch.float64))
        refusals["parent over dp", None] = None
    except ValueError as err:
        refusals["parent over dp", None] = f"forward: {err}"
    for names in (None, ("world",)):
        every = init_device_mesh("cpu", (4,), mesh_dim_names=names)
        for label in ("layer over every rank", "parent over every rank"):
            layer = _layer(job, 5)
            try:
                module = fully_shard(layer if label.startswith("layer") else torch.nn.Sequential(layer), mesh=every)
            except Exception as err:  # torch's own refusal
                refusals[label, names] = f"fully_shard: {type(err).__name__}: {err}"
                continue
            try:
                module(torch.randn(3, H, dtype=torch.float64))
                refusals[label, names] = None
            except Exception as err:
                refusals[label, names] = f"forward: {type(err).__name__}: {err}"
    return refusals


def _dtensor_inputs(job, ep_major) -> dict:
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    out = {}
    gen = torch.Generator().manual_seed(11 + dist.get_rank())
    x, g = (torch.randn(3, 2, H, generator=gen, dtype=torch.float64) for _ in range(2))
    plain_x, dtensor_x = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    first, second = _layer(job, 5), _layer(job, 5)  # alive until their backward
    plain = first(plain_x)
    (plain * g).sum().backward()
    whole = DTensor.from_local(dtensor_x, job, [Shard(0), Shard(0)], run_check=False)
    y = second(whole)
    (y.to_local() * g).sum().backward()
    out["dtensor out"] = (type(y).__name__, tuple(y.shape), list(y.placements))
    out["dtensor same"] = torch.equal(y.to_local(), plain) and torch.equal(dtensor_x.grad, plain_x.grad)
    refusals = {}
    for label, mesh, placements in (("replicate over ep", job, [Shard(0), Replicate()]),
                                    ("split H", job, [Shard(0), Shard(2)]),
                                    ("ep-major mesh", ep_major, [Shard(0), Shard(0)])):
        try:
            _layer(job, 5)(DTensor.from_local(x, mesh, placements, run_check=False))
            refusals[label] = None
        except ValueError as err:
            refusals[label] = str(err)
    layer = _layer(None, 5)
    layer.gate_weight = torch.nn.Parameter(distribute_tensor(layer.gate_weight.detach(), job, [Replicate()] * 2))
    try:
        layer(x)
        refusals["dtensor parameter"] = None
    except ValueError as err:
        refusals["dtensor parameter"] = str(err)
    out["dtensor refusals"] = refusals
    return out


def _world(tmp: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    out = {"rank": dist.get_rank()}
    from torch.distributed.device_mesh import DeviceMesh

    job = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    ep_major = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "dp"))
    # e = 0 on the odd ranks: the e groups' rank order is not their group order; all pairs remote
    reversed_e = Mesh.from_device_mesh(DeviceMesh("cpu", [[1, 0], [3, 2]], mesh_dim_names=("dp", "ep")),
                                       ranks_per_node=1)
    out["facts"] = {"job": _mesh_facts(Mesh.from_device_mesh(job)),
                    "slice": _mesh_facts(Mesh.from_device_mesh(job["ep"])),
                    "ep_major": _mesh_facts(Mesh.from_device_mesh(ep_major)), "reversed_e": _mesh_facts(reversed_e)}
    reference = _layer(None, 5)
    errors = {}
    for label, mesh, counts in (("job", job, [5, 0, 7, 4]), ("slice", job["ep"], [6, 0]),
                                ("ep_major", ep_major, [3, 6, 0, 5]), ("reversed_e", reversed_e, [4, 2, 5, 0])):
        reference.zero_grad()
        errors[label] = _forward_backward(_layer(mesh, 5), reference, counts, seed=len(counts))
    out["errors"] = errors
    # under bf16 autocast: the router in float32 on every rank, the experts' rows in bf16 wherever they run
    reference = _layer(None, 7, torch.float32)
    out["autocast errors"] = _forward_backward(_layer(job, 7, torch.float32), reference, [5, 0, 7, 4], seed=9,
                                               autocast=True)
    first, second = _layer(job["ep"], 5), _layer(job["ep"], 6)
    out["shared"] = (first.mesh is second.mesh
                     and first.placement.dispatcher.exchange is second.placement.dispatcher.exchange)
    out["device_mesh_names"] = Mesh(dp=2, ep=2).device_mesh["dp"].mesh_dim_names
    out["checkpoints"] = _checkpoints(tmp)
    out["fully_shard"] = _fully_shard_refusals(job)
    out.update(_dtensor_inputs(job, ep_major))
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("dcp"))
    return run_distributed(_world, 4, args=(tmp,), ranks_per_node=2, timeout=300, collective_timeout=60)


def test_mesh_of_a_device_mesh(world):
    for rank, out in enumerate(world):
        d, e = rank // 2, rank % 2  # the job mesh ('dp', 'ep') numbers ranks d * 2 + e
        job, piece, ep_major = (out["facts"][k] for k in ("job", "slice", "ep_major"))
        assert job["coords"] == {"d": d, "e": e, "t": 0} and job["size"] == 4
        assert job["along_e"] == [2 * d, 2 * d + 1] and job["along_d"] == [e, 2 + e]
        assert job["members"] == {"d": [e, 2 + e], "e": [2 * d, 2 * d + 1], ("d", "e"): [0, 1, 2, 3]}
        # the 'ep' slice is 2 of the 4 ranks: its global ranks, its own groups
        assert piece["coords"] == {"d": 0, "e": e, "t": 0} and piece["size"] == 2
        assert piece["all"] == [2 * d, 2 * d + 1] and piece["along_e"] == [2 * d, 2 * d + 1]
        assert piece["members"] == {"d": None, "e": [2 * d, 2 * d + 1], ("d", "e"): [2 * d, 2 * d + 1]}
        # ('ep', 'dp'): rank = e * 2 + d, mesh index (d, e) row-major
        e, d = rank // 2, rank % 2
        assert ep_major["coords"] == {"d": d, "e": e, "t": 0}
        assert ep_major["all"] == [0, 2, 1, 3] and ep_major["along_e"] == [d, 2 + d]
        assert ep_major["members"]["e"] == [d, 2 + d]
        assert out["facts"]["reversed_e"]["all"] == [1, 0, 3, 2]
        assert out["facts"]["reversed_e"]["coords"] == {"d": rank // 2, "e": 1 - rank % 2, "t": 0}


def test_layers_on_a_device_mesh_compute_the_single_process_layer(world):
    for out in world:
        for label, errors in out["errors"].items():
            bad = {k: v for k, v in errors.items() if not v <= TOL}
            assert not bad, (out["rank"], label, bad)


def test_expert_parallel_layer_under_autocast_computes_the_single_process_layer(world):
    """bf16 autocast, float32 parameters, dp2 x ep2: outputs and gradients within bf16 round-off of
    one process under the same autocast: outputs equal (the same bf16 operands); parameter gradients
    within 1e-2 (measured up to 4.3e-3: each rank rounds its partial expert gradient to bf16
    before sync_grads sums them)."""
    for out in world:
        bad = {k: v for k, v in out["autocast errors"].items() if not v <= 1e-2}
        assert not bad, (out["rank"], bad)


def test_fully_shard_over_the_experts_is_refused_not_trained(world):
    """The experts are DTensors on the 'ep' mesh: fully_shard over every rank, of the layer or of a
    module holding it, is refused by torch itself, before anything runs (plain shards would train on
    mixed experts with no error)."""
    for out in world:
        refusals = out["fully_shard"]
        assert len(refusals) == 5
        parent = refusals.pop(("parent over dp", None))
        assert parent is not None and parent.startswith(
            "forward: gate_up_proj: expected the parameter this layer made (this rank's shard over mesh axes ['e'], "
            "marked for sync_grads), got another in its place (DTensor of shape [8, 24, 8], unmarked). "
            "torch.distributed.fsdp.fully_shard on a module holding this layer"), parent
        for (label, names), text in refusals.items():
            assert text is not None and text.startswith("fully_shard: "), (label, names, text)
        overlap = ("fully_shard: RuntimeError: Cannot concatenate overlapping meshes: [DeviceMesh((world=4), 'cpu', "
                   "stride=(1,)), DeviceMesh((ep=2), 'cpu', stride=(1,))]")
        assert refusals["layer over every rank", ("world",)] == overlap
        assert refusals["parent over every rank", ("world",)] == overlap


def test_a_dtensor_input_is_its_local_tokens_and_other_layouts_are_refused(world):
    from torch.distributed.tensor import Shard

    for out in world:
        assert out["dtensor out"] == ("DTensor", (12, 2, H), [Shard(0), Shard(0)])
        assert out["dtensor same"]
        refusals = out["dtensor refusals"]
        prefix = "x: expected a DTensor whose blocks are the layer's tokens, got placements "
        assert refusals["replicate over ep"] == (
            prefix + "[Shard(dim=0), Replicate()] on mesh dims ['dp', 'ep']: ep: Replicate(), expected Shard(0) "
            "(the layer's ranks along 'e' hold different tokens)")
        assert refusals["split H"] == (
            prefix + "[Shard(dim=0), Shard(dim=2)] on mesh dims ['dp', 'ep']: ep: Shard(dim=2) splits H, which the "
            "router and the experts need whole")
        assert refusals["ep-major mesh"].startswith(prefix + "[Shard(dim=0), Shard(dim=0)] on mesh dims ['ep', 'dp']")
        assert "ep before dp" in refusals["ep-major mesh"]
        assert refusals["dtensor parameter"] == (
            "gate_weight: expected a plain tensor (the layer's mesh splits no parameter), got a DTensor with "
            "placements [Replicate(), Replicate()] on mesh dims ('dp', 'ep')")


def test_layers_on_one_device_mesh_share_its_mesh_and_exchange(world):
    assert all(out["shared"] for out in world)
    assert all(out["device_mesh_names"] == ("dp",) for out in world)


def test_state_dict_entries_describe_the_whole_tensors(world):
    entries = world[0]["checkpoints"]["ep2 entries"]
    assert entries["gate_up_proj"] == ("DTensor", (E, 2, F, H), "(Shard(dim=0),)")
    assert entries["gate_up_proj_bias"] == ("DTensor", (E, 2, F), "(Shard(dim=0),)")
    assert entries["down_proj"] == ("DTensor", (E, H, F), "(Shard(dim=0),)")
    assert entries["shared_gate_up_proj"] == ("Tensor", (2, 6, H), "")  # replicated: plain
    assert entries["gate_weight"] == ("Tensor", (H, E), "")
    assert entries["correction_bias"] == ("Tensor", (E,), "")


@pytest.mark.parametrize("trip", ["ep2 -> unsharded", "unsharded -> ep2", "dp2 x ep2 -> ep4", "ep2 x tp2 -> ep4",
                                  "ep4 -> ep2 x tp2", "ep2 x tp2 -> unsharded", "own state dict",
                                  "plain whole -> ep2 x tp2"])
def test_distributed_checkpoints_reshard_exactly(world, trip):
    for out in world:
        assert out["checkpoints"][trip] == [], (out["rank"], trip)


def test_load_refuses_a_tensor_that_is_not_whole(world):
    for out in world:
        assert out["checkpoints"]["wrong shape"] == (
            f"state_dict['down_proj']: expected the whole tensor, of shape [{E}, {H}, {F}], as a tensor or a "
            f"DTensor, got shape [{E // 2}, {H}, {F // 2}]")


# -- one process -----------------------------------------------------------------------------------


@pytest.mark.parametrize("names", [("dp", "pp"), ("expert",), None])
def test_device_mesh_with_other_dim_names_is_refused(names):
    from torch.distributed.device_mesh import DeviceMesh

    assert not dist.is_initialized()
    # a DeviceMesh without process groups: the names are refused before anything communicates
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]] if names != ("expert",) else [0, 1], mesh_dim_names=names,
                      _init_backend=False, _rank=0)
    message = ("mesh: expected a DeviceMesh whose mesh_dim_names are distinct names among 'dp', 'ep', 'tp' "
               f"(any subset, any order), got mesh_dim_names {names!r}")
    with pytest.raises(ValueError, match=re.escape(message)):
        shardmoe.MoE(H, F, E, K, mesh=mesh)


def test_mesh_of_another_kind_is_refused():
    with pytest.raises(ValueError, match=r"mesh: expected None, a shardmoe.Mesh or a "
                                         r"torch.distributed.device_mesh.DeviceMesh, got tuple"):
        shardmoe.MoE(H, F, E, K, mesh=(2, 2))


def test_single_process_state_dict_round_trips_both_layouts():
    layer, other = _layer(None, 1), _layer(None, 2)
    state = layer.state_dict()
    assert state["gate_up_proj"].shape == (E, 2, F, H) and state["shared_gate_up_proj"].shape == (2, 6, H)
    assert state["gate_up_proj"].data_ptr() == layer.gate_up_proj.data_ptr()  # a view: loads land in place
    other.load_state_dict(state)
    assert _same(_whole(other), _whole(layer)) == []
    other = _layer(None, 2)
    other.load_state_dict({**{k: v.detach() for k, v in layer.named_parameters()},
                           "correction_bias": layer.correction_bias})
    assert _same(_whole(other), _whole(layer)) == []
    with pytest.raises(ValueError, match=r"state_dict\['gate_up_proj'\]: expected the whole tensor, of shape "
                                         rf"\[{E}, 2, {F}, {H}\] \(or the parameter's layout \[{E}, {2 * F}, {H}\]\)"
                                         rf", as a tensor or a DTensor, got shape \[{E}, {F}, {H}\]"):
        other.load_state_dict({**state, "gate_up_proj": torch.zeros(E, F, H, dtype=torch.float64)})
