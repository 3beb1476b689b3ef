"""Sharded workers on the LM side: the transformer's logical partitioning and `param_specs`,
the `1b` preset (shapes only, never materialized), `--mesh` on the command line and its
path through experiment.py into the trainers."""

import dataclasses
import functools
import json
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from reference import assert_cli_refuses

import diloco_jax as dj
from diloco_jax.lm import cli, experiment, model
from diloco_jax.lm import config as config_lib
from diloco_jax.lm import data as data_lib

TINY = model.PRESETS["tiny"]
MESH_AXES = {"fsdp": 2, "tensor": 2}
TEXT = "".join(
    f"Paragraph {i}: the quick brown fox jumps over the lazy dog.\n\n" for i in range(400)
)


@functools.cache
def _shapes(config):
    return jax.eval_shape(model.init_params, config, jax.random.key(0))


def _block(q, k, v, out, up, down):
    norm = {"scale": P()}
    return {
        "attn": {
            "query": {"kernel": q},
            "key": {"kernel": k},
            "value": {"kernel": v},
            "out": {"kernel": out},
        },
        "attn_norm": norm,
        "mlp": {"up": {"kernel": up}, "down": {"kernel": down}},
        "mlp_norm": norm,
    }


def test_logical_axes_of_every_kernel():
    block = _block(
        P("embed", "heads"),
        P("embed", "heads"),
        P("embed", "heads"),
        P("heads", "embed"),
        P("embed", "mlp"),
        P("mlp", "embed"),
    )
    assert model.logical_axes(TINY) == {
        "blocks": {0: block, 1: block},
        "final_norm": {"scale": P()},
        "token_embed": {"embedding": P("vocab", "embed")},
    }
    learned = model.logical_axes(model.get_config("micro", positions="learned"))
    assert learned["position_embed"]["embedding"] == P(None, "embed")


def test_param_specs_on_tiny_over_fsdp_and_tensor():
    # tiny: D 128, 4 heads x 32, F 512, V 256; every dim divides by 2.
    block = _block(
        P("fsdp", "tensor"),  # query [D, H*K]
        P("fsdp", "tensor"),  # key
        P("fsdp", "tensor"),  # value
        P("tensor", "fsdp"),  # out [H*K, D]
        P("fsdp", "tensor"),  # up [D, F]
        P("tensor", "fsdp"),  # down [F, D]
    )
    expected = {
        "blocks": {0: block, 1: block},
        "final_norm": {"scale": P()},
        "token_embed": {"embedding": P("tensor", "fsdp")},  # [V, D]: vocab-parallel
    }
    assert model.param_specs(TINY, _shapes(TINY), MESH_AXES) == expected
    # Arrays or a Mesh give the same: only shapes and axis sizes are read.
    params = model.init_params(TINY, jax.random.key(1))
    mesh = Mesh(np.reshape(jax.devices()[:8], (2, 2, 2)), ("workers", "fsdp", "tensor"))
    assert model.param_specs(TINY, params, mesh) == expected


def _kernels(specs):
    block = specs["blocks"][0]
    return {
        "query": block["attn"]["query"]["kernel"],
        "out": block["attn"]["out"]["kernel"],
        "up": block["mlp"]["up"]["kernel"],
        "down": block["mlp"]["down"]["kernel"],
        "embedding": specs["token_embed"]["embedding"],
        "norm": block["attn_norm"]["scale"],
    }


@pytest.mark.parametrize(
    "mesh_axes, expected",
    [
        # 3 divides no dim of tiny: embed unsharded; tensor still shards heads, mlp, vocab.
        (
            {"fsdp": 3, "tensor": 2},
            dict(query=P(None, "tensor"), out=P("tensor", None), up=P(None, "tensor"),
                 down=P("tensor", None), embedding=P("tensor", None), norm=P()),
        ),
        # 8 does not divide 4 heads (H*K = 128 would split inside heads): attention kernels
        # unsharded over tensor; F 512 and V 256 still divide by 8.
        (
            {"fsdp": 2, "tensor": 8},
            dict(query=P("fsdp", None), out=P(None, "fsdp"), up=P("fsdp", "tensor"),
                 down=P("tensor", "fsdp"), embedding=P("tensor", "fsdp"), norm=P()),
        ),
        # An absent or size-1 axis leaves its dims unsharded.
        (
            {"tensor": 2},
            dict(query=P(None, "tensor"), out=P("tensor", None), up=P(None, "tensor"),
                 down=P("tensor", None), embedding=P("tensor", None), norm=P()),
        ),
        (
            {"fsdp": 4, "tensor": 1},
            dict(query=P("fsdp", None), out=P(None, "fsdp"), up=P("fsdp", None),
                 down=P(None, "fsdp"), embedding=P(None, "fsdp"), norm=P()),
        ),
        # Axes no rule names shard no parameter: a spec sharding no dim is P().
        ({"data": 8}, dict(query=P(), out=P(), up=P(), down=P(), embedding=P(), norm=P())),
    ],
    ids=["fsdp3", "tensor8", "no-fsdp", "tensor1", "other-axis"],
)  # fmt: skip
def test_param_specs_leave_indivisible_or_absent_axes_unsharded(mesh_axes, expected):
    assert _kernels(model.param_specs(TINY, _shapes(TINY), mesh_axes)) == expected


