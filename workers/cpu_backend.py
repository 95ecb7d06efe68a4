"""The `cpu` backend: the numpy reference engine on this rank's lanes, one KV cache per slot. Prefill
runs on the engine; decode steps run workers.cpu_decode's fast step on the same caches, and
speculative verify passes workers.cpu_verify's (one-lane models; several lanes: the engine's batched
forward). fast=False: the engine's own step and forward, for comparisons."""
from __future__ import annotations

from kog_dist.engine import ReferenceEngine
from kog_dist.sampling import sample
from kog_dist.speculative import MAX_NGRAM, AdaptiveDraft, NgramIndex
from kog_dist.speculative import step as spec_step

from kog_dist.backend import Backend, Clock, RunCommand, RunResult, check_command

from .cpu_decode import FastDecoder, FusedWeights, set_blas_threads
from .cpu_verify import supports as fast_verify_supports
from .cpu_verify import verify_rows

# Drafting where a verify position costs about half a step (cpu_verify on this backend's machine):
# draft on matches of 3 tokens or more, start at 4 tokens and double to k while accepted. Replaying
# kog_cli/agent_tasks.json's greedy outputs offline at that cost, this took the geometric-mean speedup
# from 1.07x to 1.20x (fix 0.88x -> 0.96x, type hints 0.91x -> 1.04x, rename 1.26x -> 1.50x, the
# free story 0.95x -> 1.00x): 1- and 2-token matches are right too rarely to pay for their positions.
CPU_MIN_NGRAM = 3
CPU_FIRST_DRAFT = 4


