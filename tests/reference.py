"""Plain-numpy float64 reference of every posjax model, written from docs/design.md §3.

It reads the Flax parameter tree (converted with ``to_float64``) and redoes the math in the
most literal form, deliberately unlike the models: per-pair bucket and index matrices, the full
L × L × d relative key/query tensors of DeBERTa instead of gathers, the EMD decoded at every
position and selected afterwards, patches cut by reshaping instead of a convolution.

Shapes: B batch, L tokens, H hidden, h heads, d = H/h, E embedding size, V vocabulary.
Masks are bool, True = a real token. Configurations are posjax's ``TextConfig``/``ViTConfig``
(read as plain records of numbers).
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np
import scipy.ndimage
from scipy.special import erf

Params = Mapping[str, Any]

ACTIVATIONS = {
    "gelu": lambda x: 0.5 * x * (1.0 + erf(x / math.sqrt(2.0))),
    "gelu_tanh": lambda x: 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi)
                                                    * (x + 0.044715 * x ** 3))),
    "relu": lambda x: np.maximum(x, 0.0),
    "tanh": np.tanh,
    "identity": lambda x: x,
}
DEBERTA = ("deberta", "deberta_v2")


def to_float64(tree: Any) -> Any:
    """Nested mapping of arrays (Flax params, unboxed) -> same nesting of float64 numpy arrays."""
    if isinstance(tree, Mapping):
        return {k: to_float64(v) for k, v in tree.items()}
    return np.asarray(tree, dtype=np.float64)


# ---------------------------------------------------------------------------------------------
# Primitives
# ---------------------------------------------------------------------------------------------

def layer_norm(x: np.ndarray, p: Params, eps: float) -> np.ndarray:
    """(x − mean) / √(var + eps) · scale + bias over the last axis (biased variance)."""
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * p["scale"] + p["bias"]


def linear(x: np.ndarray, p: Params, contract: int = 1) -> np.ndarray:
    """Contract the last ``contract`` axes of x with the leading axes of p['kernel'] (+ bias)."""
    y = np.tensordot(x, p["kernel"], axes=contract)
    return y + p["bias"] if "bias" in p else y


def masked_softmax(logits: np.ndarray, visible: np.ndarray) -> np.ndarray:
    """softmax over the last axis restricted to visible keys; a row with none is all zeros."""
    visible = np.broadcast_to(visible, logits.shape)
    any_visible = visible.any(-1, keepdims=True)
    shifted = np.where(visible, logits, -np.inf)
    row_max = np.where(any_visible, shifted.max(-1, keepdims=True), 0.0)
    e = np.where(visible, np.exp(np.where(visible, logits, 0.0) - row_max), 0.0)
    total = np.where(any_visible, e.sum(-1, keepdims=True), 1.0)
    return e / total


def attend(weights: np.ndarray, v: np.ndarray, p_out: Params) -> np.ndarray:
    """weights (B, h, Lq, Lk), v (B, Lk, h, d) -> output projection of Σ_k w v: (B, Lq, H)."""
    heads = np.einsum("bhqk,bkhd->bqhd", weights, v)
    return linear(heads, p_out, contract=2)


def mlp(x: np.ndarray, p: Params, act: str) -> np.ndarray:
    return linear(ACTIVATIONS[act](linear(x, p["fc1"])), p["fc2"])


# ---------------------------------------------------------------------------------------------
# Relative positions
# ---------------------------------------------------------------------------------------------

def t5_bucket(key_minus_query: np.ndarray, num_buckets: int, max_distance: int) -> np.ndarray:
    """T5 bidirectional bucket of the offset j − i (Raffel et al. 2020, relative attention).

    Buckets [0, n/2) hold keys at or before the query, [n/2, n) keys after it. Within a half,
    distances below n/4 get their own bucket; larger ones share n/4 log-spaced buckets,
    floor((n/4)·log(dist/(n/4)) / log(max_distance/(n/4))) past n/4, capped at the half's end.
    """
    rel = np.asarray(key_minus_query, dtype=np.int64)
    half = num_buckets // 2
    exact = half // 2
    dist = np.abs(rel)
    with np.errstate(divide="ignore"):
        log_bucket = exact + np.floor(np.log(dist / exact) / math.log(max_distance / exact)
                                      * (half - exact))
    within = np.where(dist < exact, dist, np.minimum(log_bucket, half - 1))
    return (np.where(rel > 0, half, 0) + within).astype(np.int64)


def t5_bias(table: np.ndarray, coords: list[np.ndarray], num_buckets: int, max_distance: int,
            cls_first: bool) -> np.ndarray:
    """Σ_axes table[a, bucket(c_a[j] − c_a[i]), :] -> (h, L, L).

    table: (axes, buckets [+1], h); coords: per axis, each token's coordinate (L,). With
    ``cls_first`` token 0 is [CLS]: its column (other → [CLS]) uses bucket ``num_buckets`` and its
    row ([CLS] → other) bucket ``num_buckets/2``, the row taking [0, 0].
    """
    num_tokens = len(coords[0])
    bias = np.zeros((table.shape[-1], num_tokens, num_tokens))
    for axis, c in enumerate(coords):
        bucket = np.empty((num_tokens, num_tokens), np.int64)
        for i in range(num_tokens):
            for j in range(num_tokens):
                if cls_first and i == 0:
                    bucket[i, j] = num_buckets // 2
                elif cls_first and j == 0:
                    bucket[i, j] = num_buckets
                else:
                    bucket[i, j] = t5_bucket(c[j] - c[i], num_buckets, max_distance)
        bias += np.moveaxis(table[axis][bucket], -1, 0)
    return bias


def deberta_log_bucket(r: np.ndarray, buckets: int, max_position: int) -> np.ndarray:
    """DeBERTa-v2 log buckets of r = i − j (transformers: r is not clamped first).

    mid = buckets/2; |r| <= mid unchanged, else sign(r)·(mid + ceil(log(|r|/mid) /
    log((max_position − 1)/mid) · (mid − 1))), also for |r| beyond max_position.
    """
    r = np.asarray(r, dtype=np.int64)
    mid = buckets // 2
    out = r.copy()
    far = np.abs(r) > mid
    a = np.abs(r[far]).astype(np.float64)
    out[far] = np.sign(r[far]) * (mid + np.ceil(np.log(a / mid) / np.log((max_position - 1) / mid)
                                                * (mid - 1)))
    return out


def deberta_index(query_coord: np.ndarray, key_coord: np.ndarray, span: int, buckets: int,
                  max_position: int) -> np.ndarray:
    """δ(i, j) = clamp(bucket(i − j) + k, 0, 2k − 1): query_coord (B, Lq), key_coord (Lk,) ->
    (B, Lq, Lk) row of the 2k-row relative table (k = ``span``)."""
    r = query_coord[:, :, None] - key_coord[None, None, :]
    if buckets > 0:
        r = deberta_log_bucket(r, buckets, max_position)
    return np.clip(r + span, 0, 2 * span - 1)


def deberta_span(cfg) -> int:
    """k: position_buckets for v2 with log buckets, else max_relative_positions."""
    if cfg.position_scheme == "deberta_v2" and cfg.position_buckets > 0:
        return cfg.position_buckets
    return cfg.max_relative_positions


def rotation_matrices(coords: list[np.ndarray], positioned: np.ndarray, head_dim: int,
                      base: float) -> np.ndarray:
    """RoPE as one (d, d) rotation matrix per token -> (L, d, d).

    The d features split into one chunk of m = d/A per position axis a; in chunk a, feature i
    and feature i + m/2 (i < m/2) turn by θ = c_a · base^(−2i/m) in their plane:
    [x_i, x_{i+m/2}] -> [x_i cos θ − x_{i+m/2} sin θ, x_{i+m/2} cos θ + x_i sin θ].
    A token without a position ([CLS]) keeps the identity.
    """
    length, axes = len(coords[0]), len(coords)
    m = head_dim // axes
    out = np.zeros((length, head_dim, head_dim))
    for t in range(length):
        r = np.eye(head_dim)
        if positioned[t]:
            for a in range(axes):
                for i in range(m // 2):
                    theta = coords[a][t] * base ** (-2.0 * i / m)
                    u, w = a * m + i, a * m + i + m // 2
                    r[u, u], r[u, w] = math.cos(theta), -math.sin(theta)
                    r[w, u], r[w, w] = math.sin(theta), math.cos(theta)
        out[t] = r
    return out


def alibi_slopes(num_heads: int) -> np.ndarray:
    """Press et al. 2022: n = 2^k heads get 2^(−8·1/n), 2^(−8·2/n), …, 2^(−8); other n take the
    slopes of the power of two just below n, then the odd-numbered ones of twice that power."""
    def powers(n):
        return [2.0 ** (-8.0 * k / n) for k in range(1, n + 1)]
    p = 1
    while p * 2 <= num_heads:
        p *= 2
    return np.array(powers(p) + powers(2 * p)[0::2][: num_heads - p])


def alibi(num_heads: int, coords: list[np.ndarray], positioned: np.ndarray) -> np.ndarray:
    """(h, L, L): −slope_h · Σ_a |c_a[i] − c_a[j]| per pair, 0 where either token is [CLS]."""
    slopes = alibi_slopes(num_heads)
    length = len(coords[0])
    bias = np.zeros((num_heads, length, length))
    for i in range(length):
        for j in range(length):
            if positioned[i] and positioned[j]:
                distance = sum(abs(int(c[i]) - int(c[j])) for c in coords)
                bias[:, i, j] = -slopes * distance
    return bias


def sincos_2d(grid: tuple[int, int], width: int) -> np.ndarray:
    """big_vision's 2D sin-cos table (gh·gw, width): patch (y, x) gets, for k < width/4 and
    ω_k = 10000^(−k/(width/4 − 1)), sin(xω_k), cos(xω_k), sin(yω_k), cos(yω_k) in four blocks."""
    q = width // 4
    table = np.zeros((grid[0] * grid[1], width))
    for n in range(grid[0] * grid[1]):
        y, x = divmod(n, grid[1])
        for k in range(q):
            w = 10000.0 ** (-k / (q - 1))
            table[n, k], table[n, q + k] = math.sin(x * w), math.cos(x * w)
            table[n, 2 * q + k], table[n, 3 * q + k] = math.sin(y * w), math.cos(y * w)
    return table


# ---------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------

def dot_product_attention(p: Params, x_q: np.ndarray, x_kv: np.ndarray, visible: np.ndarray,
                          scale: float, bias: np.ndarray | None,
                          rotation: np.ndarray | None = None) -> np.ndarray:
    """softmax(q·k · scale + bias, masked) v, projected: (B, Lq, H); with ``rotation`` (L, d, d)
    token t's query and key are R_t q and R_t k (RoPE)."""
    q, k, v = linear(x_q, p["query"]), linear(x_kv, p["key"]), linear(x_kv, p["value"])
    if rotation is not None:
        q = np.einsum("tde,bthe->bthd", rotation[: q.shape[1]], q)
        k = np.einsum("tde,bthe->bthd", rotation[: k.shape[1]], k)
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if bias is not None:
        logits = logits + bias
    return attend(masked_softmax(logits, visible), v, p["out"])


