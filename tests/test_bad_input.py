"""Malformed input, one table: each case is refused with one ValueError that names the field or
file at fault (and says what to do), before anything is compiled or written: no XLA
compilation starts (``compilations``: jax.monitoring's events), and the tree of the test's
folder (names, sizes, mtimes) is the same after the refused run as before. train.py's cases
run ``trainer.train``; published weights (``CONVERT_CASES``) go through
``python -m posjax.convert``, which reads them (``config.init_from`` takes only its output).
The checks themselves live where they belong (run_config, optim, the model configs, the data
readers, workdir, init_from_checks, posjax.convert, hosts); this table gathers one case per kind
of mistake.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import pathlib
import shutil
from typing import Iterator

import jax
import numpy as np
import pytest

from posjax.convert import export_hf, save_checkpoint
from posjax.convert.__main__ import main as convert_main
from posjax.convert.pretrained import Pretrained, expected_params
from posjax.models.config import TextConfig, ViTConfig
from posjax.training import evaluator
from posjax.training import hosts
from posjax.training import trainer

import synthetic_runs as syn

ROOT = pathlib.Path(__file__).resolve().parents[1]


def recipe(path: str, variant: str):
    spec = importlib.util.spec_from_file_location("recipe", ROOT / "configs" / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(variant)


def tiny(**overrides):
    return syn.tiny_config(**overrides)


# ------------------------------------------------------------------------------ the cases
# Each builds (config, workdir) in ``tmp`` and returns them; ``train``: whether train.py
# (else eval.py) refuses it.

def _npz_images(tmp, image, label):
    folder = tmp / "npz"
    folder.mkdir()
    for split in ("train", "test"):
        np.savez(folder / f"{split}.npz", image=image, label=label)
    config = recipe("vit_cifar10.py", "")
    config.data.update(path=str(folder), train_split="train", test_split="test", image_size=8,
                       mean=(0.5,), std=(0.5,))
    config.model.update(image_size=8, patch_size=4, num_channels=1, hidden_size=16,
                        num_heads=2, num_layers=1, mlp_dim=32, num_classes=4)
    config.batch_size, config.num_steps, config.optimizer.warmup_steps = 8, 2, 0
    return config


def _text(tmp, content: bytes, vocab: bytes | None = None):
    path = tmp / "corpus.txt"
    path.write_bytes(content)
    config = recipe("mlm_bert_a.py", "tiny")
    config.data.text_files = {"train": str(path), "valid": str(path)}
    config.data.update(train_split="train", test_split="valid")
    if vocab is not None:
        (tmp / "vocab.txt").write_bytes(vocab)
        config.data.tokenizer = str(tmp / "vocab.txt")
    return config


def _glue(tmp, train_tsv: str):
    folder = tmp / "glue" / "SST-2"
    folder.mkdir(parents=True)
    (folder / "train.tsv").write_text(train_tsv)
    (folder / "dev.tsv").write_text("sentence\tlabel\ngood .\t1\nbad .\t0\n")
    config = recipe("glue_tiny.py", "sst2")
    config.data.glue_dir = str(tmp / "glue")
    return config


_DONOR: list[pathlib.Path] = []


def _donor_run(tmp, edit=None):
    """A copy of a finished 2-step run of a wider model (trained once per session), its
    config.json's model section edited by ``edit``; the config to start from it."""
    if not _DONOR:
        _DONOR.append(tmp.parent / "donor_run")
        trainer.train(tiny(**{"model.hidden_size": 24, "model.mlp_dim": 40, "num_steps": 2}),
                      _DONOR[0])
    copy = tmp / "other_run"
    shutil.copytree(_DONOR[0], copy)
    if edit:
        saved = json.loads((copy / "config.json").read_text())
        edit(saved["model"])
        (copy / "config.json").write_text(json.dumps(saved))
    return tiny(init_from=str(copy))


def _scheme_field_on_another_scheme(tmp):
    config = recipe("mlm_bert_a.py", "tiny")
    config.model.use_emd = True
    return config


def _random_params(kind: str, task: str, config):
    rng = np.random.default_rng(0)
    return jax.tree.map(lambda s: rng.normal(size=s.shape).astype(np.float32) * 0.1,
                        expected_params(kind, task, config))


def _vit_npz(tmp) -> pathlib.Path:
    """A vit_jax-style .npz (its arrays' names; what the converter reads)."""
    path = tmp / "vit.npz"
    np.savez(path, **{"embedding/kernel": np.zeros((4, 4, 1, 16), np.float32),
                      "Transformer/encoderblock_0/MlpBlock_3/Dense_0/kernel":
                          np.zeros((16, 32), np.float32)})
    return path


