"""KV memory: the page allocator (buddy over 8-token base pages), block tables and prefix hashing."""
