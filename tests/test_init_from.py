"""init_from a train.py workdir: only the params are read (not the optimizer moments), and a
ViT head that read pre_logits features is not reused by a model without them."""
from __future__ import annotations

import json
import logging

import flax.linen as nn
import jax
import numpy as np
import optax
import orbax.checkpoint as ocp

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
