"""The server's eviction policy, checked once at open: maru relies on the server to evict
its objects when full, and says so where the server would not."""

from __future__ import annotations

import redis

from maru.backends._redis import connect
from maru.backends._redis.options import RedisOptions
from maru.backends._redis.topology import Node
from maru.errors import BackendError
from maru.log import get_logger

log = get_logger(__name__)


def check_eviction_policy(nodes: list[Node], options: RedisOptions) -> None:
    """Warn where a full server would refuse every put (`noeviction`) or keep maru's
    objects (a volatile-* policy while maru sets no `ttl`), naming the setting to use."""
    for node in nodes:
        try:
            policy = eviction_policy(node, options)
        except BackendError:
            continue  # unreachable for now: the calls will say so
        if policy == "noeviction" or (policy.startswith("volatile-") and not options.ttl):
            log.warning(
                "maru redis: %s has maxmemory-policy %s, so once full it %s; set "
                "maxmemory-policy allkeys-lru (or another allkeys-* policy) on the server",
                node.where,
                policy,
                "refuses every put"
                if policy == "noeviction"
                else "evicts none of maru's objects (they have no ttl)",
            )


def eviction_policy(node: Node, options: RedisOptions) -> str:
    """The server's maxmemory-policy; "" where it refuses CONFIG (proxies, managed
    servers, ACL users without it)."""
    with connect.failures("read maxmemory-policy", node.where, options):
        try:
            reply = node.client.config_get("maxmemory-policy")
        except redis.ResponseError:
            return ""
    return str(reply.get("maxmemory-policy", ""))
