"""DiLoCo with one worker as an optax optimizer (`dj.diloco_optimizer`): against a float64
NumPy reference of the rule, its degenerate cases (outer lr 1 without momentum is the inner
optimizer alone; H x R steps are `train_diloco` with M = 1), inside optax.chain,
optax.MultiSteps, jit and Orbax, and the Flax MNIST tutorial's model trained inside the
tutorial's own `nnx.Optimizer` loop."""

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from reference import diloco_sgd, linear_grads, linear_loss, make_data, precision

import diloco_jax as dj

NESTEROV = optax.sgd(0.7, momentum=0.9, nesterov=True)


def _steps(rounds):
    """The rounds of make_data (M = 1) as one batch per step, in order."""
    return [{"x": r["x"][0, h], "y": r["y"][0, h]} for r in rounds for h in range(r["x"].shape[1])]


def _run(tx, params, batches, loss=linear_loss):
    state = tx.init(params)
    update = jax.jit(tx.update)
    for batch in batches:
        grads = jax.grad(loss)(params, batch)
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params, state


def test_sgd_and_nesterov_equal_a_numpy_reference_of_the_rule():
    rounds = make_data(np.random.default_rng(0), num_rounds=4, num_workers=1, inner_steps=3)
    with precision("float64"):
        w0, b0 = np.array([0.3, -0.2, 0.1]), np.float64(0.5)
        params = {"w": jnp.asarray(w0), "b": jnp.asarray(b0)}
        tx = dj.diloco_optimizer(optax.sgd(0.1), NESTEROV, every=3)
        got, state = _run(tx, params, _steps(rounds))
        assert got["w"].dtype == jnp.float64 and int(state.count) == 12
    w, b, _ = diloco_sgd(w0, b0, rounds, inner_lr=0.1, outer_lr=0.7, momentum=0.9)
    np.testing.assert_allclose(got["w"], w, rtol=1e-12)
    np.testing.assert_allclose(got["b"], b, rtol=1e-12)
    np.testing.assert_allclose(state.anchor["w"], w, rtol=1e-12)  # the last step was outer


def test_between_outer_steps_it_is_the_inner_optimizer():
    rounds = make_data(np.random.default_rng(1), num_rounds=1, num_workers=1, inner_steps=5)
    with precision("float64"):
        w, b = np.array([0.3, -0.2, 0.1]), np.float64(0.5)
        params = {"w": jnp.asarray(w), "b": jnp.asarray(b)}
        got, state = _run(dj.diloco_optimizer(optax.sgd(0.1), NESTEROV, every=5),
                          params, _steps(rounds)[:4])  # fmt: skip
        for batch in _steps(rounds)[:4]:
            gw, gb, _ = linear_grads(w, b, batch["x"], batch["y"])
            w, b = w - 0.1 * gw, b - 0.1 * gb
        np.testing.assert_allclose(got["w"], w, rtol=1e-13)
        np.testing.assert_array_equal(state.anchor["w"], [0.3, -0.2, 0.1])  # no outer step yet


@pytest.mark.parametrize("inner", [optax.adamw(0.05, weight_decay=0.1), optax.sgd(0.2)])
def test_outer_lr_1_without_momentum_is_the_inner_optimizer_alone(inner):
    batches = _steps(make_data(np.random.default_rng(2), 3, 1, 4))
    with precision("float64"):
        params = {"w": jnp.asarray([0.3, -0.2, 0.1]), "b": jnp.asarray(0.5)}
        got, _ = _run(dj.diloco_optimizer(inner, optax.sgd(1.0), every=4), params, batches)
        alone, _ = _run(inner, params, batches)
    for name in ("w", "b"):
        np.testing.assert_allclose(got[name], alone[name], rtol=1e-13, atol=1e-15)


def test_h_times_r_steps_equal_train_diloco_with_one_worker():
    rounds = make_data(np.random.default_rng(3), num_rounds=3, num_workers=1, inner_steps=4)
    inner = optax.adamw(0.05, weight_decay=0.1)
    with precision("float64"):
        params = {"w": jnp.asarray([0.3, -0.2, 0.1]), "b": jnp.asarray(0.5)}
        got, _ = _run(dj.diloco_optimizer(inner, NESTEROV, every=4), params, _steps(rounds))
        ref = dj.train_diloco(
            linear_loss, params, rounds, num_rounds=3, num_workers=1, inner_steps=4,
            inner_optimizer=inner, outer_optimizer=NESTEROV,
        )  # fmt: skip
    for name in ("w", "b"):
        np.testing.assert_allclose(got[name], ref.params[name], rtol=1e-12)


