"""The specviz cache folder: converted models, compiled graphs, our built library, this machine's profile."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no advisory locks here; concurrent starts then do the work twice
    fcntl = None

log = logging.getLogger("specviz")


def cache_root() -> Path:
    """SPECVIZ_CACHE, default ~/.cache/specviz; where that cannot be written (a read-only home, a bad
    SPECVIZ_CACHE), a folder under the system's temporary one, said once: a start then works, and makes again
    what a writable cache would have kept."""
    asked = Path(os.environ.get("SPECVIZ_CACHE", "") or Path.home() / ".cache" / "specviz")
    return _usable(asked)


@functools.lru_cache(maxsize=8)
def _usable(asked: Path) -> Path:
    try:
        asked.mkdir(parents=True, exist_ok=True)
        if os.access(asked, os.W_OK | os.X_OK):
            return asked
        why = "not writable"
    except OSError as err:
        why = err.strerror or str(err)
    instead = Path(tempfile.gettempdir()) / f"specviz-cache-{getattr(os, 'getuid', lambda: 'user')()}"
    instead.mkdir(parents=True, exist_ok=True)
    log.warning("specviz cannot keep its cache in %s (%s); using %s instead (set SPECVIZ_CACHE to a writable "
                "folder to keep it across restarts)", asked, why, instead)
    return instead


_HELD: dict[str, list] = {}  # lock file -> [its thread lock, how deep this process holds it]
_GUARD = threading.Lock()


@contextlib.contextmanager
def locked(path: Path, progress: Callable[[str], None] | None = None) -> Iterator[None]:
    """Hold an exclusive lock on `path`.lock while making what `path` will hold (a converted model, this
    machine's profile), so that processes sharing the cache (two app starts, two test workers) make it once: the
    second waits, then finds it stored. Callers re-read `path` once inside. Writes stay atomic without the lock (a
    temporary file moved in place); the lock only saves the work. Within a process it is held by one thread at a
    time, and a holder may take it again (a profile's update while it times): flock would lock a process out
    through a second open file."""
    name = f"{path}.lock"
    say = progress or (lambda message: None)
    waiting = f"waiting for another specviz process that is making {path.name}..."
    with _GUARD:
        held = _HELD.setdefault(name, [threading.RLock(), 0])
    if not held[0].acquire(blocking=False):  # another thread of this process holds it
        say(waiting)
        held[0].acquire()
    held[1] += 1
    try:
        if fcntl is None or held[1] > 1:
            yield
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(name, "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                say(waiting)
                fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
    finally:
        held[1] -= 1
        held[0].release()


def write_json(path: Path, data) -> None:
    """data as JSON at path, whole or not at all: written beside it, then moved into its place (a reader in
    another process, or a start cut short, never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
