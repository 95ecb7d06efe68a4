"""`kog generate` and `kog checkpoint` as a user runs them: real processes, real files, bad input."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import safetensors.numpy

from kog_dist.checkpoint import CheckpointReader
from kog_dist.tiny import write_tiny_checkpoint

from reference64 import Ref64


def kog(*args, timeout=120, env=None):
    return subprocess.run([sys.executable, "-m", "kog_cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("m"))
    r = kog("checkpoint", "tiny", d, "--layers", "3", "--hidden", "64", "--lanes", "4", "--heads", "8",
            "--kv-heads", "4", "--ffn", "128", "--vocab", "300", "--delay", "2", "--window", "6",
            "--window-layers", "1", "--seed", "3")
    assert r.returncode == 0, r.stderr
    return d


def test_generate_json_matches_reference(model):
    r = kog("generate", "--model", model, "--prompt-ids", "1,5,9,33", "--temperature", "0", "-n", "12", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["token_ids"] == Ref64(model).greedy([1, 5, 9, 33], 12)
    assert set(out["stats"]) >= {"prefill_ms", "decode_tokens_per_s"}
    assert isinstance(out["text"], str)


def test_generate_default_model_answers_with_nothing_given():
    """The README's first command: the built-in SmolLM2 (fetched into the cache on first use) answers
    through its chat template, greedy, and stops at its end of turn."""
    r = kog("generate", "--prompt", "What is the capital of France?", "-n", "24", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert "Paris" in out["text"], out["text"]
    assert out["stats"]["stop_reason"] in ("eos", "stop")
    raw = json.loads(kog("generate", "--prompt", "What is the capital of France?", "-n", "4", "--raw",
                         "--json").stdout)
    assert raw["prompt_tokens"] < out["prompt_tokens"]        # --raw: no template around the text


def test_tiny_random_by_name(tmp_path):
    env = dict(os.environ, KOG_CACHE=str(tmp_path))
    r = kog("generate", "--model", "tiny-random", "--prompt", "Hello", "-n", "5", "--json", env=env)
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["token_ids"]) == 5


def test_one_lane_model_refuses_a_rank_count_its_heads_do_not_split_into():
    """SmolLM2 has 9 heads: tensor parallelism takes 1, 3 or 9 ranks (tests/test_tp.py runs 3)."""
    one_line_error(kog("generate", "--np", "2", "--backend", "cpu", "--prompt", "Hi"),
                   "2 ranks do not divide num_attention_heads=9; rank counts this model splits into: 1, 3")


def test_sampled_generate_is_reproducible(model):
    args = ("generate", "--model", model, "--prompt-ids", "1,2,3", "--temperature", "0.9", "--top-p", "0.9",
            "--top-k", "40", "--seed", "77", "-n", "16", "--json")
    a, b = kog(*args), kog(*args)
    assert json.loads(a.stdout)["token_ids"] == json.loads(b.stdout)["token_ids"]


def test_stop_ids_end_generation(model):
    full = json.loads(kog("generate", "--model", model, "--prompt-ids", "1,5", "-n", "10", "--json").stdout)
    stop = full["token_ids"][3]
    first = full["token_ids"].index(stop)
    out = json.loads(kog("generate", "--model", model, "--prompt-ids", "1,5", "-n", "10", "--json",
                         "--stop-ids", str(stop)).stdout)
    assert out["token_ids"] == full["token_ids"][:first + 1]
    assert out["stats"]["stop_reason"] == "stop"


def test_sharded_fp16_and_bf16_load_and_agree_with_reference(tmp_path):
    for dtype in ("F16", "BF16"):
        d = str(tmp_path / dtype)
        write_tiny_checkpoint(d, dtype=dtype, shards=4, hidden_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                              vocab_size=280, num_lanes=2)
        assert os.path.isfile(os.path.join(d, "model.safetensors.index.json"))
        out = json.loads(kog("generate", "--model", d, "--prompt-ids", "4,8,15", "-n", "8", "--json").stdout)
        assert out["token_ids"] == Ref64(d).greedy([4, 8, 15], 8)


def test_files_written_by_the_safetensors_package_load(tmp_path, model):
    """Interoperability: a checkpoint saved by the safetensors package itself reads back identically."""
    r = CheckpointReader(model)
    tensors = {n: r.tensor(n) for n in r.where}
    d = tmp_path / "st"
    d.mkdir()
    safetensors.numpy.save_file(tensors, str(d / "model.safetensors"))
    (d / "config.json").write_text(open(os.path.join(model, "config.json")).read())
    r2 = CheckpointReader(str(d))
    for n in tensors:
        np.testing.assert_array_equal(r2.tensor(n), tensors[n])


# -- bad input: one line, non-zero, no traceback ---------------------------------------------------
def one_line_error(r, needle):
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, r.stderr
    assert needle in lines[0], lines[0]


def copy_model(src, dst):
    import shutil
    shutil.copytree(src, dst)
    return str(dst)


def test_missing_directory(tmp_path):
    one_line_error(kog("generate", "--model", str(tmp_path / "nope")), "does not exist")


def test_missing_config(tmp_path):
    one_line_error(kog("generate", "--model", str(tmp_path)), "config.json not found")


def test_malformed_config(tmp_path, model):
    d = copy_model(model, tmp_path / "m")
    open(os.path.join(d, "config.json"), "w").write("{not json")
    one_line_error(kog("generate", "--model", d), "not valid JSON")


@pytest.mark.parametrize("change,needle", [
    ({"num_attention_heads": 2}, "not divisible by num_lanes"),
    ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
    ({"lm_head_type": "split"}, "not supported"),
    ({"hidden_size": "big"}, "hidden_size must be a positive integer"),
])
def test_inconsistent_config(tmp_path, model, change, needle):
    d = copy_model(model, tmp_path / "m")
    p = os.path.join(d, "config.json")
    c = json.load(open(p))
    c.update(change)
    json.dump(c, open(p, "w"))
    one_line_error(kog("generate", "--model", d), needle)


def test_truncated_safetensors(tmp_path, model):
    d = copy_model(model, tmp_path / "m")
    p = os.path.join(d, "model.safetensors")
    data = open(p, "rb").read()
    open(p, "wb").write(data[: len(data) // 2])
    one_line_error(kog("generate", "--model", d), "truncated")


def test_missing_tensor_and_wrong_shape(tmp_path, model):
    r = CheckpointReader(model)
    tensors = {n: r.tensor(n) for n in r.where}
    d = copy_model(model, tmp_path / "a")
    t = dict(tensors)
    del t["model.layers.1.attention.wk.weight"]
    safetensors.numpy.save_file(t, os.path.join(d, "model.safetensors"))
    one_line_error(kog("generate", "--model", d), "model.layers.1.attention.wk.weight is missing")
    t = dict(tensors)
    t["model.norm.weight"] = np.ones(10, np.float32)
    safetensors.numpy.save_file(t, os.path.join(d, "model.safetensors"))
    one_line_error(kog("generate", "--model", d), "model.norm.weight has shape [10]")


def test_unknown_dtype(tmp_path, model):
    r = CheckpointReader(model)
    t = {n: r.tensor(n) for n in r.where}
    t["model.norm.weight"] = t["model.norm.weight"].astype(np.float64)
    d = copy_model(model, tmp_path / "m")
    safetensors.numpy.save_file(t, os.path.join(d, "model.safetensors"))
    one_line_error(kog("generate", "--model", d), "unsupported dtype F64")


def test_prompt_ids_outside_vocabulary(model):
    one_line_error(kog("generate", "--model", model, "--prompt-ids", "1,300"), "outside the vocabulary")
    one_line_error(kog("generate", "--model", model, "--prompt-ids", "1,x"), "comma-separated integers")


def test_prompt_longer_than_context(model):
    ids = ",".join(["5"] * 40)
    one_line_error(kog("generate", "--model", model, "--prompt-ids", ids, "--max-seq", "32"), "exceeds the context")


def test_unknown_flag_and_command():
    one_line_error(kog("generate", "--bogus"), "unrecognized arguments")
    one_line_error(kog("frobnicate"), "unknown command")


SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                           "country": {"type": "string", "enum": ["France", "Spain"]}},
          "required": ["city", "country"], "additionalProperties": False}


def test_generate_json_schema_parses_and_validates(tmp_path):
    """--json-schema FILE (the default model, cpu): the text is the schema's object; without it, not."""
    jsonschema = pytest.importorskip("jsonschema")
    f = tmp_path / "s.json"
    f.write_text(json.dumps(SCHEMA))
    ask = ("generate", "--backend", "cpu", "--prompt", "Paris: its city and country.", "--json")
    free = json.loads(kog(*ask, "-n", "40").stdout)["text"]
    with pytest.raises((ValueError, jsonschema.ValidationError)):
        jsonschema.validate(json.loads(free), SCHEMA)
    r = kog(*ask, "-n", "60", "--json-schema", str(f))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    jsonschema.validate(json.loads(out["text"]), SCHEMA)
    assert out["stats"]["stop_reason"] in ("eos", "stop") and out["stats"]["grammar_ms"] > 0
    cut = json.loads(kog(*ask, "-n", "3", "--json-schema", str(f)).stdout)
    assert cut["stats"]["stop_reason"] == "length"


