"""The on-disk result cache: one JSON file, atomic writes, safe under concurrent processes, never fatal.

Layout: ``{"schema": SCHEMA, "entries": {key: entry}}`` in ``<cache dir>/autotune.json`` (the cache dir is
``$CODA_CACHE_DIR``, default ``~/.cache/coda``).

- Reads take no lock: writers only ever ``os.replace`` a complete file over the old one (atomic on POSIX).
- A write takes an exclusive ``fcntl.flock`` on ``autotune.json.lock`` (opened with ``O_NOFOLLOW``: a symlink there
  is refused), re-reads the file, merges its entries, writes a temp file in the same directory, fsyncs it and
  ``os.replace``-s it: two processes tuning at once both keep their results.
- A corrupt (not UTF-8, not JSON, nested too deeply, wrong structure) or stale (other schema) file, and entries that
  fail the store's validator (wrong field types or ranges), are ignored with exactly one warning per process and
  path, and dropped by the next write.
- The cache dir is used only if it is a directory owned by the current user and not writable by group or others
  (as ccache and pip require); it is created with mode 0700. Otherwise, and when a write fails (read-only dir,
  ``CODA_CACHE_DIR`` naming a file, a directory where a file should be, a symlinked lock file), the store warns
  once per dir and keeps the entries in this process's memory: a result is never lost because its write failed.
"""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import stat
import tempfile
import threading
import warnings
from typing import Callable, Optional

from .keys import SCHEMA

try:
    import fcntl
except ImportError:  # not POSIX: atomic replace only, no cross-process merge lock
    fcntl = None

RESULTS_FILE = "autotune.json"
MAX_FILE_BYTES = 64 << 20  # a results file larger than this is not one CODA wrote
MAX_ENTRY_DEPTH = 8  # nesting of an entry's values (CODA's entries are at most 2 deep)

Validator = Callable[[str, dict], Optional[str]]  # (key, entry) -> why the entry is unusable, or None


def cache_dir() -> pathlib.Path:
    """``$CODA_CACHE_DIR`` if set (read at every call), else ``~/.cache/coda``."""
    d = os.environ.get("CODA_CACHE_DIR")
    return pathlib.Path(d).expanduser() if d else pathlib.Path.home() / ".cache" / "coda"


class CacheFileWarning(RuntimeWarning):
    """A cache file or dir was corrupt, stale, unsafe or not writable; CODA goes on without it (see the messages)."""


_warned: set = set()
_warn_lock = threading.Lock()


def warn_once(key: str, message: str, stacklevel: int = 3) -> None:
    """Warn ``message`` (a :class:`CacheFileWarning`) unless ``key`` was warned about already in this process."""
    with _warn_lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(message, CacheFileWarning, stacklevel=stacklevel + 1)


def forget_warning(key: str) -> None:
    """``key`` is good again: a later problem with it warns again."""
    with _warn_lock:
        _warned.discard(key)


def _warn_once(path: pathlib.Path, why: str) -> None:
    if why.startswith("unreadable"):  # an I/O problem, not bad content: one warning for the dir (see warn_unwritable)
        warn_once(f"dir:{path.parent}", f"coda.autotune: cannot read the cache file {path} ({why}); tuning results "
                  "and compiled kernels are kept in memory for this process only", stacklevel=3)
    else:
        warn_once(str(path), f"coda.autotune: ignoring {why} cache file {path}; it will be rewritten", stacklevel=3)


# --------------------------------------------------------------------------------------------- the cache dir
def _euid() -> Optional[int]:
    return os.geteuid() if hasattr(os, "geteuid") else None


def dir_problem(d: pathlib.Path) -> Optional[str]:
    """Why ``d`` must not hold CODA's caches (None: it may, or it does not exist yet and will be created 0700).

    Refused: not a directory, not accessible, owned by another user, or writable by group or others (anyone who
    can write there could plant a compiled kernel that every process would link and run)."""
    try:
        st = os.stat(d)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"cannot be accessed ({type(e).__name__}: {e.strerror})"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    uid = _euid()
    if uid is not None and st.st_uid != uid:
        return f"is owned by uid {st.st_uid}, not by the current user (uid {uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}; fix with `chmod go-w {d}`)"
    return None


