"""Sampler snapshots through the real ampd (CPU backend): Job.save_sampler_snapshot,
Job.sample(..., snapshot=NAME), Job.sampler_snapshots, Job.delete_sampler_snapshot.

On batch-invariant jobs (a GPT, a decoder, a LoRA decoder; fp16 and fp32),
a snapshot's samples carry, bit for bit, the log-probs the training
forward computes at the step it was taken (the next step's own forward, a
token loss on those samples, reports them with a mismatch of exactly 0),
and keep doing so while the job trains on; a SIGKILLed server brings a
persisted snapshot back with the same bits; names, resends, the per-job
limit, memory admission, unknown names and another tenant's calls are
refused as documented."""
import hashlib
import os

import numpy as np
import pytest

import ampd
from ampd.client import Job
from small_lms import MODELS, VOCAB

PROMPTS = [[3, 1, 4], [1], [5, 9, 2, 6, 5], [3, 5]]


def rule_step(job, step):
    rng = np.random.default_rng(100 + step)
    ids = rng.integers(0, VOCAB, size=(4, 12), dtype=np.int64)
    return job.step(ids, (3 * ids + 1) % VOCAB)


def make_job(client, which, precision="fp16"):
    job = client.create_job(model=MODELS[which], precision=precision, seed=3,
                            optimizer=ampd.AdamW(lr=1e-2), batch_invariant=True)
    for step in range(3):
        rule_step(job, step)
    return job


def bits(values):
    return np.asarray(values, dtype=np.float32).view(np.uint32).tolist()


def flat(groups):
    """(prompt + completion, its log-probs) of every completion, in order."""
    return [(prompt + c.tokens, c.logprobs)
            for prompt, group in zip(PROMPTS, groups) for c in group]


def rl_step_on(job, samples):
    """An importance-sampling step on the samples (one micro-batch each,
    the prompts' targets -100): its forward runs on the weights before its
    update, so its log-probs are the training forward's now."""
    batches, advantages, q = [], [], []
    for (seq, lp), prompt in zip(samples, [p for p in PROMPTS for _ in range(2)]):
        ids = np.asarray(seq[:-1], dtype=np.int64)[None, :]
        targets = np.asarray(seq[1:], dtype=np.int64)[None, :].copy()
        targets[0, :len(prompt) - 1] = -100
        sampled = np.zeros(targets.shape, dtype=np.float32)
        sampled[0, len(prompt) - 1:] = lp
        batches.append((ids, targets))
        advantages.append(np.ones(targets.shape, dtype=np.float32))
        q.append(sampled)
    return job.step(micro_batches=batches, loss_fn="importance_sampling", advantages=advantages,
                    sampling_logprobs=q, return_logprobs=True)


@pytest.mark.parametrize("precision", ["fp16", "fp32"])
@pytest.mark.parametrize("which", sorted(MODELS))
def test_snapshot_logprobs_are_the_training_forwards_while_the_job_trains(server, which,
                                                                         precision):
    with ampd.Client(server.address) as client:
        job = make_job(client, which, precision)
        name = job.save_sampler_snapshot()
        assert name == "step-3"
        taken = job.sample(PROMPTS, num_samples=2, max_tokens=5, seed=11, snapshot=name)
        samples = flat(taken)
        # The current weights are still the snapshot's: the same draws.
        live = job.sample(PROMPTS, num_samples=2, max_tokens=5, seed=11)
        assert [bits(lp) for _, lp in flat(live)] == [bits(lp) for _, lp in samples]
        # The training forward at the snapshot's step (the next step's,
        # before its update) computes these log-probs bit for bit.
        result = rl_step_on(job, samples)
        assert result.logprob_mismatch == 0.0
        for (seq, lp), trained, prompt in zip(samples, result.logprobs,
                                              [p for p in PROMPTS for _ in range(2)]):
            assert bits(trained[0, len(prompt) - 1:]) == bits(lp), seq
        # The job trains on; the snapshot keeps sampling the same bits,
        # while the current weights have moved.
        for step in range(3):
            rule_step(job, 10 + step)
            again = job.sample(PROMPTS, num_samples=2, max_tokens=5, seed=11, snapshot=name)
            assert [(seq, bits(lp)) for seq, lp in flat(again)] == \
                [(seq, bits(lp)) for seq, lp in samples]
        moved = flat(job.sample(PROMPTS, num_samples=2, max_tokens=5, seed=11))
        assert [(seq, bits(lp)) for seq, lp in moved] != [(seq, bits(lp)) for seq, lp in samples]
        [info] = job.sampler_snapshots()
        assert (info.name, info.step, info.applied_steps) == (name, 3, 3)


