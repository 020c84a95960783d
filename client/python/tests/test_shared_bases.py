"""Base models shared by LoRA jobs, through the real ampd: the server's
--models-dir holds Hugging Face folders written by the client's
save_pretrained; LoRA jobs name one as their base_model.

- 16 LoRA jobs on one ~55 MB base: the server's resident memory and its
  admitted bytes come to one base plus 16 adapters (within 10%), and the
  base goes with the last job;
- each shared-base job's steps, adapters and log-probs equal, bit for bit,
  the same job made by ampd.from_pretrained (its own base, loaded from the
  same folder over LoadStateDict);
- a full job made from a base_model equals ampd.from_pretrained's;
- hostile names are refused naming config.base_model, and what config.json
  holds that ampd cannot compute is refused naming the key;
- a shared-base job survives SIGKILL and restart (its checkpoint holds the
  adapters and the base's digest, not the base), and a base whose files
  changed since leaves the job failed, saying why.
"""
import concurrent.futures
import json
import os
import shutil
import socket
import urllib.request

import numpy as np
import pytest

import ampd
import ampd.safetensors
from ampd.v1 import trainer_pb2 as pb

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
             qkv_bias=True, o_bias=False)
# ~48.3M parameters: 97 MB in bf16, so that one base against sixteen is a
# difference resident memory shows (16 private copies would be 1.5 GB).
BIG = dict(vocab_size=16384, hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
           num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
           qkv_bias=True, o_bias=False)
LORA = ampd.LoRA(rank=4, alpha=8.0)


def write_base(server_address, directory, shape, seed):
    """A Hugging Face folder (config.json + model.safetensors, F32) of a
    decoder drawn from `seed`, written by the client's save_pretrained."""
    with ampd.Client(server_address) as client:
        job = client.create_job(model=ampd.Decoder(**shape), precision="fp32", seed=seed,
                                optimizer=ampd.SGD(lr=0.0))
        job.save_pretrained(directory)
        job.delete()
    with open(os.path.join(directory, "config.json")) as f:
        assert json.load(f)["model_type"] == "qwen2"
    return directory


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    """A models dir with Org/small and big, written once for the module."""
    from conftest import AmpdProcess
    root = str(tmp_path_factory.mktemp("models"))
    workdir = str(tmp_path_factory.mktemp("writer"))
    writer = AmpdProcess([], workdir)
    try:
        write_base(writer.address, os.path.join(root, "Org", "small"), SMALL, seed=3)
        write_base(writer.address, os.path.join(root, "big"), BIG, seed=4)
    finally:
        writer.stop()
    return root


def tokens(step, vocab, batch=2, seq_len=12):
    rng = np.random.default_rng(500 + step)
    ids = rng.integers(0, vocab, size=(batch, seq_len), dtype=np.int64)
    return ids, (3 * ids + 1) % vocab


def rss_bytes(server):
    with open("/proc/%d/status" % server.proc.pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gauge(port, name):
    """A server-wide gauge's value from ampd's /metrics."""
    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=10) as response:
        text = response.read().decode()
    values = [float(line.split()[1]) for line in text.splitlines()
              if line.split(" ")[0] == name]
    assert len(values) == 1, (name, text)
    return values[0]


def adapters(job):
    state = job.state_dict("adapter")
    return {name: np.asarray(state[name]).tobytes() for name in state}


def test_models_lists_the_folders_with_a_config(models_dir, start_ampd):
    server = start_ampd("--models-dir=%s" % models_dir)
    with ampd.Client(server.address) as client:
        assert client.models() == ["Org/small", "big"]
    bare = start_ampd()
    with ampd.Client(bare.address) as client:
        assert client.models() == []
        with pytest.raises(ampd.FailedPrecondition, match="config.base_model: .*no --models-dir"):
            client.create_job(base_model="Org/small", lora=LORA)


