"""The reproduction scripts BENCHMARKS.md cites (bench/*.sh) stay runnable: each parses, and with DRY=1 each
prints its commands, whose arguments the real parsers accept (on this CPU machine every bench command then
refuses in one line for want of a GPU, after parsing) and whose checkpoint shapes are kog_dist.shapes'."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest

from mpi_helpers import REPO_ROOT, mpi_env

SCRIPTS = sorted(f for f in os.listdir(os.path.join(REPO_ROOT, "bench")) if f.endswith(".sh"))
ARGPARSE_ERRORS = ("unrecognized arguments", "invalid choice", "expected one argument", "invalid int value",
                   "the following arguments are required")


def dry(script, *args, **env):
    r = subprocess.run(["bash", os.path.join("bench", script), *args], capture_output=True, text=True, timeout=60,
                       cwd=REPO_ROOT, env=mpi_env({"DRY": "1", "OUT": env.pop("out"), "PY": sys.executable, **env}))
    assert r.returncode == 0, r.stderr
    return [shlex.split(line) for line in r.stdout.splitlines() if line.strip()]


def all_commands(tmp):
    return (dry("gpu_full_rows.sh", out=tmp) + dry("ab_variants.sh", "CFG_A=1 CFG_B=2", out=tmp, ROUNDS="1")
            + dry("ab_variants.sh", "CFG_A=1", out=tmp, ROUNDS="1", NP="2") + dry("ncu_warp_states.sh", out=tmp))


def test_every_script_parses():
    assert {"gpu_full_rows.sh", "ab_variants.sh", "ncu_warp_states.sh"} <= set(SCRIPTS)
    for s in SCRIPTS:
        r = subprocess.run(["bash", "-n", os.path.join(REPO_ROOT, "bench", s)], capture_output=True, text=True)
        assert r.returncode == 0, f"{s}: {r.stderr}"


def test_dry_runs_print_what_they_would_run(tmp_path):
    cmds = all_commands(str(tmp_path))
    mods = [c[c.index("-m") + 1] for c in cmds if "-m" in c]
    assert mods.count("kog_cli") == 13 and mods.count("kccl.bench") == 1, cmds
    variant = [c for c in cmds if "CFG_B=2" in c]
    assert len(variant) == 1 and variant[0][variant[0].index("CFG_A=1") - 1] == "--define"
    assert (tmp_path / "commands.txt").read_text().count("\n") == len(cmds)


def _bench_commands(tmp):
    out = []
    for c in all_commands(tmp):
        c = c[c.index(sys.executable):]                 # ncu's prefix off
        if c[2] == "kccl.bench" or c[2:4] == ["kog_cli", "bench"]:
            out.append(c)
    return out


# gpu_full_rows: 2b one rank, 2b two ranks, three checkpoints' benches, kccl; ab_variants: base + variant, one and
# two ranks; ncu_warp_states: one
@pytest.mark.parametrize("pick", range(11))
def test_bench_commands_parse_and_refuse_without_a_gpu(tmp_path, pick):
    cmds = _bench_commands(str(tmp_path))
    assert len(cmds) == 11
    cmd = cmds[pick]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO_ROOT, env=mpi_env())
    if "--model" in cmd:   # the dry run wrote no checkpoint: the bench stops at the missing directory
        assert r.returncode != 0
    else:
        assert r.returncode == 2, (cmd, r.stderr)
    assert not any(e in r.stderr for e in ARGPARSE_ERRORS), (cmd, r.stderr)
    assert "Traceback" not in r.stderr, (cmd, r.stderr)


def test_checkpoint_shapes_are_the_named_shapes(tmp_path):
    from kog_dist.shapes import SHAPES
    flags = {"--layers": "num_hidden_layers", "--hidden": "hidden_size", "--heads": "num_attention_heads",
             "--kv-heads": "num_key_value_heads", "--ffn": "intermediate_size", "--vocab": "vocab_size",
             "--lanes": "num_lanes", "--delay": "broadcast_delay", "--window": "sliding_window",
             "--window-layers": "sliding_window_n_layers"}
    helptext = subprocess.run([sys.executable, "-m", "kog_cli", "checkpoint", "tiny", "--help"], capture_output=True,
                              text=True, timeout=60, cwd=REPO_ROOT, env=mpi_env()).stdout
    seen = set()
    for c in all_commands(str(tmp_path)):
        if c[2:5] != ["kog_cli", "checkpoint", "tiny"]:
            continue
        name = os.path.basename(c[5]).removeprefix("ckpt_")
        shape = SHAPES[name]
        for i, a in enumerate(c[6:], 6):
            if a.startswith("--"):
                assert a in helptext, a
                if a in flags:
                    assert int(c[i + 1]) == shape[flags[a]], (name, a)
        assert ("--tie" in c) == shape["tie_word_embeddings"]
        assert set(flags) - {"--window", "--window-layers"} <= set(c), c
        seen.add(name)
    assert seen == {"2b", "llama3.2-1b", "smollm2-135m"}


def test_spills_by_file_maps_the_kernel_source_and_counts_local_traffic():
    """bench/spills_by_file.py: its line -> file map (kccl.cuda_source.inlined_line_files) walks the sources as
    build.source() does (line counts
    equal, and the pasted files start where their headers are), and SASS lines are counted under the file of
    their `//## File ... line N` mark, spill loads and stores apart, only inside the named function."""
    sys.path.insert(0, os.path.join(REPO_ROOT, "bench"))
    import spills_by_file as S
    from kccl.cuda_source import inlined_line_files
    from workers.cuda import build
    src = build.source()
    files = inlined_line_files([os.path.join(build.HERE, f) for f in build.SOURCES])
    lines = src.split("\n")
    assert len(files) == src.count("\n") + (not src.endswith("\n"))
    for name in ("mk_wo.cuh", "mk_w2.cuh", "mk_spec.cuh"):
        first = files.index(name)
        assert lines[first].startswith(f"// {name}: part of"), (name, lines[first])
    wo = files.index("mk_wo.cuh") + 1
    qkv = files.index("mk_qkv.cuh") + 1
    sass = "\n".join([
        "\t.section\t.text.other,\"ax\",@progbits",
        f"\t//## File \"/t/m.cu\", line {wo}",
        "        /*0000*/                   LDL R1, [R1] ;",
        "\t.section\t.text.monokernel,\"ax\",@progbits",
        f"\t//## File \"/t/m.cu\", line {wo + 3}",
        "        /*0000*/                   LDL.64 R2, [R1+0x8] ;",
        "        /*0010*/                   FFMA R3, R4, R5, R3 ;",
        f"\t//## File \"/t/m.cu\", line {qkv + 1}",
        "        /*0020*/                   STL [R1+0x4], R6 ;",
        "        /*0030*/                   LDG.E.128.CONSTANT R8, desc[UR4][R10.64] ;",
    ])
    assert S.attribute(files, sass) == {"mk_wo.cuh": [2, 1, 0], "mk_qkv.cuh": [2, 0, 1]}


def test_block_lateness_names_the_late_block_and_its_step():
    """bench/block_lateness.py: in marks where block 7 enters every phase 2 us late and block 3 runs its rows
    1 us longer in QKV only, QKV's last block is 7 (entry +2), 3 comes second, and attention (no stage or rows
    marks) is reported without a breakdown."""
    import numpy as np
    sys.path.insert(0, os.path.join(REPO_ROOT, "bench"))
    import block_lateness as B
    layers, nb = 4, 16
    t = np.zeros((5 * layers, nb, 5), dtype=np.int64)
    for i in range(layers):
        for k in range(5):
            m = t[5 * i + k]
            base = 100_000 * (5 * i + k)
            m[:, 0] = base                      # entry
            m[:, 1] = base + 1_000              # after the wait
            m[:, 3] = base + 1_500              # staged
            m[:, 4] = base + 2_500              # rows done
            m[:, 2] = base + 3_000              # end
            m[7] += 2_000                       # block 7 is late into everything, by its entry
            if k == 0:
                m[3, 4] += 1_000; m[3, 2] += 1_000   # block 3's QKV rows take 1 us longer
            if k == 1:
                m[:, 3:5] = 0                   # attention has no stage / rows marks
    out = B.lateness(t, layers, top=2)
    qkv = [ln for ln in out.split("\n") if ln.startswith("qkv:")][0]
    assert "late on average (block: us) 7: 2.00, 3: 1.00" in qkv and "last most often 7 x4" in qkv
    first = out.split("\n")[1]
    assert first.strip().startswith("the last block against the median") and "entry +2.00" in first
    assert "rows +0.00" in first and "wait +0.00" in first
    att_i = out.split("\n").index([ln for ln in out.split("\n") if ln.startswith("att:")][0])
    assert not out.split("\n")[att_i + 1].strip().startswith("the last block")


def test_serve_overhead_interval_holds_the_median_and_narrows_with_the_pairs():
    """bench/serve_overhead.py's bootstrap interval of the median paired difference: it holds the sample's
    median, is reproducible (fixed seed), and is several times narrower for 50 times the pairs (sqrt(50) ~ 7):
    1000 pairs show a 0.2 effect in noise of 1.0, 20 pairs do not."""
    import random
    import statistics
    sys.path.insert(0, os.path.join(REPO_ROOT, "bench"))
    import serve_overhead as S
    rng = random.Random(1)
    many = [rng.gauss(0.2, 1.0) for _ in range(1000)]
    few = [rng.gauss(0.2, 1.0) for _ in range(20)]
    lo, hi = S.median_interval(many)
    assert lo < statistics.median(many) < hi
    assert (lo, hi) == S.median_interval(many)
    flo, fhi = S.median_interval(few)
    assert flo < statistics.median(few) < fhi
    assert (fhi - flo) / (hi - lo) > 4.0
    assert lo > 0.0 and flo < 0.0


def test_relay_floor_relays_every_message_each_way(tmp_path):
    """bench/relay_floor.py on this machine, briefly: every way relays its messages through real sockets to its
    end mark (the sender's last message) and reports a positive CPU a message; bad arguments are one line and
    exit 2."""
    r = subprocess.run([sys.executable, os.path.join("bench", "relay_floor.py"), "--n", "12", "--gap-ms", "1",
                        "--repeats", "1", "--json"], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert r.returncode == 0, r.stderr
    import json
    out = json.loads(r.stdout)
    assert [w["way"] for w in out["rows"]] == ["socket", "zmq", "zmq-pinned", "zmq-asyncio"]
    assert all(0 < w["us_cpu_per_message"] < 1e5 for w in out["rows"])
    r = subprocess.run([sys.executable, os.path.join("bench", "relay_floor.py"), "--n", "0"], capture_output=True,
                       text=True, timeout=60, cwd=REPO_ROOT)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "relay_floor: error" in r.stderr


def test_gateway_cost_splits_the_gateways_ttft_with_the_stand_ins_stamps():
    """bench/gateway_cost.py, briefly: a real `kog serve --connect` in front of its stand-in coordinator; each
    path's TTFT holds the stand-in's prefill (--gap-ms) plus its way in and out, which the stand-in's stamps of
    the same request measure (stamps of another request would put them tens of ms off or negative)."""
    r = subprocess.run([sys.executable, os.path.join("bench", "gateway_cost.py"), "--reps", "4", "-n", "3",
                        "--gap-ms", "20", "--json"], capture_output=True, text=True, timeout=240, cwd=REPO_ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    import json
    out = json.loads(r.stdout)
    for p in ("direct", "gateway"):
        assert 0 < out["in"][p] < 15 and 0 < out["out"][p] < 15, out
        assert 20 < out["ttft"][p] < out["in"][p] + 20 + out["out"][p] + 15, out
    assert out["gateway_cpu_us_per_token"] > 0
    r = subprocess.run([sys.executable, os.path.join("bench", "gateway_cost.py"), "-n", "1"], capture_output=True,
                       text=True, timeout=60, cwd=REPO_ROOT)
    assert r.returncode == 2 and "gateway_cost: error" in r.stderr
