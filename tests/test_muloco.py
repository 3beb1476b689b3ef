"""MuLoCo's inner optimizer (Muon on the hidden matrices, AdamW on the rest) against NumPy
references of the authors' rule (the Dion Muon in facebookresearch/MuLoCo), its routing, a
short DiLoCo run with it, and the LM's --inner-optimizer flag."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from reference import assert_cli_refuses

import diloco_jax as dj
from diloco_jax.lm import cli
from diloco_jax.lm import config as lm_config
from diloco_jax.lm import model as model_lib

# Dion's `zeropower_via_newtonschulz5` constants, as the MuLoCo authors' code lists them.
DION = [
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
]


def np_newton_schulz(g: np.ndarray, eps: float = 1e-8) -> np.ndarray:
    """Dion's NS: transpose a tall matrix, divide by (Frobenius norm + eps), five quintic steps."""
    x = g.astype(np.float64)
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / (np.linalg.norm(x) + eps)
    for a, b, c in DION:
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if tall else x


def np_muon_step(w, m, g, *, lr, momentum, weight_decay):
    """The authors' Muon on a [fan_in, fan_out] leaf: m <- mu m + g (no Nesterov), decoupled
    decay with the base lr, the orthogonalized step scaled by sqrt(fan_out / fan_in)."""
    m = momentum * m + g
    scale = np.sqrt(w.shape[1] / w.shape[0])
    return w * (1 - lr * weight_decay) - lr * scale * np_newton_schulz(m), m


def np_adamw_step(w, m, v, g, t, *, lr, b1, b2, weight_decay, eps=1e-8):
    """AdamW with bias correction and decoupled weight decay, step t >= 1."""
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    update = (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
    return w * (1 - lr * weight_decay) - lr * update, m, v


def _labels_by_path(labels) -> dict[str, str]:
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(labels)[0]}


def test_coefficients_are_dions():
    assert [tuple(c) for c in dj.optimizers.DION_NS_COEFFS] == DION
    assert list(dj.optimizers.ns_coefficients(5)) == DION
    assert list(dj.optimizers.ns_coefficients(2)) == DION[:2]
    assert list(dj.optimizers.ns_coefficients(7)) == DION + [DION[-1]] * 2
    # optax's own "dion" preset holds the same triples
    from optax.contrib import _muon

    assert [tuple(c) for c in _muon._NS_COEFFS_PRESET_DICT["dion"]] == DION


@pytest.mark.parametrize("positions", ["rotary", "learned"])
def test_routing_of_the_tiny_lm(positions):
    config = model_lib.get_config("tiny", positions=positions)
    params = jax.eval_shape(model_lib.init_params, config, jax.random.key(0))
    labels = _labels_by_path(dj.optimizers.muon_labels(params))
    muon = {k for k, v in labels.items() if v == "muon"}
    expected = {
        f"['blocks'][{i}]['{block}']['{name}']['kernel']"
        for i in range(config.num_layers)
        for block, names in (("attn", ("query", "key", "value", "out")), ("mlp", ("up", "down")))
        for name in names
    }
    assert muon == expected
    # the tied embedding / output head, the learned positions and every norm go to AdamW
    assert labels["['token_embed']['embedding']"] == "adamw"
    assert labels["['final_norm']['scale']"] == "adamw"
    if positions == "learned":
        assert labels["['position_embed']['embedding']"] == "adamw"


def test_routing_of_a_hand_made_dict_and_a_custom_rule():
    params = {
        "wte": np.zeros((50, 8)),
        "pos_embedding": np.zeros((16, 8)),
        "layer": {"kernel": np.zeros((8, 16)), "bias": np.zeros(16)},
        "attn": {"out": {"kernel": np.zeros((16, 8))}},
        "lm_head": {"kernel": np.zeros((8, 50))},
        "output": np.zeros((8, 50)),
        "conv": np.zeros((3, 3, 4, 4)),
        "temperature": np.zeros(()),
        "stack": [np.zeros((4, 4)), np.zeros(4)],
    }
    labels = dj.optimizers.muon_labels(params)
    assert labels == {
        "wte": "adamw",
        "pos_embedding": "adamw",
        "layer": {"kernel": "muon", "bias": "adamw"},
        "attn": {"out": {"kernel": "muon"}},
        "lm_head": {"kernel": "adamw"},
        "output": "adamw",
        "conv": "adamw",
        "temperature": "adamw",
        "stack": ["muon", "adamw"],
    }
    # a caller's own rule: every 2-D leaf, embeddings included; it sees the path as strings
    seen = []

    def every_matrix(path, leaf):
        seen.append(path)
        return leaf.ndim == 2

    labels = dj.optimizers.muon_labels(params, every_matrix)
    assert labels["wte"] == labels["lm_head"]["kernel"] == "muon"
    assert ("stack", "1") in seen and ("layer", "kernel") in seen
    with pytest.raises(ValueError, match="conv.*2-D"):
        dj.optimizers.muon_labels(params, lambda path, leaf: path == ("conv",))


