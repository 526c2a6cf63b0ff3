"""Text models: embeddings + the shared encoder, with MLM (optionally EMD) and GLUE heads.

Inputs everywhere: ``input_ids`` (B, L) int, ``attention_mask`` (B, L) (1 = token, 0 = pad,
right padding, token 0 = [CLS]), optional ``token_type_ids`` (B, L). Shapes and dtypes are
checked when traced; values cannot be under ``jit``: an id >= vocab_size makes its sequence's
outputs NaN, a masked position >= L its own logits (JAX's gathers fill out-of-range rows with
NaN).
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from posjax.layers.attention import ACTIVATIONS, DEFAULT_INIT, dense, layer_norm
from posjax.layers.dropout import Dropout
from posjax.models.config import TextConfig
from posjax.models.encoder import Encoder, compute_dtype
from posjax.models.schemes import absolute_rows, input_table, scheme_of

Array = jax.Array


def _embed(num: int, features: int, names: tuple[str, str], name: str) -> nn.Embed:
    return nn.Embed(num, features, param_dtype=jnp.float32, name=name,
                    embedding_init=nn.with_logical_partitioning(DEFAULT_INIT, names))


def _lookup(table: nn.Embed, ids: Array) -> Array:
    """E[ids]: (B, L) integer ids -> (B, L, E) rows, batch-sharded like the activations.

    With the default rules the table is split along ``embed`` (fsdp) and ``vocab`` (tensor).
    Each device takes the rows of its table slice for the ids of its whole fsdp group
    (``lookup_batch``: the batch split over ``data`` only; the vocab-split partial rows are
    summed over tensor); one all-to-all over fsdp then trades the ``embed`` split for the batch
    split. Left to itself, XLA's SPMD partitioner replicates the whole (B, L, E) tensor on
    meshes with data and fsdp both > 1. Rules that do not map ``lookup_batch`` add no
    constraint on the ids or on the rows before the final (batch, length, embed) one.
    """
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"token ids must be integers, not {ids.dtype}")
    unless_ruled = nn.spmd.RulesFallback.NO_CONSTRAINT
    ids = nn.with_logical_constraint(ids, ("lookup_batch", None), fallback=unless_ruled)
    rows = nn.with_logical_constraint(jnp.take(table.embedding, ids, axis=0),
                                      ("lookup_batch", None, "embed"), fallback=unless_ruled)
    return nn.with_logical_constraint(rows, ("batch", "length", "embed"))


@jax.custom_vjp
def tied_logits(x: Array, table: Array, bias: Array) -> Array:
    """x (..., E) · tableᵀ + bias: the tied output layer, (V, E) table, (V,) bias -> (..., V).

    The same values as ``x @ table.T + bias``. The backward is written out as three 2-D
    products: dx = g·table, d table = gᵀ·x (contracting the rows of both, which XLA:CPU runs
    without transposing g) and d bias = 1ᵀ·g. Left to autodiff, the bias gradient was a
    reduce of g over its rows, which XLA:CPU (jaxlib 0.10) runs as a YNNPACK reduce ~5x
    slower than the product with a ones vector, on a (rows, 30k) tensor the size of the logits.
    """
    return _tied_logits(x, table, bias)


def _tied_logits(x: Array, table: Array, bias: Array) -> Array:
    rows = x.reshape(-1, x.shape[-1])
    out = jax.lax.dot_general(rows, table, (((1,), (1,)), ((), ()))) + bias
    return out.reshape(x.shape[:-1] + table.shape[:1])


def _tied_logits_fwd(x: Array, table: Array, bias: Array) -> tuple[Array, tuple[Array, Array]]:
    return _tied_logits(x, table, bias), (x, table)


def _tied_logits_bwd(res: tuple[Array, Array], g: Array) -> tuple[Array, Array, Array]:
    x, table = res
    rows, grads = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
    dx = jnp.dot(grads, table).reshape(x.shape)
    dtable = jax.lax.dot_general(grads, rows, (((0,), (0,)), ((), ())))
    dbias = jnp.dot(jnp.ones(grads.shape[:1], grads.dtype), grads)
    return dx, dtable, dbias


tied_logits.defvjp(_tied_logits_fwd, _tied_logits_bwd)


def _lookup_small(table: nn.Embed, ids: Array) -> Array:
    """E[ids] from a table of a few rows (token types), made whole first (a few KiB). A
    one-row table gives its row for every id, as ``nn.Embed`` does."""
    whole = nn.with_logical_constraint(table.embedding, (None, None))
    if table.num_embeddings == 1:
        rows = jnp.broadcast_to(whole[0], ids.shape + whole.shape[1:])
    else:
        rows = jnp.take(whole, ids, axis=0)
    return nn.with_logical_constraint(rows, ("batch", "length", "embed"))


def check_table_length(cfg: TextConfig, length: int) -> None:
    """Refuse a sequence longer than the absolute table the model reads (schemes.absolute_rows)."""
    rows = absolute_rows(cfg)
    if rows and length > rows:
        raise ValueError(f"sequence length {length} exceeds max_position_embeddings={rows}: "
                         "truncate inputs or enlarge the table")


class TextEmbeddings(nn.Module):
    """x = LN(E_word[ids] (+ E_pos[i]) (+ E_type[t]) (-> embed_proj)); DeBERTa then zeroes pads.

    Absolute positions are added for BERT-A/R and DeBERTa with ``position_biased_input``; TUPE
    adds none (its positions enter the attention logits). Returns (x, raw position embeddings or
    None) — the latter is EMD's P_abs.
    """

    cfg: TextConfig

    def setup(self) -> None:
        cfg = self.cfg
        e = cfg.input_embedding_size
        self.word_embeddings = _embed(cfg.vocab_size, e, ("vocab", "embed"), "word_embeddings")
        if self.has_position_table:
            self.position_embeddings = _embed(cfg.max_position_embeddings, e, ("pos", "embed"),
                                              "position_embeddings")
        if cfg.type_vocab_size:
            self.token_type_embeddings = _embed(cfg.type_vocab_size, e, (None, "embed"),
                                                "token_type_embeddings")
        if e != cfg.hidden_size:
            self.embed_proj = dense(cfg.hidden_size, ("embed_in", "embed"), name="embed_proj",
                                    dtype=compute_dtype(cfg), use_bias=False)
        self.norm = layer_norm(cfg.layer_norm_eps, name="norm", dtype=compute_dtype(cfg))
        self.dropout = Dropout(cfg.dropout_rate)

    @property
    def has_position_table(self) -> bool:
        return input_table(self.cfg)

    def __call__(self, input_ids: Array, token_mask: Array, token_type_ids: Array | None,
                 train: bool) -> tuple[Array, Array | None]:
        cfg = self.cfg
        length = input_ids.shape[1]
        x = _lookup(self.word_embeddings, input_ids)
        pos = None
        if self.has_position_table:
            check_table_length(cfg, length)
            pos = self.position_embeddings(jnp.arange(length))[None]
            if scheme_of(cfg).learned_input or cfg.position_biased_input:
                x = x + pos
        if cfg.type_vocab_size:
            types = jnp.zeros_like(input_ids) if token_type_ids is None else token_type_ids
            x = x + _lookup_small(self.token_type_embeddings, types)
        x = x.astype(compute_dtype(cfg))
        if cfg.input_embedding_size != cfg.hidden_size:
            x = self.embed_proj(x)
        x = self.norm(x)
        if scheme_of(cfg).disentangled:
            x = x * token_mask[..., None].astype(x.dtype)
        x = self.dropout(x, deterministic=not train)
        return nn.with_logical_constraint(x, ("batch", "length", "embed")), pos

    def attend(self, x: Array, bias: Array | None = None) -> Array:
        """Tied output projection x E_wordᵀ (+ bias, (V,)): (..., E) -> (..., V) in fp32."""
        if bias is None:
            return self.word_embeddings.attend(x.astype(jnp.float32))
        return tied_logits(x.astype(jnp.float32), self.word_embeddings.embedding,
                           bias.astype(jnp.float32))


def _check_is_array(name: str, value: Any) -> None:
    if value is not None and not (hasattr(value, "shape") and hasattr(value, "dtype")):
        raise ValueError(f"{name} must be an array (numpy or jax), not {type(value).__name__}: "
                         f"pass np.asarray({name})")


def check_token_inputs(input_ids: Array, attention_mask: Array,
                       token_type_ids: Array | None = None) -> None:
    """One ValueError naming the argument unless input_ids, attention_mask, token_type_ids are
    (B, L) arrays, ids of an integer dtype."""
    if attention_mask is None:
        raise ValueError("attention_mask is None: pass the (B, L) mask of real tokens "
                         "(jnp.ones_like(input_ids) when nothing is padded)")
    for name, value in (("input_ids", input_ids), ("attention_mask", attention_mask),
                        ("token_type_ids", token_type_ids)):
        _check_is_array(name, value)
    shape = tuple(input_ids.shape)
    if len(shape) != 2 or not jnp.issubdtype(input_ids.dtype, jnp.integer):
        raise ValueError(f"input_ids {shape} {input_ids.dtype} must be integer (B, L) ids")
    named = {"attention_mask": attention_mask, "token_type_ids": token_type_ids}
    for name, value in named.items():
        if value is not None and tuple(value.shape) != shape:
            raise ValueError(f"{name} {tuple(value.shape)} must have the shape of input_ids "
                             f"{shape}")
    if token_type_ids is not None and not jnp.issubdtype(token_type_ids.dtype, jnp.integer):
        raise ValueError(f"token_type_ids must be integer, not {token_type_ids.dtype}")


def check_masked_positions(masked_positions: Array | None, batch: int) -> None:
    """One ValueError unless masked_positions is None or an integer (B, M) array."""
    _check_is_array("masked_positions", masked_positions)
    if masked_positions is not None and (
            masked_positions.ndim != 2 or masked_positions.shape[0] != batch
            or not jnp.issubdtype(masked_positions.dtype, jnp.integer)):
        raise ValueError(f"masked_positions {tuple(masked_positions.shape)} "
                         f"{masked_positions.dtype} must be integer (B={batch}, M) positions")


class TextEncoder(nn.Module):
    """Embeddings + encoder. ``__call__`` returns the last hidden states (B, L, H)."""

    cfg: TextConfig

    def setup(self) -> None:
        self.embeddings = TextEmbeddings(self.cfg)
        self.encoder = Encoder(self.cfg, pre_ln=False)

    def _embed(self, input_ids: Array, attention_mask: Array, token_type_ids: Array | None,
               train: bool) -> tuple[Array, Array | None, Array]:
        """(embedded tokens, raw absolute positions or None, bool token mask)."""
        cfg = self.cfg
        check_token_inputs(input_ids, attention_mask, token_type_ids)
        check_table_length(cfg, input_ids.shape[1])
        token_mask = attention_mask.astype(bool)
        x, pos = self.embeddings(input_ids, token_mask, token_type_ids, train)
        return x, pos, token_mask

    def __call__(self, input_ids: Array, attention_mask: Array, token_type_ids: Array | None = None,
                 *, train: bool = False, first_only: bool = False) -> Array:
        """Last hidden states (B, L, H); ``first_only``: the caller reads only [CLS], (B, 1, H)
        (``Encoder``: the last layer computes that row alone), but (B, L, H) while
        intermediates are captured, so that captured hidden states stay whole."""
        x, _, token_mask = self._embed(input_ids, attention_mask, token_type_ids, train)
        return self.encoder(x, token_mask, train=train, first_only=first_only)

    def hidden_states(self, input_ids: Array, attention_mask: Array,
                      token_type_ids: Array | None = None, *, train: bool = False
                      ) -> tuple[list[Array], Array | None, Array]:
        """(every layer's output, raw absolute positions or None, bool token mask)."""
        x, pos, token_mask = self._embed(input_ids, attention_mask, token_type_ids, train)
        return self.encoder(x, token_mask, train=train, return_all=True), pos, token_mask

    def attend(self, x: Array, bias: Array | None = None) -> Array:
        return self.embeddings.attend(x, bias)


class MlmHead(nn.Module):
    """dense(H->E) -> act -> LN -> x E_wordᵀ + b (tied), fp32 logits."""

    cfg: TextConfig

    @nn.compact
    def __call__(self, x: Array, attend) -> Array:
        cfg = self.cfg
        x = dense(cfg.input_embedding_size, ("embed", "embed_out"), name="dense",
                  dtype=compute_dtype(cfg))(x)
        x = ACTIVATIONS[cfg.hidden_act](x)
        x = layer_norm(cfg.layer_norm_eps, name="norm", dtype=compute_dtype(cfg))(x)
        bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros_init(),
                                                               ("vocab",)),
                          (cfg.vocab_size,), jnp.float32)
        return attend(x, bias)


