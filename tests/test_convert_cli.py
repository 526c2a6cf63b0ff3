"""``python -m posjax.convert``: HF folder / npz -> orbax checkpoint + model_config.json (the
format ``config.init_from`` reads), posjax checkpoint -> HF folder, clear failures."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from posjax.convert import load_pretrained  # noqa: E402
from posjax.convert.__main__ import main  # noqa: E402
from posjax.models.config import TextConfig, ViTConfig  # noqa: E402


@pytest.fixture(scope="module")
def hf_mlm(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.DebertaV2Config(
        vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=24, relative_attention=True, pos_att_type="p2c|c2p",
        share_att_key=True, position_buckets=4, max_relative_positions=16,
        norm_rel_ebd="layer_norm", position_biased_input=False, legacy=False)
    folder = tmp_path_factory.mktemp("hf") / "mlm"
    transformers.DebertaV2ForMaskedLM(config).save_pretrained(folder)
    return folder


def test_hf_to_posjax_checkpoint_and_back(hf_mlm, tmp_path, capsys):
    out = tmp_path / "ckpt"
    assert main(["--from", str(hf_mlm), "--to", str(out)]) == 0
    assert "task=mlm" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["model_config.json", "params"]
    meta = json.loads((out / "model_config.json").read_text())
    assert meta["kind"] == "text" and meta["task"] == "mlm"
    pre = load_pretrained(hf_mlm)
    assert TextConfig.from_dict(meta["config"]) == pre.config
    # Exactly what config.init_from restores: StandardCheckpointer of {'params': params}.
    restored = ocp.StandardCheckpointer().restore(out / "params")
    jax.tree.map(np.testing.assert_array_equal, restored, {"params": pre.params})

    hf_out = tmp_path / "hf_again"
    assert main(["--from", str(out), "--to", str(hf_out), "--format", "hf"]) == 0
    model = transformers.DebertaV2ForMaskedLM.from_pretrained(hf_out)
    for name, p in transformers.DebertaV2ForMaskedLM.from_pretrained(hf_mlm).state_dict().items():
        np.testing.assert_array_equal(model.state_dict()[name].numpy(), p.numpy(), err_msg=name)


def test_failure_exits_nonzero_and_writes_nothing(hf_mlm, tmp_path, capsys):
    dest = tmp_path / "never"
    assert main(["--from", str(hf_mlm), "--to", str(dest), "--task", "classification"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "pooler.dense" in err
    assert not dest.exists() and list(tmp_path.iterdir()) == []


def test_a_destination_that_cannot_be_created_is_refused_before_the_source_is_read(
        hf_mlm, tmp_path, capsys, monkeypatch):
    """Under a file, or empty (an unset shell variable): one error line, exit 2, before the
    source is read (minutes for a large model), where a traceback came after it before."""
    import posjax.convert.__main__ as cli
    monkeypatch.setattr(cli, "load_pretrained", lambda *a, **k: pytest.fail("source read"))
    afile = tmp_path / "afile"
    afile.write_text("")
    cases = {(str(hf_mlm), str(afile / "x")):
             f"error: --to '{afile / 'x'}': '{afile}' is a file, not a directory; choose "
             "another --to",
             (str(hf_mlm), ""): "error: --to is empty (an unset shell variable?): give a path",
             ("", str(tmp_path / "out")):
             "error: --from is empty (an unset shell variable?): give a path"}
    for (source, dest), message in cases.items():
        assert main(["--from", source, "--to", dest]) == 2
        assert capsys.readouterr().err.strip() == message
    assert list(tmp_path.iterdir()) == [afile]


def test_cli_npz_with_new_resolution(tmp_path):
    """The real entry point on an official-style npz, resampled to a new resolution."""
    from test_convert_npz import official_arrays, random_params
    cfg = ViTConfig(image_size=16, patch_size=4, hidden_size=16, num_heads=2, num_layers=1,
                    mlp_dim=16, num_classes=3)
    np.savez(tmp_path / "vit.npz", **official_arrays(random_params(cfg, 0)))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, "-m", "posjax.convert", "--from",
                          str(tmp_path / "vit.npz"), "--to", str(tmp_path / "out"),
                          "--image-size", "24"], capture_output=True, text=True, env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert run.returncode == 0, run.stderr
    meta = json.loads((tmp_path / "out" / "model_config.json").read_text())
    assert ViTConfig.from_dict(meta["config"]).image_size == (24, 24)
    restored = ocp.StandardCheckpointer().restore(tmp_path / "out" / "params")["params"]
    assert restored["pos_embedding"].shape == (1, 1 + 36, 16)


def test_cli_pooling_first_for_big_vision_pool_type_0(tmp_path, capsys):
    """``--pooling first`` records big_vision's pool_type='0' in model_config.json; on a file
    whose arrays say [CLS] pooling it fails and writes nothing."""
    from test_convert_npz import big_vision_arrays, random_params
    cfg = ViTConfig(image_size=16, patch_size=4, hidden_size=16, num_heads=2, num_layers=1,
                    mlp_dim=16, num_classes=3, pooling="gap")
    np.savez(tmp_path / "bv.npz", **big_vision_arrays(random_params(cfg, 0)))
    assert main(["--from", str(tmp_path / "bv.npz"), "--to", str(tmp_path / "out"),
                 "--pooling", "first"]) == 0
    meta = json.loads((tmp_path / "out" / "model_config.json").read_text())
    assert ViTConfig.from_dict(meta["config"]).pooling == "first"
    token = ViTConfig(**{**meta["config"], "pooling": "token"})
    np.savez(tmp_path / "tok.npz", **big_vision_arrays(random_params(token, 1)))
    assert main(["--from", str(tmp_path / "tok.npz"), "--to", str(tmp_path / "never"),
                 "--pooling", "first"]) == 2
    assert "pooling='first' does not fit" in capsys.readouterr().err
    assert not (tmp_path / "never").exists()


def test_train_workdir_exported_for_transformers(tmp_path):
    """A fine-tuned GLUE run (train.py layout: config.json with task/model, and
    checkpoints/<step>/state holding the train state) is served by transformers."""
    from posjax.convert import expected_params
    from test_convert_hf import random_params, text_batch
    model_cfg = dict(position_scheme="deberta_v2", vocab_size=30, hidden_size=16, num_heads=2,
                     num_layers=1, mlp_dim=24, max_position_embeddings=0, type_vocab_size=2,
                     position_biased_input=False, max_relative_positions=16, position_buckets=4,
                     norm_rel_ebd=True, dropout_rate=0.0, attention_dropout_rate=0.0)
    cfg = TextConfig.from_dict(model_cfg)
    params = random_params(expected_params("text", "classification", cfg, 3), 0)
    workdir = tmp_path / "run"
    (workdir / "checkpoints").mkdir(parents=True)
    (workdir / "config.json").write_text(json.dumps({"task": "glue", "model": model_cfg}))
    for step, scale in ((2, 0.0), (7, 1.0)):   # the latest step is exported
        state = {"step": np.int32(step), "params": jax.tree.map(lambda x: x * scale, params),
                 "opt_state": {"mu": jax.tree.map(np.zeros_like, params)}}
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(workdir / "checkpoints" / str(step) / "state", state)
    assert main(["--from", str(workdir), "--to", str(tmp_path / "hf"), "--format", "hf"]) == 0
    model = transformers.DebertaV2ForSequenceClassification.from_pretrained(tmp_path / "hf")
    ids, mask, types = text_batch(30, 2)
    with torch.no_grad():
        theirs = model.eval()(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                              token_type_ids=torch.tensor(types)).logits.numpy()
    pre = load_pretrained(workdir)
    ours = pre.module().apply({"params": pre.params}, ids, mask, types)
    np.testing.assert_allclose(theirs, np.asarray(ours), atol=1e-5)
    jax.tree.map(np.testing.assert_array_equal, pre.params, params)


def test_encoder_from_posjax_checkpoints(hf_mlm, tmp_path, capsys):
    """--task encoder drops the head of a posjax checkpoint too: the text MLM keeps its
    encoder subtree; a ViT classifier drops ``head`` and gets num_classes=0. Another head
    cannot be derived."""
    from test_convert_npz import random_params
    from posjax.convert import save_checkpoint
    from posjax.convert.pretrained import Pretrained
    mlm = tmp_path / "mlm"
    assert main(["--from", str(hf_mlm), "--to", str(mlm)]) == 0
    assert main(["--from", str(mlm), "--to", str(tmp_path / "enc"), "--task", "encoder"]) == 0
    assert "task=encoder" in capsys.readouterr().out
    encoder = load_pretrained(tmp_path / "enc")
    jax.tree.map(np.testing.assert_array_equal, encoder.params,
                 load_pretrained(hf_mlm).params["encoder"])
    assert main(["--from", str(mlm), "--to", str(tmp_path / "cls"),
                 "--task", "classification"]) == 2
    assert "only 'encoder', which drops the head" in capsys.readouterr().err

    cfg = ViTConfig(image_size=16, patch_size=4, hidden_size=16, num_heads=2, num_layers=1,
                    mlp_dim=16, num_classes=3)
    save_checkpoint(Pretrained(cfg, random_params(cfg, 0), "vit", "classification"),
                    tmp_path / "vit")
    vit = load_pretrained(tmp_path / "vit", task="encoder")
    assert vit.config.num_classes == 0 and "head" not in vit.params
    images = np.zeros((1, 16, 16, 3), np.float32)
    assert vit.module().apply({"params": vit.params}, images).shape == (1, 16)


def test_the_vocabulary_of_an_imported_folder_guards_init_from(tmp_path):
    """A Hugging Face folder's tokenizer files (here vocab.txt and the same vocabulary as
    tokenizer.json) give the converted folder its data_identity.json; an init_from run that
    reads another vocabulary (two ids swapped) is refused, naming where the weights came from."""
    import ml_collections

    from posjax.data import identity
    from posjax.data.tokenizers import load_tokenizer, wordpiece_tokenizer
    from posjax.training import workdir as workdir_lib

    torch.manual_seed(0)
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(35)]
    folder = tmp_path / "hf"
    transformers.DebertaV2Model(transformers.DebertaV2Config(
        vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=24, relative_attention=True, pos_att_type="p2c|c2p",
        max_relative_positions=16)).save_pretrained(folder)
    (folder / "vocab.txt").write_text("\n".join(words) + "\n")
    wordpiece_tokenizer(str(folder / "vocab.txt"), True).save(str(folder / "tokenizer.json"))
    assert main(["--from", str(folder), "--to", str(tmp_path / "ckpt")]) == 0
    vocabulary = load_tokenizer(folder / "vocab.txt").vocabulary_identity()
    assert load_tokenizer(folder / "tokenizer.json").vocabulary_identity() == vocabulary
    assert identity.read(tmp_path / "ckpt") == {"data.tokenizer": [vocabulary]}

    swapped = words[:10] + [words[11], words[10]] + words[12:]
    (tmp_path / "other.txt").write_text("\n".join(swapped) + "\n")
    for vocab, refused in ((folder / "vocab.txt", False), (tmp_path / "other.txt", True)):
        config = ml_collections.ConfigDict({"init_from": str(tmp_path / "ckpt"),
                                            "data": {"tokenizer": str(vocab)}})
        run_identity = {"data.tokenizer": load_tokenizer(vocab).vocabulary_identity()}
        if not refused:
            workdir_lib.check_init_from_data(config, run_identity)
            continue
        # 40 ids: one block of 1024, so two swapped ids change all of it.
        with pytest.raises(ValueError, match=re.escape(
                f"data.tokenizer='{vocab}' is another vocabulary than the weights init_from="
                f"'{tmp_path / 'ckpt'}' came with (the tokenizer files of the folder they were "
                "converted from; 100% of the ids stand for other tokens)")):
            workdir_lib.check_init_from_data(config, run_identity)


def test_hf_to_a_bucket_all_or_nothing(hf_mlm, emulator, monkeypatch, capsys):
    """--to gs://: the folder is uploaded with model_config.json last; restored from the bucket
    it equals the local conversion; an existing destination is refused; an upload that fails
    part-way leaves no object; a params/ without model_config.json is refused by init_from."""
    import uuid

    import gcsfs

    from posjax import storage
    from posjax.training import init_from

    dest = f"{emulator}/converted-{uuid.uuid4().hex[:8]}"
    assert main(["--from", str(hf_mlm), "--to", dest]) == 0
    files = storage.files(dest)
    assert "model_config.json" in files and any(f.startswith("params/") for f in files)
    restored = ocp.StandardCheckpointer().restore(storage.as_path(dest) / "params")
    jax.tree.map(np.testing.assert_array_equal, restored, {"params": load_pretrained(
        hf_mlm).params})
    assert init_from.pretrained_location(dest)[1].name == "model_config.json"
    assert main(["--from", str(hf_mlm), "--to", dest]) == 2
    assert "already holds objects" in capsys.readouterr().err

    fs = gcsfs.GCSFileSystem()   # fsspec hands every caller this one cached instance
    put, calls = fs.put_file, []

    def failing_put(lpath, rpath, *args, **kwargs):
        calls.append(rpath)
        if len(calls) == 3:
            raise OSError("connection reset (injected)")
        return put(lpath, rpath, *args, **kwargs)

    monkeypatch.setattr(fs, "put_file", failing_put)
    cut = f"{emulator}/cut-{uuid.uuid4().hex[:8]}"
    assert main(["--from", str(hf_mlm), "--to", cut]) == 1
    assert "injected) (nothing was written to" in capsys.readouterr().err
    assert len(calls) == 3 and storage.files(cut) == []
    monkeypatch.undo()
    storage.write_atomically(f"{cut}/params/_METADATA", b"{}")   # a params/ alone
    with pytest.raises(ValueError, match="an upload cut short"):
        init_from.pretrained_location(cut)
