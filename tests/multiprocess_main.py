"""One process of the 2-process test run (see test_multiprocess.py); not a test module.

Usage: python multiprocess_main.py COORDINATOR NUM_PROCESSES PROCESS_ID OUT_DIR
       [CKPT_DIR [diloco|mesh]]

Joins the run, trains DiLoCo, the synchronous baseline and DiLoCo with int8 deltas (the
two-stage exchange) on `run_config()`'s data (the same on every process) and saves the final
params and histories to OUT_DIR/process-I.npz. With a last argument "diloco", only the DiLoCo
run (the one that checkpoints: what a resumed launch checks), then `save_in_background` in
CKPT_DIR-background (its "step1" and "step2" beside the run's params: one launch of two
processes for both). With "mesh": `train_on_mesh`, a (workers=2, fsdp=4) mesh over both
processes' devices, each process's devices one worker.
"""

import json
import sys
from pathlib import Path

import numpy as np
import optax
from reference import linear_loss, make_data

from diloco_jax import distributed

NUM_WORKERS, INNER_STEPS, NUM_ROUNDS = 4, 3, 3


def run_config() -> dict:
    """Params and data of the run, built identically by every process and by the test."""
    rng = np.random.default_rng(7)
    data = make_data(rng, NUM_ROUNDS, NUM_WORKERS, INNER_STEPS)
    sync_data = [{k: v[:, 0] for k, v in batch.items()} for batch in data]
    params = {"w": np.asarray([0.3, -0.2, 0.1], np.float32), "b": np.float32(0.5)}
    return {"params": params, "data": data, "sync_data": sync_data}


def train_both(
    checkpoint_dir: str | None = None, only_diloco: bool = False, **kwargs
) -> dict[str, np.ndarray]:
    """Final params of DiLoCo and sync runs, flattened to {"diloco_w": ..., ...}; with
    `only_diloco`, of the DiLoCo run alone (its history the only entry of "history")."""
    import diloco_jax as dj

    cfg = run_config()
    common = dict(num_workers=NUM_WORKERS, backend="shard_map", **kwargs)
    diloco_args = dict(num_rounds=NUM_ROUNDS, inner_steps=INNER_STEPS, **common)
    diloco = dj.train_diloco(
        linear_loss,
        cfg["params"],
        cfg["data"],
        inner_optimizer=optax.adamw(0.05),
        outer_optimizer=optax.sgd(0.7, momentum=0.9, nesterov=True),
        checkpoint_dir=checkpoint_dir,
        **diloco_args,
    )
    # Global arrays (each process holds its shards): copied whole to every host here.
    diloco_params, diloco_state = distributed.to_host((diloco.params, diloco.state))
    out = {f"diloco_{k}": np.asarray(v) for k, v in diloco_params.items()}
    out["diloco_inner_mu_w"] = np.asarray(diloco_state.inner_opt_state[0].mu["w"])
    if only_diloco:
        out["history"] = np.asarray(json.dumps([diloco.history]))
        return out
    sync = dj.train_sync(
        linear_loss,
        cfg["params"],
        cfg["sync_data"],
        num_steps=NUM_ROUNDS,
        optimizer=optax.adamw(0.05),
        **common,
    )
    # The two-stage quantized all-reduce: an all-to-all and an all-gather across processes.
    quantized = dj.train_diloco(
        linear_loss,
        cfg["params"],
        cfg["data"],
        inner_optimizer=optax.adamw(0.05),
        compression="int8,ef=1",
        **diloco_args,
    )
    sync_params, int8_params, int8_state = distributed.to_host(
        (sync.params, quantized.params, quantized.state)
    )
    out.update({f"sync_{k}": np.asarray(v) for k, v in sync_params.items()})
    out.update({f"int8_{k}": np.asarray(v) for k, v in int8_params.items()})
    out["int8_residual_w"] = np.asarray(int8_state.parts["compression"].residual["w"])
    out["history"] = np.asarray(json.dumps([diloco.history, sync.history, quantized.history]))
    return out


