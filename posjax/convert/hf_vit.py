"""Hugging Face ViT (``ViTModel``, ``ViTForImageClassification``) <-> posjax ViT.

HF names: ``[vit.]embeddings.{cls_token, position_embeddings, patch_embeddings.projection}``,
``[vit.]encoder.layer.N.{layernorm_before, attention.attention.{query,key,value},
attention.output.dense, layernorm_after, intermediate.dense, output.dense}``, ``[vit.]layernorm``,
``pooler.dense`` (ViTModel: act(dense(LN(h)[:, 0])) = our ``pre_logits`` with tanh) and
``classifier`` (ViTForImageClassification: dense on LN(h)[:, 0] = our ``head``). HF ViT always
has a [CLS] token, exact GELU and LayerNorm eps 1e-12 by default; all are read from config.json.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from posjax.convert import mapping as m
from posjax.convert.hf_common import HFConfig, activation_to_hf, config_path, labels_config
from posjax.convert.pretrained import Pretrained, expected_params
from posjax.models.config import ViTConfig
from posjax.models.schemes import HF_SCHEMES, SCHEMES

# {Hugging Face model_type: scheme} this module converts: the scheme table's image-only rows.
MODEL_TYPES = {t: n for t, n in HF_SCHEMES.items() if not SCHEMES[n].text}

# transformers ViTConfig defaults.
HF_DEFAULTS = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                   intermediate_size=3072, hidden_act="gelu", hidden_dropout_prob=0.0,
                   attention_probs_dropout_prob=0.0, layer_norm_eps=1e-12, image_size=224,
                   patch_size=16, num_channels=3, qkv_bias=True, pooler_output_size=None,
                   pooler_act="tanh")
# config.json keys without which the model is not defined (``hf_common.check_required_keys``).
REQUIRED_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                 "image_size", "patch_size")


def vit_links(cfg: ViTConfig, prefix: str) -> list[m.Link]:
    p, h = prefix, cfg.num_heads
    links = [m.copy(p + "embeddings.cls_token", ("cls",)),
             m.copy(p + "embeddings.position_embeddings", ("pos_embedding",)),
             # torch Conv2d (out, in, kh, kw) <-> Flax (kh, kw, in, out)
             m.transposed(p + "embeddings.patch_embeddings.projection.weight",
                          ("embedding", "kernel"), (2, 3, 1, 0)),
             m.copy(p + "embeddings.patch_embeddings.projection.bias", ("embedding", "bias"))]
    for i in range(cfg.num_layers):
        hl, ol = f"{p}encoder.layer.{i}.", ("encoder", f"layer_{i}")
        for name in ("query", "key", "value"):
            links += m.linear(hl + "attention.attention." + name, ol + ("attention", name),
                              heads=h, bias=cfg.qkv_bias)
        links += m.linear_from_heads(hl + "attention.output.dense", ol + ("attention", "out"), h)
        links += m.layer_norm(hl + "layernorm_before", ol + ("attention_norm",))
        links += m.layer_norm(hl + "layernorm_after", ol + ("mlp_norm",))
        links += m.linear(hl + "intermediate.dense", ol + ("mlp", "fc1"))
        links += m.linear(hl + "output.dense", ol + ("mlp", "fc2"))
    links += m.layer_norm(p + "layernorm", ("encoder_norm",))
    if cfg.representation_size:
        links += m.linear("pooler.dense", ("pre_logits",))
    if cfg.num_classes:
        links += m.linear("classifier", ("head",))
    return links


def import_vit(config_json: Mapping[str, Any], tensors: Mapping[str, np.ndarray], source: str,
               task: str | None = None) -> Pretrained:
    """HF ViT checkpoint -> Pretrained (task 'classification' with a classifier, else 'encoder';
    task='encoder' drops the classifier)."""
    hf = HFConfig(config_json, HF_DEFAULTS, config_path(source))
    names = set(tensors)
    prefix = "vit." if any(n.startswith("vit.") for n in names) else ""
    has_head = "classifier.weight" in names
    task = task or ("classification" if has_head else "encoder")
    if task not in ("classification", "encoder"):
        raise ValueError(f"task={task!r} is not valid for a ViT checkpoint: use 'classification' "
                         "or 'encoder'")
    if task == "classification" and not has_head:
        raise ValueError(f"{source}: task='classification' needs the tensors classifier.*, which "
                         "the checkpoint lacks (a ViTModel): use task='encoder'")
    ignored = set() if task == "classification" else {"classifier.weight", "classifier.bias"}
    pooler = names >= {"pooler.dense.weight", "pooler.dense.bias"}
    if pooler and hf["pooler_act"] != "tanh":
        raise hf.fail("pooler_act", "posjax's pre_logits uses tanh")
    cfg = hf.build(
        ViTConfig, position_scheme="vit", image_size=_pair(hf, "image_size"),
        patch_size=_pair(hf, "patch_size"), num_channels=hf["num_channels"],
        hidden_size=hf["hidden_size"], num_heads=hf["num_attention_heads"],
        num_layers=hf["num_hidden_layers"], mlp_dim=hf["intermediate_size"],
        num_classes=tensors["classifier.weight"].shape[0] if task == "classification" else 0,
        pooling="token",
        representation_size=tensors["pooler.dense.weight"].shape[0] if pooler else 0,
        hidden_act=hf.activation("hidden_act"), layer_norm_eps=float(hf["layer_norm_eps"]),
        dropout_rate=float(hf["hidden_dropout_prob"]),
        attention_dropout_rate=float(hf["attention_probs_dropout_prob"]),
        qkv_bias=bool(hf["qkv_bias"]))
    if hf["head_dim"] is not None and hf["head_dim"] != cfg.head_dim:
        raise hf.fail("head_dim", f"posjax needs hidden_size / num_attention_heads = "
                      f"{cfg.head_dim}")
    expected = expected_params("vit", task, cfg)
    params = m.import_tensors(vit_links(cfg, prefix), tensors, expected, source, ignored,
                              task)
    return Pretrained(cfg, params, "vit", task)


def _pair(hf: HFConfig, key: str) -> tuple[int, int]:
    """(height, width) of an int or a pair of ints in config.json."""
    v = hf[key]
    pair = [v, v] if not isinstance(v, (list, tuple)) else list(v)
    pair = [int(x) if isinstance(x, float) and x.is_integer() else x for x in pair]
    if len(pair) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0
                                 for x in pair):
        raise hf.fail(key, "give a positive int or a pair [height, width] of them")
    return pair[0], pair[1]


def export_vit(pre: Pretrained) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Pretrained ViT -> (HF config.json dict, HF-named tensors)."""
    cfg = pre.config
    required = {"position_scheme": ("vit", "HF ViT has only the learned position table"),
                "pooling": ("token", "HF ViT pools the [CLS] token only"),
                "resnet_layers": ((), "HF ViT has no hybrid ResNet stem")}
    for field, (allowed, why) in required.items():
        if getattr(cfg, field) != allowed:
            raise ValueError(f"cannot export to Hugging Face ViT: {field}="
                             f"{getattr(cfg, field)!r}; {why} (needs {allowed!r})")
    if cfg.representation_size and cfg.num_classes:
        raise ValueError(f"cannot export to Hugging Face ViT: representation_size="
                         f"{cfg.representation_size} with a head; ViTForImageClassification has "
                         "no pre-logits layer (needs 0)")
    arch = "ViTForImageClassification" if cfg.num_classes else "ViTModel"
    square = lambda s: s[0] if s[0] == s[1] else list(s)   # noqa: E731
    out = {"model_type": "vit", "architectures": [arch], "hidden_size": cfg.hidden_size,
           "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
           "intermediate_size": cfg.mlp_dim,
           "hidden_act": activation_to_hf(cfg.hidden_act, "hidden_act"),
           "hidden_dropout_prob": cfg.dropout_rate,
           "attention_probs_dropout_prob": cfg.attention_dropout_rate,
           "layer_norm_eps": cfg.layer_norm_eps, "image_size": square(cfg.image_size),
           "patch_size": square(cfg.patch_size), "num_channels": cfg.num_channels,
           "qkv_bias": cfg.qkv_bias, "pooler_output_size": cfg.representation_size or None,
           "pooler_act": "tanh", "dtype": "float32"}
    if cfg.num_classes:
        out.update(labels_config(cfg.num_classes))
    prefix = "vit." if cfg.num_classes else ""
    return out, m.export_tensors(vit_links(cfg, prefix), pre.params, "export of ViT")
