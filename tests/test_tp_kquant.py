"""K-quant layer matrices split over ranks as stored (the cuda backend's lane view, kog_dist/tp_lanes.py):
each lane's blocks are the file's rows (wq / wk / wv / w1 / w3) or the super-blocks of its columns (wo / w2),
which re-laid (workers/cuda/kquant.relayout, numpy) are the whole matrix's re-layout cut at those rows and
columns, dequantize to the lane view's float tensors, and give the HF-style reference's ids through the
numpy engine; kquant_reason accepts a split whose per-lane column cuts are whole super-blocks and names the
numbers of one that is not. CPU only (the GPU run: tests/test_cuda_tp.py -k kquant)."""
import numpy as np
import pytest

from kog_dist.formats import open_model
from kog_dist.tp_lanes import LaneSource
from workers.cuda import kquant
from workers.cuda.weights import default_dtype, kquant_reason

from hf_reference import HFLlama, random_hf_tensors, tiny_hf_config, write_gguf

PROMPT = [1, 5, 9, 33, 17, 60]
SPM = {"tokenizer.ggml.model": "llama"}
# heads * head_dim = F = 512: 2 lanes cut wo and w2 at 256 (whole super-blocks), 4 lanes at 128 (inside one)
CFG = dict(num_attention_heads=8, num_key_value_heads=2, vocab_size=97, num_hidden_layers=2, hidden_size=512,
           intermediate_size=512)
MATS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1", "feed_forward.w2",
        "feed_forward.w3")


def write_kquant_models(root) -> dict:
    """{"q4_k": ..., "q4_k_m": ...}: (path, config, the values the file holds in HF names). Every layer matrix
    Q4_K (kog_dist.formats.kquant's encoder), or Q4_K with v_proj and down_proj Q6_K (a Q4_K_M-like mix);
    embedding and LM head F32. The cuda backend keeps those in bf16, so each seed's greedy run (12 tokens
    after PROMPT) has a top-2 logit margin of at least 0.1: Q4_K seed 31 has 0.44, the mix's seed 11 0.76."""
    import gguf
    q4, q6 = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K
    c = tiny_hf_config(**CFG)
    out = {}
    for name, seed, qt in (("q4_k", 31, lambda hf: q4 if ".layers." in hf else None),
                           ("q4_k_m", 11, lambda hf: None if ".layers." not in hf else
                            q6 if ("v_proj" in hf or "down_proj" in hf) else q4)):
        p = str(root / f"{name}.gguf")
        out[name] = (p, c, write_gguf(p, c, random_hf_tensors(c, seed), qtype=qt, fields=SPM))
    return out


@pytest.fixture(scope="module")
def kmodels(tmp_path_factory):
    return write_kquant_models(tmp_path_factory.mktemp("tp_kquant"))


