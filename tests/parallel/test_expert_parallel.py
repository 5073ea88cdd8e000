"""Expert and expert-tensor parallelism against the single-process float64 reference.

Two spawned gloo worlds carry every distributed check (spawning costs seconds):
  4 ranks: ep=4, ep2 x tp2, dp2 x ep2, each on all-P2P, mixed and all-remote topologies, the
           layer configurations of CONFIGS each (glu dropless with aux + z loss and a rank without tokens;
           mlp with biases, a nonlinear output activation and capacity drops; every token routed
           to one rank's experts, with capacity; every router option; GPT-OSS's biased clamped-SwiGLU
           experts with its router), plus the raw row exchange with heap growth.
  2 ranks: ep=2 (P2P and remote), tp=2, dp=2, a worked tp=2 example, bad configurations,
           and the distributed benchmark (shardmoe/tools/bench/distributed.py) on tiny shapes.
The parent computes every expected value with shardmoe.moe.reference (plain autograd, float64):
outputs and input gradients of the concatenation of all ranks' tokens; the gate gradient of each
rank's share of the loss; expert shard gradients of each d slice's tokens; after sync_grads, the
gradients of the whole loss. Relative error bar 1e-10; topologies must agree bit for bit.
"""
import json
import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardmoe
from shardmoe.mesh import Mesh
from shardmoe.moe.composition import local
from shardmoe.moe.config import MoEConfig
from shardmoe.moe.reference import reference_forward_backward, reference_moe, reference_routing
from shardmoe.parallel import sync_grads
from shardmoe.parallel import expert_tensor as etp
from shardmoe.parallel.exchange import RowExchange
from shardmoe.testing import run_distributed
from shardmoe.tools.bench import distributed as distributed_bench

TOL = 1e-10
H, FFN = 8, 12
CONFIGS = {
    "glu_dropless_aux": dict(ffn_size=FFN, num_experts=8, top_k=2, aux_loss_coef=0.05, z_loss_coef=0.01),
    "mlp_bias_capacity": dict(ffn_size=FFN, num_experts=4, top_k=2, expert="mlp", activation="gelu",
                              output_activation="gelu_tanh", bias=True, renormalize=False, capacity_factor=0.5),
    "one_block_capacity": dict(ffn_size=FFN, num_experts=8, top_k=2, capacity_factor=1.0, aux_loss_coef=0.05),
    # every router option at once: sigmoid, router and correction biases, 4 groups choose 2, epsilon,
    # scaling, aux + z + sequence-wise losses (each rank's tokens are one sequence), capacity drops
    "deepseek_router": dict(ffn_size=FFN, num_experts=8, top_k=2, score_func="sigmoid", router_bias=True,
                            correction_bias=True, n_group=4, topk_group=2, renormalize_epsilon=1e-20,
                            routed_scaling_factor=2.5, aux_loss_coef=0.05, z_loss_coef=0.01, seq_aux_loss_coef=0.3,
                            capacity_factor=1.0),
    # GPT-OSS's experts: biased glu with the clamped SwiGLU (a limit h ~ N(0, 1.3) crosses), its router
    "gpt_oss_experts": dict(ffn_size=FFN, num_experts=8, top_k=2, bias=True, activation="clamped_swiglu",
                            swiglu_limit=1.0, swiglu_alpha=1.5, router_bias=True, aux_loss_coef=0.05),
    # a gated shared expert (dense, on the tokens' own rank, sliced over 't') beside a sigmoid
    # group-limited router with correction bias
    "shared_expert": dict(ffn_size=FFN, num_experts=8, top_k=2, score_func="sigmoid", correction_bias=True, n_group=4,
                          topk_group=2, routed_scaling_factor=2.5, aux_loss_coef=0.05, shared_ffn_size=6,
                          shared_gate=True),
}
LAYER_OPTIONS = ("score_func", "router_bias", "correction_bias", "n_group", "topk_group", "renormalize_epsilon",
                 "routed_scaling_factor", "seq_aux_loss_coef", "swiglu_limit", "swiglu_alpha", "shared_ffn_size",
                 "shared_gate")
TOKENS = {1: [10], 2: [0, 11], 4: [5, 0, 7, 4]}  # tokens per token-parallel rank (d, e); one holds none


# -- inputs and references (parent) ------------------------------------------------------------


