"""Backend choice: `cpu` (numpy), `cuda` (the monokernel), `auto` (cuda when CuPy sees a GPU)."""
from __future__ import annotations


def cuda_available() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
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


def make_backend(kind: str, model_dir: str, lanes=None, max_seq=None, exchange=None, agree=None,
                 num_slots: int = 4, progress=None, comm=None, prefill_chunk=None):
    """Returns (backend, cfg). `lanes` is this rank's range (None: all); exchange/agree carry the lane
    sums and the go-on decision between ranks (None: one rank)."""
    kind = resolve(kind)
    if kind == "cuda":
        from .cuda.backend import CudaBackend
        b = CudaBackend(model_dir, lanes=lanes, max_seq=max_seq, num_slots=num_slots, comm=comm,
                        progress=progress)
        return b, b.cfg
    from kog_dist.checkpoint import Model
    from .cpu_backend import CpuBackend
    m = Model(model_dir, lanes, progress)
    b = CpuBackend(m.cfg, m.weights, m.embed, m.lanes, exchange, max_seq, num_slots, agree, prefill_chunk)
    b.model = m
    return b, m.cfg
