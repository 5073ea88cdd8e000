"""TritonOps: the stages the MoE operators and dispatchers call, on the Triton kernels of shardmoe/kernels.

dispatch.select() picks it when kernels.kernel_path(config, x). The local dispatcher calls its expert
entry points with row_index = row_token, so the first GEMM reads x (and the backward's GEMMs read
grad_out and x) through it in the kernel; expert parallelism's expert side calls them on
dispatched rows. The router (its balance losses and stage 6 in torch; its three GEMMs on
kernels/router_gemm.py where kernels.router_path says so: moe/routing.py) and a shared expert run
beside these ops: the shared expert's dense GEMM pair over all tokens is TorchOps' stage math on
torch's own row primitives, which TritonOps inherits.

Forward, for x [S, H], N kept rows sorted by expert (row_token [N], weights w [N], row_pair [N]):
  torch path   xs = x[row_token] [N, H];  y = experts(xs) [N, H];  out = combine(w, y)  [S, H]
  this path    one gathered GEMM with the activation epilogue (reads x through row_token, so xs is
               never formed), one plain grouped GEMM storing y [N, H], then each token gathers and
               sums its k rows w_r y_r (kernels/combine.py).
Both save the same tensors for backward ("glu": h [N, 2F]; "mlp": z1 [N, P], z2 [N, H]), so the
backward reads the same context whichever path the forward took.

Backward, same contract as TorchOps.expert_backward (dx rows [N, H], gate dots dw [N] in the acc
dtype, {parameter: gradient}):
  "glu"  SonicMoE's data flow (kernels.stages.glu_expert_backward): the GEMM dA' = g Wdown_e forms, in
         its epilogue, the gate dots dw = (g Wdown_e) . a (+ g . bdown_e), dh = dSwiGLU(w dA', h)
         and a' = w a; then plain grouped GEMMs: dWdown = sum g^T a', dWgu = sum dh^T x (both
         varlen-K: each expert's rows are the reduction), dx = dh Wgu; dbdown = sum w g and
         dbgu = sum dh come from the tiles of the weight-gradient GEMMs
  "mlp"  stages 1 + 2 in one pass over g (dz2 = w g act_out'(z2) and dw = g . act_out(z2)), then
         dz1 = (dz2 W2_e) act'(z1) with the derivative in that GEMM's epilogue, and plain grouped
         GEMMs for dW2, dW1 (varlen-K) and dx (kernels.stages.mlp_expert_backward)
  then stage 5, dx_t = sum over the token's kept rows of dx_r, a gather-and-sum like the forward's.

Every expert kind the torch path runs runs here: "glu" with or without biases and with any
activation, GPT-OSS's clamped SwiGLU included (a ClampedSwiGLU as `activation`, evaluated in the
forward GEMM's GLU epilogue and in down_grad's); "mlp" with or without biases.

What this path saves against the torch path: nothing more (the same h or z1, z2); what it avoids
allocating: xs [N, H] in forward, grad_out[row_token] and xs [N, H] in backward, and for "glu" the
torch path's a, act(hg), g Wdown and dA [N, F] (it keeps dh [N, 2F] and a' [N, F]).

No step reads the device from the host: the kernels read the groups' offsets from device memory and
their launches need only N and E (kernels/schedule.py).
"""
from __future__ import annotations


from shardmoe.expert_kinds import MLP
from shardmoe.kernels import combine as kernel_combine
from shardmoe.kernels import stages as kernel_stages
from shardmoe.moe.activations import activate
from shardmoe.moe.experts import TorchOps


class TritonOps(TorchOps):
    """The stages on the Triton kernels, for every expert kind and activation of the torch path
    (biased glu and the clamped SwiGLU included); the kernels allocate their own buffers. The row
    primitives are TorchOps' own (torch's, fresh buffers): the shared expert's stage math runs on
    them."""

    name = "triton"

    def expert_forward(self, kind, activation, output_activation, xs, params, groups, *, row_index=None):
        return kernel_stages.expert_forward(kind, activation, output_activation, xs, params, groups,
                                            row_index=row_index)

    def expert_backward(self, kind, activation, output_activation, grad_rows, weight_rows, xs, saved, params,
                        groups, *, row_index=None):
        """Stages 1-4 with the fusions above. GLU: the bias gradients come with gate_up_proj_bias;
        the dots' bias term with down_proj_bias (expert tensor parallelism passes it None and adds
        that term itself, after the psum over 't')."""
        if kind is MLP:
            z1, z2 = saved
            return kernel_stages.mlp_expert_backward(grad_rows, weight_rows, xs, z1, z2, activate(activation, z1),
                                                     params, groups, activation, output_activation,
                                                     row_index=row_index)
        (h,) = saved
        return kernel_stages.glu_expert_backward(grad_rows, weight_rows, xs, h, params, groups, activation,
                                                 row_index=row_index)

    def combine(self, expert_out, weight_rows, row_pair, num_tokens, top_k):
        return kernel_combine.combine(expert_out, weight_rows, row_pair, num_tokens, top_k)

    def grad_gate_combine(self, grad_rows, out_rows):
        return kernel_combine.grad_gate_combine(grad_rows, out_rows)

    def grad_input_combine(self, dx_rows, row_pair, num_tokens, top_k):
        return kernel_combine.grad_input_combine(dx_rows, row_pair, num_tokens, top_k)


TRITON_OPS = TritonOps()
