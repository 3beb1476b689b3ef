"""The device path: a DiLoCo round with one worker per device, library against hand-written
`jit(shard_map(scan of H optax steps -> pmean of the deltas -> optax outer step))`.

Rows (each timed as the median of interleaved samples; a sample puts the round's host batch
on the devices and runs one round): the library's round jitted as `train_diloco` jits it
(`dj.jit_round`) on the "shard_map" backend and on a user mesh (`make_backend(mesh=...)`,
one worker per device), and `train_diloco` itself on each (per round in steady state, each
sample followed by hand-written rounds that are its baseline), against the hand-written
round; diagnostic rows run the hand-written round with each device's worker under a size-1
`jax.vmap` (as the backend ran it before) and the round with the whole state donated.
Workload: MLP 512-2048-512 (2.1M params), M = 2 workers on 2 fake CPU devices, H = 20 AdamW
steps, batch 32 per worker and step.

`--malloc mimalloc` reruns the script with mimalloc preloaded (the `cmeel-mimalloc` package of
the dev extra): XLA's CPU runtime allocates each execution's temporaries afresh, and glibc's
malloc hands large freed blocks back to the kernel, so with it every round faults its
temporaries in again (benchmarks/README.md). The header and the JSON say which malloc ran.

  python benchmarks/device_round.py [--reps N] [--steps H] [--malloc libc|mimalloc]
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
).strip()

import argparse  # noqa: E402
import functools  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import common  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import diloco_jax as dj  # noqa: E402

M, D, F, B = 2, 512, 2048, 32
H = 20  # inner steps (--steps)
TARGET = 1.10
REFERENCE = "hand-written shard_map"
DIAGNOSTICS = (
    "hand-written, unit vmap (diagnostic)",
    "diloco_round, whole state donated (diagnostic)",
)


def mlp_params() -> dict:
    rng = np.random.default_rng(0)
    return {
        "w1": jnp.asarray(rng.normal(size=(D, F)) * D**-0.5, jnp.float32),
        "b1": jnp.zeros(F, jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(F, D)) * F**-0.5, jnp.float32),
        "b2": jnp.zeros(D, jnp.float32),
    }


def mlp_loss(params, batch):
    hidden = jax.nn.relu(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean((hidden @ params["w2"] + params["b2"] - batch["y"]) ** 2)


def hand_written(mesh, inner, outer, unit_vmap: bool):
    """The reference round: per device, H optax steps under lax.scan, pmean of the deltas,
    the optax outer step; `unit_vmap`: the worker under a size-1 vmap (diagnostic)."""

    def worker(params, state, batches):
        def step(carry, batch):
            p, s = carry
            grads = jax.grad(mlp_loss)(p, batch)
            updates, s = inner.update(grads, s, p)
            return (optax.apply_updates(p, updates), s), None

        (p, s), _ = lax.scan(step, (params, state), batches)
        return jax.tree.map(jnp.subtract, params, p), s

    def body(params, outer_state, inner_state, batches):
        mine = jax.tree.map(lambda x: lax.pcast(x, "w", to="varying"), params)
        if unit_vmap:
            deltas, inner_state = jax.vmap(worker, in_axes=(None, 0, 0))(mine, inner_state, batches)
            delta = jax.tree.map(lambda x: x[0], deltas)
        else:
            first = lambda t: jax.tree.map(lambda x: x[0], t)  # noqa: E731
            delta, state = worker(mine, first(inner_state), first(batches))
            inner_state = jax.tree.map(lambda x: x[None], state)
        delta = jax.tree.map(lambda x: lax.pmean(x, "w"), delta)
        updates, outer_state = outer.update(delta, outer_state, params)
        return optax.apply_updates(params, updates), outer_state, inner_state

    mapped = jax.shard_map(
        body, mesh=mesh, in_specs=(P(), P(), P("w"), P("w")), out_specs=(P(), P(), P("w"))
    )
    return jax.jit(mapped, donate_argnums=(0, 1, 2))


def measure(reps: int, H: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """(seconds per round of each variant's samples, each variant's baseline samples: the
    hand-written round's, interleaved with it). Needs M devices."""
    params, inner, outer = mlp_params(), dj.default_inner_optimizer(), dj.default_outer_optimizer()
    rng = np.random.default_rng(1)
    host_batch = {
        "x": rng.normal(size=(M, H, B, D)).astype(np.float32),
        "y": rng.normal(size=(M, H, B, D)).astype(np.float32),
    }
    mesh = jax.make_mesh((M,), ("w",), axis_types=(AxisType.Auto,))
    shared, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("w"))
    user_mesh = jax.make_mesh((M,), ("workers",), axis_types=(AxisType.Auto,))

    def reference(unit_vmap):
        program = hand_written(mesh, inner, outer, unit_vmap)
        own = jax.tree.map(lambda x: np.array(x, copy=True), params)  # donated: its own
        carry = [
            jax.device_put(own, shared),
            jax.device_put(outer.init(own), shared),
            jax.device_put(dj.init_state(params, M).inner_opt_state, split),
        ]

        def run():
            batches = jax.device_put(host_batch, split)
            carry[:] = program(*carry, batches)
            common.block(carry)

        return run

    def library(backend, donate_all=False):
        from diloco_jax.loop import place_state

        program = dj.jit_round(mlp_loss, backend=backend)
        if donate_all:  # the restore's fields donated too: XLA copies them for the round
            program = jax.jit(
                functools.partial(dj.diloco_round, mlp_loss, backend=backend), donate_argnums=0
            )
        state = [place_state(dj.init_state(params, M), backend)]

        def run():
            state[0], metrics = program(state[0], backend.place_batches(host_batch, 2))
            common.block((state[0], metrics))

        return run

    def trainer(**placement):
        def run_rounds(count):
            marks = []
            dj.train_diloco(
                mlp_loss, params, [host_batch] * count, num_rounds=count, num_workers=M,
                inner_steps=H, callback=lambda entry: marks.append(time.perf_counter()),
                **placement,
            )  # fmt: skip
            return (marks[-1] - marks[0]) / (count - 1)

        return run_rounds

    variants = {
        REFERENCE: reference(False),
        "library jit_round, shard_map": library(dj.make_backend("shard_map", M)),
        "library jit_round, mesh": library(dj.make_backend("auto", M, mesh=user_mesh)),
        "hand-written, unit vmap (diagnostic)": reference(True),
        "diloco_round, whole state donated (diagnostic)": library(
            dj.make_backend("shard_map", M), donate_all=True
        ),
    }
    for run in variants.values():  # compile and warm up
        run()
        run()
    times = {name: [] for name in variants}
    for rep in range(reps):
        order = list(variants) if rep % 2 == 0 else list(reversed(variants))
        for name in order:
            start = time.perf_counter()
            variants[name]()
            times[name].append(time.perf_counter() - start)
    loops = {
        "train_diloco, shard_map (per round)": trainer(backend="shard_map"),
        "train_diloco, mesh (per round)": trainer(mesh=user_mesh),
    }
    # Each loop's sample is followed by hand-written rounds, its own baseline: the loops run
    # after the interleaved samples above, when the machine may have drifted.
    bases = {name: times[REFERENCE] for name in variants}
    reference_round = variants[REFERENCE]
    for name, run_rounds in loops.items():
        run_rounds(3)  # compile
        times[name], bases[name] = [], []
        for _ in range(reps):
            times[name].append(run_rounds(4))
            for _ in range(3):
                start = time.perf_counter()
                reference_round()
                bases[name].append(time.perf_counter() - start)
    return times, bases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7, help="timed samples per variant")
    parser.add_argument("--steps", type=int, default=H, help="inner steps H")
    parser.add_argument("--malloc", choices=["libc", "mimalloc"], default="libc")
    args = parser.parse_args()
    if args.malloc == "mimalloc" and common.allocator() != "mimalloc":
        library = common.mimalloc_library()
        if library is None:
            parser.error("--malloc mimalloc needs the cmeel-mimalloc package (pip install it)")
        preload = ":".join(filter(None, [str(library), os.environ.get("LD_PRELOAD")]))
        env = {**os.environ, "LD_PRELOAD": preload}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    print(common.header() + "\n")
    times, bases = measure(args.reps, args.steps)
    rows = []
    print(f"{'variant':<48} {'median s':>9} {'min s':>7} {'ratio':>6}")
    for name, ts in times.items():
        ratio = statistics.median(ts) / statistics.median(bases[name])
        rows.append({"variant": name, "median_s": statistics.median(ts), "min_s": min(ts),
                     "baseline_median_s": statistics.median(bases[name]),
                     "ratio": ratio})  # fmt: skip
        print(f"{name:<48} {statistics.median(ts):>9.3f} {min(ts):>7.3f} {ratio:>6.2f}")
    print(f"\ntarget: library rows within {TARGET:.2f}x of hand-written")
    payload = {"inner_steps": args.steps, "reps": args.reps, "rows": rows, "target": TARGET,
               "allocator": common.allocator()}  # fmt: skip
    print(f"wrote {common.write_results('device_round', payload)}")


if __name__ == "__main__":
    main()
