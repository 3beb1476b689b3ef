"""Flax NNX models, directly (`nnx_model_fns`): the split into params and model state, the pure
apply in train and eval mode against NumPy BatchNorm, dropout keyed per step (from streams
stored in the module, and from `rngs` passed at call time as Flax's tutorial and transformer
examples pass them), docs/your-model.md's run of the MNIST tutorial's CNN, and a DiLoCo run of
a BatchNorm + Dropout model that repeats and resumes bit for bit; the bundled digits data
against scikit-learn's copy when it is installed."""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import diloco_jax as dj
from diloco_jax.datasets import load_digits


class Net(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(3, 4, rngs=rngs)
        self.bn = nnx.BatchNorm(4, momentum=0.9, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.out = nnx.Linear(4, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(self.bn(self.lin(x))))[:, 0]


def test_the_split_puts_params_apart_from_model_state():
    model = Net(nnx.Rngs(0))
    fns = dj.nnx_model_fns(model)
    assert set(fns.params) == {"lin", "bn", "out"}
    assert set(fns.params["bn"]) == {"scale", "bias"}  # BatchNorm's own params train
    assert set(fns.model_state) == {"bn", "drop"}
    assert set(fns.model_state["bn"]) == {"mean", "var"}
    key_data = fns.model_state["drop"]["rngs"]["key"]["key_data"]
    assert key_data.dtype == jnp.uint32  # plain arrays only
    np.testing.assert_array_equal(fns.params["lin"]["kernel"], model.lin.kernel[...])
    with pytest.raises(ValueError, match="model must be a flax.nnx.Module"):
        dj.nnx_model_fns(lambda x: x)


def test_apply_updates_batch_statistics_like_numpy_and_eval_uses_them():
    model = Net(nnx.Rngs(0))
    fns = dj.nnx_model_fns(model)
    x = np.random.default_rng(0).normal(size=(8, 3)).astype(np.float32)
    _, new = fns.apply(fns.params, fns.model_state, x, rng=jax.random.key(0))
    h = x @ np.asarray(fns.params["lin"]["kernel"]) + np.asarray(fns.params["lin"]["bias"])
    np.testing.assert_allclose(new["bn"]["mean"], 0.1 * h.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new["bn"]["var"], 0.9 + 0.1 * h.var(0), rtol=1e-5)
    out, same = fns.apply(fns.params, new, x, train=False)
    np.testing.assert_array_equal(same["bn"]["mean"], new["bn"]["mean"])  # eval: no update
    normed = (h - np.asarray(new["bn"]["mean"])) / np.sqrt(np.asarray(new["bn"]["var"]) + 1e-5)
    want = normed @ np.asarray(fns.params["out"]["kernel"])[:, 0] + float(
        fns.params["out"]["bias"][0]
    )
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    merged = fns.merge(fns.params, new)
    merged.eval()
    np.testing.assert_allclose(merged(x), out, rtol=1e-6)
    assert model.bn.mean[...].sum() == 0  # the user's model is never modified


def test_dropout_draws_from_the_step_key():
    fns = dj.nnx_model_fns(Net(nnx.Rngs(0)))
    x = np.random.default_rng(0).normal(size=(16, 3)).astype(np.float32)
    run = jax.jit(lambda k: fns.apply(fns.params, fns.model_state, x, rng=k)[0])
    a, b, c = run(jax.random.key(1)), run(jax.random.key(1)), run(jax.random.key(2))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


class AttentionBlock(nnx.Module):
    """The style of Flax's NNX transformer examples: dropout layers built without streams, and
    a `__call__` taking `deterministic` and `rngs` for its layers (attention dropout too)."""

    def __init__(self, rngs):
        self.attention = nnx.MultiHeadAttention(
            num_heads=2, in_features=8, dropout_rate=0.5, decode=False, rngs=rngs
        )
        self.dropout = nnx.Dropout(0.5)
        self.out = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x, *, deterministic=False, rngs: nnx.Rngs | None = None):
        y = self.attention(x, deterministic=deterministic, rngs=rngs)
        return self.out(self.dropout(y, deterministic=deterministic, rngs=rngs))[..., 0]


def test_call_time_rngs_draw_from_the_step_key():
    fns = dj.nnx_model_fns(AttentionBlock(nnx.Rngs(0)))
    # The attention layer keeps a stream of its own; the dropout layer none.
    assert set(fns.model_state) == {"attention"}
    x = np.random.default_rng(0).normal(size=(2, 4, 8)).astype(np.float32)
    run = jax.jit(lambda k: fns.apply(fns.params, fns.model_state, x, rng=k)[0])
    a, b, c = run(jax.random.key(1)), run(jax.random.key(1)), run(jax.random.key(2))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    # Flax's own call with nnx.Rngs(fold_in(key, n)), n = 1 stored stream, draws the same
    # masks; deterministic=True draws none, whatever the key.
    module = fns.merge(fns.params, fns.model_state)
    want = module(x, rngs=nnx.Rngs(jax.random.fold_in(jax.random.key(1), 1)))
    np.testing.assert_allclose(a, want, rtol=1e-6, atol=1e-6)
    det = [
        fns.apply(fns.params, fns.model_state, x, rng=jax.random.key(k), deterministic=True)[0]
        for k in (1, 2)
    ]
    np.testing.assert_array_equal(det[0], det[1])
    np.testing.assert_allclose(det[0], module(x, deterministic=True), rtol=1e-6, atol=1e-6)
    # A call of your own rngs uses them, not the key.
    mine = fns.apply(fns.params, fns.model_state, x, rng=jax.random.key(1), rngs=nnx.Rngs(7))[0]
    np.testing.assert_allclose(mine, module(x, rngs=nnx.Rngs(7)), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="no `rngs` argument was provided"):
        fns.apply(fns.params, fns.model_state, x)  # train mode without a key: Flax's own refusal


class PositionalRngs(nnx.Module):
    """A `__call__(x, rngs)` called as Flax's MNIST tutorial calls its model: `model(x, rngs)`."""

    def __init__(self, rngs):
        self.lin = nnx.Linear(3, 4, rngs=rngs)
        self.dropout = nnx.Dropout(0.5)

    def __call__(self, x, rngs: nnx.Rngs | None = None):
        return self.dropout(self.lin(x), rngs=rngs)


def test_call_time_rngs_passed_by_position_are_used_with_a_step_key():
    fns = dj.nnx_model_fns(PositionalRngs(nnx.Rngs(0)))
    module = fns.merge(fns.params, fns.model_state)
    x = np.random.default_rng(0).normal(size=(8, 3)).astype(np.float32)
    mine = fns.apply(fns.params, fns.model_state, x, nnx.Rngs(7), rng=jax.random.key(1))[0]
    np.testing.assert_allclose(mine, module(x, nnx.Rngs(7)), rtol=1e-6, atol=1e-6)
    keyed = fns.apply(fns.params, fns.model_state, x, rng=jax.random.key(1))[0]
    want = module(x, rngs=nnx.Rngs(jax.random.fold_in(jax.random.key(1), 0)))
    np.testing.assert_allclose(keyed, want, rtol=1e-6, atol=1e-6)
    assert not np.allclose(keyed, mine)


def _docs_block(heading: str) -> str:
    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "your-model.md").read_text()
    return re.search(r"```python\n(.*?)```", text[text.index(heading) :], re.S).group(1)


