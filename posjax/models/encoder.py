"""One Transformer encoder for every position scheme (docs/design.md §2).

The scheme decides (i) what the embeddings add to the input (outside this module) and (ii) the
additive attention-logit terms, which ``Encoder.position_terms`` computes ONCE per forward and
hands to every layer. Text uses post-LN blocks, ViT pre-LN blocks. The layers are either
unrolled (``layer_i`` submodules) or, with ``scan_layers``, one ``lax.scan`` over parameters
stacked on a leading axis (``posjax.models.layout`` converts between the two layouts).
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from posjax.layers.attention import ACTIVATIONS, MultiHeadAttention, Mlp, layer_norm
from posjax.layers.disentangled import DisentangledAttention
from posjax.layers.dropout import Dropout
from posjax import kernels
from posjax.layers import blocked, positions
from posjax.layers.position_bias import T5RelativeBias, TupePositionBias, alibi_bias
from posjax.models.config import TextConfig, ViTConfig
from posjax.models.schemes import scheme_of

Array = jax.Array
Config = TextConfig | ViTConfig


def compute_dtype(cfg: Config) -> jnp.dtype:
    return jnp.dtype(cfg.dtype)


def logit_scale(cfg: Config) -> float:
    """1/√(f·d) with the scheme's ``logit_factor`` f: 1 (BERT, ViT, RoPE, ALiBi), 2 (TUPE: word
    and position correlations share the budget) or 4 (BERT-A-d: word-word, word-position,
    position-word and position-position). DeBERTa's own scale is its attention layer's."""
    return float(max(scheme_of(cfg).logit_factor, 1) * cfg.head_dim) ** -0.5


def relative_span(cfg: Config) -> int:
    """k, the half-size of DeBERTa's relative table (per axis)."""
    if "position_buckets" in scheme_of(cfg).fields and cfg.position_buckets > 0:
        return cfg.position_buckets
    return cfg.max_relative_positions


def has_conv(cfg: Config) -> bool:
    """DeBERTa-v2's convolution branch after layer 0."""
    return isinstance(cfg, TextConfig) and bool(cfg.conv_kernel_size)


def attention_kernel(cfg: Config) -> str:
    """What runs the memory-bounded path (``posjax.kernels.attention_fn``): the Pallas kernel
    for ``attention_impl='pallas'``, and for 'auto' on a TPU while attention dropout is off
    and the blocks fit the TPU's tiling (``kernels.TPU_BLOCK``) (interpreted with
    ``pallas_interpret``); else the plain-JAX scan ('blocked')."""
    pallas = cfg.attention_impl == "pallas" or (
        cfg.attention_impl == "auto" and cfg.attention_dropout_rate == 0
        and cfg.attention_block_size % kernels.TPU_BLOCK == 0
        and kernels.target_platform() == "tpu")
    return ("pallas_interpret" if cfg.pallas_interpret else "pallas") if pallas else "blocked"


def can_run_first_only(cfg: Config) -> bool:
    """Whether the last layer may compute token 0 alone (``Encoder(first_only=True)``): not
    when it is also layer 0 and DeBERTa-v2's convolution needs that layer's every row."""
    return not (has_conv(cfg) and cfg.num_layers == 1)