def usable_dir(d: pathlib.Path, group: Optional[pathlib.Path] = None) -> bool:
    """True if ``d`` may hold caches; else warns once (per dir, or per ``group``: the cache dir of a subdir) that
    the caches stay in memory."""
    why = dir_problem(d)
    if why is None:
        return True
    warn_once(f"dir:{group or d}", f"coda.autotune: not using the cache dir {d}: it {why}; tuning results and compiled "
              "kernels are kept in memory for this process only", stacklevel=3)
    return False


def warn_unwritable(d: pathlib.Path, e: BaseException) -> None:
    """One warning per dir: writing a cache file under ``d`` failed, the data stays in memory."""
    warn_once(f"dir:{d}", f"coda.autotune: cannot write to the cache dir {d} ({type(e).__name__}: "
              f"{str(e).splitlines()[0][:200] if str(e) else ''}); tuning results and compiled kernels are kept "
              "in memory for this process only", stacklevel=3)


def ensure_dir(d: pathlib.Path) -> None:
    """Create ``d`` and its missing parents (mode 0700) if missing; raise ``PermissionError`` if it is (or became)
    unusable."""
    missing = []
    p = d
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    for p in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(p, 0o700)
    why = dir_problem(d)
    if why is not None:
        raise PermissionError(f"{d} {why}")


# -------------------------------------------------------------------------------------------- reading a file
def depth_ok(v, limit: int = MAX_ENTRY_DEPTH) -> bool:
    """Whether the JSON value ``v`` nests at most ``limit`` containers deep (checked without recursion)."""
    stack = [(v, 0)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, (dict, list)):
            if d >= limit:
                return False
            stack.extend((y, d + 1) for y in (x.values() if isinstance(x, dict) else x))
    return True


