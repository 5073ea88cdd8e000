"""Agreement across ranks: the same layer everywhere, the same tokens along 't', the same replicas.

Ranks that disagree do not fail by themselves: a different top_k, hidden size, dtype, ffn_size,
capacity_factor or num_experts gives garbage or NaN on the shared-memory path, a wrong aux loss,
a hang or a C++ abort in gloo; t-peers given different tokens give outputs off by tenths; a gate
seeded per rank gives a different model on every rank. These checks turn each into one
RankMismatchError, raised on every rank alike (every rank reads the same gathered table), that
names the setting and the ranks:

  settings    every rank's layer settings (config, dtype, row width, mesh) as int64 words
              (settings_words), compared across the whole mesh by check_settings. They ride on
              the forward's counts all-gather (dispatch.plan_dispatch), and once per layer on a
              fixed-size all-gather before the first forward (ExpertParallel), because the counts
              row has E + 2 words and ranks that disagree on E cannot share one all-gather.
  t-peers     the ranks along 't' must hold the same tokens (tokens are split over the (d, e)
              coordinate and replicated over 't'): each rank adds its token count, checksum(x) and
              checksum(top-k choices) to the counts row, and check_t_peers compares them (equal
              tokens routed differently mean the gate differs along 't').
  replicas    a parameter whose gradient sync_grads sums over axes A holds the same value on the
              ranks along A (else the summed gradient belongs to no model): check_replicas, at a
              module's first sync_grads and every REPLICA_CHECK_EVERY-th after; the router (and
              the shared expert) also at each layer's first forward and every
              REPLICA_CHECK_EVERY-th after, so that replicas that drift apart are caught.
  calls       every rank of the mesh enters the same collective call of the same layer: handshake,
              one all-gather of a row naming the call and its MoE layers before its payload, so
              that a rank in sync_grads while another runs a forward raises, naming both calls and
              their ranks, where the payloads' different sizes would abort the process inside
              gloo; and so that two layers of the same settings called in another order on one
              rank raise, naming both layers, where their payloads would fit and the outputs and
              gradients come out silently wrong. A layer is named by its number (layer_number):
              the order in which a rank built it among the layers on the mesh's ranks, the same on
              every rank that builds the same model.

checksum is exact and order-sensitive: sum_i (i mod 65521 + 1) * word_i over the tensor's bytes
read as int16 words (uint8 for 1-byte dtypes), in int64 (no overflow below 2^32 words). Bitwise
equal tensors give equal sums on any thread count, unlike a floating-point sum.
"""
from __future__ import annotations

import itertools
import struct

import torch

from shardmoe.parallel import shardops
from shardmoe.moe.config import EXPERT_KINDS, GLU_ACTIVATIONS, SCORE_FUNCS
from shardmoe.notation import MESH_AXES
from shardmoe.parallel.exchange import ExchangeError

_STRINGS = EXPERT_KINDS + GLU_ACTIVATIONS + SCORE_FUNCS  # GLU_ACTIVATIONS: every activation name
_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
# (tag, payload) per setting, so that a rank can print the values the other ranks sent
_NONE, _INT, _FLOAT, _STRING, _DTYPE = range(5)
_CHECKSUM_PERIOD = 65521  # weights cycle through 1..65521: |int16 word * weight| < 2^31


# How often the replicated parameters are compared again (sync_grads' default check_every, and the
# forwards between a layer's agreement checks): a checksum of each and one small all-gather, a
# few hundredths of a percent of a step at this interval (docs/parallel.md).
REPLICA_CHECK_EVERY = 100

# The collective calls whose ranks handshake first, by the code the handshake sends: a MoE layer's
# forward, its backward, sync_grads of a module, the gather of a sharded parameter of a layer.
CALLS = ("forward", "backward", "sync_grads", "gather")

# per mesh (its global ranks in mesh order): the number the next MoE layer built on it gets
_LAYERS_BUILT: dict[tuple[int, ...], "itertools.count[int]"] = {}


class RankMismatchError(ValueError):
    """Ranks that must agree (on a layer's settings, their tokens, a replicated parameter, the
    collective call they are in) do not."""


def layer_number(mesh) -> int:
    """The number of a MoE layer being built on `mesh`: how many layers this process built on the
    same ranks before it (0, 1, ...). Ranks that build the same model build its layers in the same
    order, so a number names the same layer on every rank; a deep copy of a layer is a layer of its
    own, built when copied (the next number)."""
    return next(_LAYERS_BUILT.setdefault(tuple(mesh.ranks_along(MESH_AXES)), itertools.count()))


