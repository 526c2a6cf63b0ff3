"""Two layouts of the encoder's layer parameters, and the exact conversion between them.

Unrolled (``scan_layers=False``): ``encoder/layer_0/…``, ``encoder/layer_1/…``, one subtree per
layer. Scanned (``scan_layers=True``): ``encoder/layers/…`` with every leaf stacked on a new
leading axis of size ``num_layers`` (layer i is ``leaf[i]``). Converters and checkpoints speak
the unrolled layout; ``stack_layers`` / ``unstack_layers`` move a tree between the two without
changing a single value, so a checkpoint trained one way loads the other way.
"""
from __future__ import annotations

import re
from typing import Any, Mapping

import jax
import numpy as np

STACKED = "layers"
_UNROLLED = re.compile(r"layer_(\d+)$")


def _layer_index(key: Any) -> int | None:
    match = _UNROLLED.match(key) if isinstance(key, str) else None
    return int(match.group(1)) if match else None


def stack_layers(tree: Mapping[str, Any]) -> dict[str, Any]:
    """Unrolled -> scanned: every dict holding ``layer_0 … layer_{N−1}`` gets ``layers`` instead,
    each leaf stacked on axis 0. Trees without numbered layers are returned unchanged."""
    out: dict[str, Any] = {}
    numbered: dict[int, Any] = {}
    for key, value in tree.items():
        index = _layer_index(key)
        if index is not None:
            numbered[index] = value
        else:
            out[key] = stack_layers(value) if isinstance(value, Mapping) else value
    if numbered:
        if sorted(numbered) != list(range(len(numbered))):
            raise ValueError(f"layers {sorted(numbered)} are not numbered 0…{len(numbered) - 1}: "
                             "cannot stack them")
        if STACKED in out:
            raise ValueError(f"the tree holds both '{STACKED}' and numbered layers")
        layers = [numbered[i] for i in range(len(numbered))]
        out[STACKED] = jax.tree.map(lambda *xs: _stack(xs), *layers)
    return out


def unstack_layers(tree: Mapping[str, Any]) -> dict[str, Any]:
    """Scanned -> unrolled: ``layers`` (leaves of shape (N, …)) becomes ``layer_0 … layer_{N−1}``."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if key == STACKED and isinstance(value, Mapping):
            count = jax.tree.leaves(value)[0].shape[0]
            for i in range(count):
                out[f"layer_{i}"] = jax.tree.map(lambda x, i=i: x[i], dict(value))
        else:
            out[key] = unstack_layers(value) if isinstance(value, Mapping) else value
    return out


def to_layout(tree: Mapping[str, Any], scan_layers: bool) -> dict[str, Any]:
    """``tree`` in the layout a model with ``scan_layers`` expects (either layout accepted)."""
    return stack_layers(tree) if scan_layers else unstack_layers(tree)


def _stack(leaves: tuple[Any, ...]) -> Any:
    if all(isinstance(x, np.ndarray) for x in leaves):
        return np.stack(leaves)
    return jax.numpy.stack(leaves)
