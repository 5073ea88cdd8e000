"""shardmoe with FSDP2 and distributed checkpoints, composed as a torchtitan user composes them.

  torchrun --nproc-per-node 4 examples/fsdp_expert_parallel.py [--steps 30] [--checkpoint DIR]
  python examples/fsdp_expert_parallel.py [--steps 30]      # the same on 4 local gloo processes (CPU)

It needs exactly 4 ranks (the 2 x 2 job mesh): another WORLD_SIZE under torchrun is refused with one
line, exit status 2, before any process group. Every rank saves into and loads from one checkpoint
directory: --checkpoint, or else a temporary directory rank 0 makes and tells the others (on one
machine; across machines, pass a --checkpoint every rank sees).

One job mesh ("dp", "ep") of 2 x 2 ranks. The model, one residual block: x + MoE(tanh(x W)), the MoE a
shardmoe.MoE on the job mesh (8 experts split over 'ep', DeepSeek-V3's sigmoid router with a
correction bias, a shared expert, aux and sequence-wise balance losses). Each MoE layer is
fully_shard-ed over 'dp' (the ranks that hold the same experts); the rest of the model over every
rank. Each rank's loss is the mean over its own tokens plus the layer's aux_loss: no sync_grads and
no rescaling (docs/parallel.md, "FSDP2"). Gradients are clipped to the whole model's norm with
shardmoe.parallel.clip_grad_norm_ (torch's refuses DTensors on two meshes), AdamW steps the DTensor
parameters, the correction bias moves from the step's global expert loads. At the end the model is
saved with torch.distributed.checkpoint, loaded into a fresh model, and both give the same output.

The task is synthetic: tokens x [rows, T, H] ~ N(0, 1) and targets tanh(x A) for a fixed A, drawn
from a seed per global row, so any number of ranks sees the same global batch.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist

import shardmoe

H, F, E, K = 32, 64, 8, 2
ROWS, T = 4, 16  # rows per rank, tokens per row (a row is a sequence of the sequence-wise loss)
WORLD = 4  # the ("dp", "ep") job mesh of 2 x 2


class Model(torch.nn.Module):
    def __init__(self, mesh):
        super().__init__()
        torch.manual_seed(0)  # every rank draws the same whole tensors and keeps its shards
        self.inp = torch.nn.Linear(H, H)
        self.moe = shardmoe.MoE(H, F, E, K, mesh=mesh, score_func="sigmoid", correction_bias=True,
                                shared_ffn_size=F, aux_loss_coef=0.01, seq_aux_loss_coef=0.01)

    def forward(self, x):
        return x + self.moe(torch.tanh(self.inp(x)))


def batch(step: int, token_rank: int):
    """This token rank's rows of global batch `step`: (x, target) [ROWS, T, H]."""
    gen = torch.Generator().manual_seed(1_000_003 * step + token_rank)
    x = torch.randn(ROWS, T, H, generator=gen)
    mixing = torch.randn(H, H, generator=torch.Generator().manual_seed(7)) / H ** 0.5
    return x, torch.tanh(x @ mixing)


def build(job):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = Model(job)
    fully_shard(model.moe, mesh=job["dp"])  # the experts stay split over 'ep'
    fully_shard(model, mesh=init_device_mesh(job.device_type, (job.size(),)))  # the dense rest over every rank
    return model


def train(steps: int, checkpoint: str) -> dict:
    """Run the recipe on an initialised process group of 4 ranks; the losses (global means) and the
    largest difference between the trained and the reloaded model's outputs."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    job = init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (2, WORLD // 2), mesh_dim_names=("dp", "ep"))
    token_rank = dist.get_rank()  # ("dp", "ep") row-major: the rank is the token shard
    model = build(job)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        x, target = batch(step, token_rank)
        loss = (model(x) - target).square().mean() + model.moe.aux_loss
        loss.backward()
        shardmoe.parallel.clip_grad_norm_(model, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        model.moe.update_correction_bias(model.moe.stats["selected_per_expert"])  # global loads
        mean = loss.detach().reshape(1)
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
        if token_rank == 0 and (step % 10 == 0 or step == steps - 1):
            print(f"step {step:3d}  loss {losses[-1]:.4f}", flush=True)
    dcp.save(model.state_dict(), checkpoint_id=checkpoint)
    fresh = build(job)
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=checkpoint)
    fresh.load_state_dict(state)
    x, _ = batch(steps, token_rank)
    with torch.no_grad():
        difference = (fresh(x) - model(x)).abs().max().item()
    if token_rank == 0:
        print(f"checkpoint {checkpoint}: the reloaded model's output differs by {difference:.1e}", flush=True)
    return {"losses": losses, "reload_difference": difference}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--checkpoint", default=None, help="directory for the checkpoint, one for every rank "
                                                           "(default: a temporary one)")
    args = parser.parse_args()
    if "RANK" in os.environ:  # under torchrun
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world != WORLD:
            print(f"{parser.prog}: expected {WORLD} ranks (a 2 x 2 job mesh of dp and ep), got WORLD_SIZE={world}: "
                  f"launch with torchrun --nproc-per-node {WORLD}", file=sys.stderr)
            sys.exit(2)
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend)
        try:
            # one directory for every rank: DCP writes each rank's shards beside rank 0's metadata
            checkpoint = [args.checkpoint or (tempfile.mkdtemp(prefix="shardmoe-fsdp-") if dist.get_rank() == 0
                                              else None)]
            dist.broadcast_object_list(checkpoint, src=0)
            train(args.steps, checkpoint[0])
        finally:
            dist.destroy_process_group()
        return
    from shardmoe.testing import run_distributed

    run_distributed(train, WORLD, args=(args.steps, args.checkpoint or tempfile.mkdtemp(prefix="shardmoe-fsdp-")),
                    timeout=600)


if __name__ == "__main__":
    main()
