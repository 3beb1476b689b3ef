"""An elastic run's sync on a shaped link, against DiLoCo's all-reduce on the same link: M
worker processes and the syncer (`diloco_jax.elastic`), each in a network namespace of its own
joined by benchmarks/link.py's shaped devices, training benchmarks/elastic_lm.py's task (the
LM tiny preset, batch 8, H = 25, as link.py's DiLoCo row). See benchmarks/README.md,
"elastic_link.py".

    sudo .venv/bin/python benchmarks/elastic_link.py [--links 100mbit:20ms,10mbit:50ms]
        [--workers 2] [--rounds 6] [--out benchmarks/results/elastic_link.json]

Per link, one run: a round is the time between two syncs' closes; its compute is the slowest
worker's phase (the batches drawn and the H steps, as the worker timed it); the sync is the
rest (pushing Δ, the syncer's mean and outer step, θ back to every worker). The first two
rounds (compiles) are left out; the figure is the median. The all-reduce's round and compute
come from `link.py --methods diloco` run first, in the same invocation, on the same links.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from link import (  # noqa: E402
    SBIN,
    link_commands,
    network,
    parse_link,
    python_env,
    relay_setting,
    requirements_problem,
    sweep_stale,
    worker_address,
)
from link_worker import switch_link  # noqa: E402

from diloco_jax.auth import new_secret  # noqa: E402

DEFAULT_OUT = HERE / "results" / "elastic_link.json"
SYNCER_PORT = 47101


def allreduce_rows(links: str, workers: int, workdir: Path) -> dict[str, dict]:
    """link.py's DiLoCo rows on `links`: link name -> its row."""
    out = workdir / "link.json"
    argv = [sys.executable, str(HERE / "link.py"), "--methods", "diloco", "--links", links,
            "--workers", str(workers), "--cycles", "1", "--out", str(out), "--no-plot"]  # fmt: skip
    subprocess.run(argv, check=True, timeout=3600)
    rows = json.loads(out.read_text())["rows"]
    return {r["link"]: r for r in rows if r["method"] == "diloco"}


class NamespacedRun:
    """An elastic run on `net`: the syncer in namespace 0, worker k in namespace k + 1, each
    logging to its own file in `workdir`."""

    def __init__(self, net, workdir: Path, env: dict[str, str]):
        self.net, self.workdir, self.env = net, workdir, env
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs = []

    def _spawn(self, name: str, space: int, argv: list[str]) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "a")  # noqa: SIM115 (closed by close())
        self.logs.append(log)
        argv = [sys.executable, "-m", "diloco_jax.elastic", *argv]
        proc = self.net.spawn(space, argv, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        self.procs[name] = proc
        return proc

    def syncer(self, *flags: str) -> subprocess.Popen:
        return self._spawn("syncer", 0, ["syncer", "--task", "elastic_lm:task", "--dir",
                           str(self.workdir / "syncer"), "--host", worker_address(0),
                           "--port", str(SYNCER_PORT), *flags])  # fmt: skip

    def worker(self, k: int) -> subprocess.Popen:
        return self._spawn(f"worker-{k}", k + 1, ["worker", "--task", "elastic_lm:task",
                           "--worker", str(k), "--syncer", f"{worker_address(0)}:{SYNCER_PORT}",
                           "--dir", str(self.workdir / "workers")])  # fmt: skip

    def syncs(self) -> list[dict]:
        path = self.workdir / "syncer" / "history.jsonl"
        if not path.exists():
            return []
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]

    def wait(self, timeout: float) -> None:
        """Until every process has ended; RuntimeError if one failed or ran past `timeout`."""
        deadline = time.monotonic() + timeout
        for name, proc in self.procs.items():
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            if code != 0:
                raise RuntimeError(f"{name} exited with {code}; see {self.workdir}")

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in self.logs:
            log.close()