def test_heads_split_by_whole_heads_only():
    # 2 heads x 64: H*K = 128 divides by 4, but 4 devices would split each head in two.
    config = model.get_config("tiny", num_heads=2)
    got = _kernels(model.param_specs(config, _shapes(config), {"fsdp": 2, "tensor": 4}))
    assert got["query"] == P("fsdp", None) and got["out"] == P(None, "fsdp")
    assert got["up"] == P("fsdp", "tensor")


def test_param_specs_rules_min_size_and_errors():
    shapes = _shapes(TINY)
    # Several mesh axes for one logical axis: kept in order while their product divides.
    rules = {"embed": ("fsdp", "data"), "mlp": "tensor"}
    got = _kernels(
        model.param_specs(TINY, shapes, {"fsdp": 2, "data": 4, "tensor": 2}, rules=rules)
    )
    assert got["up"] == P(("fsdp", "data"), "tensor") and got["query"] == P(("fsdp", "data"), None)
    got = _kernels(model.param_specs(TINY, shapes, {"fsdp": 2, "data": 3}, rules=rules))
    assert got["up"] == P("fsdp", None)
    # A mesh axis partitions one dim of a leaf at most: the first that asks for it.
    got = _kernels(
        model.param_specs(TINY, shapes, MESH_AXES, rules={"embed": "fsdp", "mlp": "fsdp"})
    )
    assert got["up"] == P("fsdp", None) and got["down"] == P("fsdp", None)
    # Leaves under min_size stay whole: every kernel of tiny has 128 * 128 or more elements.
    specs = model.param_specs(TINY, shapes, MESH_AXES, min_size=128 * 128 + 1)
    assert _kernels(specs)["query"] == P() and _kernels(specs)["up"] == P("fsdp", "tensor")
    with pytest.raises(ValueError, match="do not match the structure"):
        model.param_specs(TINY, _shapes(model.PRESETS["micro"]), MESH_AXES)
    with pytest.raises(ValueError, match="'fsdp' must have an int size >= 1"):
        model.param_specs(TINY, shapes, {"fsdp": 0})
    with pytest.raises(ValueError, match="rules"):
        model.param_specs(TINY, shapes, MESH_AXES, rules={"embed": 3})


