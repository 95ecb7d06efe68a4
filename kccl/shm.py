"""POSIX shared-memory segments for the shm transport, peer liveness, and cleanup on every exit path.

A segment is a file under /dev/shm (what shm_open uses on Linux; KCCL_SHM_DIR overrides the folder),
created O_EXCL with mode 0600, fully reserved with posix_fallocate (so a full /dev/shm is an error at
create time, not a SIGBUS later) and mmap'ed shared by its owner and by every peer. No
multiprocessing.shared_memory, hence no resource_tracker process and no spurious leak warnings.

Cleanup: the communicator unlinks every name as soon as all ranks have mapped all segments (the
memory lives on until the last mapping goes), so even SIGKILL of every rank leaves nothing behind.
Until then, and when `unlink_after_attach=False`, names are unlinked by close(), by the atexit hook,
by the optional signal handler (`install_signal_cleanup`), and by any survivor that sees a peer die.
"""

from __future__ import annotations

import atexit
import errno
import mmap
import os
import signal
import time
import weakref

SHM_DIR = os.environ.get("KCCL_SHM_DIR", "/dev/shm")
DEFAULT_PREFIX = "kccl"


def segment_prefix() -> str:
    """The name prefix of this process's segments (env KCCL_SHM_PREFIX, default "kccl")."""
    return os.environ.get("KCCL_SHM_PREFIX", DEFAULT_PREFIX)


class Segment:
    """One mapped shared-memory file: `buf` (writable memoryview of bytes) and `words` (uint64 view)."""

    def __init__(self, path: str, size: int, mm: mmap.mmap, linked: bool):
        self.path = path
        self.size = size
        self._mm = mm
        self.buf = memoryview(mm)
        self.words = self.buf.cast("Q")
        self.linked = linked  # this object is responsible for unlinking the name

    @classmethod
    def create(cls, path: str, size: int) -> "Segment":
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            if hasattr(os, "posix_fallocate"):
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as exc:
                    if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                        raise  # ENOSPC: /dev/shm too small for this layout
                    os.ftruncate(fd, size)
            else:
                os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            raise
        finally:
            os.close(fd)
        return cls(path, size, mm, linked=True)

    @classmethod
    def open(cls, path: str, size: int) -> "Segment":
        fd = os.open(path, os.O_RDWR)
        try:
            actual = os.fstat(fd).st_size
            if actual != size:
                raise ValueError(f"{path}: size {actual} != expected {size} (layout mismatch)")
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(path, size, mm, linked=False)

    def unlink(self) -> None:
        """Remove the name (mappings stay valid). Idempotent."""
        unlink_quietly(self.path)
        self.linked = False

    def close(self) -> None:
        """Drop the mapping. Views handed out elsewhere keep it alive until they are collected."""
        try:
            self.words.release()
            self.buf.release()
            self._mm.close()
        except (BufferError, ValueError):
            pass  # numpy views still exported; the mapping goes when they are garbage collected


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except (FileNotFoundError, PermissionError):
        pass


def unlink_mpich_segments() -> None:
    """Drop the names of MPICH's node segments (/dev/shm/mpich_shm_*) this process has mapped; MPICH keeps
    using its mappings. Their names outlive a rank that is killed or ends without MPI_Finalize. Call it only
    once every rank of the node is past MPI_Init (after any collective): a rank still attaching needs the
    name. Open MPI's segment is left alone (its finalize unlinks the name and complains when it is gone).
    Another rank of the node may have dropped a name first."""
    try:
        paths = _mpich_paths("/proc/self/maps")
    except OSError:
        return
    for path in paths:
        unlink_quietly(path)


def _mpich_paths(maps: str) -> set[str]:
    """The MPICH node segments (/dev/shm/mpich_shm_*, still named) a /proc/PID/maps file lists."""
    with open(maps) as f:
        return {x[5] for x in (line.split() for line in f) if len(x) == 6 and x[5].startswith("/dev/shm/mpich_shm_")}


