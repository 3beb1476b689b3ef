"""The DiLoCo family on equal terms: one preset, one warm start, the same data and the same
inner steps per worker for every method; eval loss, the wire bytes each worker sends, and
the compute utilization each would keep on a 1 Gbit/s and a 100 Mbit/s network.

Methods (each with its paper's own knobs where they differ from DiLoCo's):
- diloco: Nesterov(0.7, 0.9) outer, exact all-reduce;
- streaming_int4: Streaming DiLoCo, 5 fragments, tau = 1, int4 deltas with error feedback;
- sparseloco: chunked top-k (3.1%) 2-bit deltas, error feedback with decay 0.95, outer
  SGD(1.0) (Sarfi et al. 2025);
- muloco / muloco_int4_ef: Muon inner optimizer on the hidden matrices, outer Nesterov(0.7,
  momentum 0.6) (Therien et al. 2025), exact or int4 with error feedback;
- des_loc: Adam moments averaged every 3H (mu) and 6H (nu) steps, params plainly averaged
  (outer SGD(1.0)) (Iacob et al. 2025);
- edit_clip: EDiT's clip of the mean delta (Cheng et al. 2024) at the median delta norm of a
  DiLoCo round here;
- eager: eager outer updates with a one-round delay (Kale et al. 2025);
- noloco: NoLoCo (Kolehmainen et al. 2025): each worker averages with a random partner (pairs),
  heavy-ball outer SGD(0.7, momentum 0.5), the authors' configs; diloco_heavy_ball: DiLoCo
  with that outer rule, the all-reduce it replaces;
- gasloc: GASLoC (Cagnasso et al. 2026): each worker's SGD(1.0) step, then the mean with a
  random partner (pairs, α = 1) and momentum γ = 0.5 on the result (the paper's values are
  not public: ours, untuned);
- async_dn_dylu: asynchronous DiLoCo with Delayed Nesterov and dynamic local updates (Liu et
  al. 2024) at the paper's step times, to DiLoCo's total inner steps;
- async_cgad: the same with CGAD at the server (Shah and Sun 2026: Adam on each delta gated
  by its staleness, decay 0.1, cutoff 8), and async_adam, the same Adam ungated;
- async_heloco: the same with HeLoCo at the server (arXiv 2606.00271: jobs start from the
  momentum look-ahead θ̄, each delta corrected against the outer momentum; lr 0.7, momentum
  0.9 and the authors' correction defaults);
- decoupled: Decoupled DiLoCo (Douillard et al. 2026): learners that never wait, a syncer
  merging the first 2 pushes and those within a grace window of H x 0.5 s, token-weighted;
- halos: HALoS (Kim et al. 2025): two regions of two workers, each a local server (Delayed
  Nesterov, N = 2, DyLU) pushing to the global one (the authors' rule) every 2 updates;
- diloco_1worker: DiLoCo's outer step over one worker's inner steps (`train_diloco` with
  M = 1, which `dj.diloco_optimizer(inner, outer, every=H)` equals in any training loop:
  tests/test_one_worker.py), beside sync_1worker, the same worker without it;
- sync_1worker, sync_data_parallel: the baselines.

Utilization: netsim's t_round = H t_step + latency + 8 x wire bytes / bandwidth (eager: the
max of the two), from the measured step time of one worker and each run's wire bytes per
sync (the synchronous methods' workers run at equal speed); async: per job of its mean
length, times the utilization of its own simulated clock (its workers run at the paper's
unequal step times, which it is built for).

Stragglers: every run's simulated seconds at those step times (0.58, 0.75, 1.51, 3.33 s per
inner step): a synchronous round waits for the slowest worker (R x H x 3.33 s; per step for
data parallel), the asynchronous runs report their own clock; and every run's eval loss by
the time the first barrier-free run ended (its last evaluation on or before then).

Writes results/family.md, results/family.json, results/family.png (eval loss against tokens)
and results/family_stragglers.png (against those simulated seconds). `--cache DIR` keeps each
finished run there and reads it back on a rerun.
"""

import argparse
import functools
import json
import statistics
from pathlib import Path
from typing import Any

from sweep import RESULTS, plot_eval_loss  # sets matplotlib's Agg backend

from diloco_jax import netsim
from diloco_jax.lm import compare, experiment
from diloco_jax.lm.config import make_config

STEP_SECONDS = (0.58, 0.75, 1.51, 3.33)
BANDWIDTHS = {"1 Gbit/s": 1e9, "100 Mbit/s": 100e6}
HEAVY_BALL = {"outer_optimizer": "heavy_ball", "outer_momentum": 0.5}  # NoLoCo's outer rule
# CGAD's outer lr: the best of 1e-4, 3e-4, 1e-3, 3e-3 and 1e-2 in single runs of its row (the
# paper's settings are not public); plain Adam gets the same for the comparison.
CGAD_LR = 3e-4
ASYNC_DYLU = {"dynamic_steps": True, "step_seconds": STEP_SECONDS}
ONE_WORKER = ("diloco_1worker", "sync_1worker")  # runs of one worker: no wire, no stragglers


