"""Hugging Face DeBERTa (v1 ``deberta``) and DeBERTa-v2/v3 (``deberta-v2``) <-> posjax text models.

Checkpoint layouts handled (names as in the files users download):

- ``[deberta.]embeddings.{word_embeddings, position_embeddings, token_type_embeddings,
  embed_proj, LayerNorm}``, ``[deberta.]encoder.{rel_embeddings, LayerNorm (v2 norm_rel_ebd),
  conv.{conv, LayerNorm} (v2 ConvLayer), layer.N.*}``.
- v1 attention: fused ``in_proj`` (3H × H, interleaved PER HEAD: reshape (h, 3, d, H)),
  ``q_bias``, ``v_bias`` (no key bias), ``pos_proj`` (c2p, no bias), ``pos_q_proj`` (p2c).
- v2 attention: ``{query,key,value}_proj``, ``pos_key_proj``/``pos_query_proj`` unless
  ``share_att_key``.
- MLM head: official ``lm_predictions.lm_head.{dense, LayerNorm, bias}`` or the HF legacy
  ``cls.predictions.{transform.dense, transform.LayerNorm, bias}`` (decoder tied to the word
  embeddings). With ``position_biased_input=False`` the official checkpoints still carry
  ``embeddings.position_embeddings``: we keep it and enable EMD (docs/design.md §3.3).
- Classification: ``pooler.dense`` (ContextPooler, act = pooler_hidden_act) + ``classifier``.
- ``mask_predictions.*`` (the v3 replaced-token-detection head) has no posjax module: dropped
  with a warning.

Outputs match transformers at every sequence length (v2 log buckets as transformers computes
them: i − j is not clamped first; tests/test_lengths_hf.py), except where posjax follows the
official code on purpose: EMD for MLM (above).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Mapping

import numpy as np

from posjax.convert import mapping as m
from posjax.convert.hf_common import HFConfig, activation_to_hf, config_path, labels_config
from posjax.convert.pretrained import Pretrained, expected_params
from posjax.models.config import TextConfig
from posjax.models.schemes import HF_SCHEMES, SCHEMES, input_table, scheme_of

# {Hugging Face model_type: scheme} this module converts: the scheme table's DeBERTas.
MODEL_TYPES = {t: n for t, n in HF_SCHEMES.items() if SCHEMES[n].disentangled}

_COMMON_DEFAULTS = dict(
    hidden_act="gelu", hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
    max_position_embeddings=512, type_vocab_size=0, layer_norm_eps=1e-7,
    relative_attention=False, max_relative_positions=-1, pad_token_id=0,
    position_biased_input=True, pos_att_type=None, pooler_hidden_act="gelu", talking_head=False)
# transformers DebertaConfig / DebertaV2Config defaults, plus the getattr defaults of the modeling
# code for keys the config classes do not declare.
HF_DEFAULTS = {
    "deberta": dict(_COMMON_DEFAULTS, vocab_size=50265, hidden_size=768, num_hidden_layers=12,
                    num_attention_heads=12, intermediate_size=3072),
    "deberta-v2": dict(_COMMON_DEFAULTS, vocab_size=128100, hidden_size=1536,
                       num_hidden_layers=24, num_attention_heads=24, intermediate_size=6144,
                       position_buckets=-1, share_att_key=False, norm_rel_ebd="none",
                       conv_kernel_size=0, conv_groups=1, conv_act="tanh"),
}
# config.json keys without which the model is not defined (``hf_common.check_required_keys``).
REQUIRED_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                 "intermediate_size")
MLM_OFFICIAL = "lm_predictions.lm_head."
MLM_LEGACY = "cls.predictions."
RTD_HEAD = "mask_predictions."

log = logging.getLogger(__name__)


def _pos_att_type(hf: HFConfig) -> tuple[str, ...]:
    value = hf["pos_att_type"]
    if value is None:
        items: list[str] = []
    elif isinstance(value, str):
        items = [t.strip().lower() for t in value.split("|") if t.strip()]
    elif isinstance(value, (list, tuple)):
        items = [str(t).strip().lower() for t in value]
    else:
        raise hf.fail("pos_att_type", "give a list such as [\"p2c\", \"c2p\"] or a string "
                      "such as \"p2c|c2p\"")
    if not items or not set(items) <= {"c2p", "p2c"}:
        raise hf.fail("pos_att_type", "posjax supports a non-empty subset of c2p|p2c")
    return tuple(t for t in ("c2p", "p2c") if t in items)


def text_config_from_hf(hf: HFConfig, *, use_emd: bool, position_rows: int) -> TextConfig:
    """TextConfig carrying every config.json field that changes DeBERTa's numerics.

    ``position_rows``: rows of the absolute table kept from the checkpoint (0: none).
    """
    scheme = MODEL_TYPES[hf["model_type"]]
    v2 = SCHEMES[scheme].deberta_version == 2
    h, heads = hf["hidden_size"], hf["num_attention_heads"]
    if not hf["relative_attention"]:
        raise hf.fail("relative_attention", "posjax implements DeBERTa with relative attention "
                      "(all released checkpoints set relative_attention=true)")
    if hf["talking_head"]:
        raise hf.fail("talking_head", "talking-head attention is not implemented")
    max_rel = hf["max_relative_positions"]
    if max_rel < 1:   # HF: fall back to max_position_embeddings
        max_rel = hf["max_position_embeddings"]
    embedding_size = hf["embedding_size"] or h
    norm_rel = [t.strip() for t in str(hf["norm_rel_ebd"] or "none").lower().split("|")]
    cfg = hf.build(
        TextConfig, position_scheme=scheme,
        vocab_size=hf["vocab_size"], hidden_size=h, num_heads=heads,
        num_layers=hf["num_hidden_layers"], mlp_dim=hf["intermediate_size"],
        max_position_embeddings=position_rows, type_vocab_size=hf["type_vocab_size"],
        embedding_size=0 if embedding_size == h else embedding_size,
        hidden_act=hf.activation("hidden_act"), layer_norm_eps=float(hf["layer_norm_eps"]),
        dropout_rate=float(hf["hidden_dropout_prob"]),
        attention_dropout_rate=float(hf["attention_probs_dropout_prob"]),
        pad_token_id=hf["pad_token_id"], pos_att_type=_pos_att_type(hf),
        max_relative_positions=max_rel,
        position_buckets=max(hf["position_buckets"], 0) if v2 else 0,
        share_att_key=bool(hf["share_att_key"]) if v2 else False,
        norm_rel_ebd=v2 and "layer_norm" in norm_rel,
        position_biased_input=bool(hf["position_biased_input"]),
        conv_kernel_size=hf["conv_kernel_size"] if v2 else 0,
        conv_groups=hf["conv_groups"] if v2 else 1,
        conv_act=hf.activation("conv_act") if v2 and hf["conv_kernel_size"] else "tanh",
        use_emd=use_emd, pooler_act=hf.activation("pooler_hidden_act"))
    for key, expect in (("attention_head_size", cfg.head_dim), ("pooler_hidden_size", h)):
        if hf[key] is not None and hf[key] != expect:
            raise hf.fail(key, f"posjax needs {expect} (hidden_size / heads, hidden_size)")
    return cfg


def _in_proj(source: str, att: m.Path, heads: int) -> m.Link:
    """v1 fused (3·h·d, H) weight, interleaved per head -> query/key/value kernels (H, h, d)."""
    def split(w):
        w = w.reshape(heads, 3, -1, w.shape[-1])            # (h, 3, d, H)
        return tuple(w[:, t].transpose(2, 0, 1) for t in range(3))

    def fuse(q, k, v):
        s = np.stack([q, k, v])                              # (3, H, h, d)
        return (s.transpose(2, 0, 3, 1).reshape(-1, s.shape[1]),)

    return m.Link((source,), tuple(att + (n, "kernel") for n in ("query", "key", "value")),
                  split, fuse)


def _attention_links(cfg: TextConfig, hl: str, att: m.Path) -> list[m.Link]:
    h = cfg.num_heads
    links: list[m.Link] = []
    if scheme_of(cfg).deberta_version == 1:   # fused in_proj, no key bias
        links.append(_in_proj(hl + "in_proj.weight", att, h))
        links.append(m.head_bias(hl + "q_bias", att + ("query", "bias"), h))
        links.append(m.head_bias(hl + "v_bias", att + ("value", "bias"), h))
        if "c2p" in cfg.pos_att_type:
            links += m.linear(hl + "pos_proj", att + ("pos_key",), heads=h, bias=False)
        if "p2c" in cfg.pos_att_type:
            links += m.linear(hl + "pos_q_proj", att + ("pos_query",), heads=h)
        return links
    for ours, theirs in (("query", "query_proj"), ("key", "key_proj"), ("value", "value_proj")):
        links += m.linear(hl + theirs, att + (ours,), heads=h)
    if not cfg.share_att_key:
        if "c2p" in cfg.pos_att_type:
            links += m.linear(hl + "pos_key_proj", att + ("pos_key",), heads=h)
        if "p2c" in cfg.pos_att_type:
            links += m.linear(hl + "pos_query_proj", att + ("pos_query",), heads=h)
    return links


def encoder_links(cfg: TextConfig, prefix: str, base: m.Path) -> list[m.Link]:
    """Links of the embeddings + encoder (HF names under ``prefix``, ours under ``base``)."""
    p, emb, enc = prefix, base + ("embeddings",), base + ("encoder",)
    links = [m.embedding(p + "embeddings.word_embeddings", emb + ("word_embeddings",))]
    if cfg.max_position_embeddings:
        links.append(m.embedding(p + "embeddings.position_embeddings",
                                 emb + ("position_embeddings",)))
    if cfg.type_vocab_size:
        links.append(m.embedding(p + "embeddings.token_type_embeddings",
                                 emb + ("token_type_embeddings",)))
    if cfg.input_embedding_size != cfg.hidden_size:
        links += m.linear(p + "embeddings.embed_proj", emb + ("embed_proj",), bias=False)
    links += m.layer_norm(p + "embeddings.LayerNorm", emb + ("norm",))
    links.append(m.copy(p + "encoder.rel_embeddings.weight", enc + ("rel_embeddings",)))
    if cfg.norm_rel_ebd:
        links += m.layer_norm(p + "encoder.LayerNorm", enc + ("rel_norm",))
    if cfg.conv_kernel_size:   # torch Conv1d (out, in/groups, k) <-> Flax (k, in/groups, out)
        links.append(m.transposed(p + "encoder.conv.conv.weight",
                                  enc + ("conv", "conv", "kernel"), (2, 1, 0)))
        links.append(m.copy(p + "encoder.conv.conv.bias", enc + ("conv", "conv", "bias")))
        links += m.layer_norm(p + "encoder.conv.LayerNorm", enc + ("conv", "norm"))
    for i in range(cfg.num_layers):
        hl, ol = f"{p}encoder.layer.{i}.", enc + (f"layer_{i}",)
        links += _attention_links(cfg, hl + "attention.self.", ol + ("attention",))
        links += m.linear_from_heads(hl + "attention.output.dense", ol + ("attention", "out"),
                                     cfg.num_heads)
        links += m.layer_norm(hl + "attention.output.LayerNorm", ol + ("attention_norm",))
        links += m.linear(hl + "intermediate.dense", ol + ("mlp", "fc1"))
        links += m.linear(hl + "output.dense", ol + ("mlp", "fc2"))
        links += m.layer_norm(hl + "output.LayerNorm", ol + ("mlp_norm",))
    return links


def head_links(task: str, legacy_mlm: bool) -> list[m.Link]:
    if task == "mlm":
        dense, norm, bias = ((MLM_LEGACY + "transform.dense", MLM_LEGACY + "transform.LayerNorm",
                              MLM_LEGACY + "bias") if legacy_mlm else
                             (MLM_OFFICIAL + "dense", MLM_OFFICIAL + "LayerNorm",
                              MLM_OFFICIAL + "bias"))
        return (m.linear(dense, ("mlm_head", "dense")) + m.layer_norm(norm, ("mlm_head", "norm"))
                + [m.copy(bias, ("mlm_head", "bias"))])
    if task == "classification":
        return m.linear("pooler.dense", ("pooler",)) + m.linear("classifier", ("classifier",))
    return []


# Heads of HF DeBERTa classes that posjax has no module for: (tensor prefix, what it is).
# HF's token classifier is ``classifier.*`` without a pooler (its sequence classifier has one).
OTHER_HEADS = (("qa_outputs.", "question-answering"), ("classifier.", "token-classification"))


def _detect_task(names: set[str], source: str) -> str:
    mlm = any(n.startswith((MLM_OFFICIAL, MLM_LEGACY)) for n in names)
    cls = "classifier.weight" in names and "pooler.dense.weight" in names
    if mlm and cls:
        raise ValueError(f"{source}: holds both an MLM head and a classification head: "
                         "pass task='mlm' or task='classification'")
    if not (mlm or cls):
        for prefix, head in OTHER_HEADS:
            if any(n.startswith(prefix) for n in names):
                raise ValueError(
                    f"{source}: holds a {head} head ({prefix}*), which posjax has no module "
                    "for: pass task='encoder' (--task encoder) to import the encoder without it")
    return "mlm" if mlm else "classification" if cls else "encoder"


def import_deberta(config_json: Mapping[str, Any], tensors: Mapping[str, np.ndarray],
                   source: str, task: str | None = None) -> Pretrained:
    """HF DeBERTa v1/v2/v3 checkpoint (config.json dict + tensors) -> Pretrained.

    ``task``: None infers it from the heads present; 'encoder' drops any head.
    """
    hf = HFConfig(config_json, HF_DEFAULTS[config_json["model_type"]], config_path(source))
    names = set(tensors)
    prefix = "deberta." if any(n.startswith("deberta.") for n in names) else ""
    task = task or _detect_task(names, source)
    legacy_mlm = any(n.startswith(MLM_LEGACY) for n in names) and not any(
        n.startswith(MLM_OFFICIAL) for n in names)
    ignored = {n for n in names if n.startswith(RTD_HEAD)}
    if ignored:
        log.warning("%s: dropping the replaced-token-detection head (%d tensors under %r): "
                    "posjax has no module for it", source, len(ignored), RTD_HEAD)
    ignored.add(prefix + "embeddings.position_ids")   # a buffer in older checkpoints
    if task != "mlm":
        ignored |= {n for n in names if n.startswith((MLM_OFFICIAL, MLM_LEGACY))}
    if task != "classification":
        ignored |= {n for n in names if n.startswith(("pooler.", "classifier."))}
    # A QA head is refused above when no task is given; with one, it is dropped.
    ignored |= {n for n in names if n.startswith("qa_outputs.")}
    if legacy_mlm and task == "mlm":
        ignored |= _check_tied_decoder(tensors, prefix, source)

    table = prefix + "embeddings.position_embeddings.weight"
    use_emd = task == "mlm" and not hf["position_biased_input"] and table in names
    if hf["position_biased_input"]:
        rows = hf["max_position_embeddings"]
    elif use_emd:
        rows = tensors[table].shape[0]
    else:
        rows = 0
        ignored.add(table)   # unused without EMD (HF ignores it too)
    cfg = text_config_from_hf(hf, use_emd=use_emd, position_rows=rows)
    num_labels = tensors["classifier.weight"].shape[0] if "classifier.weight" in names else 0
    if task == "classification" and not num_labels:
        raise ValueError(f"{source}: task='classification' needs the tensors pooler.dense.* and "
                         "classifier.*, which the checkpoint lacks")
    base = () if task == "encoder" else ("encoder",)
    links = encoder_links(cfg, prefix, base) + head_links(task, legacy_mlm)
    expected = expected_params("text", task, cfg, num_labels)
    params = m.import_tensors(links, tensors, expected, source, ignored, task)
    return Pretrained(cfg, params, "text", task)


def _check_tied_decoder(tensors: Mapping[str, np.ndarray], prefix: str, source: str) -> set[str]:
    """The legacy head's decoder is tied to the word embeddings and the head bias; a file that
    stores it must hold exactly those values (posjax always ties)."""
    tied = {MLM_LEGACY + "decoder.weight": prefix + "embeddings.word_embeddings.weight",
            MLM_LEGACY + "decoder.bias": MLM_LEGACY + "bias"}
    present = set()
    for name, twin in tied.items():
        if name in tensors:
            if twin not in tensors or not np.array_equal(tensors[name], tensors[twin]):
                raise ValueError(f"{source}: tensor {name!r} differs from {twin!r}: an untied "
                                 "MLM decoder cannot be represented (posjax ties it)")
            present.add(name)
    return present


def export_deberta(pre: Pretrained) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Pretrained (DeBERTa scheme) -> (HF config.json dict, HF-named tensors)."""
    cfg, task = pre.config, pre.task
    v2 = scheme_of(cfg).deberta_version == 2
    if not v2:
        for field, value in (("share_att_key", cfg.share_att_key), ("norm_rel_ebd",
                             cfg.norm_rel_ebd), ("conv_kernel_size", cfg.conv_kernel_size)):
            if value:
                raise ValueError(f"{field}={value!r} exists only in DeBERTa-v2: Hugging Face "
                                 "DeBERTa v1 cannot represent it (use position_scheme="
                                 "'deberta_v2')")
    legacy_mlm = cfg.input_embedding_size != cfg.hidden_size   # HF's official head needs E == H
    arch = {"mlm": "ForMaskedLM", "classification": "ForSequenceClassification",
            "encoder": "Model"}[task]
    out: dict[str, Any] = {
        "model_type": scheme_of(cfg).hf_model_type,
        "architectures": [("DebertaV2" if v2 else "Deberta") + arch],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "intermediate_size": cfg.mlp_dim,
        "hidden_act": activation_to_hf(cfg.hidden_act, "hidden_act"),
        "hidden_dropout_prob": cfg.dropout_rate,
        "attention_probs_dropout_prob": cfg.attention_dropout_rate,
        "max_position_embeddings": cfg.max_position_embeddings or 512,   # HF: position_ids
        "type_vocab_size": cfg.type_vocab_size, "layer_norm_eps": cfg.layer_norm_eps,
        "relative_attention": True, "max_relative_positions": cfg.max_relative_positions,
        "pad_token_id": cfg.pad_token_id, "position_biased_input": cfg.position_biased_input,
        "pos_att_type": list(cfg.pos_att_type), "pooler_hidden_size": cfg.hidden_size,
        "pooler_hidden_act": activation_to_hf(cfg.pooler_act, "pooler_act"),
        "pooler_dropout": 0.0, "legacy": legacy_mlm, "embedding_size": cfg.input_embedding_size,
        "dtype": "float32",
    }
    if v2:
        out.update(position_buckets=cfg.position_buckets or -1, share_att_key=cfg.share_att_key,
                   norm_rel_ebd="layer_norm" if cfg.norm_rel_ebd else "none",
                   conv_kernel_size=cfg.conv_kernel_size, conv_groups=cfg.conv_groups,
                   conv_act=activation_to_hf(cfg.conv_act, "conv_act"))
    if task == "classification":
        out.update(labels_config(pre.num_labels))
    prefix = "" if task == "encoder" else "deberta."
    base = () if task == "encoder" else ("encoder",)
    params = pre.params
    if cfg.max_position_embeddings and not input_table(cfg):
        # The model holds no table that neither the input nor EMD reads.
        cfg = dataclasses.replace(cfg, max_position_embeddings=0)
    links = encoder_links(cfg, prefix, base) + head_links(task, legacy_mlm)
    tensors = m.export_tensors(links, params, f"export of {cfg.position_scheme} {task}")
    return out, tensors
