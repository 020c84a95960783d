"""A Llama/Qwen2-family decoder trained through the real ampd against the same
decoder in PyTorch (and the server's reading of config.json, Qwen3's too).

For three tiny decoders in fp32 (Qwen2-style: fewer K/V heads than query
heads, q/k/v biases, untied head; Llama with attention_bias: q/k/v and o
biased; a tied one), the job's initial state dict, exported over
GetStateDict, loads into bench/pytorch/decoder.py's Decoder (Hugging Face's
names, rotate-half RoPE, repeat_kv, attention as a plain masked softmax) by
name with strict checking; then 30 identical AdamW steps on identical (B, T)
batches (some targets -100) must give the same loss curve to 1e-5 relative.
A state dict written by that PyTorch model in Hugging Face's layout, sharded
into two safetensors files (with the index.json transformers writes), loads
into a fresh job file by file, and the next step's loss is PyTorch's. Also:
the spec's wire form, the server's mapping of config.json (ampd.from_hf_config:
its keys, refusals and export), the initialisation, and the
benchmark peer on the CPU.

Skipped, saying so, where torch is not importable."""
import dataclasses
import json
import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not importable: the decoder conformance "
                                           "tests compare ampd with a PyTorch decoder")

import ampd  # noqa: E402
import ampd.safetensors  # noqa: E402
import ampd.torch as ampd_torch  # noqa: E402
from ampd.v1 import trainer_pb2 as pb  # noqa: E402

sys.path.insert(0, os.path.join(os.environ["AMPD_SOURCE_DIR"], "bench", "pytorch"))
import decoder as torch_decoder  # noqa: E402  (bench/pytorch/decoder.py)

VOCAB, HIDDEN, INTER, LAYERS, CONTEXT = 48, 32, 64, 2, 16
LR, WEIGHT_DECAY = 3e-3, 0.01

FAMILIES = {
    "qwen2": dict(num_attention_heads=4, num_key_value_heads=2, qkv_bias=True, o_bias=False,
                  tie_word_embeddings=False, rope_theta=1000000.0),
    "llama": dict(num_attention_heads=4, num_key_value_heads=4, qkv_bias=True, o_bias=True,
                  tie_word_embeddings=False, rope_theta=10000.0, rms_norm_eps=1e-5),
    "tied": dict(num_attention_heads=2, num_key_value_heads=1, qkv_bias=False, o_bias=False,
                 tie_word_embeddings=True, rope_theta=500000.0, head_dim=8),
}


def spec_of(family):
    return ampd.Decoder(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
                        num_hidden_layers=LAYERS, max_position_embeddings=CONTEXT,
                        **FAMILIES[family])


def torch_model(family):
    return torch_decoder.Decoder(VOCAB, HIDDEN, INTER, LAYERS, max_position_embeddings=CONTEXT,
                                 attention="manual", **FAMILIES[family])


def sequences(step, batch=4, seq_len=CONTEXT):
    """Step's (B, T) int64 ids and targets, a few -100: each target a fixed
    function of its input token (a bigram to learn), so the loss falls."""
    rng = np.random.default_rng(700 + step)
    ids = rng.integers(0, VOCAB, size=(batch, seq_len), dtype=np.int64)
    targets = (7 * ids + 2) % VOCAB
    targets[rng.random(targets.shape) < 0.1] = -100
    return ids, targets


def torch_loss(model, ids, targets):
    return model(torch.from_numpy(ids), torch.from_numpy(targets))


def test_spec_becomes_the_proto_decoder():
    proto = spec_of("qwen2").to_proto()
    assert proto.WhichOneof("architecture") == "decoder"
    d = proto.decoder
    assert (d.vocab_size, d.hidden_size, d.intermediate_size, d.num_hidden_layers,
            d.num_attention_heads, d.num_key_value_heads, d.max_position_embeddings) == (
        VOCAB, HIDDEN, INTER, LAYERS, 4, 2, CONTEXT)
    assert d.qkv_bias and not d.o_bias and d.HasField("o_bias")
    assert not d.HasField("head_dim") and not d.HasField("rms_norm_eps")
    assert isinstance(proto, pb.ModelSpec) and len(proto.layers) == 0


