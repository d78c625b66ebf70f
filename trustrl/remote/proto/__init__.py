"""The gateway's protobuf schema: ``trustrl.proto`` and the Python code protoc generated
from it (``trustrl_pb2.py``, ``trustrl_pb2.pyi``; committed, regenerated as
tests/test_gateway_proto.py says). Imports protobuf only."""
