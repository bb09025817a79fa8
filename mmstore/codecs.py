"""Moved to :mod:`mmstore.format.codecs` in 0.3; this alias of the 0.2 name goes in 0.4."""

import warnings

from .format.codecs import *  # noqa: F403 - the alias re-exports the module's public names
from .format.codecs import __all__  # noqa: F401

warnings.warn("mmstore.codecs moved to mmstore.format.codecs; import it from there",
              DeprecationWarning, stacklevel=2)