def test_values_a_job_could_never_train_with_are_refused_naming_the_field(server):
    base = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
                num_hidden_layers=LAYERS, max_position_embeddings=CONTEXT,
                num_attention_heads=4)
    with ampd.Client(server.address) as client:
        for extra, field in ((dict(head_dim=0), "decoder.head_dim"),
                             (dict(initializer_range=3.4e38), "decoder.initializer_range"),
                             (dict(initializer_range=1.5), "decoder.initializer_range")):
            with pytest.raises(ampd.InvalidArgument, match=field) as refused:
                client.create_job(model=ampd.Decoder(**base, **extra), precision="fp32")
            assert refused.value.field.endswith(field), refused.value.field
        # Unset head_dim is hidden / heads; the largest initializer_range is taken.
        job = client.create_job(model=ampd.Decoder(**base, initializer_range=1.0),
                                precision="fp32")
        assert job.config.model.decoder.head_dim == HIDDEN // 4
        assert len(list(client.jobs())) == 1


def mapped(client, config, **overrides):
    """The effective pb.Decoder the server makes of a config.json (a job
    created from it, its weights drawn from the seed)."""
    return client.create_job(model=ampd.from_hf_config(config, **overrides),
                             precision="fp32").config.model.decoder


def refused(client, config, match):
    """create_job of config.json is refused naming the key (field
    config.hf_config_json), and leaves no job behind."""
    before = len(client.jobs())
    with pytest.raises(ampd.InvalidArgument, match=match) as error:
        client.create_job(model=ampd.from_hf_config(config), precision="fp32")
    assert error.value.field == "config.hf_config_json", error.value.field
    assert len(client.jobs()) == before


# Llama 3.2's config.json keys, at this test's sizes.
LLAMA = {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": HIDDEN,
         "intermediate_size": INTER, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5,
         "rope_theta": 500000.0, "max_position_embeddings": CONTEXT,
         "tie_word_embeddings": True, "initializer_range": 0.02, "attention_bias": False,
         "hidden_act": "silu", "mlp_bias": False, "rope_scaling": None,
         "torch_dtype": "bfloat16"}
QWEN2 = {"model_type": "qwen2", "vocab_size": VOCAB, "hidden_size": HIDDEN,
         "intermediate_size": INTER, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
         "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
         "max_position_embeddings": CONTEXT, "tie_word_embeddings": True,
         "use_sliding_window": False, "sliding_window": 32768, "hidden_act": "silu"}


