"""Inputs shared by the model tests: random parameters and right-padded batches (and a walk
over a traced model's equations, ``every_eqn``).

Parameters are drawn at a scale where every term matters (the 0.02 init makes attention
nearly uniform, so a wrong position index would change outputs by less than the tolerance):
kernels N(0, 1/fan_in), token embeddings N(0, 1/E) (so tied MLM logits are O(1)), position
and relative tables N(0, 1), LayerNorm scales 1 + N(0, 0.2²), biases N(0, 0.2²). Shapes come
from ``jax.eval_shape`` of ``init``, so nothing is compiled.
"""
from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import numpy as np

# Modules whose (H, h, d) kernel contracts only its first axis.
_HEAD_SPLIT = ("query", "key", "value", "pos_key", "pos_query", "query_for_positions",
               "key_for_positions", "query_for_words", "key_for_words")


def abstract_variables(model: nn.Module, *args, **kwargs) -> Any:
    """Boxed (logically partitioned) ShapeDtypeStructs of ``model.init``'s variables."""
    return jax.eval_shape(lambda a, kw: model.init(jax.random.key(0), *a, **kw), args, kwargs)


def _draw(path: tuple[str, ...], shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    leaf, parent = path[-1], (path[-2] if len(path) > 1 else "")
    if leaf == "kernel":
        fan_in = shape[0] if (parent in _HEAD_SPLIT and len(shape) == 3) else math.prod(shape[:-1])
        return rng.normal(0.0, fan_in ** -0.5, shape)
    if leaf == "scale":
        return 1.0 + 0.2 * rng.normal(size=shape)
    if leaf == "bias":
        return 0.2 * rng.normal(size=shape)
    if leaf == "embedding":   # nn.Embed rows; the word table is also the tied output projection
        return rng.normal(0.0, shape[-1] ** -0.5, shape)
    return rng.normal(size=shape)   # embeddings, position / relative tables, probe, [CLS]


def random_params(model: nn.Module, *args, seed: int = 0, **kwargs) -> dict:
    """{'params': ...} of float32 numpy arrays, drawn leaf by leaf in path order."""
    shapes = nn.meta.unbox(abstract_variables(model, *args, **kwargs))
    rng = np.random.default_rng(seed)
    flat = jax.tree_util.tree_flatten_with_path(shapes)[0]
    values = [_draw(tuple(k.key for k in path), s.shape, rng).astype(np.float32)
              for path, s in flat]
    return jax.tree.unflatten(jax.tree.structure(shapes), values)


def padded_text_batch(lengths: tuple[int, ...], max_len: int, vocab_size: int, seed: int = 0
                      ) -> dict[str, np.ndarray]:
    """Right-padded ids (pad id 0), attention_mask and token_type_ids (0 on pads), (B, L) each.

    Real tokens are drawn from [1, vocab); token types switch to 1 after the first half.
    """
    rng = np.random.default_rng(seed)
    mask = (np.arange(max_len)[None, :] < np.asarray(lengths)[:, None]).astype(np.int32)
    ids = rng.integers(1, vocab_size, (len(lengths), max_len)) * mask
    types = (np.arange(max_len)[None, :] >= np.asarray(lengths)[:, None] // 2) * mask
    return {"input_ids": ids.astype(np.int32), "attention_mask": mask,
            "token_type_ids": types.astype(np.int32)}


def max_abs_error(model_out: Any, reference: np.ndarray, where: np.ndarray | None = None) -> float:
    """max |model − reference| over the positions where ``where`` (broadcast) is True."""
    diff = np.abs(np.asarray(model_out, np.float64) - reference)
    if where is not None:
        diff = diff[np.broadcast_to(where, diff.shape)]
    return float(diff.max()) if diff.size else 0.0


def every_eqn(jaxpr: Any) -> Any:
    """The equations of a jaxpr and, recursively, of the sub-jaxprs in their parameters
    (jit, scan, custom_vjp, remat ...)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from every_eqn(inner)
