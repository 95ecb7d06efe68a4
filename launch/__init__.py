"""Starting ranks: who is who (from MPI), the GPU of a local rank, `kog launch`, and the mpirun and
Slurm scripts beside this file (docs/launch.md)."""
from .discovery import (MultiNodeError, RankInfo, discover, gpu_for_local_rank,  # noqa: F401
                        require_single_node)
