"""MLM and GLUE tasks through the training loop (8 fake devices), on slices of the real data."""
import json
import logging
import pathlib
import re

import flax.linen as nn
import jax
import numpy as np
import pytest

from posjax.training.checkpointing import checkpointer as ckpt_lib
from posjax.training import evaluator
from posjax.training import run_setup
from posjax.training import trainer
from posjax.training import workdir as workdir_lib
from posjax.training import init_from as init_from_lib
from posjax.training import state as state_lib
from posjax.training.tasks import make_task
from configs.text_recipes import glue_config, mlm_config

TINY = dict(hidden_size=32, num_heads=2, num_layers=2, mlp_dim=64, dropout_rate=0.0,
            attention_dropout_rate=0.0)


def tiny_mlm(shared_data, scheme, **overrides):
    config = mlm_config(scheme, "tiny")
    config.model.update(TINY, max_position_embeddings=32)
    if scheme == "deberta":
        config.model.update(max_relative_positions=32)
    config.data.update(text_files={"valid": str(shared_data / "wikitext-2" / "valid.txt")},
                       tokenizer=str(shared_data / "bert-base-uncased-vocab" / "vocab.txt"),
                       train_split="valid[:200]", test_split="valid[-6:]", max_seq_length=32)
    config.update(num_steps=4, batch_size=16, eval_batch_size=16, log_every_steps=2,
                  eval_every_steps=0)
    config.optimizer.update(learning_rate=3e-3, warmup_steps=1)
    config.checkpoint.update(every_steps=2, async_save=False)
    config.update(overrides)
    return config


@pytest.fixture(scope="module")
def mlm_run(shared_data, tmp_path_factory):
    """A 4-step TUPE-R MLM run (checkpoints at 2 and 4): (config, workdir, result)."""
    config = tiny_mlm(shared_data, "tupe_r")
    workdir = tmp_path_factory.mktemp("mlm") / "full"
    return config, workdir, trainer.train(config, workdir)


def test_mlm_trains_and_resumes_exactly(mlm_run, tmp_path):
    """Stopping at step 2 and resuming (state + packed/masked input stream) gives the run that
    never stopped; the MLM eval reports loss, accuracy and perplexity = exp(loss)."""
    config, workdir, full = mlm_run
    assert not full.preempted
    stopped = trainer.train(config, tmp_path / "resumed", stop_after=2)
    assert stopped.preempted and stopped.step == 2
    resumed = trainer.train(config, tmp_path / "resumed")
    assert resumed.eval == pytest.approx(full.eval, rel=1e-5)
    ev = full.eval
    assert ev["perplexity"] == pytest.approx(np.exp(ev["loss"]), rel=1e-6)
    assert 0 <= ev["accuracy"] <= 1 and ev["num_predictions"] > 3 * ev["num_sequences"] > 0
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").open()]
    train = [r["loss"] for r in records if r["split"] == "train"]
    assert len(train) == 2 and train[-1] < train[0]      # a few steps already lower the loss


def test_a_vocabulary_rewritten_in_place_is_refused_on_resume_and_eval(shared_data, tmp_path):
    """The run records its vocabulary's digest at its start (data_identity.json): the same
    tokenizer path holding another vocabulary (two ids swapped) would remap every embedding
    row, so resuming or evaluating is refused before anything is compiled; a copy of the
    vocabulary under another path is the same vocabulary."""
    original = (shared_data / "bert-base-uncased-vocab" / "vocab.txt").read_text()
    vocab = tmp_path / "vocab.txt"
    vocab.write_text(original)
    config = tiny_mlm(shared_data, "bert_a")
    config.data.tokenizer = str(vocab)
    workdir = tmp_path / "run"
    assert trainer.train(config, workdir, stop_after=2).preempted
    recorded = json.loads((workdir / workdir_lib.DATA_IDENTITY_FILE).read_text())
    vocabulary = recorded["data.tokenizer"]
    assert list(recorded) == ["data.tokenizer"] and len(vocabulary["sha256"]) == 64
    assert vocabulary["size"] == 30522 and len(vocabulary["blocks"]) == 30   # 1024 ids each
    lines = original.splitlines(keepends=True)
    lines[2000], lines[2001] = lines[2001], lines[2000]
    vocab.write_text("".join(lines))
    refused = (re.escape(f"data.tokenizer='{vocab}' holds other content than this run was "
                         "trained with (ids 1024–2047 differ from what the run recorded in ")
               + re.escape(str(workdir / workdir_lib.DATA_IDENTITY_FILE)) + r"\): give the file")
    with pytest.raises(ValueError, match=refused):
        trainer.train(config, workdir)
    with pytest.raises(ValueError, match=refused):
        evaluator.evaluate(config, workdir)
    copy = tmp_path / "copy" / "vocab.txt"
    copy.parent.mkdir()
    copy.write_text(original)
    elsewhere = config.copy_and_resolve_references()
    elsewhere.data.tokenizer = str(copy)
    assert "loss" in evaluator.evaluate(elsewhere, workdir)
    vocab.write_text(original)
    assert trainer.train(config, workdir).step == config.num_steps
    assert json.loads((workdir / workdir_lib.DATA_IDENTITY_FILE).read_text()) == recorded
    # A run from before the file existed is not checked, and evaluating never writes it.
    (workdir / workdir_lib.DATA_IDENTITY_FILE).unlink()
    vocab.write_text("".join(lines))
    assert "loss" in evaluator.evaluate(config, workdir)
    assert not (workdir / workdir_lib.DATA_IDENTITY_FILE).exists()
    # A fresh start replaces what a run that never checkpointed left behind.
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / workdir_lib.DATA_IDENTITY_FILE).write_text(json.dumps(recorded))
    run = run_setup.prepare(config, fresh, training=True)
    workdir_lib.write_data_identity(fresh, run.data_identity)
    assert json.loads((fresh / workdir_lib.DATA_IDENTITY_FILE).read_text()) == run.data_identity
    assert run.data_identity["data.tokenizer"]["sha256"] != vocabulary["sha256"]