def _case(name: str, layout: tuple[int, int, int], seed: int) -> dict:
    kw = dict(CONFIGS[name])
    config = MoEConfig(H, kw.pop("ffn_size"), kw.pop("num_experts"), kw.pop("top_k"), **kw)
    counts = TOKENS[layout[0] * layout[1]]
    gen = torch.Generator().manual_seed(seed)
    S, E = sum(counts), config.num_experts

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale

    x = randn(S, H)
    params = {"gate_weight": randn(H, E)}
    if name == "one_block_capacity":
        # A large positive feature and gate column 0, 1 make experts 0 and 1 (peer 0's block under
        # any ep dividing 4) every token's top 2.
        x[:, 0] = 4.0 + torch.rand(S, generator=gen, dtype=torch.float64)
        params["gate_weight"] = randn(H, E, scale=0.1)
        params["gate_weight"][0, :2] = torch.tensor([2.0, 1.6], dtype=torch.float64)
    for pname, shape in _all_shapes(config).items():
        params[pname] = randn(*shape, scale=0.4)
    if config.router_bias:
        params["gate_bias"] = randn(E)
    correction = randn(E, scale=0.2).float() if config.correction_bias else None
    return dict(name=name, layout=layout, config=config, counts=counts, x=x, params=params, grad_out=randn(S, H),
                correction_bias=correction)


def _reference_extras(case: dict) -> dict:
    """correction_bias (float64) and the sequence starts (each rank's tokens, if any, are one) of
    the reference run on the concatenation."""
    bias = case["correction_bias"]
    starts = [o for o, c in zip(_offsets(case["counts"]), case["counts"]) if c]
    return dict(correction_bias=None if bias is None else bias.double(), sequence_starts=starts)


def _whole_shapes(config: MoEConfig) -> dict:
    E, F_ = config.num_experts, config.ffn_size
    if config.expert == "glu":
        shapes = {"gate_up_proj": (E, 2 * F_, H), "down_proj": (E, H, F_)}
        if config.bias:
            shapes.update(gate_up_proj_bias=(E, 2 * F_), down_proj_bias=(E, H))
        return shapes
    shapes = {"w1": (E, F_, H), "w2": (E, H, F_)}
    if config.bias:
        shapes.update(b1=(E, F_), b2=(E, H))
    return shapes


def _all_shapes(config: MoEConfig) -> dict:
    """The routed experts' whole shapes, then the shared expert's."""
    shapes = _whole_shapes(config)
    if config.shared_ffn_size:
        shapes.update(shared_gate_up_proj=(2 * config.shared_ffn_size, H), shared_down_proj=(H, config.shared_ffn_size))
    if config.shared_gate:
        shapes["shared_gate_weight"] = (H,)
    return shapes


def _share_grads(case: dict, mask: torch.Tensor) -> tuple[float, dict]:
    """Float64 autograd of one share of the loss: the outputs of the masked tokens times their
    output gradient, plus the masked tokens' share of the global aux + z loss (global counts)."""
    config, params = case["config"], case["params"]
    leaves = {n: p.detach().clone().requires_grad_(True) for n, p in params.items()}
    x, extras = case["x"], _reference_extras(case)
    out, _ = reference_moe(x, leaves, config, **extras)
    routing = reference_routing(x, leaves["gate_weight"], config, leaves.get("gate_bias"), extras["correction_bias"])
    S, E = x.shape[0], config.num_experts
    counts = torch.bincount(routing.selected.reshape(-1), minlength=E).to(torch.float64)
    balance = routing.probs if config.score_func == "softmax" else routing.probs / routing.probs.sum(-1, keepdim=True)
    share = config.aux_loss_coef * E * (counts / S * balance[mask].sum(0) / S).sum()
    share = share + config.z_loss_coef * torch.logsumexp(routing.logits[mask], -1).square().sum() / S
    bounds = extras["sequence_starts"] + [S]
    for start, stop in zip(bounds[:-1], bounds[1:]):  # the sequences within the mask, each 1/Q of the loss
        if config.seq_aux_loss_coef and bool(mask[start]):
            seq_counts = torch.bincount(routing.selected[start:stop].reshape(-1), minlength=E).to(torch.float64)
            f = E / (config.top_k * (stop - start)) * seq_counts
            share = share + config.seq_aux_loss_coef * (f * balance[start:stop].mean(0)).sum() / (len(bounds) - 1)
    loss = (out[mask] * case["grad_out"][mask]).sum() + share
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return share.item(), dict(zip(leaves, grads))


