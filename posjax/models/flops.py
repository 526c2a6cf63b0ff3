"""Analytic model FLOPs, counted from the model config (for MFU).

Only matrix multiplications are counted (2 FLOPs per multiply-add); softmax, norms, adds and
gathers are ignored, as is usual for MFU. With T tokens, H hidden, M MLP width:

* patch embedding: 2 · N · (p_h p_w C) · H, N = number of patches;
* per layer: Q, K, V and output projections 2 · T · H · 4H; attention scores Q Kᵀ 2 · T² · H;
  weights × V 2 · T² · H; MLP 2 · T · 2HM; a [CLS] classifier's last layer computes token 0
  alone: K, V 2 · T · H · 2H, Q and output 2 · H · 2H, scores and A·V 2 · 2 · T · H, MLP
  2 · 2HM (and DeBERTa's position terms 2 · T · H each);
* position terms (``position_flops``):
  - ``vit``/``bert_abs``/``bert_rel``/``tupe_r``'s T5 part: additions and gathers only, 0;
  - TUPE, once per forward on the (T+1, H) table, whatever the batch: projections
    2 · 2(T+1)H², correlation 2 · T² · H, and with an untied [CLS] its θ1, θ2 2 · 2H (PER
    STEP);
  - BERT-A-d: TUPE's part, plus the position sides of its two mixed terms 2 · 2TH² (PER
    STEP), and per layer the word sides 2 · (Q + T) · H² and the two products 2 · 2 · Q · T · H
    (per example; Q = T, or 1 in a [CLS] classifier's last layer);
  - DeBERTa, per layer and per term (c2p, p2c) on the R-row relative table: projection
    2 · R · H² once per forward (PER STEP), product with each example's content queries/keys
    2 · T · R · H (per example) (R = axes · 2k);
* heads: ``map`` probe attention (1 query over T keys: 2H² + 2·T·2H² + 2·2·T·H + 2H² + 2·2HM),
  ``pre_logits`` 2 · H · R_rep, classifier 2 · H · classes;
* hybrid ResNet stem: 2 · out_h · out_w · k² · C_in · C_out per convolution.

Counts are ``Flops(per_example, per_step)``: a batch of B examples costs
``B · per_example + per_step`` (``Flops.total``), the per-step part being the work on
position tables that every example shares. Training FLOPs = 3 × forward (the backward pass
costs two forwards; rematerialisation is not counted, so MFU measures useful work).
"""
from __future__ import annotations

import dataclasses

from posjax.layers.disentangled import takes_relative_shift
from posjax.models.config import TextConfig, ViTConfig
from posjax.models.schemes import scheme_of
from posjax.models.encoder import can_run_first_only, relative_span

TRAIN_FACTOR = 3.0


@dataclasses.dataclass(frozen=True)
class Flops:
    """FLOPs of a batch: ``per_example`` scales with the batch size, ``per_step`` (work on
    tables shared by every example) does not."""

    per_example: float = 0.0
    per_step: float = 0.0

    def total(self, batch: int) -> float:
        """B · per_example + per_step."""
        return batch * self.per_example + self.per_step

    def __add__(self, other: "Flops") -> "Flops":
        return Flops(self.per_example + other.per_example, self.per_step + other.per_step)

    def scaled(self, factor: float) -> "Flops":
        """Both parts times ``factor`` (e.g. ``TRAIN_FACTOR``, or a share of the layers)."""
        return Flops(factor * self.per_example, factor * self.per_step)


def attention_layer_flops(tokens: int, hidden: int, mlp_dim: int,
                          queries: int | None = None) -> float:
    """One Transformer block on one example, without position terms: K and V projections of
    all ``tokens``; Q and output projections, scores, A·V and the MLP for ``queries`` rows
    (default: every token; 1 for a [CLS] classifier's last layer, the masked slots for
    DeBERTa's EMD)."""
    t, h = tokens, hidden
    q = tokens if queries is None else queries
    return (2.0 * t * h * 2 * h + 2.0 * q * h * 2 * h + 2.0 * 2 * q * t * h
            + 2.0 * q * 2 * h * mlp_dim)


