"""The DiLoCo / data-parallel gap against model size (Charles et al. 2025, arXiv 2503.09799),
at laptop scale.

For every model size, one global batch of G sequences of SEQ_LEN bytes per step and S = H x R
steps, with R chosen so that the tokens seen, D = S x G x SEQ_LEN, are `tokens_per_param`
times the model's parameter count N (the paper fixes D / N too, at Chinchilla's 20; here it is
what fits 2 CPU cores). G doubles with each size, as the paper's best batch grows with the
model. Every run of a size starts from the same random init (no warm start, as in the paper)
and uses the same inner AdamW (peak INNER_LR, warmup S / 10, cosine decay):

  sync_data_parallel   DP_WORKERS workers x G / DP_WORKERS sequences, gradients averaged every
                       step: the global batch G, the same tokens as every DiLoCo run
  sync_1worker         1 worker x G / DP_WORKERS sequences: one DiLoCo M=4 worker's compute
  diloco_M{M}_lr{lr}   M workers x G / M sequences, H inner steps, a Nesterov outer step
                       (momentum 0.9) with learning rate lr, for every M and lr of the grid

As the paper does, the outer learning rate is tuned per size (and per M) over a small grid: the
table keeps the lr with the lowest final eval loss and reports DiLoCo / data-parallel. Eval loss
is nats per byte on the same held-out windows of the bundled corpus for every run and size.

  python sweep_model_size.py           # micro, mini, tiny, small at 0.5 tokens per parameter
  python sweep_model_size.py --quick   # micro, mini, tiny at 0.2 tokens per parameter

writes results/model_size{,_quick}.{md,json,png}: the table, every run's summary and the plan,
and the ratio against parameter count.
"""

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from diloco_jax.lm import experiment  # noqa: E402
from diloco_jax.lm import model as model_lib  # noqa: E402
from diloco_jax.lm.config import RunConfig, make_config  # noqa: E402

RESULTS = Path(__file__).parent / "results"
SIZES = ("micro", "mini", "tiny", "small")
QUICK_SIZES = ("micro", "mini", "tiny")
# Global batch in sequences per step, doubling with each size (a multiple of DP_WORKERS).
GLOBAL_BATCH = {"micro": 4, "mini": 8, "tiny": 16, "small": 32}
SEQ_LEN = 32  # micro's context, so every size sees the same windows
INNER_STEPS = 10  # H, fixed across sizes as in the paper
# Tokens per parameter: 100x and 40x below Chinchilla's 20, what 2 CPU cores allow (the default
# sweep took 62 minutes, --quick 2.9; see experiments/README.md).
TOKENS_PER_PARAM = 0.5
QUICK_TOKENS_PER_PARAM = 0.2
WORKER_COUNTS = (1, 2, 4)
# Nesterov momentum 0.9 steps 10 x lr times the mean delta once its momentum has built up: 0.1 is
# plain averaging, 0.4 the lookahead of 4 deltas. A pilot over 0.1-1.0 on micro, mini and tiny
# (at 0.3 tokens per parameter) found the best at 0.3-0.5 for 5-13 rounds and at 0.1, the
# lowest, for 25 rounds, so the grid spans 0.05-0.4.
LR_GRID = (0.05, 0.1, 0.2, 0.4)
DP_WORKERS = 4
INNER_LR = 3e-3
EVAL_BATCHES, EVAL_BATCH_SIZE = 16, 32  # 16 x 32 windows of 32 bytes: 16,384 eval tokens
EVALS_PER_RUN = 4  # evaluations along a run (the last one at its end)
MAX_BYTES = 4_000_000


@dataclasses.dataclass(frozen=True)
class SizePlan:
    """One model size's budget: N parameters, global batch G, H x R steps, D tokens."""

    size: str
    num_params: int
    global_batch: int
    inner_steps: int
    rounds: int

    @property
    def steps(self) -> int:
        return self.inner_steps * self.rounds

    @property
    def tokens(self) -> int:
        """Tokens every full-budget run sees (all workers together)."""
        return self.steps * self.global_batch * SEQ_LEN

    @property
    def tokens_per_param(self) -> float:
        return self.tokens / self.num_params


def num_params(size: str) -> int:
    """Parameters of model preset `size` with the byte vocabulary (shapes only, no compute)."""
    shapes = jax.eval_shape(model_lib.init_params, model_lib.get_config(size), jax.random.key(0))
    return model_lib.count_params(shapes)


def size_plan(size: str, tokens_per_param: float, inner_steps: int = INNER_STEPS) -> SizePlan:
    """The plan for `size`: R = round(k N / (G L H)) rounds, at least 1."""
    n = num_params(size)
    batch = GLOBAL_BATCH[size]
    rounds = max(1, round(tokens_per_param * n / (batch * SEQ_LEN * inner_steps)))
    return SizePlan(size, n, batch, inner_steps, rounds)