def runs(base) -> dict[str, tuple[str, dict[str, Any]]]:
    """label -> (algo, config overrides)."""
    h = base.inner_steps
    return {
        "diloco": ("diloco", {}),
        "streaming_int4": (
            "diloco",
            {"fragments": 5, "overlap_steps": 1, "compression": "int4,ef=1"},
        ),
        "sparseloco": (
            "diloco",
            {"compression": "sparseloco", "outer_optimizer": "sgd", "outer_lr": 1.0},
        ),
        "muloco": ("diloco", {"inner_optimizer": "muon", "outer_momentum": 0.6}),
        "muloco_int4_ef": (
            "diloco",
            {"inner_optimizer": "muon", "outer_momentum": 0.6, "compression": "int4,ef=1"},
        ),
        "des_loc": (
            "diloco",
            {"state_sync": f"mu={3 * h},nu={6 * h}", "outer_optimizer": "sgd", "outer_lr": 1.0},
        ),
        "edit_clip": ("diloco", {}),  # outer_clip: set from the DiLoCo run (see main)
        "eager": ("diloco", {"outer_delay": 1, "eager": True}),
        "diloco_heavy_ball": ("diloco", HEAVY_BALL),
        "noloco": ("diloco", {"gossip_group_size": 2, **HEAVY_BALL}),
        "gasloc": ("diloco", {"gasloc": "alpha=1,gamma=0.5", "outer_optimizer": "sgd"}),
        "async_dn_dylu": ("async", {"outer_optimizer": "delayed_nesterov"} | ASYNC_DYLU),
        "async_cgad": (
            "async",
            {"outer_optimizer": "cgad", "outer_lr": CGAD_LR, "age_decay": 0.1, "age_cutoff": 8}
            | ASYNC_DYLU,
        ),
        "async_adam": ("async", {"outer_optimizer": "adam", "outer_lr": CGAD_LR} | ASYNC_DYLU),
        "async_heloco": ("async", {"outer_optimizer": "heloco"} | ASYNC_DYLU),
        "decoupled": (
            "async",
            {
                "server": f"decoupled,quorum=2,grace_seconds={h * 0.5:g}",
                "step_seconds": STEP_SECONDS,
            },
        ),
        "halos": (
            "async",
            {
                "server": "halos,regions=0/0/1/1,local_updates=2",
                "outer_optimizer": "delayed_nesterov",
                "dn_buffer": 2,
            }
            | ASYNC_DYLU,
        ),
        "diloco_1worker": ("diloco", {}),
        "sync_1worker": ("sync", {}),
        "sync_data_parallel": ("sync", {}),
    }


def utilization(label: str, summary: dict, history: list, base, step_seconds: float) -> dict:
    """Compute utilization at each of BANDWIDTHS from the run's wire bytes per sync."""
    if label in ONE_WORKER:
        return dict.fromkeys(BANDWIDTHS, 1.0)
    overlap = label == "eager"
    if summary["algo"] == "sync":
        steps, syncs = 1, base.total_steps
    elif summary["algo"] == "async" and "steps" in history[0]:  # jobs: one server, HALoS
        steps = statistics.mean(h["steps"] for h in history)
        syncs = len(history) / base.workers  # jobs per worker
    elif summary["algo"] == "async":  # Decoupled: each learner pushes at every sync
        syncs = len(history)
        steps = history[-1]["total_steps"] / base.workers / syncs
        overlap = True  # its learners compute on while their push travels
    else:
        steps, syncs = base.inner_steps, base.rounds
    wire = summary["wire_bytes"] / syncs
    out = {}
    for name, bw in BANDWIDTHS.items():
        u = netsim.utilization(step_seconds, steps, wire, bw, overlap=overlap)
        out[name] = u * summary.get("utilization", 1.0)
    return out


def with_straggler_seconds(label: str, summary: dict, history: list, base) -> list | None:
    """The history's entries with "straggler_seconds": when each was reached at STEP_SECONDS
    (async: its own clock; a synchronous step waits for the slowest worker); None for the
    one-worker runs."""
    if label in ONE_WORKER:
        return None
    tokens_per_step = base.batch_size * base.seq_len
    return [
        {
            **h,
            "straggler_seconds": h["time"]
            if summary["algo"] == "async"
            else h["tokens_per_worker"] / tokens_per_step * max(STEP_SECONDS),
        }
        for h in history
    ]


