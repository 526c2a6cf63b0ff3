"""The position schemes, one row each: the only list of scheme names in posjax.

A scheme gives a Transformer positions in at most three places (docs/design.md §2):

* ``input``: what is added to the token embeddings — ``learned`` (an absolute table, BERT/ViT),
  ``optional`` (DeBERTa: a learned table only with ``position_biased_input``, or for its EMD),
  ``sincos2d`` (big_vision's fixed 2D sin-cos table on the patches), or ``none``;
* ``terms``: what is added to every layer's attention logits besides the content q·k —
  ``t5`` (a bucketed relative bias, ``T5RelativeBias``), ``untied`` (TUPE's (P U_Q)(P U_K)ᵀ,
  ``TupePositionBias``), ``mixed`` (BERT-A-d's word↔position cross terms), ``disentangled``
  (DeBERTa's c2p/p2c, ``DisentangledAttention``), ``alibi`` (−slope_h·|i − j|);
* ``rotary``: whether queries and keys are rotated by their positions (RoPE) before q·k.

``logit_factor`` f scales the logits by 1/√(f·d) (0: DeBERTa's 1 + #position terms);
``relative``: positions enter only as offsets, so the scheme is defined at any length or
grid without a table row per position; ``fields``: the config fields the scheme reads (which
also change what the same parameters compute); ``text`` / ``image``: whether text / ViT models
take the scheme; ``alias``: the recipes' short name (configs/mlm_<alias>.py).

``deberta_version``: 1 (DeBERTa: fused in_proj, v1's relative span) or 2 (DeBERTa-v2/v3:
separate projections, log buckets, shared keys) for the disentangled schemes, 0 otherwise;
``hf_model_type``: the Hugging Face ``config.json`` ``model_type`` of the same model
(posjax.convert imports and exports it), "" where Hugging Face has none.

Presets, (field, value) pairs of TextConfig: ``presets``: the scheme's own settings, put on
any base model that takes the scheme (the text recipes and the study's grid,
posjax/study/spec.scheme_presets): DeBERTa without absolute input positions, v3's shared keys
and LayerNorm'd relative table; ``recipe``: the further settings of the paper recipe the text
recipes follow (configs/text_recipes.py: TUPE's fairseq one, the official DeBERTa one, BERT's
without the absolute table). Settings that scale with the recipe's length (DeBERTa's span and
v3's buckets) are the recipes', by the fields the scheme reads.

Adding a scheme is one row here plus the layer that computes its term.
"""
from __future__ import annotations

import dataclasses
from typing import Any

INPUTS = ("learned", "optional", "sincos2d", "none")
TERMS = ("t5", "untied", "mixed", "disentangled", "alibi")
Preset = tuple[tuple[str, Any], ...]   # (TextConfig field, value) pairs


@dataclasses.dataclass(frozen=True)
class Scheme:
    name: str
    summary: str
    input: str
    terms: tuple[str, ...] = ()
    rotary: bool = False
    logit_factor: int = 1
    relative: bool = False
    fields: tuple[str, ...] = ()
    text: bool = True
    image: bool = True
    alias: str = ""           # the recipes' short name (configs/: bert_a for bert_abs)
    deberta_version: int = 0  # 1, 2: which DeBERTa (disentangled schemes only)
    hf_model_type: str = ""   # Hugging Face config.json model_type ("": none)
    presets: Preset = ()      # the scheme's own settings on any base model
    recipe: Preset = ()       # the paper recipe's further settings (configs/text_recipes.py)

    def __post_init__(self) -> None:
        assert self.input in INPUTS and set(self.terms) <= set(TERMS), self
        assert (self.deberta_version in (1, 2)) == self.disentangled, self

    @property
    def disentangled(self) -> bool:
        """DeBERTa: its own attention layer, padded queries masked too (official XSoftmax)."""
        return "disentangled" in self.terms

    @property
    def untied(self) -> bool:
        """TUPE's absolute correlation: a (max_len + 1)-row table read by every layer."""
        return "untied" in self.terms

    @property
    def learned_input(self) -> bool:
        return self.input == "learned"

    @property
    def input_positions_only(self) -> bool:
        """Positions enter only as a learned table added to the input (BERT-A, ViT): the
        first layer's logits are exactly TUPE Fig. 2's four word/position terms."""
        return self.learned_input and not self.terms and not self.rotary


_T5 = ("relative_buckets", "relative_max_distance")
_DEBERTA = ("pos_att_type", "max_relative_positions", "position_biased_input")
_NO_INPUT_TABLE: Preset = (("position_biased_input", False),)
_V3_PRESETS: Preset = _NO_INPUT_TABLE + (("share_att_key", True), ("norm_rel_ebd", True))
_TUPE_RECIPE: Preset = (("type_vocab_size", 0), ("layer_norm_eps", 1e-5))   # fairseq's
_DEBERTA_RECIPE: Preset = (("type_vocab_size", 0), ("layer_norm_eps", 1e-7),
                           ("pos_att_type", ("c2p", "p2c")))                 # the official
