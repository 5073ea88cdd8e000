"""Kernel tests: on CPU tensors in Triton's interpreter, or compiled on CUDA tensors with
SHARDMOE_TEST_COMPILED=1 (python -m shardmoe.tools.gpu_check's tests stage sets it; docs/gpu.md).

tests/conftest.py chooses the mode before any test module imports triton. In compiled mode
test_layer_path.py and test_hf_path.py are skipped: they feed CPU tensors to the kernels through
the force_kernels setting, which only the interpreter runs; the gpu_check parity stage runs such
cases on CUDA tensors. Shapes are tiny but every kernel sees several tiles along each of its
dimensions with its interpreter tiles (16-row tiles, 32-wide column and K tiles), each dimension's
last tile partial: uneven expert groups, empty experts (first and middle), a group spanning three row tiles,
two or three column and K tiles in every GEMM (F = H = 40, 2F = 80), and a GLU gate/up boundary
inside a tile. A tile index or order bug (a column tile's result stored to another's place) thus
changes values.
"""
import math
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

COMPILED = os.environ.get("SHARDMOE_TEST_COMPILED", "0") == "1"  # checked by tests/conftest.py
# the interpreter's way to the kernels: CPU tensors through the force_kernels setting (see the docstring)
INTERPRETER_ONLY = ("test_layer_path.py", "test_hf_path.py")

HIDDEN = 40  # H: one full and one partial 32-wide tile
FFN = 40  # F or P: two 32-wide column tiles; 2F = 80, three K tiles with the gate/up boundary inside the second
NUM_EXPERTS = 6
NUM_TOKENS = 40
TOP_K = 2
# Routing odds per expert: 0 and 4 get nothing (empty groups), 3 gets 33 rows (three 16-row tiles, the last
# holding one row) with the default batch.
EXPERT_ODDS = (0.0, 0.15, 0.1, 0.6, 0.0, 0.15)


@dataclass
class Routed:
    """A routed batch in the fused layer's layout (see shardmoe/moe/function.py)."""

    x: torch.Tensor  # [S, H] tokens
    grad_out: torch.Tensor  # [S, H] incoming gradient
    row_pair: torch.Tensor  # [N] pair t * k + j of each expert-sorted row
    row_token: torch.Tensor  # [N] token of each row
    weight_rows: torch.Tensor  # [N] routing weight of each row (float32)
    counts: torch.Tensor  # [E] rows per expert
    num_tokens: int
    top_k: int

    def cast(self, dtype):
        return Routed(self.x.to(dtype), self.grad_out.to(dtype), self.row_pair, self.row_token,
                      self.weight_rows.to(dtype if dtype == torch.float64 else torch.float32), self.counts,
                      self.num_tokens, self.top_k)


def pytest_collection_modifyitems(config, items):
    if not COMPILED:
        return
    skip = pytest.mark.skip(reason="compiled mode: CPU tensors through the force_kernels setting run only in the "
                                   "interpreter; python -m shardmoe.tools.gpu_check --only parity runs these cases on CUDA")
    for item in items:
        if item.path.parent == Path(__file__).parent and item.path.name in INTERPRETER_ONLY:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def device():
    return "cuda" if COMPILED else "cpu"


def make_routed(device, *, top_k=TOP_K, drop_every=7, seed=0) -> Routed:
    """Each token picks top_k distinct experts by EXPERT_ODDS; every `drop_every`-th pair
    is dropped (as capacity would), so some tokens keep fewer than top_k rows."""
    gen = torch.Generator().manual_seed(seed)
    odds = torch.tensor(EXPERT_ODDS).expand(NUM_TOKENS, -1)
    experts = torch.multinomial(odds, top_k, replacement=False, generator=gen)  # [S, k]
    pairs = torch.arange(NUM_TOKENS * top_k)
    kept = pairs[pairs % drop_every != drop_every - 1] if drop_every else pairs
    order = torch.argsort(experts.reshape(-1)[kept] * NUM_TOKENS * top_k + kept)
    row_pair = kept[order]
    counts = torch.bincount(experts.reshape(-1)[row_pair], minlength=NUM_EXPERTS)
    weights = torch.rand(NUM_TOKENS, top_k, generator=gen, dtype=torch.float64) + 0.1
    x = torch.randn(NUM_TOKENS, HIDDEN, generator=gen, dtype=torch.float64)
    grad_out = torch.randn(NUM_TOKENS, HIDDEN, generator=gen, dtype=torch.float64)
    to = dict(device=device)
    return Routed(x.to(**to), grad_out.to(**to), row_pair.to(**to), (row_pair // top_k).to(**to),
                  weights.reshape(-1)[row_pair].to(**to), counts.to(**to), NUM_TOKENS, top_k)


@pytest.fixture
def routed(device):
    return make_routed(device)


@pytest.fixture(scope="session")
def make_routed_batch():
    return make_routed


def make_params(expert: str, bias: bool, device, seed=1) -> dict:
    """Expert parameters in float64, scaled so activations stay O(1)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return (torch.randn(shape, generator=gen, dtype=torch.float64) / math.sqrt(shape[-1])).to(device)

    E, H, F = NUM_EXPERTS, HIDDEN, FFN
    if expert == "glu":
        return {"gate_up_proj": rand(E, 2 * F, H), "gate_up_proj_bias": rand(E, 2 * F) if bias else None,
                "down_proj": rand(E, H, F), "down_proj_bias": rand(E, H) if bias else None}
    return {"w1": rand(E, F, H), "b1": rand(E, F) if bias else None,
            "w2": rand(E, H, F), "b2": rand(E, H) if bias else None}


@pytest.fixture(scope="session")
def expert_params():
    return make_params


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64 (absolute when expected is all zeros)."""
    diff = (actual.double().cpu() - expected.double().cpu()).norm().item()
    scale = expected.double().norm().item()
    return diff / scale if scale > 0 else diff


@pytest.fixture(scope="session")
def rel_err():
    return relative_error


@pytest.fixture(scope="session")
def cast():
    """Cast a tensor, None, or a dict / tuple of them to a dtype."""
    def _cast(value, dtype):
        if value is None:
            return None
        if isinstance(value, dict):
            return {k: _cast(v, dtype) for k, v in value.items()}
        if isinstance(value, (tuple, list)):
            return type(value)(_cast(v, dtype) for v in value)
        return value.to(dtype)
    return _cast
