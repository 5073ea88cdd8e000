"""Stage parity: the layer's Triton path against the float64 reference and against its torch path.

For every case (CASES) and dtype (float32, bfloat16) one shardmoe.MoE runs forward + backward of
L = sum(out * g) + aux_loss three ways on the same weights and input:
  triton     the kernel path (on CUDA it is the default; a dry run forces it on CPU tensors in
             Triton's interpreter with the force_kernels setting);
  torch      the same layer under shardmoe.settings.override(kernels=False);
  reference  moe/reference.py in float64 on CPU, given the layer's own (rounded) weights and input
             upcast, so the errors are those of the computation, not of rounding the inputs.
For the output, the aux loss, dL/dx and every parameter's gradient it reports
    err(a, b) = max|a - b| / max|b|      (max|a - b| where b is all zeros or empty)
for triton vs reference, triton vs torch and torch vs reference, and a case passes when the
first two are within TOLERANCES[dtype], the backend chosen inside the triton context was "triton",
the empty expert got no row, and a capacity case dropped pairs.

Routing by construction, so that bf16 rounding cannot flip a top-k choice: gate_weight is zero
except gate_weight[e, e] = 1 (e < E), and each token's features 0..E-1 hold LEVELS (multiples of
1/8, exact in bf16) in a random order, expert EMPTY always the lowest. The logits are then exact
in every dtype; with the router bias and correction bias below, every top-k and group choice of
the group-limited case wins by 1.9e-4 or more in score (all 7! orders of the levels enumerated),
and the others by more, far above float32 round-off. Expert EMPTY is not chosen (checked per
case): an empty expert group in every case with tokens.
"""
from __future__ import annotations

import math
import traceback
from dataclasses import dataclass, field

from .report import table

E = 8  # experts
EMPTY = 5  # the expert no token chooses
LEVELS = tuple(0.75 * j - 2.875 for j in range(E))  # per-token logits of the experts, before biases
GATE_BIAS = tuple(0.0625 * ((5 * e) % 8) - 0.25 for e in range(E))  # router_bias values (exact in bf16)
CORRECTION_BIAS = (0.0, 0.15, -0.05, 0.07, -0.12, 0.0, 0.01, 0.11)  # selection only
# (err vs the float64 reference, err vs the torch path), by dtype: fp32 runs full-precision dots
# ("ieee", no TF32) on both paths; bf16 rounds h, a, y and the operands of every GEMM
TOLERANCES = {"float32": (1e-5, 1e-5), "bfloat16": (3e-2, 3e-2)}


@dataclass(frozen=True)
class Sizes:
    tokens: int
    hidden: int
    ffn: int


# GPU: widths divisible by 16 (the kernels' specialisation, as at the bench's shapes) but by no tile
# width (partial tiles everywhere); S k / E ~ 100 rows per expert, BLOCK_M 128 (docs/kernels.md)
SIZES = Sizes(tokens=384, hidden=336, ffn=208)
DRY_RUN_SIZES = Sizes(tokens=32, hidden=32, ffn=16)


@dataclass(frozen=True)
class Case:
    options: dict = field(default_factory=dict)  # shardmoe.MoE keyword options
    top_k: int = 2
    batch: int = 1  # x [batch, S / batch, H]: batch sequences for the sequence-wise loss
    no_tokens: bool = False  # S = 0
    # replacing options in bfloat16: the clamped SwiGLU's derivative jumps at its limit L, and an
    # entry of h within half a bf16 ulp of L rounds across it, moving the bias gradient (a sum over a
    # few rows) by whole rows' terms on any path; so bf16 runs it with L = 7 (never reached: h ~ N(0, 1))
    # and float32 checks the active clamp (L = 1.5)
    bf16_options: dict = field(default_factory=dict)


CASES = {
    "glu-softmax-aux-z": Case(dict(expert="glu", activation="silu", aux_loss_coef=0.1, z_loss_coef=0.01)),
    "glu-unnormalized-scaled-capacity": Case(dict(expert="glu", activation="silu", renormalize=False,
                                                  routed_scaling_factor=2.5, capacity_factor=0.75)),
    "mlp-bias-gelu-capacity": Case(dict(expert="mlp", activation="gelu", bias=True, capacity_factor=1.0,
                                        aux_loss_coef=0.1)),
    "mlp-sigmoid-unnormalized-z": Case(dict(expert="mlp", activation="gelu", bias=True, score_func="sigmoid",
                                            renormalize=False, z_loss_coef=0.01)),
    "glu-deepseek-router": Case(dict(expert="glu", activation="silu", score_func="sigmoid", router_bias=True,
                                     correction_bias=True, n_group=4, topk_group=2, renormalize_epsilon=1e-20,
                                     routed_scaling_factor=2.5, seq_aux_loss_coef=0.05), top_k=3, batch=2),
    "glu-gpt-oss-bias-clamped": Case(dict(expert="glu", activation="clamped_swiglu", swiglu_limit=1.5, bias=True,
                                          router_bias=True), bf16_options=dict(swiglu_limit=7.0)),
    "glu-shared-expert": Case(dict(expert="glu", activation="silu", shared_ffn_size=32, shared_gate=True)),
    "glu-no-tokens": Case(dict(expert="glu", activation="silu", aux_loss_coef=0.1, z_loss_coef=0.01), no_tokens=True),
    "mlp-no-tokens": Case(dict(expert="mlp", activation="gelu", bias=True), no_tokens=True),
}
DTYPES = ("float32", "bfloat16")


