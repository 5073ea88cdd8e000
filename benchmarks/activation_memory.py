"""Activation memory on the CPU: the attention core's two paths, and a training step under each
activation_checkpointing option.

    python benchmarks/activation_memory.py attention [--length 4096]
    python benchmarks/activation_memory.py checkpointing [--length 1024 --batch 8 --layers 4]

Each figure is measured in a fresh process (one per variant), with glibc told to hand freed
memory back to the system at once (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_), so that the
resident set follows what is allocated: the process's peak resident set is reset (Linux:
/proc/self/clear_refs) once the inputs and weights exist, the forward and backward run, and the
peak above the resident set before them is the figure ("peak"; it includes what the first call
of a kernel allocates for good, the same for every variant). Beside it, "saved" is what the
forward leaves for the backward: the bytes of the distinct storages that pass torch's saved-tensor
hooks during the forward (the fused core's kernel graph included).

attention: one attention layer of the default model's heads (d_model 96, 4 query heads over 2 kv
heads of 24), fp32, one row of `length` tokens holding documents of 512 tokens, forward and
explicit backward through the reference core (the [B K Q L L] float32 scores) and the fused one
(torch's scaled_dot_product_attention); the last line is fused / reference.
checkpointing: one training step (forward, backward) of the default model with `layers` blocks
on batch x length tokens, fp32, for each option.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch


def _reset_peak() -> int:
    """Reset the peak resident set to the current one; returns the current one in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _measured(forward) -> dict:
    """{"peak": bytes above the resident set before, "saved": bytes the forward saved for the
    backward} of forward() (which returns the tensor to backpropagate from) and its backward."""
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return t

    base = _reset_peak()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    out.backward()
    return {"peak": _status("VmHWM") - base, "saved": sum(saved.values())}


def attention_child(core: str, length: int) -> dict:
    from shardmoe.model.attention import attention
    from shardmoe.model.rope import rope_table
    from shardmoe.model.segments import packed_layout

    gen = torch.Generator().manual_seed(0)
    M, Q, K, D = 96, 2, 2, 24
    starts = torch.zeros(1, length, dtype=torch.bool)
    starts[:, ::512] = True
    layout = packed_layout(starts)
    rope = rope_table(layout.positions, D, 10000.0, torch.float32)
    nx = torch.randn(1, length, M, generator=gen, requires_grad=True)
    weights = [(torch.randn(*shape, generator=gen) * 0.1).requires_grad_() for shape in
               ((M, Q, K, D), (2, M, K, D), (M, Q, K, D))]
    grad = torch.randn(1, length, M, generator=gen)

    def forward():
        return (attention(nx, *weights, layout.segment_ids, rope, core=core) * grad).sum()

    return _measured(forward)


def checkpointing_child(option: str, length: int, batch: int, layers: int) -> dict:
    from shardmoe.model.transformer import Transformer, TransformerConfig

    model = Transformer(TransformerConfig(n_layers=layers), activation_checkpointing=option)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 257, (batch, length), generator=gen)
    starts = torch.zeros(batch, length, dtype=torch.bool)
    starts[:, ::256] = True

    return _measured(lambda: model(ids, starts, ids).total)


def run_child(args: list[str]) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    done = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True, check=True,
                          env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def mib(n: int) -> str:
    return f"{n / 2**20:8.1f}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["attention", "checkpointing"])
    parser.add_argument("--length", type=int)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    common = ["--threads", str(args.threads)]
    if args.what == "attention":
        length = args.length or 4096
        print(f"attention, one layer (M=96, 4 query heads over 2 kv heads of 24), 1 x {length} tokens, fp32:")
        print(f"{'core':<10} {'peak MiB':>9} {'saved MiB':>9}")
        rows = {core: run_child(["attention", core, str(length), *common]) for core in ("reference", "fused")}
        for core, row in rows.items():
            print(f"{core:<10} {mib(row['peak'])} {mib(row['saved'])}")
        print(f"fused / reference: peak {rows['fused']['peak'] / rows['reference']['peak']:.4f}, "
              f"saved {rows['fused']['saved'] / rows['reference']['saved']:.4f}")
    else:
        length = args.length or 1024
        print(f"one training step of the default model with {args.layers} blocks, {args.batch} x {length} tokens, "
              "fp32:")
        print(f"{'option':<10} {'peak MiB':>9} {'saved MiB':>9}")
        for option in ("none", "moe", "block"):
            row = run_child(["checkpointing", option, str(length), str(args.batch), str(args.layers), *common])
            print(f"{option:<10} {mib(row['peak'])} {mib(row['saved'])}")


def child(argv: list[str]) -> None:
    threads = int(argv[argv.index("--threads") + 1])
    argv = argv[:argv.index("--threads")]
    torch.set_num_threads(threads)
    what, *rest = argv
    if what == "attention":
        result = attention_child(rest[0], int(rest[1]))
    else:
        result = checkpointing_child(rest[0], *map(int, rest[1:]))
    print(json.dumps(result))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2:])
    else:
        main()