def task_env(workers: int, rounds: int, **extra: str) -> dict[str, str]:
    env = python_env() | dict(
        ELASTIC_WORKERS=str(workers), ELASTIC_ROUNDS=str(rounds), ELASTIC_INNER_STEPS="25",
        ELASTIC_BATCH="8", ELASTIC_PRESET="tiny", DILOCO_JAX_SECRET=new_secret().decode(),
        **extra,
    )  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), str(HERE)])
    return env


def elastic_run(net, link, args, workdir: Path) -> dict:
    """One elastic run without faults; its round, compute and sync seconds."""
    run = NamespacedRun(net, workdir, task_env(args.workers, args.rounds))
    try:
        run.syncer()
        for k in range(args.workers):
            run.worker(k)
        run.wait(1800)
    finally:
        run.close()
    syncs = run.syncs()
    rounds = [b["time"] - a["time"] for a, b in zip(syncs[1:], syncs[2:], strict=False)]
    compute = [max(s["compute_s"].values()) for s in syncs[2:]]
    round_s, compute_s = statistics.median(rounds), statistics.median(compute)
    return {
        "link": "none" if link is None else link.name,
        "round_s": round(round_s, 3),
        "compute_s": round(compute_s, 3),
        "sync_s": round(round_s - compute_s, 3),
        "round_s_all": [round(x, 3) for x in rounds],
        "compute_s_all": [round(x, 3) for x in compute],
    }


def ready_to_shape(script: str) -> bool:
    """Whether this host can build link.py's network (else one line why), after sweeping
    what killed runs left."""
    os.environ["PATH"] = os.pathsep.join([os.environ.get("PATH", ""), *SBIN])
    problem = requirements_problem()
    if problem:
        print(f"{script}: {problem}; run as root on Linux", file=sys.stderr)
        return False
    for what in sweep_stale():
        print(f"{script}: removed {what}, left by a link.py that is gone", file=sys.stderr)
    return True


def shape(net, link, control: Path, netem: bool) -> None:
    """Puts `link` (None: none) on every namespace's uplink."""
    switch_link({
        "commands": link_commands(link, net.names, net.device, netem),
        "relay": relay_setting(link, netem), "control": str(control),
    })  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--links", default="100mbit:20ms,10mbit:50ms")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if not ready_to_shape("elastic_link.py"):
        return 2
    links = [parse_link(t) for t in args.links.split(",")]
    started = time.time()
    with tempfile.TemporaryDirectory(prefix=f"djlink{os.getpid()}-") as tmp:
        workdir = Path(tmp)
        reference = allreduce_rows(args.links, args.workers, workdir)
        rows = []
        tag = f"djlink{os.getpid()}"
        control = Path(tempfile.gettempdir()) / f"{tag}.sock"
        with network(tag, args.workers + 1, 1500, control) as net:
            netem = net.has_netem()
            for link in [None, *links]:
                shape(net, link, control, netem)
                run_dir = workdir / ("none" if link is None else link.name.replace(":", "_"))
                run_dir.mkdir()
                row = elastic_run(net, link, args, run_dir)
                ref = reference.get(row["link"])
                if ref is not None:
                    comm = ref["measured_round_s"] - ref["compute_round_s"]
                    row |= {
                        "allreduce_round_s": round(ref["measured_round_s"], 3),
                        "allreduce_compute_s": round(ref["compute_round_s"], 3),
                        "allreduce_sync_s": round(comm, 3),
                        "sync_ratio": round(row["sync_s"] / comm, 3),
                    }
                rows.append(row)
                print(json.dumps(row), flush=True)
    result = {
        "benchmark": "elastic_link",
        "command": "sudo .venv/bin/python benchmarks/elastic_link.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "workers": args.workers, "preset": "tiny", "batch_size": 8, "inner_steps": 25,
        "delay_impl": "netem" if netem else "relay", "cpu_count": os.cpu_count(),
        "wall_seconds": round(time.time() - started, 1), "rows": rows,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
