"""Model configurations: frozen dataclasses validated when they are built.

Every check raises one ``ValueError`` naming the field, its value and what is allowed, so a
bad configuration fails before anything is traced or compiled.
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Mapping, Sequence

from posjax.models.schemes import SCHEMES, TEXT_SCHEMES, VIT_SCHEMES, reads_absolute_table

ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "tanh", "identity")
POOLINGS = ("token", "first", "gap", "map")
DTYPES = ("float32", "bfloat16", "float16")
# DeBERTa's relative-position gather (posjax.layers.disentangled.position_logits): take_along_axis,
# one-hot einsum, the relative shift where it is the cheaper product (2L − 1 <= 2k), or the
# relative shift at every length (no L × L gather; for hardware where gathers are slow).
GATHERS = ("take", "onehot", "shift", "skew")
# How eval.py extends a checkpoint's absolute position table to a longer data.max_seq_length
# (TextConfig.extend_positions): '' refuses; 'interpolate' resamples its rows linearly.
EXTEND_POSITIONS = ("", "interpolate")
# Which attention path runs (attention_impl): 'auto' — the plain XLA path below
# blocked_attention_from tokens and the memory-bounded path from there, run by the Pallas kernel
# on a TPU when attention dropout is off, else by the plain-JAX scan (posjax.layers.blocked);
# 'xla' — always the plain path (the L × L logits); 'blocked' — always the scan; 'pallas' —
# always the Pallas kernel (posjax.kernels; TPU, or any backend with pallas_interpret).
ATTENTION_IMPLS = ("auto", "xla", "blocked", "pallas")


def check(ok: bool, message: str) -> None:
    """Raise ``ValueError(message)`` unless ``ok`` (every config check, model and training)."""
    if not ok:
        raise ValueError(message)


def _check(ok: bool, field: str, value: Any, allowed: str) -> None:
    check(ok, f"{field}={value!r} is not valid: {allowed}")


_KINDS = {"int": (numbers.Integral, "an integer"), "float": (numbers.Real, "a number"),
          "bool": (bool, "True or False"), "str": (str, "a string")}


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_types(c: Any) -> None:
    """Every int / float / bool / str field holds a value of that kind (a bool is no number);
    numpy scalars become Python ints and floats, so that the config saves as JSON."""
    for f in dataclasses.fields(c):
        name = f.type if isinstance(f.type, str) else f.type.__name__
        kind = _KINDS.get(name)
        if kind is None:
            continue
        value = getattr(c, f.name)
        ok = isinstance(value, kind[0]) and (f.type == "bool" or not isinstance(value, bool))
        _check(ok, f.name, value, f"must be {kind[1]}")
        if name in ("int", "float") and type(value) not in (int, float):
            object.__setattr__(c, f.name, int(value) if name == "int" else float(value))


def _att_types(value: str | tuple[str, ...]) -> tuple[str, ...]:
    """pos_att_type as a tuple; a string is split on '|' or ',' ("c2p|p2c", as HF writes it).
    A term listed twice is an error: the attention scale 1/sqrt((1 + len(pos_att_type)) d)
    counts the terms."""
    _check(isinstance(value, (str, tuple, list)), "pos_att_type", value,
           "a string such as 'c2p|p2c', or a tuple of 'c2p' and/or 'p2c'")
    terms = ([t.strip() for t in value.replace(",", "|").split("|") if t.strip()]
             if isinstance(value, str) else list(value))
    _check(len(set(terms)) == len(terms), "pos_att_type", value, "lists a term twice")
    return tuple(terms)


def _check_common(c: "TextConfig | ViTConfig", schemes: tuple[str, ...]) -> None:
    _check_types(c)
    _check(c.position_scheme in schemes, "position_scheme", c.position_scheme,
           f"choose one of {', '.join(schemes)}")
    for f in ("hidden_size", "num_heads", "num_layers", "mlp_dim"):
        _check(getattr(c, f) > 0, f, getattr(c, f), "must be a positive integer")
    _check(c.hidden_size % c.num_heads == 0, "hidden_size", c.hidden_size,
           f"must be divisible by num_heads={c.num_heads}")
    _check(c.hidden_act in ACTIVATIONS, "hidden_act", c.hidden_act,
           f"choose one of {', '.join(ACTIVATIONS)}")
    _check(c.dtype in DTYPES, "dtype", c.dtype, f"choose one of {', '.join(DTYPES)}")
    for f in ("dropout_rate", "attention_dropout_rate"):
        v = getattr(c, f)
        _check(0.0 <= v < 1.0, f, v, "must lie in [0, 1)")
    _check(c.layer_norm_eps > 0, "layer_norm_eps", c.layer_norm_eps, "must be > 0")
    _check(c.gather in GATHERS, "gather", c.gather, f"choose one of {', '.join(GATHERS)}")
    _check(c.attention_block_size > 0, "attention_block_size", c.attention_block_size,
           "must be > 0 (set blocked_attention_from=0 to never block attention)")
    _check(c.blocked_attention_from >= 0, "blocked_attention_from", c.blocked_attention_from,
           "must be >= 0 (0: never block attention)")
    scheme = SCHEMES[c.position_scheme]
    _check_attention_impl(c, grid_deberta=isinstance(c, ViTConfig) and scheme.disentangled)
    if scheme.rotary:
        axes = 2 if isinstance(c, ViTConfig) else 1
        _check(c.head_dim % (2 * axes) == 0, "hidden_size", c.hidden_size,
               f"RoPE rotates pairs of features{' per grid axis' if axes == 2 else ''}: "
               f"hidden_size / num_heads = {c.head_dim} must be divisible by {2 * axes}")
        _check(c.rope_base > 1.0, "rope_base", c.rope_base,
               "must be > 1 (the rotation frequencies are rope_base ** (-2i / d))")
    if scheme.input == "sincos2d":
        _check(c.hidden_size % 4 == 0 and c.hidden_size >= 8, "hidden_size", c.hidden_size,
               "the 2D sin-cos table has sin and cos per grid axis, each of >= 2 "
               "frequencies: must be a multiple of 4, at least 8")
    if scheme.disentangled:
        _check(len(c.pos_att_type) > 0 and set(c.pos_att_type) <= {"c2p", "p2c"},
               "pos_att_type", c.pos_att_type, "a non-empty subset of ('c2p', 'p2c')")
        _check(c.max_relative_positions > 0, "max_relative_positions",
               c.max_relative_positions, "must be > 0 for DeBERTa")
        for f in ("share_att_key", "norm_rel_ebd"):
            _check(f in scheme.fields or not getattr(c, f), f, getattr(c, f),
                   "DeBERTa v1 has no such option: use position_scheme='deberta_v2' or False")
    if "position_buckets" in scheme.fields:
        _check(c.position_buckets >= 0, "position_buckets", c.position_buckets,
               "must be >= 0 (0 disables log bucketing)")
        if c.position_buckets:
            # Every value transformers computes a bucket for is accepted (odd counts, more
            # buckets than max_relative_positions); refused are the two it cannot: mid = 0
            # divides by zero, and log((max_relative_positions - 1) / mid) = 0 makes every
            # |i - j| > mid an infinite bucket (cast to an integer, which is undefined).
            _check(c.position_buckets >= 2, "position_buckets", c.position_buckets,
                   "must be 0 (no log buckets) or >= 2: the log buckets divide by "
                   "position_buckets // 2")
            _check(c.max_relative_positions - 1 != c.position_buckets // 2,
                   "max_relative_positions", c.max_relative_positions,
                   f"max_relative_positions - 1 must differ from position_buckets // 2 = "
                   f"{c.position_buckets // 2}: the log buckets divide by log((max_relative_"
                   "positions - 1) / (position_buckets // 2)), which is then 0, so every "
                   "distance beyond it has no bucket")
    if "t5" in scheme.terms:
        _check(c.relative_buckets >= 4 and c.relative_buckets % 2 == 0, "relative_buckets",
               c.relative_buckets, "must be an even number >= 4")
        _check(c.relative_max_distance > c.relative_buckets // 4, "relative_max_distance",
               c.relative_max_distance, f"must exceed relative_buckets/4={c.relative_buckets // 4}")


def _check_attention_impl(c: "TextConfig | ViTConfig", grid_deberta: bool) -> None:
    _check(c.attention_impl in ATTENTION_IMPLS, "attention_impl", c.attention_impl,
           f"choose one of {', '.join(ATTENTION_IMPLS)}")
    if c.attention_impl in ("blocked", "pallas"):
        _check(not grid_deberta, "attention_impl", c.attention_impl, "DeBERTa's 2D relative "
               "terms on a patch grid have no blocked form: use 'auto' or 'xla'")
    if c.attention_impl == "pallas":
        _check(c.attention_dropout_rate == 0, "attention_impl", c.attention_impl,
               f"the Pallas kernel has no attention dropout (attention_dropout_rate="
               f"{c.attention_dropout_rate}): use 'blocked' or attention_dropout_rate=0")
        if not c.pallas_interpret:
            from posjax.kernels import TPU_BLOCK, target_platform   # known only here
            _check(target_platform() == "tpu", "attention_impl", c.attention_impl,
                   f"the Pallas kernel compiles for TPU only, and this backend is "
                   f"{target_platform()}: set pallas_interpret=True to run it in Pallas' "
                   "interpreter (slow; for checking its numbers), or use 'blocked'")
            _check(c.attention_block_size % TPU_BLOCK == 0, "attention_block_size",
                   c.attention_block_size, f"the Pallas kernel on TPU takes blocks of a "
                   f"multiple of {TPU_BLOCK} tokens (the TPU's (8, 128) tiling): use "
                   f"{TPU_BLOCK}, 256, 512, ...")


@dataclasses.dataclass(frozen=True)
class TextConfig:
    """A post-LN text encoder whose position scheme is a choice (docs/design.md §3).

    Scheme-specific fields are ignored by schemes that do not use them.
    """

    position_scheme: str = "bert_abs"
    vocab_size: int = 30522
    hidden_size: int = 768
    num_heads: int = 12
    num_layers: int = 12
    mlp_dim: int = 3072
    max_position_embeddings: int = 512   # absolute table rows (0: no table; DeBERTa only)
    type_vocab_size: int = 2             # 0: no token-type embeddings
    embedding_size: int = 0              # 0: same as hidden_size (else embed_proj maps E->H)
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-12
    dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.1
    dtype: str = "float32"               # compute dtype; parameters are always float32
    pad_token_id: int = 0
    # T5 relative bias (bert_rel, tupe_r).
    relative_buckets: int = 32
    relative_max_distance: int = 128
    # TUPE.
    tie_cls: bool = False                # paper ablation: no untied [CLS] reset (bert_abs_d
                                         # never resets)
    # RoPE: the rotation of feature pair i at position p is p · rope_base ** (-2i / d).
    rope_base: float = 10000.0
    # DeBERTa.
    pos_att_type: tuple[str, ...] = ("c2p", "p2c")
    max_relative_positions: int = 512    # v1: span k; v2: max_position for log buckets
    position_buckets: int = 0            # v2: 256 in the released models
    share_att_key: bool = False          # v2
    norm_rel_ebd: bool = False           # v2: LayerNorm on the relative table
    position_biased_input: bool = True   # DeBERTa: add the absolute table to the input
    conv_kernel_size: int = 0            # v2 ConvLayer (0: none)
    conv_groups: int = 1
    conv_act: str = "tanh"
    gather: str = "shift"                # DeBERTa relative gather, one of GATHERS (shift:
                                         # fastest on CPU in BENCHMARKS.md; = take beyond L=k)
    # Memory-bounded attention (posjax.layers.blocked): from blocked_attention_from tokens on
    # (0: never), queries and keys in blocks of attention_block_size with an online softmax,
    # so attention memory grows as L·block, not L². Same function (dropout masks aside).
    attention_block_size: int = 512
    blocked_attention_from: int = 2048
    attention_impl: str = "auto"         # one of ATTENTION_IMPLS (above)
    pallas_interpret: bool = False       # run the Pallas kernel in its interpreter (any backend)
    # Evaluation beyond the absolute table (eval.py with data.max_seq_length N > the table's
    # rows; one of EXTEND_POSITIONS): '' refuses; 'interpolate' resamples the checkpoint's
    # table to N rows (corner-aligned linear, ``positions.interpolate_position_rows``; TUPE's
    # [CLS] row kept) before the model is built at N. Read only there (training refuses it).
    extend_positions: str = ""
    # Heads.
    use_emd: bool = False                # DeBERTa enhanced mask decoder for MLM (needs
                                         # position_biased_input=False, as officially)
    pooler_act: str = "tanh"
    remat: bool = False                  # recompute each layer's activations in the backward
    scan_layers: bool = False            # one lax.scan over stacked layer params (fast compile)

    def __post_init__(self) -> None:
        object.__setattr__(self, "pos_att_type", _att_types(self.pos_att_type))
        _check_common(self, TEXT_SCHEMES)
        _check(self.vocab_size > 0, "vocab_size", self.vocab_size, "must be > 0")
        _check(self.type_vocab_size >= 0, "type_vocab_size", self.type_vocab_size, "must be >= 0")
        _check(self.embedding_size >= 0, "embedding_size", self.embedding_size, "must be >= 0")
        _check(self.pooler_act in ACTIVATIONS, "pooler_act", self.pooler_act,
               f"choose one of {', '.join(ACTIVATIONS)}")
        _check(self.conv_act in ACTIVATIONS, "conv_act", self.conv_act,
               f"choose one of {', '.join(ACTIVATIONS)}")
        scheme = SCHEMES[self.position_scheme]
        deberta = scheme.disentangled
        _check(self.max_position_embeddings >= 0, "max_position_embeddings",
               self.max_position_embeddings, "must be >= 0")
        if self.use_emd:
            _check(deberta, "use_emd", self.use_emd,
                   "the enhanced mask decoder exists only for position_scheme deberta/deberta_v2")
        if reads_absolute_table(self):
            reader = " with use_emd=True" if self.use_emd else ""
            _check(self.max_position_embeddings > 0, "max_position_embeddings",
                   self.max_position_embeddings,
                   f"must be > 0: position_scheme={self.position_scheme!r}{reader} reads an "
                   "absolute table")
        if self.use_emd:
            _check(self.num_layers >= 2, "use_emd", self.use_emd, "EMD needs num_layers >= 2")
            _check(self.input_embedding_size == self.hidden_size, "embedding_size",
                   self.embedding_size, "EMD adds the raw position embeddings to hidden states: "
                   f"use 0 or hidden_size={self.hidden_size} with use_emd=True")
            _check(not self.position_biased_input, "use_emd", self.use_emd,
                   "the official code runs the enhanced mask decoder only when absolute "
                   "positions are not added to the input: set position_biased_input=False, or "
                   "use_emd=False to decode the last layer")
        _check(self.extend_positions in EXTEND_POSITIONS, "extend_positions",
               self.extend_positions, "choose '' (refuse lengths beyond the position table) or "
               "'interpolate' (resample its rows to the length; eval.py only)")
        _check(self.conv_kernel_size >= 0, "conv_kernel_size", self.conv_kernel_size,
               "must be >= 0 (0: no convolution layer)")
        if self.conv_kernel_size:
            _check("conv_act" in scheme.fields, "conv_kernel_size", self.conv_kernel_size,
                   "the convolution layer exists only for position_scheme='deberta_v2'")
            _check(self.conv_kernel_size % 2 == 1, "conv_kernel_size", self.conv_kernel_size,
                   "must be odd (same-length convolution)")
            _check(self.conv_groups > 0, "conv_groups", self.conv_groups, "must be > 0")
            _check(self.hidden_size % self.conv_groups == 0, "conv_groups", self.conv_groups,
                   f"must divide hidden_size={self.hidden_size}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def input_embedding_size(self) -> int:
        return self.embedding_size or self.hidden_size

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "TextConfig":
        return _from_dict(cls, d)


def stem_stride(resnet_layers: Sequence[int]) -> int:
    """Total downsampling of a hybrid ViT's ResNet stem with ``resnet_layers`` blocks per stage
    (root /4, then /2 per stage after the first); 1 without a stem."""
    return 4 * 2 ** (len(resnet_layers) - 1) if resnet_layers else 1


@dataclasses.dataclass(frozen=True)
class ViTConfig:
    """Vision Transformer (pre-LN) on patches; any text scheme may replace learned positions."""

    position_scheme: str = "vit"
    image_size: tuple[int, int] = (224, 224)
    patch_size: tuple[int, int] = (16, 16)
    num_channels: int = 3
    hidden_size: int = 768
    num_heads: int = 12
    num_layers: int = 12
    mlp_dim: int = 3072
    num_classes: int = 1000              # 0: no head (returns pooled features)
    pooling: str = "token"               # token ([CLS]) | first (patch 0, no [CLS]) | gap | map
    representation_size: int = 0         # >0: pre_logits dense + tanh
    hidden_act: str = "gelu_tanh"        # official vit_jax: tanh GELU; HF: exact ("gelu")
    layer_norm_eps: float = 1e-6         # official vit_jax 1e-6; HF 1e-12
    dropout_rate: float = 0.0
    attention_dropout_rate: float = 0.0
    dtype: str = "float32"
    qkv_bias: bool = True
    head_zero_init: bool = True
    # Hybrid ResNet-v2 stem (R50+ViT): block counts per stage, () for none.
    resnet_layers: tuple[int, ...] = ()
    resnet_width: int = 64
    # Relative schemes on the patch grid (2D, one table per axis).
    relative_buckets: int = 32
    relative_max_distance: int = 128
    tie_cls: bool = False
    rope_base: float = 10000.0           # axial RoPE: half of each head per grid axis
    pos_att_type: tuple[str, ...] = ("c2p", "p2c")
    max_relative_positions: int = 0      # 0: derived from the grid (max(gh, gw))
    position_buckets: int = 0
    share_att_key: bool = False
    norm_rel_ebd: bool = False
    gather: str = "shift"                # grids are not Toeplitz: shift, skew gather like take
    # Memory-bounded attention as TextConfig's (from blocked_attention_from tokens on, [CLS]
    # included; 0: never), for every scheme but DeBERTa's 2D one, which stays plain.
    attention_block_size: int = 512
    blocked_attention_from: int = 2048
    attention_impl: str = "auto"         # one of ATTENTION_IMPLS (above)
    pallas_interpret: bool = False       # run the Pallas kernel in its interpreter (any backend)
    remat: bool = False
    scan_layers: bool = False

    def __post_init__(self) -> None:
        for f in ("image_size", "patch_size"):
            v = getattr(self, f)
            v = (v, v) if isinstance(v, numbers.Integral) else v
            _check(isinstance(v, (tuple, list)) and len(v) == 2
                   and all(_is_int(s) and s > 0 for s in v), f, v,
                   "must be a positive int or a pair (height, width)")
            object.__setattr__(self, f, tuple(int(s) for s in v))
        object.__setattr__(self, "pos_att_type", _att_types(self.pos_att_type))
        _check(isinstance(self.resnet_layers, (tuple, list)), "resnet_layers",
               self.resnet_layers, "block counts per stage as a tuple, e.g. (3, 4, 9); () for none")
        object.__setattr__(self, "resnet_layers", tuple(self.resnet_layers))
        if self.max_relative_positions == 0:
            object.__setattr__(self, "max_relative_positions", max(self.grid_size))
        _check_common(self, VIT_SCHEMES)
        _check(self.pooling in POOLINGS, "pooling", self.pooling,
               f"choose one of {', '.join(POOLINGS)}")
        stride = self.stem_stride
        for axis, (s, p) in enumerate(zip(self.image_size, self.patch_size)):
            _check(s % (p * stride) == 0, "image_size", self.image_size,
                   f"side {s} must be divisible by patch_size {p}"
                   + (f" times the ResNet stem stride {stride}" if stride > 1 else ""))
        if SCHEMES[self.position_scheme].disentangled:
            _check(self.pooling != "token", "pooling", self.pooling,
                   "DeBERTa relative positions are defined between patches only; "
                   "use pooling='first', 'gap' or 'map' (no [CLS] token)")
        _check(self.num_channels > 0, "num_channels", self.num_channels, "must be > 0")
        if self.resnet_layers:
            _check(all(_is_int(n) and n > 0 for n in self.resnet_layers),
                   "resnet_layers", self.resnet_layers, "block counts must be positive ints")
            _check(self.resnet_width > 0, "resnet_width", self.resnet_width, "must be > 0")
            _check(self.resnet_width % 32 == 0, "resnet_width", self.resnet_width,
                   "must be a multiple of 32 (the stem's GroupNorms have 32 groups)")
        _check(self.num_classes >= 0, "num_classes", self.num_classes, "must be >= 0")
        _check(self.representation_size >= 0, "representation_size", self.representation_size,
               "must be >= 0")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def stem_stride(self) -> int:
        return stem_stride(self.resnet_layers)

    @property
    def grid_size(self) -> tuple[int, int]:
        s = self.stem_stride
        return (self.image_size[0] // (self.patch_size[0] * s),
                self.image_size[1] // (self.patch_size[1] * s))

    @property
    def pools_row_0(self) -> bool:
        """The pooling reads the encoder's row 0 alone: [CLS] ('token') or the first patch
        ('first', big_vision's ``pool_type='0'``)."""
        return self.pooling in ("token", "first")

    @property
    def num_tokens(self) -> int:
        gh, gw = self.grid_size
        return gh * gw + (1 if self.pooling == "token" else 0)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ViTConfig":
        return _from_dict(cls, d)


def _from_dict(cls, d: Mapping[str, Any]):
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} field(s) {unknown}: allowed are {sorted(names)}")
    return cls(**dict(d))
