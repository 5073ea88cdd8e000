"""shardmoe.torchtitan.MoE against torchtitan's own MoE (its bf16 casts taken out: conftest's
exact_torchtitan), float64: every router option, outputs and every gradient to round-off; the
options it refuses; its state dict; its meta-device init; torchtitan's load-balancing hook on it,
and shardmoe's centred correction-bias update, bit for bit."""
import copy
from types import SimpleNamespace

import pytest
import torch
from torchtitan.components.optimizer import register_moe_load_balancing_hook
from torchtitan.models.common import moe as titan_moe
from torchtitan.models.common.feed_forward import SigmoidGatedFeedForward
from torchtitan.models.common.linear import Linear

import shardmoe
import shardmoe.torchtitan
from shardmoe.torchtitan.moe import moe_config

from .conftest import DIM, EXPERTS, HIDDEN, cast_parameters, moe_module_config, randomize, rel_err

ROUTERS = {
    "softmax": dict(),
    "sigmoid": dict(score_func="sigmoid"),
    "route_norm_scale": dict(score_func="sigmoid", route_norm=True, route_scale=2.5),
    "gate_bias": dict(gate_bias=True),
    "groups": dict(score_func="sigmoid", groups=(4, 2), route_norm=True, route_scale=1.5),
    "no_shared_no_bias": dict(shared=False, load_balance_coeff=None, top_k=2),
}


def both(options: dict, dtype=torch.float64, seed: int = 0):
    """torchtitan's MoE and the fused one built from the same config, holding the same weights of
    `dtype` (the buffers stay float32, as torchtitan builds them)."""
    config = moe_module_config(**options)
    titan = cast_parameters(config.build(), dtype)
    randomize(titan, seed)
    fused = shardmoe.torchtitan.MoE.Config(**{f: getattr(config, f) for f in config.__slots__}).build()
    fused = cast_parameters(fused, dtype)
    fused.load_state_dict(titan.state_dict())
    return titan, fused


def forward_backward(module, x: torch.Tensor, grad: torch.Tensor):
    x = x.clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    out = module(x)
    out.backward(grad)
    return out.detach(), x.grad, {n: p.grad for n, p in module.named_parameters()}


@pytest.mark.parametrize("router", list(ROUTERS))
def test_every_router_option_computes_torchtitans_moe_to_float64_round_off(router, exact_torchtitan):
    """Outputs, input gradients and every parameter gradient equal torchtitan's to 1e-12 (relative
    to the largest entry), in training (tokens_per_expert_E counted alike) and in eval. x [3, 20, D]:
    60 tokens over 8 experts, expert 5's bias pushed down so that it gets no token (an empty group)."""
    titan, fused = both(ROUTERS[router])
    if titan.expert_bias_E is not None:
        for module in (titan, fused):
            module.expert_bias_E[5] = -10.0
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 20, DIM, generator=gen, dtype=torch.float64)
    grad = torch.randn(3, 20, DIM, generator=gen, dtype=torch.float64)
    expected, got = forward_backward(titan, x, grad), forward_backward(fused, x, grad)
    assert rel_err(got[0], expected[0]) <= 1e-12 and rel_err(got[1], expected[1]) <= 1e-12
    assert set(got[2]) == set(expected[2]) and len(got[2]) >= 4
    for name, g in expected[2].items():
        assert rel_err(got[2][name], g) <= 1e-12, name
    assert torch.equal(fused.tokens_per_expert_E, titan.tokens_per_expert_E)
    if titan.expert_bias_E is not None:
        assert fused.tokens_per_expert_E[5] == 0 and fused.tokens_per_expert_E.sum() == 60 * titan.router.top_k
    titan.eval(), fused.eval()
    assert rel_err(fused(x), titan(x)) <= 1e-12
    assert torch.equal(fused.tokens_per_expert_E, titan.tokens_per_expert_E)  # eval counts nothing


