"""Expert FFNs on expert-sorted rows: grouped GEMMs, forward, and backward stages 3 and 4.

Rows [N, .] are grouped by expert (Groups). Parameters, per expert e:
  "glu":  gate_up_proj [E, 2F, H] (rows 0:F gate, F:2F up), down_proj [E, H, F],
          optional gate_up_proj_bias [E, 2F], down_proj_bias [E, H] (GPT-OSS names; None without bias)
          h = x Wgu_e^T + bgu_e = [hg | hu];  a = act(hg) * hu;  y = a Wdown_e^T + bdown_e
  "mlp":  w1 [E, P, H], b1 [E, P], w2 [E, H, P], b2 [E, H]
          z1 = x W1_e^T + b1_e;  a1 = act(z1);  z2 = a1 W2_e^T + b2_e;  y = act_out(z2)

The stage functions below are the one place that picks an implementation: CUDA tensors go to
the Triton kernels of shardmoe/kernels (same signatures) when kernels.available() says so.
On CPU, GEMMs use torch.nn.functional.grouped_mm for fp32/bf16 operands whose strides are
16-byte aligned (its kernels require it), and a per-expert loop otherwise (float64,
odd tiny shapes). Elementwise math stays in the input dtype: the activation kernels
compute in float32 internally and round once, and a bf16 -> fp32 -> bf16 round trip
would cost more than the GEMMs on CPU. Reductions over tokens accumulate in float32.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shardmoe import kernels
from shardmoe.moe import elementwise
from shardmoe.moe.activations import activate, activate_backward
from shardmoe.moe.combine import grad_combine, grad_gate_combine, row_chunks
from shardmoe.moe.routing import accumulation_dtype


@dataclass(frozen=True)
class Groups:
    """Expert e owns rows [start_e, start_e + sizes[e]) of the dispatched matrix."""

    sizes: tuple[int, ...]
    offsets: torch.Tensor  # int32 [E], cumulative ends, as grouped_mm wants them

    @classmethod
    def from_counts(cls, counts: torch.Tensor) -> "Groups":
        return cls(tuple(int(c) for c in counts.tolist()), torch.cumsum(counts, 0).to(torch.int32))

    def row_expert(self, device=None) -> torch.Tensor:
        """[N] expert index of each row."""
        sizes = torch.tensor(self.sizes, device=device if device is not None else self.offsets.device)
        return torch.repeat_interleave(torch.arange(len(self.sizes), device=sizes.device), sizes)


def _aligned(t: torch.Tensor) -> bool:
    """Whether grouped_mm takes t's layout, by its own rule (ATen's GroupedMMUtils.h): the last two
    dims are row-major (stride[-1] == 1, stride[-2] >= max(1, cols)) or column-major (the mirror),
    and the leading stride of that layout, the data pointer and the batch strides are 16-byte
    multiples. A dim of size 1 can give both strides 1 (a [N, 1] or [1, K] matrix): which of them is
    the unit stride must then be read off the layout, not skipped, or a 4-byte leading stride passes."""
    size = t.element_size()
    rows, cols = t.shape[-2:]
    row_stride, col_stride = t.stride()[-2:]
    if row_stride == 1 and col_stride >= max(1, rows):  # ATen tests column-major first
        lead = col_stride
    elif col_stride == 1 and row_stride >= max(1, cols):
        lead = row_stride
    else:
        return False
    return t.data_ptr() % 16 == 0 and all(s * size % 16 == 0 for s in (lead, *t.stride()[:-2]))


def _use_grouped_mm(*operands: torch.Tensor) -> bool:
    return all(t.dtype in (torch.float32, torch.bfloat16) and _aligned(t) for t in operands)


def grouped_linear(rows: torch.Tensor, weight: torch.Tensor, groups: Groups,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """out_r = rows_r W_e^T (+ b_e) for the expert e of row r: rows [N, K], weight [E, O, K],
    bias [E, O] -> [N, O].

    With a bias each expert runs one addmm, which adds b_e inside the GEMM and rounds once
    (grouped_mm takes no bias on CPU, and adding it after a bf16 GEMM rounds twice)."""
    weight_t = weight.transpose(-2, -1)
    if bias is None and _use_grouped_mm(rows, weight_t):
        return F.grouped_mm(rows, weight_t, offs=groups.offsets)
    out = rows.new_empty((rows.shape[0], weight.shape[1]))
    for e, (part, dest) in enumerate(zip(rows.split(groups.sizes), out.split(groups.sizes))):
        if bias is None:
            torch.mm(part, weight_t[e], out=dest)
        else:
            torch.addmm(bias[e], part, weight_t[e], out=dest)
    return out


def grouped_linear_t(rows: torch.Tensor, weight: torch.Tensor, groups: Groups) -> torch.Tensor:
    """out_r = rows_r W_e (the input-gradient GEMM): rows [N, O], weight [E, O, K] -> [N, K]."""
    if _use_grouped_mm(rows, weight):
        return F.grouped_mm(rows, weight, offs=groups.offsets)
    out = rows.new_empty((rows.shape[0], weight.shape[2]))
    for e, (part, dest) in enumerate(zip(rows.split(groups.sizes), out.split(groups.sizes))):
        torch.mm(part, weight[e], out=dest)
    return out


def grouped_weight_grad(grad_rows: torch.Tensor, in_rows: torch.Tensor, groups: Groups) -> torch.Tensor:
    """dW_e = sum over rows r of e of grad_r^T in_r: [N, O], [N, K] -> [E, O, K].

    The sum over an expert's rows happens inside one GEMM (fp32 accumulation for bf16)."""
    grad_t = grad_rows.t()
    if _use_grouped_mm(grad_t, in_rows) and grad_rows.shape[0] > 0:
        return F.grouped_mm(grad_t, in_rows, offs=groups.offsets)
    out = grad_rows.new_zeros((len(groups.sizes), grad_rows.shape[1], in_rows.shape[1]))
    for e, (g, x) in enumerate(zip(grad_rows.split(groups.sizes), in_rows.split(groups.sizes))):
        if g.shape[0]:
            out[e] = g.t() @ x
    return out


