"""Ranks that must agree but do not get one RankMismatchError, on every rank, naming the ranks and
what differs: layer settings (checked before the first forward and in every forward's counts
exchange), the tokens of the ranks along 't', and replicated parameters (the gate at the first
forward, every parameter along its grad-sync axes at the first sync_grads).

One spawned 2-rank world runs every scenario; each builds a fresh Mesh (a failure breaks the
mesh's exchange for good) and returns the error messages, which the parent checks rank by rank.
Before these checks the same scenarios gave garbage or NaN, a hang, or a gloo abort.
"""
import time

import pytest
import torch
import torch.distributed as dist

import shardmoe
from shardmoe.mesh import Mesh
from shardmoe.parallel import sync_grads
from shardmoe.parallel.consistency import RankMismatchError
from shardmoe.testing import run_distributed

H, FFN, E, K = 8, 12, 4, 2
# setting -> (MoE keyword arguments of rank 0, those of rank 1): one setting differs in each
SETTINGS = {
    "top_k": (dict(top_k=2), dict(top_k=3)),
    "hidden_size": (dict(hidden_size=8), dict(hidden_size=16)),
    "dtype": (dict(dtype=torch.float32), dict(dtype=torch.float64)),
    "ffn_size": (dict(ffn_size=12), dict(ffn_size=16)),
    "capacity_factor": (dict(capacity_factor=None), dict(capacity_factor=1.25)),
    "num_experts": (dict(num_experts=4), dict(num_experts=8)),
    "score_func": (dict(score_func="softmax"), dict(score_func="sigmoid")),
}
EXPECTED = {
    "top_k": "top_k: rank 0 has 2, rank 1 has 3",
    "hidden_size": "hidden_size: rank 0 has 8, rank 1 has 16",
    "dtype": "dtype: rank 0 has torch.float32, rank 1 has torch.float64; row_bytes: rank 0 has 32, rank 1 has 64",
    "ffn_size": "ffn_size: rank 0 has 12, rank 1 has 16",
    "capacity_factor": "capacity_factor: rank 0 has None, rank 1 has 1.25",
    "num_experts": "num_experts: rank 0 has 4, rank 1 has 8",
    "score_func": "score_func: rank 0 has 'softmax', rank 1 has 'sigmoid'",
}


def _moe(mesh, seed: int = 0, **overrides):
    kw = dict(hidden_size=H, ffn_size=FFN, num_experts=E, top_k=K, mesh=mesh)
    kw.update(overrides)
    torch.manual_seed(seed)
    return shardmoe.MoE(kw.pop("hidden_size"), kw.pop("ffn_size"), kw.pop("num_experts"), kw.pop("top_k"), **kw)


def _step(layer, x) -> None:
    (layer(x).sum() + layer.aux_loss).backward()


_ERROR_SECONDS: list[float] = []  # per rank process: how long each failing step took to raise


def _error(run) -> str:
    start = time.monotonic()
    with pytest.raises(RankMismatchError) as info:
        run()
    _ERROR_SECONDS.append(time.monotonic() - start)
    return str(info.value)


def _settings_differ(name: str) -> str:
    """ep=2: rank 1 builds its layer with one other setting; the first forward must refuse."""
    layer = _moe(Mesh(ep=2), **SETTINGS[name][dist.get_rank()])
    x = torch.randn(5, layer.config.hidden_size, dtype=layer.gate_weight.dtype)
    return _error(lambda: _step(layer, x))


def _dtype_changes_after_the_first_step() -> str:
    """The counts exchange of every forward carries the settings: rank 1 casts its layer to float64
    after a good step (the check before the first forward has passed)."""
    layer = _moe(Mesh(ep=2))
    _step(layer, torch.randn(5, H))
    if dist.get_rank() == 1:
        layer.double()
    return _error(lambda: _step(layer, torch.randn(5, H, dtype=layer.gate_weight.dtype)))


def _t_peers_get_different_tokens() -> str:
    """tp=2: the data split by global rank gives the two t-peers different rows."""
    layer = _moe(Mesh(tp=2))
    x = torch.randn(6, H, generator=torch.Generator().manual_seed(dist.get_rank()))
    return _error(lambda: _step(layer, x))


def _t_peers_gates_drift() -> str:
    """tp=2, same tokens: rank 1's gate changes after the first step; the t-peers route differently."""
    layer = _moe(Mesh(tp=2))
    x = torch.randn(6, H, generator=torch.Generator().manual_seed(0))
    _step(layer, x)
    if dist.get_rank() == 1:
        with torch.no_grad():
            layer.gate_weight.mul_(-1)
    return _error(lambda: _step(layer, x))


def _router_biases_differ(name: str) -> str:
    """ep=2: rank 1's router bias, correction bias or a shared-expert tensor differs; the first forward
    must refuse."""
    layer = _moe(Mesh(ep=2), router_bias=True, correction_bias=True, shared_ffn_size=4, shared_gate=True)
    if dist.get_rank() == 1:
        with torch.no_grad():
            getattr(layer, name).add_(0.5)
    return _error(lambda: _step(layer, torch.randn(5, H)))


