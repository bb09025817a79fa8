"""The package version, in a leaf module that the package, the writer and the CLI all import."""

__version__ = "0.4.0"