def _hf_folder(tmp) -> pathlib.Path:
    """A tiny DeBERTa-v2 MLM as Hugging Face saves it (config.json + model.safetensors),
    written by posjax's exporter."""
    config = TextConfig(position_scheme="deberta_v2", vocab_size=30, hidden_size=16,
                        num_heads=2, num_layers=1, mlp_dim=24, max_position_embeddings=0,
                        position_biased_input=False, max_relative_positions=16,
                        position_buckets=4, pos_att_type=("c2p", "p2c"))
    return export_hf(Pretrained(config, _random_params("text", "mlm", config), "text", "mlm"),
                     tmp / "hf")


def _converted(tmp, **vit) -> pathlib.Path:
    """A converter output folder (params/ + model_config.json) of a ViT classifier like
    ``tiny``'s, with the ``vit`` fields changed."""
    config = ViTConfig(**{**dict(image_size=8, patch_size=4, num_channels=1, hidden_size=16,
                                 num_heads=2, num_layers=1, mlp_dim=32,
                                 num_classes=syn.NUM_CLASSES), **vit})
    pre = Pretrained(config, _random_params("vit", "classification", config), "vit",
                     "classification")
    return save_checkpoint(pre, tmp / "converted")


def _converted_with(tmp, damage):
    folder = _converted(tmp)
    damage(folder)
    return tiny(init_from=str(folder))