class EncoderLayer(nn.Module):
    """One block. Post-LN: x = LN(x + Attn(x)); x = LN(x + MLP(x)). Pre-LN: x += Attn(LN(x)); …

    ``x_kv``: the states keys and values are read from, None for self-attention (x_q); they
    differ only in DeBERTa's EMD (queries H_{L−1}+P, keys H_{L−1}) and for ``first_query``.
    ``first_query``: ``x_q`` is token 0's row alone (static, so that DeBERTa reads its relative
    products for that one query even under remat).
    """

    cfg: Config
    pre_ln: bool
    grid: tuple[int, int] | None = None

    @nn.compact
    def __call__(self, x_q: Array, x_kv: Array | None, mask: Array | None, terms: dict[str, Any],
                 query_positions: Array | None = None, train: bool = False,
                 first_query: bool = False) -> Array:
        cfg = self.cfg
        if first_query:
            query_positions = np.zeros((1, 1), np.int32)
        dtype = compute_dtype(cfg)
        block_size = cfg.attention_block_size if "block_terms" in terms else 0
        kernel = attention_kernel(cfg)
        if scheme_of(cfg).disentangled:
            attention = DisentangledAttention(
                num_heads=cfg.num_heads, head_dim=cfg.head_dim, pos_att_type=cfg.pos_att_type,
                span=relative_span(cfg), max_relative_positions=cfg.max_relative_positions,
                position_buckets=(cfg.position_buckets
                                  if "position_buckets" in scheme_of(cfg).fields else 0),
                v1=scheme_of(cfg).deberta_version == 1, share_att_key=cfg.share_att_key,
                grid=self.grid, gather=cfg.gather, dtype=dtype,
                attention_dropout_rate=cfg.attention_dropout_rate,
                dropout_rate=cfg.dropout_rate, block_size=block_size, kernel=kernel,
                name="attention")

            def attend(q, kv):
                return attention(q, kv, rel_table=terms["rel_table"], mask=mask,
                                 query_positions=query_positions, train=train,
                                 query_mask=terms.get("query_mask"))
        else:
            attention = MultiHeadAttention(
                num_heads=cfg.num_heads, head_dim=cfg.head_dim, logit_scale=logit_scale(cfg),
                dtype=dtype, attention_dropout_rate=cfg.attention_dropout_rate,
                qkv_bias=getattr(cfg, "qkv_bias", True), block_size=block_size,
                kernel=kernel, name="attention")

            def attend(q, kv):
                return attention(q, kv, mask=mask, bias=terms.get("bias"),
                                 position_query=terms.get("position_query"),
                                 position_key=terms.get("position_key"),
                                 rotary=terms.get("rotary"), train=train,
                                 block_terms=terms.get("block_terms"))

        drop = Dropout(cfg.dropout_rate)
        mlp = Mlp(cfg.mlp_dim, cfg.hidden_act, dtype=dtype, dropout_rate=cfg.dropout_rate,
                  inner_dropout=self.pre_ln, name="mlp")
        norm1 = layer_norm(cfg.layer_norm_eps, name="attention_norm", dtype=dtype)
        norm2 = layer_norm(cfg.layer_norm_eps, name="mlp_norm", dtype=dtype)
        if self.pre_ln:
            y = norm1(x_q)
            x = x_q + drop(attend(y, y if x_kv is None else norm1(x_kv)), deterministic=not train)
            return x + drop(mlp(norm2(x), train=train), deterministic=not train)
        x = norm1(x_q + drop(attend(x_q, x_q if x_kv is None else x_kv),
                             deterministic=not train))
        x = norm2(x + drop(mlp(x, train=train), deterministic=not train))
        return nn.with_logical_constraint(x, ("batch", "length", "embed"))


class ConvLayer(nn.Module):
    """DeBERTa-v2 convolution beside layer 0: LN(residual + act(dropout(conv(x) masked))) · mask."""

    cfg: TextConfig

    @nn.compact
    def __call__(self, x: Array, residual: Array, token_mask: Array, train: bool) -> Array:
        cfg = self.cfg
        dtype = compute_dtype(cfg)
        y = nn.Conv(cfg.hidden_size, (cfg.conv_kernel_size,), padding="SAME",
                    feature_group_count=cfg.conv_groups, dtype=dtype, param_dtype=jnp.float32,
                    kernel_init=nn.with_logical_partitioning(
                        nn.initializers.normal(0.02), (None, None, "embed")),
                    bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), ("embed",)),
                    name="conv")(x)
        y = jnp.where(token_mask[..., None], y, 0)
        y = ACTIVATIONS[cfg.conv_act](Dropout(cfg.dropout_rate)(y, deterministic=not train))
        out = layer_norm(cfg.layer_norm_eps, name="norm", dtype=dtype)(residual + y)
        return out * token_mask[..., None].astype(out.dtype)


