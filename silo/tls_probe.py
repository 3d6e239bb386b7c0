"""The certificate the aggregator's TLS endpoint presents, read before the silo opens its gRPC channel.

gRPC's Python client verifies the server's chain against the CA but does not expose the certificate, and a
CA signature proves only that the CA holder issued it. So the silo makes one TLS handshake of its own to the
same address, with the same client certificate, reads the server's certificate, and checks it against the
roster's aggregator. (The gRPC channel then connects separately; an attacker able to answer the second
connection differently would also need a CA-issued certificate for the aggregator's name.)

The same handshake says what is wrong when the silo cannot take part, naming the address it dialled, which
gRPC's own errors ("Connection refused", "WRONG_VERSION_NUMBER", "Socket closed") leave out:
`UntrustedAggregator` where the server's certificate fails this silo's CA or the name it dials (its kit is
another consortium's, or the address another service's: retrying cannot help), `ConnectionProblem` for
everything a later attempt may find mended (nothing listening yet, a name that does not resolve, a service
that does not speak TLS or gRPC, an aggregator that does not accept this silo's certificate). After the
handshake the probe exchanges HTTP/2's connection prefaces (RFC 9113 §3.4): a gRPC server answers with its
SETTINGS frame, and one that refused the client certificate closes the connection instead, which in TLS 1.3
happens only after the client's side of the handshake is complete.
"""

from __future__ import annotations

import socket
import ssl
from pathlib import Path

from privacy.pki.errors import PkiError

PROBE_TIMEOUT = 30.0
# the client's HTTP/2 connection preface: the magic octets, then an empty SETTINGS frame
CLIENT_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
FRAME_HEADER = 9  # octets; the fourth is the frame's type
SETTINGS = 4
# OpenSSL's reasons for a first answer that is no TLS record (an HTTP server's "HTTP/1.1 400" is read as a
# record of protocol version "TP")
NOT_TLS = frozenset({"WRONG_VERSION_NUMBER", "HTTP_REQUEST", "UNKNOWN_PROTOCOL", "PACKET_LENGTH_TOO_LONG"})
# verification failures a later attempt may not meet: a certificate out of its validity period
NOT_NOW = frozenset({9, 10})  # X509_V_ERR_CERT_NOT_YET_VALID, X509_V_ERR_CERT_HAS_EXPIRED
NOT_GRPC = "does not speak TLS/gRPC: is it the status page or another service?"
UNTRUSTED = "the aggregator's certificate is not the one the pinned roster names"


class ConnectionProblem(OSError):
    """The aggregator could not be reached or did not answer as one, for a reason a later attempt may not
    meet; the message names the address and what it likely means."""


class UntrustedAggregator(PkiError):
    """The server at the aggregator's address presents a certificate this silo's CA or the name it dials
    refuses: its kit (CA, roster) is another consortium's, or the address another service's."""


