"""Host logic of the multi-rank `cuda` backend (N ranks, N divides num_lanes): rank r's monokernel is the
one-rank kernel of the rank's sub-model (lanes [r*L/N, (r+1)*L/N), with their heads, kv heads and ffn
rows) plus the kccl exchanges of the monokernel (mk_multirank.cuh and `#if KOG_NRANKS > 1`, docs/monokernel.md "multi-rank").

Everything here is plain Python (no CuPy), so tests/test_cuda_multirank.py checks it on a CPU: the lane
ranges, the kernel's compile-time defines, the epoch schedule the kernel follows (mirrors mr_posted /
mr_read_later / mr_index of mk_multirank.cuh), the LL ring depth and the communicator's slot sizes.

Run on one H200 under MPS (N = 2, 4, 8 ranks give the one-rank and numpy ids; a killed rank makes the others
raise PeerLost) and on two H200s (N = 2: the one-rank ids, 791 tokens/s against 714 for one GPU; BENCHMARKS.md).
"""
from __future__ import annotations

TAGS = ("attn", "mlp", "final")      # channels 1, 2, 3 of the CudaCommunicator (kernel: 1 + kind, CH_FIN)


class RankView:
    """The rank's sub-model as the cuda backend's host code sees a config: lane-dependent sizes are the
    rank's, everything else (head_dim, hidden size, vocabulary, flags) is the model's. `full` is the
    model's config, `lanes` the rank's global lane range."""

    def __init__(self, cfg, rank: int, nranks: int):
        self.full = cfg
        self.rank, self.nranks = rank, nranks
        self.lanes = cfg.lanes_of_rank(rank, nranks)        # refuses N not dividing num_lanes
        self.num_lanes = len(self.lanes)
        self.num_attention_heads = cfg.num_attention_heads // nranks
        self.kv_heads = cfg.kv_heads // nranks
        self.num_key_value_heads = self.kv_heads
        self.intermediate_size = cfg.intermediate_size // nranks
        self.head_dim = cfg.head_dim
        self.heads_per_lane = cfg.heads_per_lane
        self.kv_heads_per_lane = cfg.kv_heads_per_lane
        self.ffn_per_lane = cfg.ffn_per_lane
        self.lm_range = lm_rows(cfg, rank, nranks)         # the LM head rows this rank computes (and holds)
        self.lm_rows = len(self.lm_range)

    def __getattr__(self, name):          # everything not lane-dependent: the model's
        return getattr(self.full, name)


def check(cfg, nranks: int) -> None:
    """The multi-rank kernel's extra rules, refused with a one-line reason."""
    if nranks < 1 or nranks > 8:
        raise ValueError(f"cuda backend: {nranks} ranks (1..8 with kccl cuda_ipc)")
    cfg.lanes_of_rank(0, nranks)
    if nranks > 1 and depth(cfg) > 16:
        raise ValueError(f"cuda backend: broadcast_delay={cfg.broadcast_delay} needs a kccl ring of "
                         f"{depth(cfg)} slots (16 at most)")


def defines(cfg, nranks: int) -> dict:
    """What the multi-rank build changes in build.defines(): the rank's lanes / heads / kv heads / ffn
    rows, the model's lane count and the rank count. Empty for one rank (the measured build)."""
    if nranks <= 1:
        return {}
    return {"CFG_L": cfg.num_lanes // nranks, "CFG_H": cfg.num_attention_heads // nranks,
            "CFG_KV": cfg.kv_heads // nranks, "CFG_F": cfg.intermediate_size // nranks,
            "CFG_LG": cfg.num_lanes, "KOG_NRANKS": nranks, "CFG_MR_DEPTH": depth(cfg)}


