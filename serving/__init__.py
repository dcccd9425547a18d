"""gRPC serving: the stratum.v1 proto, the servicer, routing headers, metrics export and the cost model."""
