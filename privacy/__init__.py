"""Secure aggregation, CKKS, differential privacy and the consortium PKI; imports `fedlt`, not the reverse."""
