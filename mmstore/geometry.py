"""Moved to :mod:`mmstore.decode.geometry` in 0.3; this alias of the 0.2 name goes in 0.4."""

import warnings

from .decode.geometry import *  # noqa: F403 - the alias re-exports the module's public names
from .decode.geometry import __all__  # noqa: F401

warnings.warn("mmstore.geometry moved to mmstore.decode.geometry; import it from there",
              DeprecationWarning, stacklevel=2)
