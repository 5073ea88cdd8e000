"""The sanitizer stage's workload: `compute-sanitizer --tool TOOL python -m shardmoe.tools.gpu_check.sanitize`.

A few forward + backward steps of shardmoe.MoE on the Triton path, on CUDA: the parity stage's
cases in WORKLOAD (a bf16 glu layer with aux and z losses, an fp32 mlp layer with biases and
capacity drops, both with an empty expert; a bf16 step of zero tokens), at the parity stage's
sizes, so the compiled kernels and their autotuned configs come from Triton's caches
(TRITON_CACHE_AUTOTUNING=1) and nothing is benchmarked under the sanitizer. Both expert kinds and
both dtypes, but not every pairing: each pairing is another set of kernels to compile and
autotune on a bare machine before the sanitized runs. Each step checks that
the Triton backend ran and that the output and every gradient are finite; the last line,
DONE_LINE, says the workload completed (a sanitizer that kills it leaves no such line).
"""
from __future__ import annotations

import sys

WORKLOAD = (("glu-softmax-aux-z", "bfloat16"), ("mlp-bias-gelu-capacity", "float32"), ("glu-no-tokens", "bfloat16"))
DONE_LINE = "sanitize: workload done"


def run_workload(device: str, dry_run: bool) -> list[str]:
    """One line per step; AssertionError naming the step and the tensor when a check fails."""
    import torch

    from . import parity

    sizes = parity.DRY_RUN_SIZES if dry_run else parity.SIZES
    lines = []
    for name, dtype_name in WORKLOAD:
        layer, x, grad_out = parity.build(parity.CASES[name], dtype_name, device, sizes)
        backend, tensors, stats = parity.forward_backward(layer, x, grad_out, parity.triton_context())
        if device == "cuda":
            torch.cuda.synchronize()
        assert backend == "triton", f"{name} {dtype_name}: expected the Triton backend, got {backend!r}"
        for key, t in tensors.items():
            assert t is not None and bool(torch.isfinite(t).all()), \
                f"{name} {dtype_name}: {key}: expected a finite tensor, got {None if t is None else 'non-finite'}"
        lines.append(f"{name} {dtype_name}: triton, {x.numel() // sizes.hidden} tokens, rows per expert "
                     f"{[int(v) for v in stats['tokens_per_expert']]}, output, aux loss and "
                     f"{len(tensors) - 2} gradients finite")
    return lines


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("python -m shardmoe.tools.gpu_check.sanitize: expected a CUDA device, got none "
              "(a dry run calls run_workload on CPU instead)", file=sys.stderr)
        return 2
    from shardmoe import settings

    with settings.override(autotune=False):  # one config per kernel: nothing to tune at these sizes
        for line in run_workload("cuda", dry_run=False):
            print(line, flush=True)
    print(DONE_LINE, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
