"""The fused CPU elementwise passes (shardmoe/moe/cpu.py): the torch path's bits, float64 closed forms,
bad input, the layer wiring, the fallback when the library cannot be built, and each pass as a torch
operator (torch.library.opcheck)."""
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import shardmoe
from shardmoe import settings
from shardmoe.moe import combine, cpu, experts
from shardmoe.moe.cpu import CpuOps
from shardmoe.moe.experts import TORCH_OPS
from shardmoe.settings import SETTINGS

DTYPES = [torch.float32, torch.bfloat16]
ACTIVATIONS = list(cpu.ACTIVATION_CODES)


@pytest.fixture(scope="module")
def fused():
    """The built library; skipped only where there is no C++ compiler at all (a failing build here
    fails the test instead)."""
    if shutil.which(cpu._compile_command(cpu.SOURCES, "x.so")[0]) is None:
        pytest.skip("no C++ compiler: the torch path is covered by the rest of the suite")
    torch.ops.load_library(str(cpu.build_library()))
    return torch.ops.shardmoe_elementwise


def torch_path(monkeypatch, fn, *args):
    """fn(*args) with the fused passes switched off (a layer's steps then decide on the torch code)."""
    with monkeypatch.context() as m:
        m.setattr(SETTINGS, "fused_elementwise", False)
        return fn(*args)


