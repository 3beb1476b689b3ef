"""One run per folder: an exclusive lock on a run's output or checkpoint folder, held for the
run's life.

The lock is `fcntl.flock` on the file LOCK_NAME inside the folder. The kernel holds it for
the open file, so it goes when the process ends however it ends (a SIGKILL or a crash
included): a dead run never blocks the next one, and no stale lock needs clearing. A second
run asking for a locked folder gets `FolderInUse` (a ValueError naming the folder and the
process holding it) at once, before it reads or writes anything there.

`release` removes the file. A run that took the lock from a file another run was just
removing would hold a lock nobody else sees, so `acquire` checks, once it holds the lock,
that the name still leads to the file it locked, and tries again otherwise.
"""

import contextlib
import fcntl
import os
from pathlib import Path

LOCK_NAME = ".diloco-jax.lock"


class FolderInUse(ValueError):
    """Another live process holds the folder's lock."""


class RunLock:
    """A held lock on `folder` (see `acquire`); `release` (or leaving a `with` block) lets it
    go and removes the lock file."""

    def __init__(self, folder: Path, fd: int):
        self.folder, self._fd = folder, fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is None:
            return
        # Removed while still locked: a run waiting on this file then sees that it is gone.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.folder / LOCK_NAME)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def acquire(folder: str | os.PathLike, *, what: str) -> RunLock:
    """Locks the existing folder `folder` for this process; `what` names it in the error
    (e.g. "--out" or "checkpoint_dir"). Raises FolderInUse when another process holds it."""
    folder = Path(folder)
    path = folder / LOCK_NAME
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise FolderInUse(
                f"{what} {folder} is in use by another run{holder}: wait for it to end, or "
                "pick another folder"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        if _same_file(fd, path):
            break
        os.close(fd)  # the holder removed this file as we locked it: lock the new one
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return RunLock(folder, fd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (mine.st_dev, mine.st_ino)


def _holder(fd: int) -> str:
    """' (process N)' from the lock file, or '' when it names none."""
    text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    return f" (process {text})" if text.isdigit() else ""
