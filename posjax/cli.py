"""Command-line plumbing of train.py and eval.py: the ``--config`` flag and its errors
(``define_config_flag``, ``parse_flags``: one ``error:`` line, status 1), and how a command
ends (``run_command``: exit codes 0 / 1 / 130, several processes)."""
from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable, TypeVar

import jax

from posjax.io_utils import SaveFailed
from posjax.training import errors
from posjax.training import hosts


EXIT_GRACE_S = 3.0   # run_command: how long a failing process > 0 lets process 0 print
EMPTY_WORKDIR = "error: --workdir is empty (an unset shell variable?): give the run's directory"
T = TypeVar("T")


def _exit_finished(signum: int, frame: Any) -> None:
    """SIGTERM after a command's work is done and written: end now, with status 0."""
    raise SystemExit(0)


def run_command(action: Callable[[], T]) -> T:
    """``action()`` for train.py / eval.py: a ValueError (bad input), ``Diverged`` or
    ``io_utils.SaveFailed`` ends the program with 'error: …' and status 1, an abort by
    Ctrl-C with one line and status 130.
    With several processes every failure ends this process at once (``os._exit`` after
    printing): a normal exit would wait at JAX's shutdown barrier for the other processes,
    which sit in a collective waiting for this one (minutes, then an abort). Ending at once
    makes their collectives fail, so they end too. Processes other than 0 first give process 0
    ``EXIT_GRACE_S`` to print its own error: it hosts JAX's coordination service, which aborts
    it as soon as another process is gone, and a failure they share (a full disk) was printed
    by process 1 only. When process 0 ends first, the service aborts the others during their
    grace, after their error line (a fatal log and a stack dump follow it: not a second
    failure).

    Once ``action`` has returned, everything is written: a SIGTERM from then on (a scheduler
    ending the finished job while the interpreter shuts down) ends the process with status 0
    (single process), so that the run does not look preempted."""
    try:
        result = action()
        if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, _exit_finished)
        return result
    except BaseException as e:   # noqa: B036 (SystemExit and KeyboardInterrupt included)
        several = jax.process_count() > 1
        if isinstance(e, KeyboardInterrupt) and not several:   # a second Ctrl-C (StopRequest)
            print("aborted by Ctrl-C", file=sys.stderr)
            sys.exit(130)
        if isinstance(e, (ValueError, errors.Diverged, SaveFailed)):
            message = f"error: {e}"
        elif several and (lost := hosts.peer_lost_message(e)):
            message = f"error: {lost}"
        elif not several:
            raise
        else:
            message = "".join(traceback.format_exception(e))
        if not several:
            sys.exit(message)
        print(f"process {jax.process_index()}: {message}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        if jax.process_index() != 0:
            time.sleep(EXIT_GRACE_S)
        os._exit(1)


def _config_args(argv: list[str]) -> str:
    out = []
    for i, a in enumerate(argv[1:], 1):
        if a.startswith("--config"):
            out.append(f"{a} {argv[i + 1]}" if a == "--config" and i + 1 < len(argv) else a)
    return " ".join(out)


def _config_error_exit(error: Exception, argv: list[str]):
    """Exit with one ``error:`` line for a config file that cannot be loaded or overridden.

    ml_collections reports an unknown override key as a KeyError (maybe inside an
    AttributeError) whose argument is the leaf name, maybe followed by a 'Did you mean ...'
    line; the whole dotted key is taken from the matching ``--config.a.b=v`` argument. Any
    other error is the config file's own."""
    import sys
    given = f"the config given by {_config_args(argv)}"
    while error.args and isinstance(error.args[0], Exception):   # AttributeError(KeyError(..))
        error = error.args[0]
    message = str(error.args[0]) if error.args else str(error)
    leaf, _, suggestion = message.partition("\n")
    leaf = leaf.strip("'\"")
    keys = [a[len("--config."):].split("=", 1)[0] for a in argv if a.startswith("--config.")]
    key = next((k for k in keys if leaf in k.split(".")), None)
    if isinstance(error, AttributeError) and "get_config" in message:
        sys.exit(f"error: cannot load {given}: the file defines no get_config()")
    if not isinstance(error, (KeyError, AttributeError)) or key is None:
        hint = ("; a run's config.json is loaded with --config configs/saved.py:WORKDIR"
                if any(a.endswith(".json") or ".json:" in a for a in argv) else "")
        sys.exit(f"error: cannot load {given}: {type(error).__name__}: {message}{hint}")
    fix = suggestion.strip() or "check the spelling against the config file"
    sys.exit(f"error: unknown config key {key!r} in {_config_args(argv)}: the config has no "
             f"such field ({fix})")


def _raised_message(text: str) -> str:
    """The message of the exception a formatted traceback ends with (from the first unindented
    line after the last frame, without the 'ValueError: ' prefix); ml_collections hands a failed
    get_config() over as such text."""
    lines = text.strip().splitlines()
    frames = [i for i, ln in enumerate(lines) if ln.startswith('  File "')]
    after = lines[frames[-1] + 1:] if frames else lines
    start = next((i for i, ln in enumerate(after) if not ln.startswith(" ")), 0)
    return re.sub(r"^[\w.]+: ", "", "\n".join(after[start:]).strip())


def define_config_flag(default: str | None, help_text: str) -> None:
    """``--config`` (ml_collections config file with ``--config.a.b=v`` overrides). With a
    default, ml_collections applies the overrides while the flag is defined, so an unknown key
    is reported here."""
    import sys

    from ml_collections import config_flags

    try:
        config_flags.DEFINE_config_file("config", default, help_text)
    except Exception as e:    # noqa: BLE001 -- any failure of the user's file: one line
        _config_error_exit(e, sys.argv)


def parse_flags(argv: list[str]) -> list[str]:
    """absl flags parser for train.py / eval.py: a bad ``--config`` (missing or broken file,
    unknown key, wrong type) ends with one ``error:`` line and exit status 1, not a
    traceback."""
    import sys

    from absl import flags

    try:
        rest = flags.FLAGS(argv)
        if flags.FLAGS.config is not None:
            flags.FLAGS.config.get("task")   # a config that failed to load raises here
        return rest
    except flags.Error as e:
        if "Error whilst parsing config file" in str(e):   # get_config raised: its message
            sys.exit(f"error: cannot load the config given by {_config_args(argv)}: "
                     f"{_raised_message(str(e))}")
        sys.exit(f"error: {e}\nPass --helpfull to see the flags.")
    except OSError as e:
        detail = " ".join(str(e).split())
        sys.exit(f"error: cannot load the config given by {_config_args(argv)}: {detail}")
    except Exception as e:    # noqa: BLE001 -- unknown key, or the file itself fails to run
        _config_error_exit(e, argv)
