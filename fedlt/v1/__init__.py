"""Generated protobuf and gRPC stubs of protos/fedlt/v1 (`make protos`); a test regenerates and diffs them."""
