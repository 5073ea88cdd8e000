"""Shape specs: parsing, caching, parse errors, local/global shape math and shape checks."""

import pytest
import torch

from shardmoe.notation import (
    Dim,
    check_shape,
    global_shape,
    local_shape,
    parse_spec,
    parse_transition,
)

MESH = {"d": 2, "e": 3, "t": 4}


def test_parse_dims_and_axes():
    spec = parse_spec("B/d/e L  M/t")
    assert spec.dims == (Dim("B", ("d", "e")), Dim("L"), Dim("M", ("t",)))
    assert spec.names == ("B", "L", "M")
    assert spec.axes == {"d", "e", "t"}
    assert spec.index("M") == 2
    assert str(spec.dims[0]) == "B/d/e"


def test_numeric_dim_has_fixed_size():
    spec = parse_spec("2 M/d")
    assert spec.dims[0].fixed_size == 2 and spec.dims[1].fixed_size is None
    spec.check((2, 5), MESH)
    with pytest.raises(ValueError, match=r"dim 2 of '2 M/d': local size 3 is not global 2"):
        spec.check((3, 5), MESH)


def test_parse_is_cached():
    parse_spec.cache_clear()
    assert parse_spec("B/d L M/t") is parse_spec("B/d L M/t")
    assert parse_spec.cache_info().hits == 1
    assert parse_transition("M/t -> M") is parse_transition("M/t -> M")


@pytest.mark.parametrize(
    "text, message",
    [
        ("", r"empty shape spec ''"),
        ("   ", r"empty shape spec"),
        ("B/x L", r"dim 'B/x' of 'B/x L': unknown mesh axis 'x'; known axes: d, e, t"),
        ("B L B/d", r"spec 'B L B/d' names dim 'B' twice"),
        ("M/t F/t", r"mesh axis 't' shards both M and F"),
        ("B//d", r"dim 'B//d' of 'B//d' has an empty mesh axis"),
        ("B/", r"has an empty mesh axis"),
        ("/d L", r"dim '/d' of '/d L' has an empty name"),
        ("B-1 L", r"name 'B-1' is not an identifier or a number"),
        ("2/t", r"a numeric dim has a fixed size and cannot be sharded"),
    ],
)
def test_parse_errors(text, message):
    with pytest.raises(ValueError, match=message):
        parse_spec(text)


def test_parse_transition():
    tr = parse_transition("B/d L F/t, M F/t -> B/d L M")
    assert [s.text for s in tr.inputs] == ["B/d L F/t", "M F/t"]
    assert tr.output.text == "B/d L M"
    for bad in ("B/d L M", "A -> B -> C"):
        with pytest.raises(ValueError, match="exactly one '->'"):
            parse_transition(bad)
    with pytest.raises(ValueError, match="unknown mesh axis 'q'"):
        parse_transition("M/q -> M")


def test_local_and_global_shape():
    spec = "B/d/e L M/t"
    assert local_shape(spec, (12, 5, 8), MESH) == (2, 5, 2)
    assert local_shape(spec, {"B": 12, "L": 5, "M": 8}, MESH) == (2, 5, 2)
    assert global_shape(spec, (2, 5, 2), MESH) == (12, 5, 8)
    # A Mesh-like object with axis_sizes works in place of the mapping.
    mesh_like = type("M", (), {"axis_sizes": MESH})()
    assert local_shape(spec, (12, 5, 8), mesh_like) == (2, 5, 2)


def test_local_shape_errors():
    with pytest.raises(ValueError, match=r"dim M of 'M/t/d': global size 50 does not split evenly over t=4\*d=2 = 8"):
        local_shape("M/t/d", (50,), MESH)
    with pytest.raises(ValueError, match=r"global_shape has 2 sizes but spec 'B L M' has 3 dims"):
        local_shape("B L M", (2, 3), MESH)
    with pytest.raises(ValueError, match=r"global_shape lacks sizes for dims \['M'\]"):
        local_shape("B L M", {"B": 1, "L": 2}, MESH)
    with pytest.raises(ValueError, match=r"uses mesh axes \['t'\] that axis_sizes"):
        local_shape("M/t", (8,), {"d": 1})


def test_check_shape():
    x = torch.zeros(2, 3, 12)
    check_shape("B/d L M/t", x, {"d": 1, "e": 1, "t": 2})  # no global sizes: only the rank is checked
    check_shape("B/d L M/t", x, {"d": 1, "e": 1, "t": 2}, M=24, B=2)
    with pytest.raises(ValueError, match=r"^dim M of 'B/d L M/t': local size 12 is not global 48 / t=2 = 24$"):
        check_shape("B/d L M/t", x, {"d": 1, "e": 1, "t": 2}, M=48)
    with pytest.raises(ValueError, match=r"dim L of 'B/d L M/t': local size 3 is not global 4 \(dim not sharded\)"):
        check_shape("B/d L M/t", x, {"d": 1, "e": 1, "t": 2}, L=4)
    with pytest.raises(ValueError, match=r"spec 'B/d L M/t' has 3 dims but the tensor has 2: shape \(2, 3\)"):
        check_shape("B/d L M/t", (2, 3), {"d": 1, "e": 1, "t": 2})
    with pytest.raises(ValueError, match=r"global_sizes names \['Q'\] that are not dims"):
        check_shape("B/d L M/t", x, {"d": 1, "e": 1, "t": 2}, Q=1)
