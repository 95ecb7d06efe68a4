"""One rank of the multi-rank decode bench (run under mpirun by tests/gpu_multirank.sh and
tests/gpu_multigpu.sh): the 2B shape, bf16, random weights made on the device, greedy, EOS ignored;
rank r uses GPU r % (GPUs seen). Prints one BENCH line on rank 0 with the tokens/s of 3 runs and the
first ids, so the lines of different N can be compared.
    mpirun -n N python3 tests/bench_multirank.py [tokens] [profile]
profile: also the per-phase clock marks of decode step 200 on every rank (where the time goes).
"""
import sys, cupy as cp
from mpi4py import MPI
from kccl.mpi_plain import allgather_json
w = MPI.COMM_WORLD
n = w.size
cp.cuda.Device(w.rank % cp.cuda.runtime.getDeviceCount()).use()
from kog_dist.shapes import shape_config
from kog_dist.backend import RunCommand
from workers.cuda import multirank as mr
from workers.cuda.backend import CudaBackend
from workers.cuda.build import build, default_blocks
from workers.cuda.weights import random_weights
cfg, dt, gen = shape_config("2b"), "BF16", int(sys.argv[1]) if len(sys.argv) > 1 else 512
sms = cp.cuda.Device().attributes["MultiProcessorCount"]
comm = None
if n > 1:
    from kccl import Communicator
    comm = Communicator.create(w, transport="cuda_ipc", **mr.comm_kwargs(cfg, n))
    view = mr.RankView(cfg, w.rank, n)
    ndev = cp.cuda.runtime.getDeviceCount()
    nb = mr.blocks_per_rank(view, sms, -(-n // ndev))    # ranks sharing this rank's GPU (MPS when > 1)
else:
    view, nb = cfg, default_blocks(cfg, sms)
prof = "profile" in sys.argv[2:]
k = build(cfg, dt, nb, nranks=n, progress=False, marks=prof)
dw = random_weights(view, dt, k, seed=1)
b = CudaBackend(cfg=cfg, weights=dw, comm=comm, nblocks=nb, max_seq=4096, num_slots=1, progress=False,
                timing_marks=prof)
b.run(RunCommand(append=[1, 2, 3, 4], max_new_tokens=32), ignore_eos=True)          # warm-up
rates = []
for _ in range(3):
    r = b.run(RunCommand(append=[1, 2, 3, 4], max_new_tokens=gen), ignore_eos=True)
    rates.append((len(r.token_ids) - 1) / r.decode_ms * 1e3)
if prof:
    from workers.cuda.bench_kernel import format_breakdown, phase_breakdown
    b.run(RunCommand(append=[1, 2, 3, 4], max_new_tokens=min(gen, 256)), ignore_eos=True, timing_token=200)
    text = format_breakdown(phase_breakdown(b.last_timing, cfg.num_hidden_layers))
    texts = allgather_json(w, text)
    for q, t in enumerate(texts if w.rank == 0 else []):
        print(f"PROFILE N={n} rank {q} (decode step 200):\n{t}", flush=True)
ids = allgather_json(w, r.token_ids[:64])
if w.rank == 0:
    same = all(x == ids[0] for x in ids)
    print(f"BENCH N={n} blocks/rank={nb} tokens={gen} tokens/s best={max(rates):.1f} all={[round(x, 1) for x in rates]} "
          f"kernel_ms={b.last_kernel_ms:.1f} ranks_same_ids={same} gpus={cp.cuda.runtime.getDeviceCount()} "
          f"ids={r.token_ids[:24]}", flush=True)
b.close()
if comm is not None:
    comm.shutdown()
