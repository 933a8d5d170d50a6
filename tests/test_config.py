"""Configuration: sizes, sources and their precedence, and errors that say what is wrong."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

import maru
from maru.config import parse_size, resolve_config

GIB, MIB = 2**30, 2**20


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("4GiB", 4 * GIB),
        ("4G", 4 * GIB),
        ("4gi", 4 * GIB),
        ("512MiB", 512 * MIB),
        ("512M", 512 * MIB),
        ("64 KiB", 64 * 1024),
        ("1.5GiB", 3 * GIB // 2),
        ("4GB", 4 * 10**9),
        ("1048576", 1048576),
        (1048576, 1048576),
        ("2T", 2 * 2**40),
    ],
)
def test_sizes_are_parsed(text: object, size: int) -> None:
    assert parse_size(text) == size
    assert maru.load_config(capacity=text).capacity == size


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("-4G", "greater than zero"),
        (-1, "greater than zero"),
        (0, "greater than zero"),
        ("0", "greater than zero"),
        ("lots", "not a size"),
        ("4XB", "not a size"),
        ("1.5", "whole number"),
        (True, "not a size"),
        ([4], "not a size"),
        ("", "not a size"),
    ],
)
def test_bad_sizes_are_rejected_with_field_value_and_allowed(value: object, problem: str) -> None:
    with pytest.raises(maru.ConfigError) as caught:
        maru.load_config(capacity=value)
    message = str(caught.value)
    assert f"capacity = {value!r} (from argument)" in message
    assert problem in message
    assert "allowed: a size such as 4GiB" in message


def test_defaults() -> None:
    config = maru.load_config(env={})
    assert (config.backend, config.namespace, config.capacity, config.chunk_tokens) == (
        "shm",
        "default",
        4 * GIB,
        256,
    )
    assert config.backend_options() == maru.load_config(shm={}).shm


def write(path, data: dict) -> str:
    path.write_text(json.dumps(data))
    return str(path)


def test_precedence_argument_over_extra_over_env_over_file(tmp_path) -> None:
    file = write(
        tmp_path / "maru.json",
        {
            "capacity": "1G",
            "namespace": "file",
            "chunk_tokens": 64,
            "mock": {"seed": 1, "name": "f"},
        },
    )
    env = {
        "MARU_CONFIG": file,
        "MARU_NAMESPACE": "env",
        "MARU_CHUNK_TOKENS": "128",
        "MARU_MOCK__SEED": "2",
    }
    extra = {"chunk_tokens": 512, "mock": {"seed": 3}}
    resolved = resolve_config(env=env, extra_config=extra, mock={"seed": 4})
    config = resolved.config
    assert config.capacity == GIB
    assert config.namespace == "env"
    assert config.chunk_tokens == 512
    assert config.mock.seed == 4
    assert config.mock.name == "f"
    assert resolved.source_of(("capacity",)) == f"file {file}"
    assert resolved.source_of(("namespace",)) == "env MARU_NAMESPACE"
    assert resolved.source_of(("chunk_tokens",)) == "kv_connector_extra_config"
    assert resolved.source_of(("mock", "seed")) == "argument"
    assert resolved.source_of(("mock", "latency")) == "default"
    assert resolved.source_of(("config_file",)) == "env MARU_CONFIG"


@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".toml", ".json"])
def test_files_in_each_format(tmp_path, suffix: str) -> None:
    body = {
        ".yaml": "capacity: 2GiB\nmock:\n  seed: 9\n",
        ".yml": "capacity: 2GiB\nmock:\n  seed: 9\n",
        ".toml": 'capacity = "2GiB"\n[mock]\nseed = 9\n',
        ".json": '{"capacity": "2GiB", "mock": {"seed": 9}}',
    }[suffix]
    path = tmp_path / f"maru{suffix}"
    path.write_text(body)
    config = maru.load_config(path, env={})
    assert (config.capacity, config.mock.seed) == (2 * GIB, 9)


def test_config_file_named_in_vllm_extra_config(tmp_path) -> None:
    file = write(tmp_path / "m.json", {"namespace": "from-file"})
    config = maru.load_config(extra_config={"config_file": file}, env={})
    assert config.namespace == "from-file"


@pytest.mark.parametrize(
    ("name", "body", "problem"),
    [
        ("missing.yaml", None, "cannot read it"),
        ("bad.yaml", "capacity: [1,\n", "not valid YAML"),
        ("bad.toml", "capacity = ", "not valid TOML"),
        ("list.yaml", "- 1\n- 2\n", "top level must be a mapping"),
        ("maru.ini", "[x]\n", "unsupported file type '.ini'"),
    ],
)
def test_unusable_files_are_config_errors_naming_the_file(tmp_path, name, body, problem) -> None:
    path = tmp_path / name
    if body is not None:
        path.write_text(body)
    with pytest.raises(maru.ConfigError) as caught:
        maru.load_config(env={"MARU_CONFIG": str(path)})
    assert f"config_file = {str(path)!r} (from env MARU_CONFIG)" in str(caught.value)
    assert problem in str(caught.value)


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        (
            {"capacty": "1G"},
            "capacty = '1G' (from argument): unknown key; allowed: backend, namespace",
        ),
        (
            {"mock": {"sede": 1}},
            "mock.sede = 1 (from argument): unknown key; allowed: name, fail_rate",
        ),
        (
            {"backend": "nosuch"},
            "backend = 'nosuch' (from argument): no backend named 'nosuch' is "
            "installed; allowed: cxl, dirstore, mock, redis, shm, tiered",
        ),
        (
            {"s3": {"url": "s3://x"}},
            "s3 = {'url': 's3://x'} (from argument): unknown key; "
            "allowed: backend, namespace, capacity, chunk_tokens, error_backoff, "
            "config_file and the sections of installed backends",
        ),
        (
            {"chunk_tokens": "many"},
            "chunk_tokens = 'many' (from argument): Input should be a valid integer",
        ),
        ({"chunk_tokens": 0}, "chunk_tokens = 0 (from argument): Input should be greater than 0"),
        (
            {"mock": {"fail_rate": 2}},
            "mock.fail_rate = 2 (from argument): Input should be less than or equal to 1",
        ),
        ({"namespace": "a/b"}, "namespace = 'a/b' (from argument): String should match pattern"),
    ],
)
def test_bad_settings_name_field_value_source_and_what_is_allowed(settings, expected) -> None:
    with pytest.raises(maru.ConfigError) as caught:
        maru.load_config(env={}, **settings)
    assert expected in str(caught.value)


def test_every_problem_is_reported_at_once_with_its_source(tmp_path) -> None:
    file = write(tmp_path / "m.json", {"capacity": "huge"})
    env = {"MARU_CONFIG": file, "MARU_BOGUS": "1", "MARU_MOCK__LATENCY": "-1"}
    with pytest.raises(maru.ConfigError) as caught:
        maru.load_config(env=env)
    message = str(caught.value)
    assert f"capacity = 'huge' (from file {file})" in message
    assert "bogus = '1' (from env MARU_BOGUS): unknown key" in message
    assert "mock.latency = '-1' (from env MARU_MOCK__LATENCY)" in message


def test_config_is_immutable() -> None:
    config = maru.load_config()
    with pytest.raises(ValidationError):
        config.capacity = 1  # type: ignore[misc]


def test_open_store_with_an_uninstalled_backend_lists_the_installed_ones() -> None:
    from maru.plugins import get_plugin_manager

    with pytest.raises(
        maru.ConfigError,
        match=r"'nosuch' is installed; installed backends: "
        r"cxl, dirstore, mock, redis, shm, tiered",
    ):
        get_plugin_manager().backend("nosuch")


def test_a_config_travels_to_other_processes_by_pickle() -> None:
    import pickle

    config = maru.load_config(capacity="1GiB", shm={"name": "elsewhere"})
    copy = pickle.loads(pickle.dumps(config))
    assert copy == config
    assert copy.shm.name == "elsewhere"