def test_sixteen_lora_jobs_hold_one_base(models_dir, start_ampd, monkeypatch):
    # Each job's CPU backend has a thread pool of its own, whose stacks and
    # arenas are per-job memory the base has nothing to do with: two
    # threads each, whatever the machine's cores.
    monkeypatch.setenv("AMPD_CPU_THREADS", "2")
    server = start_ampd("--models-dir=%s" % models_dir, "--worker-threads=2")
    with ampd.Client(server.address) as client:
        before = rss_bytes(server)
        jobs = [client.create_job(base_model="big", lora=LORA, precision="bf16", seed=i,
                                  optimizer=ampd.AdamW(lr=1e-3)) for i in range(16)]
        after = rss_bytes(server)
        per_job = jobs[0].estimated_bytes  # the adapters': 16 bytes each with AdamW in bf16
        assert all(j.estimated_bytes == per_job for j in jobs)
        base_bytes = (jobs[0].parameter_count - per_job // 16) * 2
        assert base_bytes > 90e6
        expected = base_bytes + 16 * per_job
        grew = after - before
        assert abs(grew - expected) <= 0.10 * expected, (grew, expected)
        ids, targets = tokens(0, BIG["vocab_size"])
        for job in jobs[:2]:
            assert np.isfinite(job.step(ids, targets).loss)
    server.stop()

    # Room for one base and 16 adapter jobs with 5% to spare: 16 private
    # bases (870 MB) could never be admitted.
    limit = int(expected * 1.05)
    metrics = free_port()
    server = start_ampd("--models-dir=%s" % models_dir, "--max-memory-bytes=%d" % limit,
                        "--metrics-listen=127.0.0.1:%d" % metrics)
    # 7.3M fp32 parameters with plain SGD (12 bytes each): 88 MB, about the
    # base's size, more than the room left while the base is held.
    near_base = ampd.Model([ampd.Linear(4096, 1792, bias=False)])
    with ampd.Client(server.address) as client:
        assert gauge(metrics, "ampd_shared_bases") == 0
        jobs = [client.create_job(base_model="big", lora=LORA, precision="bf16", seed=i)
                for i in range(16)]
        assert gauge(metrics, "ampd_shared_bases") == 1
        assert gauge(metrics, "ampd_shared_base_bytes") == base_bytes
        # Another base (fp32) does not fit beside them.
        with pytest.raises(ampd.ResourceExhausted):
            client.create_job(base_model="big", lora=LORA, precision="fp32", seed=99)
        for job in jobs[1:]:
            job.delete()
        # One job holds the base still, and its bytes stay admitted.
        with pytest.raises(ampd.ResourceExhausted):
            client.create_job(model=near_base, precision="fp32", optimizer=ampd.SGD(lr=0.1))
        held = rss_bytes(server)
        jobs[0].delete()
        # The last job took the base with it: its bytes are free again, in
        # resident memory and for admission.
        assert held - rss_bytes(server) > 0.8 * base_bytes, (held, rss_bytes(server))
        assert (gauge(metrics, "ampd_shared_bases"), gauge(metrics, "ampd_shared_base_bytes")) == \
            (0, 0)
        client.create_job(model=near_base, precision="fp32", optimizer=ampd.SGD(lr=0.1))


def test_shared_base_jobs_step_as_their_own_base_would(models_dir, start_ampd):
    folder = os.path.join(models_dir, "Org", "small")
    server = start_ampd("--models-dir=%s" % models_dir)
    with ampd.Client(server.address) as client:
        shared = [client.create_job(base_model="Org/small", lora=LORA, precision="bf16", seed=i,
                                    batch_invariant=True) for i in range(16)]
        assert shared[0].config.base_model == "Org/small"
        assert shared[0].config.model.decoder.hidden_size == SMALL["hidden_size"]
        assert shared[0].config.model.decoder.lora.rank == LORA.rank
        probe = tokens(99, SMALL["vocab_size"])
        runs = []
        for i, job in enumerate(shared):
            before = job.evaluate(*probe, return_logprobs=True).logprobs
            reports = [job.step(*tokens(10 * i + s, SMALL["vocab_size"])) for s in range(3)]
            runs.append((before, reports, adapters(job)))
        # Alone: each job again with a base of its own, loaded by the client
        # from the same folder.
        for i, (before, reports, weights) in enumerate(runs):
            alone = client.create_job(model=ampd.from_pretrained(folder, lora=LORA),
                                      precision="bf16", seed=i, batch_invariant=True)
            assert not alone.config.base_model
            logprobs = alone.evaluate(*probe, return_logprobs=True).logprobs
            assert [a.tobytes() for a in logprobs] == [b.tobytes() for b in before]
            for s, report in enumerate(reports):
                mine = alone.step(*tokens(10 * i + s, SMALL["vocab_size"]))
                assert (mine.loss, mine.grad_norm, mine.scale_after) == \
                    (report.loss, report.grad_norm, report.scale_after)
            assert adapters(alone) == weights
            alone.delete()
        # Sampled log-probs of a shared base are the trainer's, as anywhere.
        [[completion]] = shared[0].sample([[1, 2, 3]], max_tokens=4, seed=5)
        seq = [1, 2, 3] + list(completion.tokens)
        trained = shared[0].logprobs([seq[:len(seq)]])[0][2:]
        assert np.asarray(completion.logprobs, np.float32).tobytes() == trained.tobytes()


def test_jobs_created_at_once_load_their_base_once(models_dir, start_ampd):
    server = start_ampd("--models-dir=%s" % models_dir, "--worker-threads=4")
    probe = tokens(1, SMALL["vocab_size"])
    with ampd.Client(server.address) as client:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            jobs = list(pool.map(
                lambda i: client.create_job(base_model="Org/small", lora=LORA, precision="bf16",
                                            seed=7), range(8)))
        assert server.log().count("base model Org/small loaded (bf16") == 1, server.log()
        logprobs = {job.evaluate(*probe, return_logprobs=True).logprobs[0].tobytes()
                    for job in jobs}
        assert len(logprobs) == 1
        for job in jobs:
            job.delete()
        # The last job took the base: the next job loads it again.
        client.create_job(base_model="Org/small", lora=LORA, precision="bf16")
        assert server.log().count("base model Org/small loaded (bf16") == 2


def test_a_sharded_16_bit_base_is_read_as_from_pretrained_reads_it(models_dir, start_ampd,
                                                                    tmp_path):
    """Two shards with an index, one in BF16 and one in F16, as published
    checkpoints come: the server's load and the client's give the same bits,
    in every precision."""
    root = tmp_path / "models"
    folder = root / "sharded"
    folder.mkdir(parents=True)
    shutil.copy(os.path.join(models_dir, "Org", "small", "config.json"), folder)
    with open(os.path.join(models_dir, "Org", "small", "model.safetensors"), "rb") as f:
        state = ampd.safetensors.loads(f.read())
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    first, second = halves
    ampd.safetensors.save_file({n: state[n] for n in halves[first]}, str(folder / first),
                               {"format": "pt"}, {n: "BF16" for n in halves[first]})
    ampd.safetensors.save_file({n: state[n].astype(np.float16) for n in halves[second]},
                               str(folder / second), {"format": "pt"})
    with open(folder / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {}, "weight_map": {n: file for file, ns in halves.items()
                                                  for n in ns}}, f)
    server = start_ampd("--models-dir=%s" % root)
    probe = tokens(3, SMALL["vocab_size"])
    with ampd.Client(server.address) as client:
        assert client.models() == ["sharded"]
        for precision in ("bf16", "fp16", "fp32"):
            shared = client.create_job(base_model="sharded", lora=LORA, precision=precision,
                                       seed=5)
            alone = client.create_job(model=ampd.from_pretrained(str(folder), lora=LORA),
                                      precision=precision, seed=5)
            for job in (shared, alone):
                job.result = [job.evaluate(*probe, return_logprobs=True).logprobs[0].tobytes()]
                job.result += [job.step(*tokens(s, SMALL["vocab_size"])).loss for s in range(2)]
            assert shared.result == alone.result, precision
            assert adapters(shared) == adapters(alone), precision


