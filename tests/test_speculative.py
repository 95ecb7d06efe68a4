"""Prompt-lookup speculative decoding on the numpy engine and the cpu backend (whose verify passes are
workers.cpu_verify's): the tokens are the plain decode's tokens (greedy and sampled under a seed), and
the KV cache after a rejection holds what plain steps leave."""
import dataclasses

import numpy as np
import pytest

from kog_dist.checkpoint import Model
from kog_dist.engine import ReferenceEngine
from kog_dist.sampling import SamplingParams, sample
from kog_dist.speculative import AdaptiveDraft, NgramIndex, SpecParams, lookup, step, verify
from kog_dist.tiny import write_tiny_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("spec"))
    write_tiny_checkpoint(d, num_lanes=1, broadcast_delay=1, num_hidden_layers=2, hidden_size=64,
                          num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=40,
                          seed=5)
    return Model(d, progress=False)


def engine(m):
    return ReferenceEngine(m.cfg, m.weights, m.embed)


def plain(m, prompt, n, params):
    e = engine(m)
    logits, held, out = e.prefill(prompt), list(prompt), []
    for _ in range(n):
        t = sample(logits, params, counter=len(held))
        out.append(t)
        logits = e.step(t)
        held.append(t)
    return out, e


def speculative(m, prompt, n, params, k):
    e = engine(m)
    logits = e.prefill(prompt)
    out = [sample(logits, params, counter=len(prompt))]
    drafts = AdaptiveDraft(k)
    steps = 0
    while len(out) < n:
        toks, drafted, acc = step(e, out[-1], list(prompt) + out, params, drafts.size())
        drafts.update(drafted, acc)
        steps += 1
        out += toks
    return out[:n], steps


def test_lookup_takes_the_longest_latest_match():
    assert lookup([1, 2, 3, 4, 5, 1, 2, 3], 3) == [4, 5, 1]
    assert lookup([9, 3, 7, 1, 3, 8, 1, 3], 2) == [8, 1]        # "1 3" after the 2-gram, not "3" alone
    assert lookup([5, 6, 7], 2) == [] and lookup([5], 4) == [] and lookup([1, 2, 1], 0) == []
    ctx = [1, 2, 3, 9, 5, 2, 3, 7, 8, 2, 3]                    # "2 3" matches, no 3-gram does
    assert lookup(ctx, 2) == [7, 8] and lookup(ctx, 2, min_ngram=2) == [7, 8]
    assert lookup(ctx, 2, min_ngram=3) == [] and lookup(ctx + [7], 2, min_ngram=3) == [8, 2]


@pytest.mark.parametrize("min_ngram,vocab", [(1, 3), (2, 4), (3, 2), (1, 50)])
def test_ngram_index_answers_as_the_scan(min_ngram, vocab):
    """The index the cpu backend keeps (one push a token) drafts what lookup's scan of the whole context
    drafts, at every length, whatever was pushed at once (a prompt) or one by one (drafts accepted)."""
    rng = np.random.default_rng(min_ngram * 100 + vocab)
    ctx = [int(t) for t in rng.integers(0, vocab, 300)]
    index = NgramIndex(4, min_ngram, ctx[:40])
    for T in range(40, len(ctx) + 1):
        index.sync(ctx[:T])
        for k in (1, 3, 8):
            assert index.lookup(k) == lookup(ctx[:T], k, 4, min_ngram), (T, k)
    assert NgramIndex(4, 1, [5]).lookup(3) == [] and NgramIndex(4, 1, [1, 2, 1]).lookup(0) == []
    assert NgramIndex(4, 1, [1, 2, 3, 4, 5, 1, 2, 3]).lookup(3) == [4, 5, 1]


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.9, top_p=0.95, seed=11),
                                    SamplingParams(temperature=1.3, top_k=8, seed=3)])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_same_tokens_as_plain_decode(model, params, k):
    prompt = [3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 3, 4, 5]        # built to accept (the model may not follow it)
    want, _ = plain(model, prompt, 40, params)
    got, steps = speculative(model, prompt, 40, params, k)
    assert got == want


def test_accepting_drafts_saves_passes(model):
    """A model that repeats its context: drafts accepted, fewer passes than tokens."""
    greedy = SamplingParams()
    prompt = [1, 2]
    first, _ = plain(model, prompt, 30, greedy)
    loop = prompt + first                     # the model's own greedy text: a perfect draft source
    want, _ = plain(model, loop, 30, greedy)
    got, steps = speculative(model, loop, 30, greedy, 8)
    assert got == want
    assert steps < 30


