"""The README's Python examples run as written, in order, on 8 simulated devices: every shape
they state in a comment (``x = ...  # (2, 128, 256)``) is checked, the plot is written, and the
sharded example compiles without XLA's rematerialization warning."""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

from jax_env import xla_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]
STATED_SHAPE = re.compile(r"^(\s*)(\w+) = .*#\s*(\([\d, ]+\))")


def readme_script() -> str:
    """The README's ```python blocks joined, with an assert after every line stating a shape."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    lines = []
    for line in "".join(blocks).splitlines():
        lines.append(line)
        stated = STATED_SHAPE.match(line)
        if stated:
            indent, name, shape = stated.groups()
            lines.append(f"{indent}assert tuple({name}.shape) == {shape}, ({name!r}, {name}.shape)")
    return "\n".join(lines) + "\n"


def test_readme_examples_run_as_written(tmp_path):
    script = readme_script()
    assert script.count("assert tuple(") >= 6      # the shapes the examples promise
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT),
           "XLA_FLAGS": xla_flags(8)}
    run = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Involuntary full rematerialization" not in run.stderr
    assert (tmp_path / "attention.png").stat().st_size > 0
