"""Configuration: sizes, sources and their precedence, and errors that say what is wrong."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

import maru
from maru.config import BACKENDS_CONTEXT, MaruConfig, Options, resolve_config
from maru.config import model as config_model
from maru.config.model import PluginSettings
from maru.sizes import parse_size

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
    ("nbytes", "text"),
    [(0, "0 bytes"), (1, "1 byte"), (1023, "1023 bytes"), (1536, "1.5 KiB"), (64 << 20, "64 MiB")],
)
def test_sizes_are_written_for_people(nbytes: int, text: str) -> None:
    from maru.sizes import format_size

    assert format_size(nbytes) == text


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
            "installed; allowed: cxl, dirstore, disk, mock, redis, shm, tiered",
        ),
        (
            {"s3": {"url": "s3://x"}},
            "s3 = {'url': 's3://x'} (from argument): unknown key; "
            "allowed: backend, namespace, capacity, chunk_tokens, error_backoff, "
            "producer_loads, consumer_wait, async_loads, slow_hits, async_load_timeout, "
            "kv_cache_huge_pages, config_file, plugins and the sections of installed backends",
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
    file = write(tmp_path / "m.json", {"capacity": "huge", "bogus": 1})
    env = {"MARU_CONFIG": file, "MARU_MOCK__LATENCY": "-1"}
    with pytest.raises(maru.ConfigError) as caught:
        maru.load_config(env=env)
    message = str(caught.value)
    assert f"capacity = 'huge' (from file {file})" in message
    assert f"bogus = 1 (from file {file}): unknown key" in message
    assert "mock.latency = '-1' (from env MARU_MOCK__LATENCY)" in message


@pytest.mark.parametrize(
    ("variable", "closest"),
    [
        ("MARU_CAPACTY", "MARU_CAPACITY"),
        ("MARU_SHM__NAEM", "MARU_SHM__NAME"),
        ("MARU_NAMESPACE__NAME", "MARU_NAMESPACE"),
        ("MARU_REDIS_URL", "MARU_REDIS__URL"),
        ("MARU_PLUGIN_BLOCK", "MARU_PLUGINS_BLOCK"),
    ],
)
def test_an_unknown_environment_variable_is_a_warning_naming_it_and_the_closest(
    variable: str, closest: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING", logger="maru.config"):
        config = maru.load_config(env={variable: "x", "MARU_CHUNK_TOKENS": "512"})
    assert config.chunk_tokens == 512
    assert caplog.messages == [
        f"ignoring environment variable {variable}: maru has no such "
        f"setting (the closest is {closest})"
    ]


def test_a_stray_maru_variable_does_not_stop_a_config_from_loading(caplog) -> None:
    with caplog.at_level("WARNING", logger="maru.config"):
        assert maru.load_config(env={"MARU_HOME": "/srv/maru"}).backend == "shm"
    assert "MARU_HOME" in caplog.text


@pytest.mark.parametrize(
    "source",
    [
        lambda: maru.load_config(env={}, bogus=1),
        lambda: maru.load_config(env={}, extra_config={"shm": {"bogus": 1}}),
    ],
)
def test_unknown_keys_outside_the_environment_stay_errors(source) -> None:
    with pytest.raises(maru.ConfigError, match=r"bogus = 1 .*unknown key"):
        source()


def test_lists_and_null_are_json_in_the_environment() -> None:
    config = maru.load_config(
        env={
            "MARU_TIERED__TIERS": '["mock", "shm"]',
            "MARU_REDIS__TTL": "null",
            "MARU_REDIS__KEY_PREFIX": "[not json",
        }
    )
    assert config.tiered.tiers == ["mock", "shm"]
    assert config.redis.ttl is None and "ttl" in config.redis.model_fields_set
    assert config.redis.key_prefix == "[not json"


def test_a_bad_json_list_in_the_environment_names_the_variable() -> None:
    with pytest.raises(maru.ConfigError) as caught:
        maru.load_config(env={"MARU_TIERED__TIERS": '["shm"'})
    assert """tiered.tiers = '["shm"' (from env MARU_TIERED__TIERS)""" in str(caught.value)


def test_config_is_immutable() -> None:
    config = maru.load_config()
    with pytest.raises(ValidationError):
        config.capacity = 1  # type: ignore[misc]


def test_open_store_with_an_uninstalled_backend_lists_the_installed_ones() -> None:
    from maru.plugins import get_plugin_manager

    with pytest.raises(
        maru.ConfigError,
        match=r"'nosuch' is installed; installed backends: "
        r"cxl, dirstore, disk, mock, redis, shm, tiered",
    ):
        get_plugin_manager().provided_backend("nosuch")


ROUND_TRIP_SECTIONS = {
    "cxl": {"mode": "emulated", "device": "/tmp/maru-cxl-round-trip"},
    "redis": {"url": "redis://cache.example:6380/1", "password": "hunter2", "ttl": 30},
    "tiered": {"tiers": ["shm", "redis"]},
    "mock": {"seed": 3, "fail_rate": 0.5},
    "shm": {"name": "elsewhere", "mode": "0660"},
}


def installed_backends() -> list[str]:
    from maru.plugins import get_plugin_manager

    return sorted(get_plugin_manager().backends)


@pytest.mark.parametrize("backend", installed_backends())
def test_every_config_round_trips_through_its_dump(backend: str) -> None:
    section = ROUND_TRIP_SECTIONS.get(backend, {})
    config = maru.load_config(env={}, backend=backend, capacity="1GiB", **{backend: section})
    assert maru.MaruConfig.model_validate(config.model_dump()) == config
    assert maru.MaruConfig.model_validate_json(json.dumps(config.portable())) == config
    assert isinstance(maru.MaruConfig.model_validate({}), maru.MaruConfig)


def test_secrets_reach_another_process_intact_and_are_masked_when_shown() -> None:
    from maru.cli.demo import connector_config

    config = maru.load_config(env={}, redis=ROUND_TRIP_SECTIONS["redis"])
    extra = connector_config(config)["kv_connector_extra_config"]
    assert extra["redis"]["password"] == "hunter2"
    received = maru.load_config(env={}, extra_config=extra)
    assert received.redis.password.get_secret_value() == "hunter2"
    assert "hunter2" not in config.model_dump_json() and "hunter2" not in repr(config)


def test_a_config_travels_to_other_processes_by_pickle() -> None:
    config = maru.load_config(capacity="1GiB", shm={"name": "elsewhere"})
    copy = pickle.loads(pickle.dumps(config))
    assert copy == config
    assert copy.shm.name == "elsewhere"


@pytest.mark.parametrize(
    "make",
    [
        lambda: maru.MaruConfig(backend="shm", shm={"name": "x"}),
        lambda: MaruConfig.model_validate({"backend": "shm", "shm": {"name": "x"}}),
        lambda: MaruConfig.model_validate_json('{"backend": "shm", "shm": {"name": "x"}}'),
        lambda: maru.load_config(env={}, backend="shm", shm={"name": "x"}),
    ],
)
def test_every_entry_point_gives_exactly_a_maru_config(make) -> None:
    config = make()
    assert type(config) is maru.MaruConfig
    assert config.shm.name == "x"
    assert config.backend_options() is config.shm
    assert config.cxl is None
    assert config.model_fields_set == {"backend", "shm"}


def test_configs_from_every_entry_point_are_equal() -> None:
    direct = maru.MaruConfig(backend="mock", mock={"seed": 3}, capacity="1GiB")
    assert direct == MaruConfig.model_validate(direct.model_dump())
    assert direct == maru.load_config(env={}, **direct.portable())
    assert direct == MaruConfig.model_validate_json(json.dumps(direct.portable()))


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (
            lambda: maru.MaruConfig(backend="shm", shm={"bogus": 1}),
            "shm.bogus = 1: unknown key; allowed: checksum, prefault, name",
        ),
        (
            lambda: maru.MaruConfig(capacity="lots"),
            "capacity = 'lots': not a size; allowed: a size such as 4GiB",
        ),
        (
            lambda: maru.MaruConfig(backend="nope"),
            "backend = 'nope': no backend named 'nope' is installed; "
            "allowed: cxl, dirstore, disk, mock, redis, shm, tiered",
        ),
        (
            lambda: MaruConfig.model_validate({"bogus": 1}),
            "bogus = 1: unknown key; allowed: backend, namespace, capacity, chunk_tokens, "
            "error_backoff, producer_loads, consumer_wait, async_loads, slow_hits, "
            "async_load_timeout, kv_cache_huge_pages, config_file, plugins and the sections "
            "of installed backends (mock, shm, cxl, disk, redis, tiered, dirstore)",
        ),
        (
            lambda: MaruConfig.model_validate_json('{"mock": {"fail_rate": 2}}'),
            "mock.fail_rate = 2: Input should be less than or equal to 1",
        ),
        (
            lambda: MaruConfig.model_validate("shm"),
            "(top level) = 'shm': Input should be a valid dictionary or instance of MaruConfig",
        ),
    ],
)
def test_bad_input_to_the_model_is_a_config_error_naming_field_value_and_allowed(
    make, expected: str
) -> None:
    with pytest.raises(maru.ConfigError) as caught:
        make()
    assert expected in str(caught.value)


class FakeOptions(Options):
    size: int = 1


FAKE_BACKENDS = {"fake": FakeOptions}


@pytest.fixture
def no_plugin_manager(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail any read of the process-wide plugin manager by config validation."""

    def refuse() -> None:
        raise AssertionError("validation read the global plugin manager")

    monkeypatch.setattr(config_model, "get_plugin_manager", refuse)


