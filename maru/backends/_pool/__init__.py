"""The mapped KV pool shared by the shm and cxl backends: its public interface.

One mapped region holds everything: a header, an entry table, a hash index and
the data. There is no server: processes coordinate through the region and
`fcntl` locks on its file. The modules, one concern each:

- `region`: the format (magic, version, header words, geometry, table views) and
  the checks of what is read from it (entry seals, links);
- `locks`: the pool mutex and writer slots (liveness of writers), fork handling;
- `section`: critical sections: the mutex held, half-done changes and damage repaired;
- `index`: key hashes and bucket chains;
- `allocator`: allocation with a clock hand, eviction, freeing;
- `checksum`: the per-object checksum (on unless `checksum: false`);
- `core`: `Pool`, which composes them into reserve/commit/read/contains/...;
- `attach`: creating, mapping and sharing a region within a process;
- `mapping`: a region's file mapped at a huge-page boundary;
- `memory`: backing, population and huge pages of a mapping;
- `audit`: the derived state recomputed and compared, for tests and tools;
- `survey`: pools read and removed without attaching (`maru pool list|gc`);
- `backend`: `PoolBackend`, the Backend contract over a Pool.

The package is private to `maru/backends/`: the shm and cxl backends use only what
this module exports, and code outside `maru/backends/` asks the Backend instead.
"""

from maru.backends._pool.attach import RegionSpec, memory_of
from maru.backends._pool.backend import PoolBackend, PoolOptions
from maru.backends._pool.core import Pool
from maru.backends._pool.mapping import address_of
from maru.backends._pool.memory import reserve
from maru.backends._pool.region import Geometry
from maru.backends._pool.survey import survey_pool

__all__ = [
    "Geometry",
    "Pool",
    "PoolBackend",
    "PoolOptions",
    "RegionSpec",
    "address_of",
    "memory_of",
    "reserve",
    "survey_pool",
]