def _run_steps(opt, params, grads_T):
    state = opt.init(params)
    step = jax.jit(opt.update)
    out = []
    for g in grads_T:
        updates, state = step(g, state, params)
        params = optax.apply_updates(params, updates)
        out.append(params)
    return out


def test_muon_and_adamw_steps_match_numpy():
    """Three steps: Dion NS, momentum 0.95 without Nesterov, sqrt(fan_out / fan_in) both ways
    (tall and wide), decoupled weight decay; AdamW (0.9, 0.95) on a 1-D leaf and the
    embedding, with its own learning rate and decay."""
    rng = np.random.default_rng(0)
    shapes = {"tall": (12, 4), "wide": (4, 10), "square": (6, 6), "b": (5,), "embed": (7, 4)}
    params = {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
    grads_T = [
        {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()} for _ in range(3)
    ]
    lr, adam_lr, wd, adam_wd = 0.02, 3e-3, 0.1, 0.05
    opt = dj.muon_inner_optimizer(
        lr, adamw_learning_rate=adam_lr, weight_decay=wd, adamw_weight_decay=adam_wd
    )
    got = _run_steps(opt, jax.tree.map(jnp.asarray, params), grads_T)

    want = {k: v.astype(np.float64) for k, v in params.items()}
    m = {k: np.zeros(s) for k, s in shapes.items()}
    v = {k: np.zeros(s) for k, s in shapes.items()}
    for t, grads in enumerate(grads_T, start=1):
        for k in ("tall", "wide", "square"):
            want[k], m[k] = np_muon_step(
                want[k], m[k], grads[k], lr=lr, momentum=0.95, weight_decay=wd
            )
        for k in ("b", "embed"):
            want[k], m[k], v[k] = np_adamw_step(
                want[k], m[k], v[k], grads[k], t, lr=adam_lr, b1=0.9, b2=0.95, weight_decay=adam_wd
            )
        for k in shapes:  # every step moves a leaf by ~1e-2; float32 NS agrees to ~1e-7
            np.testing.assert_allclose(got[t - 1][k], want[k], rtol=0, atol=1e-6, err_msg=k)


def test_reference_tells_the_variants_apart():
    """The 1e-6 tolerance above would catch optax's max(1, .) scaling, Nesterov, beta 0.9."""
    rng = np.random.default_rng(1)
    w, g1, g2 = (rng.normal(size=(12, 4)) for _ in range(3))
    base, m = np_muon_step(w, 0 * w, g1, lr=0.02, momentum=0.95, weight_decay=0.0)
    base, _ = np_muon_step(base, m, g2, lr=0.02, momentum=0.95, weight_decay=0.0)
    params = {"w": jnp.asarray(w, jnp.float32)}
    grads_T = [{"w": jnp.asarray(g, jnp.float32)} for g in (g1, g2)]
    variants = [
        optax.contrib.muon(0.02, ns_coeffs="dion", nesterov=False),  # sqrt(max(1, 4 / 12)) = 1
        dj.muon_inner_optimizer(0.02, momentum=0.9, weight_decay=0.0),
    ]
    for opt in variants:
        assert np.abs(_run_steps(opt, params, grads_T)[-1]["w"] - base).max() > 1e-4
    ours = _run_steps(dj.muon_inner_optimizer(0.02, weight_decay=0.0), params, grads_T)[-1]
    assert np.abs(ours["w"] - base).max() < 1e-6


def test_newton_schulz_output_is_nearly_orthogonal():
    g = np.random.default_rng(2).normal(size=(16, 8)).astype(np.float32)
    opt = dj.muon_inner_optimizer(1.0, weight_decay=0.0, is_hidden_matrix=lambda p, x: True)
    params = {"w": jnp.zeros_like(g)}
    updates, _ = opt.update({"w": jnp.asarray(g)}, opt.init(params), params)
    ortho = -np.asarray(updates["w"]) / np.sqrt(8 / 16)  # undo lr and the fan scaling
    singular = np.linalg.svd(ortho, compute_uv=False)
    assert 0.6 < singular.min() and singular.max() < 1.3  # Dion's NS lands near 1
    np.testing.assert_allclose(ortho, np_newton_schulz(g), atol=2e-6)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(learning_rate=0.0), "learning_rate"),
        (dict(learning_rate=-0.02), "learning_rate"),
        (dict(learning_rate=float("nan")), "learning_rate"),
        (dict(adamw_learning_rate=0), "adamw_learning_rate"),
        (dict(momentum=1.0), "momentum"),
        (dict(momentum=-0.1), "momentum"),
        (dict(ns_steps=0), "ns_steps"),
        (dict(ns_steps=2.5), "ns_steps"),
        (dict(weight_decay=-1.0), "weight_decay"),
        (dict(adamw_b2=1.0), "adamw_b2"),
        (dict(is_hidden_matrix="ndim==2"), "is_hidden_matrix"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name} must be"):
        dj.muon_inner_optimizer(**kwargs)


