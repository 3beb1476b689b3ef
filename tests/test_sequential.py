"""The sequential backend: every worker on one device, one after another (`lax.map`), the
vmap backend's round up to float rounding, each convolution at one worker's shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from quick import quick

import diloco_jax as dj
from diloco_jax.workers import SequentialBackend

M, H, R = 3, 2, 2


def conv_loss(params, batch, key):
    """A one-layer CNN on 6x6 images with a dropout-like key draw (keys must match too)."""
    y = jax.lax.conv_general_dilated(
        batch["x"], params["k"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    keep = jax.random.bernoulli(key, 0.8, y.shape)
    y = jnp.where(keep, jax.nn.relu(y), 0.0).mean(axis=(1, 2)) @ params["w"]
    return jnp.mean((y - batch["y"]) ** 2)


def _data(seed=0):
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.normal(size=(M, H, 4, 6, 6, 2)).astype(np.float32),
            "y": rng.normal(size=(M, H, 4, 3)).astype(np.float32),
        }
        for _ in range(R)
    ]


PARAMS = {
    "k": jnp.asarray(np.random.default_rng(1).normal(size=(3, 3, 2, 5)) * 0.3, jnp.float32),
    "w": jnp.asarray(np.random.default_rng(2).normal(size=(5, 3)) * 0.3, jnp.float32),
}


@pytest.mark.parametrize(
    "options",
    quick(
        [
            {},
            dict(fragments=2),
            dict(state_sync={"mu": 1}),
            dict(drop_probability=0.5, drop_seed=3),
        ],
        lambda o: "fragments" in o or "drop_probability" in o,
    ),
)
def test_sequential_is_the_vmap_round_up_to_rounding(options):
    run = lambda backend: dj.train_diloco(  # noqa: E731
        conv_loss, PARAMS, _data(), num_rounds=R, num_workers=M, inner_steps=H,
        backend=backend, rng_seed=7, **options,
    )  # fmt: skip
    vmap, sequential = run("vmap"), run("sequential")
    for name in PARAMS:
        np.testing.assert_allclose(sequential.params[name], vmap.params[name], rtol=2e-6, atol=1e-7)
    for a, b in zip(vmap.history, sequential.history, strict=True):
        np.testing.assert_allclose(b["worker_loss"], a["worker_loss"], rtol=2e-6)
    # Not a relabelled vmap: the trained params moved, and differ across the two programs
    # only in rounding.
    assert not np.allclose(vmap.params["k"], PARAMS["k"])


def _conv_operands(fn, *args) -> set:
    """The operand shapes of every convolution in `fn`'s program (nested ones included)."""
    found = set()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "conv_general_dilated":
                found.add(tuple(tuple(v.aval.shape) for v in eqn.invars))
            for value in eqn.params.values():
                for sub in value if isinstance(value, tuple | list) else (value,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def test_each_convolution_runs_at_one_workers_shapes():
    backend = dj.make_backend("sequential", M)
    assert isinstance(backend, SequentialBackend) and backend.devices == (jax.devices()[0],)
    state, batches = dj.init_state(PARAMS, M), _data()[0]
    one_worker = {k: v[0, 0] for k, v in batches.items()}
    # One worker's step, on its own: the convolutions a worker's step is made of.
    want = _conv_operands(jax.grad(conv_loss), PARAMS, one_worker, jax.random.PRNGKey(0))

    def round_convs(backend):
        return _conv_operands(
            lambda s, b: dj.diloco_round(conv_loss, s, b, backend=backend, rng_seed=0),
            state,
            batches,
        )

    assert round_convs(backend) == want
    # Under vmap the workers' kernels are batched into grouped convolutions of other shapes.
    assert round_convs("vmap") != want