def build(case: Case, dtype_name: str, device: str, sizes: Sizes, seed: int = 0):
    """(layer, x, grad_out) for one case: weights ~ N(0, 1/fan_in), biases ~ N(0, 0.01), the gate by
    construction (module docstring); the same values for every dtype and device (CPU generator)."""
    import torch

    import shardmoe

    dtype = getattr(torch, dtype_name)
    H = sizes.hidden
    options = {**case.options, **(case.bf16_options if dtype == torch.bfloat16 else {})}
    layer = shardmoe.MoE(H, sizes.ffn, E, case.top_k, dtype=dtype, device=device, **options)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name == "gate_weight":
                value = torch.zeros(H, E, dtype=torch.float64)
                value[range(E), range(E)] = 1.0
            elif name == "gate_bias":
                value = torch.tensor(GATE_BIAS, dtype=torch.float64)
            elif name in layer.config.kind.bias_names:
                value = 0.1 * torch.randn(p.shape, generator=gen, dtype=torch.float64)
            else:
                value = torch.randn(p.shape, generator=gen, dtype=torch.float64) / math.sqrt(p.shape[-1])
            p.copy_(value)
        if layer.correction_bias is not None:
            layer.correction_bias.copy_(torch.tensor(CORRECTION_BIAS))
    tokens = 0 if case.no_tokens else sizes.tokens
    x = torch.randn(tokens, H, generator=gen, dtype=torch.float64)
    levels = torch.tensor(LEVELS, dtype=torch.float64)
    others = [e for e in range(E) if e != EMPTY]
    for t in range(tokens):
        x[t, others] = levels[1:][torch.randperm(E - 1, generator=gen)]
        x[t, EMPTY] = levels[0]
    grad_out = torch.randn(tokens, H, generator=gen, dtype=torch.float64)
    shape = (case.batch, tokens // case.batch, H)
    return layer, x.reshape(shape).to(device, dtype), grad_out.reshape(shape).to(device, dtype)


def triton_context():
    """The kernel path, forced: on CUDA past kernels.KERNEL_MAX_FFN (the bench's Mixtral shape is
    wider), on CPU (a dry run) into the interpreter."""
    from shardmoe import settings

    return settings.override(force_kernels=True)


def torch_context():
    from shardmoe import settings

    return settings.override(kernels=False)


def forward_backward(layer, x, grad_out, context) -> tuple[str, dict, dict]:
    """(backend name, {"out", "aux_loss", "x", every parameter: tensor}, layer.stats) of one step."""
    from shardmoe.moe import dispatch

    layer.zero_grad(set_to_none=True)
    leaf = x.detach().clone().requires_grad_()
    with context:
        backend = dispatch.select(layer.config, leaf.reshape(-1, leaf.shape[-1])).name
        out = layer(leaf)
        out.backward(grad_out)
    tensors = {"out": out.detach(), "aux_loss": layer.aux_loss.detach(), "x": leaf.grad,
               **{name: p.grad for name, p in layer.named_parameters()}}
    return backend, tensors, layer.stats


def relative_error(actual, expected) -> float:
    """check.compare.relative_error (max|actual - expected| / max(max|expected|, 1e-3), float64), and
    inf for a missing tensor or a non-finite error (a NaN must not compare below a tolerance)."""
    from shardmoe.check.compare import relative_error as compare

    if actual is None:
        return math.inf
    if tuple(actual.shape) != tuple(expected.shape):
        raise ValueError(f"shape: expected {tuple(expected.shape)}, got {tuple(actual.shape)}")
    error = compare(actual, expected)
    return error if math.isfinite(error) else math.inf


def check_case(name: str, case: Case, dtype_name: str, device: str, sizes: Sizes) -> dict:
    """One row of the table: the three runs of `case` in `dtype_name` and their errors."""
    from shardmoe.moe.reference import reference_forward_backward

    layer, x, grad_out = build(case, dtype_name, device, sizes)
    backend, triton, stats = forward_backward(layer, x, grad_out, triton_context())
    per_expert = [int(v) for v in stats["tokens_per_expert"]]
    dropped = int(stats["dropped_tokens"])
    _, torch_path, _ = forward_backward(layer, x, grad_out, torch_context())
    params = {n: p.detach().double().cpu() for n, p in layer.named_parameters()}
    correction = None if layer.correction_bias is None else layer.correction_bias.double().cpu()
    out, aux, grads = reference_forward_backward(x.double().cpu(), params, layer.config, grad_out.double().cpu(),
                                                 correction)
    reference = {"out": out, "aux_loss": aux, **grads}
    errors = {key: {"vs_reference": relative_error(triton[key], reference[key]),
                    "vs_torch": relative_error(triton[key], torch_path[key]),
                    "torch_vs_reference": relative_error(torch_path[key], reference[key])} for key in triton}
    tol_reference, tol_torch = TOLERANCES[dtype_name]
    worst = {kind: max(errors, key=lambda k: errors[k][kind])
             for kind in ("vs_reference", "vs_torch", "torch_vs_reference")}
    problems = []
    if backend != "triton":
        problems.append(f"backend: expected 'triton' in the kernel context, got {backend!r}")
    if errors[worst["vs_reference"]]["vs_reference"] > tol_reference:
        problems.append(f"{worst['vs_reference']}: error vs float64 {errors[worst['vs_reference']]['vs_reference']:.2e}"
                        f" > {tol_reference:g}")
    if errors[worst["vs_torch"]]["vs_torch"] > tol_torch:
        problems.append(f"{worst['vs_torch']}: error vs the torch path {errors[worst['vs_torch']]['vs_torch']:.2e}"
                        f" > {tol_torch:g}")
    if not case.no_tokens and per_expert[EMPTY] != 0:
        problems.append(f"expert {EMPTY}: expected no rows (the empty expert), got {per_expert[EMPTY]}")
    if case.options.get("capacity_factor") and not case.no_tokens and dropped == 0:
        problems.append("dropped_tokens: expected > 0 with a capacity, got 0")
    return {"case": name, "dtype": dtype_name, "tokens": int(x.numel() // sizes.hidden), "top_k": case.top_k,
            "backend": backend, "tokens_per_expert": per_expert, "dropped": dropped, "errors": errors,
            "worst": {kind: [key, errors[key][kind]] for kind, key in worst.items()},
            "tolerance": [tol_reference, tol_torch], "problems": problems, "passed": not problems}


def run(ctx) -> dict:
    from shardmoe import settings

    sizes = DRY_RUN_SIZES if ctx.dry_run else SIZES
    rows, left_out = [], []
    for name, case in CASES.items():
        for dtype_name in DTYPES:
            if ctx.out_of_time():
                left_out.append(f"{name} {dtype_name}")
                continue
            try:
                # one tile config per kernel: 18 small cases would otherwise compile every candidate
                with settings.override(autotune=False):
                    row = check_case(name, case, dtype_name, ctx.device, sizes)
            except Exception as err:  # one case's crash is its row, the other cases still run
                row = {"case": name, "dtype": dtype_name, "problems": [f"{type(err).__name__}: {err}"],
                       "traceback": traceback.format_exc(), "passed": False}
                print(traceback.format_exc(limit=-4), flush=True)
            rows.append(row)
            print(f"  {name} {dtype_name}: " + ("ok" if row["passed"] else "; ".join(row["problems"])), flush=True)
            ctx.progress({"sizes": vars(sizes), "rows": rows})
    return {"sizes": vars(sizes), "experts": E, "empty_expert": EMPTY, "rows": rows, "left_out": left_out,
            "passed": all(r["passed"] for r in rows) and not left_out}


def markdown(result: dict) -> list[str]:
    s = result["sizes"]
    lines = [f"H={s['hidden']} F={s['ffn']} E={result.get('experts', E)}, S={s['tokens']} tokens (0 in the "
             f"no-tokens cases); err = max|a - b| / max|b| over the output, the aux loss, dL/dx and every "
             f"parameter's gradient (the tensor with the largest error in brackets).", ""]
    lines += table(["case", "dtype", "k", "backend", "dropped", "vs float64", "vs torch path", "torch vs float64",
                    "tolerance", "ok"],
                   [[r["case"], r["dtype"], r.get("top_k"), r.get("backend"), r.get("dropped"),
                     *(None if "worst" not in r else f"{r['worst'][kind][1]:.1e} ({r['worst'][kind][0]})"
                       for kind in ("vs_reference", "vs_torch", "torch_vs_reference")),
                     None if "tolerance" not in r else f"{r['tolerance'][0]:g} / {r['tolerance'][1]:g}",
                     "yes" if r["passed"] else "NO: " + "; ".join(r["problems"])] for r in result["rows"]])
    if result.get("left_out"):
        lines += ["", "Not run (budget spent): " + ", ".join(result["left_out"])]
    return lines + ["", "Per-tensor errors are in report.json (stages.parity.result.rows[].errors)."]
