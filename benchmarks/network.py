"""Simulated network time: DiLoCo against synchronous data parallelism on slower networks,
fed by step times measured here (one worker, steady state) and the real payload size.

    python benchmarks/network.py [--quick] [--workers 8] [--latency-ms 1]

For each LM preset and each H, prints the wall time of 1000 steps per worker and the compute
utilization at 100 Gbit/s, 10 Gbit/s, 1 Gbit/s and 100 Mbit/s (ring all-reduce, no overlap:
diloco_jax.netsim), and the bandwidth each needs for 90% utilization (as in Charles et al.
2025, Table 6). Writes benchmarks/results/network.json.
"""

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from diloco_jax import model, netsim
from diloco_jax.comm import round_bytes
from diloco_jax.sampler import Sampler
from diloco_jax.train import train_sync

RESULTS = Path(__file__).parent / "results"


def step_seconds(preset: str, batch_size: int, steps: int) -> float:
    """Median steady-state seconds per step of one worker training `preset` (in-graph data)."""
    cfg = model.get_config(preset)
    params = model.init_params(cfg, jax.random.key(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, 1 << 16, dtype=np.int32))

    def sample(arrays, r, m, h):
        key = jax.random.fold_in(jax.random.fold_in(arrays["key"], r), m)
        start = jax.random.randint(key, (batch_size,), 0, tokens.shape[0] - cfg.seq_len - 1)
        windows = jax.vmap(lambda s: jax.lax.dynamic_slice(arrays["t"], (s,), (cfg.seq_len + 1,)))
        w = windows(start)
        return {"inputs": w[:, :-1], "targets": w[:, 1:]}

    sampler = Sampler({"t": tokens, "key": jax.random.key(1)}, sample)
    times = []
    train_sync(
        model.make_loss_fn(cfg),
        params,
        sampler,
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
    args = parser.parse_args()
    presets = ["micro", "mini"] if args.quick else ["micro", "mini", "tiny"]
    steps = 20 if args.quick else 60
    total = 1000
    rows = []
    for preset in presets:
        t_step = step_seconds(preset, 16, steps)
        params = jax.eval_shape(model.init_params, model.get_config(preset), jax.random.key(0))
        payload = round_bytes(params)
        runs = {"sync_data_parallel": 1} | {f"diloco_H{h}": h for h in (25, 100, 500)}
        table = netsim.network_table(
            t_step, payload, args.workers, runs, total, latency=args.latency_ms / 1e3
        )
        rows.append({"preset": preset, "num_params": model.count_params(params), **table})
    lines = []
    for row in rows:
        lines += [
            f"### {row['preset']}: {row['num_params']:,} params, {row['payload_bytes']:,} bytes "
            f"per all-reduce, step {row['step_seconds'] * 1e3:.2f} ms, M={args.workers}, "
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
            {"rows": rows, "jax": jax.__version__, "device": jax.devices()[0].device_kind},
            indent=2,
            default=float,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
