"""Tiny random-weight hybrid models for real vLLM engines in tests and benchmarks, float32,
built locally with transformers: a Llama with a sliding-window and a full-attention layer
(`layer_types`), an all-sliding-window Llama (Mistral-7B-v0.1 style), a Granite 4 style
model with a Mamba2 and an attention layer (GraniteMoeHybrid), and a Qwen3-Next with a
gated-delta-net (linear attention) and an attention layer."""

from __future__ import annotations

from pathlib import Path

COMMON = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
    "dtype": "float32",
}


KINDS = ("sliding_window", "all_sliding_window", "mamba", "linear_attention")


def build_hybrid(path: Path, kind: str) -> Path:
    """Write the `kind` (one of KINDS) model to `path` once."""
    if (path / "config.json").is_file():
        return path
    import torch
    import transformers

    if kind in ("sliding_window", "all_sliding_window"):
        second = "full_attention" if kind == "sliding_window" else "sliding_attention"
        config = transformers.LlamaConfig(
            **COMMON, head_dim=64, layer_types=["sliding_attention", second], sliding_window=64
        )
        model_class = transformers.LlamaForCausalLM
    elif kind == "linear_attention":
        config = transformers.Qwen3NextConfig(
            **COMMON,
            head_dim=64,
            layer_types=["linear_attention", "full_attention"],
            linear_num_key_heads=2,
            linear_num_value_heads=2,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
        )
        model_class = transformers.Qwen3NextForCausalLM
    else:
        config = transformers.GraniteMoeHybridConfig(
            **COMMON,
            layer_types=["mamba", "attention"],
            mamba_n_heads=4,
            mamba_d_head=32,
            mamba_d_state=16,
            mamba_n_groups=1,
            mamba_d_conv=4,
            mamba_expand=1,
            num_local_experts=0,
        )
        model_class = transformers.GraniteMoeHybridForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = model_class(config)
        with torch.no_grad():
            for name, weight in model.named_parameters():
                if name.endswith(RECURRENT_WEIGHTS):
                    weight.normal_(0, RECURRENT_STD)
                elif name.endswith("A_log"):
                    weight.fill_(SLOW_DECAY)
        model.save_pretrained(path, safe_serialization=True)
    return path


RECURRENT_WEIGHTS = ("conv1d.weight", "in_proj.weight", "out_proj.weight", "in_proj_qkvz.weight")
RECURRENT_STD = 0.2
SLOW_DECAY = -4.0
"""Random recurrent layers as initialised barely change the residual stream, and their
state decays ten-fold a token, so a state loaded at a chunk's end would not tell tokens
apart (zeroing it changed none); with these weights and a state kept for tens of tokens
(A = -exp(A_log)) it does."""
