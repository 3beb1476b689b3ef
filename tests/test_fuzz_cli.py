"""Fuzzing the command line and config parsing: a user mistake is a ConfigError or a one-line
exit 2, never a traceback, and parsing writes nothing."""

import dataclasses
import math
import os

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from reference import assert_cli_refuses

from diloco_jax.lm import cli
from diloco_jax.lm.config import PRESETS, ConfigError, RunConfig, make_config, validate

FLAGS = [
    "--preset",
    "--workers",
    "--inner-steps",
    "--rounds",
    "--data",
    "--sharding",
    "--inner-lr",
    "--inner-optimizer",
    "--muon-lr",
    "--outer-lr",
    "--outer-optimizer",
    "--outer-momentum",
    "--model",
    "--batch-size",
    "--seq-len",
    "--dtype",
    "--param-dtype",
    "--attention",
    "--embedding",
    "--max-bytes",
    "--pretrain-steps",
    "--seed",
    "--backend",
    "--checkpoint-every",
    "--outer-delay",
    "--outer-clip",
    "--outer-state-dtype",
    "--outer-state-memory",
    "--shard-outer-over-workers",
    "--weighting",
    "--temperature",
    "--anomaly-skip",
    "--state-sync",
    "--fragments",
    "--overlap-steps",
    "--merge-alpha",
    "--algo",
    "--step-seconds",
    "--dynamic-steps",
    "--dn-buffer",
    "--dn-c",
    "--tokenizer",
    "--tensorboard",
]
VALUES = st.one_of(
    st.integers(-10, 10_000).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(
        [
            "micro",
            "quick",
            "default",
            "iid",
            "non_iid",
            "pinned_host",
            "nesterov",
            "sgd",
            "adam",
            "adamw",
            "muon",
            "vmap",
            "pmap",
            "auto",
            "stdlib",
            "text:/nope",
            "hf:",
            "",
            "-",
            "nan",
            "1e-3",
            "0",
            "-1",
            "tiny",
            "micro2",
            "ü",
            "--",
            "--workers",
            "float32",
            "bfloat16",
            "float16",
            "auto",
            "xla",
            "cudnn",
            "gather",
            "onehot",
            "async",
            "delayed_nesterov",
            "0.58,0.75,1.51,3.33",
            "1,2",
            "1,nan",
            "1,,2",
            "bytes",
            "bpe:300",
            "bpe:256",
            "bpe:",
            "bpe:x",
            "bpe:-5",
        ]
    ),
    st.text(max_size=12),
)
ARGV = st.tuples(
    st.sampled_from(["train", "compare", "bogus", "--help-me"]),
    st.lists(st.tuples(st.sampled_from(FLAGS), VALUES), max_size=6),
)

SETTINGS = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@SETTINGS
@given(ARGV)
def test_any_command_line_parses_or_fails_cleanly(tmp_path, capsys, argv):
    command, pairs = argv
    args = [command] + [x for pair in pairs for x in pair] + ["--out", str(tmp_path / "out")]
    before = sorted(os.listdir(tmp_path))
    try:
        run = cli.parse(args)
    except ConfigError as e:
        assert "\n" not in str(e) and str(e)
    except SystemExit as e:
        assert e.code == 2
        err = capsys.readouterr().err
        assert err.startswith("diloco-jax: error:") and err.count("\n") == 1, err
    else:
        validate(run.cfg)  # what parse returns is always a valid config
        assert run.command in ("train", "compare")
        assert run.checkpoint_every is None or run.checkpoint_every >= 1
    assert sorted(os.listdir(tmp_path)) == before  # parsing never writes


FIELD_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 10**6),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
)


FIELDS = [f.name for f in dataclasses.fields(RunConfig)]


@settings(max_examples=400, deadline=None)
@given(
    st.one_of(
        st.sampled_from(FIELDS).flatmap(lambda f: st.fixed_dictionaries({f: FIELD_VALUES})),
        st.dictionaries(st.sampled_from(FIELDS), FIELD_VALUES, max_size=4),
    )
)
@example({"val_fraction": "x"})
@example({"outer_lr": "x"})
@example({"inner_lr": True})
@example({"model": ["a"]})
@example({"workers": 2.0})
@example({"inner_lr": math.inf})
def test_make_config_accepts_only_valid_configs(overrides):
    try:
        cfg = make_config("micro", **overrides)
    except ConfigError as e:
        assert str(e) and "\n" not in str(e)
        return
    validate(cfg)
    for name in ("workers", "inner_steps", "rounds", "batch_size", "seq_len", "eval_batches"):
        assert isinstance(getattr(cfg, name), int) and getattr(cfg, name) >= 1
    assert math.isfinite(cfg.inner_lr) and cfg.inner_lr > 0
    assert math.isfinite(cfg.muon_lr) and cfg.muon_lr > 0
    assert cfg.inner_optimizer in ("adamw", "muon")
    assert math.isfinite(cfg.resolved_outer_lr) and cfg.resolved_outer_lr > 0


def test_unknown_config_field_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown config fields"):
        make_config("micro", learning_rate=1.0)


@pytest.mark.parametrize(
    "out",
    ["/proc/x/y", "{file}/y", "{file}", "{tmp}/new/" + "../" * 40 + "proc/zz/q", "a\x00b"],
)
def test_unusable_output_folder_fails_with_one_line_and_writes_nothing(tmp_path, capsys, out):
    (tmp_path / "file").write_text("not a folder")
    out = out.format(file=tmp_path / "file", tmp=tmp_path)
    before = sorted(os.listdir(tmp_path))
    assert_cli_refuses(["train", "--preset", "micro", "--out", out], "error: --out", capsys)
    assert sorted(os.listdir(tmp_path)) == before


OUT_PATHS = st.lists(
    st.one_of(st.sampled_from(["..", ".", "file", "proc", "", "dir"]), st.text(max_size=6)),
    min_size=1,
    max_size=4,
).map("/".join)


@SETTINGS
@given(OUT_PATHS)
@example("file/\n")  # a newline in the path once split the error over two lines
def test_any_output_path_is_created_or_fails_cleanly(tmp_path, out):
    """What main does before any work: parse, then create the folder; a path is either a
    writable folder afterwards or a one-line ConfigError that left nothing behind."""
    base = tmp_path / "base"
    base.mkdir(exist_ok=True)
    (base / "file").write_text("x")
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    try:
        made = cli.create_out(cli.parse(["train", "--out", str(base / out)]).out)
    except ConfigError as e:
        assert str(e).startswith("--out") and "\n" not in str(e)
        assert sorted(str(p) for p in tmp_path.rglob("*")) == before
    else:
        assert made.is_dir() and os.access(made, os.W_OK)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_is_a_valid_config(preset):
    validate(make_config(preset))
