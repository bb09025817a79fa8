"""Shared test support, one copy of each helper (importable as ``support``:
pytest's ``pythonpath = ["tests"]`` makes ``tests/`` the import root).

- ``stores``  store builders: deterministic records, plain / part / merged stores
- ``images``  photo-like images, encoded files, image folders with broken inputs
- ``compare`` store comparisons: file bytes, every public read path
- ``faults``  fault injection: forked ingest runs with crash points, damaged
              files and manifests, tmpfs / ext4 mounts, dropped root privileges
- ``proc``    running things elsewhere: the CLI in-process or as a child
              process, a function in a forked child with a timeout
- ``fuzz``    the store fuzzer (mutations of a pristine store and its oracle)
"""