def test_deberta_emd_mlm_step(shared_data):
    """DeBERTa with the enhanced mask decoder: one jitted gradient step through the task."""
    config = tiny_mlm(shared_data, "deberta")
    task = make_task(config)
    task.validate()
    assert task.model_config.use_emd
    model = task.build_model()
    pipe = task.make_pipeline("train", 4, 0, True, 0, 1)
    batch = next(pipe.iterator)
    params = jax.jit(lambda b: nn.unbox(task.init_params(model, jax.random.PRNGKey(0), b)))(batch)

    def loss(p):
        total, count = task.train_metrics(model, p, batch, jax.random.PRNGKey(1))["loss"]
        return total, count

    (total, count), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    assert count == batch["masked_weights"].sum() and np.isfinite(total)
    assert total / count == pytest.approx(np.log(30522), rel=0.05)   # untrained: ~uniform
    assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
    assert float(np.abs(grads["mlm_head"]["bias"]).sum()) > 0


def test_glue_from_mlm_encoder(mlm_run, shared_data, tmp_path, caplog):
    """GLUE starts from the MLM run's encoder (init_from a train.py workdir), trains on an SST-2
    slice and reports accuracy; evaluation on the test split writes the submission file."""
    mlm, mlm_dir, _ = mlm_run
    config = glue_config("sst2,tupe_r", "tiny")
    config.model.update(TINY, max_position_embeddings=32)
    config.data.update(glue_dir=str(shared_data / "glue"), max_seq_length=32,
                       train_split="train[:512]", test_split="validation[:100]",
                       tokenizer=str(shared_data / "bert-base-uncased-vocab" / "vocab.txt"))
    config.update(num_steps=4, batch_size=16, eval_batch_size=16, log_every_steps=2,
                  init_from=str(mlm_dir))
    config.checkpoint.update(every_steps=4, async_save=False)
    config.optimizer.warmup_steps = 1

    run = run_setup.prepare(config, tmp_path / "probe", training=True)
    fresh = state_lib.init_state(run.task, run.model, run.tx, run.mesh, run.shardings,
                                 config.seed)
    loaded = init_from_lib.load_init_from(fresh, config.init_from, run.shardings)
    pretrained = run_setup.prepare(mlm, mlm_dir, training=False)
    ckpt = ckpt_lib.Checkpointer(mlm_dir, 2, 3, create=False)
    mlm_state = ckpt.restore(ckpt.latest_step(), pretrained.abstract)
    ckpt.close()
    same = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))),
                        loaded.params["encoder"], mlm_state.params["encoder"])
    assert jax.tree.leaves(same) and all(jax.tree.leaves(same))

    result = trainer.train(config, tmp_path / "glue")
    assert set(result.eval) == {"num_examples", "accuracy", "score", "loss"}
    assert result.eval["num_examples"] == 100
    config.data.test_split = "test[:37]"
    out = evaluator.evaluate(config, tmp_path / "glue")
    assert out["num_examples"] == 37 and "accuracy" not in out
    rows = (tmp_path / "glue" / "predictions" / f"step_{out['step']}" / "SST-2.tsv"
            ).read_text().splitlines()
    assert rows[0] == "index\tprediction" and len(rows) == 38
    assert [int(r.split("\t")[0]) for r in rows[1:]] == list(range(37))
    assert {r.split("\t")[1] for r in rows[1:]} <= {"0", "1"}

    # Fine-tuning that run's encoder with another vocabulary would read its embedding rows as
    # other tokens: refused, naming the run's own tokenizer. An edited vocabulary (two ids
    # swapped, as when BERT's [unused] rows get new words) is named in a warning.
    lines = pathlib.Path(mlm.data.tokenizer).read_text().splitlines(keepends=True)
    edited = lines[:3000] + [lines[3001], lines[3000]] + lines[3002:]
    (tmp_path / "edited.txt").write_text("".join(edited))
    config.data.tokenizer = str(tmp_path / "edited.txt")
    with caplog.at_level(logging.WARNING):
        run_setup.prepare(config, tmp_path / "glue_edited_vocabulary", training=True)
    assert (f"data.tokenizer='{tmp_path / 'edited.txt'}' differs from the run "
            f"init_from='{mlm_dir}' was trained with (data.tokenizer='{mlm.data.tokenizer}' "
            "there) in ids 2048–3071: those embedding rows start from another token's"
            ) in caplog.text
    other = lines[:5] + lines[5:][::-1]   # the same tokens, but almost every id another one
    (tmp_path / "other.txt").write_text("".join(other))
    config.data.tokenizer = str(tmp_path / "other.txt")
    with pytest.raises(ValueError, match=re.escape(
            f"data.tokenizer='{tmp_path / 'other.txt'}' is another vocabulary than the run "
            f"init_from='{mlm_dir}' was trained with (data.tokenizer='{mlm.data.tokenizer}' "
            "there; 100% of the ids stand for other tokens)")):
        run_setup.prepare(config, tmp_path / "glue_other_vocabulary", training=True)


