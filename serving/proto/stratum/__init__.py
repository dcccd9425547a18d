"""The stratum proto package."""
