"""Mesh: layout, coordinates, groups and topology, on one process and in one spawned 4-rank world;
the pipeline axis p (each rank's Mesh is its stage's (d, e, t) mesh) in the same world."""

import pytest
import torch
import torch.distributed as dist

from shardmoe.mesh import PIPELINE_MESH_AXES, Mesh, parse_mesh
from shardmoe.testing import run_distributed

LAYOUTS = [(4, 1, 1), (1, 4, 1), (1, 1, 4), (2, 2, 1), (2, 1, 2), (1, 2, 2)]


def test_single_process_mesh_needs_no_process_group():
    assert not dist.is_initialized()
    mesh = Mesh()
    assert (mesh.world_size, mesh.rank, mesh.ranks_per_node) == (1, 0, 1)
    assert mesh.coords() == {"d": 0, "e": 0, "t": 0}
    assert mesh.size() == 1 and mesh.size(("d", "e")) == 1
    assert mesh.group("t") is None and mesh.group(("d", "e")) is None
    assert mesh.rank_at(e=0) == 0 and mesh.ranks_along("e") == [0]
    assert mesh.node_of(0) == 0 and mesh.same_node(0, 0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(dp=2, tp=2), r"Mesh\(dp=2, ep=1, tp=2\) needs 4 ranks: initialise torch.distributed first"),
        (dict(ep=0), r"Mesh: ep must be a positive int, got 0"),
        (dict(tp=2.0), r"Mesh: tp must be a positive int, got 2.0"),
        (dict(ep=2, pp=2), r"Mesh\(dp=1, ep=2, tp=1, pp=2\) needs 4 ranks: initialise torch.distributed first"),
        (dict(pp=0), r"Mesh: pp must be a positive int, got 0"),
    ],
)
def test_single_process_mesh_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Mesh(**kwargs)


def test_mesh_argument_errors():
    mesh = Mesh()
    with pytest.raises(ValueError, match="unknown mesh axis 'x'; known axes: d, e, t"):
        mesh.size("x")
    with pytest.raises(ValueError, match=r"rank_at: e=1 is outside 0..0"):
        mesh.rank_at(e=1)
    with pytest.raises(ValueError, match=r"rank 1 is not a rank of this mesh; its ranks are 0"):
        mesh.node_of(1)
    with pytest.raises(ValueError, match="name an axis twice"):
        mesh.coord(("d", "d"))


def _check_world(layouts):
    """Runs on each rank; returns what the parent asserts on."""
    rank = dist.get_rank()
    out = {"layouts": {}}
    for dp, ep, tp in layouts:
        mesh = Mesh(dp=dp, ep=ep, tp=tp)
        groups = {}
        for axes in ("d", "e", "t", ("d", "e"), ("t", "d"), ("e", "t"), ("d", "e", "t")):
            group = mesh.group(axes)
            members = dist.get_process_group_ranks(group) if group is not None else [rank]
            # The group works: the sum of the members' ranks comes back.
            total = torch.tensor([float(rank)])
            if group is not None:
                dist.all_reduce(total, group=group)
            groups[axes] = (sorted(members), total.item())
        out["layouts"][(dp, ep, tp)] = {
            "coords": mesh.coords(),
            "coord_td": mesh.coord(("t", "d")),
            "coord_de": mesh.coord(("d", "e")),
            "size_de": mesh.size(("d", "e")),
            "peer_e0": mesh.rank_at(e=0),
            "peer_t_last": mesh.rank_at(t=tp - 1),
            "along_e": mesh.ranks_along("e"),
            "along_td": mesh.ranks_along(("t", "d")),
            "groups": groups,
        }
    out["device_mesh_names"] = mesh.device_mesh.mesh_dim_names
    if dist.get_world_size() == 8:
        out["sub_mesh"] = _check_sub_mesh()
    if dist.get_world_size() != 4:
        return out
    # Topology, with the 4 ranks on 2 pretend nodes of 2.
    out["ranks_per_node"] = Mesh(dp=4).ranks_per_node
    out["nodes"] = [Mesh(dp=4).node_of(r) for r in range(4)]
    out["same_node"] = (Mesh(dp=4).same_node(0, 1), Mesh(dp=4).same_node(1, 2))
    out["override"] = Mesh(ep=4, ranks_per_node=1).node_of(3)
    out["pipeline"] = _check_pipeline()
    # A wrong layout raises on every rank before any communication; the world still works after.
    try:
        Mesh(dp=3)
    except ValueError as error:
        out["bad_world"] = str(error)
    try:
        Mesh(ep=2, pp=3)
    except ValueError as error:
        out["bad_pipeline"] = str(error)
    try:
        Mesh(tp=4, ranks_per_node=3)
    except ValueError as error:
        out["bad_node"] = str(error)
    dist.barrier()
    return out


