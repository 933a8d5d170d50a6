"""The plugin manager: built-in plugins plus third-party entry points (group ``maru``).

Entry points are loaded once, when the manager is built. Built-ins go through the same
hooks as third-party plugins; every backend and layout adapter is attributed to the
distribution that provides it, so conflicts and `maru info` can name it.

One broken plugin must not take every backend down: an entry point that fails to import
or register is logged once and skipped, and remembered, so `maru info` lists it and a
config naming a backend nobody provides says which plugins failed and why. Operators
keep a plugin from loading at all with ``MARU_PLUGINS_BLOCK`` (entry point names,
comma-separated; or a config's ``plugins.block``), and see every hook call in maru's
log with ``MARU_PLUGINS_TRACE=1`` (or ``plugins.trace``).

This module sits below the backends: it names the classes plugins provide and
checks their pydantic ``Options`` model, which configs are validated by; that a
backend class is a ``Backend`` is checked above it, in ``maru.backends.registry``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import logging
import os
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pluggy
from pydantic import BaseModel

from maru import hookspecs
from maru.errors import ConfigError, PluginError
from maru.log import get_logger

log = get_logger(__name__)

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
ENV_PLUGINS_BLOCK = "MARU_PLUGINS_BLOCK"
"""Entry point names of plugins not to load, comma-separated (also `plugins.block`)."""
ENV_PLUGINS_TRACE = "MARU_PLUGINS_TRACE"
"""Set to 1 to log every hook call and its answer (also `plugins.trace`)."""
TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
_HOOK_CACHES = ("backends", "backend_options", "layout_adapters")
"""The cached answers of the hooks, forgotten when a plugin is blocked."""


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


@dataclass(frozen=True)
class UnloadedPlugin:
    """A plugin maru did not load: blocked, or failed with `error` (its exception)."""

    name: str
    entry_point: str
    distribution: str
    version: str
    error: str = ""

    def __str__(self) -> str:
        where = (
            f"entry point {self.name} = {self.entry_point}, distribution "
            f"{self.distribution!r} {self.version}"
            if self.entry_point
            else "no installed entry point has this name"
        )
        if self.error:
            return f"plugin {self.name!r} ({where}) failed to load: {self.error}"
        return f"plugin {self.name!r} ({where}) is blocked ({ENV_PLUGINS_BLOCK} or plugins.block)"


def maru_version() -> str:
    """The installed maru version."""
    try:
        return importlib.metadata.version("maru")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def plugin_names(value: str | Iterable[str]) -> tuple[str, ...]:
    """Plugin names from a comma-separated text (as in `MARU_PLUGINS_BLOCK`) or a list."""
    names = value.split(",") if isinstance(value, str) else value
    return tuple(name.strip() for name in names if name.strip())


class MaruPluginManager:
    """Registers maru's plugins and answers which backends and adapters exist.

    Plugins named in `block` are never imported; with `trace`, every hook call is logged.
    """

    def __init__(
        self,
        *,
        load_entry_points: bool = True,
        plugins: Iterable[Any] = (),
        block: Iterable[str] = (),
        trace: bool = False,
    ) -> None:
        self._pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self._pm.add_hookspecs(hookspecs)
        self._info: dict[str, PluginInfo] = {}
        self._entry_points: dict[str, importlib.metadata.EntryPoint] = {}
        self._failed: dict[str, UnloadedPlugin] = {}
        self._blocked: set[str] = set()
        self._tracing = False
        self.configure(block, trace)
        builtin = PluginInfo("builtin", "maru", maru_version())
        for module_name in BUILTIN_PLUGINS:
            if not self._pm.is_blocked(module_name):
                self._register(importlib.import_module(module_name), module_name, builtin)
        if load_entry_points:
            self._load_entry_points()
        for plugin in plugins:
            name = getattr(plugin, "__name__", repr(plugin))
            self._register(plugin, name, PluginInfo(name, name, "unknown"))

    def configure(self, block: Iterable[str] = (), trace: bool = False) -> None:
        """Block the plugins named in `block` (unregistering any already loaded) and,
        with `trace`, log every hook call from now on."""
        for name in set(plugin_names(block)) - self._blocked:
            self._blocked.add(name)
            self._pm.set_blocked(name)
            self._info.pop(name, None)
            self._failed.pop(name, None)
            for cached in _HOOK_CACHES:
                self.__dict__.pop(cached, None)
        if trace and not self._tracing:
            self._pm.add_hookcall_monitoring(_ignore_call, _log_call)
            self._tracing = True

    def _register(self, plugin: Any, name: str, info: PluginInfo) -> None:
        if self._pm.register(plugin, name=name) is not None:  # None: blocked
            self._info[name] = PluginInfo(name, info.distribution, info.version)

    def _load_entry_points(self) -> None:
        for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if entry_point.name in self._entry_points:
                continue  # the same distribution found twice on sys.path
            self._entry_points[entry_point.name] = entry_point
            if not self._pm.is_blocked(entry_point.name):
                self._load(entry_point)

    def _load(self, entry_point: importlib.metadata.EntryPoint) -> None:
        """Import and register one entry point; one that fails is logged and skipped."""
        described = _described(entry_point)
        info = PluginInfo(entry_point.name, described.distribution, described.version)
        try:
            self._register(entry_point.load(), entry_point.name, info)
        except Exception as exc:
            error = " ".join(str(exc).split())  # one line: pluggy's messages span several
            failed = dataclasses.replace(described, error=f"{type(exc).__name__}: {error}")
            self._failed[entry_point.name] = failed
            log.warning(
                "%s; maru goes on without it",
                failed,
                exc_info=log.isEnabledFor(logging.DEBUG),
            )

    def plugins(self) -> list[PluginInfo]:
        """Every registered plugin, built-ins first."""
        return list(self._info.values())

    def failed(self) -> list[UnloadedPlugin]:
        """The entry points that failed to import or register, with their errors."""
        return list(self._failed.values())

    def blocked(self) -> list[UnloadedPlugin]:
        """The blocked plugin names, each with its entry point where one is installed."""
        return [
            _described(self._entry_points[name])
            if name in self._entry_points
            else UnloadedPlugin(name, "", "", "")
            for name in sorted(self._blocked)
        ]

    def unloaded_note(self) -> str:
        """Why a backend may be missing: every failed and blocked plugin ('' if none)."""
        unloaded = [*self.failed(), *self.blocked()]
        if not unloaded:
            return ""
        return "plugins not loaded, whose backends maru cannot know: " + "; ".join(
            map(str, unloaded)
        )

    @functools.cached_property
    def backends(self) -> dict[str, Provided]:
        """Backend classes by name."""
        return self._collect("maru_backends", "backend")

    @functools.cached_property
    def backend_options(self) -> dict[str, type[BaseModel]]:
        """Each backend's Options model by name: what a config's sections are validated by."""
        return {name: options_model(item) for name, item in self.backends.items()}

    @functools.cached_property
    def layout_adapters(self) -> dict[str, Provided]:
        """Layout adapter classes by name, in the order they are asked."""
        return self._collect("maru_layout_adapters", "layout adapter")

    def provided_backend(self, name: str) -> Provided:
        """The backend called `name` and its plugin, or a ConfigError listing what is
        installed and which plugins did not load."""
        try:
            return self.backends[name]
        except KeyError:
            note = self.unloaded_note()
            raise ConfigError(
                f"backend: no backend named {name!r} is installed; "
                f"installed backends: {', '.join(sorted(self.backends)) or 'none'}"
                + (f"; {note}" if note else "")
            ) from None

    def _answers(self, hook_name: str) -> Iterator[tuple[PluginInfo, list[Any]]]:
        """Each plugin's answer to `hook_name`, in registration order (built-ins first),
        asked one plugin at a time through pluggy: so every answer is attributed to its
        plugin, and tracing sees every call."""
        impls = getattr(self._pm.hook, hook_name).get_hookimpls()
        for impl in impls:
            others = [other.plugin for other in impls if other is not impl]
            answers = self._pm.subset_hook_caller(hook_name, others)()
            yield self._info[impl.plugin_name], [cls for answer in answers for cls in answer]

    def _collect(self, hook_name: str, kind: str) -> dict[str, Provided]:
        provided: dict[str, Provided] = {}
        for info, classes in self._answers(hook_name):
            for cls in classes:
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


def _described(entry_point: importlib.metadata.EntryPoint) -> UnloadedPlugin:
    """`entry_point` and its distribution, as `maru info` and errors name it."""
    dist = entry_point.dist
    return UnloadedPlugin(
        entry_point.name,
        entry_point.value,
        dist.metadata["Name"] if dist else "unknown",
        dist.version if dist else "unknown",
    )


def _ignore_call(hook_name: str, impls: Sequence[pluggy.HookImpl], kwargs: Any) -> None:
    """pluggy's `before` of a hook call: `_log_call` logs the call once it has answered."""


