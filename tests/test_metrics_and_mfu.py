"""Metrics: accumulation and divergence checks, the metrics log on resume, the tags of
evaluation results, and the peak FLOP/s behind MFU."""
from __future__ import annotations

import json

import jax.numpy as jnp

from posjax import config_defaults
from posjax.training import errors as errors_lib
from posjax.training import metrics, peak_flops
from posjax.training import workdir as workdir_lib
from posjax.training import state as state_lib

import synthetic_runs as syn


def test_metric_accumulator_weights():
    acc = metrics.MetricAccumulator()
    acc.add({"loss": (jnp.float32(6.0), jnp.float32(3.0)), "grad_norm": jnp.float32(1.0)})
    acc.add({"loss": (jnp.float32(2.0), jnp.float32(1.0)), "grad_norm": jnp.float32(3.0)})
    assert acc.result() == {"loss": 2.0, "grad_norm": 2.0}


def test_divergence_checks_sums_and_every_state_value():
    acc = metrics.MetricAccumulator()
    acc.add({"loss": (jnp.float32(0.0), jnp.float32(0.0)), "grad_norm": jnp.float32(0.0)})
    assert acc.all_finite(errors_lib.DIVERGENCE_METRICS)   # a batch without weight is no divergence
    acc.add({"loss": (jnp.float32(jnp.nan), jnp.float32(1.0)), "grad_norm": jnp.float32(1.0)})
    assert not acc.all_finite(errors_lib.DIVERGENCE_METRICS)
    assert acc.all_finite(("grad_norm",))
    state = state_lib.TrainState(step=jnp.int32(3), params={"w": jnp.ones((2, 2))},
                                 opt_state=(jnp.zeros(2), {"nu": jnp.ones(3)}))
    assert state_lib.all_finite(state)
    assert not state_lib.all_finite(state.replace(opt_state=(jnp.zeros(2),
                                                             {"nu": jnp.array([1, jnp.inf, 1.])})))


def test_jsonl_drops_records_after_the_resume_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "split": "train", "loss": 1.0}) + "\n"
                            for s in (1, 2, 3, 4)))
    metrics.drop_after(path, 2)
    assert [r["step"] for r in metrics.read_metrics(path)] == [1, 2]


def test_split_tags_keep_splits_apart():
    tags = [workdir_lib.split_tag(s) for s in ("test", "train[:80%]", "train[80%:]", "dev/x", "a b")]
    assert tags == ["test", "train_-80%", "train_80%-", "dev_x", "a_b"]


def test_eval_tags_keep_other_data_apart():
    saved = config_defaults.config_dict(syn.tiny_config(**{"data": {"data_dir": "/d", "test_split": "t"}}))
    same = syn.tiny_config(**{"data": {"data_dir": "/d", "test_split": "v", "worker_count": 2}})
    assert workdir_lib.eval_tag(None, same) == "" and workdir_lib.eval_tag(saved, same) == ""
    assert workdir_lib.eval_tag(saved, syn.tiny_config(**{"data": {"path": "/p", "data_dir": "/d"}}))
    other = syn.tiny_config(**{"data": {"data_dir": "/e"}})
    assert workdir_lib.eval_tag(saved, other) == workdir_lib.eval_tag(saved, other.copy_and_resolve_references())
    assert workdir_lib.eval_tag(saved, other) not in ("", workdir_lib.eval_tag(
        saved, syn.tiny_config(**{"data": {"data_dir": "/f"}})))


def test_peak_flops_sources():
    configured = peak_flops.peak_flops_per_device(5e12)
    assert (configured.value, configured.source, configured.measure) == (
        5e12, "config.peak_flops", None)
    measured = peak_flops.peak_flops_per_device()
    assert measured.value > 1e8 and measured.source.startswith("measured")   # CPU: no table
    assert measured.measure is peak_flops.measure_matmul_flops


def test_best_rate_keeps_the_fastest_trial():
    clock = iter([0.0, 3.0, 10.0, 12.0, 20.0, 25.0]).__next__   # trials of 3 s, 2 s, 5 s
    calls = []
    assert peak_flops.best_rate(8.0, lambda: calls.append(1), 3, timer=clock) == 4.0
    assert len(calls) == 3


def test_mfu_above_one_remeasures_and_raises_a_measured_peak():
    measurements = iter([150.0, 400.0])
    peak = peak_flops.PeakFlops(100.0, "measured", measure=lambda: next(measurements))
    assert peak.mfu(50.0) == 0.5 and peak.value == 100.0        # <= 1: not re-measured
    assert peak.mfu(200.0) == 1.0 and peak.value == 200.0       # re-measured 150 < achieved
    assert peak.mfu(300.0) == 0.75 and peak.value == 400.0      # re-measured 400
    fixed = peak_flops.PeakFlops(100.0, "config.peak_flops")
    assert fixed.mfu(200.0) == 2.0 and fixed.value == 100.0     # a configured peak is kept
