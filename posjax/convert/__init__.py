"""Published weights in and out of posjax.

    from posjax.convert import load_pretrained, export_hf, save_checkpoint

    pre = load_pretrained("deberta-v3-base/")        # HF folder, ViT .npz or posjax folder
    logits = pre.module().apply({"params": pre.params}, input_ids, attention_mask)
    save_checkpoint(pre, "ckpt/deberta-v3-base")     # orbax params + model_config.json
    export_hf(pre, "hf_out/")                        # config.json + model.safetensors

Sources:
- Hugging Face folders (config.json + model.safetensors / pytorch_model.bin, sharded or not):
  DeBERTa v1 (``deberta``), DeBERTa-v2/v3 (``deberta-v2``), ViT (``vit``); any *Model,
  *ForMaskedLM (official ``lm_predictions`` or legacy ``cls.predictions`` head; EMD enabled when
  the file carries the absolute position table) or *ForSequenceClassification /
  ViTForImageClassification.
- Official vit_jax ``.npz`` files (ViT-B/16 … H/14, R50+ViT-B/16; with or without pre_logits;
  the ``opt/target/`` variant) and big_vision ViT ``.npz`` files ([CLS], GAP or MAP pooling,
  or the first patch's row with ``pooling='first'``; learned positions; ``params/`` training
  checkpoints; one tower of a two-tower checkpoint as ``file.npz:img``).
- Folders written by ``save_checkpoint`` (model_config.json + params/), and train.py workdirs
  (the latest checkpoint's params), e.g. to export a fine-tuned model for transformers.

The CLI ``python -m posjax.convert --from SRC --to DEST`` wraps these calls.
"""
from __future__ import annotations

import json
import pathlib
import re

from posjax.convert import hf_deberta, hf_vit, vit_npz
from posjax.convert.checkpoint import (MODEL_CONFIG, is_train_workdir, load_checkpoint,
                                      load_train_workdir, save_checkpoint)
from posjax.convert.destination import write_directory
from posjax.convert.hf_common import check_required_keys, read_config_json
from posjax.convert.mapping import check_tree
from posjax.convert.pretrained import (Pretrained, build_module, expected_params,
                                       resize_vit)
from posjax.convert.tensors import read_folder_weights, read_npz, write_safetensors
from posjax.data import identity
from posjax.io_utils import local_path

__all__ = ["Pretrained", "build_module", "expected_params", "export_hf", "load_checkpoint",
           "load_pretrained", "resize_vit", "save_checkpoint", "source_data_identity"]

HF_MODEL_TYPES = tuple(hf_deberta.MODEL_TYPES) + tuple(hf_vit.MODEL_TYPES)
TASKS = (None, "mlm", "classification", "encoder")


def _npz_submodel(path: str | pathlib.Path) -> tuple[str | pathlib.Path, str | None]:
    """``file.npz:img`` (big_vision's way to name one model of a checkpoint) -> (file.npz,
    'img'); any other path unchanged, with None."""
    match = re.fullmatch(r"(.+\.npz):([\w/]+)", str(path))
    return (match[1], match[2]) if match else (path, None)


def load_pretrained(path: str | pathlib.Path, *, task: str | None = None,
                    image_size: int | tuple[int, int] | None = None,
                    resample: str | None = None, pooling: str | None = None) -> Pretrained:
    """Checkpoint folder or file -> Pretrained(config, params, kind, task).

    task: None keeps the checkpoint's head (a head posjax has no module for, e.g. HF's token
    classifier or QA head, is refused); 'encoder' drops it; 'mlm'/'classification' demand
    it. image_size (ViT): resample the position table to this resolution with ``resample``
    ('bilinear', the vit_jax choice and default for .npz/posjax; 'bicubic', the HF/timm choice
    and default for HF folders). pooling (.npz only): 'first' reads a big_vision model trained
    with ``pool_type='0'``, which the arrays cannot tell from 'gap'. Any problem raises one
    ValueError naming the file and tensor.
    """
    if task not in TASKS:
        raise ValueError(f"task={task!r} is not valid: choose one of {TASKS}")
    if resample is not None and image_size is None:
        raise ValueError(f"resample={resample!r} needs image_size (the target resolution)")
    path, submodel = _npz_submodel(path)
    path = local_path(path, "path")
    is_npz = path.is_file() and path.suffix == ".npz"
    if pooling is not None and not is_npz:
        raise ValueError(f"pooling={pooling!r} applies to ViT .npz files only, whose arrays "
                         f"cannot tell 'first' from 'gap'; {path} is not one: leave it unset")
    if is_npz:
        pre = vit_npz.import_npz(read_npz(path), str(path), task, submodel, pooling)
        default_method = "bilinear"
    elif path.is_dir() and ((path / MODEL_CONFIG).is_file() or is_train_workdir(path)):
        pre = load_checkpoint(path) if (path / MODEL_CONFIG).is_file() else \
            load_train_workdir(path)
        default_method = "bilinear"
        if task == "encoder":
            pre = pre.without_head()
        elif task not in (None, pre.task):
            raise ValueError(f"{path}: holds a {pre.task!r} model; task={task!r} cannot be "
                             "derived from it (only 'encoder', which drops the head)")
    elif path.is_dir():
        pre, default_method = _load_hf(path, task), "bicubic"
    else:
        raise ValueError(f"{path}: not found or not a checkpoint: pass a Hugging Face folder, "
                         "a posjax checkpoint folder or a vit_jax / big_vision .npz file")
    if image_size is not None:
        pre = resize_vit(pre, image_size, resample or default_method)
    return pre