def position_flops(cfg: TextConfig | ViTConfig, tokens: int, axes: int = 1,
                   first_only: bool = False) -> Flops:
    """Matmul FLOPs of the position terms over the whole forward (all layers); with
    ``first_only`` DeBERTa's last layer takes the T table rows of token 0's pairs per term and
    position axis (axes·2·T·H per example) instead of the product with all R rows. RoPE, ALiBi,
    the T5 bias and fixed tables add no matmul FLOPs (element-wise work and gathers only)."""
    h = cfg.hidden_size
    scheme = scheme_of(cfg)
    if scheme.untied:
        # Projections of the T + 1 table rows ([CLS]'s row 0 too), the T × T correlation and
        # the [CLS] reset's two logits θ1, θ2 per head (when [CLS] is untied).
        has_cls = isinstance(cfg, TextConfig) or cfg.pooling == "token"
        reset = has_cls and not cfg.tie_cls and "mixed" not in scheme.terms
        rows = tokens + 1
        untied = Flops(per_step=2.0 * 2 * rows * h * h + 2.0 * tokens * tokens * h
                       + (2.0 * 2 * h if reset else 0.0))
        if "mixed" not in scheme.terms:
            return untied

        def mixed_layer(queries: int) -> float:
            return 2.0 * (queries + tokens) * h * h + 2.0 * 2 * queries * tokens * h

        last = mixed_layer(1 if first_only else tokens)
        per_example = (cfg.num_layers - 1) * mixed_layer(tokens) + last
        return untied + Flops(per_example=per_example, per_step=2.0 * 2 * tokens * h * h)
    if scheme.disentangled:
        rows = deberta_table_rows(cfg, tokens, axes)
        # The relative shift (text only) multiplies the 2T − 1 table rows of the distances.
        product_rows = rows
        if axes == 1 and takes_relative_shift(cfg.gather, 2 * tokens - 1, rows):
            product_rows = 2 * tokens - 1
        per_layer = len(cfg.pos_att_type)
        terms = cfg.num_layers * per_layer
        full_layers = cfg.num_layers - 1 if first_only else cfg.num_layers
        per_example = full_layers * per_layer * 2.0 * tokens * product_rows * h
        if first_only:
            per_example += per_layer * axes * 2.0 * tokens * h
        return Flops(per_example=per_example, per_step=terms * 2.0 * rows * h * h)
    return Flops()


def deberta_table_rows(cfg: TextConfig | ViTConfig, tokens: int, axes: int = 1) -> int:
    """R, the relative-table rows DeBERTa multiplies: axes · 2k (v1 text: 2·min(T, k))."""
    span = relative_span(cfg)
    if scheme_of(cfg).deberta_version == 1 and axes == 1:
        span = min(tokens, span)   # v1 text uses only min(L, k) rows each side
    return axes * 2 * span


def emd_position_flops(cfg: TextConfig, queries: int, tokens: int) -> Flops:
    """DeBERTa's position terms in one pass of the enhanced mask decoder: ``queries`` masked
    slots over ``tokens`` keys. Their index is per example, so every gather strategy multiplies
    all R table rows: c2p 2·Q·R·H, p2c 2·T·R·H per example; the table projection 2·R·H² per
    term once per step."""
    h, rows = cfg.hidden_size, deberta_table_rows(cfg, tokens)
    per_example = sum(2.0 * (queries if term == "c2p" else tokens) * rows * h
                      for term in cfg.pos_att_type)
    return Flops(per_example=per_example, per_step=len(cfg.pos_att_type) * 2.0 * rows * h * h)


def encoder_forward_flops(cfg: TextConfig | ViTConfig, tokens: int, axes: int = 1,
                          first_only: bool = False) -> Flops:
    """Layer stack plus position terms for ``tokens`` tokens (``axes``: 2 on an image grid;
    ``first_only``: the last layer computes token 0 alone, as for [CLS] classifiers)."""
    full = attention_layer_flops(tokens, cfg.hidden_size, cfg.mlp_dim)
    layers = cfg.num_layers * full
    if first_only:
        layers += attention_layer_flops(tokens, cfg.hidden_size, cfg.mlp_dim, queries=1) - full
    return Flops(per_example=layers) + position_flops(cfg, tokens, axes, first_only)


