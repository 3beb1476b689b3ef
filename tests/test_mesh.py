"""Sharded workers on the user's mesh (`train_diloco(mesh=, param_sharding=)`): on 8 fake
devices, (workers=2, fsdp=2, tensor=2) and (workers=2, fsdp=4) runs equal the vmap run on the
same data; every state leaf's shard has the size its spec says; the cross-worker collectives
the compiler emits carry exactly `wire_bytes_per_device`; checkpoints restore onto the same
and onto another mesh shape; bad placement input is a ValueError naming the argument."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from quick import quick
from reference import precision

import diloco_jax as dj
from diloco_jax import hlo
from diloco_jax import placement as placement_lib

M, H, R = 2, 4, 3
D_IN, D_HID, D_OUT, B = 8, 16, 4, 8


def mlp_loss(params, batch):
    hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean((hidden @ params["w2"] - batch["y"]) ** 2)


def _params(dtype=jnp.float32):
    rng = np.random.default_rng(0)
    return {
        "w1": jnp.asarray(rng.normal(size=(D_IN, D_HID)) * 0.3, dtype),
        "b1": jnp.zeros(D_HID, dtype),
        "w2": jnp.asarray(rng.normal(size=(D_HID, D_OUT)) * 0.3, dtype),
    }


def _rounds(dtype=np.float32):
    rng = np.random.default_rng(1)
    return [
        {"x": rng.normal(size=(M, H, B, D_IN)).astype(dtype),
         "y": rng.normal(size=(M, H, B, D_OUT)).astype(dtype)}
        for _ in range(R)
    ]  # fmt: skip


def _mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


MESHES = {
    "fsdp2xtensor2": (
        (2, 2, 2), ("workers", "fsdp", "tensor"),
        {"w1": P("fsdp", "tensor"), "b1": P("tensor"), "w2": P("tensor", "fsdp")},
    ),
    "fsdp4": (
        (2, 4), ("workers", "fsdp"), {"w1": P(None, "fsdp"), "b1": P("fsdp"), "w2": P("fsdp")}
    ),
}  # fmt: skip


def _run(mesh_name=None, dtype=jnp.float32, **options):
    if mesh_name is None:  # both meshes compare against the same vmap run: run it once
        key = tuple(sorted(options.items()))
        try:
            return _vmap_run(dtype, key)
        except TypeError:  # an unhashable option (a dict): run it each time
            return _vmap_run.__wrapped__(dtype, key)
    common = dict(num_rounds=R, num_workers=M, inner_steps=H, **options)
    shape, names, specs = MESHES[mesh_name]
    return dj.train_diloco(
        mlp_loss, _params(dtype), _rounds(dtype), mesh=_mesh(shape, names),
        param_sharding=specs, **common,
    )  # fmt: skip


@functools.cache
def _vmap_run(dtype, options):
    common = dict(num_rounds=R, num_workers=M, inner_steps=H, **dict(options))
    return dj.train_diloco(mlp_loss, _params(dtype), _rounds(dtype), backend="vmap", **common)


def _close(a, b, rtol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=rtol)


SGD_CASES = {
    "plain": {},
    "fragments": dict(fragments=2),
    "delayed": dict(outer_delay=1),
    "eager": dict(outer_delay=1, eager=True),
    "faults": dict(drop_probability=0.4, worker_steps=(4, 3)),
    "des_loc": dict(state_sync={"trace": 2}, inner_optimizer=optax.sgd(0.05, momentum=0.9)),
    "muloco": dict(inner_optimizer=dj.muon_inner_optimizer(0.02)),
}


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("case", quick(SGD_CASES, {"plain", "fragments", "muloco"}))
def test_a_sharded_run_equals_the_vmap_run(mesh_name, case):
    options = {"inner_optimizer": optax.sgd(0.05), **SGD_CASES[case]}
    ref, got = _run(None, **options), _run(mesh_name, **options)
    _close(ref.params, got.params, 1e-5)
    _close(ref.state, got.state, 1e-5)
    for a, b in zip(ref.history, got.history, strict=True):
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-5)
    # The params keep their specs; the per-worker state is split over workers too.
    _, _, specs = MESHES[mesh_name]
    for name, spec in specs.items():
        assert got.params[name].sharding.spec == spec


# The default inner AdamW (Muon for MuLoCo); DES-LOC syncs Adam's two moments.
ADAM_CASES = {
    **{k: v for k, v in SGD_CASES.items() if k not in ("des_loc", "muloco")},
    "des_loc": dict(state_sync={"mu": 4, "nu": 8}),
    "muloco": dict(inner_optimizer=dj.muon_inner_optimizer(0.02)),
}


# Each case on both meshes with SGD in float32 above; here each on one of them (dealt in
# turn, so each mesh runs Adam's sharded moments in float64 with half the cases).
ADAM_GRID = [(case, list(MESHES)[i % len(MESHES)]) for i, case in enumerate(ADAM_CASES)]


@pytest.mark.parametrize(
    "case, mesh_name", quick(ADAM_GRID, lambda c: c[0] in ("plain", "des_loc"))
)
def test_adam_in_float64_equals_the_vmap_run(case, mesh_name):
    with precision("float64"):
        options = ADAM_CASES[case]
        ref, got = _run(None, jnp.float64, **options), _run(mesh_name, jnp.float64, **options)
        _close(ref.params, got.params, 1e-12)
        _close(ref.state, got.state, 1e-12)
        for a, b in zip(ref.history, got.history, strict=True):  # recorded in float32
            np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-6)


def test_every_state_leaf_holds_the_shard_its_spec_says():
    result = _run("fsdp2xtensor2", outer_delay=1)
    state = result.state
    device0 = jax.devices()[0]

    def shard_shape(x):
        return next(s.data.shape for s in x.addressable_shards if s.device == device0)

    # θ and the outer momentum: w1 [8, 16] at (fsdp, tensor) -> [4, 8] on each device.
    assert shard_shape(state.params["w1"]) == (4, 8)
    assert shard_shape(state.outer_opt_state[0].trace["w1"]) == (4, 8)
    assert shard_shape(state.params["w2"]) == (8, 2)
    assert shard_shape(state.params["b1"]) == (8,)
    # Per-worker fields: [M, ...] split over workers and the spec.
    mu = state.inner_opt_state[0].mu
    assert shard_shape(mu["w1"]) == (1, 4, 8) and shard_shape(mu["w2"]) == (1, 8, 2)
    assert shard_shape(state.parts["delay"].deltas[0]["w1"]) == (1, 4, 8)
    # Per device, the matrices' leaves hold 1/4 of what the replicated layout puts there
    # (each of a worker's 4 devices a whole copy of its worker's slice).
    matrices = [
        x
        for path, x in jax.tree_util.tree_flatten_with_path(state)[0]
        if "'w1'" in jax.tree_util.keystr(path) or "'w2'" in jax.tree_util.keystr(path)
    ]
    sharded = sum(np.prod(shard_shape(x)) * x.dtype.itemsize for x in matrices)
    replicated = sum(
        x.nbytes / (M if x.sharding.spec and x.sharding.spec[0] == "workers" else 1)
        for x in matrices
    )
    assert sharded / replicated == 0.25


@pytest.mark.parametrize("mesh_name", quick([*MESHES, "data_parallel"], {"fsdp2xtensor2"}))
def test_per_device_wire_bytes_are_the_compiled_cross_worker_collectives(mesh_name):
    params, (batch,) = _params(), _rounds()[:1]
    if mesh_name == "data_parallel":
        backend = dj.make_backend("shard_map", M, data_parallel=4)
        result = dj.train_diloco(
            mlp_loss, params, [batch], num_rounds=1, num_workers=M, inner_steps=H,
            data_parallel=4,
        )  # fmt: skip
        placed = None
        per_device = result.history[0]["wire_bytes_per_device"]
        # Replicated inside each worker: every device all-reduces all of the params.
        assert per_device == result.history[0]["wire_bytes"] == 4 * (128 + 64 + 16) + 8
    else:
        shape, names, specs = MESHES[mesh_name]
        mesh = _mesh(shape, names)
        backend = dj.make_backend("auto", M, mesh=mesh)
        result = dj.train_diloco(
            mlp_loss, params, [batch], num_rounds=1, num_workers=M, inner_steps=H, mesh=mesh,
            param_sharding=specs,
        )  # fmt: skip
        placed = placement_lib.placement(
            params, backend.mesh,
            placement_lib.resolve_param_specs(params, backend.mesh, specs), [(0, 1, 2)],
        )  # fmt: skip
        per_device = result.history[0]["wire_bytes_per_device"]
        # A device sends its shards' float32 bytes (w1 [8, 16] and w2 [16, 4] 4 ways; b1 [16]
        # 2 ways on (fsdp, tensor), 4 ways on fsdp=4), plus the loss and the exclusion count:
        # 4 bytes each; a ring all-reduce over M = 2 sends 2 (M - 1) / M = 1 x its operand.
        shards = {"fsdp2xtensor2": 128 / 4 + 64 / 4 + 16 / 2, "fsdp4": (128 + 64 + 16) / 4}
        assert per_device == 4 * shards[mesh_name] + 8
        assert result.history[0]["wire_bytes"] == 4 * (128 + 64 + 16) + 8
    state = dj.init_state(params, M)
    if placed is not None:
        state = jax.device_put(state, placed.shardings(state))
    batches = backend.place_batches(batch, 2)
    compiled = (
        jax.jit(functools.partial(dj.diloco_round, mlp_loss, backend=backend))
        .lower(state, batches)
        .compile()
    )
    assert hlo.cross_worker_wire_bytes(compiled, M, 8) == per_device


@pytest.mark.parametrize(
    "options",
    quick([dict(fragments=2), dict(compression="int8"), dict(outer_delay=1, eager=True)],
          lambda o: "fragments" in o),
    ids=["fragments", "int8", "eager"],
)  # fmt: skip
def test_the_low_level_api_on_a_mesh_backend_equals_train_diloco(options):
    """`make_backend(mesh=, worker_axis=, param_sharding=)`, `init_state(..., backend=)` and
    `jit_round`: the state built at its shards, the rounds keep them, the run ends bit for bit
    where train_diloco's does on the same mesh, and the compiled collectives carry exactly its
    `wire_bytes_per_device`. `on_user_mesh` hands the arrays back on the user's mesh (the
    same buffers), the worker axis by its own name."""
    mesh = _mesh((2, 2, 2), ("replica", "fsdp", "tensor"))
    specs = MESHES["fsdp2xtensor2"][2]
    method = dj.method.method_from_options(None, dict(options), caller="test")
    backend = dj.make_backend("auto", M, mesh=mesh, worker_axis="replica", param_sharding=specs)
    state = dj.init_state(_params(), M, method, backend=backend)
    assert state.inner_opt_state[0].mu["w1"].sharding.spec == P("workers", "fsdp", "tensor")
    step = dj.jit_round(mlp_loss, method, backend=backend)
    for batches in _rounds():
        state, _ = step(state, backend.place_batches(batches, lead=2))
    ref = dj.train_diloco(
        mlp_loss, _params(), _rounds(), num_rounds=R, num_workers=M, inner_steps=H,
        method=method, mesh=mesh, worker_axis="replica", param_sharding=specs,
    )  # fmt: skip
    mine = backend.on_user_mesh(state)
    for a, b in zip(jax.tree.leaves(ref.state), jax.tree.leaves(mine), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # the same program
        assert a.sharding == b.sharding
    mu = mine.inner_opt_state[0].mu["w2"]
    assert mu.sharding == jax.NamedSharding(mesh, P("replica", "tensor", "fsdp"))
    before = {
        s.device: s.data.unsafe_buffer_pointer()
        for s in state.inner_opt_state[0].mu["w1"].addressable_shards
    }
    after = {
        s.device: s.data.unsafe_buffer_pointer()
        for s in mine.inner_opt_state[0].mu["w1"].addressable_shards
    }
    assert before == after
    # The collectives of the compiled round: each device's shards of the exchange.
    batches = backend.place_batches(_rounds()[0], 2)
    round_ = functools.partial(dj.diloco_round, mlp_loss, method=method, backend=backend)
    compiled = jax.jit(round_).lower(state, batches).compile()
    per_round = ref.history[0]["wire_bytes_per_device"]
    assert hlo.cross_worker_wire_bytes(compiled, M, 8) == per_round


@pytest.mark.parametrize("given", ["param_specs", "nothing"])
def test_jit_round_keeps_a_state_placed_by_hand_at_its_shards(given):
    """A mesh backend built without param_sharding and a state put at its shards by hand:
    jit_round keeps every leaf where it was (with param_specs= it constrains the new state
    to them; without, nothing tells it the specs, so it adds no constraint that would
    replicate them)."""
    shape, names, specs = MESHES["fsdp2xtensor2"]
    backend = dj.make_backend("auto", M, mesh=_mesh(shape, names))
    params = _params()
    resolved = placement_lib.resolve_param_specs(params, backend.mesh, specs)
    placed = placement_lib.placement(params, backend.mesh, resolved, [(0, 1, 2)])
    state = dj.init_state(params, M)
    state = jax.device_put(state, placed.shardings(state))
    want = [x.sharding.spec for x in jax.tree.leaves(state)]
    options = {"param_specs": resolved} if given == "param_specs" else {}
    step = dj.jit_round(mlp_loss, backend=backend, **options)
    for batches in _rounds()[:2]:
        state, _ = step(state, backend.place_batches(batches, 2))
    assert [x.sharding.spec for x in jax.tree.leaves(state)] == want
    assert state.inner_opt_state[0].mu["w1"].sharding.spec == P("workers", "fsdp", "tensor")


def _meshes(tree):
    return {x.sharding.mesh for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)}


def test_a_users_explicit_mesh_with_its_own_worker_axis_name():
    """`jax.make_mesh` as a user calls it (Explicit axes) with the workers on "replica": the
    run equals the vmap run and every array comes back on that very mesh; train_sync and
    train_async too. A state put on that mesh by hand is refused by the round with the
    way out, and a Backend's param_sharding can't be given twice."""
    mesh = jax.make_mesh((2, 4), ("replica", "fsdp"))
    specs = MESHES["fsdp4"][2]
    inner = optax.sgd(0.05, momentum=0.9)
    options = dict(num_rounds=R, num_workers=M, inner_steps=H, inner_optimizer=inner)
    ref = dj.train_diloco(mlp_loss, _params(), _rounds(), backend="vmap", **options)
    placed = dict(mesh=mesh, worker_axis="replica", param_sharding=specs)
    got = dj.train_diloco(mlp_loss, _params(), _rounds(), **placed, **options)
    _close(ref.params, got.params, 1e-5)
    _close(ref.state, got.state, 1e-5)
    assert got.params["w1"].sharding == jax.NamedSharding(mesh, P(None, "fsdp"))
    trace = got.state.inner_opt_state[0].trace["w1"]
    assert trace.sharding == jax.NamedSharding(mesh, P("replica", None, "fsdp"))
    assert _meshes(got.state) == {mesh}
    steps = [{k: v[:, h] for k, v in r.items()} for r in _rounds() for h in range(H)]
    sync = dj.train_sync(
        mlp_loss, _params(), steps, num_steps=2, num_workers=M, optimizer=inner, **placed
    )
    assert _meshes((sync.params, sync.state)) == {mesh}
    asyn = dj.train_async(
        mlp_loss, _params(), _rounds(), num_workers=M, inner_steps=H, num_updates=2,
        step_seconds=(1.0, 1.7), inner_optimizer=inner, **placed,
    )  # fmt: skip
    assert _meshes((asyn.params, asyn.state)) == {mesh}
    backend = dj.make_backend("auto", M, mesh=mesh, worker_axis="replica", param_sharding=specs)
    by_hand = jax.device_put(
        dj.init_state(_params(), M), jax.NamedSharding(mesh, P())
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"state holds arrays on a mesh with Explicit axes"):
        dj.diloco_round(mlp_loss, by_hand, _rounds()[0], backend=backend)
    with pytest.raises(ValueError, match="param_sharding given twice"):
        dj.train_diloco(
            mlp_loss, _params(), _rounds(), backend=backend, param_sharding=specs, **options
        )
    # The backend's own param_sharding, given no other: the run above, bit for bit.
    again = dj.train_diloco(mlp_loss, _params(), _rounds(), backend=backend, **options)
    for a, b in zip(jax.tree.leaves(got.state), jax.tree.leaves(again.state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(param_sharding={"w1": P()}), "param_sharding needs a mesh"),
        (dict(worker_axis="replica"), "worker_axis needs a mesh"),
        (dict(mesh=_mesh((2, 4), ("workers", "fsdp")), param_sharding={"w1": "fsdp"}),
         "param_sharding must be a pytree of PartitionSpecs"),
    ],
)  # fmt: skip
def test_make_backend_refuses_placement_options_it_cant_use(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dj.make_backend("auto", M, **kwargs)


def test_a_spec_tree_missing_a_key_names_it():
    common = dict(num_rounds=R, num_workers=M, inner_steps=H)
    mesh = _mesh((2, 2, 2), ("workers", "fsdp", "tensor"))
    cases = [
        ({"w1": P("fsdp", "tensor"), "b1": P("tensor")}, r"\(missing: \['w2'\]\)$"),
        ({"w1": P(), "b1": P(), "w2": P(), "w3": P("fsdp")}, r"\(extra: \['w3'\]\)$"),
    ]
    for specs, match in cases:
        with pytest.raises(ValueError, match=r"param_sharding must be .*" + match):
            dj.train_diloco(
                mlp_loss, _params(), _rounds(), mesh=mesh, param_sharding=specs, **common
            )


def test_an_indivisible_batch_names_the_default_batch_sharding_as_the_default():
    mesh = _mesh((2, 2, 2), ("workers", "fsdp", "tensor"))
    odd = [jax.tree.map(lambda x: x[:, :, :6], r) for r in _rounds()]  # B = 6, 4 ways
    common = dict(num_rounds=R, num_workers=M, inner_steps=H, mesh=mesh)
    with pytest.raises(
        ValueError,
        match=r"the default batch_sharding .*pass batch_sharding= .*size 6, not divisible by 4",
    ):
        dj.train_diloco(mlp_loss, _params(), odd, **common)
    with pytest.raises(ValueError, match=r"^batch_sharding .*size 6, not divisible by 4"):
        dj.train_diloco(mlp_loss, _params(), odd, batch_sharding=P(("tensor", "fsdp")), **common)


def test_a_sharded_checkpoint_restores_onto_the_same_and_another_mesh(tmp_path):
    whole = _run("fsdp2xtensor2")
    shape, names, specs = MESHES["fsdp2xtensor2"]
    common = dict(num_workers=M, inner_steps=H, checkpoint_dir=tmp_path)
    dj.train_diloco(
        mlp_loss, _params(), _rounds()[:1], num_rounds=1, mesh=_mesh(shape, names),
        param_sharding=specs, **common,
    )  # fmt: skip
    # The rest on (workers=2, fsdp=4): restored onto the other mesh's shardings.
    shape4, names4, specs4 = MESHES["fsdp4"]
    resumed = dj.train_diloco(
        mlp_loss, _params(), _rounds(), num_rounds=R, mesh=_mesh(shape4, names4),
        param_sharding=specs4, **common,
    )  # fmt: skip
    _close(whole.state, resumed.state, 1e-5)
    assert resumed.params["w1"].sharding.spec == specs4["w1"]
    # And onto the same mesh: bit for bit.
    again = tmp_path / "again"
    first = dict(mesh=_mesh(shape, names), param_sharding=specs, num_workers=M, inner_steps=H)
    dj.train_diloco(mlp_loss, _params(), _rounds()[:1], num_rounds=1, checkpoint_dir=again, **first)
    same = dj.train_diloco(
        mlp_loss, _params(), _rounds(), num_rounds=R, checkpoint_dir=again, **first
    )
    for a, b in zip(jax.tree.leaves(whole.state), jax.tree.leaves(same.state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_params_placed_by_the_user_keep_their_sharding():
    shape, names, specs = MESHES["fsdp4"]
    mesh = _mesh(shape, names)
    params = {k: jax.device_put(v, jax.NamedSharding(mesh, specs[k])) for k, v in _params().items()}
    result = dj.train_diloco(
        mlp_loss, params, _rounds(), num_rounds=R, num_workers=M, inner_steps=H, mesh=mesh
    )
    assert result.params["w1"].sharding.spec == P(None, "fsdp")
    assert result.state.inner_opt_state[0].mu["w1"].sharding.spec == P("workers", None, "fsdp")


def test_a_callable_param_sharding_and_a_batch_sharding_equal_the_vmap_run():
    def spec_of(path, leaf):  # matrices over (fsdp, tensor), vectors over tensor
        return P("fsdp", "tensor") if leaf.ndim == 2 else P("tensor")

    options = dict(num_rounds=R, num_workers=M, inner_steps=H, inner_optimizer=optax.sgd(0.05))
    ref = dj.train_diloco(mlp_loss, _params(), _rounds(), backend="vmap", **options)
    got = dj.train_diloco(
        mlp_loss, _params(), _rounds(), mesh=_mesh((2, 2, 2), ("workers", "fsdp", "tensor")),
        param_sharding=spec_of, batch_sharding=P("tensor"), **options,
    )  # fmt: skip
    _close(ref.params, got.params, 1e-5)
    for a, b in zip(ref.history, got.history, strict=True):
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-5)
    assert got.params["w2"].sharding.spec == P("fsdp", "tensor")
    assert got.params["b1"].sharding.spec == P("tensor")
    assert got.state.outer_opt_state[0].trace["w1"].sharding.spec == P("fsdp", "tensor")
    # Each device all-reduces its shards (a quarter of w1 and w2, half of b1) in float32,
    # plus the loss and the exclusion count.
    assert got.history[0]["wire_bytes_per_device"] == 4 * (128 / 4 + 64 / 4 + 16 / 2) + 8


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(mesh=_mesh((8,), ("data",))), "mesh has no worker_axis 'workers'"),
        (dict(mesh=_mesh((4, 2), ("workers", "fsdp"))), "must equal the size 4"),
        (dict(param_sharding={"w1": P("model"), "b1": P(), "w2": P()}), "names 'model'"),
        (dict(param_sharding={"w1": P("workers"), "b1": P(), "w2": P()}), "worker axis"),
        (dict(param_sharding={"w1": P(None, None, "fsdp"), "b1": P(), "w2": P()}), "more entries"),
        (dict(param_sharding={"w1": P()}), "param_sharding must be a pytree"),
        (dict(batch_sharding=P("tensor")), "batch_sharding"),
        (dict(data_parallel=2), "mesh= replaces devices= and data_parallel="),
    ],
)  # fmt: skip
def test_bad_placement_input_names_the_argument(kwargs, match):
    kwargs = {"mesh": _mesh((2, 4), ("workers", "fsdp")), **kwargs}
    with pytest.raises(ValueError, match=match):
        dj.train_diloco(
            mlp_loss, _params(), _rounds(), num_rounds=R, num_workers=M, inner_steps=H, **kwargs
        )


def test_a_dim_not_divisible_by_its_axes_is_refused():
    with pytest.raises(
        ValueError, match=r"param_sharding\['w'\].*dim 0 of size 6 is not divisible"
    ):
        dj.train_diloco(
            lambda p, b: jnp.sum(p["w"]) * jnp.mean(b), {"w": jnp.zeros(6)},
            [np.ones((M, H, 8), np.float32)], num_rounds=1, num_workers=M, inner_steps=H,
            mesh=_mesh((2, 4), ("workers", "fsdp")), param_sharding={"w": P("fsdp")},
        )  # fmt: skip


def test_placement_options_without_a_mesh_are_refused():
    with pytest.raises(ValueError, match="param_sharding needs a mesh"):
        dj.train_diloco(
            mlp_loss, _params(), _rounds(), num_rounds=R, num_workers=M, inner_steps=H,
            param_sharding={"w1": P()},
        )  # fmt: skip


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_train_sync_on_a_mesh_equals_vmap(mesh_name):
    shape, names, specs = MESHES[mesh_name]
    steps = [{k: v[:, h] for k, v in r.items()} for r in _rounds() for h in range(H)]
    common = dict(num_steps=len(steps), num_workers=M, optimizer=optax.sgd(0.05))
    ref = dj.train_sync(mlp_loss, _params(), steps, backend="vmap", **common)
    got = dj.train_sync(
        mlp_loss, _params(), steps, mesh=_mesh(shape, names), param_sharding=specs, **common
    )
    _close(ref.params, got.params, 1e-5)
    assert got.params["w1"].sharding.spec == specs["w1"]
    # Each step all-reduces the device's gradient shards and the loss (M = 2: 1 x operand).
    shards = {"fsdp2xtensor2": 128 / 4 + 64 / 4 + 16 / 2, "fsdp4": (128 + 64 + 16) / 4}
    assert got.history[0]["wire_bytes_per_device"] == 4 * shards[mesh_name] + 4


def test_model_state_and_a_train_step_run_on_a_mesh():
    """Issue 23's parts on (workers, fsdp): a model state merged by its rules, and a worker
    step, each equal to the vmap run. The model state sits where docs/devices.md says: each
    worker's copy whole on its devices (a leaf shaped like b1, which fsdp splits, included),
    the merged leaves whole on every device, the kept ones per worker."""
    shape, names, specs = MESHES["fsdp4"]
    mesh = _mesh(shape, names)
    inner = optax.sgd(0.05)

    def loss_ms(params, model_state, batch):
        hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
        new = {
            "avg": 0.9 * model_state["avg"] + 0.1 * jnp.mean(batch["x"], axis=0),
            "hidden": jnp.mean(hidden, axis=0),  # b1's shape
            "count": model_state["count"] + 1,  # an int: kept per worker
        }
        return mlp_loss(params, batch), new

    ms = {"avg": jnp.zeros(D_IN), "hidden": jnp.zeros(D_HID), "count": jnp.int32(0)}
    common = dict(num_rounds=R, num_workers=M, inner_steps=H, model_state=ms, inner_optimizer=inner)
    ref = dj.train_diloco(loss_ms, _params(), _rounds(), backend="vmap", **common)
    got = dj.train_diloco(loss_ms, _params(), _rounds(), mesh=mesh, param_sharding=specs, **common)
    _close(ref.model_state, got.model_state, 1e-6)
    _close(ref.params, got.params, 1e-5)
    assert specs["b1"] == P("fsdp")
    assert {k: v.sharding.spec for k, v in got.state.model_state.items()} == {
        "avg": P("workers"),
        "hidden": P("workers"),
        "count": P("workers"),
    }
    assert {k: v.sharding.spec for k, v in got.model_state.items()} == {
        "avg": P(),
        "hidden": P(),
        "count": P("workers"),
    }
    assert got.model_state["count"].shape == (M,)

    def step(state, batch, info):
        params, opt_state = state
        loss, grads = jax.value_and_grad(mlp_loss)(params, batch)
        updates, opt_state = inner.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": loss}

    by_step = dj.train_diloco_step(
        step, (_params(), inner.init(_params())), _rounds(), params_of=lambda s: s[0],
        with_params=lambda s, p: (p, s[1]), num_rounds=R, num_workers=M, inner_steps=H,
        mesh=mesh, param_sharding=specs,
    )  # fmt: skip
    _close(ref.params, by_step.params, 1e-5)
    assert by_step.state.inner_opt_state[0]["w1"].sharding.spec == P("workers", None, "fsdp")


def test_the_state_is_built_in_place_on_the_mesh():
    """A zero-round run returns init_state's values, every leaf already at its shards."""
    shape, names, specs = MESHES["fsdp2xtensor2"]
    result = dj.train_diloco(
        mlp_loss, _params(), [], num_rounds=0, num_workers=M, inner_steps=H,
        mesh=_mesh(shape, names), param_sharding=specs, outer_delay=1,
    )  # fmt: skip
    eager = dj.init_state(_params(), M, outer_delay=1)
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(result.state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    deltas = result.state.parts["delay"].deltas
    assert deltas[0]["w1"].sharding.spec == P("workers", "fsdp", "tensor")
    assert result.state.outer_opt_state[0].trace["w2"].sharding.spec == P("tensor", "fsdp")


def _async(mesh_name=None, dtype=jnp.float32, **options):
    common = dict(num_workers=M, inner_steps=H, step_seconds=(1.0, 1.7), **options)
    if mesh_name is None:
        return dj.train_async(mlp_loss, _params(dtype), _rounds(dtype), **common)
    shape, names, specs = MESHES[mesh_name]
    return dj.train_async(
        mlp_loss, _params(dtype), _rounds(dtype), mesh=_mesh(shape, names),
        param_sharding=specs, **common,
    )  # fmt: skip


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_train_async_on_a_mesh_equals_one_device(mesh_name):
    """Asynchronous DiLoCo (Adam, float64; stale arrivals: worker 1 is 1.7x slower): worker
    m's jobs on the mesh's slice m, sharded by the specs, end where the one-device run does;
    θ keeps its specs, the per-worker inner state is [M, ...] at P(workers, *spec)."""
    with precision("float64"):
        ref, got = (
            _async(None, jnp.float64, num_updates=4),
            _async(mesh_name, jnp.float64, num_updates=4),
        )
        _close(ref.params, got.params, 1e-12)
        _close(ref.state, got.state, 1e-12)
    assert [e["staleness"] for e in got.history] == [e["staleness"] for e in ref.history]
    assert max(e["staleness"] for e in got.history) > 0
    for a, b in zip(ref.history, got.history, strict=True):
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-12)
    # Each arrival: the job's worker sends a float64 delta, |θ| = 128 + 16 + 64, and each of
    # its devices its shard of it; the counts are averaged over the M workers.
    shard = {"fsdp2xtensor2": 128 / 4 + 16 / 2 + 64 / 4, "fsdp4": (128 + 16 + 64) / 4}[mesh_name]
    for done, entry in enumerate(got.history, start=1):
        assert entry["wire_bytes"] == round(done * 8 * (128 + 16 + 64) / M)
        assert entry["wire_bytes_per_device"] == round(done * 8 * shard / M)
    assert "wire_bytes_per_device" not in ref.history[0]
    shape, names, specs = MESHES[mesh_name]
    mesh = _mesh(shape, names)
    mu = got.state.inner_opt_state[0].mu
    for name, spec in specs.items():
        assert got.params[name].sharding.spec == spec
        assert mu[name].sharding.spec == P("workers", *spec)
        want = placement_lib.shard_shape(mu[name].shape, P("workers", *spec), mesh)
        assert {s.data.shape for s in mu[name].addressable_shards} == {want}


