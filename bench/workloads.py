"""The benchmarked models, their training steps in both frameworks, and their analytic FLOPs.

A ``Workload`` is one model at one size with one batch. Both frameworks train it the same way:
classification cross-entropy (text: 2 labels on [CLS] through the pooler; images: 1000 classes on
[CLS]) or, for the study's small models (``study_workloads``), masked-LM cross-entropy over the
masked slots of each sequence (the 30,522-word tied output layer on those slots alone), AdamW (lr 1e-4, weight decay 0.01, β = (0.9, 0.999), ε = 1e-8), fp32 parameters,
dropout as configured and active (train mode).

Ours: ``posjax`` modules and a plain ``jax.jit(value_and_grad + optax.adamw)`` step with donated
parameters and optimizer state (posjax.training was not available when these were written).
Hugging Face: the matching ``transformers`` model, ``torch.optim.AdamW`` (``fused=True``, its
fastest CPU/GPU path), ``torch.autocast`` for bf16.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from bench.common import block
from posjax import (TextConfig, TextForMaskedLM, TextForSequenceClassification, ViT,
                    ViTConfig)
from posjax.models import flops
from posjax.models.schemes import SCHEMES

LEARNING_RATE = 1e-4
WEIGHT_DECAY = 0.01


@dataclasses.dataclass(frozen=True)
class Workload:
    """One model, one batch. ``hf`` names the Hugging Face counterpart (None: none exists)."""

    name: str
    cfg: TextConfig | ViTConfig
    batch: int
    length: int = 0              # text tokens per example (images: from cfg.num_tokens)
    num_labels: int = 2
    hf: str | None = None        # 'bert' | 'deberta_v2' | 'vit'
    hf_note: str = ""
    task: str = "classify"       # 'classify' ([CLS] / image classes) | 'mlm' (masked slots)
    predictions: int = 0         # mlm: masked slots per sequence (M)

    @property
    def is_text(self) -> bool:
        return isinstance(self.cfg, TextConfig)

    @property
    def tokens(self) -> int:
        """Sequence length the encoder sees."""
        return self.length if self.is_text else self.cfg.num_tokens

    @property
    def is_mlm(self) -> bool:
        return self.task == "mlm"


# --------------------------------------------------------------------------- model zoo

def _text_shape(scale: str) -> dict[str, Any]:
    """Encoder dimensions: DeBERTa-v3-small's shape (6 × 768) on CPU, base (12 × 768) on GPU."""
    if scale == "smoke":
        return dict(vocab_size=512, hidden_size=64, num_heads=4, num_layers=1, mlp_dim=128,
                    max_position_embeddings=64)
    layers = 12 if scale == "gpu" else 6
    return dict(vocab_size=30522, hidden_size=768, num_heads=12, num_layers=layers, mlp_dim=3072,
                max_position_embeddings=512)


def text_config(scheme: str, scale: str, dtype: str = "float32", **overrides: Any) -> TextConfig:
    """BERT-A, TUPE-R or DeBERTa-v3 at ``scale``; DeBERTa uses the v3 recipe (log buckets,
    shared attention key, LayerNorm'd relative table, no absolute input positions, no types)."""
    kw = dict(_text_shape(scale), dtype=dtype, dropout_rate=0.1, attention_dropout_rate=0.1)
    row = SCHEMES.get(scheme)   # an unknown scheme: TextConfig's error names the choices
    if row is not None and row.deberta_version == 2:   # the table's v3 presets and recipe
        smoke = scale == "smoke"
        kw.update(row.presets + row.recipe, max_relative_positions=64 if smoke else 512,
                  position_buckets=16 if smoke else 256, max_position_embeddings=0,
                  pooler_act="gelu")
    kw.update(overrides)
    return TextConfig(position_scheme=scheme, **kw)


def vit_config(size: str, scale: str, dtype: str = "float32") -> ViTConfig:
    """ViT-S/16 or ViT-B/16 at 224 px with HF numerics (exact GELU, LN eps 1e-12), no dropout."""
    if scale == "smoke":
        dims = dict(image_size=32, patch_size=8, hidden_size=64, num_heads=4, num_layers=1,
                    mlp_dim=128, num_classes=10)
    else:
        width, heads = (384, 6) if size == "S" else (768, 12)
        dims = dict(image_size=224, patch_size=16, hidden_size=width, num_heads=heads,
                    num_layers=12, mlp_dim=4 * width, num_classes=1000)
    return ViTConfig(position_scheme="vit", hidden_act="gelu", layer_norm_eps=1e-12, dtype=dtype,
                     **dims)


