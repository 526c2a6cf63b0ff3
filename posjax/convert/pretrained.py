"""What an import yields: a model config, plain float32 params and the module they belong to."""
from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from posjax.convert.mapping import check_tree
from posjax.layers.positions import resample_position_table
from posjax.models.config import TextConfig, ViTConfig
from posjax.models.layout import to_layout
from posjax.models.params import flatten, param_key, patch_table_prefix, unflatten
from posjax.models.text import TextEncoder, TextForMaskedLM, TextForSequenceClassification
from posjax.models.vit import ViT

KINDS = ("text", "vit")
TASKS = ("mlm", "classification", "encoder")


def build_module(kind: str, task: str, config: TextConfig | ViTConfig,
                 num_labels: int = 0) -> nn.Module:
    """The Flax module for (kind, task): text mlm -> TextForMaskedLM, classification ->
    TextForSequenceClassification(num_labels), encoder -> TextEncoder; vit -> ViT (its head, if
    any, is part of the config)."""
    if kind == "vit":
        if not isinstance(config, ViTConfig):
            raise ValueError(f"kind='vit' needs a ViTConfig, got {type(config).__name__}")
        return ViT(config)
    if kind != "text":
        raise ValueError(f"kind={kind!r} is not valid: choose one of {', '.join(KINDS)}")
    if not isinstance(config, TextConfig):
        raise ValueError(f"kind='text' needs a TextConfig, got {type(config).__name__}")
    if task == "mlm":
        return TextForMaskedLM(config)
    if task == "classification":
        if num_labels < 1:
            raise ValueError(f"num_labels={num_labels} is not valid for task='classification': "
                             "must be >= 1 (1 = regression)")
        return TextForSequenceClassification(config, num_labels)
    if task == "encoder":
        return TextEncoder(config)
    raise ValueError(f"task={task!r} is not valid: choose one of {', '.join(TASKS)}")


def expected_params(kind: str, task: str, config: TextConfig | ViTConfig,
                    num_labels: int = 0) -> dict[str, Any]:
    """Shapes (ShapeDtypeStruct tree) of ``nn.meta.unbox(module.init(...)['params'])``; nothing
    is allocated or compiled."""
    module = build_module(kind, task, config, num_labels)
    if kind == "vit":
        h, w = config.image_size
        args = (jnp.zeros((1, h, w, config.num_channels), jnp.float32),)
    else:
        ids = jnp.zeros((1, 2), jnp.int32)
        args = (ids, jnp.ones_like(ids))
    shapes = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), *args))
    return nn.meta.unbox(shapes["params"])


@dataclasses.dataclass(frozen=True)
class Pretrained:
    """An imported model: ``module().apply({'params': params}, ...)`` runs it.

    kind: 'text' | 'vit'; task: 'mlm' | 'classification' | 'encoder' (for ViT: 'classification'
    when the config has a head, else 'encoder'). params: nested dict of np.float32 arrays with
    exactly the structure of ``nn.meta.unbox(module().init(...)['params'])``.
    """

    config: TextConfig | ViTConfig
    params: dict[str, Any]
    kind: str
    task: str

    @property
    def num_labels(self) -> int:
        """Classifier outputs (text classification; 0 otherwise)."""
        bias = self.params.get("classifier", {}).get("bias")
        if self.kind == "text" and self.task == "classification" and bias is not None:
            return int(np.shape(bias)[0])
        return 0

    def module(self) -> nn.Module:
        return build_module(self.kind, self.task, self.config, self.num_labels)

    def without_head(self) -> "Pretrained":
        """The encoder alone (task 'encoder'): a text model keeps ``params['encoder']``; a ViT
        drops ``head`` (keeps ``pre_logits``) and gets ``num_classes=0``."""
        if self.task == "encoder":
            return self
        if self.kind == "vit":
            config = dataclasses.replace(self.config, num_classes=0)
            params = {k: v for k, v in self.params.items() if k != "head"}
        else:
            config, params = self.config, self.params["encoder"]
        check_tree(params, expected_params(self.kind, "encoder", config), "without_head")
        return Pretrained(config, params, self.kind, "encoder")

    def with_scan_layers(self, scan_layers: bool) -> "Pretrained":
        """The same model with ``config.scan_layers`` set and the layer params restacked
        (``posjax.models.layout``): values unchanged, only the tree layout differs."""
        if self.config.scan_layers == scan_layers:
            return self
        return Pretrained(dataclasses.replace(self.config, scan_layers=scan_layers),
                          to_layout(self.params, scan_layers), self.kind, self.task)


def resize_vit(pre: Pretrained, image_size: int | tuple[int, int],
               method: str = "bilinear") -> Pretrained:
    """The same ViT at another resolution: the grid rows of each learned absolute table are
    resampled to the new patch grid (``resample_position_table``), the rows before them kept:
    ``pos_embedding`` (1, [CLS] + grid, H), and TUPE's ``encoder/tupe_bias/position_embeddings``
    (its reset row, [CLS] and the grid, H): ``posjax.models.params.patch_table_prefix``, the
    rule ``init_from`` follows. Relative tables do not depend on the grid size."""
    if pre.kind != "vit":
        raise ValueError(f"image_size applies to ViT checkpoints only, this one is {pre.kind!r}")
    cfg = dataclasses.replace(pre.config, image_size=image_size)
    if cfg.image_size == pre.config.image_size:
        return pre
    num_prefix_tokens = int(cfg.pooling == "token")   # the [CLS] token

    def resample(table: Any, num_prefix_rows: int) -> np.ndarray:
        return np.asarray(resample_position_table(table, pre.config.grid_size, cfg.grid_size,
                                                  num_prefix_rows, method), np.float32)

    flat = flatten(pre.params)
    for path, table in flat.items():
        prefix = patch_table_prefix(param_key(path), num_prefix_tokens)
        if prefix is not None:
            flat[path] = resample(table, prefix)
    params = unflatten(flat)
    check_tree(params, expected_params(pre.kind, pre.task, cfg, pre.num_labels),
               f"resize to image_size={image_size}")
    return Pretrained(cfg, params, pre.kind, pre.task)
