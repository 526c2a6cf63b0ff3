"""Long sequences: one attention layer, plain (materialised L × L logits) vs blocked
(``posjax.layers.blocked``), per position scheme: forward + backward time and XLA's scratch.

    python -m bench.long_attention            # hidden 768, 12 heads, batch 1, L = 512 … 16k
    python -m bench.long_attention --smoke    # tiny layer, L = 64, 128 (seconds)

Schemes: ``content`` (q·k only: ViT, BERT-A, NoPE, RoPE), ``t5`` (BERT-R's relative bias),
``tupe`` (TUPE-R: untied positions with the [CLS] reset + T5 bias), ``deberta`` (c2p + p2c,
v3 setting: log buckets, 256-row span, shared key). Each measurement is jax.grad of
Σ sin(out) with respect to the layer's parameters (with the shared position modules') and
the input. Memory is ``memory_analysis().temp_size_in_bytes`` of the compiled step (scratch
beyond arguments and outputs). A plain run whose scratch, extrapolated ∝ L² from its last
measured length, exceeds ``--plain-max-gib`` is neither compiled nor run ("does not fit");
beyond ``--plain-max-length`` / ``--blocked-max-length`` runs are compiled for their memory
but not timed ("not run"; a full run is slow on a CPU).
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from bench.common import _cpu_description, load_average
from posjax.layers import blocked as bl
from posjax.layers.attention import MultiHeadAttention
from posjax.layers.disentangled import DisentangledAttention
from posjax.layers.position_bias import T5RelativeBias, TupePositionBias

SCHEMES = ("content", "t5", "tupe", "deberta")
FULL = dict(hidden=768, heads=12, lengths=(512, 1024, 2048, 4096, 8192, 16384), block=512,
            buckets=256, max_position=512)
SMOKE = dict(hidden=32, heads=4, lengths=(64, 128), block=32, buckets=16, max_position=32)


class Layer(nn.Module):
    """One attention layer of ``scheme`` with its shared position terms; ``block`` > 0: the
    blocked path (the terms un-materialised)."""

    scheme: str
    hidden: int
    heads: int
    max_len: int
    buckets: int
    max_position: int
    block: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        length, d = x.shape[1], self.hidden // self.heads
        if self.scheme == "deberta":
            table = self.param("rel_embeddings", nn.initializers.normal(0.02),
                               (2 * self.buckets, self.hidden))
            layer = DisentangledAttention(
                num_heads=self.heads, head_dim=d, pos_att_type=("c2p", "p2c"), span=self.buckets,
                max_relative_positions=self.max_position, position_buckets=self.buckets,
                share_att_key=True, block_size=self.block)
            return layer(x, x, rel_table=table)
        tupe = self.scheme == "tupe"
        layer = MultiHeadAttention(self.heads, d, logit_scale=((2 if tupe else 1) * d) ** -0.5,
                                   block_size=self.block)
        t5 = T5RelativeBias(self.heads, 32, 128, untie_cls=tupe) if self.scheme != "content" \
            else None
        untied = TupePositionBias(self.heads, d, self.max_len) if tupe else None
        if self.block:
            terms = bl.BlockTerms(
                products=(untied.block_terms(length)["untied"],) if tupe else (),
                relative_bias=t5.block_terms(length) if t5 else None)
            return layer(x, x, block_terms=terms)
        bias = None
        if t5 is not None:
            bias = t5(length)
        if untied is not None:
            bias = bias + untied(length)["bias"]
        return layer(x, x, bias=None if bias is None else bias[None])


def step(model: Layer):
    """(params, x) -> gradients of Σ sin(out) w.r.t. both."""
    return jax.jit(jax.grad(lambda p, x: jnp.sum(jnp.sin(model.apply(p, x))), argnums=(0, 1)))


def layer(scheme: str, block: int, s: dict) -> Layer:
    return Layer(scheme, s["hidden"], s["heads"], max(s["lengths"]), s["buckets"],
                 s["max_position"], block)


def init(scheme: str, s: dict):
    """Parameters of ``scheme``'s layer: the same tree for plain and blocked, any length."""
    return jax.jit(layer(scheme, 0, s).init)(jax.random.key(1), jnp.ones((1, 8, s["hidden"])))


