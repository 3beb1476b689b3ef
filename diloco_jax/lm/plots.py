"""PNG plots of a comparison: eval loss against tokens per worker and against bytes sent.

Each run keeps one colour in every figure (`run_colors`: matplotlib's default cycle in the
runs' order), so a reader matches lines across figures by colour. Both figures start from the
shared warm start's eval loss when there is one (a star at 0 tokens; a dotted line on the
bytes figure, whose log axis has no 0), put the legend below the axes where it hides no point,
and label their axes with units: tokens per worker, the payload bytes each worker sent (the
values it contributes to the exchanges; the ring all-reduce's wire traffic is about 2(M-1)/M
times that, `wire_bytes` in the summary).
"""

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; no display needed
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import EngFormatter, LogLocator, NullFormatter  # noqa: E402

Record = dict[str, Any]
WARM_START = "warm start"
WARM_START_COLOR = "black"


def run_colors(names: list[str]) -> dict[str, str]:
    """name -> colour: matplotlib's default cycle ("C0", "C1", ...) in the order given."""
    return {name: f"C{i % 10}" for i, name in enumerate(names)}


def _eval_points(history: list[Record], x_key: str) -> tuple[list[float], list[float]]:
    points = [(h[x_key], h["eval_loss"]) for h in history if "eval_loss" in h]
    return [p[0] for p in points], [p[1] for p in points]


def _finish(fig: Figure, ax, title: str, unit: str) -> None:
    ax.set_ylabel(f"eval loss ({unit})")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    fig.legend(loc="outside lower center", ncols=2, frameon=False)


def eval_vs_tokens_figure(
    histories: dict[str, list[Record]],
    unit: str = "nats / byte",
    warm_start_loss: float | None = None,
    colors: dict[str, str] | None = None,
) -> Figure:
    """Eval loss (in `unit`) against tokens seen per worker, one line per run; each line
    starts at the warm start's point (0, `warm_start_loss`) when that is given."""
    colors = colors or run_colors(list(histories))
    fig, ax = plt.subplots(figsize=(6.5, 4.6), dpi=120, layout="constrained")
    start = [] if warm_start_loss is None else [(0, warm_start_loss)]
    for name, history in histories.items():
        xs, ys = _eval_points(history, "tokens_per_worker")
        xs, ys = [p[0] for p in start] + xs, [p[1] for p in start] + ys
        ax.plot(xs, ys, marker="o", ms=3, color=colors[name], label=name)
    if warm_start_loss is not None:
        ax.plot([0], [warm_start_loss], "*", ms=11, color=WARM_START_COLOR, label=WARM_START)
    ax.xaxis.set_major_formatter(EngFormatter(sep=""))
    ax.set_xlabel("tokens per worker")
    _finish(fig, ax, "Eval loss vs tokens per worker", unit)
    return fig


def eval_vs_bytes_figure(
    histories: dict[str, list[Record]],
    unit: str = "nats / byte",
    warm_start_loss: float | None = None,
    colors: dict[str, str] | None = None,
) -> Figure:
    """Eval loss against the cumulative payload bytes each worker sent (log x). A run that
    never communicates is a dashed line at its final eval loss, in its own colour; the warm
    start (0 bytes) a dotted black line."""
    colors = colors or run_colors(list(histories))
    fig, ax = plt.subplots(figsize=(6.5, 4.6), dpi=120, layout="constrained")
    for name, history in histories.items():
        xs, ys = _eval_points(history, "bytes_communicated")
        if xs and max(xs) > 0:
            ax.plot(xs, ys, marker="o", ms=3, color=colors[name], label=name)
        elif ys:
            label = f"{name} (sends nothing; final loss)"
            ax.axhline(ys[-1], ls="--", color=colors[name], label=label)
    if warm_start_loss is not None:
        ax.axhline(warm_start_loss, ls=":", color=WARM_START_COLOR, label=f"{WARM_START} (0 B)")
    ax.set_xscale("log")
    # Labels at 1, 2 and 5 of each decade (a narrow range still gets some), none between.
    ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(EngFormatter(unit="B", sep=""))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("payload bytes sent per worker (log scale)")
    _finish(fig, ax, "Eval loss vs communication", unit)
    return fig


def save(fig: Figure, path: Path) -> None:
    fig.savefig(path)
    plt.close(fig)


def plot_eval_vs_tokens(histories, path: Path, unit="nats / byte", **options) -> None:
    """`eval_vs_tokens_figure(histories, unit, **options)` written to `path`."""
    save(eval_vs_tokens_figure(histories, unit, **options), path)


def plot_eval_vs_bytes(histories, path: Path, unit="nats / byte", **options) -> None:
    """`eval_vs_bytes_figure(histories, unit, **options)` written to `path`."""
    save(eval_vs_bytes_figure(histories, unit, **options), path)
