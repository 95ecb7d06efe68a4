"""The `cuda` backend: batched prefill (cuBLAS + prefill.cu), then ONE launch of the monokernel for the
whole generation (with speculation on a one-lane model: its speculative build, mk_spec.cuh). Tokens come back through host-mapped memory while the kernel runs; the host raises a
host-mapped cancel flag that the kernel reads once per token.

One rank runs every lane (the measured path). With a kccl `cuda_ipc` CudaCommunicator of N > 1 ranks
(`comm`), rank r runs lanes [r*L/N, (r+1)*L/N) and its monokernel (built with KOG_NRANKS = N)
exchanges lane partials with the other ranks through kccl.cuh; every rank samples the same token.
The multi-rank path has run on one GPU shared by N ranks under MPS (docs/kccl-gpu.md "multi-rank
monokernel", tests/gpu_multirank.sh), not yet across several GPUs. Stop rules and results follow workers/cpu_backend.py exactly: the
host applies them to the tokens in order; the kernel stops by itself on EOS / stop ids / max tokens /
cancel, so it never runs more than one token past the host's decision (two with several ranks: the
cancel word travels with the final-norm exchange of the next token).
"""
from __future__ import annotations

import ctypes
import time

import numpy as np

from kog_dist.backend import Backend, Clock, RunCommand, RunResult, check_command

from .host import (MAX_EOS, MAX_STOP, N_PARAMS, REASONS, SPEC_MIN_NGRAM, SPEC_PROBE, SPEC_START, SPEC_WORDS,
                   SW_ACCEPTED, SW_DRAFTED, SW_K, SW_PROBE, SW_STEPS, _KEEP, _Mapped, _cuda_error, hang_report,
                   rope_table)
from .mask import masked_build
from .params import LAYOUT, MASK_LAYOUT, MR_MASK_LAYOUT, ParamWords


