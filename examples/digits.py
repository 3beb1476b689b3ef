"""DiLoCo on a real dataset with your own Flax NNX model: a small CNN with BatchNorm and
Dropout classifies the handwritten digits bundled with the package (1797 8 x 8 images), with
DiLoCo (M = 4 workers, one sync every H steps) against data parallelism on the same examples
in the same order: at equal steps (one sync every step) and at equal bytes (one step per
DiLoCo round). It prints test accuracy and the bytes each worker sent.

    python examples/digits.py                 # the README's figures (about a minute on 2 cores)
    python examples/digits.py --rounds 2 --inner-steps 2 --out result.json
"""

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import diloco_jax as dj
from diloco_jax.datasets import load_digits


class CNN(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, width: int = 16, dropout: float = 0.2):
        self.conv1 = nnx.Conv(1, width, (3, 3), rngs=rngs)
        self.bn1 = nnx.BatchNorm(width, momentum=0.9, rngs=rngs)
        self.conv2 = nnx.Conv(width, 2 * width, (3, 3), rngs=rngs)
        self.bn2 = nnx.BatchNorm(2 * width, momentum=0.9, rngs=rngs)
        self.dropout = nnx.Dropout(dropout, rngs=rngs)
        self.head = nnx.Linear(2 * width, 10, rngs=rngs)

    def __call__(self, x_BxHxWx1: jax.Array) -> jax.Array:
        x = nnx.relu(self.bn1(self.conv1(x_BxHxWx1)))
        x = nnx.relu(self.bn2(self.conv2(x)))
        return self.head(self.dropout(x.mean(axis=(1, 2))))


def split(seed: int, test_size: int = 297):
    """(train, test) dicts of images [N, 8, 8, 1] and labels [N], a seeded permutation."""
    images, labels = load_digits()
    order = np.random.default_rng(seed).permutation(len(labels))
    test, train = order[:test_size], order[test_size:]
    return ({"x": images[train], "y": labels[train]}, {"x": images[test], "y": labels[test]})


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--inner-steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker and step")
    parser.add_argument("--lr", type=float, default=3e-3, help="inner / data-parallel AdamW")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the results here as JSON")
    args = parser.parse_args(argv)
    M, H, R, B = args.workers, args.inner_steps, args.rounds, args.batch_size

    start = time.perf_counter()
    train, test = split(args.seed)
    fns = dj.nnx_model_fns(CNN(nnx.Rngs(args.seed)))

    def loss_fn(params, model_state, batch, key):
        logits, model_state = fns.apply(params, model_state, batch["x"], rng=key)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["y"])
        return loss, (model_state, {"accuracy": accuracy})

    def eval_fn(params, model_state, data):
        logits, _ = fns.apply(params, model_state, data["x"], train=False)
        return {"test_accuracy": jnp.mean(jnp.argmax(logits, -1) == data["y"])}

    inner = optax.adamw(args.lr, weight_decay=1e-4)
    common = dict(
        num_workers=M, has_aux=True, rng_seed=args.seed, model_state=fns.model_state,
        eval_fn=eval_fn, eval_data=test, eval_every=H * R,
    )  # fmt: skip
    rounds = dj.worker_rounds(train, M, H, B, seed=args.seed, num_rounds=R)
    diloco = dj.train_diloco(
        loss_fn, fns.params, rounds, num_rounds=R, inner_steps=H,
        method=dj.DiLoCo(inner=inner), **common,
    )  # fmt: skip
    steps = dj.sync_steps(train, M, H, B, seed=args.seed, num_rounds=R)
    equal_steps = dj.train_sync(
        loss_fn, fns.params, steps, num_steps=R * H, optimizer=inner, **common
    )
    equal_bytes = dj.train_sync(
        loss_fn, fns.params, steps[:R], num_steps=R, optimizer=inner, **{**common, "eval_every": R}
    )
    results = {}
    for name, run in (
        ("diloco", diloco), ("sync_equal_steps", equal_steps), ("sync_equal_bytes", equal_bytes)
    ):  # fmt: skip
        last = run.history[-1]
        results[name] = {
            "steps": last["steps"],
            "train_loss": last["loss"],
            "train_accuracy": last["accuracy"],
            "test_accuracy": last["test_accuracy"],
            "wire_bytes": last["wire_bytes"],
            "model_state_wire_bytes": last["model_state_wire_bytes"],
        }
    print(f"M = {M} workers, H = {H}, {R} rounds, batch {B} per worker and step")
    print(f"{'run':<18} {'steps':>6} {'train acc':>10} {'test acc':>9} {'wire MB/worker':>15}")
    for name, row in results.items():
        print(
            f"{name:<18} {row['steps']:>6} {row['train_accuracy']:>10.4f} "
            f"{row['test_accuracy']:>9.4f} {row['wire_bytes'] / 1e6:>15.3f}"
        )
    if args.out:
        # The wall time of the three runs, compiles included, and the cores they had.
        timing = {"seconds": time.perf_counter() - start, "cpus": len(os.sched_getaffinity(0))}
        with open(args.out, "w") as f:
            json.dump({"config": vars(args), "results": results, **timing}, f, indent=2)
    return results


if __name__ == "__main__":
    sys.exit(main() and 0)
