"""Simulated network time: DiLoCo against synchronous data parallelism on slower networks,
fed by step times measured here (one worker, steady state) and the wire bytes each worker
sends per sync (`diloco_jax.comm`: every collective costed by its kind, ring algorithms).

    python benchmarks/network.py [--quick] [--workers 8] [--latency-ms 1] [--presets a,b]
        [--dtype float32|bfloat16] [--batch-size 16]

For each LM preset and each H, prints the wall time of 1000 steps per worker and the compute
utilization at 100 Gbit/s, 10 Gbit/s, 1 Gbit/s and 100 Mbit/s (no overlap:
diloco_jax.netsim), and the bandwidth each needs for 90% utilization (as in Charles et al.
2025, Table 6). Writes benchmarks/results/network.json.
"""

import argparse
import json
import time
from pathlib import Path

import common
import jax
import numpy as np
import optax

from diloco_jax import netsim
from diloco_jax.comm import round_wire_bytes, sync_step_wire_bytes
from diloco_jax.lm import model
from diloco_jax.train import train_sync

RESULTS = Path(__file__).parent / "results"


def step_seconds(preset: str, batch_size: int, steps: int, dtype: str = "float32") -> float:
    """Median steady-state seconds per step of one worker training `preset` (in-graph data)."""
    w = common.lm_workload(preset, batch_size, dtype)
    times = []
    train_sync(
        w.loss_fn,
        w.params,
        w.sampler(1),
        num_steps=steps,
        num_workers=1,
        optimizer=optax.adamw(1e-3),
        backend="vmap",
        callback=lambda _: times.append(time.perf_counter()),
    )
    return float(np.median(np.diff(times[1:])))  # the first step includes compilation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--latency-ms", type=float, default=1.0)
    parser.add_argument("--presets", default=None, help="comma-separated LM presets")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    if args.presets:
        presets = args.presets.split(",")
    else:
        presets = ["micro", "mini"] if args.quick else ["micro", "mini", "tiny"]
    print(common.header() + "\n")
    steps = 20 if args.quick else 60
    total = 1000
    rows = []
    for preset in presets:
        t_step = step_seconds(preset, args.batch_size, steps, args.dtype)
        common.progress(f"{preset}: {t_step * 1e3:.3f} ms per step")
        config = model.get_config(preset, dtype=args.dtype)
        params = jax.eval_shape(model.init_params, config, jax.random.key(0))
        wire = round_wire_bytes(params, None, args.workers)
        runs = {"sync_data_parallel": (1, sync_step_wire_bytes(params, args.workers))}
        runs |= {f"diloco_H{h}": (h, wire) for h in (25, 100, 500)}
        table = netsim.network_table(t_step, runs, total, latency=args.latency_ms / 1e3)
        table["num_workers"] = args.workers
        rows.append(
            {"preset": preset, "num_params": model.count_params(params), "wire": wire, **table}
        )
    lines = []
    for row in rows:
        lines += [
            f"### {row['preset']} ({args.dtype}, B={args.batch_size}): "
            f"{row['num_params']:,} params, {row['wire']:,.0f} wire bytes per DiLoCo sync, "
            f"step {row['step_seconds'] * 1e3:.2f} ms, M={args.workers}, "
            f"latency {args.latency_ms:g} ms, {total} steps per worker",
            "",
            "| run | " + " | ".join(netsim.BANDWIDTHS) + " | bandwidth for 90% |",
            "| --- | " + " | ".join("---:" for _ in netsim.BANDWIDTHS) + " | ---: |",
        ]
        for name, r in row["runs"].items():
            cells = [
                f"{r[b]['wall_seconds']:.3g} s ({r[b]['utilization']:.0%})"
                for b in netsim.BANDWIDTHS
            ]
            bw = netsim.format_bandwidth(r["bandwidth_for_90pct_bit_s"])
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {bw} |")
        lines.append("")
    print("\n".join(lines))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "network.json").write_text(
        json.dumps(
            {
                "rows": rows,
                "dtype": args.dtype,
                "batch_size": args.batch_size,
                "environment": common.environment(),
            },
            indent=2,
            default=float,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
