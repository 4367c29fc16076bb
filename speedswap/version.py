"""The package version (one place; setup.py reads it from here)."""

__version__ = "0.1.0"