def _offsets(counts):
    return [sum(counts[:r]) for r in range(len(counts))]


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    err = (actual - expected).abs().max().item() if expected.numel() else 0.0
    scale = expected.abs().max().item() if expected.numel() else 0.0
    assert err <= TOL * max(scale, 1e-300), f"{what}: max error {err:.3e} against max |expected| {scale:.3e}"


def _local_shard(name: str, whole: torch.Tensor, coords: dict, layout) -> torch.Tensor:
    """This rank's shard, cut here by hand (not with the code under test)."""
    dp, ep, tp = layout
    if name in ("gate_weight", "gate_bias", "shared_gate_weight"):
        return whole
    if name.startswith("shared_"):  # one dense expert, sliced over 't' only
        return _local_shard(name.removeprefix("shared_"), whole[None], {**coords, "e": 0}, (dp, 1, tp))[0]
    El = whole.shape[0] // ep
    block = whole[coords["e"] * El : (coords["e"] + 1) * El]
    if name in ("gate_up_proj", "gate_up_proj_bias"):
        F_ = whole.shape[1] // 2
        Ft = F_ // tp
        t = coords["t"]
        return torch.cat([block[:, t * Ft : (t + 1) * Ft], block[:, F_ + t * Ft : F_ + (t + 1) * Ft]], dim=1)
    split = {"down_proj": 2, "w1": 1, "b1": 1, "w2": 2}.get(name)
    if split is None:
        return block
    size = block.shape[split] // tp
    return block.narrow(split, coords["t"] * size, size)