def source_data_identity(path: str | pathlib.Path) -> dict[str, list[identity.Entry]]:
    """What the weights at ``path`` were trained on, for the converter's output folder
    (``posjax.data.identity``): a posjax checkpoint folder's or train.py workdir's recorded
    identity, the vocabularies of a Hugging Face folder's tokenizer files; {} for .npz files
    and folders without either."""
    folder = local_path(_npz_submodel(path)[0], "path")
    if not folder.is_dir():
        return {}
    if (folder / MODEL_CONFIG).is_file() or is_train_workdir(folder):
        return identity.read(folder)
    return identity.folder_vocabularies(folder)


# A tensor name (its end) that only one model_type's checkpoints hold.
_MODEL_TYPE_TENSORS = (("deberta", ".attention.self.in_proj.weight"),
                       ("deberta-v2", ".attention.self.query_proj.weight"),
                       ("vit", "embeddings.patch_embeddings.projection.weight"))


def weights_model_type(names: set[str]) -> tuple[str, str] | None:
    """(model_type, a tensor name that shows it) of a Hugging Face checkpoint's tensor
    ``names``; None when no name tells."""
    for model_type, end in _MODEL_TYPE_TENSORS:
        for name in sorted(names):
            if name.endswith(end):
                return model_type, name
    return None


def _load_hf(folder: pathlib.Path, task: str | None) -> Pretrained:
    """A Hugging Face folder: its config.json (its model_type, then, once the weights are
    read, whether they are of that type and the keys that define the model), then the weights
    against it."""
    config = read_config_json(folder)
    path = folder / "config.json"
    model_type = config.get("model_type")
    if model_type is None:
        raise ValueError(f"{path}: has no model_type: a Hugging Face config.json names the "
                         f"model's type (posjax imports {', '.join(HF_MODEL_TYPES)}); the file "
                         "is incomplete: download it again")
    if model_type not in HF_MODEL_TYPES:
        raise ValueError(f"{path}: model_type={model_type!r} is not supported: "
                         f"posjax imports {', '.join(HF_MODEL_TYPES)}")
    tensors, source = read_folder_weights(folder)
    found = weights_model_type(set(tensors))
    if found is not None and found[0] != model_type:
        raise ValueError(f"{path}: model_type={model_type!r} contradicts the weights: {source} "
                         f"holds a {found[0]!r} model (tensor {found[1]!r}). The config.json "
                         "belongs to another model: download the folder's config.json again")
    vit = model_type in hf_vit.MODEL_TYPES
    check_required_keys(config, (hf_vit if vit else hf_deberta).REQUIRED_KEYS, path)
    if vit:
        return hf_vit.import_vit(config, tensors, str(source), task)
    return hf_deberta.import_deberta(config, tensors, str(source), task)


def export_hf(pre: Pretrained, out_dir: str | pathlib.Path) -> pathlib.Path:
    """Write a Hugging Face folder (config.json + model.safetensors) that transformers loads
    with the matching Auto/architecture class and that reproduces ``pre``'s outputs (HF has no
    EMD: its MLM logits are those of ``use_emd=False``). All-or-nothing; never overwrites."""
    pre = pre.with_scan_layers(False)   # the name mappings speak the unrolled layout
    check_tree(pre.params, expected_params(pre.kind, pre.task, pre.config, pre.num_labels),
               "export_hf")
    if pre.kind == "vit":
        config, tensors = hf_vit.export_vit(pre)
    elif pre.config.position_scheme in hf_deberta.MODEL_TYPES.values():
        config, tensors = hf_deberta.export_deberta(pre)
    else:
        raise ValueError(f"position_scheme={pre.config.position_scheme!r} has no Hugging Face "
                         "model: export supports deberta, deberta_v2 and vit")

    def fill(staging: pathlib.Path) -> None:
        write_safetensors(tensors, staging / "model.safetensors")
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    return write_directory(out_dir, fill)
