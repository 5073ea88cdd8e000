"""The loss-curve figure written at the end of a run (matplotlib, imported here only)."""
from __future__ import annotations

from pathlib import Path


def plot_loss_curve(metrics: list[dict], path: str | Path, title: str = "") -> Path:
    """PNG of the training cross-entropy per step (with held-out points where present) above the
    learning rate; `metrics` are the rows of metrics.jsonl."""
    import matplotlib

    matplotlib.use("Agg")  # no display: write files only
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in metrics]
    fig, (ax_loss, ax_lr) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True,
                                         gridspec_kw={"height_ratios": [3, 1]})
    ax_loss.plot(steps, [m["loss"] for m in metrics], lw=1.2, label="train cross-entropy")
    evals = [m for m in metrics if "val_loss" in m]
    if evals:
        ax_loss.plot([m["step"] for m in evals], [m["val_loss"] for m in evals], "o", color="tab:red",
                     label="held-out cross-entropy")
    ax_loss.set_ylabel("loss (nats / byte)")
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
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
