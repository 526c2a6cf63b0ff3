"""Parameter layout of the posjax models, in one place for ``init_from``
(posjax.training.init_from) and the converters (posjax.convert): the rules tied to parameter
names.

A parameter is named by its path in the params tree: a tuple (``flatten``) or JAX's key string
(``param_key``: ``"['encoder']['tupe_bias']['position_embeddings']"``). Here: which parameters
are heads a fine-tuning run may re-initialise (``HEAD_ROOTS``), ViT's [CLS] token (``CLS``) and
the [CLS] and prefix rows of position tables (``cls_row``, ``patch_table_prefix``,
``text_table_prefix``), a scanned layer stack (``SCANNED_LAYERS``, ``first_layers``), the
config fields that set each parameter's shape (``shape_fields``) and those that change what
the same parameters compute (``SAME_FUNCTION_FIELDS``; ``unread_scheme_settings``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from posjax.models.layout import STACKED
from posjax.models.schemes import scheme_fields

Path = tuple[str, ...]
Tree = dict[str, Any]
CLS = "['cls']"                       # ViT's [CLS] token (pooling="token")
SCANNED_LAYERS = f"['{STACKED}']"     # the layer stack of a scanned model (scan_layers=True)


def flatten(tree: Mapping[str, Any], prefix: Path = ()) -> dict[Path, Any]:
    """{path: leaf} of a nested mapping (an empty mapping has no leaves)."""
    out: dict[Path, Any] = {}
    for k, v in tree.items():
        if isinstance(v, Mapping):
            out.update(flatten(v, prefix + (k,)))
        else:
            out[prefix + (k,)] = v
    return out


def unflatten(flat: Mapping[Path, Any]) -> Tree:
    """The nested dict of ``flatten``'s {path: leaf}."""
    tree: Tree = {}
    for path, v in flat.items():
        node = tree
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = v
    return tree


def param_key(path: Path) -> str:
    """``path`` as JAX's key string (``jax.tree_util.keystr``): ``('a', 'b')`` -> ``['a']['b']``."""
    return "".join(f"[{k!r}]" for k in path)


def keyed(tree: Mapping[str, Any]) -> dict[str, Any]:
    """{``param_key``: leaf} of a params tree, in JAX's order (keys sorted at every level)."""
    return {param_key(path): leaf for path, leaf in sorted(flatten(tree).items())}


# Parameters a fine-tuning run may re-initialise (another number of classes, a new pooler):
# every other saved parameter must load with its shape, or the run would train a pretrained
# body around randomly initialised pieces.
HEAD_ROOTS = ("['classifier']", "['pooler']", "['mlm_head']", "['head']", "['pre_logits']",
              "['map_head']")
SHAPE_FIELDS = (("word_embeddings", ("vocab_size", "embedding_size")),
                 ("['embeddings']['position_embeddings']", ("max_position_embeddings",)),
                 ("['tupe_bias']['position_embeddings']", ("max_position_embeddings",)),
                 ("token_type_embeddings", ("type_vocab_size",)),
                 ("rel_embeddings", ("max_relative_positions", "position_buckets")),
                 ("relative_bias", ("relative_buckets",)),
                 ("['resnet']", ("resnet_layers", "resnet_width")),
                 ("['embedding']['kernel']", ("patch_size", "num_channels")))
WIDTH_FIELDS = ("hidden_size", "num_heads", "mlp_dim")


def shape_fields(key: str, saved_shape: tuple[int, ...] | None,
                  shape: tuple[int, ...] | None, target: dict[str, Any],
                  whole: bool = False) -> tuple[str, ...]:
    """The config.model fields that set the shape of the parameter ``key``, saved with
    ``saved_shape`` and ``shape`` in this model (None: absent on that side; ``target``: all
    this model's parameters). ``whole``: every saved layer must load (eval.py)."""
    if "['layer_" in key and (saved_shape is None or shape is None):
        return ("num_layers",)   # a layer only one side has
    is_vit = "['embedding']['kernel']" in target
    if is_vit and key.endswith(("['pos_embedding']", "['tupe_bias']['position_embeddings']")):
        fields = ("image_size", "patch_size", "hidden_size")   # a grid it could not resample
    else:
        fields = next((f for part, f in SHAPE_FIELDS if part in key), WIDTH_FIELDS)
    if key == "['embedding']['kernel']" and any(k.startswith("['resnet']") for k in target):
        fields = (*fields, "resnet_width")   # its input channels are the stem's output
    if "['layers']" in key and saved_shape is not None and shape is not None and (
            saved_shape[:1] < shape[:1] or (whole and saved_shape[:1] != shape[:1])):
        fields = ("num_layers", *fields)   # a deeper scanned stack (or any other depth)
    return fields