@pytest.mark.slow
def test_the_mnist_tutorials_cnn_trains_unchanged_as_the_docs_show():
    """docs/your-model.md's block, run as written: the CNN of Flax's MNIST tutorial (dropout
    `rngs` at call time) trains through `nnx_model_fns` with a key per worker and step (a
    __call__ given no rngs in train mode would stop the run: Flax refuses dropout then)."""
    ns = {}
    exec(compile(_docs_block("### The official MNIST tutorial's CNN"), "your-model.md", "exec"), ns)
    result, fns = ns["result"], ns["fns"]
    assert jax.tree.structure(result.params) == jax.tree.structure(fns.params)
    for got, want in zip(jax.tree.leaves(result.params), jax.tree.leaves(fns.params), strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype
    assert np.isfinite([h["loss"] for h in result.history]).all()
    assert ns["predictions"].shape == (16,)
    # The step key reaches the call: Flax's own call with nnx.Rngs(fold_in(key, 0)) (no
    # stream stored in this CNN) draws the same dropout masks.
    x, key = jnp.asarray(ns["images"][:8]), jax.random.key(3)
    apply = jax.jit(lambda k: fns.apply(fns.params, fns.model_state, x, rng=k)[0])
    flax_call = nnx.jit(lambda module, k: module(x, rngs=nnx.Rngs(k)))
    want = flax_call(fns.merge(fns.params, fns.model_state), jax.random.fold_in(key, 0))
    np.testing.assert_allclose(apply(key), want, rtol=1e-5, atol=1e-5)
    assert not np.allclose(apply(key), apply(jax.random.key(4)))


def _digits_run(rounds, num_rounds, checkpoint_dir=None):
    fns = dj.nnx_model_fns(Net(nnx.Rngs(0)))

    def loss_fn(params, model_state, batch, key):
        pred, model_state = fns.apply(params, model_state, batch["x"], rng=key)
        return jnp.mean((pred - batch["y"]) ** 2), model_state

    return dj.train_diloco(
        loss_fn, fns.params, rounds, num_rounds=num_rounds, num_workers=2, inner_steps=2,
        rng_seed=3, model_state=fns.model_state, inner_optimizer=optax.adamw(1e-2),
        checkpoint_dir=checkpoint_dir,
    )  # fmt: skip


@pytest.mark.slow
def test_a_batchnorm_dropout_model_trains_repeats_and_resumes_bit_identically(tmp_path):
    rng = np.random.default_rng(0)
    data = {"x": rng.normal(size=(64, 3)).astype(np.float32)}
    data["y"] = data["x"] @ np.array([1.0, -2.0, 0.5], np.float32)
    rounds = dj.worker_rounds(data, 2, 2, 4, num_rounds=4)
    first, second = _digits_run(rounds, 4), _digits_run(rounds, 4)
    for a, b in zip(jax.tree.leaves(first.state), jax.tree.leaves(second.state), strict=True):
        np.testing.assert_array_equal(a, b)
    _digits_run(rounds[:2], 2, tmp_path)
    resumed = _digits_run(rounds, 4, tmp_path)
    for a, b in zip(jax.tree.leaves(first.state), jax.tree.leaves(resumed.state), strict=True):
        np.testing.assert_array_equal(a, b)
    assert first.history[-1]["loss"] < first.history[0]["loss"]
    # The running mean is merged ("mean"), the RNG state kept per worker ("keep").
    assert first.model_state["bn"]["mean"].shape == (4,)
    assert first.model_state["drop"]["rngs"]["count"].shape == (2,)


def test_bundled_digits_are_scikit_learns():
    images, labels = load_digits()
    assert images.shape == (1797, 8, 8, 1) and labels.shape == (1797,)
    assert images.dtype == np.float32 and 0 <= images.min() and images.max() == 1.0
    np.testing.assert_array_equal(
        np.bincount(labels), [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]
    )
    datasets = pytest.importorskip("sklearn.datasets")
    reference = datasets.load_digits()
    np.testing.assert_array_equal(images[..., 0] * 16, reference.images)
    np.testing.assert_array_equal(labels, reference.target)
