"""The vLLM half of maru: the only package that imports vLLM.

`maru.connector.MaruKVConnector` is the facade vLLM loads; it hands each call to one of
two halves, kept apart as vLLM keeps them apart:

- `scheduler`: lookups, and which chunks to load and save (vLLM's scheduler process);
- `worker`: copying chunks between the store and the KV cache (each worker process),
  through `maru.transfer`;
- `metadata`: what the scheduler half sends the workers each step, and the handshake;
- `keys`: the key schema: every key, object header and namespace record, built and parsed;
- `records`: the namespace records kept in the store, read and compared;
- `identity`: what identifies a chunk's bytes (model weights, dtypes, layout, hash seed);
- `guard`: when a half uses the store, and when it backs off;
- `stats` and `metrics`: every statistic in one table, the connector's stats and
  Prometheus metrics made from it;
- `events`: KV events for routers;
- `groups`: the KV cache groups maru serves, and what a chunk stores of each;
- `registration`: the connector's name in vLLM's connector factory (an entry point);
- `compat`: what differs between vLLM releases;
- `command_line`: an instance as a `vllm serve` command line would start it (`maru doctor`).

`keys` and `records` import neither vLLM nor torch (the `maru` command uses them); this
module imports nothing, so importing one of them costs only that module.
"""
