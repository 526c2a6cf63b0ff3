"""The Pallas kernel on a device mesh: one kernel call per shard, inside ``jax.shard_map``.

XLA cannot partition a Mosaic kernel ("Mosaic kernels cannot be automatically partitioned"):
under a jit whose mesh has several devices, ``pallas_attention`` runs per shard. Attention is
independent per example and per head, so each device takes its examples (the logical axis
'batch', ``data`` × ``fsdp`` under ``posjax.training.mesh.LOGICAL_RULES``) and its heads
('heads', ``tensor``) of q (B, L, h, d), k, v, the masks and every position term, and no
collective runs. A dimension a mesh axis does not divide stays whole (replicated) there.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable

import flax.linen as nn
import jax
from jax.sharding import PartitionSpec as P

from posjax.layers import blocked as bl

# Per BlockTerms leaf (its field name): the axis holding heads, and whether a 4-D leaf is
# per example (axis 0) — Product's (B, L, h, d) sides; (L, h, d) sides are shared.
_HEAD_AXIS = {"query_side": -2, "key_side": -2, "first_row": 0, "first_col": 0,
              "table": 2, "slopes": 0, "rel_key": 1, "rel_query": 1,
              "coords": None, "positioned": None}


def _mesh_axes(logical: str, mesh: Any, size: int) -> Any:
    """The mesh axes the rules map ``logical`` to, if together they divide ``size``."""
    axes = nn.logical_to_mesh_axes((logical,))[0]
    if axes is None:
        return None
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    names = tuple(a for a in names if a in mesh.axis_names)
    count = math.prod(mesh.shape[a] for a in names)
    return names if names and size % count == 0 else None


def _term_specs(terms: bl.BlockTerms, batch: Any, heads: Any) -> bl.BlockTerms:
    def spec(path, leaf) -> P:
        name = getattr(path[-1], "name", getattr(path[-1], "key", ""))
        if name not in _HEAD_AXIS:
            raise ValueError(f"posjax.kernels.sharded: no sharding known for the position "
                             f"term field {jax.tree_util.keystr(path)}")
        dims: list[Any] = [None] * leaf.ndim
        if _HEAD_AXIS[name] is not None:
            dims[_HEAD_AXIS[name]] = heads
        if name in ("query_side", "key_side") and leaf.ndim == 4:
            dims[0] = batch
        return P(*dims)
    return jax.tree_util.tree_map_with_path(spec, terms)


def per_shard(attention: Callable) -> Callable:
    """``attention`` (``pallas_attention``'s signature) run once per shard of the current
    mesh (``jax.set_mesh``); called directly where there is no mesh or one device."""
    @functools.wraps(attention)
    def call(q, k, v, *, key_mask=None, query_mask=None, block_terms=None, **static):
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty or mesh.size == 1:
            return attention(q, k, v, key_mask=key_mask, query_mask=query_mask,
                             block_terms=block_terms, **static)
        batch = _mesh_axes("batch", mesh, q.shape[0])
        heads = _mesh_axes("heads", mesh, q.shape[2])
        terms = bl.BlockTerms() if block_terms is None else block_terms

        def mask_spec(m):
            return P() if m is None else P(batch if m.shape[0] == q.shape[0] else None, None)

        def shard(q, k, v, key_mask, query_mask, terms):
            return attention(q, k, v, key_mask=key_mask, query_mask=query_mask,
                             block_terms=terms, **static)

        qkv = P(batch, None, heads, None)
        return jax.shard_map(
            shard, mesh=mesh, out_specs=qkv, check_vma=False,
            in_specs=(qkv, qkv, qkv, mask_spec(key_mask), mask_spec(query_mask),
                      _term_specs(terms, batch, heads)))(q, k, v, key_mask, query_mask, terms)
    return call
