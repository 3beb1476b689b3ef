"""`diloco-jax compare`: DiLoCo against the two synchronous baselines of the paper's Table 2,
at equal per-worker batch and steps, with a summary table and plots."""

import json
import statistics
from pathlib import Path
from typing import Any

from diloco_jax import netsim
from diloco_jax.lm import experiment, tblog
from diloco_jax.lm.config import RunConfig
from diloco_jax.lm.plots import plot_eval_vs_bytes, plot_eval_vs_tokens, run_colors
from diloco_jax.lm.runlog import RunLog, write_json

Record = dict[str, Any]


def runs_of(cfg: RunConfig) -> dict[str, tuple[str, int]]:
    """name -> (algo, workers): DiLoCo with M workers and H inner steps; one worker with one
    DiLoCo worker's batch and steps; M workers averaging gradients every step (M x batch)."""
    return {
        "diloco": ("diloco", cfg.workers),
        "sync_1worker": ("sync", 1),
        "sync_data_parallel": ("sync", cfg.workers),
    }


def compare_command(
    cfg: RunConfig,
    corpus: experiment.Corpus,
    out: Path,
    progress: bool = True,
    tensorboard: bool = False,
):
    """Runs the three runs into `out`: config.json, metrics.jsonl (all runs, a "run" field
    each), summary.json, summary.md, eval_loss_vs_tokens.png, eval_loss_vs_bytes.png, and with
    `tensorboard` the event files of each run (pretrain too) in out/tensorboard/RUN/."""
    tb = lambda name: tblog.run_dir(out, name) if tensorboard else None
    aux = experiment.aux_names(cfg)  # train metrics beside the loss, e.g. accuracy
    run_log = lambda total, desc, name: RunLog(metrics, total, desc, progress, tb(name), aux)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "config.json", experiment.config_record(cfg, corpus, runs=runs_of(cfg)))
    metrics = out / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    summaries, histories = {}, {}
    with run_log(cfg.pretrain_steps, "pretrain M=1", "pretrain") as log:
        params, warm = experiment.pretrain(cfg, corpus, on_record=log)
    for name, (algo, workers) in runs_of(cfg).items():
        with run_log(cfg.total_steps, f"{name} M={workers}", name) as log:
            summaries[name], histories[name] = experiment.run(
                cfg, corpus, algo, workers, name=name, params=params, on_record=log
            )
    network = simulated_network(cfg, histories["sync_1worker"], summaries)
    summary = {
        "config": json.loads(json.dumps(experiment.config_record(cfg, corpus))),
        "runs": summaries,
        "network": network,
    }
    write_json(out / "summary.json", summary)
    table = summary_markdown(cfg, summaries) + "\n" + network_markdown(network)
    (out / "summary.md").write_text(table)
    unit = "nats / byte" if cfg.tokenizer == "bytes" else "nats / token"
    # Every run starts from the warm start: its eval loss is each line's first point.
    options = dict(
        warm_start_loss=warm[-1].get("eval_loss") if warm else None,
        colors=run_colors(list(runs_of(cfg))),
    )
    plot_eval_vs_tokens(histories, out / "eval_loss_vs_tokens.png", unit, **options)
    plot_eval_vs_bytes(histories, out / "eval_loss_vs_bytes.png", unit, **options)
    print(table)
    print(f"wrote {out}/summary.json, summary.md, metrics.jsonl and 2 plots")
    return summary


def step_seconds(history: list[Record]) -> float:
    """One worker's steady-state seconds per step: the median gap between consecutive records
    (robust to the first step's compilation and to the evaluation steps)."""
    times = [h["wall_seconds"] for h in history]
    return float(statistics.median(b - a for a, b in zip(times, times[1:], strict=False)))


def simulated_network(cfg: RunConfig, one_worker: list[Record], runs: dict[str, Record]):
    """netsim's table for DiLoCo (sync every H steps) and data parallelism (every step), fed
    by the measured step time of one worker and the wire bytes each run's history reports
    per sync (every collective costed by its kind under ring algorithms)."""
    table = netsim.network_table(
        step_seconds(one_worker),
        {
            # A delayed or eager outer update hides the exchange behind the next round.
            "diloco": (
                cfg.inner_steps,
                runs["diloco"]["wire_bytes"] / cfg.rounds,
                cfg.outer_delay > 0,
            ),
            "sync_data_parallel": (1, runs["sync_data_parallel"]["wire_bytes"] / cfg.total_steps),
        },
        cfg.total_steps,
    )
    return table | {"num_workers": cfg.workers}


