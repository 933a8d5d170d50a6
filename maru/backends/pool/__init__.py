"""The mapped KV pool shared by the shm and cxl backends: its public interface.

One mapped region holds everything: a header, an entry table, a hash index and
the data. There is no server: processes coordinate through the region and
`fcntl` locks on its file. The modules, one concern each:

- `region`: the format (magic, version, header words, geometry, table views);
- `locks`: the pool mutex and writer slots (liveness of writers), fork handling;
- `index`: key hashes and bucket chains;
- `allocator`: allocation with a clock hand, eviction, freeing;
- `checksum`: the optional per-object checksum;
- `core`: `Pool`, which composes them into reserve/commit/read/contains/...;
- `attach`: creating, mapping and sharing a region within a process;
- `memory`: backing, population and huge pages of a mapping;
- `backend`: `PoolBackend`, the Backend contract over a Pool.

Code outside `maru/backends/` uses only what this module exports.
"""

from maru.backends.pool.attach import RegionSpec, memory_of
from maru.backends.pool.backend import PoolBackend, PoolOptions
from maru.backends.pool.core import Pool
from maru.backends.pool.region import Geometry

__all__ = [
    "Geometry",
    "Pool",
    "PoolBackend",
    "PoolOptions",
    "RegionSpec",
    "memory_of",
]