def test_generate_json_schema_bad_input(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "array", "uniqueItems": true}')
    one_line_error(kog("generate", "--backend", "cpu", "--json-schema", str(bad)), "uniqueItems")
    bad.write_text("{not json")
    one_line_error(kog("generate", "--backend", "cpu", "--json-schema", str(bad)), "not a readable JSON file")
    one_line_error(kog("generate", "--json-schema", str(tmp_path / "none.json"), "--np", "3", "--backend", "cpu"),
                   "not a readable JSON file")      # before any rank starts
    one_line_error(kog("generate", "--speculative", "9"), "--speculative must be 0..8")


def test_generate_speculative_flag_keeps_the_tokens():
    ask = ("generate", "--backend", "cpu", "--prompt", "Repeat: one two three four five six, one two three four",
           "-n", "24", "--json")
    off = json.loads(kog(*ask, "--speculative", "0").stdout)
    on = json.loads(kog(*ask, "--speculative", "8").stdout)
    default = json.loads(kog(*ask).stdout)       # the cpu backend speculates unless told not to
    assert on["token_ids"] == off["token_ids"] == default["token_ids"]
    assert off["stats"]["spec_steps"] == 0 and on["stats"]["spec_steps"] > 0
    assert default["stats"]["spec_steps"] == on["stats"]["spec_steps"]
