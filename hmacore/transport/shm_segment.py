"""A named shared-memory file that several processes map, with a process-shared mutex and a
crash-safe lifetime (the shared store's segment, :mod:`.shared_store`).

Files, all under ``directory`` (default ``/dev/shm``, a tmpfs):

* ``<name>``: the data, ``size`` bytes reserved with ``posix_fallocate`` when created (a full
  tmpfs is an error at open, never a SIGBUS on a later write), mapped by every user.
* ``<name>.lock``: the mutex. ``flock(LOCK_EX)`` around every access; the kernel drops it
  when its holder dies, so a crashed process never leaves it held. flock locks belong to an
  open file description, so a thread lock is taken first (threads of one process share it).
* ``<name>.users``: liveness. Every attached process holds ``flock(LOCK_SH)`` on it for as
  long as it is attached. Whoever gets ``LOCK_EX`` on it (non-blocking) knows nobody is
  attached: at open, the data is new or left by crashed users (it is re-initialised); at
  close, it is the last user (it unlinks the three files).

Plus a sentinel process (:mod:`._shm_sentinel`), started detached by the creator, that removes
the files once every user is gone, even when all of them were killed.

Opening, closing and sweeping run under the mutex, so they never race each other. A waiter
that gets the mutex of a lock file a last user unlinked meanwhile sees a different inode at the
path and starts over. :func:`sweep_stale` removes segments of a name prefix that nobody uses
(engines that were killed: their SH locks went with them).

Fork: the locks and the mapping belong to the process that opened them; a forked child that
uses a segment re-opens it (``Segment.ensure_owner``) and never unlocks the parent's locks.
"""
from __future__ import annotations

import errno
import fcntl
import mmap
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import Iterator

from ..errors import StoreError
from ._shm_sentinel import same_file as _same_file   # the sentinel imports nothing of ours

__all__ = ["Segment", "sweep_stale", "segment_paths", "valid_segment_name"]

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
LOCK_TIMEOUT_S = 60.0      # a mutex holder works for milliseconds; a minute means it hangs


def valid_segment_name(name: str) -> bool:
    return isinstance(name, str) and bool(_NAME_RE.match(name)) and not name.endswith(
        (".lock", ".users"))


def segment_paths(directory: str, name: str) -> tuple[str, str, str]:
    """(data, lock, users) paths of segment ``name``."""
    base = os.path.join(directory, name)
    return base, base + ".lock", base + ".users"


