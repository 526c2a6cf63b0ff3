"""posjax.study: the tiny text and image studies end to end (grid, resume, failed cell, report
from results/ only), bad study configs, the statistics and the synthetic data."""
import json
import math
import pathlib
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from jax_env import xla_flags
from posjax.study import report, stats, synthetic
from posjax.study.__main__ import main
from posjax.study.spec import StudyConfigError, check_study, load_config_file

ROOT = pathlib.Path(__file__).resolve().parents[1]
TEXT = str(ROOT / "configs" / "study_text.py")
VIT = str(ROOT / "configs" / "study_vit.py")
VERDICTS = set(report.VERDICTS)


def _finite(x):
    return x is not None and math.isfinite(x)


def test_paired_statistics_on_known_numbers():
    p = stats.paired({1: 1.0, 2: 2.0, 3: 3.0}, {1: 0.5, 2: 1.0, 3: 2.5, 4: 9.0})
    assert p["seeds"] == [1, 2, 3] and p["differences"] == [0.5, 1.0, 0.5]
    half = 4.302652729911275 * np.std([0.5, 1.0, 0.5], ddof=1) / math.sqrt(3)
    assert p["mean"] == pytest.approx(2 / 3)
    assert (p["low"], p["high"]) == pytest.approx((2 / 3 - half, 2 / 3 + half))
    assert p["distinguishable"] is False                       # covers 0: not distinguishable
    q = stats.paired({1: 1.0, 2: 1.1, 3: 1.2}, {1: 0.0, 2: 0.1, 3: 0.1})
    assert q["distinguishable"] is True and q["low"] > 0
    assert stats.paired({1: 1.0}, {1: 0.0})["distinguishable"] is None   # n < 2
    assert stats.mean_std([1.0, 3.0]) == {"mean": 2.0, "std": math.sqrt(2), "n": 2}
    assert stats.steps_to_reach([0, 10, 20], [5.0, 3.0, 1.0], 2.0) == pytest.approx(15.0)
    assert stats.steps_to_reach([0, 10], [5.0, 3.0], 1.0) is None


