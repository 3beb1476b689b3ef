"""θ and the outer state in host memory (`outer_state_memory="pinned_host"`): between rounds
they sit in pinned host memory (the per-worker state on the devices), the compiled round
takes and returns them there, and the run is the on-device run bit for bit (on a mesh, with
fragments and drops, on one device, through an eval and a resume, with the outer state split
over the workers); what it can't run with is refused, naming the option."""

import functools
import re

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from quick import quick
from test_outer_shards import H, M, R, _mesh, _one_round, _params, _rounds, mlp_loss

import diloco_jax as dj
from diloco_jax import placement as placement_lib

SPECS = {"w1": P(None, "fsdp"), "b1": P("fsdp"), "w2": P(), "c": P()}


def _run(layout, data=None, num_rounds=R, **options):
    common = dict(num_rounds=num_rounds, num_workers=M, inner_steps=H, **options)
    data = _rounds(count=R) if data is None else data
    if layout == "vmap":
        return dj.train_diloco(mlp_loss, _params(), data, backend="vmap", **common)
    mesh, _ = _mesh("fsdp4")
    return dj.train_diloco(
        mlp_loss, _params(), data, mesh=mesh, param_sharding=SPECS,
        inner_optimizer=optax.adam(0.02), **common,
    )  # fmt: skip


def _equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _memory(x):
    return x.sharding.memory_kind


@pytest.mark.parametrize(
    "layout, options",
    quick(
        [("fsdp4", {}), ("fsdp4", dict(fragments=2, drop_probability=0.4)), ("vmap", {})],
        lambda c: "fragments" in c[1],
    ),
    ids=["mesh", "mesh-fragments-drops", "one-device"],
)
def test_host_memory_between_rounds_and_the_same_bits(layout, options):
    ref = _run(layout, **options)
    got = _run(layout, outer_state_memory="pinned_host", **options)
    _equal(ref.state, got.state)
    _equal(ref.params, got.params)
    assert [h["loss"] for h in ref.history] == [h["loss"] for h in got.history]
    state = got.state
    outer = jax.tree.leaves(state.outer_opt_state)
    assert {_memory(x) for x in jax.tree.leaves(state.params) + outer} == {"pinned_host"}
    others = jax.tree.leaves(state.inner_opt_state) + [state.round]
    others += jax.tree.leaves(state.parts)
    assert {_memory(x) for x in others} == {"device"}
    # The caller's params come back in device memory, with their shardings.
    assert {_memory(x) for x in jax.tree.leaves(got.params)} == {"device"}
    if layout == "fsdp4":
        assert got.params["w1"].sharding.spec == P(None, "fsdp")


def test_the_outer_state_split_over_workers_in_host_memory_is_the_device_run():
    ref = _run("fsdp4", shard_outer_over_workers=True)
    got = _run("fsdp4", shard_outer_over_workers=True, outer_state_memory="pinned_host")
    _equal(ref.state, got.state)
    _equal(ref.params, got.params)
    assert [h["loss"] for h in ref.history] == [h["loss"] for h in got.history]
    outer = jax.tree.leaves(got.state.outer_opt_state)
    assert {_memory(x) for x in jax.tree.leaves(got.state.params) + outer} == {"pinned_host"}
    assert {_memory(x) for x in jax.tree.leaves(got.state.inner_opt_state)} == {"device"}
    # Every state leaf keeps the split on-device run's partitioning (none gathered).
    for x, y in zip(jax.tree.leaves(ref.state), jax.tree.leaves(got.state), strict=True):
        assert x.sharding.spec == y.sharding.spec
        assert x.addressable_shards[0].data.shape == y.addressable_shards[0].data.shape
    # Each device's host memory holds its 1/(4 fsdp x 2 workers) of w1's momentum trace.
    (trace,) = [
        x for path, x in jax.tree_util.tree_leaves_with_path(got.state.outer_opt_state)
        if "w1" in jax.tree_util.keystr(path)
    ]  # fmt: skip
    assert trace.addressable_shards[0].data.size * 8 == _params()["w1"].size


def test_the_compiled_round_takes_and_returns_them_in_host_memory():
    mesh, _ = _mesh("fsdp4")
    params = _params()
    backend = dj.make_backend("auto", M, mesh=mesh)
    specs = placement_lib.resolve_param_specs(params, mesh, SPECS)
    placed = placement_lib.placement(params, mesh, specs, host=True)
    state = dj.init_state(params, M)
    state = jax.device_put(state, placed.shardings(state))
    batch = backend.place_batches(_rounds(count=1)[0], 2)
    round_fn = functools.partial(
        dj.diloco_round, mlp_loss, backend=backend, outer_state_memory="pinned_host"
    )
    lowered = jax.jit(round_fn, out_shardings=(placed.shardings(state), None)).lower(state, batch)
    # The program copies them to the device inside (XLA's device placement annotations) ...
    text = lowered.as_text()
    assert set(re.findall(r'_xla_buffer_placement = "(\w+)"', text)) == {"device", "pinned_host"}
    # ... and its entry takes and returns θ (4 leaves) and the outer trace (4) in host memory
    # space S(5): 8 arguments and 8 outputs, nothing else.
    layout = re.search(r"entry_computation_layout=\{(.*)\}", lowered.compile().as_text()).group(1)
    assert layout.count("S(5)") == 16


def test_an_eval_and_a_resume_see_the_same_bits(tmp_path):
    def eval_fn(params):
        return {"norm": optax.tree.norm(params)}

    full = _run("fsdp4", eval_fn=eval_fn)
    data = _rounds(count=R)
    common = dict(eval_fn=eval_fn, outer_state_memory="pinned_host", checkpoint_dir=tmp_path)
    _run("fsdp4", data=data[:2], num_rounds=2, **common)
    resumed = _run("fsdp4", data=data, **common)
    _equal(full.state, resumed.state)
    assert [h["norm"] for h in full.history] == [h["norm"] for h in resumed.history]
    assert _memory(resumed.state.params["w1"]) == "pinned_host"


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(outer_delay=1), "does not run with a delayed or eager"),
        (dict(backend="pmap"), "does not run with the pmap backend"),
        (dict(outer_state_memory="gpu"), "outer_state_memory must be one of"),
    ],
)
def test_what_cannot_run_in_host_memory_is_refused(options, match):
    with pytest.raises(ValueError, match=match):
        _one_round(**({"outer_state_memory": "pinned_host", "backend": "shard_map"} | options))
