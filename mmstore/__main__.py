"""``python -m mmstore`` is the ``mmstore`` command."""

import sys

from .cli import main

sys.exit(main())
