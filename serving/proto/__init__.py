"""Protocol buffers of the serving API and their generated Python stubs (regenerate with regenerate.py)."""
