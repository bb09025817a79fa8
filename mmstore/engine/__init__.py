"""The batch engine, free of torch: how a loader plans its memory
(``plan``), reads a batch's records (``reads``: page cache, ``preadv``;
``direct``: ``O_DIRECT``; ``aio``: Linux AIO), keeps the reads in flight
(``inflight``), is tuned (``tuning``) and resumes (``state``).
:mod:`mmstore.torch` is an adapter over it."""
