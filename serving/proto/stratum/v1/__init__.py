"""stratum.v1: the serving API (stratum.proto) and its generated stubs, stratum_pb2 and stratum_pb2_grpc."""
