"""The generated protobuf and gRPC code of the bots.v1 API (scripts/gen_proto.py).

Public: the server and other tools import the messages from here.
"""
