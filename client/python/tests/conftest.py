"""Shared fixtures: a real ampd process over a socket, and deterministic batches.

CTest passes the ampd binary as $AMPD_BINARY and puts the staged package
(with its generated stubs) first on PYTHONPATH.
"""
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time

import numpy as np
import pytest


class AmpdProcess:
    """ampd started with --listen=127.0.0.1:PORT (0: a free one); stderr to a log file."""

    def __init__(self, flags, workdir, port=0):
        self.flags = list(flags)
        self.workdir = workdir
        self.port = port
        self.peer_port = 0  # --peer-address's port, as ampd reports it
        self.proc = None
        self.log_path = os.path.join(workdir, "ampd.log")
        self.start()

    @property
    def address(self):
        return "127.0.0.1:%d" % self.port

    def start(self):
        binary = os.environ["AMPD_BINARY"]
        log = open(self.log_path, "a", encoding="utf-8")
        self.proc = subprocess.Popen(
            [binary, "--listen=127.0.0.1:%d" % self.port, "--metrics-listen=", "--device=cpu"]
            + self.flags, stdout=subprocess.PIPE, stderr=log, text=True)
        log.close()
        for line in self.proc.stdout:
            peers = re.match(r"ampd: peers on [^:]+:(\d+)", line)
            if peers:
                self.peer_port = int(peers.group(1))
            m = re.match(r"ampd: listening on [^:]+:(\d+)", line)
            if m:
                self.port = int(m.group(1))
                # Keep draining stdout so ampd never blocks on a full pipe.
                threading.Thread(target=self.proc.stdout.read, daemon=True).start()
                return
        self.proc.wait(timeout=30)
        raise RuntimeError("ampd did not start (exit %s): %s" % (self.proc.returncode, self.log()))

    def log(self):
        with open(self.log_path, encoding="utf-8") as f:
            return f.read()

    def kill(self):
        """SIGKILL: no final checkpoint, no graceful anything."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def restart(self):
        """Start again on the same port and flags (same --state-dir)."""
        self.start()

    def wait_for_log(self, text, timeout=30):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if text in self.log():
                return
            time.sleep(0.02)
        raise AssertionError("ampd never logged %r:\n%s" % (text, self.log()))

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def workdir():
    path = tempfile.mkdtemp(prefix="ampd_python_")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def start_ampd(workdir):
    started = []

    def start(*flags, port=0):
        server = AmpdProcess(flags, workdir, port)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def server(start_ampd):
    return start_ampd()


def batch(step, n=32, features=8, outputs=1, scale=1.0):
    """The deterministic regression batch of a step: y = tanh(x @ w)."""
    rng = np.random.default_rng(1000 + step)
    w = np.random.default_rng(7).standard_normal((features, outputs)).astype(np.float32)
    x = (scale * rng.standard_normal((n, features))).astype(np.float32)
    return x, np.tanh(x @ w).astype(np.float32)
