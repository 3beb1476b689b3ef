"""Wire bytes per device of one DiLoCo round, read from the compiled program, for every codec
and worker count (fake CPU devices, one worker per device).

    python benchmarks/wire_bytes.py [--workers 2,4,8,16,32] [--fragments P]

The model is the issue's linear layer, |θ| = 256 x 64 + 64 float32 (65.8 KB). For each
compression and M, the round is compiled with `backend="shard_map"` on M devices and every
collective of its optimized HLO is costed under ring algorithms (`hlo.wire_bytes`: all-reduce
2(M-1)/M, all-gather (M-1), all-to-all (M-1)/M x its per-device operand). The table shows
those bytes, their ratio to the exact round's, and the ratio of `comm.round_wire_bytes` (the
formula history's "wire_bytes" uses) to them. Writes benchmarks/results/wire_bytes.json.
"""

import argparse
import functools
import json
import os
from pathlib import Path

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=32"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import common  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import diloco_jax as dj  # noqa: E402
from diloco_jax import comm, hlo  # noqa: E402

RESULTS = Path(__file__).parent / "results"
SPECS = ("none", "bf16", "fp8", "int8", "int4", "e3m0", "topk:0.01", "sign_prune:0.5", "sparseloco")
PARAMS = {"w": jnp.zeros((256, 64), jnp.float32), "b": jnp.zeros((64,), jnp.float32)}


def _loss(params, batch):
    return 0.5 * jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)


def compiled_wire_bytes(num_workers: int, spec: str, fragments: int | None) -> float:
    inner, outer = optax.sgd(0.1), dj.default_outer_optimizer()
    state = dj.init_state(
        PARAMS,
        num_workers,
        inner_optimizer=inner,
        outer_optimizer=outer,
        compression=spec,
        fragments=fragments,
    )
    batch = {"x": jnp.ones((num_workers, 2, 2, 256)), "y": jnp.ones((num_workers, 2, 2, 64))}
    round_fn = functools.partial(
        dj.diloco_round,
        _loss,
        inner_optimizer=inner,
        outer_optimizer=outer,
        backend=dj.make_backend("shard_map", num_workers),
        compression=spec,
        fragments=fragments,
    )
    return hlo.wire_bytes(jax.jit(round_fn).lower(state, batch).compile())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="2,4,8,16,32")
    parser.add_argument("--fragments", type=int, default=None)
    args = parser.parse_args()
    counts = [int(m) for m in args.workers.split(",")]
    print(common.header() + "\n")
    rows = []
    for m in counts:
        exact = None
        for spec in SPECS:
            got = compiled_wire_bytes(m, spec, args.fragments)
            exact = got if spec == "none" else exact
            formula = comm.round_wire_bytes(PARAMS, spec, m, fragments=args.fragments)
            rows.append(
                {"workers": m, "compression": spec, "wire_bytes": got, "formula": formula}
                | {"vs_exact": got / exact}
            )
            common.progress(f"M={m} {spec}: {got:,.0f} bytes ({got / exact:.3f}x exact)")
    fragments = f", fragments={args.fragments}" if args.fragments else ""
    lines = [
        f"Per-device wire bytes of one round (|θ| = 256 x 64 + 64 float32{fragments}), "
        "from the compiled HLO; (x exact); formula / compiled",
        "",
        "| M | " + " | ".join(SPECS) + " |",
        "| ---: | " + " | ".join("---:" for _ in SPECS) + " |",
    ]
    for m in counts:
        cells = []
        for row in (r for r in rows if r["workers"] == m):
            cells.append(
                f"{row['wire_bytes'] / 1e3:,.1f} KB ({row['vs_exact']:.2f}x)"
                + ("" if abs(row["formula"] / row["wire_bytes"] - 1) < 1e-9 else " (!)")
            )
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    exact_match = all(abs(r["formula"] / r["wire_bytes"] - 1) < 1e-9 for r in rows)
    lines += ["", f"formula = compiled for every cell: {exact_match}"]
    print("\n".join(lines))
    RESULTS.mkdir(exist_ok=True)
    name = "wire_bytes.json" if not args.fragments else f"wire_bytes_p{args.fragments}.json"
    (RESULTS / name).write_text(
        json.dumps({"rows": rows, "environment": common.environment()}, indent=2) + "\n"
    )


if __name__ == "__main__":
    main()