@pytest.mark.usefixtures("no_plugin_manager")
def test_validation_against_a_given_set_of_backends_reads_no_plugin_manager() -> None:
    data = {"backend": "fake", "fake": {"size": 3}}
    config = MaruConfig.model_validate(data, backends=FAKE_BACKENDS)
    assert type(config) is MaruConfig
    assert config.fake == FakeOptions(size=3)
    assert config.backend_options() == FakeOptions(size=3)
    assert MaruConfig.model_validate(data, context={BACKENDS_CONTEXT: FAKE_BACKENDS}) == config
    assert MaruConfig.model_validate_json(json.dumps(data), backends=FAKE_BACKENDS) == config
    assert (
        maru.load_config(env={"MARU_FAKE__SIZE": "3"}, backends=FAKE_BACKENDS, backend="fake")
        == config
    )
    assert pickle.loads(pickle.dumps(config)) == config


@pytest.mark.usefixtures("no_plugin_manager")
def test_errors_against_a_given_set_of_backends_name_only_those() -> None:
    with pytest.raises(maru.ConfigError) as caught:
        maru.load_config(env={}, backends=FAKE_BACKENDS, backend="shm", fake={"size": "x"}, shm={})
    message = str(caught.value)
    assert (
        "backend = 'shm' (from argument): no backend named 'shm' is installed; "
        "allowed: fake" in message
    )
    assert "fake.size = 'x' (from argument): Input should be a valid integer" in message
    assert "shm = {} (from argument): unknown key; allowed: backend, namespace" in message
    assert "sections of installed backends (fake)" in message