def test_the_server_maps_both_families_config_json(server, tmp_path):
    """config.json is the server's to map (the client sends its text): its
    keys become the job's parts, overrides go over them, and what ampd
    cannot compute is refused naming the key."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA))
    with ampd.Client(server.address) as client:
        d = mapped(client, str(path), max_position_embeddings=CONTEXT // 2)
        assert (d.num_key_value_heads, d.head_dim, d.max_position_embeddings) == (2, 16,
                                                                                  CONTEXT // 2)
        assert d.tie_word_embeddings and not d.qkv_bias and not d.o_bias
        assert d.rms_norm_eps == np.float32(1e-5) and d.rope_theta == 500000.0
        biased = mapped(client, dict(LLAMA, attention_bias=True))
        assert biased.qkv_bias and biased.o_bias
        d = mapped(client, QWEN2)
        assert d.qkv_bias and not d.o_bias and d.head_dim == HIDDEN // 4
        assert d.rope_theta == 1000000.0
        for bad, match in ((dict(LLAMA, rope_scaling={"rope_type": "yarn", "factor": 4.0}),
                            "rope_scaling.rope_type"),
                           (dict(LLAMA, rope_scaling={"rope_type": "llama3"}),
                            "rope_scaling.factor"),
                           (dict(LLAMA, model_type="mistral"), "model_type"),
                           (dict(LLAMA, hidden_act="gelu"), "hidden_act"),
                           (dict(QWEN2, use_sliding_window=True), "use_sliding_window")):
            refused(client, bad, "config.json: " + match)


# Qwen3-0.6B's config.json as transformers 4.x wrote it (head_dim 128 where
# hidden / heads is 64), at this test's sizes.
QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
         "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
         "hidden_size": HIDDEN, "initializer_range": 0.02, "intermediate_size": INTER,
         "max_position_embeddings": CONTEXT, "max_window_layers": 28, "model_type": "qwen3",
         "num_attention_heads": 4, "num_hidden_layers": LAYERS, "num_key_value_heads": 2,
         "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
         "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
         "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
         "vocab_size": VOCAB}


def test_qwen3_keys_become_parts_and_its_export_names_qwen3(server):
    """Qwen3's keys become parts (qk_norm, its own head_dim, attention_bias
    on all four projections); what it cannot compute is refused by key; and
    a job's export config.json (Job.hf_config_json, the server's writing)
    names the family whose parts the job has, whoever made the spec."""
    with ampd.Client(server.address) as client:
        d = mapped(client, QWEN3)
        assert (d.qk_norm, d.head_dim, d.qkv_bias, d.o_bias) == (True, 128, False, False)
        assert (d.num_key_value_heads, d.rope_theta) == (2, 1e6)
        # Qwen3Config's head_dim defaults to 128, not hidden / heads.
        assert mapped(client, {k: v for k, v in QWEN3.items() if k != "head_dim"}).head_dim == 128
        biased = mapped(client, dict(QWEN3, attention_bias=True))
        assert biased.qkv_bias and biased.o_bias and biased.qk_norm
        for bad, match in ((dict(QWEN3, use_sliding_window=True), "use_sliding_window"),
                           (dict(QWEN3, layer_types=["sliding_attention"] * LAYERS),
                            "layer_types"),
                           (dict(QWEN3, hidden_act="gelu"), "hidden_act"),
                           (dict(QWEN3, rope_scaling={"rope_type": "yarn", "factor": 4.0}),
                            "rope_scaling.rope_type"),
                           (dict(QWEN3, model_type="mistral"),
                            'model_type: "mistral": one of gpt2, llama, qwen2, qwen3')):
            refused(client, bad, "config.json: " + match)
        with pytest.raises(ValueError, match="n_layer: not a field of Decoder"):
            ampd.from_hf_config(QWEN3, n_layer=1)
        with pytest.raises(ampd.InvalidArgument, match="config.model.gpt: .* describes a decoder"):
            client.create_job(model=ampd.hf.HfConfig(json.dumps(QWEN3),
                                                     pb.ModelSpec(gpt=pb.Gpt(n_layer=1))),
                              precision="fp32")

        job = client.create_job(model=ampd.from_hf_config(QWEN3), precision="fp32")
        config = json.loads(job.proto.hf_config_json)
        assert (config["model_type"], config["architectures"], config["head_dim"],
                config["attention_bias"]) == ("qwen3", ["Qwen3ForCausalLM"], 128, False)
        spec = ampd.Decoder(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
                            num_hidden_layers=LAYERS, num_attention_heads=4,
                            max_position_embeddings=CONTEXT)
        for parts, family in ((dict(qkv_bias=True, o_bias=False), "qwen2"),
                              (dict(qkv_bias=True, o_bias=True), "llama"),
                              (dict(qkv_bias=True, o_bias=True, qk_norm=True), "qwen3")):
            job = client.create_job(model=dataclasses.replace(spec, **parts), precision="fp32")
            assert json.loads(job.proto.hf_config_json)["model_type"] == family, parts
        # o_proj biased and q/k/v not: no family has those parts.
        job = client.create_job(model=dataclasses.replace(spec, qkv_bias=False, o_bias=True),
                                precision="fp32")
        assert job.proto.hf_config_json == ""
        with pytest.raises(ValueError, match="no Hugging Face family"):
            job.save_pretrained("unused")


LLAMA32 = {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": HIDDEN,
           "intermediate_size": INTER, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
           "num_key_value_heads": 2, "max_position_embeddings": CONTEXT, "hidden_act": "silu",
           "rope_theta": 500000.0,
           "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}


def test_llama3_rope_scaling_in_both_key_styles_reaches_the_job(server):
    """transformers 4.x's rope_theta + rope_scaling and 5.x's rope_parameters
    give one model; CreateJob keeps it in the effective config and refuses a
    bad field set over it by name."""
    new_style = {k: v for k, v in LLAMA32.items() if k not in ("rope_theta", "rope_scaling")}
    new_style["rope_parameters"] = dict(LLAMA32["rope_scaling"], rope_theta=500000.0)
    with ampd.Client(server.address) as client:
        old = mapped(client, LLAMA32)
        assert mapped(client, new_style) == old
        assert old.rope_theta == 500000.0
        r = old.rope_scaling
        assert (r.rope_type, r.factor, r.low_freq_factor, r.high_freq_factor,
                r.original_max_position_embeddings) == (pb.ROPE_TYPE_LLAMA3, 32.0, 1.0, 4.0, 8192)
        r = mapped(client, dict(LLAMA32, rope_scaling={"type": "linear", "factor": 2.0})
                   ).rope_scaling
        assert (r.rope_type, r.factor, r.HasField("low_freq_factor")) == (pb.ROPE_TYPE_LINEAR, 2.0,
                                                                          False)
        for scaling, field in ((ampd.RopeScaling("linear", 0.5), "decoder.rope_scaling.factor"),
                               (ampd.RopeScaling("llama3", 8.0, 4.0, 1.0, 8192),
                                "decoder.rope_scaling.high_freq_factor")):
            with pytest.raises(ampd.InvalidArgument, match=field):
                client.create_job(model=ampd.from_hf_config(LLAMA32, rope_scaling=scaling),
                                  precision="fp32", seed=1)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fp32_loss_curve_equals_pytorch(server, family):
    with ampd.Client(server.address) as client:
        job = client.create_job(model=spec_of(family), precision="fp32", seed=11,
                                optimizer=ampd.AdamW(lr=LR, weight_decay=WEIGHT_DECAY))
        model = torch_model(family)
        # Strict: every Hugging Face name matches, shapes included.
        model.load_state_dict(ampd_torch.decoder_state_dict(job), strict=True)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        ours, theirs = [], []
        for step in range(30):
            ids, targets = sequences(step)
            ours.append(job.step(ids, targets).loss)
            opt.zero_grad()
            loss = torch_loss(model, ids, targets)
            loss.backward()
            opt.step()
            theirs.append(loss.item())
        for step, (a, b) in enumerate(zip(ours, theirs)):
            assert a == pytest.approx(b, rel=1e-5), "step %d: ampd %r, PyTorch %r" % (step + 1, a, b)
        assert theirs[-1] < theirs[0] - 0.5  # it learned, so equal curves say something
        # ampd's final weights, loaded into PyTorch, give the loss ampd's next step reports.
        final = torch_model(family)
        final.load_state_dict(ampd_torch.decoder_state_dict(job), strict=True)
        ids, targets = sequences(30)
        with torch.no_grad():
            expected = torch_loss(final, ids, targets).item()
        assert job.step(ids, targets).loss == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("family", ["qwen2", "tied"])
def test_sharded_pytorch_checkpoint_loads_file_by_file(server, tmp_path, family):
    torch.manual_seed(5)
    source = torch_model(family)
    weights = {k: v.detach().numpy().copy() for k, v in source.state_dict().items()}
    if FAMILIES[family]["tie_word_embeddings"]:
        weights.pop("lm_head.weight")  # save_pretrained writes a tied head once
    names = list(weights)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for file, held in shards.items():
        ampd.safetensors.save_file({k: weights[k] for k in held}, str(tmp_path / file),
                                   {"format": "pt"})
        weight_map.update({k: file for k in held})
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with ampd.Client(server.address) as client:
        job = client.create_job(model=spec_of(family), precision="fp32", seed=3,
                                optimizer=ampd.AdamW(lr=LR, weight_decay=WEIGHT_DECAY))
        # One file alone replaces the weights it holds; the rest stay the job's.
        job.load(str(tmp_path / "model-00001-of-00002.safetensors"), partial=True)
        half = ampd_torch.decoder_state_dict(job)
        for name in shards["model-00001-of-00002.safetensors"]:
            assert np.array_equal(half[name].numpy(), weights[name]), name
        projection = [n for n in shards["model-00002-of-00002.safetensors"] if "proj" in n][-1]
        assert not np.array_equal(half[projection].numpy(), weights[projection])
        # A file alone is not the whole model.
        with pytest.raises(ampd.InvalidStateDict, match="missing"):
            job.load(str(tmp_path / "model-00002-of-00002.safetensors"))
        job.load_sharded(str(index))
        loaded = ampd_torch.decoder_state_dict(job)
        for name, value in source.state_dict().items():
            assert np.array_equal(loaded[name].numpy(), value.numpy()), name
        ids, targets = sequences(0)
        with torch.no_grad():
            expected = torch_loss(source, ids, targets).item()
        assert job.step(ids, targets).loss == pytest.approx(expected, rel=1e-5)
        # A name the model does not have is refused, partial or not.
        ampd.safetensors.save_file({"model.layers.7.mlp.up_proj.weight": weights[names[-1]]},
                                   str(tmp_path / "other.safetensors"))
        with pytest.raises(ampd.InvalidStateDict, match="not a tensor of this job"):
            job.load(str(tmp_path / "other.safetensors"), partial=True)


def test_initialisation_is_hugging_faces(server):
    with ampd.Client(server.address) as client:
        job = client.create_job(
            model=ampd.Decoder(vocab_size=512, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=32, qkv_bias=True,
                               initializer_range=0.04),
            precision="fp32", seed=1)
        state = ampd_torch.decoder_state_dict(job)
    for name, value in state.items():
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            assert torch.equal(value, torch.ones_like(value)), name
        elif name.endswith("bias"):
            assert torch.equal(value, torch.zeros_like(value)), name
        else:
            assert value.std().item() == pytest.approx(0.04, rel=0.1), name
    assert tuple(state["model.layers.0.self_attn.k_proj.weight"].shape) == (32, 64)
    assert tuple(state["model.layers.1.mlp.down_proj.weight"].shape) == (64, 128)


def test_bench_peer_runs_and_counts_the_parameters_ampd_counts(server):
    """bench/pytorch/decoder.py on the CPU with tiny flags: a line per
    precision, and its FLOP count's N (every parameter, the tied embedding
    once) from the same sizes as ampd's job."""
    import re
    import subprocess
    script = os.path.join(os.environ["AMPD_SOURCE_DIR"], "bench", "pytorch", "decoder.py")
    run = subprocess.run(
        [sys.executable, script, "--device", "cpu", "--vocab", str(VOCAB), "--hidden",
         str(HIDDEN), "--intermediate", str(INTER), "--layers", str(LAYERS), "--heads", "4",
         "--kv-heads", "2", "--batch", "2", "--seq-len", str(CONTEXT), "--steps", "2",
         "--warmup", "1", "--precisions", "fp32,bf16", "--peak-tflops", "1"],
        capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = re.findall(r"^(fp32|bf16) +step median +[0-9.]+ ms +[0-9]+ tokens/s +[0-9.]+ TFLOP/s "
                       r"+MFU +[0-9.]+%  \((\d+) params, loss ([0-9.]+)\)$", run.stdout, re.M)
    assert [line[0] for line in lines] == ["fp32", "bf16"], run.stdout
    with ampd.Client(server.address) as client:
        job = client.create_job(
            model=ampd.Decoder(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
                               num_hidden_layers=LAYERS, num_attention_heads=4,
                               num_key_value_heads=2, max_position_embeddings=CONTEXT,
                               qkv_bias=True, tie_word_embeddings=True),
            precision="fp32")
    assert int(lines[0][1]) == job.parameter_count


@pytest.mark.parametrize("targets", [("q_proj", "k_proj", "v_proj", "o_proj"),
                                     ("gate_proj", "up_proj", "down_proj")])
def test_bench_peer_with_lora_counts_the_parameters_ampd_counts(server, targets):
    """bench/pytorch/decoder.py --lora-rank on the CPU: a line per
    precision, and its FLOP count's two N (the frozen base, every parameter
    with the tied embedding once; the adapters) those of ampd's LoRA job of
    the same shape, whose parameter count is the base's plus the adapters'."""
    import re
    import subprocess
    script = os.path.join(os.environ["AMPD_SOURCE_DIR"], "bench", "pytorch", "decoder.py")
    run = subprocess.run(
        [sys.executable, script, "--device", "cpu", "--vocab", str(VOCAB), "--hidden",
         str(HIDDEN), "--intermediate", str(INTER), "--layers", str(LAYERS), "--heads", "4",
         "--kv-heads", "2", "--batch", "2", "--seq-len", str(CONTEXT), "--steps", "2",
         "--warmup", "1", "--precisions", "fp32,bf16", "--peak-tflops", "1", "--lora-rank", "4",
         "--lora-targets", ",".join(targets)],
        capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"LoRA rank 4, alpha 8, targets {','.join(targets)}:" in run.stdout, run.stdout
    lines = re.findall(r"^(fp32|bf16) +step median +[0-9.]+ ms +[0-9]+ tokens/s +[0-9.]+ TFLOP/s "
                       r"+MFU +[0-9.]+%  \((\d+) base \+ (\d+) adapter params, loss ([0-9.]+)\)$",
                       run.stdout, re.M)
    assert [line[0] for line in lines] == ["fp32", "bf16"], run.stdout
    shape = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
                 num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=CONTEXT, qkv_bias=True, tie_word_embeddings=True)
    with ampd.Client(server.address) as client:
        full = client.create_job(model=ampd.Decoder(**shape), precision="fp32")
        lora = client.create_job(
            model=ampd.Decoder(lora=ampd.LoRA(rank=4, alpha=8.0, target_modules=targets),
                               **shape),
            precision="fp32")
    for _, base, adapters, _ in lines:
        assert int(base) == full.parameter_count
        assert int(adapters) == lora.parameter_count - full.parameter_count
    # rank x (in + out) per target and layer: q/o (32 + 32), k/v (32 + 16),
    # gate/up/down (32 + 64).
    widths = {"q_proj": 64, "k_proj": 48, "v_proj": 48, "o_proj": 64, "gate_proj": 96,
              "up_proj": 96, "down_proj": 96}
    assert int(lines[0][2]) == LAYERS * 4 * sum(widths[t] for t in targets)
