"""The ampd package against a real ampd over a socket: training, loss scaling,
state dicts and safetensors round trips, listing and deleting, typed errors."""
import math
import os

import numpy as np
import pytest

import ampd
from ampd import safetensors
from conftest import batch


def mlp(hidden=32):
    return ampd.Model([ampd.Linear(8, hidden), ampd.ReLU(), ampd.Linear(hidden, 1)], loss="mse")


def create(client, **kw):
    kw.setdefault("model", mlp())
    kw.setdefault("precision", "fp16")
    kw.setdefault("optimizer", ampd.AdamW(lr=1e-2))
    kw.setdefault("seed", 3)
    return client.create_job(**kw)


def test_trains_with_dynamic_loss_scaling(server):
    with ampd.Client(server.address) as client:
        job = create(client, scaler=ampd.Scaler(policy="pytorch", init_scale=2.0 ** 24,
                                                growth_interval=5))
        assert job.config.scaler.growth_interval == 5
        assert job.config.optimizer.beta2 == pytest.approx(0.999)  # effective defaults
        assert job.next_sequence == 1 and job.loss_scale == 2.0 ** 24
        results = [job.step(*batch(s)) for s in range(1, 41)]
        assert [r.global_step for r in results] == list(range(1, 41))
        skipped = [r for r in results if r.skipped]
        assert skipped, "an fp16 job at scale 2^24 must overflow at first"
        for r in skipped:
            assert r.found_inf and r.scale_backed_off and r.scale_after == r.scale_before / 2
            assert r.grad_norm is None
        grew = [r for r in results if r.scale_grew]
        assert grew and all(r.scale_after == 2 * r.scale_before for r in grew)
        applied = [r for r in results if not r.skipped]
        assert all(r.grad_norm is not None and math.isfinite(r.grad_norm) for r in applied)
        assert results[-1].applied_steps == len(applied)
        assert np.mean([r.loss for r in applied[-5:]]) < 0.5 * np.mean([r.loss for r in applied[:5]])
        assert results[-1].samples == 32 and results[-1].timings.total_seconds > 0

        # A non-finite batch is an overflow, not an error: skipped, scale halved.
        x, y = batch(41)
        x[0, 0] = np.inf
        r = job.step(x, y)
        assert r.skipped and r.found_inf and r.scale_after == r.scale_before / 2
        job.refresh()
        assert job.step_count == 41 and job.next_sequence == 42
        assert job.applied_steps == len(applied) and job.loss_scale == r.scale_after


def test_per_layer_scales_one_per_gpt_block(server):
    # Adaptive per-layer scales on a GPT: one scale per block in every
    # StepResult and on the Job, GetJob's the last step's.
    gpt = ampd.GPT(vocab_size=32, context_length=8, d_model=16, n_layer=3, n_head=2)
    with ampd.Client(server.address) as client:
        job = client.create_job(model=gpt, precision="fp16", seed=5,
                                scaler=ampd.Scaler(policy="adaptive", per_layer_scales=True))
        assert job.config.scaler.per_layer_scales
        rng = np.random.default_rng(9)
        results = []
        for _ in range(6):
            ids = rng.integers(0, 32, size=(4, 8), dtype=np.int64)
            results.append(job.step(ids, (ids + 1) % 32))
        assert all(len(r.layer_scales_after) == 3 for r in results)
        assert not any(r.skipped for r in results)
        assert results[-1].layer_scales_after[-1] == results[-1].scale_after
        assert job.layer_scales == list(results[-1].layer_scales_after)
        job.refresh()
        assert job.layer_scales == list(results[-1].layer_scales_after)
        assert job.loss_scale == results[-1].scale_after


