"""kccl: collectives between the ranks of one host over peer-mapped memory (see kccl/README.md).

    from kccl import Communicator
    comm = Communicator.create(MPI.COMM_WORLD, transport="shm", max_floats=..., depth=..., tags=...)
"""

from .communicator import Communicator, Handle
from .errors import KcclError, KcclTimeout, PeerLost
from .rendezvous import FileRendezvous
from .shm import close_all, install_signal_cleanup
from .wait import BackoffPolicy

__all__ = ["Communicator", "Handle", "KcclError", "KcclTimeout", "PeerLost", "BackoffPolicy",
           "install_signal_cleanup", "close_all", "FileRendezvous"]
