"""Per-device memory of one compiled DiLoCo round on a user's mesh, compile only.

For each LM preset, M = 2 workers on 8 fake CPU devices, the default method (AdamW inner
steps, Nesterov outer, non-finite exclusion), the round is lowered from shapes alone (no
array is ever allocated) and compiled as `train_diloco` jits it on a GPU or TPU (the whole
state donated; on CPU it keeps the restored fields, `diloco_jax.donation`);
`compiled.memory_analysis()` of the partitioned program gives each device's bytes:
arguments (the state and the batch it holds), outputs, temporaries (activations, gradients,
the deltas) and the total. Layouts:

- replicated: a (workers=2, 4) mesh, every param whole on each of a worker's 4 devices, the
  batch split over them (the `data_parallel=4` layout);
- fsdp=4: a (workers=2, fsdp=4) mesh, each param split by `model.param_specs` over fsdp;
- fsdp=4 + ZeRO-1: the same, the outer state split over the workers too
  (`shard_outer_over_workers=True`);
- fsdp=4 + pinned_host: fsdp=4 with θ and the outer state in pinned host memory
  (`outer_state_memory="pinned_host"`). XLA's CPU compiler has one memory for both kinds and
  counts host buffers as device bytes, so this row subtracts the θ and outer-state shards
  the placement puts in host memory ("host GB", once: the donated outputs reuse the
  arguments' buffers) from args and total;
- fsdp=4 + ZeRO-1 + pinned_host: both, the outer state's shards over the workers in host
  memory.

"wire MB/dev" is what each device sends to the other workers in the round: the ring bytes of
the compiled program's cross-worker collectives (`hlo.cross_worker_wire_bytes`).
`--compression SPEC` runs every layout with that codec (each device encoding its own shards;
the ZeRO-1 layouts, which refuse compression, are left out). `--no-exclusion` turns the
non-finite exclusion off: no round-start copy of the inner state is kept for a non-finite
worker's restore (what that copy costs in temporaries).

`--target h200` compiles the same rounds for 8 NVIDIA H200s (one host) with XLA's GPU
compiler, ahead of time and without a GPU (`common.target_devices`; it needs JAX's CUDA
plugin installed). That compile drops the `pinned_host` memory kind, so its table leaves the
host-memory layouts out; without a GPU present the model picks its CPU kernels (XLA
attention, a gather embedding). The model options of `diloco_jax.lm.model.ModelConfig`
apply to every layout: `--dtype bfloat16` (compute dtype; params, gradients and state stay
float32), `--remat`, `--shard-activations`. The default target, `cpu`, gives XLA CPU's
figures: the same arguments and outputs, other temporaries.

  python benchmarks/mesh_memory.py [--presets 150m,400m,1b] [--batch B] [--seq L] [--steps H]
      [--compression int8] [--no-exclusion] [--target cpu|h200] [--dtype bfloat16]
      [--remat] [--shard-activations]
"""

import os
import sys

if "h200" in sys.argv:
    # Without a GPU the CUDA plugin's driver check would fail (and stop the plugin loading);
    # nothing runs on the device, XLA only compiles for it.
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import argparse  # noqa: E402
import functools  # noqa: E402
import time  # noqa: E402

import common  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import diloco_jax as dj  # noqa: E402
from diloco_jax import hlo, offload  # noqa: E402
from diloco_jax import placement as placement_lib  # noqa: E402
from diloco_jax.lm import model  # noqa: E402

M = 2
H200_BYTES = 141e9
LAYOUTS = (
    "replicated",
    "fsdp=4",
    "fsdp=4 + ZeRO-1 over workers",
    "fsdp=4 + pinned_host",
    "fsdp=4 + ZeRO-1 + pinned_host",
)


