"""LoRA on the decoder, through the real ampd: ampd.LoRA on the wire and
through CreateJob's checks; fp32 LoRA jobs (three sets of targets) against
the hand-written PyTorch LoRA (bench/pytorch/lora.py) loaded from the job's
exported base and adapters, 30 AdamW steps to 1e-5 relative; the adapter
view (PEFT's names and adapter_config) and the merged view loading into
PyTorch; an fp16 LoRA job's frozen fp16 base and its admitted bytes; and
the reference itself: PEFT's initialisation, its names, only the adapters
training, and the merged model computing what the adapted one does.

Skipped, saying so, where torch is not importable."""
import json
import os
import sys
import threading

import grpc
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not importable: the LoRA reference "
                                            "needs PyTorch")

import ampd  # noqa: E402
import ampd.safetensors  # noqa: E402
import ampd.torch as ampd_torch  # noqa: E402
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
                            # Finite, yet every step would overflow: above 2^16.
                            (ampd.LoRA(rank=4, alpha=3.4e38), "decoder.lora.alpha"),
                            (ampd.LoRA(rank=4, alpha=65537.0), "decoder.lora.alpha"),
                            (ampd.LoRA(rank=4, alpha=8.0, target_modules=("q_proj", "lm_head")),
                             "decoder.lora.target_modules[1]")):
            with pytest.raises(ampd.InvalidArgument, match=field.replace("[", r"\[")):
                client.create_job(model=spec_of(lora), precision="fp32", seed=1)
        # The bound itself is taken.
        client.create_job(model=spec_of(ampd.LoRA(rank=4, alpha=65536.0)), precision="fp32")


@pytest.mark.parametrize("where", ["frozen base", "lora_A", "lora_B"])
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_a_loaded_state_with_inf_or_nan_is_refused_naming_the_tensor(server, where, value):
    with ampd.Client(server.address) as client:
        job = lora_job(client, TARGET_SETS["attention"], precision="fp16")
        state = job.state_dict()
        name = {"frozen base": "model.layers.1.mlp.up_proj.weight",
                "lora_A": "base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight",
                "lora_B": "base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight"}[where]
        assert name in state, sorted(state)
        before = state[name].copy()
        bad = state[name].copy()
        bad.reshape(-1)[3] = value
        state[name] = bad
        for partial in (False, True):
            load = state if not partial else {name: bad}
            with pytest.raises(ampd.InvalidArgument, match=name.replace(".", r"\.")):
                job.load_state_dict(load, partial=partial)
        # An all-NaN file, as a base loaded with partial=True, too.
        with pytest.raises(ampd.InvalidArgument, match="inf or NaN"):
            job.load_state_dict({name: np.full_like(before, np.nan)}, partial=True)
        # Nothing was loaded, and the job still trains.
        np.testing.assert_array_equal(job.state_dict()[name], before)
        ids, targets = sequences(0)
        assert np.isfinite(job.step(ids.numpy(), targets.numpy()).loss)


def test_target_modules_in_pefts_forms(server):
    """PEFT's dotted suffixes name their module; "all-linear" is all seven;
    a path into one layer (PEFT would adapt that layer alone) is refused."""
    with ampd.Client(server.address) as client:
        for given, effective in (
                (("self_attn.q_proj", "mlp.down_proj", "v_proj"), ["q_proj", "down_proj", "v_proj"]),
                ("all-linear", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                "down_proj"])):
            job = client.create_job(model=spec_of(ampd.LoRA(rank=4, alpha=8.0,
                                                            target_modules=given)),
                                    precision="fp32", seed=1)
            assert list(job.config.model.decoder.lora.target_modules) == effective
        for given, field in ((("model.layers.0.self_attn.q_proj",), "target_modules[0]"),
                             (("mlp.q_proj",), "target_modules[0]"),
                             (("q_proj", "self_attn.q_proj"), "target_modules[1]: repeats")):
            with pytest.raises(ampd.InvalidArgument, match=field.replace("[", r"\[")):
                client.create_job(model=spec_of(ampd.LoRA(rank=4, alpha=8.0,
                                                          target_modules=given)),
                                  precision="fp32", seed=1)


