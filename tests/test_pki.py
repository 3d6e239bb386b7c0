import ipaddress
import os
from concurrent import futures
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from hypothesis import given, settings
from hypothesis import strategies as st

from privacy.pki.ca import (
    CaPaths,
    IssuedPaths,
    PkiError,
    init_ca,
    issue_operator,
    issue_server,
    issue_silo,
    list_issued,
    revoke,
)
from privacy.pki.identity import (
    RevocationList,
    load_certificate,
    operator_name_of,
    read_certificate,
    silo_id_of,
    verify_chain,
)
from privacy.pki.signing import load_private_key, sign, verify

CONTEXT = "fedlt/test/v1"


@dataclass(frozen=True)
class Pki:
    ca: CaPaths
    server: IssuedPaths
    silo_a: IssuedPaths
    silo_b: IssuedPaths
    expired: IssuedPaths
    future: IssuedPaths
    operator: IssuedPaths
    other_ca: CaPaths
    intruder: IssuedPaths  # same silo id as silo_a, from another CA of the same name


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    root = tmp_path_factory.mktemp("pki")
    ca_dir, other_dir, out = root / "ca", root / "other-ca", root / "out"
    now = datetime.now(UTC)
    return Pki(
        ca=init_ca(ca_dir, name="Test Consortium"),
        server=issue_server(ca_dir, out, hosts=["127.0.0.1", "localhost"]),
        silo_a=issue_silo(ca_dir, out, silo_id="hospital-a"),
        silo_b=issue_silo(ca_dir, out, silo_id="bank.b"),
        expired=issue_silo(ca_dir, out, silo_id="expired", valid_from=now - timedelta(days=10), days=1),
        future=issue_silo(ca_dir, out, silo_id="future", valid_from=now + timedelta(days=1)),
        operator=issue_operator(ca_dir, out),
        other_ca=init_ca(other_dir, name="Test Consortium"),
        intruder=issue_silo(other_dir, root / "intruder", silo_id="hospital-a"),
    )


@pytest.fixture
def fresh(tmp_path) -> CaPaths:
    return init_ca(tmp_path / "ca", name="Fresh Consortium")


def cert_of(issued: IssuedPaths | CaPaths) -> x509.Certificate:
    return read_certificate(issued.certificate)


def ext(cert: x509.Certificate, kind):
    return cert.extensions.get_extension_for_class(kind)


# --- structure -------------------------------------------------------------------------------------------


def test_ca_certificate_may_sign_only_certificates_and_crls(pki):
    cert = cert_of(pki.ca)
    constraints = ext(cert, x509.BasicConstraints)
    assert constraints.critical
    assert (constraints.value.ca, constraints.value.path_length) == (True, 0)
    usage = ext(cert, x509.KeyUsage)
    assert usage.critical
    assert (usage.value.key_cert_sign, usage.value.crl_sign, usage.value.digital_signature) == (
        True,
        True,
        False,
    )
    assert ext(cert, x509.SubjectKeyIdentifier).value.digest
    assert cert.subject == cert.issuer
    assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
    assert cert.public_key().curve.name == "secp256r1"
    assert cert.signature_hash_algorithm.name == "sha256"
    assert pki.ca.key.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")  # PKCS8


def test_key_files_are_private_and_certificates_public(pki):
    for issued in (pki.ca, pki.server, pki.silo_a, pki.operator):
        assert issued.key.stat().st_mode & 0o777 == 0o600
        assert issued.certificate.stat().st_mode & 0o777 == 0o644