def blocks_per_rank(cfg, sms: int, ranks_on_device: int) -> int:
    """Blocks of one rank's kernel when `ranks_on_device` ranks share a GPU (under MPS every persistent
    kernel must be resident at once): the SMs split evenly, rounded down to a multiple of the rank's
    lanes when that keeps >= 85% of the share (build.default_blocks' rule)."""
    share = max(1, sms // max(1, ranks_on_device))
    lr = cfg.num_lanes                  # a RankView: the rank's lanes
    nb = share - share % lr
    return nb if nb >= 0.85 * share and nb > 0 else share


# ---- the epoch schedule (mk_multirank.cuh mr_posted / mr_read_later / mr_index) ----------------------
def posted(cfg, i: int) -> bool:
    """Layer i's partials are posted (both kinds): read by the early all-reduce and/or delta layers later."""
    d, N = cfg.broadcast_delay, cfg.num_hidden_layers
    return bool(cfg.use_comm and ((i < d and cfg.use_early_comm) or (i + d < N and (i >= d or cfg.early_layers_to_future))))


def read_later(cfg, i: int) -> bool:
    d, N = cfg.broadcast_delay, cfg.num_hidden_layers
    return bool(cfg.use_comm and i + d < N and (i >= d or cfg.early_layers_to_future))


def read_now(cfg, i: int) -> bool:
    """Layer i is an early all-reduce (its consumer phase sums every lane's partial at once)."""
    return bool(cfg.use_comm and cfg.use_early_comm and i < cfg.broadcast_delay and cfg.num_lanes > 1)


def index(cfg, i: int) -> int:
    return sum(1 for j in range(i) if posted(cfg, j))


def npost(cfg) -> int:
    """Epochs per token on each of the tags attn and mlp."""
    return index(cfg, cfg.num_hidden_layers)


def schedule(cfg, e0: int = 1, tokens: int = 1):
    """[(token, layer, epoch, reads, ack_at)] of one tag for `tokens` tokens: reads lists the layers whose
    phases read the epoch (the layer itself for an early all-reduce, layer + delta for the delayed term);
    ack_at is the last of them (the last read of the epoch's LL words)."""
    out = []
    d = cfg.broadcast_delay
    for n in range(tokens):
        for i in range(cfg.num_hidden_layers):
            if not posted(cfg, i):
                continue
            reads = ([i] if read_now(cfg, i) else []) + ([i + d] if read_later(cfg, i) else [])
            out.append((n, i, e0 + n * npost(cfg) + index(cfg, i), reads, reads[-1] if reads else None))
    return out


def all_early(cfg) -> bool:
    """Every layer is an early all-reduce (delay >= layers): every lane holds the same residual stream, which
    is tensor parallelism (kog_dist.tp_lanes: a one-lane model seen as N such lanes)."""
    return bool(cfg.use_comm and cfg.use_early_comm and cfg.broadcast_delay >= cfg.num_hidden_layers)


def depth(cfg) -> int:
    """Ring depth of every tag. All layers early: a rank posts (kind, layer j) only once every rank has read
    (kind, layer j - 1) (its QKV or W13 norm summed the other kind's layer j - 1 from every rank, which every
    rank posted after all of its blocks read this kind's layer j - 1), so 2 would do; 6 keeps the final
    exchange's ring of 6 tokens (mr_final) and margin. The layers' partials travel as LL words with no acks (mk_multirank.cuh, mr_put): a
    rank that posts epoch e of a tag has read, in the block that posts, the rows of layer e - delta from
    every rank, so the blocks owning those rows are in that layer and every lane of every rank is done
    through the layer before it, reads of layer e - 2*delta - 1 included. A ring of 2*delta + 2 leaves
    one layer of margin (docs/monokernel.md "multi-rank"; the CPU tests check it on a model)."""
    return 6 if all_early(cfg) else 2 * cfg.broadcast_delay + 2


def final_floats(cfg, nranks: int) -> int:
    """The final exchange's payload: the rank's normed rows [L/N][D] and its cancel word (4 floats)."""
    return (cfg.num_lanes // nranks) * cfg.hidden_size + 4


def lm_units(cfg, nranks: int) -> int:
    """LM head units (2 rows each) of a rank: the vocabulary's units split evenly, the last rank fewer
    (mk_layout.cuh U_LM)."""
    return -(-((cfg.vocab_size + 1) // 2) // nranks)


def lm_rows(cfg, rank: int, nranks: int) -> range:
    """The LM head rows (vocabulary ids) rank computes (mk_lm.cuh phase_lm)."""
    u = lm_units(cfg, nranks)
    return range(min(cfg.vocab_size, 2 * u * rank), min(cfg.vocab_size, 2 * u * (rank + 1)))


def fin_words(cfg, nranks: int) -> int:
    """LL words of a rank's final slot (mk_multirank.cuh FIN_WORDS): the normed rows [L/N][D], the cancel
    word, the rank's best logit and its index, the logits of its LM rows (sampling past the candidates),
    then its sampling candidates (5 words and 4096 // N keys of 2 words)."""
    return (cfg.num_lanes // nranks) * cfg.hidden_size + 3 + 2 * lm_units(cfg, nranks) + 5 + 2 * (4096 // nranks)


def ll_floats(cfg, nranks: int) -> int:
    """The biggest LL post, 8 bytes (2 floats of slot) a word: a layer's partials [L/N][D], or the final
    slot (fin_words)."""
    return 2 * max((cfg.num_lanes // nranks) * cfg.hidden_size, fin_words(cfg, nranks))


def max_floats(cfg, nranks: int) -> int:
    """Slot capacity for CudaCommunicator.create: a layer's LL words and the final payload (the prefill
    exchanges through a kccl.cuda_shared.SharedBuffer, not the window)."""
    return max(ll_floats(cfg, nranks), final_floats(cfg, nranks))


def comm_kwargs(cfg, nranks: int, timeout: float = 30.0) -> dict:
    return dict(max_floats=max_floats(cfg, nranks), depth=depth(cfg), tags=TAGS, timeout=timeout)


def window_bytes(cfg, nranks: int) -> int:
    """Bytes of one rank's IPC window (kccl.cuda_ipc.CudaLayout with comm_kwargs)."""
    from kccl.cuda_layout import COLL_DEPTH, CudaLayout
    kw = comm_kwargs(cfg, nranks)
    lay = CudaLayout(nranks, 4 * kw["max_floats"], (("_coll", COLL_DEPTH),) + tuple((t, kw["depth"]) for t in TAGS))
    return lay.size


def epochs_run(cfg, tokens: int) -> dict:
    """What a launch that decoded `tokens` tokens posted on each tag (CudaCommunicator.advance)."""
    return {"attn": tokens * npost(cfg), "mlp": tokens * npost(cfg), "final": tokens}

