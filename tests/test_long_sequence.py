"""bench/long_sequence.py at tiny sizes: every measurement in its own capped subprocess, ours
(plain and blocked) and Hugging Face's, compile-only rows, and what is reported when a step
does not fit or would take too long."""
import json

import pytest

from bench import long_sequence as ls

GIB = 2 ** 30


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """The report of a tiny run: DeBERTa-v3 both paths, HF, the 12-layer compile-only rows."""
    out = tmp_path_factory.mktemp("long") / "smoke"
    assert ls.main(["--smoke", "--models", "deberta_v2", "hf_deberta_v2", "--lengths", "64",
                    "--deep", "deberta_v2:64", "--out", str(out)]) == 0
    return json.loads(out.with_suffix(".json").read_text()), out.with_suffix(".md").read_text()


def test_every_measurement_runs_and_reports_time_and_memory(smoke):
    report, markdown = smoke
    rows = {(r["model"], r["path"], r["layers"], r.get("scan", False)): r
            for r in report["rows"]}
    assert set(rows) == {("deberta_v2", "plain", 2, False), ("deberta_v2", "blocked", 2, False),
                         ("hf_deberta_v2", "plain", 2, False),
                         ("deberta_v2", "blocked", 12, False), ("deberta_v2", "blocked", 12, True)}
    for key in [("deberta_v2", "plain", 2, False), ("deberta_v2", "blocked", 2, False),
                ("hf_deberta_v2", "plain", 2, False)]:
        r = rows[key]
        assert r["status"] == "ok", r
        assert len(r["times"]) == report["runs"] and all(t > 0 for t in r["times"])
        assert 0.1 * GIB < r["peak_rss"] < 16 * GIB
    for path in ("plain", "blocked"):   # XLA's buffers: at least the arguments (params)
        xla = rows[("deberta_v2", path, 2, False)]["xla"]
        assert xla["total"] >= xla["argument"] >= 4 * rows[("deberta_v2", path, 2, False)][
            "params"]
    # Ours and HF build the same model: equal parameter counts.
    assert rows[("hf_deberta_v2", "plain", 2, False)]["params"] == rows[
        ("deberta_v2", "plain", 2, False)]["params"]
    deep, remat = rows[("deberta_v2", "blocked", 12, False)], rows[("deberta_v2", "blocked", 12,
                                                                     True)]
    assert deep["status"] == remat["status"] == "not run" and remat["remat"]
    two_layers = rows[("deberta_v2", "blocked", 2, False)]["xla"]
    assert deep["xla"]["argument"] == remat["xla"]["argument"] > two_layers["argument"]
    assert "| deberta_v2, 2 layers | 64 |" in markdown and "lax.scan + remat" in markdown
    assert "| HF DebertaV2Model (torch), 2 layers | 64 |" in markdown


def test_a_slow_step_is_compiled_not_run(tmp_path):
    """Past --max-step-s (extrapolated ∝ L² from the last timed length) only XLA's memory."""
    out = tmp_path / "slow"
    assert ls.main(["--smoke", "--models", "rope", "--paths", "blocked", "--lengths", "32",
                    "64", "--max-step-s", "1e-9", "--deep", "--out", str(out)]) == 0
    first, second = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert first["status"] == "ok" and second["status"] == "not run"
    assert second["predicted_s"] == pytest.approx(4 * ls.step_ms(first) / 1e3)
    assert second["xla"]["total"] > 0 and "times" not in second
    assert ls.cell_time(second).startswith("not run (~")


def test_a_step_over_the_cap_did_not_fit_and_longer_ones_are_not_tried(tmp_path):
    out = tmp_path / "capped"
    assert ls.main(["--smoke", "--models", "rope", "--paths", "plain", "--lengths", "32", "64",
                    "--cap-gib", "0.5", "--wait-s", "0", "--deep", "--out", str(out)]) == 0
    first, second = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert first["status"] == "did not fit" and first["error"]
    assert second["status"] == ls.NOT_TRIED and second["shorter"] == 32
    assert ls.cell_time(second) == "not tried (32 did not fit)"
    # --update re-measures them in place under the full cap, and says so.
    # From --one-step-from on: one timed step, no warm-up (marked ¹).
    assert ls.main(["--smoke", "--models", "rope", "--paths", "plain", "--lengths", "32", "64",
                    "--one-step-from", "64", "--deep", "--update", str(out)]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert [(r["length"], r["status"], r["update"], len(r["times"]), r["warmup"])
            for r in report["rows"]] == [(32, "ok", 1, 3, True), (64, "ok", 1, 1, False)]
    assert ls.cell_time(report["rows"][1]).endswith(" ¹")
    assert report["updates"][0]["command"].endswith(f"--update {out}")
    markdown = out.with_suffix(".md").read_text()
    assert "| rope, 2 layers † | 64 |" in markdown
    assert "Rows marked † re-measured by" in markdown


def test_the_fit_check_counts_new_buffers_against_the_cap():
    xla = {"argument": 5, "output": 3, "alias": 1, "temp": 10, "total": 17}
    assert ls.fits(xla, 88, 100) and not ls.fits(xla, 89, 100)
    assert ls.cell_time({"status": "does not fit (XLA)", "xla": {"total": 20 * GIB}}) == \
        "does not fit (XLA 20.0 GiB)"
    assert ls.step_ms({"status": "ok", "times": [3.0, 1.0, 2.0]}) == 2000.0
    assert ls.predicted_step_s(None, 64) is None
    assert ls.predicted_step_s((32, 1.5), 64) == 6.0


def test_bad_options_are_refused():
    with pytest.raises(SystemExit):
        ls.parse_args(["--cap-gib", "32"])
    with pytest.raises(SystemExit):
        ls.parse_args(["--runs", "0"])
