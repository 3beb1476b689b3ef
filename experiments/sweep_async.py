"""Asynchronous DiLoCo at small scale (Liu et al. 2024, arXiv 2401.09135): 4 workers at the
paper's step times of 0.58, 0.75, 1.51 and 3.33 s per step, on a simulated clock.

Runs, from one shared warm start of the `quick` preset (M=4, H=25, R=12):

- diloco: synchronous DiLoCo, Nesterov(0.7, 0.9); every round waits for the slowest worker;
- async_nesterov: each arriving delta applied with the same Nesterov(0.7, 0.9);
- async_nesterov_lr/M: the same at lr 0.7 / M, the per-delta scale of DiLoCo's mean;
- async_dn: Delayed Nesterov(0.7, 0.9, N = M, c = 0);
- async_dn_dylu: DN with dynamic local updates (slower workers take fewer steps per job);
- async_dn_dylu_lr/2: the same at outer lr 0.35 (a check of why DyLU falls behind here).

Fairness: as the paper compares methods per update step (each local step of any worker
counts once), every run stops at DiLoCo's total inner steps, M x H x R = 1200 summed over
the workers: the same compute and tokens. The simulated seconds each took are a column, and
so is each run's eval loss by the simulated time the last async run ended (equal time).

Writes results/async.md, results/async.json and results/async.png (eval loss against
inner steps per worker, and against simulated seconds).
"""

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from sweep import RESULTS  # noqa: E402

from diloco_jax.lm import experiment  # noqa: E402
from diloco_jax.lm.config import make_config  # noqa: E402

STEP_SECONDS = (0.58, 0.75, 1.51, 3.33)
# label -> (algo, config overrides)
RUNS: dict[str, tuple[str, dict[str, Any]]] = {
    "diloco": ("diloco", {}),
    "async_nesterov": ("async", {}),
    "async_nesterov_lr/M": ("async", {"outer_lr": 0.7 / len(STEP_SECONDS)}),
    "async_dn": ("async", {"outer_optimizer": "delayed_nesterov"}),
    "async_dn_dylu": ("async", {"outer_optimizer": "delayed_nesterov", "dynamic_steps": True}),
    "async_dn_dylu_lr/2": (
        "async",
        {"outer_optimizer": "delayed_nesterov", "dynamic_steps": True, "outer_lr": 0.35},
    ),
}
TITLE = "Async DiLoCo at step times 0.58/0.75/1.51/3.33 s (M=4), equal total inner steps"


def main() -> None:
    parser = argparse.ArgumentParser(description=TITLE)
    parser.add_argument("--preset", default="quick")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = make_config(args.preset, workers=len(STEP_SECONDS), step_seconds=STEP_SECONDS)
    corpus = experiment.load_corpus(base)
    params, _ = experiment.pretrain(base, corpus)
    summaries, histories = {}, {}
    for label, (algo, overrides) in RUNS.items():
        cfg = dataclasses.replace(base, **overrides)
        summary, history = experiment.run(cfg, corpus, algo, cfg.workers, name=label, params=params)
        if algo == "diloco":  # every round lasts H steps of the slowest worker
            round_seconds = cfg.inner_steps * max(STEP_SECONDS)
            for entry in history:
                entry["time"] = (entry["round"] + 1) * round_seconds
            summary.update(
                simulated_seconds=history[-1]["time"],
                utilization=sum(STEP_SECONDS) / (len(STEP_SECONDS) * max(STEP_SECONDS)),
                job_steps=[cfg.inner_steps],
            )
        summaries[label], histories[label] = summary, history
        print(f"{label}: eval loss {summary['final_eval_loss']:.4f}")
    # Equal simulated time: each run's last eval by the time the last async run ended.
    until = max(s["simulated_seconds"] for s in summaries.values() if s["algo"] == "async")
    for label, history in histories.items():
        done = [h for h in history if "eval_loss" in h and h["time"] <= until]
        summaries[label]["eval_loss_at_equal_time"] = done[-1]["eval_loss"] if done else None
        summaries[label]["equal_time_seconds"] = until
    table = _table(base, summaries)
    (out / "async.md").write_text(table)
    (out / "async.json").write_text(json.dumps(summaries, indent=2, sort_keys=True) + "\n")
    _plot(histories, out / "async.png")
    print(table)


def _table(base, summaries: dict[str, dict[str, Any]]) -> str:
    until = next(iter(summaries.values()))["equal_time_seconds"]
    lines = [
        f"## {TITLE}",
        "",
        f"Base: preset with {base.model} model, M={base.workers}, H={base.inner_steps}, "
        f"R={base.rounds} (every run stops at {base.workers * base.total_steps} inner steps "
        f"summed over workers), {base.sharding}, warm start {base.pretrain_steps} steps.",
        "",
        "| run | outer | steps per job | outer updates | inner steps (all workers) "
        "| simulated seconds | utilization | payload bytes / worker | eval loss | eval ppl "
        f"| eval loss by {until:.0f} s |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for label, s in summaries.items():
        at_time = s["eval_loss_at_equal_time"]
        steps = "/".join(str(h) for h in s["job_steps"])
        total = round(s["steps_per_worker"] * s["workers"])
        lines.append(
            f"| {label} | {s['outer']} | {steps} | {s['communication_rounds']} | "
            f"{total:,} | {s['simulated_seconds']:.0f} | {s['utilization']:.0%} | "
            f"{s['bytes_communicated']:,} | {s['final_eval_loss']:.4f} | "
            f"{s['final_eval_ppl']:.3f} | {'-' if at_time is None else f'{at_time:.4f}'} |"
        )
    return "\n".join(lines) + "\n"


def _plot(histories: dict[str, list[dict[str, Any]]], path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), dpi=120, sharey=True)
    for label, history in histories.items():
        evals = [h for h in history if "eval_loss" in h]
        style = "--" if label == "diloco" else "-"
        steps = [h.get("steps_per_worker", h["steps"]) for h in evals]
        axes[0].plot(steps, [h["eval_loss"] for h in evals], style, marker="o", ms=2, label=label)
        axes[1].plot([h["time"] for h in evals], [h["eval_loss"] for h in evals], style, ms=2)
    axes[0].set_xlabel("inner steps per worker (mean)")
    axes[1].set_xlabel("simulated seconds")
    axes[0].set_ylabel("eval loss (nats / byte)")
    # Keep the converging runs readable: a diverging run leaves the plot at the top.
    first = sorted(h["eval_loss"] for hs in histories.values() for h in hs if "eval_loss" in h)
    axes[0].set_ylim(top=first[len(first) // 2] + 0.6)
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(TITLE, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    main()
