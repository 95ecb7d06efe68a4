"""Under MPICH's hydra, each rank runs as the child of a small keeper process, so that one rank dying of
a signal does not take rank 0 down before it can tell its clients.

hydra's proxy SIGKILLs every rank of the job the moment waitpid() shows one of them *killed by a
signal* (proxy/pmip.c, whatever -disable-auto-cleanup says), so a SIGKILLed or crashed rank used to
reach the clients as a lost server instead of `backend_failed`. The keeper is the process hydra
started: it forks the real rank before anything else happens (no MPI, no threads, no CUDA yet), gives
it the PMI socket, forwards the launcher's signals to it, and exits with the rank's status as a plain
exit code (128 + the signal), which hydra treats as an exit: with -disable-auto-cleanup it SIGUSR1s
the survivors instead (the coordinator takes that as "a rank failed"), with the default cleanup it
still SIGKILLs them all. Nothing changes for the rank itself: same environment, same process group.

Only under hydra (PMI_FD, PMI_RANK and hydra's MPI_LOCALRANKID set; srun's PMI-2 sets no
MPI_LOCALRANKID); KOG_KEEPER=0 turns it off. The rank gets SIGKILL should its keeper die
(PR_SET_PDEATHSIG), so it is never left behind.
"""
from __future__ import annotations

import ctypes
import os
import signal

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCONT)


def wanted(environ=os.environ) -> bool:
    return (bool(environ.get("PMI_FD")) and "PMI_RANK" in environ and "MPI_LOCALRANKID" in environ
            and environ.get("KOG_KEEPER", "1") != "0")


def keep() -> None:
    """Return in the rank (the child); in the keeper, wait for the rank and exit with its status."""
    if not wanted():
        return
    try:
        pmi_fd = int(os.environ["PMI_FD"])
    except ValueError:
        return
    keeper = os.getpid()
    pid = os.fork()
    if pid == 0:                                 # the rank: carry on as if started directly
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)   # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
        if os.getppid() != keeper:               # the keeper died before that: so do we
            os._exit(1)
        return
    os.close(pmi_fd)                             # the rank alone holds the PMI socket: hydra sees it close

    def forward(signum, frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass
    for sig in FORWARDED:
        signal.signal(sig, forward)
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except ChildProcessError:
            status = 1 << 8
            break
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))
