"""Old name of ``support.stores`` / ``support.compare`` / ``support.faults``
(a thin re-export kept while other branches still import it; new code
imports from ``support``)."""

from support.compare import BOOKKEEPING, assert_reads_same, assert_same_files  # noqa: F401
from support.faults import drop_dac_override  # noqa: F401
from support.stores import SMALL_SCHEMA, sample, write_parts, write_store  # noqa: F401
