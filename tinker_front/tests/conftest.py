"""Fixtures: a real ampd and the real ampd-tinker front, each a process on
its own socket, over a tiny Qwen2-family base folder; the tinker SDK talks to
the front as it talks to Tinker (TINKER_BASE_URL-style base_url, an
X-API-Key starting tml-).

CTest passes $AMPD_BINARY, $AMPD_TINKER_PYTHON and $AMPD_SOURCE_DIR, and
puts the staged ampd and ampd_tinker packages on PYTHONPATH.
"""
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import tiny_base  # noqa: E402

BASE = "tiny/qwen2-chars"
KEY = "tml-ampd-test-key-one"
OTHER_KEY = "tml-ampd-test-key-two"


class Process:
    """A command that prints 'NAME: listening on HOST:PORT'; stderr to a log."""

    def __init__(self, name, argv, workdir, env=None):
        self.name, self.argv, self.env = name, argv, env
        self.log_path = os.path.join(workdir, name + ".log")
        self.start()

    def start(self):
        log = open(self.log_path, "a", encoding="utf-8")
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=log, text=True,
                                     env=self.env)
        log.close()
        for line in self.proc.stdout:
            m = re.match(r"[\w-]+: listening on ([^:]+):(\d+)", line)
            if m:
                self.address = "%s:%s" % (m.group(1), m.group(2))
                threading.Thread(target=self.proc.stdout.read, daemon=True).start()
                return
        self.proc.wait(timeout=30)
        raise RuntimeError("%s did not start (exit %s): %s" % (self.name, self.proc.returncode,
                                                               self.log()))

    def log(self):
        with open(self.log_path, encoding="utf-8") as f:
            return f.read()

    def alive(self):
        return self.proc.poll() is None

    def stop(self, sig=signal.SIGTERM):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def workdir():
    path = tempfile.mkdtemp(prefix="ampd_tinker_")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def models_dir(workdir):
    path = os.path.join(workdir, "models")
    tiny_base.make(path, BASE)
    return path


@pytest.fixture(scope="module")
def ampd_server(workdir):
    server = Process("ampd", [os.environ["AMPD_BINARY"], "--listen=127.0.0.1:0",
                              "--metrics-listen=", "--device=cpu"], workdir)
    yield server
    server.stop()


def start_front(workdir, ampd_address, models_dir, *flags):
    env = dict(os.environ)
    # The front never imports the SDK: drop an older SDK's path from its PYTHONPATH.
    env["PYTHONPATH"] = os.environ["AMPD_TINKER_PYTHONPATH"]
    return Process("ampd-tinker", [
        os.environ["AMPD_TINKER_PYTHON"], "-m", "ampd_tinker", "--ampd=" + ampd_address,
        "--listen=127.0.0.1:0", "--models-dir=" + models_dir,
        "--state-dir=" + os.path.join(workdir, "front-state")] + list(flags), workdir, env)


@pytest.fixture(scope="module")
def front(workdir, ampd_server, models_dir):
    server = start_front(workdir, ampd_server.address, models_dir)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def base_url(front):
    return "http://" + front.address