HF_TUPE_NOTE = "HF has no TUPE: HF column is BertForSequenceClassification (absolute), equal size"


def throughput_workloads(scale: str, dtype: str = "float32") -> list[Workload]:
    """The four models of the throughput table. CPU: 6 × 768 text encoders (DeBERTa-v3-small
    shape, BERT vocabulary 30,522 for all three so sizes are equal), batch 8 × 128; ViT-S/16
    at 224 px, batch 8. GPU: base sizes (12 × 768) in bf16, again with BERT's vocabulary for
    all three (DeBERTa-v3-base's own 128,100 words would add 75M embedding parameters and
    unbalance the overhead table), batch 32 × 512 and ViT-B/16 batch 128."""
    gpu, smoke = scale == "gpu", scale == "smoke"
    tb, tl = (2, 16) if smoke else ((32, 512) if gpu else (8, 128))
    vb = 2 if smoke else (128 if gpu else 8)
    suffix = "base" if gpu else "small"
    deberta = text_config("deberta_v2", scale, dtype)
    return [
        Workload(f"BERT-A ({suffix})", text_config("bert_abs", scale, dtype), tb, tl, hf="bert"),
        Workload(f"TUPE-R ({suffix})", text_config("tupe_r", scale, dtype), tb, tl, hf="bert",
                 hf_note=HF_TUPE_NOTE),
        Workload(f"DeBERTa-v3 ({suffix})", deberta, tb, tl, hf="deberta_v2"),
        Workload("ViT-B/16" if gpu else "ViT-S/16", vit_config("B" if gpu else "S", scale, dtype),
                 vb, num_labels=0, hf="vit"),
    ]


STUDY_HF_NOTE = ("HF has no TUPE: HF column is BertForMaskedLM (absolute), equal size")
# (label, study cell, HF reference model, note on the HF column)
STUDY_CELLS = (("study BERT-A", "bert_abs", "bert", ""),
               ("study TUPE-R", "tupe_r", "bert", STUDY_HF_NOTE),
               ("study DeBERTa-v3", "deberta_v2_no_emd", "deberta_v2", ""))