class CudaBackend(Backend):
    """`model`: a path (any format kog_dist.formats.open_model reads) or a tensor source (open_model's,
    a CheckpointReader), or None with `weights` (DeviceWeights made by the caller, e.g. random_weights).
    `dtype`: the storage (weights.split_dtype: BF16, F16, F32, Q8_0, Q4_0, Q4_1, Q4_0:F32, ...); None: the
    checkpoint's own (weights.default_dtype). `speculative`: the backend will serve speculative requests
    (a server's default): both builds take the thread count that suits the verify passes
    (build.speculating_defines); without it a speculative request still runs, on the plain build's."""

    grammar_on_ranks = True   # several ranks: each rank's host runs the grammar, its kernel masks its rows

    def __init__(self, model=None, lanes=None, max_seq=None, num_slots: int = 4, comm=None,
                 progress=None, *, cfg=None, weights=None, dtype: str | None = None, nblocks: int | None = None,
                 prefetch: int | None = None, prefill_chunk: int = 2048, extra_defines: dict | None = None,
                 timing_marks: bool = False, speculative: bool = False):
        import cupy as cp

        from .build import build
        from .prefill import Prefill
        from .weights import default_dtype, load_checkpoint, open_source
        self.cp = cp
        self.nranks = getattr(comm, "size", 1) if comm is not None else 1
        self.comm = comm if self.nranks > 1 else None
        src = None
        if weights is None:
            src = open_source(model, cfg)
            cfg = src.cfg
            dtype = dtype or default_dtype(src)
        else:
            dtype = weights.dtype
        view = None
        if self.nranks > 1:
            from .multirank import RankView, blocks_per_rank, check
            if not hasattr(comm, "dev_ptr"):
                raise ValueError("the cuda backend with several ranks needs a kccl 'cuda_ipc' communicator "
                                 "(kccl.cuda_ipc.CudaCommunicator), not " + type(comm).__name__)
            from .multirank import TAGS
            if [comm.channel(t) for t in TAGS] != [1, 2, 3]:   # the kernel's channels 1 + kind and CH_FIN
                raise ValueError(f"the cuda_ipc communicator must be created with tags={TAGS} "
                                 "(multirank.comm_kwargs)")
            full = cfg or weights.cfg.full
            check(full, self.nranks)
            from .multirank import depth, max_floats
            if comm.depth != depth(full) or comm.max_floats < max_floats(full, self.nranks):
                raise ValueError(f"the cuda_ipc communicator has depth {comm.depth} and {comm.max_floats} "
                                 f"floats a slot; this model needs depth {depth(full)} and at least "
                                 f"{max_floats(full, self.nranks)} (create it with multirank.comm_kwargs)")
            view = RankView(full, comm.rank, self.nranks)
            if lanes is not None and tuple(lanes) != tuple(view.lanes):
                raise ValueError(f"rank {comm.rank}: lanes {lanes} differ from the cuda backend's {view.lanes}")
            if nblocks is None:
                sms = cp.cuda.Device().attributes["MultiProcessorCount"]
                bus = getattr(comm, "bus_ids", None) or [0] * self.nranks
                nblocks = blocks_per_rank(view, sms, bus.count(bus[comm.rank]))
            self.cfg, self.rcfg = full, view
            self.hang_s = max(self.hang_s, float(getattr(comm, "timeout", 30.0)) + 10.0)
        else:
            self.cfg = self.rcfg = cfg if weights is None else weights.cfg
            if lanes is not None and len(lanes) != self.cfg.num_lanes:
                raise ValueError("the cuda backend runs all lanes on one rank unless given a kccl cuda_ipc "
                                 "communicator of several ranks")
        if speculative and self.nranks == 1 and self.cfg.num_lanes == 1:
            from .build import speculating_defines
            extra_defines = {**speculating_defines(self.cfg, dtype, nblocks), **(extra_defines or {})}
        self.k = build(self.cfg, dtype, nblocks, prefetch, progress=progress is not False, extra=extra_defines,
                       nranks=self.nranks, marks=timing_marks)
        # the speculative build runs the plain build's thread count and row loops: the same sums in the same
        # order, so a verify pass gives the plain step's bits
        self._spec_build = (dtype, prefetch, {**(extra_defines or {}), "CFG_NT": self.k.nthreads},
                            progress is not False)
        self.ks = self.sbuf = None      # the speculative build and its buffers, made at the first such request
        self.km = self.dmask = None     # the token mask's build (structured outputs) and its mapped words, the same
        if weights is None:
            try:
                weights = load_checkpoint(src, self.cfg, dtype, progress, view=view, kernels=self.k)
            finally:
                if src is not model:
                    src.close()
        cfg = self.cfg
        self.dw = weights
        self.nblocks = int(self.k.defines["CFG_NB"])
        from .build import spec_positions
        # the K-quants have no verify pass (mk_kquant.cuh): their requests decode a token at a time
        self.spec_max = 0 if getattr(weights, "kq", False) else spec_positions(self.cfg, dtype, self.nblocks,
                                                                               self.nranks, self.k.nthreads)
        if self.k.params_bytes > N_PARAMS * 8:
            raise RuntimeError("Params struct larger than the host buffer")
        if self.nranks > 1 and 8 * self.k.fin_words > 4 * comm.max_floats:
            raise RuntimeError(f"the kernel's final slot ({self.k.fin_words} LL words) exceeds the communicator's "
                               f"{comm.max_floats} floats (multirank.fin_words differs from mk_multirank.cuh)")
        self.max_seq = min(max_seq or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.num_slots = num_slots
        self.tokens = [[] for _ in range(num_slots)]
        self.caches = [None] * num_slots
        self.rope = rope_table(cfg, self.max_seq)
        rc = self.rcfg                    # the shapes this rank computes (all lanes with one rank)
        self.prefill = Prefill(rc, weights, self.k, prefill_chunk, self.rope, self.comm, self.max_seq)
        f32 = cp.float32
        self.buf = self._step_buffers(1, self.k.nch)
        self.buf["part"] = cp.empty(rc.num_hidden_layers * 2 * rc.num_lanes * rc.hidden_size, f32)
        if self.nranks > 1:
            self.buf["yfin"] = cp.zeros(self.k.fin_floats, f32)
        self.ctr = cp.zeros(self.k.nctr, cp.uint64)
        self.sortbuf = cp.empty(self.k.vpow2, cp.uint64)
        self.params = cp.zeros(N_PARAMS, cp.uint64)
        self.ring = _Mapped(self.max_seq + 2)
        self.status = _Mapped(4)
        self.cancel = _Mapped(1)
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.last_kernel_ms = 0.0
        self.last_prefill_ms = 0.0
        self.cancel_raised_at = -1
        if self.comm is not None:
            # every rank built and uploaded before any kernel waits on a peer (those waits are bounded
            # by comm.timeout; a host rendezvous is not)
            rdv = getattr(self.comm, "_rdv", None)
            if rdv is not None:
                rdv.barrier()

    # -- state ---------------------------------------------------------------------------------------
    def cached(self, slot: int) -> int:
        return len(self.tokens[slot]) if 0 <= slot < self.num_slots else 0

    def free(self, slot: int) -> None:
        self.tokens[slot] = []
        self.caches[slot] = None

    def close(self) -> None:
        if getattr(self.comm, "abandoned", False):
            # a kernel may still run (cudaFreeHost would wait for it) or the context faulted: the
            # process's exit frees the mapped buffers
            self.caches = [None] * self.num_slots
            return
        for m in (self.ring, self.status, self.cancel) + ((self.dmask,) if self.dmask else ()):
            m.free()
        self.prefill.close()
        self.caches = [None] * self.num_slots

    def _cache(self, slot: int):
        if self.caches[slot] is None:
            cfg, cp = self.rcfg, self.cp
            shape = (cfg.num_hidden_layers, cfg.kv_heads, self.max_seq, cfg.head_dim)
            self.caches[slot] = (cp.zeros(shape, self.dw.emb.dtype), cp.zeros(shape, self.dw.emb.dtype))
        return self.caches[slot]

    def kv_bytes_per_slot(self) -> int:
        cfg = self.rcfg
        return 2 * cfg.num_hidden_layers * cfg.kv_heads * self.max_seq * cfg.head_dim * self.dw.emb.itemsize

    # -- one request ---------------------------------------------------------------------------------
    def run(self, cmd: RunCommand, on_token=None, *, ignore_eos: bool = False, dbg_logits=None,
            timing_token: int | None = None, spec_fixed: int | None = None) -> RunResult:
        """Backend.run; ignore_eos (benchmarks), dbg_logits (a [max_new, V] float32 device array that
        receives every step's logits; with several ranks only the rows of the rank's LM head share,
        multirank.lm_rows) and timing_token (record per-phase clock marks of that decode step
        into self.last_timing, [5N+2, blocks, 5] ns: mk_layout.cuh tmark) and spec_fixed (with
        cmd.speculative: every verify pass drafts that many tokens, the context's last, whatever they
        are: the cost of a pass of spec_fixed + 1 positions) are for tests and benchmarks."""
        if timing_token is not None and str(self.k.defines.get("CFG_MARKS", 0)) != "1":
            raise ValueError("this monokernel was built without timing marks: create the backend with "
                             "timing_marks=True (kog bench --profile) for a per-phase profile")
        self._timing_token = timing_token
        self._spec_fixed = spec_fixed       # (speculative) every pass drafts this many tokens: its cost
        cp, cfg = self.cp, self.cfg
        check_command(cmd, self.cached(cmd.slot), cfg.vocab_size, self.max_seq, self.num_slots)
        clock = Clock()
        held = self.tokens[cmd.slot][:cmd.keep]
        feed = [int(t) for t in cmd.append]
        if not feed:
            feed, held = held[-1:], held[:-1]
        res = RunResult(prefill_tokens=len(feed))
        kc, vc = self._cache(cmd.slot)
        P = len(held) + len(feed)
        max_new = min(cmd.max_new_tokens, self.max_seq - P + 1)
        with self.stream:
            pre = feed if max_new <= 0 else feed[:-1]
            if pre:
                self.prefill.run(pre, len(held), kc, vc, self.max_seq)
            self.stream.synchronize()
        res.prefill_ms = self.last_prefill_ms = clock.ms()
        held = held + feed
        if max_new <= 0:
            self.tokens[cmd.slot] = held
            res.cached = len(held)
            res.stop_reason = "none" if cmd.max_new_tokens == 0 else "length"
            return res
        eos = () if ignore_eos else tuple(cfg.eos_token_ids)
        stop = tuple(int(s) for s in cmd.stop_ids)
        if cmd.grammar is not None:     # its end of turn stops the decode, as on the cpu backend
            stop = tuple(dict.fromkeys(t for t in (*cmd.grammar.grammar.lltok.eos_tokens, *stop) if t not in eos))
        # speculative: verify passes of the last token and up to spec_k drafts (one lane, one rank); a constrained
        # request decodes a token at a time, as on the cpu backend (the mask of a draft's successor needs the draft)
        spec_k = min(cmd.speculative, self.spec_max - 1) if self.spec_max > 1 and cmd.grammar is None else 0
        toks, reason, t_first = self._generate(kc, vc, feed[-1], P - 1, max_new, cmd.sampling, eos, stop, on_token,
                                               clock, res, dbg_logits, max(0, spec_k), held, cmd.grammar)
        res.token_ids = toks
        res.stop_reason = reason
        held = held + toks[:-1]
        self.tokens[cmd.slot] = held
        res.cached = len(held)
        return res

    hang_s = 20.0
    mask_wait_s = 60.0    # the kernel's longest wait for a token's mask (the host computes one in ~50 us)
    cooperative = None

    def _step_buffers(self, P: int, nch: int) -> dict:
        """The decode step's scratch (mk_layout.cuh Params q .. cand_i), a row for each of P positions: the
        plain kernel's with P = 1, the speculative build's with P = spec_max (its hres one lane's)."""
        cp, rc, f32 = self.cp, self.rcfg, self.cp.float32
        L, D, N, V, H, KV, hd = (rc.num_lanes, rc.hidden_size, rc.num_hidden_layers, rc.vocab_size,
                                 rc.num_attention_heads, rc.kv_heads, rc.head_dim)
        return {
            "q": cp.empty(P * H * hd, f32),
            "attp": cp.empty(P * KV * nch * (H // KV) * (hd + 4), f32),   # ATTP = HD + 4 (mk_layout.cuh)
            "hid": cp.empty(P * rc.intermediate_size, f32),
            "hres": cp.empty(P * (2 * N + 1) * L * D, f32),
            "logits": cp.empty(V, f32),
            "cand_v": cp.empty(P * self.nblocks, f32),
            "cand_i": cp.empty(P * self.nblocks, cp.int32),
        }

    def prepare_speculative(self) -> None:
        """Compile the speculative build now (a server whose requests speculate by default), not at the
        first such request; nothing for models without verify passes (several lanes or ranks)."""
        if self.spec_max > 1:
            self._spec()

    def _spec(self):
        """The speculative build (verify passes of self.spec_max positions, mk_spec.cuh) and its buffers:
        the one-token buffers with a row a position, the pass state and the context's ids."""
        if self.ks is None:
            from .build import build
            dtype, prefetch, extra, progress = self._spec_build
            marks = str(self.k.defines.get("CFG_MARKS", 0)) == "1"
            self.ks = build(self.cfg, dtype, self.nblocks, prefetch, progress=progress, extra=extra, spec=self.spec_max,
                            marks=marks)
            cp, P, V = self.cp, self.spec_max, self.rcfg.vocab_size
            self.sbuf = self._step_buffers(P, self.ks.nch)
            self.sbuf.update({
                "part": self.buf["part"],
                "spec_logits": cp.empty(P * V, cp.float32),
                "spec": cp.zeros(SPEC_WORDS, cp.int32),   # (+ the attention tickets, zero between passes)
                "ctx": cp.zeros(self.max_seq + 16, cp.int32),
            })
        return self.ks, self.sbuf

    _spec_on = _mask_on = False

    @property
    def _kk(self):
        """The build this launch runs: the speculative one, the token mask's or the plain one."""
        return self.ks if self._spec_on else self.km if self._mask_on else self.k

    def _launch(self):
        """cuLaunchCooperativeKernel: the driver refuses the launch unless every block is resident."""
        cp = self.cp
        try:
            fptr = self._kk.mono.kernel.ptr
            launch = cp.cuda.driver.launchCooperativeKernel
        except AttributeError:     # an older CuPy: a plain launch (132 blocks on 132 idle SMs)
            self.cooperative = False
            self._plain_launch()
            return
        if self._params_by_value:   # the Params words themselves (mk_layout.cuh CFG_PCONST)
            self._argv = (ctypes.c_void_p * 1)(self._hparams.ctypes.data)
        else:
            self._argval = ctypes.c_uint64(self.params.data.ptr)
            self._argv = (ctypes.c_void_p * 1)(ctypes.addressof(self._argval))
        if self.comm is not None and self.cooperative is False:
            self._plain_launch()
            return
        try:
            launch(fptr, self.nblocks, 1, 1, self._kk.nthreads, 1, 1, self._kk.smem_bytes, self.stream.ptr,
                   ctypes.addressof(self._argv))
        except Exception as e:  # noqa: BLE001
            if self.comm is None:
                raise
            # several ranks on one GPU (MPS): if the driver refuses a cooperative launch, a plain one
            # (SMs / ranks blocks per rank fit together on an otherwise idle GPU)
            import sys
            print(f"[kog] rank {self.comm.rank}: cooperative launch refused ({e}); plain launch",
                  file=sys.stderr, flush=True)
            self.cooperative = False
            self._plain_launch()
            return
        self.cooperative = True

    @property
    def _params_by_value(self) -> bool:
        return str(self.k.defines.get("CFG_PCONST", 1)) == "1"

    def _plain_launch(self):
        if not self._params_by_value:
            self._kk.mono((self.nblocks,), (self._kk.nthreads,), (self.params,), shared_mem=self._kk.smem_bytes)
            return
        self._argv = (ctypes.c_void_p * 1)(self._hparams.ctypes.data)
        self.cp.cuda.driver.launchKernel(self._kk.mono.kernel.ptr, self.nblocks, 1, 1, self._kk.nthreads, 1, 1,
                                         self._kk.smem_bytes, self.stream.ptr, ctypes.addressof(self._argv), 0)

    def _params(self, kc, vc, first, start_pos, max_new, sp, eos, stop, dbg, spec_k=0, context=None):
        b = self.sbuf if spec_k else self.buf
        ptr = lambda a: 0 if a is None else a.data.ptr
        layout = (MR_MASK_LAYOUT if self.nranks > 1 else MASK_LAYOUT) if self._mask_on else LAYOUT
        p = ParamWords(N_PARAMS, layout)   # by mk_layout.cuh's names
        for name, a in (("w", self.dw.w), ("norms", self.dw.norms), ("fnorm", self.dw.fnorm), ("emb", self.dw.emb),
                        ("kc", kc), ("vc", vc), ("ctr", self.ctr), ("sortbuf", self.sortbuf),
                        ("dbg_logits", dbg), ("rope", self.rope), ("ws", self.dw.ws), ("bias", self.dw.bias),
                        ("wh", getattr(self.dw, "wh", None)), ("kt", getattr(self.dw, "kt", None)),
                        *((n, b[n]) for n in ("q", "attp", "hid", "part", "hres", "logits", "cand_v", "cand_i"))):
            p[name] = ptr(a)
        p["lm"] = self.dw.lm_ptr()
        p["ring"], p["status"], p["cancel"] = self.ring.ptr, self.status.ptr, self.cancel.ptr
        if spec_k:
            st = np.zeros(SPEC_WORDS, np.int32)
            st[SW_K], st[SW_PROBE] = min(spec_k, SPEC_START), SPEC_PROBE   # AdaptiveDraft(k, start=SPEC_START)
            b["spec"].set(st, stream=self.stream)
            b["ctx"][:len(context)].set(np.asarray(context, np.int32), stream=self.stream)
            p["spec"], p["ctx"], p["spec_logits"] = b["spec"].data.ptr, b["ctx"].data.ptr, b["spec_logits"].data.ptr
            p["spec_k"], p["spec_min_ngram"] = spec_k, SPEC_MIN_NGRAM
            p["spec_fixed"] = min(int(self._spec_fixed or 0), self.spec_max - 1)
        self._timing = None
        if getattr(self, "_timing_token", None) is not None:
            self._timing = self.cp.zeros((5 * self.cfg.num_hidden_layers + 2, self.nblocks, 5), self.cp.uint64)
            p["timing"], p["timing_token"] = self._timing.data.ptr, int(self._timing_token)
        if self.nranks > 1:
            from .multirank import TAGS
            p["kd"] = self.comm.dev_ptr
            p["e0"] = [self.comm.next_epoch(tag) for tag in TAGS]
            p["yfin"] = self.buf["yfin"].data.ptr
        p["start_pos"], p["first_token"], p["max_new"], p["max_seq"] = start_pos, first, max_new, self.max_seq
        p["temperature"], p["top_p"], p["top_k"] = float(sp.temperature), float(sp.top_p), int(sp.top_k)
        p["seed"] = int(sp.seed)
        dev_stop, dev_eos = stop[:MAX_STOP], eos[:MAX_EOS]
        p["n_stop"], p["stop_ids"] = len(dev_stop), dev_stop
        p["n_eos"], p["eos_ids"] = len(dev_eos), dev_eos
        if self._mask_on:
            self.dmask.params(p, self.mask_wait_s)
        h = p.words
        self._hparams = h              # passed by value at the launch (CFG_PCONST)
        if not self._params_by_value:
            self.params.set(h, stream=self.stream)

    _watch_t = 0.0

    def _watch(self, stalled_s: float):
        """Several ranks, every ~0.1 s: kccl's check_kernel. A dead peer raises the abort word (the
        kernel's waits give up and it leaves; the host then raises PeerLost from the status words).
        It raises by itself when the kernel will not leave: the CUDA context faulted (under MPS, the
        dead rank's memory goes away under the survivors' kernels) or the kernel ignores the abort
        word / its own failed wait for ABORT_GRACE_S; stalled_s: seconds since the last token."""
        now = time.perf_counter()
        if now - self._watch_t >= 0.1:
            self._watch_t = now
            self.comm.check_kernel("decode", stalled_s)

    def _done(self, ev) -> bool:
        """ev.done; with several ranks a CUDA error there is the communicator's to explain."""
        try:
            return ev.done
        except Exception as exc:  # noqa: BLE001 - CUDARuntimeError of a faulted context
            if self.comm is None:
                raise
            raise self.comm.fault(exc, "decode") from exc

    def _after_kernel(self):
        """Several ranks: raise what a kccl wait reported (PeerLost / KcclTimeout / KcclError), else
        record the epochs the launch used (every rank ran the same tokens: they sample the same ids)."""
        from .multirank import epochs_run
        self.comm.raise_for_status("decode")
        for tag, count in epochs_run(self.cfg, int(self.status.a[0])).items():
            self.comm.advance(tag, count)

    def _poison(self, spec: bool = False):
        b = self.sbuf if spec else self.buf
        for name in ("q", "attp", "hid", "part", "hres", "logits", "cand_v") + (("yfin",) if self.nranks > 1 else ()):
            b[name].fill(np.nan)
        self.ctr.fill(0)
        self.ring.a[:] = -1
        self.status.a[:] = 0
        self.cancel.a[:] = 0

    def _generate(self, kc, vc, first, start_pos, max_new, sp, eos, stop, on_token, clock, res, dbg,
                  spec_k=0, context=None, grammar=None):
        cp = self.cp
        V = self.cfg.vocab_size
        if spec_k:
            self._spec()
        self._spec_on = bool(spec_k)
        self._mask_on = grammar is not None
        with self.stream:
            gm = masked_build(self, grammar) if grammar is not None else None   # (mask.py)
            self._poison(self._spec_on)
            self._params(kc, vc, first, start_pos, max_new, sp, eos, stop, dbg, spec_k, context)
            ev0, ev1 = cp.cuda.Event(), cp.cuda.Event()
            ev0.record(self.stream)
            self._launch()
            ev1.record(self.stream)
        stop_set, eos_set = set(stop), set(eos)
        toks: list[int] = []
        reason = None
        t_first = None
        seen = 0
        ring, status = self.ring.a, self.status.a
        last_progress = time.perf_counter()
        try:
            while True:
                cnt = int(status[0])
                while seen < cnt and reason is None:
                    tok = int(ring[seen])
                    if not 0 <= tok < V:
                        if gm is not None and gm.timed_out():
                            raise RuntimeError(f"monokernel: no token mask for token {seen} within {self.mask_wait_s} s")
                        if gm is not None and tok == -1 and self.comm is not None:
                            # a peer's sampler had no mask (its host cancelled while the kernel waited): every
                            # rank ended at this token without one
                            reason = "cancel"
                            break
                        raise RuntimeError(f"monokernel: token {seen} not written (read {tok})")
                    seen += 1
                    toks.append(tok)
                    if gm is not None:   # token n + 1's mask while the kernel runs its forward
                        gm.advance(tok, tok not in stop_set and tok not in eos_set and len(toks) < max_new)
                    now = clock.ms()
                    if t_first is None:
                        t_first = res.first_token_ms = now
                    res.decode_ms = now - t_first
                    go = on_token(tok) is not False if on_token else True
                    if not go:
                        reason = "cancel"
                    elif tok in stop_set or tok in eos_set:
                        reason = "eos" if tok in eos_set else "stop"
                    elif len(toks) >= max_new:
                        reason = "length"
                    if reason is not None and reason != "length":
                        self.cancel.a[0] = 1          # the kernel stops within one token
                        self.cancel_raised_at = int(status[0])
                    last_progress = time.perf_counter()
                if reason is not None or self._done(ev1):
                    if reason is None:
                        # the kernel ended: drain what it wrote
                        if int(status[0]) > seen:
                            continue
                    break
                stalled = time.perf_counter() - last_progress
                if self.comm is not None:
                    self._watch(stalled)
                if stalled > self.hang_s:
                    hang_report(self, seen)
            if self.comm is not None:
                while not self._done(ev1):   # the host stopped reading: the kernel stops within two tokens
                    self._watch(time.perf_counter() - last_progress)
                    time.sleep(0.001)
            try:
                ev1.synchronize()
            except Exception as exc:  # noqa: BLE001
                if self.comm is None:
                    raise
                raise self.comm.fault(exc, "decode") from exc
            if self.comm is not None:
                self._after_kernel()
        except Exception as exc:
            if self.comm is not None or _cuda_error(exc):   # the process exits after either
                _KEEP.append((ev0, ev1))
            else:   # the host failed (a grammar's error, on_token's): the kernel stops within a token or mask wait
                self.cancel.a[0] = 1
                ev1.synchronize()
            raise
        self.last_kernel_ms = cp.cuda.get_elapsed_time(ev0, ev1)
        if gm is not None:
            gm.finish(res)
        if spec_k:
            st = self.sbuf["spec"].get()
            res.spec_steps, res.spec_drafted, res.spec_accepted = (int(st[SW_STEPS]), int(st[SW_DRAFTED]),
                                                                   int(st[SW_ACCEPTED]))
        self.last_timing = self._timing.get() if self._timing is not None else None
        if reason is None:
            code = int(status[1])
            # code 4 without a host decision: another rank's host cancelled (several ranks stop together)
            if code == 0 or (code == 4 and self.comm is None):
                raise RuntimeError(f"monokernel ended without a stop reason after {seen} tokens (code {code})")
            reason = REASONS[code]
            if reason == "length" and len(toks) != max_new:
                raise RuntimeError(f"monokernel stopped at {len(toks)} of {max_new} tokens")
        return toks, reason, t_first
