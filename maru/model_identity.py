"""What identifies a model's weights, for the key namespace: never just its path.

The same weights at two paths must share chunks, and different weights at one
path (a directory updated in place, a `latest` symlink) must never: that would
load KV computed by other weights, and give wrong tokens. A model directory (a
local one, or the hub snapshot vLLM loads) is identified by a digest of its
configuration file and, per weight file, its name, size and a few sampled
windows of its bytes: cheap at start-up (a few hundred KiB read per file), and
weights trained further differ in every window. A hub model that is not in the
local cache falls back to its name and revision.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

log = logging.getLogger("maru.model_identity")

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
