"""``init_from``: start a run from pretrained parameters, a converter folder (``params/`` +
``model_config.json``) or a train.py workdir (its latest checkpoint's params).

``read_pretrained`` restores the saved params (those that fit straight onto this model's
shardings); ``merge_pretrained`` puts them into a fresh state, adapting what it can (a ViT
position table's [CLS] row, a deeper scanned stack, a patch grid to resample: ``adapted``) and
noting what keeps its init. Which parameter is what comes from ``posjax.models.params``; the
checks made before anything is compiled are in ``init_from_checks``.
"""
from __future__ import annotations

import logging
import math
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from posjax import checkpoint_io, storage
from posjax.io_utils import read_json_object
from posjax.layers.positions import resample_position_table
from posjax.models import params as params_lib
from posjax.models.config import stem_stride
from posjax.models.layout import to_layout
from posjax.training.state import TrainState


def pretrained_location(path: str | pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """(orbax checkpoint holding a top-level ``params`` tree, its model-config JSON) for
    ``init_from``: a converter folder (``params/`` + ``model_config.json``) or a train.py
    workdir (the latest ``checkpoints/<step>/state`` + ``config.json``), local or ``gs://``."""
    root = storage.as_path(path, "init_from")
    storage.check_credentials(root, "init_from")
    # On a bucket Orbax saves a step in place and ends it with commit_success.txt, and
    # posjax.convert uploads model_config.json last: without them, an upload cut short.
    bucket = storage.is_bucket(root)
    if (root / "params").is_dir():
        if bucket and not (root / "model_config.json").exists():
            raise ValueError(f"init_from={str(path)!r}: params/ without model_config.json (an "
                             "upload cut short): convert again to a new folder")
        return root / "params", root / "model_config.json"
    steps = sorted(int(p.name) for p in (root / "checkpoints").glob("*") if p.name.isdigit()
                   and (p / "state").is_dir() and (not bucket or (p / "commit_success.txt")
                                                   .exists()))
    if steps:
        return root / "checkpoints" / str(steps[-1]) / "state", root / "config.json"
    published = root.suffix == ".npz" or ((root / "config.json").is_file() and any(
        (root / f"{name}{index}").is_file() for name in ("model.safetensors",
                                                          "pytorch_model.bin")
        for index in ("", ".index.json")))
    convert = (f": it looks like published weights (a Hugging Face folder or an .npz); convert "
               f"them first, python -m posjax.convert --from {str(path)} --to CKPT, then give "
               "init_from=CKPT" if published else "")
    raise ValueError(f"init_from={str(path)!r}: neither a converter folder (params/ + "
                     "model_config.json) nor a train.py workdir with checkpoints/<step>/state"
                     + convert)


def saved_tree(path: str | pathlib.Path, params_dir: pathlib.Path) -> dict[str, Any]:
    """The metadata tree (shapes, dtypes) of the checkpoint at ``params_dir``; it must hold a
    top-level ``params`` tree."""
    try:
        tree = checkpoint_io.read_metadata_tree(params_dir)
    except ValueError as e:
        raise ValueError(f"init_from={str(path)!r}: {e}") from None
    if "params" not in tree:
        raise ValueError(f"init_from={str(path)!r}: {params_dir} holds no 'params' tree "
                         f"(top-level keys {sorted(tree)})")
    return tree


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
    tree = saved_tree(path, params_dir)
    target = params_lib.keyed(target_params)
    shardings = params_lib.keyed(param_shardings)
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
    loaded = checkpoint_io.read_item(params_dir, ocp.PyTreeCheckpointHandler(),
                                lambda handler: handler.restore(params_dir, args=args))
    # Either layer layout loads into either (scan_layers on one side only): restack.
    target_scanned = any(params_lib.SCANNED_LAYERS in key for key in target)
    loaded = {"params": to_layout(loaded["params"], target_scanned)}
    return params_lib.keyed(loaded["params"]), pretrained_config(cfg_file)


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
    flat_shardings = params_lib.keyed(shardings)
    loaded = encoder_rooted(loaded, flat_shardings)
    num_prefix_tokens = 1 if params_lib.CLS in flat_shardings else 0
    saved_cls = params_lib.CLS in loaded
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
        value, done = adapted(key, loaded[key], fresh, saved_cls, num_prefix_tokens, grid,
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


def _match_cls_rows(key: str, old: Any, fresh: Any, saved_cls: bool) -> Any:
    """``old`` (a saved ViT position parameter, ``_cls_row``) without its [CLS] row
    (``saved_cls``), or with this model's initial one (``fresh``'s) inserted."""
    axis, index = params_lib.cls_row(key, old.ndim)
    if saved_cls:
        return jnp.delete(jnp.asarray(old), index % old.shape[axis], axis=axis)
    index %= fresh.shape[axis]
    cls = jax.lax.slice_in_dim(jnp.asarray(fresh, old.dtype), index, index + 1, axis=axis)
    return jnp.concatenate([jax.lax.slice_in_dim(jnp.asarray(old), 0, index, axis=axis), cls,
                            jax.lax.slice_in_dim(jnp.asarray(old), index, None, axis=axis)],
                           axis=axis)


def adapted(key: str, old: Any, fresh: Any, saved_cls: bool, num_prefix_tokens: int,
             grid: tuple[int, int] | None, pretrained_config: dict[str, Any],
             first_layers: bool = True) -> tuple[Any, list[str]]:
    """(``old``, the saved value of ``key``, in the shape of this model's ``fresh``, or None
    where it cannot be; what was done to it). In this order: a ViT position parameter saved for
    another pooling (``saved_cls``: the checkpoint has a [CLS] token) loses its [CLS] row or
    gets ``fresh``'s (``_cls_row``); a deeper scanned stack gives its first layers
    (``first_layers``); a patch-position table is resampled to ``grid`` (``_resampling``).
    Traceable, so that ``jax.eval_shape`` tells from shapes alone whether a parameter loads."""
    done = []
    if params_lib.cls_row(key, old.ndim) is not None and saved_cls != bool(num_prefix_tokens):
        old = _match_cls_rows(key, old, fresh, saved_cls)
        done.append(f"[CLS] row {'dropped' if saved_cls else 'from the init'} "
                    f"(this model pools {'without' if saved_cls else 'on'} [CLS])")
    if first_layers and params_lib.first_layers(key, tuple(old.shape), tuple(fresh.shape)):
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


def _resampling(key: str, saved_shape: tuple[int, ...], shape: tuple[int, ...],
                grid: tuple[int, int] | None, num_prefix_tokens: int,
                pretrained_config: dict[str, Any]) -> tuple[tuple[int, int], int] | None:
    """(saved grid, rows before the patch rows) when the table saved as ``key`` is a
    patch-position table to resample to ``grid``; None when it is not one, or its saved grid
    cannot be told (it then keeps its init)."""
    prefix = params_lib.patch_table_prefix(key, num_prefix_tokens)
    if grid is None or prefix is None or len(saved_shape) != len(shape) \
            or saved_shape[-1] != shape[-1]:
        return None
    try:
        return _grid(pretrained_config, saved_shape[-2] - prefix), prefix
    except ValueError:   # e.g. a [CLS] row in the checkpoint and none here
        return None


def saved_model_config(saved: dict[str, Any]) -> dict[str, Any]:
    """The model section of a saved config: ``model`` in a train.py workdir's config.json,
    ``config`` in the converter's model_config.json."""
    return saved.get("model", saved.get("config", saved))


def _grid(model_cfg: dict[str, Any], tokens: int) -> tuple[int, int]:
    """Patch grid: from image_size / (patch_size · the ResNet stem's stride) in a (possibly
    nested) model config, else square."""
    cfg = saved_model_config(model_cfg)
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


def pretrained_config(cfg_file: pathlib.Path) -> dict[str, Any]:
    """The model config saved beside ``init_from``'s params ({} when there is none); one
    ValueError naming the file when it is not a JSON object."""
    try:
        return read_json_object(cfg_file, "the saved model's config",
                                "copy or convert the checkpoint again") or {}
    except ValueError as e:
        raise ValueError(f"init_from: {e}") from None


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
