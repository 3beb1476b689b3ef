"""The bytes in history agree with the collectives XLA actually compiled into a round."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import linear_loss

import diloco_jax as dj
from diloco_jax import hlo

M, H, DIM = 8, 3, 1000


def _round_program(backend_name, params):
    inner, outer = dj.default_inner_optimizer(), dj.default_outer_optimizer()
    backend = dj.make_backend(backend_name, M)
    state = dj.init_state(params, M, inner_optimizer=inner, outer_optimizer=outer)
    batch = {"x": jnp.ones((M, H, 4, DIM)), "y": jnp.ones((M, H, 4))}
    round_fn = functools.partial(
        dj.diloco_round,
        linear_loss,
        inner_optimizer=inner,
        outer_optimizer=outer,
        backend=backend,
        exclude_nonfinite=False,  # the unweighted exact all-reduce
    )
    return jax.jit(round_fn).lower(state, batch).compile()


def _sync_program(backend_name, params):
    opt = dj.default_inner_optimizer()
    step = functools.partial(dj.sync.sync_step, linear_loss, optimizer=opt, backend=backend_name)
    batch = {"x": jnp.ones((M, 4, DIM)), "y": jnp.ones((M, 4))}
    return jax.jit(step).lower(dj.sync.init_sync_state(params, opt), batch).compile()


@pytest.mark.parametrize("backend", ["shard_map", "pmap"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_round_all_reduces_exactly_the_deltas(backend, dtype):
    params = {"w": jnp.zeros(DIM, dtype), "b": jnp.float32(0)}
    found = hlo.collectives(_round_program(backend, params))
    assert {c.op for c in found} == {"all-reduce"}
    assert not any(c.in_loop for c in found)  # nothing is communicated inside the inner scan
    # Deltas travel in float32 whatever the param dtype: (1000 + 1) x 4 bytes. The one extra
    # float32 scalar is the round's mean loss, reduced from the per-worker losses.
    history = dj.train_diloco(
        linear_loss,
        params,
        [{"x": np.ones((M, H, 4, DIM)), "y": np.ones((M, H, 4))}],
        num_rounds=1,
        num_workers=M,
        inner_steps=H,
        backend=backend,
    ).history
    assert history[0]["bytes_communicated"] == (DIM + 1) * 4
    assert sum(c.operand_bytes for c in found) == (DIM + 1) * 4 + 4


@pytest.mark.parametrize("backend", ["shard_map", "pmap"])
def test_sync_step_all_reduces_the_gradients(backend):
    params = {"w": jnp.zeros(DIM), "b": jnp.float32(0)}
    found = hlo.collectives(_sync_program(backend, params))
    assert sum(c.operand_bytes for c in found) == (DIM + 1) * 4 + 4


def test_vmap_backend_compiles_no_collective():
    params = {"w": jnp.zeros(DIM), "b": jnp.float32(0)}
    assert hlo.collectives(_round_program("vmap", params)) == []