_NO_TABLE_RECIPE: Preset = (("max_position_embeddings", 0),)   # BERT's, without the table

SCHEMES: dict[str, Scheme] = {s.name: s for s in (
    Scheme("vit", "ViT: learned absolute table on the input", "learned", text=False,
           hf_model_type="vit"),
    Scheme("bert_abs", "BERT-A: learned absolute table on the input", "learned", alias="bert_a"),
    Scheme("bert_rel", "BERT-R: BERT-A + T5 relative bias", "learned", ("t5",), fields=_T5,
           alias="bert_r"),
    Scheme("tupe_a", "TUPE-A: untied positional correlation, [CLS] reset", "none",
           ("untied",), logit_factor=2, fields=("tie_cls",), recipe=_TUPE_RECIPE),
    Scheme("tupe_r", "TUPE-R: TUPE-A + T5 relative bias", "none", ("untied", "t5"),
           logit_factor=2, fields=_T5 + ("tie_cls",), recipe=_TUPE_RECIPE),
    Scheme("bert_abs_d", "BERT-A-d: all four word/position terms, untied projections", "none",
           ("untied", "mixed"), logit_factor=4, alias="bert_a_d", recipe=_TUPE_RECIPE),
    Scheme("deberta", "DeBERTa v1: disentangled c2p/p2c attention", "optional",
           ("disentangled",), logit_factor=0, relative=True, fields=_DEBERTA,
           deberta_version=1, hf_model_type="deberta", presets=_NO_INPUT_TABLE,
           recipe=_DEBERTA_RECIPE),
    Scheme("deberta_v2", "DeBERTa v2/v3: + log buckets, shared keys, table LayerNorm",
           "optional", ("disentangled",), logit_factor=0, relative=True,
           fields=_DEBERTA + ("position_buckets", "share_att_key", "norm_rel_ebd", "conv_act"),
           deberta_version=2, hf_model_type="deberta-v2", presets=_V3_PRESETS,
           recipe=_DEBERTA_RECIPE),
    Scheme("rope", "RoPE: queries and keys rotated by position (2D axial on grids)", "none",
           rotary=True, relative=True, fields=("rope_base",), recipe=_NO_TABLE_RECIPE),
    Scheme("alibi", "ALiBi: per-head linear bias -slope·|i - j| (symmetric)", "none",
           ("alibi",), relative=True, recipe=_NO_TABLE_RECIPE),
    Scheme("nope", "NoPE: no positions at all", "none", relative=True,
           recipe=_NO_TABLE_RECIPE),
    Scheme("sincos2d", "fixed 2D sin-cos table on the patches (big_vision)", "sincos2d",
           text=False),
)}

TEXT_SCHEMES = tuple(n for n, s in SCHEMES.items() if s.text)
VIT_SCHEMES = tuple(n for n, s in SCHEMES.items() if s.image)
ALIASES = {s.alias: n for n, s in SCHEMES.items() if s.alias}
# {Hugging Face model_type: scheme}, in the table's order.
HF_SCHEMES = {s.hf_model_type: n for n, s in SCHEMES.items() if s.hf_model_type}


def scheme_of(cfg: Any) -> Scheme:
    """The row of ``cfg.position_scheme`` (a TextConfig / ViTConfig or anything with one)."""
    return SCHEMES[cfg.position_scheme]


def scheme_fields() -> dict[str, tuple[str, ...]]:
    """{scheme: the config fields it reads}, for every scheme that reads any."""
    return {n: s.fields for n, s in SCHEMES.items() if s.fields}


def reads_absolute_table(cfg: Any) -> bool:
    """Whether a text model with ``cfg`` reads an absolute position table: BERT-A/R's input
    table, TUPE's untied one, DeBERTa's when the input (``position_biased_input``) or the EMD
    reads it. The config refuses such a model without table rows."""
    scheme = scheme_of(cfg)
    return scheme.learned_input or scheme.untied or (
        scheme.input == "optional" and (cfg.position_biased_input or cfg.use_emd))


def input_table(cfg: Any) -> bool:
    """Whether the model's input embeddings hold the table (all readers but TUPE's logits)."""
    return reads_absolute_table(cfg) and not scheme_of(cfg).untied


def absolute_rows(cfg: Any) -> int:
    """Rows of the absolute position table a text model with ``cfg`` reads, 0 when it reads
    none: it has no position beyond them."""
    return cfg.max_position_embeddings if reads_absolute_table(cfg) else 0
