"""DiLoCo with one worker as an optax optimizer (`dj.diloco_optimizer`) against its inner
optimizer alone, in the Flax MNIST tutorial's loop and model (`nnx.Optimizer`, the tutorial's
CNN), on the digits bundled with the package resized to 28 x 28 (1500 to train, 297 held out).

Every run takes the same batches in the same order (batch 64, AdamW lr 0.005, b1 0.9, weight
decay 1e-4) for `--steps` steps, and is evaluated on the held-out digits every `--every`
steps: AdamW alone, and AdamW inside `diloco_optimizer` with H = 30 and an outer Nesterov of
lr 0.7 with momentum 0.5 (modded-nanogpt's speedrun setting) and 0.9 (the DiLoCo paper's).
Each configuration runs over 3 seeds (the model's init and the batch order).

    cd experiments && ../.venv/bin/python diloco_optimizer.py [--steps 600] [--seeds 3]

Writes results/diloco_optimizer.json (every evaluation of every run), .md (the table) and
.png (held-out loss against steps, the mean over seeds).
"""

import argparse
import json
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax
from flax import nnx

import diloco_jax as dj
from diloco_jax.datasets import load_digits

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
TRAIN = 1500
BATCH = 64
H = 30


class CNN(nnx.Module):
    """The Flax MNIST tutorial's model."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
        self.avg_pool = lambda x: nnx.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(3136, 256, rngs=rngs)
        self.linear2 = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x_Bx28x28x1):
        x = self.avg_pool(nnx.relu(self.conv1(x_Bx28x28x1)))
        x = self.avg_pool(nnx.relu(self.conv2(x)))
        x = x.reshape(x.shape[0], -1)
        return self.linear2(nnx.relu(self.linear1(x)))


def optimizers() -> dict:
    adamw = optax.adamw(0.005, 0.9, weight_decay=1e-4)
    return {
        "AdamW": adamw,
        "DiLoCo(AdamW), H 30, Nesterov 0.7 / 0.5": dj.diloco_optimizer(
            adamw, optax.sgd(0.7, momentum=0.5, nesterov=True), every=H
        ),
        "DiLoCo(AdamW), H 30, Nesterov 0.7 / 0.9": dj.diloco_optimizer(
            adamw, optax.sgd(0.7, momentum=0.9, nesterov=True), every=H
        ),
    }


def loss_fn(model, batch):
    logits = model(batch["image"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return loss, logits


@nnx.jit
def train_step(model, optimizer, batch):
    (loss, _), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
    optimizer.update(model, grads)
    return loss


@nnx.jit
def evaluate(model, batch):
    loss, logits = loss_fn(model, batch)
    return loss, (logits.argmax(-1) == batch["label"]).mean()


def digits():
    images, labels = load_digits()
    images = jax.image.resize(jnp.asarray(images) / float(images.max()),
                              (len(images), 28, 28, 1), "linear")  # fmt: skip
    labels = jnp.asarray(labels)
    train = {"image": images[:TRAIN], "label": labels[:TRAIN]}
    held = {"image": images[TRAIN:], "label": labels[TRAIN:]}
    return train, held


def run(tx, seed: int, steps: int, every: int, train: dict, held: dict) -> list[dict]:
    model = CNN(rngs=nnx.Rngs(seed))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    order = np.random.default_rng(seed).permutation(TRAIN * (steps * BATCH // TRAIN + 1)) % TRAIN
    records = []
    for step in range(1, steps + 1):
        pick = order[(step - 1) * BATCH : step * BATCH]
        train_step(model, optimizer, {k: v[pick] for k, v in train.items()})
        if step % every == 0:
            loss, accuracy = evaluate(model, held)
            records.append({"step": step, "loss": float(loss), "accuracy": float(accuracy)})
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--every", type=int, default=H)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    train, held = digits()
    started, runs = time.monotonic(), {}
    for name, tx in optimizers().items():
        runs[name] = [run(tx, s, args.steps, args.every, train, held) for s in range(args.seeds)]
        print(f"{name}: {time.monotonic() - started:.0f} s", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "command": f"python diloco_optimizer.py --steps {args.steps} --seeds {args.seeds}",
        "machine": {"python": platform.python_version(), "jax": jax.__version__},
        "runs": runs,
    }
    (args.out / "diloco_optimizer.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        f"| optimizer | held-out loss at step {args.steps} | accuracy | best loss (step) |",
        "| --- | --- | --- | --- |",
    ]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for name, seeds in runs.items():
        steps = [r["step"] for r in seeds[0]]
        loss = np.mean([[r["loss"] for r in s] for s in seeds], axis=0)
        accuracy = np.mean([[r["accuracy"] for r in s] for s in seeds], axis=0)
        best = int(np.argmin(loss))
        lines.append(f"| {name} | {loss[-1]:.4f} | {accuracy[-1]:.3f} | "
                     f"{loss[best]:.4f} ({steps[best]}) |")  # fmt: skip
        ax.plot(steps, loss, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel(f"held-out loss (mean of {args.seeds} seeds)")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "diloco_optimizer.png", dpi=120)
    (args.out / "diloco_optimizer.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