LR, WEIGHT_DECAY = 1e-2, 0.01
TARGET_SETS = {
    "attention": ("q_proj", "k_proj", "v_proj", "o_proj"),
    # k and v alone among the stacked q|k|v: their blocks are not the first.
    "kv_mlp": ("k_proj", "v_proj", "gate_proj", "up_proj", "down_proj"),
    "all": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
}


def lora_job(client, targets, precision="fp32", seed=5, rank=4, alpha=8.0):
    return client.create_job(
        model=spec_of(ampd.LoRA(rank=rank, alpha=alpha, target_modules=targets)),
        precision=precision, seed=seed, optimizer=ampd.AdamW(lr=LR, weight_decay=WEIGHT_DECAY))


def torch_lora_of(job, targets, rank=4, alpha=8.0):
    """bench/pytorch's decoder with PEFT's LoRA, holding the job's base and adapters."""
    model = torch_model()
    model.load_state_dict(ampd_torch.decoder_state_dict(job), strict=True)
    torch_lora.apply_lora(model, rank=rank, alpha=alpha, target_modules=targets)
    torch_lora.load_adapter_state_dict(model, ampd_torch.lora_state_dict(job))
    return model


@pytest.mark.parametrize("which", sorted(TARGET_SETS))
def test_fp32_lora_loss_curve_equals_pytorch(server, which):
    targets = TARGET_SETS[which]
    with ampd.Client(server.address) as client:
        job = lora_job(client, targets)
        # The job holds the base (Hugging Face's names) and the adapters (PEFT's).
        state = job.state_dict()
        adapters = [n for n in state if ".lora_" in n and not n.startswith("optimizer.")]
        assert len(adapters) == 2 * LAYERS * len(targets)
        moments = [n for n in state if n.startswith("optimizer.") and n.endswith(".exp_avg")]
        assert sorted(moments) == sorted("optimizer.%s.exp_avg" % n for n in adapters)
        assert not np.any(state[adapters[1]])  # B starts at zero
        model = torch_lora_of(job, targets)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR,
                                weight_decay=WEIGHT_DECAY)
        ours, theirs = [], []
        for step in range(30):
            ids, targets_ = sequences(step)
            ours.append(job.step(ids.numpy(), targets_.numpy()).loss)
            opt.zero_grad()
            loss = model(ids, targets_)
            loss.backward()
            opt.step()
            theirs.append(loss.item())
        for step, (a, b) in enumerate(zip(ours, theirs)):
            assert a == pytest.approx(b, rel=1e-5), "step %d: ampd %r, PyTorch %r" % (step + 1, a, b)
        assert theirs[-1] < theirs[0] - 0.05  # the adapters learned
        # The base never moved; the adapters are PyTorch's.
        after = job.state_dict()
        for name in state:
            if ".lora_" not in name and not name.startswith("optimizer."):
                assert np.array_equal(after[name], state[name]), name
        for name, value in torch_lora.adapter_state_dict(model).items():
            np.testing.assert_allclose(after[name], value.numpy(), rtol=1e-3, atol=1e-5)


def test_adapter_and_merged_views_load_into_pytorch(server, tmp_path):
    targets = TARGET_SETS["kv_mlp"]
    with ampd.Client(server.address) as client:
        job = lora_job(client, targets)
        for step in range(5):
            ids, targets_ = sequences(step)
            job.step(ids.numpy(), targets_.numpy())
        ids, targets_ = sequences(50)
        expected = job.evaluate(ids.numpy(), targets_.numpy()).loss
        # The adapter view: PEFT's names, only the adapters, PEFT's config.
        adapter = job.state_dict("adapter")
        assert all(".lora_A." in n or ".lora_B." in n for n in adapter)
        assert len(adapter) == 2 * LAYERS * len(targets)
        config = json.loads(adapter.metadata["adapter_config"])
        assert (config["peft_type"], config["task_type"], config["r"], config["lora_alpha"],
                config["target_modules"]) == ("LORA", "CAUSAL_LM", 4, 8.0, list(targets))
        model = torch_model()
        model.load_state_dict(ampd_torch.decoder_state_dict(job), strict=True)
        torch_lora.apply_lora(model, rank=4, alpha=8.0, target_modules=targets)
        torch_lora.load_adapter_state_dict(
            model, {k: torch.from_numpy(np.array(v)) for k, v in adapter.items()})
        with torch.no_grad():
            assert model(ids, targets_).item() == pytest.approx(expected, rel=1e-5)
        # The merged view: a plain decoder in Hugging Face's names.
        merged = job.state_dict("merged")
        assert not any(".lora_" in n or n.startswith("optimizer.") for n in merged)
        plain = torch_model()
        plain.load_state_dict(ampd_torch.decoder_state_dict(merged), strict=True)
        with torch.no_grad():
            assert plain(ids, targets_).item() == pytest.approx(expected, rel=1e-5)
        # export_peft writes what PeftModel.from_pretrained reads.
        out = job.export_peft(str(tmp_path / "adapter"))
        assert json.load(open(os.path.join(out, "adapter_config.json")))["r"] == 4
        again = ampd.safetensors.load_file(os.path.join(out, "adapter_model.safetensors"))
        assert list(again) == list(adapter)


