"""What identifies a chunk's bytes: the model's weights, dtypes, layout, sizes, the hash
scheme and its seed. Their digest is part of every key (`maru.vllm.keys`), so instances
share exactly when their chunks are the same bytes.

The model is identified by its weights, never just its path: the same weights at two
paths must share chunks, and different weights at one path (a directory updated in
place, a `latest` symlink) must never: that would load KV computed by other weights,
and give wrong tokens. A model directory (a local one, or the hub snapshot vLLM loads)
is identified by a digest of its configuration file and, per weight file, its name,
size and a few sampled windows of its bytes: cheap at start-up (a few hundred KiB read
per file), and weights trained further differ in every window. A hub model that is not
in the local cache falls back to its name and revision.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from maru.config import MaruConfig
from maru.log import get_logger
from maru.vllm.compat import release, vllm_version

log = get_logger(__name__)

CONFIG_FILES = ("config.json",)
"""What shapes the KV besides the weights (architecture, RoPE, dtypes)."""
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
INDEX_SUFFIX = ".index.json"
SAMPLES_PER_FILE = 4
SAMPLE_BYTES = 64 * 1024


def model_identity(model: str, revision: str | None = None) -> str:
    """A short digest of the weights `model` names (a directory or a hub id)."""
    directory = Path(model) if Path(model).is_dir() else hub_snapshot(model, revision)
    if directory is None:
        return f"name:{model}@{revision or 'default'}"
    return "weights:" + directory_digest(directory)


def directory_digest(directory: Path) -> str:
    """Digest of a model directory's configuration and sampled weight files."""
    digest = hashlib.sha256()
    files = sorted(p for p in directory.iterdir() if p.is_file())
    for path in files:
        name = path.name
        if name in CONFIG_FILES or name.endswith(INDEX_SUFFIX):
            digest.update(f"{name}\0".encode() + path.read_bytes())
        elif name.endswith(WEIGHT_SUFFIXES):
            digest.update(f"{name}\0{path.stat().st_size}\0".encode() + sampled(path))
    return digest.hexdigest()[:32]


def sampled(path: Path) -> bytes:
    """Windows of a file's bytes spread over it, first and last included."""
    size = path.stat().st_size
    last = max(size - SAMPLE_BYTES, 0)
    offsets = sorted({last * i // (SAMPLES_PER_FILE - 1) for i in range(SAMPLES_PER_FILE)})
    with path.open("rb") as file:
        windows = []
        for offset in offsets:
            file.seek(offset)
            windows.append(file.read(SAMPLE_BYTES))
    return b"".join(windows)


def hub_snapshot(model: str, revision: str | None) -> Path | None:
    """The local snapshot directory of a hub model, if it is in the cache."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(model, "config.json", revision=revision)
    except Exception as exc:  # a malformed id is not ours to judge; vLLM will say
        log.debug("no hub snapshot for %s: %s", model, exc)
        return None
    return Path(found).parent if isinstance(found, str) else None


def kv_identity(
    vllm_config: Any, config: MaruConfig, layout: str, model_id: str, groups: list[str]
) -> dict[str, Any]:
    """Everything besides the token hashes that changes the bytes of a chunk; the model
    by what identifies its weights (`model_identity`), not by its path; the KV cache
    groups by their signatures (`maru.vllm.groups`).

    Not the vLLM release: releases whose hashes and pages agree share. A release that
    hashes blocks differently makes other keys (and its seed, NONE_HASH, is here); one
    that lays pages out differently has another layout fingerprint."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    return {
        "model": model_id,
        "dtype": str(model.dtype),
        "kv_dtype": str(cache.cache_dtype),
        "layout": layout,
        "kv_groups": groups,
        "block_size": cache.block_size,
        "chunk_tokens": config.chunk_tokens,
        "tp_size": vllm_config.parallel_config.tensor_parallel_size,
        "pp_size": vllm_config.parallel_config.pipeline_parallel_size,
        "hash_algorithm": getattr(cache, "prefix_caching_hash_algo", "unknown"),
        "hash_seed": none_hash_hex(),
    }


def namespace_record(
    vllm_config: Any, config: MaruConfig, identity: dict[str, Any]
) -> dict[str, Any]:
    """A namespace's record (`maru.vllm.records`): its identity, its tenant, whether its
    block-hash seed is the same in every process, and the vLLM release."""
    return identity | {
        "vllm": vllm_version(),
        "namespace": config.namespace,
        "hash_seed_shared": hash_seed_advice(vllm_config) is None,
    }


def none_hash_hex() -> str:
    """vLLM's NONE_HASH, the seed of every block hash chain (empty if not set yet)."""
    try:
        from vllm.v1.core import kv_cache_utils
    except ImportError:
        return ""
    return bytes(getattr(kv_cache_utils, "NONE_HASH", b"")).hex()


def hash_seed_advice(vllm_config: Any) -> str | None:
    """What makes block hashes match across processes here, if they cannot yet (None)."""
    if os.environ.get("PYTHONHASHSEED") is not None:
        return None
    algorithm = str(getattr(vllm_config.cache_config, "prefix_caching_hash_algo", ""))
    version = release()
    if version is not None and version < (0, 29):
        return (
            "set PYTHONHASHSEED to one value everywhere (before vLLM 0.29 every "
            "algorithm takes its seed from it)"
        )
    if algorithm.startswith("xxhash"):
        return "set PYTHONHASHSEED to one value everywhere, or use a sha256 algorithm"
    return None


def warn_if_hash_seed_is_per_process(vllm_config: Any) -> None:
    """Say once when block hashes cannot match across processes, and what fixes it here."""
    advice = hash_seed_advice(vllm_config)
    if advice is None:
        return
    algorithm = str(getattr(vllm_config.cache_config, "prefix_caching_hash_algo", ""))
    log.warning(
        "maru: vLLM's block-hash seed is random per process here (hash %s, vLLM %s, "
        "no PYTHONHASHSEED), so other instances can never hit this one's chunks; %s",
        algorithm,
        vllm_version(),
        advice,
    )
