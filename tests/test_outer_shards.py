"""ZeRO-1 across workers (`shard_outer_over_workers=True`): on 8 fake devices the split outer
state gives the replicated run's params, states and history to float rounding (the same sums
and update rule; XLA fuses the slices' arithmetic apart, so a last bit may differ), each
device holds 1/M of the outer state's shards, the compiled round's
cross-worker collectives are a reduce-scatter and an all-gather of shards (the bytes of the
all-reduce they replace, `wire_bytes_per_device`), a replicated checkpoint resumes split,
and what can't run split is refused, naming the option."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from quick import quick

import diloco_jax as dj
from diloco_jax import hlo, placement
from diloco_jax import outer_sharding as outer_shards_lib

M, H, R = 2, 4, 3
D_IN, D_HID, D_OUT, B = 8, 16, 4, 8
MESHES = {
    "fsdp4": ((2, 4), ("workers", "fsdp"), {"w1": P(None, "fsdp"), "b1": P("fsdp"), "w2": P()}),
    "fsdp2xtensor2": (
        (2, 2, 2), ("workers", "fsdp", "tensor"),
        {"w1": P("fsdp", "tensor"), "b1": P("tensor"), "w2": P("tensor", "fsdp")},
    ),
}  # fmt: skip


def mlp_loss(params, batch):
    hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean((hidden @ params["w2"] - batch["y"]) ** 2) + jnp.sum(params["c"] ** 2)


def _params():
    rng = np.random.default_rng(0)
    return {
        "w1": jnp.asarray(rng.normal(size=(D_IN, D_HID)) * 0.3, jnp.float32),
        "b1": jnp.zeros(D_HID, jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(D_HID, D_OUT)) * 0.3, jnp.float32),
        "c": jnp.ones((3,), jnp.float32),  # no dim divisible by M: stays replicated
    }


def _rounds(num_workers=M, count=R):
    rng = np.random.default_rng(1)
    return [
        {"x": rng.normal(size=(num_workers, H, B, D_IN)).astype(np.float32),
         "y": rng.normal(size=(num_workers, H, B, D_OUT)).astype(np.float32)}
        for _ in range(count)
    ]  # fmt: skip


def _mesh(mesh_name):
    shape, names, specs = MESHES[mesh_name]
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape)), specs


def _run(mesh_name, data=None, **options):
    mesh, specs = _mesh(mesh_name)
    return dj.train_diloco(
        mlp_loss, _params(), _rounds() if data is None else data, num_rounds=R, num_workers=M,
        inner_steps=H, mesh=mesh, param_sharding=specs | {"c": P()},
        inner_optimizer=optax.adam(0.02), **options,
    )  # fmt: skip


def _close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)


def _shard_shape(x):
    device0 = jax.devices()[0]
    return next(s.data.shape for s in x.addressable_shards if s.device == device0)


CASES = {
    "plain": {},  # the default weights: non-finite exclusion, a weighted exchange
    "adam_outer_no_weights": dict(outer_optimizer=optax.adam(0.1), exclude_nonfinite=False),
    "fragments_drops": dict(fragments=2, drop_probability=0.4, drop_seed=3),
    "bf16_restarted_momentum": dict(
        outer_optimizer=dj.restart_momentum(dj.default_outer_optimizer(), 2),
        outer_state_dtype="bfloat16",
    ),
}


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("case", quick(CASES, {"plain", "fragments_drops"}))
def test_the_split_outer_state_equals_the_replicated_run(mesh_name, case):
    ref = _run(mesh_name, **CASES[case])
    got = _run(mesh_name, shard_outer_over_workers=True, **CASES[case])
    _close(ref.params, got.params)
    _close(ref.state, got.state)
    for a, b in zip(ref.history, got.history, strict=True):
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-6)
        np.testing.assert_allclose(a["outer_grad_norm"], b["outer_grad_norm"], rtol=1e-6)
        # + the squared norm's float32 per sync (ring all-reduce over M = 2: 1 x 4 B)
        syncs = 2 if "fragments" in CASES[case] else 1
        extra = 4 * syncs * (a["round"] + 1)
        assert b["wire_bytes_per_device"] == a["wire_bytes_per_device"] + extra


def test_each_device_holds_one_mth_of_the_outer_state():
    ref, got = _run("fsdp2xtensor2"), _run("fsdp2xtensor2", shard_outer_over_workers=True)
    trace_ref, trace = ref.state.outer_opt_state[0].trace, got.state.outer_opt_state[0].trace
    # w1 [8, 16] at (fsdp, tensor): [4, 8] per device replicated over workers, [2, 8] split
    # (dim 0 divides by M x its 2 fsdp ways); the worker axis comes after fsdp there.
    assert trace["w1"].sharding.spec == P(("fsdp", "workers"), "tensor")
    assert _shard_shape(trace_ref["w1"]) == (4, 8) and _shard_shape(trace["w1"]) == (2, 8)
    assert _shard_shape(trace["b1"]) == (4,) and _shard_shape(trace["w2"]) == (4, 2)
    # c [3]: no dim divisible by M, replicated as before.
    assert trace["c"].sharding.spec == P() and _shard_shape(trace["c"]) == (3,)
    # θ and the per-worker state keep their layouts.
    assert got.params["w1"].sharding.spec == P("fsdp", "tensor")
    assert _shard_shape(got.state.inner_opt_state[0].mu["w1"]) == (1, 4, 8)
    split = sum(np.prod(_shard_shape(trace[k])) for k in ("w1", "b1", "w2"))
    whole = sum(np.prod(_shard_shape(trace_ref[k])) for k in ("w1", "b1", "w2"))
    assert split / whole == 1 / M


def _cross_worker(compiled, per_worker):
    """(op, operand bytes, group size) of the collectives outside loops whose groups pair
    devices of different workers (worker m owns devices m * per_worker ...)."""
    out = []
    for c in hlo.collectives(compiled):
        if c.in_loop or not c.replica_groups:
            continue
        if len({d // per_worker for d in c.replica_groups[0]}) > 1:
            out.append((c.op, c.operand_bytes, len(c.replica_groups[0])))
    return out


def test_the_compiled_sync_reduce_scatters_and_all_gathers_shards():
    mesh, specs = _mesh("fsdp4")
    params, (batch,) = _params(), _rounds(count=1)
    specs = specs | {"c": P()}
    result = dj.train_diloco(
        mlp_loss, params, [batch], num_rounds=1, num_workers=M, inner_steps=H, mesh=mesh,
        param_sharding=specs, shard_outer_over_workers=True,
    )  # fmt: skip
    backend = dj.make_backend("auto", M, mesh=mesh)
    shards = placement.outer_shards(params, backend, specs)
    assert shards.dims == (0, None, 0, 0)  # b1 [16], c [3], w1 [8, 16], w2 [16, 4]
    state = jax.device_put(dj.init_state(params, M), _storage(params, mesh, specs, shards))
    compiled = (
        jax.jit(functools.partial(dj.diloco_round, mlp_loss, backend=backend, outer_shards=shards))
        .lower(state, backend.place_batches(batch, 2))
        .compile()
    )
    found = _cross_worker(compiled, 4)
    by_op = {}
    for op, n, _ in found:
        by_op[op] = by_op.get(op, 0) + n
    # A device's float32 shards: w1 [8, 16] over fsdp on dim 1 ([8, 4]: 128 B), w2 [16, 4]
    # whole (256 B), b1 [16] over fsdp ([4]: 16 B), reduce-scattered over the M = 2 workers,
    # each half all-gathered back; c [3] (split along no dim) all-reduced whole (12 B) with
    # the scalars of the round: the loss, the weight sum and the slices' squared norm of the
    # mean delta (4 B each).
    assert by_op == {"reduce-scatter": 128 + 256 + 16, "all-gather": (128 + 256 + 16) / M,
                     "all-reduce": 12 + 12}  # fmt: skip
    # The ring bytes of the all-reduce they replace, + the norm's 4 B: history's
    # wire_bytes_per_device (and wire_bytes, with whole leaves).
    ring = sum(hlo.ring_wire_bytes(op, n, size) for op, n, size in found)
    assert ring == result.history[0]["wire_bytes_per_device"] == 4 * (32 + 64 + 4 + 3) + 12
    assert result.history[0]["wire_bytes"] == 4 * (128 + 64 + 16 + 3) + 12


def _storage(params, mesh, specs, shards):
    from diloco_jax import placement as placement_lib

    placed = placement_lib.placement(
        params, mesh, placement_lib.resolve_param_specs(params, mesh, specs), split_outer=True
    )
    assert placed.outer == shards
    return placed.shardings(dj.init_state(params, M))


@pytest.mark.parametrize(
    "layout", quick(["one_device_per_worker", "data_parallel"], {"data_parallel"})
)
def test_backends_without_a_mesh_split_it_too(layout):
    num_workers, options = (4, {"backend": "shard_map"}) if layout == "one_device_per_worker" else (
        M, {"data_parallel": 4})  # fmt: skip
    common = dict(
        num_rounds=2,
        num_workers=num_workers,
        inner_steps=H,
        outer_optimizer=optax.adam(0.1),
        **options,
    )
    data = _rounds(num_workers, 2)
    ref = dj.train_diloco(mlp_loss, _params(), data, **common)
    got = dj.train_diloco(mlp_loss, _params(), data, shard_outer_over_workers=True, **common)
    # Over 4 workers a reduce-scatter may add in another order than the all-reduce.
    for a, b in zip(jax.tree.leaves(ref.state), jax.tree.leaves(got.state), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    mu = got.state.outer_opt_state[0].mu
    assert _shard_shape(mu["w1"]) == (D_IN // num_workers, D_HID)
    assert _shard_shape(mu["c"]) == (3,)


def test_a_replicated_checkpoint_resumes_split(tmp_path):
    full = _run("fsdp4", shard_outer_over_workers=True)
    data = _rounds()
    mesh, specs = _mesh("fsdp4")
    common = dict(
        num_workers=M,
        inner_steps=H,
        mesh=mesh,
        param_sharding=specs | {"c": P()},
        inner_optimizer=optax.adam(0.02),
        checkpoint_dir=tmp_path,
    )
    dj.train_diloco(mlp_loss, _params(), data[:2], num_rounds=2, **common)
    resumed = dj.train_diloco(
        mlp_loss, _params(), data, num_rounds=R, shard_outer_over_workers=True, **common
    )
    _close(full.state, resumed.state)
    assert resumed.state.outer_opt_state[0].trace["w1"].sharding.spec == P("workers", "fsdp")


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(outer_clip=1.0), "updates each coordinate on its own.*reduce_sum"),
        (dict(compression="int8"), "does not run with compression"),
        (dict(outer_delay=1), "does not run with a delayed or eager"),
        (dict(backend="vmap"), "does not run with workers other than one per device group"),
        (dict(shard_outer_over_workers="yes"), "shard_outer_over_workers must be"),
    ],
)
def test_what_cannot_run_split_is_refused(options, match):
    with pytest.raises(ValueError, match=match):
        _one_round(**({"shard_outer_over_workers": True} | options))


def _one_round(**options):
    return dj.train_diloco(
        mlp_loss, _params(), _rounds(count=1), num_rounds=1, num_workers=M, inner_steps=H,
        **options,
    )  # fmt: skip


def test_per_coordinate_rules_pass_and_mixing_ones_are_named():
    like = {"w": jax.ShapeDtypeStruct((4, 6), jnp.float32), "s": jax.ShapeDtypeStruct((), "f4")}
    for ok in (
        dj.default_outer_optimizer(),
        optax.adam(0.1),
        dj.outer.cast_state(optax.sgd(0.7, momentum=0.9), "bfloat16"),
        dj.restart_momentum(optax.sgd(0.7, momentum=0.9, nesterov=True), 3),
    ):
        outer_shards_lib.check_per_coordinate(ok, like)
    for mixing, name in (
        (optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.7)), "reduce_sum"),
        (optax.scale_by_param_block_rms(), "reduce_sum"),
    ):
        with pytest.raises(ValueError, match=f"shard_outer_over_workers.*{name}"):
            outer_shards_lib.check_per_coordinate(mixing, like)


def test_storage_and_worker_forms_round_trip():
    x = jnp.arange(4 * 12, dtype=jnp.float32).reshape(4, 12)
    # dim 1 of 12 in 3 shards of 4, each cut in M = 2: worker m holds columns
    # 4 s + 2 m ... 4 s + 2 m + 1 of every shard s.
    y = outer_shards_lib.to_workers(x, 1, 3, 2)
    cols = [[4 * s + 2 * m + j for s in range(3) for j in range(2)] for m in range(2)]
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x)[:, cols].transpose(1, 0, 2))
    np.testing.assert_array_equal(np.asarray(outer_shards_lib.from_workers(y, 1, 3)), np.asarray(x))
    assert outer_shards_lib.storage_spec(P("fsdp"), 0) == P(("fsdp", "workers"))
    assert outer_shards_lib.storage_spec(P("fsdp"), 1) == P("fsdp", "workers")
    assert outer_shards_lib.storage_spec(P(), 2) == P(None, None, "workers")


@pytest.mark.parametrize("split", [False, True], ids=["replicated_outer", "split_outer"])
def test_init_state_compiles_to_no_more_than_each_devices_shards(split):
    """The in-place init `train_diloco` runs (`placement.build_program`): no temporaries, and its
    outputs on a device are exactly that device's shards of the state."""
    from diloco_jax import placement as placement_lib

    mesh, specs = _mesh("fsdp2xtensor2")
    params = _params()
    specs = placement_lib.resolve_param_specs(params, mesh, specs | {"c": P()})
    placed = placement_lib.placement(params, mesh, specs, split_outer=split)
    init = functools.partial(dj.init_state, num_workers=M, method=dj.DiLoCo())
    compiled, _ = placement_lib.build_program(init, placed, params, None, None)
    stats = compiled.memory_analysis()
    # Per device, float32: w1 [8, 16] -> [4, 8], b1 [16] over tensor -> [8], w2 [16, 4] ->
    # [8, 2], c [3] whole: 4 x (32 + 8 + 16 + 3) = 236 bytes of params.
    theta = 4 * (32 + 8 + 16 + 3)
    # The outer trace like θ, or split over the 2 workers where a dim allows ([2, 8], [4],
    # [4, 2]; c whole); the worker's AdamW mu and nu like θ; two int32 counters.
    outer = 4 * (16 + 4 + 8 + 3) if split else theta
    assert stats.temp_size_in_bytes == 0
    assert stats.argument_size_in_bytes == theta
    # XLA's output buffer adds its table of 8-byte pointers, one per state leaf (18).
    assert stats.output_size_in_bytes == theta + outer + 2 * theta + 2 * 4 + 8 * 18
