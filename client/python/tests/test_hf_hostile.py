"""Hostile Hugging Face inputs against a real ampd: config.json text sent
in CreateJob (JobConfig.hf_config_json) and the folders of --models-dir
(JobConfig.base_model). Each is refused with INVALID_ARGUMENT naming the
request field, quickly, and the server goes on serving."""
import json
import os
import shutil
import subprocess

import numpy as np
import pytest

import ampd
import ampd.safetensors
from ampd.hf import HfConfig

LLAMA = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 16}
GEMMA = dict(LLAMA, model_type="gemma3_text", head_dim=8)
SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
             qkv_bias=True, o_bias=False)
LORA = ampd.LoRA(rank=4, alpha=8.0)


def refused(client, text, match):
    """create_job of config.json `text` is INVALID_ARGUMENT on
    config.hf_config_json matching `match`."""
    with pytest.raises(ampd.InvalidArgument, match=match) as error:
        client.create_job(model=HfConfig(text), precision="fp32")
    assert error.value.field == "config.hf_config_json", (match, error.value)


def test_an_object_of_many_keys_is_read_in_linear_time(server):
    """~95k keys under the 1 MiB cap (a scan per key took the server 12 s of
    one request's CPU; JsonValueTest.AnObjectOfManyKeysTakesLinearTime holds
    the reader to linear time): both refusals name the field."""
    many = "{" + ",".join('"%d":0' % i for i in range(95000)) + "}"
    assert len(many) < 1 << 20
    with ampd.Client(server.address) as client:
        refused(client, many, "model_type: missing")
        refused(client, many[:-1] + ',"94999":1}', 'the key "94999" twice')


def test_layer_counts_are_capped_before_any_per_layer_list(server):
    """Gemma's sliding-layer list was built from num_hidden_layers before
    any size check: 1e9 layers took seconds and a gigabit, 1e12 the host's
    memory. Every family refuses a layer count above 65536 by key."""
    with ampd.Client(server.address) as client:
        refused(client, json.dumps(dict(GEMMA, num_hidden_layers=10 ** 9)),
                "num_hidden_layers: 1000000000: at most 65536")
        refused(client, json.dumps(dict(LLAMA, num_hidden_layers=10 ** 12)),
                "num_hidden_layers: .*at most 65536")
        gpt2 = {"model_type": "gpt2", "vocab_size": 64, "n_positions": 16, "n_embd": 32,
                "n_layer": 70000, "n_head": 4}
        refused(client, json.dumps(gpt2), "n_layer: 70000: at most 65536")
        # The largest allowed count maps, and admission then sizes it.
        with pytest.raises(ampd.ResourceExhausted):
            client.create_job(model=HfConfig(json.dumps(dict(GEMMA, num_hidden_layers=65536,
                                                             hidden_size=4096, head_dim=128,
                                                             num_attention_heads=32,
                                                             intermediate_size=16384,
                                                             vocab_size=262144))),
                              precision="fp32")
        assert client.create_job(model=HfConfig(json.dumps(GEMMA)), precision="fp32")


def test_numbers_out_of_range_name_their_key(server):
    """A float finite for Python but infinite as float32 is config.json's
    error (its key), not the mapped model's; integers out of int64, NaN,
    wrong types and zero sizes are refused by key too."""
    with ampd.Client(server.address) as client:
        refused(client, json.dumps(dict(LLAMA, rope_theta=1e39)),
                "rope_theta: 1e\\+39: beyond float32's range")
        refused(client, json.dumps(dict(LLAMA, rms_norm_eps=-1e300)),
                "rms_norm_eps: .*beyond float32's range")
        refused(client, json.dumps(dict(LLAMA, vocab_size=2 ** 64)), "vocab_size: must be an integer")
        refused(client, json.dumps(LLAMA).replace('"vocab_size": 64', '"vocab_size": 1e400'),
                "vocab_size: must be an integer")
        refused(client, json.dumps(dict(LLAMA, rms_norm_eps=float("nan"))), "a value expected")
        refused(client, json.dumps(dict(LLAMA, vocab_size="64")), "vocab_size: must be an integer")
        refused(client, json.dumps(dict(LLAMA, head_dim=0)), "head_dim: must be > 0")
        # A config.json that maps onto a model the server refuses names the
        # file, not a config.model.* field the request never sent.
        refused(client, json.dumps(dict(LLAMA, num_attention_heads=-4)),
                "config.json: decoder.num_attention_heads: must be > 0")
        refused(client, json.dumps(dict(LLAMA, rope_scaling={"rope_type": "linear", "factor": 0})),
                "config.json: decoder.rope_scaling.factor: must be finite and >= 1")
        refused(client, json.dumps(dict(LLAMA, rms_norm_eps=1e-50)),
                "config.json: decoder.rms_norm_eps: must be finite and > 0")
        refused(client, "[" * 100000 + "]" * 100000, "nested too deep")
        refused(client, '{"model_type": "llama", "model_type": "qwen2"}', '"model_type" twice')
        refused(client, " " * (2 << 20) + "{}", "at most 1048576 bytes")
        # A model far beyond --max-memory-bytes: admission, before allocating.
        with pytest.raises(ampd.ResourceExhausted):
            client.create_job(model=HfConfig(json.dumps(dict(LLAMA, vocab_size=2 ** 40))),
                              precision="fp32")
        assert client.create_job(model=HfConfig(json.dumps(LLAMA)), precision="fp32")


