"""The plugin manager: built-in plugins plus third-party entry points (group ``maru``).

Entry points are loaded once, on first use. Built-ins go through the same hooks
as third-party plugins; every backend and layout adapter is attributed to the
distribution that provides it, so conflicts and `maru info` can name it.

This module sits below the backends: it names the classes plugins provide and
checks their pydantic ``Options`` model, which configs are validated by; that a
backend class is a ``Backend`` is checked above it, in ``maru.backends.registry``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import pluggy
from pydantic import BaseModel

from maru import hookspecs
from maru.errors import ConfigError, PluginError

BUILTIN_PLUGINS = (
    "maru.backends.mock",
    "maru.backends.shm",
    "maru.backends.cxl",
    "maru.backends.disk",
    "maru.backends.redis",
    "maru.backends.tiered",
    "maru.layouts",
)
DEFAULT_BACKEND = "shm"
"""The backend a configuration that names none uses: the embedded shared-memory pool."""
ENTRY_POINT_GROUP = hookspecs.PROJECT_NAME


@dataclass(frozen=True)
class PluginInfo:
    """One registered plugin and the distribution that ships it."""

    name: str
    distribution: str
    version: str


@dataclass(frozen=True)
class Provided:
    """A backend or layout adapter class and where it came from."""

    name: str
    cls: type
    plugin: PluginInfo


def maru_version() -> str:
    """The installed maru version."""
    try:
        return importlib.metadata.version("maru")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class MaruPluginManager:
    """Registers maru's plugins and answers which backends and adapters exist."""

    def __init__(self, *, load_entry_points: bool = True, plugins: Iterable[Any] = ()) -> None:
        self._pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self._pm.add_hookspecs(hookspecs)
        self._info: dict[str, PluginInfo] = {}
        builtin = PluginInfo("builtin", "maru", maru_version())
        for module_name in BUILTIN_PLUGINS:
            self._register(importlib.import_module(module_name), module_name, builtin)
        if load_entry_points:
            self._load_entry_points()
        for plugin in plugins:
            name = getattr(plugin, "__name__", repr(plugin))
            self._register(plugin, name, PluginInfo(name, name, "unknown"))

    def _register(self, plugin: Any, name: str, info: PluginInfo) -> None:
        self._pm.register(plugin, name=name)
        self._info[name] = PluginInfo(name, info.distribution, info.version)

    def _load_entry_points(self) -> None:
        for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if self._pm.has_plugin(entry_point.name):
                continue
            dist = entry_point.dist
            info = PluginInfo(
                entry_point.name,
                dist.metadata["Name"] if dist else "unknown",
                dist.version if dist else "unknown",
            )
            try:
                plugin = entry_point.load()
            except Exception as exc:
                raise PluginError(
                    f"plugin {entry_point.name!r} ({entry_point.value}) from distribution "
                    f"{info.distribution!r} failed to load: {type(exc).__name__}: {exc}"
                ) from exc
            self._register(plugin, entry_point.name, info)

    def plugins(self) -> list[PluginInfo]:
        """Every registered plugin, built-ins first."""
        return list(self._info.values())

    @functools.cached_property
    def backends(self) -> dict[str, Provided]:
        """Backend classes by name."""
        return self._collect(self._pm.hook.maru_backends, "backend")

    @functools.cached_property
    def backend_options(self) -> dict[str, type[BaseModel]]:
        """Each backend's Options model by name: what a config's sections are validated by."""
        return {name: options_model(item) for name, item in self.backends.items()}

    @functools.cached_property
    def layout_adapters(self) -> dict[str, Provided]:
        """Layout adapter classes by name, in the order they are asked."""
        return self._collect(self._pm.hook.maru_layout_adapters, "layout adapter")

    def provided_backend(self, name: str) -> Provided:
        """The backend called `name` and its plugin, or a ConfigError listing what is installed."""
        try:
            return self.backends[name]
        except KeyError:
            raise ConfigError(
                f"backend: no backend named {name!r} is installed; "
                f"installed backends: {', '.join(sorted(self.backends)) or 'none'}"
            ) from None

    def _collect(self, hook: pluggy.HookCaller, kind: str) -> dict[str, Provided]:
        provided: dict[str, Provided] = {}
        for impl in hook.get_hookimpls():  # registration order: built-ins first
            info = self._info[impl.plugin_name]
            for cls in impl.function() or ():
                name = getattr(cls, "name", None)
                if not isinstance(name, str) or not name:
                    raise PluginError(
                        f"{kind} {cls!r} from distribution {info.distribution!r} "
                        "has no string class attribute 'name'"
                    )
                if name in provided:
                    first = provided[name].plugin
                    raise PluginError(
                        f"{kind} name {name!r} is provided twice: by distribution "
                        f"{first.distribution!r} (plugin {first.name!r}) and by distribution "
                        f"{info.distribution!r} (plugin {info.name!r}); uninstall one of them"
                    )
                provided[name] = Provided(name, cls, info)
        return provided


def options_model(item: Provided) -> type[BaseModel]:
    """The pydantic Options model of backend `item`; PluginError naming its distribution
    if it has none."""
    options = getattr(item.cls, "Options", None)
    if not (isinstance(options, type) and issubclass(options, BaseModel)):
        raise plugin_error(item, "has no pydantic 'Options' model")
    return options


def plugin_error(item: Provided, problem: str) -> PluginError:
    """A PluginError naming the backend, the distribution that provides it and `problem`."""
    return PluginError(
        f"backend {item.name!r} from distribution {item.plugin.distribution!r} {problem}"
    )


@functools.cache
def get_plugin_manager() -> MaruPluginManager:
    """The process-wide plugin manager, built (and entry points loaded) on first use."""
    return MaruPluginManager()
