"""Decoupled DiLoCo on real processes against its simulated clock, on localhost: a syncer and
M learner processes training benchmarks/elastic_lm.py's task (`ELASTIC_ALGO=decoupled`: a
quorum of M - 1, `--grace` seconds, 2 fragments), learner M-1 a straggler that takes `--slow`
seconds more per inner step (`DILOCO_JAX_SLOW_STEP`). See benchmarks/README.md,
"elastic_decoupled.py".

    .venv/bin/python benchmarks/elastic_decoupled.py [--workers 4] [--merges 24]
        [--inner-steps 8] [--slow 0.1] [--grace 0.5] [--out FILE]

Measured from one run (default out: benchmarks/results/elastic_decoupled.json), from the
first merge to the last (the processes' start-up and compilation left out):
- real: the seconds between them, and the inner steps every learner completed in them and
  their tokens per second;
- simulated: `DecoupledDiLoCo.schedule` at each learner's measured seconds per inner step
  (the median of its steps' seconds, its first two left out: compilation): the clock
  `train_async(server=...)` sweeps, the same window and the learners' steps in it;
- synchronous DiLoCo at the same step times, every round waiting for the slowest learner;
- replay: `train_async(server=..., arrivals=...)` on the run's record from the same θ_0: the
  largest relative difference of its Θ from the real one.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np
from elastic_async import max_relative_difference, rates, run_processes

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_OUT = HERE / "results" / "elastic_decoupled.json"


def real_run(args: argparse.Namespace, workdir: Path) -> Path:
    """One run to its end: the syncer and each learner a process, the last one slower;
    returns the run's folder."""
    task_env = dict(ELASTIC_WORKERS=str(args.workers), ELASTIC_ROUNDS=str(args.merges),
                    ELASTIC_INNER_STEPS=str(args.inner_steps), ELASTIC_ALGO="decoupled",
                    ELASTIC_GRACE=str(args.grace))  # fmt: skip
    run_processes(workdir, task_env, args.workers, args.slow, "--heartbeat-timeout", "30")
    return workdir


def measure(args: argparse.Namespace, out: Path) -> dict:
    import elastic_lm

    import diloco_jax as dj
    from diloco_jax import elastic
    from diloco_jax.decoupled import replay_rounds, steps_by

    task = elastic_lm.task()
    spec = task.server
    lines = elastic.history(out / "syncer")
    merges = elastic.arrivals(out / "syncer")
    steps = [elastic.worker_metrics(out / "workers", m) for m in range(args.workers)]
    per_step = [statistics.median(x["seconds"] for x in s[2:]) for s in steps]
    tokens_per_step = int(np.prod(np.shape(task.batches(0, 0)["inputs"])[1:]))
    start, end = lines[0]["wall"], lines[-1]["wall"]  # the first merge and the last
    real_seconds = end - start
    real_steps = sum(1 for s in steps for x in s if start < x["time"] <= end)
    schedule = spec.schedule(per_step, args.inner_steps, len(lines))
    sim_seconds = schedule[-1].time - schedule[0].time
    sim_steps = sum(
        steps_by(schedule[-1].time, s) - steps_by(schedule[0].time, s) for s in per_step
    )
    rounds = [
        jax.tree.map(lambda *x: np.stack(x), *(task.batches(m, j) for m in range(args.workers)))
        for j in range(replay_rounds(merges, args.inner_steps))
    ]
    replay = dj.train_async(
        task.loss_fn, task.params, rounds, num_workers=args.workers,
        inner_steps=args.inner_steps, num_updates=len(merges), server=spec, arrivals=merges,
        method=task.method,
    )  # fmt: skip
    real = elastic.final_params(out / "syncer", task)
    return {
        "merges": len(lines),
        "late_pushes": sum(x["late"] for x in lines),
        **rates((real_seconds, real_steps), (sim_seconds, sim_steps), tokens_per_step, per_step),
        "replay_max_relative_difference": max_relative_difference(real, replay.params),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--merges", type=int, default=24)
    parser.add_argument("--inner-steps", type=int, default=8)
    parser.add_argument("--slow", type=float, default=0.1)
    parser.add_argument("--grace", type=float, default=0.5)
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args(argv)
    os.environ.update(ELASTIC_WORKERS=str(args.workers), ELASTIC_ROUNDS=str(args.merges),
                      ELASTIC_INNER_STEPS=str(args.inner_steps), ELASTIC_ALGO="decoupled",
                      ELASTIC_GRACE=str(args.grace))  # fmt: skip
    sys.path.insert(0, str(HERE))
    with tempfile.TemporaryDirectory() as workdir:
        result = measure(args, real_run(args, Path(workdir)))
    print(json.dumps(result), flush=True)
    record = {
        "command": "benchmarks/elastic_decoupled.py " + " ".join(argv or sys.argv[1:]),
        "workers": args.workers,
        "inner_steps": args.inner_steps,
        "straggler_extra_seconds_per_step": args.slow,
        "grace_seconds": args.grace,
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "jax": jax.__version__,
        "run": result,
    }
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
