"""The on-disk result cache: one JSON file, atomic writes, safe under concurrent processes.

Layout: ``{"schema": SCHEMA, "entries": {key: entry}}`` in ``<cache dir>/autotune.json`` (the cache dir is
``$CODA_CACHE_DIR``, default ``~/.cache/coda``).

- Reads take no lock: writers only ever ``os.replace`` a complete file over the old one (atomic on POSIX).
- A write takes an exclusive ``fcntl.flock`` on ``autotune.json.lock``, re-reads the file, merges its entries,
  writes a temp file in the same directory, fsyncs it and ``os.replace``-s it: two processes tuning at once both
  keep their results.
- A corrupt (unparsable, wrong structure) or stale (other schema) file is ignored with exactly one warning per
  process and path, and is rewritten by the next write.
"""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import tempfile
import threading
import warnings
from typing import Optional

from .keys import SCHEMA

try:
    import fcntl
except ImportError:  # not POSIX: atomic replace only, no cross-process merge lock
    fcntl = None

RESULTS_FILE = "autotune.json"


def cache_dir() -> pathlib.Path:
    """``$CODA_CACHE_DIR`` if set (read at every call), else ``~/.cache/coda``."""
    d = os.environ.get("CODA_CACHE_DIR")
    return pathlib.Path(d).expanduser() if d else pathlib.Path.home() / ".cache" / "coda"


class CacheFileWarning(RuntimeWarning):
    """A cache file was corrupt or stale and is ignored (it is rewritten by the next write)."""


_warned: set = set()
_warn_lock = threading.Lock()


def _warn_once(path: pathlib.Path, why: str) -> None:
    key = str(path)
    with _warn_lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(f"coda.autotune: ignoring {why} cache file {path}; it will be rewritten", CacheFileWarning,
                  stacklevel=3)


def _parse(path: pathlib.Path) -> tuple[dict, Optional[str]]:
    """(entries, problem); problem is None for a good (or missing) file."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}, None
    except OSError as e:
        return {}, f"unreadable ({e.__class__.__name__})"
    try:
        data = json.loads(text)
    except ValueError:
        return {}, "corrupt (not JSON)"
    if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
        return {}, "corrupt (unexpected structure)"
    if data.get("schema") != SCHEMA:
        return {}, f"stale (schema {data.get('schema')!r}, expected {SCHEMA})"
    entries = {k: v for k, v in data["entries"].items() if isinstance(k, str) and isinstance(v, dict)}
    return entries, None


def atomic_write_bytes(path: pathlib.Path, data: bytes) -> None:
    """Write ``data`` to a temp file next to ``path``, fsync, then ``os.replace`` it over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def file_lock(path: pathlib.Path):
    """Exclusive inter-process lock on ``<path>.lock`` (a no-op where fcntl is unavailable)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if fcntl is None:
        yield
        return
    with open(f"{path}.lock", "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


class ResultStore:
    """One JSON file of entries: ``path``, or ``cache_dir()/name`` resolved at each use (default: the tuning
    results, ``autotune.json``)."""

    def __init__(self, path: Optional[pathlib.Path] = None, name: str = RESULTS_FILE):
        self._path = pathlib.Path(path) if path is not None else None
        self._name = name
        self._lock = threading.Lock()

    @property
    def path(self) -> pathlib.Path:
        return self._path if self._path is not None else cache_dir() / self._name

    def load(self) -> dict:
        """All entries of the file (empty, with one warning, if it is corrupt or stale)."""
        path = self.path
        entries, problem = _parse(path)
        if problem is not None:
            _warn_once(path, problem)
        return entries

    def get(self, key: str) -> Optional[dict]:
        return self.load().get(key)

    def put(self, key: str, entry: dict) -> None:
        self.update({key: entry})

    def update(self, new: dict) -> None:
        """Merge ``new`` into the file under the lock (re-read, merge, atomic replace)."""
        path = self.path
        with self._lock, file_lock(path):
            entries, problem = _parse(path)
            if problem is not None:
                _warn_once(path, problem)
            entries.update(new)
            data = json.dumps({"schema": SCHEMA, "entries": entries}, indent=1, sort_keys=True).encode()
            atomic_write_bytes(path, data)
            with _warn_lock:  # the file is good again: a later corruption warns again
                _warned.discard(str(path))

    def clear(self) -> None:
        path = self.path
        with self._lock, file_lock(path):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
