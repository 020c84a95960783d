"""LoRA on the decoder: ampd.LoRA on the wire and through CreateJob's checks,
and the hand-written PyTorch LoRA (bench/pytorch/lora.py) that ampd's LoRA
jobs are compared with: PEFT's initialisation, its names, only the
adapters training, and the merged model computing what the adapted one does.

Skipped, saying so, where torch is not importable."""
import os
import sys

import grpc
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not importable: the LoRA reference "
                                            "needs PyTorch")

import ampd  # noqa: E402
from ampd.v1 import trainer_pb2 as pb  # noqa: E402

sys.path.insert(0, os.path.join(os.environ["AMPD_SOURCE_DIR"], "bench", "pytorch"))
import decoder as torch_decoder  # noqa: E402  (bench/pytorch/decoder.py)
import lora as torch_lora  # noqa: E402  (bench/pytorch/lora.py)

VOCAB, HIDDEN, INTER, LAYERS, CONTEXT = 48, 32, 64, 2, 16
SHAPE = dict(num_attention_heads=4, num_key_value_heads=2, qkv_bias=True, o_bias=False)


def spec_of(lora):
    return ampd.Decoder(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
                        num_hidden_layers=LAYERS, max_position_embeddings=CONTEXT, lora=lora,
                        **SHAPE)


def torch_model():
    return torch_decoder.Decoder(VOCAB, HIDDEN, INTER, LAYERS, max_position_embeddings=CONTEXT,
                                 attention="manual", **SHAPE)


def sequences(step, batch=4, seq_len=CONTEXT):
    rng = np.random.default_rng(900 + step)
    ids = rng.integers(0, VOCAB, size=(batch, seq_len), dtype=np.int64)
    targets = (5 * ids + 3) % VOCAB
    return torch.from_numpy(ids), torch.from_numpy(targets)


def test_lora_becomes_the_proto_decoders():
    d = spec_of(ampd.LoRA(rank=4, alpha=8.0)).to_proto().decoder
    assert d.HasField("lora")
    assert (d.lora.rank, d.lora.alpha, list(d.lora.target_modules)) == (4, 8.0, [])
    d = spec_of(ampd.LoRA(rank=2, alpha=16.0, target_modules=("gate_proj", "down_proj"))) \
        .to_proto().decoder
    assert list(d.lora.target_modules) == ["gate_proj", "down_proj"]
    assert not spec_of(None).to_proto().decoder.HasField("lora")
    assert isinstance(d.lora, pb.LoRA)


def test_create_job_names_the_bad_lora_field(server):
    with ampd.Client(server.address) as client:
        for lora, field in ((ampd.LoRA(rank=17, alpha=8.0), "decoder.lora.rank"),
                            (ampd.LoRA(rank=4, alpha=-1.0), "decoder.lora.alpha"),
                            (ampd.LoRA(rank=4, alpha=8.0, target_modules=("q_proj", "lm_head")),
                             "decoder.lora.target_modules[1]")):
            with pytest.raises(ampd.InvalidArgument, match=field.replace("[", r"\[")):
                client.create_job(model=spec_of(lora), precision="fp32", seed=1)


def test_a_valid_lora_job_is_refused_until_the_engine_trains_adapters(server):
    # A full fine-tune in its place would be another job: refused, named.
    with ampd.Client(server.address) as client:
        with pytest.raises(ampd.AmpdError, match="decoder.lora") as error:
            client.create_job(model=spec_of(ampd.LoRA(rank=4, alpha=8.0)), precision="fp32",
                              seed=1)
        assert error.value.code == grpc.StatusCode.UNIMPLEMENTED


def test_reference_lora_is_pefts():
    torch.manual_seed(3)
    model = torch_model()
    ids, targets = sequences(0)
    with torch.no_grad():
        before = model(ids, targets).item()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    targets_modules = ("q_proj", "v_proj", "o_proj", "down_proj")
    torch_lora.apply_lora(model, rank=4, alpha=8.0, target_modules=targets_modules)
    # B starts at zero: the adapted model computes what the base did.
    with torch.no_grad():
        assert model(ids, targets).item() == before
    # PEFT's kaiming_uniform_(a=sqrt(5)) bound for A (r, in): 1 / sqrt(in).
    a = model.model.layers[0].mlp.down_proj.lora_A.weight
    assert a.shape == (4, INTER) and a.abs().max() <= 1.0 / np.sqrt(INTER)
    assert a.abs().max() > 0.5 / np.sqrt(INTER)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(trained) == 2 * LAYERS * len(targets_modules)
    assert all(".lora_A." in n or ".lora_B." in n for n in trained)

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(30):
        ids, targets = sequences(step)
        opt.zero_grad()
        loss = model(ids, targets)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05  # it learned: the adapters do train
    # The base never moved.
    for name, value in model.state_dict().items():
        if ".lora_" not in name:
            assert torch.equal(value, base[name.replace(".base.", ".")]), name

    adapter = torch_lora.adapter_state_dict(model)
    assert list(adapter)[:2] == [
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    assert adapter["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"].shape == (
        HIDDEN, 4)
    assert torch_lora.adapter_config(model) == {"r": 4, "lora_alpha": 8.0,
                                                "target_modules": list(targets_modules)}
    # The adapters loaded into a fresh LoRA of the same base give the same loss.
    again = torch_model()
    again.load_state_dict(base)
    torch_lora.apply_lora(again, rank=4, alpha=8.0, target_modules=targets_modules)
    torch_lora.load_adapter_state_dict(again, adapter)
    # The merged weights, in Hugging Face's names, into a plain decoder.
    merged = torch_model()
    merged.load_state_dict(torch_lora.merged_state_dict(model), strict=True)
    ids, targets = sequences(99)
    with torch.no_grad():
        expected = model(ids, targets).item()
        assert again(ids, targets).item() == expected
        assert merged(ids, targets).item() == pytest.approx(expected, rel=1e-5)
    with pytest.raises(KeyError, match="missing"):
        torch_lora.load_adapter_state_dict(again, dict(list(adapter.items())[1:]))
