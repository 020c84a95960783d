"""ampd.DataParallelJob against two real replicas over Gloo on loopback: the
same losses, skips and scales as one ampd training each batch as two
micro-batches, and a replica SIGKILLed and restarted mid-run rejoining with
every step applied once."""
import threading
import time

import numpy as np
import pytest

import ampd
from conftest import batch


MODEL = ampd.Model([ampd.Linear(8, 32), ampd.ReLU(), ampd.Linear(32, 1)], loss="mse")


def replicas(start_ampd, workdir, n, *flags):
    servers = []
    for r in range(n):
        # Port 0: the kernel picks it and ampd reports it ("ampd: peers on").
        server = start_ampd("--peer-address=127.0.0.1:0",
                            "--state-dir=%s/state%d" % (workdir, r), *flags)
        server.peer = "127.0.0.1:%d" % server.peer_port
        servers.append(server)
    return servers


def alone_run(start_ampd, steps, scale):
    server = start_ampd()
    job = ampd.Client(server.address).create_job(model=MODEL, precision="fp16", seed=3)
    out = []
    for i in range(1, steps + 1):
        x, y = batch(i, scale=scale)
        out.append(job.step(micro_batches=[(x[:16], y[:16]), (x[16:], y[16:])]))
    return out


def expect_same(alone, group):
    assert len(alone) == len(group)
    for a, g in zip(alone, group):
        assert g.skipped == a.skipped
        assert g.scale_after == a.scale_after
        if np.isnan(a.loss):
            assert np.isnan(g.loss)
        else:
            assert g.loss == pytest.approx(a.loss, rel=2e-3, abs=1e-6)


def test_two_ranks_train_like_one_process(start_ampd, workdir):
    steps = 40
    alone = alone_run(start_ampd, steps, scale=300.0)
    servers = replicas(start_ampd, workdir, 2)
    job = ampd.DataParallelJob.create([s.address for s in servers], servers[0].peer,
                                      model=MODEL, precision="fp16", seed=3, timeout_ms=5000)
    group = [job.step(*batch(i, scale=300.0)) for i in range(1, steps + 1)]
    expect_same(alone, group)
    assert sum(r.skipped for r in group) >= 2  # fp16's opening backoffs, on both


def test_a_killed_replica_rejoins_and_nothing_is_lost(start_ampd, workdir):
    steps, kill_after = 30, 12
    alone = alone_run(start_ampd, steps, scale=300.0)
    servers = replicas(start_ampd, workdir, 2, "--checkpoint-every=5")
    job = ampd.DataParallelJob.create([s.address for s in servers], servers[0].peer,
                                      model=MODEL, precision="fp16", seed=3, timeout_ms=3000)
    group = []
    for i in range(1, steps + 1):
        if i == kill_after + 1:
            servers[1].kill()
            # This step goes out while the replica is still starting again,
            # and is resent until it is back.
            threading.Thread(target=servers[1].restart).start()
        group.append(job.step(*batch(i, scale=300.0)))
    expect_same(alone, group)
    servers[1].wait_for_log("copied the state of rank 0")
    states = [ampd.Client(s.address).job(j.job_id).state_dict()
              for s, j in zip(servers, job.jobs)]
    assert states[0].metadata["ampd.step"] == str(steps)
    assert set(states[0]) == set(states[1])
    for name in states[0]:
        np.testing.assert_array_equal(states[0][name], states[1][name])


def test_rows_that_do_not_split_are_refused_before_sending(start_ampd, workdir):
    servers = replicas(start_ampd, workdir, 2)
    job = ampd.DataParallelJob.create([s.address for s in servers], servers[0].peer,
                                      model=MODEL, precision="fp32", timeout_ms=3000)
    x, y = batch(1, n=33)
    with pytest.raises(ValueError, match="do not split"):
        job.step(x, y)
    assert job.step(*batch(1)).loss > 0


GPT = ampd.GPT(vocab_size=32, context_length=16, d_model=32, n_layer=2, n_head=4)


def token_batch(i, loss_fn):
    """Step i's (4, 16) batch and the per-token arrays loss_fn reads."""
    rng = np.random.default_rng(100 + i)
    ids = rng.integers(0, 32, size=(4, 16)).astype(np.int32)
    targets = rng.integers(0, 32, size=(4, 16)).astype(np.int32)
    targets[:, ::5] = -100
    extra = {"loss_fn": loss_fn}
    if loss_fn == "cross_entropy":
        extra["weights"] = rng.uniform(0, 2, size=(4, 16)).astype(np.float32)
    else:
        extra["advantages"] = rng.uniform(-1, 1, size=(4, 16)).astype(np.float32)
        # Near the model's log-probs (about -ln 32): PPO clips on both sides.
        extra["sampling_logprobs"] = rng.uniform(-3.9, -3.0, size=(4, 16)).astype(np.float32)
        if loss_fn == "ppo":
            extra["ppo_clip"] = (0.9, 1.1)
    return ids, targets, extra


def test_token_losses_on_two_ranks_sum_over_both_like_one_process(start_ampd, workdir):
    """Each step's loss is the sum over both ranks' tokens, reported alike by
    both; fp32 weights agree with one process on both halves to float
    rounding (the same gradient terms, summed per rank first)."""
    losses = ["cross_entropy", "importance_sampling", "ppo"] * 2
    # Plain SGD: equal weights say equal gradients (Adam would turn the
    # rounding noise of a gradient that is zero exactly, attention's key
    # bias, into lr-sized steps).
    sgd = ampd.SGD(lr=0.02)
    alone_job = ampd.Client(start_ampd().address).create_job(model=GPT, precision="fp32",
                                                             seed=5, optimizer=sgd)
    alone = []
    for i, loss_fn in enumerate(losses, start=1):
        ids, targets, extra = token_batch(i, loss_fn)
        per_token = {k: [v[:2], v[2:]] for k, v in extra.items()
                     if k in ("weights", "advantages", "sampling_logprobs")}
        rest = {k: v for k, v in extra.items() if k not in per_token}
        alone.append(alone_job.step(micro_batches=[(ids[:2], targets[:2]), (ids[2:], targets[2:])],
                                    **per_token, **rest))
    servers = replicas(start_ampd, workdir, 2)
    job = ampd.DataParallelJob.create([s.address for s in servers], servers[0].peer,
                                      model=GPT, precision="fp32", seed=5, optimizer=sgd,
                                      timeout_ms=5000)
    group = []
    for i, loss_fn in enumerate(losses, start=1):
        ids, targets, extra = token_batch(i, loss_fn)
        group.append(job.step(ids, targets, **extra))
    assert group[0].loss == alone[0].loss  # before any update: the same two sums added
    for a, g in zip(alone, group):
        assert not g.skipped
        assert g.loss == pytest.approx(a.loss, rel=1e-5)
    mine = ampd.Client(servers[0].address).job(job.jobs[0].job_id).state_dict()
    reference = alone_job.state_dict()
    assert set(mine) == set(reference)
    for name, value in reference.items():
        np.testing.assert_allclose(mine[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