def _cut(arrs, rows, cols, k):
    """The re-layout (nib, hi, rec) of a whole [R, k] matrix cut at rows x cols (cols on super-blocks)."""
    nib, hi, rec = arrs
    r = slice(None) if rows is None else rows
    c = slice(0, k) if cols is None else cols
    out = [nib.reshape(-1, k // 2)[r, c.start // 2:c.stop // 2].reshape(-1),
           None if hi is None else hi.reshape(-1, k // 4)[r, c.start // 4:c.stop // 4].reshape(-1),
           rec.reshape(-1, k // 256 * kquant.REC)[r, c.start // 256 * kquant.REC:c.stop // 256 * kquant.REC]]
    return [None if a is None else a.reshape(-1) for a in out]


@pytest.mark.parametrize("which", ["q4_k", "q4_k_m"])
def test_lane_blocks_are_the_whole_matrix_cut(kmodels, which):
    """(a) each lane's blocks re-laid = the whole matrix's re-layout at the lane's rows / super-block columns;
    (b) each lane's blocks dequantized = the lane view's float tensor of that lane."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from kog_dist.tp import _slices
    path = kmodels[which][0]
    one, lv = open_model(path, progress=False), LaneSource(open_model(path, progress=False), 2)
    seen = set()
    for i in range(CFG["num_hidden_layers"]):
        for m in MATS:
            name = f"model.layers.{i}.{m}.weight"
            whole, t = one.blocks(name)
            k = one.shape(name)[-1]
            ref = kquant.relayout(whole, t, xp=np)
            lanes, lt = lv.blocks(name)
            assert lt == t and lanes.shape[0] == 2
            seen.add(t)
            floats = lv.tensor(name)
            for lane in range(2):
                rows, cols = _slices(lv.plans[lane], name)
                got = kquant.relayout(lanes[lane], t, xp=np)
                for g, w in zip(got, _cut(ref, rows, cols, k)):
                    assert (g is None) == (w is None), (name, lane)
                    if g is not None:
                        np.testing.assert_array_equal(g, w, err_msg=f"{name} lane {lane}")
                one_lane, _ = lv.blocks(name, range(lane, lane + 1))
                np.testing.assert_array_equal(one_lane[0], lanes[lane])
                deq = dequantize(lanes[lane], GGMLQuantizationType[t])
                np.testing.assert_array_equal(deq, floats[lane], err_msg=f"{name} lane {lane}")
                # and the layout's own decoder (kquant.cuh's arithmetic) gives those values too
                np.testing.assert_array_equal(kquant.decode(*got, t).reshape(deq.shape), deq)
    assert seen == ({"Q4_K"} if which == "q4_k" else {"Q4_K", "Q6_K"})
    one.close()
    lv.close()


def test_lane_blocks_read_only_the_lanes_bytes(kmodels):
    """A lane's blocks are its share of the file's bytes (the source's nbytes_read counts what was served)."""
    path = kmodels["q4_k"][0]
    one = open_model(path, progress=False)
    name = "model.layers.0.feed_forward.w2.weight"
    whole = one.blocks(name)[0].nbytes
    lv = LaneSource(open_model(path, progress=False), 2)
    before = lv.nbytes_read
    b, _ = lv.blocks(name, range(1, 2))
    assert b.nbytes == whole // 2 and lv.nbytes_read - before == whole // 2
    one.close()
    lv.close()


def test_lane_blocks_refuse_a_cut_inside_a_super_block(kmodels):
    lv = LaneSource(open_model(kmodels["q4_k"][0], progress=False), 4)
    lv.blocks("model.layers.0.attention.wq.weight")            # rows: whole rows at any split
    with pytest.raises(ValueError, match="columns 0..128 do not fall on the 256-weight blocks of Q4_K"):
        lv.blocks("model.layers.0.attention.wo.weight")
    lv.close()


def test_kquant_reason_of_a_split(kmodels):
    """(c) None where every lane's wo / w2 columns are whole super-blocks (so default_dtype keeps the file's
    types); otherwise a reason with the numbers (and the dequantizing fallback to BF16)."""
    path = kmodels["q4_k_m"][0]
    one = open_model(path, progress=False)
    two, four = LaneSource(open_model(path, progress=False), 2), LaneSource(open_model(path, progress=False), 4)
    assert kquant_reason(one) is None and kquant_reason(two) is None
    assert default_dtype(two) == "Q4_K+Q6_K" == default_dtype(one)
    why = kquant_reason(four)
    assert why == ("split over 4 ranks, each rank's wo columns (heads * head_dim / 4 = 128) are not a multiple "
                   "of the 256-weight super-blocks"), why
    assert default_dtype(four) == "BF16"
    for s in (one, two, four):
        s.close()


def test_kquant_reason_names_the_ffn_cut(tmp_path):
    """heads * head_dim = 512 and F = 768 over 2 lanes: wo's 256 columns are whole, w2's 384 are not."""
    import gguf
    c = tiny_hf_config(**{**CFG, "intermediate_size": 768, "num_hidden_layers": 1})
    p = str(tmp_path / "f.gguf")
    write_gguf(p, c, random_hf_tensors(c, 0), fields=SPM,
               qtype=lambda hf: gguf.GGMLQuantizationType.Q4_K if ".layers." in hf else None)
    one, two = open_model(p, progress=False), LaneSource(open_model(p, progress=False), 2)
    assert kquant_reason(one) is None
    assert kquant_reason(two) == ("split over 2 ranks, each rank's w2 columns (intermediate_size / 2 = 384) are "
                                  "not a multiple of the 256-weight super-blocks")
    one.close()
    two.close()


@pytest.mark.parametrize("which", ["q4_k", "q4_k_m"])
def test_lane_view_of_a_kquant_file_gives_the_reference_ids(kmodels, which):
    from test_cuda_tp import _greedy_numpy
    path, c, held = kmodels[which]
    want, logits = HFLlama(c, held).greedy(PROMPT, 12)
    assert min(float(np.diff(np.sort(lg)[-2:])[0]) for lg in logits) >= 0.1     # the fixture's margin
    assert _greedy_numpy(LaneSource(open_model(path, progress=False), 2), 12) == want


@pytest.mark.parametrize("rank", [0, 1])
def test_rank_upload_of_split_kquants_decodes_to_the_lane_view(kmodels, rank, monkeypatch):
    """load_checkpoint of a rank's view (2 ranks, one lane each) with CuPy stood in for by numpy: every field of
    every layer in the rank's arrays (kquant.cuh's layout at field_ranges, decoded with kquant.decode) is the
    lane view's float tensor of the rank's lane, W13 gate / up interleaved; p.kt's types are the file's."""
    import sys
    monkeypatch.setitem(sys.modules, "cupy", np)
    monkeypatch.setattr(np, "cuda", type("C", (), {"Device": lambda *a: type("D", (), {"synchronize": lambda s: None})()}),
                        raising=False)
    from workers.cuda.multirank import RankView
    from workers.cuda.weights import load_checkpoint
    path = kmodels["q4_k_m"][0]
    lv = LaneSource(open_model(path, progress=False), 2)
    view = RankView(lv.cfg, rank, 2)
    dw = load_checkpoint(lv, lv.cfg, default_dtype(lv), False, view=view, kernels=object())
    assert dw.kq and dw.cfg.num_lanes == 1
    for i in range(CFG["num_hidden_layers"]):
        p = f"model.layers.{i}."
        want = {m: lv.tensor(p + m + ".weight", range(rank, rank + 1))[0] for m in MATS}
        want["feed_forward.w13"] = np.stack([want["feed_forward.w1"], want["feed_forward.w3"]], axis=1)
        for field, j, e0, n in dw.field_ranges():
            t = dw.ktypes[i][field]
            assert t == lv.quant_type(p + ("feed_forward.w1" if field.endswith("w13") else field) + ".weight")
            e = i * dw.layer_elems + e0
            got = kquant.decode(dw.w[e // 2:(e + n) // 2], None if t == "Q4_K" else dw.wh[e // 4:(e + n) // 4],
                                dw.ws[e // 256 * kquant.REC:(e + n) // 256 * kquant.REC], t)
            np.testing.assert_array_equal(got, want[field].reshape(-1), err_msg=f"layer {i} {field}")
        assert int(dw.kt[i]) == kquant.type_word(dw.ktypes[i])
    lv.close()