def disentangled_attention(p: Params, cfg, x_q: np.ndarray, x_kv: np.ndarray,
                           visible: np.ndarray, rel_table: np.ndarray,
                           query_coords: list[np.ndarray], key_coords: list[np.ndarray]
                           ) -> np.ndarray:
    """DeBERTa: (c2c + c2p + p2c) / √(d·(1 + #position terms)), masked softmax, projected.

    c2p[i, j] = Q_c[i]·K_r[δ(i, j)], p2c[i, j] = K_c[j]·Q_r[δ(i, j)] with the same δ, summed
    over the position axes a (table block a holds rows a·2k … a·2k + 2k − 1).
    query_coords: per axis (B, Lq); key_coords: per axis (Lk,).
    """
    q, k, v = linear(x_q, p["query"]), linear(x_kv, p["key"]), linear(x_kv, p["value"])
    d = q.shape[-1]
    logits = np.einsum("bqhd,bkhd->bhqk", q, k)
    span = deberta_span(cfg)
    buckets = cfg.position_buckets if cfg.position_scheme == "deberta_v2" else 0
    pos_key = p["key"] if cfg.share_att_key else p.get("pos_key")
    pos_query = p["query"] if cfg.share_att_key else p.get("pos_query")
    for axis, (qc, kc) in enumerate(zip(query_coords, key_coords)):
        idx = axis * 2 * span + deberta_index(qc, kc, span, buckets, cfg.max_relative_positions)
        if "c2p" in cfg.pos_att_type:
            k_rel = linear(rel_table, pos_key)[idx]            # (B, Lq, Lk, h, d)
            logits = logits + np.einsum("bqhd,bqkhd->bhqk", q, k_rel)
        if "p2c" in cfg.pos_att_type:
            q_rel = linear(rel_table, pos_query)[idx]          # (B, Lq, Lk, h, d)
            logits = logits + np.einsum("bkhd,bqkhd->bhqk", k, q_rel)
    logits = logits / math.sqrt(d * (1 + len(cfg.pos_att_type)))
    return attend(masked_softmax(logits, visible), v, p["out"])


