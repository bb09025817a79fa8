"""Moving whole stores between a local directory and object storage.

:func:`push` uploads a finished store to a URL (the manifest last, so a
half-pushed store is never a store there); :func:`pull` downloads one into
``DEST.partial``, verifies every block, file and record, and publishes it as
``DEST``. Both resume after a kill: rerun them. To train from a URL without
pulling first, ``mmstore.open(URL, cache_dir=..., cache_limit=...)``
(:mod:`mmstore.remote.replica`).
"""

from __future__ import annotations

from .pull import pull
from .push import push

__all__ = ["pull", "push"]