class TextForMaskedLM(nn.Module):
    """Masked-LM logits (B, M, V) at ``masked_positions`` (B, M), or (B, L, V) at all positions.

    With ``cfg.use_emd`` (DeBERTa) the enhanced mask decoder produces the states that are decoded.
    """

    cfg: TextConfig

    def setup(self) -> None:
        self.encoder = TextEncoder(self.cfg)
        self.mlm_head = MlmHead(self.cfg)

    def __call__(self, input_ids: Array, attention_mask: Array,
                 token_type_ids: Array | None = None, masked_positions: Array | None = None,
                 *, train: bool = False) -> Array:
        check_token_inputs(input_ids, attention_mask, token_type_ids)
        check_masked_positions(masked_positions, input_ids.shape[0])
        layers, pos, token_mask = self.encoder.hidden_states(input_ids, attention_mask,
                                                             token_type_ids, train=train)
        if self.cfg.use_emd:
            h = self.encoder.encoder.enhanced_mask_decoder(layers[-2], pos, token_mask,
                                                           masked_positions, train=train)
        else:
            h = layers[-1]
            if masked_positions is not None:
                h = jnp.take_along_axis(h, masked_positions[..., None], axis=1)
        return self.mlm_head(h, self.encoder.attend)


class TextForSequenceClassification(nn.Module):
    """GLUE head on [CLS]: logits = W · dropout(act(dense(dropout(h_0)))) + b; num_labels=1 is
    regression (STS-B). The head of the official DeBERTa (ContextPooler) and of fairseq, which
    TUPE's code uses, for every scheme; HF's BertForSequenceClassification has no dropout
    before its pooler (same values in eval mode)."""

    cfg: TextConfig
    num_labels: int = 2

    @nn.compact
    def __call__(self, input_ids: Array, attention_mask: Array,
                 token_type_ids: Array | None = None, *, train: bool = False) -> Array:
        cfg = self.cfg
        h = TextEncoder(cfg, name="encoder")(input_ids, attention_mask, token_type_ids, train=train,
                                             first_only=True)
        x = Dropout(cfg.dropout_rate)(h[:, 0], deterministic=not train)
        x = dense(cfg.hidden_size, ("embed", "mlp"), name="pooler", dtype=compute_dtype(cfg))(x)
        x = ACTIVATIONS[cfg.pooler_act](x)
        x = Dropout(cfg.dropout_rate)(x, deterministic=not train)
        return dense(self.num_labels, ("mlp", None), name="classifier",
                     dtype=jnp.float32)(x.astype(jnp.float32))
