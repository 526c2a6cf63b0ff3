"""Peak FLOP/s per device, the denominator of MFU.

MFU = (model FLOPs per step × steps/s) / (peak FLOP/s per device × devices), with model FLOPs
from ``posjax.models.flops`` (B · per example + per-step terms). Peak per device
(``PeakFlops``): ``config.peak_flops`` if > 0, else the dense bf16 peak of known accelerators
(``PEAK_FLOPS`` by device kind), else measured at startup: the best of several timings of a
jitted fp32 matmul running on every local device at once (CPU). A measurement taken while the
machine was busy is too low; when the observed MFU exceeds 1 the peak is measured again and the
largest of the measurements and the observed rate is kept (a device can do at least what it
was seen doing), so a measured peak never gives MFU > 1.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

# Dense bf16 peak FLOP/s of one JAX device, by substring of device_kind (first match wins).
PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("TPU v2", 22.5e12),        # per core (a v2 chip has 2 devices)
    ("TPU v3", 61.5e12),        # per core
    ("TPU v4", 275e12),
    ("TPU v5 lite", 197e12),
    ("TPU v5e", 197e12),
    ("TPU v5", 459e12),         # v5p
    ("TPU v6", 918e12),         # v6e (Trillium)
    ("H200", 989e12),
    ("H100", 989e12),
    ("A100", 312e12),
)

class PeakFlops:
    """Peak FLOP/s of one device and where it comes from; ``mfu`` turns an achieved rate into
    MFU. ``measure`` (None for a configured or table peak) re-measures the peak."""

    def __init__(self, value: float, source: str,
                 measure: Callable[[], float] | None = None):
        self.value = float(value)
        self.source = source
        self.measure = measure

    def mfu(self, flops_per_s_per_device: float) -> float:
        """achieved / peak. A measured peak below the achieved rate is re-measured and raised
        to max(old, new measurement, achieved), so the result is then <= 1."""
        if flops_per_s_per_device > self.value and self.measure is not None:
            old = self.value
            self.value = max(old, self.measure(), flops_per_s_per_device)
            logging.warning("MFU > 1 against the measured peak %.4g FLOP/s: re-measured, peak "
                            "now %.4g FLOP/s", old, self.value)
        return flops_per_s_per_device / self.value

def peak_flops_per_device(configured: float = 0.0) -> PeakFlops:
    """The peak of one device: configured, from ``PEAK_FLOPS``, else measured."""
    if configured > 0:
        return PeakFlops(configured, "config.peak_flops")
    kind = jax.devices()[0].device_kind
    for key, value in PEAK_FLOPS:
        if key.lower() in kind.lower():
            return PeakFlops(value, f"table ({kind})")
    return PeakFlops(measure_matmul_flops(), f"measured fp32 matmul ({kind})",
                     measure=measure_matmul_flops)

def best_rate(work: float, run: Callable[[], Any], trials: int,
              timer: Callable[[], float] = time.perf_counter) -> float:
    """work / (shortest of ``trials`` timings of ``run()``): the least disturbed trial."""
    best = math.inf
    for _ in range(trials):
        start = timer()
        run()
        best = min(best, timer() - start)
    return work / best

def measure_matmul_flops(size: int = 1024, trials: int = 5,
                         timer: Callable[[], float] = time.perf_counter) -> float:
    """FLOP/s per local device of a (size × size) fp32 matmul run on every local device at once
    (fake CPU devices share the cores, so this is each one's share), best of ``trials``."""
    devices = jax.local_devices()
    mesh = jax.sharding.Mesh(np.array(devices), ("d",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    x = jax.device_put(jnp.ones((len(devices), size, size), jnp.float32), sharding)
    matmul = jax.jit(lambda a: jnp.einsum("bij,bjk->bik", a, a))
    matmul(x).block_until_ready()
    return best_rate(2.0 * size ** 3, lambda: matmul(x).block_until_ready(), trials, timer)
