"""Performance regressions that do not depend on timing.

- In-graph data: with a `Sampler` the compiled round's memory does not grow with H, while
  host-fed batches' argument size grows exactly with H (the check can fail).
- One dispatch per round: `train_diloco` over R rounds compiles the round once and calls it
  exactly R times (compiles counted with a `jax.monitoring` listener, calls read from a
  `jax.profiler` trace), and the H inner steps are a while loop inside that one program.
- No hidden work: the compiled round moves no more bytes and launches no more kernels per
  inner step than a hand-written round with the same metrics.
"""

import functools
import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import diloco_jax as dj
from diloco_jax.lm import data as data_lib
from diloco_jax.lm import model as model_lib

PRESET = "micro"
M = 2  # workers
B = 4  # sequences per worker per step
STREAM = 4096  # tokens in the synthetic stream the sampler draws from
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def _sample(batch_size, seq_len, arrays, round_index, worker, step):
    key = data_lib.batch_key(arrays["key"], round_index, worker, step)
    return data_lib.sample_batch(
        arrays["tokens"], arrays["starts"][worker], arrays["lengths"][worker], key,
        batch_size, seq_len,
    )  # fmt: skip


def _sampler(seq_len: int) -> dj.Sampler:
    """In-graph iid windows of a random token stream, as `experiment.make_sampler` builds them."""
    tokens = np.random.default_rng(0).integers(1, 256, size=STREAM, dtype=np.int32)
    arrays = {
        "tokens": jnp.asarray(tokens),
        "starts": jnp.zeros((M,), jnp.int32),
        "lengths": jnp.full((M,), STREAM, jnp.int32),
        "key": jax.random.key(0),
    }
    return dj.Sampler(arrays, functools.partial(_sample, B, seq_len))


@functools.lru_cache(maxsize=1)
def _model():
    """The micro preset and its abstract params (shapes only: nothing is run)."""
    config = model_lib.get_config(PRESET)
    return config, jax.eval_shape(model_lib.init_params, config, jax.random.key(0))


def _compiled_round(inner_steps: int, data):
    """The round as train.py jits it, compiled for abstract state and `data`."""
    config, params = _model()
    inner, outer = dj.default_inner_optimizer(), dj.default_outer_optimizer()
    fn = functools.partial(
        dj.diloco_round, model_lib.make_loss_fn(config), inner_optimizer=inner,
        outer_optimizer=outer, backend="vmap", num_workers=M, inner_steps=inner_steps,
        exclude_nonfinite=False,  # as the hand-written reference round: no weights
    )  # fmt: skip
    state = jax.eval_shape(
        lambda p: dj.init_state(p, M, inner_optimizer=inner, outer_optimizer=outer), params
    )
    return jax.jit(fn, donate_argnums=0).lower(state, data).compile()


def _host_batches(inner_steps: int) -> dict:
    seq_len = _model()[0].seq_len
    shape = jax.ShapeDtypeStruct((M, inner_steps, B, seq_len), jnp.int32)
    return {"inputs": shape, "targets": shape}


@functools.lru_cache(maxsize=2)
def _host_round(inner_steps: int):
    return _compiled_round(inner_steps, _host_batches(inner_steps))


def _hlo_instructions(compiled) -> int:
    return sum(1 for line in compiled.as_text().splitlines() if " = " in line)


@pytest.fixture(scope="module")
def sampler_rounds():
    sampler = _sampler(_model()[0].seq_len)
    return {h: _compiled_round(h, sampler) for h in (10, 200)}


def test_sampler_round_memory_does_not_grow_with_h(sampler_rounds):
    small, large = (sampler_rounds[h].memory_analysis() for h in (10, 200))
    assert large.temp_size_in_bytes <= 1.2 * small.temp_size_in_bytes
    # The round's inputs and outputs are the state, the token stream and per-worker metrics.
    assert large.argument_size_in_bytes == small.argument_size_in_bytes
    assert large.output_size_in_bytes == small.output_size_in_bytes


@pytest.mark.slow
def test_host_fed_round_arguments_grow_with_h():
    """The contrast, and proof that the check above can fail: [M, H, B, L] batches are
    arguments, so H=200 carries exactly 190 more steps of two int32 [M, B, L] arrays."""
    small, large = (_host_round(h).memory_analysis() for h in (10, 200))
    per_step = 2 * M * B * _model()[0].seq_len * 4
    assert large.argument_size_in_bytes - small.argument_size_in_bytes == 190 * per_step
    assert large.argument_size_in_bytes > 1.2 * small.argument_size_in_bytes


def test_inner_steps_are_a_loop_in_one_program(sampler_rounds):
    """H steps compile to one while loop that runs H times, not to H unrolled steps: the
    optimized program has about the same size for H=10 and H=200."""
    for h, compiled in sampler_rounds.items():
        text = compiled.as_text()
        assert re.search(r"\bwhile\(", text)
        trip_counts = re.findall(r'"known_trip_count":\{"n":"(\d+)"', text)
        if trip_counts:  # XLA annotates loops whose trip count it knows
            assert str(h) in trip_counts
    small, large = (_hlo_instructions(sampler_rounds[h]) for h in (10, 200))
    assert large < 1.1 * small