def operands(dtype, rows=37, width=45, seed=0):
    """Row-strided views (every op must honour the row stride) of odd widths (a ragged vector end)."""
    g = torch.Generator().manual_seed(seed)
    wide = (2 * torch.randn(rows, 3 * width + 5, generator=g)).to(dtype)
    h = wide[:, 3:3 + 2 * width]
    other = wide[:, 1:1 + width]
    weight = torch.rand(rows, generator=g)
    return h, other, weight


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_glu_passes_give_todays_bits(fused, monkeypatch, dtype, activation):
    """glu forward (a and act(hg)) and the stage-4 elementwise backward equal the torch path bit for
    bit: the kernels round bf16 intermediates where the torch path does. The width is a whole
    number of vectors because aten evaluates a row's ragged end with scalar code (in double for
    gelu), whose bits differ from its own vector code's; ragged ends are checked against float64.
    One exception: the float32 gelu_tanh backward, where the compiler fuses a different set of
    multiply-adds than aten's build did (same formula, same float64 error: 1.16e-6 both in a probe),
    is held to 4 float32 eps of the largest value."""
    h, grad_a, _ = operands(dtype, width=64)
    ops = CpuOps.decide(h)
    assert ops.elementwise_fits(h, activation=activation)
    a, act_gate = experts.glu_activation(ops, h, activation)
    a_ref, act_ref = experts.glu_activation(TORCH_OPS, h, activation)
    torch.testing.assert_close(act_gate, act_ref, rtol=0, atol=0)
    torch.testing.assert_close(a, a_ref, rtol=0, atol=0)
    grad_h = ops.glu_backward(grad_a, h, act_gate, activation)
    grad_h_ref = TORCH_OPS.glu_backward(grad_a, h, act_gate, activation)
    fma = activation == "gelu_tanh" and dtype == torch.float32
    atol = 4 * torch.finfo(dtype).eps * float(grad_h_ref.abs().max()) if fma else 0.0
    torch.testing.assert_close(grad_h, grad_h_ref, rtol=0, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_combine_side_passes(fused, dtype):
    """scale_rows, combine_rows (with and without weights), bias_grad: the torch path's bits;
    rowwise_dot: float32 round-off of a float64 dot of the same (rounded) operands."""
    rows, other, weight = operands(dtype)
    rows = rows[:, :other.shape[1]]
    row_pair = torch.randperm(2 * rows.shape[0], generator=torch.Generator().manual_seed(1))[:rows.shape[0]]
    groups = experts.Groups.from_counts(torch.tensor([10, 0, 27]))
    ops = CpuOps.decide(rows)
    assert ops.elementwise_fits(rows)  # else both sides below would be torch's code
    same = [
        ("scale_rows", (rows, weight)),
        ("combine_rows", (rows, row_pair, rows.shape[0], 2, weight)),
        ("combine_rows", (rows, row_pair, rows.shape[0], 2)),
        ("bias_grad", (rows, groups)),
    ]
    for name, args in same:
        torch.testing.assert_close(getattr(ops, name)(*args), getattr(TORCH_OPS, name)(*args), rtol=0, atol=0)
    for factors in [(other,), (other, rows)]:
        dot = ops.rowwise_dot(rows, *factors)
        exact = rows.double()
        for f in factors:
            exact = exact * f.double()
        exact = exact.sum(-1)
        scale = rows.double().abs()
        for f in factors:
            scale = scale * f.double().abs()
        # float32 products and sum: |error| <= (width + len(factors)) eps32 sum |terms|
        bound = (rows.shape[1] + len(factors)) * torch.finfo(torch.float32).eps * scale.sum(-1)
        assert dot.dtype == torch.float32 and bool(((dot.double() - exact).abs() <= bound).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_glu_backward_one_pass_is_the_separate_passes_in_one(fused, dtype, activation):
    """glu_backward_one_pass (a, dh and the gate dots in one pass) against glu_forward, scale_rows, rowwise_dot
    and glu_backward run in turn on the same row-strided operands of a ragged width: a and dh bit
    for bit, the dots too in bf16; in float32 the compiler may fuse another multiply-add into the
    dot, so it is held to float32 round-off of the same products."""
    h, g_down, weight = operands(dtype, width=45)
    a, grad_h, dots = cpu.glu_backward_one_pass(h, g_down, weight, activation)
    act_gate = torch.empty_like(g_down, memory_format=torch.contiguous_format)
    a_ref = cpu.glu_forward(h, activation, act_gate)
    grad_h_ref = cpu.glu_backward(cpu.scale_rows(g_down, weight), h, act_gate, activation)
    dots_ref = cpu.rowwise_dot(g_down, act_gate, h[:, 45:])
    torch.testing.assert_close(a, a_ref, rtol=0, atol=0)
    torch.testing.assert_close(grad_h, grad_h_ref, rtol=0, atol=0)
    assert dots.dtype == torch.float32
    terms = (g_down.float() * act_gate.float() * h[:, 45:].float()).abs().sum(-1)
    atol = 0.0 if dtype == torch.bfloat16 else float((48 * torch.finfo(torch.float32).eps * terms).max())
    torch.testing.assert_close(dots, dots_ref, rtol=0, atol=atol)
    # into given buffers, the same values
    a_out, grad_h_out = torch.full_like(a, float("nan")), torch.full_like(grad_h, float("nan"))
    cpu.glu_backward_one_pass(h, g_down, weight, activation, a_out=a_out, grad_h_out=grad_h_out)
    torch.testing.assert_close(a_out, a, rtol=0, atol=0)
    torch.testing.assert_close(grad_h_out, grad_h, rtol=0, atol=0)
    # a written over g_down itself (the layer's use): the same a, dh and dots
    g_down_copy = g_down.clone()
    a_in_place, grad_h_in_place, dots_in_place = cpu.glu_backward_one_pass(h, g_down_copy, weight, activation,
                                                                      a_out=g_down_copy)
    assert a_in_place.data_ptr() == g_down_copy.data_ptr()
    for got, want in [(a_in_place, a), (grad_h_in_place, grad_h), (dots_in_place, dots)]:
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_glu_against_float64_closed_forms(fused):
    """Independent of the torch path: float32 kernels against float64 autograd of act(hg) * hu."""
    h, grad_a, _ = operands(torch.float32, rows=64, width=33)
    for activation in ACTIVATIONS:
        act_fn = {"relu": F.relu, "gelu": F.gelu, "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
                  "silu": F.silu, "identity": lambda z: z}[activation]
        h64 = h.double().requires_grad_()
        width = h.shape[1] // 2
        act64 = act_fn(h64[:, :width])
        a64 = act64 * h64[:, width:]
        (grad_h64,) = torch.autograd.grad(a64, h64, grad_a.double())
        act_gate = torch.empty_like(grad_a)
        a = cpu.glu_forward(h, activation, act_gate)
        grad_h = cpu.glu_backward(grad_a, h, act_gate, activation)
        for got, want in [(act_gate, act64), (a, a64), (grad_h, grad_h64)]:
            # float32 exp/erf/tanh err by a few eps relative to the operands' scale, which
            # cancellation (1 + erf(z) for z << 0) can make large relative to a tiny result
            error = (got.double() - want.detach()).abs().max()
            assert error <= 32 * torch.finfo(torch.float32).eps * want.abs().max(), (activation, float(error))


def test_results_do_not_depend_on_thread_count(fused):
    rows, other, weight = operands(torch.bfloat16, rows=300, width=200)
    token = torch.randint(0, 50, (300,), generator=torch.Generator().manual_seed(2))
    pairs = combine.token_rows(torch.randperm(600, generator=torch.Generator().manual_seed(3))[:300], 100, 6)
    previous = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append((cpu.index_add_rows(other, token, 50, weight), cpu.rowwise_dot(other, rows[:, :200]),
                            cpu.combine_pairs(other, pairs, weight),
                            *cpu.glu_backward_one_pass(rows[:, :400], other, weight, "silu")))
    finally:
        torch.set_num_threads(previous)
    for one, two in zip(*results):
        torch.testing.assert_close(one, two, rtol=0, atol=0)


def test_bad_input_named_before_any_work(fused):
    h = torch.randn(4, 6)
    with pytest.raises(ValueError, match=r"act_gate: expected shape \(4, 3\), got \(4, 2\)"):
        cpu.glu_forward(h, "silu", torch.empty(4, 2))
    with pytest.raises(ValueError, match=r"h: expected an even width \[hg \| hu\], got 5"):
        cpu.glu_forward(torch.randn(4, 5), "silu")
    with pytest.raises(ValueError, match=r"grad_a: expected shape \(4, 3\), got \(3, 3\)"):
        cpu.glu_backward(torch.randn(3, 3), h, torch.randn(4, 3), "silu")
    with pytest.raises(ValueError, match=r"weight_rows: expected shape \(4,\), got \(5,\)"):
        cpu.scale_rows(h, torch.rand(5))
    with pytest.raises(ValueError, match=r"g_down: expected shape \(4, 3\), got \(4, 6\)"):
        cpu.glu_backward_one_pass(h, h, torch.rand(4), "silu")
    with pytest.raises(ValueError, match=r"weight_rows: expected shape \(4,\), got \(3,\)"):
        cpu.glu_backward_one_pass(h, h[:, :3], torch.rand(3), "silu")
    with pytest.raises(ValueError, match=r"grad_h_out: expected shape \(4, 6\), got \(4, 3\)"):
        cpu.glu_backward_one_pass(h, h[:, :3], torch.rand(4), "silu", grad_h_out=torch.empty(4, 3))
    with pytest.raises(ValueError, match=r"second_factor: expected shape \(4, 6\), got \(4, 5\)"):
        cpu.rowwise_dot(h, h, torch.randn(4, 5))
    out_of_range = torch.tensor([0, 1, 3, 2])
    with pytest.raises(IndexError, match=r"index: expected indices in \[0, 3\), got 3 at row 2"):
        cpu.index_add_rows(h, out_of_range, 3)
    with pytest.raises(IndexError, match=r"token_rows: expected row indices in \[-1, 4\), got 4 for token 1"):
        cpu.combine_pairs(h, torch.tensor([[0, 1], [-1, 4]]))
    with pytest.raises(ValueError, match=r"token_rows: expected \[S, k\], got shape \(4,\)"):
        cpu.combine_pairs(h, torch.tensor([0, 1, 2, 3]))
    # what the kernels do not take goes to the torch path, not to them
    ops = CpuOps.decide(h)
    assert not ops.elementwise_fits(h.double())
    assert not ops.elementwise_fits(h, activation="clamped_swiglu")
    assert not ops.elementwise_fits(h.t())
    with torch.enable_grad():
        assert not ops.elementwise_fits(h.requires_grad_())
    # given the forward's decision, only the operands are checked (the settings were read by it)
    h = h.detach()
    assert not CpuOps(side_by_side=True).elementwise_fits(h)
    with settings.override(fused_elementwise=False):
        assert not CpuOps.decide(h).elementwise
        assert CpuOps(elementwise=True).elementwise_fits(h)
        assert not CpuOps(elementwise=True).elementwise_fits(h.t())


def test_layer_runs_the_fused_passes_with_todays_results(fused, monkeypatch):
    """A bf16 glu layer, forward and backward: the forward's passes and the backward's one GLU pass
    (glu_backward_one_pass, not the separate glu_backward and rowwise_dot) are called, and the output and every
    gradient but the router's equal the torch path's bits (the router's gradient gets the row dots,
    which sum in another order)."""
    torch.manual_seed(0)
    layer = shardmoe.MoE(32, 24, 4, 2, dtype=torch.bfloat16)
    x = torch.randn(50, 32, dtype=torch.bfloat16)

    def step():
        layer.zero_grad(set_to_none=True)
        xg = x.clone().requires_grad_()
        out = layer(xg)
        out.float().square().sum().backward()
        return out, xg.grad, {n: p.grad for n, p in layer.named_parameters()}

    called = set()
    for name in ("glu_forward", "glu_backward", "glu_backward_one_pass", "scale_rows", "rowwise_dot", "combine_pairs"):
        def spy(*args, _name=name, _fn=getattr(cpu, name), **kwargs):
            called.add(_name)
            return _fn(*args, **kwargs)
        monkeypatch.setattr(cpu, name, spy)
    fused_out, fused_dx, layer_grads = step()
    assert called == {"glu_forward", "glu_backward_one_pass", "scale_rows", "combine_pairs"}
    ref_out, ref_dx, ref_grads = torch_path(monkeypatch, step)
    torch.testing.assert_close(fused_out, ref_out, rtol=0, atol=0)
    for name, grad in layer_grads.items():
        exact = name != "gate_weight"
        torch.testing.assert_close(grad, ref_grads[name], rtol=0 if exact else 2e-2, atol=0 if exact else 1e-3)
    torch.testing.assert_close(fused_dx, ref_dx, rtol=2e-2, atol=1e-3)  # dx also flows through the router


def opcheck_arguments(name):
    """Small arguments of op `name`: float32, row-strided views of an odd width, each written buffer
    fresh; the optional operands given to some ops and left out of combine_pairs."""
    h, rows, weight = operands(torch.float32, rows=6, width=5)
    n, f = rows.shape
    silu = cpu.ACTIVATION_CODES["silu"]
    return {
        "glu_forward": lambda: (h, silu, torch.empty(n, f), torch.empty(n, f)),
        "glu_backward": lambda: (rows, h, torch.randn(n, f), silu, torch.empty(n, 2 * f)),
        "glu_backward_one_pass": lambda: (h, rows, weight, silu, torch.empty(n, f), torch.empty(n, 2 * f), torch.empty(n)),
        "scale_rows": lambda: (rows, weight, torch.empty(n, f)),
        "rowwise_dot": lambda: (rows, h[:, :f], h[:, f:], torch.empty(n)),
        "index_add_rows": lambda: (rows, torch.tensor([0, 2, 1, 0, 3, 2]), weight, torch.zeros(4, f)),
        "combine_pairs": lambda: (rows, torch.tensor([[0, 3], [2, -1], [1, 5], [4, -1]]), None, torch.empty(4, f)),
    }[name]()


@pytest.mark.parametrize("name", ["glu_forward", "glu_backward", "glu_backward_one_pass", "scale_rows", "rowwise_dot",
                                  "index_add_rows", "combine_pairs"])
def test_pass_is_a_proper_torch_operator(fused, name):
    """torch.library.opcheck: the schema marks exactly the buffers the op writes, the op runs under
    FakeTensorMode and through AOT dispatch with dynamic shapes to its eager results; and its Meta
    kernel (what fake tensors and torch.compile trace) takes meta tensors and writes nothing."""
    op, args = getattr(fused, name), opcheck_arguments(name)
    torch.library.opcheck(op, args)
    assert op(*(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args)) is None


@pytest.mark.parametrize("compiler", ["/nonexistent/c++", "false"])
def test_unbuildable_library_falls_back_with_one_warning(monkeypatch, tmp_path, compiler):
    """No compiler (or one that fails): one RuntimeWarning line, then the torch path, results intact."""
    monkeypatch.setenv("CXX", compiler)
    monkeypatch.setenv("SHARDMOE_CACHE_DIR", str(tmp_path))
    cpu.library_loaded.cache_clear()
    try:
        torch.manual_seed(0)
        layer = shardmoe.MoE(16, 8, 4, 2)
        x = torch.randn(20, 16, requires_grad=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            layer(x).sum().backward()
            layer(x).sum().backward()
        lines = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert len(lines) == 1 and "\n" not in lines[0], lines
        assert lines[0].startswith("shardmoe: the C++ CPU library (elementwise passes, side-by-side GEMMs) is unavailable, "
                                  "using the torch path")
        assert x.grad is not None and bool(torch.isfinite(x.grad).all())
        assert not CpuOps.decide(x.detach()).elementwise
    finally:
        cpu.library_loaded.cache_clear()


def test_a_build_on_first_use_says_so_once(monkeypatch, tmp_path, capsys):
    """The first forward on a machine waited for the compiler without a word; the build announces
    itself in one line on stderr, and a cached build is silent."""
    monkeypatch.setenv("SHARDMOE_CACHE_DIR", str(tmp_path))
    compiled = []

    def compiler(command, **options):  # stands in for the compiler: writes the library file
        compiled.append(command)
        Path(command[command.index("-o") + 1]).write_bytes(b"not really a library")
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(cpu.subprocess, "run", compiler)
    library = cpu.build_library()
    assert capsys.readouterr().err == ("shardmoe: building the C++ CPU passes for this torch and CPU, once (about "
                                       f"40 s of compiler CPU time, longer on a busy machine; cached in {tmp_path})\n")
    assert library.parent == tmp_path and library.is_file() and len(compiled) == 1
    assert cpu.build_library() == library
    assert capsys.readouterr().err == "" and len(compiled) == 1
