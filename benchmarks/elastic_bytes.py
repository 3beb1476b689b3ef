"""The bytes an elastic run puts on the wire with each compression, counted by the kernel
(docs/faults.md, "Measured: the bytes on the wire"; benchmarks/README.md).

Each run (`python -m diloco_jax.elastic run` on benchmarks/elastic_sync.py's task: a θ of
`--mb` MB, H = 1, M = `--workers`) runs in a network namespace of its own, so its loopback
device carries that run's traffic alone: the syncer's gRPC calls, θ or a sync's reply to each
worker, each worker's push, headers and TCP included. The figure is the loopback's
transmitted bytes over the run, per round, and its ratio to the uncompressed run's. The
workers' θ_0 is the task's own, so no round sends θ whole here: a worker gets the encoded
mean of each sync (the dense kinds' two-stage reply) or, uncompressed, θ.

    sudo .venv/bin/python benchmarks/elastic_bytes.py [--mb 16] [--workers 2] [--rounds 8]
        [--compressions none,int8,int4]

Error feedback is on for the lossy kinds (`KIND,ef=1`). Writes
benchmarks/results/elastic_bytes.json; needs root (`ip netns`).
"""

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_OUT = HERE / "results" / "elastic_bytes.json"
SBIN = ("/usr/sbin", "/sbin", "/usr/local/sbin")


def _ip() -> str:
    found = shutil.which("ip") or shutil.which("ip", path=os.pathsep.join(SBIN))
    if found is None:
        raise SystemExit("elastic_bytes.py needs the `ip` tool (iproute2)")
    return found


def _lo_bytes(ip: str, namespace: str) -> int:
    """The loopback's transmitted bytes in `namespace`."""
    shown = subprocess.run([ip, "-n", namespace, "-s", "-j", "link", "show", "lo"],
                           capture_output=True, text=True, check=True)  # fmt: skip
    return int(json.loads(shown.stdout)[0]["stats64"]["tx"]["bytes"])


def run_bytes(args: argparse.Namespace, compression: str, workdir: Path) -> dict:
    """One run in a namespace of its own: its bytes per round and seconds per sync."""
    ip, namespace = _ip(), f"djbytes{os.getpid()}"
    spec = "none" if compression == "none" else f"{compression},ef=1"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE)]),
               XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu",
               ELASTIC_SYNC_MB=str(args.mb), ELASTIC_WORKERS=str(args.workers),
               ELASTIC_ROUNDS=str(args.rounds), ELASTIC_SYNC_COMPRESSION=spec)  # fmt: skip
    out = workdir / compression
    argv = [sys.executable, "-m", "diloco_jax.elastic", "run", "--task", "elastic_sync:make_task",
            "--out", str(out), "--heartbeat-timeout", "60"]  # fmt: skip
    subprocess.run([ip, "netns", "add", namespace], check=True)
    try:
        subprocess.run([ip, "-n", namespace, "link", "set", "lo", "up"], check=True)
        before = _lo_bytes(ip, namespace)
        done = subprocess.run([ip, "netns", "exec", namespace, *argv], env=env,
                              capture_output=True, text=True, timeout=1800)  # fmt: skip
        sent = _lo_bytes(ip, namespace) - before
    finally:
        subprocess.run([ip, "netns", "del", namespace], check=False)
    if done.returncode:
        raise SystemExit(
            f"the {compression} run failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )
    times = [json.loads(x)["time"] for x in (out / "syncer" / "history.jsonl").open()]
    gaps = sorted(b - a for a, b in zip(times[2:], times[3:], strict=False))
    return {
        "compression": spec,
        "bytes": sent,
        "bytes_per_round": round(sent / args.rounds),
        "sync_seconds": round(gaps[len(gaps) // 2], 4) if gaps else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=16.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--compressions", default="none,int8,int4")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    kinds = args.compressions.split(",")
    if kinds[0] != "none":
        raise SystemExit("--compressions must start with none (the ratios' reference)")
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run_bytes(args, kind, Path(tmp)) for kind in kinds]
    for row in rows:
        row["over_none"] = round(row["bytes"] / rows[0]["bytes"], 4)
    result = {
        "command": "sudo .venv/bin/python benchmarks/elastic_bytes.py "
        f"--mb {args.mb:g} --workers {args.workers} --rounds {args.rounds} "
        f"--compressions {args.compressions}",
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "theta_mb": args.mb,
        "workers": args.workers,
        "rounds": args.rounds,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print("| compression | bytes a round | of uncompressed | s a sync |\n|---|---|---|---|")
    for row in rows:
        print(f"| {row['compression']} | {row['bytes_per_round'] / 1e6:.2f} MB | "
              f"{row['over_none']:.3f}x | {row['sync_seconds']} |")  # fmt: skip
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