def _parse(path: pathlib.Path, validate: Optional[Validator] = None) -> tuple[dict, Optional[str]]:
    """(entries, problem); problem is None for a good (or missing) file. Never raises."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        return {}, None
    except OSError as e:
        return {}, f"unreadable ({e.__class__.__name__})"
    if len(raw) > MAX_FILE_BYTES:
        return {}, f"corrupt (larger than {MAX_FILE_BYTES >> 20} MiB)"
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return {}, "corrupt (not UTF-8)"
    except RecursionError:
        return {}, "corrupt (nested too deeply)"
    except ValueError:
        return {}, "corrupt (not JSON)"
    if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
        return {}, "corrupt (unexpected structure)"
    schema = data.get("schema")
    if type(schema) is not int or schema != SCHEMA:
        shown = repr(schema) if isinstance(schema, (int, float, str, type(None))) else type(schema).__name__
        return {}, f"stale (schema {shown[:40]}, expected {SCHEMA})"
    entries, bad = {}, []
    for k, v in data["entries"].items():
        why = "not an object" if not isinstance(v, dict) else "nested too deeply" if not depth_ok(v) else None
        if why is None and validate is not None:
            try:
                why = validate(k, v)
            except Exception as e:  # a validator must not crash on data it did not foresee
                why = f"{type(e).__name__}"
        if why is None:
            entries[k] = v
        else:
            bad.append((k, why))
    if bad:
        k, why = bad[0]
        return entries, (f"{len(bad)} invalid entr{'y' if len(bad) == 1 else 'ies'} (first: {k[:120]!r}: {why}) "
                         "in the")
    return entries, None


# -------------------------------------------------------------------------------------------- writing a file
def atomic_write_bytes(path: pathlib.Path, data: bytes) -> None:
    """Write ``data`` to a temp file next to ``path`` (mode 0600), fsync, then ``os.replace`` it over ``path``."""
    ensure_dir(path.parent)
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
    """Exclusive inter-process lock on ``<path>.lock`` (a no-op where fcntl is unavailable). The lock file is opened
    with ``O_NOFOLLOW``: a symlink there raises ``OSError`` instead of creating or locking its target."""
    ensure_dir(path.parent)
    if fcntl is None:
        yield
        return
    lock = f"{path}.lock"
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    if not hasattr(os, "O_NOFOLLOW") and os.path.islink(lock):
        raise OSError(f"{lock} is a symlink")
    fd = os.open(lock, flags, 0o600)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{lock} is not a regular file")
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


class ResultStore:
    """One JSON file of entries: ``path``, or ``cache_dir()/name`` resolved at each use (default: the tuning
    results, ``autotune.json``). ``validate(key, entry)`` returns why an entry read from disk is unusable (None if
    it is usable); unusable entries are ignored (one warning) and dropped by the next write.

    Entries whose write failed (or that belong to a refused cache dir) are kept in memory, per path, for the life
    of the process; :meth:`load` and :meth:`get` see them, and the next successful write stores them too."""

    def __init__(self, path: Optional[pathlib.Path] = None, name: str = RESULTS_FILE,
                 validate: Optional[Validator] = None):
        self._path = pathlib.Path(path) if path is not None else None
        self._name = name
        self._validate = validate
        self._lock = threading.Lock()
        self._memory: dict = {}  # str(path) -> {key: entry} not on disk

    @property
    def path(self) -> pathlib.Path:
        return self._path if self._path is not None else cache_dir() / self._name

    def load(self) -> dict:
        """All entries: the file's (empty, with one warning, if it is corrupt or stale; only the valid ones) and
        those kept in memory."""
        path = self.path
        entries: dict = {}
        if usable_dir(path.parent):
            entries, problem = _parse(path, self._validate)
            if problem is not None:
                _warn_once(path, problem)
        with self._lock:
            entries.update(self._memory.get(str(path), {}))
        return entries

    def get(self, key: str) -> Optional[dict]:
        return self.load().get(key)

    def put(self, key: str, entry: dict) -> bool:
        return self.update({key: entry})

    def update(self, new: dict) -> bool:
        """Merge ``new`` into the file under the lock (re-read, merge, atomic replace). True if it is on disk; False
        (one warning per dir) if it could not be written and is kept in memory instead. Never raises ``OSError``."""
        path = self.path
        with self._lock:
            pending = {**self._memory.get(str(path), {}), **new}
            try:
                if not usable_dir(path.parent):
                    raise _Refused
                with file_lock(path):
                    entries, problem = _parse(path, self._validate)
                    if problem is not None:
                        _warn_once(path, problem)
                    entries.update(pending)
                    data = json.dumps({"schema": SCHEMA, "entries": entries}, indent=1, sort_keys=True).encode()
                    atomic_write_bytes(path, data)
            except _Refused:
                self._memory[str(path)] = pending
                return False
            except (OSError, ValueError, TypeError, RecursionError) as e:
                warn_unwritable(path.parent, e)
                self._memory[str(path)] = pending
                return False
            self._memory.pop(str(path), None)
        forget_warning(str(path))  # the file is good again: a later corruption warns again
        forget_warning(f"dir:{path.parent}")
        return True

    def clear(self) -> bool:
        """Forget every entry (in memory and on disk). False (one warning) if the file could not be removed."""
        path = self.path
        with self._lock:
            self._memory.pop(str(path), None)
            try:
                if dir_problem(path.parent) is not None or not path.parent.is_dir():
                    return not path_exists(path)  # nothing of ours to remove (a refused dir is left alone)
                with file_lock(path):
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
            except OSError as e:
                warn_unwritable(path.parent, e)
                return False
        return True


class _Refused(Exception):
    """The cache dir is refused (already warned)."""


def path_exists(path: pathlib.Path) -> bool:
    """``path.exists()`` that answers False instead of raising (permission denied on a parent, ...)."""
    try:
        return path.exists()
    except OSError:
        return False
