"""The disk backend's parts: object files, the store's directory, the LRU index, its options."""
