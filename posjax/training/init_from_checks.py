"""Checks of ``init_from`` made before anything is compiled, from the checkpoint's metadata and
config alone: ``check_init_from`` (the encoder's parameters must load; eval.py on the weights
as they are: all of them) and ``function_mismatches`` (config fields that would make the same
parameters compute another function). Each failure is one ValueError saying which
``--config.model`` values to give.
"""
from __future__ import annotations

import pathlib
from typing import Any, Callable

import jax

from posjax.models import params as params_lib
from posjax.models.layout import to_layout
from posjax.training import init_from as init_from_lib


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
    params_dir, cfg_file = init_from_lib.pretrained_location(path)
    saved = init_from_lib.saved_tree(path, params_dir)["params"]
    saved_cfg = init_from_lib.pretrained_config(cfg_file)
    saved_model = init_from_lib.saved_model_config(saved_cfg)
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
    target = params_lib.keyed(target_params)
    scanned = any(params_lib.SCANNED_LAYERS in key for key in target)
    shapes = jax.tree_util.tree_map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype),
                                    dict(saved), is_leaf=lambda x: hasattr(x, "shape"))
    shapes = params_lib.keyed(jax.eval_shape(lambda t: to_layout(t, scanned), shapes))
    shapes = init_from_lib.encoder_rooted(shapes, target)
    num_prefix_tokens = 1 if params_lib.CLS in target else 0
    saved_cls = params_lib.CLS in shapes
    # The encoder is what a pretrained model is for: a head or a bias that happens to fit
    # alone does not make a checkpoint usable.
    encoder = [k for k in target if k.startswith("['encoder']")] or list(target)

    def fits(key: str) -> bool:
        if tuple(shapes[key].shape) == tuple(target[key].shape):
            return True
        # Evaluating the weights as they are may not drop saved layers.
        return jax.eval_shape(lambda old, fresh: init_from_lib.adapted(
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
        return _advice(sorted({f for k in keys for f in params_lib.shape_fields(
            k, tuple(shapes[k].shape) if k in shapes else None,
            tuple(target[k].shape) if k in target else None, target, whole)
            if model_config is None or hasattr(model_config, f)}),
            cfg_file, saved_model, model_config, missing_are_defaults)

    if not whole:
        _check_body(path, shapes, target, fits, advice)
    else:
        bad = [k for k in target if not (k in shapes and fits(k))]
        left_over = sorted(set(shapes) - set(target))
        body = [k for k in bad + left_over if params_lib.in_body(k)]
        _check_whole(path, cfg_file, [_misfit(k, shapes, target) for k in bad], left_over,
                     advice(body) if body else None)


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
    bad = [k for k in target if params_lib.in_body(k) and not (k in shapes and fits(k))]
    if not bad:
        return
    misfits = [_misfit(k, shapes, target) for k in bad]
    more = f" and {len(misfits) - 5} more" if len(misfits) > 5 else ""
    raise ValueError(
        f"init_from={str(path)!r}: {len(misfits)} parameter(s) of this model outside its heads "
        f"would not load from the pretrained model and would keep a random init: "
        f"{', '.join(misfits[:5])}{more}. Give config.model {advice(bad)}, or start without "
        "init_from")


def _misfit(key: str, shapes: dict[str, Any], target: dict[str, Any]) -> str:
    """``key`` with its saved and its shape here, or that the checkpoint lacks it."""
    if key not in shapes:
        return f"{key} (not in the checkpoint)"
    return f"{key} (saved {tuple(shapes[key].shape)}, here {tuple(target[key].shape)})"


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
    fields = (params_lib.SAME_FUNCTION_FIELDS["*"] + (("pooler_act",) if with_pooler else ())
              + (("pooling",) if heads else ()))
    schemes = (model_config.position_scheme,
               *((theirs.position_scheme,) if "position_scheme" in saved
                 or missing_are_defaults else ()))
    for scheme in dict.fromkeys(schemes):
        fields += tuple(f for f in params_lib.SAME_FUNCTION_FIELDS.get(scheme, ())
                        if f not in fields)
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
