"""The tiered backend's parts: copies into a tier written by a thread of its own."""
