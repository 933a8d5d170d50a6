"""How the backend reaches a server: blocking connection pools built from the fields
(timeouts, TLS, ACL user) rather than from URL query arguments, Sentinel, and the one
place where redis-py's errors become maru's."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.connection import parse_url
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelConnectionPool

from maru.backends._redis.options import RedisOptions, tls_settings
from maru.errors import BackendError, ConfigError

ACL_NEEDS = (
    "a user whose ACL allows GET, SET, EXISTS, DEL, SCAN, STRLEN and INFO on the keys "
    "under key_prefix (and CLUSTER SLOTS in a cluster)"
)


@contextmanager
def failures(operation: str, where: str, options: RedisOptions) -> Iterator[None]:
    """redis-py errors inside become maru's: refused credentials or permissions a
    ConfigError naming the field (retrying cannot fix them), anything else a
    BackendError naming the operation and the server (never the password)."""
    try:
        yield
    except redis.AuthenticationError as exc:
        raise ConfigError(
            f"redis.username = {options.username!r} / redis.password: {where} refused them "
            f"({type(exc).__name__}: {exc}); allowed: a user and password the server accepts"
        ) from None
    except (redis.exceptions.NoPermissionError, redis.exceptions.AuthorizationError) as exc:
        raise ConfigError(
            f"redis.username = {options.username!r} may not {operation} on {where} "
            f"({type(exc).__name__}: {exc}); allowed: {ACL_NEEDS}"
        ) from None
    except redis.RedisError as exc:
        raise BackendError(f"{operation} on {where} failed: {type(exc).__name__}: {exc}") from None


def settings(options: RedisOptions, url: str) -> dict[str, Any]:
    """redis-py's connection settings for `url`: the URL's, then maru's fields over them."""
    chosen = parse_url(url)
    chosen.update(
        socket_connect_timeout=options.connect_timeout,
        socket_timeout=options.timeout,
        retry=Retry(NoBackoff(), 0),
        protocol=2,  # the wire path reads RESP2
    )
    if options.username:
        chosen["username"] = options.username
    if options.password:
        chosen["password"] = options.password.get_secret_value()
    if options.db is not None:
        chosen["db"] = options.db
    if urlsplit(url).scheme == "rediss":
        chosen.update(tls_settings(options))
    return chosen


def client(options: RedisOptions, url: str) -> redis.Redis:
    """A client of the server at `url` whose callers beyond `pool_size` wait up to
    `pool_timeout` for a connection instead of failing at once."""
    pool = redis.BlockingConnectionPool(
        max_connections=options.pool_size, timeout=options.pool_timeout, **settings(options, url)
    )
    return redis.Redis(connection_pool=pool)


class BlockingSentinelPool(SentinelConnectionPool, redis.BlockingConnectionPool):
    """Connections to the primary the Sentinels name, waited for as in `client`."""


def sentinel_client(options: RedisOptions) -> redis.Redis:
    """A client of the primary the Sentinels name: after a failover, new connections go
    to the new primary. The Sentinels are asked with maru's timeouts too."""
    addresses, service_name = options.sentinel
    chosen = settings(options, "redis://")
    chosen.pop("host", None)
    timeouts = {
        "socket_connect_timeout": options.connect_timeout,
        "socket_timeout": options.timeout,
        "retry": Retry(NoBackoff(), 0),
    }
    sentinel = Sentinel(addresses, sentinel_kwargs=timeouts, **chosen)
    return sentinel.master_for(
        service_name,
        connection_pool_class=BlockingSentinelPool,
        max_connections=options.pool_size,
        timeout=options.pool_timeout,
    )
