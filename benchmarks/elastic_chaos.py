"""A chaos run on a shaped link: an elastic run (`diloco_jax.elastic`) whose workers are
SIGKILLed and restarted at random, against the same run without faults, both on
benchmarks/link.py's network at 10 Mbit/s and 50 ms per uplink (the syncer's included). The
task is benchmarks/elastic_lm.py's on the LM app's default corpus (ELASTIC_DATA=corpus): the
tiny preset, batch 8, H = 25. See benchmarks/README.md, "elastic_chaos.py".

    sudo .venv/bin/python benchmarks/elastic_chaos.py [--workers 4] [--rounds 120]
        [--link 10mbit:50ms] [--every 120] [--seed 0]
        [--out benchmarks/results/elastic_chaos.json] [--plot PATH] [--clean-from FILE]

The fault-free run trains R rounds. The chaos run trains the same R rounds while, every
`--every` seconds on average (uniform in [0.75, 1.25] x that), a random worker is SIGKILLed
and started again at once; it rejoins at the next round open after its startup. Recorded per
run: each sync's time (from the first sync), its workers and their mean inner loss, tokens per
second (the included phases' tokens over the wall time from the first sync to the last), each
kill, and every process's exit code (a restarted worker still starting when the run ended
finds no syncer and exits 1 after its syncer_timeout; a process that does not end at all is
recorded as such). `--clean-from FILE` takes the fault-free run from an earlier result file of
the same settings instead of running it again.
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from elastic_link import NamespacedRun, ready_to_shape, shape, task_env  # noqa: E402
from link import network, parse_link  # noqa: E402

DEFAULT_OUT = HERE / "results" / "elastic_chaos.json"
TOKENS_PER_PHASE = 25 * 8 * 128  # H x batch x sequence length


def one_run(net, args, workdir: Path, chaos: bool) -> dict:
    run = NamespacedRun(net, workdir, task_env(args.workers, args.rounds, ELASTIC_DATA="corpus"))
    rng = random.Random(args.seed)
    kills = []
    started = time.time()
    try:
        run.syncer("--heartbeat-timeout", "3", "--join-timeout", "600")
        for k in range(args.workers):
            run.worker(k)
        next_kill = None
        while run.procs["syncer"].poll() is None:
            time.sleep(0.2)
            if not chaos or not run.syncs():
                continue
            now = time.time()
            if next_kill is None:
                next_kill = now + args.every * rng.uniform(0.75, 1.25)
            elif now >= next_kill:
                k = rng.randrange(args.workers)
                run.procs[f"worker-{k}"].kill()
                run.procs[f"worker-{k}"].wait()
                kills.append({"worker": k, "time": now, "after_syncs": len(run.syncs())})
                run.worker(k)
                next_kill = now + args.every * rng.uniform(0.75, 1.25)
        codes = {}
        for name, proc in run.procs.items():  # every process must end by itself
            try:
                codes[name] = proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                codes[name] = "did not end within 120 s of the syncer"
    finally:
        run.close()
    syncs = run.syncs()
    t0 = syncs[0]["time"]
    for kill in kills:
        kill["at_s"] = round(kill.pop("time") - t0, 2)
    wall = syncs[-1]["time"] - t0
    phases = sum(len(s["included"]) for s in syncs[1:])
    return {
        "chaos": chaos,
        "rounds": len(syncs),
        "wall_s": round(time.time() - started, 1),
        "first_to_last_sync_s": round(wall, 1),
        "tokens_per_s": round(phases * TOKENS_PER_PHASE / wall, 1),
        "phases_included": phases,
        "kills": kills,
        "exit_codes": codes,
        "syncs": [
            {
                "round": s["round"],
                "time": round(s["time"] - t0, 2),
                "included": s["included"],
                "loss": s["loss"],
            }
            for s in syncs
        ],  # fmt: skip
    }


def _clean_run(args: argparse.Namespace) -> dict:
    """The fault-free run of --clean-from, if it was measured with these settings."""
    earlier = json.loads(args.clean_from.read_text())
    same = {"workers": args.workers, "link": args.link, "preset": "tiny", "inner_steps": 25}
    if any(earlier.get(k) != v for k, v in same.items()):
        raise SystemExit(f"elastic_chaos.py: {args.clean_from} was measured with other settings")
    run = next(r for r in earlier["runs"] if not r["chaos"])
    if run["rounds"] != args.rounds:
        raise SystemExit(f"elastic_chaos.py: {args.clean_from} has {run['rounds']} rounds")
    return run


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for run in result["runs"]:
        label = "chaos" if run["chaos"] else "no faults"
        syncs = run["syncs"]
        axes[0].plot([s["round"] for s in syncs], [s["loss"] for s in syncs], label=label)
        axes[1].plot([s["time"] / 60 for s in syncs], [s["loss"] for s in syncs], label=label)
        if run["chaos"]:
            for kill in run["kills"]:
                axes[1].axvline(kill["at_s"] / 60, color="0.8", lw=0.8)
    axes[0].set_xlabel("sync")
    axes[1].set_xlabel("minutes since the first sync (grey: a worker killed)")
    for ax in axes:
        ax.set_ylabel("mean inner train loss (nats/byte)")
        ax.legend()
    fig.suptitle(f"elastic DiLoCo, M = {result['workers']}, on {result['link']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=120)
    parser.add_argument("--link", default="10mbit:50ms")
    parser.add_argument("--every", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--clean-from", type=Path, default=None)
    args = parser.parse_args(argv)
    if not ready_to_shape("elastic_chaos.py"):
        return 2
    link = parse_link(args.link)
    started = time.time()
    runs = []
    with tempfile.TemporaryDirectory(prefix=f"djlink{os.getpid()}-") as tmp:
        tag = f"djlink{os.getpid()}"
        control = Path(tempfile.gettempdir()) / f"{tag}.sock"
        with network(tag, args.workers + 1, 1500, control) as net:
            netem = net.has_netem()
            shape(net, link, control, netem)
            for chaos in (False, True):
                if not chaos and args.clean_from is not None:
                    runs.append(_clean_run(args))
                    continue
                workdir = Path(tmp) / ("chaos" if chaos else "clean")
                workdir.mkdir()
                run = one_run(net, args, workdir, chaos)
                print(json.dumps({k: v for k, v in run.items() if k != "syncs"}), flush=True)
                runs.append(run)
    result = {
        "benchmark": "elastic_chaos",
        "command": "sudo .venv/bin/python benchmarks/elastic_chaos.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "workers": args.workers, "link": args.link, "every_s": args.every, "seed": args.seed,
        "preset": "tiny", "batch_size": 8, "inner_steps": 25,
        "delay_impl": "netem" if netem else "relay", "cpu_count": os.cpu_count(),
        "wall_seconds": round(time.time() - started, 1), "runs": runs,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.plot or args.out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