def handshake(mesh, call: str, layers=(), again: bool = False) -> None:
    """Before the collectives of `call` (one of CALLS) of the MoE layers numbered `layers` (one for a
    layer's forward, backward or gather; those the module holds for sync_grads): an all-gather of
    one int64 row (the call's code, the number of layers, the first and last number, `again`:
    sync_grads of a module with no backward since its last) over the whole mesh; RankMismatchError
    on every rank unless every rank sent the same, e.g. 'ranks are in different collective calls:
    rank 0 has 'the forward of MoE layer 1', rank 1 has 'the forward of MoE layer 0''. A rank that
    never arrives ends in gather_table's ExchangeError at the timeout."""
    if mesh.size() == 1:
        return
    numbers = sorted(layers)
    row = [CALLS.index(call), len(numbers), numbers[0] if numbers else -1, numbers[-1] if numbers else -1, int(again)]
    device = "cuda" if mesh.device_mesh is not None and mesh.device_mesh.device_type == "cuda" else "cpu"
    table = gather_table(torch.tensor(row, dtype=torch.int64, device=device), mesh,
                         f"{describe_call(*row)} (its handshake)").tolist()
    if any(r != table[0] for r in table):
        names = [repr(describe_call(*r)) for r in table]
        raise RankMismatchError(
            f"ranks are in different collective calls: {by_value(names, mesh.ranks_along(MESH_AXES))}: every rank "
            "of the mesh must make the same shardmoe calls in the same order (the forward and backward of the same "
            "layers, in the same order; sync_grads of the same module on every rank after the same backward). A "
            "MoE layer's number is the order in which the rank built it among the layers on these ranks, from 0: "
            "every rank must build the same layers in the same order")


def describe_call(code: int, count: int, first: int, last: int, again: int = 0) -> str:
    """A handshake row in words: 'the forward of MoE layer 3', 'sync_grads of a module holding MoE
    layers 0 to 3 (4 layers)', '... again, with no backward since its last'."""
    if not 0 <= code < len(CALLS):
        return f"unknown call {code}"
    layers = ("no MoE layer" if count == 0 else f"MoE layer {first}" if count == 1 else
              f"MoE layers {first} to {last} ({count} layers)")
    return {"forward": f"the forward of {layers}", "backward": f"the backward of {layers}",
            "sync_grads": f"sync_grads of a module holding {layers}",
            "gather": f"the gather of a sharded parameter of {layers}"}[CALLS[code]] + \
        (", again with no backward since its last" if again else "")


def checksum(t: torch.Tensor) -> int:
    """Exact, order-sensitive checksum of a tensor's bytes (see the module docstring). The weight of
    word i depends on i mod 65521 only, so the words are summed per residue first, in int64 (each
    column's sum of at most n / 65521 int16 words), and the 65521 column sums are weighted once:
    the same value as weighting every word, without an int64 copy of the tensor."""
    flat = t.detach().contiguous().view(-1)
    words = flat.view(torch.uint8 if flat.element_size() == 1 else torch.int16)
    weights = torch.arange(1, _CHECKSUM_PERIOD + 1, dtype=torch.int64, device=words.device)
    whole = words.numel() // _CHECKSUM_PERIOD * _CHECKSUM_PERIOD
    columns = words[:whole].view(-1, _CHECKSUM_PERIOD).sum(0, dtype=torch.int64)
    tail = words[whole:].to(torch.int64)
    return int((columns * weights).sum() + (tail * weights[:tail.numel()]).sum())


def layer_settings(config, mesh, dtype: torch.dtype) -> dict:
    """What every rank's copy of one sharded MoE layer must agree on."""
    settings = {}
    for name, field in config.__dataclass_fields__.items():
        value = getattr(config, name)
        # an int given for a float option (capacity_factor=1) is the same setting as its float
        settings[name] = float(value) if "float" in str(field.type) and value is not None else value
    settings.update(dtype=dtype, row_bytes=config.hidden_size * torch.empty((), dtype=dtype).element_size(),
                    dp=mesh.size("d"), ep=mesh.size("e"), tp=mesh.size("t"), ranks_per_node=mesh.ranks_per_node)
    return settings


def settings_words(settings: dict) -> torch.Tensor:
    """[2 * len(settings)] int64: (tag, payload) per setting, in the dict's order."""
    words = []
    for value in settings.values():
        if value is None:
            words += [_NONE, 0]
        elif isinstance(value, (bool, int)):
            words += [_INT, int(value)]
        elif isinstance(value, float):
            words += [_FLOAT, struct.unpack("<q", struct.pack("<d", value))[0]]
        elif isinstance(value, str):
            words += [_STRING, _STRINGS.index(value)]
        elif isinstance(value, torch.dtype):
            words += [_DTYPE, _DTYPES.index(value) if value in _DTYPES else -1]
        else:
            raise TypeError(f"settings_words: cannot encode {value!r}")
    return torch.tensor(words, dtype=torch.int64)


def gather_table(row: torch.Tensor, mesh, what: str) -> torch.Tensor:
    """All-gather one int64 row [C] from every rank of the mesh -> [W, C], row i from the rank of
    mesh index i (coord(MESH_AXES, rank); the global rank for a Mesh(dp, ep, tp) of the world).
    Collective over all axes; every rank passes the same C."""
    spec = "R/" + "/".join(MESH_AXES) + " C -> R C"
    try:
        return shardops.all_gather(spec, row.view(1, -1), mesh)
    except RuntimeError as err:
        raise ExchangeError(f"{what} over the whole mesh failed on rank {mesh.rank}: a peer failed, hung or left; "
                            f"cause: {err}") from err


