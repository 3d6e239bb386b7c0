"""CKKS homomorphic encryption (TenSEAL): the `ckks` privacy layer.

`keys` holds the consortium's CKKS key as two types, the secret context silos keep and the public one the
aggregator adds with; `seeded` writes a silo's uploads as seeded ciphertexts, half the bytes of TenSEAL's own;
`halves` is the layer's two halves, with the consistency step that lets a silo decrypt only a sum every silo
it counts signed; `layer` makes the halves for the simulator and the consortium, and declares the layer in
the registry (`LAYER`); `wire` puts its messages on the consortium's wire. It asks the runtime for two
capabilities: the key service (`privacy.keyservice`), which moves the secret context from the silo that made
it to every other silo, sealed to each one's enrollment key; and "silos step", as only silos can read its
sums, with `privacy.stepping`: masks on what they release after decrypting, and the state they step to kept
sealed and signed by every silo that computed it.
"""
