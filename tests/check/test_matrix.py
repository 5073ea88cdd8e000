"""The MoE layer against the float64 reference over the whole configuration matrix."""
import pytest
import torch

import shardmoe
from shardmoe.check.cases import (EXPERT_OPTIONS, EXPERTS, GLU_ACTIVATIONS, MLP_ACTIVATIONS, ROUTERS, SHARED,
                                  core_matrix, edge_cases, expert_option_matrix, full_matrix, gradcheck_cases,
                                  precision_cases, quick_matrix, router_matrix, shared_matrix)
from shardmoe.check.command import single_threaded
from shardmoe.check.compare import TOLERANCES, compare_with_reference, relative_error, run_layer
from shardmoe.check.inputs import make_inputs
from shardmoe.moe.config import ACTIVATIONS, GLU_ACTIVATIONS as CONFIG_GLU_ACTIVATIONS
from shardmoe.moe.reference import reference_routing

MATRIX = full_matrix()


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    with single_threaded():
        yield


@pytest.mark.parametrize("case", MATRIX, ids=lambda c: c.name)
def test_float64_matches_reference(case):
    result = compare_with_reference(case, torch.float64)
    assert result.passed, (result.worst, result.problems)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", precision_cases(), ids=lambda c: c.name)
def test_low_precision_within_tolerance_of_float64(case, dtype):
    result = compare_with_reference(case, dtype)
    assert result.passed, (result.worst, result.problems)


def test_core_matrix_in_bf16_within_tolerance_of_float64():
    """bf16 over every core configuration, not just the precision set: the routing gradient's
    cancellations make it the tensor that rounding choices in the layer show up in first.
    An "mlp" output relu is left out, as in the precision set: no input draw keeps every z2 clear
    of its kink by bf16's margin, and across the kink bf16 and float64 legitimately disagree."""
    cases = [c for c in core_matrix() if c.config.output_activation != "relu"]
    relu_out = sum(out == "relu" for _, out in MLP_ACTIVATIONS) * 2 * 2 * 2 * EXPERTS  # x bias, renorm, capacity, k
    assert len(cases) == len(core_matrix()) - relu_out == 368  # the count docs/checking.md gives
    failures = []
    for case in cases:
        result = compare_with_reference(case, torch.bfloat16)
        if not result.passed:
            failures.append((case.name, result.worst, result.problems))
    assert not failures, failures


def test_matrix_covers_every_option():
    configs = [c.config for c in MATRIX]
    assert {(c.expert, c.activation) for c in configs} == {("glu", a) for a in CONFIG_GLU_ACTIVATIONS} | {
        ("mlp", a) for a in ACTIVATIONS}
    assert {c.output_activation for c in configs if c.expert == "mlp"} == set(ACTIVATIONS)
    assert {c.top_k for c in configs} == set(range(1, EXPERTS + 1))
    assert {c.renormalize for c in configs} == {True, False}
    assert {c.capacity_factor is None for c in configs} == {True, False}
    assert {(c.expert, c.bias) for c in configs} == {(e, b) for e in ("glu", "mlp") for b in (True, False)}
    assert any(c.aux_loss_coef > 0 and c.z_loss_coef > 0 for c in configs)
    for expert in ("glu", "mlp"):
        of_kind = [c for c in MATRIX if c.config.expert == expert]
        assert {c.num_tokens for c in of_kind} >= {0, 1}
        assert any(c.empty_expert is not None and c.config.capacity_factor is None for c in of_kind)
        assert any(len(c.tokens_shape) > 1 for c in of_kind)


