"""The example third-party plugin, installed for real, selected by name from a config file."""

from __future__ import annotations

import pytest

import maru
from maru.testing import BackendContract, EvictionContract
from tests.conftest import unique_name


class TestDirStoreFromConfigFile(BackendContract, EvictionContract):
    @pytest.fixture
    def make_store(self, tmp_path, open_stores):
        def factory(capacity: int) -> maru.Backend:
            config_file = tmp_path / f"{unique_name('maru')}.yaml"
            config_file.write_text(
                f"backend: dirstore\ncapacity: {capacity}\n"
                f"dirstore:\n  path: {tmp_path / 'objects'}\n"
                f"namespace: {unique_name()}\n"
            )
            store = open_stores(config_file=config_file)
            assert type(store).__module__ == "maru_example_plugin"
            return store

        return factory