class Encoder(nn.Module):
    """Layer stack plus the scheme's shared position terms.

    ``grid``: patch grid for images (2D relative positions); ``has_cls``: token 0 is [CLS].
    """

    cfg: Config
    pre_ln: bool
    grid: tuple[int, int] | None = None
    has_cls: bool = True

    def setup(self) -> None:
        cfg = self.cfg
        scheme = scheme_of(cfg)
        untie = self.has_cls and not cfg.tie_cls   # TUPE's [CLS] reset (and TUPE-R's buckets)
        if "t5" in scheme.terms:
            self.relative_bias = T5RelativeBias(
                cfg.num_heads, cfg.relative_buckets, cfg.relative_max_distance,
                # On a grid [CLS] has no position: its pairs always use the two extra buckets.
                untie_cls=(untie and scheme.untied) or (self.grid is not None and self.has_cls),
                grid=self.grid)
        if scheme.untied:
            max_len = (cfg.max_position_embeddings if isinstance(cfg, TextConfig)
                       else cfg.num_tokens)
            # BERT-A-d (TUPE's ablation) keeps [CLS] tied and adds the two mixed terms.
            mixed = "mixed" in scheme.terms
            self.tupe_bias = TupePositionBias(
                cfg.num_heads, cfg.head_dim, max_len, eps=cfg.layer_norm_eps,
                untie_cls=untie and not mixed, logit_scale=logit_scale(cfg), mixed_terms=mixed)
        if scheme.disentangled:
            axes = 1 if self.grid is None else 2
            self.rel_embeddings = self.param(
                "rel_embeddings", nn.with_logical_partitioning(nn.initializers.normal(0.02),
                                                               ("pos", "embed")),
                (axes * 2 * relative_span(cfg), cfg.hidden_size), jnp.float32)
            if cfg.norm_rel_ebd:
                self.rel_norm = layer_norm(cfg.layer_norm_eps, name="rel_norm",
                                           dtype=jnp.float32)
        if has_conv(self.cfg):
            self.conv = ConvLayer(cfg)
        if cfg.scan_layers:
            # One parameter tree with a leading 'layers' axis: params['layers'][...] of shape
            # (num_layers, *per-layer shape), run by one lax.scan (see ``_scan``).
            self.layer_stack = self.param("layers", self._init_layer_stack)
        else:
            # static_argnums counts self as argument 0: `train` and `first_query` are 6 and 7
            # (always given positionally: remat refuses static positions past the arguments).
            layer_cls = (nn.remat(EncoderLayer, static_argnums=(6, 7)) if cfg.remat
                         else EncoderLayer)
            self.layers = [layer_cls(cfg, self.pre_ln, self.grid, name=f"layer_{i}")
                           for i in range(cfg.num_layers)]

    def _layer(self) -> EncoderLayer:
        """An unbound layer, applied functionally to one slice of the stacked params."""
        return EncoderLayer(self.cfg, self.pre_ln, self.grid, parent=None)

    def _init_layer_stack(self, rng: Array) -> Any:
        """num_layers independent layer inits stacked on a new leading axis named 'layers'.

        Parameter shapes do not depend on the sequence length, so a short dummy input is used
        (the whole grid for images, whose 2D relative positions are defined per patch).
        """
        cfg = self.cfg
        length = 1 if self.grid is None else self.grid[0] * self.grid[1] + int(self.has_cls)
        x = jnp.zeros((1, length, cfg.hidden_size), compute_dtype(cfg))
        mask = jnp.ones((1, 1, length, length), bool)
        terms = self.position_terms(length)

        def init_one(key: Array) -> Any:
            return self._layer().init({"params": key}, x, None, mask, terms)["params"]

        stacked = jax.vmap(init_one)(jax.random.split(rng, cfg.num_layers))
        return jax.tree.map(lambda p: p.add_axis(0, {nn.PARTITION_NAME: "layers"}), stacked,
                            is_leaf=lambda p: isinstance(p, nn.Partitioned))

    def _apply_layer(self, params: Any, x_q: Array, x_kv: Array | None, mask: Array,
                     terms: dict[str, Any], query_positions: Array | None, train: bool,
                     rng: Array | None, first_query: bool = False) -> tuple[Array, Any]:
        """One layer from its params -> (output, its sown intermediates or {})."""
        capture = self.is_mutable_collection("intermediates")
        rngs = None if rng is None else {"dropout": rng}
        out = self._layer().apply({"params": params}, x_q, x_kv, mask, terms, query_positions,
                                  train, first_query, rngs=rngs,
                                  mutable=["intermediates"] if capture else False)
        return out if capture else (out, {})

    def _dropout_rng(self, train: bool) -> Array | None:
        return self.make_rng("dropout") if train and self.has_rng("dropout") else None

    def _scan(self, params: Any, h: Array, mask: Array, terms: dict[str, Any],
              train: bool) -> tuple[Array, Array]:
        """lax.scan of the layer over ``params``' leading axis -> (last output, all outputs)."""
        count = jax.tree.leaves(params)[0].shape[0]
        rng = self._dropout_rng(train)
        rngs = None if rng is None else jax.random.split(rng, count)

        def body(carry, xs):
            layer_params, rng = xs
            out, sown = self._apply_layer(layer_params, carry, None, mask, terms, None, train,
                                          rng)
            return out, (out, sown)

        if self.cfg.remat:
            body = jax.checkpoint(body, prevent_cse=False)
        last, (outputs, sown) = jax.lax.scan(body, h, (params, rngs))
        for i in range(count):   # the scan stacked each layer's intermediates on axis 0
            self._resow(jax.tree.map(lambda a: a[i], sown))
        return last, outputs

    def _resow(self, sown: Any) -> None:
        """Sow here what one functionally applied layer sowed (attention maps, for plots)."""
        for path, value in jax.tree_util.tree_leaves_with_path(sown):
            name = path[-2].key   # path ends (..., sow name, index in the sown tuple)
            self.sow("intermediates", name, value)

    def uses_blocked_attention(self, length: int) -> bool:
        """Whether a forward over ``length`` tokens runs the memory-bounded blocked path
        (``posjax.layers.blocked``): from ``cfg.blocked_attention_from`` tokens on (0: never),
        except DeBERTa on a patch grid (its 2D relative terms have no blocked form), and not
        while attention maps are captured (the blocked path has no L × L map);
        ``attention_impl`` 'xla': never, 'blocked'/'pallas': at every length
        (``attention_kernel`` says what runs it)."""
        impl, start = self.cfg.attention_impl, self.cfg.blocked_attention_from
        grid_deberta = self.grid is not None and scheme_of(self.cfg).disentangled
        if impl == "xla" or grid_deberta or self.is_mutable_collection("intermediates"):
            return False
        return impl != "auto" or (start > 0 and length >= start)

    def position_terms(self, length: int, blocked_path: bool = False) -> dict[str, Any]:
        """The position terms every layer shares, computed once: {'bias': (1, h, L, L)} (the sum
        of the scheme's additive terms; with BERT-A-d also the position sides of its mixed
        terms, 'position_query' and 'position_key', (L, h, d) each), {'rotary': (cos, sin)}
        (RoPE, each (L, A, m/2)) or {'rel_table': (A·2k, H)} (DeBERTa). On the blocked path
        (``blocked_path``) the additive terms come un-materialised as 'block_terms'
        (``blocked.BlockTerms``) instead of 'bias'."""
        cfg = self.cfg
        scheme = scheme_of(cfg)
        terms: dict[str, Any] = {}
        if blocked_path:
            terms["block_terms"] = blocked.BlockTerms()
        if scheme.disentangled:
            table = self.rel_embeddings
            if cfg.norm_rel_ebd:
                table = self.rel_norm(table)
            terms["rel_table"] = table.astype(compute_dtype(cfg))
            return terms
        coords, positioned = positions.token_coordinates(length, self.grid, self.has_cls)
        if scheme.rotary:
            cos, sin = positions.rotary_angles(coords, positioned, cfg.head_dim, cfg.rope_base)
            terms["rotary"] = (jnp.asarray(cos), jnp.asarray(sin))
        if blocked_path:
            block_terms = terms["block_terms"]
            if scheme.untied:
                untied = self.tupe_bias.block_terms(length)
                block_terms = block_terms.with_products(untied.pop("untied"))
                terms.update(untied)
            if "t5" in scheme.terms:
                block_terms = block_terms.replace(
                    relative_bias=self.relative_bias.block_terms(length))
            if "alibi" in scheme.terms:
                slopes = jnp.asarray(positions.alibi_slopes(cfg.num_heads))
                grid_coords = ({} if self.grid is None else dict(
                    coords=jnp.asarray(np.stack(coords), jnp.int32),
                    positioned=jnp.asarray(positioned)))
                block_terms = block_terms.replace(
                    linear_bias=blocked.LinearBias(slopes, **grid_coords))
            terms["block_terms"] = block_terms
            return terms
        bias = None
        if scheme.untied:
            untied = self.tupe_bias(length)
            bias = untied.pop("bias")
            terms.update(untied)
        if "t5" in scheme.terms:
            rel = self.relative_bias(length)
            bias = rel if bias is None else bias + rel
        if "alibi" in scheme.terms:
            bias = alibi_bias(cfg.num_heads, coords, positioned)
        if bias is not None:
            terms["bias"] = bias[None]
        return terms

    def attention_mask(self, token_mask: Array, blocked_path: bool = False) -> Array:
        """(B, 1, Lq, Lk) bool. DeBERTa masks padded queries too (official XSoftmax); on the
        blocked path that query part goes separately (terms['query_mask']) and this is the
        (B, 1, 1, Lk) key mask, so no L × L mask exists."""
        keys = token_mask[:, None, None, :]
        if scheme_of(self.cfg).disentangled and not blocked_path:
            return keys & token_mask[:, None, :, None]
        return keys

    def __call__(self, x: Array, token_mask: Array, *, train: bool = False,
                 return_all: bool = False, first_only: bool = False) -> Array | list[Array]:
        """x: (B, L, H) embedded tokens; token_mask: (B, L) bool -> (B, L, H) (or every layer's).

        ``first_only``: the caller reads only token 0 (a [CLS] classifier), so the last layer
        computes only that row: its query, one attention row over every key, the MLP. Returns
        (B, 1, H), equal to ``[:, :1]`` of the full output (dropout masks aside), for ~1/L of
        the last layer's cost; where the row cannot run alone (``can_run_first_only``) the
        last layer computes every row and row 0 is returned. While intermediates are captured
        the full (B, L, H) is computed and returned, so that captured hidden states and
        attention maps stay whole (``[:, :1]`` of it is the (B, 1, H) above).
        """
        if return_all and first_only:
            raise ValueError("return_all=True needs every token of every layer: "
                             "set first_only=False")
        blocked_path = self.uses_blocked_attention(x.shape[1])
        terms = self.position_terms(x.shape[1], blocked_path)
        mask = self.attention_mask(token_mask, blocked_path)
        if blocked_path and scheme_of(self.cfg).disentangled:
            terms["query_mask"] = token_mask
        capturing = self.is_mutable_collection("intermediates")
        row_alone = first_only and can_run_first_only(self.cfg) and not capturing
        first_row = first_only and not row_alone and not capturing   # sliced from every row
        if self.cfg.scan_layers:
            out = self._scanned_call(x, token_mask, mask, terms, train, return_all, row_alone)
            return out[:, :1] if first_row else out
        outputs = []
        h = x
        for i, layer in enumerate(self.layers):
            if row_alone and i == len(self.layers) - 1:
                return layer(*self._first_query(h, mask, terms), None, train, True)
            out = layer(h, None, mask, terms, None, train, False)
            if i == 0 and has_conv(self.cfg):
                out = self.conv(x, out, token_mask, train)
            outputs.append(out)
            h = out
        return outputs if return_all else h[:, :1] if first_row else h

    @staticmethod
    def _first_query(h: Array, mask: Array, terms: dict[str, Any]
                     ) -> tuple[Array, Array, Array, dict[str, Any]]:
        """A layer's (x_q, x_kv, mask, terms) for token 0's query alone (``first_query``):
        (B, 1, H) queries against all (B, L, H) keys; the (·, ·, Lq, Lk) mask, shared bias and
        BERT-A-d's position queries cut to row 0."""
        cut = {"bias": lambda v: v[:, :, :1], "position_query": lambda v: v[:1],
               "query_mask": lambda v: v[:, :1]}
        rows = {k: cut[k](v) if k in cut else v for k, v in terms.items()}
        return h[:, :1], h, mask[:, :, :1], rows

    def enhanced_mask_decoder(self, hidden_prev: Array, z: Array, token_mask: Array,
                              query_positions: Array | None, train: bool = False) -> Array:
        """DeBERTa EMD: the LAST layer run twice (shared weights), keys/values = H_{L−1}, the
        first query H_{L−1} + P_abs, the second the first's output. Only ``query_positions``
        (B, M) are decoded -> (B, M, H) (all positions when None)."""
        terms = self.position_terms(hidden_prev.shape[1])
        query = hidden_prev + z.astype(hidden_prev.dtype)
        if query_positions is not None:
            query = jnp.take_along_axis(query, query_positions[..., None], axis=1)
        mask = token_mask[:, None, None, :]
        if self.cfg.scan_layers:
            last = jax.tree.map(lambda p: p[-1], self.layer_stack)
            for _ in range(2):
                query, sown = self._apply_layer(last, query, hidden_prev, mask, terms,
                                                query_positions, train, self._dropout_rng(train))
                self._resow(sown)
            return query
        layer = self.layers[-1]
        for _ in range(2):
            query = layer(query, hidden_prev, mask, terms, query_positions, train, False)
        return query

    def _scanned_call(self, x: Array, token_mask: Array, mask: Array, terms: dict[str, Any],
                      train: bool, return_all: bool, first_only: bool) -> Array | list[Array]:
        """The layer loop of ``__call__`` as one scan (DeBERTa-v2's conv after layer 0 needs
        layer 0 on its own: it is applied first, then the scan runs over layers 1…N−1; with
        ``first_only`` the last layer runs after the scan, on token 0's query)."""
        params = self.layer_stack
        head: list[Array] = []
        h = x
        if has_conv(self.cfg):
            first = jax.tree.map(lambda p: p[0], params)
            out, sown = self._apply_layer(first, x, None, mask, terms, None, train,
                                          self._dropout_rng(train))
            self._resow(sown)
            h = self.conv(x, out, token_mask, train)
            head = [h]
            params = jax.tree.map(lambda p: p[1:], params)
        if first_only:
            last = jax.tree.map(lambda p: p[-1], params)
            params = jax.tree.map(lambda p: p[:-1], params)
            if jax.tree.leaves(params)[0].shape[0]:
                h, _ = self._scan(params, h, mask, terms, train)
            out, _ = self._apply_layer(last, *self._first_query(h, mask, terms), None, train,
                                       self._dropout_rng(train), first_query=True)
            return out
        h, outputs = self._scan(params, h, mask, terms, train)
        if not return_all:
            return h
        return head + [outputs[i] for i in range(outputs.shape[0])]
