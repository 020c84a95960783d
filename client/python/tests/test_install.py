"""The package as a user gets it: `pip install ./client/python` (protoc runs in
setup.py's build_py) and the build's wheel, each into a fresh virtual
environment with system site packages (grpcio, protobuf, numpy and torch
from Debian), without network (--no-build-isolation --no-deps). Then the
venv's python alone runs examples/train_mlp.py (trains, skipped steps, scale
changes, export) and, where torch is importable, examples/quickstart.py,
which also loads the exported state into an nn.Sequential whose loss must
match ampd's."""
import importlib
import os
import re
import shutil
import subprocess
import sys


SOURCE = os.environ.get("AMPD_SOURCE_DIR") or os.path.abspath(
    os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def venv(workdir, name):
    path = os.path.join(workdir, name)
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", path], check=True)
    return os.path.join(path, "bin", "python")


def clean_env():
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the venv alone must provide ampd
    env["PIP_NO_INDEX"] = "1"
    return env


def pip_install(python, target, workdir):
    subprocess.run([python, "-m", "pip", "install", "--no-build-isolation", "--no-deps",
                    "--no-cache-dir", target], check=True, cwd=workdir, env=clean_env(),
                   capture_output=True)
    where = subprocess.run([python, "-c", "import ampd.v1.trainer_pb2 as m; print(m.__file__)"],
                           check=True, cwd=workdir, env=clean_env(), capture_output=True, text=True)
    assert where.stdout.startswith(os.path.dirname(os.path.dirname(python))), where.stdout


def run_quickstart(python, server, workdir):
    out = subprocess.run(
        [python, os.path.join(SOURCE, "client", "python", "examples", "quickstart.py"),
         server.address], check=True, cwd=workdir, env=clean_env(), capture_output=True,
        text=True, timeout=300).stdout
    skipped = int(re.search(r"skipped (\d+)", out).group(1))
    scales = re.search(r"scales \[(.*)\]", out).group(1).split(",")
    torch_loss, ampd_loss = map(float, re.search(r"torch (\S+) ampd (\S+)", out).groups())
    assert skipped > 0 and len(scales) > 1, out
    assert abs(torch_loss - ampd_loss) <= 1e-2 * abs(torch_loss), out  # fp16 forward vs fp32
    assert os.path.getsize(os.path.join(workdir, "mlp.safetensors")) > 0


def run_examples(python, server, workdir):
    """quickstart.py where torch is importable; train_mlp.py (no torch needed) always."""
    out = subprocess.run(
        [python, os.path.join(SOURCE, "client", "python", "examples", "train_mlp.py"),
         "--server", server.address, "--steps", "30", "--growth-interval", "5",
         "--out", os.path.join(workdir, "train_mlp.safetensors")],
        check=True, cwd=workdir, env=clean_env(), capture_output=True, text=True,
        timeout=300).stdout
    assert "SKIPPED (overflow)" in out and "->" in out and "exported to" in out, out
    try:  # the venv sees the same system site packages as this python
        importlib.import_module("torch")
    except ImportError:
        return
    run_quickstart(python, server, workdir)


def test_pip_install_from_source(server, workdir):
    # A copy of the checkout's client/python and proto/, so the build leaves
    # nothing in the source tree.
    tree = os.path.join(workdir, "src")
    shutil.copytree(os.path.join(SOURCE, "client", "python"), os.path.join(tree, "client", "python"),
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__",
                                                  "trainer_pb2*.py"))
    shutil.copytree(os.path.join(SOURCE, "proto"), os.path.join(tree, "proto"))
    python = venv(workdir, "venv")
    pip_install(python, os.path.join(tree, "client", "python"), workdir)
    run_examples(python, server, workdir)


def test_pip_install_without_proto_fails_clearly(workdir):
    tree = os.path.join(workdir, "alone")
    shutil.copytree(os.path.join(SOURCE, "client", "python"), tree,
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__",
                                                  "trainer_pb2*.py"))
    python = venv(workdir, "venv")
    env = clean_env()
    env.pop("AMPD_PROTO_DIR", None)
    result = subprocess.run([python, "-m", "pip", "install", "--no-build-isolation", "--no-deps",
                             tree], cwd=workdir, env=env, capture_output=True, text=True)
    assert result.returncode != 0
    assert "trainer.proto not found" in result.stdout + result.stderr


def test_wheel_of_the_staged_package(server, workdir):
    staged = os.environ.get("PYTHONPATH", "").split(os.pathsep)[0]
    assert os.path.isfile(os.path.join(staged, "ampd", "v1", "trainer_pb2.py")), staged
    package = os.path.join(workdir, "package")
    shutil.copytree(staged, package, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", os.path.join(workdir, "dist"), package], check=True,
                   env=clean_env(), capture_output=True)
    wheels = os.listdir(os.path.join(workdir, "dist"))
    assert len(wheels) == 1 and wheels[0].startswith("ampd-0.1.0-py3"), wheels
    python = venv(workdir, "venv")
    pip_install(python, os.path.join(workdir, "dist", wheels[0]), workdir)
    run_examples(python, server, workdir)
