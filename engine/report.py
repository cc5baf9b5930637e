"""The end-of-run figure: reward, held-out accuracy and rollout/trainer mismatch over steps."""

from __future__ import annotations

from pathlib import Path


def plot_metrics(records: list[dict], path: str | Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("reward_mean", "train reward"),
        ("accuracy", "held-out accuracy"),
        ("mismatch_k3_kl", "mismatch k3 KL"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.2))
    for ax, (key, label) in zip(axes, panels):
        points = [(r["step"], r[key]) for r in records if key in r]
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o" if key == "accuracy" else None, markersize=3)
        ax.set_title(label)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
