"""Maru's configuration: one pydantic model, loaded from arguments, vLLM, env and a file.

Precedence, highest first: explicit arguments > vLLM ``kv_connector_extra_config``
> ``MARU_*`` environment variables > a YAML/TOML/JSON file (``config_file`` or
``MARU_CONFIG``) > defaults. Each backend's options live in a section named after
the backend and are validated by that backend's own ``Options`` model. Every
value remembers where it came from, so errors and ``maru config show`` can say.
"""

from __future__ import annotations

import difflib
import functools
import json
import logging
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    create_model,
    field_validator,
)
from pydantic_core import PydanticCustomError

from maru.errors import ConfigError
from maru.sizes import Size

ENV_PREFIX = "MARU_"
ENV_CONFIG_FILE = "MARU_CONFIG"
ENV_NESTING = "__"
DEFAULT_SOURCE = "default"
SECRET_KEY_RE = re.compile(r"(^|_)(password|secret|token)$", re.IGNORECASE)
ENV_JSON_RE = re.compile(r"^\s*(\[|\{|null\s*$)")
"""Environment values that are JSON: lists, mappings and null (others stay strings)."""

log = logging.getLogger(__name__)

class Options(BaseModel):
    """Base for a backend's options section: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class MaruConfig(BaseModel):
    """Maru's configuration. Backend sections are added per installed backend."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: str = Field("shm", description="name of the storage backend")
    namespace: str = Field(
        "default",
        pattern=r"^[A-Za-z0-9._:-]{1,64}$",
        description="prefix that separates tenants sharing one store",
    )
    capacity: Size = Field(4 * 2**30, description="bytes the store may hold")
    chunk_tokens: int = Field(256, gt=0, description="tokens per stored object")
    error_backoff: float = Field(
        10.0, ge=0, description="seconds the vLLM connector skips the store after an error"
    )
    config_file: Path | None = Field(None, description="YAML, TOML or JSON file to read")

    installed_backends: ClassVar[tuple[str, ...] | None] = None

    @field_validator("backend")
    @classmethod
    def _backend_installed(cls, name: str) -> str:
        installed = cls.installed_backends
        if installed is None:
            from maru.plugins import get_plugin_manager

            installed = tuple(get_plugin_manager().backends)
        if name not in installed:
            raise PydanticCustomError(
                "backend_not_installed",
                f"no backend named {name!r} is installed; allowed: {', '.join(sorted(installed))}",
            )
        return name

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> MaruConfig:
        """Validate, with the sections of the installed backends when called on MaruConfig."""
        model = config_model() if cls is MaruConfig else cls
        return super(MaruConfig, model).model_validate(obj, **kwargs)

    @classmethod
    def model_validate_json(cls, json_data: str | bytes, **kwargs: Any) -> MaruConfig:
        """`model_validate` for JSON text."""
        model = config_model() if cls is MaruConfig else cls
        return super(MaruConfig, model).model_validate_json(json_data, **kwargs)

    def __reduce__(self) -> tuple[Any, tuple[dict[str, Any]]]:
        """Pickle as data: the class with backend sections is made per process."""
        return MaruConfig.model_validate, (self.model_dump(),)

    def portable(self) -> dict[str, Any]:
        """JSON-ready settings, secrets included, for handing this config to another
        process (e.g. vLLM's `kv_connector_extra_config`); `model_dump(mode="json")`
        masks secrets, which is right only for showing them."""
        data = self.model_dump(mode="json", exclude_none=True, exclude={"config_file"})
        for path, value in leaves(self.model_dump(exclude_none=True, exclude={"config_file"})):
            if isinstance(value, SecretStr):
                target = data
                for part in path[:-1]:
                    target = target[part]
                target[path[-1]] = value.get_secret_value()
        return data

    def backend_options(self, name: str | None = None) -> BaseModel:
        """The validated options section of backend `name` (default: the selected one)."""
        name = name or self.backend
        section = getattr(self, name, None) if name in type(self).model_fields else None
        if section is not None:
            return section
        from maru.plugins import get_plugin_manager

        return get_plugin_manager().backend(name).Options()


@functools.cache
def _config_model(backends: tuple[tuple[str, type[BaseModel]], ...]) -> type[MaruConfig]:
    sections: dict[str, Any] = {name: (opts | None, None) for name, opts in backends}
    model = create_model("MaruConfig", __base__=MaruConfig, **sections)
    model.installed_backends = tuple(name for name, _ in backends)
    return model


def config_model() -> type[MaruConfig]:
    """MaruConfig with one optional section per installed backend."""
    from maru.plugins import get_plugin_manager

    backends = get_plugin_manager().backends
    return _config_model(tuple((name, p.cls.Options) for name, p in backends.items()))


Path_ = tuple[str, ...]


@dataclass
class ResolvedConfig:
    """A validated config and the source of every value that was not a default."""

    config: MaruConfig
    sources: dict[Path_, str] = field(default_factory=dict)

    def source_of(self, path: Path_) -> str:
        """Where the value at `path` (or the section holding it) came from."""
        return source_of(self.sources, path)


def source_of(sources: Mapping[Path_, str], path: Path_) -> str:
    """The source of the value at `path`, of the section above it, or of what is inside it."""
    for end in range(len(path), 0, -1):
        if path[:end] in sources:
            return sources[path[:end]]
    inside = sorted({source for key, source in sources.items() if key[: len(path)] == path})
    return ", ".join(inside) or DEFAULT_SOURCE


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


