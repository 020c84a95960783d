"""The client against a secured ampd: TLS with a client certificate (mutual
TLS), bearer tokens from the argument or $AMPD_TOKEN, tenants' isolation as
typed errors. Certificates and tokens come from scripts/make-dev-certs.sh."""
import os
import subprocess

import pytest

import ampd
from conftest import batch


@pytest.fixture
def secured(start_ampd, workdir):
    secrets = os.path.join(workdir, "secrets")
    subprocess.run(["bash", os.environ["AMPD_MAKE_CERTS"], secrets], check=True,
                   capture_output=True)
    s = lambda name: os.path.join(secrets, name)  # noqa: E731
    server = start_ampd("--tls-cert=" + s("server.crt"), "--tls-key=" + s("server.key"),
                        "--tls-client-ca=" + s("ca.crt"), "--auth-tokens=" + s("tenants"))
    tokens = {}
    for tenant in ("alice", "bob"):
        with open(s(tenant + ".token"), encoding="utf-8") as f:
            tokens[tenant] = f.read().strip()
    return server, s, tokens


def connect(server, s, **kw):
    # The certificate names "ampd"; the client dials 127.0.0.1.
    return ampd.Client(server.address, tls_ca=s("ca.crt"), tls_cert=s("alice.crt"),
                       tls_key=s("alice.key"), tls_server_name="ampd", **kw)


def test_tls_and_tokens(secured, monkeypatch):
    server, s, tokens = secured
    model = ampd.Model([ampd.Linear(8, 16), ampd.ReLU(), ampd.Linear(16, 1)])
    monkeypatch.setenv("AMPD_TOKEN", tokens["alice"])
    with connect(server, s) as alice:  # token from $AMPD_TOKEN
        job = alice.create_job(model=model, optimizer=ampd.SGD(lr=0.05, momentum=0.9))
        for step in range(1, 6):
            assert job.step(*batch(step)).global_step == step
        assert [j.job_id for j in alice.jobs()] == [job.job_id]
    monkeypatch.delenv("AMPD_TOKEN")

    with connect(server, s, token=tokens["bob"]) as bob:
        assert bob.jobs() == []
        with pytest.raises(ampd.JobNotFound) as e:
            bob.job(job.job_id)
        assert e.value.reason == "JOB_NOT_FOUND"

    with connect(server, s, retry_deadline=1) as nobody:
        with pytest.raises(ampd.Unauthenticated) as e:
            nobody.jobs()
        assert e.value.code.name == "UNAUTHENTICATED" and e.value.reason == "UNAUTHENTICATED"

    # PEM given as bytes works as well as paths.
    with open(s("ca.crt"), "rb") as f:
        ca = f.read()
    with ampd.Client(server.address, tls_ca=ca, tls_cert=s("alice.crt"), tls_key=s("alice.key"),
                     tls_server_name="ampd", token=tokens["alice"]) as again:
        assert again.job(job.job_id).step_count == 5

    # Plaintext against a TLS server: the transport fails, retried until the deadline.
    with ampd.Client(server.address, token=tokens["alice"], timeout=2, retry_deadline=1) as plain:
        with pytest.raises(ampd.Unavailable):
            plain.jobs()

    with pytest.raises(ValueError, match="together"):
        ampd.Client(server.address, tls_ca=s("ca.crt"), tls_cert=s("alice.crt"))