def mesh_config() -> dict:
    """A model whose matrix splits over fsdp = 4, and its data (M = 2 workers, H = 3)."""
    rng = np.random.default_rng(11)
    params = {"w": rng.normal(size=(8, 4)).astype(np.float32), "b": np.zeros(4, np.float32)}
    data = [
        {
            "x": rng.normal(size=(2, INNER_STEPS, 8, 8)).astype(np.float32),
            "y": rng.normal(size=(2, INNER_STEPS, 8, 4)).astype(np.float32),
        }
        for _ in range(NUM_ROUNDS)
    ]
    return {"params": params, "data": data}


def mesh_loss(params, batch):
    import jax.numpy as jnp

    return jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)


def train_on_mesh(devices, checkpoint_dir: str | None = None) -> dict[str, np.ndarray]:
    """DiLoCo (SGD inner steps) on a (workers=2, fsdp=4) mesh of `devices` with w at
    P("fsdp", None): with `checkpoint_dir`, 2 rounds checkpointed every round, then a second
    call that resumes there and runs the third (Orbax writing and reading each process's
    shards); else the 3 rounds in one call. Then the 3 rounds again with
    `process_local_data=True`, each process passing only its own worker's batches (as host
    batches, and as a Sampler's `worker_arrays`), and with the outer state split over the
    workers (`shard_outer_over_workers`); over several processes, `train_async` on the mesh
    must refuse (its jobs run one at a time in one process). Returns
    the final params of both, the workers' inner momentum of w, the round the resumed call's
    data started at and the history."""
    import jax
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    import diloco_jax as dj

    cfg = mesh_config()
    mesh = jax.sharding.Mesh(
        np.asarray(devices).reshape(2, 4), ("workers", "fsdp"), axis_types=(AxisType.Auto,) * 2
    )
    run = dict(
        num_workers=2,
        inner_steps=INNER_STEPS,
        inner_optimizer=optax.sgd(0.1, momentum=0.5),
        mesh=mesh,
        param_sharding={"w": P("fsdp", None), "b": P()},
    )
    if checkpoint_dir is not None:
        dj.train_diloco(
            mesh_loss, cfg["params"], cfg["data"], num_rounds=2, checkpoint_dir=checkpoint_dir,
            checkpoint_every=1, **run,
        )  # fmt: skip
    starts = []

    def data_from(start):  # what a resumed run draws: the rounds from its checkpoint on
        starts.append(start)
        return iter(cfg["data"][start:])

    result = dj.train_diloco(
        mesh_loss, cfg["params"], data_from, num_rounds=NUM_ROUNDS,
        checkpoint_dir=checkpoint_dir, **run,
    )  # fmt: skip
    if jax.process_count() > 1:  # global arrays: this process holds its shards only
        assert not result.params["w"].is_fully_addressable
    params, state = distributed.to_host((result.params, result.state))
    out = {f"mesh_{k}": np.asarray(v) for k, v in params.items()}
    out["mesh_start_round"] = np.asarray(starts)
    # Each process feeds only the workers its devices own (here: one, its own).
    mine = (
        slice(jax.process_index(), jax.process_index() + 1)
        if jax.process_count() > 1
        else slice(None)
    )
    local = [{k: v[mine] for k, v in batch.items()} for batch in cfg["data"]]
    fed = dj.train_diloco(
        mesh_loss, cfg["params"], local, num_rounds=NUM_ROUNDS, process_local_data=True, **run
    )
    out.update({f"local_{k}": np.asarray(v) for k, v in distributed.to_host(fed.params).items()})
    # The same batches drawn in the graph: each process's Sampler holds its own worker's
    # rounds (worker_arrays, [M_local, R, H, B, ...]), each batch split over its 4 devices.
    table = {k: np.stack([b[k] for b in cfg["data"]], axis=1)[mine] for k in cfg["data"][0]}
    sampler = dj.Sampler(
        {}, lambda a, r, m, h, own: {k: v[r, h] for k, v in own.items()}, worker_arrays=table,
        worker_sharding=P(None, None, "fsdp"),
    )  # fmt: skip
    drawn = dj.train_diloco(
        mesh_loss, cfg["params"], sampler, num_rounds=NUM_ROUNDS, process_local_data=True, **run
    )
    if jax.process_count() > 1:
        assert table["x"].shape[0] == 1  # this process's worker only
    out.update(
        {f"sampled_{k}": np.asarray(v) for k, v in distributed.to_host(drawn.params).items()}
    )
    # ZeRO-1 across the processes' workers: the outer momentum split over them.
    split = dj.train_diloco(
        mesh_loss, cfg["params"], cfg["data"], num_rounds=NUM_ROUNDS,
        shard_outer_over_workers=True, **run,
    )  # fmt: skip
    trace_w = split.state.outer_opt_state[0].trace["w"]
    assert trace_w.sharding.spec == P(("fsdp", "workers")), trace_w.sharding
    if jax.process_count() > 1:  # async jobs run one at a time: not over several processes
        try:
            dj.train_async(
                mesh_loss, cfg["params"], cfg["data"], num_workers=2, num_updates=2,
                inner_steps=INNER_STEPS, step_seconds=[1.0, 1.0], mesh=mesh,
            )  # fmt: skip
        except ValueError as error:
            assert "runs in one process" in str(error), error
        else:
            raise AssertionError("train_async ran on a mesh over several processes")
    out.update({f"split_{k}": np.asarray(v) for k, v in distributed.to_host(split.params).items()})
    out["mesh_inner_trace_w"] = np.asarray(state.inner_opt_state[0].trace["w"])
    out["history"] = np.asarray(json.dumps(result.history))
    return out


