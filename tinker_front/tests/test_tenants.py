"""API keys onto ampd's tenants: with --api-keys, only the listed keys get
in, and each key's models are ampd jobs of its own tenant (created with the
tenant's bearer token), so ampd's ownership and quotas hold per key."""
import hashlib
import os

import ampd
import httpx
import tinker

from conftest import BASE, Process, start_front

TOKENS = {"alice": "tok-alice-secret", "bob": "tok-bob-secret"}


def test_keys_map_onto_ampd_tenants(workdir, models_dir):
    tenants = os.path.join(workdir, "tenants")
    with open(tenants, "w") as f:
        for tenant, token in TOKENS.items():
            f.write("%s %s\n" % (tenant, hashlib.sha256(token.encode()).hexdigest()))
    keys = os.path.join(workdir, "api-keys")
    with open(keys, "w") as f:
        f.write("# API_KEY TENANT AMPD_TOKEN\n")
        for tenant, token in TOKENS.items():
            f.write("tml-%s-key %s %s\n" % (tenant, tenant, token))
    server = Process("ampd-tenants", [os.environ["AMPD_BINARY"], "--listen=127.0.0.1:0",
                                      "--metrics-listen=", "--device=cpu",
                                      "--auth-tokens=" + tenants], workdir)
    front = start_front(workdir, server.address, models_dir, "--api-keys=" + keys,
                        "--state-dir=" + os.path.join(workdir, "tenant-state"))
    try:
        url = "http://" + front.address
        service = tinker.ServiceClient(base_url=url, api_key="tml-alice-key")
        trainer = service.create_lora_training_client(base_model=BASE, rank=2)
        if type(trainer).__name__.startswith("Backcompat"):
            trainer = trainer.result()
        with ampd.Client(server.address, token=TOKENS["alice"]) as alice:
            assert [j.config.display_name for j in alice.jobs()] == ["tinker:" + BASE]
        with ampd.Client(server.address, token=TOKENS["bob"]) as bob:
            assert bob.jobs() == []
        r = httpx.post(url + "/api/v1/get_info", json={"model_id": trainer.model_id},
                       headers={"X-API-Key": "tml-bob-key"})
        assert r.status_code == 404
        r = httpx.post(url + "/api/v1/get_info", json={"model_id": trainer.model_id},
                       headers={"X-API-Key": "tml-not-listed"})
        assert r.status_code == 401
    finally:
        front.stop()
        server.stop()