def check_settings(table: torch.Tensor, names, what: str, mesh) -> None:
    """table [W, 2 * len(names)]: every rank's settings_words (gather_table's rows). Raise
    RankMismatchError listing every setting on which the ranks differ, e.g. 'top_k: rank 0 has 2,
    rank 1 has 3' (global ranks)."""
    problems = []
    ranks = mesh.ranks_along(MESH_AXES)  # the global rank of each row
    for i, name in enumerate(names):
        column = table[:, 2 * i : 2 * i + 2]
        if bool((column != column[0]).any()):
            values = [_decode(int(tag), int(payload)) for tag, payload in column.tolist()]
            problems.append(f"{name}: {by_value(values, ranks)}")
    if problems:
        raise RankMismatchError(f"{what} differ across ranks (every rank must build the same model, from the same "
                                "options and dtype, on the same mesh): " + "; ".join(problems))


def check_t_peers(table: torch.Tensor, mesh) -> None:
    """table [W, 4 + E]: each rank's token count, checksums of its tokens and of its top-k choices,
    its sequences and selections per expert. The ranks along 't' hold the same tokens and the same gate, so they
    must agree on all of it."""
    for group in _groups_along(mesh, "t"):
        rows = table[_rows(mesh, group)]
        coords = mesh.coords(group[0])
        where = f"ranks {', '.join(map(str, group))} (coordinate d={coords['d']}, e={coords['e']})"
        if bool((rows[:, :2] != rows[0, :2]).any()):
            tokens = [f"{int(s)} tokens with checksum {int(c)}" for s, c in rows[:, :2].tolist()]
            raise RankMismatchError(
                f"the ranks along mesh axis 't' hold different tokens: {by_value(tokens, group)}, on {where}. "
                "Rule: tokens are split over the (d, e) coordinate and replicated over 't', so ranks with the same "
                "(d, e) must get the same rows (split the data by mesh.coord(('d', 'e')), not by the global rank)")
        if bool((rows[:, 2:] != rows[0, 2:]).any()):  # same tokens, other choices
            raise RankMismatchError(
                f"the ranks along mesh axis 't' route the same tokens differently on {where}: their router differs "
                "(gate_weight or gate_bias; the correction bias is compared before this): it must be replicated on "
                "every rank: build the layer from the same seed everywhere and step every rank's optimizer alike")


def check_replicas(named: list[tuple[str, tuple[str, ...]]], table: torch.Tensor, mesh, what: str) -> None:
    """table [W, P]: every rank's checksum of P parameters, named with the axes along which each
    holds the same value. Raise RankMismatchError naming the first parameter and ranks that differ."""
    for i, (name, axes) in enumerate(named):
        for group in _groups_along(mesh, axes):
            values = table[_rows(mesh, group), i]
            if bool((values != values[0]).any()):
                raise RankMismatchError(
                    f"{what}: parameter {name!r} must hold the same value on ranks {', '.join(map(str, group))} "
                    f"(replicated along mesh axes {axes}), but differs: {by_value(values.tolist(), group, 'checksum')}"
                    "; initialise it from the same seed (or load the same weights) on every rank")


def _groups_along(mesh, axes) -> list[list[int]]:
    """The groups of global ranks of the mesh that differ only in their coordinates along axes."""
    seen, groups = set(), []
    for rank in mesh.ranks_along(MESH_AXES):
        if rank not in seen:
            group = mesh.ranks_along(axes, rank) if axes else [rank]
            seen.update(group)
            groups.append(group)
    return groups


def _rows(mesh, ranks: list[int]) -> list[int]:
    """The rows of a gathered table that global ranks own (their mesh indices)."""
    return [mesh.coord(MESH_AXES, r) for r in ranks]


def by_value(values: list, ranks, noun: str = "") -> str:
    """'rank 0 has 2, ranks 1, 3 have 3' (ranks grouped by value, in order of first appearance)."""
    grouped: dict = {}
    for rank, value in zip(ranks, values):
        grouped.setdefault(value if isinstance(value, (int, str)) else repr(value), []).append(rank)
    noun = f"{noun} " if noun else ""
    parts = []
    for value, members in grouped.items():
        who = f"rank {members[0]} has" if len(members) == 1 else f"ranks {', '.join(map(str, members))} have"
        parts.append(f"{who} {noun}{value}")
    return ", ".join(parts)


def _decode(tag: int, payload: int):
    if tag == _NONE:
        return "None"
    if tag == _FLOAT:
        return repr(struct.unpack("<d", struct.pack("<q", payload))[0])
    if tag == _STRING:
        return repr(_STRINGS[payload])
    if tag == _DTYPE:
        return str(_DTYPES[payload]) if payload >= 0 else "another dtype"
    return str(payload)
