"""Moved to :mod:`mmstore.store.reader` in 0.3; this alias of the 0.2 name goes in 0.4."""

import warnings

from .store.reader import *  # noqa: F403 - the alias re-exports the module's public names
from .store.reader import __all__  # noqa: F401

warnings.warn("mmstore.reader moved to mmstore.store.reader; import it from there",
              DeprecationWarning, stacklevel=2)
