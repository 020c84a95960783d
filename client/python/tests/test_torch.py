"""ampd.torch: an nn.Sequential's spec and weights into a job, and the job's
weights back into an nn.Sequential whose forward gives ampd's loss.

Skipped, saying so, where torch is not importable (it is optional; Debian's
python3-torch provides it)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not importable: the interop tests need it")
from torch import nn  # noqa: E402

import ampd  # noqa: E402
import ampd.torch as ampd_torch  # noqa: E402
from conftest import batch  # noqa: E402


def sequential():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Tanh(),
                         nn.Linear(16, 1))


def test_from_module_and_back(server):
    module = sequential()
    model, weights = ampd_torch.from_module(module)
    assert [type(layer).__name__ for layer in model.layers] == \
        ["Linear", "GELU", "LayerNorm", "Tanh", "Linear"]
    assert set(weights) == {"model." + k for k in module.state_dict()}
    with ampd.Client(server.address) as client:
        job = ampd_torch.create_job_from_module(client, module, precision="fp32",
                                                optimizer=ampd.AdamW(lr=1e-2))
        state = job.state_dict()
        for name, value in module.state_dict().items():
            assert np.array_equal(state["model." + name], value.numpy()), name
        # Train, then each step's loss (computed before its update) must be the
        # loss a torch forward gives with the weights after the previous step.
        for s in range(1, 11):
            job.step(*batch(s))
        copy = sequential()
        copy.load_state_dict(ampd_torch.to_state_dict(job))  # strict: every key matches
        x, y = batch(11)
        with torch.no_grad():
            expected = nn.functional.mse_loss(copy(torch.from_numpy(x)), torch.from_numpy(y)).item()
        assert job.step(x, y).loss == pytest.approx(expected, rel=1e-5)


def test_fp16_job_loads_into_torch(server):
    with ampd.Client(server.address) as client:
        module = sequential()
        job = ampd_torch.create_job_from_module(client, module, precision="fp16",
                                                scaler=ampd.Scaler(init_scale=2.0 ** 20))
        results = [job.step(*batch(s)) for s in range(1, 21)]
        assert any(r.skipped for r in results)
        module.load_state_dict(ampd_torch.to_state_dict(job.state_dict()))
        x, y = batch(21)
        with torch.no_grad():
            expected = nn.functional.mse_loss(module(torch.from_numpy(x)), torch.from_numpy(y)).item()
        # ampd's forward runs in fp16 (fp32 accumulation), torch's here in fp32.
        assert job.step(x, y).loss == pytest.approx(expected, rel=1e-2)


def test_torch_tensors_as_batches(server):
    with ampd.Client(server.address) as client:
        model = ampd.Model([ampd.Linear(8, 16), ampd.ReLU(), ampd.Linear(16, 1)])
        a = client.create_job(model=model, precision="bf16", seed=4)
        b = client.create_job(model=model, precision="bf16", seed=4)
        for s in range(1, 6):
            x, y = batch(s)
            xb = torch.from_numpy(x).to(torch.bfloat16)  # travels as BF16 bits
            ra = a.step(xb, torch.from_numpy(y))
            rb = b.step(xb.to(torch.float32).numpy(), y)  # the same values as float32
            assert (ra.loss, ra.scale_after, ra.grad_norm) == (rb.loss, rb.scale_after, rb.grad_norm)


def test_embedding_model_and_unsupported_layers(server):
    torch.manual_seed(1)
    module = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 4))
    with ampd.Client(server.address) as client:
        job = ampd_torch.create_job_from_module(client, module, loss="cross_entropy",
                                                precision="fp32")
        ids = torch.arange(10) % 10
        labels = torch.arange(10) % 4
        job.step(ids, labels)
        copy = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 4))
        copy.load_state_dict(ampd_torch.to_state_dict(job))
        with torch.no_grad():
            expected = nn.functional.cross_entropy(copy(ids), labels).item()
        assert job.step(ids, labels).loss == pytest.approx(expected, rel=1e-5)
    with pytest.raises(ValueError, match="Dropout"):
        ampd_torch.from_module(nn.Sequential(nn.Linear(2, 2), nn.Dropout()))
    with pytest.raises(ValueError, match="approximate"):
        ampd_torch.from_module(nn.Sequential(nn.GELU(approximate="tanh")))
    with pytest.raises(ValueError, match="first layer"):
        ampd_torch.from_module(nn.Sequential(nn.Linear(2, 2), nn.Embedding(3, 2)))
