"""forward_backward + optim_step through the real ampd: several calls then
one update train exactly as one step() over the same micro-batches does
(fp32, bf16, fp16 through a skipped update; a full and a LoRA decoder; a
cispo update, its per-token losses too), optim_step's hyperparameters
against torch.optim.AdamW, and a SIGKILL between calls: the client learns
from AccumulationLost how many calls to resend, and nothing an update
applied is lost."""
import os

import numpy as np
import pytest

import ampd

VOCAB = 32
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             max_position_embeddings=16, num_attention_heads=4, num_key_value_heads=2,
             qkv_bias=True)


def micro_batches(update, k=4):
    rng = np.random.default_rng(300 + update)
    batches = []
    for i in range(k):
        ids = rng.integers(0, VOCAB, size=(2 + i % 2, 8), dtype=np.int64)
        targets = (3 * ids + 1) % VOCAB
        targets[:, -1] = -100
        batches.append((ids, targets))
    return batches


def create(client, precision, lora):
    scaler = ampd.Scaler(init_scale=2.0 ** 30, growth_interval=2) if precision == "fp16" else None
    return client.create_job(
        model=ampd.Decoder(lora=ampd.LoRA(rank=4, alpha=8.0) if lora else None, **SHAPE),
        precision=precision, optimizer=ampd.AdamW(lr=3e-3), scaler=scaler, seed=9)


def same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for name in sa:
        assert sa[name].tobytes() == sb[name].tobytes(), name


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_calls_then_optim_step_equal_one_step_bit_for_bit(server, precision, lora):
    client = ampd.Client(server.address)
    fused, split = create(client, precision, lora), create(client, precision, lora)
    skipped = applied = 0
    for update in range(40 if precision == "fp16" else 3):
        batches = micro_batches(update)
        a = fused.step(micro_batches=batches, loss_fn="cross_entropy")
        losses = []
        # Calls of 1, 2 and 1 micro-batches.
        for part in (batches[:1], batches[1:3], batches[3:]):
            r = split.forward_backward(micro_batches=part, loss_fn="cross_entropy")
            assert r.loss_scale == a.scale_before
            losses.append(r.loss)
        assert split.pending == 3
        b = split.optim_step()
        assert split.pending == 0
        assert (b.global_step, b.applied_steps, b.skipped) == (a.global_step, a.applied_steps,
                                                               a.skipped)
        assert (b.scale_before, b.scale_after, b.grad_norm) == (a.scale_before, a.scale_after,
                                                                a.grad_norm)
        assert np.float32(b.loss).tobytes() == np.float32(a.loss).tobytes()
        if not a.skipped:
            assert sum(losses) == pytest.approx(a.loss, rel=1e-5)
        same_state(fused, split)
        skipped += a.skipped
        applied += not a.skipped
        if precision == "fp16" and skipped and applied >= 2:
            break
    if precision == "fp16":
        assert skipped > 0 and applied >= 2


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cispo_calls_then_optim_step_equal_one_cispo_step_bit_for_bit(server, precision):
    """cispo with its clip range through forward_backward: each call's
    per-token log-probs and losses are the Step's for those micro-batches,
    and the update leaves the job exactly as the Step does."""
    client = ampd.Client(server.address)
    fused, split = create(client, precision, False), create(client, precision, False)
    for update in range(2):
        batches = micro_batches(update)
        rng = np.random.default_rng(400 + update)
        # Sampling log-probs near the model's (about -log V) and advantages
        # of both signs: ratios on both sides of the clip range.
        sampling = [(rng.uniform(-1.0, 1.0, size=y.shape) - np.log(VOCAB)).astype(np.float32)
                    for _, y in batches]
        advantages = [rng.normal(size=y.shape).astype(np.float32) for _, y in batches]
        loss = dict(loss_fn="cispo", cispo_clip=(0.9, 1.5), return_logprobs=True)
        a = fused.step(micro_batches=batches, advantages=advantages,
                       sampling_logprobs=sampling, **loss)
        token_losses, logprobs, losses = [], [], []
        for lo, hi in ((0, 1), (1, 3), (3, 4)):
            r = split.forward_backward(micro_batches=batches[lo:hi],
                                       advantages=advantages[lo:hi],
                                       sampling_logprobs=sampling[lo:hi], **loss)
            assert len(r.token_losses) == hi - lo
            token_losses += r.token_losses
            logprobs += r.logprobs
            losses.append(r.loss)
        b = split.optim_step()
        assert not a.skipped and not b.skipped
        assert (b.scale_after, b.grad_norm) == (a.scale_after, a.grad_norm)
        assert np.float32(b.loss).tobytes() == np.float32(a.loss).tobytes()
        assert sum(losses) == pytest.approx(a.loss, rel=1e-5, abs=1e-5)
        for ours, theirs in zip(token_losses + logprobs, a.token_losses + a.logprobs):
            assert ours.tobytes() == theirs.tobytes()
        same_state(fused, split)
    # A parameter cispo does not read is refused naming it; nothing accumulates.
    with pytest.raises(ampd.InvalidArgument) as refused:
        split.forward_backward(*batches[0], loss_fn="cispo", advantages=advantages[0],
                               sampling_logprobs=sampling[0], dro_beta=0.05)
    assert refused.value.field == "dro_beta"
    assert split.pending == 0


