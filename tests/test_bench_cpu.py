"""`kog bench` on the cpu backend: the table's numbers come from a real run and hang together."""
import json
import subprocess
import sys

from kog_dist.tiny import write_tiny_checkpoint


def kog(*args):
    return subprocess.run([sys.executable, "-m", "kog_dist.cli", *args], capture_output=True, text=True, timeout=120)


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


def test_cpu_bench_refuses_shape():
    r = kog("bench", "--backend", "cpu", "--shape", "2b")
    assert r.returncode == 2 and "--shape makes its weights on a GPU" in r.stderr
