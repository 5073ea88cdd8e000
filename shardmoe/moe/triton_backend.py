"""The Triton backend: the Backend protocol (moe/backends.py) over the kernels of shardmoe/kernels.

backends.select picks it when kernels.fused_path(config, x). Its gathered entry points are the
fused ones the local dispatcher calls: kernels.stages.expert_forward_combine for the forward and
this module's expert_backward with row_index for the backward; expert parallelism's expert side
calls expert_forward / expert_backward on dispatched rows. Routing, the
balance losses and stage 6 stay in torch (moe/routing.py) on every path.

Forward, for x [S, H], N kept rows sorted by expert (row_token [N], weights w [N], row_pair [N]):
  torch path   xs = x[row_token] [N, H];  y = experts(xs) [N, H];  out = combine(w, y)  [S, H]
  this path    one gathered GEMM with the activation epilogue (reads x through row_token, so xs is
               never formed), one plain grouped GEMM storing y [N, H], then each token gathers and
               sums its k rows w_r y_r (kernels/combine.py).
Both save the same tensors for backward ("glu": h [N, 2F]; "mlp": z1 [N, P], z2 [N, H]), so the
backward reads the same context whichever path the forward took.

Backward, same contract as moe.experts.expert_backward (dx rows [N, H], gate dots dw [N] in the
acc dtype, {parameter: gradient}):
  "glu"  SonicMoE's data flow (kernels.stages.glu_backward): the GEMM dA' = g Wdown_e forms, in
         its epilogue, the gate dots dw = (g Wdown_e) . a (+ g . bdown_e), dh = dSwiGLU(w dA', h)
         and a' = w a; then plain grouped GEMMs: dWdown = sum g^T a', dWgu = sum dh^T x (both
         varlen-K: each expert's rows are the reduction), dx = dh Wgu; dbdown = sum w g and
         dbgu = sum dh come from the tiles of the weight-gradient GEMMs
  "mlp"  stages 1 + 2 in one pass over g (dz2 = w g act_out'(z2) and dw = g . act_out(z2)), then
         dz1 = (dz2 W2_e) act'(z1) with the derivative in that GEMM's epilogue, and plain grouped
         GEMMs for dW2, dW1 (varlen-K) and dx (kernels.stages.mlp_backward)
  then stage 5, dx_t = sum over the token's kept rows of dx_r, a gather-and-sum like the forward's.
With row_index [N] (the fused layer), the gradient and input arguments are the token-order [S, H]
tensors and the kernels read row r from row row_index[r]: grad_out[row_token] and x[row_token] are
never copied. Expert parallelism passes already-dispatched rows and no row_index.

Every expert kind the torch path runs runs here: "glu" with or without biases and with any
activation, GPT-OSS's clamped SwiGLU included (a ClampedSwiGLU as `activation`, evaluated in the
forward GEMM's GLU epilogue and in down_grad's); "mlp" with or without biases. A shared expert
(moe/shared_experts.py) is a dense GEMM pair over all tokens that moe/function.py runs beside the
backend, on torch, whichever backend the routed experts take.

What this path saves against the torch path: nothing more (the same h or z1, z2); what it avoids
allocating: xs [N, H] in forward, grad_out[row_token] and xs [N, H] in backward, and for "glu" the
torch path's a, act(hg), g Wdown and dA [N, F] (it keeps dh [N, 2F] and a' [N, F]).

No step reads the device from the host: the kernels read the groups' offsets from device memory and
their launches need only N and E (kernels/schedule.py).
"""
from __future__ import annotations

import torch

from shardmoe.expert_kinds import GLU, MLP, ExpertKind
from shardmoe.kernels import combine as kernel_combine
from shardmoe.kernels import stages as kernel_stages
from shardmoe.moe.activations import activate
from shardmoe.moe.experts import TORCH_OPS
from shardmoe.rows import Groups


def expert_backward(kind: ExpertKind, activation, output_activation: str, grad_rows: torch.Tensor,
                    weight_rows: torch.Tensor, xs: torch.Tensor, saved: tuple, params: dict, groups: Groups, *,
                    row_index: torch.Tensor | None = None):
    """Stages 1-4 with the fusions above: (dx rows [N, H], dw [N] acc dtype, {parameter: gradient}).
    The signature of moe.experts.expert_backward, plus row_index: grad_rows and xs are [N, H] rows,
    or the [S, H] token-order tensors with row_index [N]. GLU: the bias gradients come with
    gate_up_proj_bias; the dots' bias term with down_proj_bias (expert tensor parallelism passes
    it None and adds that term itself, after the psum over 't')."""
    return _BACKWARD[kind](activation, output_activation, grad_rows, weight_rows, xs, saved, params, groups,
                           row_index)


def _glu_backward(activation, output_activation, grad_rows, weight_rows, xs, saved, params, groups, row_index):
    (h,) = saved
    return kernel_stages.glu_backward(grad_rows, weight_rows, xs, h, params, groups, activation, row_index=row_index)


def _mlp_backward(activation, output_activation, grad_rows, weight_rows, xs, saved, params, groups, row_index):
    z1, z2 = saved
    return kernel_stages.mlp_backward(grad_rows, weight_rows, xs, z1, z2, activate(activation, z1), params, groups,
                                       activation, output_activation, row_index=row_index)


_BACKWARD = {GLU: _glu_backward, MLP: _mlp_backward}


class TritonBackend:
    """The Backend protocol on the Triton kernels, for every expert kind and activation of the torch
    backend (biased glu and the clamped SwiGLU included); the kernels allocate their own buffers.
    A shared expert, which moe/function.py runs on torch beside the backend, gets torch's own row
    primitives (its tensors are on the GPU)."""

    name = "triton"
    ops = TORCH_OPS

    def expert_forward(self, kind, activation, output_activation, xs, params, groups):
        return kernel_stages.expert_forward(kind, activation, output_activation, xs, params, groups)

    def expert_backward(self, kind, activation, output_activation, grad_rows, weight_rows, xs, saved, params,
                        groups):
        return expert_backward(kind, activation, output_activation, grad_rows, weight_rows, xs, saved, params,
                               groups)

    def gathered_forward(self, kind, activation, output_activation, x, row_token, weight_rows, row_pair, top_k,
                         params, groups):
        return kernel_stages.expert_forward_combine(kind, activation, output_activation, x, row_token,
                                                     weight_rows, row_pair, params, groups, top_k)

    def gathered_backward(self, kind, activation, output_activation, grad_out, weight_rows, x, row_token, saved,
                          params, groups):
        return expert_backward(kind, activation, output_activation, grad_out, weight_rows, x, saved, params,
                               groups, row_index=row_token)

    def combine(self, expert_out, weight_rows, row_pair, num_tokens, top_k):
        return kernel_combine.combine(expert_out, weight_rows, row_pair, num_tokens, top_k)

    def grad_gate_combine(self, grad_rows, out_rows, out_scale=None):
        return kernel_combine.grad_gate_combine(grad_rows, out_rows if out_scale is None else out_rows * out_scale)

    def grad_input_combine(self, dx_rows, row_pair, num_tokens, top_k):
        return kernel_combine.grad_input_combine(dx_rows, row_pair, num_tokens, top_k)


TRITON = TritonBackend()
