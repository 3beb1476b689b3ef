"""Asynchronous DiLoCo on real processes against its simulated clock, on localhost: a syncer
and M worker processes training benchmarks/elastic_lm.py's task (`ELASTIC_ALGO=async`: Delayed
Nesterov at the syncer), worker M-1 a straggler that takes `--slow` seconds more per inner step
(`DILOCO_JAX_SLOW_STEP`). See benchmarks/README.md, "elastic_async.py".

    .venv/bin/python benchmarks/elastic_async.py [--workers 4] [--updates 40] [--inner-steps 8]
        [--slow 0.05] [--out benchmarks/results/elastic_async.json]

One real run with DyLU off and one with it on. For each:
- real: wall seconds from the first job's start to the last update, and the inner steps and
  tokens per second over them (every worker's applied jobs);
- simulated: `async_schedule` for the same number of updates at each worker's measured
  seconds per inner step (the median over its timed jobs of their steps' seconds / steps; a
  step count's first job compiles its program and is not timed): the clock `train_async`
  would sweep, and its tokens per second;
- real / simulated tokens per second: what the simulated clock leaves out (the hops, each
  update's outer step and checkpoint, the batches drawn);
- replay: `train_async(arrivals=...)` on the run's arrival log from the same θ_0: the
  largest relative difference of its θ from the real one.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from diloco_jax.auth import new_secret

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_OUT = HERE / "results" / "elastic_async.json"
TASK = "elastic_lm:task"


def _spawn(out: Path, name: str, argv: list[str], env: dict) -> subprocess.Popen:
    log = open(out / f"{name}.log", "ab")  # noqa: SIM115 (the process keeps it)
    return subprocess.Popen([sys.executable, "-m", "diloco_jax.elastic", *argv], stdout=log,
                            stderr=subprocess.STDOUT, env=env)  # fmt: skip


def _address(folder: Path) -> str:
    """A syncer's "host:port" once it serves."""
    path = folder / "syncer.address"
    while not (path.exists() and path.read_text().endswith("\n")):
        time.sleep(0.02)
    return path.read_text().strip()


def max_relative_difference(real, replay) -> float:
    """The largest relative difference of a real run's params from its replay's."""
    return max(
        float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-30)))
        for a, b in zip(jax.tree.leaves(real), jax.tree.leaves(replay), strict=True)
    )


def rates(real: tuple, simulated: tuple, tokens_per_step: int, per_step: list) -> dict:
    """A real window and its simulated clock's, each (seconds, inner steps), as the fields a
    results file records; synchronous DiLoCo at the same step times waits for the slowest
    worker every step."""
    (real_s, real_n), (sim_s, sim_n) = real, simulated
    return {
        "seconds_per_step": [round(s, 4) for s in per_step],
        "real_seconds": round(real_s, 3),
        "real_inner_steps": real_n,
        "real_tokens_per_second": round(real_n * tokens_per_step / real_s, 1),
        "simulated_seconds": round(sim_s, 3),
        "simulated_inner_steps": sim_n,
        "simulated_tokens_per_second": round(sim_n * tokens_per_step / sim_s, 1),
        "synchronous_tokens_per_second": round(len(per_step) * tokens_per_step / max(per_step), 1),
    }


def real_run(args: argparse.Namespace, dylu: bool, workdir: Path) -> Path:
    """One run to its end; returns its syncer folder."""
    env = dict(ELASTIC_WORKERS=str(args.workers), ELASTIC_ROUNDS=str(args.updates),
               ELASTIC_INNER_STEPS=str(args.inner_steps), ELASTIC_ALGO="async",
               ELASTIC_DYLU="1" if dylu else "0")  # fmt: skip
    return run_processes(workdir, env, args.workers, args.slow)


