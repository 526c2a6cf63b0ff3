"""Vision Transformer (Dosovitskiy et al. 2021, Eq. 1–4) on the shared encoder.

z_0 = [x_cls; x_p^1 E; …; x_p^N E] + E_pos, pre-LN blocks, y = LN(z_L) pooled. Any text
position scheme may replace the learned table (``position_scheme``): relative ones use 2D
(row, column) offsets on the patch grid.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from posjax.layers import positions
from posjax.layers.attention import DEFAULT_INIT, Mlp, MultiHeadAttention, dense, layer_norm
from posjax.layers.dropout import Dropout
from posjax.models.config import ViTConfig
from posjax.models.encoder import Encoder, compute_dtype
from posjax.models.schemes import scheme_of

Array = jax.Array


def weight_standardize(w: Array, axis=(0, 1, 2), eps: float = 1e-5) -> Array:
    """(w − mean) / (std + eps) over the receptive field and input channels (BiT)."""
    w = w - jnp.mean(w, axis=axis, keepdims=True)
    return w / (jnp.std(w, axis=axis, keepdims=True) + eps)


class StdConv(nn.Conv):
    """Convolution with weight standardisation."""

    def param(self, name, init_fn, *init_args, **kw):
        value = super().param(name, init_fn, *init_args, **kw)
        return weight_standardize(value) if name == "kernel" else value


class ResidualUnit(nn.Module):
    """Bottleneck unit (ResNet-v2 layout of vit_jax: conv → GN → relu, projection when needed)."""

    features: int
    strides: tuple[int, int] = (1, 1)
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: Array) -> Array:
        conv = lambda f, k, s, name: StdConv(f, k, s, use_bias=False, dtype=self.dtype,
                                             param_dtype=jnp.float32, name=name)
        gn = lambda name, **kw: nn.GroupNorm(dtype=self.dtype, param_dtype=jnp.float32,
                                             name=name, **kw)
        residual = x
        if x.shape[-1] != self.features * 4 or self.strides != (1, 1):
            residual = gn("gn_proj")(conv(self.features * 4, (1, 1), self.strides, "conv_proj")(x))
        y = nn.relu(gn("gn1")(conv(self.features, (1, 1), (1, 1), "conv1")(x)))
        y = nn.relu(gn("gn2")(conv(self.features, (3, 3), self.strides, "conv2")(y)))
        y = gn("gn3", scale_init=nn.initializers.zeros)(conv(self.features * 4, (1, 1), (1, 1),
                                                            "conv3")(y))
        return nn.relu(residual + y)


class ResNetStem(nn.Module):
    """Hybrid stem: conv7/2 → GN → relu → maxpool3/2, then stages of bottleneck units
    (first stage stride 1, later ones stride 2). R50+ViT-B/16: layers (3, 4, 9), width 64."""

    layers: tuple[int, ...]
    width: int = 64
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: Array) -> Array:
        x = StdConv(self.width, (7, 7), (2, 2), use_bias=False, dtype=self.dtype,
                    param_dtype=jnp.float32, name="conv_root")(x)
        x = nn.relu(nn.GroupNorm(dtype=self.dtype, param_dtype=jnp.float32, name="gn_root")(x))
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        for s, blocks in enumerate(self.layers):
            features = self.width * 2 ** s
            for u in range(blocks):
                strides = (2, 2) if (s > 0 and u == 0) else (1, 1)
                x = ResidualUnit(features, strides, self.dtype, name=f"block{s + 1}_unit{u + 1}")(x)
        return x


class MAPHead(nn.Module):
    """Multihead attention pooling: a learned probe attends to the tokens, then LN + MLP residual."""

    cfg: ViTConfig

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg = self.cfg
        dtype = compute_dtype(cfg)
        probe = self.param("probe", nn.with_logical_partitioning(
            nn.initializers.xavier_uniform(), (None, None, "embed")), (1, 1, x.shape[-1]),
            jnp.float32)
        probe = jnp.broadcast_to(probe, (x.shape[0], 1, x.shape[-1])).astype(dtype)
        y = MultiHeadAttention(cfg.num_heads, cfg.head_dim, cfg.head_dim ** -0.5, dtype=dtype,
                               name="attention")(probe, x)
        z = layer_norm(cfg.layer_norm_eps, name="norm", dtype=dtype)(y)
        y = y + Mlp(cfg.mlp_dim, cfg.hidden_act, dtype=dtype, name="mlp")(z)
        return y[:, 0]


class ViT(nn.Module):
    """images (B, H, W, C) -> logits (B, num_classes) (pooled features when num_classes=0)."""

    cfg: ViTConfig

    @nn.compact
    def __call__(self, images: Array, *, train: bool = False) -> Array:
        cfg = self.cfg
        dtype = compute_dtype(cfg)
        if images.ndim != 4:
            raise ValueError(f"images {tuple(images.shape)} must be (B, H, W, C)")
        if tuple(images.shape[1:3]) != cfg.image_size or images.shape[3] != cfg.num_channels:
            raise ValueError(
                f"images have shape {tuple(images.shape[1:])}, but image_size={cfg.image_size} "
                f"and num_channels={cfg.num_channels}: resize the inputs or set image_size "
                "(see posjax.layers.positions.resample_position_table for pretrained tables)")
        x = images.astype(dtype)
        if cfg.resnet_layers:
            x = ResNetStem(cfg.resnet_layers, cfg.resnet_width, dtype, name="resnet")(x)
        x = nn.Conv(cfg.hidden_size, cfg.patch_size, strides=cfg.patch_size, padding="VALID",
                    dtype=dtype, param_dtype=jnp.float32, name="embedding",
                    kernel_init=nn.with_logical_partitioning(
                        nn.initializers.lecun_normal(), (None, None, None, "embed")),
                    bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(),
                                                           ("embed",)))(x)
        b, gh, gw, c = x.shape
        x = x.reshape(b, gh * gw, c)
        has_cls = cfg.pooling == "token"
        if has_cls:
            cls = self.param("cls", nn.with_logical_partitioning(
                nn.initializers.zeros_init(), (None, None, "embed")), (1, 1, c), jnp.float32)
            x = jnp.concatenate([jnp.broadcast_to(cls.astype(dtype), (b, 1, c)), x], axis=1)
        scheme = scheme_of(cfg)
        if scheme.learned_input:
            pos = self.param("pos_embedding", nn.with_logical_partitioning(
                DEFAULT_INIT, (None, "pos", "embed")), (1, x.shape[1], c), jnp.float32)
            x = x + pos.astype(dtype)
        elif scheme.input == "sincos2d":   # fixed; [CLS] gets no position (as in big_vision)
            table = positions.sincos_2d_table((gh, gw), c)
            table = np.concatenate([np.zeros((int(has_cls), c), np.float32), table])
            x = x + jnp.asarray(table, dtype)[None]
        x = Dropout(cfg.dropout_rate)(x, deterministic=not train)
        x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
        token_mask = jnp.ones(x.shape[:2], bool)
        x = Encoder(cfg, pre_ln=True, grid=(gh, gw), has_cls=has_cls, name="encoder")(
            x, token_mask, train=train, first_only=cfg.pools_row_0)
        x = layer_norm(cfg.layer_norm_eps, name="encoder_norm", dtype=dtype)(x)
        if cfg.pools_row_0:
            x = x[:, 0]
        elif cfg.pooling == "gap":
            x = jnp.mean(x, axis=1)
        else:
            x = MAPHead(cfg, name="map_head")(x)
        if cfg.representation_size:
            x = jnp.tanh(dense(cfg.representation_size, ("embed", "mlp"), name="pre_logits",
                               dtype=dtype)(x))
        if not cfg.num_classes:
            return x
        init = nn.initializers.zeros_init() if cfg.head_zero_init else DEFAULT_INIT
        return dense(cfg.num_classes, (None, "vocab"), name="head", dtype=jnp.float32,
                     kernel_init=init)(x.astype(jnp.float32))
