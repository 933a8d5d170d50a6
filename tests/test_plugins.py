"""The plugin system: built-ins and entry points through the same hooks, conflicts, and
a broken plugin that is skipped (not fatal), blocked, or traced."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import numpy as np
import pytest

import maru
from maru.backends.mock import MockBackend
from maru.backends.registry import backend_class, backend_classes
from maru.cli._engine import run_engine
from maru.config import Options
from maru.plugins import MaruPluginManager, UnloadedPlugin, get_plugin_manager
from tests.broken_plugin import (
    DESCRIBED,
    DISTRIBUTION,
    ENTRY_POINT,
    ERROR,
    MODULE,
    BrokenPlugin,
    fresh_plugin_manager,
    install_broken_plugin,
    installed_here,
)
from tests.conftest import unique_name


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


# --- a broken plugin is skipped, not fatal -------------------------------------------

FAILED = f"{DESCRIBED} failed to load: {ERROR}"
"""How maru names the broken plugin's failure, in its log, its errors and `maru info`."""
BAD_HOOK = """
    import maru

    @maru.hookimpl
    def maru_backends(unknown_argument):
        return []
"""


@pytest.fixture
def broken(tmp_path, monkeypatch) -> BrokenPlugin:
    """The broken distribution, installed for this process (with a fresh process-wide
    plugin manager) and, through `broken.env()`, for subprocesses."""
    return installed_here(tmp_path / "site", monkeypatch)


