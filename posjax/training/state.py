"""Train state, its shardings, sharded initialisation and ``init_from`` (pretrained params).

Sharded init: ``eval_shape`` of the boxed params gives the logical axis names -> NamedShardings
(``mesh.logical_shardings``); the optimizer state inherits each parameter's sharding
(``optax.tree_map_params``); ``jit(init, out_shardings=...)`` then materialises every array
directly on its devices, unboxed.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import pathlib
from typing import Any, Callable

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, Sharding

from posjax.data.common import local_path
from posjax.layers.positions import resample_position_table
from posjax.models.config import stem_stride
from posjax.models.layout import to_layout
from posjax.training import checkpoint as ckpt_lib
from posjax.training import mesh as mesh_lib
from posjax.training.tasks import Task


@flax.struct.dataclass
class TrainState:
    """step () int32; params and opt_state: fp32 trees (unboxed)."""

    step: jax.Array
    params: Any
    opt_state: Any


@jax.jit
def _all_finite(tree: Any) -> jax.Array:
    checks = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
              if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(checks)) if checks else jnp.array(True)


def all_finite(tree: Any) -> bool:
    """Whether every floating-point value in ``tree`` (e.g. a TrainState) is finite."""
    return bool(_all_finite(tree))


def _is_sharding(x: Any) -> bool:
    return isinstance(x, Sharding)


def abstract_state(task: Task, model: nn.Module, tx: optax.GradientTransformation,
                   mesh: Mesh, seed: int) -> tuple[TrainState, TrainState]:
    """(abstract state with shardings attached, the state's NamedShardings) — no compute."""
    batch = {k: jnp.asarray(v) for k, v in task.dummy_batch(mesh_lib.batch_shards(mesh)).items()}
    boxed = jax.eval_shape(lambda: task.init_params(model, jax.random.PRNGKey(seed), batch))
    param_shardings = mesh_lib.logical_shardings(boxed, mesh)
    params = nn.unbox(boxed)
    opt_state = jax.eval_shape(tx.init, params)
    replicated = mesh_lib.replicated(mesh)
    opt_shardings = optax.tree_utils.tree_map_params(
        tx, lambda _, s: s, opt_state, param_shardings,
        transform_non_params=lambda _: replicated, is_leaf=_is_sharding)
    shardings = TrainState(step=replicated, params=param_shardings, opt_state=opt_shardings)
    shapes = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=params,
                        opt_state=opt_state)
    abstract = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            shapes, shardings)
    return abstract, shardings


def init_state(task: Task, model: nn.Module, tx: optax.GradientTransformation, mesh: Mesh,
               shardings: TrainState, seed: int) -> TrainState:
    """Fresh state, initialised inside jit straight onto its shardings (params from ``seed``)."""
    batch_size = mesh_lib.batch_shards(mesh)

    def init() -> TrainState:
        batch = {k: jnp.asarray(v) for k, v in task.dummy_batch(batch_size).items()}
        params = nn.unbox(task.init_params(model, jax.random.PRNGKey(seed), batch))
        return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                          opt_state=tx.init(params))

    # Initialisation needs no activation constraints: out_shardings place every array.
    with jax.set_mesh(mesh):
        return jax.jit(init, out_shardings=shardings)()


# ----------------------------------------------------------------------------- init_from