def _mapped_by() -> dict[str, set[int]]:
    """/dev/shm/mpich_shm_* path -> the pids that map it (processes whose maps cannot be read are skipped)."""
    out: dict[str, set[int]] = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            for path in _mpich_paths(f"/proc/{pid}/maps"):
                out.setdefault(path, set()).add(int(pid))
        except OSError:
            pass
    return out


def sweep_mpich_segments(since: float, job_session: int | None = None, wait_s: float = 2.0) -> list[str]:
    """After an MPICH job has ended: unlink the node segments (/dev/shm/mpich_shm_*) of this user made
    since `since` (time.time()) that no process maps any more. A rank killed before every rank is past
    MPI_Init (so before unlink_mpich_segments could run) leaves its job's segment named; only the
    launcher outlives that. A segment still mapped by a process of `job_session` (the job's ranks, exiting)
    is waited for up to `wait_s`; one mapped by anything else (another job) is left alone."""
    uid = os.getuid()
    cands = []
    try:
        names = os.listdir("/dev/shm")          # MPICH's folder, whatever KCCL_SHM_DIR says
    except OSError:
        return []
    for name in names:
        path = os.path.join("/dev/shm", name)
        try:
            st = os.stat(path)
        except OSError:
            continue
        if name.startswith("mpich_shm_") and st.st_uid == uid and st.st_mtime >= since - 1.0:
            cands.append(path)
    removed, deadline = [], time.monotonic() + wait_s
    while cands:
        maps = _mapped_by()
        later = []
        for path in cands:
            users = maps.get(path, set())
            if not users:
                unlink_quietly(path)
                removed.append(path)
            elif job_session is not None and any(_session(q) == job_session for q in users):
                later.append(path)
        cands = later
        if not cands or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return removed


# ---- liveness ---------------------------------------------------------------------------------

def _stat_fields(pid: int) -> list[bytes]:
    """/proc/PID/stat after the command name (fields[0] is field 3, the state); OSError where unreadable."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    return stat[stat.rindex(b")") + 2:].split()


def process_starttime(pid: int) -> int:
    """The process start time (clock ticks since boot) from /proc, 0 where /proc is unavailable."""
    try:
        return int(_stat_fields(pid)[19])  # field 22 of stat
    except OSError:
        return 0


def _session(pid: int) -> int:
    """The session of `pid` (field 6 of stat), -1 where unknown."""
    try:
        return int(_stat_fields(pid)[3])
    except (OSError, ValueError, IndexError):
        return -1


def process_alive(pid: int, starttime: int = 0) -> bool:
    """False when `pid` is gone, a zombie, or a different process that reused the pid."""
    try:
        fields = _stat_fields(pid)
    except FileNotFoundError:
        return False
    except OSError:
        fields = None
    if fields is not None:
        if fields[0] in (b"Z", b"X", b"x"):
            return False
        return not starttime or int(fields[19]) == starttime
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---- cleanup registry -------------------------------------------------------------------------

_live = weakref.WeakSet()


def register(obj) -> None:
    """Close `obj` (anything with .close()) at interpreter exit or on an installed signal."""
    _live.add(obj)


def unregister(obj) -> None:
    _live.discard(obj)


def close_all() -> None:
    """Close every live communicator of this process (unlinks the names it still owns)."""
    for obj in list(_live):
        try:
            obj.close()
        except Exception:
            pass


atexit.register(close_all)


def install_signal_cleanup(signals=(signal.SIGTERM, signal.SIGINT, signal.SIGHUP)) -> None:
    """Install handlers that close every communicator, then do what the previous handler did.

    Not installed by default (a library should not take over signals). Call it from the main thread.
    A previous Python handler is chained; a default or ignored one is re-raised with SIG_DFL.
    """
    for sig in signals:
        previous = signal.getsignal(sig)

        def handler(signum, frame, previous=previous):
            close_all()
            if callable(previous):
                previous(signum, frame)
            elif previous == signal.SIG_IGN:
                return
            else:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

        signal.signal(sig, handler)
