"""HALoS on real processes against its simulated clock, on localhost: a global syncer, a
syncer per region and M worker processes training benchmarks/elastic_lm.py's task
(`ELASTIC_ALGO=halos`: two regions, a push every 2 region updates), worker M-1 (in region 1)
a straggler that takes `--slow` seconds more per inner step (`DILOCO_JAX_SLOW_STEP`). See
benchmarks/README.md, "elastic_halos.py".

    .venv/bin/python benchmarks/elastic_halos.py [--workers 4] [--global-updates 12]
        [--inner-steps 8] [--slow 0.1] [--out FILE]

Measured from one run (default out: benchmarks/results/elastic_halos.json), from the first
region update to the last (the processes' start-up and compilation left out):
- real: the seconds between them, the inner steps of the updates after the first, and their
  tokens per second;
- simulated: `HALoS.arrivals` for as many region updates at each worker's measured seconds
  per inner step (the median over its timed jobs; a worker's first job compiles): the clock
  `train_async(server=...)` sweeps, and its tokens per second over the same updates;
- synchronous DiLoCo at the same step times, every round waiting for the slowest worker;
- replay: `train_async(server=..., arrivals=...)` on the run's record from the same θ_0: the
  largest relative difference of its θ_G from the real one.
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
DEFAULT_OUT = HERE / "results" / "elastic_halos.json"


def measure(args: argparse.Namespace, syncer_dir: Path) -> dict:
    import elastic_lm

    import diloco_jax as dj
    from diloco_jax import elastic

    task = elastic_lm.task()
    spec, h = task.server, args.inner_steps
    lines = sorted((x for r in range(spec.num_regions)
                    for x in elastic.history(syncer_dir / f"region-{r}")),
                   key=lambda x: x["time"])  # fmt: skip
    timed = {m: [x["steps_s"] / x["steps"] for x in lines if x["worker"] == m and x["steps_s"]]
             for m in range(args.workers)}  # fmt: skip
    per_step = [statistics.median(timed[m]) for m in range(args.workers)]
    tokens_per_step = int(np.prod(np.shape(task.batches(0, 0)["inputs"])[1:]))
    real_seconds = lines[-1]["time"] - lines[0]["time"]
    real_steps = sum(x["steps"] for x in lines[1:])
    arrivals = spec.arrivals(per_step, (h,) * args.workers, len(lines))
    sim_seconds = arrivals[-1][0] - arrivals[0][0]
    sim_steps = h * (len(arrivals) - 1)
    record = elastic.arrivals(syncer_dir)
    rounds = [
        jax.tree.map(lambda *x: np.stack(x), *(task.batches(m, j) for m in range(args.workers)))
        for j in range(1 + max(a.job for a in record.arrivals))
    ]
    replay = dj.train_async(
        task.loss_fn, task.params, rounds, num_workers=args.workers, inner_steps=h,
        num_updates=len(record.arrivals), server=spec, arrivals=record, method=task.method,
    )  # fmt: skip
    real = elastic.final_params(syncer_dir, task)
    return {
        "region_updates": len(lines),
        "global_updates": len(record.pushes),
        "merges": len(record.merges),
        **rates((real_seconds, real_steps), (sim_seconds, sim_steps), tokens_per_step, per_step),
        "replay_max_relative_difference": max_relative_difference(real, replay.params),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--global-updates", type=int, default=12)
    parser.add_argument("--inner-steps", type=int, default=8)
    parser.add_argument("--slow", type=float, default=0.1)
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args(argv)
    task_env = dict(ELASTIC_WORKERS=str(args.workers), ELASTIC_ROUNDS=str(args.global_updates),
                    ELASTIC_INNER_STEPS=str(args.inner_steps), ELASTIC_ALGO="halos")  # fmt: skip
    os.environ.update(task_env)
    sys.path.insert(0, str(HERE))
    import elastic_lm

    regions = elastic_lm.task().server.regions
    with tempfile.TemporaryDirectory() as workdir:
        syncer_dir = run_processes(Path(workdir), task_env, args.workers, args.slow,
                                   "--heartbeat-timeout", "30", regions=regions)  # fmt: skip
        result = measure(args, syncer_dir)
    print(json.dumps(result), flush=True)
    record = {
        "command": "benchmarks/elastic_halos.py " + " ".join(argv or sys.argv[1:]),
        "workers": args.workers,
        "regions": list(regions),
        "inner_steps": args.inner_steps,
        "straggler_extra_seconds_per_step": args.slow,
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "jax": jax.__version__,
        "run": result,
    }
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
