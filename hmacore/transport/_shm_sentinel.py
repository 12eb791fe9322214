"""Remove a shared segment once every process using it is gone, however they ended.

``python _shm_sentinel.py DIRECTORY NAME``: started by the process that creates segment NAME
(:mod:`.shm_segment`); it forks a detached watcher (own session, parent gone: no process
tree it could be killed with) and exits. It blocks in ``flock(LOCK_EX)`` on the
segment's users file, which the kernel grants when the last user's ``LOCK_SH`` is gone: a
clean close or a SIGKILL alike (vLLM force-kills its engine core and workers when they are
slow to exit, so their shutdown hooks may never run). It then takes the segment's mutex and,
if still nobody is attached and the files are still this segment's, unlinks them.

It never waits for the mutex while holding the users lock (an opener holds the mutex while
it joins the users), so it cannot deadlock with an opener. Standard library only: it starts
in a few milliseconds and imports nothing of the package.
"""
from __future__ import annotations

import errno
import fcntl
import os
import sys


def same_file(fd: int, path: str) -> bool:
    """Is ``path`` still the file open as ``fd`` (not removed or replaced)?"""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


def watch(directory: str, name: str) -> bool:
    """Wait for the users of segment ``name`` to be gone, then remove it. True if this call
    removed it; False if the files were already gone or replaced."""
    base = os.path.join(directory, name)
    data_p, lock_p, users_p = base, base + ".lock", base + ".users"
    try:
        lock_fd = os.open(lock_p, os.O_RDWR | os.O_CLOEXEC)
        users_fd = os.open(users_p, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        while True:
            fcntl.flock(users_fd, fcntl.LOCK_EX)          # all users gone (or none yet)
            fcntl.flock(users_fd, fcntl.LOCK_UN)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            try:
                if not (same_file(lock_fd, lock_p) and same_file(users_fd, users_p)):
                    return False              # removed (or removed and made anew) by a user
                try:
                    fcntl.flock(users_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError as e:
                    if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                        raise
                    continue                  # someone attached meanwhile: keep watching
                for p in (data_p, users_p, lock_p):
                    try:
                        os.unlink(p)
                    except FileNotFoundError:
                        pass
                return True
            finally:
                fcntl.flock(lock_fd, fcntl.LOCK_UN)
    finally:
        os.close(users_fd)
        os.close(lock_fd)


def main(argv: list[str]) -> int:
    """``DIRECTORY NAME``: detach (fork; the parent prints the watcher's PID and exits, so the
    watcher is nobody's descendant: vLLM kills its engine's whole process tree), then watch."""
    directory, name = argv[0], argv[1]
    pid = os.fork()
    if pid:
        sys.stdout.write(f"{pid}\n")
        sys.stdout.flush()
        return 0
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    try:
        watch(directory, name)
    finally:
        os._exit(0)
    return 0    # pragma: no cover


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
