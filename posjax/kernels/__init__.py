"""Fused attention kernels (Pallas): ``pallas_attention``, a drop-in for
``posjax.layers.blocked.blocked_attention`` (issue #52)."""
from posjax.kernels.flash import pallas_attention

__all__ = ["pallas_attention"]
