"""Attention maps as PNG: collect every layer's attention weights and draw layers × heads."""
from __future__ import annotations

import pathlib
from typing import Any, Sequence

import flax.linen as nn
import jax
import numpy as np

from posjax.io_utils import write_atomically


def pyplot() -> Any:
    """matplotlib.pyplot on the file-only Agg backend (no display needed; imported on use)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def attention_maps(model: nn.Module, variables: Any, *args: Any, **kwargs: Any) -> list[np.ndarray]:
    """Every attention module's weights, in call order: a list of (B, h, Lq, Lk) arrays.

    Runs ``model.apply(variables, *args, **kwargs)`` collecting the ``attention_weights`` each
    attention layer sows into the ``intermediates`` collection (EMD passes included, last).
    """
    _, state = model.apply(variables, *args, mutable=["intermediates"], **kwargs)
    maps: list[np.ndarray] = []

    def collect(tree: Any) -> None:
        if isinstance(tree, dict):
            for key in _call_order(tree):
                if key == "attention_weights":
                    maps.extend(np.asarray(w, np.float32) for w in tree[key])
                else:
                    collect(tree[key])

    collect(jax.device_get(state["intermediates"]))
    return maps


def _call_order(tree: dict) -> list[str]:
    """Keys with numbered siblings (layer_2 before layer_10) in numeric order."""
    def key(k: str) -> tuple:
        stem, _, num = k.rpartition("_")
        return (stem, int(num)) if num.isdigit() else (k, -1)
    return sorted(tree, key=key)


def attention_labels(model: nn.Module, count: int) -> list[str]:
    """Row labels for the ``count`` maps ``attention_maps(model, ...)`` returned: 'layer k' for
    the encoder layers, then 'MAP head' (ViT ``pooling='map'``) or 'EMD pass k' (DeBERTa's
    enhanced mask decoder, ``use_emd``: two passes through the last layer)."""
    cfg = getattr(model, "cfg", None)
    layers = min(getattr(cfg, "num_layers", count), count)
    extra = count - layers
    if getattr(cfg, "pooling", None) == "map":
        after = ["MAP head"] * extra
    elif getattr(cfg, "use_emd", False):
        after = [f"EMD pass {k}" for k in range(extra)]
    else:
        after = [f"attention {layers + k}" for k in range(extra)]
    return [f"layer {k}" for k in range(layers)] + after


def save_attention_png(maps: Sequence[np.ndarray], path: str | pathlib.Path, *, example: int = 0,
                       max_heads: int = 8, tokens: Sequence[str] | None = None,
                       title: str = "", row_labels: Sequence[str] | None = None
                       ) -> pathlib.Path:
    """Draw one example's maps as a grid (rows: layers, columns: heads) into ``path`` (PNG).

    Rows are labelled ``row_labels`` (``attention_labels(model, len(maps))``), by default
    'layer k'. ``tokens`` (one per key) label the keys of the bottom-left map when there are
    at most 32 (more would not be legible)."""
    if not maps:
        raise ValueError("maps is empty: the model sowed no attention weights")
    rows = len(maps)
    row_labels = [f"layer {k}" for k in range(rows)] if row_labels is None else list(row_labels)
    if len(row_labels) != rows:
        raise ValueError(f"row_labels has {len(row_labels)} labels for {rows} maps")
    batch, keys = maps[0].shape[0], maps[-1].shape[-1]
    if not -batch <= example < batch:
        raise ValueError(f"example={example} is not in the batch of {batch} maps")
    if tokens is not None and len(tokens) != keys:
        raise ValueError(f"tokens has {len(tokens)} labels for the {keys} keys of the maps")
    plt = pyplot()
    cols = min(maps[0].shape[1], max_heads)
    fig, axes = plt.subplots(rows, cols, figsize=(2.2 * cols, 2.2 * rows), squeeze=False)
    for r, m in enumerate(maps):
        for c in range(cols):
            ax = axes[r][c]
            ax.imshow(m[example, c], cmap="viridis", vmin=0.0, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if r == 0:
                ax.set_title(f"head {c}", fontsize=8)
            if c == 0:
                ax.set_ylabel(row_labels[r], fontsize=8)
    if tokens is not None and len(tokens) <= 32:
        ax = axes[-1][0]
        ax.set_xticks(range(len(tokens)))
        ax.set_xticklabels(tokens, rotation=90, fontsize=5)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, path)
    return path


def save_figure(fig: Any, path: pathlib.Path) -> None:
    """Matplotlib figure ``fig`` into ``path`` (format from its suffix, 100 dpi), atomically:
    a crash mid-write leaves the previous file, not a truncated image. Closes ``fig``."""
    try:
        write_atomically(path, lambda tmp: fig.savefig(tmp, dpi=100,
                                                       format=path.suffix[1:] or "png"))
    finally:
        pyplot().close(fig)
