"""Moved to :mod:`mmstore.format.schema` in 0.3; this alias of the 0.2 name goes in 0.4."""

import warnings

from .format.schema import *  # noqa: F403 - the alias re-exports the module's public names
from .format.schema import __all__  # noqa: F401

warnings.warn("mmstore.schema moved to mmstore.format.schema; import it from there",
              DeprecationWarning, stacklevel=2)