def _check_case(case: dict, results: list[dict]) -> None:
    """Every rank's results against the float64 references of its share."""
    layout, counts = case["layout"], case["counts"]
    dp, ep, tp = layout
    extras = _reference_extras(case)
    out, aux, full = reference_forward_backward(case["x"], case["params"], case["config"], case["grad_out"], **extras)
    offsets = _offsets(counts)
    routing = reference_routing(case["x"], case["params"]["gate_weight"], case["config"], case["params"].get("gate_bias"),
                                extras["correction_bias"])
    shares, slices = {}, {}
    for rank, res in enumerate(results):
        coords = {"d": rank // (ep * tp), "e": rank // tp % ep, "t": rank % tp}
        r, d = coords["d"] * ep + coords["e"], coords["d"]
        rows = slice(offsets[r], offsets[r] + counts[r])
        what = f"{case['name']} {layout} rank {rank}"
        _assert_close(res["out"], out[rows], f"{what} output")
        _assert_close(res["grad_x"], full["x"][rows], f"{what} input gradient")
        mask = torch.zeros(sum(counts), dtype=torch.bool)
        mask[rows] = True
        if r not in shares:
            shares[r] = _share_grads(case, mask)
        share, share_grads = shares[r]
        assert res["aux"] == pytest.approx(share, rel=TOL, abs=1e-300), f"{what} aux share"
        _assert_close(res["local"]["gate_weight"], share_grads["gate_weight"], f"{what} local gate gradient")
        if d not in slices:
            d_mask = torch.zeros(sum(counts), dtype=torch.bool)
            d_mask[offsets[d * ep] : offsets[d * ep] + sum(counts[d * ep : (d + 1) * ep])] = True
            slices[d] = _share_grads(case, d_mask)[1]
        for name in _all_shapes(case["config"]):
            # a shared expert's gradient covers this rank's tokens, a routed shard's its d slice's
            grads = share_grads if name.startswith("shared_") else slices[d]
            expected = _local_shard(name, grads[name], coords, layout)
            _assert_close(res["local"][name], expected, f"{what} local {name} gradient")
            _assert_close(res["synced"][name], _local_shard(name, full[name], coords, layout), f"{what} synced {name}")
        _assert_close(res["synced"]["gate_weight"], full["gate_weight"], f"{what} synced gate gradient")
        if "gate_bias" in full:
            _assert_close(res["local"]["gate_bias"], share_grads["gate_bias"], f"{what} local gate bias gradient")
            _assert_close(res["synced"]["gate_bias"], full["gate_bias"], f"{what} synced gate bias gradient")
        if case["correction_bias"] is not None:  # one update from the global loads, the same on every rank
            load = torch.bincount(routing.selected.reshape(-1), minlength=case["config"].num_experts).double()
            step = case["config"].bias_update_rate * torch.sign(load.mean() - load)
            assert torch.equal(res["correction_bias"], case["correction_bias"] + step.float()), f"{what} bias update"
        assert torch.equal(res["tokens_per_expert"], routing.tokens_per_expert), f"{what} tokens_per_expert"
        assert res["dropped_tokens"] == routing.dropped_pairs, f"{what} dropped_tokens"
        assert res["capacity"] == case["config"].capacity(sum(counts))
    assert sum(shares[r][0] for r in shares) == pytest.approx(aux.item(), rel=TOL), "aux shares sum to the loss"


def _assert_same(a: dict, b: dict, what: str) -> None:
    for key in ("out", "grad_x", "aux"):
        assert torch.equal(torch.as_tensor(a[key]), torch.as_tensor(b[key])), f"{what}: {key} differs"
    for group in ("local", "synced"):
        for name in a[group]:
            assert torch.equal(a[group][name], b[group][name]), f"{what}: {group} {name} differs"


# -- what the ranks run --------------------------------------------------------------------------


def _run_case(case: dict, mesh: Mesh) -> dict:
    config = case["config"]
    kw = {f: getattr(config, f) for f in ("expert", "activation", "output_activation", "bias", "renormalize",
                                          "capacity_factor", "aux_loss_coef", "z_loss_coef", *LAYER_OPTIONS)}
    layer = shardmoe.MoE(H, config.ffn_size, config.num_experts, config.top_k, mesh=mesh, dtype=torch.float64, **kw)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            local(p).copy_(case["params"][name] if name in ("gate_weight", "gate_bias") else
                    etp.shard_expert_param(name, case["params"][name], mesh))
        if case["correction_bias"] is not None:
            layer.correction_bias.copy_(case["correction_bias"])
    r = mesh.coord(("d", "e"))
    start = _offsets(case["counts"])[r]
    rows = slice(start, start + case["counts"][r])
    results = []
    for _ in range(2):  # a second step reuses the shared heap and must give the same bits
        layer.zero_grad(set_to_none=True)
        x = case["x"][rows].clone().requires_grad_(True)
        out = layer(x)
        ((out * case["grad_out"][rows]).sum() + layer.aux_loss).backward()
        unsynced = {n: local(p.grad).clone() for n, p in layer.named_parameters()}
        sync_grads(layer, mesh)
        stats = layer.stats
        results.append(dict(out=out.detach(), grad_x=x.grad, aux=layer.aux_loss.item(), local=unsynced,
                            synced={n: local(p.grad).clone() for n, p in layer.named_parameters()},
                            tokens_per_expert=stats["tokens_per_expert"], dropped_tokens=stats["dropped_tokens"],
                            capacity=stats["capacity"], rows=stats["rows"]))
    _assert_same(results[0], results[1], "second step")
    if layer.correction_bias is not None:
        layer.update_correction_bias(layer.stats["selected_per_expert"])
        results[0]["correction_bias"] = layer.correction_bias.clone()
    return results[0]


def _exchange_checks(ranks_per_node: int) -> list[bool]:
    """Rows tagged (source, destination, index, trial) through RowExchange, sizes that grow the heap."""
    mesh = Mesh(ep=dist.get_world_size(), ranks_per_node=ranks_per_node)
    exchange, me, size = RowExchange(mesh, "e"), mesh.coord("e"), mesh.size("e")
    gen = torch.Generator().manual_seed(7)
    ok = []
    for trial, scale in enumerate((1, 3000, 2)):
        counts = (torch.randint(0, 3, (size, size), generator=gen) * scale).tolist()

        def tagged(source, dest):
            n = counts[source][dest]
            return torch.stack([torch.full((n,), source), torch.full((n,), dest), torch.arange(n),
                                torch.full((n,), trial)], 1).to(torch.int32)

        rows = torch.cat([tagged(me, q) for q in range(size)]).view(torch.uint8)
        received = exchange.exchange(rows, counts).view(torch.int32)
        ok.append(torch.equal(received, torch.cat([tagged(s, me) for s in range(size)])))
    return ok


def _world(cases: list[dict], topologies: tuple[int, ...]) -> dict:
    meshes, results = {}, {}
    for case in cases:
        for rpn in topologies:
            key = (case["layout"], rpn)
            if key not in meshes:
                dp, ep, tp = case["layout"]
                meshes[key] = Mesh(dp=dp, ep=ep, tp=tp, ranks_per_node=rpn)
            results[(case["name"], case["layout"], rpn)] = _run_case(case, meshes[key])
    return {"cases": results, "meshes": meshes}


def _seeded_shards() -> dict:
    """Parameters of a layer built on an ep2 x tp2 mesh right after torch.manual_seed(3)."""
    mesh = Mesh(ep=2, tp=2)
    torch.manual_seed(3)
    layer = shardmoe.MoE(H, FFN, 4, 2, expert="mlp", bias=True, mesh=mesh, dtype=torch.float64)
    return {n: local(p).detach().clone() for n, p in layer.named_parameters()}


def _four_rank_world(cases: list[dict]) -> dict:
    out = _world(cases, (4, 2, 1))
    out["seeded"] = _seeded_shards()
    out["exchange"] = {rpn: _exchange_checks(rpn) for rpn in (4, 2, 1)}
    out["paths"] = {rpn: RowExchange(Mesh(ep=4, ranks_per_node=rpn)).path(0, 3) for rpn in (4, 1)}
    del out["meshes"]
    return out


def _two_rank_world(cases: list[dict], tp_example: dict, bench_json: str) -> dict:
    out = _world(cases, (2, 1))
    meshes = out.pop("meshes")
    out["tp_example"] = _run_tp_example(tp_example)
    out["errors"] = _bad_configurations(meshes[((1, 2, 1), 2)], meshes[((1, 1, 2), 2)])
    out["low_precision"] = {name: _run_low_precision(meshes[((1, 2, 1), 2)], name) for name in LOW_PRECISION}
    out["bench_exit"] = distributed_bench.run_distributed(SimpleNamespace(mesh="e=2", quick=True, dtype="fp32",
                                                                        json=bench_json, device="cpu", threads=None))
    return out


# Outputs, input and expert gradients come out bit-identical here; the gate gradient differs by the
# rounding of its sum over ranks (1 ulp: 1.3e-7 in fp32, 4e-3 in bf16).
LOW_PRECISION = {"fp32": (torch.float32, 1e-6), "bf16": (torch.bfloat16, 2e-2)}


def _low_precision_inputs(dtype: torch.dtype) -> dict:
    gen = torch.Generator().manual_seed(11)
    params = {"gate_weight": torch.randn(16, 4, generator=gen), "gate_up_proj": torch.randn(4, 64, 16, generator=gen) * 0.3,
              "down_proj": torch.randn(4, 16, 32, generator=gen) * 0.3}
    return dict(params={n: p.to(dtype) for n, p in params.items()}, x=torch.randn(15, 16, generator=gen).to(dtype),
                grad_out=torch.randn(15, 16, generator=gen).to(dtype), counts=[6, 9])


def _low_precision_step(layer, x, grad_out) -> dict:
    x = x.clone().requires_grad_(True)
    out = layer(x)
    ((out.float() * grad_out.float()).sum() + layer.aux_loss).backward()
    return dict(out=out.detach(), grad_x=x.grad)


def _run_low_precision(mesh: Mesh, name: str) -> dict:
    """fp32 / bf16 on ep=2: the grouped_mm kernels, mixed-dtype row packing, synced gradients."""
    dtype = LOW_PRECISION[name][0]
    inputs = _low_precision_inputs(dtype)
    layer = shardmoe.MoE(16, 32, 4, 2, aux_loss_coef=0.01, mesh=mesh, dtype=dtype)
    with torch.no_grad():
        for pname, p in layer.named_parameters():
            whole = inputs["params"][pname]
            local(p).copy_(whole if pname == "gate_weight" else etp.shard_expert_param(pname, whole, mesh))
    start = sum(inputs["counts"][: mesh.coord("e")])
    rows = slice(start, start + inputs["counts"][mesh.coord("e")])
    result = _low_precision_step(layer, inputs["x"][rows], inputs["grad_out"][rows])
    sync_grads(layer, mesh)
    result["grads"] = {n: local(p.grad) for n, p in layer.named_parameters()}
    return result


def _bad_configurations(ep_mesh: Mesh, tp_mesh: Mesh) -> list[str]:
    """Rank 0 alone builds bad layers: had any constructor communicated, rank 0 would block (its peer
    sits in the barrier below) and the world would time out instead of reporting."""
    messages = []
    if dist.get_rank() == 0:
        for build in (lambda: shardmoe.MoE(H, FFN, 3, 1, mesh=ep_mesh),
                      lambda: shardmoe.MoE(H, 5, 4, 1, mesh=tp_mesh),
                      lambda: shardmoe.MoE(H, 4, 4, 1, mesh=tp_mesh, shared_ffn_size=5),
                      lambda: Mesh(dp=3)):
            with pytest.raises(ValueError) as info:
                build()
            messages.append(str(info.value))
    dist.barrier()
    return messages


# -- a worked example: H=4, F=4, E=2, k=1, tp=2 ----------------------------------------------------


def _tp_example() -> dict:
    """The inputs of a small tp=2 example worked by hand: one token x = [1, 2, 3, 4] routed to expert 0,
    and each t rank's shard of expert 0 written out. Routing weight 0.6 on expert 0: softmax
    probability 0.6 from a gate whose logits differ by ln 1.5, kept as is (renormalize=False; top-1
    would renormalise to 1)."""
    f64 = dict(dtype=torch.float64)
    gate_rows = torch.tensor([[0.1, 0.2, 0.3, 0.4]] * 2 + [[0.5, 0.6, 0.7, 0.8]] * 2, **f64)
    up_rows = torch.tensor([[0.1] * 4] * 2 + [[0.2] * 4] * 2, **f64)
    gate_up = torch.stack([torch.cat([gate_rows, up_rows]), torch.full((8, 4), 0.3, **f64)])
    down = torch.stack([torch.full((4, 4), 0.1, **f64), torch.full((4, 4), 0.2, **f64)])
    router = torch.zeros(2, 4, **f64)
    router[0, 0] = math.log(1.5)
    # each t rank's expert 0 shard: its slice of the gate rows, then the same slice of the up rows;
    # its slice of down_proj's last dim
    shards = [
        (torch.tensor([[0.1, 0.2, 0.3, 0.4]] * 2 + [[0.1] * 4] * 2, **f64), torch.full((4, 2), 0.1, **f64)),
        (torch.tensor([[0.5, 0.6, 0.7, 0.8]] * 2 + [[0.2] * 4] * 2, **f64), torch.full((4, 2), 0.1, **f64)),
    ]
    return dict(x=torch.tensor([[1.0, 2.0, 3.0, 4.0]], **f64), gate_up=gate_up, down=down, router=router,
                shards=shards)


def _run_tp_example(example: dict) -> dict:
    mesh = Mesh(tp=2, ranks_per_node=2)
    # The whole Mixtral-layout tensors, sharded as shardmoe.hf.from_block does (it wants a
    # real transformers block, and importing transformers in every rank would cost seconds).
    layer = shardmoe.MoE(4, 4, 2, 1, renormalize=False, mesh=mesh, dtype=torch.float64)
    with torch.no_grad():
        local(layer.gate_weight).copy_(example["router"].t())
        for name, whole in (("gate_up_proj", example["gate_up"]), ("down_proj", example["down"])):
            local(getattr(layer, name)).copy_(etp.shard_expert_param(name, whole, mesh))
    x = example["x"].clone().requires_grad_(True)
    out = layer(x)
    out.sum().backward()
    grads = {n: local(p.grad).clone() for n, p in layer.named_parameters()}
    return dict(out=out.detach(), grad_x=x.grad, grads=grads, gate_up=local(layer.gate_up_proj).detach().clone(),
                down=local(layer.down_proj).detach().clone(),
                whole={n: etp.gather_expert_param(n, local(getattr(layer, n)).detach(), mesh)
                       for n in ("gate_up_proj", "down_proj")})


def _tp_example_expected(example: dict) -> dict:
    """Float64 autograd of the example written out from scratch: out = p0 * expert0(x)."""
    x = example["x"].clone().requires_grad_(True)
    gate_up = example["gate_up"].clone().requires_grad_(True)
    down = example["down"].clone().requires_grad_(True)
    router = example["router"].clone().requires_grad_(True)
    p0 = torch.softmax(x @ router.t(), -1)[:, 0:1]
    hidden = F.silu(x @ gate_up[0, :4].t()) * (x @ gate_up[0, 4:].t())
    out = p0 * (hidden @ down[0].t())
    out.sum().backward()
    return dict(out=out.detach(), grad_x=x.grad, gate_up=gate_up.grad, down=down.grad, gate=router.grad.t())


# -- tests ---------------------------------------------------------------------------------------

LAYOUTS_4 = [(1, 4, 1), (1, 2, 2), (2, 2, 1)]
LAYOUTS_2 = [(1, 2, 1), (1, 1, 2), (2, 1, 1)]


@pytest.fixture(scope="module")
def four_rank_results():
    cases = [_case(name, layout, seed) for seed, (layout, name) in
             enumerate((layout, name) for layout in LAYOUTS_4 for name in CONFIGS)]
    return cases, run_distributed(_four_rank_world, 4, args=(cases,), timeout=240)


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory):
    cases = [_case(name, layout, 100 + seed) for seed, (layout, name) in
             enumerate((layout, name) for layout in LAYOUTS_2 for name in CONFIGS
                       if not (layout == (1, 1, 2) and name == "one_block_capacity"))]
    example = _tp_example()
    bench_json = str(tmp_path_factory.mktemp("bench") / "report.json")
    results = run_distributed(_two_rank_world, 2, args=(cases, example, bench_json), timeout=180)
    with open(bench_json) as f:
        results[0]["bench"] = json.load(f)
    return cases, example, results