def study_workloads(scale: str, dtype: str = "float32") -> list[Workload]:
    """The text study's MLM models as it trains them (configs/study_text.py: its base config
    and cells, expanded by ``posjax.study.spec``): 4 layers × 128 (4 heads, MLP 512), BERT
    vocabulary, batch 32 × 64 tokens, 12 masked slots per sequence; BERT-A, TUPE-R and
    DeBERTa-v3 without EMD (HF's DeBERTa MLM head has none). ``smoke``: the dimensions of the
    study's tiny variant (2 layers × 32, batch 8 × 32), vocabulary 30,522 all the same."""
    from configs import study_text
    from posjax.data.text import max_predictions
    from posjax.study.spec import check_study
    base, cells = check_study(study_text.get_config())
    batch, length = int(base.batch_size), int(base.data.max_seq_length)
    slots = max_predictions(base.data)
    small: dict[str, Any] = {}
    if scale == "smoke":
        batch, length, slots = 8, 32, 8
        small = dict(hidden_size=32, num_heads=2, num_layers=2, mlp_dim=64)
    out = []
    for name, cell, hf, note in STUDY_CELLS:
        entry = next(c for c in cells if c.name == cell)
        model = dict(entry.model, dtype=dtype, use_emd=False, **small)
        if small and entry.model.get("max_position_embeddings"):
            model["max_position_embeddings"] = length
        if small and SCHEMES[entry.scheme].disentangled:
            model.update(max_relative_positions=length, position_buckets=length // 2)
        out.append(Workload(name, TextConfig(**model), batch, length, hf=hf, task="mlm",
                            predictions=slots, hf_note=note))
    return out


def all_workloads(scale: str, dtype: str = "float32") -> list[Workload]:
    """The throughput table's models, then the study's small MLM models."""
    return throughput_workloads(scale, dtype) + study_workloads(scale, dtype)


# --------------------------------------------------------------------------- analytic FLOPs

def forward_flops(w: Workload, every_row: bool = False) -> float:
    """Matmul FLOPs of one forward pass over the whole batch (2 per multiply-add), as
    ``posjax.models.flops`` counts them for the model as it runs: per layer projections
    2·L·4H², MLP 2·L·2HF, scores and weighted values 4·L²·H, except that the last layer of a
    [CLS] classifier computes token 0 alone (``Encoder(first_only=True)``). Terms that do not
    depend on the batch are counted once per step: DeBERTa's table projections 2·R·H² per
    layer and term (R = 2k rows; the products with the content 2·L·R'·H per sequence, R' = R,
    or 2L − 1 with the ``shift`` gather when fewer), TUPE's position correlation. Heads: text
    pooler 2H² + classifier 2H·C per example; ViT as ``flops.vit_forward_flops``. Embedding
    lookups, LayerNorm, softmax, dropout and the optimizer count as zero.

    ``every_row``: the last layer computes every token, as HF does (its FLOPs for HF's MFU).
    """
    cfg, b, seq = w.cfg, w.batch, w.tokens
    if not w.is_text:
        return flops.vit_forward_flops(cfg, first_only=not every_row).total(b)
    if w.is_mlm:   # both frameworks decode the masked slots alone
        from posjax.training.text_tasks import mlm_head_flops
        return float((flops.text_encoder_forward_flops(cfg, seq)
                      + mlm_head_flops(cfg, w.predictions, seq)).total(b))
    h = cfg.hidden_size
    head = flops.Flops(per_example=2 * h * h + 2 * h * w.num_labels)
    return float((flops.text_encoder_forward_flops(cfg, seq, first_only=not every_row)
                  + head).total(b))


def train_flops(w: Workload, every_row: bool = False) -> float:
    """One training step = forward + backward = 3 × forward matmul FLOPs (ViT: less the
    input gradient of the patch embedding, ``flops.vit_train_flops``)."""
    if not w.is_text:
        return flops.vit_train_flops(w.cfg, first_only=not every_row).total(w.batch)
    return flops.TRAIN_FACTOR * forward_flops(w, every_row)


# --------------------------------------------------------------------------- inputs

def make_batch(w: Workload, seed: int = 0) -> dict[str, np.ndarray]:
    """Random full-length token ids (or images in [-1, 1]) and labels, as numpy; MLM: also
    ``masked_positions`` (B, M), distinct sorted positions in 1 … L − 1, and their targets
    ``masked_ids``."""
    rng = np.random.default_rng(seed)
    if w.is_mlm:
        positions = np.sort(np.stack([rng.choice(np.arange(1, w.length), w.predictions,
                                                 replace=False) for _ in range(w.batch)]), -1)
        return {"input_ids": rng.integers(1, w.cfg.vocab_size, (w.batch, w.length), np.int32),
                "attention_mask": np.ones((w.batch, w.length), np.int32),
                "masked_positions": positions.astype(np.int32),
                "masked_ids": rng.integers(1, w.cfg.vocab_size, (w.batch, w.predictions),
                                           np.int32)}
    if w.is_text:
        return {"input_ids": rng.integers(1, w.cfg.vocab_size, (w.batch, w.length), np.int32),
                "attention_mask": np.ones((w.batch, w.length), np.int32),
                "labels": rng.integers(0, w.num_labels, (w.batch,), np.int32)}
    c = w.cfg
    images = rng.uniform(-1, 1, (w.batch, *c.image_size, c.num_channels)).astype(np.float32)
    return {"images": images,
            "labels": rng.integers(0, c.num_classes, (w.batch,), np.int32)}


# --------------------------------------------------------------------------- ours (JAX)

def build_model(w: Workload, package: Any = None) -> nn.Module:
    """The posjax model of ``w``; ``package``: another copy of posjax (e.g. an older revision
    imported by bench/ab.py) whose config and model classes to use instead."""
    if package is None:
        if w.is_mlm:
            return TextForMaskedLM(w.cfg)
        if w.is_text:
            return TextForSequenceClassification(w.cfg, num_labels=w.num_labels)
        return ViT(w.cfg)
    config_cls = package.TextConfig if w.is_text else package.ViTConfig
    known = {f.name for f in dataclasses.fields(config_cls)}
    fields = {f.name: getattr(w.cfg, f.name) for f in dataclasses.fields(w.cfg)}
    missing = {k: v for k, v in fields.items() if k not in known}
    default = type(w.cfg)()
    changed = [k for k, v in missing.items() if v != getattr(default, k)]
    if changed:
        raise ValueError(f"{package.__name__} has no config field(s) {changed} that {w.name} sets")
    cfg = config_cls(**{k: v for k, v in fields.items() if k in known})
    if w.is_mlm:
        return package.TextForMaskedLM(cfg)
    if w.is_text:
        return package.TextForSequenceClassification(cfg, num_labels=w.num_labels)
    return package.ViT(cfg)


def _logits(model: nn.Module, params: Any, batch: dict[str, jax.Array], key: jax.Array,
            is_text: bool) -> jax.Array:
    rngs = {"dropout": key}
    if "masked_positions" in batch:
        return model.apply({"params": params}, batch["input_ids"], batch["attention_mask"],
                           masked_positions=batch["masked_positions"], train=True, rngs=rngs)
    if is_text:
        return model.apply({"params": params}, batch["input_ids"], batch["attention_mask"],
                           train=True, rngs=rngs)
    return model.apply({"params": params}, batch["images"], train=True, rngs=rngs)


def make_train_step(model: nn.Module, tx: optax.GradientTransformation, is_text: bool):
    """jit((params, opt_state, batch, key) -> (params, opt_state, key, loss)), donating state."""

    def loss_fn(params, batch, key):
        logits = _logits(model, params, batch, key, is_text).astype(jnp.float32)
        labels = batch["masked_ids"] if "masked_ids" in batch else batch["labels"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    def step(params, opt_state, batch, key):
        key, dropout_key = jax.random.split(key)
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, dropout_key)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, key, loss

    return jax.jit(step, donate_argnums=(0, 1, 3))


class OursTrainer:
    """A posjax model with its jitted AdamW step; ``step()`` runs one step and blocks."""

    framework = "ours"

    def __init__(self, w: Workload, seed: int = 0,
                 compiler_options: dict[str, Any] | None = None, package: Any = None) -> None:
        self.workload = w
        model = build_model(w, package)
        batch = {k: jnp.asarray(v) for k, v in make_batch(w, seed).items()}
        init_args = ((batch["input_ids"], batch["attention_mask"]) if w.is_text
                     else (batch["images"],))
        init = jax.jit(lambda k: nn.meta.unbox(model.init(k, *init_args)["params"]))
        key = jax.random.key(seed)
        params = init.lower(key).compile(compiler_options)(key)
        self.num_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
        tx = optax.adamw(LEARNING_RATE, weight_decay=WEIGHT_DECAY)
        opt_state = tx.init(params)
        key = jax.random.key(seed + 1)
        step = make_train_step(model, tx, w.is_text)
        t0 = time.perf_counter()
        self._compiled = step.lower(params, opt_state, batch, key).compile(compiler_options)
        self.compile_s = time.perf_counter() - t0
        self.xla_flops = _cost_flops(self._compiled)
        self._state = (params, opt_state, key)
        self._batch = batch
        self.loss = float("nan")

    def step(self) -> None:
        params, opt_state, key = self._state
        params, opt_state, key, loss = self._compiled(params, opt_state, self._batch, key)
        block(loss)
        self._state = (params, opt_state, key)
        self.loss = loss


def _cost_flops(compiled: Any) -> float:
    """FLOPs XLA's cost analysis counts for a compiled executable (nan if unavailable)."""
    try:
        cost = compiled.cost_analysis()
    except Exception:   # backends without cost analysis
        return float("nan")
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return float((cost or {}).get("flops", float("nan")))


# --------------------------------------------------------------------------- Hugging Face (torch)

def hf_deberta_v2_config(cfg: TextConfig, **extra: Any):
    """The ``transformers.DebertaV2Config`` of a deberta_v2 ``cfg`` (same sizes, buckets,
    shared key, table LayerNorm, dropout); ``extra``: further DebertaV2Config fields."""
    import transformers
    return transformers.DebertaV2Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        intermediate_size=cfg.mlp_dim, max_position_embeddings=cfg.max_relative_positions,
        relative_attention=True, position_buckets=cfg.position_buckets,
        max_relative_positions=cfg.max_relative_positions, share_att_key=cfg.share_att_key,
        norm_rel_ebd="layer_norm" if cfg.norm_rel_ebd else "none",
        pos_att_type=list(cfg.pos_att_type), position_biased_input=cfg.position_biased_input,
        type_vocab_size=cfg.type_vocab_size, layer_norm_eps=cfg.layer_norm_eps,
        hidden_dropout_prob=cfg.dropout_rate,
        attention_probs_dropout_prob=cfg.attention_dropout_rate,
        pooler_dropout=cfg.dropout_rate, pooler_hidden_act=cfg.pooler_act, **extra)


