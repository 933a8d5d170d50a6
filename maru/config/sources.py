"""Where a configuration's values come from, and the loading that merges them.

Precedence, highest first: explicit arguments > vLLM ``kv_connector_extra_config``
> ``MARU_*`` environment variables > a YAML/TOML/JSON file (``config_file`` or
``MARU_CONFIG``) > defaults. Every value remembers where it came from, so errors and
``maru config show`` can say.

The ``plugins`` section is read from every source first, before the rest is validated:
the plugin manager must know which plugins not to load before it loads the backends the
config is validated against. ``MARU_PLUGINS_BLOCK`` and ``MARU_PLUGINS_TRACE`` are its
variables (the plugin manager reads them too, in a process that reads no config).
"""

from __future__ import annotations

import difflib
import json
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from maru.config.model import (
    DEFAULT_SOURCE,
    Backends,
    MaruConfig,
    Path_,
    PluginSettings,
    config_errors,
    leaves,
    model_at,
    section_model,
    source_of,
    validate,
)
from maru.errors import ConfigError
from maru.log import get_logger
from maru.plugins import ENV_PLUGINS_BLOCK, ENV_PLUGINS_TRACE, get_plugin_manager

log = get_logger(__name__)

ENV_PREFIX = "MARU_"
ENV_CONFIG_FILE = "MARU_CONFIG"
ENV_NESTING = "__"
ENV_JSON_RE = re.compile(r"^\s*(\[|\{|null\s*$)")
"""Environment values that are JSON: lists, mappings and null (others stay strings)."""
ENV_ALIASES: dict[str, Path_] = {
    ENV_PLUGINS_BLOCK: ("plugins", "block"),
    ENV_PLUGINS_TRACE: ("plugins", "trace"),
}
"""Variables whose names do not nest by `__`: the plugin manager's own."""


@dataclass
class ResolvedConfig:
    """A validated config and the source of every value that was not a default."""

    config: MaruConfig
    sources: dict[Path_, str] = field(default_factory=dict)

    def source_of(self, path: Path_) -> str:
        """Where the value at `path` (or the section holding it) came from."""
        return source_of(self.sources, path)


class _Merger:
    """Deep-merges layers of raw settings, remembering the source of each leaf."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {}
        self.sources: dict[Path_, str] = {}

    def add(
        self,
        values: Mapping[str, Any],
        source: str | None = None,
        env_names: Mapping[Path_, str] | None = None,
    ) -> None:
        for path, value in leaves(values):
            target = self.data
            for part in path[:-1]:
                if not isinstance(target.get(part), dict):
                    target[part] = {}
                target = target[part]
            target[path[-1]] = value
            self.sources[path] = env_names[path] if env_names else source or DEFAULT_SOURCE


def _env_layer(
    env: Mapping[str, str], backends: Backends
) -> tuple[dict[str, Any], dict[Path_, str]]:
    """The `MARU_*` settings; an unknown variable is a warning, never an error, since a
    stray variable in a serving environment must not stop vLLM from starting."""
    values: dict[str, Any] = {}
    names: dict[Path_, str] = {}
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX) or name == ENV_CONFIG_FILE:
            continue
        path = _env_path(name)
        if not _known_path(backends, path):
            log.warning(
                "ignoring environment variable %s: maru has no such setting (the closest is %s)",
                name,
                _closest_env_name(backends, path),
            )
            continue
        target = values
        for part in path[:-1]:
            target = target.setdefault(part, {})
        target[path[-1]] = _env_value(value)
        names[path] = f"env {name}"
    return values, names


def _env_path(name: str) -> Path_:
    """The setting a `MARU_*` variable names: its alias's, else its parts split at `__`."""
    return ENV_ALIASES.get(name) or tuple(
        part.lower() for part in name[len(ENV_PREFIX) :].split(ENV_NESTING)
    )


def _env_value(text: str) -> Any:
    """A list, mapping or null written as JSON; anything else stays text for pydantic."""
    if ENV_JSON_RE.match(text):
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            pass  # validation then names the variable and its value
    return text


def _known_path(backends: Backends, path: Path_) -> bool:
    """Is `path` a setting: a top-level one, a backend's section, or a key inside one?"""
    if len(path) == 1:
        return path[0] in MaruConfig.model_fields or path[0] in backends
    model = model_at(backends, path[:-1])
    return model is not None and (
        path[-1] in model.model_fields or path[-1] in getattr(model, "renamed", {})
    )


def _closest_env_name(backends: Backends, path: Path_) -> str:
    """The variable of the known setting whose name is closest to `path` (an alias where
    the setting has one)."""
    aliases = {setting: name for name, setting in ENV_ALIASES.items()}
    known = [
        aliases.get(p, ENV_PREFIX + ENV_NESTING.join(p).upper()) for p in _setting_paths(backends)
    ]
    wanted = ENV_PREFIX + ENV_NESTING.join(path).upper()
    return (difflib.get_close_matches(wanted, known, n=1, cutoff=0) or sorted(known))[0]


