"""An instance as a `vllm serve` command line would start it, resolved by vLLM itself
(for `maru doctor`, which compares it with the namespaces a store holds)."""

from __future__ import annotations

import logging
from typing import Any

from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import init_none_hash

from maru.config import MaruConfig
from maru.errors import ConfigError, MaruError
from maru.vllm.compat import vllm_version
from maru.vllm.identity import hash_seed_advice, kv_identity, model_identity, namespace_record


def expected_record(vllm_config: Any, config: MaruConfig) -> tuple[dict[str, Any], str | None]:
    """The namespace record the scheduler half would write (its layout and KV cache
    groups still unknown),
    and what would make block hashes match across processes, if they cannot."""
    init_none_hash(get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo))
    model = vllm_config.model_config
    model_id = model_identity(model.model, model.revision)
    identity = kv_identity(vllm_config, config, "", model_id, [])
    return namespace_record(vllm_config, config, identity), hash_seed_advice(vllm_config)


def vllm_config_from_command(command: list[str]) -> Any:
    """vLLM's configuration for a `vllm serve MODEL ...` command line (the leading `vllm
    serve` may be left out), resolved by vLLM itself."""
    words = list(command)
    for word in ("vllm", "serve"):
        if words and words[0] == word:
            words.pop(0)
    try:
        parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="vllm serve"))
    except Exception as exc:  # e.g. a CUDA build of vLLM on a machine without a GPU
        raise MaruError(
            f"vLLM {vllm_version()} cannot build its configuration on this "
            f"machine ({type(exc).__name__}: {exc}); run maru doctor where the "
            "instance runs"
        ) from exc
    parser.add_argument("model_tag", nargs="?")
    parser.error = _command_line_error  # type: ignore[method-assign]
    args = parser.parse_args(words)
    engine_args = EngineArgs.from_cli_args(args)
    if args.model_tag:
        engine_args.model = args.model_tag
    disabled = logging.root.manager.disable
    logging.disable(logging.WARNING)  # vLLM logs to stdout, where --json goes
    try:
        return engine_args.create_engine_config()
    except Exception as exc:
        raise ConfigError(
            f"vLLM command line {' '.join(command)!r}: vLLM says: {type(exc).__name__}: {exc}"
        ) from exc
    finally:
        logging.disable(disabled)


def _command_line_error(message: str) -> None:
    raise ConfigError(f"vLLM command line: {message}; allowed: what `vllm serve` takes")
