"""Job.evaluate and the optimizer's learning-rate schedule against a real ampd
over a socket: evaluate reports the loss the next step reports on the same
batches and changes nothing; warmup_cosine follows nanoGPT's get_lr over the
applied update count."""
import math

import numpy as np
import pytest

import ampd
from conftest import batch


def mlp():
    return ampd.Model([ampd.Linear(8, 32), ampd.ReLU(), ampd.Linear(32, 1)], loss="mse")


def get_lr(it, learning_rate, warmup_iters, lr_decay_iters, min_lr):
    """nanoGPT's train.py get_lr, as it is there."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    assert 0 <= decay_ratio <= 1
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)


def f32(v):
    return float(np.float32(v))


@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_evaluate_is_the_next_steps_loss_and_changes_nothing(server, precision):
    with ampd.Client(server.address) as client:
        job = client.create_job(model=mlp(), precision=precision, optimizer=ampd.AdamW(lr=1e-2),
                                scaler=ampd.Scaler(init_scale=2.0 ** 24) if precision == "fp16"
                                else None, seed=5)
        for s in range(1, 6):
            job.step(*batch(s))
        before = job.state_dict_bytes()
        job.refresh()
        step, scale = job.step_count, job.loss_scale
        r = job.evaluate(*batch(100))
        assert isinstance(r, ampd.EvaluateResult) and r.samples == 32 and r.seconds >= 0
        pair = [batch(101, n=5), batch(102)]
        two = job.evaluate(pair)
        assert two.samples == 37
        assert job.evaluate(micro_batches=pair).loss == two.loss
        assert job.state_dict_bytes() == before
        job.refresh()
        assert (job.step_count, job.loss_scale, job.next_sequence) == (step, scale, step + 1)
        assert job.step(*batch(100)).loss == r.loss
        again = job.evaluate(pair)
        assert job.step(pair).loss == again.loss

        with pytest.raises(TypeError, match="micro-batches"):
            job.evaluate([])
        with pytest.raises(ampd.InvalidArgument) as e:
            job.evaluate(*batch(1, features=3))
        assert "micro_batches[0].inputs" in e.value.message
        job.delete()
        with pytest.raises(ampd.JobNotFound):
            job.evaluate(*batch(1))


def test_warmup_cosine_follows_get_lr_over_applied_steps(server):
    with ampd.Client(server.address) as client:
        optimizer = ampd.AdamW(lr=1e-2, lr_schedule="warmup_cosine", warmup_steps=2,
                               decay_steps=6, min_lr=1e-3)
        job = client.create_job(model=mlp(), precision="fp16", optimizer=optimizer,
                                scaler=ampd.Scaler(init_scale=2.0 ** 24, growth_interval=1000),
                                seed=5)
        o = job.config.optimizer
        assert (o.warmup_steps, o.decay_steps) == (2, 6) and o.min_lr == f32(1e-3)
        skipped = 0
        for s in range(1, 16):
            r = job.step(*batch(s))
            applied_before = r.applied_steps - (0 if r.skipped else 1)
            assert r.learning_rate == f32(get_lr(applied_before, f32(1e-2), 2, 6, f32(1e-3))), s
            skipped += r.skipped
        assert skipped > 0, "an fp16 job at scale 2^24 must overflow at first"
        assert job.step(*batch(16), learning_rate=0.5).learning_rate == 0.5
        # Defaults: warmup 0, min_lr lr / 10.
        plain = client.create_job(model=mlp(), precision="fp32",
                                  optimizer=ampd.SGD(lr=0.1, lr_schedule="warmup_cosine",
                                                     decay_steps=10))
        assert plain.config.optimizer.warmup_steps == 0
        assert plain.config.optimizer.min_lr == f32(np.float32(0.1) / np.float32(10))
        assert plain.step(*batch(1)).learning_rate == f32(0.1)
        with pytest.raises(ampd.InvalidArgument) as e:
            client.create_job(model=mlp(), optimizer=ampd.AdamW(lr_schedule="warmup_cosine",
                                                                warmup_steps=5, decay_steps=5))
        assert "config.optimizer.decay_steps" in e.value.message
        with pytest.raises(ValueError, match="lr_schedule"):
            ampd.AdamW(lr_schedule="linear").to_proto()
