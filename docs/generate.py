"""The figures of README.md and docs/lm.md, written from the results files in docs/results/.

    python docs/generate.py            # rewrite every generated block from its results file
    python docs/generate.py --check    # exit 1, naming the block, if one differs

A generated block sits between `<!-- generated: NAME -->` and `<!-- /generated -->` lines.
The results files and the commands that made them:

- docs/results/make_run.json: `make run` (Python 3.11, the oldest stack) in a fresh clone,
  timed from the clone's first make to its end, venv included:
      git clone REPO CLONE && cd CLONE && time make run
      python docs/generate.py --record make_run CLONE/runs/compare SECONDS CLONE
- docs/results/compare_quick.json: `diloco-jax compare --preset quick --out OUT` in that
  clone's venv, timed:
      python docs/generate.py --record compare_quick OUT SECONDS CLONE
- docs/results/compare_quick_newest.json: the same command on the newest stack
  (`make test-newest`'s .venv-newest), to show what another XLA changes:
      python docs/generate.py --record compare_quick_newest OUT SECONDS CLONE .venv-newest
- docs/results/digits.json: the digits example, `python examples/digits.py --out
  docs/results/digits.json` (it records its own time).
- benchmarks/results/worker_map.json: `python benchmarks/worker_map.py` (one device: the vmap
  and sequential backends against `train_sync`'s steps), for docs/devices.md.

A record holds the run's summary.json, the tables it printed (its summary.md), the wall
seconds, the machine's load, the clone's commit and the date. tests/test_docs_figures.py
checks that every block equals its rendering, that rendering a summary gives exactly what the
run printed, and that each record is of the current code's configuration (preset, corpus, the
oldest stack's jax): a change to any of them fails it until the runs are recorded again.
"""

import datetime
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from diloco_jax.lm.compare import network_markdown, summary_markdown
from diloco_jax.lm.config import RunConfig

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
DOCS = (
    ROOT / "README.md",
    ROOT / "docs" / "lm.md",
    ROOT / "docs" / "your-model.md",
    ROOT / "docs" / "devices.md",
)
BENCHMARK_RESULTS = ROOT / "benchmarks" / "results"
BLOCK = re.compile(r"(<!-- generated: ([\w-]+) -->\n)(.*?)(<!-- /generated -->)", re.S)


