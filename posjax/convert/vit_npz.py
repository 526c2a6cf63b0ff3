"""Official vision_transformer (vit_jax) ``.npz`` checkpoints -> posjax ViT.

Names (DESIGN.md §3.4): ``embedding/{kernel,bias}``, ``cls``,
``Transformer/posembed_input/pos_embedding``, ``Transformer/encoderblock_{i}/{LayerNorm_0,
MultiHeadDotProductAttention_1/{query,key,value,out}, LayerNorm_2, MlpBlock_3/Dense_{0,1}}``,
``Transformer/encoder_norm``, optional ``pre_logits`` and ``head``; hybrids add the ResNet-v2
stem ``conv_root``, ``gn_root``, ``block{s}/unit{u}/{conv,gn}{1,2,3,_proj}``. Files saved with
the optimizer carry everything under ``opt/target/`` (and its state under ``opt/state/``).

The npz holds no config: shapes give sizes, counts give depth and stages, ``cls`` present means
[CLS] pooling (else global average pooling). vit_jax uses tanh GELU and LayerNorm eps 1e-6.
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
_BLOCK = "Transformer/encoderblock_{}/"
_RESNET_UNIT = re.compile(r"^block(\d+)/unit(\d+)/")


def strip_optimizer_prefix(arrays: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray],
                                                                        set[str]]:
    """Params without the ``opt/target/`` prefix, and the optimizer-state names to ignore."""
    if not any(k.startswith(TARGET) for k in arrays):
        return dict(arrays), set()
    params = {k[len(TARGET):]: v for k, v in arrays.items() if k.startswith(TARGET)}
    state = {k for k in arrays if k.startswith(STATE)}
    rest = {k: v for k, v in arrays.items() if not k.startswith((TARGET, STATE))}
    params.update(rest)   # left for the unknown-tensor check
    return params, state


def _count(pattern: re.Pattern, names: set[str]) -> list[int]:
    return sorted({int(mt.group(1)) for n in names if (mt := pattern.match(n))})


def _resnet_layers(names: set[str]) -> tuple[int, ...]:
    stages: dict[int, int] = {}
    for n in names:
        if mt := _RESNET_UNIT.match(n):
            s, u = int(mt.group(1)), int(mt.group(2))
            stages[s] = max(stages.get(s, 0), u)
    return tuple(stages[s] for s in sorted(stages)) if stages else ()


def config_from_npz(arrays: Mapping[str, np.ndarray], source: str) -> ViTConfig:
    """ViTConfig at the checkpoint's own resolution (square grid from the position table)."""
    names = set(arrays)
    needed = ["embedding/kernel", "Transformer/posembed_input/pos_embedding",
              _BLOCK.format(0) + "MultiHeadDotProductAttention_1/query/kernel",
              _BLOCK.format(0) + "MlpBlock_3/Dense_0/kernel"]
    missing = [n for n in needed if n not in names]
    if missing:
        raise ValueError(f"{source}: missing array(s) {missing}: not an official vit_jax ViT "
                         "checkpoint")
    kernel = arrays["embedding/kernel"]
    _, heads, _ = arrays[needed[2]].shape
    depth = _count(re.compile(r"^Transformer/encoderblock_(\d+)/"), names)
    if depth != list(range(len(depth))):
        raise ValueError(f"{source}: encoder blocks {depth} are not numbered 0..N-1")
    resnet = _resnet_layers(names)
    has_cls = "cls" in names
    rows = arrays["Transformer/posembed_input/pos_embedding"].shape[1] - int(has_cls)
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
        pooling="token" if has_cls else "gap",
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


def npz_links(cfg: ViTConfig, names: set[str]) -> list[m.Link]:
    """vit_jax names -> posjax ViT paths (layouts are identical: both are Flax)."""
    links = _dense("embedding", ("embedding",))
    links.append(m.copy("Transformer/posembed_input/pos_embedding", ("pos_embedding",)))
    if cfg.pooling == "token":
        links.append(m.copy("cls", ("cls",)))
    for i in range(cfg.num_layers):
        b, ol = _BLOCK.format(i), ("encoder", f"layer_{i}")
        links += _norm(b + "LayerNorm_0", ol + ("attention_norm",))
        for name in ("query", "key", "value", "out"):
            links += _dense(b + "MultiHeadDotProductAttention_1/" + name,
                            ol + ("attention", name))
        links += _norm(b + "LayerNorm_2", ol + ("mlp_norm",))
        links += _dense(b + "MlpBlock_3/Dense_0", ol + ("mlp", "fc1"))
        links += _dense(b + "MlpBlock_3/Dense_1", ol + ("mlp", "fc2"))
    links += _norm("Transformer/encoder_norm", ("encoder_norm",))
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


def import_npz(arrays: Mapping[str, np.ndarray], source: str, task: str | None = None
               ) -> Pretrained:
    """Official vit_jax npz arrays -> Pretrained at the checkpoint's resolution. task='encoder'
    drops ``head`` (and keeps ``pre_logits``)."""
    arrays, ignored = strip_optimizer_prefix(arrays)
    cfg = config_from_npz(arrays, source)
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
    params = m.import_tensors(npz_links(cfg, set(arrays)), arrays, expected, source, ignored)
    return Pretrained(cfg, params, "vit", task)
