"""What a checkpoint costs at round 10 and at round 1,000: a run that saves after every round,
its round time and resident memory (RSS) over the run, against the same run without saves.

A tiny MLP (2 workers, H = 4, in-graph data) trains R rounds with `checkpoint_every=1`
(background saves, keeping 3). Each round's end is timed at its history entry (the callback),
and the process's RSS read there (/proc/self/statm). The report compares the first and the
last 100 rounds (median round time, RSS), fits the RSS growth per save (least squares over
the rounds after the first 100, which warm up Orbax and the allocator), and gives the bytes of
the last checkpoint's metadata: constant-cost saves mean flat time and RSS, a metadata of the
same size at every round, and the history file growing by one line a round.

A third run, a diagnostic, saves the same way with Orbax's throughput logging answered
without TensorStore's `experimental_collect_matching_metrics`: that function (TensorStore
0.1.86) keeps every result it returns alive (about 3.7 KB a call here), and Orbax's array
handlers call it on every save, so RSS grows with the saves whatever the caller does; the
diagnostic shows what a save costs without that leak. Only this script patches it, for that
run; the library does not.

    python benchmarks/checkpoint_cost.py [--rounds 1000]
        [--out benchmarks/results/checkpoint_cost.json]
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import diloco_jax as dj

HERE = Path(__file__).resolve().parent
WIDTH, WORKERS, INNER_STEPS, BATCH = 32, 2, 4, 8


def rss_bytes() -> int:
    """This process's resident set size."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def workload():
    """(params, loss_fn, sampler) of a 2-layer MLP regressing a fixed random linear map, each
    (round, worker, step) drawing its own batch in the compiled round."""
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {
        "w1": jax.random.normal(k1, (WIDTH, WIDTH)) / WIDTH**0.5,
        "w2": jax.random.normal(k2, (WIDTH, 1)) / WIDTH**0.5,
    }
    target = jax.random.normal(k3, (WIDTH, 1))

    def loss_fn(p, batch):
        hidden = jax.nn.relu(batch["x"] @ p["w1"])
        return jnp.mean((hidden @ p["w2"] - batch["x"] @ target) ** 2)

    def sample(arrays, r, m, h):
        key = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(arrays["key"], r), m), h)
        return {"x": jax.random.normal(key, (BATCH, WIDTH))}

    return params, loss_fn, dj.Sampler({"key": jax.random.key(1)}, sample)


def run(rounds: int, checkpoint_dir: str | None) -> dict:
    """Per round: seconds since the previous round's end and RSS at its end."""
    params, loss_fn, sampler = workload()
    ends, rss = [], []

    def callback(_entry):
        ends.append(time.perf_counter())
        rss.append(rss_bytes())

    dj.train_diloco(
        loss_fn, params, sampler, num_rounds=rounds, num_workers=WORKERS,
        inner_steps=INNER_STEPS, backend="vmap", callback=callback,
        checkpoint_dir=checkpoint_dir, checkpoint_every=1, keep_checkpoints=3,
    )  # fmt: skip
    return {"round_s": np.diff(ends).tolist(), "rss": rss}


def run_without_tensorstore_metrics(rounds: int, checkpoint_dir: str) -> dict:
    """`run` with Orbax's per-save TensorStore metrics collection answered by 0 bytes (it only
    feeds a throughput log line)."""
    from orbax.checkpoint._src.serialization import tensorstore_utils

    collect = tensorstore_utils.get_tensorstore_raw_bytes
    tensorstore_utils.get_tensorstore_raw_bytes = lambda *args, **kwargs: 0
    try:
        return run(rounds, checkpoint_dir)
    finally:
        tensorstore_utils.get_tensorstore_raw_bytes = collect


def summary(trace: dict) -> dict:
    """First and last 100 rounds' median round time and mean RSS; RSS growth per round."""
    round_s, rss = np.asarray(trace["round_s"]), np.asarray(trace["rss"], np.float64)
    tail = np.arange(100, len(rss))
    slope = float(np.polyfit(tail, rss[100:], 1)[0]) if len(tail) > 1 else float("nan")
    return {
        "median_round_ms_first_100": 1e3 * statistics.median(round_s[1:101]),
        "median_round_ms_last_100": 1e3 * statistics.median(round_s[-100:]),
        "rss_mb_round_100": rss[99] / 1e6,
        "rss_mb_last": rss[-1] / 1e6,
        "rss_growth_kb_per_round_after_100": slope / 1e3,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "checkpoint_cost.json")
    args = parser.parse_args(argv)
    if args.rounds < 201:
        parser.error("--rounds must be >= 201 (the first and last 100 rounds are compared)")
    plain = run(args.rounds, None)
    with tempfile.TemporaryDirectory(prefix="checkpoint-cost-") as folder:
        saved = run(args.rounds, folder)
        last = Path(folder) / str(args.rounds)
        metadata_bytes = (last / "metadata" / "metadata").stat().st_size
        history = Path(folder) / getattr(dj.checkpoint, "HISTORY_FILE", "none")
        history_bytes = history.stat().st_size if history.exists() else 0
    with tempfile.TemporaryDirectory(prefix="checkpoint-cost-") as folder:
        diagnostic = run_without_tensorstore_metrics(args.rounds, folder)
    report = {
        "benchmark": "checkpoint_cost",
        "command": " ".join(["python", "benchmarks/checkpoint_cost.py", *sys.argv[1:]]),
        "rounds": args.rounds,
        "model": f"MLP {WIDTH}-{WIDTH}-1, M={WORKERS}, H={INNER_STEPS}, batch {BATCH}",
        "jax": jax.__version__,
        "cpu_count": os.cpu_count(),
        "load_average_1m": os.getloadavg()[0],
        "without_checkpoints": summary(plain),
        "checkpoint_every_round": summary(saved)
        | {"last_metadata_bytes": metadata_bytes, "history_file_bytes": history_bytes},
        "checkpoint_every_round_without_tensorstore_metrics": summary(diagnostic),
        "traces": {
            "without_checkpoints": plain,
            "checkpoint_every_round": saved,
            "checkpoint_every_round_without_tensorstore_metrics": diagnostic,
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    for name in (
        "without_checkpoints",
        "checkpoint_every_round",
        "checkpoint_every_round_without_tensorstore_metrics",
    ):
        print(name, json.dumps(report[name], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