def test_cost_ratios_are_taken_within_each_round():
    from posjax.study.cost import ratios, rotated

    assert [rotated(["a", "b", "c"], r) for r in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    # The load doubles in round 2: per-round ratios stay 1.5, the medians of times would not.
    times = {"base": [1.0, 2.0, 1.0], "x": [1.5, 3.0, 1.5], "y": [0.5, 1.0, 0.6]}
    out = ratios(times, "base")
    assert out["base"]["time_ratio"] == 1.0
    assert out["x"] == {"step_time_s": 1.5, "time_ratio": 1.5, "time_ratio_min": 1.5,
                        "time_ratio_max": 1.5}
    assert out["y"]["time_ratio"] == 0.5 and out["y"]["time_ratio_max"] == pytest.approx(0.6)


def test_equivalence_holm_and_mean_interval_on_known_numbers():
    m = stats.mean_interval([0.5, 1.0, 0.5])
    assert m["se"] == pytest.approx(np.std([0.5, 1.0, 0.5], ddof=1) / math.sqrt(3))
    assert (m["low"], m["high"]) == pytest.approx((2 / 3 - 4.302652729911275 * m["se"],
                                                   2 / 3 + 4.302652729911275 * m["se"]))
    assert math.isnan(stats.mean_interval([1.0])["low"])
    # one-sided t: t = mean / se with n - 1 degrees of freedom
    from scipy import stats as sp
    assert stats.one_sided_p(0.3, 0.1, 5) == pytest.approx(sp.t.sf(3.0, 4))
    # TOST: the larger one-sided p; the near bound (0.5 - 0.1) / 0.05 = 8 standard errors away
    assert stats.tost(0.1, 0.05, 6, 0.5) == pytest.approx(sp.t.sf(8.0, 5))
    assert stats.tost(0.1, 0.05, 6, 0.1) == pytest.approx(0.5)
    h = stats.holm({"a": 0.01, "b": 0.04, "c": 0.03, "d": float("nan")})
    assert [h[k]["p_adjusted"] for k in "abc"] == pytest.approx([0.03, 0.06, 0.06])
    assert h["a"]["rejected"] and not h["b"]["rejected"] and not h["d"]["rejected"]
    assert stats.paired({1: 1.0}, {1: 0.0})["why"] == "n = 1: no interval"


def _rec(name, seed, loss, acc=0.5):
    return {"name": name, "seed": seed, "status": "ok", "cell": f"{name}-s{seed}",
            "final": {"loss": loss, "accuracy": acc}}


def test_claim_rules_decide_from_numbers():
    groups = {"a": [_rec("a", s, v) for s, v in ((1, 1.0), (2, 1.1), (3, 1.05), (4, 1.0))],
              "b": [_rec("b", s, v) for s, v in ((1, 2.0), (2, 2.2), (3, 2.1), (4, 2.05))]}
    claim = {"claim": "a better", "a": "a", "b": "b", "metric": "final.loss", "better": "lower"}
    assert report.decide(claim, groups, {})["verdict"] == "reproduced"
    assert report.decide({**claim, "better": "higher"}, groups, {})["verdict"] == "contradicted"
    # a 'same' claim: the interval lies outside the margin -> contradicted; a wide margin holds
    assert report.decide({**claim, "rule": "same", "margin": 0.1}, groups,
                         {})["verdict"] == "contradicted"
    assert report.decide({**claim, "rule": "same", "margin": 2.0}, groups,
                         {})["verdict"] == "reproduced"
    # an underpowered 'same' (interval covers 0 but is wider than the margin) decides nothing
    noisy = {"a": [_rec("a", s, v) for s, v in ((1, 1.0), (2, 1.5), (3, 0.6))],
             "b": [_rec("b", s, 1.0) for s in (1, 2, 3)]}
    assert report.decide({**claim, "rule": "same", "margin": 0.05}, noisy,
                         {})["verdict"] == "undecidable at this scale"
    assert report.decide({**claim, "b": "c"}, groups, {})["verdict"] == \
        "undecidable at this scale"
    # the gate: an MLM claim is undecidable while an entry is not below the bigram
    gated = report.decide(claim, groups, {}, {"baselines": {"bigram": 1.5}})
    assert gated["verdict"] == "undecidable at this scale" and "bigram" in gated["undecidable"]
    at_chance = report.decide({**claim, "metric": "final.accuracy", "better": "higher"}, groups,
                              {}, {"chance": 0.5})
    assert "at chance" in at_chance["undecidable"]
    glue = report.decide({**claim, "metric": "glue_mean"}, groups, {}, {"glue_tasks": []})
    assert "GLUE is off" in glue["undecidable"]
    # convergence: a t-interval of the per-seed ratios
    conv = {"a": {"ratios": {1: 0.25, 2: 0.2, 3: 0.22}, "steps": {1: 25, 2: 20, 3: 22}}}
    rule = {**claim, "rule": "convergence", "at_most": 0.3}
    assert report.decide(rule, groups, conv)["verdict"] == "reproduced"
    slower = {"a": {"ratios": {1: 0.55, 2: 0.6, 3: 0.58}, "steps": {1: 55, 2: 60, 3: 58}}}
    assert report.decide(rule, groups, slower)["verdict"] == \
        "effect smaller than the paper's (excluded)"
    # Holm across claims: three p-values of 0.02 each are not all significant together
    weak = {"a": [_rec("a", s, v) for s, v in ((1, 0.9), (2, 1.0), (3, 0.7))],
            "b": [_rec("b", s, 1.0) for s in (1, 2, 3)]}
    alone = report.decide(claim, weak, {})
    family = report.decide_all([claim] * 3, weak, {}, {})
    assert alone["holm"]["p_adjusted"] == pytest.approx(alone["effect"]["p"])
    assert family[0]["holm"]["p_adjusted"] == pytest.approx(3 * alone["effect"]["p"])


def test_sweep_cells_and_the_chosen_rate(tmp_path):
    from posjax.study import cells as cells_lib
    from posjax.study.grid import chosen_rate

    study = load_config_file(TEXT + ":tiny")
    _, cells = check_study(study)
    sweep = [c for c in cells if c.sweep]
    assert [c.id for c in sweep[:2]] == ["bert_abs-lr0.001", "tupe_a-lr0.001"]
    assert all(c.seed == 1 for c in sweep) and cells.index(sweep[-1]) < len(sweep)
    assert [c.id for c in cells[len(sweep):]][:2] == ["bert_abs-s2", "tupe_a-s2"]
    rate, why = chosen_rate(tmp_path, study, "bert_abs")
    assert rate is None and "has not finished" in why
    for lr, loss in ((1e-3, 2.0), (3e-3, 1.5)):
        cells_lib.write_json(cells_lib.results_file(tmp_path, f"bert_abs-lr{lr:g}"),
                             {"status": "ok", "held_out": {"1": {"loss": loss}}})
    assert chosen_rate(tmp_path, study, "bert_abs") == (3e-3, "")
    cells_lib.write_json(cells_lib.results_file(tmp_path, "bert_abs-lr0.003"),
                         {"status": "failed"})
    assert chosen_rate(tmp_path, study, "bert_abs") == (1e-3, "")
    study.claims.append(dict(claim="x", a="bert_abs", b="nope", metric="final.loss",
                             rule="same"))
    with pytest.raises(StudyConfigError, match="margin"):
        check_study(study)


def test_convergence_pairs_each_seed_with_its_baseline(tmp_path):
    """Per seed: steps to the baseline's final loss of that seed over the baseline's own steps
    (its last evaluation, or earlier where its curve dipped below); None when a seed never
    reaches it."""
    (tmp_path / "results").mkdir()
    curves = {"base-s1": [4.0, 3.0, 2.0, 1.0], "base-s2": [4.0, 1.5, 2.5, 2.0],
              "fast-s1": [2.0, 1.0, 0.5, 0.4], "fast-s2": [3.0, 2.0, 1.0, 0.9],
              "slow-s1": [4.0, 3.5, 3.0, 2.5], "slow-s2": [4.0, 1.0, 1.0, 1.0]}
    for cell, losses in curves.items():
        rows = "".join(f"{step},{v}\n" for step, v in zip((10, 20, 30, 40), losses))
        (tmp_path / "results" / f"{cell}_curve.csv").write_text("step,eval_loss\n" + rows)
    groups = {name: [{"cell": f"{name}-s{seed}", "name": name, "seed": seed, "status": "ok",
                      "final": {"loss": curves[f"{name}-s{seed}"][-1]}} for seed in (1, 2)]
              for name in ("base", "fast", "slow")}
    conv = report.convergence(tmp_path, groups, "base")
    assert conv["base"]["ratios"] == {1: 1.0, 2: 1.0}
    # base-s2 dips below its final 2.0 early: it reaches it at step 18 (between 10 and 20).
    base2 = 10 + 10 * (4.0 - 2.0) / (4.0 - 1.5)
    assert conv["fast"]["steps"] == pytest.approx({1: 20.0, 2: 20.0})
    assert conv["fast"]["ratios"] == pytest.approx({1: 20.0 / 40.0, 2: 20.0 / base2})
    assert conv["fast"]["ratio"] == pytest.approx((0.5 + 20.0 / base2) / 2)
    assert conv["slow"]["steps"][1] is None and conv["slow"]["reached"] == "1/2"
    assert conv["slow"]["ratio"] is None
    claim = {"claim": "fast", "a": "slow", "b": "base", "rule": "convergence"}
    slow = report.decide(claim, groups, conv)
    assert slow["verdict"] == "not shown" and "never reached the target in seeds [1]" in \
        slow["measured"]
    fast = report.decide({**claim, "a": "fast", "at_most": 0.9}, groups, conv)
    assert fast["effect"]["n"] == 2 and fast["effect"]["mean"] == pytest.approx(
        conv["fast"]["ratio"])


def test_layout_scores_tell_a_2d_table_from_one_without_layout():
    """A table whose rows are a smooth function of (row, col) has neighbours alike (ρ well
    below 0, every nearest patch a neighbour); its rows shuffled have no layout."""
    from posjax.study import analysis
    g = 8
    rows, cols = np.divmod(np.arange(g * g), g)
    freqs = np.linspace(0.2, 1.0, 8)
    table = np.concatenate([np.sin(rows[:, None] * freqs), np.cos(rows[:, None] * freqs),
                            np.sin(cols[:, None] * freqs), np.cos(cols[:, None] * freqs)], 1)
    smooth = analysis.layout_scores(analysis.vit_similarity(table[None], (g, g), 0))
    assert smooth["distance_correlation"] < -0.5 and smooth["nearest_is_neighbour"] == 1.0
    shuffled = table[np.random.default_rng(0).permutation(g * g)]
    none = analysis.layout_scores(analysis.vit_similarity(shuffled[None], (g, g), 0))
    assert abs(none["distance_correlation"]) < 0.1 and none["nearest_is_neighbour"] < 0.4
    assert none["by_chance"] == smooth["by_chance"] == pytest.approx(
        (4 * 3 + 4 * (g - 2) * 5 + (g - 2) ** 2 * 8) / (g * g) / (g * g - 1))


def test_synthetic_tasks_are_deterministic_and_positional():
    data = synthetic.default_data_config("shift", 12)
    a = synthetic.make_batch(data, 3, 0, 5, 4)
    b = synthetic.make_batch(data, 3, 0, 5, 4)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    x, pos, tgt = a["input_ids"][0], a["masked_positions"][0], a["masked_ids"][0]
    assert np.array_equal(tgt, x[pos - int(data.shift)])        # the token k to the left
    rev = synthetic.make_batch(synthetic.default_data_config("reverse", 12), 0, 0, 0, 1)
    assert np.array_equal(rev["masked_ids"][0], rev["input_ids"][0, 1:][::-1])
    cnt = synthetic.make_batch(synthetic.default_data_config("count", 64), 0, 0, 0, 2)
    marks = cnt["masked_positions"][0][cnt["masked_weights"][0] > 0]
    assert np.all(cnt["input_ids"][0][marks] == synthetic.MARK)


@pytest.mark.parametrize("edit, words", [
    (lambda s: s.cells.append(dict(name="x", scheme="rope_typo")), ["scheme='rope_typo'",
                                                                     "choose one of"]),
    (lambda s: s.cells.append(dict(name="y", scheme="bert_abs", model=dict(tie_cls=True))),
     ["model.tie_cls=True has no effect", "tupe_a"]),
    (lambda s: s.cells.append(dict(s.cells[0])), ["duplicate cell name"]),
    (lambda s: setattr(s, "seeds", 0), ["study.seeds=0", ">= 1"]),
    (lambda s: s.cells.append(dict(name="z", scheme="bert_abs", model=dict(hidden_sise=4))),
     ["unknown TextConfig field", "hidden_sise"]),
])
def test_bad_study_configs_are_one_clear_error(edit, words, tmp_path, capsys):
    study = load_config_file(TEXT + ":tiny")
    edit(study)
    with pytest.raises(StudyConfigError) as e:
        check_study(study)
    assert all(w in str(e.value) for w in words), str(e.value)
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("field, split, words", [
    ("transfer.test_split", "test[:1000]",
     "study.transfer.test_split='test[:1000]' holds examples of 1 of the 10 classes"),
    ("transfer.test_split", "test[::0]", "study.transfer.test_split='test[::0]': split "),
    ("base_overrides", (("data.test_split", "test[9000:]"),),
     "data.test_split='test[9000:]' holds examples of 1 of the 10 classes"),
])
def test_image_study_splits_are_checked_before_any_cell(field, split, words, shared_data):
    """A slice of the class-ordered CIFAR-10 file that drops classes (the transfer's too,
    which is read only after training) is refused before anything trains. The check reads
    the real CIFAR-10 files under config.data_root (``shared_data``)."""
    study = load_config_file(VIT)
    if field == "base_overrides":
        study.base_overrides = tuple(study.base_overrides) + split
    else:
        study.transfer.test_split = split
    with pytest.raises(StudyConfigError) as e:
        check_study(study)
    assert words in str(e.value), str(e.value)


def test_cli_bad_config_and_report_without_results(tmp_path, capsys):
    bad = tmp_path / "bad_study.py"
    bad.write_text(open(TEXT).read().replace(
        'dict(name="bert_rel", scheme="bert_rel")', 'dict(name="bert_abs", scheme="bert_rel")'
    ).replace("pathlib.Path(__file__).resolve().parent",
              f"pathlib.Path({str(ROOT / 'configs')!r})"))
    assert main(["--config", str(bad) + ":tiny", "--workdir", str(tmp_path / "s")]) == 2
    assert main(["--config", str(bad), "--workdir", str(tmp_path / "s")]) == 2
    assert "duplicate cell name" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()                        # nothing trained or written
    assert main(["--workdir", str(tmp_path / "s"), "--report"]) == 2


def _check_common(rep, manifest_cells, runnable):
    names = [c["cell"] for c in rep["cells"]]
    assert names == [c["cell"] for c in manifest_cells]          # every cell, in grid order
    for c in rep["cells"]:
        if c["name"] in runnable:
            assert c["status"] == "ok", c
    for name in runnable:
        for m, s in rep["table"][name].items():
            if m != "status":
                assert s["n"] == 2 and _finite(s["mean"]) and _finite(s["std"]), (name, m)
        cost = rep["cost"][name]
        assert _finite(cost["time_ratio"]) and _finite(cost["memory_ratio"])
        assert cost["time_ratio_min"] <= cost["time_ratio"] <= cost["time_ratio_max"]
        assert cost["params"] > 0 and cost["temp_bytes"] > 0
        assert len(cost["seconds_per_round"]) == rep["cost_measurement"]["rounds"]
    assert rep["cost"][rep["baseline"]]["time_ratio"] == 1.0
    assert rep["claims"] and all(c["verdict"] in VERDICTS for c in rep["claims"])
    for c in rep["claims"]:
        if c.get("metric") != "glue_mean":
            assert c["effect"]["n"] >= 1 and f"{c['effect']['mean']:+.4f}" in c["measured"]


# The grid runs in a subprocess with one CPU device (the test processes simulate 8, which would
# shard every tiny step 8 ways): an interrupted cell first, then the text grid with a cell
# invalid at train time, a rerun. The image study: tests/test_study_vit.py (another worker).
GRIDS = """
import json, pathlib, sys
import jax
from posjax.study import cells as cells_lib, cost, runner
from posjax.study.grid import run_grid
from posjax.study.spec import check_study, load_config_file
tmp = pathlib.Path(sys.argv[1])
jax.config.update("jax_compilation_cache_dir", str(tmp / "jax_cache"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
text = tmp / "text"
study = load_config_file(sys.argv[2] + ":tiny")
study.cells.append(dict(name="broken", scheme="bert_abs",
                        train={"optimizer.warmup_steps": 10**6}))   # invalid at train time
base, cells = check_study(study)
first = cells[0]
runner.train(cells_lib.main_config(base, first), cells_lib.cell_dir(text, first.id),
             stop_after=3)                                           # an interrupted cell
lines = []
run_grid(study, text, log=lines.append)
again = run_grid(study, text, log=lines.append)
cost.measure(study, text, log=lines.append)
json.dump({"lines": lines, "again": [r["cell"] for r in again]}, open(tmp / "log.json", "w"))
from posjax.study import report
report.build(text)
"""


def study_env() -> dict[str, str]:
    """A tiny study's subprocess: one CPU device, XLA's quick compile (a tiny study's time is
    its compiles, and it checks the grid's logic, not speed)."""
    env = {**os.environ, "XLA_FLAGS": xla_flags(1) + " --xla_backend_optimization_level=0 "
           "--xla_llvm_disable_expensive_passes=true", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": str(ROOT)}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    return env


def test_tiny_text_study_end_to_end(tmp_path, shared_data):
    """Needs the real data (tiny Shakespeare): the study config reads it under the data root,
    which the subprocess gets from os.environ."""
    env = study_env()
    done = subprocess.run([sys.executable, "-c", GRIDS, str(tmp_path), TEXT], env=env,
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming from" in done.stdout + done.stderr           # the interrupted cell resumed
    text = tmp_path / "text"
    log = json.loads((tmp_path / "log.json").read_text())
    lines = log["lines"]
    assert any("broken-lr0.001 FAILED" in line and "warmup_steps" in line for line in lines)
    assert any("broken-s2 waits: every sweep cell of 'broken' failed" in line for line in lines)
    # rerun: everything finished is skipped (the broken cells are retried and fail again)
    assert log["again"] == ["broken-lr0.001", "broken-lr0.003"]
    first = "bert_abs-s2"
    rec = json.loads((text / "results" / f"{first}.json").read_text())
    curve = (text / "results" / f"{first}_curve.csv").read_text().splitlines()
    assert curve[0].startswith("step,train_loss") and len(curve) >= 3
    assert rec["status"] == "ok" and _finite(rec["held_out"]["1"]["loss"])
    assert rec["learning_rate"] in (1e-3, 3e-3) and not rec["sweep"]
    # provenance: the commit and every stage's full config
    assert len(rec["provenance"]["git_commit"]) == 40
    assert set(rec["configs"]) == {"main", "synth_shift"}
    assert rec["configs"]["main"]["optimizer"]["learning_rate"] == rec["learning_rate"]
    assert rec["configs"]["synth_shift"]["task"] == "position_synth"
    moved = rec["position_movement"]
    assert list(moved) == ["['encoder']['embeddings']['position_embeddings']['embedding']"]
    assert 0 < moved[next(iter(moved))]["relative"] < 1
    # where a cell's time went: training, then each follow-up stage that ran
    assert 0 < rec["train_s"] <= rec["wall_s"]
    assert {"params", "position_movement", "held_out", "synth_shift"} <= set(rec["stage_s"])
    assert rec["train_s"] + sum(rec["stage_s"].values()) <= rec["wall_s"] + 1e-6
    sweep = json.loads((text / "results" / "bert_abs-lr0.003.json").read_text())
    assert sweep["sweep"] and "synthetic" not in sweep and _finite(sweep["held_out"]["2"]["loss"])
    rep = report.build(text)
    manifest = json.loads((text / "results" / "study.json").read_text())
    _check_common(rep, manifest["cells"], ("bert_abs", "tupe_a", "nope"))
    broken = [c for c in rep["cells"] if c["name"] == "broken"]
    assert [c["status"] for c in broken] == ["failed", "failed", "not run"]
    b = rep["baselines"]
    assert b["bigram"] < b["unigram"] and b["num_predictions"] > 100
    chosen = rep["sweep"]["entries"]["bert_abs"]["chosen"]
    assert chosen == rec["learning_rate"]
    assert rep["floor_verdicts"]["tupe_a"]["verdict"].endswith("NoPE")
    ext = rep["extrapolation"]
    assert ext["bert_abs"]["2"]["extended"] and not ext["nope"]["2"]["extended"]
    assert _finite(ext["bert_abs"]["2"]["mean"]) and ext["bert_abs"]["2"]["n"] == 2
    syn = rep["synthetic"]["shift"]
    assert syn["tupe_a"]["2"]["extended"] and _finite(syn["tupe_a"]["2"]["mean"])
    # 6 steps: no entry is below the bigram, so every MLM claim is undecidable
    assert all(c["verdict"] == "undecidable at this scale" and "bigram" in c["undecidable"]
               for c in rep["claims"] if "loss" in c.get("metric", "final.loss"))
    assert set(rep["head_labels"]["tupe_a"]) <= {"global", "local", "broad", "previous", "next"}
    assert {"curves.png", "tupe_terms_bert_abs.png", "tupe_heads_tupe_a.png",
            "synthetic_shift.png"} <= set(rep["figures"])
    md = (text / "report.md").read_text()
    times = rep["time"]["entries"]["bert_abs"]
    assert times["cells"] == 2 and 0 < times["train_s"] <= times["wall_s"]
    assert times["stage_s"]["held_out"] > 0 and rep["time"]["sum_wall_s"] > times["wall_s"]
    for word in ("broken-lr0.003 | bert_abs | 0.003 | failed", "## Claims",
                 "## Baselines of the held-out targets", "| bigram (the true previous token) |",
                 "## Learning-rate sweep", "beyond nope (p, Holm)",
                 "## How far the positional parameters moved", "undecidable at this scale",
                 "## Time per cell", "| entry | cells | wall | training |",
                 "side by side in one process"):
        assert word in md, word
    # the report from results/ alone (as merged from other machines)
    merged = tmp_path / "merged"
    shutil.copytree(text / "results", merged / "results")
    rep2 = report.build(merged)
    assert json.dumps(rep2["table"]) == json.dumps(rep["table"])
    assert (merged / "report.md").read_text().replace(str(merged), "") == md.replace(
        str(text), "")


def test_study_overrides_from_the_command_line():
    from posjax.study.__main__ import apply_overrides

    study = load_config_file(TEXT)
    apply_overrides(study, ["--config.seeds=5", "--config.glue.tasks=['sst2']",
                            "--config.title=paper scale"])
    assert study.seeds == 5 and list(study.glue.tasks) == ["sst2"]
    assert study.title == "paper scale"
    with pytest.raises(StudyConfigError, match="no key 'sedes'"):
        apply_overrides(study, ["--config.sedes=3"])


def test_beyond_nope_verdicts_need_two_paired_seeds():
    """An entry with fewer than two seeds paired with NoPE is undecidable (no test, no part in
    Holm); one clearly below NoPE helps, one clearly above is worse."""
    def paired(mean, n, low, high):
        return {"nope": {"loss": {"mean": mean, "se": 0.01, "n": n, "low": low, "high": high}}}

    rep = {"paired": {"good": paired(-1.0, 5, -1.03, -0.97), "bad": paired(0.5, 5, 0.47, 0.53),
                      "one": paired(-1.0, 1, float("nan"), float("nan")),
                      "none": paired(float("nan"), 0, float("nan"), float("nan"))}}
    verdicts = report._floor_verdicts(rep, "loss", "nope", "lower")
    assert verdicts["good"]["verdict"] == "helps beyond NoPE"
    assert verdicts["bad"]["verdict"] == "worse than NoPE"
    assert verdicts["one"]["verdict"] == "undecidable: 1 paired seed (a test needs 2)"
    assert verdicts["none"]["verdict"] == "undecidable: 0 paired seeds (a test needs 2)"


def test_another_url_is_refused(tmp_path, monkeypatch, capsys):
    """A URL other than gs:// is one error, not a local folder named 's3:'."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["--config", TEXT + ":tiny", "--workdir", "s3://bucket/study"])
    assert e.value.code == 2 and "a local folder or gs://bucket/path" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_study_on_a_bucket_keeps_its_results_there_and_resumes_on_another_machine(
        emulator, tmp_path, monkeypatch):
    """``--workdir gs://``: results/ and the report live on the bucket, the cells train in a
    local folder. Cells another machine finished (uploaded) are pulled and not run again; a
    new cell's results are uploaded as soon as it ends; the report is written to the bucket; a
    third machine with an empty local folder runs nothing."""
    from posjax import storage
    from posjax.study import cells as cells_lib
    url = f"{emulator}/study"
    finished = ROOT / "studies" / "vit" / "results"
    for cell in ("vit-s1", "vit-s2"):   # as another machine left them
        for path in finished.glob(f"{cell}[._]*"):
            storage.write_atomically(f"{url}/results/{path.name}", path.read_bytes())
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax_cache"))
    ran = []

    def run_cell(root, study, base, cell):   # stands in for 3,000 steps: seed 2's record
        ran.append(cell.id)
        assert root.is_relative_to(tmp_path / "machine_a"), root
        record = {**json.loads((finished / "vit-s2.json").read_text()), "cell": cell.id,
                  "seed": cell.seed}
        cells_lib.write_json(cells_lib.results_file(root, cell.id), record)
        return record

    monkeypatch.setattr(cells_lib, "run_cell", run_cell)
    for machine, expected in (("machine_a", ["vit-s3"]), ("machine_b", [])):
        monkeypatch.setenv("POSJAX_STUDY_CACHE", str(tmp_path / machine))
        ran.clear()
        assert main(["--config", "configs/study_vit.py", "--workdir", url, "--cell", "vit"]) == 0
        assert ran == expected, machine
        names = storage.files(url)
        assert {"results/vit-s3.json", "results/study.json", "report.md",
                "report.json"} <= set(names), names
        assert not any(n.startswith("cells/") for n in names), "training scratch stays local"
    report_md = storage.read_with_generation(f"{url}/report.md")[0].decode()
    assert "vit" in report_md and (tmp_path / "machine_b" / "posjax-test" / "study" /
                                   "results" / "vit-s1.json").is_file()
