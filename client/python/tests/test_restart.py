"""Exactly-once across ampd crashes: SIGKILL, restart on the same port and
--state-dir, and the client's retries resend the same sequence.

With --checkpoint-every=1 --checkpoint-sync every answered step is on disk
before its answer, so no acknowledged step may be lost or applied twice: the
final weights must equal an uninterrupted run's, bit for bit (the CPU
backend is deterministic). Without --checkpoint-sync and with
--checkpoint-every > 1 acknowledged steps can be lost, and the client must say
which (StepsLost) instead of silently training on from the wrong step.
"""
import os
import threading
import time

import numpy as np
import pytest

import ampd
from ampd import safetensors
from conftest import batch

STEPS = 60


def create(client, seed=5):
    model = ampd.Model([ampd.Linear(8, 16), ampd.GELU(), ampd.Linear(16, 1)], loss="mse")
    return client.create_job(model=model, precision="fp16", optimizer=ampd.AdamW(lr=1e-2),
                             scaler=ampd.Scaler(policy="pytorch", growth_interval=4), seed=seed)


def tensors_equal(a, b):
    assert set(a) == set(b)
    for name in a:
        assert np.array_equal(a[name], b[name]), name


def reference_state(client, steps):
    job = create(client)
    results = [job.step(*batch(s)) for s in range(1, steps + 1)]
    return job, results


def test_sigkill_between_steps_loses_nothing(start_ampd, workdir):
    server = start_ampd("--state-dir=" + os.path.join(workdir, "state"), "--checkpoint-every=1",
                        "--checkpoint-sync")
    client = ampd.Client(server.address, timeout=10, retry_deadline=60)
    ref, ref_results = reference_state(client, STEPS)
    job = create(client)
    results = []
    for s in range(1, STEPS + 1):
        if s in (10, 31):
            server.kill()
            # Restart a little later: the client's first attempts of step s
            # find no server and are retried with backoff.
            threading.Timer(0.5, server.restart).start()
        results.append(job.step(*batch(s)))
    assert [r.global_step for r in results] == list(range(1, STEPS + 1))
    assert [(r.loss, r.skipped, r.scale_after) for r in results] == \
        [(r.loss, r.skipped, r.scale_after) for r in ref_results]
    job.refresh()
    assert job.step_count == STEPS and job.applied_steps == ref.refresh().applied_steps
    tensors_equal(job.state_dict(), ref.state_dict())
    client.close()


def test_sigkill_during_steps_loses_nothing_and_doubles_nothing(start_ampd, workdir):
    """Kills land at arbitrary points, in flight included: a step applied and
    checkpointed whose answer was lost is answered from the record on the
    resend, one never checkpointed is trained (once) by the resend."""
    server = start_ampd("--state-dir=" + os.path.join(workdir, "state"), "--checkpoint-every=1",
                        "--checkpoint-sync")
    client = ampd.Client(server.address, timeout=10, retry_deadline=60, max_backoff=0.2)
    ref, _ = reference_state(client, 3 * STEPS)
    job = create(client)
    kills = []
    done = threading.Event()

    def killer():
        rng = np.random.default_rng(11)
        while not done.is_set() and len(kills) < 4:
            time.sleep(float(rng.uniform(0.2, 0.6)))
            if done.is_set():
                return
            server.kill()  # returns once the process is gone
            kills.append(job.next_sequence)
            server.restart()

    thread = threading.Thread(target=killer)
    thread.start()
    try:
        for s in range(1, 3 * STEPS + 1):
            assert job.step(*batch(s)).global_step == s
            time.sleep(0.005)
    finally:
        done.set()
        thread.join()
    assert kills, "the server was never killed during the run"
    job.refresh()
    assert job.step_count == 3 * STEPS and job.applied_steps == ref.refresh().applied_steps
    tensors_equal(job.state_dict(), ref.state_dict())
    client.close()


def test_steps_lost_without_checkpoint_sync(start_ampd, workdir):
    server = start_ampd("--state-dir=" + os.path.join(workdir, "state"), "--checkpoint-every=5")
    client = ampd.Client(server.address, timeout=10, retry_deadline=60)
    ref, ref_results = reference_state(client, 9)
    ref_state = ref.state_dict()  # read now: the crash below sets ref back too
    job = create(client)
    for s in range(1, 8):
        job.step(*batch(s))
    server.wait_for_log("job %s checkpointed at step 5" % job.job_id)
    server.kill()
    server.restart()

    try:
        job.step(*batch(8))
        raise AssertionError("steps 6 and 7 were lost in the crash but step 8 succeeded")
    except ampd.StepsLost as e:
        assert e.lost_sequences == [6, 7] and e.pending_sequence == 8
        assert e.expected_sequence == 6 and e.reason == "SEQUENCE_MISMATCH"
        assert "6..7" in str(e)
    assert job.next_sequence == 6 and job.step_count == 5
    # The caller resends what it was told to: the run is whole again.
    for s in (6, 7, 8, 9):
        r = job.step(*batch(s))
        assert (r.global_step, r.loss) == (s, ref_results[s - 1].loss)
    tensors_equal(job.state_dict(), ref_state)
    client.close()