@pytest.fixture
def hostile_models(workdir, start_ampd, tmp_path):
    """A models dir of one good base (ok) and a folder per hostile variant
    of it, and a server over it."""
    root = tmp_path / "models"
    writer = start_ampd()
    with ampd.Client(writer.address) as client:
        job = client.create_job(model=ampd.Decoder(**SMALL), precision="fp32", seed=3,
                                optimizer=ampd.SGD(lr=0.0))
        job.save_pretrained(str(root / "ok"))
    writer.stop()
    ok = root / "ok"
    with open(ok / "model.safetensors", "rb") as f:
        weights = f.read()
    state = ampd.safetensors.loads(weights)
    config = (ok / "config.json").read_text()

    def variant(name, files):
        folder = root / name
        folder.mkdir()
        (folder / "config.json").write_text(config)
        for file, data in files.items():
            (folder / file).write_bytes(data if isinstance(data, bytes) else data.encode())
        return name

    (tmp_path / "secret.safetensors").write_bytes(weights)
    index = lambda file: json.dumps({"metadata": {}, "weight_map": {n: file for n in state}})
    names = {
        variant("escape_index", {"model.safetensors.index.json": index("../../secret.safetensors")}):
            "weight_map.*not a file name of the folder",
        variant("absolute_index",
                {"model.safetensors.index.json": index(str(tmp_path / "secret.safetensors"))}):
            "weight_map.*not a file name of the folder",
        variant("missing_shard", {"model.safetensors.index.json": index("shard.safetensors")}):
            "shard.safetensors: missing",
        variant("truncated", {"model.safetensors": weights[:len(weights) - 100]}):
            "model.safetensors",
        variant("wrong_shape", {"model.safetensors": ampd.safetensors.dumps(
            dict(state, **{"model.norm.weight": np.zeros(7, np.float32)}), {"format": "pt"})}):
            "model.norm.weight",
        variant("wrong_dtype", {"model.safetensors": ampd.safetensors.dumps(
            dict(state, **{"model.norm.weight": np.zeros(32, np.int32)}), {"format": "pt"})}):
            "model.norm.weight",
    }
    bad_utf8 = root / "bad_utf8"
    bad_utf8.mkdir()
    (bad_utf8 / "config.json").write_bytes(config.replace('"qwen2"', '"qwen\xff"').encode("latin-1"))
    shutil.copy(ok / "model.safetensors", bad_utf8 / "model.safetensors")
    names["bad_utf8"] = "not UTF-8"
    odd_heads = root / "odd_heads"
    shutil.copytree(ok, odd_heads)
    (odd_heads / "config.json").write_text(
        json.dumps(dict(json.loads(config), head_dim=7, num_attention_heads=4)))
    names["odd_heads"] = "config.json: decoder.head_dim: must be even"
    # A weight file far larger than config.json's model: refused before it is
    # read whole into the server's memory.
    padded = root / "padded"
    shutil.copytree(ok, padded)
    with open(padded / "model.safetensors", "ab") as f:
        f.truncate(len(weights) + (80 << 20))
    names["padded"] = "model.safetensors: .* bytes, more than"
    os.symlink(str(tmp_path / "secret.safetensors"), str(root / "ok" / "linked.safetensors"))
    link = root / "linked_shard"
    shutil.copytree(ok, link, symlinks=True)
    (link / "model.safetensors.index.json").write_text(index("linked.safetensors"))
    names["linked_shard"] = "linked.safetensors: a symlink out of --models-dir"
    os.unlink(str(root / "ok" / "linked.safetensors"))
    return start_ampd("--models-dir=%s" % root), names