def test_a_full_job_from_a_base_model_is_from_pretrained(models_dir, start_ampd):
    folder = os.path.join(models_dir, "Org", "small")
    server = start_ampd("--models-dir=%s" % models_dir)
    with ampd.Client(server.address) as client:
        full = client.create_job(base_model="Org/small", precision="fp16", seed=1)
        mine = client.create_job(model=ampd.from_pretrained(folder), precision="fp16", seed=1)
        probe = tokens(7, SMALL["vocab_size"])
        for _ in range(2):
            a = full.evaluate(*probe, return_logprobs=True).logprobs
            b = mine.evaluate(*probe, return_logprobs=True).logprobs
            assert [x.tobytes() for x in a] == [y.tobytes() for y in b]
            ra, rb = full.step(*probe), mine.step(*probe)
            assert (ra.loss, ra.grad_norm) == (rb.loss, rb.grad_norm)
        # Its own copy, trainable: the full state holds the weights.
        assert "model.embed_tokens.weight" in full.state_dict()


def test_hostile_and_unmappable_bases_are_refused(models_dir, start_ampd, tmp_path):
    outside = tmp_path / "outside"
    shutil.copytree(os.path.join(models_dir, "Org", "small"), outside)
    escape = os.path.join(models_dir, "escape")
    os.symlink(str(outside), escape)
    odd = os.path.join(models_dir, "odd")
    shutil.copytree(os.path.join(models_dir, "Org", "small"), odd)
    with open(os.path.join(odd, "config.json")) as f:
        config = json.load(f)
    config["hidden_act"] = "gelu"
    with open(os.path.join(odd, "config.json"), "w") as f:
        json.dump(config, f)
    # Weights the config's model does not match: one missing.
    holey = os.path.join(models_dir, "holey")
    shutil.copytree(os.path.join(models_dir, "Org", "small"), holey)
    weights = os.path.join(holey, "model.safetensors")
    with open(weights, "rb") as f:
        state = ampd.safetensors.loads(f.read())
    kept = {name: value for name, value in state.items() if name != "model.norm.weight"}
    with open(weights, "wb") as f:
        f.write(ampd.safetensors.dumps(kept, {"format": "pt"}))
    try:
        server = start_ampd("--models-dir=%s" % models_dir)
        with ampd.Client(server.address) as client:
            for name, says in (("../models", "component"), ("Org/../../etc", "component"),
                               ("/etc", "absolute"), ("Org//small", "component"),
                               ("Org/small\nampd: forged log line", "control character 0xa"),
                               ("Org/\x1b[31msmall", "control character 0x1b"),
                               ("Org\\small", "backslash"),
                               ("escape", "symlink out of --models-dir"),
                               ("nothing", "no such folder"), ("Org", "config.json: missing"),
                               ("odd", "hidden_act"),
                               ("holey", "model.norm.weight: missing from its weight files")):
                with pytest.raises(ampd.InvalidArgument, match=says) as e:
                    client.create_job(base_model=name, lora=LORA)
                assert e.value.field == "config.base_model", (name, e.value)
            # The model is config.json's: a field of it beside base_model is refused.
            model = pb.ModelSpec(decoder=pb.Decoder(hidden_size=32))
            request = pb.CreateJobRequest(config=pb.JobConfig(model=model, base_model="Org/small"))
            with pytest.raises(ampd.InvalidArgument) as e:
                client._call(lambda md, t: client._stub.CreateJob(request, metadata=md, timeout=t))
            assert e.value.field == "config.model.decoder.hidden_size"
            # A shared-base job's weights are the base's: loading one is refused.
            job = client.create_job(base_model="Org/small", lora=LORA, precision="fp32")
            weight = "model.layers.0.mlp.up_proj.weight"
            up = np.zeros((SMALL["intermediate_size"], SMALL["hidden_size"]), np.float32)
            with pytest.raises(ampd.InvalidArgument, match="read-only"):
                job.load_state_dict({weight: up}, partial=True)
            assert weight not in job.state_dict()
    finally:
        os.unlink(escape)
        shutil.rmtree(odd)
        shutil.rmtree(holey)