def _setting_paths(backends: Backends) -> list[Path_]:
    """The path of every leaf setting: the top-level ones and those of every section."""
    paths = _model_paths(MaruConfig, ())
    for name, options in backends.items():
        paths.extend(_model_paths(options, (name,)))
    return paths


def _model_paths(model: type[BaseModel], prefix: Path_) -> list[Path_]:
    paths: list[Path_] = []
    for key in model.model_fields:
        nested = section_model(model, key)
        paths.extend(_model_paths(nested, (*prefix, key)) if nested else [(*prefix, key)])
    return paths


def read_config_file(path: Path, source: str) -> dict[str, Any]:
    """The mapping in a YAML, TOML or JSON file; ConfigError if it is not one."""
    where = f"config_file = {str(path)!r} (from {source})"
    suffix = path.suffix.lower()
    loaders = {
        ".yaml": yaml.safe_load,
        ".yml": yaml.safe_load,
        ".json": json.loads,
        ".toml": tomllib.loads,
    }
    if suffix not in loaders:
        raise ConfigError(
            f"{where}: unsupported file type {suffix or '(none)'!r}; "
            "allowed: .yaml, .yml, .toml, .json"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read it: {exc.strerror or exc}") from None
    try:
        data = loaders[suffix](text)
    except (yaml.YAMLError, json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{where}: not valid {suffix[1:].upper()}: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{where}: the top level must be a mapping of settings, got {type(data).__name__}"
        )
    return data


def _pick_config_file(
    overrides: Mapping[str, Any], extra: Mapping[str, Any], env: Mapping[str, str]
) -> tuple[Path, str] | None:
    for value, source in (
        (overrides.get("config_file"), "argument"),
        (extra.get("config_file"), "kv_connector_extra_config"),
        (env.get(ENV_CONFIG_FILE), f"env {ENV_CONFIG_FILE}"),
    ):
        if value:
            return Path(value).expanduser(), source
    return None


def resolve_config(
    config_file: str | os.PathLike[str] | None = None,
    *,
    extra_config: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    backends: Backends | None = None,
    **overrides: Any,
) -> ResolvedConfig:
    """Merge every source by precedence, validate against `backends` (default: the
    installed ones, once the plugin manager has applied the sources' `plugins` section),
    and keep each value's source."""
    env = os.environ if env is None else env
    extra = dict(extra_config or {})
    if config_file is not None:
        overrides["config_file"] = config_file
    merger = _Merger()
    chosen = _pick_config_file(overrides, extra, env)
    file_values = read_config_file(*chosen) if chosen else {}
    unloaded = ""
    if backends is None:
        backends, unloaded = _installed([file_values, _env_plugins(env), extra, overrides])
    if chosen:
        merger.add(file_values, f"file {chosen[0]}")
    env_values, env_names = _env_layer(env, backends)
    merger.add(env_values, env_names=env_names)
    merger.add(extra, "kv_connector_extra_config")
    merger.add(overrides, "argument")
    if chosen:
        merger.data["config_file"] = str(chosen[0])
        merger.sources[("config_file",)] = chosen[1]
    with config_errors(backends, merger.sources):
        return ResolvedConfig(validate(merger.data, backends, unloaded), merger.sources)


def _env_plugins(env: Mapping[str, str]) -> dict[str, Any]:
    """The `plugins` section the `MARU_*` variables give."""
    section: dict[str, Any] = {}
    for name, value in env.items():
        path = _env_path(name) if name.startswith(ENV_PREFIX) else ()
        if len(path) == 2 and path[0] == "plugins":
            section[path[1]] = _env_value(value)
    return {"plugins": section}


def _installed(layers: list[Mapping[str, Any]]) -> tuple[Backends, str]:
    """The installed backends and which plugins did not load, once the process-wide plugin
    manager has applied the `plugins` section of `layers` (lowest precedence first)."""
    section: dict[str, Any] = {}
    for layer in layers:
        values = layer.get("plugins")
        if isinstance(values, Mapping):
            section.update(values)
    try:
        settings = PluginSettings.model_validate(section)
    except ValidationError:
        settings = PluginSettings()  # validating the whole config reports it, with its source
    manager = get_plugin_manager(settings.block, trace=settings.trace)
    return manager.backend_options, manager.unloaded_note()


def load_config(
    config_file: str | os.PathLike[str] | None = None,
    *,
    extra_config: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    backends: Backends | None = None,
    **overrides: Any,
) -> MaruConfig:
    """The validated MaruConfig from arguments, vLLM extra config, env and file."""
    return resolve_config(
        config_file, extra_config=extra_config, env=env, backends=backends, **overrides
    ).config
