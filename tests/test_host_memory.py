"""keep_freed_memory(): XLA:CPU's scratch block is reused between runs instead of faulted in.

Each case runs in a fresh interpreter: the setting only reaches XLA's threads when it comes
before the backend starts, and pytest's process has started it long ago.
"""
import os
import platform
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")

SCRATCH_MIB = 64

# A jitted function whose (4096, 4096) float32 product is a 64 MiB temporary, far above
# glibc's mmap threshold; prints the minor page faults of the third call.
SCRIPT = textwrap.dedent("""
    import resource, sys
    from bench import host_memory
    assert not host_memory.kept()
    if sys.argv[1] == "keep":
        assert host_memory.keep_freed_memory()
        assert host_memory.keep_freed_memory()   # idempotent
        assert host_memory.kept()
    import jax, jax.numpy as jnp
    x = jax.random.normal(jax.random.key(0), (4096, 16))
    f = jax.jit(lambda x: jnp.max(jnp.tanh(x @ x.T), axis=0))
    for _ in range(2):
        f(x).block_until_ready()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    f(x).block_until_ready()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.strip().splitlines()[-1])


def test_scratch_block_is_reused_not_faulted_in():
    pages = SCRATCH_MIB * 2**20 // 4096
    default, kept = _faults("default"), _faults("keep")
    # Control: by default glibc maps the block afresh for every run (every page faults).
    assert default >= 0.9 * pages, (default, pages)
    # Kept: the freed block is reused; a few stray pages at most.
    assert kept < pages // 20, (kept, pages)


@pytest.mark.parametrize("platforms, on_cpu", [("cpu", True), ("cuda,cpu", False), ("tpu", False)])
def test_platform_gate_reads_jax_platforms(platforms, on_cpu):
    script = ("from bench import host_memory as h; "
              "print(h.jax_runs_on_cpu(), h.keep_freed_memory())")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "JAX_PLATFORMS": platforms})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(on_cpu), str(on_cpu)]