def _log_call(
    outcome: pluggy.Result[Any],
    hook_name: str,
    impls: Sequence[pluggy.HookImpl],
    kwargs: Mapping[str, Any],
) -> None:
    """Log one hook call: its plugins and what it returned or raised."""
    arguments = ", ".join(f"{key}={value!r}" for key, value in kwargs.items())
    plugins = ", ".join(impl.plugin_name for impl in impls) or "no plugin"
    answer = (
        f"raised {outcome.exception!r}"
        if outcome.exception is not None
        else f"returned {outcome.get_result()!r}"
    )
    log.info("plugin hook %s(%s) of %s %s", hook_name, arguments, plugins, answer)


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


_manager: MaruPluginManager | None = None
_manager_lock = threading.RLock()  # reentrant: a plugin may ask for the manager on import


def get_plugin_manager(block: Iterable[str] = (), *, trace: bool = False) -> MaruPluginManager:
    """The process-wide plugin manager, built on first use with the plugins named in
    `MARU_PLUGINS_BLOCK` and in `block` never imported, and hook calls logged if
    `MARU_PLUGINS_TRACE` or `trace` says so; once it is built, `block` and `trace` (a
    config's `plugins` section) apply from then on."""
    global _manager
    with _manager_lock:
        if _manager is None:
            _manager = MaruPluginManager(
                block=(*plugin_names(os.environ.get(ENV_PLUGINS_BLOCK, "")), *block),
                trace=trace or os.environ.get(ENV_PLUGINS_TRACE, "").strip().lower() in TRUE_WORDS,
            )
        else:
            _manager.configure(block, trace)
        return _manager