def test_optim_step_hyperparameters_match_torch_adamw(server):
    torch = pytest.importorskip("torch", reason="the reference is torch.optim.AdamW")
    client = ampd.Client(server.address)
    job = client.create_job(
        model=ampd.Model([ampd.Linear(8, 16), ampd.Tanh(), ampd.Linear(16, 2)], loss="mse"),
        precision="fp32", optimizer=ampd.AdamW(), seed=4)
    state = job.state_dict()
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    with torch.no_grad():
        for name, p in net.named_parameters():
            p.copy_(torch.from_numpy(state["model." + name]))
    hyper = [dict(lr=2e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, max_grad_norm=0.5),
             dict(lr=5e-3, betas=(0.5, 0.9), eps=1e-4, weight_decay=0.0, max_grad_norm=0.0),
             dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.3, max_grad_norm=10.0)]
    # One torch optimizer whose param group takes each update's values (its
    # step count and moments carry over, as the job's do).
    opt = torch.optim.AdamW(net.parameters())
    rng = np.random.default_rng(5)
    for h in hyper:
        parts = [(rng.standard_normal((6, 8)).astype(np.float32),
                  rng.standard_normal((6, 2)).astype(np.float32)) for _ in range(3)]
        for x, y in parts:
            job.forward_backward(x, y, micro_batches_in_update=len(parts))
        r = job.optim_step(**h)
        assert r.learning_rate == np.float32(h["lr"]) and not r.skipped
        opt.zero_grad()
        for x, y in parts:
            loss = torch.nn.functional.mse_loss(net(torch.from_numpy(x)), torch.from_numpy(y))
            (loss / len(parts)).backward()
        if h["max_grad_norm"] > 0:
            torch.nn.utils.clip_grad_norm_(net.parameters(), h["max_grad_norm"])
        for group in opt.param_groups:
            group.update(lr=h["lr"], betas=h["betas"], eps=h["eps"],
                         weight_decay=h["weight_decay"])
        opt.step()
        got = job.state_dict()
        for name, p in net.named_parameters():
            np.testing.assert_allclose(got["model." + name], p.detach().numpy(), rtol=0,
                                       atol=1e-6, err_msg=name)
    # The job's own hyperparameters are untouched: the next update uses them.
    x, y = rng.standard_normal((6, 8)).astype(np.float32), rng.standard_normal((6, 2)).astype(
        np.float32)
    job.forward_backward(x, y)
    assert job.optim_step().learning_rate == np.float32(1e-3)


