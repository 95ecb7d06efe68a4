"""The monokernel profile's arithmetic (workers/cuda/bench_kernel.py): clock marks per phase and block in,
critical path / wait / busy / stage / rows / signal / tail out. CPU only."""
import numpy as np

from workers.cuda.bench_kernel import format_breakdown, phase_breakdown


def _marks(nl=2, nb=4, fine=True):
    """Phases back to back, 10 us apart; block b ends b * 100 ns after block 0; ATT and LM without marks 3/4."""
    t = np.zeros((5 * nl + 2, nb, 5 if fine else 3), np.uint64)
    t[5 * nl + 1, :, 1] = 1_000                       # token wait ends at 1 us
    base = 1_000
    for ph in range(5 * nl + 1):
        for b in range(nb):
            row = [base + 100, base + 1_100, base + 9_000 + 100 * b]
            if fine:
                att_or_lm = ph == 5 * nl or ph % 5 == 1
                row += [0, 0] if att_or_lm else [base + 2_100, base + 8_100]
            t[ph, b] = row
        base += 10_000
    return t


def test_breakdown_sums_each_phase_over_layers():
    bd = phase_breakdown(_marks(), 2)
    # critical: previous phase's last end -> this phase's last end; the first from the token wait (1 us)
    assert abs(bd["qkv"]["critical_us"] - (9.3 + 10.0)) < 1e-9
    for k in ("att", "wo", "w13", "w2"):
        assert abs(bd[k]["critical_us"] - 20.0) < 1e-9
        assert abs(bd[k]["wait_us"] - 2.0) < 1e-9 and abs(bd[k]["busy_us"] - 2 * 8.05) < 1e-9   # medians over 4 blocks
    assert abs(bd["wo"]["stage_us"] - 2.0) < 1e-9 and abs(bd["wo"]["rows_us"] - 12.0) < 1e-9
    assert abs(bd["wo"]["signal_us"] - 2 * 1.05) < 1e-9 and abs(bd["wo"]["tail_us"] - 2 * 0.15) < 1e-9
    assert bd["att"]["rows_us"] == 0.0 and bd["lm"]["stage_us"] == 0.0      # no marks 3/4 there
    assert abs(bd["total_us"] - 109.3) < 1e-6          # token wait end -> last LM end


def test_three_marks_still_read_and_formatted():
    coarse, fine = phase_breakdown(_marks(fine=False), 2), phase_breakdown(_marks(), 2)
    for k in ("qkv", "wo", "w13", "w2", "lm"):
        assert coarse[k]["critical_us"] == fine[k]["critical_us"] and coarse[k]["rows_us"] == 0.0
    assert "rows us" in format_breakdown(fine) and "rows us" not in format_breakdown(coarse)
    last = format_breakdown(fine).splitlines()[-2:]
    assert last[0].startswith("total") and last[1].startswith("layers")


def test_lane_chains_read_when_blocks_split_evenly_over_lanes():
    t = _marks(nl=2, nb=4)
    t[5 * 2 - 1, 3, 2] += 7_000                      # block 3 (lane 1 of 2) ends its last W2 7 us later
    bd = phase_breakdown(t, 2, num_lanes=2)
    e0, e1 = bd["lanes"]["end_us"]
    assert abs((e1 - e0) - (7.0 + 0.2)) < 1e-6       # lane 0: blocks 0-1, lane 1: blocks 2-3
    assert abs(bd["lanes"]["slowest_minus_median_us"] - (e1 - e0) / 2) < 1e-6
    assert "lane chains end" in format_breakdown(bd)
    assert "lanes" not in phase_breakdown(t, 2, num_lanes=3) and "lanes" not in phase_breakdown(t, 2)


def test_layer_spans_add_up_to_the_token():
    t = _marks(nl=3, nb=4)
    t[5 * 1 + 4, 2, 2] += 4_000                      # layer 1's W2: block 2 ends 4 us later (3.9 after block 3)
    bd = phase_breakdown(t, 3)
    # layer 0: token wait end (1 us) -> its last W2 end (41 + 9.3 us); layers 50 us apart, layer 1 3.9 us longer
    assert bd["layer_us"] == [49.3, 53.9, 46.1]
    assert bd["lm_after_layers_us"] == 10.0
    assert abs(sum(bd["layer_us"]) + bd["lm_after_layers_us"] - bd["total_us"]) < 1e-6
    assert "layers (us" in format_breakdown(bd)
