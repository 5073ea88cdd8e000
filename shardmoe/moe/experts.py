"""Expert FFNs on expert-sorted rows: the forward, and backward stages 3 and 4, as plain stage math.

Rows [N, .] are grouped by expert (Groups). Parameters, per expert e:
  "glu":  gate_up_proj [E, 2F, H] (rows 0:F gate, F:2F up), down_proj [E, H, F],
          optional gate_up_proj_bias [E, 2F], down_proj_bias [E, H] (GPT-OSS names; None without bias)
          h = x Wgu_e^T + bgu_e = [hg | hu];  a = act(hg) * hu;  y = a Wdown_e^T + bdown_e
          (activation a ClampedSwiGLU: a = (clamp(hu, -L, L) + 1) f(min(hg, L)), moe/activations.py)
  "mlp":  w1 [E, P, H], b1 [E, P], w2 [E, H, P], b2 [E, H]
          z1 = x W1_e^T + b1_e;  a1 = act(z1);  z2 = a1 W2_e^T + b2_e;  y = act_out(z2)
pre_gemm, post_gemm and TorchOps' expert_forward and expert_backward take the kind
(shardmoe/expert_kinds.py: GLU or MLP) and run its body here; stages 3 and 4 are a function per
kind (grad_post_gemm_glu, ...).

Every stage function takes `ops` first: the row primitives it runs on (the experts' GEMMs, the
GLU's elementwise passes, row scaling, row dots, combines, row buffers). TorchOps below is torch's
own, on any device, with fresh buffers; its linear and weight_grad hold every form the experts'
GEMMs take: grouped_mm for fp32/bf16 operands whose strides are 16-byte aligned (its kernels
require it; on CPU it runs the per-expert loop's products, bit for bit), the CPU's side-by-side
GEMMs where CpuOps allows them, and a per-expert loop otherwise (float64, odd tiny shapes, a
GEMM into a given buffer, and a GEMM with a bias: one addmm per expert adds b_e inside the GEMM
and rounds once). On CPU the stages run on moe/cpu.py's CpuOps, which overrides the elementwise
primitives with the C++ passes, allows the side-by-side GEMMs and lends the layer's workspace
buffers where they take the operands. Elementwise math stays in the input dtype: the activation
kernels compute in float32 internally and round once, and a bf16 -> fp32 -> bf16 round trip
would cost more than the GEMMs on CPU. Reductions over tokens accumulate in float32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from shardmoe.expert_kinds import GLU, MLP, ExpertKind
from shardmoe.moe import combine as comb
from shardmoe.moe.activations import ClampedSwiGLU, activate, activate_backward
from shardmoe.moe.combine import grad_combine, grad_gate_combine, row_chunks
from shardmoe.rows import Groups, accumulation_dtype


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


class TorchOps:
    """What a step's stages run on (moe/dispatch.py select()): the row primitives the stage math
    calls, in torch's own ops (any device, fresh buffers), and the stages the operators and
    dispatchers call (expert_forward, expert_backward, combine, grad_gate_combine,
    grad_input_combine), here the stage math below on those primitives. moe/cpu.py's CpuOps is the
    same with the CPU's own primitives; moe/triton_ops.py's TritonOps runs the stages on kernels."""

    name = "torch"

    # whether the GEMMs write into row buffers of empty() (CpuOps: the workspace's) rather than
    # leave grouped_mm, which allocates its output, to make them
    fills_row_buffers = False

    def empty(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """An uninitialised row buffer of `shape` with like's dtype and device."""
        return like.new_empty(shape)

    def gemm_fits(self, groups: Groups, *tensors: torch.Tensor) -> bool:
        """Whether the experts' GEMMs of these operands run side by side, one expert per intra-op
        thread (the CPU's C++ GEMMs, moe/cpu.py CpuOps): never with torch's own ops."""
        return False

    # -- the experts' GEMMs: every form of them is here ------------------------------------------

    def linear(self, rows: torch.Tensor, weight: torch.Tensor, groups: Groups,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """out_r = rows_r W_e^T (+ b_e) for the expert e of row r: rows [N, K], weight [E, O, K],
        bias [E, O] -> [N, O]. The forward GEMMs (and, through linear_t, the input-gradient ones),
        in the first form that takes them:
          grouped_mm   torch's grouped GEMM, for fp32/bf16 operands its stride rule takes, no bias,
                       where the output may be its own allocation (on CPU it runs the per-expert
                       products of the loop below, bit for bit)
          side by side torch.ops.shardmoe_gemm.experts_mm, one expert per intra-op thread, into a
                       row buffer, where gemm_fits (moe/cpu.py, "Side-by-side GEMMs")
          per expert   one torch.mm (addmm with a bias: b_e added inside the GEMM, one rounding)
                       per expert into a row buffer of empty()"""
        weight_t = weight.transpose(-2, -1)
        if bias is None and not self.fills_row_buffers and _use_grouped_mm(rows, weight_t):
            return F.grouped_mm(rows, weight_t, offs=groups.offsets)
        out = self.empty((rows.shape[0], weight_t.shape[2]), rows)
        if bias is None and self.gemm_fits(groups, rows, weight_t, out):
            torch.ops.shardmoe_gemm.experts_mm(rows, weight_t, list(groups.sizes), out)
            return out
        for e, part, dest in groups.expert_rows(rows, out):
            if bias is None:
                torch.mm(part, weight_t[e], out=dest)
            else:
                torch.addmm(bias[e], part, weight_t[e], out=dest)
        return out

    def linear_t(self, rows: torch.Tensor, weight: torch.Tensor, groups: Groups) -> torch.Tensor:
        """out_r = rows_r W_e (the input-gradient GEMM): rows [N, O], weight [E, O, K] -> [N, K];
        linear with W_e^T."""
        return self.linear(rows, weight.transpose(-2, -1), groups)

    def weight_grad(self, grad_rows: torch.Tensor, in_rows: torch.Tensor, groups: Groups) -> torch.Tensor:
        """dW_e = sum over rows r of e of grad_r^T in_r: [N, O], [N, K] -> [E, O, K]. The sum over an
        expert's rows happens inside one GEMM (fp32 accumulation for bf16): side by side where
        gemm_fits (torch.ops.shardmoe_gemm.experts_weight_grad), else grouped_mm where its stride
        rule takes the operands, else one GEMM per expert."""
        if self.gemm_fits(groups, grad_rows, in_rows):
            out = grad_rows.new_empty((groups.num_experts, grad_rows.shape[1], in_rows.shape[1]))
            torch.ops.shardmoe_gemm.experts_weight_grad(grad_rows, in_rows, list(groups.sizes), out)
            return out
        grad_t = grad_rows.t()
        if _use_grouped_mm(grad_t, in_rows) and grad_rows.shape[0] > 0:
            return F.grouped_mm(grad_t, in_rows, offs=groups.offsets)
        out = grad_rows.new_zeros((groups.num_experts, grad_rows.shape[1], in_rows.shape[1]))
        for e, (g, x) in enumerate(zip(grad_rows.split(groups.sizes), in_rows.split(groups.sizes))):
            if g.shape[0]:
                out[e] = g.t() @ x
        return out

    def bias_grad(self, grad_rows: torch.Tensor, groups: Groups) -> torch.Tensor:
        """db_e = sum over rows r of e of grad_r: [N, O] -> [E, O], summed in the acc dtype."""
        acc = accumulation_dtype(grad_rows.dtype)
        out = grad_rows.new_zeros((groups.num_experts, grad_rows.shape[1]), dtype=acc)
        out.index_add_(0, groups.row_expert(grad_rows.device), grad_rows.to(acc))
        return out.to(grad_rows.dtype)

    def glu(self, h: torch.Tensor, activation: str | ClampedSwiGLU,
            act_gate: torch.Tensor | None = None) -> torch.Tensor:
        """a = act(hg) * hu [N, F] for h = [hg | hu] [N, 2F], row chunk by row chunk so that act(hg)
        is still in cache when the product reads it; act(hg) (a ClampedSwiGLU's gate factor
        f(min(hg, L))) is also written to act_gate [N, F] when one is given."""
        ffn = h.shape[-1] // 2
        a = self.empty((h.shape[0], ffn), h)
        for c in row_chunks(h):
            if isinstance(activation, ClampedSwiGLU):
                act = activation.forward(h[c, :ffn], h[c, ffn:], out=a[c])[1]
                if act_gate is not None:
                    act_gate[c] = act
                continue
            act = activate(activation, h[c, :ffn])
            if act_gate is not None:
                act_gate[c] = act
            torch.mul(act, h[c, ffn:], out=a[c])
        return a

    def glu_backward(self, grad_a: torch.Tensor, h: torch.Tensor, act_gate: torch.Tensor,
                     activation: str | ClampedSwiGLU) -> torch.Tensor:
        """dh = [dA hu act'(hg) | dA act(hg)] [N, 2F] from dA [N, F], h = [hg | hu] [N, 2F] and
        act(hg) [N, F] (a ClampedSwiGLU by its own derivative), one pass per row chunk: the [N, F]
        intermediate dA * hu never leaves the cache."""
        ffn = act_gate.shape[-1]
        grad_h = self.empty(h.shape, h)
        for c in row_chunks(h):
            gate, up = h[c, :ffn], h[c, ffn:]
            if isinstance(activation, ClampedSwiGLU):
                activation.backward(grad_a[c], gate, up, act_gate[c], grad_h[c, :ffn], grad_h[c, ffn:])
                continue
            grad_h[c, :ffn] = activate_backward(activation, grad_a[c] * up, gate)
            torch.mul(grad_a[c], act_gate[c], out=grad_h[c, ffn:])
        return grad_h

    def has_glu_backward_one_pass(self, grad_rows: torch.Tensor, h: torch.Tensor, weight_rows: torch.Tensor,
                       activation: str | ClampedSwiGLU) -> bool:
        """Whether these ops have glu_backward_one_pass, the glu expert's backward elementwise work
        in one pass (_glu_expert_backward_one_pass), for these operands: torch's own have not."""
        return False

    def scale_rows(self, rows: torch.Tensor, weight_rows: torch.Tensor, *,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        return comb.scale_rows(rows, weight_rows, out=out)

    def rowwise_dot(self, rows: torch.Tensor, *factors: torch.Tensor) -> torch.Tensor:
        return comb.rowwise_dot(rows, *factors)

    def combine_rows(self, rows: torch.Tensor, row_pair: torch.Tensor, num_tokens: int, top_k: int,
                     weight_rows: torch.Tensor | None = None) -> torch.Tensor:
        return comb.combine_rows(rows, row_pair, num_tokens, top_k, weight_rows)

    # -- the stages the operators and dispatchers call (TritonOps runs them on its kernels) --------

    def expert_forward(self, kind: ExpertKind, activation: str | ClampedSwiGLU, output_activation: str,
                       xs: torch.Tensor, params: dict[str, torch.Tensor | None], groups: Groups, *,
                       row_index: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple]:
        """y [N, H] for dispatched rows xs [N, H] (with row_index [N]: the rows xs[row_index] of the
        token-order xs [S, H], gathered into a row buffer), pre_gemm then post_gemm, and the tensors
        backward keeps, kind.saved(z, z2): GLU (h,) with h [N, 2F];  MLP (z1, z2) with z1 [N, P],
        z2 [N, H]."""
        if row_index is not None:
            xs = gather_rows(self, xs, row_index)
        a, z = pre_gemm(self, kind, activation, xs, params, groups)
        y, z2 = post_gemm(self, kind, output_activation, a, params, groups)
        return y, kind.saved(z, z2)

    def expert_backward(self, kind: ExpertKind, activation: str | ClampedSwiGLU, output_activation: str,
                        grad_rows: torch.Tensor, weight_rows: torch.Tensor, xs: torch.Tensor, saved: tuple,
                        params: dict, groups: Groups, *, row_index: torch.Tensor | None = None):
        """Stages 1-4 on dispatched rows, given the unscaled output gradient g [N, H], the combine
        weights w [N], the rows xs [N, H] and what expert_forward saved (with row_index [N],
        grad_rows and xs are the token-order [S, H] tensors, gathered here).

        GLU runs the elementwise work of stages 2-4 as one pass where these ops have it for the
        operands (has_glu_backward_one_pass: the CPU's C++ pass; _glu_expert_backward_one_pass),
        and stage by stage otherwise (_glu_expert_backward_by_stage): the same products, the same
        bits.

        Returns (dx rows [N, H], gate dots dw [N] in the acc dtype, {parameter name: gradient}).
        GLU takes the gate dot over F, as (g Wdown) . a: with F sharded that is a partial sum.
        """
        if row_index is not None:
            grad_rows, xs = gather_rows(self, grad_rows, row_index), gather_rows(self, xs, row_index)
        if kind is MLP:
            return _mlp_expert_backward(self, activation, output_activation, grad_rows, weight_rows, xs, saved, params,
                                 groups)
        (h,) = saved
        has_bias = params.get("gate_up_proj_bias") is not None
        one_pass = self.has_glu_backward_one_pass(grad_rows, h, weight_rows, activation)
        by = _glu_expert_backward_one_pass if one_pass else _glu_expert_backward_by_stage
        grad_xs, grad_dots, grads = by(self, activation, grad_rows, weight_rows, xs, h, params, groups, has_bias)
        # y = a Wdown_e^T + bdown_e, so g . y gains g . bdown_e; expert TP passes down_proj_bias None
        # (it adds the term once, after the psum of the partial dots over t) but still wants dbdown
        if params.get("down_proj_bias") is not None:
            row_bias = params["down_proj_bias"][groups.row_expert(grad_rows.device)]
            grad_dots = grad_dots + grad_gate_combine(self, grad_rows, row_bias)
        return grad_xs, grad_dots, grads

    def combine(self, expert_out: torch.Tensor, weight_rows: torch.Tensor, row_pair: torch.Tensor,
                num_tokens: int, top_k: int) -> torch.Tensor:
        """The forward combine (combine.combine): out [S, H] acc dtype."""
        return comb.combine(self, expert_out, weight_rows, row_pair, num_tokens, top_k)

    def grad_gate_combine(self, grad_rows: torch.Tensor, out_rows: torch.Tensor) -> torch.Tensor:
        """Stage 2 (combine.grad_gate_combine): dw_r = g_r . y_r [N] acc dtype."""
        return comb.grad_gate_combine(self, grad_rows, out_rows)

    def grad_input_combine(self, dx_rows: torch.Tensor, row_pair: torch.Tensor, num_tokens: int,
                           top_k: int) -> torch.Tensor:
        """Stage 5 (combine.grad_input_combine): dx [S, H] acc dtype."""
        return comb.grad_input_combine(self, dx_rows, row_pair, num_tokens, top_k)


TORCH_OPS = TorchOps()


def gather_rows(ops: TorchOps, tokens: torch.Tensor, row_token: torch.Tensor) -> torch.Tensor:
    """tokens[row_token]: [S, D], [N] -> [N, D], into a buffer of ops.empty."""
    return torch.index_select(tokens, 0, row_token, out=ops.empty((row_token.shape[0], tokens.shape[1]), tokens))


def glu_activation(ops, h: torch.Tensor, activation: str | ClampedSwiGLU) -> tuple[torch.Tensor, torch.Tensor]:
    """For h = [hg | hu] [N, 2F]: (a = act(hg) * hu, act(hg)), both [N, F] (backward needs both);
    for a ClampedSwiGLU act(hg) is its gate factor f(min(hg, L))."""
    act_gate = ops.empty((h.shape[0], h.shape[-1] // 2), h)
    return ops.glu(h, activation, act_gate), act_gate


def pre_gemm(ops, kind: ExpertKind, activation: str | ClampedSwiGLU, xs: torch.Tensor,
             params: dict[str, torch.Tensor | None], groups: Groups) -> tuple[torch.Tensor, torch.Tensor]:
    """The expert's first GEMM and activation, (a, z) for dispatched rows xs [N, H]:
      GLU: z = h = xs Wgu_e^T + bgu_e [N, 2F], a = act(hg) * hu [N, F]
      MLP: z = z1 = xs W1_e^T + b1_e [N, P], a = act(z1)      [N, P]
    A tile task passes the weight rows of its columns (both halves for GLU) and gets those columns."""
    if kind is GLU:
        h = ops.linear(xs, params["gate_up_proj"], groups, params.get("gate_up_proj_bias"))
        return ops.glu(h, activation), h
    z1 = ops.linear(xs, params["w1"], groups, params["b1"])
    return activate(activation, z1), z1


def post_gemm(ops, kind: ExpertKind, output_activation: str, a: torch.Tensor, params: dict[str, torch.Tensor | None],
              groups: Groups) -> tuple[torch.Tensor, torch.Tensor]:
    """The expert's second GEMM and output activation, (y, z2) [N, H] each:
      GLU: y = z2 = a Wdown_e^T + bdown_e;  MLP: z2 = a W2_e^T + b2_e, y = act_out(z2)."""
    if kind is GLU:
        y = ops.linear(a, params["down_proj"], groups, params.get("down_proj_bias"))
        return y, y
    z2 = ops.linear(a, params["w2"], groups, params["b2"])
    return activate(output_activation, z2), z2


def grad_post_gemm_glu(ops, grad_rows: torch.Tensor, weight_rows: torch.Tensor, a: torch.Tensor,
                       down_proj: torch.Tensor, groups: Groups, has_bias: bool = False):
    """Stage 3 for "glu", fed the unscaled g [N, H] and w [N]:
      g_down = g Wdown_e            [N, F]   (also feeds stage 2: g . y = g_down . a)
      dA     = w g_down = ge Wdown_e [N, F]
      dWdown_e = sum ge^T a          [E, H, F]
      dbdown_e = sum ge              [E, H]   (with has_bias, else None)
    Applying w after the GEMM is exact (it is linear) and lets stage 2 reuse the GEMM.
    The bias adds w_tj bdown_e to the output, so stage 2's gate dot gains g . bdown_e: the
    caller adds it (expert_backward), since this function only sees the gradient side."""
    g_down = ops.linear_t(grad_rows, down_proj, groups)
    grad_a = grad_combine(ops, g_down, weight_rows)
    grad_expert = grad_combine(ops, grad_rows, weight_rows)
    grad_down = ops.weight_grad(grad_expert, a, groups)
    grad_down_bias = ops.bias_grad(grad_expert, groups) if has_bias else None
    return grad_a, grad_down, g_down, grad_down_bias


def grad_pre_gemm_glu(ops, grad_a: torch.Tensor, h: torch.Tensor, act_gate: torch.Tensor, xs: torch.Tensor,
                      gate_up_proj: torch.Tensor, groups: Groups, activation: str | ClampedSwiGLU,
                      has_bias: bool = False):
    """Stage 4 for "glu", given act(hg) from the recomputed forward:
      dhg = (dA * hu) * act'(hg);  dhu = dA * act(hg);  dh = [dhg | dhu]   [N, 2F]
      dWgu_e = sum dh^T x   [E, 2F, H];   dx = dh Wgu_e   [N, H];   dbgu_e = sum dh  [E, 2F] (has_bias)
    (a ClampedSwiGLU computes dh by its own derivative, ClampedSwiGLU.backward)"""
    grad_h = ops.glu_backward(grad_a, h, act_gate, activation)
    grad_bias = ops.bias_grad(grad_h, groups) if has_bias else None
    return ops.linear_t(grad_h, gate_up_proj, groups), ops.weight_grad(grad_h, xs, groups), grad_bias


def grad_post_gemm_mlp(ops, grad_expert: torch.Tensor, z2: torch.Tensor, a1: torch.Tensor, w2: torch.Tensor,
                       has_bias: bool, groups: Groups, output_activation: str):
    """Stage 3 for "mlp", fed ge [N, H] from grad_combine:
      dz2 = ge * act_out'(z2);  dW2_e = sum dz2^T a1;  db2_e = sum dz2;  da1 = dz2 W2_e  [N, P]"""
    grad_z2 = activate_backward(output_activation, grad_expert, z2)
    grad_b2 = ops.bias_grad(grad_z2, groups) if has_bias else None
    return ops.linear_t(grad_z2, w2, groups), ops.weight_grad(grad_z2, a1, groups), grad_b2


def grad_pre_gemm_mlp(ops, grad_a1: torch.Tensor, z1: torch.Tensor, xs: torch.Tensor, w1: torch.Tensor,
                      has_bias: bool, groups: Groups, activation: str):
    """Stage 4 for "mlp": dz1 = da1 * act'(z1);  dW1_e = sum dz1^T x;  db1_e = sum dz1;  dx = dz1 W1_e"""
    grad_z1 = activate_backward(activation, grad_a1, z1)
    grad_b1 = ops.bias_grad(grad_z1, groups) if has_bias else None
    return ops.linear_t(grad_z1, w1, groups), ops.weight_grad(grad_z1, xs, groups), grad_b1


def _mlp_expert_backward(ops, activation, output_activation, grad_rows, weight_rows, xs, saved, params, groups):
    z1, z2 = saved
    has_bias = params["b1"] is not None
    grad_dots = grad_gate_combine(ops, grad_rows, activate(output_activation, z2))
    grad_a1, grad_w2, grad_b2 = grad_post_gemm_mlp(ops, grad_combine(ops, grad_rows, weight_rows), z2,
                                                   activate(activation, z1), params["w2"], has_bias, groups,
                                                   output_activation)
    grad_xs, grad_w1, grad_b1 = grad_pre_gemm_mlp(ops, grad_a1, z1, xs, params["w1"], has_bias, groups, activation)
    return grad_xs, grad_dots, {"w1": grad_w1, "b1": grad_b1, "w2": grad_w2, "b2": grad_b2}


def _glu_expert_backward_by_stage(ops, activation: str | ClampedSwiGLU, grad_rows: torch.Tensor,
                                  weight_rows: torch.Tensor, xs: torch.Tensor, h: torch.Tensor, params: dict,
                                  groups: Groups, has_bias: bool):
    """Stages 2-4 for "glu" from the stage functions (their elementwise work in separate passes):
    recompute (a, act(hg)) from h, stage 3, stage 2's dots, stage 4.
    Returns (dx rows, dots without the down bias term, {parameter name: gradient})."""
    a, act_gate = glu_activation(ops, h, activation)
    grad_a, grad_down, g_down, grad_down_bias = grad_post_gemm_glu(ops, grad_rows, weight_rows, a,
                                                                   params["down_proj"], groups, has_bias)
    # a = act(hg) * hu, or (clamped SwiGLU) a = f(gc) * (uc + 1): take the dot on a itself
    grad_dots = grad_gate_combine(ops, g_down, a) if isinstance(activation, ClampedSwiGLU) \
        else grad_gate_combine(ops, g_down, act_gate, h[:, act_gate.shape[1]:])
    grad_xs, grad_gate_up, grad_gate_up_bias = grad_pre_gemm_glu(ops, grad_a, h, act_gate, xs,
                                                                 params["gate_up_proj"], groups, activation, has_bias)
    return grad_xs, grad_dots, {"gate_up_proj": grad_gate_up, "gate_up_proj_bias": grad_gate_up_bias,
                                "down_proj": grad_down, "down_proj_bias": grad_down_bias}


def _glu_expert_backward_one_pass(ops, activation: str, grad_rows: torch.Tensor, weight_rows: torch.Tensor,
                                  xs: torch.Tensor, h: torch.Tensor, params: dict, groups: Groups, has_bias: bool):
    """Stages 2-4 for "glu" where ops.glu_backward_one_pass takes the rows: the GEMMs of
    grad_post_gemm_glu and grad_pre_gemm_glu, and all their elementwise work, with stage 2's dots
    and the recomputed a, in one pass after the first GEMM (FlashMoE puts the same work in that
    GEMM's epilogue):
      g_down = g Wdown_e [N, F];   (a, dh, dw) = glu_backward_one_pass(h, g_down, w)
      dWdown_e = sum (w g)^T a;    dWgu_e = sum dh^T x;    dx = dh Wgu_e
    dx rows and every gradient are _glu_expert_backward_by_stage's bits (the float32 dots its values
    to round-off), from 1 pass over [N, F]-sized rows instead of 4 and without its act(hg), dA and
    separate a buffers. Returns what _glu_expert_backward_by_stage returns."""
    g_down = ops.linear_t(grad_rows, params["down_proj"], groups)
    # a overwrites g_down, which nothing reads after the pass: one [N, F] buffer fewer
    a, grad_h, grad_dots = ops.glu_backward_one_pass(h, g_down, weight_rows, activation, a_out=g_down,
                                                     grad_h_out=ops.empty(h.shape, h))
    del g_down  # the same tensor as a: freed with it below
    grad_expert = grad_combine(ops, grad_rows, weight_rows)
    grads = {"down_proj": ops.weight_grad(grad_expert, a, groups),
             "down_proj_bias": ops.bias_grad(grad_expert, groups) if has_bias else None}
    del a, grad_expert
    grads["gate_up_proj_bias"] = ops.bias_grad(grad_h, groups) if has_bias else None
    grads["gate_up_proj"] = ops.weight_grad(grad_h, xs, groups)
    return ops.linear_t(grad_h, params["gate_up_proj"], groups), grad_dots, grads
