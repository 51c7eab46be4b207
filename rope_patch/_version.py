"""The package version, in a module of its own: rope_patch/__init__.py re-exports it, the modules that record it
(persistence.py) import it without importing the package first, and setuptools reads it without importing anything."""

__version__ = "0.1.0"