def test_params_placed_by_their_specs_give_the_same_loss_and_grads():
    """The specs are valid shardings of the params (one entry per dim, dims divisible), and
    GSPMD's partitioned loss and gradients agree with the unsharded ones."""
    mesh = Mesh(np.reshape(jax.devices()[:4], (2, 2)), ("fsdp", "tensor"))
    params = model.init_params(TINY, jax.random.key(0))
    specs = model.param_specs(TINY, params, mesh)
    placed = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)
    assert placed["blocks"][0]["mlp"]["up"]["kernel"].sharding.spec == P("fsdp", "tensor")
    tokens = jax.random.randint(jax.random.key(1), (4, 33), 0, 256, jnp.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    grad = jax.jit(jax.value_and_grad(model.make_loss_fn(TINY)))
    (loss, grads), (sharded_loss, sharded_grads) = grad(params, batch), grad(placed, batch)
    np.testing.assert_allclose(sharded_loss, loss, rtol=1e-6)
    for got, want in zip(jax.tree.leaves(sharded_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-7)


@pytest.mark.slow
def test_shard_activations_splits_the_residual_batch_over_fsdp():
    """Under a mesh with an fsdp axis, `shard_activations` constrains the residual stream at
    each block boundary (num_layers + 1 of them) to its batch over fsdp, with or without
    `remat`; the loss and gradients stay the unconstrained ones up to rounding. Without the
    option, or with a batch fsdp does not divide, nothing is constrained; beside a tensor
    axis (where XLA's partitioner aborts on it) it is a ValueError."""
    mesh = jax.make_mesh((4,), ("fsdp",), axis_types=(AxisType.Auto,))
    params = model.init_params(TINY, jax.random.key(0))
    specs = model.param_specs(TINY, params, mesh)
    placed = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)

    def lowered(config, batch_size, mesh=mesh):
        tokens = jax.random.randint(jax.random.key(1), (batch_size, 17), 0, 256, jnp.int32)
        batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
        # Built outside the mesh: building the NNX module under `jax.set_mesh` fails (noted).
        grad = jax.jit(jax.value_and_grad(model.make_loss_fn(config)))
        with jax.set_mesh(mesh):
            return grad.lower(placed, batch), grad(placed, batch)

    def batch_constraints(text):
        # [B, L, D] split on B over fsdp, whole over tensor (Shardy's lowering)
        return len(re.findall(r'sharding_constraint .*\[\{"fsdp"\}, \{\}, \{\}\]', text))

    plain_lowered, (loss, grads) = lowered(TINY, 4)
    assert batch_constraints(plain_lowered.as_text()) == 0
    for options in ({"shard_activations": True}, {"shard_activations": True, "remat": True}):
        config = dataclasses.replace(TINY, **options)
        got_lowered, (got_loss, got_grads) = lowered(config, 4)
        # each boundary's and, in the backward pass, its cotangent's
        assert batch_constraints(got_lowered.as_text()) == 2 * (TINY.num_layers + 1)
        np.testing.assert_allclose(got_loss, loss, rtol=1e-6)
        for got, want in zip(jax.tree.leaves(got_grads), jax.tree.leaves(grads), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-7)
    odd, _ = lowered(dataclasses.replace(TINY, shard_activations=True), 6)
    assert batch_constraints(odd.as_text()) == 0
    tensor = jax.make_mesh((2, 2), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2)
    with pytest.raises(ValueError, match="shard_activations .* also partitions \\('tensor',\\)"):
        lowered(dataclasses.replace(TINY, shard_activations=True), 4, mesh=tensor)


# Stated range for the 1b preset: 1.0-1.3B parameters with the byte vocabulary or a 32k one.
@pytest.mark.parametrize("vocab_size, exact", [(256, 1_007_241_216), (32_000, 1_072_252_928)])
def test_1b_preset_parameter_count_and_flops(vocab_size, exact):
    config = model.get_config("1b", vocab_size=vocab_size)
    shapes = _shapes(config)  # eval_shape: nothing allocated
    count = model.count_params(shapes)
    assert 1.0e9 <= count <= 1.3e9 and count == exact
    d, f, layers, hk = 2048, 8192, 20, 16 * 128
    assert (config.d_model, config.d_ff, config.num_layers, config.num_heads) == (d, f, layers, 16)
    # 6 N over the matmul weights plus attention over a 1024 context: within 10% of 6 x count.
    n = layers * (4 * d * hk + 2 * d * f) + vocab_size * d
    flops = model.flops_per_token(config, 1024)
    assert flops == 6 * n + 12 * layers * hk * 1024
    assert 1.0 < flops / (6 * count) < 1.1
    # Every kernel shards over 4 x 2 devices; only the norm scales stay whole.
    specs = model.param_specs(config, shapes, {"fsdp": 4, "tensor": 2})
    assert all(
        s == P() if leaf.ndim == 1 else set(s) == {"fsdp", "tensor"}
        for s, leaf in zip(jax.tree.leaves(specs), jax.tree.leaves(shapes), strict=True)
    )


def test_1b_run_preset_is_valid():
    cfg = config_lib.make_config("h200_1b")
    assert cfg.model == "1b" and cfg.mesh is None
    config_lib.validate(config_lib.make_config("h200_1b", mesh=(("workers", 2), ("fsdp", 4))))


def test_mesh_flag_parses_into_the_config():
    run = cli.parse(["train", "--preset", "micro", "--mesh", "workers=2,fsdp=2,tensor=2"])
    assert run.cfg.mesh == (("workers", 2), ("fsdp", 2), ("tensor", 2))
    run = cli.parse(["compare", "--preset", "micro", "--mesh", "fsdp=2, workers=2"])
    assert run.cfg.mesh == (("fsdp", 2), ("workers", 2))
    assert cli.parse(["train", "--preset", "micro"]).cfg.mesh is None
    assert config_lib.format_mesh(run.cfg.mesh) == "fsdp=2,workers=2"
    assert config_lib.mesh_axes(run.cfg, 1) == (("fsdp", 2), ("workers", 1))


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["train", "--mesh", "workers=2,fsdp"],
            "--mesh must look like 'workers=2,fsdp=2,tensor=2'",
        ),
        (["train", "--mesh", "workers=2,fsdp=2.5"], "--mesh must look like"),
        (["train", "--mesh", "workers=2,fsdp=-1"], "--mesh must look like"),
        (["train", "--mesh", "workers=2,"], "--mesh must look like"),
        (["train", "--mesh", ""], "--mesh must look like"),
        (["train", "--mesh", "workers=2,fsdp=0"], "--mesh axis fsdp must have a size >= 1"),
        (["compare", "--mesh", "fsdp=2,tensor=2"], "--mesh needs a 'workers' axis"),
        (["train", "--mesh", "workers=2,workers=2"], "--mesh names an axis twice"),
        (
            ["train", "--mesh", "workers=4,fsdp=2"],
            "--mesh workers=4,fsdp=2: the workers axis must have the run's 2 workers",
        ),
        (["train", "--mesh", "workers=2,fsdp=3"], "batch_size must be a multiple of 3"),
        (["train", "--backend", "vmap", "--mesh", "workers=2"], "--mesh places the workers"),
        (
            ["train", "--batch-size", "8", "--mesh", "workers=2,fsdp=8"],
            "--mesh workers=2,fsdp=8 needs 16 devices, there are 8",
        ),
        (
            ["train", "--shard-activations", "--mesh", "workers=2,fsdp=2,tensor=2"],
            "--shard-activations splits the batch over fsdp only: --mesh "
            "workers=2,fsdp=2,tensor=2 also partitions each worker over tensor",
        ),
        (
            ["compare", "--shard-activations", "--mesh", "workers=2,fsdp=1,tensor=2"],
            "also partitions each worker over tensor",
        ),
        (
            ["train", "--shard-activations", "--mesh", "workers=2,fsdp=1"],
            "--mesh workers=2,fsdp=1 has no fsdp axis of size > 1",
        ),
        (["train", "--shard-activations"], "--shard-activations splits the batch over a --mesh"),
    ],
)
def test_bad_mesh_is_one_line_exit_2_naming_mesh(argv, message, tmp_path, capsys):
    out = tmp_path / "never"
    assert_cli_refuses([*argv, "--preset", "micro", "--out", str(out)], message, capsys, out)