def test_cache_after_a_rejection_equals_plain_steps(model):
    greedy = SamplingParams()
    prompt = [2, 9, 4, 2, 9]
    want, e_plain = plain(model, prompt, 6, greedy)
    e = engine(model)
    logits = e.prefill(prompt)
    t0 = sample(logits, greedy, counter=len(prompt))
    bad = (want[1] + 1) % model.cfg.vocab_size            # a draft that must be rejected at once
    rows = e.forward(np.asarray([t0, bad, 7]), all_logits=True)
    toks, acc = verify(rows, [bad, 7], greedy, len(prompt) + 1)
    assert acc == 0 and toks == [want[1]]
    e.truncate(len(prompt) + 1)
    n = e.pos
    for i in range(model.cfg.num_hidden_layers):      # positions held: exactly the plain path's values
        np.testing.assert_allclose(e.caches[i].k[:, :, :n], e_plain.caches[i].k[:, :, :n], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(e.caches[i].v[:, :, :n], e_plain.caches[i].v[:, :, :n], rtol=1e-5, atol=1e-6)


def test_adaptive_draft_backs_off_and_recovers():
    d = AdaptiveDraft(8)
    sizes = []
    for _ in range(3):                       # rejected at once: 8, 4, 2, then no drafts
        sizes.append(d.size())
        d.update(sizes[-1], 0)
    assert sizes == [8, 4, 2] and d.k == 0
    gaps = []
    for _ in range(4):                       # failed probes: 8, 16, 32, 32 steps apart
        n = 1
        while d.size() == 0:
            n += 1
        gaps.append(n)
        d.update(1, 0)
    assert gaps == [8, 16, 32, 32], gaps
    while d.size() == 0:
        pass
    d.update(1, 1)                           # a probe accepted: drafting again, doubling
    assert d.size() == 2 and d.probe_every == 8
    d.update(2, 2)
    d.update(4, 4)
    assert d.size() == 8
    d.update(8, 3)                           # partial: one more than was accepted
    assert d.size() == 4
    d.update(0, 0)                           # no lookup match: nothing learnt
    assert d.size() == 4
    d = AdaptiveDraft(8, start=4)            # a backend whose verify positions are dear starts lower
    assert d.size() == 4
    d.update(4, 4)
    assert d.size() == 8


def test_spec_params_ranges():
    SpecParams(k=8).validate()
    for bad in (dict(k=9), dict(k=-1), dict(k=True), dict(method="medusa"), dict(ngram=0)):
        with pytest.raises(ValueError):
            SpecParams(**bad).validate()


# ---- the cpu backend: speculative runs give the plain runs' ids, stop rules included ---------------
from kog_dist.backend import RunCommand  # noqa: E402
from kog_dist.protocol import ProtocolError, parse_request  # noqa: E402
from workers.cpu_backend import CpuBackend  # noqa: E402
from workers.cpu_verify import supports as fast_verify_supports  # noqa: E402


def backend(m, cfg=None):
    b = CpuBackend(cfg or m.cfg, m.weights, m.embed, num_slots=2)
    assert fast_verify_supports(b.decoder)         # these tests run the fast verify pass
    return b


def assert_same_cache(b, slot_a, slot_b, n):
    """Bitwise: the fast verify pass writes the one-token step's keys and values."""
    for ca, cb in zip(b.slots[slot_a].caches, b.slots[slot_b].caches):
        assert np.array_equal(ca.k[:, :, :n], cb.k[:, :, :n]) and np.array_equal(ca.v[:, :, :n], cb.v[:, :, :n])


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, seed=5)])
def test_backend_ids_equal_with_and_without_speculation(model, params):
    b = backend(model)
    prompt = [3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 3, 4]
    plain_run = b.run(RunCommand(slot=0, append=prompt, max_new_tokens=48, sampling=params))
    spec_run = b.run(RunCommand(slot=1, append=prompt, max_new_tokens=48, sampling=params, speculative=8))
    assert spec_run.token_ids == plain_run.token_ids
    assert spec_run.stop_reason == plain_run.stop_reason and spec_run.cached == plain_run.cached
    assert spec_run.spec_steps > 0 and spec_run.spec_accepted <= spec_run.spec_drafted
    assert_same_cache(b, 0, 1, plain_run.cached)
    # the slot's cache is the plain one's: a continuation from it gives the same ids again
    more = [9, 1]
    a = b.run(RunCommand(slot=0, keep=plain_run.cached, append=more, max_new_tokens=12, sampling=params))
    c = b.run(RunCommand(slot=1, keep=spec_run.cached, append=more, max_new_tokens=12, sampling=params))
    assert a.token_ids == c.token_ids


def test_backend_stops_inside_an_accepted_draft(model):
    """A stop id, and max_new_tokens, that fall in the middle of a verify pass's accepted drafts."""
    b = backend(model)
    prompt = [1, 2]
    first = b.run(RunCommand(slot=0, append=prompt, max_new_tokens=30)).token_ids
    loop = prompt + first                                    # the model's own text: drafts accepted
    want = b.run(RunCommand(slot=0, append=loop, max_new_tokens=30)).token_ids
    for n in (1, 2, 5, 13):
        got = b.run(RunCommand(slot=1, append=loop, max_new_tokens=n, speculative=8))
        assert got.token_ids == want[:n] and got.stop_reason == "length" and got.cached == len(loop) + n - 1
    stop = want[7]
    got = b.run(RunCommand(slot=1, append=loop, max_new_tokens=30, speculative=8, stop_ids=(stop,)))
    assert got.token_ids == want[:want.index(stop) + 1] and got.stop_reason == "stop"


