"""Workers x data meshes: a worker spans several devices, its batch split over a data axis."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from quick import quick
from reference import linear_loss, make_data

import diloco_jax as dj
from diloco_jax import hlo

PARAMS = {"w": jnp.asarray(np.linspace(-1, 1, 16, dtype=np.float32)), "b": jnp.float32(0.5)}


@pytest.mark.parametrize("num_workers, data_parallel", quick([(2, 4), (4, 2), (4, 4)], {(4, 2)}))
def test_data_mesh_matches_vmap(num_workers, data_parallel):
    # (4, 4): two device groups of 4, two workers per group.
    rounds = make_data(np.random.default_rng(0), 3, num_workers, inner_steps=3, batch=8, dim=16)
    kw = dict(num_rounds=3, num_workers=num_workers, inner_steps=3)
    ref = dj.train_diloco(linear_loss, PARAMS, rounds, backend="vmap", **kw)
    mesh = dj.train_diloco(linear_loss, PARAMS, rounds, data_parallel=data_parallel, **kw)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), mesh.params, ref.params
    )
    for h, r in zip(mesh.history, ref.history, strict=True):
        np.testing.assert_allclose(h["worker_loss"], r["worker_loss"], rtol=1e-5)
    steps = [{k: v[:, 0] for k, v in r.items()} for r in rounds]
    sync_ref = dj.train_sync(
        linear_loss, PARAMS, steps, num_steps=3, num_workers=num_workers, backend="vmap"
    )
    sync = dj.train_sync(
        linear_loss,
        PARAMS,
        steps,
        num_steps=3,
        num_workers=num_workers,
        data_parallel=data_parallel,
    )
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
        sync.params,
        sync_ref.params,
    )


def test_gradients_reduce_over_data_every_step_and_deltas_over_workers_once():
    backend = dj.make_backend("shard_map", 2, data_parallel=4)
    assert backend.mesh.shape == {"workers": 2, "data": 4}
    inner, outer = dj.default_inner_optimizer(), dj.default_outer_optimizer()
    state = dj.init_state(PARAMS, 2, inner_optimizer=inner, outer_optimizer=outer)
    batch = backend.place_batches(make_data(np.random.default_rng(1), 1, 2, 3, 8, 16)[0], lead=2)
    round_fn = functools.partial(
        dj.diloco_round, linear_loss, inner_optimizer=inner, outer_optimizer=outer,
        backend=backend, exclude_nonfinite=False,  # the unweighted exchange
    )  # fmt: skip
    found = hlo.collectives(jax.jit(round_fn).lower(state, batch).compile())
    in_loop = [c for c in found if c.in_loop]
    outside = [c for c in found if not c.in_loop]
    # Inside the inner scan: gradients (16 + 1 floats) and the loss over each worker's 4
    # devices; once per round: the deltas over the 2 workers (plus the round's mean loss).
    assert {len(g) for c in in_loop for g in c.replica_groups} == {4}
    assert sum(c.operand_bytes for c in in_loop) == (16 + 1 + 1) * 4
    delta = [c for c in outside if {len(g) for g in c.replica_groups} == {2}]
    assert sum(c.operand_bytes for c in delta) == (16 + 1) * 4 + 4


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(data_parallel=3), "must divide the number of devices"),
        (dict(data_parallel=0), "data_parallel must be an integer"),
        (dict(data_parallel=2, backend="vmap"), "needs backend 'shard_map'"),
        (dict(data_parallel=2, backend="pmap"), "needs backend 'shard_map'"),
        (dict(data_parallel=4, num_workers=3), "num_workers=3 can't be placed"),
    ],
)
def test_bad_data_parallel(kwargs, match):
    kw = dict(num_rounds=1, num_workers=2, inner_steps=1) | kwargs
    rounds = make_data(np.random.default_rng(2), 1, kw["num_workers"], 1, batch=8, dim=16)
    with pytest.raises(ValueError, match=match):
        dj.train_diloco(linear_loss, PARAMS, rounds, **kw)


def test_batch_not_divisible_by_data_parallel():
    rounds = make_data(np.random.default_rng(3), 1, 2, 1, batch=6, dim=16)
    with pytest.raises(ValueError, match="divisible"):
        dj.train_diloco(
            linear_loss, PARAMS, rounds, num_rounds=1, num_workers=2, inner_steps=1, data_parallel=4
        )


def test_two_stage_exchange_on_a_data_mesh_matches_vmap():
    """The int8 two-stage all-reduce over the workers axis of a (workers, data) mesh: the same
    mean as on one device (the layout never changes the arithmetic)."""
    rounds = make_data(np.random.default_rng(2), 2, 4, inner_steps=2, batch=8, dim=16)
    kw = dict(num_rounds=2, num_workers=4, inner_steps=2, compression="int8,ef=1")
    ref = dj.train_diloco(linear_loss, PARAMS, rounds, backend="vmap", **kw)
    mesh = dj.train_diloco(linear_loss, PARAMS, rounds, data_parallel=2, **kw)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), mesh.params, ref.params
    )
    assert mesh.history[-1]["wire_bytes"] == ref.history[-1]["wire_bytes"] > 0