def four_term_attention(p: Params, cfg, x_q: np.ndarray, x_kv: np.ndarray,
                        visible: np.ndarray, terms: Mapping[str, np.ndarray]) -> np.ndarray:
    """BERT-A-d: a_ij = [(x_i W_Q)(x_j W_K)ᵀ + (x_i W̃_Q)(p_j Ũ_K)ᵀ + (p_i Ũ_Q)(x_j W̃_K)ᵀ
    + (p_i U_Q)(p_j U_K)ᵀ] / √(4d), each term with its own projections; the last is
    ``terms['bias']``, already scaled. Queries are the first Lq tokens."""
    def affine(x, p_proj):   # every projection of the four terms has a bias
        return np.tensordot(x, p_proj["kernel"], axes=1) + p_proj["bias"]

    q, k, v = affine(x_q, p["query"]), affine(x_kv, p["key"]), affine(x_kv, p["value"])
    word_q, word_k = affine(x_q, p["query_for_positions"]), affine(x_kv, p["key_for_positions"])
    lq = x_q.shape[1]
    pos_q, pos_k = terms["position_query"][:lq], terms["position_key"]
    word_word = np.einsum("bqhd,bkhd->bhqk", q, k)
    word_pos = np.einsum("bqhd,khd->bhqk", word_q, pos_k)
    pos_word = np.einsum("qhd,bkhd->bhqk", pos_q, word_k)
    logits = (word_word + word_pos + pos_word) / math.sqrt(4 * cfg.head_dim)
    logits = logits + terms["bias"][:, :lq]
    return attend(masked_softmax(logits, visible), v, p["out"])


