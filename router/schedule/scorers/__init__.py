"""Scorers: weighted cost terms, lower is better. Every module here registers one plugin by name
when imported, and importing the package imports them all: adding one is adding a file."""

import importlib
import pkgutil

for _m in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_m.name}")
