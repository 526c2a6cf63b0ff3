"""Bad input to posjax.convert: one clear ValueError naming the file and tensor, raised before
anything is written; destinations are all-or-nothing and never overwritten."""
from __future__ import annotations

import json
import shutil
import sys

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.numpy import load_file, save_file  # noqa: E402

import posjax.convert as convert  # noqa: E402
from posjax.convert import export_hf, load_pretrained, save_checkpoint  # noqa: E402
from posjax.convert.pretrained import Pretrained  # noqa: E402
from posjax.models.config import TextConfig, ViTConfig  # noqa: E402


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A tiny DeBERTa-v2 classifier written by transformers."""
    torch.manual_seed(0)
    config = transformers.DebertaV2Config(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=24, relative_attention=True, pos_att_type="c2p|p2c",
        position_buckets=4, max_relative_positions=16, position_biased_input=False, num_labels=2)
    folder = tmp_path_factory.mktemp("hf") / "deberta"
    transformers.DebertaV2ForSequenceClassification(config).save_pretrained(folder)
    return folder


@pytest.fixture
def copy_of(hf_folder, tmp_path):
    dest = tmp_path / "copy"
    shutil.copytree(hf_folder, dest)
    return dest


def edit_config(folder, **changes):
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def edit_tensors(folder, drop=(), add=None):
    path = folder / "model.safetensors"
    tensors = {k: v for k, v in load_file(path).items() if k not in drop}
    save_file({**tensors, **(add or {})}, path)


def test_wrong_model_type(copy_of):
    edit_config(copy_of, model_type="bert")
    with pytest.raises(ValueError, match=r"config\.json: model_type='bert' is not supported"):
        load_pretrained(copy_of)


def test_shape_mismatch_names_tensor(copy_of):
    edit_config(copy_of, intermediate_size=32)
    with pytest.raises(ValueError, match=r"model\.safetensors.*deberta\.encoder\.layer\.0\."
                       r"intermediate\.dense\.weight' of shape \(24, 16\).*"
                       r"mlp/fc1/kernel, which needs \(16, 32\)"):
        load_pretrained(copy_of)


def test_missing_tensor_named(copy_of):
    name = "deberta.encoder.layer.0.attention.self.pos_key_proj.weight"
    edit_tensors(copy_of, drop=[name])
    with pytest.raises(ValueError, match=rf"model\.safetensors: missing tensor.*{name}"):
        load_pretrained(copy_of)


def test_unknown_tensor_named(copy_of):
    edit_tensors(copy_of, add={"deberta.encoder.layer.0.surprise.weight": np.zeros(3, np.float32)})
    with pytest.raises(ValueError, match=r"deberta\.encoder\.layer\.0\.surprise\.weight"):
        load_pretrained(copy_of)


def test_unsupported_numerics_refused(copy_of):
    edit_config(copy_of, relative_attention=False)
    with pytest.raises(ValueError, match=r"copy/config\.json: relative_attention=False is not"):
        load_pretrained(copy_of)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_safetensors(copy_of, damage):
    path = copy_of / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x07" * 64)
    with pytest.raises(ValueError, match=r"model\.safetensors.*(truncated or corrupt)"):
        load_pretrained(copy_of)


def test_bin_needs_torch_and_must_be_whole(copy_of, monkeypatch):
    state = load_file(copy_of / "model.safetensors")
    (copy_of / "model.safetensors").unlink()
    torch.save({k: torch.tensor(v) for k, v in state.items()}, copy_of / "pytorch_model.bin")
    monkeypatch.setitem(sys.modules, "torch", None)   # as if torch were not installed
    with pytest.raises(ValueError, match=r"pytorch_model\.bin: reading PyTorch .bin .*needs torch"):
        load_pretrained(copy_of)
    monkeypatch.undo()
    path = copy_of / "pytorch_model.bin"
    path.write_bytes(path.read_bytes()[:300])
    with pytest.raises(ValueError, match=r"pytorch_model\.bin: not a readable PyTorch checkpoint"):
        load_pretrained(copy_of)


def test_folder_without_weights_or_config(tmp_path, copy_of):
    (copy_of / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no weights found"):
        load_pretrained(copy_of)
    with pytest.raises(ValueError, match="no config.json"):
        load_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not found or not a checkpoint"):
        load_pretrained(tmp_path / "absent")


def test_wrong_task(copy_of):
    with pytest.raises(ValueError, match=r"missing tensor.*lm_predictions"):
        load_pretrained(copy_of, task="mlm")
    encoder = load_pretrained(copy_of, task="encoder")   # heads may be dropped on request
    assert set(encoder.params) == {"embeddings", "encoder"}


@pytest.mark.parametrize("head, tensors", [
    ("token-classification", {"classifier.weight": (3, 16), "classifier.bias": (3,)}),
    ("question-answering", {"qa_outputs.weight": (2, 16), "qa_outputs.bias": (2,)})])
def test_a_head_posjax_has_no_module_for(copy_of, head, tensors):
    """HF's token classifier (``classifier.*`` without a pooler) and QA head are refused
    with the way out, which then works: task='encoder' imports the encoder without them."""
    edit_tensors(copy_of, drop=["pooler.dense.weight", "pooler.dense.bias", "classifier.weight",
                                "classifier.bias"],
                 add={k: np.zeros(s, np.float32) for k, s in tensors.items()})
    prefix = next(iter(tensors)).split(".")[0]
    with pytest.raises(ValueError, match=rf"model\.safetensors: holds a {head} head "
                       rf"\({prefix}\.\*\), which posjax has no module for: pass "
                       r"task='encoder' \(--task encoder\)"):
        load_pretrained(copy_of)
    encoder = load_pretrained(copy_of, task="encoder")
    assert set(encoder.params) == {"embeddings", "encoder"}


@pytest.mark.parametrize("changes, error", [
    ({"hidden_size": "16"}, r"config\.json: hidden_size='16' is not valid: must be a number"),
    ({"position_biased_input": "false"},
     r"config\.json: position_biased_input='false' is not valid: must be true or false"),
    ({"num_attention_heads": 3},   # posjax's num_heads, named as config.json names it
     r"config\.json: hidden_size=16 is not valid: must be divisible by num_attention_heads=3"),
    ({"pos_att_type": 5}, r"config\.json: pos_att_type=5 is not supported: give a list")])
def test_bad_config_values_name_the_config_json_key(copy_of, changes, error):
    edit_config(copy_of, **changes)
    with pytest.raises(ValueError, match=error):
        load_pretrained(copy_of)


def test_a_tensor_that_is_not_float_or_has_too_few_dimensions_is_named(copy_of):
    name = "deberta.encoder.layer.0.attention.self.query_proj.weight"
    weight = load_file(copy_of / "model.safetensors")[name]
    edit_tensors(copy_of, add={name: weight.astype(np.int8)})
    with pytest.raises(ValueError, match=rf"tensor '{name}' has dtype int8, not floating point"):
        load_pretrained(copy_of)
    edit_tensors(copy_of, add={name: np.array(1.0, np.float32)})
    with pytest.raises(ValueError, match=rf"tensor '{name}' of shape \(\) cannot be laid out"):
        load_pretrained(copy_of)


def test_unused_tensors_of_an_encoder_import_give_no_head_advice(copy_of):
    edit_tensors(copy_of, add={"deberta.encoder.layer.0.surprise.weight": np.zeros(3, np.float32)})
    for task, advice in (("classification", True), ("encoder", False)):
        with pytest.raises(ValueError, match="surprise") as e:
            load_pretrained(copy_of, task=task)
        assert ("task='encoder'" in str(e.value)) == advice


@pytest.mark.parametrize("image_size", [[16], 16.7, [16, 0], True, [16, None]])
def test_a_vit_image_size_that_is_not_sizes_is_named(tmp_path, image_size):
    folder = tmp_path / "vit"
    transformers.ViTModel(transformers.ViTConfig(
        image_size=16, patch_size=4, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=16), add_pooling_layer=False).save_pretrained(folder)
    assert load_pretrained(folder).config.image_size == (16, 16)
    edit_config(folder, image_size=image_size)
    with pytest.raises(ValueError, match=r"config\.json: image_size=.* is not supported: give a "
                                         r"positive int or a pair"):
        load_pretrained(folder)


def test_corrupt_npz(tmp_path):
    path = tmp_path / "vit.npz"
    np.savez(path, **{"embedding/kernel": np.zeros((4, 4, 3, 8), np.float32)})
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"vit\.npz: .*truncated or corrupt"):
        load_pretrained(path)


def test_untied_legacy_decoder_refused(tmp_path):
    config = transformers.DebertaV2Config(
        vocab_size=30, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=24, relative_attention=True, pos_att_type="c2p",
        max_relative_positions=8, position_biased_input=False, legacy=True)
    transformers.DebertaV2ForMaskedLM(config).save_pretrained(tmp_path / "m")
    edit_tensors(tmp_path / "m", add={"cls.predictions.decoder.weight":
                                      np.ones((30, 16), np.float32)})
    with pytest.raises(ValueError, match=r"cls\.predictions\.decoder\.weight.*untied"):
        load_pretrained(tmp_path / "m")


def zeros_like(shapes):
    return jax.tree.map(lambda s: np.zeros(s.shape, np.float32), shapes)


def test_export_refuses_what_hf_cannot_hold(tmp_path):
    vit = ViTConfig(image_size=8, patch_size=4, hidden_size=8, num_heads=2, num_layers=1,
                    mlp_dim=8, pooling="gap", num_classes=2)
    pre = Pretrained(vit, {}, "vit", "classification")
    with pytest.raises(ValueError, match="export_hf"):   # params checked against the config first
        export_hf(pre, tmp_path / "a")
    pre = Pretrained(vit, zeros_like(convert.expected_params("vit", "classification", vit)),
                     "vit", "classification")
    with pytest.raises(ValueError, match=r"pooling='gap'"):
        export_hf(pre, tmp_path / "b")
    text = TextConfig(position_scheme="tupe_a", vocab_size=10, hidden_size=8, num_heads=2,
                      num_layers=1, mlp_dim=8, max_position_embeddings=8)
    tparams = zeros_like(convert.expected_params("text", "encoder", text))
    with pytest.raises(ValueError, match=r"position_scheme='tupe_a' has no Hugging Face model"):
        export_hf(Pretrained(text, tparams, "text", "encoder"), tmp_path / "c")
    assert not any(tmp_path.iterdir())


def test_destination_all_or_nothing(hf_folder, tmp_path, monkeypatch):
    pre = load_pretrained(hf_folder)
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    for write in (save_checkpoint, export_hf):
        with pytest.raises(ValueError, match="already exists"):
            write(pre, existing)
    assert [p.name for p in existing.iterdir()] == ["keep.txt"]

    def fail_midway(tensors, path):   # a full disk / crash while writing the weights
        path.write_bytes(b"partial")
        raise OSError("No space left on device")

    monkeypatch.setattr(convert, "write_safetensors", fail_midway)
    with pytest.raises(OSError):
        export_hf(pre, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing"]   # no out, no staging