def network_markdown(network: dict[str, Any]) -> str:
    """Simulated wall time (compute utilization) of each run on slower networks."""
    bandwidths = list(netsim.BANDWIDTHS)
    lines = [
        f"## Simulated network: {network['num_workers']} workers, measured step "
        f"{network['step_seconds'] * 1e3:.1f} ms, latency {network['latency_seconds'] * 1e3:g} ms",
        "",
        "| run | sync every | wire bytes / sync | "
        + " | ".join(bandwidths)
        + " | bandwidth for 90% compute |",
        "| --- | ---: | ---: | " + " | ".join("---:" for _ in bandwidths) + " | ---: |",
    ]
    for name, row in network["runs"].items():
        cells = [
            f"{row[b]['wall_seconds']:.3g} s ({row[b]['utilization']:.0%})" for b in bandwidths
        ]
        lines.append(
            f"| {name} | {row['steps_per_sync']} steps | {row['wire_bytes_per_sync']:,.0f} | "
            + " | ".join(cells)
            + f" | {netsim.format_bandwidth(row['bandwidth_for_90pct_bit_s'])} |"
        )
    lines += [
        "",
        "Model: t_round = H t_step + latency + 8 x wire bytes / bandwidth, the wire bytes "
        "each worker sends under ring algorithms (all-reduce 2(M-1)/M, all-gather M-1, "
        "all-to-all (M-1)/M x its operand) (Charles et al. 2025, Table 6); with a delayed or "
        "eager outer update the exchange runs under the next round: t_round = max(H t_step, "
        "latency + 8 x wire bytes / bandwidth).",
        "",
    ]
    return "\n".join(lines)


def _units(cfg: RunConfig) -> str:
    """What a token is, for the table's note."""
    if cfg.tokenizer == "bytes":
        return "Eval loss and perplexity are per byte (byte-level tokens)."
    return (
        f"Eval loss and perplexity are per token ({cfg.tokenizer}); bits per byte = total "
        "nats over the eval text / (ln 2 x its UTF-8 bytes), comparable across tokenizers."
    )


def summary_markdown(cfg: RunConfig, runs: dict[str, Record]) -> str:
    """A table shaped like the paper's Table 2: communication, time, compute & data, ppl."""
    base = runs["sync_1worker"]
    lines = [
        f"# DiLoCo vs synchronous baselines ({cfg.model} model, data {cfg.data}, "
        f"{cfg.sharding}, M={cfg.workers}, H={cfg.inner_steps}, R={cfg.rounds}, "
        f"from a {cfg.pretrain_steps}-step warm start)",
        "",
        "| run | workers | communication rounds | payload bytes / worker | wire bytes / worker "
        "| wall time (s) | tokens/s | MFU | compute & data | eval loss | eval perplexity "
        "| eval bits/byte |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r in runs.items():
        mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.3g}%"
        lines.append(
            f"| {name} | {r['workers']} | {r['communication_rounds']:,} | "
            f"{r['bytes_communicated']:,} | {r['wire_bytes']:,} | {r['wall_seconds']:.0f} | "
            f"{r['tokens_per_second']:,.0f} | {mfu} | "
            f"{r['tokens_seen'] / base['tokens_seen']:.0f}x | {r['final_eval_loss']:.4f} | "
            f"{r['final_eval_ppl']:.3f} | {r['final_eval_bits_per_byte']:.4f} |"
        )
    lines += [
        "",
        f"{_units(cfg)} Every run takes the same steps per worker "
        "with the same per-worker batch; `compute & data` is total tokens relative to "
        "sync_1worker. DiLoCo communicates every H steps, data parallelism every step. "
        "tokens/s and MFU (model FLOPs per token x tokens/s over the device's peak FLOP/s; "
        "on a CPU, a large float32 matmul's measured FLOP/s) cover each whole run, compiles "
        "and evaluations included.",
        "",
    ]
    return "\n".join(lines)
