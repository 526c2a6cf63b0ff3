"""A text model's absolute position table against the sequence length: refused beyond its
rows, or (eval.py only, ``model.extend_positions='interpolate'``) extended to them.

The state of a checkpoint is restored with the table it was saved with (R rows;
``cut_to_table`` lets the abstract state be built at a longer data.max_seq_length), then
``extend`` resamples every absolute table to the N = data.max_seq_length positions the model
is rebuilt with: the input table (R, E) -> (N, E), TUPE's untied table (1 + R, H) ->
(1 + N, H) with its [CLS] row 0 kept; rows by corner-aligned linear interpolation
(``positions.interpolate_position_rows``: the first and last rows kept, row j at old
position j·(R − 1)/(N − 1)).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Mapping

import jax

from posjax.layers import positions
from posjax.models import params as params_lib
from posjax.models.config import TextConfig
from posjax.models.schemes import SCHEMES, TEXT_SCHEMES, absolute_rows

TOKEN_KEYS = ("input_ids", "attention_mask", "token_type_ids")   # (B, L) arrays of a batch


def check_length(cfg: TextConfig, length: int, length_field: str) -> None:
    """Sequences of ``length`` must fit the absolute table unless ``extend_positions`` says
    how to extend it; ``extend_positions`` must have something to extend."""
    rows = absolute_rows(cfg)
    if rows and length > rows and not cfg.extend_positions:
        relative = ", ".join(n for n in TEXT_SCHEMES if SCHEMES[n].relative)
        raise ValueError(f"{length_field}={length} exceeds model.max_position_embeddings="
                         f"{cfg.max_position_embeddings}: position_scheme="
                         f"{cfg.position_scheme!r} reads an absolute position table, which has "
                         f"no rows beyond {cfg.max_position_embeddings}; shorten the sequences "
                         "or enlarge the position table, or to evaluate a checkpoint at this "
                         "length set model.extend_positions='interpolate' (eval.py resamples "
                         "the table's rows to it); relative schemes without a table, "
                         f"{relative}, run at any length")
    if cfg.extend_positions and not applies(cfg, length):
        why = (f"position_scheme={cfg.position_scheme!r} reads no absolute position table"
               if not rows else f"{length_field}={length} fits the table's {rows} rows")
        raise ValueError(f"model.extend_positions={cfg.extend_positions!r} has no effect: "
                         f"{why}; remove it")


def applies(cfg: TextConfig, length: int) -> bool:
    """Whether evaluating ``cfg``'s checkpoint at ``length`` extends its absolute table."""
    rows = absolute_rows(cfg)
    return bool(cfg.extend_positions and rows and length > rows)


def cut_to_table(cfg: TextConfig, batch: Mapping[str, Any]) -> Mapping[str, Any]:
    """``batch`` with its (B, L) token arrays cut to the absolute table's rows when L exceeds
    them (for building the checkpoint's parameters, whose shapes do not depend on L)."""
    rows = absolute_rows(cfg)
    if not rows or batch["input_ids"].shape[1] <= rows:
        return batch
    return {k: v[:, :rows] if k in TOKEN_KEYS else v for k, v in batch.items()}


def extend(cfg: TextConfig, params: Any, length: int) -> tuple[TextConfig, Any]:
    """(``cfg`` with ``length`` table rows, ``params`` with every absolute table resampled to
    ``length`` positions, each on its own sharding; see the module docstring), or both as
    they are where nothing is extended (``applies`` is False)."""
    if not applies(cfg, length):
        return cfg, params
    resized: list[str] = []

    def resize(path: Any, leaf: Any) -> Any:
        key = jax.tree_util.keystr(path)
        prefix = params_lib.text_table_prefix(key)
        if prefix is None:
            return leaf
        resized.append(key)
        stretch = functools.partial(positions.interpolate_position_rows, rows=length,
                                    num_prefix_rows=prefix)
        return jax.jit(stretch, out_shardings=getattr(leaf, "sharding", None))(leaf)

    params = jax.tree_util.tree_map_with_path(resize, params)
    if not resized:
        raise ValueError(f"model.extend_positions={cfg.extend_positions!r}: the restored "
                         "params hold no absolute position table to extend")
    logging.info("extended %s from %d to %d positions (%s)", ", ".join(resized),
                 absolute_rows(cfg), length, cfg.extend_positions)
    return dataclasses.replace(cfg, max_position_embeddings=length), params
