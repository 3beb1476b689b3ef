"""In-graph data: a Sampler gives the same run as the same batches fed from the host."""

import jax.numpy as jnp
import numpy as np
import pytest
from reference import linear_loss, make_data

import diloco_jax as dj


def _table_sampler(rounds):
    """A Sampler that looks up batch [r, m, h] in a device-resident table of all rounds."""
    table = {k: jnp.stack([r[k] for r in rounds]) for k in rounds[0]}  # [R, M, H, ...]
    return dj.Sampler(table, lambda a, r, m, h: {k: v[r, m, h] for k, v in a.items()})


@pytest.mark.parametrize("backend", ["vmap", "shard_map", "pmap"])
def test_sampler_equals_host_batches(backend):
    rounds = make_data(np.random.default_rng(0), num_rounds=3, num_workers=4, inner_steps=2)
    params = {"w": jnp.asarray([0.3, -0.2, 0.1]), "b": jnp.float32(0.5)}
    kw = dict(num_rounds=3, num_workers=4, inner_steps=2, backend=backend)
    host = dj.train_diloco(linear_loss, params, rounds, **kw)
    graph = dj.train_diloco(linear_loss, params, _table_sampler(rounds), **kw)
    np.testing.assert_array_equal(graph.params["w"], host.params["w"])
    np.testing.assert_array_equal(graph.params["b"], host.params["b"])
    assert graph.history == host.history


def test_sync_sampler_uses_step_as_round_index():
    rounds = make_data(np.random.default_rng(1), num_rounds=3, num_workers=2, inner_steps=1)
    params = {"w": jnp.asarray([0.3, -0.2, 0.1]), "b": jnp.float32(0.5)}
    steps = [{k: v[:, 0] for k, v in r.items()} for r in rounds]
    host = dj.train_sync(linear_loss, params, steps, num_steps=3, num_workers=2)
    graph = dj.train_sync(linear_loss, params, _table_sampler(rounds), num_steps=3, num_workers=2)
    np.testing.assert_array_equal(graph.params["w"], host.params["w"])
    assert graph.history == host.history


def test_inner_loop_with_batch_function_needs_num_steps():
    import optax

    opt = optax.sgd(0.1)
    params = {"w": jnp.ones(3), "b": jnp.float32(0)}
    batch = {"x": jnp.ones((2, 3)), "y": jnp.zeros(2)}
    with pytest.raises(ValueError, match="num_steps"):
        dj.inner.inner_loop(linear_loss, opt, params, opt.init(params), lambda h: batch)
    _, _, losses = dj.inner.inner_loop(
        linear_loss, opt, params, opt.init(params), lambda h: batch, num_steps=4
    )
    assert losses.shape == (4,)
    with pytest.raises(ValueError, match="num_workers"):
        dj.diloco_round(
            linear_loss,
            dj.init_state(params, 2, inner_optimizer=opt, outer_optimizer=opt),
            _table_sampler([{"x": 1.0}]),
            inner_optimizer=opt,
            outer_optimizer=opt,
            inner_steps=1,
        )
