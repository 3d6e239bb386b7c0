"""fedlt: federated learning on long-tailed, non-IID data where the aggregator only ever sees sums."""

__version__ = "0.1.0"
