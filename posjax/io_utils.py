"""File and signal utilities with no dependency beyond the standard library: local paths
(``local_path``: no URLs), writable folders, atomic writes, a failed write as one
``SaveFailed`` (``writing``), one-line error summaries, and signals kept from threads and input
workers (``signals_to_receiver_thread``)."""
from __future__ import annotations

import contextlib
import glob
import json
import os
import pathlib
import re
import signal
import socket
import tempfile
import threading
from typing import Any, Callable, Iterator


SHIELDED_SIGNALS = {signal.SIGTERM, signal.SIGINT}

_receiver: threading.Thread | None = None


@contextlib.contextmanager
def signals_to_receiver_thread() -> Iterator[None]:
    """Inside: SIGTERM and SIGINT reach the process through one daemon thread started for the
    purpose; the calling thread blocks them, and so does every thread or process started inside
    (they inherit the block). Python still runs the handlers in the main thread, as always.

    This closes the start-up window of input workers: a SIGTERM sent to the whole process group
    while a worker is still importing (about 2 s) would otherwise kill it with the default
    action before ``input_worker_init`` runs, and the main process would wait for its batches
    forever. Signals that arrive meanwhile are not lost; the block ends on exit."""
    global _receiver
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    if _receiver is None:   # started with the caller's (unblocked) mask, lives for the process
        _receiver = threading.Thread(target=threading.Event().wait, name="signal-receiver",
                                     daemon=True)
        _receiver.start()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, SHIELDED_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class SaveFailed(RuntimeError):
    """A checkpoint, or another file of the run (``writing``), could not be written (a full
    disk, a folder no longer writable)."""


def storage_question(bucket: bool) -> str:
    """What to check when a write failed: a disk's space and permissions, or a bucket's."""
    return ("does this account still have write access to the bucket (its quota, billing, "
            "permissions)?" if bucket else "is the disk full, or the folder no longer writable?")


@contextlib.contextmanager
def writing(what: str) -> Iterator[None]:
    """An OSError inside, while ``what`` (naming the file: a path or a ``gs://`` URL) is
    written, raises one SaveFailed saying so and how to go on: the metrics log, an eval
    result, a plot fail this way when the disk fills or the bucket refuses (tracebacks from
    TensorBoard's writer, before). A bucket's HTTP response body is left out."""
    try:
        yield
    except OSError as e:
        cause = re.sub(r" \[http_response_body=.*", "", str(e.strerror or e))
        raise SaveFailed(f"{what} could not be written ({type(e).__name__}: {cause}): "
                         f"{storage_question('gs://' in what)} Fix the storage, then run the "
                         "command again (a training run resumes from its latest checkpoint)"
                         ) from e


def error_summary(error: BaseException) -> str:
    """``Type: first line of the message``: TFDS's DatasetNotFoundError lists every dataset it
    knows (~250 lines) after its first line."""
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def local_path(value: str | os.PathLike, what: str) -> pathlib.Path:
    """``value`` as an absolute local path (``~`` expanded). A URL (``gs://``, ``s3://``, ...)
    is one ValueError naming ``what``: runs read and write their folders through the file
    system (a file lock, atomic renames), and pathlib would turn ``gs://b/x`` into a local
    folder ``gs:/b/x``."""
    text = os.fspath(value)
    if not text.strip():
        raise ValueError(f"{what} is empty (an unset shell variable?): give a path")
    if _URL.match(text):
        raise ValueError(f"{what}={text!r} is a URL, but posjax opens its folders through "
                         "the file system (a workdir needs file locks and atomic renames): give "
                         "a local path, or on several hosts a shared file system every host "
                         "mounts (NFS, Filestore)")
    return pathlib.Path(text).expanduser().resolve()


def read_json_object(path: pathlib.Path, holds: str, fix: str) -> dict[str, Any] | None:
    """The JSON object in ``path``; None when there is no such file. One ValueError, '``path``
    is damaged (why): it should hold ``holds`` as JSON; ``fix``', when it cannot be read or is
    not a JSON object."""
    if not path.exists():
        return None
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as e:   # a directory; UnicodeDecodeError, JSONDecodeError
        saved = e
    if not isinstance(saved, dict):
        why = saved if isinstance(saved, Exception) else "not a JSON object"
        raise ValueError(f"{path} is damaged ({why}): it should hold {holds} as JSON; {fix}")
    return saved


def check_creatable(path: pathlib.Path, what: str) -> None:
    """One ValueError naming ``what`` unless ``path`` is a directory this process can write
    in, or can be created as one (its nearest existing ancestor is such a directory)."""
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{what} {str(path)!r}: {str(existing)!r} is a file, not a "
                         f"directory; choose another {what}")
    why = cannot_write_in(existing)
    if why:
        raise ValueError(f"{what} {str(path)!r} is not writable ({str(existing)!r}: {why}); "
                         "choose a directory you can write to")


def cannot_write_in(directory: pathlib.Path) -> str | None:
    """Why no file can be created in ``directory`` (None if one can)."""
    try:
        with tempfile.TemporaryFile(dir=directory):
            return None
    except OSError as e:
        return e.strerror


def write_atomically(path: pathlib.Path, write: Callable[[pathlib.Path], None]) -> None:
    """``write(tmp)`` into a temporary file in ``path``'s folder, then ``os.replace`` it onto
    ``path``: a crash leaves the old file or the new one, never a partial one. The file gets
    the usual permissions (0666 less the umask), readable by others on shared storage.

    A ``gs://`` path (``storage.as_path``) is written to a local temporary file, then uploaded
    in one request: Cloud Storage replaces an object whole.

    The temporary file is ``.<name>.<host>.<pid namespace>.<pid>.tmp``; those a killed writer
    of this host and PID namespace left for the same ``path`` are removed first (a SIGKILL
    mid-write cannot clean up after itself).
    """
    if os.fspath(path).startswith("gs://"):   # a Cloud Storage object: one upload replaces it
        with tempfile.TemporaryDirectory() as folder:
            write(tmp := pathlib.Path(folder) / path.name)
            path.write_bytes(tmp.read_bytes())
        return
    prefix = f".{path.name}.{_pid_space()}."
    _remove_abandoned(path.parent, prefix)
    tmp = path.with_name(f"{prefix}{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _pid_space() -> str:
    """Where a pid names one process: this host and PID namespace (containers sharing a host
    name, with host networking, have PID namespaces of their own)."""
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:   # not Linux
        namespace = 0
    return f"{socket.gethostname()}.{namespace}"


def _remove_abandoned(folder: pathlib.Path, prefix: str) -> None:
    """Remove ``folder/<prefix><pid>.tmp`` files whose writer is gone (``prefix`` names this
    host and PID namespace, where the pid means one process)."""
    for tmp in folder.glob(glob.escape(prefix) + "*.tmp"):
        pid = tmp.name[len(prefix):-len(".tmp")]
        if pid.isdigit() and not _process_exists(int(pid)):
            tmp.unlink(missing_ok=True)


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # another user's process
        return True
    return True


def write_text_atomically(path: pathlib.Path, text: str) -> None:
    """``text`` into ``path`` (UTF-8), atomically (``write_atomically``)."""
    write_atomically(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
