"""The plugin system: built-ins and entry points through the same hooks, and conflicts."""

from __future__ import annotations

import textwrap
import uuid
from pathlib import Path

import pytest

import maru
from maru.backends.mock import MockBackend
from maru.backends.registry import backend_class, backend_classes
from maru.config import Options
from maru.plugins import MaruPluginManager, get_plugin_manager


def make_distribution(root: Path, dist_name: str, source: str) -> str:
    """Install a one-module distribution with a `maru` entry point under `root`."""
    module = f"plugin_{uuid.uuid4().hex[:10]}"
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist_name.replace('-', '_')}-1.2.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: 1.2.3\n")
    (info / "entry_points.txt").write_text(f"[maru]\n{module} = {module}\n")
    return module


DUPLICATE_MOCK = """
    import maru
    from maru.backends.mock import MockBackend

    class OtherMock(MockBackend):
        name = "mock"

    @maru.hookimpl
    def maru_backends():
        return [OtherMock]
"""


def test_builtins_are_plugins_of_the_maru_distribution() -> None:
    manager = MaruPluginManager(load_entry_points=False)
    mock = manager.backends["mock"]
    assert mock.cls is MockBackend
    assert mock.plugin.distribution == "maru"


def test_entry_points_are_discovered_with_their_distribution() -> None:
    dirstore = get_plugin_manager().backends["dirstore"]
    assert dirstore.plugin.distribution == "maru-example-plugin"
    assert dirstore.cls.__module__ == "maru_example_plugin"


def test_the_process_wide_manager_loads_entry_points_once() -> None:
    assert get_plugin_manager() is get_plugin_manager()


def test_two_providers_of_one_backend_name_name_both_distributions(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    module = make_distribution(tmp_path, "acme-maru-mock", DUPLICATE_MOCK)
    with pytest.raises(maru.PluginError) as caught:
        MaruPluginManager().backends  # noqa: B018
    message = str(caught.value)
    assert "backend name 'mock' is provided twice" in message
    assert "distribution 'maru'" in message
    assert f"distribution 'acme-maru-mock' (plugin '{module}')" in message


def test_a_plugin_that_fails_to_import_is_named(tmp_path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    make_distribution(tmp_path, "broken-plugin", "import does_not_exist_anywhere\n")
    with pytest.raises(
        maru.PluginError,
        match="from distribution 'broken-plugin' failed to load: ModuleNotFoundError",
    ):
        MaruPluginManager()


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ("class Thing:\n    name = 'thing'\n", "does not subclass maru.backends.base.Backend"),
        (
            "from maru.backends.mock import MockBackend\n"
            "class Thing(MockBackend):\n    name = 'thing'\n    Options = dict\n",
            "no pydantic 'Options'",
        ),
        ("class Thing:\n    pass\n", "has no string class attribute 'name'"),
    ],
)
def test_malformed_backends_are_refused_with_the_reason(body: str, problem: str) -> None:
    namespace: dict = {}
    exec(body, namespace)

    class Plugin:
        @staticmethod
        @maru.hookimpl
        def maru_backends():
            return [namespace["Thing"]]

    with pytest.raises(maru.PluginError, match=problem):
        backend_classes(MaruPluginManager(load_entry_points=False, plugins=[Plugin]))


def test_layout_adapters_come_through_their_hook() -> None:
    class Adapter:
        name = "test-adapter"

    class Plugin:
        @staticmethod
        @maru.hookimpl
        def maru_layout_adapters():
            return [Adapter]

    manager = MaruPluginManager(load_entry_points=False, plugins=[Plugin])
    assert manager.layout_adapters["test-adapter"].cls is Adapter


class ThingOptions(Options):
    size: int = 1


class NotABackend:
    name = "thing"
    Options = ThingOptions


class ThingPlugin:
    @staticmethod
    @maru.hookimpl
    def maru_backends():
        return [NotABackend]


def test_the_plugin_manager_validates_options_but_leaves_the_backend_check_to_the_registry():
    manager = MaruPluginManager(load_entry_points=False, plugins=[ThingPlugin])
    assert manager.backend_options["thing"] is ThingOptions
    assert manager.provided_backend("thing").cls is NotABackend
    with pytest.raises(
        maru.PluginError,
        match=r"backend 'thing' from distribution '.*' "
        r"does not subclass maru\.backends\.base\.Backend",
    ):
        backend_class("thing", manager)


def test_the_registry_hands_out_checked_backend_classes() -> None:
    manager = MaruPluginManager(load_entry_points=False)
    assert backend_class("mock", manager) is MockBackend
    assert backend_classes(manager)["mock"] is MockBackend


def test_the_registry_names_the_installed_backends_for_an_unknown_one() -> None:
    with pytest.raises(
        maru.ConfigError,
        match=r"backend: no backend named 'nosuch' is installed; installed backends: "
        r"cxl, dirstore, disk, mock, redis, shm, tiered",
    ):
        backend_class("nosuch")


def test_open_store_refuses_a_class_that_is_not_a_backend(monkeypatch) -> None:
    manager = MaruPluginManager(load_entry_points=False, plugins=[ThingPlugin])
    monkeypatch.setattr("maru.backends.registry.get_plugin_manager", lambda: manager)
    config = maru.MaruConfig.model_validate({"backend": "thing"}, backends=manager.backend_options)
    with pytest.raises(maru.PluginError, match="does not subclass"):
        maru.open_store(config)