def _train(tmp_path, name, *flags, model_name="micro"):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 3)
    out = tmp_path / name
    argv = [
        "train",
        "--preset",
        "micro",
        "--model",
        model_name,
        "--data",
        f"text:{corpus}",
        "--inner-steps",
        "3",
        "--rounds",
        "2",
        "--out",
        str(out),
        "--no-progress",
        *flags,
    ]
    assert cli.main(argv) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return records, json.loads((out / "summary.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["diloco", "sync", "async"])
def test_mesh_reaches_the_trainers_only_when_given(monkeypatch, tmp_path, algo):
    """--mesh's keywords as the trainers get them, whatever the engine does with them: the
    pretrain's one worker on workers=1 (4 devices), the run's 2 workers on all 8; each with
    model.param_specs over fsdp x tensor. Without --mesh (checked on the diloco run, whose
    pretrain is the sync path), no mesh keyword at all."""
    calls, streams = [], []

    def recording(trainer):
        def fake(loss_fn, params, sampler, mesh=None, worker_axis=None, param_sharding=None,
                 **kwargs):  # fmt: skip
            calls.append((trainer.__name__, mesh, worker_axis, param_sharding, kwargs))
            streams.append(sampler.sharding)
            # Run without the mesh: the stream, split over it, goes back to one piece too.
            sampler = dataclasses.replace(sampler, sharding=None, worker_sharding=None)
            return trainer(loss_fn, params, sampler, **kwargs)

        fake.__name__ = trainer.__name__
        return fake

    monkeypatch.setattr(experiment, "train_diloco", recording(experiment.train_diloco))
    monkeypatch.setattr(experiment, "train_sync", recording(experiment.train_sync))
    monkeypatch.setattr(experiment, "train_async", recording(experiment.train_async))
    _, summary = _train(tmp_path, "mesh", "--algo", algo, "--mesh", "workers=2,fsdp=2,tensor=2")
    (pre, pre_mesh, pre_axis, pre_specs, _), (run, mesh, axis, specs, kwargs) = calls
    assert pre == "train_sync" and run == f"train_{algo}"
    assert pre_axis == axis == "workers" and kwargs["num_workers"] == 2
    assert dict(pre_mesh.shape) == {"workers": 1, "fsdp": 2, "tensor": 2}
    assert dict(mesh.shape) == {"workers": 2, "fsdp": 2, "tensor": 2}
    assert list(pre_mesh.devices.flat) == jax.devices()[:4]
    assert list(mesh.devices.flat) == jax.devices()[:8]
    assert set(mesh.axis_types) == {jax.sharding.AxisType.Auto}
    micro = model.get_config("micro")
    assert specs == pre_specs == model.param_specs(micro, _shapes(micro), MESH_AXES)
    assert summary["devices"] == 8
    # The token stream every worker reads (iid), split over each worker's 4 devices.
    assert [spec.tree()["tokens"] for spec in streams] == [P(("fsdp", "tensor"))] * 2
    if algo != "diloco":
        return
    calls.clear(), streams.clear()
    _train(tmp_path, "plain", "--algo", algo)
    assert [call[1:4] for call in calls] == [(None, None, None)] * 2
    assert [spec.tree()["tokens"] for spec in streams] == [P()] * 2


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["halos,regions=0/1,local_updates=1", "decoupled,quorum=1"])
def test_a_server_trains_on_a_mesh_as_on_one_device(tmp_path, spec):
    """`train --algo async --server halos,...|decoupled,... --mesh workers=2,fsdp=2,tensor=2`:
    each worker's jobs (or learner's steps) on its 4 devices, the servers' θ at
    model.param_specs over all 8; the losses of the run on one device, to float32 rounding,
    and each device's bytes its shards."""
    server = ["--algo", "async", "--server", spec]
    plain, plain_summary = _train(tmp_path, "one", *server)
    meshed, summary = _train(tmp_path, "mesh", *server, "--mesh", "workers=2,fsdp=2,tensor=2")
    runs = [[r for r in x if r["run"] == "async"] for x in (plain, meshed)]
    assert [r["update"] for r in runs[1]] == [r["update"] for r in runs[0]]
    np.testing.assert_allclose([r["loss"] for r in runs[1]], [r["loss"] for r in runs[0]],
                               rtol=2e-4)  # fmt: skip
    assert summary["final_eval_loss"] == pytest.approx(plain_summary["final_eval_loss"], rel=2e-4)
    assert 0 < runs[1][-1]["wire_bytes_per_device"] < runs[1][-1]["wire_bytes"]


@pytest.mark.slow
def test_compare_on_a_mesh_counts_what_each_device_sends(tmp_path):
    """`compare --mesh workers=2,fsdp=2,tensor=2`: DiLoCo, the one-worker baseline and data
    parallelism all train on the mesh, and each run's summary holds what a device sends: its
    float32 shards of the params (by `model.param_specs`) per exchange, plus DiLoCo's loss and
    exclusion count (8 bytes a round) or the sync step's loss (4 bytes a step)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 3)
    out = tmp_path / "cmp"
    argv = ["compare", "--preset", "micro", "--data", f"text:{corpus}", "--rounds", "2",
            "--inner-steps", "2", "--pretrain-steps", "0", "--out", str(out), "--no-progress",
            "--mesh", "workers=2,fsdp=2,tensor=2"]  # fmt: skip
    assert cli.main(argv) == 0
    runs = json.loads((out / "summary.json").read_text())["runs"]
    micro = model.get_config("micro")
    shapes = _shapes(micro)
    specs = model.param_specs(micro, shapes, MESH_AXES)
    shard = 0
    for leaf, spec in zip(jax.tree.leaves(shapes), jax.tree.leaves(specs), strict=True):
        named = [n for e in spec if e is not None for n in (e if isinstance(e, tuple) else (e,))]
        shard += np.prod(leaf.shape) // np.prod([MESH_AXES[n] for n in named], dtype=int)
    assert 0 < shard < model.count_params(shapes) / 3  # most of the model split 4 ways
    assert runs["diloco"]["wire_bytes_per_device"] == 2 * (4 * shard + 8)
    assert runs["sync_data_parallel"]["wire_bytes_per_device"] == 2 * 2 * (4 * shard + 4)
    assert runs["sync_1worker"]["wire_bytes_per_device"] == 0
    for run in runs.values():
        assert np.isfinite(run["final_eval_loss"])


@pytest.mark.parametrize(
    "pretrain_steps", ["0", pytest.param("2", marks=pytest.mark.slow)], ids=["cold", "warm-start"]
)
@pytest.mark.slow
def test_train_on_a_mesh_matches_the_run_without_one(tmp_path, pretrain_steps):
    """tiny (float32) with 2 workers, each over fsdp=2 x tensor=2 of the 8 devices: the same
    losses as the vmap / shard_map run, up to the partitioned matmuls' rounding. The warm
    start trains its one worker on the mesh workers=1,fsdp=4 (4 devices), then 2 workers on
    workers=2,fsdp=4, both recomputing each block and splitting the residual's batch over
    fsdp (`--remat --shard-activations`: what a device holds, not what the model computes;
    test_mesh checks that every path's loss sees the mesh's axes)."""
    flags = ["--pretrain-steps", pretrain_steps]
    plain, _ = _train(tmp_path, "plain", *flags, model_name="tiny")
    mesh = ["--mesh", "workers=2,fsdp=2,tensor=2"]
    if pretrain_steps != "0":
        mesh = ["--mesh", "workers=2,fsdp=4", "--remat", "--shard-activations"]
    meshed, summary = _train(tmp_path, "mesh", *flags, *mesh, model_name="tiny")
    assert (tmp_path / "mesh" / "metrics.jsonl").exists() and summary["devices"] == 8
    model_record = json.loads((tmp_path / "mesh" / "config.json").read_text())["model"]
    assert model_record["remat"] == model_record["shard_activations"] == (pretrain_steps != "0")
    assert [r["run"] for r in meshed] == [r["run"] for r in plain]
    assert [r["run"] for r in meshed].count("pretrain") == int(pretrain_steps)
    for got, want in zip(meshed, plain, strict=True):
        np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
        if "eval_loss" in want:
            np.testing.assert_allclose(got["eval_loss"], want["eval_loss"], rtol=1e-5)
    assert meshed[-1]["run"] == "diloco"
    assert meshed[-1]["loss"] == pytest.approx(plain[-1]["loss"], rel=1e-5)


@pytest.mark.slow
def test_a_checkpointed_run_resumes_on_another_mesh(tmp_path):
    """2 rounds on workers=2,fsdp=4 with the outer state split over the workers and a
    checkpoint each round; the last one removed, the rerun on workers=2,fsdp=2,tensor=2 with
    θ and the outer state in host memory restores round 1's onto the new layout and trains
    round 2: the losses of the uninterrupted run, up to the partitioned matmuls' rounding."""
    flags = ["--pretrain-steps", "0", "--checkpoint-every", "1"]
    first, _ = _train(
        tmp_path, "run", *flags, "--mesh", "workers=2,fsdp=4", "--shard-outer-over-workers"
    )
    steps = tmp_path / "run" / "checkpoints" / "run"
    assert sorted(p.name for p in steps.iterdir() if p.name.isdigit()) == ["1", "2"]
    shutil.rmtree(steps / "2")
    resumed, summary = _train(
        tmp_path, "run", *flags, "--mesh", "workers=2,fsdp=2,tensor=2",
        "--outer-state-memory", "pinned_host",
    )  # fmt: skip
    config = json.loads((tmp_path / "run" / "config.json").read_text())["config"]
    assert config["mesh"] == [["workers", 2], ["fsdp", 2], ["tensor", 2]]
    assert not config["shard_outer_over_workers"]
    assert config["outer_state_memory"] == "pinned_host"
    assert [r["round"] for r in resumed] == [r["round"] for r in first]
    assert resumed[0] == first[0]  # restored from the checkpoint, wall clock and all
    assert resumed[-1]["wall_seconds"] != first[-1]["wall_seconds"]  # trained again
    for got, want in zip(resumed, first, strict=True):
        np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
        if "eval_loss" in want:
            np.testing.assert_allclose(got["eval_loss"], want["eval_loss"], rtol=1e-5)


def test_a_fresh_loss_traces_first_inside_a_mesh_round():
    """`make_loss_fn` builds the abstract module when the loss is made: a loss first traced
    inside a round's shard_map (nothing of the model built before) runs there, instead of
    resolving the model's logical axes against that mesh."""
    import optax

    import diloco_jax as dj

    config = model.get_config("micro")
    model._abstract_split.cache_clear()
    params = jax.tree.map(np.asarray, model.init_params(config, jax.random.key(0)))
    model._abstract_split.cache_clear()  # init_params builds no abstract module; be sure
    loss_fn = model.make_loss_fn(config)
    mesh = jax.make_mesh((2, 4), ("workers", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (2, 1, 4, config.seq_len))
    batch = {"inputs": tokens.astype(np.int32), "targets": tokens.astype(np.int32)}
    result = dj.train_diloco(
        loss_fn, params, [batch], num_rounds=1, num_workers=2, inner_steps=1, mesh=mesh,
        param_sharding=model.param_specs(config, params, {"fsdp": 4}),
        inner_optimizer=optax.sgd(0.1),
    )  # fmt: skip
    assert np.isfinite(result.history[0]["loss"])


@pytest.mark.slow
def test_a_compressed_run_on_a_sharded_mesh(tmp_path):
    """--compression int8 with each worker's params over fsdp=4: each device encodes its
    shards (tests/test_sharded_compression.py has the exact checks); the run trains and
    sends int8 payloads, about a quarter of the float32 run's bytes."""
    flags = ["--pretrain-steps", "0", "--mesh", "workers=2,fsdp=4"]
    records, summary = _train(tmp_path, "int8", *flags, "--compression", "int8")
    assert summary["devices"] == 8
    assert all(np.isfinite(r["loss"]) for r in records if "loss" in r)
    _, exact = _train(tmp_path, "exact", *flags)
    sent = [s["bytes_communicated"] for s in (summary, exact)]
    assert 0.25 < sent[0] / sent[1] < 0.3


@pytest.mark.parametrize("sharding", ["iid", "non_iid"])
def test_the_samplers_streams_split_over_each_workers_devices_draw_the_same_windows(sharding):
    """make_sampler under --mesh workers=2,fsdp=2,tensor=2: each device holds a quarter of the
    stream its worker reads ("non_iid": only its own worker's shard, stored as that worker's
    row), and every (round, worker, step) draws the windows sample_batch cuts from the whole
    stream at the worker's shard."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, size=1001).astype(np.int32)
    corpus = experiment.Corpus(tokens, np.asarray([0, 300, 520, 800]), {}, {})
    mesh = (("workers", 2), ("fsdp", 2), ("tensor", 2))
    cfg = config_lib.RunConfig(sharding=sharding, batch_size=4, seq_len=16, mesh=mesh)
    sampler = experiment.make_sampler(cfg, corpus, 2, salt=0)
    backend = dj.make_backend("auto", 2, mesh=experiment.make_mesh(cfg, 2))
    placed = dj.sampler.place_sampler(sampler, backend)
    stream = (placed.arrays if sharding == "iid" else placed.worker_arrays)["tokens"]
    starts, lengths = data_lib.worker_shards(corpus.doc_starts, 1001, 2, sharding, 16)
    # One stream of 1001 tokens padded to 1004, or two rows of the longest shard (520) each.
    assert stream.shape == ((1004,) if sharding == "iid" else (2, 520))
    assert max(lengths) == (1001 if sharding == "iid" else 520)
    assert {s.data.shape[-1] for s in stream.addressable_shards} == {stream.shape[-1] // 4}

    def draw(s, r, m, h):  # worker m's draw, its row of worker_arrays where it has one
        own = () if s.worker_arrays is None else (jax.tree.map(lambda x: x[m], s.worker_arrays),)
        return s.sample(s.arrays, r, m, h, *own)

    draw = jax.jit(draw)
    for r, m, h in [(0, 0, 0), (3, 1, 2), (5, 0, 7)]:
        got = draw(placed, jnp.int32(r), m, h)
        key = data_lib.batch_key(sampler.arrays["key"], r, m, h)
        want = data_lib.sample_batch(tokens, starts[m], lengths[m], key, 4, 16)
        np.testing.assert_array_equal(got["inputs"], want["inputs"])
        np.testing.assert_array_equal(got["targets"], want["targets"])