def test_a_lora_snapshot_holds_the_adapters_alone(server):
    with ampd.Client(server.address) as client:
        full = make_job(client, "decoder")
        lora = make_job(client, "lora")
        full.save_sampler_snapshot("s")
        lora.save_sampler_snapshot("s")
        [f] = full.sampler_snapshots()
        [a] = lora.sampler_snapshots()
        # fp16 working copies: 2 bytes a parameter. The adapters: rank 4 over
        # q, k, v, o of 2 layers (hidden 32; 8 KV dims a head, 2 KV heads).
        adapters = 2 * (4 * 32 + 32 * 4 + 4 * 32 + 16 * 4 + 4 * 32 + 16 * 4 + 4 * 32 + 32 * 4)
        assert a.bytes == 2 * adapters
        assert f.bytes == 2 * full.parameter_count
        assert a.bytes < f.bytes / 5


def test_names_resends_deletes_and_refusals(server):
    with ampd.Client(server.address) as client:
        job = make_job(client, "lora")
        assert job.save_sampler_snapshot("policy-v1") == "policy-v1"
        # A resend (nothing trained since) makes no second copy.
        assert job.save_sampler_snapshot("policy-v1") == "policy-v1"
        assert job.save_sampler_snapshot() == "step-3"
        assert job.save_sampler_snapshot() == "step-3"
        assert [s.name for s in job.sampler_snapshots()] == ["policy-v1", "step-3"]
        rule_step(job, 20)
        with pytest.raises(ampd.SnapshotExists) as exists:
            job.save_sampler_snapshot("policy-v1")
        assert exists.value.snapshot == "policy-v1"
        assert job.save_sampler_snapshot() == "step-4"
        # Unknown names: NOT_FOUND naming the field.
        for call in (lambda: job.sample(PROMPTS, snapshot="nope"),
                     lambda: job.delete_sampler_snapshot("nope")):
            with pytest.raises(ampd.SnapshotNotFound) as missing:
                call()
            assert missing.value.metadata["field"] == "snapshot"
            assert missing.value.snapshot == "nope"
        with pytest.raises(ampd.InvalidField) as bad:
            job.save_sampler_snapshot("../etc")
        assert bad.value.field == "snapshot"
        with pytest.raises(ampd.InvalidField):
            job.sample(PROMPTS, snapshot="a b")
        job.delete_sampler_snapshot("policy-v1")
        assert [s.name for s in job.sampler_snapshots()] == ["step-3", "step-4"]
        with pytest.raises(ampd.SnapshotNotFound):
            job.sample(PROMPTS, snapshot="policy-v1")
        # At most 32 a job.
        for i in range(30):
            job.save_sampler_snapshot("n%d" % i)
        with pytest.raises(ampd.SnapshotLimit) as limit:
            job.save_sampler_snapshot("one-more")
        assert limit.value.max_snapshots == 32
        job.delete_sampler_snapshot("n0")
        job.save_sampler_snapshot("one-more")


