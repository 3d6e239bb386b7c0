"""The `blind` privacy layer: a secure sum under the silos' output masks, so the aggregator reads neither a
silo's input nor any sum (the model), and no single silo reads another's input (`halves`, `keys`)."""