def test_server_certificate_names_its_hosts_for_server_auth_only(pki):
    cert = cert_of(pki.server)
    sans = ext(cert, x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert sans.get_values_for_type(x509.DNSName) == ["localhost"]
    assert list(ext(cert, x509.ExtendedKeyUsage).value) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert ext(cert, x509.KeyUsage).value.digital_signature
    assert not ext(cert, x509.BasicConstraints).value.ca
    assert pki.server.certificate.name == "aggregator.pem"
    with pytest.raises(PkiError, match="not a client certificate"):
        silo_id_of(cert)


def test_silo_certificate_carries_its_id_for_client_auth(pki):
    cert = cert_of(pki.silo_a)
    assert ext(cert, x509.SubjectAlternativeName).value.get_values_for_type(
        x509.UniformResourceIdentifier
    ) == ["fedlt://silo/hospital-a"]
    assert list(ext(cert, x509.ExtendedKeyUsage).value) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "hospital-a"
    assert (pki.silo_a.certificate.name, pki.silo_a.key.name) == ("hospital-a.pem", "hospital-a.key")
    assert silo_id_of(cert) == "hospital-a"
    assert silo_id_of(cert_of(pki.silo_b)) == "bank.b"


def test_an_operator_is_not_a_silo_and_a_silo_is_not_an_operator(pki):
    assert operator_name_of(cert_of(pki.operator)) == "operator"
    with pytest.raises(PkiError, match="names fedlt://operator/operator, but silo certificates name"):
        silo_id_of(cert_of(pki.operator))
    with pytest.raises(PkiError, match="names fedlt://silo/hospital-a, but operator certificates name"):
        operator_name_of(cert_of(pki.silo_a))


def test_silo_id_falls_back_to_the_common_name_only_without_a_fedlt_uri(pki):
    key = load_private_key(pki.ca.key)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "legacy-silo")])
    now = datetime.now(UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(cert_of(pki.ca).subject)
        .public_key(ec.generate_private_key(ec.SECP256R1()).public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + timedelta(days=1))
    )
    client = builder.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    assert silo_id_of(client.sign(key, hashes.SHA256())) == "legacy-silo"
    with pytest.raises(PkiError, match="names no operator"):
        operator_name_of(client.sign(key, hashes.SHA256()))
    with pytest.raises(PkiError, match="not a client certificate"):
        silo_id_of(builder.sign(key, hashes.SHA256()))


def test_load_certificate_refuses_garbage():
    with pytest.raises(PkiError, match="not a PEM certificate"):
        load_certificate(b"-----BEGIN CERTIFICATE-----\nnope\n-----END CERTIFICATE-----\n")


# --- chain and validity ----------------------------------------------------------------------------------


def test_verify_chain_accepts_a_certificate_of_this_ca(pki):
    for issued in (pki.server, pki.silo_a, pki.operator):
        verify_chain(cert_of(issued), cert_of(pki.ca))


def test_verify_chain_refuses_a_certificate_of_another_ca_with_the_same_name(pki):
    with pytest.raises(PkiError, match="not issued by the consortium CA"):
        verify_chain(cert_of(pki.intruder), cert_of(pki.ca))


def test_verify_chain_refuses_an_expired_certificate(pki):
    with pytest.raises(PkiError, match="expired on"):
        verify_chain(cert_of(pki.expired), cert_of(pki.ca))


def test_verify_chain_refuses_a_certificate_not_yet_valid(pki):
    with pytest.raises(PkiError, match="not yet valid"):
        verify_chain(cert_of(pki.future), cert_of(pki.ca))


# --- revocation ------------------------------------------------------------------------------------------


def test_a_revocation_takes_effect_on_reload(fresh, tmp_path):
    a = issue_silo(fresh.directory, tmp_path / "out", silo_id="a")
    b = issue_silo(fresh.directory, tmp_path / "out", silo_id="b")
    revocations = RevocationList.load(fresh.certificate, fresh.crl)
    assert not revocations.is_revoked(cert_of(a))
    assert revoke(fresh.directory, silo_id="a") == a.serial
    revocations.reload()
    assert revocations.is_revoked(cert_of(a))
    assert not revocations.is_revoked(cert_of(b))
    assert [r.revoked_at is not None for r in list_issued(fresh.directory)] == [True, False]
    assert revoke(fresh.directory, serial=b.serial) == b.serial
    revocations.reload()
    assert revocations.is_revoked(cert_of(b))


def test_revoking_twice_or_nothing_is_refused(fresh, tmp_path):
    a = issue_silo(fresh.directory, tmp_path / "out", silo_id="a")
    revoke(fresh.directory, silo_id="a")
    with pytest.raises(PkiError, match="no live certificate"):
        revoke(fresh.directory, silo_id="a")
    with pytest.raises(PkiError, match="already revoked"):
        revoke(fresh.directory, serial=a.serial)
    with pytest.raises(PkiError, match="no certificate with serial"):
        revoke(fresh.directory, serial=a.serial + 1)


@pytest.mark.parametrize(
    ("name", "refusal"),
    [("Test Consortium", "does not verify"), ("Another Consortium", "not by the consortium CA")],
)
def test_a_crl_of_another_ca_is_refused(pki, tmp_path, name, refusal):
    other = init_ca(tmp_path / "other", name=name)
    with pytest.raises(PkiError, match=refusal):
        RevocationList.load(pki.ca.certificate, other.crl)