def test_a_snapshot_is_admitted_against_the_memory_limit(start_ampd, workdir):
    state = os.path.join(workdir, "state")
    server = start_ampd("--state-dir=" + state)
    with ampd.Client(server.address) as client:
        job = client.create_job(model=MODELS["decoder"], precision="fp32", seed=3,
                                batch_invariant=True)
        job.save_sampler_snapshot("a")
        [a] = job.sampler_snapshots()
        estimated = job.estimated_bytes
    server.stop()
    # Room for the job and one snapshot and a half: the restored one counts.
    server = start_ampd("--state-dir=" + state,
                        "--max-memory-bytes=%d" % (estimated + a.bytes + a.bytes // 2))
    with ampd.Client(server.address) as client:
        job = client.job(job.job_id)
        assert [s.name for s in job.sampler_snapshots()] == ["a"]
        with pytest.raises(ampd.MemoryLimit) as refused:
            job.save_sampler_snapshot("b")
        assert refused.value.metadata["field"] == "snapshot"
        assert int(refused.value.metadata["requested_bytes"]) == a.bytes
        assert [s.name for s in job.sampler_snapshots()] == ["a"]
        job.delete_sampler_snapshot("a")
        assert job.save_sampler_snapshot("b") == "b"


def test_a_persisted_snapshot_survives_sigkill_with_its_bits(start_ampd, workdir):
    server = start_ampd("--state-dir=" + os.path.join(workdir, "state"))
    with ampd.Client(server.address) as client:
        job = make_job(client, "lora")
        job.save_sampler_snapshot("keep")
        job.save_sampler_snapshot("drop")
        before = flat(job.sample(PROMPTS, num_samples=2, max_tokens=5, seed=11, snapshot="keep"))
        job_id = job.job_id
    server.kill()
    server.restart()
    with ampd.Client(server.address) as client:
        job = client.job(job_id)
        # The job's own steps were never checkpointed (no --checkpoint-every):
        # it is back at step 0, and the snapshots at the step they were taken.
        assert job.step_count == 0
        assert [(s.name, s.step) for s in job.sampler_snapshots()] == [("drop", 3), ("keep", 3)]
        after = flat(job.sample(PROMPTS, num_samples=2, max_tokens=5, seed=11, snapshot="keep"))
        assert [(seq, bits(lp)) for seq, lp in after] == [(seq, bits(lp)) for seq, lp in before]
        job.delete_sampler_snapshot("drop")
    server.kill()
    # The file's format version and its job's config digest are checked:
    # a file of another version is left on disk, not restored.
    files = os.path.join(workdir, "state", "snapshots", job_id)
    assert sorted(os.listdir(files)) == ["keep.safetensors"]
    keep = ampd.safetensors.load_file(os.path.join(files, "keep.safetensors"))
    assert keep.metadata["ampd.sampler_snapshot"] == "1"
    assert keep.metadata["ampd.snapshot_step"] == "3"
    assert all("lora_" in name for name in keep)  # a LoRA job's adapters alone
    other = keep.copy()
    other.metadata["ampd.sampler_snapshot"] = "2"
    ampd.safetensors.save_file(other, os.path.join(files, "other.safetensors"))
    server.restart()
    with ampd.Client(server.address) as client:
        assert [s.name for s in client.job(job_id).sampler_snapshots()] == ["keep"]
        server.wait_for_log("sampler snapshot other not restored")
        client.job(job_id).delete()
    assert not os.listdir(os.path.join(workdir, "state", "snapshots"))


def test_a_save_resent_after_sigkill_answers_as_the_original(start_ampd, workdir):
    """The client's save whose answer a restart lost is resent: the server
    answers it as it answered the original (the snapshot restored from its
    file, the job back at the same step with the same weights), while a
    save under that name of another step is still SNAPSHOT_EXISTS."""
    state = os.path.join(workdir, "state")
    server = start_ampd("--state-dir=" + state, "--checkpoint-every=1", "--checkpoint-sync")
    with ampd.Client(server.address) as client:
        job = make_job(client, "lora")
        assert job.save_sampler_snapshot("policy") == "policy"
        assert job.save_sampler_snapshot() == "step-3"
        job_id = job.job_id
    server.kill()
    server.restart()
    with ampd.Client(server.address) as client:
        job = client.job(job_id)
        assert job.step_count == 3
        # The same saves again: the same answers, no second copy.
        assert job.save_sampler_snapshot("policy") == "policy"
        assert job.save_sampler_snapshot() == "step-3"
        assert [(s.name, s.step) for s in job.sampler_snapshots()] == [("policy", 3),
                                                                       ("step-3", 3)]
        rule_step(job, 3)
        with pytest.raises(ampd.SnapshotExists) as exists:
            job.save_sampler_snapshot("policy")
        assert exists.value.snapshot == "policy"
        assert job.save_sampler_snapshot() == "step-4"
    server.kill()
    # Restored at step 4, the job's name "policy" holds step 3's weights:
    # a save under it is another save, refused.
    server.restart()
    with ampd.Client(server.address) as client:
        job = client.job(job_id)
        assert job.step_count == 4
        with pytest.raises(ampd.SnapshotExists):
            job.save_sampler_snapshot("policy")
        assert job.save_sampler_snapshot("step-4") == "step-4"


def test_another_tenant_can_neither_see_nor_use_a_jobs_snapshots(start_ampd, workdir):
    tenants = os.path.join(workdir, "tenants")
    with open(tenants, "w", encoding="utf-8") as f:
        for name in ("alice", "bob"):
            digest = hashlib.sha256(("%s-secret" % name).encode()).hexdigest()
            f.write("%s %s\n" % (name, digest))
    server = start_ampd("--auth-tokens=" + tenants)
    with ampd.Client(server.address, token="alice-secret") as alice, \
            ampd.Client(server.address, token="bob-secret") as bob:
        job = make_job(alice, "lora")
        job.save_sampler_snapshot("mine")
        theirs = Job(bob, job.proto)  # alice's job id, called by bob
        for call in (lambda: theirs.sampler_snapshots(),
                     lambda: theirs.sample(PROMPTS, snapshot="mine"),
                     lambda: theirs.save_sampler_snapshot("mine"),
                     lambda: theirs.delete_sampler_snapshot("mine")):
            with pytest.raises(ampd.JobNotFound):
                call()
        assert [s.name for s in job.sampler_snapshots()] == ["mine"]
        job.sample(PROMPTS, snapshot="mine")


def test_a_snapshot_counts_against_its_tenants_memory_quota(start_ampd, workdir):
    tenants = os.path.join(workdir, "tenants")
    digest = hashlib.sha256(b"alice-secret").hexdigest()

    def write_tenants(quota=""):
        with open(tenants, "w", encoding="utf-8") as f:
            f.write("alice %s %s\n" % (digest, quota))

    write_tenants()
    state = "--state-dir=" + os.path.join(workdir, "state")
    server = start_ampd("--auth-tokens=" + tenants, state)
    with ampd.Client(server.address, token="alice-secret") as alice:
        job = alice.create_job(model=MODELS["lora"], precision="fp16", seed=3,
                               batch_invariant=True)
        job.save_sampler_snapshot("a")
        [a] = job.sampler_snapshots()
    server.stop()
    write_tenants("max_memory_bytes=%d" % (job.estimated_bytes + a.bytes + a.bytes // 2))
    server = start_ampd("--auth-tokens=" + tenants, state)
    with ampd.Client(server.address, token="alice-secret") as alice:
        job = alice.job(job.job_id)
        with pytest.raises(ampd.MemoryLimit) as refused:
            job.save_sampler_snapshot("b")
        assert refused.value.metadata["tenant"] == "alice"
        assert refused.value.metadata["field"] == "snapshot"
        job.delete_sampler_snapshot("a")
        job.save_sampler_snapshot("b")