def test_micro_batches_float64_and_learning_rate(server):
    with ampd.Client(server.address) as client:
        job = create(client, precision="fp32")
        (x1, y1), (x2, y2) = batch(1), batch(2)
        r = job.step([(x1, y1), (x2, y2)])
        assert r.samples == 64 and r.global_step == 1
        # float64 arrays (NumPy's default) travel as float32: the same step as
        # float32 arrays on a twin job.
        twin = create(client, precision="fp32")
        r64 = twin.step(micro_batches=[(x1.astype(np.float64), y1.astype(np.float64)), (x2, y2)])
        assert r64.loss == r.loss
        assert job.step(*batch(3), learning_rate=0.0).applied_steps == 2
        with pytest.raises(TypeError, match="unsupported dtype"):
            job.step(x1.astype(np.uint8), y1)
        for bad in ((x1,), ([],), ([(x1, y1, y1)],), ((x1, y1),)):
            with pytest.raises(TypeError, match="micro-batches"):
                job.step(*bad)
        assert job.next_sequence == 3


def test_state_dict_round_trip(server, workdir):
    with ampd.Client(server.address) as client:
        job = create(client, scaler=ampd.Scaler(policy="deepspeed", min_scale=1.0,
                                                growth_interval=4, hysteresis=2))
        for s in range(1, 11):
            job.step(*batch(s))
        state = job.state_dict()
        assert isinstance(state, ampd.StateDict)
        assert set(state) >= {"model.0.weight", "model.0.bias", "model.2.weight", "model.2.bias",
                              "optimizer.model.0.weight.exp_avg"}
        assert state["model.0.weight"].shape == (32, 8) and state["model.0.weight"].dtype == np.float32
        assert state.metadata["ampd.step"] == "10"
        assert any(k.startswith("scaler.") for k in state.metadata)

        path = job.export(os.path.join(workdir, "state.safetensors"))
        exported = safetensors.load_file(path)
        with open(path, "rb") as f:
            assert safetensors.dumps(exported) == f.read()  # the codec reproduces the file

        # Train on, then load the export: the state is the exported one again.
        for s in range(11, 16):
            job.step(*batch(s))
        assert not np.array_equal(job.state_dict()["model.0.weight"], state["model.0.weight"])
        job.load(path)
        # LoadStateDict replaces the state, not the job's place in its
        # sequence: the step count (and so the next sequence) carries on.
        assert job.step_count == 15 and job.next_sequence == 16
        again = job.state_dict()
        assert set(again) == set(state)
        for name in state:
            assert np.array_equal(again[name], state[name]), name
        for key, value in state.metadata.items():
            if not key.startswith("ampd."):
                assert again.metadata[key] == value, key

        # Loaded into a second job of the same config, it trains identically.
        other = create(client, seed=99, scaler=ampd.Scaler(policy="deepspeed", min_scale=1.0,
                                                           growth_interval=4, hysteresis=2))
        other.load_state_dict(state)
        assert other.next_sequence == 1
        a, b = job.step(*batch(11)), other.step(*batch(11))
        assert (a.loss, a.scale_after, a.growth_tracker) == (b.loss, b.scale_after, b.growth_tracker)
        mine, theirs = job.state_dict(), other.state_dict()
        for name in mine:
            assert np.array_equal(mine[name], theirs[name]), name


def test_jobs_list_get_delete(server):
    with ampd.Client(server.address) as client:
        made = [create(client, display_name="j%d" % i) for i in range(3)]
        listed = client.jobs(page_size=2)  # two pages
        assert sorted(j.job_id for j in made) == [j.job_id for j in listed]
        made[0].step(*batch(1))
        again = client.job(made[0].job_id)
        assert again.step_count == 1 and again.next_sequence == 2
        made[1].delete()
        assert [j.job_id for j in client.jobs()] == sorted([made[0].job_id, made[2].job_id])
        with pytest.raises(ampd.JobNotFound) as e:
            made[1].refresh()
        assert e.value.code.name == "NOT_FOUND" and e.value.reason == "JOB_NOT_FOUND"
        assert e.value.job_id == made[1].job_id


def test_create_with_request_id_is_idempotent(server):
    with ampd.Client(server.address) as client:
        a = create(client, request_id="train-42")
        b = create(client, request_id="train-42")
        assert a.job_id == b.job_id and len(client.jobs()) == 1


