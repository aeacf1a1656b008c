"""One run per dump folder: ``<dump_folder>/run.lock``, held for the life of a run.

The lock is taken by the run's first process (global rank 0, or the only process) right after
the config is parsed, before anything is written; the other ranks of the run never touch it.
It is an ``flock`` on the file, which the kernel drops when the process ends however it ends,
plus the holder's pid, hostname and start time in the file, for the message a second run gets:

- a second run into the folder while the lock is held stops at once with one line naming the
  folder, the holder's pid and host, and what to do;
- a lock file whose lock is no longer held (its process was killed: SIGKILL, a crash, a lost
  node) is taken over with one warning naming the dead pid;
- the file is removed when the run ends (normally, by an exception, or by SIGTERM/SIGINT: the
  handlers in checkpoints.py end the run through the normal exit path).
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import os
import signal
import socket
import threading
import time

from hymo_recipes.titan.api import logger

LOCK_NAME = "run.lock"


class RunLockError(RuntimeError):
    """Another live run holds the dump folder."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    def __init__(self, folder: str):
        self.folder = os.path.abspath(folder)
        self.path = os.path.join(self.folder, LOCK_NAME)
        self.fd: int | None = None

    def acquire(self) -> None:
        os.makedirs(self.folder, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = _read(fd)
                os.close(fd)
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                raise RunLockError(
                    f"dump folder {self.folder} is in use by another run (pid {holder.get('pid', '?')} on "
                    f"{holder.get('hostname', '?')}, since {holder.get('started', '?')}; lock {self.path}): wait for "
                    "it to end or stop it, or pass another --job.dump_folder") from None
            # the file may have been removed (its holder ended) between our open and our flock
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        previous = _read(fd)
        if previous.get("pid"):
            pid, here = int(previous["pid"]), previous.get("hostname") == socket.gethostname()
            if here and pid != os.getpid() and _pid_alive(pid):
                # a live process of that pid but no lock held: a filesystem without flock, or a reused
                # pid; not taken over unasked
                os.close(fd)
                raise RunLockError(
                    f"dump folder {self.folder} has a lock file {self.path} of pid {pid} on this host, which is "
                    "running but holds no lock: if that process is not a training run, delete the file; else "
                    "stop it or pass another --job.dump_folder")
            state = "is not running" if here else "holds no lock any more"
            logger.warning(f"stale lock {self.path} taken over: pid {previous['pid']} on {previous.get('hostname')} "
                           f"(started {previous.get('started')}) {state}: that run ended without releasing it "
                           "(killed or crashed); its last checkpoint is checked before resuming")
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "hostname": socket.gethostname(),
                                  "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                                  "run_id": os.environ.get("TORCHELASTIC_RUN_ID")}).encode() + b"\n", 0)
        os.fsync(fd)
        self.fd = fd
        atexit.register(self.release)

    def release(self) -> None:
        """Removes the file (if it is still this lock's) and drops the lock; idempotent."""
        if self.fd is None:
            return
        try:
            if os.stat(self.path).st_ino == os.fstat(self.fd).st_ino:
                os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self.fd)
        self.fd = None


def _read(fd: int) -> dict:
    try:
        data = os.pread(fd, 4096, 0)
        return json.loads(data) if data.strip() else {}
    except (OSError, ValueError):
        return {}


_held: RunLock | None = None


def acquire_for_run(config) -> RunLock | None:
    """Takes the dump folder's lock if this process is the run's rank 0 (module docstring);
    raises RunLockError if another live run holds it."""
    global _held
    if os.environ.get("RANK", "0") != "0" or _held is not None:
        return _held
    lock = RunLock(config.job.dump_folder)
    lock.acquire()
    _held = lock
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _release_and_die)  # checkpoints.SaveGuard may replace it with a save
    return lock


def _release_and_die(signum, frame) -> None:
    """SIGTERM's default action, after removing the lock file."""
    release_for_run()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def release_for_run() -> None:
    global _held
    if _held is not None:
        _held.release()
        _held = None
