"""bench/spec_replay.py replays the speculative loop offline to choose the drafting policy; its choices are
only as good as the replay is faithful. The cpu backend runs the same loop for real (AdaptiveDraft's sizes,
lookup's drafts, the max_tokens cap, a pass of one without a match): the replay of the backend's own greedy
output must count the same drafted and accepted tokens and the same passes."""
import importlib.util
import os

import pytest

from kog_dist.backend import RunCommand
from kog_dist.tiny import write_tiny_checkpoint
from workers.cpu_backend import CPU_FIRST_DRAFT, CPU_MIN_NGRAM
from workers.factory import make_backend

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_replay():
    spec = importlib.util.spec_from_file_location("spec_replay", os.path.join(ROOT, "bench", "spec_replay.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("replay"))
    write_tiny_checkpoint(d, num_lanes=1, broadcast_delay=1, num_hidden_layers=2, hidden_size=64,
                          num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=40,
                          seed=11)
    b, _ = make_backend("cpu", d, num_slots=1)
    yield b
    b.close()


@pytest.mark.parametrize("prompt,max_new", [
    ([3, 7, 1, 9, 4, 3, 7, 1, 9, 4, 3, 7, 1], 40),             # a repeating prompt: drafts accepted
    ([5, 2, 8, 11, 30, 2, 8, 17, 6, 21, 2, 8], 33),            # "2 8" recurs with different continuations
    (list(range(1, 30)), 24),
])
def test_replay_counts_what_the_cpu_backend_counts(backend, prompt, max_new):
    assert backend._verify() is not None          # the loop under test: the fast verify pass's policy
    replay = load_replay().replay
    backend.free(0)
    res = backend.run(RunCommand(slot=0, append=prompt, max_new_tokens=max_new, speculative=8), ignore_eos=True)
    backend.free(0)
    plain = backend.run(RunCommand(slot=0, append=prompt, max_new_tokens=max_new), ignore_eos=True)
    assert res.token_ids == plain.token_ids and len(res.token_ids) == max_new
    speedup, steps, accepted, drafted = replay(list(prompt), res.token_ids, [1.0] * 9, CPU_MIN_NGRAM,
                                               CPU_FIRST_DRAFT, max_new)
    assert (steps, drafted, accepted) == (res.spec_steps, res.spec_drafted, res.spec_accepted)
    # with passes that cost one token whatever their width, the replay's speedup is tokens per pass
    passes = (max_new - 1) - accepted
    assert speedup == pytest.approx((max_new - 1) / passes)


def test_replay_drafts_on_a_repeating_prompt(backend):
    """The first case above is not vacuous: the backend drafted and accepted there."""
    prompt = [3, 7, 1, 9, 4, 3, 7, 1, 9, 4, 3, 7, 1]
    backend.free(0)
    res = backend.run(RunCommand(slot=0, append=prompt, max_new_tokens=40, speculative=8), ignore_eos=True)
    assert res.spec_drafted > 0 and res.spec_steps > 0
