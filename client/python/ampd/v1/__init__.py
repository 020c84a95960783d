"""ampd.v1: trainer_pb2 and trainer_pb2_grpc, generated from proto/ampd/v1/trainer.proto
at build time (client/python/CMakeLists.txt, or setup.py when pip builds the package)."""