def test_case_counts_are_the_ones_docs_checking_md_gives():
    """Each count derived from the option lists, then compared with the figure the page prints."""
    variants = len(GLU_ACTIVATIONS) + 2 * len(MLP_ACTIVATIONS)  # mlp: x bias on/off
    assert len(core_matrix()) == variants * 2 * 2 * EXPERTS == 400  # x renormalize x capacity x k
    # per kind, per (renormalize, capacity): an empty expert for k = 1..E-1, four tiny layouts for
    # k = 1 and E; plus one (3, 5) layout per kind
    assert len(edge_cases()) == 2 * (4 * ((EXPERTS - 1) + 2 * 4) + 1) == 90
    # router families x capacity x k = 1, 2, plus a tie case per family
    assert len(router_matrix()) == len(ROUTERS) * (2 * 2 + 1) == 25
    # expert options x (plain softmax and every router family) x capacity x k = 1, 2
    assert len(expert_option_matrix()) == len(EXPERT_OPTIONS) * (1 + len(ROUTERS)) * 2 * 2 == 72
    # shared experts x 2 routers x capacity x k = 1, 2, plus one beside mlp experts and one tie
    assert len(shared_matrix()) == len(SHARED) * 2 * 2 * 2 + 2 == 18
    assert len(full_matrix()) == 400 + 90 + 25 + 72 + 18 == 605
    # + one case of each of the 6 edge kinds per kind, one per router family, one tie, one per expert
    # option, 3 shared
    assert len(quick_matrix()) == variants + 2 * 6 + len(ROUTERS) + 1 + len(EXPERT_OPTIONS) + 3 == 49
    assert len(precision_cases()) == 17 and len(gradcheck_cases()) == 4


def test_router_matrix_covers_every_router_option_and_ties():
    configs = [c.config for c in MATRIX]
    assert {c.score_func for c in configs} == {"softmax", "sigmoid"}
    for option in ("router_bias", "correction_bias"):
        assert any(getattr(c, option) and c.score_func == "sigmoid" for c in configs)
        assert any(getattr(c, option) and c.score_func == "softmax" for c in configs)
    assert {(c.n_group, c.topk_group) for c in configs} >= {(1, 1), (2, 1), (4, 2)}
    assert any(c.renormalize_epsilon > 0 for c in configs) and any(c.routed_scaling_factor != 1 for c in configs)
    assert any(c.seq_aux_loss_coef > 0 and c.capacity_factor is not None for c in configs)
    assert any(not c.renormalize and c.score_func == "sigmoid" for c in configs)
    ties = [c for c in MATRIX if c.tie]
    assert {tuple(sorted(dict(score=c.config.score_func, groups=c.config.n_group).items())) for c in ties} \
        >= {(("groups", 1), ("score", "softmax")), (("groups", 2), ("score", "sigmoid"))}
    assert any(c.tie for c in quick_matrix())


def test_expert_option_matrix_crosses_every_option_with_every_router_and_the_clamps_act():
    """Each expert option meets every router (and the plain one) with and without capacity; in the
    clamped cases' float64 inputs both clamps act on kept pairs (h above L, |hu| above L, and below)."""
    cases = expert_option_matrix()
    routers = {tuple(sorted((n, getattr(c.config, n)) for n in ("score_func", "router_bias", "correction_bias",
                                                                 "n_group"))) for c in cases}
    assert len(routers) == 1 + len(ROUTERS)
    for options in EXPERT_OPTIONS:
        of_option = [c for c in cases if (c.config.bias, c.config.activation)
                     == (options.get("bias", False), options.get("activation", "silu"))]
        assert len(of_option) == len(cases) // len(EXPERT_OPTIONS)
        assert {c.config.capacity_factor is None for c in of_option} == {True, False}
    for case in (c for c in cases if c.config.activation == "clamped_swiglu"):
        inputs, config = make_inputs(case), case.config
        routing = reference_routing(inputs.x.reshape(-1, config.hidden_size), inputs.params["gate_weight"], config,
                                    inputs.params.get("gate_bias"), inputs.correction_bias)
        tokens, slots = routing.kept.nonzero(as_tuple=True)
        experts = routing.selected[tokens, slots]
        x = inputs.x.reshape(-1, config.hidden_size)[tokens]
        h = torch.einsum("nh,nfh->nf", x, inputs.params["gate_up_proj"][experts])
        if config.bias:
            h = h + inputs.params["gate_up_proj_bias"][experts]
        gate, up, limit = h[:, :config.ffn_size], h[:, config.ffn_size:], config.swiglu_limit
        assert (gate > limit).any() and (gate < limit).any(), case.name
        assert (up.abs() > limit).any() and (up.abs() < limit).any(), case.name


