"""All workers on one device: `backend="vmap"` (the workers batched) against
`backend="sequential"` (one after another, `lax.map`), vmap with the inner steps unrolled
(`unroll_inner_steps=True`), and `train_sync`'s step at the same inner steps.

Workloads: the CNN of Flax's NNX MNIST tutorial (docs/your-model.md: two 3x3 convolutions,
BatchNorm, dropout, 28x28 inputs; batch 32 per worker and step) and the LM transformer presets
of `diloco_jax.lm.model`. Each row runs M workers for H inner steps (one round, `dj.jit_round`,
the state donated as `train_diloco` runs it) and, for the same M x H worker-steps, H steps of
`train_sync`'s step over M workers; samples interleave (A B C, C B A, ...) and the table gives
the median seconds per round and the ratios. The ratios, not the seconds, carry over between
machines. Last, why a CNN's round lags `train_sync` on CPU: a convolution's steps as one
program each against the same steps in one `lax.scan`, as a round runs its inner steps.

  python benchmarks/worker_map.py [--workers M] [--steps H] [--reps N] [--lm tiny,small]
"""

import argparse
import functools
import statistics
from functools import partial

import common
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax

import diloco_jax as dj
from diloco_jax import sync
from diloco_jax.datasets import load_digits


class CNN(nnx.Module):
    """The CNN of Flax's NNX MNIST tutorial, as docs/your-model.md writes it."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm1 = nnx.BatchNorm(32, rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=0.025)
        self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm2 = nnx.BatchNorm(64, rngs=rngs)
        self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(3136, 256, rngs=rngs)
        self.dropout2 = nnx.Dropout(rate=0.025)
        self.linear2 = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x, rngs: nnx.Rngs | None = None):
        x = self.dropout1(self.conv1(x), rngs=rngs)
        x = self.avg_pool(nnx.relu(self.batch_norm1(x)))
        x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
        x = x.reshape(x.shape[0], -1)
        x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
        return self.linear2(x)


def cnn_case(num_workers: int, inner_steps: int, batch: int = 32) -> dict:
    """The tutorial CNN's round pieces: params, model state, loss, and one round's batches."""
    fns = dj.nnx_model_fns(CNN(rngs=nnx.Rngs(0)))

    def loss_fn(params, model_state, batch, key):
        logits, model_state = fns.apply(params, model_state, batch["image"], rng=key)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        return loss, model_state

    images, labels = load_digits()
    images = np.pad(images.repeat(3, axis=1).repeat(3, axis=2), ((0, 0), (2, 2), (2, 2), (0, 0)))
    data = {"image": images, "label": labels}
    rounds = dj.worker_rounds(data, num_workers, inner_steps, batch, num_rounds=1)
    return {
        "name": "tutorial CNN",
        "loss_fn": loss_fn,
        "params": fns.params,
        "model_state": fns.model_state,
        "batches": jax.tree.map(jnp.asarray, rounds[0]),
        "rng_seed": 0,
    }


def lm_case(preset: str, num_workers: int, inner_steps: int, batch: int) -> dict:
    workload = common.lm_workload(preset, batch)
    return {
        "name": f"LM {preset}",
        "loss_fn": workload.loss_fn,
        "params": workload.params,
        "model_state": None,
        "batches": workload.host_batches((num_workers, inner_steps)),
        "rng_seed": None,
    }


def round_runner(case: dict, backend: str, num_workers: int, unroll: bool = False):
    """A callable running one round of `case` on `backend` (state donated, rebuilt each
    time from a kept copy so every sample starts alike); `unroll`: its inner steps unrolled
    (`unroll_inner_steps=True`)."""
    optimizer = optax.adamw(1e-3)
    method = dj.DiLoCo(inner=optimizer)
    options = {"backend": backend, "unroll_inner_steps": unroll}
    if case["rng_seed"] is not None:
        options["rng_seed"] = case["rng_seed"]
    step = dj.jit_round(case["loss_fn"], method, **options)
    state = dj.init_state(case["params"], num_workers, method, model_state=case["model_state"])
    kept = jax.tree.map(jnp.copy, state)
    batches = case["batches"]

    def run():
        fresh = jax.tree.map(jnp.copy, kept)
        return step(fresh, batches)

    return run


def sync_runner(case: dict, num_workers: int, inner_steps: int):
    """H data-parallel steps of `train_sync` over the same M x H worker-batches."""
    optimizer = optax.adamw(1e-3)
    options = {"optimizer": optimizer, "backend": "vmap", "num_workers": num_workers}
    if case["rng_seed"] is not None:
        options["rng_seed"] = case["rng_seed"]
    step = jax.jit(functools.partial(sync.sync_step, case["loss_fn"], **options))
    state = sync.init_sync_state(case["params"], optimizer, case["model_state"], num_workers)
    steps = [jax.tree.map(lambda x, h=h: x[:, h], case["batches"]) for h in range(inner_steps)]

    def run():
        s = state
        for batch in steps:
            s, metrics = step(s, batch)
        return s, metrics

    return run


def measure(case: dict, num_workers: int, inner_steps: int, reps: int) -> dict:
    runs = {
        "vmap": round_runner(case, "vmap", num_workers),
        "sequential": round_runner(case, "sequential", num_workers),
        "vmap_unrolled": round_runner(case, "vmap", num_workers, unroll=True),
        "train_sync": sync_runner(case, num_workers, inner_steps),
    }
    for name, run in runs.items():  # compile, and one warm run
        common.progress(f"{case['name']}: compiling {name}")
        common.time_once(run)
    times = common.interleaved(runs, reps)
    row = {"workload": case["name"], "workers": num_workers, "inner_steps": inner_steps}
    for name, seconds in times.items():
        row[f"{name}_s"] = statistics.median(seconds)
    row["vmap_over_sequential"] = common.median_ratio(times["vmap"], times["sequential"])
    row["vmap_over_sync"] = common.median_ratio(times["vmap"], times["train_sync"])
    row["sequential_over_sync"] = common.median_ratio(times["sequential"], times["train_sync"])
    row["unrolled_over_sync"] = common.median_ratio(times["vmap_unrolled"], times["train_sync"])
    return row


def conv_in_loop(reps: int, steps: int = 4) -> dict:
    """Why the CNN lags `train_sync`: `steps` SGD steps of a two-convolution model (the
    tutorial's convolutions, batch 32, 28x28) as one jitted program per step against the same
    steps in one program under `lax.scan`, as a round runs its inner steps."""
    key = jax.random.key(0)
    weights = (
        jax.random.normal(key, (3, 3, 1, 32)) * 0.1,
        jax.random.normal(key, (3, 3, 32, 64)) * 0.05,
    )
    images_SxBxHxWxC = jax.random.normal(key, (steps, 32, 28, 28, 1))
    conv = partial(
        jax.lax.conv_general_dilated,
        window_strides=(1, 1),
        padding="SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
    )

    def loss(w, x):
        return jnp.mean(conv(jax.nn.relu(conv(x, w[0])), w[1]) ** 2)

    def sgd_step(w, x):
        return jax.tree.map(lambda p, g: p - 0.01 * g, w, jax.grad(loss)(w, x)), None

    one_step = jax.jit(lambda w, x: sgd_step(w, x)[0])
    scanned = jax.jit(lambda w, xs: lax.scan(sgd_step, w, xs)[0])

    def per_step():
        w = weights
        for x in images_SxBxHxWxC:
            w = one_step(w, x)
        return w

    runs = {"per_step": per_step, "scan": lambda: scanned(weights, images_SxBxHxWxC)}
    for run in runs.values():
        common.time_once(run)
    times = common.interleaved(runs, reps)
    return {
        "steps": steps,
        "per_step_s": statistics.median(times["per_step"]),
        "scan_s": statistics.median(times["scan"]),
        "scan_over_per_step": common.median_ratio(times["scan"], times["per_step"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4, help="inner steps H of a round")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--lm", default="tiny,small", help="LM presets, comma-separated ('' none)")
    parser.add_argument("--lm-batch", type=int, default=4, help="sequences per worker and step")
    args = parser.parse_args()
    print(common.header() + "\n")
    cases = [cnn_case(args.workers, args.steps)]
    cases += [
        lm_case(preset, args.workers, args.steps, args.lm_batch)
        for preset in args.lm.split(",")
        if preset
    ]
    rows = [measure(case, args.workers, args.steps, args.reps) for case in cases]
    headers = ["workload", "M x H", "vmap s", "sequential s", "vmap unrolled s", "train_sync s",
               "vmap / sequential", "vmap / sync", "sequential / sync",
               "unrolled / sync"]  # fmt: skip
    table = [
        [
            r["workload"],
            f"{r['workers']} x {r['inner_steps']}",
            f"{r['vmap_s']:.3f}",
            f"{r['sequential_s']:.3f}",
            f"{r['vmap_unrolled_s']:.3f}",
            f"{r['train_sync_s']:.3f}",
            f"{r['vmap_over_sequential']:.2f}",
            f"{r['vmap_over_sync']:.2f}",
            f"{r['sequential_over_sync']:.2f}",
            f"{r['unrolled_over_sync']:.2f}",
        ]  # fmt: skip
        for r in rows
    ]
    print(common.markdown_table(headers, table))
    common.progress("a convolution's steps: one program each, and in one loop")
    loop = conv_in_loop(args.reps)
    print(
        f"\n{loop['steps']} SGD steps of two convolutions: {loop['per_step_s']:.3f} s as one "
        f"program per step, {loop['scan_s']:.3f} s in one lax.scan "
        f"({loop['scan_over_per_step']:.1f} x)"
    )
    payload = {"reps": args.reps, "rows": rows, "conv_in_loop": loop}
    path = common.write_results("worker_map", payload)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