def test_it_composes_with_chain_multisteps_and_jit():
    batches = _steps(make_data(np.random.default_rng(4), 2, 1, 8))
    params = {"w": jnp.asarray([0.3, -0.2, 0.1]), "b": jnp.asarray(0.5)}
    tx = dj.diloco_optimizer(optax.sgd(0.1), NESTEROV, every=2)
    # chain: clipping first, then the optimizer on the clipped gradients.
    chained, _ = _run(optax.chain(optax.clip_by_global_norm(0.5), tx), params, batches)
    clip = optax.clip_by_global_norm(0.5)

    def clipped(p, b):
        g = jax.grad(linear_loss)(p, b)
        return clip.update(g, clip.init(p))[0]

    state, p = tx.init(params), params
    for batch in batches:
        updates, state = tx.update(clipped(p, batch), state, p)  # not jitted: the same
        p = optax.apply_updates(p, updates)
    for name in ("w", "b"):
        np.testing.assert_allclose(chained[name], p[name], rtol=1e-6)
    # MultiSteps(k=2): the optimizer steps on the mean of each two gradients.
    multi, _ = _run(optax.MultiSteps(tx, every_k_schedule=2), params, batches)
    state, p = tx.init(params), params
    for a, b in zip(batches[::2], batches[1::2], strict=True):
        ga, gb = jax.grad(linear_loss)(p, a), jax.grad(linear_loss)(p, b)
        updates, state = tx.update(jax.tree.map(lambda x, y: (x + y) / 2, ga, gb), state, p)
        p = optax.apply_updates(p, updates)
    for name in ("w", "b"):
        np.testing.assert_allclose(multi[name], p[name], rtol=1e-6)
    assert not np.allclose(multi["w"], chained["w"])


def test_its_state_checkpoints_with_orbax_and_resumes_bit_for_bit(tmp_path):
    import orbax.checkpoint as ocp

    batches = _steps(make_data(np.random.default_rng(5), 3, 1, 3))
    params = {"w": jnp.asarray([0.3, -0.2, 0.1]), "b": jnp.asarray(0.5)}
    tx = dj.diloco_optimizer(optax.adam(0.05), NESTEROV, every=3)
    whole, _ = _run(tx, params, batches)
    half, state = _run(tx, params, batches[:4])  # cut inside the second round
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "ckpt", {"params": half, "opt": state})
        ckpt.wait_until_finished()
        back = ckpt.restore(tmp_path / "ckpt", {"params": half, "opt": state})
    assert isinstance(back["opt"], dj.DiLoCoOptimizerState)
    update, p, s = jax.jit(tx.update), back["params"], back["opt"]
    for batch in batches[4:]:
        updates, s = update(jax.grad(linear_loss)(p, batch), s, p)
        p = optax.apply_updates(p, updates)
    for name in ("w", "b"):
        np.testing.assert_array_equal(p[name], whole[name])


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match="every must be an integer >= 1, got 0"):
        dj.diloco_optimizer(optax.sgd(0.1), NESTEROV, every=0)
    with pytest.raises(ValueError, match="inner must be an optax GradientTransformation"):
        dj.diloco_optimizer("adam", NESTEROV, every=2)
    with pytest.raises(ValueError, match="outer must be an optax GradientTransformation"):
        dj.diloco_optimizer(optax.sgd(0.1), None, every=2)
    with pytest.raises(ValueError, match="look-ahead"):
        dj.diloco_optimizer(optax.sgd(0.1), dj.heloco(0.7), every=2)
    dj.diloco_optimizer(optax.sgd(0.1), dj.heloco(0.7, lookahead=False), every=2)
    tx = dj.diloco_optimizer(optax.sgd(0.1), NESTEROV, every=2)
    params = {"w": jnp.ones(3)}
    with pytest.raises(ValueError, match="needs params"):
        tx.update(params, tx.init(params))


def _experiment():
    """experiments/diloco_optimizer.py: the tutorial's CNN and the digits at 28 x 28."""
    path = Path(__file__).resolve().parents[1] / "experiments" / "diloco_optimizer.py"
    spec = importlib.util.spec_from_file_location("diloco_optimizer_experiment", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # 8 s: the tutorial's CNN compiled and trained for 30 steps
def test_the_tutorials_model_trains_in_the_tutorials_own_nnx_optimizer_loop():
    experiment = _experiment()
    train, _ = experiment.digits()
    images, labels = train["image"][:512], train["label"][:512]
    tx = dj.diloco_optimizer(optax.adamw(0.005, 0.9), NESTEROV, every=5)
    model = experiment.CNN(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    def loss_fn(model, batch):
        logits = model(batch["image"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        return loss, logits

    @nnx.jit
    def train_step(model, optimizer, batch):  # the tutorial's step
        grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
        (loss, _), grads = grad_fn(model, batch)
        optimizer.update(model, grads)
        return loss

    losses = []
    for step in range(30):
        at = (step * 64) % 512
        batch = {"image": images[at : at + 64], "label": labels[at : at + 64]}
        losses.append(float(train_step(model, optimizer, batch)))
    # Its state lives in the nnx.Optimizer; step 30 was an outer step, so the model's params
    # are the new anchor θ.
    assert int(optimizer.opt_state.count[...]) == 30
    anchor = jax.tree.leaves(nnx.state(optimizer.opt_state.anchor))
    now = jax.tree.leaves(nnx.state(model, nnx.Param))
    for a, p in zip(anchor, now, strict=True):  # step 30 was an outer step: params = anchor
        np.testing.assert_array_equal(np.asarray(a), np.asarray(p))
    assert np.mean(losses[-5:]) < 0.5 * losses[0], losses
    accuracy = float((model(images).argmax(-1) == labels).mean())
    assert accuracy > 0.6, accuracy