def test_glue_from_converted_encoder(tmp_path, shared_data):
    """A published encoder imported without its head (converter task 'encoder', params rooted
    at ['embeddings']) lands in the GLUE model's params['encoder']. The recipe's MRPC files and
    BERT vocabulary lie under config.data_root (``shared_data``)."""
    from posjax.convert import Pretrained, save_checkpoint
    from posjax.models.config import TextConfig
    from posjax.models.text import TextEncoder

    config = glue_config("mrpc,deberta", "tiny")   # a task with local files
    config.model.update(TINY, max_position_embeddings=32, max_relative_positions=32,
                        vocab_size=30522)
    config.data.max_seq_length = 32
    cfg = TextConfig.from_dict(dict(config.model))
    ids = np.zeros((1, 8), np.int32)
    encoder = jax.jit(lambda: nn.unbox(TextEncoder(cfg).init(jax.random.PRNGKey(7), ids,
                                                             np.ones_like(ids))["params"]))()
    encoder = jax.tree.map(np.asarray, encoder)
    save_checkpoint(Pretrained(cfg, encoder, "text", "encoder"), tmp_path / "imported")
    config.init_from = str(tmp_path / "imported")
    run = run_setup.prepare(config, tmp_path / "glue", training=True)
    fresh = state_lib.init_state(run.task, run.model, run.tx, run.mesh, run.shardings, 0)
    loaded = init_from_lib.load_init_from(fresh, config.init_from, run.shardings)
    same = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), b)),
                        loaded.params["encoder"], encoder)
    assert jax.tree.leaves(same) and all(jax.tree.leaves(same))
    assert np.array_equal(loaded.params["classifier"]["kernel"],
                          fresh.params["classifier"]["kernel"])


def test_stsb_regression_and_summaries():
    """STS-B uses one output and squared error; summaries compute the official metrics."""
    config = glue_config("stsb,bert_a", "tiny")
    task = make_task(config)
    assert task.glue_task.num_labels == 1 and task.dummy_batch(2)["label"].dtype == np.float32
    out = task.summarize({"prediction": np.array([1.0, 2.0, 3.5]),
                          "label": np.array([1.5, 2.0, 3.0]), "loss": np.array([0.25, 0, .25]),
                          "idx": np.arange(3)})
    assert set(out) == {"num_examples", "pearson", "spearman", "score", "loss"}
    assert out["spearman"] == pytest.approx(1.0)
    mlm = make_task(mlm_config("tupe_r", "tiny"))
    s = mlm.summarize({"loss_sum": np.array([6.0, 2.0]), "correct": np.array([1.0, 3.0]),
                       "predictions": np.array([3.0, 1.0])})
    assert s["loss"] == 2.0 and s["accuracy"] == 1.0 and s["perplexity"] == pytest.approx(np.e ** 2)