def test_shared_base_jobs_survive_sigkill(models_dir, start_ampd, tmp_path):
    state_dir = tmp_path / "state"
    server = start_ampd("--models-dir=%s" % models_dir, "--state-dir=%s" % state_dir,
                        "--checkpoint-every=1", "--checkpoint-sync=true")
    with ampd.Client(server.address) as client:
        stepped = client.create_job(base_model="Org/small", lora=LORA, precision="bf16", seed=2)
        fresh = client.create_job(base_model="Org/small", lora=LORA, precision="bf16", seed=3)
        twin = client.create_job(base_model="Org/small", lora=LORA, precision="bf16", seed=2)
        for s in range(2):
            stepped.step(*tokens(s, SMALL["vocab_size"]))
            twin.step(*tokens(s, SMALL["vocab_size"]))
        ids = stepped.job_id, fresh.job_id, twin.job_id
    server.kill()
    # The checkpoint holds the adapters and the base's name and digest only.
    with open(state_dir / (ids[0] + ".safetensors"), "rb") as f:
        state = ampd.safetensors.loads(f.read())
    assert state.metadata["ampd.base_model"] == "Org/small"
    assert state.metadata["ampd.base_digest"].startswith("sha256:")
    assert not any(name.startswith("model.") for name in state)
    assert any("lora_A" in name for name in state)

    server.restart()
    with ampd.Client(server.address) as client:
        stepped, fresh, twin = (client.job(i) for i in ids)
        assert (stepped.step_count, fresh.step_count, stepped.state) == (2, 0, "active")
        for s in range(2, 4):
            a = stepped.step(*tokens(s, SMALL["vocab_size"]))
            b = twin.step(*tokens(s, SMALL["vocab_size"]))
            assert (a.loss, a.grad_norm) == (b.loss, b.grad_norm)
        assert adapters(stepped) == adapters(twin)
        fresh.step(*tokens(0, SMALL["vocab_size"]))
        twin.delete()
    server.stop()

    # A base whose files changed since: its jobs are kept, failed, saying why.
    folder = os.path.join(models_dir, "Org", "small")
    config_path = os.path.join(folder, "config.json")
    with open(config_path) as f:
        original = f.read()
    try:
        with open(config_path, "w") as f:
            f.write(original + "\n")
        server.restart()
        with ampd.Client(server.address) as client:
            for job_id in ids[:2]:
                job = client.job(job_id)
                assert job.state == "failed"
                assert "ampd.base_digest" in job.failure, job.failure
    finally:
        with open(config_path, "w") as f:
            f.write(original)
