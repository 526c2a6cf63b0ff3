"""posjax.study: the tiny image study end to end through the CLI (NoPE as the floor, resolution
transfer with its equal-steps control, the 2D-layout measure). Its own file: pytest-xdist runs
it beside the tiny text study (tests/test_study.py)."""
import json
import subprocess
import sys

from test_study import VIT, _check_common, _finite, study_env


def test_tiny_image_study_end_to_end(tmp_path, shared_data):
    """Needs the real data (MNIST) under the data root, which the subprocess gets from
    os.environ."""
    vit = tmp_path / "vit"
    done = subprocess.run([sys.executable, "-m", "posjax.study", "--config", VIT + ":tiny",
                           "--workdir", str(vit)], env=study_env(), capture_output=True,
                          text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    rep = json.loads((vit / "report.json").read_text())
    manifest = json.loads((vit / "results" / "study.json").read_text())
    _check_common(rep, manifest["cells"], ("vit", "bert_rel", "nope"))
    t = rep["transfer"]
    assert {"56px bilinear", "56px bicubic", "56px finetuned"} <= set(t["vit"])
    assert _finite(t["vit"]["56px bicubic"]["mean"]) and _finite(t["nope"]["56px as_is"]["mean"])
    rec = json.loads((vit / "results" / "vit-s1.json").read_text())
    assert rec["transfer_control"]["size"] == 28 and _finite(
        rec["transfer_control"]["finetuned"]["accuracy"])
    assert {"main", "ft56", "ft28"} <= set(rec["configs"])
    assert "position_similarity_vit.png" in rep["figures"]
    assert (vit / "position_similarity_vit.png").stat().st_size > 0
    assert set(rep["layout"]["vit"]) == {"vit-s1"}   # the analysis: follow_up_seeds = 1
    assert "## Is the learned table two-dimensional?" in (vit / "report.md").read_text()
    assert any("nope" in c["measured"] for c in rep["claims"])
