"""The configuration model: `MaruConfig`, its backend sections, and what a bad value is.

Each backend's options live in a section named after the backend, validated by that
backend's own ``Options`` model. Which backends exist is an input of validation, never
read inside a validator: the pydantic validation context carries it under
``BACKENDS_CONTEXT`` as a mapping of backend name to ``Options`` class. The public
entry points (``MaruConfig(...)``, ``MaruConfig.model_validate``,
``model_validate_json`` and, in ``maru.config.sources``, ``resolve_config`` and
``load_config``) take it as ``backends=`` or, by default, from the plugin manager,
which also says, under ``UNLOADED_CONTEXT``, which plugins did not load (so a backend
that is not installed can be explained).
Every invalid input is one ``ConfigError`` naming the field, the value, its source
where known, and what is allowed.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from maru.errors import ConfigError
from maru.plugins import (
    DEFAULT_BACKEND,
    ENV_PLUGINS_BLOCK,
    ENV_PLUGINS_TRACE,
    get_plugin_manager,
    options_model,
    plugin_names,
)
from maru.sizes import Size

DEFAULT_SOURCE = "default"
BACKENDS_CONTEXT = "backends"
"""Key of the validation context that holds the installed backends' Options by name."""
UNLOADED_CONTEXT = "unloaded_plugins"
"""Key of the validation context that says which plugins failed to load or are blocked."""
SECRET_KEY_RE = re.compile(r"(^|_)(password|secret|token)$", re.IGNORECASE)
Path_ = tuple[str, ...]
Backends = Mapping[str, type[BaseModel]]
"""The backends a config is validated against: each name and its Options model."""


class Options(BaseModel):
    """Base for a backend's options section: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    renamed: ClassVar[dict[str, str]] = {}
    """Keys the section still accepts under an old name, old -> new (its validator
    warns); `MARU_*` variables may use the old name too."""


class PluginSettings(BaseModel):
    """The `plugins:` section: which plugins not to load, and whether to log hook calls.

    `load_config` (so the vLLM connector and the `maru` command) applies it before any
    plugin loads; a `MaruConfig(...)` built directly is validated against the plugins
    loaded already. `MARU_PLUGINS_BLOCK` and `MARU_PLUGINS_TRACE` apply to every
    process, before any config is read.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    block: tuple[str, ...] = Field(
        (),
        description="entry point names of plugins never to load (a list, or comma-separated "
        f"text as in {ENV_PLUGINS_BLOCK})",
    )
    trace: bool = Field(
        False, description=f"log every plugin hook call and its answer (as {ENV_PLUGINS_TRACE}=1)"
    )

    @field_validator("block", mode="before")
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        return plugin_names(value) if isinstance(value, str) else value


def _installed_context() -> dict[str, Any]:
    """A validation context of the installed backends' Options models and of the plugins
    that did not load, from the process-wide plugin manager."""
    manager = get_plugin_manager()
    return {BACKENDS_CONTEXT: manager.backend_options, UNLOADED_CONTEXT: manager.unloaded_note()}


def _context(context: Mapping[str, Any] | None, backends: Backends | None) -> dict[str, Any]:
    """A validation context naming the backends: `backends`, else those `context` names,
    else the installed ones."""
    context = dict(context or {})
    if backends is not None:
        context[BACKENDS_CONTEXT] = backends
    elif context.get(BACKENDS_CONTEXT) is None:
        context.update(_installed_context())
    return context


@contextmanager
def config_errors(backends: Backends, sources: Mapping[Path_, str] | None = None) -> Iterator[None]:
    """Turn a ValidationError inside the block into the ConfigError that explains it."""
    try:
        yield
    except ValidationError as exc:
        raise config_error(exc, backends, sources) from None


def validate(data: Any, backends: Backends, unloaded: str = "") -> MaruConfig:
    """`data` validated against `backends` (`unloaded`: why some may be missing);
    ValidationError if it is bad."""
    return MaruConfig.__pydantic_validator__.validate_python(
        data, context={BACKENDS_CONTEXT: backends, UNLOADED_CONTEXT: unloaded}
    )


def _context_backends(info: ValidationInfo) -> Backends:
    """The backends in the validation context; an error if the caller gave none."""
    backends = (info.context or {}).get(BACKENDS_CONTEXT)
    if backends is None:
        raise PydanticCustomError(
            "backends_missing",
            "MaruConfig is validated against a set of backends; allowed: MaruConfig(...), "
            "MaruConfig.model_validate(..., backends=...) or a validation context with "
            f"{BACKENDS_CONTEXT!r} mapping backend names to their Options models",
        )
    return backends


