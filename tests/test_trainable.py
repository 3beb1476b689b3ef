"""The trainable mask: frozen leaves keep their values bit for bit through inner and outer
steps (weight decay on), carry no optimizer state, and send no bytes; the trainable leaves
train exactly as a model whose frozen leaves are constants."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from quick import quick
from reference import make_data

import diloco_jax as dj
from diloco_jax import hlo

M, H, R = 2, 4, 3
W = np.linspace(-1.0, 1.0, 7).astype(np.float32)  # the frozen leaf: 7 elements, distinctive


def _params():
    return {"w": jnp.asarray(W), "b": jnp.float32(0.5), "c": jnp.zeros(3)}


def _loss(params, batch):
    pred = batch["x"] @ params["c"] + params["b"] + jnp.sum(params["w"]) * 0.1
    return 0.5 * jnp.mean((pred - batch["y"]) ** 2)


MASK = {"w": False, "b": True, "c": True}
OPTIONS = [
    {},
    dict(fragments={"w": 0, "b": 0, "c": 1}),
    dict(outer_delay=1, eager=True),
    dict(outer_delay=2),
    dict(compression="int8,ef=1"),
    dict(drop_probability=0.5, drop_seed=1),
    dict(state_sync={"mu": 2}),
]


# Every option on vmap; on the device backend the ones whose state carries per-worker copies.
CASES = [(o, "vmap") for o in OPTIONS] + [(OPTIONS[i], "shard_map") for i in (0, 1, 2)]


# Quick: the device backend's cases, and compression and drops on vmap; the rest slow.
@pytest.mark.parametrize(
    "options, backend",
    quick(CASES, lambda c: c[1] == "shard_map" or {"compression", "drop_probability"} & set(c[0])),
    ids=[f"{sorted(o)}-{b}" for o, b in CASES],
)
def test_frozen_leaves_stay_bit_for_bit_with_every_option(options, backend):
    rounds = make_data(np.random.default_rng(0), R, M, H)
    result = dj.train_diloco(
        _loss, _params(), rounds, num_rounds=R, num_workers=M, inner_steps=H, backend=backend,
        trainable=MASK, **options,  # default inner AdamW: weight decay 0.1 on every leaf
    )  # fmt: skip
    np.testing.assert_array_equal(result.params["w"], W)
    assert result.params["b"] != 0.5 and not np.array_equal(result.params["c"], np.zeros(3))
    inner_shapes = {x.shape for x in jax.tree.leaves(result.state.inner_opt_state)}
    assert (M, 7) not in inner_shapes  # no Adam moments for the frozen leaf
    outer_shapes = {x.shape for x in jax.tree.leaves(result.state.outer_opt_state)}
    assert (7,) not in outer_shapes and (M, 7) not in outer_shapes  # no outer momentum either


def test_trainable_leaves_train_as_with_frozen_constants():
    rounds = make_data(np.random.default_rng(1), R, M, H)
    run = dict(num_rounds=R, num_workers=M, inner_steps=H, backend="vmap")
    masked = dj.train_diloco(_loss, _params(), rounds, trainable=MASK, **run)
    rest = {k: v for k, v in _params().items() if k != "w"}
    constant = dj.train_diloco(
        lambda p, b: _loss({**p, "w": jnp.asarray(W)}, b), rest, rounds, **run
    )
    for k in rest:
        np.testing.assert_array_equal(masked.params[k], constant.params[k])
    assert [h["loss"] for h in masked.history] == [h["loss"] for h in constant.history]
    # Bytes: only b and c (4 floats) travel, with the exclusion weight and the loss metric.
    assert masked.history[0]["wire_bytes"] == constant.history[0]["wire_bytes"] == 4 + 16 + 4
    assert masked.history[0]["bytes_communicated"] == 16


def test_a_callable_mask_is_the_pytree_mask():
    rounds = make_data(np.random.default_rng(2), R, M, H)
    run = dict(num_rounds=R, num_workers=M, inner_steps=H, backend="vmap")
    by_tree = dj.train_diloco(_loss, _params(), rounds, trainable=MASK, **run)
    by_path = dj.train_diloco(
        _loss, _params(), rounds, trainable=lambda path, leaf: path[0].key != "w", **run
    )
    jax.tree.map(np.testing.assert_array_equal, by_tree.state, by_path.state)


def test_the_compiled_round_exchanges_no_frozen_leaf():
    backend = dj.make_backend("shard_map", M)
    state = dj.init_state(_params(), M, trainable=MASK, exclude_nonfinite=False)
    batch = make_data(np.random.default_rng(3), 1, M, H)[0]
    round_fn = functools.partial(
        dj.diloco_round, _loss, backend=backend, trainable=MASK, exclude_nonfinite=False
    )
    found = hlo.collectives(jax.jit(round_fn).lower(state, batch).compile())
    assert not any((7,) in c.operand_shapes for c in found)
    assert sum(c.operand_bytes for c in found) == (1 + 3) * 4 + 4  # b, c and the mean loss


def test_sync_and_async_keep_frozen_leaves():
    rounds = make_data(np.random.default_rng(4), R, M, H)
    steps = [{k: v[:, h] for k, v in r.items()} for r in rounds for h in range(H)]
    sync = dj.train_sync(_loss, _params(), steps, num_steps=R * H, num_workers=M, trainable=MASK)
    np.testing.assert_array_equal(sync.params["w"], W)
    run = dict(num_workers=M, inner_steps=H, num_updates=3, step_seconds=(1.0, 1.0))
    async_ = dj.train_async(_loss, _params(), rounds, trainable=MASK, **run)
    np.testing.assert_array_equal(async_.params["w"], W)
    assert async_.params["b"] != 0.5


def test_a_state_built_with_another_mask_is_refused():
    state = dj.init_state(_params(), M)
    batch = make_data(np.random.default_rng(5), 1, M, H)[0]
    with pytest.raises(ValueError, match="another trainable mask"):
        dj.diloco_round(_loss, state, batch, trainable=MASK)


@pytest.mark.parametrize(
    "mask, match",
    [
        ({"w": False, "b": True}, "trainable must be a pytree of bools with the params' structure"),
        ({"w": 0, "b": 1, "c": 1}, "trainable must give one bool per param leaf"),
        ({"w": False, "b": False, "c": False}, "trainable freezes every param leaf"),
        (lambda path, leaf: "yes", "trainable must give one bool per param leaf"),
    ],
)
def test_bad_masks_name_trainable(mask, match):
    rounds = make_data(np.random.default_rng(6), 1, M, H)
    with pytest.raises(ValueError, match=match):
        dj.train_diloco(_loss, _params(), rounds, num_rounds=1, num_workers=M, inner_steps=H,
                        trainable=mask)  # fmt: skip
    with pytest.raises(ValueError, match="trainable freezes every leaf of fragment 0"):
        dj.train_diloco(_loss, _params(), rounds, num_rounds=1, num_workers=M, inner_steps=H,
                        trainable=MASK, fragments={"w": 0, "b": 1, "c": 1})  # fmt: skip
