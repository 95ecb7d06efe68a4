"""`kog bench` on the cpu backend: the table's numbers come from a real run and hang together."""
import json
import subprocess
import sys

from kog_dist.tiny import write_tiny_checkpoint


def kog(*args):
    return subprocess.run([sys.executable, "-m", "kog_cli", *args], capture_output=True, text=True, timeout=120)


def test_cpu_bench_json_and_table(tmp_path):
    d = str(tmp_path / "m")
    write_tiny_checkpoint(d, num_lanes=4)
    r = kog("bench", "--backend", "cpu", "--model", d, "--reps", "2", "--pp", "16", "--prompt", "8",
            "--gen", "12", "--baselines", "none", "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    tg = rep["monokernel"]["tg"]
    assert tg["gen"] == 12 and tg["tokens_per_s"] > 0
    # GB/s is tokens/s times the bytes streamed per token; the fraction is over the copy measured now
    assert abs(tg["GB_per_s"] - tg["tokens_per_s"] * rep["monokernel"]["streamed_bytes_per_token"] / 1e9) < 1e-6
    assert 0 < tg["fraction_of_copy_bw"] < 1
    assert rep["copy_bandwidth_GBps"] > 0.1
    t = kog("bench", "--backend", "cpu", "--model", d, "--reps", "1", "--pp", "8", "--prompt", "4",
            "--gen", "4", "--baselines", "none")
    assert t.returncode == 0 and "| cpu (numpy)" in t.stdout and "tg4 @ 4" in t.stdout, t.stdout
    # the decode rows sample when told (the same prompt and seed as the greedy rows above: other ids)
    s = kog("bench", "--backend", "cpu", "--model", d, "--reps", "2", "--pp", "16", "--prompt", "8",
            "--gen", "12", "--baselines", "none", "--json", "--temperature", "5", "--top-p", "0.99")
    assert s.returncode == 0, s.stderr
    sampled = json.loads(s.stdout)
    assert sampled["args"]["temperature"] == 5 and sampled["monokernel"]["tg"]["gen"] == 12
    assert sampled["monokernel"]["tg"]["ids_head"] != rep["monokernel"]["tg"]["ids_head"]


def test_cpu_bench_refuses_shape():
    r = kog("bench", "--backend", "cpu", "--shape", "2b")
    assert r.returncode == 2 and "--shape makes its weights on a GPU" in r.stderr
    r = kog("bench", "--shape", "3b")   # the name first, whatever the machine
    from kog_dist.shapes import SHAPES
    assert r.returncode == 2 and r.stderr.strip() == f"kog bench: error: unknown shape '3b' (known: {', '.join(SHAPES)})", r.stderr
    assert "llama3.1-8b" in SHAPES and "qwen2.5-7b" in SHAPES


def test_np_is_checked_before_any_rank_starts(tmp_path):
    """`kog bench --np N` (the multi-rank cuda backend under the MPI launcher): bad rank counts and
    backends are one-line errors with exit 2; on a machine without a GPU it says so instead of launching."""
    d = str(tmp_path / "m")
    write_tiny_checkpoint(d, num_lanes=4)
    for args, why in ((("--shape", "2b", "--np", "3"), "3 ranks do not divide num_lanes=8"),
                      (("--model", d, "--np", "8"), "8 ranks do not divide num_lanes=4"),
                      (("--model", d, "--np", "0"), "--np must be >= 1"),
                      (("--model", d, "--np", "8", "--backend", "cpu"), "8 ranks do not divide num_lanes=4"),
                      (("--shape", "2b", "--np", "2", "--backend", "cpu"), "--np with --backend cpu runs a real model"),
                      (("--model", str(tmp_path / "nope"), "--np", "2"), "does not exist")):
        r = kog("bench", *args)
        assert r.returncode == 2 and why in r.stderr and len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)
    try:
        import cupy  # noqa: F401
        return       # a GPU machine would launch the ranks: tests/gpu_multigpu.sh covers that
    except ImportError:
        pass
    r = kog("bench", "--model", d, "--np", "2")
    assert r.returncode == 2 and "needs CuPy and a CUDA GPU on every rank" in r.stderr