class CpuBackend(Backend):
    grammar_on_ranks = True       # several ranks: each masks with its own matcher (workers/rank.py)

    def __init__(self, cfg, weights, embed, lanes=None, exchange=None, max_seq=None, num_slots=4,
                 agree=None, prefill_chunk=None, fast: bool = True, tp=None):
        """`agree(flag) -> bool` makes every rank take rank 0's decision to go on (None: one rank).
        tp: this rank's part of a tensor-parallel job (workers.cpu_tp.TensorParallel): cfg, weights and
        the logits are the shard's; partials are summed over the ranks, tokens sampled across the
        vocabulary shards; speculative requests decode plainly (the same tokens)."""
        self.cfg = cfg
        self.tp = tp
        self.max_seq = min(max_seq or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.num_slots = num_slots
        # fused q/k/v and gate/up matrices; the engines' weights become views of them (one copy)
        self.decoder = FastDecoder(cfg, FusedWeights(cfg, weights), embed) if fast else None
        if tp is not None and self.decoder is not None:
            self.decoder.reduce = tp.reduce
        self._new = lambda: ReferenceEngine(cfg, weights, embed, lanes, exchange, self.max_seq, prefill_chunk,
                                            tp=tp is not None)
        self.sample = tp.sample if tp is not None else sample
        self.slots = [None] * num_slots
        self.tokens = [[] for _ in range(num_slots)]   # the ids each slot's cache holds
        self.agree = agree or (lambda flag: flag)

    def _prefill(self, eng, feed):
        """On the BLAS thread count the decode steps find faster now: two threads that collapse when
        another process holds a core do the same to the prefill's GEMMs."""
        d = self.decoder
        n = d.preferred_threads() if d else None
        if not n or n == d.base_threads:
            return eng.prefill(feed)
        set_blas_threads(n)
        try:
            return eng.prefill(feed)
        finally:
            set_blas_threads(d.base_threads)

    def _verify(self):
        """The verify pass for speculative steps: the fast one where the decoder's model has it. A
        pass with no draft (no match in the context) is the plain step itself, bitwise the same
        logits, and its timing goes to the decoder's thread choice like every plain step's."""
        d = self.decoder
        if not fast_verify_supports(d):
            return None
        return lambda eng, ids: d.step(eng, int(ids[0]))[None] if len(ids) == 1 else verify_rows(d, eng, ids)

    def cached(self, slot: int) -> int:
        return len(self.tokens[slot]) if 0 <= slot < self.num_slots else 0

    def free(self, slot: int) -> None:
        self.slots[slot] = None
        self.tokens[slot] = []

    def run(self, cmd: RunCommand, on_token=None, ignore_eos: bool = False) -> RunResult:
        """ignore_eos: decode max_new_tokens whatever comes (benchmarks)."""
        check_command(cmd, self.cached(cmd.slot), self.cfg.vocab_size, self.max_seq, self.num_slots)
        clock = Clock()
        eng = self.slots[cmd.slot] or self._new()
        self.slots[cmd.slot] = eng
        held = self.tokens[cmd.slot][:cmd.keep]
        feed = list(cmd.append)
        if not feed:  # nothing new: re-run the last kept token to get its logits
            feed, held = held[-1:], held[:-1]
        eng.truncate(len(held))
        res = RunResult(prefill_tokens=len(feed))
        logits = self._prefill(eng, feed)
        held += [int(t) for t in feed]
        res.prefill_ms = clock.ms()
        stop = (set() if ignore_eos else set(self.cfg.eos_token_ids)) | set(cmd.stop_ids)
        speculative = cmd.speculative if self.tp is None else 0
        g = cmd.grammar             # structured outputs: mask, draw, advance; without speculation (one token a step)
        if g is not None:
            stop |= set(g.grammar.lltok.eos_tokens)
        v0 = self.tp.v0 if self.tp is not None else 0       # tensor parallel: logits of vocabulary rows v0..
        draw = self.sample if g is None else (lambda lg, sp, counter: _draw_masked(g, lg, sp, counter,
                                                                                   self.sample, v0))
        verify = self._verify() if speculative > 0 and g is None else None
        if speculative <= 0 or g is not None:
            drafts, min_ngram = None, 1
        elif verify:
            drafts, min_ngram = AdaptiveDraft(speculative, start=CPU_FIRST_DRAFT), CPU_MIN_NGRAM
        else:
            drafts, min_ngram = AdaptiveDraft(speculative), 1
        index = NgramIndex(MAX_NGRAM, min_ngram, held) if drafts else None
        t_first = None
        ahead = [] if cmd.max_new_tokens == 0 else [draw(logits, cmd.sampling, counter=len(held))]
        while ahead:
            # ahead: tokens drawn but not yet given out; all but the last of a verify pass are accepted
            # drafts, whose keys and values the cache already holds
            tok = ahead.pop(0)
            res.token_ids.append(tok)
            now = clock.ms()
            if t_first is None:
                t_first = res.first_token_ms = now
            res.decode_ms = now - t_first
            go = on_token(tok) is not False if on_token else True
            if not self.agree(go):
                res.stop_reason = "cancel"
                break
            if tok in stop:
                res.stop_reason = "eos" if tok in self.cfg.eos_token_ids else "stop"
                break
            if len(res.token_ids) == cmd.max_new_tokens or len(held) + 1 > self.max_seq:
                res.stop_reason = "length"
                break
            if ahead:
                held.append(tok)
                continue
            k = min(drafts.size(), cmd.max_new_tokens - len(res.token_ids) - 1,
                    self.max_seq - len(held) - 1) if drafts else 0
            if k > 0:   # one pass over tok and up to k drafts copied from the context
                index.sync(held)
                index.push(tok)
                toks, drafted, accepted = spec_step(eng, tok, None, cmd.sampling, k, forward=verify,
                                                    draft=index.lookup(k))
                drafts.update(drafted, accepted)
                res.spec_steps += drafted > 0          # verify passes: those that checked a draft
                res.spec_drafted += drafted
                res.spec_accepted += accepted
                held.append(tok)
                ahead = toks
                continue
            logits = self.decoder.step(eng, tok) if self.decoder else eng.step(tok)
            held.append(tok)
            ahead = [draw(logits, cmd.sampling, counter=len(held))]
        if not res.token_ids and cmd.max_new_tokens == 0:
            res.stop_reason = "none"
        if g is not None:
            res.grammar_ms = g.mask_s * 1e3
        eng.truncate(len(held))        # drafts accepted past a stop are not context
        self.tokens[cmd.slot] = held
        res.cached = len(held)
        return res


def _draw_masked(g, logits, params, counter: int, draw=sample, v0: int = 0) -> int:
    """One draw under the grammar: the tokens it forbids are -inf before sampling (`draw`: this backend's
    sampler; logits of vocabulary rows v0.. on a tensor-parallel shard), and it takes the token."""
    tok = draw(g.mask(logits, v0), params, counter)
    if not g.accept(tok):    # the mask allowed it, so only a broken grammar gets here
        raise ValueError(f"the grammar refused token {tok} that its mask allowed")
    return tok
