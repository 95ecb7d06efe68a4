"""Prompt-lookup speculative decoding on the numpy engine: the tokens are the plain decode's tokens
(greedy and sampled under a seed), and the KV cache after a rejection holds what plain steps leave."""
import numpy as np
import pytest

from kog_dist.checkpoint import Model
from kog_dist.engine import ReferenceEngine
from kog_dist.sampling import SamplingParams, sample
from kog_dist.speculative import AdaptiveDraft, SpecParams, lookup, step, verify
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


def test_spec_params_ranges():
    SpecParams(k=8).validate()
    for bad in (dict(k=9), dict(k=-1), dict(k=True), dict(method="medusa"), dict(ngram=0)):
        with pytest.raises(ValueError):
            SpecParams(**bad).validate()