def load(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def duration(seconds: float) -> str:
    """'13 min 5 s', or '58 s' under a minute."""
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s" if minutes else f"{rest} s"


def printed_table(record: dict) -> str:
    """The tables the command printed, rendered from its summary as it rendered them."""
    summary = record["summary"]
    cfg = RunConfig(**_config_fields(summary["config"]["config"]))
    return summary_markdown(cfg, summary["runs"]) + "\n" + network_markdown(summary["network"])


def _config_fields(fields: dict) -> dict:
    """A RunConfig's fields from JSON (lists back to the tuples they were)."""
    out = dict(fields)
    if out.get("mesh") is not None:
        out["mesh"] = tuple(tuple(axis) for axis in out["mesh"])
    if out.get("step_seconds") is not None:
        out["step_seconds"] = tuple(out["step_seconds"])
    return out


def _provenance(record: dict, command: str) -> str:
    config = record["summary"]["config"]
    return (
        f"Printed by `{command}` in a fresh clone of commit {record['commit'][:7]} on "
        f"{record['date']} ({record['machine']} at a 15-minute load of "
        f"{record['load_15min']:g}, Python {record['python']}, jax {config['jax_version']}); "
        "wall times, tokens/s and MFU are that machine's; the bytes are the same on every "
        "machine running this stack, the losses bit for bit on that machine only (the same "
        "code, recorded on two 2-core machines, printed losses that differ in the third or "
        "fourth digit)."
    )


def gap_share(record: dict) -> float:
    """How much of the gap from one worker to data parallelism DiLoCo leaves, in percent."""
    runs = record["summary"]["runs"]
    one, dp = runs["sync_1worker"]["final_eval_loss"], runs["sync_data_parallel"]["final_eval_loss"]
    return 100 * (runs["diloco"]["final_eval_loss"] - dp) / (one - dp)


def digits_table(record: dict) -> str:
    """docs/your-model.md's account of examples/digits.py's three runs."""
    cfg, runs = record["config"], record["results"]
    lines = [
        f"Measured with that command (defaults: M = {cfg['workers']}, H = {cfg['inner_steps']}, "
        f"{cfg['rounds']} rounds, batch {cfg['batch_size']} per worker and step, AdamW "
        f"{cfg['lr']:g} inner / data-parallel optimizer, DiLoCo's default Nesterov outer step, "
        f"seed {cfg['seed']}; CPU, {duration(record['seconds'])} for the three runs on "
        f"{record['cpus']} cores):",
        "",
        "| run | inner steps | wire MB / worker | BatchNorm merge kB / worker | train acc "
        "| test acc |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in runs.items():
        lines.append(
            f"| {name} | {r['steps']} | {r['wire_bytes'] / 1e6:.3f} | "
            f"{r['model_state_wire_bytes'] / 1e3:.1f} | {r['train_accuracy']:.4f} | "
            f"{r['test_accuracy']:.4f} |"
        )
    diloco, steps = runs["diloco"], runs["sync_equal_steps"]
    gap = 100 * (steps["test_accuracy"] - diloco["test_accuracy"])
    lines += [
        "",
        f"DiLoCo with one sync every {cfg['inner_steps']} steps comes within {gap:.1f} points "
        "of data parallelism's test accuracy at equal steps while sending "
        f"{steps['wire_bytes'] / diloco['wire_bytes']:.0f} x fewer bytes; data parallelism at "
        f"DiLoCo's bytes ({runs['sync_equal_bytes']['steps']} steps) reaches "
        f"{runs['sync_equal_bytes']['test_accuracy']:.4f}.",
    ]
    return "\n".join(lines) + "\n"


def worker_map_table(record: dict) -> str:
    """docs/devices.md's one-device backends: seconds per round and their ratios."""
    env = record["environment"]
    lines = [
        "| workload | M x H | vmap s | sequential s | vmap, unrolled s | train_sync s "
        "| vmap / sequential | vmap / train_sync | unrolled / train_sync |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in record["rows"]:
        lines.append(
            f"| {r['workload']} | {r['workers']} x {r['inner_steps']} | {r['vmap_s']:.3f} | "
            f"{r['sequential_s']:.3f} | {r['vmap_unrolled_s']:.3f} | {r['train_sync_s']:.3f} | "
            f"{r['vmap_over_sequential']:.2f} | {r['vmap_over_sync']:.2f} | "
            f"{r['unrolled_over_sync']:.2f} |"
        )
    lines += [
        "",
        f"`python benchmarks/worker_map.py` (median of {record['reps']} interleaved rounds; "
        f"jax {env['jax']}, one CPU device on {env['cpu_count']} cores, 1-minute load "
        f"{env['load_average_1m']:g}); train_sync is M x H worker-steps as H jitted steps.",
    ]
    return "\n".join(lines) + "\n"


def conv_in_loop(record: dict) -> str:
    """docs/devices.md's sentence on a convolution's steps in one loop, from the same run."""
    loop = record["conv_in_loop"]
    return (
        f"{loop['steps']} SGD steps of two convolutions took {loop['scan_s']:.2f} s in one "
        f"`lax.scan` against {loop['per_step_s']:.2f} s as one program per step "
        f"({loop['scan_over_per_step']:.0f} x, the same run).\n"
    )


def newest_losses(oldest: dict, newest: dict) -> str:
    """The quick preset's final eval losses on both stacks, for the README's stacks."""
    losses = lambda record: " / ".join(  # noqa: E731
        f"{run['final_eval_loss']:.4f}" for run in record["summary"]["runs"].values()
    )
    return (
        f"On it, `diloco-jax compare --preset quick` printed final eval losses {losses(newest)} "
        f"(Python {newest['python']}, jax {newest['summary']['config']['jax_version']}) against "
        f"the oldest stack's {losses(oldest)}, from the same bytes: another XLA fuses and "
        "rounds otherwise, so losses agree to about three digits, not bit for bit.\n"
    )


def blocks() -> dict[str, str]:
    """NAME -> the text of its generated block."""
    make_run, quick = load("make_run"), load("compare_quick")
    worker_map = json.loads((BENCHMARK_RESULTS / "worker_map.json").read_text())
    table = lambda record, command: (  # noqa: E731
        "```text\n"
        + printed_table(record).rstrip("\n")
        + "\n```\n\n"
        + _provenance(record, command)
        + "\n"
    )
    return {
        "make-run-time": (
            f"In a fresh clone on {make_run['machine']} (a 15-minute load of "
            f"{make_run['load_15min']:g} when it ended), `make run` took "
            f"{duration(make_run['seconds'])}, the venv's install included; `.venv/bin/diloco-jax "
            f"compare --preset quick` (a smaller model, fewer rounds; the same three runs) took "
            f"{duration(quick['seconds'])} there.\n"
        ),
        "make-run-table": table(make_run, "make run"),
        "quick-table": table(quick, "diloco-jax compare --preset quick"),
        "digits-table": digits_table(load("digits")),
        "worker-map-table": worker_map_table(worker_map),
        "conv-in-loop": conv_in_loop(worker_map),
        "newest-losses": newest_losses(quick, load("compare_quick_newest")),
        "gap-share": (
            f"the gap left to data parallelism is {gap_share(make_run):.0f}% (default preset) "
            f"and {gap_share(quick):.0f}% (quick) of the gap between the two baselines.\n"
        ),
    }


def rewrite(text: str, generated: dict[str, str]) -> str:
    return BLOCK.sub(lambda m: m.group(1) + generated[m.group(2)] + m.group(4), text)


def record(name: str, out: Path, seconds: float, clone: Path, venv: str = ".venv") -> None:
    """Writes docs/results/NAME.json from a finished run's OUT/summary.json (run with the
    Python of CLONE/VENV)."""
    commit = subprocess.run(
        ["git", "-C", str(clone), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    version = "import platform; print(platform.python_version())"
    python = subprocess.run(
        [str(clone / venv / "bin" / "python"), "-c", version],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    data = {
        "commit": commit,
        "date": datetime.date.today().isoformat(),
        "machine": f"{len(os.sched_getaffinity(0))} CPU cores",
        "python": python,
        "seconds": seconds,
        # the machine's 15-minute load average when the run ended (other jobs slow it)
        "load_15min": round(os.getloadavg()[2], 1),
        "summary": json.loads((out / "summary.json").read_text()),
        "printed": (out / "summary.md").read_text(),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")


def main(argv: list[str]) -> int:
    if argv[:1] == ["--record"]:
        name, out, seconds, clone, *venv = argv[1:6]
        record(name, Path(out), float(seconds), Path(clone), *venv)
        return 0
    generated = blocks()
    stale = []
    for path in DOCS:
        text = path.read_text()
        new = rewrite(text, generated)
        if new != text:
            stale.append(path.relative_to(ROOT))
            if "--check" not in argv:
                path.write_text(new)
    if "--check" in argv and stale:
        print(f"generated blocks out of date in {', '.join(map(str, stale))}: run docs/generate.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
