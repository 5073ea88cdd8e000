"""Per-kernel GPU times measured on a lease, kept as data for the traffic model's calibration
(traffic.py).

PROFILES_206AE40: the 2026-11-27 H100 lease of commit 206ae40 (NVIDIA H100 80GB HBM3, torch 2.11 +
CUDA 13, triton 3.6): one bf16 forward + backward of the layer (glu, silu, dropless, glu's dh formed
once), torch.profiler's "Self CUDA" total of each Triton kernel over two profiled steps after three
warm-up steps, at the bench's two shapes. Each kernel ran twice a step (forward_gemm: gate_up and
down; grad_gemm: g Wdown with its dot epilogue, and dx; weight_grad: dWdown and dWgate_up), with
the configs its autotuner chose (not recorded).
"""
PROFILED_STEPS = 2
PROFILES_206AE40 = {
    "fine": {"forward_gemm_kernel": 3.287, "grad_gemm_kernel": 2.440, "weight_grad_kernel": 3.377},
    "mixtral": {"forward_gemm_kernel": 20.161, "grad_gemm_kernel": 19.999, "weight_grad_kernel": 38.371},
}  # ms of CUDA time over PROFILED_STEPS steps
