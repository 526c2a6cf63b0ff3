"""ViT ``.npz`` checkpoints of the official vit_jax and big_vision code -> posjax ViT.

vit_jax names (docs/design.md §3.4): ``embedding/{kernel,bias}``, ``cls``,
``Transformer/posembed_input/pos_embedding``, ``Transformer/encoderblock_{i}/{LayerNorm_0,
MultiHeadDotProductAttention_1/{query,key,value,out}, LayerNorm_2, MlpBlock_3/Dense_{0,1}}``,
``Transformer/encoder_norm``, optional ``pre_logits`` and ``head``; hybrids add the ResNet-v2
stem ``conv_root``, ``gn_root``, ``block{s}/unit{u}/{conv,gn}{1,2,3,_proj}``. Files saved with
the optimizer carry everything under ``opt/target/`` (and its state under ``opt/state/``).

big_vision's ViT (models/vit.py) numbers its block modules from 0
(``MultiHeadDotProductAttention_0``, ``LayerNorm_1``, ``MlpBlock_0``), keeps ``pos_embedding``
at the top, adds it to the patches *before* the [CLS] token is prepended (so the token has no
position row: posjax's table gets a zero row for it, the same function), and pools with
``MAPHead_0/{probe, MultiHeadDotProductAttention_0, LayerNorm_0, MlpBlock_0}`` when the model
has one. A scanned encoder (``scan=True``) stacks the blocks as ``Transformer/encoderblock``
with a leading layer axis. Older checkpoints keep the table under ``Transformer/``, and some
have a [CLS] row in it (g² + 1 rows); both are read as big_vision's loader reads them. Its
training checkpoints hold the model under ``params/``; a two-tower checkpoint (SigLIP, LiT)
holds one ViT per tower (``img/``), chosen as ``file.npz:img``. Models with fixed sin-cos
positions (``posemb='sincos2d'``: no table) are refused.

The npz holds no config: shapes give sizes, counts give depth and stages, ``cls`` present means
[CLS] pooling, a MAP head MAP pooling, else global average pooling. big_vision's
``pool_type='0'`` (the first patch's row, no [CLS]) has the same parameters as 'gap' and cannot
be told apart from it: ``pooling='first'`` says so. Both codes use tanh GELU and LayerNorm eps
1e-6.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Mapping

import numpy as np

from posjax.convert import mapping as m
from posjax.convert.pretrained import Pretrained, expected_params
from posjax.models.config import ViTConfig

TARGET, STATE = "opt/target/", "opt/state/"
PARAMS = "params/"   # big_vision checkpoints saved with their optax state
_BLOCK = "Transformer/encoderblock_{}/"
_RESNET_UNIT = re.compile(r"^block(\d+)/unit(\d+)/")


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where one code keeps the position table, and how it names a block's modules."""

    name: str
    pos_embedding: str
    attention: str
    attention_norm: str
    mlp_norm: str
    mlp: str


VIT_JAX = Layout("vit_jax", "Transformer/posembed_input/pos_embedding",
                 "MultiHeadDotProductAttention_1", "LayerNorm_0", "LayerNorm_2", "MlpBlock_3")
BIG_VISION = Layout("big_vision", "pos_embedding", "MultiHeadDotProductAttention_0",
                    "LayerNorm_0", "LayerNorm_1", "MlpBlock_0")
_MAP = "MAPHead_0/"
_POOLING_EVIDENCE = {"token": "it has a 'cls' token", "map": f"it has {_MAP}probe",
                     "gap": "no 'cls' token, no MAP head"}


def strip_optimizer_prefix(arrays: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray],
                                                                        set[str]]:
    """Params without the ``opt/target/`` (vit_jax, Flax optimizer) or ``params/`` (big_vision,
    optax) prefix, and the optimizer-state names to ignore."""
    if any(k.startswith(PARAMS) for k in arrays):
        params = {k[len(PARAMS):]: v for k, v in arrays.items() if k.startswith(PARAMS)}
        return params, {k for k in arrays if not k.startswith(PARAMS)}
    if not any(k.startswith(TARGET) for k in arrays):
        return dict(arrays), set()
    params = {k[len(TARGET):]: v for k, v in arrays.items() if k.startswith(TARGET)}
    state = {k for k in arrays if k.startswith(STATE)}
    rest = {k: v for k, v in arrays.items() if not k.startswith((TARGET, STATE))}
    params.update(rest)   # left for the unknown-tensor check
    return params, state