def _cut_in_half(path: pathlib.Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


CASES = {
    # configs
    "unknown key": (lambda t: tiny(num_step=3), "'num_step'"),
    "zero num_steps": (lambda t: tiny(num_steps=0), "num_steps=0"),
    "negative batch_size": (lambda t: tiny(batch_size=-16), "batch_size=-16"),
    "zero log_every_steps": (lambda t: tiny(log_every_steps=0), "log_every_steps=0"),
    "negative eval_batch_size": (lambda t: tiny(eval_batch_size=-1), "eval_batch_size=-1"),
    "zero checkpoint interval": (lambda t: tiny(**{"checkpoint.every_steps": 0}),
                                 "checkpoint.every_steps=0"),
    "negative checkpoint.keep": (lambda t: tiny(**{"checkpoint.keep": -1}),
                                 "checkpoint.keep=-1"),
    "zero learning rate": (lambda t: tiny(**{"optimizer.learning_rate": 0.0}),
                           "optimizer.learning_rate=0.0"),
    "unknown optimizer": (lambda t: tiny(**{"optimizer.name": "lamb"}), "optimizer.name='lamb'"),
    "warmup past the end": (lambda t: tiny(**{"optimizer.warmup_steps": 6}),
                            "optimizer.warmup_steps=6"),
    "NaN weight decay": (lambda t: tiny(**{"optimizer.weight_decay": float("nan")}),
                         "optimizer.weight_decay=nan"),
    "heads not dividing width": (lambda t: tiny(**{"model.num_heads": 3}), "num_heads=3"),
    "zero layers": (lambda t: tiny(**{"model.num_layers": 0}), "num_layers=0"),
    "scheme field on the wrong scheme": (_scheme_field_on_another_scheme, "use_emd"),
    "patch not dividing the image": (lambda t: tiny(**{"model.patch_size": 3}), "patch_size"),
    "batch not divisible by data parallel": (lambda t: tiny(batch_size=12), "batch_size=12"),
    "mesh bigger than the devices": (lambda t: tiny(**{"mesh.data": 16}), "mesh"),
    "negative peak_flops": (lambda t: tiny(peak_flops=-1.0), "peak_flops=-1.0"),
    "eval.py's eval_step given to train.py": (lambda t: tiny(eval_step=4),
                                              "eval_step=4 applies to eval.py only"),
    # data
    "images with another channel count": (lambda t: _npz_images(
        t, np.zeros((16, 8, 8, 3), np.uint8), np.arange(16) % 4), "channel"),
    "images of float dtype": (lambda t: _npz_images(
        t, np.zeros((16, 8, 8, 1), np.complex64), np.arange(16) % 4), "image"),
    "image labels out of range": (lambda t: _npz_images(
        t, np.zeros((16, 8, 8, 1), np.uint8), np.arange(16)), "model.num_classes=4"),
    "empty text file": (lambda t: _text(t, b""), "data.test_split='valid'"),
    "text that is not UTF-8": (lambda t: _text(t, "caf\xe9 au lait\n".encode("latin-1")),
                               "corpus.txt: line 1"),
    "empty vocabulary": (lambda t: _text(t, b"some words\n", vocab=b""), "vocab.txt"),
    "GLUE TSV without its label column": (lambda t: _glue(t, "sentence\ngood .\nbad .\n"),
                                          "train.tsv"),
    "GLUE label out of range": (lambda t: _glue(t, "sentence\tlabel\ngood .\t7\nbad .\t9\n"),
                                "train.tsv"),
    # weights
    "weights config missing a field": (
        lambda t: _donor_run(t, lambda m: m.pop("hidden_size")), "config.json"),
    "weights config contradicting itself": (
        lambda t: _donor_run(t, lambda m: m.update(num_heads=5)), "config.json there"),
    "a run of another model": (_donor_run, "init_from"),
    "a converter folder of another model": (
        lambda t: tiny(init_from=str(_converted(t, hidden_size=24, mlp_dim=40))),
        "none of its 24 parameters fits this model's encoder"),
    "a converter folder whose model_config.json is not JSON": (
        lambda t: _converted_with(t, lambda f: _cut_in_half(f / "model_config.json")),
        "model_config.json is damaged"),
    "a converter folder cut short": (
        lambda t: _converted_with(t, lambda f: _cut_in_half(f / "params" / "_METADATA")),
        "cannot read this checkpoint"),
    "a published .npz given to init_from": (lambda t: tiny(init_from=str(_vit_npz(t))),
                                            "vit.npz': neither"),
    "a Hugging Face folder given to init_from": (lambda t: tiny(init_from=str(_hf_folder(t))),
                                                 "convert them first"),
}


def _tree(path: pathlib.Path) -> dict[str, tuple[int, int]]:
    """{relative name: (size, mtime_ns)} of everything under ``path`` (itself included)."""
    if not path.exists():
        return {}
    out = {".": (0, path.stat().st_mtime_ns)}
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            p = pathlib.Path(dirpath) / name
            st = p.lstat()
            out[str(p.relative_to(path))] = (st.st_size, st.st_mtime_ns)
    return out


# jax.monitoring's events of a compilation: lowering to MLIR, then XLA's compile. Tracing
# alone (jax.eval_shape: the abstract state, the init_from checks) is none.
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")


@contextlib.contextmanager
def compilations() -> Iterator[list[str]]:
    """The compile events (``COMPILE_EVENTS``) of the programs lowered inside the block. A
    program already compiled in this process is not compiled again, so a refused input is
    checked in a fresh process too (each case alone: ``pytest -k``)."""
    seen: list[str] = []

    def listener(event: str, duration: float, **kwargs) -> None:
        if event in COMPILE_EVENTS:
            seen.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def test_compilations_sees_a_compilation():
    with compilations() as seen:
        jax.jit(lambda x: x * 3 + 1)(np.arange(5, dtype=np.float32))
    assert seen == list(COMPILE_EVENTS)
    with compilations() as seen:
        jax.eval_shape(lambda x: x * 5 + 1, np.arange(5, dtype=np.float32))
    assert seen == []


# The cases built on configs/mlm_bert_a.py:tiny or glue_tiny.py that keep its tokenizer: the
# BERT vocabulary under config.data_root, which the real data (``shared_data``) provides.
NEEDS_DATA = {"scheme field on the wrong scheme", "empty text file", "text that is not UTF-8",
              "GLUE TSV without its label column", "GLUE label out of range"}
assert NEEDS_DATA <= set(CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_refused_naming_the_culprit_and_writes_nothing(name, tmp_path, request):
    if name in NEEDS_DATA:
        request.getfixturevalue("shared_data")   # skips (or fails in CI) without the data
    build, culprit = CASES[name]
    try:
        config = build(tmp_path)
    except ValueError as e:   # refused while the config is built (the model config's checks)
        assert culprit in str(e), str(e)
        return
    workdir = tmp_path / "workdir"
    workdir.mkdir()
    (workdir / "keep.txt").write_text("a file the run must leave alone")
    before = _tree(tmp_path)
    with compilations() as compiled, pytest.raises(ValueError) as refused:
        trainer.train(config, workdir)
    message = str(refused.value)
    assert culprit in message, message
    assert _tree(tmp_path) == before, f"{name}: the refused run changed files"
    assert compiled == [], f"{name}: refused after {len(compiled)} compile event(s)"


def _edit_config_json(**changes):
    """A damage of a Hugging Face folder: its config.json with ``changes`` (None: the key
    removed)."""
    def edit(folder: pathlib.Path) -> None:
        config = json.loads((folder / "config.json").read_text())
        for key, value in changes.items():
            if value is None:
                config.pop(key)
            else:
                config[key] = value
        (folder / "config.json").write_text(json.dumps(config))
    return edit


def _corrupt_header(folder: pathlib.Path) -> None:
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:24] = b"#" * 16            # the JSON header after its 8-byte length
    path.write_bytes(bytes(data))


def _from_hf(damage):
    def build(tmp: pathlib.Path) -> pathlib.Path:
        folder = _hf_folder(tmp)
        damage(folder)
        return folder
    return build


def _cut_npz(tmp: pathlib.Path) -> pathlib.Path:
    path = _vit_npz(tmp)
    _cut_in_half(path)
    return path


# name: (build the source in tmp, what the error names, the way out it gives)
CONVERT_CASES = {
    "truncated .safetensors": (_from_hf(lambda f: _cut_in_half(f / "model.safetensors")),
                               "model.safetensors: not a readable safetensors file",
                               "download it again"),
    ".safetensors with a corrupt header": (_from_hf(_corrupt_header),
                                           "model.safetensors: not a readable safetensors file",
                                           "download it again"),
    "truncated .npz": (_cut_npz, "vit.npz: not a readable .npz archive", "download it again"),
    "config.json without hidden_size": (_from_hf(_edit_config_json(hidden_size=None)),
                                        "config.json: has no hidden_size", "download it again"),
    "config.json without num_attention_heads": (
        _from_hf(_edit_config_json(num_attention_heads=None)),
        "config.json: has no num_attention_heads", "add it with the values"),
    "config.json without model_type": (_from_hf(_edit_config_json(model_type=None)),
                                       "config.json: has no model_type", "download it again"),
    "config.json whose heads do not divide the width": (
        _from_hf(_edit_config_json(num_attention_heads=3)),
        "config.json: hidden_size=16 is not valid: must be divisible by num_attention_heads=3",
        "correct it from the model card"),
    "config.json whose model_type contradicts the weights": (
        _from_hf(_edit_config_json(model_type="deberta")),
        "config.json: model_type='deberta' contradicts the weights",
        "download the folder's config.json again"),
    "config.json that is not JSON": (
        _from_hf(lambda f: _cut_in_half(f / "config.json")), "config.json: not valid JSON",
        "download it again"),
}


@pytest.mark.parametrize("name", list(CONVERT_CASES))
def test_bad_weights_are_refused_by_the_converter_naming_the_culprit(name, tmp_path, capsys):
    """``python -m posjax.convert``: exit status 2 and one line, 'error: ' with the file and
    field at fault and the way out; no destination, nothing compiled."""
    build, culprit, fix = CONVERT_CASES[name]
    source = build(tmp_path)
    capsys.readouterr()
    before = _tree(tmp_path)
    with compilations() as compiled:
        status = convert_main(["--from", str(source), "--to", str(tmp_path / "converted")])
    out, err = capsys.readouterr()
    assert status == 2 and out == "", (status, out)
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    assert culprit in err and fix in err, err
    assert _tree(tmp_path) == before, f"{name}: the refused conversion changed files"
    assert compiled == [], f"{name}: refused after {len(compiled)} compile event(s)"


WORKDIR_CASES = {
    "a file where the workdir should be": (lambda t: t / "file", "file", "is a file"),
    "a file where checkpoints/ should be": (lambda t: t / "run", "run/checkpoints", "checkpoints"),
    "a file where tensorboard/ should be": (lambda t: t / "run", "run/tensorboard", "tensorboard"),
    "a workdir that is not writable": (lambda t: pathlib.Path("/proc/posjax_run"), None,
                                       "not writable"),
    "a damaged config.json beside checkpoints": (lambda t: t / "run", "run/config.json",
                                                 "config.json"),
}


@pytest.mark.parametrize("name", list(WORKDIR_CASES))
def test_bad_workdir_is_refused_and_left_alone(name, tmp_path):
    workdir_of, a_file, culprit = WORKDIR_CASES[name]
    workdir = workdir_of(tmp_path)
    if a_file:
        (tmp_path / a_file).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / a_file).write_text("{not json")
    if "config.json" in name:
        (workdir / "checkpoints" / "2").mkdir(parents=True)
    before = _tree(tmp_path)
    with pytest.raises(ValueError, match=culprit):
        trainer.train(tiny(), workdir if "workdir" not in name or "not" in name
                      else workdir / "run")
    assert _tree(tmp_path) == before


def test_bad_peer_timeout_is_refused_before_jax_starts():
    config = tiny(**{"distributed.enabled": True, "distributed.peer_timeout_s": 0})
    with pytest.raises(ValueError, match=r"distributed.peer_timeout_s=0 is not valid"):
        hosts.maybe_initialize_distributed(config)


def test_eval_of_a_workdir_without_checkpoints_names_it(tmp_path):
    before = _tree(tmp_path)
    with pytest.raises(ValueError, match="has no checkpoints/"):
        evaluator.evaluate(tiny(), tmp_path)
    assert _tree(tmp_path) == before