def test_a_job_without_adapters_has_a_merged_view_and_no_adapter_view(server):
    with ampd.Client(server.address) as client:
        job = client.create_job(model=spec_of(None), precision="bf16", seed=1)
        with pytest.raises(ampd.InvalidArgument, match="view"):
            job.state_dict("adapter")
        with pytest.raises(ValueError, match="view"):
            job.state_dict("peft")
        # Its weights alone, F32: the masters, without optimizer state.
        full, merged = job.state_dict(), job.state_dict("merged")
        weights = [n for n in full if not n.startswith("optimizer.")]
        assert list(merged) == weights
        for name in weights:
            assert merged[name].dtype == np.float32
            np.testing.assert_array_equal(merged[name], full[name])
        assert not any(k.startswith("scaler.") for k in merged.metadata)


def test_fp16_lora_job_holds_its_base_in_fp16(server):
    targets = TARGET_SETS["attention"]
    with ampd.Client(server.address) as client:
        job = lora_job(client, targets, precision="fp16")
        full = client.create_job(model=spec_of(None), precision="fp16", seed=5)
        base = sum(np.prod(v.shape) for n, v in full.state_dict().items()
                   if not n.startswith("optimizer."))
        adapters = LAYERS * 4 * sum(HIDDEN + out for out in (32, 16, 16, 32))  # r (in + out)
        # Frozen base: 2 bytes each (fp16); adapters: fp32 master, fp16 working
        # copy and gradient, two fp32 moments (16 bytes each).
        assert job.parameter_count == base + adapters
        assert job.estimated_bytes == 2 * base + 16 * adapters
        state = job.state_dict()
        assert state["model.embed_tokens.weight"].dtype == np.float16
        # The base is the full job's of the same seed, rounded to fp16.
        full_state = full.state_dict()
        np.testing.assert_array_equal(
            state["model.layers.0.self_attn.q_proj.weight"],
            full_state["model.layers.0.self_attn.q_proj.weight"].astype(np.float16))
        for step in range(3):
            ids, targets_ = sequences(step)
            reply = job.step(ids.numpy(), targets_.numpy())
            assert np.isfinite(reply.loss)
        # A full state loads back (the F16 base as it was exported).
        job.load_state_dict(state)


def test_sigkill_loses_nothing_of_a_lora_job(start_ampd, workdir):
    """A fp16 LoRA job checkpointed every step survives SIGKILL: after a
    restart it goes on exactly as an uninterrupted job (same losses, same
    frozen fp16 base, adapters and moments bit for bit)."""
    server = start_ampd("--state-dir=" + os.path.join(workdir, "state"), "--checkpoint-every=1",
                        "--checkpoint-sync")
    client = ampd.Client(server.address, timeout=10, retry_deadline=60)
    targets = TARGET_SETS["all"]
    reference = lora_job(client, targets, precision="fp16")
    ref = [reference.step(*(t.numpy() for t in sequences(s))).loss for s in range(12)]
    job = lora_job(client, targets, precision="fp16")
    losses = []
    for s in range(12):
        if s == 6:
            server.kill()
            threading.Timer(0.5, server.restart).start()
        losses.append(job.step(*(t.numpy() for t in sequences(s))).loss)
    assert losses == ref
    a, b = job.state_dict(), reference.state_dict()
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and np.array_equal(a[name], b[name]), name
    assert a["model.norm.weight"].dtype == np.float16
    client.close()


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
