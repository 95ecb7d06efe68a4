"""Named model shapes (spec keys), each defined once: `kog bench --shape NAME` makes random weights of
one on the device, the PyTorch baselines build the same model, the tests compile the kernel for it.

`2b` is the published Laneformer 2B (spec: "The 2B checkpoint"); the others are the public configs of
Llama-family models as one-lane Laneformers (spec: "Llama-family checkpoints")."""
from __future__ import annotations

from .config import LaneformerConfig

_LLAMA = dict(model_type="laneformer_tp", num_lanes=1, broadcast_delay=1, tie_word_embeddings=True)

SHAPES: dict[str, dict] = {
    "2b": dict(model_type="laneformer_tp", hidden_size=3072, num_hidden_layers=15, num_attention_heads=32,
               num_key_value_heads=16, intermediate_size=12288, vocab_size=32000, num_lanes=8,
               broadcast_delay=2, use_comm=True, use_early_comm=True, early_layers_to_future=True,
               rope_theta=10000.0, norm_eps=1e-5, sliding_window=2048, sliding_window_n_layers=10,
               lm_head_type="replicate", replicated_rmsn_scale=True, max_position_embeddings=4096,
               tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
    # meta-llama/Llama-3.2-1B: tied, llama3 rope scaling
    "llama3.2-1b": dict(_LLAMA, hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                        num_key_value_heads=8, intermediate_size=8192, vocab_size=128256, rope_theta=500000.0,
                        norm_eps=1e-5, max_position_embeddings=131072, bos_token_id=128000,
                        eos_token_id=128001,
                        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    # meta-llama/Llama-3.1-8B: untied, llama3 rope scaling (factor 8)
    "llama3.1-8b": dict(_LLAMA, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=8, intermediate_size=14336, vocab_size=128256, rope_theta=500000.0,
                        norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=False,
                        bos_token_id=128000, eos_token_id=128001,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    # Qwen/Qwen2.5-7B-Instruct: q/k/v biases, untied, 152064-row vocabulary
    "qwen2.5-7b": dict(_LLAMA, hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, intermediate_size=18944, vocab_size=152064, rope_theta=1000000.0,
                       norm_eps=1e-6, max_position_embeddings=32768, attention_bias=True,
                       tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645),
    # HuggingFaceTB/SmolLM2-135M: the built-in default model's shape
    "smollm2-135m": dict(_LLAMA, hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, intermediate_size=1536, vocab_size=49152, rope_theta=100000.0,
                         norm_eps=1e-5, max_position_embeddings=8192, bos_token_id=1, eos_token_id=2),
    # Qwen/Qwen2.5-0.5B: q/k/v biases, 151936-row vocabulary
    "qwen2.5-0.5b": dict(_LLAMA, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, intermediate_size=4864, vocab_size=151936, rope_theta=1000000.0,
                         norm_eps=1e-6, max_position_embeddings=32768, attention_bias=True,
                         bos_token_id=151643, eos_token_id=151645),
}


def shape_config(name: str) -> LaneformerConfig:
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r} (known: {', '.join(SHAPES)})")
    return LaneformerConfig.from_dict(dict(SHAPES[name]))