def run_maru(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The `maru` command, in a process of its own as an operator runs it (`python -m
    maru`: the release lanes' environments have no `maru` script of their own)."""
    command = [sys.executable, "-m", "maru", *argv]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)


def test_a_plugin_that_fails_to_import_is_logged_once_and_skipped(broken, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="vllm.maru"):
        manager = get_plugin_manager()
        assert {"mock", "shm", "dirstore"} <= set(manager.backends), "the others all work"
        assert get_plugin_manager() is manager
    assert [r.getMessage() for r in caplog.records] == [f"{FAILED}; maru goes on without it"]
    assert manager.failed() == [UnloadedPlugin(ENTRY_POINT, MODULE, DISTRIBUTION, "0.1", ERROR)]
    assert ENTRY_POINT not in [p.name for p in manager.plugins()]
    assert broken.imports() == 1


def test_a_plugin_that_fails_to_register_is_skipped(tmp_path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    module = make_distribution(tmp_path, "bad-hook-plugin", BAD_HOOK)
    manager = MaruPluginManager()
    [failed] = manager.failed()
    assert (failed.name, failed.distribution) == (module, "bad-hook-plugin")
    assert failed.error.startswith("PluginValidationError: ")
    assert "{'unknown_argument'}" in failed.error
    assert module not in [p.name for p in manager.plugins()]
    assert backend_class("mock", manager) is MockBackend


def test_stores_open_beside_a_broken_plugin(broken, pool_names) -> None:
    configs = [
        maru.MaruConfig(backend="mock", mock={"name": unique_name()}),
        maru.load_config(env={}, backend="shm", capacity="16MiB", shm={"name": pool_names()}),
    ]
    for config in configs:
        with maru.open_store(config) as store:
            assert store.put(b"key", b"value")
            assert store.get(b"key") == b"value"


@pytest.mark.parametrize(
    "configure",
    [
        lambda: maru.MaruConfig(backend=ENTRY_POINT),
        lambda: maru.load_config(env={"MARU_BACKEND": ENTRY_POINT}),
        lambda: maru.open_store(backend=ENTRY_POINT),
        lambda: backend_class(ENTRY_POINT),
    ],
    ids=["MaruConfig", "load_config", "open_store", "backend_class"],
)
def test_configuring_the_broken_plugins_backend_names_its_failure(broken, configure) -> None:
    with pytest.raises(maru.ConfigError) as caught:
        configure()
    message = str(caught.value)
    assert f"no backend named {ENTRY_POINT!r} is installed" in message
    assert "cxl, dirstore, disk, mock, redis, shm, tiered" in message
    assert f"plugins not loaded, whose backends maru cannot know: {FAILED}" in message


def test_maru_info_lists_a_broken_plugin_and_exits_0(broken) -> None:
    text = run_maru("info", env=broken.env())
    assert text.returncode == 0, text.stderr
    assert f"failed to load:\n  {FAILED}\n" in text.stdout
    assert "dirstore" in text.stdout and "configured backend: shm" in text.stdout
    assert text.stderr.count(ERROR) == 1, "logged once"
    as_json = run_maru("info", "--json", env=broken.env())
    assert as_json.returncode == 0, as_json.stderr
    info = json.loads(as_json.stdout)
    assert info["failed_plugins"] == [
        {
            "name": ENTRY_POINT,
            "entry_point": MODULE,
            "distribution": DISTRIBUTION,
            "version": "0.1",
            "error": ERROR,
        }
    ]
    assert (info["blocked_plugins"], info["configured"]["backend"]) == ([], "shm")


def test_maru_plugins_block_keeps_a_plugin_from_being_imported(broken) -> None:
    env = broken.env(MARU_PLUGINS_BLOCK=f" {ENTRY_POINT}, not-installed ")
    text = run_maru("info", env=env)
    as_json = run_maru("info", "--json", env=env)
    assert (text.returncode, text.stderr, as_json.returncode) == (0, "", 0)
    assert broken.imports() == 0
    info = json.loads(as_json.stdout)
    assert info["failed_plugins"] == []
    assert [(p["name"], p["distribution"]) for p in info["blocked_plugins"]] == [
        (ENTRY_POINT, DISTRIBUTION),
        ("not-installed", ""),
    ]
    assert (
        f"blocked:\n  {DESCRIBED} is blocked (MARU_PLUGINS_BLOCK or plugins.block)\n"
        "  plugin 'not-installed' (no installed entry point has this name) is blocked"
    ) in text.stdout
    assert run_maru("info", env=broken.env()).returncode == 0
    assert broken.imports() == 1, "unblocked, the same process tries it"


def test_plugins_block_in_a_config_file_keeps_a_plugin_from_being_imported(broken, tmp_path):
    path = tmp_path / "maru.yaml"
    path.write_text(f"backend: mock\nplugins:\n  block: [{ENTRY_POINT}]\n")
    assert maru.load_config(path).plugins.block == (ENTRY_POINT,)
    assert broken.imports() == 0
    manager = get_plugin_manager()
    assert [p.name for p in manager.blocked()] == [ENTRY_POINT]
    assert manager.failed() == []


def test_a_plugin_blocked_once_loaded_is_unregistered() -> None:
    manager = MaruPluginManager()
    assert "dirstore" in manager.backends
    manager.configure(block=["dirstore"])
    assert "dirstore" not in manager.backends
    assert "dirstore" not in [p.name for p in manager.plugins()]
    with pytest.raises(
        maru.ConfigError,
        match=r"plugin 'dirstore' \(entry point dirstore = maru_example_plugin, distribution "
        r"'maru-example-plugin' 0\.1\.0\) is blocked \(MARU_PLUGINS_BLOCK or plugins\.block\)",
    ):
        manager.provided_backend("dirstore")


def test_maru_plugins_trace_logs_each_hook_call(monkeypatch, caplog) -> None:
    monkeypatch.setenv("MARU_PLUGINS_TRACE", "1")
    fresh_plugin_manager(monkeypatch)
    with caplog.at_level(logging.INFO, logger="vllm.maru"):
        backends = get_plugin_manager().backends
    calls = [m for m in caplog.messages if m.startswith("plugin hook maru_backends() of ")]
    assert (
        "plugin hook maru_backends() of maru.backends.mock returned "
        "[[<class 'maru.backends.mock.MockBackend'>]]"
    ) in calls
    assert len(calls) == len(backends), "one call per plugin, each attributed"


def test_maru_plugins_trace_shows_hook_calls_on_the_command_line() -> None:
    done = run_maru("info", env=os.environ | {"MARU_PLUGINS_TRACE": "1"})
    assert done.returncode == 0, done.stderr
    assert "maru: INFO: plugin hook maru_backends() of maru.backends.shm returned" in done.stderr


@pytest.mark.slow
def test_a_vllm_engine_stores_and_loads_beside_a_broken_plugin(tiny_model, pool_names, tmp_path):
    """The connector a vLLM engine loads finds the broken plugin (its import is tried,
    its failure logged) and works: the second prompt loads the shared prefix from shm."""
    plugin = install_broken_plugin(tmp_path / "site")
    rng = np.random.default_rng(0)
    prefix = rng.integers(1, 500, 256).tolist()
    prompts = [prefix + rng.integers(1, 500, 40).tolist() for _ in range(2)]
    config = {
        "kv_connector": "MaruKVConnector",
        "kv_connector_module_path": "maru.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "backend": "shm",
            "capacity": "64MiB",
            "chunk_tokens": 64,
            "shm": {"name": pool_names()},
        },
    }
    log = tmp_path / "engine.log"
    run = run_engine(
        tiny_model,
        prompts,
        kv_transfer_config=config,
        enable_prefix_caching=False,
        env=plugin.variables(),
        log_path=log,
    )
    assert plugin.imports() >= 1 and ERROR in log.read_text(), "the plugin was tried"
    assert run.external_cached_tokens == [0, len(prefix)]
    assert run.extra["connector_totals"]["load_errors"] == 0