def test_tie_cases_route_both_twins_and_the_lower_wins():
    """The tie cases' inputs give experts 0 and 1 bitwise equal scores, and the layer's
    expert 1 only receives tokens that also chose expert 0 (top_k = 2) or that expert 0 could not
    take: its selection counts never exceed expert 0's."""
    for case in (c for c in MATRIX if c.tie):
        inputs = make_inputs(case, torch.float64)
        routing = reference_routing(inputs.x, inputs.params["gate_weight"], case.config,
                                    inputs.params.get("gate_bias"), inputs.correction_bias)
        assert torch.equal(routing.probs[:, 0], routing.probs[:, 1]), case.name
        layer, _, _ = run_layer(case.config, inputs)
        chose_1 = (routing.selected == 1).any(-1)
        assert ((routing.selected == 0).any(-1) | ~chose_1).all(), case.name
        assert layer.stats["selected_per_expert"].tolist() == torch.bincount(routing.selected.reshape(-1),
                                                                             minlength=4).tolist()


def test_quick_matrix_is_a_subset_touching_every_activation():
    quick = quick_matrix()
    assert set(quick) <= set(MATRIX) and len(quick) < len(MATRIX) / 5
    assert {(c.config.expert, c.config.activation) for c in quick} == {
        (c.config.expert, c.config.activation) for c in MATRIX}


def test_capacity_cases_drop_pairs():
    """The capacity factor is chosen so that the dropped-pair paths always run."""
    for case in MATRIX:
        if case.config.capacity_factor and case.num_tokens > 1:
            inputs = make_inputs(case)
            routing = reference_routing(inputs.x, inputs.params["gate_weight"], case.config)
            assert routing.dropped_pairs > 0, case.name


@pytest.mark.parametrize("case", [c for c in MATRIX if c.empty_expert is not None], ids=lambda c: c.name)
def test_empty_expert_gets_exactly_zero_gradient(case):
    """The relative-error floor would tolerate 1e-13 here; an expert with no tokens must get exact zeros."""
    inputs = make_inputs(case)
    layer, _, _ = run_layer(case.config, inputs)
    assert layer.stats["tokens_per_expert"][case.empty_expert] == 0
    for name in inputs.params:
        if name != "gate_weight":
            assert not getattr(layer, name).grad[case.empty_expert].any(), name


def test_relative_error_definition():
    expected = torch.tensor([1.0, -4.0, 2.0], dtype=torch.float64)
    assert relative_error(expected + torch.tensor([0.0, 0.0, 0.002]), expected) == pytest.approx(0.002 / 4)
    # Below the floor the error is measured against the floor, not against round-off.
    assert relative_error(torch.tensor([2e-6]), torch.tensor([1e-17])) == pytest.approx(2e-6 / 1e-3)
    assert relative_error(torch.zeros(0), torch.zeros(0)) == 0.0


class _Perturbed(shardmoe.MoE):
    """shardmoe.MoE with one deliberate defect, to prove the harness sees it."""

    defect = None

    def forward(self, x):
        if self.defect == "input_grad":
            x.register_hook(lambda g: g * (1 + 1e-8))
        y = super().forward(x)
        if self.defect == "gate_grad":
            self.gate_weight.register_hook(lambda g: g * (1 + 1e-8))
        if self.defect == "aux":
            self.aux_loss = self.aux_loss * 0.5
        return y


@pytest.mark.parametrize("defect,tensor", [("input_grad", "x"), ("gate_grad", "gate_weight"), ("aux", "aux_loss")])
def test_harness_catches_small_defects(monkeypatch, defect, tensor):
    monkeypatch.setattr(_Perturbed, "defect", defect)
    monkeypatch.setattr(shardmoe, "MoE", _Perturbed)
    case = next(c for c in MATRIX if c.config.aux_loss_coef and c.config.expert == "glu")
    result = compare_with_reference(case, torch.float64)
    assert not result.passed
    assert result.worst[0] == tensor and result.errors[tensor] > TOLERANCES[torch.float64]


def test_shared_matrix_covers_both_shared_experts_with_both_routers_capacity_and_ties():
    shared = [c for c in MATRIX if c.config.shared_ffn_size]
    assert {(c.config.shared_gate, c.config.score_func, c.config.capacity_factor is not None) for c in shared} \
        == {(g, s, cap) for g in (False, True) for s in ("softmax", "sigmoid") for cap in (False, True)}
    assert any(c.config.expert == "mlp" for c in shared) and any(c.tie and c.config.shared_gate for c in shared)
    assert sum(c.config.shared_ffn_size > 0 for c in quick_matrix()) == 3
