"""python -m posjax.plan: train.py's step compiled by the real TPU compiler (libtpu, no TPU) for
a single-host v5e:2x2 slice; slice names, memory against memory_analysis(), the collectives of
data-only / fsdp / tensor meshes, the largest batch, exit statuses."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("libtpu", reason="libtpu (requirements-test.txt) compiles for TPU")

from jax_env import xla_flags  # noqa: E402
from posjax import plan as plan_lib  # noqa: E402
from posjax import tpu as tpu_lib  # noqa: E402
from posjax.models.schemes import TEXT_SCHEMES  # noqa: E402
from posjax.training import mesh as mesh_lib  # noqa: E402
from posjax.training import steps as steps_lib  # noqa: E402
from tpu_plans import VIT_SCHEMES, tiny_text, tiny_vit  # noqa: E402


def _quiet(line: str) -> None:
    pass


@pytest.mark.parametrize("name,topology,chips", [
    ("v4-32", "v4:2x2x4", 16), ("v4-8", "v4:2x2x1", 4), ("v4-128", "v4:4x4x4", 64),
    ("v5litepod-16", "v5e:4x4", 16), ("v5e-256", "v5e:16x16", 256), ("v5e-8", "v5e:2x4", 8),
    ("v5p-128", "v5p:4x4x4", 64), ("v5p-8", "v5p:2x2x1", 4), ("v6e-64", "v6e:8x8", 64),
    ("v4:2x2x4", "v4:2x2x4", 16), ("V5E:4x8", "v5e:4x8", 32),
])
def test_slice_names(name, topology, chips):
    tpu = tpu_lib.parse_slice(name)
    assert (tpu.topology, tpu.chips) == (topology, chips)


@pytest.mark.parametrize("name", ["v7-8", "v4-3", "v4-6", "v5e-512", "v4:2x2", "tpu", "v5e-0"])
def test_unknown_slice_is_one_error(name):
    with pytest.raises(ValueError, match="--tpu"):
        tpu_lib.parse_slice(name)


@pytest.mark.parametrize("scheme", TEXT_SCHEMES)
def test_every_text_scheme_compiles_for_v5e(scheme):
    report = plan_lib.plan(tiny_text(scheme), "v5e:2x2", progress=_quiet)
    assert report["fits"] and report["chips"] == 4 and report["hosts"] == 1
    pc = report["per_chip"]
    # data-only mesh: every chip holds all parameters (fp32) and AdamW's two moments
    assert pc["opt_state"] == pytest.approx(2 * pc["params"], rel=0.01)
    assert 0 < pc["total"] < tpu_lib.CHIPS["v5e"].hbm_bytes
    kinds = {c["kind"] for c in report["collectives"]}
    assert kinds == {"all-reduce"}, kinds   # data-only: gradient all-reduces, nothing else


@pytest.mark.parametrize("scheme", VIT_SCHEMES)
def test_vit_schemes_compile_for_v5e(scheme):
    report = plan_lib.plan(tiny_vit(scheme), "v5e:2x2", progress=_quiet)
    assert report["fits"]
    assert {c["kind"] for c in report["collectives"]} == {"all-reduce"}


def test_plan_numbers_are_memory_analysis():
    config = tiny_text("bert_abs")
    report = plan_lib.plan(config, "v5e:2x2", progress=_quiet)
    mesh = mesh_lib.build_mesh(config.mesh, tpu_lib.slice_devices(tpu_lib.parse_slice("v5e:2x2")))
    stats = steps_lib.build_training(config, mesh).lower(16).compile().memory_analysis()
    memory = report["memory_analysis"]
    assert memory["temp"] == stats.temp_size_in_bytes
    assert memory["argument"] == stats.argument_size_in_bytes
    assert report["per_chip"]["total"] == (
        stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
        + stats.temp_size_in_bytes + stats.generated_code_size_in_bytes)
    # the donated state aliases its outputs: parameters + optimizer state (+ step)
    assert memory["alias"] >= report["per_chip"]["params"] + report["per_chip"]["opt_state"]
    # at width 32 XLA's count is mostly elementwise work (norms, softmax, AdamW): above ours
    assert report["xla_flops_per_chip"] > report["model_flops_per_chip"] > 0
    assert "ESTIMATE (roofline" in plan_lib.format_report(report)


@pytest.mark.parametrize("scheme", ["bert_abs", "deberta_v2"])
def test_fsdp_gathers_weights_and_tensor_keeps_them(scheme):
    """fsdp=4: the weights are all-gathered (per layer, forward and backward) and parameters
    are a quarter per chip, with no fp32 all-to-all inside the layer loop; tensor=4: no
    weight is gathered, activations are all-reduced inside the layers."""
    fsdp = tiny_text(scheme)
    fsdp.mesh = {"data": 1, "fsdp": 4, "tensor": 1}
    fsdp.model.scan_layers = True
    data = plan_lib.plan(tiny_text(scheme), "v5e:2x2", progress=_quiet)
    report = plan_lib.plan(fsdp, "v5e:2x2", progress=_quiet)
    gathers = [c for c in report["collectives"] if c["kind"] == "all-gather"]
    # in the forward and in the backward layer loop, once per layer (2 layers)
    assert len([c for c in gathers if c["in_loop"] and c["times"] == 2]) >= 2
    assert report["per_chip"]["params"] < 0.5 * data["per_chip"]["params"]
    assert not [c for c in report["collectives"] if c["kind"] == "all-to-all" and c["in_loop"]
                and "f32" in c["dtypes"]]
    tensor = tiny_text(scheme)
    tensor.mesh = {"data": 1, "fsdp": 1, "tensor": 4}
    tensor.model.scan_layers = True
    report = plan_lib.plan(tensor, "v5e:2x2", progress=_quiet)
    gathered = sum(c["bytes"] * c["times"] for c in report["collectives"]
                   if c["kind"] in ("all-gather", "all-to-all"))
    # only the argmax of the vocabulary-split logits (the MLM accuracy) is gathered: KiBs
    assert gathered < 8 * 2 ** 10, gathered
    assert any(c["kind"] == "all-reduce" and c["in_loop"] for c in report["collectives"])


def test_a_step_that_does_not_fit_is_a_result():
    config = tiny_vit("vit", batch=4)
    config.model.update(image_size=64, patch_size=4, hidden_size=256, num_heads=4,
                        num_layers=2, mlp_dim=1024)
    config.data.image_size = 64
    config.batch_size = config.eval_batch_size = 1 << 17
    report = plan_lib.plan(config, "v5e:2x2", progress=_quiet)
    assert not report["fits"] and report["needed_bytes"] > report["available_bytes"] > 0
    assert "fits: NO" in plan_lib.format_report(report)


@pytest.mark.parametrize("limit,line_limit", [(100, 100), (1000, 1000), (40_000, 40_000),
                                              (4099, 3000), (2000, 3000)])
def test_largest_batch_brackets_the_limit(monkeypatch, limit, line_limit):
    """The search against a compiler whose step fits up to ``limit`` examples, with memory
    linear in the batch that reaches HBM at ``line_limit`` (XLA's is nearly linear; the last
    two cases are off by a third): a bracket one unit wide within the default compiles, and a
    true bracket within a few."""
    tried = []

    def compile_step(training, batch, devices, progress):
        tried.append(batch)
        if batch > limit:
            raise plan_lib.DoesNotFit("RESOURCE_EXHAUSTED", None, None)
        memory = {"total": 1000 + 7 * batch, "temp": 7 * batch}
        return plan_lib.Compiled(batch, 0.0, memory, 0.0, [], 0)

    monkeypatch.setattr(plan_lib, "compile_step", compile_step)
    start = compile_step(None, 64, 1, None) if limit >= 64 else None
    tried.clear()
    hbm = 1000 + 7 * line_limit
    lo, hi = plan_lib.largest_batch(None, start, 64, unit=4, hbm=hbm, devices=1,
                                    progress=_quiet)
    assert lo <= limit < hi
    if limit == line_limit:   # a true line: one unit, in a few compiles
        assert lo == limit // 4 * 4 and hi == lo + 4 and len(tried) <= 6, tried
    else:                     # one unit, or all 16 compiles spent narrowing it
        assert hi == lo + 4 or len(tried) == 16, tried
    lo, hi = plan_lib.largest_batch(None, start, 64, unit=4, hbm=hbm, devices=1,
                                    progress=_quiet, tolerance=0.25, max_compiles=4)
    assert lo <= limit and (hi is None or limit < hi)


def test_two_slices_put_data_across_slices():
    config = tiny_text("tupe_r")
    config.mesh = {"data": 2, "fsdp": 4, "tensor": 1}
    report = plan_lib.plan(config, "v5e:2x2", num_slices=2, progress=_quiet)
    assert report["fits"] and report["chips"] == 8 and report["num_slices"] == 2
    devices = tpu_lib.slice_devices(tpu_lib.parse_slice("v5e:2x2"), 2)
    mesh = mesh_lib.build_mesh(config.mesh, devices)
    for data_index in range(2):   # each data row of the mesh is one whole slice
        assert {d.slice_index for d in mesh.devices[data_index].flat} == {data_index}
    config.mesh = {"data": 1, "fsdp": 8, "tensor": 1}
    with pytest.raises(ValueError, match="does not split over the 2 slices"):
        plan_lib.plan(config, "v5e:2x2", num_slices=2, progress=_quiet)


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {"XLA_FLAGS": xla_flags(), "PATH": "/usr/bin:/bin"}
    import os
    env = {**os.environ, **env}
    return subprocess.run([sys.executable, "-m", "posjax.plan", *args], capture_output=True,
                          text=True, env=env, timeout=300)


def test_cli_reports_and_writes_json(tmp_path):
    out = tmp_path / "plan.json"
    done = _cli("--config", "configs/mlm_bert_a.py:size=tiny", "--tpu", "v5e-4",
                "--config.batch_size=16", "--json", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "compiling the train step" in done.stderr          # progress
    assert "fits: yes" in done.stdout and "collectives per step" in done.stdout
    assert json.loads(out.read_text())["per_chip"]["total"] > 0


@pytest.mark.parametrize("args,message", [
    (["--tpu", "v9-8"], "--tpu 'v9-8' is unknown"),
    (["--tpu", "v5e-4", "--config.mesh.tensor=3"], "mesh"),
    (["--tpu", "v5e-4", "--config.batch_size=6"], "batch_size=6 is not divisible"),
    (["--tpu", "v5e-4", "--config.model.num_heads=5"], "num_heads"),
    (["--tpu", "v5e-4", "--config.nonsense=1"], "nonsense"),
])
def test_cli_bad_input_is_one_error_and_status_2(args, message):
    done = _cli("--config", "configs/mlm_bert_a.py:size=tiny", *args)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert message in done.stderr and "Traceback" not in done.stderr


def test_a_study_grid_is_planned_entry_by_entry():
    """The tiny text study on a v5e-4: every entry compiled, and the grid's cost from the runs
    each entry makes (2 sweep rates + 1 later seed)."""
    from posjax.study.spec import load_config_file

    study = load_config_file("configs/study_text.py:tiny")
    report = plan_lib.plan_study(study, "v5e-4", progress=_quiet)
    assert list(report["entries"]) == ["bert_abs", "tupe_a", "nope"]
    assert report["fits"] and report["runs_per_entry"] == 3
    per_run = [e["days_per_run"] for e in report["entries"].values()]
    assert all(d > 0 for d in per_run)
    assert report["grid_days"] == pytest.approx(3 * sum(per_run))
    text = plan_lib.format_study(report)
    assert "3 entries x 3 runs each" in text and "whole grid >=" in text


def test_auto_takes_the_pallas_kernel_on_a_sharded_slice():
    """'auto' on TPU (attention dropout 0, a blocked length, blocks on the (8, 128) tiling)
    runs the Pallas kernel, per shard of an fsdp × tensor mesh: XLA cannot partition a Mosaic
    kernel, and without shard_map every multi-chip step failed to compile. Otherwise 'auto'
    takes the plain-JAX scan, and 'pallas' off the tiling is one error."""
    import dataclasses

    from posjax import kernels
    from posjax.models import encoder
    from posjax.models.config import TextConfig

    config = tiny_text("deberta_v2")
    config.model.update(attention_impl="auto", attention_dropout_rate=0.0,
                        blocked_attention_from=32, attention_block_size=128)   # 64 tokens
    config.mesh = {"data": 1, "fsdp": 2, "tensor": 2}
    report = plan_lib.plan(config, "v5e:2x2", progress=_quiet)
    assert report["fits"] and report["pallas_kernel_calls"] >= 1
    assert "attention: the Pallas kernel" in plan_lib.format_report(report)
    with kernels.compiling_for("tpu"):
        cfg = TextConfig(**{k: v for k, v in config.model.items()
                            if k in {f.name for f in dataclasses.fields(TextConfig)}})
        assert encoder.attention_kernel(cfg) == "pallas"
        for off in (dict(attention_dropout_rate=0.1), dict(attention_block_size=32)):
            assert encoder.attention_kernel(dataclasses.replace(cfg, **off)) == "blocked"
        with pytest.raises(ValueError, match="attention_block_size=32.*multiple of 128"):
            dataclasses.replace(cfg, attention_impl="pallas", attention_block_size=32)
    assert encoder.attention_kernel(cfg) == "blocked"          # built for this CPU
