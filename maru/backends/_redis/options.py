"""The `redis:` config section, checked when it is loaded so that a bad address, a
TLS file that is missing or a contradiction between fields is one ConfigError naming
the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from pydantic import Field, SecretStr, field_validator, model_validator

from maru.config import Options, Size

SCHEMES = ("redis", "rediss", "unix", "redis+sentinel")
SEED_SCHEMES = ("redis", "rediss")
"""Schemes of the extra seed nodes of a cluster (`urls`)."""

MARU_QUERY_ARGUMENTS = {
    "socket_timeout": "timeout",
    "timeout": "pool_timeout",
    "socket_connect_timeout": "connect_timeout",
    "max_connections": "pool_size",
    "retry_on_timeout": "(none: maru never retries)",
    "retry_on_error": "(none: maru never retries)",
    "ssl_ca_certs": "tls_ca_file",
    "ssl_certfile": "tls_cert_file",
    "ssl_keyfile": "tls_key_file",
    "ssl_cert_reqs": "tls_verify",
    "ssl_check_hostname": "tls_verify",
    "protocol": "(none: maru speaks RESP2)",
}
"""URL query arguments that would override maru's own settings -> the field to use."""

TLS_FIELDS = ("tls_ca_file", "tls_cert_file", "tls_key_file")