def run_processes(
    workdir: Path, task_env: dict, workers: int, slow: float, *flags: str,
    regions: tuple[int, ...] | None = None,
) -> Path:  # fmt: skip
    """The syncer and each worker a process of this host (`TASK`, sized by `task_env`),
    worker M-1 `slow` seconds slower per inner step, all run to their end; with `regions`
    (HALoS: each worker's region), a syncer per region under the global one, each worker at
    its region's. Returns the (global) syncer's folder (the workers' is beside it)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE)]),
               XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu",
               DILOCO_JAX_SECRET=new_secret().decode(), **task_env)  # fmt: skip
    syncer_dir = workdir / "syncer"
    argv = ["syncer", "--task", TASK, "--dir", str(syncer_dir), "--port", "0", *flags]
    procs = {"syncer": _spawn(workdir, "syncer", argv, env)}
    addresses = [_address(syncer_dir)] * workers
    if regions is not None:
        for r in sorted(set(regions)):
            folder = syncer_dir / f"region-{r}"
            argv = ["syncer", "--task", TASK, "--dir", str(folder), "--port", "0", "--region",
                    str(r), "--global-syncer", addresses[0], *flags]  # fmt: skip
            procs[f"region-{r}"] = _spawn(workdir, f"region-{r}", argv, env)
        addresses = [_address(syncer_dir / f"region-{r}") for r in regions]
    for m in range(workers):
        extra = str(slow if m == workers - 1 else 0.0)
        argv = ["worker", "--task", TASK, "--worker", str(m), "--syncer", addresses[m],
                "--dir", str(workdir / "workers")]  # fmt: skip
        procs[f"worker-{m}"] = _spawn(workdir, f"worker-{m}", argv,
                                      {**env, "DILOCO_JAX_SLOW_STEP": extra})  # fmt: skip
    try:
        for name, p in procs.items():
            if p.wait(900) != 0:
                log = (workdir / f"{name}.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{name} exited with {p.returncode}:\n{log}")
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return syncer_dir


def _seconds_per_step(jobs: list[dict]) -> float:
    """The median seconds per inner step over a worker's timed jobs (a step count's first job
    in a process compiles its program and reports no time)."""
    return statistics.median(x["steps_s"] / x["steps"] for x in jobs if x["steps_s"] > 0)


def measure(args: argparse.Namespace, dylu: bool, syncer_dir: Path) -> dict:
    import elastic_lm

    import diloco_jax as dj
    from diloco_jax import elastic

    lines = elastic.history(syncer_dir)
    events = elastic.arrivals(syncer_dir)
    task = elastic_lm.task()
    tokens_per_step = int(np.prod(np.shape(task.batches(0, 0)["inputs"])[1:]))
    seconds = max(x["time"] for x in lines) - min(x["started"] for x in lines)
    steps = sum(x["steps"] for x in lines)
    per_step = [_seconds_per_step([x for x in lines if x["worker"] == m])
                for m in range(args.workers)]  # fmt: skip
    simulated = dj.async_schedule(per_step, args.inner_steps, len(lines), dynamic_steps=dylu)
    sim_steps = sum(e.steps for e in simulated.events)
    rounds = [
        jax.tree.map(lambda *x: np.stack(x), *(task.batches(m, j) for m in range(args.workers)))
        for j in range(1 + max(e.job for e in events))
    ]
    replay = dj.train_async(
        task.loss_fn, task.params, rounds, num_workers=args.workers,
        inner_steps=args.inner_steps, num_updates=len(events), arrivals=events,
        method=task.method,
    )  # fmt: skip
    real = elastic.final_params(syncer_dir, task)
    difference = max_relative_difference(real, replay.params)
    real_tps = steps * tokens_per_step / seconds
    sim_tps = sim_steps * tokens_per_step / simulated.elapsed_seconds
    return {
        "dylu": dylu,
        "updates": len(lines),
        "seconds_per_step": [round(s, 4) for s in per_step],
        "job_steps": [
            sorted({x["steps"] for x in lines if x["worker"] == m}) for m in range(args.workers)
        ],  # fmt: skip
        "real_seconds": round(seconds, 3),
        "real_inner_steps": steps,
        "real_tokens_per_second": round(real_tps, 1),
        "simulated_seconds": round(simulated.elapsed_seconds, 3),
        "simulated_inner_steps": sim_steps,
        "simulated_tokens_per_second": round(sim_tps, 1),
        "real_over_simulated": round(real_tps / sim_tps, 3),
        "max_staleness": max(x["staleness"] for x in lines),
        "replay_max_relative_difference": difference,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--updates", type=int, default=40)
    parser.add_argument("--inner-steps", type=int, default=8)
    parser.add_argument("--slow", type=float, default=0.05)
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args(argv)
    os.environ.update(ELASTIC_WORKERS=str(args.workers), ELASTIC_ROUNDS=str(args.updates),
                      ELASTIC_INNER_STEPS=str(args.inner_steps), ELASTIC_ALGO="async")  # fmt: skip
    sys.path.insert(0, str(HERE))
    results = []
    for dylu in (False, True):
        os.environ["ELASTIC_DYLU"] = "1" if dylu else "0"
        with tempfile.TemporaryDirectory() as workdir:
            syncer_dir = real_run(args, dylu, Path(workdir))
            results.append(measure(args, dylu, syncer_dir))
        print(json.dumps(results[-1]), flush=True)
    record = {
        "command": "benchmarks/elastic_async.py " + " ".join(argv or sys.argv[1:]),
        "workers": args.workers,
        "updates": args.updates,
        "inner_steps": args.inner_steps,
        "straggler_extra_seconds_per_step": args.slow,
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "jax": jax.__version__,
        "runs": results,
    }
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
