"""Your own train step (`train_diloco_step`): a worker step `(worker_state, batch, info) ->
(worker_state, metrics)` runs H times a round inside the one compiled round. The loss_fn form
is this contract with worker state (params, inner optimizer state): the two give the same
runs bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from reference import linear_loss, make_data

import diloco_jax as dj
from diloco_jax import inner

M, H, R = 2, 4, 3
PARAMS = {"w": jnp.zeros(3), "b": jnp.float32(0)}
INNER = optax.adamw(1e-2, weight_decay=0.1)


def adam_step(state, batch, info):
    """A hand-written train step: (params, optax state, step counter) -> its next value."""
    params, opt_state, count = state
    loss, grads = jax.value_and_grad(linear_loss)(params, batch)
    updates, opt_state = INNER.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state, count + 1), {"loss": loss}


def params_of(state):
    return state[0]


def with_params(state, params):
    return (params, *state[1:])


def _state():
    return (PARAMS, INNER.init(PARAMS), jnp.zeros((), jnp.int32))


def _rounds():
    return make_data(np.random.default_rng(0), R, M, H)


def _step_run(step=adam_step, rounds=None, **options):
    return dj.train_diloco_step(
        step, _state(), _rounds() if rounds is None else rounds, params_of=params_of,
        with_params=with_params, num_rounds=R, num_workers=M, inner_steps=H, **options,
    )  # fmt: skip


def _loss_run(rounds=None, **options):
    return dj.train_diloco(
        linear_loss, PARAMS, _rounds() if rounds is None else rounds, num_rounds=R,
        num_workers=M, inner_steps=H, inner_optimizer=INNER, **options,
    )  # fmt: skip


def _assert_same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize(
    "options",
    [{}, dict(fragments=2), dict(outer_delay=1), dict(state_sync={"mu": 2}),
     dict(backend="shard_map")],
    ids=["plain", "fragments", "delayed", "state_sync", "shard_map"],
)  # fmt: skip
def test_the_train_step_form_equals_the_loss_fn_form(options):
    by_step, by_loss = _step_run(**options), _loss_run(**options)
    _assert_same(by_step.params, by_loss.params)
    # The worker state holds the optax state the loss_fn form keeps as inner_opt_state.
    _assert_same(by_step.state.inner_opt_state[1], by_loss.state.inner_opt_state)
    for a, b in zip(by_step.history, by_loss.history, strict=True):
        assert a == b


def test_the_rest_of_the_worker_state_stays_with_each_worker():
    result = _step_run()
    np.testing.assert_array_equal(result.state.inner_opt_state[2], [R * H] * M)


def test_step_info_tells_round_worker_step_and_key():
    seen = []

    def step(state, batch, info):
        state, metrics = adam_step(state, batch, info)
        u = jax.random.uniform(info.key, ())
        f = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
        return state, {**metrics, "r": f(info.round), "m": f(info.worker),
                       "h": f(info.step), "u": u}  # fmt: skip

    history = _step_run(step, rng_seed=5).history
    for r, entry in enumerate(history):
        assert entry["worker_r"] == [r] * M and entry["worker_m"] == list(range(M))
        assert entry["h"] == np.mean(range(H))  # mean of 0..H-1
        want = [
            np.mean(
                [
                    float(jax.random.uniform(inner.step_key(inner.worker_key(5, r, m), h), ()))
                    for h in range(H)
                ]
            )
            for m in range(M)
        ]  # fmt: skip
        np.testing.assert_allclose(entry["worker_u"], want, rtol=1e-6)
    del seen


def test_frozen_leaves_of_a_train_step_stay_bit_identical():
    result = _step_run(trainable={"w": True, "b": False})
    assert float(result.params["b"]) == 0.0
    assert not np.array_equal(result.params["w"], PARAMS["w"])


def test_a_train_step_run_resumes_bit_identically(tmp_path):
    whole = _step_run()
    rounds = _rounds()
    dj.train_diloco_step(
        adam_step, _state(), rounds[:1], params_of=params_of, with_params=with_params,
        num_rounds=1, num_workers=M, inner_steps=H, checkpoint_dir=tmp_path,
    )  # fmt: skip
    resumed = _step_run(checkpoint_dir=tmp_path)
    _assert_same(whole.state, resumed.state)
    assert whole.history == resumed.history


@pytest.mark.parametrize(
    "step, kwargs, match",
    [
        (adam_step, dict(inner_optimizer=optax.sgd(0.1)), "a worker step is its own inner"),
        (lambda s, b, i: (s, {"acc": jnp.float32(1)}), {}, "holding 'loss'"),
        (lambda s, b, i: ((s[0]["w"], *s[1:]), {"loss": jnp.float32(1)}), {},
         "worker_step's params"),
        (adam_step, dict(has_aux=True), "unexpected keyword|has_aux"),
    ],
)  # fmt: skip
def test_bad_train_step_input_is_a_clear_error(step, kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        _step_run(step, **kwargs)


def test_params_of_must_be_callable():
    with pytest.raises(ValueError, match="params_of must be a callable"):
        dj.train_diloco_step(
            adam_step, _state(), _rounds(), params_of=None, with_params=with_params,
            num_rounds=R, num_workers=M, inner_steps=H,
        )  # fmt: skip
