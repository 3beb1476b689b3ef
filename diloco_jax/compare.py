"""`diloco-jax compare`: DiLoCo against the two synchronous baselines of the paper's Table 2,
at equal per-worker batch and steps, with a summary table and plots."""

import json
from pathlib import Path
from typing import Any

from diloco_jax import lm
from diloco_jax.config import RunConfig
from diloco_jax.plots import plot_eval_vs_bytes, plot_eval_vs_tokens
from diloco_jax.runlog import RunLog, write_json

Record = dict[str, Any]


def runs_of(cfg: RunConfig) -> dict[str, tuple[str, int]]:
    """name -> (algo, workers): DiLoCo with M workers and H inner steps; one worker with one
    DiLoCo worker's batch and steps; M workers averaging gradients every step (M x batch)."""
    return {
        "diloco": ("diloco", cfg.workers),
        "sync_1worker": ("sync", 1),
        "sync_data_parallel": ("sync", cfg.workers),
    }


def compare_command(cfg: RunConfig, corpus: lm.Corpus, out: Path, progress: bool = True):
    """Runs the three runs into `out`: config.json, metrics.jsonl (all runs, a "run" field
    each), summary.json, summary.md, eval_loss_vs_tokens.png, eval_loss_vs_bytes.png."""
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "config.json", lm.config_record(cfg, corpus, runs=runs_of(cfg)))
    metrics = out / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    summaries, histories = {}, {}
    for name, (algo, workers) in runs_of(cfg).items():
        log = RunLog(metrics, cfg.total_steps, desc=f"{name} M={workers}", progress=progress)
        try:
            summaries[name], histories[name] = lm.run(cfg, corpus, algo, workers, name=name,
                                                      on_record=log)  # fmt: skip
        finally:
            log.close()
    summary = {"config": json.loads(json.dumps(lm.config_record(cfg, corpus))), "runs": summaries}
    write_json(out / "summary.json", summary)
    table = summary_markdown(cfg, summaries)
    (out / "summary.md").write_text(table)
    plot_eval_vs_tokens(histories, out / "eval_loss_vs_tokens.png")
    plot_eval_vs_bytes(histories, out / "eval_loss_vs_bytes.png")
    print(table)
    print(f"wrote {out}/summary.json, summary.md, metrics.jsonl and 2 plots")
    return summary


def summary_markdown(cfg: RunConfig, runs: dict[str, Record]) -> str:
    """A table shaped like the paper's Table 2: communication, time, compute & data, ppl."""
    base = runs["sync_1worker"]
    lines = [
        f"# DiLoCo vs synchronous baselines ({cfg.model} model, data {cfg.data}, "
        f"{cfg.sharding}, M={cfg.workers}, H={cfg.inner_steps}, R={cfg.rounds})",
        "",
        "| run | workers | communication rounds | bytes sent / worker | wall time (s) | "
        "compute & data | eval loss | eval perplexity |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r in runs.items():
        lines.append(
            f"| {name} | {r['workers']} | {r['communication_rounds']:,} | "
            f"{r['bytes_communicated']:,} | {r['wall_seconds']:.0f} | "
            f"{r['tokens_seen'] / base['tokens_seen']:.0f}x | {r['final_eval_loss']:.4f} | "
            f"{r['final_eval_ppl']:.3f} |"
        )
    lines += [
        "",
        "Perplexity is per byte (byte-level tokens). Every run takes the same steps per worker "
        "with the same per-worker batch; `compute & data` is total tokens relative to "
        "sync_1worker. DiLoCo communicates every H steps, data parallelism every step.",
        "",
    ]
    return "\n".join(lines)