def measure(scheme: str, length: int, block: int, s: dict, params,
            runs: int) -> tuple[float | None, float]:
    """(median ms per forward + backward, or None with ``runs`` = 0; scratch MiB). With
    several runs the first (a warm-up) is not counted."""
    model = layer(scheme, block, s)
    x = jax.random.normal(jax.random.key(0), (1, length, s["hidden"]))
    compiled = step(model).lower(params, x).compile()
    mib = compiled.memory_analysis().temp_size_in_bytes / 2 ** 20
    if runs == 0:
        return None, mib
    if runs > 1:
        jax.block_until_ready(compiled(params, x))            # warm-up
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(params, x))
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times)), mib


def fmt(value: float | None, digits: int = 0, missing: str = "does not fit") -> str:
    return missing if value is None else f"{value:,.{digits}f}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny layer, L = 64, 128")
    parser.add_argument("--lengths", type=int, nargs="+", help="override the lengths")
    parser.add_argument("--schemes", nargs="+", choices=SCHEMES, default=list(SCHEMES))
    parser.add_argument("--block", type=int, help="block size (default 512; smoke 32)")
    parser.add_argument("--runs", type=int, default=2,
                        help="runs per measurement; from 2 on, the first is a warm-up")
    parser.add_argument("--plain-max-gib", type=float, default=16.0,
                        help="plain runs predicted (∝ L²) above this are not compiled")
    parser.add_argument("--plain-max-length", type=int, default=None,
                        help="longer plain runs are compiled (memory) but not timed")
    parser.add_argument("--blocked-max-length", type=int, default=None,
                        help="longer blocked runs are compiled (memory) but not timed")
    args = parser.parse_args(argv)
    s = dict(SMOKE if args.smoke else FULL)
    if args.lengths:
        s["lengths"] = tuple(args.lengths)
    block = args.block or s["block"]

    def runs(length: int, limit: int | None) -> int:   # 0: compiled for its memory only
        return 0 if limit and length > limit else args.runs
    cpu = _cpu_description()["cpu_model"]
    print(f"# Long attention: one layer, hidden {s['hidden']}, {s['heads']} heads, batch 1, "
          f"forward + backward; block {block}\n\n{cpu}, {jax.default_backend()}, load "
          f"{load_average()}\n")
    print("| scheme | L | plain ms | blocked ms | plain scratch MiB | blocked scratch MiB |")
    print("|---|---:|---:|---:|---:|---:|")
    for scheme in args.schemes:
        last: tuple[int, float] | None = None   # (length, MiB) of the last plain measurement
        params = init(scheme, s)
        for length in s["lengths"]:
            predicted = None if last is None else last[1] * (length / last[0]) ** 2 / 1024
            plain_ms = plain_mib = None
            plain_missing = "does not fit"
            if predicted is not None and predicted > args.plain_max_gib:
                plain_missing = f"does not fit (~{predicted:,.0f} GiB)"
            else:
                plain_ms, plain_mib = measure(scheme, length, 0, s, params,
                                              runs(length, args.plain_max_length))
                last = (length, plain_mib)
            blocked_ms, blocked_mib = measure(scheme, length, block, s, params,
                                              runs(length, args.blocked_max_length))
            print(f"| {scheme} | {length} | "
                  f"{fmt(plain_ms, 0, 'not run' if plain_mib else plain_missing)} | "
                  f"{fmt(blocked_ms, 0, 'not run')} | {fmt(plain_mib, 1, plain_missing)} | "
                  f"{fmt(blocked_mib, 1)} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