def _check_world(cases, results, topologies):
    for case in cases:
        per_topology = [[rank["cases"][(case["name"], case["layout"], rpn)] for rank in results] for rpn in topologies]
        _check_case(case, per_topology[0])
        for rpn, other in zip(topologies[1:], per_topology[1:]):
            for rank, (a, b) in enumerate(zip(per_topology[0], other)):
                _assert_same(a, b, f"{case['name']} {case['layout']} rank {rank}: ranks_per_node {rpn}")


def test_four_ranks_every_layout_and_topology_matches_the_reference(four_rank_results):
    cases, results = four_rank_results
    _check_world(cases, results, (4, 2, 1))


def test_four_ranks_paths_follow_the_topology(four_rank_results):
    _, results = four_rank_results
    assert results[0]["paths"] == {4: "p2p", 1: "remote"}
    rows = {rpn: [rank["cases"][("glu_dropless_aux", (1, 4, 1), rpn)]["rows"] for rank in results] for rpn in (4, 2, 1)}
    assert all(r["remote"] == 0 for r in rows[4]) and sum(r["p2p"] for r in rows[4]) > 0
    assert all(r["p2p"] == 0 for r in rows[1]) and sum(r["remote"] for r in rows[1]) > 0
    assert sum(r["p2p"] for r in rows[2]) > 0 and sum(r["remote"] for r in rows[2]) > 0
    for r in rows[4] + rows[2] + rows[1]:
        assert r["min_to_peers"] <= r["p2p"] + r["remote"]