def _check_pipeline() -> dict:
    """Per pipelined layout: this rank's stage, its stage mesh's coordinates and ranks, the ranks
    along p, and what an all-reduce over the stage's (d, e, t) group and over the pipeline group sums;
    and the timeout of every group the Mesh made (the default group's, 20 s here)."""
    out = {}
    for layout in ((2, 1, 1, 2), (1, 2, 1, 2), (1, 1, 2, 2), (1, 1, 1, 4)):
        dp, ep, tp, pp = layout
        mesh = Mesh(dp, ep, tp, pp=pp)
        sums = []
        for group in (mesh.group(("d", "e", "t")), mesh.pipeline_group):
            total = torch.tensor([float(dist.get_rank())])
            if group is not None:
                dist.all_reduce(total, group=group)
            sums.append(total.item())
        groups = [mesh.group(a) for a in ("d", "e", "t", ("d", "e", "t"))] + [mesh.pipeline_group]
        timeouts = {str(g._get_backend(torch.device("cpu")).options._timeout) for g in groups if g is not None}
        if mesh.parameter_mesh is not None:
            timeouts.add(str(mesh.parameter_mesh.get_group()._get_backend(torch.device("cpu")).options._timeout))
        out[layout] = {"stage": mesh.stage, "coords": mesh.coords(), "size": mesh.size(),
                       "stage_ranks": mesh.ranks_along(("d", "e", "t")), "pipeline_ranks": mesh.pipeline_ranks,
                       "sums": sums, "world_size": mesh.world_size, "timeouts": timeouts,
                       "names": mesh.device_mesh.mesh_dim_names}
    return out


def _check_sub_mesh() -> dict:
    """The ('ep', 'tp') slice of a job DeviceMesh ('dp', 'ep', 'tp') of shape (2, 2, 2): 4 of the 8
    ranks, whose ('e', 't') group is a flattened sub-mesh, not the world."""
    from torch.distributed.device_mesh import init_device_mesh

    job = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "ep", "tp"))
    mesh = Mesh.from_device_mesh(job["ep", "tp"])
    group = mesh.group(("e", "t"))
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total, group=group)
    return {"members": sorted(dist.get_process_group_ranks(group)), "total": total.item(),
            "coords": mesh.coords(), "size": mesh.size(), "along_t": mesh.ranks_along("t"),
            "all": mesh.ranks_along(("d", "e", "t")), "group_d": mesh.group("d")}


@pytest.fixture(scope="module")
def world():
    return run_distributed(_check_world, 4, args=(LAYOUTS,), ranks_per_node=2, timeout=60, collective_timeout=20)


@pytest.fixture(scope="module")
def world8():
    """The only layout with three axes of size > 1, whose pair groups are flattened sub-meshes."""
    return run_distributed(_check_world, 8, args=([(2, 2, 2)],), timeout=60, collective_timeout=20)


