"""The library's version: one place, read by the package metadata (pyproject.toml) and
sent in every connection's handshake, so that ranks running different installs fail at
connect time with a message saying so."""

__version__ = "0.1.0"