def test_float32_and_bf16_inputs_compute_in_their_dtype():
    """A float32 module on float32 x and a bf16 one on bf16 x give outputs of their dtype, equal to
    the float64 module's to the dtype's round-off: the experts run in x's dtype (torchtitan's casts
    to bf16 whatever it is), the router in float32."""
    titan, reference = both(ROUTERS["groups"])
    x = torch.randn(2, 16, DIM, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    expected = reference(x)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        fused = shardmoe.torchtitan.from_torchtitan(cast_parameters(titan, dtype))
        out = fused(x.to(dtype))
        assert out.dtype == dtype and rel_err(out.double(), expected) <= tol


def test_under_torch_compile_outputs_and_the_counts_of_each_forward_are_eager_ones():
    """torchtitan compiles its blocks: the swapped module compiled (dynamo, aot_eager) gives the eager
    outputs, and tokens_per_expert_E counts each forward's own selections (the operator hands them
    over when it runs, not when dynamo traces), over three forwards of different inputs."""
    _, fused = both(ROUTERS["groups"], dtype=torch.float32)
    compiled = torch.compile(copy.deepcopy(fused), backend="aot_eager")
    gen = torch.Generator().manual_seed(5)
    for i in range(3):
        x = (i + 1) * torch.randn(2, 8, DIM, generator=gen)
        assert torch.equal(compiled(x), fused(x))
    assert torch.equal(compiled._orig_mod.tokens_per_expert_E, fused.tokens_per_expert_E)
    assert fused.tokens_per_expert_E.sum() == 3 * 16 * 3


REFUSED = [
    (lambda c: setattr(c.router, "_debug_force_load_balance", True), "router._debug_force_load_balance"),
    (lambda c: setattr(c.shared_experts.w2, "bias", True), "shared_experts.w2: .* with no bias, got a bias"),
    (lambda c: setattr(c, "shared_experts", SigmoidGatedFeedForward.Config(
        w1=c.shared_experts.w1, w2=c.shared_experts.w2, w3=c.shared_experts.w3,
        gate=Linear.Config(in_features=DIM, out_features=1))), "shared_experts: .* got SigmoidGatedFeedForward"),
    (lambda c: (setattr(c.router, "num_expert_groups", 8), setattr(c.router, "num_limited_groups", 4)),
     "router.num_expert_groups: .* at least two experts per group .* got 8"),
]


@pytest.mark.parametrize("change, message", REFUSED)
def test_what_the_fused_layer_does_not_compute_is_refused_naming_the_part(change, message):
    config = moe_module_config()
    change(config)
    with torch.device("meta"):
        titan = config.build()
        with pytest.raises(ValueError, match=message):
            moe_config(titan)
        with pytest.raises(ValueError, match=message):
            shardmoe.torchtitan.from_torchtitan(titan)


def test_state_dict_has_torchtitans_keys_and_layouts_and_loads_both_ways():
    titan, fused = both(ROUTERS["gate_bias"])
    expected, got = titan.state_dict(), fused.state_dict()
    assert list(got) == list(expected) == [
        "expert_bias_E", "routed_experts.inner_experts.w1_EFD", "routed_experts.inner_experts.w2_EDF",
        "routed_experts.inner_experts.w3_EFD", "router.gate.weight", "router.gate.bias", "shared_experts.w1.weight",
        "shared_experts.w2.weight", "shared_experts.w3.weight"]
    assert tuple(got["routed_experts.inner_experts.w2_EDF"].shape) == (EXPERTS, DIM, HIDDEN)
    other, _ = both(ROUTERS["gate_bias"], seed=5)
    other.load_state_dict(got)
    assert all(torch.equal(other.state_dict()[k], v) for k, v in expected.items())


def test_built_on_meta_then_to_empty_and_init_states_equals_the_eager_module():
    """torchtitan's init path (build on meta, to_empty, init_states: param_init of each child and
    _init_self_buffers) gives every parameter and buffer, expert_bias_E and tokens_per_expert_E
    included, what an eager build initialised under the same seed holds; memory left by to_empty
    is NaN here."""
    config = shardmoe.torchtitan.MoE.Config(**{f: getattr(moe_module_config(gate_bias=True), f)
                                              for f in titan_moe.MoE.Config.__slots__})
    eager = config.build()
    torch.manual_seed(4)
    eager.init_states()
    with torch.device("meta"):
        fused = config.build()
    fused.to_empty(device="cpu")
    with torch.no_grad():
        for t in [*fused.parameters(), *fused.buffers()]:
            t.fill_(float("nan"))
    torch.manual_seed(4)
    fused.init_states()
    names = [n for n, _ in [*eager.named_parameters(), *eager.named_buffers()]]
    assert "expert_bias_E" in names and "tokens_per_expert_E" in names
    state = dict([*fused.named_parameters(), *fused.named_buffers()])
    for name, value in [*eager.named_parameters(), *eager.named_buffers()]:
        assert torch.equal(state[name], value), name


def test_torchtitans_bias_hook_moves_the_fused_module_as_its_own_and_as_shardmoes_centred_update(exact_torchtitan):
    """register_moe_load_balancing_hook, unchanged, on a model of each module (one process: its
    loss mesh is None), ten SGD steps: expert_bias_E equal bit for bit after every step, and equal to
    shardmoe.MoE.update_correction_bias(load, centred=True) fed the same loads; the plain update
    (centred=False) drifts away from it."""
    titan, fused = both(ROUTERS["sigmoid"])
    layer = shardmoe.MoE(DIM, HIDDEN, EXPERTS, 3, score_func="sigmoid", correction_bias=True,
                         bias_update_rate=titan.load_balance_coeff)
    plain = shardmoe.MoE(DIM, HIDDEN, EXPERTS, 3, score_func="sigmoid", correction_bias=True,
                         bias_update_rate=titan.load_balance_coeff)
    with torch.no_grad():
        for bias in (layer.correction_bias, plain.correction_bias):
            bias.copy_(titan.expert_bias_E)
    single_process = SimpleNamespace(get_optional_mesh=lambda name: None, ep_enabled=False, tp=1)
    gen = torch.Generator().manual_seed(3)
    runs = []
    for module in (titan, fused):
        block, model = torch.nn.Module(), torch.nn.Module()  # what the hook walks: model.layers[i].moe
        block.moe, block.moe_enabled, model.layers = module, True, torch.nn.ModuleDict({"0": block})
        optimizer = torch.optim.SGD(module.parameters(), lr=0.01)
        loads = []
        optimizer.register_step_pre_hook(lambda *_, m=module, out=loads: out.append(m.tokens_per_expert_E.clone()))
        register_moe_load_balancing_hook(optimizer, [model], single_process)
        runs.append((block, optimizer, loads, []))
    for step in range(10):
        x, g = torch.randn(2, 4, 8, DIM, generator=gen, dtype=torch.float64)
        for block, optimizer, _, biases in runs:
            (block.moe(x) * g).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            biases.append(block.moe.expert_bias_E.clone())
        load = runs[1][2][-1]
        assert torch.equal(load, runs[0][2][-1]) and load.sum() == 4 * 8 * 3
        layer.update_correction_bias(load, centred=True)
        plain.update_correction_bias(load)
        assert torch.equal(runs[1][3][-1], runs[0][3][-1]), step
        assert torch.equal(layer.correction_bias, runs[1][3][-1]), step
        assert torch.equal(fused.tokens_per_expert_E, torch.zeros(EXPERTS))  # the hook zeroes it
    assert not torch.equal(plain.correction_bias, layer.correction_bias)


# torchtitan's expert-parallel plan on a 4-rank gloo world, with its mesh names (ParallelDims):
#   ep2            dp_replicate=2 x dp_shard=2 (fsdp=2); ep=2 from dp_shard, efsdp=1
#   ep2_efsdp2     dp_shard=4 (fsdp=4); ep=2, the experts FSDP-sharded over efsdp=2
LAYOUTS = {"ep2": dict(data_parallel_replicate_degree=2, data_parallel_shard_degree=2, expert_parallel_degree=2),
           "ep2_efsdp2": dict(data_parallel_shard_degree=4, expert_parallel_degree=2)}
DIST_STEPS = 4


def _train_record(model, parallel_dims, rows: list[torch.Tensor], total_tokens: int, all_reduce) -> dict:
    """AdamW steps with torchtitan's bias hook; per step the loss summed over the ranks, the MoE
    layers' tokens_per_expert_E summed over the ranks (read before the hook zeroes them) and their
    expert_bias_E after it. Each rank's loss is its tokens' cross-entropy sum over the batch's
    token count (torchtitan's global-token normalisation: FSDP sums the gradients)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    moes = [block.moe for block in list(model.layers.values())[1:]]
    counts = []
    optimizer.register_step_pre_hook(lambda *_: counts.append(all_reduce(torch.stack([m.tokens_per_expert_E for m in moes]))))
    register_moe_load_balancing_hook(optimizer, [model], parallel_dims)
    losses, biases = [], []
    for tokens in rows:
        loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten(),
                                                 reduction="sum") / total_tokens
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(all_reduce(loss.detach())))
        biases.append(torch.stack([m.expert_bias_E.detach().clone() for m in moes]))
    return dict(losses=losses, counts=counts, biases=biases)


def _expert_parallel_world(full_state: dict, batches: list[torch.Tensor]) -> dict:
    """One rank: each layout of LAYOUTS built, parallelized and trained as torchtitan's trainer does
    it (config.update_from_config, build on meta, the swap, parallelize_deepseekv3, to_empty,
    init_weights, then the checkpoint's weights through set_model_state_dict), with the three
    changes a CPU gloo world needs: torchtitan's device type set to "cpu" (it falls back to "cuda"
    without an accelerator), the partial_dtensor backend selected as its trainer selects it, and
    FSDP's reductions as plain sums (gloo has no PREMUL_SUM; torchtitan sets the divide factor to 1)."""
    import torch.distributed as dist
    import torchtitan.distributed.parallel_dims as titan_parallel_dims
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         set_model_state_dict)
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import (CompileConfig, OverrideConfig, ParallelismConfig, TrainingConfig,
                                   apply_overrides)
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.utils import set_spmd_backend
    from torchtitan.models.deepseek_v3.parallelize import parallelize_deepseekv3

    from .conftest import deepseek_v3_config

    titan_parallel_dims.device_type = "cpu"
    set_spmd_backend("partial_dtensor")
    results = {}
    for name, degrees in LAYOUTS.items():
        parallelism = ParallelismConfig(spmd_backend="partial_dtensor", **degrees)
        parallel_dims = ParallelDims.from_config(parallelism, dist.get_world_size())
        parallel_dims.build_mesh()
        config = deepseek_v3_config()
        if name == "ep2_efsdp2":  # the config's one setting instead of the swap
            apply_overrides(OverrideConfig(imports=["shardmoe.torchtitan.fused_moe"]), config)
        config.update_from_config(config=SimpleNamespace(parallelism=parallelism))
        with torch.device("meta"):
            model = config.build()
        if name == "ep2":
            shardmoe.torchtitan.swap_moe(model)
        model = parallelize_deepseekv3(model, parallel_dims=parallel_dims,
                                       training=TrainingConfig(mixed_precision_param="float32"),
                                       parallelism=parallelism, compile_config=CompileConfig(), ac_config=None,
                                       dump_folder="")
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
        model.to_empty(device="cpu")
        with torch.no_grad():
            model.init_weights(buffer_device=None)
        set_model_state_dict(model, {k: v.clone() for k, v in full_state.items()},
                             options=StateDictOptions(full_state_dict=True))
        moe = model.layers["1"].moe
        batch = parallel_dims.get_mesh("batch")
        loss_group = parallel_dims.get_mesh("loss").get_group()

        def all_reduce(t, group=loss_group):
            t = t.clone()
            dist.all_reduce(t, group=group)
            return t

        rows = [b.chunk(batch.size())[batch.get_local_rank()] for b in batches]
        record = _train_record(model, parallel_dims, rows, batches[0][:, 1:].numel(), all_reduce)
        record["state"] = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                                   cpu_offload=True))
        record["mesh"] = (type(moe).__name__, moe.expert_mesh.size("e"), parallel_dims.get_mesh("efsdp").size())
        results[name] = record
    return results if dist.get_rank() == 0 else {name: {} for name in results}


