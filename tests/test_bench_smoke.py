"""The benchmark entry point in smoke mode: every suite runs at tiny sizes and reports sane
numbers; bad command lines fail before anything runs."""
import contextlib
import io
import json
import math
import pathlib
import re
import time

import pytest

from bench import run as bench_run
from bench.attention import VARIANTS, max_abs_difference, settings
from bench.common import Budget, Progress, Scale, _cpu_description
from bench.workloads import all_workloads, forward_flops, throughput_workloads


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """(report path, stderr) of the whole smoke run."""
    out = tmp_path_factory.mktemp("bench") / "smoke.json"
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert bench_run.main(["--smoke", "--out", str(out)]) == 0
    return out, err.getvalue()


@pytest.fixture(scope="module")
def smoke_out(smoke_run):
    return smoke_run[0]


@pytest.fixture(scope="module")
def smoke_report(smoke_out):
    return json.loads(smoke_out.read_text())


def _table(report, suite, title_start):
    entry = next(e for e in report["suites"] if e["suite"] == suite)
    return next(t for t in entry["tables"] if t["title"].startswith(title_start))


def test_every_suite_reports(smoke_report):
    assert [e["suite"] for e in smoke_report["suites"]] == list(bench_run.SUITES)
    assert smoke_report["command"].startswith("python -m bench --smoke --out ")
    for entry in smoke_report["suites"]:
        assert entry["tables"] and all(t["rows"] for t in entry["tables"]), entry["suite"]


def test_every_suite_shows_its_progress_to_the_end(smoke_run):
    lines = smoke_run[1].splitlines()
    for suite in bench_run.SUITES:
        ticks = [ln for ln in lines if ln.startswith(f"[{suite}] ") and " done (" in ln]
        assert ticks and all(re.search(r" done \(\d+/\d+\), \d+ s, ETA \d+:\d\d:\d\d$", ln)
                             for ln in ticks), (suite, ticks)
        done, total = re.search(r"\((\d+)/(\d+)\)", ticks[-1]).groups()
        assert done == total, ticks[-1]
    assert sum("building, compiling" in ln for ln in lines) == 3   # text, ViT, study MLM


def test_progress_eta_scales_with_the_work_left():
    clock = iter([100.0, 110.0, 140.0, 141.0])
    out = io.StringIO()
    progress = Progress("attention", [1, 3, 0], stream=out, clock=lambda: next(clock))
    for length in (8, 16, 32):
        progress.tick(f"L = {length}")
    assert out.getvalue().splitlines() == [
        "[attention] L = 8 done (1/3), 10 s, ETA 0:00:30",
        "[attention] L = 16 done (2/3), 40 s, ETA 0:00:00",
        "[attention] L = 32 done (3/3), 41 s, ETA 0:00:00"]


def test_throughput_numbers_are_finite_and_paired(smoke_report):
    speed = _table(smoke_report, "throughput", "Train-step throughput")
    cols = speed["columns"]
    assert [r[0] for r in speed["rows"]] == [w.name for w in all_workloads("smoke")]
    for row in speed["rows"]:
        ours, hf, speedup = (row[cols.index(c)] for c in ("ours ms/step", "HF ms/step", "speed-up"))
        assert 0 < ours < math.inf and 0 < hf < math.inf and speedup > 0
        assert row[cols.index("rounds")] == 2
    mfu = _table(smoke_report, "throughput", "Model FLOPs")
    for row in mfu["rows"]:
        assert 0 < row[mfu["columns"].index("ours MFU")] < 1


def test_attention_variants_agree_and_memory_is_measured(smoke_report):
    memory = _table(smoke_report, "attention", "Disentangled attention: XLA scratch")
    for row in memory["rows"]:
        assert all(v > 0 for v in row[1:1 + len(VARIANTS)])
    timing = _table(smoke_report, "attention", "Disentangled attention: forward")
    assert any("max |Δ|" in n for n in timing["notes"])


