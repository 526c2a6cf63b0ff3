"""Config files stand alone (no trainer imported), their one variant grammar (``key=value``,
older spellings still accepted), the data root, and the import boundaries of the package."""
from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

from posjax import config_defaults

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"


def load(name: str, variant: str | None = None):
    spec = importlib.util.spec_from_file_location(f"cfg_{name[:-3]}", CONFIGS / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config() if variant is None else module.get_config(variant)


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    import os
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, **env})


LOAD_EVERY_CONFIG = """
import importlib.util, json, pathlib, sys
loaded = []
for path in sorted(pathlib.Path("configs").glob("*.py")):
    spec = importlib.util.spec_from_file_location("cfg_" + path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if path.stem not in ("__init__", "saved", "text_recipes"):
        module.get_config()
    loaded.append(path.name)
heavy = sorted(m for m in sys.modules
               if m.split(".")[0] in ("orbax", "grain") or m.startswith("posjax.training"))
print(json.dumps({"loaded": loaded, "heavy": heavy}))
"""


def test_config_files_import_nothing_from_the_trainer():
    done = _python(LOAD_EVERY_CONFIG)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert "vit_digits.py" in out["loaded"] and "mlm_tupe_r.py" in out["loaded"]
    assert out["heavy"] == []


def test_convert_imports_nothing_from_training():
    code = ("import pkgutil, importlib, sys, posjax.convert\n"
            "for m in pkgutil.iter_modules(posjax.convert.__path__):\n"
            "    importlib.import_module('posjax.convert.' + m.name)\n"
            "print(sorted(m for m in sys.modules if m.startswith('posjax.training')))")
    done = _python(code)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_training_modules_stay_small():
    training = ROOT / "posjax" / "training"
    sizes = {str(p.relative_to(training)): len(p.read_text().splitlines())
             for p in training.rglob("*.py")}   # its sub-packages' modules too
    assert {name: n for name, n in sizes.items() if n > 310} == {}


@pytest.mark.parametrize("name,old,new", [
    ("vit_digits.py", "tiny", "size=tiny"),
    ("vit_imagenet.py", "b16,finetune", "model=b16,mode=finetune"),
    ("vit_imagenet.py", "h14", "model=h14"),
    ("glue_tiny.py", "sst2,deberta", "task=sst2,scheme=deberta"),
    ("glue_base.py", "mrpc", "task=mrpc"),
    ("mlm_tupe_r.py", "tiny", "size=tiny"),
    ("mlm_deberta.py", "seq512", "seq=512"),
])
def test_both_variant_grammars_give_the_same_config(name, old, new):
    assert load(name, old).to_dict() == load(name, new).to_dict()


def test_saved_config_takes_its_workdir_either_way(tmp_path):
    config = load("vit_digits.py", "tiny")
    (tmp_path / config_defaults.CONFIG_FILE).write_text(config.to_json())
    saved = json.loads(config.to_json())
    assert json.loads(load("saved.py", str(tmp_path)).to_json()) == saved
    assert json.loads(load("saved.py", f"workdir={tmp_path}").to_json()) == saved


@pytest.mark.parametrize("name,variant", [("glue_tiny.py", "task=sst2,sceme=deberta"),
                                          ("vit_digits.py", "size=tiny,steps=3"),
                                          ("mlm_bert_a.py", "sise=tiny"),
                                          ("vit_mnist.py", "root=/data")])
def test_an_unknown_variant_key_is_one_clear_error(name, variant):
    key = variant.split(",")[-1].split("=")[0]
    with pytest.raises(ValueError, match=rf"^configs/{name}: unknown variant key '{key}' in "
                                         rf"'{variant}'; its keys are "):
        load(name, variant)


def test_variant_values_grammar():
    keys = {"task": "sst2", "scheme": "tupe_r", "data_root": ""}
    assert config_defaults.variant_values("", keys, "f") == keys
    assert config_defaults.variant_values("mrpc, deberta", keys, "f") == {
        **keys, "task": "mrpc", "scheme": "deberta"}
    assert config_defaults.variant_values("scheme=bert_a,data_root=/d", keys, "f") == {
        **keys, "scheme": "bert_a", "data_root": "/d"}
    with pytest.raises(ValueError, match="variant 'a,b,c' is unknown"):   # data_root: by key
        config_defaults.variant_values("a,b,c", keys, "f")
    assert config_defaults.variant_values("/runs/a=1,b", {"workdir": ""}, "f",
                                          whole=True) == {"workdir": "/runs/a=1,b"}


def test_data_root_follows_POSJAX_DATA(monkeypatch, tmp_path):
    monkeypatch.setenv(config_defaults.DATA_ENV, str(tmp_path))
    assert config_defaults.data_root() == str(tmp_path)
    config = load("mlm_tupe_r.py", "size=tiny")
    assert config.data_root == str(tmp_path)
    assert config.data.tokenizer == str(tmp_path / "bert-base-uncased-vocab" / "vocab.txt")
    assert load("glue_tiny.py", "task=rte").data.glue_dir == str(tmp_path / "glue")
    assert load("vit_mnist.py").data.path == str(tmp_path / "mnist")
    monkeypatch.delenv(config_defaults.DATA_ENV)
    assert config_defaults.data_root() == str(ROOT.parent / "shared" / "data")


def test_data_root_moves_every_path_derived_from_it():
    config = load("glue_tiny.py", "task=sst2,data_root=/elsewhere")
    assert config.data.glue_dir == "/elsewhere/glue"
    config.data_root = "/moved"     # as --config.data_root=/moved does
    assert config.data.tokenizer == "/moved/bert-base-uncased-vocab/vocab.txt"
    config.data.glue_dir = "/own"   # a path set itself no longer follows
    config.data_root = "/again"
    assert config.data.glue_dir == "/own" and config.data.tokenizer.startswith("/again/")


def test_recipe_glue_tables_agree_with_the_data_layer():
    from configs import text_recipes
    from posjax.data.glue import TASKS
    assert set(text_recipes.GLUE_TASKS) == set(TASKS)
    assert set(text_recipes.GLUE_SINGLE_SENTENCE) == {
        name for name, task in TASKS.items() if len(task.tsv_text) == 1}