def test_bad_sizes_are_one_line_errors(tmp_path):
    """Counts and sizes that cannot make a row are refused before any work, one line and exit 2."""
    d = str(tmp_path / "m")
    write_tiny_checkpoint(d, num_lanes=4)
    for args, why in ((("--reps", "0"), "--reps must be >= 1 (got 0)"),
                      (("--gen", "0"), "--gen must be >= 1"),
                      (("--pp", "-1"), "--pp must be >= 1"),
                      (("--prefetch", "-5"), "--prefetch must be >= 0"),
                      (("--nblocks", "0"), "--nblocks must be >= 1"),
                      (("--baseline-repeats", "0"), "--baseline-repeats must be >= 1"),
                      (("--ctx", "100", "--ctx-gen", "100"), "--ctx-gen (100) must be below --ctx (100)"),
                      (("--temperature", "-1"), "temperature must be a number in [0, 1e+06]"),
                      (("--top-p", "0"), "top_p must be a number in (0, 1]")):
        r = kog("bench", "--backend", "cpu", "--model", d, *args)
        assert r.returncode == 2 and why in r.stderr and len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)


def test_table_says_when_the_rows_ran_the_profile_build():
    """`kog bench --profile` compiles the clock marks into the kernel it measures: its table says so, a
    table without --profile does not."""
    from kog_cli.bench import table
    rep = {"date": "2026-01-01", "device": "stand-in", "model": "tiny", "dtype": "F32", "copy_bandwidth_GBps": 100.0,
           "baselines": [],
           "monokernel": {"streamed_bytes_per_token": 1e6, "timing_marks": False,
                          "pp": {"prompt": 16, "tokens_per_s": 1000.0, "ttft_ms": 16.0},
                          "tg": {"prompt": 8, "gen": 8, "tokens_per_s": 50.0, "ms_per_token": 20.0,
                                 "GB_per_s": 0.05, "fraction_of_copy_bw": 0.0005}}}
    assert "profile build" not in table(rep)
    rep["monokernel"]["timing_marks"] = True
    assert "--profile: every row ran the profile build" in table(rep)


