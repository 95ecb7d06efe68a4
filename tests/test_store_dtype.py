"""--dtype on the cpu backend: the layer matrices take exactly the values their storage holds (gguf.quants'
round to nearest and dequantization for Q8_0 / Q4_0 / Q4_1, round to nearest even for bf16), as the GPU
stores them, so every backend computes one function."""
import json
import subprocess
import sys

import gguf
import numpy as np
import pytest

from kog_dist.checkpoint import LANE_TENSORS, Model
from kog_dist.engine import ReferenceEngine
from kog_dist.tiny import write_tiny_checkpoint


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("store"))
    write_tiny_checkpoint(d, num_lanes=2, broadcast_delay=1, num_hidden_layers=2, hidden_size=64,
                          num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=300, seed=9)
    return d


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1"])
def test_layer_matrices_hold_the_quantized_values(model_dir, name):
    plain, stored = Model(model_dir, progress=False), Model(model_dir, progress=False, store=name)
    qt = getattr(gguf.GGMLQuantizationType, name)
    for key, a in plain.weights.items():
        b = stored.weights[key]
        if any(f".{t}." in key for t in LANE_TENSORS):
            want = gguf.quants.dequantize(gguf.quants.quantize(a.reshape(-1, a.shape[-1]), qt), qt).reshape(a.shape)
            assert np.array_equal(b, want), key
            assert not np.array_equal(b, a), key
        else:                                        # norms, LM head: as they were
            assert np.array_equal(b, a), key


def test_greedy_ids_follow_the_stored_values(model_dir):
    """The cpu backend under --dtype q4_0 gives the reference engine's ids on the quantized weights."""
    m = Model(model_dir, progress=False, store="Q4_0")
    eng = ReferenceEngine(m.cfg, m.weights, m.embed)
    logits, want = eng.prefill([1, 5, 9]), []
    for _ in range(10):
        want.append(int(np.argmax(logits)))
        logits = eng.step(want[-1])
    r = subprocess.run([sys.executable, "-m", "kog_cli", "generate", "--model", model_dir, "--prompt-ids", "1,5,9",
                        "-n", "10", "--dtype", "q4_0", "--backend", "cpu", "--json"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["token_ids"] == want
    bad = subprocess.run([sys.executable, "-m", "kog_cli", "generate", "--model", model_dir, "--prompt-ids", "1",
                          "--dtype", "q3_k"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "not a storage type" in bad.stderr and "Traceback" not in bad.stderr