def test_backend_cache_after_rejected_drafts_is_the_plain_one(model):
    """A prompt whose lookups the model does not follow: drafts are rejected, the rejected positions'
    keys and values are dropped, and what the cache holds is bitwise the plain run's."""
    b = backend(model)
    prompt = [5, 9, 14, 5, 9, 14, 5, 9, 22, 5, 9, 31, 5, 9]
    plain_run = b.run(RunCommand(slot=0, append=prompt, max_new_tokens=24), ignore_eos=True)
    spec_run = b.run(RunCommand(slot=1, append=prompt, max_new_tokens=24, speculative=8), ignore_eos=True)
    assert spec_run.token_ids == plain_run.token_ids and spec_run.cached == plain_run.cached
    assert spec_run.spec_accepted < spec_run.spec_drafted               # something was rejected
    assert b.slots[1].pos == spec_run.cached
    assert_same_cache(b, 0, 1, plain_run.cached)


def test_backend_eos_inside_an_accepted_draft(model):
    """EOS drawn in the middle of a pass's accepted drafts ends the run there: the drafts after it
    are not given out and not kept in the cache."""
    greedy = SamplingParams()
    b = backend(model)
    prompt = [1, 2]
    loop = prompt + b.run(RunCommand(slot=0, append=prompt, max_new_tokens=30), ignore_eos=True).token_ids
    want = b.run(RunCommand(slot=0, append=loop, max_new_tokens=30), ignore_eos=True).token_ids
    eos = want[9]
    cfg = dataclasses.replace(model.cfg, eos_token_id=eos)
    b = backend(model, cfg)
    plain_run = b.run(RunCommand(slot=0, append=loop, max_new_tokens=30, sampling=greedy))
    spec_run = b.run(RunCommand(slot=1, append=loop, max_new_tokens=30, sampling=greedy, speculative=8))
    assert plain_run.token_ids == want[:want.index(eos) + 1] and plain_run.stop_reason == "eos"
    assert spec_run.token_ids == plain_run.token_ids and spec_run.stop_reason == "eos"
    assert spec_run.spec_accepted > 0 and spec_run.cached == plain_run.cached == b.slots[1].pos
    assert_same_cache(b, 0, 1, plain_run.cached)


def test_backend_stop_string_inside_an_accepted_draft(model):
    """A stop string is the caller's on_token returning False (kog_dist.coordinator): when it fires on
    a token in the middle of a pass's accepted drafts, the run ends there with the plain run's ids and
    cache, the drafts after it neither given out nor kept."""
    b = backend(model)
    prompt = [1, 2]
    loop = prompt + b.run(RunCommand(slot=0, append=prompt, max_new_tokens=30), ignore_eos=True).token_ids
    want = b.run(RunCommand(slot=0, append=loop, max_new_tokens=30), ignore_eos=True).token_ids
    for j in (3, 10):
        runs = []
        for slot, k in ((0, 0), (1, 8)):
            seen = []
            r = b.run(RunCommand(slot=slot, append=loop, max_new_tokens=30, speculative=k),
                      on_token=lambda t, seen=seen: seen.append(t) or len(seen) < j, ignore_eos=True)
            assert seen == r.token_ids == want[:j] and r.stop_reason == "cancel"
            runs.append(r)
        assert runs[1].spec_accepted > 0 and runs[0].cached == runs[1].cached == b.slots[1].pos
        assert_same_cache(b, 0, 1, runs[0].cached)


def test_protocol_speculative_field():
    base = {"v": 1, "op": "generate", "prompt_ids": [1, 2]}
    assert parse_request(dict(base, speculative=True))["speculative"] == 8
    assert parse_request(dict(base, speculative={"method": "prompt_lookup", "k": 3}))["speculative"] == 3
    assert parse_request(dict(base, speculative=False))["speculative"] == 0
    assert "speculative" not in parse_request(base)                 # the server's default applies
    for bad in ({"k": 9}, {"method": "eagle"}, {"k": "4"}, 4, "yes"):
        with pytest.raises(ProtocolError):
            parse_request(dict(base, speculative=bad))


def test_sampled_tokens_follow_the_model_distribution(model):
    """Over many seeds, the first three tokens the speculative cpu backend samples after a context that drafts
    (temperature 1, top-p 0.98) follow the model's exact distribution (plain numpy forwards, chi-square at
    p = 1e-4), as the plain sampler's do over other seeds; the same counts against a distribution a little off
    (1.15 times the temperature) are told apart, so the check can fail. Drafts were accepted and rejected."""
    from spec_stats import assert_sampler_follows, draws_after_echo
    # chosen among random prompts (seed 0) for the check's power: after the echo the model says what it said
    # the first time with probability 0.70 (then the lookup drafts), and the two drafts next with 0.50, 0.45
    sp = SamplingParams(temperature=1.0, top_p=0.98)
    ctx, spec, plain, drafted, accepted = draws_after_echo(backend(model), [36, 13, 20, 24, 9, 8, 20, 3], sp, 2500)
    assert_sampler_follows(engine(model), ctx, sp, spec, plain, drafted, accepted)