def test_train_async_on_a_mesh_resumes_bit_for_bit(tmp_path):
    """2 checkpointed updates, then a call for 4 that resumes them on the mesh: the run of 4
    in one go, bit for bit (each worker's inner state and job start restored onto its own
    devices)."""
    whole = _async("fsdp4", num_updates=4)
    _async("fsdp4", num_updates=2, checkpoint_dir=tmp_path)
    resumed = _async("fsdp4", num_updates=4, checkpoint_dir=tmp_path)
    for a, b in zip(jax.tree.leaves(whole.state), jax.tree.leaves(resumed.state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert resumed.history == whole.history
    mu = resumed.state.inner_opt_state[0].mu["w1"]
    assert mu.sharding.spec == P("workers", None, "fsdp")


def test_train_async_on_a_mesh_with_a_sampler_equals_one_device():
    """A Sampler's arrays replicated on each worker's devices, drawn inside its jobs: the
    one-device run's params."""
    rounds = _rounds()
    arrays = jax.tree.map(lambda *xs: jnp.stack(xs), *rounds)  # [R, M, H, B, ...]

    def sample(arrays, round_index, worker, step):
        return jax.tree.map(lambda x: x[round_index, worker, step], arrays)

    sampler = dj.Sampler(arrays, sample)
    shape, names, specs = MESHES["fsdp4"]
    common = dict(num_workers=M, inner_steps=H, step_seconds=(1.0, 1.7), num_updates=4,
                  inner_optimizer=optax.sgd(0.05))  # fmt: skip
    ref = dj.train_async(mlp_loss, _params(), sampler, **common)
    got = dj.train_async(
        mlp_loss, _params(), sampler, mesh=_mesh(shape, names), param_sharding=specs, **common
    )
    _close(ref.params, got.params, 1e-5)
    assert got.params["w1"].sharding.spec == specs["w1"]


def _halos(mesh_name=None, dtype=jnp.float32, **options):
    """HALoS, a region per worker, a push at each local update, hops on both levels (server
    messages in flight between arrivals)."""
    server = dj.HALoS(regions=(0, 1), local_updates=1, worker_seconds=0.2, region_seconds=0.5)
    return _async(mesh_name, dtype, server=server, **options)


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_halos_on_a_mesh_equals_one_device(mesh_name):
    """HALoS's workers on their slices of the mesh, the servers' θ at the specs over all of
    it: the one-device run's θ and history (float64), each device's bytes its shards."""
    with precision("float64"):
        ref, got = _halos(None, jnp.float64, num_updates=4), _halos(mesh_name, jnp.float64,
                                                                   num_updates=4)  # fmt: skip
        _close(ref.params, got.params, 1e-12)
        _close(ref.state, got.state, 1e-12)
    assert max(e["global_updates"] for e in got.history) > 0  # the GPS took pushes
    keys = ("update", "time", "worker", "staleness", "global_updates", "wire_bytes")
    assert [{k: e[k] for k in keys} for e in got.history] == [
        {k: e[k] for k in keys} for e in ref.history
    ]
    shard = {"fsdp2xtensor2": 128 / 4 + 16 / 2 + 64 / 4, "fsdp4": (128 + 16 + 64) / 4}[mesh_name]
    for done, entry in enumerate(got.history, start=1):
        assert entry["wire_bytes_per_device"] == round(done * 8 * shard / M)
    assert "wire_bytes_per_device" not in ref.history[0]
    shape, names, specs = MESHES[mesh_name]
    for name, spec in specs.items():
        assert got.params[name].sharding.spec == spec
        assert got.state.inner_opt_state[0].mu[name].sharding.spec == P("workers", *spec)


def test_halos_on_a_mesh_resumes_bit_for_bit(tmp_path):
    """2 checkpointed updates, then a call for 4 that resumes them on the mesh (a job and a
    push in flight across the cut): the run of 4 in one go, bit for bit."""
    whole = _halos("fsdp4", num_updates=4)
    _halos("fsdp4", num_updates=2, checkpoint_dir=tmp_path)
    resumed = _halos("fsdp4", num_updates=4, checkpoint_dir=tmp_path)
    for a, b in zip(jax.tree.leaves(whole.state), jax.tree.leaves(resumed.state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert resumed.history == whole.history


def _decoupled(mesh_name=None, dtype=jnp.float32, **options):
    """Decoupled DiLoCo: 2 fragments, a quorum of 1 with a grace window (the slow learner's
    pushes merged in some syncs, late in others), RDA on w1."""
    server = dj.DecoupledDiLoCo(quorum=1, grace_seconds=1.5, fragments=2, merge="rda",
                                average_leaves=("b1", "w2"))  # fmt: skip
    return _async(mesh_name, dtype, server=server, **options)


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_decoupled_diloco_on_a_mesh_equals_one_device(mesh_name):
    """Decoupled DiLoCo's learners on their slices of the mesh, θ and the fragments' outer
    states at the specs over all of it: the one-device run's θ, state and history (float64),
    each device's bytes its shards of the pushes."""
    with precision("float64"):
        ref = _decoupled(None, jnp.float64, num_updates=6)
        got = _decoupled(mesh_name, jnp.float64, num_updates=6)
        _close(ref.params, got.params, 1e-12)
        _close(ref.state, got.state, 1e-12)
    assert any(e["late"] for e in got.history) and any(e["merged"] == [0, 1] for e in got.history)
    keys = ("update", "time", "fragment", "merged", "weights", "late", "wire_bytes", "loss")
    assert [{k: e[k] for k in keys} for e in got.history] == [
        {k: e[k] for k in keys} for e in ref.history
    ]
    # Leaves b1 (16 floats), w1 (128), w2 (64) in that order: fragment 0 is b1 and w2, fragment
    # 1 is w1. One device's shards of them, in float64 bytes:
    whole = (8 * (16 + 64), 8 * 128)
    shard = {"fsdp2xtensor2": (8 * (16 / 2 + 64 / 4), 8 * 128 / 4),
             "fsdp4": (8 * (16 / 4 + 64 / 4), 8 * 128 / 4)}[mesh_name]  # fmt: skip
    for entry in got.history:
        # learner m's pushes of fragment q by then: its steps 4k + 2(q + 1) ended by `time`
        pushes = [[sum(1 for k in range(99) if (4 * k + 2 * (q + 1)) * s <= entry["time"])
                   for q in (0, 1)] for s in (1.0, 1.7)]  # fmt: skip
        sent = [round(sum(np.dot(size, n) for n in pushes) / M) for size in (whole, shard)]
        assert [entry["wire_bytes"], entry["wire_bytes_per_device"]] == sent
    shape, names, specs = MESHES[mesh_name]
    assert "wire_bytes_per_device" not in ref.history[0]
    for name, spec in specs.items():
        assert got.params[name].sharding.spec == spec
        assert got.state.inner_opt_state[0].mu[name].sharding.spec == P("workers", *spec)
    # Each fragment's outer state (its leaves' momentum) at those leaves' specs.
    for p, names in enumerate((("b1", "w2"), ("w1",))):
        leaves = jax.tree.leaves(got.state.outer_opt_state[p])
        assert [x.sharding.spec for x in leaves] == [specs[n] for n in names]


def test_decoupled_diloco_on_a_mesh_resumes_bit_for_bit(tmp_path):
    """3 checkpointed syncs, then a call for 6 that resumes them on the mesh (merged
    fragments pending at learners across the cut): the run of 6 in one go, bit for bit."""
    whole = _decoupled("fsdp4", num_updates=6)
    _decoupled("fsdp4", num_updates=3, checkpoint_dir=tmp_path)
    resumed = _decoupled("fsdp4", num_updates=6, checkpoint_dir=tmp_path)
    for a, b in zip(jax.tree.leaves(whole.state), jax.tree.leaves(resumed.state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert getattr(a, "sharding", None) == getattr(b, "sharding", None)
    assert resumed.history == whole.history


def test_train_async_mesh_options_are_checked():
    shape, names, specs = MESHES["fsdp4"]
    common = dict(num_workers=M, inner_steps=H, step_seconds=(1.0, 1.0), num_updates=1)
    with pytest.raises(ValueError, match="need a mesh"):
        dj.train_async(mlp_loss, _params(), _rounds(), param_sharding=specs, **common)
    with pytest.raises(ValueError, match="backend='auto'"):
        dj.train_async(
            mlp_loss, _params(), _rounds(), mesh=_mesh(shape, names), backend="vmap", **common
        )
    with pytest.raises(ValueError, match="num_workers"):
        dj.train_async(mlp_loss, _params(), _rounds(), mesh=_mesh((4, 2), names), **common)


def test_the_loss_sees_the_workers_own_axes_on_every_path():
    """A loss traced in a round on a mesh finds the worker's own axes in context (Auto, for
    XLA to partition; what a model's activation constraints and the finite check ask), on
    each path that runs it: the workers' shard_map (M = 2), one worker under plain jit
    (M = 1) and `train_async`'s jobs on each worker's slice."""
    seen = []

    def recording_loss(params, batch):
        mesh = jax.sharding.get_abstract_mesh()
        seen.append(dict(zip(mesh.axis_names, mesh.axis_types, strict=True)).get("fsdp"))
        return mlp_loss(params, batch)

    shape, names, specs = MESHES["fsdp4"]
    placed = dict(mesh=_mesh(shape, names), param_sharding=specs)
    dj.train_diloco(recording_loss, _params(), _rounds()[:1], num_rounds=1, num_workers=M,
                    inner_steps=H, **placed)  # fmt: skip
    one = {k: v[:1] for k, v in _rounds()[0].items()}
    dj.train_diloco(recording_loss, _params(), [one], num_rounds=1, num_workers=1,
                    inner_steps=H, mesh=_mesh((1, 4), names), param_sharding=specs)  # fmt: skip
    dj.train_async(recording_loss, _params(), _rounds(), num_workers=M, inner_steps=H,
                   num_updates=2, step_seconds=(1.0, 1.7), **placed)  # fmt: skip
    assert len(seen) >= 3 and set(seen) == {AxisType.Auto}
