"""setup.py: only the build step pyproject.toml cannot express.

ampd/v1/trainer_pb2.py and trainer_pb2_grpc.py are generated from
proto/ampd/v1/trainer.proto, never committed. A package staged by CMake
(client/python/CMakeLists.txt) already holds them; from a source checkout,
build_py runs protoc with grpc_python_plugin (Debian: protobuf-compiler and
protobuf-compiler-grpc) on ../../proto, or on $AMPD_PROTO_DIR.
"""
import os
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
STUBS = ("trainer_pb2.py", "trainer_pb2_grpc.py")


def generate_stubs(out_dir):
    proto_dir = os.environ.get("AMPD_PROTO_DIR", os.path.join(HERE, "..", "..", "proto"))
    proto = os.path.join(proto_dir, "ampd", "v1", "trainer.proto")
    if not os.path.isfile(proto):
        raise SystemExit("ampd: %s not found: build from the ampd source tree (client/python) "
                         "or set AMPD_PROTO_DIR to its proto/ directory" % proto)
    protoc = shutil.which("protoc")
    plugin = shutil.which("grpc_python_plugin")
    if protoc is None or plugin is None:
        raise SystemExit("ampd: protoc and grpc_python_plugin are needed to generate ampd/v1 "
                         "(Debian: apt-get install protobuf-compiler protobuf-compiler-grpc)")
    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    subprocess.run([protoc, "--proto_path=" + proto_dir, "--python_out=" + out_dir,
                    "--grpc_python_out=" + out_dir, "--plugin=protoc-gen-grpc_python=" + plugin,
                    os.path.join("ampd", "v1", "trainer.proto")], check=True, cwd=proto_dir)


class BuildPyWithStubs(build_py):
    def run(self):
        super().run()
        staged = os.path.join(HERE, "ampd", "v1")
        if all(os.path.isfile(os.path.join(staged, s)) for s in STUBS):
            return  # staged by CMake: build_py copied them already
        generate_stubs(self.build_lib)


setup(cmdclass={"build_py": BuildPyWithStubs})
