"""gRPC layer: proto <-> domain conversion, status mapping, server lifecycle."""