def test_a_tampered_crl_is_refused_even_after_a_good_one(fresh, tmp_path):
    revocations = RevocationList.load(fresh.certificate, fresh.crl)
    crl = x509.load_pem_x509_crl(fresh.crl.read_bytes())
    der = bytearray(crl.public_bytes(serialization.Encoding.DER))
    der[-1] ^= 0x01  # the last byte of the signature
    tampered = x509.load_der_x509_crl(bytes(der)).public_bytes(serialization.Encoding.PEM)
    fresh.crl.write_bytes(tampered)
    with pytest.raises(PkiError, match="does not verify"):
        revocations.reload()
    with pytest.raises(PkiError, match="does not verify"):
        RevocationList.load(fresh.certificate, fresh.crl)


def test_a_missing_crl_is_an_error_not_an_empty_list(fresh):
    fresh.crl.unlink()
    with pytest.raises(PkiError, match="cannot read CRL"):
        RevocationList.load(fresh.certificate, fresh.crl)


# --- signatures ------------------------------------------------------------------------------------------


def test_a_signature_verifies_only_for_its_data_signer_and_context(pki):
    signature = sign(pki.silo_a.key, b"round 7", context=CONTEXT)
    verify(cert_of(pki.silo_a), signature, b"round 7", context=CONTEXT)
    with pytest.raises(PkiError, match="signature does not verify"):
        verify(cert_of(pki.silo_a), signature, b"round 8", context=CONTEXT)
    with pytest.raises(PkiError, match="signature does not verify"):
        verify(cert_of(pki.silo_b), signature, b"round 7", context=CONTEXT)
    with pytest.raises(PkiError, match="signature does not verify"):
        verify(cert_of(pki.silo_a), signature, b"round 7", context="fedlt/other/v1")
    with pytest.raises(PkiError, match="signature does not verify"):
        verify(cert_of(pki.silo_a), b"not a signature", b"round 7", context=CONTEXT)


def test_the_context_length_prefix_keeps_context_and_data_apart(pki):
    signature = sign(pki.silo_a.key, b"c", context="fedlt/ab")
    with pytest.raises(PkiError, match="signature does not verify"):
        verify(cert_of(pki.silo_a), signature, b"bc", context="fedlt/a")


@settings(max_examples=25, deadline=None)
@given(data=st.binary(max_size=256))
def test_a_signature_verifies_exactly_the_signed_bytes(pki, data):
    key = load_private_key(pki.silo_b.key)
    signature = sign(key, data, context=CONTEXT)
    verify(cert_of(pki.silo_b), signature, data, context=CONTEXT)
    with pytest.raises(PkiError, match="signature does not verify"):
        verify(cert_of(pki.silo_b), signature, data + b"x", context=CONTEXT)


def test_load_private_key_refuses_a_key_others_can_read(tmp_path, pki):
    exposed = tmp_path / "exposed.key"
    exposed.write_bytes(pki.silo_a.key.read_bytes())
    os.chmod(exposed, 0o644)
    with pytest.raises(PkiError, match=r"accessible by group or others \(mode 0644\).*chmod 600"):
        load_private_key(exposed)
    with pytest.raises(PkiError, match="accessible by group or others"):
        sign(exposed, b"x", context=CONTEXT)


def test_load_private_key_refuses_a_file_that_is_not_a_key(tmp_path):
    garbage = tmp_path / "garbage.key"
    garbage.write_bytes(b"hello")
    garbage.chmod(0o600)
    with pytest.raises(PkiError, match="not an unencrypted PEM private key"):
        load_private_key(garbage)


# --- refusals --------------------------------------------------------------------------------------------


def test_init_ca_never_overwrites_a_ca(fresh):
    key = fresh.key.read_bytes()
    with pytest.raises(PkiError, match="already holds a CA"):
        init_ca(fresh.directory, name="Again")
    assert fresh.key.read_bytes() == key


@pytest.mark.parametrize("silo_id", ["", "-lead", "with space", "a/b", "x" * 65, "é", "a\n"])
def test_an_invalid_silo_id_is_refused_with_the_rule(fresh, tmp_path, silo_id):
    with pytest.raises(PkiError, match=r"invalid silo id .*letters, digits"):
        issue_silo(fresh.directory, tmp_path / "out", silo_id=silo_id)


