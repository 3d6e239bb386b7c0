"""The certificate the aggregator's TLS endpoint presents, read before the silo opens its gRPC channel.

gRPC's Python client verifies the server's chain against the CA but does not expose the certificate, and a
CA signature proves only that the CA holder issued it. So the silo makes one TLS handshake of its own to the
same address, with the same client certificate, reads the server's certificate, and checks it against the
roster's aggregator. (The gRPC channel then connects separately; an attacker able to answer the second
connection differently would also need a CA-issued certificate for the aggregator's name.)
"""

from __future__ import annotations

import socket
import ssl
from pathlib import Path

from privacy.pki.errors import PkiError

PROBE_TIMEOUT = 30.0


def server_certificate(
    address: str, *, server_name: str, ca_pem: bytes, certificate: Path, key: Path
) -> bytes:
    """PEM of the certificate the TLS server at `address` (host:port) presents; OSError if unreachable."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cadata=ca_pem.decode())
    context.load_cert_chain(certificate, key)
    context.set_alpn_protocols(["h2"])
    with (
        socket.create_connection((host, int(port)), timeout=PROBE_TIMEOUT) as raw,
        context.wrap_socket(raw, server_hostname=server_name or host) as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    if der is None:
        raise PkiError(f"the TLS server at {address} presented no certificate")
    return ssl.DER_cert_to_PEM_cert(der).encode()