def tupe_table_correlation(p: Params, length: int, num_heads: int, eps: float,
                           terms: int = 2) -> np.ndarray:
    """TUPE: P = LN(table[0 : L+1]); A = (P U_Q + b)/√(terms·d) · (P U_K + b)ᵀ per head
    (2 terms in TUPE, 4 in BERT-A-d).

    -> (h, L+1, L+1); row/column 0 is the [CLS] table row."""
    pos = layer_norm(p["position_embeddings"][: length + 1], p["norm"], eps)
    d = pos.shape[-1] // num_heads
    pq = linear(pos, p["query"]) / math.sqrt(terms * d)
    pk = linear(pos, p["key"])
    return np.einsum("ihd,jhd->hij", pq, pk)


def tupe_position_logits(p: Params, length: int, num_heads: int, eps: float,
                         untie_cls: bool, terms: int = 2) -> np.ndarray:
    """TUPE's term (h, L, L): B = A[:, 1:, 1:] (token i uses table row i + 1); untied [CLS]:
    column 0 := θ2 = A[:, 1, 1], then row 0 := θ1 = A[:, 0, 0]."""
    a = tupe_table_correlation(p, length, num_heads, eps, terms)
    b = a[:, 1:, 1:].copy()
    if untie_cls:
        b[:, :, 0] = a[:, 1, 1][:, None]
        b[:, 0, :] = a[:, 0, 0][:, None]
    return b