def _expected_coords(rank, dp, ep, tp):
    return {"d": rank // (ep * tp), "e": rank // tp % ep, "t": rank % tp}


@pytest.fixture(params=LAYOUTS + [(2, 2, 2)], ids=str)
def layout_world(request):
    world = request.getfixturevalue("world8" if request.param == (2, 2, 2) else "world")
    return request.param, world


def test_coordinates_and_peers(layout_world):
    layout, world = layout_world
    dp, ep, tp = layout
    for rank, out in enumerate(world):
        got = out["layouts"][layout]
        c = _expected_coords(rank, dp, ep, tp)
        assert got["coords"] == c
        assert rank == (c["d"] * ep + c["e"]) * tp + c["t"]
        assert got["coord_td"] == c["t"] * dp + c["d"]
        assert got["coord_de"] == c["d"] * ep + c["e"]
        assert got["size_de"] == dp * ep
        assert got["peer_e0"] == (c["d"] * ep + 0) * tp + c["t"]
        assert got["peer_t_last"] == (c["d"] * ep + c["e"]) * tp + tp - 1
        assert got["along_e"] == [(c["d"] * ep + e) * tp + c["t"] for e in range(ep)]
        assert got["along_td"] == [(d * ep + c["e"]) * tp + t for t in range(tp) for d in range(dp)]


def test_groups_hold_the_ranks_that_share_the_other_coordinates(layout_world):
    layout, world = layout_world
    dp, ep, tp = layout
    for rank, out in enumerate(world):
        for axes, (members, total) in out["layouts"][layout]["groups"].items():
            axes = (axes,) if isinstance(axes, str) else axes
            mine = _expected_coords(rank, dp, ep, tp)
            expected = [
                r
                for r in range(len(world))
                if all(_expected_coords(r, dp, ep, tp)[a] == mine[a] for a in "det" if a not in axes)
            ]
            assert members == expected, (rank, axes)
            assert total == sum(expected)


def test_topology_from_local_world_size(world):
    for out in world:
        assert out["ranks_per_node"] == 2
        assert out["nodes"] == [0, 0, 1, 1]
        assert out["same_node"] == (True, False)
        assert out["override"] == 3


def test_bad_layout_raises_before_communicating(world):
    for out in world:
        assert out["bad_world"] == "Mesh(dp=3, ep=1, tp=1): dp*ep*tp = 3 but the world size is 4"
        assert out["bad_node"] == "ranks_per_node = 3 must be positive and divide the world size 4"


def test_the_pipeline_axis_is_outermost_and_a_ranks_mesh_is_its_stages(world):
    for rank, out in enumerate(world):
        for (dp, ep, tp, pp), got in out["pipeline"].items():
            stage_size = dp * ep * tp
            stage, index = rank // stage_size, rank % stage_size
            stage_ranks = list(range(stage * stage_size, (stage + 1) * stage_size))
            pipeline_ranks = [p * stage_size + index for p in range(pp)]
            assert got["stage"] == stage and got["coords"] == _expected_coords(index, dp, ep, tp)
            assert got["size"] == stage_size and got["world_size"] == 4
            assert got["stage_ranks"] == stage_ranks and got["pipeline_ranks"] == pipeline_ranks
            assert got["sums"] == [sum(stage_ranks), sum(pipeline_ranks)]
            assert got["timeouts"] == {"0:00:20"} and got["names"] == ("dp", "ep", "tp")
        assert out["bad_pipeline"] == "Mesh(dp=1, ep=2, tp=1, pp=3): pp*dp*ep*tp = 6 but the world size is 4"


def test_parse_mesh_option():
    assert parse_mesh("p=2,e=2", PIPELINE_MESH_AXES) == {"p": 2, "d": 1, "e": 2, "t": 1}
    with pytest.raises(ValueError, match=r"AXIS in d, e, t and SIZE >= 1, got 'p=2'"):
        parse_mesh("p=2")
    assert parse_mesh("d=2,e=2") == {"d": 2, "e": 2, "t": 1}
    assert parse_mesh("e=4") == {"d": 1, "e": 4, "t": 1}
    assert parse_mesh("d=2 t=2") == {"d": 2, "e": 1, "t": 2}
    assert parse_mesh("") == {"d": 1, "e": 1, "t": 1}
    with pytest.raises(ValueError, match=r"--mesh: expected comma-separated AXIS=SIZE with AXIS in d, e, t "
                                         r"and SIZE >= 1, got 'x=2'"):
        parse_mesh("x=2")
    with pytest.raises(ValueError, match="got 't=0'"):
        parse_mesh("t=0")


def test_parse_mesh_refuses_an_axis_given_twice():
    with pytest.raises(ValueError, match=r"--mesh: expected each axis at most once, got axis 'd' twice "
                                         r"\('d=2' and 'd=4'\) in 'd=2,e=2,d=4'"):
        parse_mesh("d=2,e=2,d=4")


def test_mesh_names_its_device_mesh_dims_as_torch_users_do(layout_world):
    _, world = layout_world
    assert all(out["device_mesh_names"] == ("dp", "ep", "tp") for out in world)


def test_sub_mesh_of_a_job_device_mesh(world8):
    for rank, out in enumerate(world8):
        sub, d = out["sub_mesh"], rank // 4
        members = [4 * d + i for i in range(4)]
        assert sub["members"] == members and sub["total"] == sum(members)
        assert sub["coords"] == {"d": 0, "e": rank // 2 % 2, "t": rank % 2} and sub["size"] == 4
        assert sub["all"] == members and sub["along_t"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert sub["group_d"] is None