def select_submodel(arrays: Mapping[str, np.ndarray], submodel: str | None, source: str
                    ) -> dict[str, np.ndarray]:
    """The arrays under ``<submodel>/`` (e.g. a two-tower checkpoint's ``img``), unprefixed;
    all of them when ``submodel`` is None, unless they are all under sub-models (then one
    ValueError naming them and the ``file.npz:<name>`` way to choose)."""
    if submodel:
        prefix = submodel.strip("/") + "/"
        chosen = {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}
        if not chosen:
            tops = sorted({k.split("/", 1)[0] for k in arrays})
            raise ValueError(f"{source}: no arrays under {prefix!r}; its top-level names are "
                             f"{tops[:8]}")
        return chosen
    tops = sorted({k.split("/", 1)[0] for k in arrays})
    if "embedding" not in tops and {"img", "txt"} & set(tops):
        raise ValueError(f"{source}: a checkpoint of several models ({', '.join(tops)}): "
                         f"choose the ViT with {source}:img")
    return dict(arrays)


_SCANNED = "Transformer/encoderblock/"


def unstack_scanned_blocks(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """big_vision's scanned encoder (``scan=True``: one ``Transformer/encoderblock`` whose
    arrays carry a leading layer axis) as numbered blocks ``encoderblock_{i}``."""
    out = {k: v for k, v in arrays.items() if not k.startswith(_SCANNED)}
    for name, stacked in arrays.items():
        if name.startswith(_SCANNED):
            for i, layer in enumerate(stacked):
                out[f"{_BLOCK.format(i)}{name[len(_SCANNED):]}"] = layer
    return out


def _table_at_the_top(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """big_vision's older checkpoints keep the table in the encoder (``Transformer/
    pos_embedding``, or ``Transformer/posembed_input/pos_embedding`` before that); its loader
    moves it to the top, as here."""
    out = dict(arrays)
    for old in ("Transformer/pos_embedding", "Transformer/posembed_input/pos_embedding"):
        if old in out and BIG_VISION.pos_embedding not in out:
            out[BIG_VISION.pos_embedding] = out.pop(old)
    return out


def table_has_cls_row(arrays: Mapping[str, np.ndarray], layout: Layout) -> bool:
    """Whether the position table holds a row for [CLS]: always in vit_jax; in big_vision only
    in its old checkpoints (g² + 1 rows: [CLS] prepended before the table was added)."""
    if "cls" not in arrays:
        return False
    rows = arrays[layout.pos_embedding].shape[1]
    return layout is VIT_JAX or (math.isqrt(rows) ** 2 != rows
                                 and math.isqrt(rows - 1) ** 2 == rows - 1)


def detect_layout(names: set[str], source: str) -> Layout:
    for layout in (VIT_JAX, BIG_VISION):
        if _BLOCK.format(0) + layout.attention + "/query/kernel" in names:
            return layout
    raise ValueError(f"{source}: no {_BLOCK.format(0)}MultiHeadDotProductAttention_{{0,1}}/"
                     "query/kernel: not a ViT checkpoint of the official vit_jax or big_vision "
                     "code")


def _count(pattern: re.Pattern, names: set[str]) -> list[int]:
    return sorted({int(mt.group(1)) for n in names if (mt := pattern.match(n))})


def _resnet_layers(names: set[str]) -> tuple[int, ...]:
    stages: dict[int, int] = {}
    for n in names:
        if mt := _RESNET_UNIT.match(n):
            s, u = int(mt.group(1)), int(mt.group(2))
            stages[s] = max(stages.get(s, 0), u)
    return tuple(stages[s] for s in sorted(stages)) if stages else ()


def config_from_npz(arrays: Mapping[str, np.ndarray], source: str,
                    layout: Layout) -> ViTConfig:
    """ViTConfig at the checkpoint's own resolution (square grid from the position table)."""
    names = set(arrays)
    if layout is BIG_VISION and layout.pos_embedding not in names:
        raise ValueError(f"{source}: no pos_embedding: a big_vision ViT with fixed sin-cos "
                         "position embeddings (posemb='sincos2d'), which posjax does not "
                         "implement")
    needed = ["embedding/kernel", layout.pos_embedding,
              _BLOCK.format(0) + layout.attention + "/query/kernel",
              _BLOCK.format(0) + layout.mlp + "/Dense_0/kernel"]
    missing = [n for n in needed if n not in names]
    if missing:
        raise ValueError(f"{source}: missing array(s) {missing}: not an official "
                         f"{layout.name} ViT checkpoint")
    kernel = arrays["embedding/kernel"]
    _, heads, _ = arrays[needed[2]].shape
    depth = _count(re.compile(r"^Transformer/encoderblock_(\d+)/"), names)
    if depth != list(range(len(depth))):
        raise ValueError(f"{source}: encoder blocks {depth} are not numbered 0..N-1")
    resnet = _resnet_layers(names)
    has_cls = "cls" in names
    pooling = "token" if has_cls else "map" if _MAP + "probe" in names else "gap"
    # vit_jax's table has a row for [CLS]; big_vision adds it before [CLS] is prepended.
    rows = arrays[layout.pos_embedding].shape[1] - int(table_has_cls_row(arrays, layout))
    grid = math.isqrt(rows)
    if grid * grid != rows:
        raise ValueError(f"{source}: position table has {rows} grid rows, not a square grid; "
                         "posjax infers image_size from a square grid only")
    stride = 4 * 2 ** (len(resnet) - 1) if resnet else 1
    size = (grid * kernel.shape[0] * stride, grid * kernel.shape[1] * stride)
    return ViTConfig(
        position_scheme="vit", image_size=size, patch_size=tuple(kernel.shape[:2]),
        num_channels=arrays["conv_root/kernel"].shape[2] if resnet else kernel.shape[2],
        hidden_size=kernel.shape[3], num_heads=heads, num_layers=len(depth),
        mlp_dim=arrays[needed[3]].shape[1],
        num_classes=arrays["head/kernel"].shape[1] if "head/kernel" in names else 0,
        pooling=pooling,
        representation_size=(arrays["pre_logits/kernel"].shape[1]
                              if "pre_logits/kernel" in names else 0),
        hidden_act="gelu_tanh", layer_norm_eps=1e-6, resnet_layers=resnet,
        resnet_width=arrays["conv_root/kernel"].shape[3] if resnet else 64)


def _dense(source: str, target: m.Path) -> list[m.Link]:
    return [m.copy(f"{source}/kernel", target + ("kernel",)),
            m.copy(f"{source}/bias", target + ("bias",))]


def _norm(source: str, target: m.Path) -> list[m.Link]:
    return [m.copy(f"{source}/scale", target + ("scale",)),
            m.copy(f"{source}/bias", target + ("bias",))]


def _attention_and_mlp(attention: str, mlp: str, target: m.Path) -> list[m.Link]:
    links = []
    for name in ("query", "key", "value", "out"):
        links += _dense(f"{attention}/{name}", target + ("attention", name))
    links += _dense(f"{mlp}/Dense_0", target + ("mlp", "fc1"))
    links += _dense(f"{mlp}/Dense_1", target + ("mlp", "fc2"))
    return links


def _cls_position_row(source: str) -> m.Link:
    """big_vision's table (1, N, H), added before [CLS] is prepended <-> posjax's (1, 1 + N, H)
    with a zero [CLS] row: the same sums."""
    return m.Link((source,), (("pos_embedding",),),
                  lambda t: (np.concatenate([np.zeros_like(t[:, :1]), t], axis=1),),
                  lambda t: (t[:, 1:],))


def npz_links(cfg: ViTConfig, names: set[str], layout: Layout, cls_row: bool
              ) -> list[m.Link]:
    """vit_jax / big_vision names -> posjax ViT paths (layouts are identical: all are Flax).
    ``cls_row``: the saved table has a [CLS] row (``table_has_cls_row``)."""
    links = _dense("embedding", ("embedding",))
    if cfg.pooling == "token" and not cls_row:
        links.append(_cls_position_row(layout.pos_embedding))
    else:
        links.append(m.copy(layout.pos_embedding, ("pos_embedding",)))
    if cfg.pooling == "token":
        links.append(m.copy("cls", ("cls",)))
    for i in range(cfg.num_layers):
        b, ol = _BLOCK.format(i), ("encoder", f"layer_{i}")
        links += _norm(b + layout.attention_norm, ol + ("attention_norm",))
        links += _norm(b + layout.mlp_norm, ol + ("mlp_norm",))
        links += _attention_and_mlp(b + layout.attention, b + layout.mlp, ol)
    links += _norm("Transformer/encoder_norm", ("encoder_norm",))
    if cfg.pooling == "map":
        links.append(m.copy(_MAP + "probe", ("map_head", "probe")))
        links += _norm(_MAP + "LayerNorm_0", ("map_head", "norm"))
        links += _attention_and_mlp(_MAP + "MultiHeadDotProductAttention_0", _MAP + "MlpBlock_0",
                                    ("map_head",))
    if cfg.representation_size:
        links += _dense("pre_logits", ("pre_logits",))
    if cfg.num_classes:
        links += _dense("head", ("head",))
    if cfg.resnet_layers:
        links.append(m.copy("conv_root/kernel", ("resnet", "conv_root", "kernel")))
        links += _norm("gn_root", ("resnet", "gn_root"))
        for n in sorted(names):   # units: block{s}/unit{u}/{conv*,gn*}/{kernel,scale,bias}
            if mt := _RESNET_UNIT.match(n):
                rest = n[mt.end():].split("/")
                links.append(m.copy(n, ("resnet", f"block{mt.group(1)}_unit{mt.group(2)}",
                                        *rest)))
    return links


def import_npz(arrays: Mapping[str, np.ndarray], source: str, task: str | None = None,
               submodel: str | None = None, pooling: str | None = None) -> Pretrained:
    """vit_jax or big_vision npz arrays -> Pretrained at the checkpoint's resolution.
    ``submodel``: the tower of a two-tower checkpoint (``img``). task='encoder' drops ``head``
    (and keeps ``pre_logits``). ``pooling``: None reads it from the arrays; 'first' for a
    big_vision model trained with ``pool_type='0'`` (its arrays look like 'gap')."""
    arrays, ignored = strip_optimizer_prefix(arrays)
    arrays = unstack_scanned_blocks(select_submodel(arrays, submodel, source))
    layout = detect_layout(set(arrays), source)
    if layout is BIG_VISION:
        arrays = _table_at_the_top(arrays)
    cfg = config_from_npz(arrays, source, layout)
    if pooling not in (None, cfg.pooling):
        if {pooling, cfg.pooling} != {"gap", "first"}:
            raise ValueError(
                f"{source}: pooling={pooling!r} does not fit the checkpoint, whose arrays say "
                f"{cfg.pooling!r} ({_POOLING_EVIDENCE[cfg.pooling]}); only a 'gap' checkpoint "
                "may be read as 'first' (big_vision's pool_type='0'): leave pooling unset")
        cfg = dataclasses.replace(cfg, pooling=pooling)
    if task not in (None, "classification", "encoder"):
        raise ValueError(f"task={task!r} is not valid for a ViT checkpoint: use 'classification' "
                         "or 'encoder'")
    if task == "classification" and not cfg.num_classes:
        raise ValueError(f"{source}: task='classification' needs head/kernel, which the "
                         "checkpoint lacks: use task='encoder'")
    if task == "encoder" and cfg.num_classes:
        cfg = dataclasses.replace(cfg, num_classes=0)
        ignored |= {"head/kernel", "head/bias"}
    task = "classification" if cfg.num_classes else "encoder"
    expected = expected_params("vit", task, cfg)
    links = npz_links(cfg, set(arrays), layout, table_has_cls_row(arrays, layout))
    params = m.import_tensors(links, arrays, expected, source, ignored, task)
    return Pretrained(cfg, params, "vit", task)