def grouped_bias_grad(grad_rows: torch.Tensor, groups: Groups) -> torch.Tensor:
    """db_e = sum over rows r of e of grad_r: [N, O] -> [E, O], summed in the acc dtype."""
    if elementwise.available(grad_rows):  # the same row-order sum, one pass
        return elementwise.combine_rows(grad_rows, groups.row_expert(), len(groups.sizes)).to(grad_rows.dtype)
    acc = accumulation_dtype(grad_rows.dtype)
    out = grad_rows.new_zeros((len(groups.sizes), grad_rows.shape[1]), dtype=acc)
    out.index_add_(0, groups.row_expert(grad_rows.device), grad_rows.to(acc))
    return out.to(grad_rows.dtype)


def glu_activation(h: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """For h = [hg | hu] [N, 2F]: (a = act(hg) * hu, act(hg)), both [N, F] (backward needs both)."""
    ffn = h.shape[-1] // 2
    act_gate = h.new_empty((h.shape[0], ffn))
    return _glu(h, activation, act_gate), act_gate


def _glu(h: torch.Tensor, activation: str, act_gate: torch.Tensor | None = None) -> torch.Tensor:
    """a = act(hg) * hu [N, F], row chunk by row chunk so that act(hg) is still in cache when the
    product reads it; act(hg) is also written to act_gate when one is given."""
    if elementwise.available(h, *([] if act_gate is None else [act_gate]), activation=activation):
        return elementwise.glu_forward(h, activation, act_gate)
    ffn = h.shape[-1] // 2
    a = h.new_empty((h.shape[0], ffn))
    for c in row_chunks(h):
        act = activate(activation, h[c, :ffn])
        if act_gate is not None:
            act_gate[c] = act
        torch.mul(act, h[c, ffn:], out=a[c])
    return a


def pre_gemm(expert: str, activation: str, xs: torch.Tensor, params: dict[str, torch.Tensor | None],
             groups: Groups) -> tuple[torch.Tensor, torch.Tensor]:
    """The expert's first GEMM and activation, (a, z) for dispatched rows xs [N, H]:
      "glu": z = h = xs Wgu_e^T + bgu_e [N, 2F], a = act(hg) * hu [N, F]
      "mlp": z = z1 = xs W1_e^T + b1_e [N, P], a = act(z1)      [N, P]
    A tile task passes the weight rows of its columns (both halves for "glu") and gets those columns."""
    if expert == "glu":
        h = grouped_linear(xs, params["gate_up_proj"], groups, params.get("gate_up_proj_bias"))
        return _glu(h, activation), h
    z1 = grouped_linear(xs, params["w1"], groups, params["b1"])
    return activate(activation, z1), z1


def post_gemm(expert: str, output_activation: str, a: torch.Tensor, params: dict[str, torch.Tensor | None],
              groups: Groups) -> tuple[torch.Tensor, torch.Tensor]:
    """The expert's second GEMM and output activation, (y, z2) [N, H] each:
      "glu": y = z2 = a Wdown_e^T + bdown_e;  "mlp": z2 = a W2_e^T + b2_e, y = act_out(z2)."""
    if expert == "glu":
        y = grouped_linear(a, params["down_proj"], groups, params.get("down_proj_bias"))
        return y, y
    z2 = grouped_linear(a, params["w2"], groups, params["b2"])
    return activate(output_activation, z2), z2


def expert_forward(expert: str, activation: str, output_activation: str, xs: torch.Tensor,
                   params: dict[str, torch.Tensor | None], groups: Groups):
    """y [N, H] for dispatched rows xs [N, H] (pre_gemm then post_gemm), and the tensors backward
    keeps: "glu": (h,) with h [N, 2F];  "mlp": (z1, z2) with z1 [N, P], z2 [N, H]."""
    # the Triton kernels take no glu biases: a biased glu runs the torch path on every device
    if kernels.available(xs) and params.get("gate_up_proj_bias") is None:
        from shardmoe.kernels import experts as triton_experts
        return triton_experts.expert_forward(expert, activation, output_activation, xs, params, groups)
    a, z = pre_gemm(expert, activation, xs, params, groups)
    y, z2 = post_gemm(expert, output_activation, a, params, groups)
    return y, ((z,) if expert == "glu" else (z, z2))


def grad_post_gemm_glu(grad_rows: torch.Tensor, weight_rows: torch.Tensor, a: torch.Tensor,
                       down_proj: torch.Tensor, groups: Groups, has_bias: bool = False):
    """Stage 3 for "glu", fed the unscaled g [N, H] and w [N]:
      g_down = g Wdown_e            [N, F]   (also feeds stage 2: g . y = g_down . a)
      dA     = w g_down = ge Wdown_e [N, F]
      dWdown_e = sum ge^T a          [E, H, F]
      dbdown_e = sum ge              [E, H]   (with has_bias, else None)
    Applying w after the GEMM is exact (it is linear) and lets stage 2 reuse the GEMM.
    The bias adds w_tj bdown_e to the output, so stage 2's gate dot gains g . bdown_e: the
    caller adds it (expert_backward), since this function only sees the gradient side."""
    if kernels.available(grad_rows) and not has_bias:
        from shardmoe.kernels import experts as triton_experts
        return (*triton_experts.grad_post_gemm_glu(grad_rows, weight_rows, a, down_proj, groups), None)
    g_down = grouped_linear_t(grad_rows, down_proj, groups)
    grad_a = grad_combine(g_down, weight_rows)
    grad_expert = grad_combine(grad_rows, weight_rows)
    grad_down = grouped_weight_grad(grad_expert, a, groups)
    grad_down_bias = grouped_bias_grad(grad_expert, groups) if has_bias else None
    return grad_a, grad_down, g_down, grad_down_bias


def grad_pre_gemm_glu(grad_a: torch.Tensor, h: torch.Tensor, act_gate: torch.Tensor, xs: torch.Tensor,
                      gate_up_proj: torch.Tensor, groups: Groups, activation: str, has_bias: bool = False):
    """Stage 4 for "glu", given act(hg) from the recomputed forward:
      dhg = (dA * hu) * act'(hg);  dhu = dA * act(hg);  dh = [dhg | dhu]   [N, 2F]
      dWgu_e = sum dh^T x   [E, 2F, H];   dx = dh Wgu_e   [N, H];   dbgu_e = sum dh  [E, 2F] (has_bias)"""
    if kernels.available(grad_a) and not has_bias:
        from shardmoe.kernels import experts as triton_experts
        return (*triton_experts.grad_pre_gemm_glu(grad_a, h, act_gate, xs, gate_up_proj, groups, activation), None)
    ffn = act_gate.shape[-1]
    if elementwise.available(grad_a, h, act_gate, activation=activation):
        grad_h = elementwise.glu_backward(grad_a, h, act_gate, activation)
    else:
        grad_h = torch.empty_like(h)
        # one pass per row chunk: the [N, F] intermediate dA * hu never leaves the cache
        for c in row_chunks(h):
            gate, up = h[c, :ffn], h[c, ffn:]
            grad_h[c, :ffn] = activate_backward(activation, grad_a[c] * up, gate)
            torch.mul(grad_a[c], act_gate[c], out=grad_h[c, ffn:])
    grad_bias = grouped_bias_grad(grad_h, groups) if has_bias else None
    return grouped_linear_t(grad_h, gate_up_proj, groups), grouped_weight_grad(grad_h, xs, groups), grad_bias


def grad_post_gemm_mlp(grad_expert: torch.Tensor, z2: torch.Tensor, a1: torch.Tensor, w2: torch.Tensor,
                       has_bias: bool, groups: Groups, output_activation: str):
    """Stage 3 for "mlp", fed ge [N, H] from grad_combine:
      dz2 = ge * act_out'(z2);  dW2_e = sum dz2^T a1;  db2_e = sum dz2;  da1 = dz2 W2_e  [N, P]"""
    if kernels.available(grad_expert):
        from shardmoe.kernels import experts as triton_experts
        return triton_experts.grad_post_gemm_mlp(grad_expert, z2, a1, w2, has_bias, groups, output_activation)
    grad_z2 = activate_backward(output_activation, grad_expert, z2)
    grad_b2 = grouped_bias_grad(grad_z2, groups) if has_bias else None
    return grouped_linear_t(grad_z2, w2, groups), grouped_weight_grad(grad_z2, a1, groups), grad_b2


def grad_pre_gemm_mlp(grad_a1: torch.Tensor, z1: torch.Tensor, xs: torch.Tensor, w1: torch.Tensor,
                      has_bias: bool, groups: Groups, activation: str):
    """Stage 4 for "mlp": dz1 = da1 * act'(z1);  dW1_e = sum dz1^T x;  db1_e = sum dz1;  dx = dz1 W1_e"""
    if kernels.available(grad_a1):
        from shardmoe.kernels import experts as triton_experts
        return triton_experts.grad_pre_gemm_mlp(grad_a1, z1, xs, w1, has_bias, groups, activation)
    grad_z1 = activate_backward(activation, grad_a1, z1)
    grad_b1 = grouped_bias_grad(grad_z1, groups) if has_bias else None
    return grouped_linear_t(grad_z1, w1, groups), grouped_weight_grad(grad_z1, xs, groups), grad_b1


def expert_backward(expert: str, activation: str, output_activation: str, grad_rows: torch.Tensor,
                    weight_rows: torch.Tensor, xs: torch.Tensor, saved: tuple, params: dict, groups: Groups):
    """Stages 1-4 on dispatched rows, given the unscaled output gradient g [N, H], the combine
    weights w [N], the rows xs [N, H] and what expert_forward saved.

    Returns (dx rows [N, H], gate dots dw [N] in the acc dtype, {parameter name: gradient}).
    "glu" takes the gate dot over F, as (g Wdown) . a: with F sharded that is a partial sum.
    """
    if expert == "glu":
        (h,) = saved
        has_bias = params.get("gate_up_proj_bias") is not None
        a, act_gate = glu_activation(h, activation)
        grad_a, grad_down, g_down, grad_down_bias = grad_post_gemm_glu(grad_rows, weight_rows, a, params["down_proj"],
                                                                       groups, has_bias)
        grad_dots = grad_gate_combine(g_down, act_gate, h[:, act_gate.shape[1]:])
        if has_bias:  # y = a Wdown_e^T + bdown_e, so g . y gains g . bdown_e
            row_bias = params["down_proj_bias"][groups.row_expert(grad_rows.device)]
            grad_dots = grad_dots + grad_gate_combine(grad_rows, row_bias)
        grad_xs, grad_gate_up, grad_gate_up_bias = grad_pre_gemm_glu(grad_a, h, act_gate, xs, params["gate_up_proj"],
                                                                     groups, activation, has_bias)
        return grad_xs, grad_dots, {"gate_up_proj": grad_gate_up, "gate_up_proj_bias": grad_gate_up_bias,
                                    "down_proj": grad_down, "down_proj_bias": grad_down_bias}
    z1, z2 = saved
    has_bias = params["b1"] is not None
    grad_dots = grad_gate_combine(grad_rows, activate(output_activation, z2))
    grad_a1, grad_w2, grad_b2 = grad_post_gemm_mlp(grad_combine(grad_rows, weight_rows), z2,
                                                   activate(activation, z1), params["w2"], has_bias, groups,
                                                   output_activation)
    grad_xs, grad_w1, grad_b1 = grad_pre_gemm_mlp(grad_a1, z1, xs, params["w1"], has_bias, groups, activation)
    return grad_xs, grad_dots, {"w1": grad_w1, "b1": grad_b1, "w2": grad_w2, "b2": grad_b2}
