"""The package version, which joiners must match."""

__version__ = "0.1.0"