def resnet_stem_flops(cfg: ViTConfig) -> float:
    """Convolutions of the hybrid ResNet-v2 stem (root conv 7×7/2, max-pool /2, bottlenecks),
    per image."""
    if not cfg.resnet_layers:
        return 0.0
    conv = lambda hw, k, cin, cout: 2.0 * hw[0] * hw[1] * k * k * cin * cout
    hw = (cfg.image_size[0] // 2, cfg.image_size[1] // 2)
    total = pixel_layer_flops(cfg)
    hw = ((hw[0] + 1) // 2, (hw[1] + 1) // 2)
    cin = cfg.resnet_width
    for stage, blocks in enumerate(cfg.resnet_layers):
        f = cfg.resnet_width * 2 ** stage
        for unit in range(blocks):
            stride = 2 if (stage > 0 and unit == 0) else 1
            out = (hw[0] // stride, hw[1] // stride)
            total += conv(hw, 1, cin, f) + conv(out, 3, f, f) + conv(out, 1, f, 4 * f)
            if cin != 4 * f or stride != 1:
                total += conv(out, 1, cin, 4 * f)
            hw, cin = out, 4 * f
    return total


def vit_forward_flops(cfg: ViTConfig, first_only: bool = True) -> Flops:
    """Forward FLOPs through ``posjax.models.vit.ViT`` (per image + per step); with 'token'
    pooling (and 'first') the last layer computes row 0 alone, as the model runs
    (``first_only=False``: every row, as implementations without that shortcut do)."""
    h = cfg.hidden_size
    per_image = resnet_stem_flops(cfg) + patch_embedding_flops(cfg)
    t = cfg.num_tokens
    if cfg.pooling == "map":
        per_image += (2.0 * h * h * 2 + 2.0 * t * 2 * h * h + 2.0 * 2 * t * h
                      + 2.0 * 2 * h * cfg.mlp_dim)
    features = h
    if cfg.representation_size:
        per_image += 2.0 * h * cfg.representation_size
        features = cfg.representation_size
    per_image += 2.0 * features * cfg.num_classes
    return Flops(per_example=per_image) + encoder_forward_flops(
        cfg, t, axes=2,
        first_only=first_only and cfg.pools_row_0 and can_run_first_only(cfg))


def patch_embedding_flops(cfg: ViTConfig) -> float:
    """The patch embedding per image: a p×p convolution of stride p from the pixels (or from
    a hybrid stem's features) to the width."""
    gh, gw = cfg.grid_size
    in_channels = cfg.resnet_width * 4 * 2 ** (len(cfg.resnet_layers) - 1) if cfg.resnet_layers \
        else cfg.num_channels
    return 2.0 * gh * gw * cfg.patch_size[0] * cfg.patch_size[1] * in_channels * cfg.hidden_size


def pixel_layer_flops(cfg: ViTConfig) -> float:
    """The layer that reads the pixels, per image: a hybrid's root convolution (7×7, stride 2,
    to ``resnet_width``), else the patch embedding."""
    if not cfg.resnet_layers:
        return patch_embedding_flops(cfg)
    return 2.0 * (cfg.image_size[0] // 2) * (cfg.image_size[1] // 2) * 7 * 7 \
        * cfg.num_channels * cfg.resnet_width


def vit_train_flops(cfg: ViTConfig, first_only: bool = True) -> Flops:
    """Training FLOPs: 3 × forward (forward, dx and dW of every product), less the dx of the
    layer that reads the pixels, which backpropagation does not compute: the images are not
    differentiated."""
    return (vit_forward_flops(cfg, first_only).scaled(TRAIN_FACTOR)
            + Flops(per_example=-pixel_layer_flops(cfg)))


def text_encoder_forward_flops(cfg: TextConfig, length: int, first_only: bool = False) -> Flops:
    """Forward FLOPs of ``TextEncoder`` on sequences of ``length`` tokens (no task head):
    optional embedding projection 2·L·E·H, the v2 convolution 2·L·k·H²/groups, the stack
    (``first_only``: as run for a [CLS] classifier)."""
    h = cfg.hidden_size
    per_sequence = 0.0
    if cfg.input_embedding_size != h:
        per_sequence += 2.0 * length * cfg.input_embedding_size * h
    if cfg.conv_kernel_size:
        per_sequence += 2.0 * length * cfg.conv_kernel_size * h * h / cfg.conv_groups
    return Flops(per_example=per_sequence) + encoder_forward_flops(
        cfg, length, first_only=first_only and can_run_first_only(cfg))
