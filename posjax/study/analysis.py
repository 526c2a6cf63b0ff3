"""Position analyses of trained params (small numpy arrays the report plots).

* ``bert_terms``: BERT-A's first-layer logit split into TUPE's four correlations (TUPE Fig. 2):
  with word rows w_i and position rows p_i (the embedding tables, before LayerNorm, no token
  types) and layer 0's W_Q, W_K (biases left out), per head
  (w_iW_Q)(w_jW_K)ᵀ, (w_iW_Q)(p_jW_K)ᵀ, (p_iW_Q)(w_jW_K)ᵀ, (p_iW_Q)(p_jW_K)ᵀ, all / √d,
  averaged over heads.
* ``tupe_position_maps``: TUPE's per-head positional logits (its ``tupe_bias`` module applied to
  its own params), softmax over keys, and a label per head (``head_label``).
* ``vit_similarity``: cosine similarity of each learned patch position row with every other
  (ViT Fig. 7).
"""
from __future__ import annotations

from typing import Any

import numpy as np

HEAD_RULE = ("previous: mean attention on key i-1 >= 0.4 (and >= on i+1); next: on key i+1 >= "
             "0.4; local: mass within |i-j| <= 3 >= 0.5; global: normalised row entropy >= "
             "0.9; broad: anything else")


def bert_terms(params: dict[str, Any], token_ids: np.ndarray, num_heads: int) -> dict[str, np.ndarray]:
    """TUPE Fig. 2's four (L, L) first-layer terms for ``token_ids`` (L,)."""
    enc = params["encoder"]
    w = np.asarray(enc["embeddings"]["word_embeddings"]["embedding"])[token_ids]
    p = np.asarray(enc["embeddings"]["position_embeddings"]["embedding"])[: len(token_ids)]
    att = enc["encoder"]["layer_0"]["attention"]
    wq, wk = np.asarray(att["query"]["kernel"]), np.asarray(att["key"]["kernel"])   # (H, h, d)
    d = wq.shape[-1]

    def term(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        q, k = np.einsum("lH,Hhd->hld", a, wq), np.einsum("lH,Hhd->hld", b, wk)
        return np.einsum("hqd,hkd->qk", q, k) / (num_heads * np.sqrt(d))

    return {"word-word": term(w, w), "word-pos": term(w, p), "pos-word": term(p, w),
            "pos-pos": term(p, p)}


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    z = np.exp(x - x.max(axis, keepdims=True))
    return z / z.sum(axis, keepdims=True)


def head_label(attention: np.ndarray) -> str:
    """One of global/local/broad/previous/next for an (L, L) row-stochastic map (``HEAD_RULE``)."""
    n = attention.shape[0]
    i = np.arange(n)
    prev = float(np.mean(attention[i[1:], i[1:] - 1]))
    nxt = float(np.mean(attention[i[:-1], i[:-1] + 1]))
    near = np.abs(i[:, None] - i[None, :]) <= 3
    local = float(np.mean(np.sum(attention * near, -1)))
    entropy = -np.sum(attention * np.log(attention + 1e-12), -1) / np.log(n)
    if prev >= 0.4 and prev >= nxt:
        return "previous"
    if nxt >= 0.4:
        return "next"
    if local >= 0.5:
        return "local"
    if float(np.mean(entropy)) >= 0.9:
        return "global"
    return "broad"


def tupe_position_maps(params: dict[str, Any], cfg: Any, length: int
                       ) -> tuple[np.ndarray, list[str]]:
    """((h, L, L) softmax of TUPE's positional logits for tokens 1..L-1 (the [CLS] row and
    column dropped), head labels)."""
    from posjax.layers.position_bias import TupePositionBias

    module = TupePositionBias(cfg.num_heads, cfg.head_dim, cfg.max_position_embeddings,
                              eps=cfg.layer_norm_eps, untie_cls=not cfg.tie_cls)
    tree = params["encoder"]["encoder"]["tupe_bias"]
    tree = {k: v for k, v in tree.items() if k in ("position_embeddings", "norm", "query", "key")}
    bias = np.asarray(module.apply({"params": tree}, length)["bias"])[:, 1:, 1:]
    maps = softmax(bias, -1)
    return maps, [head_label(m) for m in maps]


def vit_similarity(table: np.ndarray, grid: tuple[int, int], prefix: int) -> np.ndarray:
    """(gh, gw, gh, gw) cosine similarities of the grid rows of a (1, P + gh·gw, H) table."""
    rows = np.asarray(table).reshape(-1, np.shape(table)[-1])[prefix:]
    rows = rows / (np.linalg.norm(rows, axis=-1, keepdims=True) + 1e-12)
    return (rows @ rows.T).reshape(*grid, *grid)


def layout_scores(similarity: np.ndarray) -> dict[str, float]:
    """How two-dimensional a learned table's layout is, from its (gh, gw, gh, gw) similarities
    (``vit_similarity``): ``distance_correlation``, Spearman's ρ between the similarity and
    the grid distance of every pair of patches (−1: similarity falls with distance; 0: no
    layout, as for the rows in random order); ``nearest_is_neighbour``, the share of patches
    whose most similar other patch is one of its 8 grid neighbours, and ``by_chance``, that
    share for a random other patch."""
    from scipy import stats

    gh, gw = np.shape(similarity)[:2]
    sim = np.asarray(similarity, np.float64).reshape(gh * gw, gh * gw)
    rows, cols = np.divmod(np.arange(gh * gw), gw)
    dist = np.hypot(rows[:, None] - rows[None], cols[:, None] - cols[None])
    pairs = np.triu_indices(gh * gw, 1)
    neighbour = (dist > 0) & (dist < 1.5)
    others = np.where(np.eye(gh * gw, dtype=bool), -np.inf, sim)
    nearest = np.argmax(others, axis=1)
    return {"distance_correlation": float(stats.spearmanr(sim[pairs], dist[pairs]).statistic),
            "nearest_is_neighbour": float(np.mean(neighbour[np.arange(gh * gw), nearest])),
            "by_chance": float(np.mean(neighbour.sum(1) / (gh * gw - 1)))}


# Parameter names that hold positional information (tables, relative biases and embeddings,
# TUPE's positional projections, DeBERTa's position projections, BERT-A-d's cross terms).
POSITIONAL = ("position_embeddings", "rel_bias", "rel_embeddings", "rel_norm", "tupe_bias",
              "_for_positions", "pos_key", "pos_query", "pos_embedding")


def position_movement(initial: Any, final: Any) -> dict[str, dict[str, float]]:
    """How far each positional parameter moved in training: ``{path: {init_norm, change_norm,
    relative (change_norm / init_norm; nan for a zero init), max_abs_change}}``. For an
    additive logit bias (T5's table) ``max_abs_change`` is the most any logit moved."""
    import jax

    moved = {}
    flat_final = dict(jax.tree_util.tree_flatten_with_path(final)[0])
    for path, start in jax.tree_util.tree_flatten_with_path(initial)[0]:
        key = jax.tree_util.keystr(path)
        if not any(word in key for word in POSITIONAL) or path not in flat_final:
            continue
        a = np.asarray(start, np.float64)
        delta = np.asarray(flat_final[path], np.float64) - a
        norm = float(np.linalg.norm(a))
        moved[key] = {"init_norm": norm, "change_norm": float(np.linalg.norm(delta)),
                      "relative": float(np.linalg.norm(delta) / norm) if norm else float("nan"),
                      "max_abs_change": float(np.max(np.abs(delta))) if delta.size else 0.0}
    return moved
