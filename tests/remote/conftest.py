"""The fixtures of the ``az://`` and ``http(s)://`` tests (``support.scheme_fixtures``)."""

from support.scheme_fixtures import az, azurite_server, web  # noqa: F401