def save_in_background(checkpoint_dir: str) -> dict[str, np.ndarray]:
    """A state split over both processes' devices saved by a background `Saver` while the
    processes run collectives of their own (the save's barriers must not mix with them), then
    a second save, and both steps restored: {"step1": ..., "step2": ...} whole on this host."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import diloco_jax as dj

    mesh = jax.make_mesh((jax.device_count(),), ("x",), devices=jax.devices())
    sharding = NamedSharding(mesh, P("x"))
    values = np.arange(8 * jax.device_count(), dtype=np.float32).reshape(-1, 2)
    state = {"v": jax.make_array_from_callback(values.shape, sharding, lambda i: values[i])}
    total = jax.jit(lambda x: jnp.sum(x * x), out_shardings=NamedSharding(mesh, P()))
    saver = dj.checkpoint.Saver(checkpoint_dir, keep=3)
    assert saver.background, "a multi-process Saver writes in the background"
    sums = []
    for step in (1, 2):
        saver.save(step, state, {"step": step})
        for _ in range(5):  # cross-process all-reduces while the write is in flight
            sums.append(float(total(state["v"])))
        state = {"v": state["v"] + 1}
    saver.close()
    assert len(set(sums[:5])) == 1 and sums[0] == float(np.sum(values * values))
    out = {}
    for step in (2, 1):  # the latest first: then step 2 is discarded, and 1 is the latest
        dj.checkpoint.discard_after(checkpoint_dir, step)
        restored, metadata, at = dj.checkpoint.restore(checkpoint_dir, state, {})
        assert at == step and metadata["step"] == step
        out[f"step{step}"] = np.asarray(distributed.to_host(restored)["v"])
    return out


def main(argv: list[str]) -> None:
    coordinator, num_processes, process_id, out_dir = argv[:4]
    checkpoint_dir = argv[4] if len(argv) > 4 else None
    only_diloco = argv[5:] == ["diloco"]
    distributed.initialize(coordinator, int(num_processes), int(process_id))
    import jax

    assert jax.process_count() == int(num_processes), jax.process_count()
    if argv[5:] == ["mesh"]:
        result = train_on_mesh(jax.devices(), checkpoint_dir)
    else:
        result = train_both(checkpoint_dir, only_diloco)
        if only_diloco:
            result |= save_in_background(f"{checkpoint_dir}-background")
    np.savez(Path(out_dir) / f"process-{process_id}.npz", **result)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
