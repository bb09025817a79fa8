"""The fixtures of the ``az://``, ``gs://`` and ``http(s)://`` tests (``support.scheme_fixtures``)."""

from support.scheme_fixtures import az, azurite_server, gcs_server, gs, web  # noqa: F401
