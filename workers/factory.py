"""Backend choice: `cpu` (numpy), `cuda` (the monokernel), `auto` (cuda when CuPy sees a GPU; with several
ranks, when every rank sees one and the model suits the multi-rank kernel)."""
from __future__ import annotations

from kccl import optional
from kog_dist.checkpoint import Model
from kog_dist.config import check_context_fits
from kog_dist.formats import open_model

from . import cpu_tp
from .cpu_backend import CpuBackend
from .cuda import multirank              # plain Python: no CuPy needed
from .cuda.backend import CudaBackend   # CuPy is imported when one is built, not here


def cuda_available() -> bool:
    try:
        return optional.cupy().cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, no device: all mean "not here"
        return False


def resolve(kind: str) -> str:
    if kind == "auto":
        return "cuda" if cuda_available() else "cpu"
    if kind == "cuda" and not cuda_available():
        raise ValueError("--backend cuda needs CuPy and a CUDA GPU, and this machine has none")
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"unknown backend {kind!r} (cpu, cuda, auto)")
    return kind


def choose(kind: str, size: int, here: bool, everywhere: bool, cfg=None) -> tuple[str, str | None]:
    """The backend of a job of `size` ranks, the same on every rank: (kind, a note for rank 0's log or
    None). `here`: this rank sees a GPU (cuda_available()); `everywhere`: every rank does (the job's
    AND of `here`, taken over MPI by kog-worker). cpu is always cpu; cuda needs a GPU on every rank
    (ValueError otherwise, on every rank alike when they pass the same `everywhere`); auto gives cuda
    when every rank sees a GPU and, with several ranks, the model passes the multi-rank kernel's rules
    (workers.cuda.multirank.check: 1..8 ranks, ring depth), else cpu."""
    if kind not in ("cpu", "cuda", "auto"):
        raise ValueError(f"unknown backend {kind!r} (cpu, cuda, auto)")
    if kind == "cpu":
        return "cpu", None
    if size > 1 and cfg is not None and cfg.num_lanes == 1:
        from kog_dist.tp_lanes import lanes_config    # tensor parallelism: the model as N all-early lanes
        cfg = lanes_config(cfg, size)                 # refuses a split the model cannot take, in one line
    if not everywhere:
        if kind == "cuda":
            if size == 1:
                raise ValueError("--backend cuda needs CuPy and a CUDA GPU, and this machine has none")
            where = "this machine has none" if not here else "another rank sees none"
            raise ValueError(f"--backend cuda needs CuPy and a CUDA GPU on every rank, and {where}")
        if size > 1 and here:
            return "cpu", f"--backend auto: not every one of the {size} ranks sees a GPU; using cpu"
        return "cpu", None
    if size > 1 and cfg is not None:
        try:
            multirank.check(cfg, size)
        except ValueError as e:
            if kind == "cuda":
                raise
            return "cpu", f"--backend auto: {e}; using cpu"
    if size > 1:
        what = "tensor-parallel partials" if cfg is not None and multirank.all_early(cfg) else "lane partials"
        return "cuda", (f"--backend {kind}: cuda backend on {size} ranks (each rank's monokernel exchanges "
                        f"{what} with the others through kccl cuda_ipc)")
    return "cuda", None


# --dtype names -> the backends' storage types (kog generate, kog-worker, kog serve, kog bench)
STORE_NAMES = {"bf16": "BF16", "fp16": "F16", "fp32": "F32", "q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1",
               # the K-quants (cuda only: random weights of `kog bench --shape`, or a K-quant GGUF as it is stored)
               "q4_k": "Q4_K", "q5_k": "Q5_K", "q6_k": "Q6_K", "q4_k_m": "Q4_K_M", "q5_k_m": "Q5_K_M"}
K_STORES = ("Q4_K", "Q5_K", "Q6_K", "Q4_K_M", "Q5_K_M")


def make_backend(kind: str, src, lanes=None, max_seq=None, exchange=None, agree=None,
                 num_slots: int = 4, progress=None, comm=None, prefill_chunk=None, dtype=None,
                 speculative: bool = False, tp=None):
    """Returns (backend, cfg). `src` is the opened model (kog_dist.formats.open_model: config and tensor
    source) or a path to open; `lanes` is this rank's range (None: all); exchange/agree carry the lane
    sums and the go-on decision between ranks (None: one rank). `dtype` (None: the model's own):
    bf16, fp16, fp32, q8_0, q4_0 or q4_1 storage of the layer matrices; the cpu backend computes on
    the values that storage holds, the cuda backend streams it. `speculative`: requests will speculate by
    default (the cuda backend compiles for it). `tp` (rank, size): this rank's shard of a one-lane model
    split over `size` ranks by tensor parallelism (workers.cpu_tp; `comm` carries its sums)."""
    store = STORE_NAMES.get(str(dtype).lower()) if dtype is not None else None
    if dtype is not None and store is None:
        raise ValueError(f"--dtype {dtype}: not a storage type ({', '.join(STORE_NAMES)})")
    kind = resolve(kind)
    if isinstance(src, str):
        src = open_model(src, progress=progress)
    if kind == "cuda":
        b = CudaBackend(src, lanes=lanes, max_seq=max_seq, num_slots=num_slots, comm=comm,
                        progress=progress, dtype=store, speculative=speculative)
        return b, b.cfg
    if store in K_STORES:
        raise ValueError(f"--dtype {dtype}: the cpu backend stores bf16, fp16, fp32, q8_0, q4_0 or q4_1 (a K-quant "
                         "GGUF runs as it is stored: leave --dtype out)")
    check_context_fits(src.cfg, max_seq)   # a context whose KV cache cannot fit is refused before loading
    if tp is not None and tp[1] > 1:
        m, par = cpu_tp.build(src, comm, tp[0], tp[1], progress=progress, store=store)
        b = CpuBackend(m.local_cfg, m.weights, m.embed, m.lanes, exchange, max_seq, num_slots, agree,
                       prefill_chunk, tp=par)
        b.model = m
        return b, m.cfg
    m = Model(src, lanes, progress, store=store)
    b = CpuBackend(m.cfg, m.weights, m.embed, m.lanes, exchange, max_seq, num_slots, agree, prefill_chunk)
    b.model = m
    return b, m.cfg
