"""Tests for diloco_jax.lm.model: shapes, parameter counts, causality, loss, training, dtypes."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from diloco_jax.lm import model

MICRO = model.PRESETS["micro"]
# Learned positions, and 2 heads x 8 = 16 != d_model 32: exercises the other code paths.
ALT = dataclasses.replace(MICRO, positions="learned", head_dim=8)
# Eager op-by-op dispatch is slow on CPU; jit every forward pass in these tests, and keep
# input shapes few so compilations are shared between tests.
_apply = jax.jit(model.apply, static_argnums=0)
_micro_loss = jax.jit(model.make_loss_fn(MICRO))


@functools.cache
def _params(config, seed=0):
    return model.init_params(config, jax.random.key(seed))


def _random_batch(config, key, batch_size=4, seq_len=None):
    seq_len = config.seq_len if seq_len is None else seq_len
    tokens = jax.random.randint(key, (batch_size, seq_len + 1), 0, config.vocab_size, jnp.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def _hand_count(c: model.ModelConfig) -> int:
    """Parameter count from the architecture, written out independently of the code."""
    d, h, f, v = c.d_model, c.num_heads, c.d_ff, c.vocab_size
    k = c.head_dim if c.head_dim is not None else d // h
    attention = 3 * d * h * k + h * k * d  # q, k, v, out kernels (no biases)
    mlp = d * f + f * d  # up, down kernels
    norms = 2 * d  # two RMSNorm scales per block
    total = c.num_layers * (attention + mlp + norms)
    total += d  # final norm
    total += v * d  # token embedding, tied with the output projection
    if c.positions == "learned":
        total += c.seq_len * d
    return total


def _abstract_params(config):
    return jax.eval_shape(functools.partial(model.init_params, config), jax.random.key(0))


@pytest.mark.parametrize("config", [MICRO, ALT], ids=["micro", "alt"])
def test_logits_shape_and_dtype(config):
    params = _params(config)
    for seq_len in (config.seq_len, 5):
        inputs = jnp.zeros((2, seq_len), jnp.int32)
        logits = _apply(config, params, inputs)
        assert logits.shape == (2, seq_len, config.vocab_size)
        assert logits.dtype == jnp.float32
        assert bool(jnp.all(jnp.isfinite(logits)))


def test_params_are_plain_nested_dicts():
    params = _params(MICRO)
    assert type(params) is dict
    for leaf in jax.tree.leaves(params):
        assert isinstance(leaf, jax.Array)
    # Usable directly with optax.
    opt_state = optax.adam(1e-3).init(params)
    assert jax.tree.structure(opt_state[0].mu) == jax.tree.structure(params)


@pytest.mark.parametrize("name", sorted(model.PRESETS))
def test_param_count_matches_hand_formula(name):
    config = model.PRESETS[name]
    abstract = _abstract_params(config)
    assert model.count_params(abstract) == _hand_count(config)


def test_learned_positions_and_head_dim_param_count():
    params = _params(ALT)
    assert params["blocks"][0]["attn"]["query"]["kernel"].shape == (32, 16)
    assert params["position_embed"]["embedding"].shape == (ALT.seq_len, ALT.d_model)
    assert model.count_params(params) == _hand_count(ALT)


@pytest.mark.parametrize(
    "name,paper_millions",
    [("60m", 60), ("150m", 150), ("400m", 400)],
)
def test_paper_shapes_with_32k_vocab_match_their_names(name, paper_millions):
    config = model.get_config(name, vocab_size=32_000)
    count = model.count_params(_abstract_params(config))
    # Hand arithmetic, e.g. 60m: 3 * (4*896*1024 + 8*896^2 + 2*896) + 896 + 32000*896.
    assert count == _hand_count(config)
    assert abs(count / 1e6 - paper_millions) / paper_millions < 0.03


def test_count_params_simple():
    params = {"a": jnp.zeros((2, 3)), "b": {"c": jnp.zeros((4,))}}
    assert model.count_params(params) == 10


def test_flops_per_token_formula():
    c = MICRO
    n = c.num_layers * (4 * c.d_model * c.d_model + 2 * c.d_model * c.d_ff) + 256 * c.d_model
    expected = 6 * n + 12 * c.num_layers * c.d_model * c.seq_len
    assert model.flops_per_token(c) == expected
    assert model.flops_per_token(c, seq_len=8) < expected


@pytest.mark.parametrize("config", [MICRO, ALT], ids=["micro", "alt"])
def test_causality(config):
    params = _params(config)
    inputs = jax.random.randint(jax.random.key(2), (2, config.seq_len), 0, 256, jnp.int32)
    t = 10
    changed = inputs.at[:, t + 1].set((inputs[:, t + 1] + 1) % 256)
    before, after = _apply(config, params, inputs), _apply(config, params, changed)
    np.testing.assert_allclose(before[:, : t + 1], after[:, : t + 1], atol=1e-6)
    assert float(jnp.max(jnp.abs(before[:, t + 1 :] - after[:, t + 1 :]))) > 1e-6


def test_loss_at_init_is_about_log_vocab():
    params = _params(MICRO)
    batch = _random_batch(MICRO, jax.random.key(3), batch_size=8)
    loss = _micro_loss(params, batch)
    assert loss.shape == () and loss.dtype == jnp.float32
    assert abs(float(loss) - math.log(256)) < 0.1


def test_sgd_steps_reduce_loss_on_fixed_batch():
    loss_fn = model.make_loss_fn(MICRO)
    params = _params(MICRO)
    batch = _random_batch(MICRO, jax.random.key(4), batch_size=4)
    opt = optax.sgd(1.0)

    @jax.jit
    def step(params, opt_state):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state = opt.init(params)
    losses = []
    for _ in range(5):
        params, opt_state, loss = step(params, opt_state)
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.05, losses


def test_vmap_and_scan_over_stacked_params():
    loss_fn = model.make_loss_fn(MICRO)
    # Two "workers" with different params: the init and a scaled copy.
    stacked = jax.tree.map(lambda x: jnp.stack([x, 0.5 * x]), _params(MICRO))
    batch = _random_batch(MICRO, jax.random.key(6), batch_size=8)

    def body(params, _):
        loss, grads = jax.vmap(jax.value_and_grad(loss_fn), in_axes=(0, None))(params, batch)
        return jax.tree.map(lambda p, g: p - 0.5 * g, params, grads), loss

    _, losses = jax.jit(lambda p: jax.lax.scan(body, p, None, length=2))(stacked)
    assert losses.shape == (2, 2)
    # Worker 0 of the vmapped scan equals a plain call on its own params.
    single = jax.tree.map(lambda x: x[0], stacked)
    np.testing.assert_allclose(losses[0, 0], _micro_loss(single, batch), rtol=1e-5)


def test_init_model_returns_pure_apply_fn():
    apply_fn, params = model.init_model(MICRO, jax.random.key(0))
    inputs = jnp.ones((2, 5), jnp.int32)
    np.testing.assert_allclose(
        jax.jit(apply_fn)(params, inputs), _apply(MICRO, params, inputs), atol=1e-6
    )


def test_bf16_params_give_float32_loss():
    config = dataclasses.replace(MICRO, dtype="bfloat16")
    params = model.init_params(config, jax.random.key(0))
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
    batch = _random_batch(config, jax.random.key(7), batch_size=2)
    loss, grads = jax.jit(jax.value_and_grad(model.make_loss_fn(config)))(params, batch)
    assert loss.dtype == jnp.float32 and bool(jnp.isfinite(loss))
    assert abs(float(loss) - math.log(256)) < 0.2
    assert all(g.dtype == jnp.bfloat16 for g in jax.tree.leaves(grads))
    logits = jax.eval_shape(functools.partial(model.apply, config), params, batch["inputs"])
    assert logits.dtype == jnp.float32


@pytest.mark.parametrize(
    "overrides",
    [
        {"d_model": 30, "num_heads": 4},  # not divisible
        {"num_layers": 0},
        {"vocab_size": -1},
        {"d_ff": 0},
        {"head_dim": 7},  # odd head dim with rotary
        {"positions": "alibi"},
        {"dtype": "int8"},
    ],
)
def test_bad_config_raises(overrides):
    with pytest.raises(ValueError):
        dataclasses.replace(MICRO, **overrides)


def test_bad_inputs_and_names_raise():
    params = _params(MICRO)
    with pytest.raises(ValueError, match="length"):
        model.apply(MICRO, params, jnp.zeros((1, MICRO.seq_len + 1), jnp.int32))
    with pytest.raises(ValueError, match="inputs_BxL"):
        model.apply(MICRO, params, jnp.zeros((4,), jnp.int32))
    with pytest.raises(ValueError, match="params"):
        model.apply(MICRO, {"token_embed": params["token_embed"]}, jnp.zeros((1, 4), jnp.int32))
    with pytest.raises(ValueError, match="preset"):
        model.get_config("1b")