def test_plots_are_drawn_beside_the_report_and_again_from_it(smoke_out, tmp_path, capsys):
    from PIL import Image
    from bench import plots
    drawn = sorted(p.name for p in smoke_out.parent.glob("*.png"))
    assert drawn == ["smoke_attention.png", "smoke_throughput.png"]
    for name in drawn:
        with Image.open(smoke_out.parent / name) as image:
            assert image.format == "PNG" and image.size[0] >= 700
    assert plots.main([str(smoke_out), "--stem", str(tmp_path / "again")]) == 0
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["again_attention.png",
                                                               "again_throughput.png"]
    report = json.loads(smoke_out.read_text())
    report["suites"] = [e for e in report["suites"] if e["suite"] == "compile"]
    (tmp_path / "compile_only.json").write_text(json.dumps(report))
    assert plots.main([str(tmp_path / "compile_only.json")]) == 1
    assert "no throughput or attention tables to plot" in capsys.readouterr().err


@pytest.mark.parametrize("length", [6, 12])
def test_naive_and_efficient_disentangled_attention_match(length):
    """R = 16 table rows: at L = 6 (2L − 1 <= R) shift and skew both shift; at L = 12 shift
    gathers like take and skew still shifts."""
    s = settings(Scale("smoke", 2, 0))
    assert max_abs_difference(s, length) < 1e-5


def test_shared_bias_gradient_equals_broadcast_add():
    """The custom gradient of add_shared_bias (a ones-contraction) is the broadcast's."""
    import jax
    import jax.numpy as jnp
    from posjax.layers.attention import add_shared_bias
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    logits = jax.random.normal(k1, (3, 2, 5, 5))
    bias = jax.random.normal(k2, (1, 2, 5, 5))
    g = jax.random.normal(k3, (3, 2, 5, 5))
    ours = jax.vjp(add_shared_bias, logits, bias)
    plain = jax.vjp(jnp.add, logits, bias)
    assert jnp.array_equal(ours[0], plain[0])
    for a, b in zip(ours[1](g), plain[1](g)):
        assert a.shape == b.shape and jnp.allclose(a, b, atol=1e-6)


def test_flops_count_batch_independent_terms_once():
    text = {w.cfg.position_scheme: w for w in throughput_workloads("smoke")}
    deberta = text["deberta_v2"]
    import dataclasses
    double = dataclasses.replace(deberta, batch=2 * deberta.batch)
    # the relative-table projection does not grow with the batch
    assert forward_flops(double) < 2 * forward_flops(deberta)
    bert = text["bert_abs"]
    assert forward_flops(dataclasses.replace(bert, batch=2 * bert.batch)) == 2 * forward_flops(bert)