def test_seeded_construction_holds_the_single_process_layers_shards(four_rank_results):
    _, results = four_rank_results
    torch.manual_seed(3)
    whole = shardmoe.MoE(H, FFN, 4, 2, expert="mlp", bias=True, dtype=torch.float64)
    for rank, result in enumerate(results):
        coords = {"e": rank // 2, "t": rank % 2}
        for name, p in whole.named_parameters():
            assert torch.equal(result["seeded"][name], _local_shard(name, p.detach(), coords, (1, 2, 2))), name


def test_row_exchange_is_exact_on_every_topology_and_grows_its_heap(four_rank_results):
    _, results = four_rank_results
    for rank in results:
        assert rank["exchange"] == {4: [True] * 3, 2: [True] * 3, 1: [True] * 3}


def test_all_tokens_on_one_block_and_capacity_drop_pairs(four_rank_results):
    cases, results = four_rank_results
    case = next(c for c in cases if c["name"] == "one_block_capacity" and c["layout"] == (1, 4, 1))
    stats = [rank["cases"][("one_block_capacity", (1, 4, 1), 4)] for rank in results]
    assert int(stats[0]["tokens_per_expert"][2:].sum()) == 0
    assert stats[0]["dropped_tokens"] > 0
    # Every kept row lands on peer 0; global capacity leaves the last ranks' tokens nothing.
    assert [r["rows"]["received"] for r in stats] == [int(stats[0]["tokens_per_expert"].sum()), 0, 0, 0]
    assert case["config"].capacity(sum(case["counts"])) == stats[0]["capacity"]


def test_two_ranks_ep2_and_tp2_match_the_reference(two_rank_results):
    cases, _, results = two_rank_results
    _check_world(cases, results, (2, 1))


def test_tp2_worked_example(two_rank_results):
    _, example, results = two_rank_results
    expected = _tp_example_expected(example)
    for t, rank in enumerate(results):
        got = rank["tp_example"]
        gate_shard, down_shard = example["shards"][t]
        assert torch.equal(got["gate_up"][0], gate_shard) and torch.equal(got["down"][0], down_shard)
        _assert_close(got["out"], expected["out"], f"rank {t} output")
        _assert_close(got["grad_x"], expected["grad_x"], f"rank {t} input gradient")
        _assert_close(got["grads"]["gate_weight"], expected["gate"], f"rank {t} gate gradient")
        _assert_close(got["grads"]["gate_up_proj"], _local_shard("gate_up_proj", expected["gate_up"], {"e": 0, "t": t},
                                                                  (1, 1, 2)), f"rank {t} gate_up_proj gradient")
        _assert_close(got["grads"]["down_proj"], _local_shard("down_proj", expected["down"], {"e": 0, "t": t},
                                                               (1, 1, 2)), f"rank {t} down_proj gradient")
        assert torch.equal(got["whole"]["gate_up_proj"], example["gate_up"])
        assert torch.equal(got["whole"]["down_proj"], example["down"])


def test_bad_configurations_raise_before_any_communication(two_rank_results):
    _, _, results = two_rank_results
    first, second, shared, third = results[0]["errors"]
    assert first == "num_experts: expected a multiple of the mesh's ep = 2 (experts are split over 'e'), got 3"
    assert second.startswith("ffn_size: expected a multiple of the mesh's tp = 2") and second.endswith("got 5")
    assert shared.startswith("shared_ffn_size: expected a multiple of the mesh's tp = 2") and shared.endswith("got 5")
    assert "dp*ep*tp = 3 but the world size is 2" in third
    assert results[1]["errors"] == []


def test_distributed_benchmark_reports_both_paths(two_rank_results):
    _, _, results = two_rank_results
    assert [r["bench_exit"] for r in results] == [0, 0]
    (report,) = results[0]["bench"]
    assert report["world"] == 2 and report["mesh"] == {"d": 1, "e": 2, "t": 1} and report["bit_identical"]
    p2p, remote = report["paths"]["p2p"], report["paths"]["remote"]
    assert p2p["remote_rows"] == 0 and p2p["p2p_rows"] > 0
    assert remote["p2p_rows"] == 0 and remote["remote_rows"] == p2p["p2p_rows"]
    for path in (p2p, remote):
        assert path["tokens_per_s_per_rank"] > 0 and set(path["phases_s"]) == set(distributed_bench.PHASES)
        assert path["bytes_sent_per_rank"] >= path["bytes_min_per_rank"] > 0


@pytest.mark.parametrize("name", list(LOW_PRECISION))
def test_fp32_and_bf16_expert_parallel_track_the_single_process_layer(two_rank_results, name):
    _, _, results = two_rank_results
    dtype, tol = LOW_PRECISION[name]
    inputs = _low_precision_inputs(dtype)
    single = shardmoe.MoE(16, 32, 4, 2, aux_loss_coef=0.01, dtype=dtype)
    with torch.no_grad():
        for pname, p in single.named_parameters():
            p.copy_(inputs["params"][pname])
    expected = _low_precision_step(single, inputs["x"], inputs["grad_out"])

    def rel(a, b):
        return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()

    out = torch.cat([r["low_precision"][name]["out"] for r in results])
    grad_x = torch.cat([r["low_precision"][name]["grad_x"] for r in results])
    assert out.dtype == dtype and rel(out, expected["out"]) <= tol
    assert rel(grad_x, expected["grad_x"]) <= tol
    for pname, p in single.named_parameters():
        for e, r in enumerate(results):
            got = r["low_precision"][name]["grads"][pname]
            want = p.grad if pname == "gate_weight" else p.grad[2 * e : 2 * e + 2]
            assert rel(got, want) <= tol, (pname, e)


def test_compiling_an_expert_parallel_layer_is_refused_by_name():
    """The fake implementation that torch.compile traces with has no shapes for rows that cross
    ranks: the expert-parallel dispatcher refuses, naming what to do instead."""
    from shardmoe.parallel.expert_parallel import ExpertParallel

    with pytest.raises(NotImplementedError, match="torch.compile of an expert-parallel MoE layer"):
        ExpertParallel.fake_forward(None, None, None, None)