def test_bad_text_configs(shared_data):
    config = mlm_config("bert_a", "tiny")
    config.model["vocab_size"] = 1000
    with pytest.raises(ValueError, match=r"model.vocab_size=1000 is smaller than the tokenizer's "
                                         r"30522 ids"):
        make_task(config).validate()
    config = mlm_config("tupe_r", "tiny")
    config.data.max_seq_length = 256
    with pytest.raises(ValueError, match="data.max_seq_length=256 exceeds model.max_position"):
        make_task(config).validate()
    config = glue_config("cola,deberta", "tiny")
    config.model["use_emd"] = True
    with pytest.raises(ValueError, match="use_emd"):
        make_task(config).validate()
    config = mlm_config("bert_a", "tiny")
    config.model["pos_att_type"] = ("c2p",)   # DeBERTa's: BERT-A would ignore it
    with pytest.raises(ValueError, match=r"model.pos_att_type=\('c2p',\) has no effect with "
                                         r"position_scheme='bert_abs' \(only deberta, "
                                         r"deberta_v2 read it\)"):
        make_task(config).validate()
    config = glue_config("cola,deberta", "tiny")
    config.model["tie_cls"] = True
    with pytest.raises(ValueError, match=r"model.tie_cls=True .* \(only tupe_a, tupe_r read"):
        make_task(config).validate()
    for config in (mlm_config("bert_a", "tiny"), glue_config("mrpc", "tiny")):
        config.label_smoothing = 0.5   # an image-classification key
        with pytest.raises(ValueError, match=r"label_smoothing=0.5: the (mlm|glue) task trains"):
            make_task(config).validate()
    config = glue_config("sst2", "tiny")
    config.data.task = "squad"
    with pytest.raises(ValueError, match="data.task='squad'"):
        make_task(config).validate()
    with pytest.raises(ValueError, match="GLUE task 'squad' is unknown"):
        glue_config("squad", "tiny")


@pytest.mark.parametrize("scheme", ["rope", "alibi", "nope", "deberta_v2"])
def test_todays_baselines_train_and_evaluate_at_twice_the_length(shared_data, tmp_path, scheme):
    """The new schemes train through the MLM recipe; eval.py's length override evaluates a
    relative scheme at 2L into its own result file (the run's own stays), while an absolute
    table refuses it before anything is compiled, naming the field and why."""
    config = tiny_mlm(shared_data, scheme)
    if scheme == "deberta_v2":
        config.model.update(max_relative_positions=32, position_buckets=16, use_emd=False,
                            max_position_embeddings=0)
    workdir = tmp_path / "run"
    result = trainer.train(config, workdir)
    assert np.isfinite(result.eval["loss"])
    longer = tiny_mlm(shared_data, scheme)
    longer.model.update(config.model.to_dict())
    longer.data.max_seq_length = 64
    extrapolated = evaluator.evaluate(longer, workdir)
    assert np.isfinite(extrapolated["loss"]) and extrapolated["num_sequences"] > 0
    files = sorted(p.name for p in (workdir / "checkpoints").glob("eval_*.json"))
    assert any(name.endswith("_seq-64.json") for name in files), files
    assert any(not name.endswith("_seq-64.json") for name in files), files


def _spy_for_evaluation(monkeypatch):
    """Record every (params in, model out, params out) of the text tasks' for_evaluation."""
    from posjax.training import text_tasks
    calls = []
    original = text_tasks._TextTask.for_evaluation

    def spy(self, model, params):
        out_model, out_params = original(self, model, params)
        calls.append((jax.device_get(params), out_model, jax.device_get(out_params)))
        return out_model, out_params

    monkeypatch.setattr(text_tasks._TextTask, "for_evaluation", spy)
    return calls


def _interpolated(table, rows):
    """Corner-aligned linear interpolation of ``table``'s rows to ``rows`` rows (numpy)."""
    x = np.arange(rows) * (len(table) - 1) / (rows - 1)
    return np.stack([np.interp(x, np.arange(len(table)), c) for c in table.T], axis=1)