def _correction_bias_drifts(how: str, tp: int = 1) -> str:
    """ep=2 (or tp=2, the same tokens): the correction bias agrees at the first forward, then drifts
    apart on one rank (nudged, or updated from each rank's local load instead of the global one);
    the next forward refuses, naming the bias."""
    layer = _moe(Mesh(ep=2 // tp, tp=tp), correction_bias=True)
    x = torch.randn(6, H, generator=torch.Generator().manual_seed(dist.get_rank() if tp == 1 else 0))
    _step(layer, x)
    if how == "nudged" and dist.get_rank() == 1:
        with torch.no_grad():
            layer.correction_bias[0] += 1e-3
    if how == "local load":
        layer.update_correction_bias(layer.stats["selected_per_expert"] + dist.get_rank() * torch.arange(E))
    return _error(lambda: _step(layer, x))


def _gate_seeded_per_rank() -> str:
    """ep=2: each rank seeds its layer with its own rank; the gates differ."""
    layer = _moe(Mesh(ep=2), seed=dist.get_rank())
    return _error(lambda: _step(layer, torch.randn(5, H)))


class _Model(torch.nn.Module):
    def __init__(self, mesh):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(H, H)
        self.moe = _moe(mesh)

    def forward(self, x):
        return self.moe(self.proj(x))


def _replicas_differ_at_sync(parameter: str, dp: int, ep: int) -> str:
    """Rank 1 changes one parameter that sync_grads sums (the gate agrees, so a forward runs); the
    first sync_grads must name it."""
    mesh = Mesh(dp=dp, ep=ep)
    model = _Model(mesh)
    if dist.get_rank() == 1:
        with torch.no_grad():
            model.get_parameter(parameter).add_(1.0)
    model(torch.randn(5, H)).sum().backward()
    return _error(lambda: sync_grads(model, mesh))


def _modules_differ_at_sync() -> str:
    """Rank 1's model has one more parameter: sync_grads' buckets would not match (a gloo abort)."""
    mesh = Mesh(ep=2)
    model = _Model(mesh)
    if dist.get_rank() == 1:
        model.extra = torch.nn.Parameter(torch.zeros(3))
    model(torch.randn(5, H)).sum().backward()
    return _error(lambda: sync_grads(model, mesh))


def _refusal(run) -> str | None:
    """The message of the RankMismatchError that run raises, or None when it runs through (the
    parent's assertion then fails, not this world)."""
    start = time.monotonic()
    try:
        run()
    except RankMismatchError as err:
        _ERROR_SECONDS.append(time.monotonic() - start)
        return str(err)
    return None


def _layers_called_in_other_orders() -> dict:
    """Two layers of the same settings whose routers are equal (so that every payload of the two
    fits the other's and, unchecked, nothing fails: the outputs and gradients come out silently
    wrong) and whose experts are not; rank 1 calls them in the other order: in the forward, in the
    backward through separate losses (on a fresh mesh: a refusal inside a layer breaks its mesh's
    exchange), and in sync_grads of one layer each. Each call must be refused on both ranks,
    naming both layers by number."""
    swapped = dist.get_rank() == 1
    x = torch.randn(6, H, generator=torch.Generator().manual_seed(dist.get_rank()))
    out = {}
    for call in ("forward", "backward"):
        mesh = Mesh(ep=2)
        first, second = _moe(mesh, seed=0), _moe(mesh, seed=1)
        with torch.no_grad():
            second.gate_weight.to_local().copy_(first.gate_weight.to_local())
        out[f"{call} numbers"] = [first.placement.dispatcher.number, second.placement.dispatcher.number]
        if call == "forward":
            out[call] = _refusal(lambda: [layer(x) for layer in ((second, first) if swapped else (first, second))])
        else:
            losses = [layer(x).sum() for layer in (first, second)]  # the same order on both ranks
            out[call] = _refusal(lambda: [loss.backward() for loss in (losses[::-1] if swapped else losses)])
    out["sync_grads numbers"] = out["backward numbers"]
    out["sync_grads"] = _refusal(lambda: sync_grads(second if swapped else first, mesh))
    return out


def _agreement_world() -> dict:
    rank = dist.get_rank()
    out = {f"settings {name}": _settings_differ(name) for name in SETTINGS}
    out["dtype after a step"] = _dtype_changes_after_the_first_step()
    out["t tokens"] = _t_peers_get_different_tokens()
    out["t gates"] = _t_peers_gates_drift()
    out["gate per rank"] = _gate_seeded_per_rank()
    out["correction bias drift"] = {how: _correction_bias_drifts(how) for how in ("nudged", "local load")}
    # with t=2 the t-peers' routing check sees the drift too and blames gate_weight: the correction
    # bias's own check in the counts exchange must name it first
    out["correction bias drift"]["nudged, tp=2"] = _correction_bias_drifts("nudged", tp=2)
    out["router biases"] = {name: _router_biases_differ(name) for name in ("gate_bias", "correction_bias",
                                                                           "shared_down_proj", "shared_gate_weight")}
    out["dense per rank"] = _replicas_differ_at_sync("proj.weight", dp=1, ep=2)
    out["experts per d rank"] = _replicas_differ_at_sync("moe.gate_up_proj", dp=2, ep=1)
    out["modules differ"] = _modules_differ_at_sync()
    out["layer order"] = _layers_called_in_other_orders()
    # A layer whose ranks agree (a zero-token rank included) still runs, and syncs, after all that.
    mesh = Mesh(ep=2)
    model = _Model(mesh)
    model(torch.randn(0 if rank == 0 else 7, H)).sum().backward()
    sync_grads(model, mesh)
    out["agreeing model gate grad"] = model.moe.gate_weight.grad.to_local()
    out["slowest error seconds"] = max(_ERROR_SECONDS)
    return out


@pytest.fixture(scope="module")
def messages():
    return run_distributed(_agreement_world, 2, timeout=120, collective_timeout=20)


def test_every_rank_raises_the_same_error_at_once(messages):
    for key, text in messages[0].items():
        if isinstance(text, str):
            assert messages[1][key] == text, key
    # no wait for a timeout: one all-gather (collective_timeout is 20 s)
    assert max(m["slowest error seconds"] for m in messages) < 5.0


@pytest.mark.parametrize("name", SETTINGS)
def test_a_differing_setting_is_named_with_the_ranks(messages, name):
    text = messages[0][f"settings {name}"]
    assert text.startswith("MoE layer settings differ across ranks"), text
    assert EXPECTED[name] in text, text


def test_the_counts_exchange_of_every_forward_carries_the_settings(messages):
    assert EXPECTED["dtype"] in messages[0]["dtype after a step"]


def test_t_peers_with_different_tokens_are_told_the_rule(messages):
    text = messages[0]["t tokens"]
    assert "the ranks along mesh axis 't' hold different tokens: rank 0 has 6 tokens with checksum" in text, text
    assert "rank 1 has 6 tokens with checksum" in text and "ranks 0, 1 (coordinate d=0, e=0)" in text, text
    assert "tokens are split over the (d, e) coordinate and replicated over 't'" in text, text
    assert "route the same tokens differently on ranks 0, 1" in messages[0]["t gates"]


def test_replicated_parameters_that_differ_are_named(messages):
    assert "MoE layer: parameter 'gate_weight' must hold the same value on ranks 0, 1" in messages[0]["gate per rank"]
    assert len(messages[0]["router biases"]) == 4
    for name, text in messages[0]["router biases"].items():
        assert f"MoE layer: parameter '{name}' must hold the same value on ranks 0, 1" in text, text
        assert messages[1]["router biases"][name] == text
    dense = messages[0]["dense per rank"]
    assert "sync_grads: parameter 'proj.weight' must hold the same value on ranks 0, 1 (replicated along mesh " \
           "axes ('e',))" in dense, dense
    experts = messages[0]["experts per d rank"]
    assert "sync_grads: parameter 'moe.gate_up_proj' must hold the same value on ranks 0, 1 (replicated along " \
           "mesh axes ('d',))" in experts, experts
    assert "rank 0 has checksum" in experts and "rank 1 has checksum" in experts
    modules = messages[0]["modules differ"]
    assert modules.startswith("the parameters of _Model differ across ranks"), modules
    assert "number of parameters: rank 0 has 5, rank 1 has 6" in modules, modules


def test_a_correction_bias_that_drifts_apart_is_refused_at_the_next_forward(messages):
    """It was never noticed: the ranks routed with different biases for the rest of the run."""
    for how, text in messages[0]["correction bias drift"].items():
        assert "correction_bias (checksum of the buffer; update it on every rank from the same global load" in text, \
            (how, text)
        assert "rank 0 has" in text and "rank 1 has" in text and "gate_weight" not in text, text
        assert messages[1]["correction bias drift"][how] == text
    assert len(messages[0]["correction bias drift"]) == 3


def test_agreeing_ranks_with_a_zero_token_rank_still_train(messages):
    grads = [m["agreeing model gate grad"] for m in messages]
    assert torch.equal(grads[0], grads[1]) and grads[0].abs().sum() > 0


@pytest.mark.parametrize("call", ["forward", "backward", "sync_grads"])
def test_layers_called_in_another_order_on_one_rank_are_refused_naming_both(messages, call):
    """Unchecked, the forward's outputs were off by tenths and the gradients by more, with no error:
    the handshake named the kind of call, not the layer."""
    first, second = messages[0]["layer order"][f"{call} numbers"]
    assert messages[1]["layer order"][f"{call} numbers"] == [first, second] and first != second
    text = messages[0]["layer order"][call]
    kind = {"forward": "the forward of", "backward": "the backward of", "sync_grads": "sync_grads of a module holding"}
    assert text is not None, f"the {call} of two layers in another order on rank 1 ran through"
    assert text.startswith(f"ranks are in different collective calls: rank 0 has '{kind[call]} MoE layer {first}', "
                           f"rank 1 has '{kind[call]} MoE layer {second}'"), text
    assert "every rank must build the same layers in the same order" in text, text
    assert messages[1]["layer order"][call] == text