def position_terms(p_enc: Params, cfg, length: int, coords: list[np.ndarray],
                   has_cls: bool, is_grid: bool) -> dict[str, np.ndarray]:
    """The terms every layer shares: {'bias': (h, L, L)} or {'rel_table': (A·2k, H)}.

    Text [CLS] handling: TUPE resets unless ``tie_cls``; TUPE-R's T5 buckets untie [CLS] with it.
    On a grid [CLS] has no coordinates, so its T5 pairs always use the two extra buckets.
    """
    scheme = cfg.position_scheme
    if scheme in DEBERTA:
        table = p_enc["rel_embeddings"]
        if cfg.norm_rel_ebd:
            table = layer_norm(table, p_enc["rel_norm"], cfg.layer_norm_eps)
        return {"rel_table": table}
    bias = None
    if scheme in ("tupe_a", "tupe_r"):
        bias = tupe_position_logits(p_enc["tupe_bias"], length, cfg.num_heads,
                                    cfg.layer_norm_eps, untie_cls=has_cls and not cfg.tie_cls)
    if scheme == "bert_abs_d":
        # Four terms, [CLS] tied; the position sides of the mixed terms use token i's row i + 1.
        p = p_enc["tupe_bias"]
        pos = layer_norm(p["position_embeddings"][1: length + 1], p["norm"], cfg.layer_norm_eps)
        return {"bias": tupe_position_logits(p, length, cfg.num_heads, cfg.layer_norm_eps,
                                             untie_cls=False, terms=4),
                "position_query": np.tensordot(pos, p["query_for_words"]["kernel"], axes=1)
                + p["query_for_words"]["bias"],
                "position_key": np.tensordot(pos, p["key_for_words"]["kernel"], axes=1)
                + p["key_for_words"]["bias"]}
    positioned = np.ones(length, bool)
    positioned[0] = not (has_cls and is_grid)   # a grid's [CLS] has no position
    if scheme == "rope":
        return {"rotation": rotation_matrices(coords, positioned, cfg.head_dim, cfg.rope_base)}
    if scheme == "alibi":
        return {"bias": alibi(cfg.num_heads, coords, positioned)}
    if scheme in ("bert_rel", "tupe_r"):
        cls_first = has_cls and (is_grid or (scheme == "tupe_r" and not cfg.tie_cls))
        rel = t5_bias(p_enc["relative_bias"]["rel_bias"], coords, cfg.relative_buckets,
                      cfg.relative_max_distance, cls_first)
        bias = rel if bias is None else bias + rel
    return {} if bias is None else {"bias": bias}


def attention(p: Params, cfg, x_q: np.ndarray, x_kv: np.ndarray, visible: np.ndarray,
              terms: Mapping[str, np.ndarray], query_coords: list[np.ndarray],
              key_coords: list[np.ndarray]) -> np.ndarray:
    """The scheme's attention: disentangled for DeBERTa, else dot product (+ shared bias) with
    logit scale 1/√(2d) for TUPE and 1/√d otherwise."""
    if cfg.position_scheme in DEBERTA:
        return disentangled_attention(p, cfg, x_q, x_kv, visible, terms["rel_table"],
                                      query_coords, key_coords)
    if cfg.position_scheme == "bert_abs_d":
        return four_term_attention(p, cfg, x_q, x_kv, visible, terms)
    factor = 2 if cfg.position_scheme in ("tupe_a", "tupe_r") else 1
    return dot_product_attention(p, x_q, x_kv, visible, 1 / math.sqrt(factor * cfg.head_dim),
                                 terms.get("bias"), terms.get("rotation"))