def test_response_lost_in_a_restart(start_ampd, workdir):
    """A checkpoint without the last step's recorded response (one written
    before ampd kept it): resending that step says the batch trained but its
    answer is gone, and the job moves past it."""
    state_dir = os.path.join(workdir, "state")
    server = start_ampd("--state-dir=" + state_dir, "--checkpoint-every=1", "--checkpoint-sync")
    client = ampd.Client(server.address, timeout=10, retry_deadline=60)
    job = create(client)
    for s in range(1, 4):
        job.step(*batch(s))
    server.kill()
    files = [f for f in os.listdir(state_dir) if job.job_id in f and f.endswith(".safetensors")]
    assert len(files) == 1, os.listdir(state_dir)
    path = os.path.join(state_dir, files[0])
    checkpoint = safetensors.load_file(path)
    assert checkpoint.metadata.pop("ampd.last_report")
    safetensors.save_file(checkpoint, path)
    server.restart()

    job.next_sequence = 3  # as if step 3's answer never arrived
    try:
        job.step(*batch(3))
        raise AssertionError("a resent step without a recorded response succeeded")
    except ampd.StepResponseLost as e:
        assert e.sequence == 3 and e.expected_sequence == 4
    assert job.next_sequence == 4
    assert job.step(*batch(4)).global_step == 4
    client.close()


def test_deadline_exceeded_steps_are_resent_and_applied_once(server):
    """Every step is first sent with a deadline far under its time (1 ms), so
    that attempt and its quick resends of the same sequence all time out.
    Where the deadline found the step, the server either stopped it at a
    deadline check (nothing applied) or had already applied it (a resend then
    waits behind it and gets the recorded response). The same sequence is then
    resent with a patient deadline: either way it is applied exactly once, and
    the weights equal an uninterrupted run's bit for bit. The test does not
    depend on which of the two happened, nor on how slow the machine is."""
    model = ampd.Model([ampd.Linear(256, 512), ampd.ReLU(), ampd.Linear(512, 256)], loss="mse")
    rng = np.random.default_rng(3)
    batches = [(rng.standard_normal((512, 256)).astype(np.float32),
                rng.standard_normal((512, 256)).astype(np.float32)) for _ in range(8)]
    with ampd.Client(server.address) as patient, \
            ampd.Client(server.address, timeout=0.001, retry_deadline=0.05,
                        initial_backoff=0.001, max_backoff=0.01) as hasty:
        ref = patient.create_job(model=model, precision="fp32", seed=2)
        ref_losses = [ref.step(x, y).loss for x, y in batches]
        ref_state, ref_applied = ref.state_dict(), ref.refresh().applied_steps
        job = patient.create_job(model=model, precision="fp32", seed=2)
        hasty_job = hasty.job(job.job_id)
        losses = []
        for x, y in batches:
            sequence = job.next_sequence
            hasty_job.next_sequence = sequence
            # 1 MB of input and ~200 MFLOP: no attempt can finish in 1 ms.
            with pytest.raises(ampd.errors.DeadlineExceeded):
                hasty_job.step(x, y)
            assert hasty_job.next_sequence == sequence
            losses.append(job.step(x, y).loss)
            assert job.next_sequence == sequence + 1
        assert losses == ref_losses
        job.refresh()
        assert job.step_count == len(batches) and job.applied_steps == ref_applied
        tensors_equal(job.state_dict(), ref_state)


def test_backoff_survives_thousands_of_attempts():
    """A tiny deadline and a long retry_deadline reach attempt counts far past
    what 2**attempt as a float can hold; the backoff stays capped."""
    client = ampd.Client("127.0.0.1:1", initial_backoff=1e-9, max_backoff=1e-6)
    try:
        deadline = time.monotonic() + 60
        for attempt in (0, 1, 64, 1024, 10 ** 6):
            assert client._sleep_before_retry(attempt, deadline)
    finally:
        client.close()