def test_typed_errors(server):
    with ampd.Client(server.address) as client:
        with pytest.raises(ampd.InvalidField) as e:
            create(client, optimizer=ampd.AdamW(lr=float("nan")))
        assert isinstance(e.value, ampd.InvalidArgument) and isinstance(e.value, ampd.AmpdError)
        assert e.value.code.name == "INVALID_ARGUMENT" and e.value.reason == "INVALID_FIELD"
        assert e.value.field == "config.optimizer.lr" and e.value.domain == "ampd"
        assert "INVALID_FIELD field=config.optimizer.lr" in str(e.value)

        job = create(client)
        x, y = batch(1)
        with pytest.raises(ampd.InvalidField) as e:
            job.step(x[:, :5], y)
        assert e.value.field.startswith("micro_batches[0].inputs")
        assert job.next_sequence == 1  # a refused step keeps the sequence

        for s in range(1, 4):
            job.step(*batch(s))
        # A stale sequence (another client ahead of this one): SequenceMismatch,
        # and the Job follows the server.
        stale = client.job(job.job_id)
        job.step(*batch(4))
        job.step(*batch(5))
        with pytest.raises(ampd.SequenceMismatch) as e:
            stale.step(*batch(4))
        assert not isinstance(e.value, ampd.StepsLost)
        assert e.value.reason == "SEQUENCE_MISMATCH" and e.value.expected_sequence == 6
        assert stale.next_sequence == 6

        # Resending the last applied sequence returns the recorded response
        # without training again.
        before = job.state_dict_bytes()
        job.next_sequence = 5
        assert job.step(*batch(5)).global_step == 5 and job.refresh().step_count == 5
        assert job.state_dict_bytes() == before

        with pytest.raises(ampd.InvalidStateDict) as e:
            job.load_state_dict_bytes(b"not a safetensors file")
        assert e.value.reason == "INVALID_STATE_DICT"
        state = job.state_dict()
        del state["model.2.bias"]
        with pytest.raises(ampd.InvalidStateDict):
            job.load_state_dict(state)

        with pytest.raises(ampd.JobNotFound):
            client.job("no-such-job")
        with pytest.raises(ValueError, match="precision"):
            create(client, precision="fp8")


def test_resource_limits(start_ampd):
    server = start_ampd("--max-jobs=1")
    with ampd.Client(server.address) as client:
        create(client)
        with pytest.raises(ampd.JobLimit) as e:
            create(client)
        assert isinstance(e.value, ampd.ResourceExhausted)
        assert e.value.code.name == "RESOURCE_EXHAUSTED" and e.value.metadata["max_jobs"] == "1"


def test_failed_job_and_recovery(server):
    with ampd.Client(server.address) as client:
        job = create(client, scaler=ampd.Scaler(policy="deepspeed", init_scale=4.0, min_scale=2.0,
                                                hysteresis=1, raise_at_min_scale=True))
        good = job.state_dict()
        x, y = batch(1)
        x[0, 0] = np.inf
        with pytest.raises(ampd.JobFailed):
            for _ in range(4):
                job.step(x, y)
        job.refresh()
        assert job.state == "failed" and job.failure
        with pytest.raises(ampd.JobFailed) as e:
            job.step(*batch(2))
        assert e.value.reason == "JOB_FAILED" and e.value.job_id == job.job_id
        job.load_state_dict(good)
        assert job.state == "active" and job.next_sequence == job.step_count + 1
        r = job.step(*batch(2))
        assert r.global_step == job.next_sequence - 1 and not r.skipped


def test_unreachable_server_is_unavailable_after_the_retry_deadline():
    client = ampd.Client("127.0.0.1:1", timeout=1, retry_deadline=0.5)
    with pytest.raises(ampd.Unavailable) as e:
        client.jobs()
    assert e.value.code.name == "UNAVAILABLE" and e.value.reason == ""