def hf_model(w: Workload):
    """The transformers model matching ``w`` (random init), in train mode."""
    import transformers
    cfg = w.cfg
    if w.hf == "bert":
        hc = transformers.BertConfig(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
            num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
            intermediate_size=cfg.mlp_dim, max_position_embeddings=cfg.max_position_embeddings,
            type_vocab_size=max(cfg.type_vocab_size, 1), layer_norm_eps=cfg.layer_norm_eps,
            hidden_dropout_prob=cfg.dropout_rate,
            attention_probs_dropout_prob=cfg.attention_dropout_rate, num_labels=w.num_labels)
        model = (transformers.BertForMaskedLM if w.is_mlm
                 else transformers.BertForSequenceClassification)(hc)
    elif w.hf == "deberta_v2":
        hc = hf_deberta_v2_config(cfg, num_labels=w.num_labels)
        model = (transformers.DebertaV2ForMaskedLM if w.is_mlm
                 else transformers.DebertaV2ForSequenceClassification)(hc)
    elif w.hf == "vit":
        hc = transformers.ViTConfig(
            hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_heads, intermediate_size=cfg.mlp_dim,
            image_size=cfg.image_size[0], patch_size=cfg.patch_size[0],
            num_channels=cfg.num_channels, layer_norm_eps=cfg.layer_norm_eps,
            hidden_dropout_prob=cfg.dropout_rate,
            attention_probs_dropout_prob=cfg.attention_dropout_rate, num_labels=cfg.num_classes)
        model = transformers.ViTForImageClassification(hc)
    else:
        raise ValueError(f"hf={w.hf!r} is not valid: choose 'bert', 'deberta_v2' or 'vit'")
    return model.train()


