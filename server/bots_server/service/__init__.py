"""gRPC layer: no SQL, no numpy.

    convert.py       API messages <-> the core's domain types
    servicer.py      the TaskSelector servicer: convert, delegate to the core, convert back
    status.py        errors -> status codes, in one place
    handlers.py      the generated method handlers, with requests that always parse
    interceptors.py  request ids, per-RPC metrics, bearer-token auth
    rpc_names.py     gRPC names as Prometheus labels
    tls.py           TLS and mutual TLS credentials
    server.py        build, serve, shut down gracefully
"""
