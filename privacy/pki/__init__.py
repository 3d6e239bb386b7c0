"""The consortium PKI: a CA kept in a directory, peer identities read from certificates, bound signatures.

All keys are ECDSA P-256 and every signature is ECDSA with SHA-256, because that is what gRPC's TLS stack and
every silo's OpenSSL accept without configuration.
"""
