"""experiments/sweep_model_size.py's plumbing on a tiny budget (the sweep itself is not run)."""

import importlib.util
import json
from pathlib import Path

import pytest

PATH = Path(__file__).parent.parent / "experiments" / "sweep_model_size.py"


@pytest.fixture(scope="module")
def sweep():
    spec = importlib.util.spec_from_file_location("sweep_model_size", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.MAX_BYTES = 800_000  # enough for the eval windows, quicker to load
    return module


def test_plan_fixes_tokens_per_parameter(sweep):
    plan = sweep.size_plan("micro", 0.3)
    # micro by hand: 1 layer of q, k, v, out (4 x 32 x 32), MLP (2 x 32 x 128), two norms;
    # the final norm; the tied 256 x 32 embedding.
    assert plan.num_params == 4 * 32 * 32 + 2 * 32 * 128 + 2 * 32 + 32 + 256 * 32 == 20_576
    # 0.3 x 20,576 tokens at 4 sequences of 32 per step, H = 10: round(4.82) = 5 rounds.
    assert (plan.global_batch, plan.inner_steps, plan.rounds) == (4, 10, 5)
    assert plan.tokens == 5 * 10 * 4 * 32 and plan.tokens_per_param == 6400 / 20_576


def test_every_run_of_a_size_sees_the_same_tokens(sweep):
    plan = sweep.size_plan("mini", 0.3)
    runs = sweep.runs_of(plan, (1, 2, 4), (0.1, 0.2, 0.4))
    labels = [label for label, *_ in runs]
    assert labels[:4] == ["sync_data_parallel", "diloco_M1_lr0.2", "diloco_M2_lr0.2",
                          "diloco_M4_lr0.2"]  # fmt: skip
    assert labels[-1] == "sync_1worker" and len(labels) == 11
    for label, algo, workers, cfg in runs:
        assert cfg.total_steps == plan.steps and cfg.pretrain_steps == 0
        tokens = plan.global_batch if label != "sync_1worker" else plan.global_batch // 4
        assert workers * cfg.batch_size == tokens and cfg.model == "mini"
        if algo == "diloco":
            assert cfg.resolved_outer_lr == float(label.split("_lr")[1])


def _summary(algo, workers, loss, lr=None):
    return {"algo": algo, "workers": workers, "final_eval_loss": loss, "outer_lr": lr,
            "wall_seconds": 1.0}  # fmt: skip


def test_best_lr_and_ratio(sweep):
    runs = {
        "sync_data_parallel": _summary("sync", 4, 2.0),
        "sync_1worker": _summary("sync", 1, 3.0),
        "diloco_M1_lr0.1": _summary("diloco", 1, 2.2, 0.1),
        "diloco_M1_lr0.2": _summary("diloco", 1, 1.9, 0.2),
        "diloco_M4_lr0.2": _summary("diloco", 4, 2.5, 0.2),
    }
    assert sweep.best_per_workers(runs) == {1: "diloco_M1_lr0.2", 4: "diloco_M4_lr0.2"}
    assert sweep.ratios(runs) == {1: 1.9 / 2.0, 4: 2.5 / 2.0}
    plan = sweep.plan_record(sweep.size_plan("micro", 0.3))
    table = sweep.table_markdown({"micro": {"plan": plan, "runs": runs}})
    assert "| 1.9000 (0.2) | 2.5000 (0.2) | 0.9500 | 1.2500 |" in table
    assert "| micro | 4 | - | 2.5000 |" in table  # M=4 ran at lr 0.2 only


@pytest.mark.slow
def test_main_end_to_end_and_resume(sweep, tmp_path, monkeypatch):
    argv = ["--sizes", "micro", "--workers", "2", "--lr-grid", "0.2", "--tokens-per-param",
            "0.1", "--out", str(tmp_path)]  # fmt: skip
    record = sweep.main(argv)
    assert {p.name for p in tmp_path.iterdir()} == {
        "model_size.md", "model_size.json", "model_size.png", "model_size_runs"
    }  # fmt: skip
    runs = record["results"]["micro"]["runs"]
    assert set(runs) == {"sync_data_parallel", "diloco_M2_lr0.2", "sync_1worker"}
    ratio = (
        runs["diloco_M2_lr0.2"]["final_eval_loss"] / runs["sync_data_parallel"]["final_eval_loss"]
    )
    saved = json.loads((tmp_path / "model_size.json").read_text())
    assert saved["results"]["micro"]["ratio"] == {"2": ratio}
    # A rerun trains nothing: every run comes from the cache.
    monkeypatch.setattr(sweep.experiment, "run", lambda *a, **k: pytest.fail("trained again"))
    assert sweep.main(argv)["results"]["micro"]["runs"] == runs


def test_cache_survives_a_new_config_field_at_its_default(sweep, tmp_path):
    plan = sweep.size_plan("micro", 0.1)
    key = json.loads(json.dumps(sweep._run_key("diloco", 2, sweep.run_config(plan, 2, 0.2))))
    path = tmp_path / "run.json"
    older = {**key, "config": {k: v for k, v in key["config"].items() if k != "outer_clip"}}
    sweep.save_cached(path, older, {"final_eval_loss": 1.5})
    assert sweep.load_cached(path, key) == {"final_eval_loss": 1.5}  # outer_clip at default
    clipped = {**key, "config": {**key["config"], "outer_clip": 1.0}}
    assert sweep.load_cached(path, clipped) is None
    other_lr = {**key, "config": {**key["config"], "outer_lr": 0.4}}
    assert sweep.load_cached(path, other_lr) is None
    assert sweep.load_cached(path, {**key, "workers": 4}) is None
    gone = {**older, "config": {**older["config"], "retired_field": 1}}
    sweep.save_cached(path, gone, {"final_eval_loss": 1.5})
    assert sweep.load_cached(path, key) is None  # a field RunConfig no longer has
