"""Moved to :mod:`mmstore.store.writer` in 0.3; this alias of the 0.2 name goes in 0.4."""

import warnings

from .store.writer import *  # noqa: F403 - the alias re-exports the module's public names
from .store.writer import __all__  # noqa: F401

warnings.warn("mmstore.writer moved to mmstore.store.writer; import it from there",
              DeprecationWarning, stacklevel=2)