def cls_row(key: str, ndim: int) -> tuple[int, int] | None:
    """(axis, index) of the [CLS] row of a ViT position parameter ``key`` with ``ndim`` axes:
    ``pos_embedding`` (1, [CLS] + patches, H) row 0; TUPE's ``position_embeddings``
    (1 + [CLS] + patches, H) row 1; a relative-bias ``rel_bias`` (axes, buckets + [CLS], h)
    the last bucket. None for any other parameter."""
    if key.endswith("['pos_embedding']") and ndim == 3:
        return 1, 0
    if key.endswith("['tupe_bias']['position_embeddings']") and ndim == 2:
        return 0, 1
    if key.endswith("['rel_bias']") and ndim == 3:
        return 1, -1
    return None


def in_body(key: str) -> bool:
    """Whether parameter ``key`` must load for a fine-tuning run: not a head (``HEAD_ROOTS``)
    and not ViT's [CLS] token."""
    return not key.startswith(HEAD_ROOTS) and key != "['cls']"


def patch_table_prefix(key: str, num_prefix_tokens: int) -> int | None:
    """Rows before the patch rows of a per-token position table named ``key``; None if it is
    not one."""
    if key.endswith("['pos_embedding']"):
        return num_prefix_tokens
    if key.endswith("['tupe_bias']['position_embeddings']"):
        return 1 + num_prefix_tokens
    return None


def text_table_prefix(key: str) -> int | None:
    """Rows before the position rows of a text model's absolute position table ``key``: 0 for
    the input table (``['embeddings']['position_embeddings']['embedding']``, (rows, E)), 1 for
    TUPE's untied table (its [CLS] row 0, then rows 1 … rows); None for any other parameter."""
    if key.endswith("['embeddings']['position_embeddings']['embedding']"):
        return 0
    if key.endswith("['tupe_bias']['position_embeddings']"):
        return 1
    return None


def first_layers(key: str, saved_shape: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """A scanned layer stack of this model is shallower than the saved one: it takes the
    first layers, as an unrolled model takes layer_0 … layer_{n-1}."""
    return ("['layers']" in key and len(saved_shape) == len(shape) and len(shape) > 0
            and saved_shape[1:] == shape[1:] and saved_shape[0] > shape[0])


# Fields that change what the same parameters compute, which their shapes cannot show: for
# every model, and for each position scheme the fields it reads (the scheme table's).
SAME_FUNCTION_FIELDS = {
    "*": ("position_scheme", "hidden_act", "layer_norm_eps", "qkv_bias"),
    **scheme_fields(),
}


def unread_scheme_settings(cfg: Any) -> list[tuple[str, tuple[str, ...]]]:
    """(field, schemes that read it) for each scheme setting (``SAME_FUNCTION_FIELDS``) that
    ``cfg`` sets away from its default although its own position scheme does not read it
    (e.g. pos_att_type with bert_abs): such an override would change nothing."""
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    own = set(SAME_FUNCTION_FIELDS["*"]) | set(SAME_FUNCTION_FIELDS.get(cfg.position_scheme, ()))
    readers: dict[str, tuple[str, ...]] = {}
    for scheme, fields in SAME_FUNCTION_FIELDS.items():
        for field in fields:
            if scheme != "*" and field not in own:
                readers[field] = readers.get(field, ()) + (scheme,)
    return [(f, schemes) for f, schemes in readers.items() if getattr(cfg, f) != defaults[f]]