def run_cached(cache: Path | None, label: str, train) -> tuple[dict, list]:
    """(summary, history) of `train()`, kept as CACHE/LABEL.json when `cache` is given and
    read back from there on a rerun (the runs are deterministic: a rerun would repeat it)."""
    path = None if cache is None else cache / f"{label}.json"
    if path is not None and path.exists():
        saved = json.loads(path.read_text())
        return saved["summary"], saved["history"]
    summary, history = train()
    if path is not None:
        path.write_text(json.dumps({"summary": summary, "history": history}) + "\n")
    return summary, history


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="quick")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument(
        "--cache",
        help="a folder keeping each finished run's summary and history; a rerun reads them "
        "back instead of training again",
    )
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = None if args.cache is None else Path(args.cache)
    if cache is not None:
        cache.mkdir(parents=True, exist_ok=True)
    base = make_config(args.preset, workers=len(STEP_SECONDS))
    corpus = experiment.load_corpus(base)
    warm_start = functools.cache(lambda: experiment.pretrain(base, corpus)[0])
    summaries, histories, clip = {}, {}, None
    for label, (algo, overrides) in runs(base).items():
        if label == "edit_clip":  # clip at the median outer-gradient norm DiLoCo saw
            clip = statistics.median(h["outer_grad_norm"] for h in histories["diloco"])
            overrides = {"outer_clip": clip}
        cfg = make_config(args.preset, workers=len(STEP_SECONDS), **overrides)
        workers = 1 if label in ONE_WORKER else cfg.workers
        summaries[label], histories[label] = run_cached(
            cache,
            label,
            lambda cfg=cfg, algo=algo, workers=workers, label=label: experiment.run(
                cfg,
                corpus,
                algo,
                workers,
                name=label,
                params=warm_start(),
            ),
        )
        print(f"{label}: eval loss {summaries[label]['final_eval_loss']:.4f}", flush=True)
    step_seconds = compare.step_seconds(histories["sync_1worker"])
    timed = {}
    for label, summary in summaries.items():
        summary["utilization_at"] = utilization(
            label, summary, histories[label], base, step_seconds
        )
        timed[label] = with_straggler_seconds(label, summary, histories[label], base)
        summary["straggler_seconds"] = (
            None if timed[label] is None else max(h["straggler_seconds"] for h in timed[label])
        )
    # When the first barrier-free run ends: every run's eval loss by then, on the same clock.
    by = min(s["straggler_seconds"] for s in summaries.values() if s["algo"] == "async")
    for label, summary in summaries.items():
        reached = [h["eval_loss"] for h in timed[label] or [] if "eval_loss" in h
                   and h["straggler_seconds"] <= by]  # fmt: skip
        summary["eval_loss_by"] = reached[-1] if reached else None
    table = _table(base, summaries, step_seconds, by)
    (out / "family.md").write_text(table)
    curves = {  # what the figures draw, so they can be redrawn from this file
        label: [
            [h["tokens_per_worker"], h["eval_loss"], h.get("straggler_seconds")]
            for h in timed[label] or history
            if "eval_loss" in h
        ]
        for label, history in histories.items()
    }
    record = {"step_seconds": step_seconds, "clip": clip, "runs": summaries, "curves": curves}
    (out / "family.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    plot_eval_loss(
        "The DiLoCo family, equal inner steps",
        histories,
        out / "family.png",
        figsize=(7, 4.5),
        legend_fontsize=7,
    )
    plot_eval_loss(
        "The DiLoCo family with stragglers",
        {label: t for label, t in timed.items() if t is not None},
        out / "family_stragglers.png",
        figsize=(7, 4.5),
        legend_fontsize=7,
        x="straggler_seconds",
        xlabel="simulated seconds",
    )
    print(table)


def _table(base, summaries: dict[str, dict], step_seconds: float, by: float) -> str:
    lines = [
        "## The DiLoCo family on equal terms",
        "",
        f"Base: `quick` preset ({base.model} model), M={base.workers}, H={base.inner_steps}, "
        f"R={base.rounds}, one {base.pretrain_steps}-step warm start; utilization from a "
        f"measured {step_seconds * 1e3:.1f} ms step.",
        "",
        "| run | inner / outer | deltas sent as | wire bytes / worker | eval loss | "
        + " | ".join(f"utilization at {b}" for b in BANDWIDTHS)
        + f" | simulated seconds with stragglers | eval loss by {by:,.0f} s |",
        "| --- | --- | --- | ---: | ---: | "
        + " | ".join("---:" for _ in BANDWIDTHS)
        + " | ---: | ---: |",
    ]
    for label, s in summaries.items():
        util = " | ".join(f"{s['utilization_at'][b]:.0%}" for b in BANDWIDTHS)
        straggler = s["straggler_seconds"]
        straggler = "-" if straggler is None else f"{straggler:,.0f}"
        early = "-" if s["eval_loss_by"] is None else f"{s['eval_loss_by']:.4f}"
        lines.append(
            f"| {label} | {s.get('inner', 'adamw')} / {s['outer']} | {s['compression']} | "
            f"{s['wire_bytes']:,} | {s['final_eval_loss']:.4f} | {util} | {straggler} | {early} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
