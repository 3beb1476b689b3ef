"""Independent NumPy references (float64) for the tests: a linear model trained with plain SGD
inner steps and an SGD/Nesterov outer step, written from the paper's equations; the block
codecs written from their definitions; and the CLI's refusal contract."""

import contextlib
import functools

import jax
import numpy as np
import pytest

QMAX = {"int8": 127.0, "int4": 7.0}
E3M0_GRID = np.array([0.0] + [2.0 ** (e - 7) for e in range(1, 8)])


@contextlib.contextmanager
def precision(dtype):
    """Runs its block with x64 on for dtype "float64" (off for "float32"), then off again."""
    jax.config.update("jax_enable_x64", dtype == "float64")
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", False)


@functools.partial(jax.jit, static_argnums=2)
def worker_deltas(params, batch, inner):
    """Each worker's Δ_m = θ - θ_m after its H steps of optax `inner` on linear_loss from θ,
    computed by the library (`inner_loop`, `worker_delta`), for tests of what an exchange
    does with them; float32 leaves [M, ...] (batch leaves [M, H, ...])."""
    import diloco_jax as dj

    def one(b):
        p, _, _ = dj.inner.inner_loop(linear_loss, inner, params, inner.init(params), b)
        return dj.outer.worker_delta(params, p)

    return jax.vmap(one)(batch)


def linear_loss(params, batch):
    """0.5 * mean((x @ w + b - y)^2) — the JAX loss the tests train."""
    import jax.numpy as jnp

    err = batch["x"] @ params["w"] + params["b"] - batch["y"]
    return 0.5 * jnp.mean(err**2)


def np_adam(g, m, v, t, lr, b1=0.9, b2=0.999, eps=1e-8):
    """One optax.adam step at count t (1-based): (update, new m, new v)."""
    m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
    return -lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps), m, v


class NpAdamWorkers:
    """float64 Adam inner steps of M workers of the linear model [w0, w1, w2, b], each with
    its own optimizer state that persists from round to round (the step count is shared)."""

    def __init__(self, num_workers, lr):
        self.m, self.v = np.zeros((num_workers, 4)), np.zeros((num_workers, 4))
        self.t, self.lr = 0, lr

    def run(self, start, x, y):
        """Each worker's params [M, 4] after the round's H steps from `start` (on x [M, H, B,
        3], y [M, H, B])."""
        local = start.copy()
        for h in range(x.shape[1]):
            self.t += 1
            for w in range(local.shape[0]):
                err = x[w, h] @ local[w, :3] + local[w, 3] - y[w, h]
                grad = np.append(x[w, h].T @ err / len(err), err.mean())
                upd, self.m[w], self.v[w] = np_adam(grad, self.m[w], self.v[w], self.t, self.lr)
                local[w] += upd
        return local


def linear_grads(w, b, x, y):
    err = x @ w + b - y
    return x.T @ err / len(y), err.mean(), 0.5 * np.mean(err**2)


def make_data(rng, num_rounds, num_workers, inner_steps, batch=4, dim=3):
    """Rounds of {"x": [M, H, B, D], "y": [M, H, B]} float32."""
    return [
        {
            "x": rng.normal(size=(num_workers, inner_steps, batch, dim)).astype(np.float32),
            "y": rng.normal(size=(num_workers, inner_steps, batch)).astype(np.float32),
        }
        for _ in range(num_rounds)
    ]


def diloco_sgd(w, b, rounds, inner_lr, outer_lr, momentum, nesterov=True):
    """DiLoCo with SGD inner steps and SGD(+momentum) outer steps. Returns (w, b, losses)
    where losses[r][m] is worker m's mean pre-update loss in round r."""
    w, b = np.float64(w).copy(), np.float64(b)
    trace_w, trace_b = np.zeros_like(w), 0.0
    losses = []
    for batch in rounds:
        x, y = batch["x"].astype(np.float64), batch["y"].astype(np.float64)
        deltas_w, deltas_b, round_losses = [], [], []
        for xm, ym in zip(x, y, strict=True):
            wm, bm, step_losses = w.copy(), b, []
            for xs, ys in zip(xm, ym, strict=True):
                gw, gb, loss = linear_grads(wm, bm, xs, ys)
                step_losses.append(loss)
                wm, bm = wm - inner_lr * gw, bm - inner_lr * gb
            deltas_w.append(w - wm)
            deltas_b.append(b - bm)
            round_losses.append(np.mean(step_losses))
        dw, db = np.mean(deltas_w, axis=0), np.mean(deltas_b)
        trace_w, trace_b = dw + momentum * trace_w, db + momentum * trace_b
        if nesterov:
            uw, ub = dw + momentum * trace_w, db + momentum * trace_b
        else:
            uw, ub = trace_w, trace_b
        w, b = w - outer_lr * uw, b - outer_lr * ub
        losses.append(round_losses)
    return w, b, losses


def np_codec(blocks, kind):
    """float32 blocks [NB, 32] -> (their decoded values after one quantization, each block's
    scale [NB]): symmetric absmax int8 / int4 (round half to even), or e3m0's nearest grid
    point (brute force)."""
    blocks = blocks.astype(np.float32)
    if kind == "e3m0":
        scale = np.abs(blocks).max(axis=1, keepdims=True)
        mags = scale[..., None] * E3M0_GRID
        pick = np.argmin(np.abs(np.abs(blocks)[..., None] - mags), axis=-1)
        return (np.sign(blocks) * np.take_along_axis(mags, pick[..., None], -1)[..., 0]).astype(
            np.float32
        ), scale[:, 0]
    scale = np.abs(blocks).max(axis=1) / np.float32(QMAX[kind])
    safe = np.where(scale > 0, scale, np.float32(1))
    q = np.clip(np.round(blocks / safe[:, None]), -QMAX[kind], QMAX[kind])
    return (q * scale[:, None]).astype(np.float32), scale


def np_blocks(x):
    """An array flattened in float32 and zero-padded to whole blocks of 32: [NB, 32]."""
    flat = np.ravel(x).astype(np.float32)
    padded = np.zeros(-(-flat.size // 32) * 32, np.float32)
    padded[: flat.size] = flat
    return padded.reshape(-1, 32)


def assert_cli_refuses(argv, message, capsys, out=None):
    """The CLI's contract for bad input: `diloco-jax argv` exits 2 with one stderr line
    "diloco-jax: error: ..." holding `message`, and leaves the folder `out` unwritten."""
    from diloco_jax.lm.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("diloco-jax: error:") and err.count("\n") == 1, err
    assert message in err, err
    assert out is None or not out.exists()
