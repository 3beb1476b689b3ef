"""Shared runner for the paper's sweeps at small scale (imported by the sweep_*.py scripts).

Each sweep varies one setting of DiLoCo from the `quick` preset, starting every run from the
same warm start, and writes results/<name>.md (a table) and results/<name>.png (eval loss
against tokens per worker), plus results/<name>.json with every run's summary.
"""

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from diloco_jax.lm import experiment  # noqa: E402
from diloco_jax.lm.config import make_config  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def run_sweep(
    name: str, title: str, variants: dict[str, dict[str, Any]], baselines: bool = True
) -> None:
    """Runs DiLoCo once per variant (config overrides on the `quick` preset, or --preset),
    plus the sync_1worker and sync_data_parallel baselines of the base config."""
    parser = argparse.ArgumentParser(description=title)
    parser.add_argument("--preset", default="quick")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = make_config(args.preset)
    corpus = experiment.load_corpus(
        dataclasses.replace(
            base, workers=max(v.get("workers", base.workers) for v in variants.values())
        )
    )
    params, _ = experiment.pretrain(base, corpus)
    summaries, histories = {}, {}
    runs = [(label, "diloco", make_config(args.preset, **ov)) for label, ov in variants.items()]
    if baselines:
        runs += [("sync_1worker", "sync", base), ("sync_data_parallel", "sync", base)]
    for label, algo, cfg in runs:
        workers = 1 if label == "sync_1worker" else cfg.workers
        summaries[label], histories[label] = experiment.run(
            cfg, corpus, algo, workers, name=label, params=params
        )
        print(f"{label}: eval loss {summaries[label]['final_eval_loss']:.4f}")
    table = _table(title, base, summaries)
    (out / f"{name}.md").write_text(table)
    (out / f"{name}.json").write_text(json.dumps(summaries, indent=2, sort_keys=True) + "\n")
    plot_eval_loss(title, histories, out / f"{name}.png")
    print(table)


def _table(title: str, base, summaries: dict[str, dict[str, Any]]) -> str:
    lines = [
        f"## {title}",
        "",
        f"Base: preset with {base.model} model, M={base.workers}, H={base.inner_steps}, "
        f"R={base.rounds}, {base.sharding}, warm start {base.pretrain_steps} steps.",
        "",
        "| run | workers | H | outer | data | deltas sent as | payload bytes / worker "
        "| wire bytes / worker | eval loss | eval ppl |",
        "| --- | ---: | ---: | --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for label, s in summaries.items():
        lines.append(
            f"| {label} | {s['workers']} | {s['inner_steps']} | {s['outer']} | "
            f"{s['sharding']} | {s['compression']} | {s['bytes_communicated']:,} | "
            f"{s['wire_bytes']:,} | {s['final_eval_loss']:.4f} | {s['final_eval_ppl']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def plot_eval_loss(
    title: str,
    histories: dict[str, list[dict[str, Any]]],
    path: Path,
    figsize: tuple[float, float] = (6, 4),
    legend_fontsize: float = 8,
    x: str = "tokens_per_worker",
    xlabel: str = "tokens per worker",
) -> None:
    """Eval loss against each entry's `x` (tokens per worker), one line per run (sync
    baselines dashed), each run its own colour (matplotlib's tab10, tab20 past ten runs), the
    legend beside the axes where it hides no point."""
    fig, ax = plt.subplots(figsize=figsize, dpi=120, layout="constrained")
    palette = plt.get_cmap("tab10" if len(histories) <= 10 else "tab20")
    for i, (label, history) in enumerate(histories.items()):
        points = [(h[x], h["eval_loss"]) for h in history if "eval_loss" in h]
        style = "--" if label.startswith("sync") else "-"
        ax.plot(*zip(*points, strict=True), style, marker="o", ms=2, color=palette(i), label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("eval loss (nats / byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.legend(loc="outside right upper", fontsize=legend_fontsize, frameon=False)
    fig.savefig(path)
    plt.close(fig)