@pytest.mark.parametrize("argv, message", [
    (["nosuch"], "unknown suite"),
    (["--runs", "1"], "--runs=1"),
    (["--budget", "-5"], "--budget=-5"),
    (["--out", "results.txt"], "must end in .md or .json"),
    (["--out", "/no/such/folder/r.md"], "does not exist"),
    (["--xla-option", "fusion=off"], "is not xla_KEY=VALUE"),
])
def test_bad_command_lines_fail_early(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench_run.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_xla_options_parse_to_compile_options():
    from bench.common import parse_options
    assert parse_options([], "--xla-option") is None
    assert parse_options(["xla_cpu_experimental_ynn_fusion_type=", "xla_cpu_max_isa=AVX2",
                          "xla_backend_optimization_level=1", "xla_cpu_enable_fast_math=false"],
                         "--xla-option") == {
        "xla_cpu_experimental_ynn_fusion_type": "", "xla_cpu_max_isa": "AVX2",
        "xla_backend_optimization_level": 1, "xla_cpu_enable_fast_math": False}


def test_gpu_mode_without_gpu_says_how_to_fix(capsys):
    assert bench_run.main(["--gpu", "compile"]) == 2
    assert "--smoke" in capsys.readouterr().err


def test_gpu_script_runs_where_python_is_python3(tmp_path):
    """bench/gpu.sh, run as BENCHMARKS.md shows (an executable), on a host whose interpreter
    is only ``python3`` (no ``python``, no nvidia-smi): it reaches the suite, which here says
    that JAX has no GPU."""
    import os
    import shutil
    import subprocess
    import sys
    tools = tmp_path / "bin"
    tools.mkdir()
    python3 = tools / "python3"   # a wrapper: a symlinked venv interpreter loses the venv
    python3.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python3.chmod(0o755)
    for tool in ("bash", "dirname"):
        (tools / tool).symlink_to(shutil.which(tool))
    script = pathlib.Path(__file__).resolve().parents[1] / "bench" / "gpu.sh"
    done = subprocess.run([str(script), str(tmp_path / "out.md"), "5"],   # as documented
                          env={**os.environ, "PATH": str(tools)}, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert "--gpu needs a GPU" in done.stderr


def test_gpu_mode_refuses_a_cpu_only_torch(monkeypatch, capsys):
    """JAX on a GPU but the pinned CPU torch: HF would silently run on the CPU."""
    import jax
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert bench_run.main(["--gpu", "compile"]) == 2
    assert "torch has no CUDA" in capsys.readouterr().err


def test_spent_budget_skips_work_but_still_reports():
    from bench import compile_time
    spent = Budget(1e-9)
    time.sleep(0.001)
    compile_table, step_table = compile_time.run(Scale("smoke", 2, 1.0), spent, {})
    assert compile_table.rows == [[1, None, None]] and not step_table.rows
    assert any("time budget spent" in n for n in compile_table.notes)


def test_a_failing_suite_keeps_the_others_and_fails_the_run(tmp_path, monkeypatch, capsys):
    from bench import attention

    def out_of_memory(*args):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory\nmore detail")
    monkeypatch.setattr(attention, "run", out_of_memory)
    out = tmp_path / "r.md"
    assert bench_run.main(["--smoke", "attention", "compile", "--budget", "1e-9",
                           "--out", str(out)]) == 1
    text = out.read_text()
    assert "**Failed**: RuntimeError: RESOURCE_EXHAUSTED: out of memory\n" in text
    assert "### Compile time of one training step" in text
    assert "suite(s) failed: attention" in capsys.readouterr().err


def test_a_failing_throughput_group_keeps_the_other(monkeypatch):
    from bench import throughput

    def text_only(group, scale, budget):
        if not group[0].is_text:
            raise RuntimeError("CUDA out of memory")
        return {w.name: {"ours": [1.0, 1.0], "hf": [2.0, 2.0], "compile_s": 1.0,
                         "xla_flops": 1.0, "params": 1, "hf_params": 1, "hf_attn": "sdpa",
                         "hf_optimizer": "fused", "hf_device": "cpu", "same_hf_as": w.name}
                for w in group}
    monkeypatch.setattr(throughput, "_measure_group", text_only)
    speed = throughput.run(Scale("smoke", 2, 0), Budget(0), {})[0]
    names = [w.name for w in all_workloads("smoke")]
    assert [row[0] for row in speed.rows] == names[:3] + names[4:]   # ViT failed
    assert f"Failed: {names[3]}: RuntimeError: CUDA out of memory" in speed.notes


@pytest.mark.parametrize("argv, message", [
    (["--before", "no-such-revision"], "neither a git revision"),
    (["--models", "GPT"], "unknown ['GPT']"),
    (["--rounds", "2"], "--rounds=2"),
    (["--after-option", "fusion"], "is not xla_KEY=VALUE"),
])
def test_ab_bad_command_lines_fail_before_building(argv, message, capsys):
    from bench import ab
    assert ab.main(argv) == 2
    assert message in capsys.readouterr().err


def test_ab_imports_an_older_revision_as_its_own_package(tmp_path):
    import posjax
    from bench.ab import import_variant
    old = import_variant("HEAD", "before", tmp_path)
    assert old.__name__.startswith("posjax_before_") and old is not posjax
    assert old.TextConfig is not posjax.TextConfig
    assert old.layers.attention.__name__.startswith(old.__name__)   # imports rewritten


def test_sharding_smoke_measures_the_partitioned_step(tmp_path, capsys, shared_data):
    """bench.sharding on the test process's 8 devices: our embedding lookup is not
    rematerialised, and the step's temporaries and collectives are read back. The run is
    set up from configs/mlm_*.py:tiny, whose checks need the BERT vocabulary
    (``shared_data``)."""
    from bench import sharding
    out = tmp_path / "sharding.md"
    assert sharding.main(["--smoke", "--out", str(out)]) == 0
    assert out.read_text() == capsys.readouterr().out.rstrip("\n") + "\n"
    row = next(line for line in out.read_text().splitlines() if "| working tree |" in line)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:4] == ["BERT-A", "2×2×2", "working tree", "0"]
    temp, *collectives, total = (float(c) for c in cells[4:])
    assert temp > 0 and total > 0
    assert abs(sum(collectives) - total) <= 0.01 * total   # the cells have 3 digits


def test_collective_bytes_reads_xla_cpu_collectives():
    from bench.sharding import collective_bytes
    six = ", ".join(["f32[32]{0}"] * 5) + ", /*index=5*/f32[32]{0}"
    hlo = f"""
  %all-gather = f32[4,8]{{1,0}} all-gather(f32[2,8]{{1,0}} %p), replica_groups={{{{0,1}}}}
  %all-reduce.100 = ({six}) all-reduce(%a, %b, %c, %d, %e, /*index=5*/%f), to_apply=%add
  %a2a = (f32[2,3]{{1,0}}, bf16[2,3]{{1,0}}) all-to-all(f32[2,3]{{1,0}} %y, bf16[2,3]{{1,0}} %z)
  %add.1 = f32[4,8]{{1,0}} add(f32[4,8]{{1,0}} %all-gather, f32[4,8]{{1,0}} %all-gather)
"""
    assert collective_bytes(hlo) == {"all-gather": 128, "all-reduce": 6 * 128, "all-to-all": 36}
    with pytest.raises(ValueError, match="only XLA:CPU's synchronous"):
        collective_bytes("  %s = (f32[2]{0}, f32[4]{0}) all-gather-start(f32[2]{0} %p)")
    with pytest.raises(ValueError, match="read 0 of the HLO's 1 collectives"):
        collective_bytes("  %x = f32[2]{0:E=1} all-reduce(f32[2]{0} %p)")   # an unknown form
    with pytest.raises(ValueError, match="element type 'f8e4m3fn'"):
        collective_bytes("  %x = f8e4m3fn[2]{0} all-reduce(f8e4m3fn[2]{0} %p)")


@pytest.mark.parametrize("argv, message", [
    (["--batch", "12"], "--batch=12"),
    (["--layers", "0"], "--layers=0"),
    (["--out", "r.json"], "must end in .md"),
    (["--before", "no-such-revision"], "neither a git revision"),
])
def test_sharding_bad_command_lines_fail_before_compiling(argv, message, capsys):
    from bench import sharding
    assert sharding.main(argv) == 2
    assert message in capsys.readouterr().err


def test_the_bench_turns_off_a_persistent_compilation_cache(tmp_path):
    """README suggests JAX_COMPILATION_CACHE_DIR for train.py; in the bench such a cache would
    make the compile suite time a file read instead of the compiler."""
    import os
    import subprocess
    import sys
    done = subprocess.run(
        [sys.executable, "-c", "import bench.run, jax; "
         "print(jax.config.jax_enable_compilation_cache)"],
        cwd=pathlib.Path(__file__).resolve().parents[1], capture_output=True, text=True,
        env={**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path)}, timeout=120)
    assert done.returncode == 0 and done.stdout == "False\n", done.stderr[-2000:]


def test_the_environment_tells_cpu_generations_apart():
    """Two CPUs both named 'AMD EPYC' differ in family/model and vector extensions."""
    cpuinfo = ("processor\t: 0\nmodel name\t: AMD EPYC\ncpu family\t: 26\nmodel\t\t: 2\n"
               "flags\t\t: fpu sse2 avx2 fma avx512f avx512_bf16\n\n"
               "processor\t: 1\ncpu family\t: 25\nmodel\t\t: 1\nflags\t\t: avx2\n")
    assert _cpu_description(cpuinfo) == {"cpu_model": "AMD EPYC", "cpu_family_model": "26/2",
                                         "cpu_simd": "avx2 fma avx512f avx512_bf16"}
    without_name = _cpu_description("processor\t: 0\nflags\t\t: sse2\n")
    assert without_name.pop("cpu_model")   # platform.processor()'s, or 'unknown'
    assert without_name == {
        "cpu_simd": "none of avx2 fma avx512f avx512_bf16 avx512_vnni amx_bf16 amx_tile"}
    assert set(_cpu_description("")) == {"cpu_model"}
