"""The ``shared_data`` fixture (tests/conftest.py): without the real data folder a test that
needs it skips with one line naming the folder and POSJAX_DATA; with POSJAX_REQUIRE_DATA set
(CI) it fails instead, so the data tests never silently stop running there."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

TESTS = pathlib.Path(__file__).resolve().parent
ROOT = TESTS.parent

NEEDS_DATA = '''
import os, pathlib

def test_reads_the_data(shared_data):
    assert shared_data == pathlib.Path(os.environ["POSJAX_DATA"])
'''


def run_pytest(tmp_path: pathlib.Path, data: pathlib.Path, require: str | None) -> str:
    """pytest on a one-test file that requests ``shared_data``, in a fresh process with
    POSJAX_DATA=``data`` (and POSJAX_REQUIRE_DATA=``require`` unless None); its output."""
    (tmp_path / "test_needs_data.py").write_text(NEEDS_DATA)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")   # not the repository's addopts
    env = {**os.environ, "POSJAX_DATA": str(data), "COLUMNS": "1000",   # no cut lines
           "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)])}
    env.pop("POSJAX_REQUIRE_DATA", None)
    if require is not None:
        env["POSJAX_REQUIRE_DATA"] = require
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rsE", "-p", "no:cacheprovider", "-n", "0",
         "-p", "no:benchmark",
         "-p", "conftest",   # tests/conftest.py, from PYTHONPATH: the fixture under test
         "-c", str(tmp_path / "pytest.ini"), "--rootdir", str(tmp_path),
         str(tmp_path / "test_needs_data.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    return done.stderr + done.stdout   # pytest's summary line last (warnings go to stderr)


def outcome_line(out: str, word: str) -> str:
    """The one line of the short summary that starts with ``word`` (SKIPPED, ERROR)."""
    lines = [line for line in out.splitlines() if line.startswith(word)]
    assert len(lines) == 1, out
    return lines[0]


@pytest.mark.parametrize("require", [None, "", "0"])
def test_a_missing_data_folder_skips_with_one_line(tmp_path, require):
    missing = tmp_path / "no_such_data"
    out = run_pytest(tmp_path, missing, require)
    assert out.rstrip().splitlines()[-1].startswith("1 skipped"), out
    line = outcome_line(out, "SKIPPED")
    assert f"real data folder {missing} is absent" in line and "set POSJAX_DATA" in line, line


@pytest.mark.parametrize("require", ["1", "yes"])
def test_a_missing_data_folder_fails_where_data_is_required(tmp_path, require):
    missing = tmp_path / "no_such_data"
    out = run_pytest(tmp_path, missing, require)
    assert out.rstrip().splitlines()[-1].startswith("1 error"), out
    assert "skipped" not in out.rstrip().splitlines()[-1], out
    line = outcome_line(out, "ERROR")
    assert f"real data folder {missing} is absent" in line and "POSJAX_REQUIRE_DATA" in line, line
    assert "Traceback" not in out, out      # the one line, not a stack


@pytest.mark.parametrize("require", [None, "1"])
def test_a_present_data_folder_is_given_to_the_test(tmp_path, require):
    present = tmp_path / "data"
    present.mkdir()
    out = run_pytest(tmp_path, present, require)
    assert out.rstrip().splitlines()[-1].startswith("1 passed"), out