def leaves(values: Mapping[str, Any], prefix: Path_ = ()) -> list[tuple[Path_, Any]]:
    """Every (path, value) under nested mappings; an empty mapping is a value."""
    found: list[tuple[Path_, Any]] = []
    for key, value in values.items():
        path = (*prefix, str(key))
        if isinstance(value, Mapping) and value:
            found.extend(leaves(value, path))
        else:
            found.append((path, value))
    return found


def _env_layer(
    env: Mapping[str, str], model: type[BaseModel]
) -> tuple[dict[str, Any], dict[Path_, str]]:
    """The `MARU_*` settings; an unknown variable is a warning, never an error, since a
    stray variable in a serving environment must not stop vLLM from starting."""
    values: dict[str, Any] = {}
    names: dict[Path_, str] = {}
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX) or name == ENV_CONFIG_FILE:
            continue
        path = tuple(part.lower() for part in name[len(ENV_PREFIX) :].split(ENV_NESTING))
        if not _known_path(model, path):
            log.warning("ignoring environment variable %s: maru has no such setting "
                        "(the closest is %s)", name, _closest_env_name(model, path))
            continue
        target = values
        for part in path[:-1]:
            target = target.setdefault(part, {})
        target[path[-1]] = _env_value(value)
        names[path] = f"env {name}"
    return values, names


def _env_value(text: str) -> Any:
    """A list, mapping or null written as JSON; anything else stays text for pydantic."""
    if ENV_JSON_RE.match(text):
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            pass  # validation then names the variable and its value
    return text


def _section_model(model: type[BaseModel], key: str) -> type[BaseModel] | None:
    """The model of the mapping field `key` of `model`, if it is one."""
    annotation = model.model_fields[key].annotation if key in model.model_fields else None
    nested = [
        a
        for a in getattr(annotation, "__args__", (annotation,))
        if isinstance(a, type) and issubclass(a, BaseModel)
    ]
    return nested[0] if nested else None


def _known_path(model: type[BaseModel], path: Path_) -> bool:
    for part in path[:-1]:
        nested = _section_model(model, part)
        if nested is None:
            return False
        model = nested
    return path[-1] in model.model_fields


def _closest_env_name(model: type[BaseModel], path: Path_) -> str:
    """The variable of the known setting whose name is closest to `path`."""
    known = {ENV_NESTING.join(p).upper(): p for p in _setting_paths(model)}
    wanted = ENV_NESTING.join(path).upper()
    closest = difflib.get_close_matches(wanted, known, n=1, cutoff=0) or sorted(known)
    return ENV_PREFIX + closest[0]


def _setting_paths(model: type[BaseModel], prefix: Path_ = ()) -> list[Path_]:
    paths: list[Path_] = []
    for key in model.model_fields:
        nested = _section_model(model, key)
        paths.extend(_setting_paths(nested, (*prefix, key)) if nested else [(*prefix, key)])
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
    **overrides: Any,
) -> ResolvedConfig:
    """Merge every source by precedence, validate, and keep each value's source."""
    env = os.environ if env is None else env
    extra = dict(extra_config or {})
    if config_file is not None:
        overrides["config_file"] = config_file
    merger = _Merger()
    chosen = _pick_config_file(overrides, extra, env)
    if chosen:
        path, source = chosen
        merger.add(read_config_file(path, source), f"file {path}")
    model = config_model()
    env_values, env_names = _env_layer(env, model)
    merger.add(env_values, env_names=env_names)
    merger.add(extra, "kv_connector_extra_config")
    merger.add(overrides, "argument")
    if chosen:
        merger.data["config_file"] = str(chosen[0])
        merger.sources[("config_file",)] = chosen[1]
    try:
        config = model.model_validate(merger.data)
    except ValidationError as exc:
        raise config_error(exc, model, merger.sources) from None
    return ResolvedConfig(config, merger.sources)


def load_config(
    config_file: str | os.PathLike[str] | None = None,
    *,
    extra_config: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    **overrides: Any,
) -> MaruConfig:
    """The validated MaruConfig from arguments, vLLM extra config, env and file."""
    return resolve_config(config_file, extra_config=extra_config, env=env, **overrides).config


def shown_value(path: Path_, value: Any) -> Any:
    """`value`, or a mask if the key at `path` holds a secret."""
    return "***" if path and SECRET_KEY_RE.search(path[-1]) and value else value


def config_error(
    exc: ValidationError, model: type[BaseModel], sources: Mapping[Path_, str]
) -> ConfigError:
    """One ConfigError naming each bad field, its value, its source and what is allowed."""
    problems = []
    for error in exc.errors():
        path = tuple(str(part) for part in error["loc"])
        message = error["msg"]
        if error["type"] == "extra_forbidden":
            message = f"unknown key; allowed: {_allowed_keys(model, path[:-1])}"
        value = shown_value(path, error["input"])
        problems.append(
            f"{'.'.join(path) or '(top level)'} = {value!r} "
            f"(from {source_of(sources, path)}): {message}"
        )
    return ConfigError("invalid maru config: " + "; ".join(problems))


def _allowed_keys(model: type[BaseModel], path: Path_) -> str:
    for part in path:
        nested = _section_model(model, part)
        if nested is None:
            return "(none)"
        model = nested
    keys = ", ".join(model.model_fields)
    if not path and getattr(model, "installed_backends", None) is not None:
        return (
            f"{', '.join(MaruConfig.model_fields)} and the sections of installed "
            f"backends ({', '.join(model.installed_backends)})"
        )
    return keys or "(none)"