class HFTrainer:
    """The transformers counterpart of ``w`` with torch AdamW; ``step()`` runs one step."""

    framework = "hf"

    def __init__(self, w: Workload, seed: int = 0) -> None:
        import torch
        self.workload = w
        self._torch = torch
        torch.manual_seed(seed)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model = hf_model(w).to(self.device)
        self.attn_implementation = getattr(self.model.config, "_attn_implementation", "eager")
        self.num_params = sum(p.numel() for p in self.model.parameters())
        try:
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LEARNING_RATE,
                                               weight_decay=WEIGHT_DECAY, fused=True)
            self.optimizer_kind = "fused"
        except (RuntimeError, ValueError):
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LEARNING_RATE,
                                               weight_decay=WEIGHT_DECAY)
            self.optimizer_kind = "default"
        batch = make_batch(w, seed)
        labels = batch.pop("masked_ids" if w.is_mlm else "labels")
        self.labels = torch.from_numpy(labels.astype(np.int64)).to(self.device)
        self.masked_positions = None
        if w.is_mlm:
            self.masked_positions = torch.from_numpy(
                batch.pop("masked_positions").astype(np.int64)).to(self.device)
        if w.is_text:
            self.inputs = {k: torch.from_numpy(v.astype(np.int64)).to(self.device)
                           for k, v in batch.items()}
        else:   # NHWC -> NCHW
            self.inputs = {"pixel_values": torch.from_numpy(
                batch["images"].transpose(0, 3, 1, 2).copy()).to(self.device)}
        self.bf16 = w.cfg.dtype == "bfloat16"
        self.loss = float("nan")

    def step(self) -> None:
        torch = self._torch
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            if self.masked_positions is None:
                logits = self.model(**self.inputs).logits
            else:
                logits = self._masked_logits()
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, -2),
                                                 self.labels.flatten())
        loss.backward()
        self.optimizer.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.loss = loss.detach()

    def _masked_logits(self):
        """MLM logits at the masked slots alone (B, M, V), as ours decodes them: the encoder's
        last hidden states gathered at ``masked_positions``, then the model's own MLM head
        (HF's forward would decode every token)."""
        torch = self._torch
        hidden = self.model.base_model(**self.inputs)[0]
        rows = hidden[torch.arange(hidden.shape[0], device=hidden.device)[:, None],
                      self.masked_positions]
        if hasattr(self.model, "cls"):
            return self.model.cls(rows)
        return self.model.lm_predictions(rows, self.model.base_model.embeddings.word_embeddings)