def test_swapped_model_under_torchtitans_expert_parallel_plan_trains_as_one_process():
    """Four gloo ranks, torchtitan's plan (parallelize_deepseekv3: the experts Shard(0) over 'ep',
    FSDP over 'fsdp' and, for the experts, 'efsdp'), float32, AdamW with torchtitan's bias hook over
    its loss mesh: for ep=2 (x HSDP 2 x 2) and ep=2 x efsdp=2, every step's loss equals the single
    process's on the whole batch to 1e-6, the selections per expert summed over the ranks and the
    expert biases equal it exactly, and every weight after the last step to 1e-5 (measured: 9e-8
    and 3e-7)."""
    from shardmoe.testing import run_distributed

    from .conftest import deepseek_v3_config

    model = deepseek_v3_config().build()
    randomize(model, seed=0)
    full_state = {k: v.clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(2)
    batches = [torch.randint(0, 64, (4, 17), generator=gen) for _ in range(DIST_STEPS)]
    shardmoe.torchtitan.swap_moe(model)
    one_process = SimpleNamespace(get_optional_mesh=lambda name: None, ep_enabled=False, tp=1)
    expected = _train_record(model, one_process, batches, batches[0][:, 1:].numel(), lambda t: t.clone())
    results = run_distributed(_expert_parallel_world, 4, args=(full_state, batches), timeout=600,
                              collective_timeout=300)[0]
    for name, got in results.items():
        assert got["mesh"] == ("MoE", 2, 1 if name == "ep2" else 2)
        assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(got["losses"], expected["losses"], strict=True)), name
        for step in range(DIST_STEPS):
            assert torch.equal(got["counts"][step], expected["counts"][step]), (name, step)
            assert torch.equal(got["biases"][step], expected["biases"][step]), (name, step)
        final = model.state_dict()
        assert set(got["state"]) == set(final)
        for key, value in final.items():
            assert rel_err(got["state"][key], value) <= 1e-5, (name, key)