def post_ln_layer(p: Params, cfg, x_q, x_kv, visible, terms, query_coords, key_coords):
    """x = LN(x_q + Attn(x_q, x_kv)); x = LN(x + MLP(x))."""
    x = layer_norm(x_q + attention(p["attention"], cfg, x_q, x_kv, visible, terms, query_coords,
                                   key_coords), p["attention_norm"], cfg.layer_norm_eps)
    return layer_norm(x + mlp(x, p["mlp"], cfg.hidden_act), p["mlp_norm"], cfg.layer_norm_eps)


def pre_ln_layer(p: Params, cfg, x, visible, terms, coords, key_coords):
    """x += Attn(LN(x)); x += MLP(LN(x))."""
    y = layer_norm(x, p["attention_norm"], cfg.layer_norm_eps)
    x = x + attention(p["attention"], cfg, y, y, visible, terms, coords, key_coords)
    return x + mlp(layer_norm(x, p["mlp_norm"], cfg.layer_norm_eps), p["mlp"], cfg.hidden_act)


# ---------------------------------------------------------------------------------------------
# Text
# ---------------------------------------------------------------------------------------------

def text_embeddings(p: Params, cfg, ids: np.ndarray, types: np.ndarray | None,
                    mask: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """x = LN(proj(E_word[ids] + [E_pos[i]] + [E_type[t]])) (DeBERTa: · mask); also E_pos rows.

    Absolute rows are added for BERT-A/R and for DeBERTa with position_biased_input; TUPE adds
    none. The raw position rows (L, E) are returned for DeBERTa's EMD (None without a table).
    """
    scheme = cfg.position_scheme
    x = p["word_embeddings"]["embedding"][ids]
    pos = None
    if "position_embeddings" in p:
        pos = p["position_embeddings"]["embedding"][: ids.shape[1]]
        if scheme not in DEBERTA or cfg.position_biased_input:
            x = x + pos
    if cfg.type_vocab_size:
        x = x + p["token_type_embeddings"]["embedding"][
            np.zeros_like(ids) if types is None else types]
    if "embed_proj" in p:
        x = linear(x, p["embed_proj"])
    x = layer_norm(x, p["norm"], cfg.layer_norm_eps)
    if scheme in DEBERTA:
        x = x * mask[..., None]
    return x, pos


def conv1d_same(x: np.ndarray, p: Params, groups: int) -> np.ndarray:
    """Grouped 1D cross-correlation, zero padding (k−1)/2 each side: (B, L, C) -> (B, L, O).

    y[t, o] = b[o] + Σ_u Σ_c x[t + u − (k−1)/2, g·C/G + c] · W[u, c, o], g = o // (O/G).
    """
    kernel = p["kernel"]
    k, c_in_group, c_out = kernel.shape
    pad = (k - 1) // 2
    xp = np.pad(x, ((0, 0), (pad, pad), (0, 0)))
    out_per_group = c_out // groups
    y = np.zeros(x.shape[:2] + (c_out,))
    for g in range(groups):
        xs = xp[..., g * c_in_group:(g + 1) * c_in_group]
        w = kernel[..., g * out_per_group:(g + 1) * out_per_group]
        for u in range(k):
            y[..., g * out_per_group:(g + 1) * out_per_group] += (
                xs[:, u: u + x.shape[1]] @ w[u])
    return y + p["bias"]


def text_encoder(p: Params, cfg, ids: np.ndarray, mask: np.ndarray,
                 types: np.ndarray | None = None) -> tuple[list[np.ndarray], np.ndarray | None]:
    """Every layer's output (each (B, L, H)) and the raw absolute rows (L, E) or None.

    p: the TextEncoder subtree {'embeddings', 'encoder'}. Post-LN layers; BERT/TUPE mask keys,
    DeBERTa masks queries and keys; the v2 conv layer joins after layer 0.
    """
    mask = np.asarray(mask, bool)
    batch, length = ids.shape
    x, pos = text_embeddings(p["embeddings"], cfg, ids, types, mask)
    coords = [np.arange(length)]
    terms = position_terms(p["encoder"], cfg, length, coords, has_cls=True, is_grid=False)
    visible = mask[:, None, None, :]
    if cfg.position_scheme in DEBERTA:
        visible = visible & mask[:, None, :, None]
    query_coords = [np.broadcast_to(c, (batch, length)) for c in coords]
    outputs, h = [], x
    for i in range(cfg.num_layers):
        h = post_ln_layer(p["encoder"][f"layer_{i}"], cfg, h, h, visible, terms, query_coords,
                          coords)
        if i == 0 and cfg.conv_kernel_size:
            pc = p["encoder"]["conv"]
            y = conv1d_same(x, pc["conv"], cfg.conv_groups) * mask[..., None]
            y = ACTIVATIONS[cfg.conv_act](y)
            h = layer_norm(h + y, pc["norm"], cfg.layer_norm_eps) * mask[..., None]
        outputs.append(h)
    return outputs, pos


def enhanced_mask_decoder(p: Params, cfg, layers: list[np.ndarray], pos: np.ndarray,
                          mask: np.ndarray) -> np.ndarray:
    """DeBERTa EMD at every position: the last layer twice with keys/values H_{L−1}; the first
    query is H_{L−1} + P_abs, the second the first's output. -> (B, L, H)."""
    hidden_prev = layers[-2]
    batch, length, _ = hidden_prev.shape
    coords = [np.arange(length)]
    terms = position_terms(p["encoder"], cfg, length, coords, has_cls=True, is_grid=False)
    visible = np.asarray(mask, bool)[:, None, None, :]
    last = p["encoder"][f"layer_{cfg.num_layers - 1}"]
    query_coords = [np.broadcast_to(coords[0], (batch, length))]
    query = hidden_prev + pos[None]
    for _ in range(2):
        query = post_ln_layer(last, cfg, query, hidden_prev, visible, terms, query_coords, coords)
    return query


def mlm_head(p: Params, cfg, h: np.ndarray, word_embeddings: np.ndarray) -> np.ndarray:
    """LN(act(dense(h))) E_wordᵀ + b: (..., H) -> (..., V)."""
    x = layer_norm(ACTIVATIONS[cfg.hidden_act](linear(h, p["dense"])), p["norm"],
                   cfg.layer_norm_eps)
    return x @ word_embeddings.T + p["bias"]


def masked_lm(p: Params, cfg, ids, mask, types, masked_positions: np.ndarray
              ) -> tuple[list[np.ndarray], np.ndarray]:
    """TextForMaskedLM: (every layer's output, logits (B, M, V) at ``masked_positions`` (B, M))."""
    layers, pos = text_encoder(p["encoder"], cfg, ids, mask, types)
    h = enhanced_mask_decoder(p["encoder"], cfg, layers, pos, mask) if cfg.use_emd else layers[-1]
    h = np.take_along_axis(h, masked_positions[..., None], axis=1)
    word = p["encoder"]["embeddings"]["word_embeddings"]["embedding"]
    return layers, mlm_head(p["mlm_head"], cfg, h, word)


def sequence_classification(p: Params, cfg, ids, mask, types) -> np.ndarray:
    """classifier(act(pooler(h[:, 0]))): (B, num_labels)."""
    h = text_encoder(p["encoder"], cfg, ids, mask, types)[0][-1][:, 0]
    return linear(ACTIVATIONS[cfg.pooler_act](linear(h, p["pooler"])), p["classifier"])


# ---------------------------------------------------------------------------------------------
# ViT
# ---------------------------------------------------------------------------------------------

def patch_embed(images: np.ndarray, p: Params) -> tuple[np.ndarray, tuple[int, int]]:
    """Cut (B, Hi, Wi, C) into row-major p_h × p_w patches and project each: (B, N, H), grid."""
    ph, pw, c, hidden = p["kernel"].shape
    b, hi, wi, _ = images.shape
    gh, gw = hi // ph, wi // pw
    patches = images.reshape(b, gh, ph, gw, pw, c).transpose(0, 1, 3, 2, 4, 5)
    patches = patches.reshape(b, gh * gw, ph * pw * c)
    return patches @ p["kernel"].reshape(ph * pw * c, hidden) + p["bias"], (gh, gw)


def map_pool(p: Params, cfg, x: np.ndarray) -> np.ndarray:
    """Attention pooling: y = MHA(probe, x); y + MLP(LN(y)) -> (B, H)."""
    probe = np.broadcast_to(p["probe"], (x.shape[0], 1, x.shape[-1]))
    visible = np.ones((1, 1, 1, x.shape[1]), bool)
    y = dot_product_attention(p["attention"], probe, x, visible, 1 / math.sqrt(cfg.head_dim), None)
    y = y + mlp(layer_norm(y, p["norm"], cfg.layer_norm_eps), p["mlp"], cfg.hidden_act)
    return y[:, 0]


def vit(p: Params, cfg, images: np.ndarray) -> np.ndarray:
    """ViT logits (B, num_classes), or pooled features when num_classes = 0.

    Pre-LN blocks on [CLS] (pooling 'token') + patches; learned absolute table for
    vit/bert_abs/bert_rel; relative schemes use each token's (row, col) on the patch grid.
    """
    x, (gh, gw) = patch_embed(images, p["embedding"])
    batch = x.shape[0]
    has_cls = cfg.pooling == "token"
    rows, cols = np.divmod(np.arange(gh * gw), gw)
    if has_cls:
        x = np.concatenate([np.broadcast_to(p["cls"], (batch, 1, x.shape[-1])), x], axis=1)
        rows, cols = np.concatenate([[0], rows]), np.concatenate([[0], cols])
    if cfg.position_scheme in ("vit", "bert_abs", "bert_rel"):
        x = x + p["pos_embedding"]
    if cfg.position_scheme == "sincos2d":   # patches only: [CLS] gets no position
        x[:, int(has_cls):] = x[:, int(has_cls):] + sincos_2d((gh, gw), x.shape[-1])
    coords = [rows, cols]
    terms = position_terms(p["encoder"], cfg, x.shape[1], coords, has_cls, is_grid=True)
    visible = np.ones((1, 1, x.shape[1], x.shape[1]), bool)
    query_coords = [np.broadcast_to(c, (batch, len(c))) for c in coords]
    for i in range(cfg.num_layers):
        x = pre_ln_layer(p["encoder"][f"layer_{i}"], cfg, x, visible, terms, query_coords, coords)
    x = layer_norm(x, p["encoder_norm"], cfg.layer_norm_eps)
    if cfg.pooling in ("token", "first"):   # [CLS], or the first patch (no [CLS])
        x = x[:, 0]
    elif cfg.pooling == "gap":
        x = x.mean(1)
    else:
        x = map_pool(p["map_head"], cfg, x)
    if cfg.representation_size:
        x = np.tanh(linear(x, p["pre_logits"]))
    return linear(x, p["head"]) if cfg.num_classes else x


def resample_grid_table(table: np.ndarray, old_grid: tuple[int, int],
                        new_grid: tuple[int, int]) -> np.ndarray:
    """vit_jax's fine-tuning resize: keep the [CLS] row, zoom the (gh, gw, H) grid with
    ``scipy.ndimage.zoom(order=1)`` to the new grid. table: (1, 1 + gh·gw, H)."""
    (gh, gw), (nh, nw) = old_grid, new_grid
    cls, grid = table[:, :1], table[0, 1:].reshape(gh, gw, -1)
    zoomed = scipy.ndimage.zoom(grid, (nh / gh, nw / gw, 1), order=1)
    return np.concatenate([cls, zoomed.reshape(1, nh * nw, -1)], axis=1)
