"""The hook specifications: maru's only extension points.

A plugin is any module or object with functions decorated by `maru.hookimpl`.
Built-in backends and layout adapters are plugins too, registered through these
same hooks. Third-party distributions publish an entry point in the group
``maru``::

    [project.entry-points.maru]
    my_backend = "my_package.plugin"
"""

from __future__ import annotations

import pluggy

PROJECT_NAME = "maru"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def maru_backends() -> list[type]:
    """Return the storage backend classes this plugin provides.

    Each class subclasses `maru.backends.base.Backend`, has a unique class
    attribute `name` (the value users put in `backend:`) and a pydantic model
    `Options` that validates the config section named after the backend.
    Two plugins providing the same name is an error naming both distributions.
    """


@hookspec
def maru_layout_adapters() -> list[type]:
    """Return the KV-layout adapter classes this plugin provides.

    An adapter recognises how a vLLM KV cache sits in memory (container, shape,
    strides) and copies whole pages of a block by block id. Each class has a
    unique `name`. Adapters are asked in registration order; built-ins first,
    so a third-party adapter is used for caches the built-ins do not recognise.
    """
