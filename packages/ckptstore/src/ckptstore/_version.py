"""The package version, in a module of its own: any module can record it without importing the
package ``__init__`` (which imports every module: a hidden import cycle)."""

__version__ = "0.1.0"