def round_memory(
    preset: str,
    layout: str,
    batch: int,
    seq: int,
    steps: int,
    compression: str = "none",
    exclusion: bool = True,
    target: str = "cpu",
    **model_options,
) -> dict:
    """memory_stats of the compiled round of `preset` (with `model_options`, ModelConfig
    fields) under `layout` (with `compression`; without the non-finite exclusion if not
    `exclusion`) compiled for `target`'s devices, its cross-worker wire bytes per device
    (from the HLO), and the compile's wall seconds."""
    config = model.get_config(preset, **model_options)
    # One axis name for both layouts ("replicated" only leaves the params whole on it): the
    # model's logical axes (`model.LOGICAL_RULES`) name it.
    axis = "fsdp"
    devices = np.array(common.target_devices(target, M * 4)).reshape(M, 4)
    mesh = jax.sharding.Mesh(devices, ("workers", axis), axis_types=(AxisType.Auto,) * 2)
    backend = dj.make_backend("auto", M, mesh=mesh)
    shapes = jax.eval_shape(model.init_params, config, jax.random.key(0))
    shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), shapes)
    if layout.startswith("fsdp=4"):
        specs = model.param_specs(config, shapes, {"fsdp": 4})
    else:
        specs = lambda path, leaf: P()  # noqa: E731
    placed = placement_lib.placement(
        shapes,
        backend.mesh,
        placement_lib.resolve_param_specs(shapes, backend.mesh, specs),
        split_outer="ZeRO" in layout,
        host="pinned_host" in layout,
    )
    method = dj.DiLoCo(compression=compression, weights=dj.Weights(exclude_nonfinite=exclusion))
    state = jax.eval_shape(lambda p: dj.init_state(p, M, method), shapes)
    shardings = placed.shardings(state)
    state = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), state, shardings
    )
    tokens = NamedSharding(backend.mesh, P("workers", None, axis))
    batches = {
        k: jax.ShapeDtypeStruct((M, steps, batch, seq), jnp.int32, sharding=tokens)
        for k in ("inputs", "targets")
    }
    loss_fn = model.make_loss_fn(config)
    memory = offload.HOST if placed.host else "device"
    fn = functools.partial(
        dj.diloco_round, loss_fn, method=method, backend=backend, outer_shards=placed.outer,
        outer_state_memory=memory, param_specs=placed.specs,
    )  # fmt: skip
    start = time.perf_counter()
    # Donating the state, as train_diloco's round does: the new state reuses its buffers.
    round_fn = jax.jit(fn, out_shardings=(shardings, None), donate_argnums=0)
    compiled = round_fn.lower(state, batches).compile()
    stats = common.memory_stats(compiled)
    host = sum(
        int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
        for name in type(state).HOST if placed.host
        for x in jax.tree.leaves(getattr(state, name))
    )  # fmt: skip
    stats["host_bytes"] = host
    if target == "cpu":  # one memory for both kinds: the host arguments counted as device's
        stats["argument_size_in_bytes"] -= host
        stats["total"] -= host
    stats["wire_bytes_per_device"] = hlo.cross_worker_wire_bytes(compiled, M, mesh.devices.size)
    stats["compile_s"] = time.perf_counter() - start
    stats["params"] = model.count_params(shapes)
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="150m,400m,1b")
    parser.add_argument("--batch", type=int, default=8, help="sequences per worker and step")
    parser.add_argument("--seq", type=int, default=1024, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=2, help="inner steps H (a lax.scan)")
    parser.add_argument(
        "--compression", default="none", help="a codec spec (the ZeRO-1 rows are left out)"
    )
    parser.add_argument(
        "--no-exclusion",
        action="store_true",
        help="exclude_nonfinite=False: no round-start copy of the inner state to restore",
    )
    parser.add_argument(
        "--target",
        choices=common.TARGETS,
        default="cpu",
        help="compile for 8 fake CPU devices or 8 H200s (without a GPU)",
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="the model's compute dtype (params and state stay float32)",
    )
    parser.add_argument("--remat", action="store_true", help="ModelConfig.remat")
    parser.add_argument("--shard-activations", action="store_true",
                        help="ModelConfig.shard_activations")  # fmt: skip
    args = parser.parse_args()
    model_options = {"dtype": args.dtype, "remat": args.remat,
                     "shard_activations": args.shard_activations}  # fmt: skip
    print(common.header() + "\n")
    print(f"target {args.target}, model options {model_options}\n")
    rows = []
    head = (
        f"{'preset':<7} {'layout':<30} {'args GB':>8} {'host GB':>8} {'temp GB':>8} {'total GB':>9}"
    )
    print(head + f" {'of H200':>8} {'vs repl.':>8} {'wire MB/dev':>11} {'vs repl.':>8}")
    for preset in args.presets.split(","):
        replicated = wire = None
        for layout in LAYOUTS:
            if "ZeRO" in layout and args.compression != "none":
                continue  # the split outer state runs without compression
            if "pinned_host" in layout and args.target != "cpu":
                # The deviceless GPU compile drops the memory kind (no S(5) buffer in its
                # program, no host bytes in its analysis): these rows would be fsdp=4's.
                continue
            s = round_memory(
                preset, layout, args.batch, args.seq, args.steps, args.compression,
                exclusion=not args.no_exclusion, target=args.target, **model_options,
            )  # fmt: skip
            replicated = replicated or s["total"]
            wire = wire or s["wire_bytes_per_device"]
            row = {"preset": preset, "layout": layout, **s,
                   "fraction_of_h200": s["total"] / H200_BYTES,
                   "vs_replicated": s["total"] / replicated,
                   "wire_vs_replicated": s["wire_bytes_per_device"] / wire}  # fmt: skip
            rows.append(row)
            print(
                f"{preset:<7} {layout:<30} {s['argument_size_in_bytes'] / 1e9:>8.2f} "
                f"{s['host_bytes'] / 1e9:>8.2f} "
                f"{s['temp_size_in_bytes'] / 1e9:>8.2f} {s['total'] / 1e9:>9.2f} "
                f"{row['fraction_of_h200']:>8.2f} {row['vs_replicated']:>8.3f} "
                f"{s['wire_bytes_per_device'] / 1e6:>11.2f} {row['wire_vs_replicated']:>8.2f}",
                flush=True,
            )
    payload = {"batch": args.batch, "seq": args.seq, "inner_steps": args.steps,
               "compression": args.compression, "exclusion": not args.no_exclusion,
               "target": args.target, "model_options": model_options,
               "rows": rows}  # fmt: skip
    name = "mesh_memory" if args.target == "cpu" else f"mesh_memory_{args.target}"
    print(f"\nwrote {common.write_results(name, payload)}")


if __name__ == "__main__":
    main()
