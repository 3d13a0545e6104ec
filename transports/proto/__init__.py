"""Generated protobuf code for proto/ (see tests/test_grpc_web_codec.py for the drift check); do not edit."""
