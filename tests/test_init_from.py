"""init_from a train.py workdir: only the params are read (not the optimizer moments), a
ViT head that read pre_logits features is not reused by a model without them, and a damaged
one is one error."""
from __future__ import annotations

import gc
import json
import logging
import re
import sys
import time

import flax.linen as nn
import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import test_training_synthetic as syn
from posjax.training import loop
from posjax.training import state as state_lib
from posjax.training.tasks import make_task


def write_workdir(path, config) -> dict:
    """A workdir as train.py leaves it: checkpoints/<step>/state holding step, params and the
    AdamW state, and config.json. Returns the saved params."""
    task = make_task(config)
    params = nn.unbox(task.init_params(task.build_model(), jax.random.PRNGKey(3),
                                       task.dummy_batch(2)))
    params = jax.tree.map(lambda x: np.asarray(x) + 0.5, params)
    opt_state = optax.adamw(1e-3).init(params)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path / "checkpoints" / "4" / "state",
                   {"step": np.int32(4), "params": params, "opt_state": opt_state})
    (path / "config.json").write_text(json.dumps(config.to_dict()))
    return params


def test_workdir_params_load_and_a_pre_logits_head_is_not_reused(tmp_path, caplog):
    source = syn.tiny_config(**{"model.representation_size": 16})
    saved = write_workdir(tmp_path / "source", source)
    assert "pre_logits" in saved

    config = syn.tiny_config(**{"init_from": str(tmp_path / "source")})
    run = loop.prepare(config, tmp_path / "run", training=True)
    state = state_lib.init_state(run.task, run.model, run.tx, run.mesh, run.shardings, 0)
    loaded, _ = state_lib.read_pretrained(tmp_path / "source", state.params,
                                          run.shardings.params)
    assert sorted(loaded) == sorted(jax.tree_util.keystr(p) for p, _ in
                                    jax.tree_util.tree_leaves_with_path(saved))

    fresh = jax.tree.map(np.asarray, state.params)
    with caplog.at_level(logging.WARNING):
        params = state_lib.load_init_from(state, str(tmp_path / "source"), run.shardings).params
    # Same head shape (16 -> 4 classes either way), but it read tanh(pre_logits) features.
    np.testing.assert_array_equal(np.asarray(params["head"]["kernel"]), fresh["head"]["kernel"])
    np.testing.assert_array_equal(np.asarray(params["head"]["bias"]), fresh["head"]["bias"])
    warning = "\n".join(r.getMessage() for r in caplog.records)
    assert "['head']['kernel']: read pre_logits features in the checkpoint" in warning
    assert "['pre_logits']['kernel']: in the checkpoint but not in this model" in warning
    q = params["encoder"]["layer_0"]["attention"]["query"]["kernel"]
    np.testing.assert_array_equal(np.asarray(q),
                                  saved["encoder"]["layer_0"]["attention"]["query"]["kernel"])


def test_same_features_keep_the_pretrained_head(tmp_path):
    saved = write_workdir(tmp_path / "source", syn.tiny_config())
    config = syn.tiny_config(**{"init_from": str(tmp_path / "source")})
    run = loop.prepare(config, tmp_path / "run", training=True)
    state = state_lib.init_state(run.task, run.model, run.tx, run.mesh, run.shardings, 0)
    params = state_lib.load_init_from(state, str(tmp_path / "source"), run.shardings).params
    np.testing.assert_array_equal(np.asarray(params["head"]["kernel"]), saved["head"]["kernel"])


def test_a_damaged_init_from_is_one_error_and_nothing_else(tmp_path, monkeypatch, caplog):
    """Data files cut short: one ValueError naming the folder; none of the other failed reads
    is logged or printed after it (given as a relative path, as users do)."""
    write_workdir(tmp_path / "source", syn.tiny_config())
    for data in (tmp_path / "source" / "checkpoints" / "4" / "state").rglob("d/*"):
        data.write_bytes(data.read_bytes()[:10])
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    monkeypatch.chdir(tmp_path)
    config = syn.tiny_config(**{"init_from": "source"})
    with pytest.raises(ValueError) as refused:   # before anything is compiled or written
        loop.prepare(config, tmp_path / "run", training=True)
    message = str(refused.value)
    assert re.fullmatch(
        rf"init_from='source': {tmp_path}/source/checkpoints/4/state: cannot read this "
        r"checkpoint \(ValueError: (OUT_OF_RANGE|DATA_LOSS): [^\n]*\); if it is damaged \(a "
        r"full disk, an interrupted copy\), copy or convert it again", message), message
    assert "tensorstore_spec" not in message and len(message) < 900, message
    assert not (tmp_path / "run").exists()
    time.sleep(1)   # reads still in flight finish
    gc.collect()    # failed tasks nobody awaited are reported when collected
    assert [r.getMessage()[:200] for r in caplog.records if r.name == "asyncio"] == []
    assert [str(u.exc_value) for u in unraisable] == []