def _try_flock(fd: int, op: int) -> bool:
    try:
        fcntl.flock(fd, op | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise


def _flock_bounded(fd: int, op: int, what: str, timeout: float = LOCK_TIMEOUT_S) -> None:
    """``flock(fd, op)``, waiting at most ``timeout`` seconds (StoreError after)."""
    deadline = time.monotonic() + timeout
    delay = 0.0002
    while not _try_flock(fd, op):
        if time.monotonic() > deadline:
            raise StoreError(f"{what}: lock not acquired within {timeout:.0f} s (a process "
                             "holds it and does not let go)")
        time.sleep(delay)
        delay = min(delay * 2, 0.01)


def _unlink(*paths: str) -> None:
    for p in paths:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


class Segment:
    """One process's attachment to shared segment ``name`` (see the module docstring).

    Args:
        name: file name (letters, digits, ``.``, ``_``, ``-``; at most 200 characters).
        size: bytes of the data file.
        init: ``init(buf)`` writes a fresh segment's contents (called with the mutex held,
            only by the process that creates or reclaims the segment).
        check: ``check(buf)`` raises StoreError if an existing segment does not fit this
            user (different geometry); called with the mutex held.
        directory: where the files live (a tmpfs: ``/dev/shm``).

    Attributes: ``buf`` (the ``mmap``), ``created`` (this process initialised the data),
    ``reclaimed`` (it re-initialised data left by users that are all gone).
    """

    def __init__(self, name: str, size: int, init: Callable[[mmap.mmap], None],
                 check: Callable[[mmap.mmap], None], directory: str = "/dev/shm", *,
                 sentinel: bool = True) -> None:
        if not valid_segment_name(name):
            raise StoreError(f"segment name {name!r} must be 1-200 characters of letters, "
                             "digits, '.', '_', '-' (not starting with '.', '_' or '-')")
        if not os.path.isdir(directory):
            raise StoreError(f"shared-memory directory {directory!r} does not exist")
        self.name, self.size, self.directory = name, int(size), directory
        self._init, self._check = init, check
        self.paths = segment_paths(directory, name)
        self.buf: mmap.mmap | None = None
        self._fds: tuple[int, int, int] | None = None     # data, lock, users
        self.created = self.reclaimed = False
        self.pid = os.getpid()
        self._want_sentinel = bool(sentinel)
        self.sentinel_pid: int | None = None
        self._open()

    # -- lifetime -------------------------------------------------------------------------
    def _open(self) -> None:
        data_p, lock_p, users_p = self.paths
        for _ in range(100):
            lock_fd = os.open(lock_p, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                _flock_bounded(lock_fd, fcntl.LOCK_EX, f"segment {self.name}")
                if not _same_file(lock_fd, lock_p):     # a last user unlinked it meanwhile
                    os.close(lock_fd)
                    continue
                self._attach(lock_fd)
                fcntl.flock(lock_fd, fcntl.LOCK_UN)
                if self.created and self._want_sentinel:
                    self._start_sentinel()
                return
            except BaseException:
                os.close(lock_fd)      # closing drops the mutex (and nothing else of ours)
                raise
        raise StoreError(f"segment {self.name}: could not open it (removed 100 times meanwhile)")

    def _start_sentinel(self) -> None:
        """The creator starts the process that removes the files once every user is gone,
        however the users end (:mod:`._shm_sentinel`). It is detached (a double fork): vLLM
        kills every descendant of its engine core at shut-down, a sentinel among them would
        die with the users it watches. ``sentinel_pid`` is its PID (None if it did not
        start: segments of killed users are then swept at the next open)."""
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_shm_sentinel.py")
        try:
            out = subprocess.run([sys.executable, "-I", "-S", script, self.directory, self.name],
                                 stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, close_fds=True, timeout=60,
                                 check=True).stdout
            self.sentinel_pid = int(out.split()[0])
        except Exception:   # no interpreter to run, a failed start: the sweep remains
            self.sentinel_pid = None

    def _attach(self, lock_fd: int) -> None:
        """Mutex held: create / reclaim or attach, then hold LOCK_SH on the users file."""
        data_p, _, users_p = self.paths
        users_fd = os.open(users_p, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        data_fd = -1
        alone = False
        try:
            alone = _try_flock(users_fd, fcntl.LOCK_EX)
            data_fd = os.open(data_p, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            if alone:       # nobody attached: a new segment, or one whose users all died
                self.reclaimed = os.fstat(data_fd).st_size > 0
                os.ftruncate(data_fd, 0)
                try:
                    os.posix_fallocate(data_fd, 0, self.size)
                except OSError as e:
                    os.ftruncate(data_fd, 0)
                    free = os.statvfs(self.directory)
                    raise StoreError(
                        f"segment {self.name}: cannot reserve {self.size} bytes in "
                        f"{self.directory} ({e.strerror}; {free.f_bavail * free.f_frsize} bytes "
                        "free): lower store_capacity_bytes or enlarge the tmpfs") from None
                self.buf = mmap.mmap(data_fd, self.size)
                self._init(self.buf)
                self.created = True
                fcntl.flock(users_fd, fcntl.LOCK_SH)   # a downgrade; the mutex covers the gap
            else:
                size = os.fstat(data_fd).st_size
                if size <= 0:
                    raise StoreError(f"segment {self.name} has users but no data")
                self.buf = mmap.mmap(data_fd, size)
                self._check(self.buf)
                # the sentinel may hold LOCK_EX for an instant (it never waits while it does)
                _flock_bounded(users_fd, fcntl.LOCK_SH, f"segment {self.name} users")
        except BaseException:
            self._release_map(True)
            if alone:              # nobody else uses it: a failed creation leaves no files
                _unlink(*self.paths)
            if data_fd >= 0:
                os.close(data_fd)
            os.close(users_fd)
            raise
        self._fds = (data_fd, lock_fd, users_fd)

    @property
    def closed(self) -> bool:
        return self._fds is None

    def close(self, *, views_released: bool = True) -> bool:
        """Detach; the last user unlinks the files. True if this call unlinked them.
        ``views_released``: every NumPy view of ``buf`` was dropped (else the mapping is left
        to the garbage collector; the files are still unlinked)."""
        if self._fds is None:
            return False
        data_fd, lock_fd, users_fd = self._fds
        self._fds = None
        if os.getpid() != self.pid:     # a forked copy: the locks are the parent's
            self._drop_inherited(data_fd, lock_fd, users_fd)
            return False
        last = False
        try:
            _flock_bounded(lock_fd, fcntl.LOCK_EX, f"segment {self.name}")
            last = _try_flock(users_fd, fcntl.LOCK_EX)
            if last:
                _unlink(*self.paths)
        finally:
            self._release_map(views_released)
            for fd in (data_fd, users_fd, lock_fd):      # the mutex goes last
                os.close(fd)
        return last

    def _release_map(self, views_released: bool) -> None:
        if self.buf is not None:
            try:
                if views_released:
                    self.buf.close()
            except BufferError:
                pass        # a view is alive: the mapping goes with the last view
            self.buf = None

    def _drop_inherited(self, *fds: int) -> None:
        self.buf = None     # the child's copy of the mapping goes with the object
        for fd in fds:      # closing a copy never releases the parent's locks
            try:
                os.close(fd)
            except OSError:
                pass

    def ensure_owner(self) -> bool:
        """In a forked child: re-open the segment as this process's own (fresh descriptors
        and locks). Returns True if it re-opened."""
        if os.getpid() == self.pid or self._fds is None:
            return False
        self._drop_inherited(*self._fds)
        self._fds = None
        self.pid = os.getpid()
        self.created = self.reclaimed = False
        self._open()
        return True

    # -- the mutex --------------------------------------------------------------------------
    @contextmanager
    def locked(self) -> Iterator[None]:
        """The process-shared mutex (callers also hold a thread lock: see the docstring)."""
        if self._fds is None:
            raise StoreError(f"segment {self.name} is closed")
        fd = self._fds[1]
        _flock_bounded(fd, fcntl.LOCK_EX, f"segment {self.name}")
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)


def sweep_stale(directory: str, prefix: str) -> list[str]:
    """Remove the segments named ``prefix*`` in ``directory`` that no process is attached to
    (their users were killed); returns the names removed. Segments in use, or being opened
    (their mutex is held), are left alone."""
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for fn in names:
        if not (fn.startswith(prefix) and fn.endswith(".lock")):
            continue
        name = fn[:-len(".lock")]
        data_p, lock_p, users_p = segment_paths(directory, name)
        try:
            lock_fd = os.open(lock_p, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if not _try_flock(lock_fd, fcntl.LOCK_EX) or not _same_file(lock_fd, lock_p):
                continue
            try:
                users_fd = os.open(users_p, os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:
                users_fd = -1
            try:
                if users_fd < 0 or _try_flock(users_fd, fcntl.LOCK_EX):
                    _unlink(data_p, users_p, lock_p)
                    removed.append(name)
            finally:
                if users_fd >= 0:
                    os.close(users_fd)
        finally:
            os.close(lock_fd)
    return removed
