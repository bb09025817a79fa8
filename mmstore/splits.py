"""Moved to :mod:`mmstore.order.splits` in 0.3; this alias of the 0.2 name goes in 0.4."""

import warnings

from .order.splits import *  # noqa: F403 - the alias re-exports the module's public names
from .order.splits import __all__  # noqa: F401

warnings.warn("mmstore.splits moved to mmstore.order.splits; import it from there",
              DeprecationWarning, stacklevel=2)