def _reference_round(loss_fn, inner, outer):
    """Hand-written round: vmap over workers of a scan of optax steps, mean delta, outer
    update, plus the metrics `diloco_round` returns (mean / per-worker loss, delta norm)."""

    def worker(params, inner_state, batches_H):
        def step(carry, batch):
            p, s = carry
            loss, grads = jax.value_and_grad(loss_fn)(p, batch)
            updates, s = inner.update(grads, s, p)
            return (optax.apply_updates(p, updates), s), loss

        (p, s), losses_H = lax.scan(step, (params, inner_state), batches_H)
        return jax.tree.map(jnp.subtract, params, p), s, losses_H

    def round_fn(params, outer_state, inner_states, batches):
        deltas, inner_states, losses = jax.vmap(worker, in_axes=(None, 0, 0))(
            params, inner_states, batches
        )
        delta = jax.tree.map(lambda d: jnp.mean(d, axis=0), deltas)
        updates, outer_state = outer.update(delta, outer_state, params)
        new = (optax.apply_updates(params, updates), outer_state, inner_states)
        return new, (jnp.mean(losses), jnp.mean(losses, axis=1), optax.tree.norm(delta))

    return jax.jit(round_fn, donate_argnums=(0, 1, 2))


def _step_kernels(compiled) -> int:
    """Instructions in the while-loop bodies that launch work (not tuple plumbing)."""
    text = compiled.as_text()
    free = ("get-tuple-element", "tuple", "bitcast", "constant", "parameter")
    bodies = set(re.findall(r"\bwhile\(.*?\bbody=%([\w.\-]+)", text))
    count, current = 0, None
    for line in text.splitlines():
        header = re.match(r"^%([\w.\-]+) .*\{$", line)
        if header:
            current = header.group(1)
        elif line.startswith("}"):
            current = None
        elif current in bodies and " = " in line:
            op = re.search(r"\s([a-z][\w\-]*)\(", line.split(" = ", 1)[1])
            count += bool(op) and op.group(1) not in free
    return count


def test_round_does_the_work_of_hand_written_code():
    """The compiled library round moves no more bytes and launches no more kernels per inner
    step than the same round written by hand with the same metrics (XLA's static estimates,
    no timing). A nested size-1 vmap around the workers once cost +8 kernels per step."""
    config, params = _model()
    inner, outer = dj.default_inner_optimizer(), dj.default_outer_optimizer()
    state = jax.eval_shape(
        lambda p: dj.init_state(p, M, inner_optimizer=inner, outer_optimizer=outer), params
    )
    reference = _reference_round(model_lib.make_loss_fn(config), inner, outer)
    args = (state.params, state.outer_opt_state, state.inner_opt_state, _host_batches(10))
    ref, lib = reference.lower(*args).compile(), _host_round(10)
    ref_bytes = ref.cost_analysis()["bytes accessed"]
    assert lib.cost_analysis()["bytes accessed"] <= 1.01 * ref_bytes
    assert _step_kernels(lib) <= _step_kernels(ref)


def _outermost_spans(log_dir: Path, name: str) -> int:
    """Calls of a jitted function in a profile: events `name`, nested repeats counted once."""
    (path,) = log_dir.rglob("*.xplane.pb")
    profile = jax.profiler.ProfileData.from_file(str(path))
    spans = sorted(
        (event.start_ns, event.end_ns)
        for plane in profile.planes
        for line in plane.lines
        for event in line.events
        if event.name == name
    )
    count, end = 0, -math.inf
    for start, stop in spans:
        if start >= end:
            count, end = count + 1, stop
    return count


def _linear_loss(params, batch):
    return jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)


def _linear_sampler() -> dj.Sampler:
    """Regression batches drawn in the graph from a per-(round, worker, step) key."""

    def sample(arrays, round_index, worker, step):
        key = data_lib.batch_key(arrays["key"], round_index, worker, step)
        x = jax.random.normal(key, (8, 3))
        return {"x": x, "y": x @ arrays["w_true"]}

    return dj.Sampler({"key": jax.random.key(1), "w_true": jnp.arange(3.0)}, sample)


def test_train_diloco_compiles_once_and_dispatches_once_per_round(tmp_path):
    """R rounds: one compile of the round, R calls of it. (A small model, since what is
    counted does not depend on the model; a fresh loss_fn so train.py's jit cache misses.)"""
    num_rounds, inner_steps = 3, 5
    loss_fn = lambda params, batch: _linear_loss(params, batch)
    params = {"w": jnp.zeros(3), "b": jnp.float32(0)}
    compiles = []

    def on_duration(event: str, duration: float, **kwargs) -> None:
        if event == COMPILE_EVENT:
            compiles.append(kwargs.get("fun_name", ""))

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    try:
        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = 0  # C++ dispatch events only: tracing Python is slow
        with jax.profiler.trace(tmp_path, profiler_options=options):
            result = dj.train_diloco(
                loss_fn, params, _linear_sampler(), num_rounds=num_rounds, num_workers=M,
                inner_steps=inner_steps, backend="vmap",
            )  # fmt: skip
            jax.block_until_ready(result.state)
    finally:
        jax.monitoring.unregister_event_duration_listener(on_duration)

    round_compiles = [name for name in compiles if "diloco_round" in name]
    assert round_compiles == ["jit(diloco_round)"]
    assert _outermost_spans(tmp_path, "PjitFunction(diloco_round)") == num_rounds
    assert int(result.state.round) == num_rounds
    assert [h["steps"] for h in result.history] == [5, 10, 15]
