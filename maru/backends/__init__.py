"""Storage backends. Each one honours the contract in `maru.backends.base`."""
