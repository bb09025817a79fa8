"""Moved to :mod:`mmstore.format.ragged` in 0.3; this alias of the 0.2 name goes in 0.4."""

import warnings

from .format.ragged import *  # noqa: F403 - the alias re-exports the module's public names
from .format.ragged import __all__  # noqa: F401

warnings.warn("mmstore.ragged moved to mmstore.format.ragged; import it from there",
              DeprecationWarning, stacklevel=2)
