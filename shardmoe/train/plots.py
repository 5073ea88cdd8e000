"""The figures written at the end of a run (matplotlib, imported here only): the loss curve and
the per-expert load heatmap. Both are drawn from the rows of metrics.jsonl."""
from __future__ import annotations

from pathlib import Path

DPI = 110
# expert_load.png is LOAD_WIDTH x (LOAD_MARGIN + LOAD_PANEL * layers) inches at DPI: one panel a layer
LOAD_WIDTH, LOAD_MARGIN, LOAD_PANEL = 7.0, 0.9, 1.5


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display: write files only
    import matplotlib.pyplot as plt

    return plt


def plot_loss_curve(metrics: list[dict], path: str | Path, title: str = "", *, unit: str) -> Path:
    """PNG of the training cross-entropy per step (with held-out points where present) above the
    learning rate; `metrics` are the rows of metrics.jsonl, their losses in nats per `unit` (the
    tokenizer's: "byte" for bytes, "token" for any other)."""
    plt = _pyplot()
    steps = [m["step"] for m in metrics]
    fig, (ax_loss, ax_lr) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True,
                                         gridspec_kw={"height_ratios": [3, 1]})
    ax_loss.plot(steps, [m["loss"] for m in metrics], lw=1.2, label="train cross-entropy")
    evals = [m for m in metrics if "val_loss" in m]
    if evals:
        ax_loss.plot([m["step"] for m in evals], [m["val_loss"] for m in evals], "o", color="tab:red",
                     label="held-out cross-entropy")
    ax_loss.set_ylabel(f"loss (nats / {unit})")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend()
    if title:
        ax_loss.set_title(title, fontsize=10)
    ax_lr.plot(steps, [m["lr"] for m in metrics], color="tab:gray", lw=1.2)
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_xlabel("step")
    ax_lr.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def plot_loss_comparison(runs: dict[str, list[dict]], path: str | Path, title: str = "") -> Path:
    """PNG of several runs' training cross-entropy per step (held-out points as markers), one
    colour per run; `runs` maps a label to the rows of its metrics.jsonl."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (label, metrics) in enumerate(runs.items()):
        colour = f"C{i}"
        ax.plot([m["step"] for m in metrics], [m["loss"] for m in metrics], lw=1.0, color=colour, alpha=0.8,
                label=f"{label} train")
        evals = [m for m in metrics if "val_loss" in m]
        ax.plot([m["step"] for m in evals], [m["val_loss"] for m in evals], "o", color=colour,
                label=f"{label} held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / byte)")
    ax.grid(alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def plot_expert_load(metrics: list[dict], path: str | Path, title: str = "") -> Path | None:
    """PNG heatmap of each MoE layer's load over the steps: one panel per layer (layer 0 on top),
    steps along x, experts along y, colour = expert_tokens[l][j] / mean_j expert_tokens[l][j]
    (1 is a balanced expert, 0 an idle one), one colour scale for all panels.

    Rows without `expert_tokens` (logged before the column existed, then resumed) are left out;
    with none left there is nothing to draw and no file (None)."""
    rows = [m for m in metrics if "expert_tokens" in m]
    if not rows:
        return None
    import torch

    counts = torch.tensor([m["expert_tokens"] for m in rows], dtype=torch.float64)  # [steps, layers, E]
    relative = counts / counts.mean(dim=2, keepdim=True)
    steps, layers, experts = relative.shape
    plt = _pyplot()
    fig, axes = plt.subplots(layers, 1, figsize=(LOAD_WIDTH, LOAD_MARGIN + LOAD_PANEL * layers), sharex=True,
                             squeeze=False, layout="constrained")
    extent = (rows[0]["step"] - 0.5, rows[-1]["step"] + 0.5, experts - 0.5, -0.5)
    vmax = max(float(relative.max()), 1.0)
    for layer, ax in enumerate(axes[:, 0]):
        image = ax.imshow(relative[:, layer].T.numpy(), aspect="auto", interpolation="nearest",
                          cmap="viridis", vmin=0.0, vmax=vmax, extent=extent)
        ax.set_ylabel(f"layer {layer}\nexpert")
        ax.yaxis.get_major_locator().set_params(integer=True)
    axes[-1, 0].set_xlabel("step")
    fig.colorbar(image, ax=axes[:, 0].tolist(), label="tokens / mean tokens per expert")
    if title:
        fig.suptitle(title, fontsize=10)
    path = Path(path)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path