class RedisOptions(Options):
    """The `redis:` config section."""

    url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="redis://, rediss:// (TLS) or unix:// address of a server or of a "
        "cluster node, or redis+sentinel://host:port,host:port/service_name",
    )
    urls: tuple[str, ...] = Field(
        (),
        description="more cluster nodes (redis:// or rediss://) to learn the cluster's "
        "layout from when `url` does not answer",
    )
    cluster: bool = Field(False, description="the URLs name nodes of a Redis Cluster")
    sentinels: tuple[str, ...] = Field(
        (),
        description="host:port of the Sentinels that know the primary (instead of a "
        "redis+sentinel:// url)",
    )
    service_name: str | None = Field(
        None, description="the primary's name at the Sentinels (with `sentinels`)"
    )
    username: str | None = Field(None, description="ACL user (or in the URL)")
    password: SecretStr | None = Field(
        None, description="password; set it with MARU_REDIS__PASSWORD rather than in a file"
    )
    db: int | None = Field(None, ge=0, description="database number (not in cluster mode)")
    key_prefix: str = Field("maru:", description="prefix of every key maru writes")
    ttl: float | None = Field(None, gt=0, description="seconds an object lives, if set")
    connect_timeout: float = Field(0.5, gt=0, le=60, description="seconds to connect")
    timeout: float = Field(
        0.5,
        gt=0,
        le=60,
        description="seconds a call may take beyond moving its bytes (its deadline is "
        "timeout + bytes / min_throughput)",
    )
    min_throughput: Size = Field(
        100 * 10**6,
        description="bytes per second a transfer may be as slow as before it times out: "
        "a call that moves an object gets that many more seconds per byte",
    )
    node_backoff: float = Field(
        2.0,
        ge=0,
        le=600,
        description="cluster: seconds a node that failed is not asked (its keys are misses) "
        "before it is tried again; 0 asks it every time",
    )
    chunked_reads: bool = Field(
        True,
        description="read into buffers of 16 MiB and more in 1 MiB ranges inside MULTI/EXEC "
        "(about twice as fast from Redis 7); turn off for proxies without MULTI",
    )
    pool_size: int = Field(16, ge=1, le=1024, description="connections per process (per node)")
    pool_timeout: float = Field(
        0.5,
        gt=0,
        le=60,
        description="seconds a call waits for a free connection when all pool_size are busy",
    )
    tls_ca_file: Path | None = Field(None, description="CA certificates (PEM) to verify the server")
    tls_cert_file: Path | None = Field(None, description="client certificate (PEM), for mTLS")
    tls_key_file: Path | None = Field(None, description="client certificate's key (PEM)")
    tls_verify: bool = Field(
        True, description="verify the server's certificate and host name (rediss://)"
    )

    @field_validator("url")
    @classmethod
    def _known_scheme(cls, url: str) -> str:
        return _checked_url(url, SCHEMES)

    @field_validator("urls")
    @classmethod
    def _seed_urls(cls, urls: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(_checked_url(url, SEED_SCHEMES) for url in urls)

    @field_validator("sentinels")
    @classmethod
    def _host_ports(cls, sentinels: tuple[str, ...]) -> tuple[str, ...]:
        for address in sentinels:
            host_port(address)
        return sentinels

    @field_validator(*TLS_FIELDS)
    @classmethod
    def _readable(cls, path: Path | None) -> Path | None:
        if path is not None and not path.is_file():
            raise ValueError("no such file; allowed: the path of a readable PEM file")
        return path

    @model_validator(mode="after")
    def _consistent(self) -> RedisOptions:
        scheme = urlsplit(self.url).scheme
        if self.urls and not self.cluster:
            raise ValueError(f"urls = {list(self.urls)} needs cluster: true (they are seed nodes)")
        if self.cluster and (self.db or scheme not in SEED_SCHEMES):
            raise ValueError(
                f"cluster: true with url scheme {scheme!r} and db = {self.db}; allowed: a "
                "redis:// or rediss:// url and no db"
            )
        if bool(self.sentinels) != bool(self.service_name):
            raise ValueError("sentinels and service_name go together; allowed: both or neither")
        if (self.sentinels or scheme == "redis+sentinel") and self.cluster:
            raise ValueError(
                "Sentinel (sentinels, or a redis+sentinel:// url) with cluster: true; "
                "allowed: one of them"
            )
        if scheme == "redis+sentinel" and not urlsplit(self.url).path[1:]:
            raise ValueError("a redis+sentinel:// url ends in /service_name; it has none")
        self.sentinel  # noqa: B018 (raises for an address that is not host:port)
        tls = [name for name in TLS_FIELDS if getattr(self, name)]
        if tls and scheme != "rediss":
            raise ValueError(
                f"{', '.join(tls)} need a rediss:// url (TLS); url scheme is {scheme!r}"
            )
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("tls_cert_file and tls_key_file go together; allowed: both or neither")
        return self

    @property
    def sentinel(self) -> tuple[list[tuple[str, int]], str] | None:
        """The Sentinels' addresses and the primary's service name, if Sentinel is used."""
        if self.sentinels:
            return [host_port(address) for address in self.sentinels], str(self.service_name)
        parts = urlsplit(self.url)
        if parts.scheme != "redis+sentinel":
            return None
        addresses = parts.netloc.rpartition("@")[2].split(",")
        return [host_port(address) for address in addresses], parts.path[1:]


def _checked_url(url: str, schemes: tuple[str, ...]) -> str:
    """`url`, or a ValueError naming its bad scheme or a query argument maru sets itself."""
    parts = urlsplit(url)
    if parts.scheme not in schemes:
        raise ValueError(f"scheme {parts.scheme or '(none)'!r} is not one of {', '.join(schemes)}")
    for name in parse_qs(parts.query):
        if name in MARU_QUERY_ARGUMENTS:
            raise ValueError(
                f"query argument {name} is maru's to set; use redis.{MARU_QUERY_ARGUMENTS[name]}"
            )
    return url


def host_port(address: str) -> tuple[str, int]:
    """("host", port) from "host:port", or a ValueError saying what is allowed."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{address!r} is not host:port (a port from 1 to 65535)")
    return host.strip("[]"), int(port)


def tls_settings(options: Any) -> dict[str, Any]:
    """redis-py's TLS settings from the fields (for rediss:// connections)."""
    settings: dict[str, Any] = {
        "ssl_cert_reqs": "required" if options.tls_verify else "none",
        "ssl_check_hostname": options.tls_verify,
    }
    for field, setting in zip(
        TLS_FIELDS, ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"), strict=True
    ):
        if getattr(options, field) is not None:
            settings[setting] = str(getattr(options, field))
    return settings
