"""Private machinery of the redis backend: its options, how it connects, where each key
lives (one server, a Sentinel-watched primary, or the primaries of a cluster), and the
wire path that moves objects straight between sockets and the callers' buffers."""