def server_certificate(
    address: str, *, server_name: str, ca_pem: bytes, certificate: Path, key: Path
) -> bytes:
    """PEM of the certificate the TLS server at `address` (host:port) presents, once it has accepted this
    silo's certificate and answered as an HTTP/2 server; ConnectionProblem or UntrustedAggregator if not."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cadata=ca_pem.decode())
    context.load_cert_chain(certificate, key)
    context.set_alpn_protocols(["h2"])
    with _connected(address, host, int(port)) as raw:
        tls = _handshake(context, raw, address, server_name or host)
        with tls:
            der = tls.getpeercert(binary_form=True)
            if tls.selected_alpn_protocol() != "h2":
                raise ConnectionProblem(f"{address} speaks TLS but not HTTP/2, so it {NOT_GRPC}")
            _exchange_prefaces(tls, address, certificate)
    if der is None:
        raise PkiError(f"the TLS server at {address} presented no certificate")
    return ssl.DER_cert_to_PEM_cert(der).encode()


def _connected(address: str, host: str, port: int) -> socket.socket:
    try:
        return socket.create_connection((host, port), timeout=PROBE_TIMEOUT)
    except socket.gaierror as exc:
        raise ConnectionProblem(
            f"cannot resolve {host!r}, the host of connection.aggregator {address} ({exc.strerror}): is the "
            "name right, and does this machine's DNS know it?"
        ) from None
    except ConnectionRefusedError:
        raise ConnectionProblem(
            f"nothing listens at {address} (connection refused): is the aggregator running, and is "
            "connection.aggregator its gRPC address (the `listening on` line it printed)?"
        ) from None
    except TimeoutError:
        raise ConnectionProblem(
            f"no answer from {address} within {PROBE_TIMEOUT:.0f} s: a firewall dropping the connection, "
            "or the wrong host?"
        ) from None
    except OSError as exc:
        raise ConnectionProblem(f"cannot reach {address}: {exc.strerror or exc}") from None


def _handshake(context: ssl.SSLContext, raw: socket.socket, address: str, name: str) -> ssl.SSLSocket:
    try:
        return context.wrap_socket(raw, server_hostname=name)
    except ssl.SSLCertVerificationError as exc:
        if exc.verify_code in NOT_NOW:
            raise ConnectionProblem(
                f"the aggregator at {address} presents a certificate out of its validity period "
                f"({exc.verify_message}): its operator renews it (python -m aggregator ca renew-server), "
                "or this machine's clock is wrong"
            ) from None
        raise UntrustedAggregator(
            f"{UNTRUSTED}: the TLS server at {address} presents a certificate that {_refusal(exc, name)}. "
            "Check that connection.aggregator is this consortium's aggregator, and that connection.ca and "
            "connection.roster are the files of this consortium's enrollment kit, not another's"
        ) from None
    except TimeoutError:
        raise ConnectionProblem(
            f"{address} gave no TLS answer within {PROBE_TIMEOUT:.0f} s, so it {NOT_GRPC}"
        ) from None
    except (ConnectionError, ssl.SSLEOFError, ssl.SSLZeroReturnError) as exc:
        raise ConnectionProblem(
            f"{address} ended the TLS handshake ({exc.strerror or type(exc).__name__}), so it {NOT_GRPC}"
        ) from None
    except ssl.SSLError as exc:
        if exc.reason in NOT_TLS:
            raise ConnectionProblem(f"{address} {NOT_GRPC} (its answer is no TLS: {exc.reason})") from None
        raise ConnectionProblem(f"the TLS handshake with {address} failed ({exc.reason or exc})") from None


def _refusal(exc: ssl.SSLCertVerificationError, name: str) -> str:
    """Why this silo refuses the server's certificate, as a clause."""
    if exc.verify_code == 62:  # X509_V_ERR_HOSTNAME_MISMATCH
        return (
            f"is not issued for {name!r} (set connection.server_name to a name the roster's aggregator has)"
        )
    return f"this silo's CA does not vouch for ({exc.verify_message})"


def _exchange_prefaces(tls: ssl.SSLSocket, address: str, certificate: Path) -> None:
    """Send HTTP/2's client preface and read the server's first frame: SETTINGS from a gRPC server that
    accepted this silo's certificate; nothing, or an alert, from one that did not."""
    refused = (
        f"the aggregator at {address} closed the connection after the TLS handshake: it does not accept this "
        f"silo's certificate ({certificate}); check that this consortium's CA issued it and that it has not "
        "expired"
    )
    try:
        tls.sendall(CLIENT_PREFACE)
        header = tls.recv(FRAME_HEADER)
    except (ConnectionError, ssl.SSLEOFError, ssl.SSLZeroReturnError):
        raise ConnectionProblem(refused) from None
    except ssl.SSLError as exc:
        raise ConnectionProblem(f"{refused} (TLS alert {exc.reason})") from None
    except TimeoutError:
        raise ConnectionProblem(
            f"{address} sent no HTTP/2 settings within {PROBE_TIMEOUT:.0f} s, so it {NOT_GRPC}"
        ) from None
    if not header:
        raise ConnectionProblem(refused)
    if len(header) < 4 or header[3] != SETTINGS:
        raise ConnectionProblem(f"{address} does not answer as an HTTP/2 server, so it {NOT_GRPC}")
