"""The installed backend classes, each checked to honour the Backend contract.

The plugin manager (a layer below) only knows what plugins provide; this module is
where a provided class is checked to be a `Backend` with an Options model before
maru opens a store with it.
"""

from __future__ import annotations

from maru.backends.base import Backend
from maru.plugins import (
    MaruPluginManager,
    Provided,
    get_plugin_manager,
    options_model,
    plugin_error,
)


def checked_backend(item: Provided) -> type[Backend]:
    """`item`'s class; PluginError if it does not subclass Backend or lacks an Options model."""
    if not (isinstance(item.cls, type) and issubclass(item.cls, Backend)):
        raise plugin_error(item, "does not subclass maru.backends.base.Backend")
    options_model(item)
    return item.cls


def backend_class(name: str, manager: MaruPluginManager | None = None) -> type[Backend]:
    """The installed backend class called `name` (by default from the process-wide plugin
    manager); ConfigError listing the installed backends if there is none."""
    return checked_backend((manager or get_plugin_manager()).provided_backend(name))


def backend_classes(manager: MaruPluginManager | None = None) -> dict[str, type[Backend]]:
    """Every installed backend class by name, each checked."""
    provided = (manager or get_plugin_manager()).backends
    return {name: checked_backend(item) for name, item in provided.items()}