def test_absolute_tables_refuse_evaluation_beyond_their_rows_unless_extended(
        shared_data, tmp_path, monkeypatch):
    """eval.py at 2L refuses an absolute table by default, naming model.extend_positions; with
    extend_positions='interpolate' the checkpoint's table is resampled to 2L rows (first and
    last rows kept, the rest linear between neighbours) and the model evaluates at 2L."""
    config = tiny_mlm(shared_data, "bert_a")
    trainer.train(config, tmp_path / "run")
    before = sorted(p.name for p in (tmp_path / "run").rglob("*"))
    longer = tiny_mlm(shared_data, "bert_a")
    longer.data.max_seq_length = 64
    with pytest.raises(ValueError, match=r"data.max_seq_length=64 exceeds model.max_position_"
                       r"embeddings=32: position_scheme='bert_abs' reads an absolute position "
                       r"table, which has no rows beyond 32; .* set "
                       r"model.extend_positions='interpolate'"):
        evaluator.evaluate(longer, tmp_path / "run")
    assert sorted(p.name for p in (tmp_path / "run").rglob("*")) == before

    calls = _spy_for_evaluation(monkeypatch)
    longer.model.extend_positions = "interpolate"
    result = evaluator.evaluate(longer, tmp_path / "run")
    assert np.isfinite(result["loss"]) and result["num_sequences"] > 0
    assert any(p.name.endswith("_seq-64.json") for p in (tmp_path / "run").rglob("eval_*"))
    (params, model, extended), = calls
    key = ("encoder", "embeddings", "position_embeddings", "embedding")
    table = np.asarray(params[key[0]][key[1]][key[2]][key[3]])
    stretched = np.asarray(extended[key[0]][key[1]][key[2]][key[3]])
    assert table.shape == (32, 32) and stretched.shape == (64, 32)
    assert model.cfg.max_position_embeddings == 64
    np.testing.assert_array_equal(stretched[0], table[0])
    np.testing.assert_allclose(stretched[-1], table[-1], rtol=1e-6)
    np.testing.assert_allclose(stretched, _interpolated(table, 64), rtol=1e-5, atol=1e-7)
    # Every other parameter is the checkpoint's.
    flat, flat_ext = (jax.tree_util.tree_leaves_with_path(t) for t in (params, extended))
    for (path, a), (_, b) in zip(flat, flat_ext):
        if "position_embeddings" not in jax.tree_util.keystr(path):
            np.testing.assert_array_equal(a, b)


def test_tupe_untied_table_is_extended_with_its_cls_row_kept(mlm_run, shared_data,
                                                             monkeypatch):
    """TUPE-R's untied table (1 + L rows: [CLS] row 0, positions 1…L) at 2L: row 0 unchanged,
    rows 1…2L interpolated from rows 1…L."""
    config, workdir, _ = mlm_run
    calls = _spy_for_evaluation(monkeypatch)
    longer = tiny_mlm(shared_data, "tupe_r")
    longer.data.max_seq_length = 64
    longer.model.extend_positions = "interpolate"
    result = evaluator.evaluate(longer, workdir)
    assert np.isfinite(result["loss"])
    (params, model, extended), = calls
    table = np.asarray(params["encoder"]["encoder"]["tupe_bias"]["position_embeddings"])
    stretched = np.asarray(extended["encoder"]["encoder"]["tupe_bias"]["position_embeddings"])
    assert table.shape == (33, 32) and stretched.shape == (65, 32)
    assert model.cfg.max_position_embeddings == 64
    np.testing.assert_array_equal(stretched[0], table[0])
    np.testing.assert_allclose(stretched[1:], _interpolated(table[1:], 64), rtol=1e-5,
                               atol=1e-7)


def test_extend_positions_is_refused_where_it_would_change_nothing(shared_data, tmp_path):
    """Training (at any length), a scheme without a table, a length within the table and an
    unknown method are each one error naming model.extend_positions."""
    config = tiny_mlm(shared_data, "bert_a")
    config.model.extend_positions = "interpolate"
    config.data.max_seq_length = 64
    with pytest.raises(ValueError, match=r"model.extend_positions='interpolate' applies only "
                                         r"when eval.py evaluates a run's checkpoints .*train.py"):
        trainer.train(config, tmp_path / "run")
    assert not (tmp_path / "run" / "checkpoints").exists()
    config = tiny_mlm(shared_data, "bert_a")
    config.model.extend_positions = "interpolate"
    with pytest.raises(ValueError, match=r"model.extend_positions='interpolate' has no effect: "
                                         r"data.max_seq_length=32 fits the table's 32 rows"):
        make_task(config).validate()
    config = tiny_mlm(shared_data, "rope")
    config.model.extend_positions = "interpolate"
    with pytest.raises(ValueError, match=r"has no effect: position_scheme='rope' reads no "
                                         r"absolute position table"):
        make_task(config).validate()
    config = tiny_mlm(shared_data, "bert_a")
    config.model.extend_positions = "nearest"
    with pytest.raises(ValueError, match=r"model.extend_positions='nearest' is not valid: "
                                         r"choose '' .* or 'interpolate'"):
        make_task(config).validate()
