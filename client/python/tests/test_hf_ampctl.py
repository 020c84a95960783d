"""ampctl's Hugging Face folders against transformers and PEFT themselves
(the pinned versions of scripts/requirements-hf.txt, under
scripts/python-env.sh's environment), through the real ampctl binary and a
real ampd: for every family of test_hf_transformers.py, a folder
transformers' save_pretrained wrote (random weights from a small config,
nothing downloaded; llama3's in shards with their index) becomes a job with
`ampctl train --from-hf` (the server maps config.json; the weights load
shard by shard), trains a few steps, and `ampctl state export --hf-dir`
writes a folder AutoModelForCausalLM.from_pretrained opens, whose fp32
log-probs equal ampd's to 1e-5 relative. An export forced into small shards
reopens from its index; a bf16 folder loads widened; a PEFT adapter folder
loads into a LoRA job (`--adapter`) whose log-probs equal PeftModel's, for
target_modules as names, dotted suffixes and "all-linear"; and what ampd
cannot compute is refused naming the key before anything is created.

Outside CI these skip, saying so, where transformers is not importable (run
them through CTest after scripts/python-env.sh); with CI=true they fail."""
import json
import os
import re
import subprocess

import numpy as np
import pytest

if os.environ.get("CI") != "true":
    pytest.importorskip("peft", reason="peft is not importable: these tests run under "
                                       "scripts/python-env.sh's environment")
import torch  # noqa: E402

import ampd  # noqa: E402
from test_hf_peft import TARGETS, peft_folders  # noqa: E402
from test_hf_transformers import (FAMILIES, ampd_logprobs, assert_close, batch,  # noqa: E402
                                  hf_logprobs_and_loss, load_hf, make_folder)

AMPCTL = os.environ.get("AMPCTL_BINARY", "")


def ampctl(server, *args, check=True):
    """ampctl against `server`; the finished process (stdout, stderr, code)."""
    if not AMPCTL:
        pytest.fail("AMPCTL_BINARY is not set (CTest sets it)")
    done = subprocess.run([AMPCTL, "--server=%s" % server.address, *args], capture_output=True,
                          text=True, timeout=300)
    if check and done.returncode != 0:
        raise AssertionError("ampctl %s: exit %d\n%s%s" % (" ".join(args), done.returncode,
                                                          done.stdout, done.stderr))
    return done


def train_from_hf(server, directory, *extra, steps=3):
    """`ampctl train --from-hf` in fp32 on its synthetic sequences; the job id."""
    done = ampctl(server, "train", "--from-hf=%s" % directory, "--precision=fp32",
                  "--steps=%d" % steps, "--batch-size=2", "--seq-len=16", "--lr=0.001", *extra)
    ids = set(re.findall(r"^job (\S+): \d+ parameters", done.stdout, re.M))
    assert len(ids) == 1, done.stdout
    print(done.stdout)
    return ids.pop()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_ampctl_trains_a_folder_and_exports_one_transformers_opens(server, tmp_path, family):
    original = make_folder(family, tmp_path / "hf")
    job_id = train_from_hf(server, tmp_path / "hf")
    out = tmp_path / "out"
    ampctl(server, "state", "export", "--job=%s" % job_id, "--hf-dir=%s" % out)
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json",
                                       "model.safetensors"]
    model = load_hf(str(out))
    assert model.config.model_type == FAMILIES[family][0].model_type
    with ampd.Client(server.address) as client:
        job = client.job(job_id)
        ids, targets = batch(family, 5)
        theirs, loss = hf_logprobs_and_loss(model, ids, targets)
        assert_close("%s ampctl export log-probs" % family, ampd_logprobs(job, ids), theirs)
        assert_close("%s ampctl export loss" % family, job.evaluate(ids, targets).loss,
                     loss.item())
    # The steps trained: the export is not the folder it came from.
    before, _ = hf_logprobs_and_loss(original, ids, targets)
    assert np.abs(before - theirs).max() > 1e-4


def test_a_sharded_export_reopens_from_its_index(server, tmp_path):
    make_folder("qwen3", tmp_path / "hf")
    job_id = train_from_hf(server, tmp_path / "hf", steps=1)
    out = tmp_path / "out"
    ampctl(server, "state", "export", "--job=%s" % job_id, "--hf-dir=%s" % out,
           "--max-shard-size=100KB")
    index = json.load(open(out / "model.safetensors.index.json"))
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    assert shards[0] == "model-00001-of-%05d.safetensors" % len(shards)
    assert sorted(os.listdir(out)) == sorted(shards + ["config.json", "generation_config.json",
                                                       "model.safetensors.index.json"])
    model = load_hf(str(out))
    with ampd.Client(server.address) as client:
        job = client.job(job_id)
        ids, targets = batch("qwen3", 2)
        theirs, _ = hf_logprobs_and_loss(model, ids, targets)
        assert_close("sharded export log-probs", ampd_logprobs(job, ids), theirs)
    # The shards reload into a job of their own, file by file.
    again = train_from_hf(server, out, steps=0)
    with ampd.Client(server.address) as client:
        assert_close("reloaded export log-probs", ampd_logprobs(client.job(again), ids), theirs)


def test_a_bf16_folder_loads_widened(server, tmp_path):
    make_folder("llama3_tied", tmp_path / "f32").to(torch.bfloat16).save_pretrained(
        tmp_path / "bf16")
    model = load_hf(str(tmp_path / "bf16"))  # the bf16 values, widened
    job_id = train_from_hf(server, tmp_path / "bf16", steps=0)
    with ampd.Client(server.address) as client:
        ids, targets = batch("llama3_tied", 0)
        theirs, _ = hf_logprobs_and_loss(model, ids, targets)
        assert_close("bf16 folder log-probs", ampd_logprobs(client.job(job_id), ids), theirs)


@pytest.mark.parametrize("which", sorted(TARGETS))
def test_a_peft_adapter_folder_loads_into_a_lora_job(server, tmp_path, which):
    base, adapter, adapted = peft_folders(tmp_path, TARGETS[which])
    job_id = train_from_hf(server, base, "--adapter=%s" % adapter, steps=0)
    with ampd.Client(server.address) as client:
        job = client.job(job_id)
        assert job.config.model.decoder.lora.rank == 4
        ids, targets = batch("llama3", 0)
        theirs, _ = hf_logprobs_and_loss(adapted.eval(), ids, targets)
        assert_close("%s adapter log-probs" % which, ampd_logprobs(job, ids), theirs)


def test_what_ampd_cannot_compute_is_refused_naming_the_key(server, tmp_path):
    make_folder("llama3", tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    config = json.load(open(path))
    config["rope_parameters"] = dict(config["rope_parameters"], rope_type="yarn")
    json.dump(config, open(path, "w"))
    with ampd.Client(server.address) as client:
        before = len(client.jobs())
        done = ampctl(server, "train", "--from-hf=%s" % (tmp_path / "hf"), "--steps=1",
                      check=False)
        assert done.returncode == 2, done.stderr
        assert "config.hf_config_json: config.json: rope_parameters.rope_type" in done.stderr
        assert len(client.jobs()) == before
    base, adapter, _ = peft_folders(tmp_path / "peft", ["q_proj"])
    adapter_config = os.path.join(adapter, "adapter_config.json")
    json.dump(dict(json.load(open(adapter_config)), use_dora=True), open(adapter_config, "w"))
    done = ampctl(server, "train", "--from-hf=%s" % base, "--adapter=%s" % adapter, check=False)
    assert done.returncode == 2 and "use_dora" in done.stderr, done.stderr