def pretrained_location(path: str | pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """(orbax checkpoint holding a top-level ``params`` tree, its model-config JSON) for
    ``init_from``: a converter folder (``params/`` + ``model_config.json``) or a train.py
    workdir (the latest ``checkpoints/<step>/state`` + ``config.json``)."""
    root = local_path(path, "init_from")
    if (root / "params").is_dir():
        return root / "params", root / "model_config.json"
    steps = sorted(int(p.name) for p in (root / "checkpoints").glob("*")
                   if p.name.isdigit() and (p / "state").is_dir())
    if steps:
        return root / "checkpoints" / str(steps[-1]) / "state", root / "config.json"
    published = root.suffix == ".npz" or ((root / "config.json").is_file() and any(
        (root / name).is_file() for name in ("model.safetensors", "pytorch_model.bin",
                                               "model.safetensors.index.json",
                                               "pytorch_model.bin.index.json")))
    convert = (f": it looks like published weights (a Hugging Face folder or an .npz); convert "
               f"them first, python -m posjax.convert --from {str(path)} --to CKPT, then give "
               "init_from=CKPT" if published else "")
    raise ValueError(f"init_from={str(path)!r}: neither a converter folder (params/ + "
                     "model_config.json) nor a train.py workdir with checkpoints/<step>/state"
                     + convert)


def init_from_fingerprint(path: str | pathlib.Path) -> str | None:
    """A digest of what ``init_from`` holds (``pretrained_location``): the names and sizes of
    the checkpoint's files (Orbax names data files afresh at each save, so another checkpoint
    of the same model shows) and the model config. None when there is no such checkpoint."""
    try:
        params_dir, cfg_file = pretrained_location(path)
    except ValueError:
        return None
    digest = hashlib.sha256()
    for file in sorted(f for f in params_dir.rglob("*") if f.is_file()):
        digest.update(f"{file.relative_to(params_dir)}\0{file.stat().st_size}\0".encode())
    if cfg_file.is_file():
        digest.update(cfg_file.read_bytes())
    return digest.hexdigest()[:16]


def _saved_tree(path: str | pathlib.Path, params_dir: pathlib.Path) -> dict[str, Any]:
    """The metadata tree (shapes, dtypes) of the checkpoint at ``params_dir``; it must hold a
    top-level ``params`` tree."""
    try:
        tree = ckpt_lib.read_metadata_tree(params_dir)
    except ValueError as e:
        raise ValueError(f"init_from={str(path)!r}: {e}") from None
    if "params" not in tree:
        raise ValueError(f"init_from={str(path)!r}: {params_dir} holds no 'params' tree "
                         f"(top-level keys {sorted(tree)})")
    return tree


def check_init_from(path: str | pathlib.Path, target_params: Any,
                    grid: tuple[int, int] | None = None, model_config: Any = None,
                    whole: bool = False) -> None:
    """Raise one ValueError when no encoder parameter saved at ``path`` would be loaded into
    a model with ``target_params`` (abstract shapes are enough): e.g. a text checkpoint for a
    ViT, or another model width; or when this run's ``model_config`` (a TextConfig /
    ViTConfig) would compute another function with the same parameters than the model saved
    there (``function_mismatches``). ``whole`` (eval.py on the pretrained weights): every
    parameter must load, heads included (a position table may be resampled), none may be left
    over, and a ViT must pool as the saved one. Reads only the checkpoint's metadata and
    config."""
    params_dir, cfg_file = pretrained_location(path)
    saved = _saved_tree(path, params_dir)["params"]
    saved_cfg = _pretrained_config(cfg_file)
    saved_model = _saved_model_config(saved_cfg)
    with_pooler = "pooler" in saved   # a text classifier's: its activation then matters
    # A train.py run left out only fields at their defaults; a model_config.json may be partial.
    missing_are_defaults = cfg_file.name == "config.json" and cfg_file.is_file()
    mismatches = (function_mismatches(saved_model, model_config, with_pooler,
                                      missing_are_defaults=missing_are_defaults, heads=whole)
                  if model_config else [])
    if mismatches:
        theirs = ", ".join(f"{f}={value!r}" for f, value, _ in mismatches)
        ours = ", ".join(f"{f}={value!r}" for f, _, value in mismatches)
        flags = " ".join(f"--config.model.{f}={_flag(v)}" for f, v, _ in mismatches)
        raise ValueError(
            f"init_from={str(path)!r}: the pretrained model ({cfg_file.name} there) has "
            f"{theirs} where this run's config.model has {ours}: its weights would compute "
            f"another function here. Give config.model the pretrained values: {flags}")
    target = _flatten(target_params)
    scanned = any("['layers']" in key for key in target)
    shapes = jax.tree_util.tree_map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype),
                                    dict(saved), is_leaf=lambda x: hasattr(x, "shape"))
    shapes = _flatten(jax.eval_shape(lambda t: to_layout(t, scanned), shapes))
    shapes = encoder_rooted(shapes, target)
    num_prefix_tokens = 1 if "['cls']" in target else 0
    saved_cls = "['cls']" in shapes
    # The encoder is what a pretrained model is for: a head or a bias that happens to fit
    # alone does not make a checkpoint usable.
    encoder = [k for k in target if k.startswith("['encoder']")] or list(target)

    def fits(key: str) -> bool:
        if tuple(shapes[key].shape) == tuple(target[key].shape):
            return True
        # Evaluating the weights as they are may not drop saved layers.
        return jax.eval_shape(lambda old, fresh: _adapted(
            key, old, fresh, saved_cls, num_prefix_tokens, grid, saved_cfg,
            first_layers=not whole)[0], shapes[key], target[key]) is not None

    if not any(key in shapes and fits(key) for key in encoder):
        scheme = (f" (its position_scheme is {saved_model['position_scheme']!r})"
                  if "position_scheme" in saved_model else "")
        raise ValueError(
            f"init_from={str(path)!r}: none of its {len(shapes)} parameters fits this model's "
            f"encoder{scheme}: give config.model the pretrained model's "
            f"architecture (see {cfg_file.name} there), or start without init_from")

    def advice(keys: list[str]) -> str:   # what to give config.model for these misfits
        return _advice(sorted({f for k in keys for f in _shape_fields(
            k, tuple(shapes[k].shape) if k in shapes else None,
            tuple(target[k].shape) if k in target else None, target, whole)
            if model_config is None or hasattr(model_config, f)}),
            cfg_file, saved_model, model_config, missing_are_defaults)

    if not whole:
        _check_body(path, shapes, target, fits, advice)
    else:
        bad = [k for k in target if not (k in shapes and fits(k))]
        left_over = sorted(set(shapes) - set(target))
        body = [k for k in bad + left_over if _in_body(k)]
        _check_whole(path, cfg_file, [_misfit(k, shapes, target) for k in bad], left_over,
                     advice(body) if body else None)


