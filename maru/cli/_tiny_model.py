"""A random-weight Llama checkpoint written to disk, for real vLLM engines in tests,
benchmarks and the demo: no download, no tokenizer (engines take token-id prompts)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

_MARKER = "maru-tiny-llama.json"
"""Sidecar file recording the arguments a tiny model was built with (for idempotency)."""


def build_tiny_llama(
    path: str | os.PathLike[str],
    *,
    layers: int = 2,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 64,
    vocab: int = 512,
    intermediate: int = 256,
    max_positions: int = 4096,
    seed: int = 0,
) -> Path:
    """Write a random-weight bf16 Llama model (config + safetensors) to `path`.

    Idempotent: if `path` already holds a model built with the same arguments it is
    left alone, so tests can share one directory. `head_dim` must be a head size the
    vLLM CPU attention backend supports (32, 64, 80, 96, 112, 128, ...; not 16).
    """
    path = Path(path)
    spec = {
        "layers": layers,
        "hidden": hidden,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "vocab": vocab,
        "intermediate": intermediate,
        "max_positions": max_positions,
        "seed": seed,
    }
    if _tiny_model_matches(path, spec):
        return path
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")

    import torch  # here, not at the top: the idempotent path should cost nothing
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    # Build under the same parent and move in, so a concurrent or interrupted build
    # never leaves a half-written model that the marker vouches for.
    path.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tiny-llama-", dir=path.parent))
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = LlamaForCausalLM(config).to(torch.bfloat16)
        model.save_pretrained(staging, safe_serialization=True)
        (path / _MARKER).unlink(missing_ok=True)
        for item in staging.iterdir():
            item.chmod(0o644)  # mkdtemp/mkstemp modes are owner-only
            os.replace(item, path / item.name)
        (path / _MARKER).write_text(json.dumps(spec, sort_keys=True))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def _tiny_model_matches(path: Path, spec: dict[str, int]) -> bool:
    """Whether `path` holds a complete tiny model built from exactly `spec`."""
    try:
        recorded = json.loads((path / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    has_weights = any(path.glob("*.safetensors"))
    return recorded == spec and (path / "config.json").is_file() and has_weights


def add_word_tokenizer(path: str | os.PathLike[str], vocab: int) -> Path:
    """Give the model at `path` a tokenizer of `vocab` words split on spaces (<pad>, <s>,
    </s>, then "w3", "w4", ...): text made of its tokens encodes back to the same ids,
    so clients that send text (`vllm bench serve`) send exactly the prompts they made.
    Idempotent."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    path = Path(path)
    if (path / "tokenizer.json").is_file():
        return path
    special = {"<pad>": 0, "<s>": 1, "</s>": 2}
    words = special | {f"w{i}": i for i in range(len(special), vocab)}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": "<pad>",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<pad>",
        "model_max_length": 1 << 20,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path