def test_validation_without_a_set_of_backends_says_how_to_give_one() -> None:
    with pytest.raises(
        ValidationError,
        match="MaruConfig is validated against a set of "
        r"backends; allowed: MaruConfig\(\.\.\.\)",
    ):
        MaruConfig.__pydantic_validator__.validate_python({"backend": "shm"})


def test_a_pickled_config_is_a_maru_config_with_its_sections_and_secrets() -> None:
    config = maru.MaruConfig(backend="redis", redis={"password": "hunter2"})
    copy = pickle.loads(pickle.dumps(config))
    assert type(copy) is MaruConfig
    assert copy == config
    assert copy.redis.password.get_secret_value() == "hunter2"
    with pytest.raises(ValidationError):
        copy.backend = "shm"  # type: ignore[misc]


def test_the_readmes_configuration_block_shows_the_defaults() -> None:
    """The README's annotated YAML block is what a config without settings holds, so a
    changed default cannot leave it saying the old one."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    block = readme[readme.index("```yaml\nbackend: shm") + len("```yaml\n") :]
    shown = yaml.safe_load(block[: block.index("```")])
    config, defaults = maru.load_config(**shown), maru.load_config()
    sections = [
        name
        for name, value in shown.items()
        if isinstance(value, dict) and name not in MaruConfig.model_fields
    ]
    assert config.model_dump(exclude=set(sections)) == defaults.model_dump(exclude=set(sections))
    for name in sections:
        assert config.backend_options(name) == defaults.backend_options(name), name


def test_the_plugin_variables_set_the_plugins_section_without_a_warning(caplog) -> None:
    env = {"MARU_PLUGINS_BLOCK": " acme, other ,", "MARU_PLUGINS_TRACE": "1"}
    with caplog.at_level("WARNING"):
        resolved = resolve_config(env=env, backends=FAKE_BACKENDS, backend="fake")
    assert resolved.config.plugins == PluginSettings(block=("acme", "other"), trace=True)
    assert resolved.source_of(("plugins", "block")) == "env MARU_PLUGINS_BLOCK"
    assert caplog.messages == []


@pytest.mark.parametrize(
    ("settings", "env", "expected"),
    [
        (
            {"plugins": {"blok": ["acme"]}},
            {},
            "plugins.blok = ['acme'] (from argument): unknown key; allowed: block, trace",
        ),
        (
            {},
            {"MARU_PLUGINS_TRACE": "maybe"},
            "plugins.trace = 'maybe' (from env MARU_PLUGINS_TRACE): Input should be a valid "
            "boolean",
        ),
    ],
)
def test_a_bad_plugins_section_names_the_field_value_and_source(settings, env, expected) -> None:
    with pytest.raises(maru.ConfigError) as caught:
        resolve_config(env=env, backends=FAKE_BACKENDS, backend="fake", **settings)
    assert expected in str(caught.value)