def test_schedules_are_accepted():
    schedule = optax.linear_schedule(0.0, 0.02, 10)
    opt = dj.muon_inner_optimizer(schedule, adamw_learning_rate=schedule)
    params = {"w": jnp.ones((4, 4)), "b": jnp.ones(4)}
    updates, _ = jax.jit(opt.update)(params, jax.jit(opt.init)(params), params)  # one compile
    assert all(float(jnp.abs(u).max()) == 0.0 for u in jax.tree.leaves(updates))  # lr(0) = 0


# A transformer small enough that the two compiles of the run stay a few seconds.
TINY_LM = model_lib.ModelConfig(
    vocab_size=32, seq_len=8, d_model=16, num_layers=1, num_heads=2, d_ff=32
)


def _micro_diloco(inner_optimizer):
    config = TINY_LM
    params = model_lib.init_params(config, jax.random.key(0))
    rng = np.random.default_rng(0)
    M, H, R, B = 2, 3, 2, 2
    tokens = rng.integers(0, config.vocab_size, size=(R, M, H, B, config.seq_len + 1))
    rounds = [{"inputs": t[..., :-1], "targets": t[..., 1:]} for t in tokens.astype(np.int32)]
    return dj.train_diloco(
        model_lib.make_loss_fn(config),
        params,
        rounds,
        num_rounds=R,
        num_workers=M,
        inner_steps=H,
        inner_optimizer=inner_optimizer,
        outer_optimizer=optax.sgd(0.7, momentum=0.6, nesterov=True),  # the MuLoCo recipe
        backend="vmap",
    )


@pytest.mark.slow
def test_short_diloco_run_with_muon_is_finite_and_repeatable():
    first = _micro_diloco(dj.muon_inner_optimizer(0.02))
    second = _micro_diloco(dj.muon_inner_optimizer(0.02))
    assert all(np.isfinite(h["loss"]) for h in first.history)
    assert first.history[-1]["loss"] < first.history[0]["loss"]
    for a, b in zip(jax.tree.leaves(first.state), jax.tree.leaves(second.state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    changed = jax.tree.map(
        lambda a, b: bool(np.any(np.asarray(a) != np.asarray(b))),
        first.params,
        model_lib.init_params(TINY_LM, jax.random.key(0)),
    )
    assert all(jax.tree.leaves(changed))  # every leaf trained, Muon's and AdamW's


def test_lm_inner_optimizer_config():
    assert lm_config.make_config("micro").inner_optimizer == "adamw"
    cfg = lm_config.make_config("micro", inner_optimizer="muon", muon_lr=0.05)
    # Shapes are all the routing needs: the abstract params and state (nothing computed).
    config = model_lib.get_config(cfg.model)
    params = jax.eval_shape(model_lib.init_params, config, jax.random.key(0))
    opt = lm_config.inner_optimizer(cfg)
    state = jax.eval_shape(opt.init, params)
    assert set(state.inner_states) == {"muon", "adamw"}
    # the same warmup + cosine shape as AdamW's, peaking at muon_lr
    muon_schedule = lm_config.inner_schedule(cfg, cfg.muon_lr)
    adamw_schedule = lm_config.inner_schedule(cfg, cfg.inner_lr)
    for step in (0, 1, cfg.warmup_steps, cfg.total_steps):
        assert float(muon_schedule(step)) * cfg.inner_lr == pytest.approx(
            float(adamw_schedule(step)) * cfg.muon_lr
        )
    for bad, message in (
        (dict(inner_optimizer="sgd"), "inner_optimizer must be one of"),
        (dict(muon_lr=0.0), "muon_lr must be"),
    ):
        with pytest.raises(lm_config.ConfigError, match=message):
            lm_config.make_config("micro", **bad)


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_cli_flag_accepts_adamw_and_muon(name, tmp_path):
    run = cli.parse(["train", "--inner-optimizer", name, "--out", str(tmp_path / "o")])
    assert run.cfg.inner_optimizer == name


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--inner-optimizer", "sgd"], "invalid choice"),
        (["--inner-optimizer", "Muon"], "invalid choice"),
        (["--muon-lr", "-1"], "muon_lr"),
    ],
)
def test_cli_flag_rejects_others_with_one_line(argv, message, tmp_path, capsys):
    out = tmp_path / "never"
    argv = ["train", "--preset", "micro", *argv, "--out", str(out)]
    assert_cli_refuses(argv, message, capsys, out)