def test_sigkill_between_calls_names_the_calls_to_resend(start_ampd, workdir):
    server = start_ampd("--state-dir=" + os.path.join(workdir, "state"), "--checkpoint-every=1",
                        "--checkpoint-sync")
    client = ampd.Client(server.address, retry_deadline=60)
    job = create(client, "fp32", False)
    reference = create(client, "fp32", False)
    # One applied update, on disk before it was acknowledged.
    for j in (job, reference):
        for part in micro_batches(0)[:2]:
            j.forward_backward(*part, loss_fn="cross_entropy")
        j.optim_step()
    applied = job.state_dict()
    batches = micro_batches(1)
    job.forward_backward(*batches[0], loss_fn="cross_entropy")
    job.forward_backward(*batches[1], loss_fn="cross_entropy")
    server.kill()
    server.restart()
    # The third call counts on two the server no longer holds.
    with pytest.raises(ampd.AccumulationLost) as e:
        job.forward_backward(*batches[2], loss_fn="cross_entropy")
    assert e.value.pending_lost == 2 and e.value.expected_index == 1
    assert e.value.reason == "ACCUMULATION_LOST"
    assert job.pending == 0
    # Nothing applied was lost: the update before the kill is all there.
    restored = job.state_dict()
    for name in applied:
        assert restored[name].tobytes() == applied[name].tobytes(), name
    # An OptimStep for calls the server lost is refused the same way.
    job.pending = 2
    with pytest.raises(ampd.AccumulationLost) as e:
        job.optim_step()
    assert e.value.pending_lost == 2
    assert job.refresh().applied_steps == 1
    # Resent, the update is the one the reference makes without a restart.
    for j in (job, reference):
        for part in batches[:3]:
            j.forward_backward(*part, loss_fn="cross_entropy")
        j.optim_step()
    same_state(job, reference)


def test_retries_replay_and_misuse_is_refused(server):
    client = ampd.Client(server.address)
    job = create(client, "fp32", False)
    batches = micro_batches(0)
    # Calls accumulate in index order: on a job that dropped nothing, a call
    # ahead of the next index arrived early (SEQUENCE_MISMATCH), not lost.
    job.pending = 2
    with pytest.raises(ampd.SequenceMismatch) as e:
        job.forward_backward(*batches[0], loss_fn="cross_entropy")
    assert not isinstance(e.value, ampd.AccumulationLost)
    assert e.value.metadata["expected_index"] == "1"
    job.pending = 0
    first = job.forward_backward(*batches[0], loss_fn="cross_entropy", return_logprobs=True)
    # A resent call (the same sequence and index) gets its recorded answer
    # and accumulates nothing more.
    job.pending = 0
    again = job.forward_backward(*batches[0], loss_fn="cross_entropy", return_logprobs=True)
    assert again.pending == 1 and again.loss == first.loss
    assert again.logprobs[0].tobytes() == first.logprobs[0].tobytes()
    # A Step would drop the accumulated gradients: refused.
    with pytest.raises(ampd.AccumulationPending) as e:
        job.step(*batches[1], loss_fn="cross_entropy")
    assert e.value.pending == 1
    job.refresh()
    r = job.optim_step(lr=1e-3)
    # A resent OptimStep gets the recorded response (Step's rule).
    job.next_sequence -= 1
    job.pending = 1
    assert job.optim_step(lr=1e-3) == r
    # Nothing accumulated: refused, nothing applied.
    with pytest.raises(ampd.InvalidArgument):
        job.optim_step()
    assert job.refresh().applied_steps == 1
    # betas belong to Adam and AdamW.
    sgd = client.create_job(model=ampd.Decoder(**SHAPE), precision="fp32", optimizer=ampd.SGD())
    sgd.forward_backward(*batches[0], loss_fn="cross_entropy")
    with pytest.raises(ampd.InvalidArgument):
        sgd.optim_step(betas=(0.9, 0.99))
    assert sgd.optim_step(weight_decay=0.01).applied_steps == 1