# Parameters a fine-tuning run may re-initialise (another number of classes, a new pooler):
# every other saved parameter must load with its shape, or the run would train a pretrained
# body around randomly initialised pieces.
HEAD_ROOTS = ("['classifier']", "['pooler']", "['mlm_head']", "['head']", "['pre_logits']",
              "['map_head']")
_SHAPE_FIELDS = (("word_embeddings", ("vocab_size", "embedding_size")),
                 ("['embeddings']['position_embeddings']", ("max_position_embeddings",)),
                 ("['tupe_bias']['position_embeddings']", ("max_position_embeddings",)),
                 ("token_type_embeddings", ("type_vocab_size",)),
                 ("rel_embeddings", ("max_relative_positions", "position_buckets")),
                 ("relative_bias", ("relative_buckets",)),
                 ("['resnet']", ("resnet_layers", "resnet_width")),
                 ("['embedding']['kernel']", ("patch_size", "num_channels")))
_WIDTH_FIELDS = ("hidden_size", "num_heads", "mlp_dim")


def _shape_fields(key: str, saved_shape: tuple[int, ...] | None,
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
        fields = next((f for part, f in _SHAPE_FIELDS if part in key), _WIDTH_FIELDS)
    if key == "['embedding']['kernel']" and any(k.startswith("['resnet']") for k in target):
        fields = (*fields, "resnet_width")   # its input channels are the stem's output
    if "['layers']" in key and saved_shape is not None and shape is not None and (
            saved_shape[:1] < shape[:1] or (whole and saved_shape[:1] != shape[:1])):
        fields = ("num_layers", *fields)   # a deeper scanned stack (or any other depth)
    return fields


def _advice(fields: list[str], cfg_file: pathlib.Path, saved_model: dict[str, Any],
            model_config: Any, missing_are_defaults: bool) -> str:
    """What to give config.model so that parameters shaped by ``fields`` load: "the pretrained
    model's values: --config.model.F=V ..." where the saved config (``saved_model``, from
    ``cfg_file``) holds them (all fields for a train.py ``config.json``,
    ``missing_are_defaults``), else the fields' names."""
    try:
        saved = type(model_config).from_dict(saved_model) if model_config else None
    except (ValueError, TypeError):
        saved = None
    known = [f for f in fields if saved is not None and (missing_are_defaults or f in saved_model)]
    flags = [f"--config.model.{f}={_flag(getattr(saved, f))}" for f in known
             if getattr(saved, f) != getattr(model_config, f)]
    unknown = [f for f in fields if f not in known]
    pronoun = "it" if len(unknown) == 1 else "them"
    where = (f"there is no {cfg_file.name} there to say {pronoun}" if not cfg_file.is_file()
             else f"{cfg_file.name} there does not say {pronoun}" if saved is not None
             else f"see {cfg_file.name} there, which is not a config of this kind of model")
    whose = "its" if flags else "the pretrained model's"
    parts = ([f"the pretrained model's values: {' '.join(flags)}"] if flags else []) + (
        [f"{whose} {', '.join(unknown)} ({where})"] if unknown else [])
    # No parts: the saved values agree, yet the shapes differ.
    return " and ".join(parts) or f"the pretrained model's architecture (see {cfg_file.name})"


def _check_body(path: str | pathlib.Path, shapes: dict[str, Any], target: dict[str, Any],
                fits: Callable[[str], bool], advice: Callable[[list[str]], str]) -> None:
    """One ValueError when a parameter of this model outside its heads (``HEAD_ROOTS``; and
    ViT's [CLS] token) would not load from the checkpoint: another shape, or none there (more
    layers, token types the checkpoint lacks); ``advice(keys)`` says what to give
    config.model (``_advice``)."""
    bad = [k for k in target if _in_body(k) and not (k in shapes and fits(k))]
    if not bad:
        return
    misfits = [_misfit(k, shapes, target) for k in bad]
    more = f" and {len(misfits) - 5} more" if len(misfits) > 5 else ""
    raise ValueError(
        f"init_from={str(path)!r}: {len(misfits)} parameter(s) of this model outside its heads "
        f"would not load from the pretrained model and would keep a random init: "
        f"{', '.join(misfits[:5])}{more}. Give config.model {advice(bad)}, or start without "
        "init_from")


def _cls_row(key: str, ndim: int) -> tuple[int, int] | None:
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


def _in_body(key: str) -> bool:
    """Whether parameter ``key`` must load for a fine-tuning run: not a head (``HEAD_ROOTS``)
    and not ViT's [CLS] token."""
    return not key.startswith(HEAD_ROOTS) and key != "['cls']"


def _misfit(key: str, shapes: dict[str, Any], target: dict[str, Any]) -> str:
    """``key`` with its saved and its shape here, or that the checkpoint lacks it."""
    if key not in shapes:
        return f"{key} (not in the checkpoint)"
    return f"{key} (saved {tuple(shapes[key].shape)}, here {tuple(target[key].shape)})"


def _match_cls_rows(key: str, old: Any, fresh: Any, saved_cls: bool) -> Any:
    """``old`` (a saved ViT position parameter, ``_cls_row``) without its [CLS] row
    (``saved_cls``), or with this model's initial one (``fresh``'s) inserted."""
    axis, index = _cls_row(key, old.ndim)
    if saved_cls:
        return jnp.delete(jnp.asarray(old), index % old.shape[axis], axis=axis)
    index %= fresh.shape[axis]
    cls = jax.lax.slice_in_dim(jnp.asarray(fresh, old.dtype), index, index + 1, axis=axis)
    return jnp.concatenate([jax.lax.slice_in_dim(jnp.asarray(old), 0, index, axis=axis), cls,
                            jax.lax.slice_in_dim(jnp.asarray(old), index, None, axis=axis)],
                           axis=axis)


def _adapted(key: str, old: Any, fresh: Any, saved_cls: bool, num_prefix_tokens: int,
             grid: tuple[int, int] | None, pretrained_config: dict[str, Any],
             first_layers: bool = True) -> tuple[Any, list[str]]:
    """(``old``, the saved value of ``key``, in the shape of this model's ``fresh``, or None
    where it cannot be; what was done to it). In this order: a ViT position parameter saved for
    another pooling (``saved_cls``: the checkpoint has a [CLS] token) loses its [CLS] row or
    gets ``fresh``'s (``_cls_row``); a deeper scanned stack gives its first layers
    (``first_layers``); a patch-position table is resampled to ``grid`` (``_resampling``).
    Traceable, so that ``jax.eval_shape`` tells from shapes alone whether a parameter loads."""
    done = []
    if _cls_row(key, old.ndim) is not None and saved_cls != bool(num_prefix_tokens):
        old = _match_cls_rows(key, old, fresh, saved_cls)
        done.append(f"[CLS] row {'dropped' if saved_cls else 'from the init'} "
                    f"(this model pools {'without' if saved_cls else 'on'} [CLS])")
    if first_layers and _first_layers(key, tuple(old.shape), tuple(fresh.shape)):
        done.append(f"the first {fresh.shape[0]} of the saved layers ({old.shape[0]})")
        old = old[:fresh.shape[0]]
    resampling = (None if tuple(old.shape) == tuple(fresh.shape) else
                  _resampling(key, old.shape, fresh.shape, grid, num_prefix_tokens,
                              pretrained_config))
    if resampling is not None:
        old_grid, prefix = resampling
        old = resample_position_table(jnp.asarray(old), old_grid, grid, num_prefix_tokens=prefix)
        done.append(f"resampled grid {old_grid} -> {grid}")
    return (old if tuple(old.shape) == tuple(fresh.shape) else None), done


def _first_layers(key: str, saved_shape: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """A scanned layer stack of this model is shallower than the saved one: it takes the
    first layers, as an unrolled model takes layer_0 … layer_{n-1}."""
    return ("['layers']" in key and len(saved_shape) == len(shape) and len(shape) > 0
            and saved_shape[1:] == shape[1:] and saved_shape[0] > shape[0])


def _check_whole(path: str | pathlib.Path, cfg_file: pathlib.Path, not_loaded: list[str],
                 left_over: list[str], body_advice: str | None, shown: int = 5) -> None:
    """One ValueError when evaluating the weights at ``path`` as they are would run parameters
    they do not hold (``not_loaded``: random init) or leave some of theirs out (``left_over``,
    e.g. a pre_logits layer the head reads, or layers). ``body_advice``: what to give
    config.model where the misfits are not all in the heads (``_advice``)."""
    if not (not_loaded or left_over):
        return
    parts = [f"{len(keys)} parameter(s) {what}: {', '.join(keys[:shown])}"
             + (f" and {len(keys) - shown} more" if len(keys) > shown else "")
             for keys, what in ((not_loaded, "of this model would keep a random init"),
                                (left_over, "of the checkpoint would be left out"))
             if keys]
    advice = (f"Give config.model {body_advice}, or train" if body_advice else
              f"Give config.model the pretrained model's heads (see {cfg_file.name} there: "
              "num_classes / num_labels, pooling, representation_size), or fine-tune them")
    raise ValueError(
        f"init_from={str(path)!r}: eval.py evaluates these weights as they are, but "
        + "; ".join(parts) + f". {advice} with train.py")


def _resampling(key: str, saved_shape: tuple[int, ...], shape: tuple[int, ...],
                grid: tuple[int, int] | None, num_prefix_tokens: int,
                pretrained_config: dict[str, Any]) -> tuple[tuple[int, int], int] | None:
    """(saved grid, rows before the patch rows) when the table saved as ``key`` is a
    patch-position table to resample to ``grid``; None when it is not one, or its saved grid
    cannot be told (it then keeps its init)."""
    prefix = _patch_table_prefix(key, num_prefix_tokens)
    if grid is None or prefix is None or len(saved_shape) != len(shape) \
            or saved_shape[-1] != shape[-1]:
        return None
    try:
        return _grid(pretrained_config, saved_shape[-2] - prefix), prefix
    except ValueError:   # e.g. a [CLS] row in the checkpoint and none here
        return None


def _pretrained_config(cfg_file: pathlib.Path) -> dict[str, Any]:
    return json.loads(cfg_file.read_text()) if cfg_file.exists() else {}


def _saved_model_config(saved: dict[str, Any]) -> dict[str, Any]:
    """The model section of a saved config: ``model`` in a train.py workdir's config.json,
    ``config`` in the converter's model_config.json."""
    return saved.get("model", saved.get("config", saved))


# Fields that change what the same parameters compute, which their shapes cannot show: for
# every model, and for the position schemes that read them.
SAME_FUNCTION_FIELDS = {
    "*": ("position_scheme", "hidden_act", "layer_norm_eps", "qkv_bias"),
    "bert_rel": ("relative_buckets", "relative_max_distance"),
    "tupe_a": ("tie_cls",),
    "tupe_r": ("relative_buckets", "relative_max_distance", "tie_cls"),
    "deberta": ("pos_att_type", "max_relative_positions", "position_biased_input"),
    "deberta_v2": ("pos_att_type", "max_relative_positions", "position_buckets",
                   "share_att_key", "norm_rel_ebd", "position_biased_input", "conv_act"),
}


def function_mismatches(saved: dict[str, Any], model_config: Any, with_pooler: bool = False,
                        missing_are_defaults: bool = False, heads: bool = False
                        ) -> list[tuple[str, Any, Any]]:
    """(field, saved value, this value) for each field in which ``model_config`` (TextConfig /
    ViTConfig) computes differently from the saved model config ``saved`` with the same
    parameters: the activation, the LayerNorm epsilon, the position scheme and the settings
    of its scheme, and of the saved scheme where that differs (``SAME_FUNCTION_FIELDS``), so
    that one error lists every override; the pooler's activation when the checkpoint has a
    pooler (``with_pooler``). Only the fields ``saved`` holds are compared, unless
    ``missing_are_defaults`` (a train.py run's config, which leaves out fields at their
    defaults). Empty when ``saved`` is not a config of the same kind (the parameter shapes then
    decide) or agrees in all of them. Dropout, dtype, the gather strategy, remat, layer
    scanning and the heads may differ (``heads``: not a ViT's pooling)."""
    try:
        theirs = type(model_config).from_dict(saved)
    except (ValueError, TypeError):
        return []
    fields = (SAME_FUNCTION_FIELDS["*"] + (("pooler_act",) if with_pooler else ())
              + (("pooling",) if heads else ()))
    schemes = (model_config.position_scheme,
               *((theirs.position_scheme,) if "position_scheme" in saved
                 or missing_are_defaults else ()))
    for scheme in dict.fromkeys(schemes):
        fields += tuple(f for f in SAME_FUNCTION_FIELDS.get(scheme, ()) if f not in fields)
    if not missing_are_defaults:
        fields = tuple(f for f in fields if f in saved)
    if getattr(model_config, "grid_size", None) != getattr(theirs, "grid_size", None):
        fields = tuple(f for f in fields if f != "max_relative_positions")   # ViT: from the grid
    if not (getattr(theirs, "conv_kernel_size", 0)
            and getattr(model_config, "conv_kernel_size", 0)):
        fields = tuple(f for f in fields if f != "conv_act")
    return [(f, getattr(theirs, f), getattr(model_config, f)) for f in fields
            if hasattr(model_config, f) and not _same_value(f, getattr(theirs, f),
                                                             getattr(model_config, f))]


def _same_value(field: str, a: Any, b: Any) -> bool:
    return set(a) == set(b) if field == "pos_att_type" else a == b   # an unordered choice


def _flag(value: Any) -> str:
    """``value`` as a shell passes it to a --config.model override: a tuple (pos_att_type) as
    a quoted Python literal, which ml_collections parses back to the tuple."""
    return f'"{value!r}"' if isinstance(value, tuple) else str(value)


def read_pretrained(path: str | pathlib.Path, target_params: Any, param_shardings: Any
                    ) -> tuple[dict[str, np.ndarray | jax.Array], dict[str, Any]]:
    """Params saved by the converter (``<path>/params``: orbax StandardCheckpointer of
    ``{'params': tree}``, plus ``<path>/model_config.json``) or by train.py (``<path>`` a
    workdir: the latest checkpoint's ``params``), as {keystr path: array}.

    Leaves whose path and shape match the target are restored straight onto the target's
    sharding; the others are restored replicated (they may be resampled or skipped).
    """
    import orbax.checkpoint as ocp

    params_dir, cfg_file = pretrained_location(path)
    tree = _saved_tree(path, params_dir)
    target = _flatten(target_params)
    shardings = _flatten(param_shardings)
    any_sharding = next(iter(shardings.values()))
    replicated = NamedSharding(any_sharding.mesh, jax.sharding.PartitionSpec())

    def abstract(path, m):
        key = jax.tree_util.keystr(path)
        shape = tuple(m.shape)
        same = key in target and tuple(target[key].shape) == shape
        return jax.ShapeDtypeStruct(shape, m.dtype,
                                    sharding=shardings[key] if same else replicated)

    # Only the params: a train.py checkpoint also holds the optimizer moments (2x the params),
    # which would otherwise be read and replicated on every device for nothing.
    item = {"params": jax.tree_util.tree_map_with_path(
        abstract, dict(tree["params"]), is_leaf=lambda x: hasattr(x, "shape"))}
    args = ocp.args.PyTreeRestore(item=item, partial_restore=True,
                                  restore_args=ocp.checkpoint_utils.construct_restore_args(item))
    loaded = ckpt_lib.read_item(params_dir, ocp.PyTreeCheckpointHandler(),
                                lambda handler: handler.restore(params_dir, args=args))
    # Either layer layout loads into either (scan_layers on one side only): restack.
    target_scanned = any("['layers']" in key for key in target)
    loaded = {"params": to_layout(loaded["params"], target_scanned)}
    return _flatten(loaded["params"]), _pretrained_config(cfg_file)


def encoder_rooted(loaded: dict[str, Any], model_keys: Any) -> dict[str, Any]:
    """A bare text-encoder checkpoint (converter task 'encoder': keys ``['embeddings']...``)
    seen from a task model holding its encoder under ``['encoder']`` (MLM, GLUE); other
    checkpoints unchanged."""
    if any(k in model_keys for k in loaded):
        return loaded
    prefixed = {f"['encoder']{k}": v for k, v in loaded.items()}
    return prefixed if any(k in model_keys for k in prefixed) else loaded


def merge_pretrained(params: Any, loaded: dict[str, Any], shardings: Any,
                     pretrained_config: dict[str, Any], grid: tuple[int, int] | None = None
                     ) -> tuple[Any, list[str]]:
    """Replace leaves of ``params`` by ``loaded`` ones with the same path (a bare text-encoder
    checkpoint is first placed under ``['encoder']``, see ``encoder_rooted``).

    Same shape: taken as is. A patch-position table with another token count, when this model
    has a patch ``grid`` (gh, gw): resampled to that grid (bilinear, vit_jax convention). That
    is ViT's ``pos_embedding`` (1, P + gh·gw, H), whose [CLS] row (P = 1 when the model has a
    ``cls`` parameter) is kept, and TUPE's ``position_embeddings`` (1 + P + gh·gw, H), whose
    extra first row is kept too. The old grid comes from the pretrained model config, else
    it must be square. A ViT position table saved for another pooling first loses its [CLS]
    row, or gets this model's initial one; a scanned layer stack shallower than the saved one
    takes its first layers (``_adapted``, which ``check_init_from`` runs on shapes).
    Any other shape mismatch (e.g. a new ``num_classes`` head) or absence keeps the fresh init,
    and so does a ``head`` that read ``pre_logits`` features in one model and not in the other
    (a ViT fine-tuned without the pre-training representation layer gets a fresh head).
    Returns (params, log lines).
    """
    flat_shardings = _flatten(shardings)
    loaded = encoder_rooted(loaded, flat_shardings)
    num_prefix_tokens = 1 if "['cls']" in flat_shardings else 0
    saved_cls = "['cls']" in loaded
    notes = []
    used = set()

    def has_pre_logits(keys: Any) -> bool:
        return any(k.startswith("['pre_logits']") for k in keys)

    head_reads_other_features = has_pre_logits(loaded) != has_pre_logits(flat_shardings)

    def pick(path, fresh):
        key = jax.tree_util.keystr(path)
        if key not in loaded:
            notes.append(f"{key}: not in the checkpoint, keeps its init {tuple(fresh.shape)}")
            return fresh
        used.add(key)
        if head_reads_other_features and key.startswith("['head']"):
            notes.append(f"{key}: read pre_logits features in the checkpoint, this model has "
                         "no pre_logits (or the reverse); keeps its init")
            return fresh
        value, done = _adapted(key, loaded[key], fresh, saved_cls, num_prefix_tokens, grid,
                               pretrained_config)
        if value is not None:
            if done:
                notes.append(f"{key}: " + "; ".join(done))
            return jax.device_put(jnp.asarray(value, fresh.dtype), flat_shardings[key])
        notes.append(f"{key}: shape {tuple(loaded[key].shape)} in the checkpoint, "
                     f"{tuple(fresh.shape)} here; keeps its init")
        return fresh

    merged = jax.tree_util.tree_map_with_path(pick, params)
    notes += [f"{k}: in the checkpoint but not in this model, ignored"
              for k in sorted(set(loaded) - used)]
    return merged, notes


def _patch_table_prefix(key: str, num_prefix_tokens: int) -> int | None:
    """Rows before the patch rows of a per-token position table named ``key``; None if it is
    not one."""
    if key.endswith("['pos_embedding']"):
        return num_prefix_tokens
    if key.endswith("['tupe_bias']['position_embeddings']"):
        return 1 + num_prefix_tokens
    return None


def _grid(model_cfg: dict[str, Any], tokens: int) -> tuple[int, int]:
    """Patch grid: from image_size / (patch_size · the ResNet stem's stride) in a (possibly
    nested) model config, else square."""
    cfg = model_cfg.get("model", model_cfg.get("config", model_cfg))
    if "image_size" in cfg and "patch_size" in cfg:
        size = cfg["image_size"]
        patch = cfg["patch_size"]
        size = (size, size) if isinstance(size, int) else tuple(size)
        patch = (patch, patch) if isinstance(patch, int) else tuple(patch)
        stride = stem_stride(cfg.get("resnet_layers") or ())
        grid = (size[0] // (patch[0] * stride), size[1] // (patch[1] * stride))
        if grid[0] * grid[1] == tokens:
            return grid
    side = math.isqrt(tokens)
    if side * side != tokens:
        raise ValueError(f"cannot infer the patch grid of a position table with {tokens} patch "
                         "rows: give image_size and patch_size in model_config.json")
    return side, side


def _flatten(tree: Any) -> dict[str, Any]:
    return {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(tree)}


def load_init_from(state: TrainState, path: str, shardings: TrainState,
                   grid: tuple[int, int] | None = None) -> TrainState:
    """``state`` with the params of ``path`` merged in (``merge_pretrained``; ``grid``: this
    model's patch grid, for models on images); one WARNING when some are not taken as they are
    (see ``init_from_summary``)."""
    loaded, pretrained_cfg = read_pretrained(path, state.params, shardings.params)
    params, notes = merge_pretrained(state.params, loaded, shardings.params, pretrained_cfg,
                                     grid)
    if notes:
        logging.warning("%s", init_from_summary(path, notes))
    return state.replace(params=params)


# What merge_pretrained's note says of a parameter that kept its init, or was ignored; its
# other notes say how a saved parameter was adapted.
SKIPPED_NOTES = ("keeps its init", "ignored")


def init_from_summary(path: str, notes: list[str], shown: int = 5) -> str:
    """'init_from P: N parameter(s) not loaded as they are (k skipped, a adapted):' and the
    first ``shown`` notes, one per line (``merge_pretrained``'s 'name: what happened', one
    per parameter)."""
    adapted = sum(not any(s in n for s in SKIPPED_NOTES) for n in notes)
    head = (f"init_from {path}: {len(notes)} parameter(s) not loaded as they are "
            f"({len(notes) - adapted} skipped, {adapted} adapted):")
    more = [f"... and {len(notes) - shown} more"] if len(notes) > shown else []
    return "\n  ".join([head, *notes[:shown], *more])