def plan_record(plan: SizePlan) -> dict[str, Any]:
    """The plan as JSON: its fields and the derived steps, tokens and tokens per parameter."""
    derived = {
        "steps": plan.steps,
        "tokens": plan.tokens,
        "tokens_per_param": plan.tokens_per_param,
    }
    return dataclasses.asdict(plan) | derived


def run_config(plan: SizePlan, workers: int, outer_lr: float | None = None) -> RunConfig:
    """The RunConfig of one run of `plan` with `workers` workers sharing the global batch."""
    if plan.global_batch % workers:
        raise ValueError(f"global batch {plan.global_batch} does not split over {workers}")
    return make_config(
        "quick",
        model=plan.size,
        max_bytes=MAX_BYTES,
        workers=workers,
        inner_steps=plan.inner_steps,
        rounds=plan.rounds,
        batch_size=plan.global_batch // workers,
        seq_len=SEQ_LEN,
        pretrain_steps=0,
        inner_lr=INNER_LR,
        warmup_steps=max(1, plan.steps // 10),
        eval_batches=EVAL_BATCHES,
        outer_lr=outer_lr,
    )


def runs_of(
    plan: SizePlan, worker_counts: Sequence[int], lr_grid: Sequence[float]
) -> list[tuple[str, str, int, RunConfig]]:
    """(label, algo, workers, config) of every run of one size: data parallelism, DiLoCo with
    the grid's middle lr for every M, the other lrs, then the single worker, so that a sweep
    cut short already has a ratio for every M."""
    middle = len(lr_grid) // 2
    order = sorted(range(len(lr_grid)), key=lambda i: (abs(i - middle), i))
    runs = [("sync_data_parallel", "sync", DP_WORKERS, run_config(plan, DP_WORKERS))]
    for i in order:
        for m in worker_counts:
            lr = lr_grid[i]
            runs.append((f"diloco_M{m}_lr{lr:g}", "diloco", m, run_config(plan, m, lr)))
    # One worker with one data-parallel worker's batch: a quarter of the tokens.
    quarter = dataclasses.replace(run_config(plan, DP_WORKERS), workers=1)
    return runs + [("sync_1worker", "sync", 1, quarter)]


def load_corpus() -> experiment.Corpus:
    """The bundled corpus with the eval windows every run and size is measured on."""
    cfg = make_config(
        "quick",
        max_bytes=MAX_BYTES,
        seq_len=SEQ_LEN,
        batch_size=EVAL_BATCH_SIZE,
        eval_batches=EVAL_BATCHES,
        workers=max(DP_WORKERS, *WORKER_COUNTS),
    )
    return experiment.load_corpus(cfg)


def _run_key(algo: str, workers: int, cfg: RunConfig) -> dict[str, Any]:
    """What identifies a run in the cache: same key, same (bit-identical) result."""
    return {"algo": algo, "workers": workers, "config": dataclasses.asdict(cfg)}


def _same_run(cached: dict[str, Any], key: dict[str, Any]) -> bool:
    """Whether two run keys name the same run. A config field one key lacks counts at
    RunConfig's default, so a field added to RunConfig later (whose default leaves runs
    unchanged) does not invalidate the runs cached before it."""
    if {k: v for k, v in cached.items() if k != "config"} != {
        k: v for k, v in key.items() if k != "config"
    }:
        return False
    defaults = json.loads(json.dumps(dataclasses.asdict(RunConfig())))
    a, b = cached["config"], key["config"]
    missing = object()
    return all(
        a.get(f, defaults.get(f, missing)) == b.get(f, defaults.get(f, missing))
        for f in a.keys() | b.keys()
    )


def load_cached(path: Path, key: dict[str, Any]) -> dict[str, Any] | None:
    """The summary cached at `path` if it was made with the same run as `key`, else None."""
    if not path.is_file():
        return None
    cached = json.loads(path.read_text())
    return cached["summary"] if _same_run(cached["key"], key) else None


def save_cached(path: Path, key: dict[str, Any], summary: dict[str, Any]) -> None:
    """Writes one run's key and summary atomically (a temporary file, then a rename), so
    sweeps running side by side over disjoint runs of one cache never clash."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"key": key, "summary": summary}, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def run_size(
    plan: SizePlan,
    corpus: experiment.Corpus,
    worker_counts: Sequence[int],
    lr_grid: Sequence[float],
    cache: Path | None = None,
    train: bool = True,
    baselines: bool = True,
) -> dict[str, dict[str, Any]]:
    """Trains every run of `plan` from one shared init; label -> summary (with "outer_lr").
    With `cache` (a folder), each finished run is saved as cache/LABEL.json and a run already
    there with the same key is not trained again, so an interrupted sweep resumes where it
    stopped. Runs missing from the cache are left out instead of trained when `train` is
    False, and so are the two baselines when `baselines` is False."""
    _, params, _ = experiment.init_model(run_config(plan, DP_WORKERS))
    summaries = {}
    for label, algo, workers, cfg in runs_of(plan, worker_counts, lr_grid):
        key = json.loads(json.dumps(_run_key(algo, workers, cfg)))
        cached = None if cache is None else load_cached(cache / f"{label}.json", key)
        if cached is not None:
            summaries[label] = cached
            print(f"{plan.size} {label}: cached", flush=True)
            continue
        if not train or (algo == "sync" and not baselines):
            continue
        summary, _ = experiment.run(
            cfg,
            corpus,
            algo,
            workers,
            params=params,
            name=label,
            eval_every=max(1, cfg.rounds // EVALS_PER_RUN),
        )
        summary["outer_lr"] = cfg.resolved_outer_lr if algo == "diloco" else None
        summaries[label] = json.loads(json.dumps(summary))
        if cache is not None:
            save_cached(cache / f"{label}.json", key, summaries[label])
        print(
            f"{plan.size} {label}: eval loss {summary['final_eval_loss']:.4f} "
            f"({summary['wall_seconds']:.0f}s)",
            flush=True,
        )
    return summaries


def best_per_workers(summaries: dict[str, dict[str, Any]]) -> dict[int, str]:
    """M -> the label of that M's DiLoCo run with the lowest final eval loss."""
    best: dict[int, str] = {}
    for label, s in summaries.items():
        if s["algo"] != "diloco":
            continue
        m = s["workers"]
        if m not in best or s["final_eval_loss"] < summaries[best[m]]["final_eval_loss"]:
            best[m] = label
    return dict(sorted(best.items()))


def ratios(summaries: dict[str, dict[str, Any]]) -> dict[int, float]:
    """M -> best DiLoCo final eval loss / data-parallel final eval loss."""
    dp = summaries["sync_data_parallel"]["final_eval_loss"]
    return {
        m: summaries[label]["final_eval_loss"] / dp
        for m, label in best_per_workers(summaries).items()
    }


def table_markdown(results: dict[str, dict[str, Any]]) -> str:
    """The main table (best outer lr per M) and the full outer-lr grid, as Markdown."""
    sizes = list(results)
    ms = sorted({m for r in results.values() for m in best_per_workers(r["runs"])})
    head = (
        "| model | params | global batch | steps (H x R) | tokens / param | sync_1worker "
        "| data-parallel | "
        + " | ".join(f"DiLoCo M={m} (lr)" for m in ms)
        + " | "
        + " | ".join(f"ratio M={m}" for m in ms)
        + " |"
    )
    lines = [head, "| --- | ---: | ---: | ---: | ---: | ---: | ---: |" + " ---: |" * 2 * len(ms)]
    for size in sizes:
        plan, runs = results[size]["plan"], results[size]["runs"]
        best = best_per_workers(runs)
        ratio = ratios(runs)
        cells = [
            f"{runs[best[m]]['final_eval_loss']:.4f} ({runs[best[m]]['outer_lr']:g})"
            if m in best
            else "-"
            for m in ms
        ]
        one = runs.get("sync_1worker", {}).get("final_eval_loss")
        lines.append(
            f"| {size} | {plan['num_params']:,} | {plan['global_batch']} x {SEQ_LEN} | "
            f"{plan['inner_steps']} x {plan['rounds']} | {plan['tokens_per_param']:.2f} | "
            f"{'-' if one is None else f'{one:.4f}'} | "
            f"{runs['sync_data_parallel']['final_eval_loss']:.4f} | "
            + " | ".join(cells)
            + " | "
            + " | ".join(f"{ratio[m]:.4f}" if m in ratio else "-" for m in ms)
            + " |"
        )
    lrs = sorted({r["outer_lr"] for v in results.values() for r in v["runs"].values()} - {None})
    lines += [
        "",
        "Final eval loss of every DiLoCo run of the outer learning-rate grid:",
        "",
        "| model | M | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " |",
        "| --- | ---: |" + " ---: |" * len(lrs),
    ]
    for size in sizes:
        runs = results[size]["runs"]
        for m in ms:
            by_lr = {
                s["outer_lr"]: s["final_eval_loss"]
                for s in runs.values()
                if s["algo"] == "diloco" and s["workers"] == m
            }
            cells = [f"{by_lr[lr]:.4f}" if lr in by_lr else "-" for lr in lrs]
            lines.append(f"| {size} | {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_ratios(results: dict[str, dict[str, Any]], path: Path) -> None:
    """DiLoCo / data-parallel final eval loss against parameter count (log x), one line per M."""
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    per_m: dict[int, list[tuple[int, float]]] = {}
    for r in results.values():
        for m, ratio in ratios(r["runs"]).items():
            per_m.setdefault(m, []).append((r["plan"]["num_params"], ratio))
    for m, points in sorted(per_m.items()):
        xs, ys = zip(*sorted(points), strict=True)
        ax.plot(xs, ys, marker="o", label=f"DiLoCo M={m}")
    ax.axhline(1.0, ls="--", color="gray", label="data-parallel")
    for size, r in results.items():
        ax.annotate(size, (r["plan"]["num_params"], 1.0), textcoords="offset points",
                    xytext=(0, -12), ha="center", fontsize=8, color="gray")  # fmt: skip
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # no overlapping labels
    ax.set_xlabel("parameters (log)")
    ax.set_ylabel("final eval loss, DiLoCo / data-parallel")
    ax.set_title("DiLoCo vs data-parallel against model size")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"sizes {', '.join(QUICK_SIZES)}")
    parser.add_argument("--sizes", nargs="+", choices=SIZES, help="model sizes to run")
    parser.add_argument(
        "--tokens-per-param",
        type=float,
        help=f"default {TOKENS_PER_PARAM} ({QUICK_TOKENS_PER_PARAM} with --quick)",
    )
    parser.add_argument("--workers", type=int, nargs="+", default=list(WORKER_COUNTS))
    parser.add_argument("--lr-grid", type=float, nargs="+", default=list(LR_GRID))
    parser.add_argument("--out", default=str(RESULTS), help="output folder")
    parser.add_argument("--name", help="output file stem (default model_size[_quick])")
    parser.add_argument(
        "--cache",
        help="folder of finished runs, reused when rerun (default OUT/NAME_runs)",
    )
    parser.add_argument(
        "--cached-only",
        action="store_true",
        help="train nothing: tabulate the runs already in the cache (a sweep still running)",
    )
    parser.add_argument(
        "--no-baselines",
        action="store_true",
        help="train only DiLoCo runs (to split one size's grid over processes sharing --cache)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the sweep and writes NAME.md, NAME.json and NAME.png into --out."""
    args = parse_args(argv)
    sizes = args.sizes or (QUICK_SIZES if args.quick else SIZES)
    if args.tokens_per_param is None:
        args.tokens_per_param = QUICK_TOKENS_PER_PARAM if args.quick else TOKENS_PER_PARAM
    name = args.name or ("model_size_quick" if args.quick else "model_size")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = Path(args.cache) if args.cache else out / f"{name}_runs"
    start, load_start = time.perf_counter(), os.getloadavg()[0]
    corpus = load_corpus()
    results = {}
    for size in sizes:
        plan = size_plan(size, args.tokens_per_param)
        print(
            f"{size}: {plan.num_params:,} params, {plan.global_batch} x {SEQ_LEN} per step, "
            f"H={plan.inner_steps} x R={plan.rounds}",
            flush=True,
        )
        runs = run_size(
            plan,
            corpus,
            args.workers,
            args.lr_grid,
            cache / size,
            train=not args.cached_only,
            baselines=not args.no_baselines,
        )
        if "sync_data_parallel" not in runs:  # not run yet (--cached-only, --no-baselines)
            continue
        results[size] = {
            "plan": plan_record(plan),
            "runs": runs,
            "best": best_per_workers(runs),
            "ratio": ratios(runs),
        }
    wall = time.perf_counter() - start
    run_seconds = sum(s["wall_seconds"] for r in results.values() for s in r["runs"].values())
    num_runs = sum(len(r["runs"]) for r in results.values())
    table = table_markdown(results) + (
        f"\n{num_runs} runs, {run_seconds / 60:.0f} min of training in all (the sum of the "
        "runs' wall times, compiles and evaluations included).\n"
    )
    record = {
        "command": " ".join(["python", "sweep_model_size.py", *(argv or sys.argv[1:])]),
        "tokens_per_param": args.tokens_per_param,
        "lr_grid": args.lr_grid,
        "workers": args.workers,
        "seq_len": SEQ_LEN,
        "inner_lr": INNER_LR,
        "wall_seconds": wall,
        "run_seconds": run_seconds,
        "load_average_1min": {"start": load_start, "end": os.getloadavg()[0]},
        "jax_version": jax.__version__,
        "results": results,
    }
    (out / f"{name}.md").write_text(table)
    (out / f"{name}.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    plot_ratios(results, out / f"{name}.png")
    print(table)
    print(f"{wall / 60:.1f} min; wrote {out}/{name}.md, .json, .png")
    return record


if __name__ == "__main__":
    main()
