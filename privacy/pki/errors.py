"""The PKI's one error type, in its own module so that `ca`, `identity` and `signing` can all raise it."""

from __future__ import annotations

from fedlt.errors import FedltError


class PkiError(FedltError):
    """A certificate, key, CRL or signature is refused, or a CA request is invalid; the message says which."""
