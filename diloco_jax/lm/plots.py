"""PNG plots of a comparison: eval loss against tokens per worker and against bytes sent."""

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; no display needed
import matplotlib.pyplot as plt  # noqa: E402

Record = dict[str, Any]


def _eval_points(history: list[Record], x_key: str) -> tuple[list[float], list[float]]:
    points = [(h[x_key], h["eval_loss"]) for h in history if "eval_loss" in h]
    return [p[0] for p in points], [p[1] for p in points]


def plot_eval_vs_tokens(
    histories: dict[str, list[Record]], path: Path, unit: str = "nats / byte"
) -> None:
    """Eval loss (in `unit`) against tokens seen per worker, one line per run."""
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    for name, history in histories.items():
        ax.plot(*_eval_points(history, "tokens_per_worker"), marker="o", ms=3, label=name)
    ax.set_xlabel("tokens per worker")
    ax.set_ylabel(f"eval loss ({unit})")
    ax.set_title("Eval loss vs tokens per worker")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_eval_vs_bytes(
    histories: dict[str, list[Record]], path: Path, unit: str = "nats / byte"
) -> None:
    """Eval loss against cumulative bytes each worker sent (log x). A run that never
    communicates is drawn as a horizontal line at its final eval loss."""
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    for name, history in histories.items():
        xs, ys = _eval_points(history, "bytes_communicated")
        if xs and max(xs) > 0:
            ax.plot(xs, ys, marker="o", ms=3, label=name)
        elif ys:
            ax.axhline(ys[-1], ls="--", color="gray", label=f"{name} (no communication, final)")
    ax.set_xscale("log")
    ax.set_xlabel("bytes sent per worker (log)")
    ax.set_ylabel(f"eval loss ({unit})")
    ax.set_title("Eval loss vs communication")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