def test_speculative_rows_on_the_default_model():
    """`kog bench --model M --speculative K`: every agent-like task of kog_cli/agent_tasks.json with and without
    prompt lookup, ids identical (the exit status says so too); the copy-heavy edits get drafts accepted, and
    the verify pass's cost per size is reported (the cpu backend's fast pass)."""
    import os
    import pytest
    from kog_dist.models import default_gguf_path
    gguf = default_gguf_path()
    if gguf is None or not os.path.isfile(gguf):
        pytest.skip("the default model's GGUF is not on this machine")
    r = kog("bench", "--backend", "cpu", "--model", gguf, "--speculative", "8", "--gen", "24", "--reps", "1",
            "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    names = [row["task"] for row in rep["rows"]]
    assert names == ["rename", "type_hints", "reformat", "fix", "story"], names
    assert all(row["identical"] for row in rep["rows"])
    edits = [row for row in rep["rows"] if row["kind"] == "edit"]
    assert sum(row["accepted"] for row in edits) > 0 and all(row["spec_steps"] > 0 for row in edits), edits
    for row in rep["rows"]:
        assert row["accepted"] <= row["drafted"] and row["new_tokens"] <= 24
        # every pass of the weights counted: one token each plus the accepted drafts
        assert row["tokens_per_pass_all"] == (row["new_tokens"] - 1) / (row["new_tokens"] - 1 - row["accepted"])
    assert max(row["tokens_per_pass_all"] for row in edits) > 1
    cost = rep["verify_cost"]
    assert cost["step_ms"] > 0 and all(cost[str(t)] > 0 for t in (2, 4, 8))
    t = kog("bench", "--backend", "cpu", "--model", gguf, "--speculative", "4", "--gen", "8", "--reps", "1")
    assert t.returncode == 0 and "| reformat | edit |" in t.stdout and "verify pass cost" in t.stdout, t.stdout


def test_speculative_rows_refuse_what_they_cannot_run():
    """--shape with --speculative is the cuda backend's verify-pass cost: refused in one line without a GPU
    (or with --backend cpu), as is --np without --model."""
    from workers.factory import cuda_available
    if not cuda_available():
        r = kog("bench", "--shape", "smollm2-135m", "--speculative", "8")
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "verify passes" in r.stderr and "CUDA GPU" in r.stderr, r.stderr
    r = kog("bench", "--shape", "smollm2-135m", "--speculative", "8", "--backend", "cpu")
    assert r.returncode == 2 and "needs CuPy and a CUDA GPU" in r.stderr, r.stderr
    r = kog("bench", "--shape", "smollm2-135m", "--speculative", "8", "--np", "2")
    assert r.returncode == 2 and "--speculative" in r.stderr and "give --model" in r.stderr, r.stderr
    r = kog("bench", "--model", "default", "--speculative", "12")
    assert r.returncode == 2 and r.stderr.strip() == "kog bench: error: --speculative takes 1 to 8 draft tokens (got 12)"


def test_pass_cost_divides_by_the_passes_run():
    """kog_cli/bench_spec.pass_cost's arithmetic (the cuda rows of `kog bench --shape S --speculative K` and
    bench/spec_verify_cost.py), on a stand-in for the cuda backend (no GPU here): a pass of P positions that
    costs c(P) ms and gives one token, or some accepted drafts, is reported as c(P) / c(plain); sizes past the
    build's positions are dropped; each run asks for the pass size it measures."""
    from kog_dist.backend import RunResult
    from kog_cli.bench_spec import pass_cost
    cost = {"plain": 0.5, 1: 0.52, 2: 0.7, 4: 0.85}
    seen = []

    class Stand:
        spec_max = 4

        class cfg:
            vocab_size = 100

        def run(self, cmd, ignore_eos=False, spec_fixed=None):
            key = "plain" if cmd.speculative == 0 else (1 if spec_fixed == -1 else spec_fixed + 1)
            seen.append((key, len(cmd.append), cmd.max_new_tokens))
            passes = cmd.max_new_tokens if key in ("plain", 1) else cmd.max_new_tokens // 2   # some accepted
            return RunResult(token_ids=[0] * cmd.max_new_tokens, decode_ms=(passes - 1) * cost[key],
                             spec_steps=0 if key in ("plain", 1) else passes - 1)
    rows = pass_cost(Stand(), [1, 2, 4, 8], prompt_len=16, gen=64, reps=2)
    assert [r["positions"] for r in rows] == ["plain", 1, 2, 4]
    for r in rows[1:]:
        assert abs(r["vs_plain"] - cost[r["positions"]] / cost["plain"]) < 1e-9
        assert abs(r["pass_us"] - cost[r["positions"]] * 1e3) < 1e-6
    assert len(seen) == 8 and all(n == 16 and g == 64 for _, n, g in seen)


def test_cpu_bench_text_prompt_is_the_models_tokens(tmp_path):
    """--text: the decode rows start from the text's tokens (as `kog generate --raw` encodes them for a model without
    a chat template), so their greedy ids are generate's; refused in one line with --np or without --model."""
    d = str(tmp_path / "m")
    write_tiny_checkpoint(d, num_lanes=4)
    r = kog("bench", "--backend", "cpu", "--model", d, "--reps", "1", "--pp", "8", "--gen", "6", "--baselines", "none",
            "--text", "Hello there", "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    g = kog("generate", "--backend", "cpu", "--model", d, "--raw", "--prompt", "Hello there", "-n", "6", "--json")
    assert g.returncode == 0, g.stderr
    gen = json.loads(g.stdout)
    assert rep["monokernel"]["tg"]["prompt"] == gen["prompt_tokens"] == len(rep["args"]["text_ids"])
    assert rep["monokernel"]["tg"]["ids_head"][:len(gen["token_ids"])] == gen["token_ids"]
    for extra in (("--np", "2"), ("--speculative", "4")):
        e = kog("bench", "--backend", "cpu", "--model", d, "--text", "hi", *extra)
        assert e.returncode == 2 and len(e.stderr.strip().splitlines()) == 1 and "--text takes --model" in e.stderr
    e = kog("bench", "--shape", "smollm2-135m", "--text", "hi")
    assert e.returncode == 2 and "--text takes --model" in e.stderr, e.stderr
