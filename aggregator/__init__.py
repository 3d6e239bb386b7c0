"""The consortium aggregator: gRPC service, round state machine, persistence, operator CLI."""