def test_hostile_base_folders_are_refused_naming_base_model(hostile_models):
    server, names = hostile_models
    with ampd.Client(server.address) as client:
        for name, says in names.items():
            with pytest.raises(ampd.InvalidArgument, match=says) as e:
                client.create_job(base_model=name, lora=LORA, precision="fp32")
            assert e.value.field == "config.base_model", (name, e.value)
        job = client.create_job(base_model="ok", lora=LORA, precision="fp32")
        assert job.state_dict()


def ampctl(server, *args):
    """ampctl against `server`: the finished process."""
    binary = os.environ["AMPCTL_BINARY"]
    return subprocess.run([binary, "--server=%s" % server.address, *args], capture_output=True,
                          text=True, timeout=120)


def test_ampctl_refuses_hostile_folders_with_a_clear_error(server, tmp_path):
    """ampctl train --from-hf / --adapter over hostile folders: exit 2 and
    a message naming the file and key, never a crash nor a job."""
    with ampd.Client(server.address) as client:
        job = client.create_job(model=ampd.Decoder(**SMALL), precision="fp32", seed=3)
        job.save_pretrained(str(tmp_path / "ok"))
        job.delete()
        before = len(client.jobs())
    ok = tmp_path / "ok"
    config = (ok / "config.json").read_text()

    def folder(name, files):
        path = tmp_path / name
        shutil.copytree(ok, path)
        for file, data in files.items():
            (path / file).write_bytes(data if isinstance(data, bytes) else data.encode())
        return str(path)

    adapter = lambda **c: {"adapter_config.json": json.dumps(dict(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}, **c))}
    cases = [
        (["--from-hf=%s" % folder("escape", {"model.safetensors.index.json": json.dumps(
            {"weight_map": {"model.norm.weight": "../../etc/passwd"}})})], "not a file name"),
        (["--from-hf=%s" % folder("bad_utf8", {"config.json": config.replace(
            '"qwen2"', '"qwen\xff"').encode("latin-1")})], "not UTF-8"),
        (["--from-hf=%s" % folder("deep", {"config.json": "[" * 10000})], "nested too deep"),
        (["--from-hf=%s" % (tmp_path / "nothing")], "cannot read"),
        (["--from-hf=%s" % ok, "--adapter=%s" % folder("rank_text", adapter(r="4"))],
         "adapter_config.json: r: missing or not an integer"),
        (["--from-hf=%s" % ok, "--adapter=%s" % folder("alpha_text", adapter(lora_alpha="8"))],
         "adapter_config.json: lora_alpha: missing or not a number"),
        (["--from-hf=%s" % ok, "--adapter=%s" % folder("peft_list", adapter(peft_type=["LORA"]))],
         "adapter_config.json: peft_type"),
        (["--from-hf=%s" % ok, "--adapter=%s" % folder("not_json", {"adapter_config.json": "{"})],
         "adapter_config.json: not a JSON document"),
    ]
    for args, says in cases:
        done = ampctl(server, "train", "--precision=fp32", "--steps=0", *args)
        assert done.returncode == 2 and says in done.stderr, (args, done.returncode, done.stderr)
    with ampd.Client(server.address) as client:
        assert len(client.jobs()) == before


def test_a_config_beyond_max_memory_bytes_is_refused_before_allocating(start_ampd):
    """A config.json of a model far beyond --max-memory-bytes is
    RESOURCE_EXHAUSTED (MEMORY_LIMIT) at admission, without
    the server's memory growing; a small one still fits."""
    server = start_ampd("--max-memory-bytes=100000000")
    big = dict(LLAMA, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
               num_attention_heads=64, num_key_value_heads=8, vocab_size=128256)
    def rss():
        with open("/proc/%d/status" % server.proc.pid) as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))

    with ampd.Client(server.address) as client:
        before = rss()
        with pytest.raises(ampd.MemoryLimit):
            client.create_job(model=HfConfig(json.dumps(big)), precision="fp32")
        assert rss() < before + (64 << 20), (before, rss())
        assert client.create_job(model=HfConfig(json.dumps(LLAMA)), precision="fp32")