@pytest.mark.parametrize("host", ["", "host:50051", "under_score.org", "-x.org"])
def test_an_invalid_host_is_refused(fresh, tmp_path, host):
    with pytest.raises(PkiError, match="invalid host"):
        issue_server(fresh.directory, tmp_path / "out", hosts=[host])


def test_issued_keys_never_go_into_the_ca_directory(fresh):
    with pytest.raises(PkiError, match="outside the CA directory"):
        issue_silo(fresh.directory, fresh.directory, silo_id="ca", replace=True)


def test_a_second_live_certificate_needs_replace_which_revokes_the_first(fresh, tmp_path):
    first = issue_silo(fresh.directory, tmp_path / "out", silo_id="a")
    first_cert = cert_of(first)  # the replacement overwrites the file
    with pytest.raises(PkiError, match="already has a live certificate"):
        issue_silo(fresh.directory, tmp_path / "elsewhere", silo_id="a")
    second = issue_silo(fresh.directory, tmp_path / "out", silo_id="a", replace=True)
    assert second.replaced == first.serial
    records = {r.serial: r for r in list_issued(fresh.directory)}
    assert records[first.serial].revoked_at is not None
    assert records[second.serial].revoked_at is None
    revocations = RevocationList.load(fresh.certificate, fresh.crl)
    assert revocations.is_revoked(first_cert)
    assert not revocations.is_revoked(cert_of(second))
    assert silo_id_of(cert_of(second)) == "a"


def test_existing_key_files_are_not_overwritten_without_replace(fresh, tmp_path):
    issue_silo(fresh.directory, tmp_path / "out", silo_id="a")
    revoke(fresh.directory, silo_id="a")
    with pytest.raises(PkiError, match=r"a\.key already exists"):
        issue_silo(fresh.directory, tmp_path / "out", silo_id="a")


def test_a_certificate_never_outlives_its_ca(tmp_path):
    ca = init_ca(tmp_path / "ca", name="Short CA", days=10)
    issued = issue_silo(ca.directory, tmp_path / "out", silo_id="a", days=825)
    assert issued.not_after == cert_of(ca).not_valid_after_utc == cert_of(issued).not_valid_after_utc


# --- a real mutual-TLS handshake -------------------------------------------------------------------------


def _ping(request: bytes, context: grpc.ServicerContext) -> bytes:
    return silo_id_of(load_certificate(context.auth_context()["x509_pem_cert"][0])).encode()


@pytest.fixture(scope="module")
def tls_port(pki):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    handler = grpc.method_handlers_generic_handler(
        "t.T", {"Ping": grpc.unary_unary_rpc_method_handler(_ping)}
    )
    server.add_generic_rpc_handlers((handler,))
    credentials = grpc.ssl_server_credentials(
        [(pki.server.key.read_bytes(), pki.server.certificate.read_bytes())],
        root_certificates=pki.ca.certificate.read_bytes(),
        require_client_auth=True,
    )
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    try:
        yield port
    finally:
        server.stop(None)


def ping(pki: Pki, port: int, client: IssuedPaths | None, *, roots: CaPaths | None = None) -> bytes:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=(roots or pki.ca).certificate.read_bytes(),
        private_key=None if client is None else client.key.read_bytes(),
        certificate_chain=None if client is None else client.certificate.read_bytes(),
    )
    options = [("grpc.use_local_subchannel_pool", 1)]
    with grpc.secure_channel(f"127.0.0.1:{port}", credentials, options=options) as channel:
        return channel.unary_unary("/t.T/Ping")(b"", timeout=5)


def test_mutual_tls_admits_a_silo_of_this_ca_and_names_it_from_its_certificate(pki, tls_port):
    assert ping(pki, tls_port, pki.silo_a) == b"hospital-a"
    assert ping(pki, tls_port, pki.silo_b) == b"bank.b"


@pytest.mark.parametrize("client", [None, "intruder", "expired", "future"])
def test_mutual_tls_refuses_clients_without_a_valid_certificate_of_this_ca(pki, tls_port, client):
    with pytest.raises(grpc.RpcError) as refused:
        ping(pki, tls_port, None if client is None else getattr(pki, client))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_silo_refuses_an_aggregator_whose_certificate_is_of_another_ca(pki, tls_port):
    with pytest.raises(grpc.RpcError) as refused:
        ping(pki, tls_port, pki.intruder, roots=pki.other_ca)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