def _line_errors(exc: ValidationError, prefix: Path_ = ()) -> list[InitErrorDetails]:
    """`exc`'s errors, their locations under `prefix`, ready to be raised again."""
    return [
        InitErrorDetails(
            type=PydanticCustomError(error["type"], error["msg"]),
            loc=(*prefix, *error["loc"]),
            input=error["input"],
        )
        for error in exc.errors()
    ]


class MaruConfig(BaseModel):
    """Maru's configuration: the settings below and one section per backend.

    A section holds that backend's validated Options, or None when not given; read it
    as an attribute (`config.shm`) or with `backend_options`.
    """

    model_config = ConfigDict(extra="allow", frozen=True)

    backend: str = Field(DEFAULT_BACKEND, description="name of the storage backend")
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
    producer_loads: bool = Field(
        False,
        description="with vLLM's kv_role kv_producer, also load what the store holds "
        "(a producer saves only, by default)",
    )
    consumer_wait: float = Field(
        10.0,
        ge=0,
        description="with kv_role kv_consumer, seconds a request waits for the objects its "
        "producer named (kv_transfer_params) to be stored before computing them",
    )
    async_loads: Literal["auto", "always", "never"] = Field(
        "auto",
        description="load a hit in the background (vLLM parks its request, others decode): "
        "auto where its objects are on a slow tier (disk, remote; a tiered store's lower "
        "tiers), always, or never (every load inside the engine's step)",
    )
    slow_hits: Literal["auto", "when_faster", "always"] = Field(
        "auto",
        description="load a hit on a slow tier: when_faster (only where its load is "
        "expected to end before vLLM would compute the same tokens; both rates are learned "
        "as the engine runs), always, or auto (always for kv_role kv_consumer, which must "
        "load what its producer computed; else when_faster)",
    )
    async_load_timeout: float = Field(
        10.0,
        gt=0,
        description="seconds a request's background load may take, plus one per 100 MiB it "
        "reads, before it counts as failed and vLLM recomputes",
    )
    kv_cache_huge_pages: bool = Field(
        True,
        description="move a CPU KV cache onto 2 MiB pages at start-up: copies into it run "
        "up to a fifth faster, for 0.7-3 s per GiB of cache, once",
    )
    config_file: Path | None = Field(None, description="YAML, TOML or JSON file to read")
    plugins: PluginSettings = Field(
        default_factory=PluginSettings, description="plugins not to load; hook call tracing"
    )

    def __init__(self, /, **data: Any) -> None:
        """Validate `data` against the installed backends; ConfigError if it is bad."""
        context = _installed_context()
        with config_errors(context[BACKENDS_CONTEXT]):
            self.__pydantic_validator__.validate_python(data, self_instance=self, context=context)

    # Like BaseModel's own __init__, this one only validates into `self`; the marker tells
    # pydantic so, and model_validate then validates directly, keeping its context.
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]

    @classmethod
    def model_validate(
        cls,
        obj: Any,
        *,
        backends: Backends | None = None,
        context: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> MaruConfig:
        """Validate `obj` against `backends` (default: the installed ones); ConfigError
        if it is bad."""
        context = _context(context, backends)
        with config_errors(context[BACKENDS_CONTEXT]):
            return super().model_validate(obj, context=context, **kwargs)

    @classmethod
    def model_validate_json(
        cls,
        json_data: str | bytes | bytearray,
        *,
        backends: Backends | None = None,
        context: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> MaruConfig:
        """`model_validate` for JSON text."""
        context = _context(context, backends)
        with config_errors(context[BACKENDS_CONTEXT]):
            return super().model_validate_json(json_data, context=context, **kwargs)

    @model_validator(mode="wrap")
    @classmethod
    def _sections(
        cls, data: Any, handler: ValidatorFunctionWrapHandler, info: ValidationInfo
    ) -> Any:
        """Validate each backend section by its backend's Options, refuse unknown keys,
        and report every problem of the settings and the sections at once."""
        if not isinstance(data, Mapping):
            return handler(data)
        backends = _context_backends(info)
        settings = {key: value for key, value in data.items() if key in cls.model_fields}
        sections, errors = _validated_sections(data, cls.model_fields, backends)
        try:
            config = handler({**settings, **sections})
        except ValidationError as exc:
            errors = _line_errors(exc) + errors
        if errors:
            raise ValidationError.from_exception_data(cls.__name__, errors)
        # Every section is stored (None where absent) but only those given count as set.
        absent = {name for name in sections if name not in data}
        object.__setattr__(config, "__pydantic_fields_set__", config.model_fields_set - absent)
        return config

    @field_validator("backend")
    @classmethod
    def _backend_installed(cls, name: str, info: ValidationInfo) -> str:
        installed = _context_backends(info)
        if name not in installed:
            unloaded = (info.context or {}).get(UNLOADED_CONTEXT)
            raise PydanticCustomError(
                "backend_not_installed",
                f"no backend named {name!r} is installed; allowed: {', '.join(sorted(installed))}"
                + (f"; {unloaded}" if unloaded else ""),
            )
        return name

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
        """The validated options section of backend `name` (default: the selected one),
        or that installed backend's default Options when the config has none."""
        name = name or self.backend
        section = (self.model_extra or {}).get(name)
        if section is not None:
            return section
        return options_model(get_plugin_manager().provided_backend(name))()


def _validated_sections(
    data: Mapping[Any, Any], settings: Mapping[str, Any], backends: Backends
) -> tuple[dict[str, BaseModel | None], list[InitErrorDetails]]:
    """Every backend's section of `data`, validated (None where absent), and the errors
    of the bad sections and of the keys that are neither a setting nor a backend."""
    sections: dict[str, BaseModel | None] = dict.fromkeys(backends)
    errors: list[InitErrorDetails] = []
    for key, value in data.items():
        if key in settings:
            continue
        if key not in backends:
            errors.append(
                InitErrorDetails(
                    type=PydanticCustomError("extra_forbidden", "Extra inputs are not permitted"),
                    loc=(str(key),),
                    input=value,
                )
            )
            continue
        try:
            sections[key] = None if value is None else backends[key].model_validate(value)
        except ValidationError as exc:
            errors.extend(_line_errors(exc, (key,)))
    return sections, errors


def source_of(sources: Mapping[Path_, str], path: Path_) -> str:
    """The source of the value at `path`, of the section above it, or of what is inside it."""
    for end in range(len(path), 0, -1):
        if path[:end] in sources:
            return sources[path[:end]]
    inside = sorted({source for key, source in sources.items() if key[: len(path)] == path})
    return ", ".join(inside) or DEFAULT_SOURCE


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


def section_model(model: type[BaseModel], key: str) -> type[BaseModel] | None:
    """The model of the mapping field `key` of `model`, if it is one."""
    annotation = model.model_fields[key].annotation if key in model.model_fields else None
    nested = [
        a
        for a in getattr(annotation, "__args__", (annotation,))
        if isinstance(a, type) and issubclass(a, BaseModel)
    ]
    return nested[0] if nested else None


def model_at(backends: Backends, path: Path_) -> type[BaseModel] | None:
    """The model of the mapping at `path` below the top level: a backend's Options, a
    setting's model (`plugins`), or a model nested in one; None if `path` names no mapping."""
    model = backends.get(path[0]) or section_model(MaruConfig, path[0])
    for part in path[1:]:
        if model is None:
            return None
        model = section_model(model, part)
    return model


def shown_value(path: Path_, value: Any) -> Any:
    """`value`, or a mask if the key at `path` holds a secret."""
    return "***" if path and SECRET_KEY_RE.search(path[-1]) and value else value


def config_error(
    exc: ValidationError, backends: Backends, sources: Mapping[Path_, str] | None = None
) -> ConfigError:
    """One ConfigError naming each bad field, its value, its source (when `sources`
    knows them) and what is allowed."""
    problems = []
    for error in exc.errors():
        path = tuple(str(part) for part in error["loc"])
        message = error["msg"]
        if error["type"] == "extra_forbidden":
            message = f"unknown key; allowed: {_allowed_keys(backends, path[:-1])}"
        value = shown_value(path, error["input"])
        where = f" (from {source_of(sources, path)})" if sources is not None else ""
        problems.append(f"{'.'.join(path) or '(top level)'} = {value!r}{where}: {message}")
    return ConfigError("invalid maru config: " + "; ".join(problems))


def _allowed_keys(backends: Backends, path: Path_) -> str:
    if not path:
        return (
            f"{', '.join(MaruConfig.model_fields)} and the sections of installed "
            f"backends ({', '.join(backends) or 'none'})"
        )
    model = model_at(backends, path)
    return ", ".join(model.model_fields) if model and model.model_fields else "(none)"
