"""A language model's token losses (Step's loss_fn) through the real ampd
against a hand-written PyTorch version of Tinker's definitions, in fp32.

The job's initial weights load into bench/pytorch/gpt.py's GPT (or
bench/pytorch/decoder.py's Qwen2-style decoder); then each
loss (cross_entropy with per-token weights, importance_sampling, ppo with a
clip range that some ratios leave) trains 4 plain-SGD steps on both sides.
SGD moves the weights by lr times the gradient, so equal weights after the
steps say the gradients were equal, and each step's reported loss must be
PyTorch's sum over the target tokens to 1e-5 relative. Also: a sum over two
micro-batches is the sum over one batch of both, and the refusals name the
field. Skipped, saying so, where torch is not importable."""
import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not importable: the token-loss "
                                           "conformance tests compare ampd with PyTorch")
import torch.nn.functional as F  # noqa: E402

import ampd  # noqa: E402
import ampd.torch as ampd_torch  # noqa: E402

sys.path.insert(0, os.path.join(os.environ["AMPD_SOURCE_DIR"], "bench", "pytorch"))
import decoder as torch_decoder  # noqa: E402  (bench/pytorch/decoder.py)
import gpt as torch_gpt  # noqa: E402  (bench/pytorch/gpt.py)

VOCAB, CONTEXT, D_MODEL, N_LAYER, N_HEAD = 48, 12, 32, 2, 2
SPEC = ampd.GPT(vocab_size=VOCAB, context_length=CONTEXT, d_model=D_MODEL, n_layer=N_LAYER,
                n_head=N_HEAD)
# A Qwen2-style decoder: grouped K/V heads, q/k/v biases, untied.
DECODER = ampd.Decoder(vocab_size=VOCAB, hidden_size=D_MODEL, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=CONTEXT, qkv_bias=True)


def models(kind):
    """ampd's spec, a PyTorch peer factory and the exporter, per model kind."""
    if kind == "gpt":
        return (SPEC, lambda: torch_gpt.GPT(VOCAB, CONTEXT, D_MODEL, N_LAYER, N_HEAD,
                                            attention="manual"), ampd_torch.gpt2_state_dict)
    return (DECODER, lambda: torch_decoder.Decoder(VOCAB, D_MODEL, 64, 2, 4, 2,
                                                   max_position_embeddings=CONTEXT,
                                                   qkv_bias=True, attention="manual"),
            ampd_torch.decoder_state_dict)
LR = 0.05
CLIP = (0.9, 1.1)


def torch_token_loss(model, ids, targets, loss_fn, weights, advantages, sampling):
    """Tinker's definitions, summed over the target tokens (-100 adds nothing)."""
    logits = model.logits(torch.from_numpy(ids)).float()
    targets = torch.from_numpy(targets)
    keep = targets != -100
    logp = F.log_softmax(logits, dim=-1).gather(-1, targets.clamp(min=0).unsqueeze(-1))
    logp = logp.squeeze(-1)
    if loss_fn == "cross_entropy":
        term = -torch.from_numpy(weights) * logp
    else:
        ratio = torch.exp(logp - torch.from_numpy(sampling))
        a = torch.from_numpy(advantages)
        if loss_fn == "importance_sampling":
            term = -ratio * a
        else:
            term = -torch.minimum(ratio * a, torch.clamp(ratio, *CLIP) * a)
    return (term * keep).sum(), logp.detach()


def batch(step, size=3):
    rng = np.random.default_rng(900 + step)
    ids = rng.integers(0, VOCAB, size=(size, CONTEXT), dtype=np.int64)
    targets = (3 * ids + 1) % VOCAB
    targets[rng.random(targets.shape) < 0.15] = -100
    weights = rng.uniform(0.0, 2.0, size=ids.shape).astype(np.float32)
    advantages = rng.uniform(-1.0, 1.0, size=ids.shape).astype(np.float32)
    return ids, targets, weights, advantages, rng


@pytest.mark.parametrize("kind", ["gpt", "decoder"])
@pytest.mark.parametrize("loss_fn", ["cross_entropy", "importance_sampling", "ppo"])
def test_token_loss_and_gradients_equal_pytorch(server, loss_fn, kind):
    spec, peer, export = models(kind)
    with ampd.Client(server.address) as client:
        job = client.create_job(model=spec, precision="fp32", seed=4,
                                optimizer=ampd.SGD(lr=LR))
        model = peer()
        model.load_state_dict(export(job), strict=True)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        for step in range(4):
            ids, targets, weights, advantages, rng = batch(step)
            # The sampler's log-probs: the model's own, moved by up to 0.3,
            # so PPO's ratios straddle its clip range.
            with torch.no_grad():
                _, logp = torch_token_loss(model, ids, targets, "cross_entropy", weights,
                                           None, None)
            sampling = (logp.numpy() + rng.uniform(-0.3, 0.3, size=ids.shape)).astype(np.float32)
            kwargs = {"loss_fn": loss_fn}
            if loss_fn == "cross_entropy":
                kwargs["weights"] = weights
            else:
                kwargs.update(advantages=advantages, sampling_logprobs=sampling)
            if loss_fn == "ppo":
                kwargs["ppo_clip"] = CLIP
            result = job.step(ids, targets, return_logprobs=True, **kwargs)
            ours = result.loss
            opt.zero_grad()
            theirs, their_logp = torch_token_loss(model, ids, targets, loss_fn, weights,
                                                  advantages, sampling)
            theirs.backward()
            opt.step()
            assert ours == pytest.approx(theirs.item(), rel=1e-5, abs=1e-5), \
                "step %d: ampd %r, PyTorch %r" % (step + 1, ours, theirs.item())
            # The step's own log-probs: PyTorch's before the update, 0 where ignored.
            keep = targets != -100
            (logp,) = result.logprobs
            assert logp.shape == targets.shape and np.all(logp[~keep] == 0)
            np.testing.assert_allclose(logp[keep], their_logp.numpy()[keep], rtol=1e-5,
                                       atol=1e-5)
            if loss_fn == "cross_entropy":
                assert result.ratios is None and result.logprob_mismatch is None
            else:
                (ratio,) = result.ratios
                np.testing.assert_allclose(ratio[keep], np.exp(logp - sampling)[keep], rtol=1e-6)
                assert np.all(ratio[~keep] == 0)
                # fp32 subtraction and max are exact: the same value, bit for bit.
                assert result.logprob_mismatch == np.max(np.abs(logp - sampling)[keep])
                assert result.logprob_mismatch > 0.0
        # Elementwise within 1e-4 of the tensor's own scale: a weight that
        # four updates brought near zero keeps the absolute rounding of the
        # sums that moved it (the decoder's embedding measured 1.8e-5 apart
        # on an element of 2e-3 in a tensor of 1.56, with OpenBLAS's Haswell
        # kernels; 1.2e-5 of its scale), which no fixed atol fits.
        final = export(job)
        for name, value in model.state_dict().items():
            scale = float(value.abs().max())
            assert torch.allclose(final[name], value, rtol=1e-4, atol=1e-4 * scale), name


def test_a_sum_over_micro_batches_is_the_sum_over_one_batch(server):
    ids, targets, weights, _, _ = batch(7, size=4)
    with ampd.Client(server.address) as client:
        whole = client.create_job(model=SPEC, precision="fp32", seed=5)
        split = client.create_job(model=SPEC, precision="fp32", seed=5)
        one = whole.step(ids, targets, loss_fn="cross_entropy", weights=weights).loss
        two = split.step(micro_batches=[(ids[:2], targets[:2]), (ids[2:], targets[2:])],
                         loss_fn="cross_entropy", weights=[weights[:2], weights[2:]]).loss
        assert two == pytest.approx(one, rel=1e-5)
        # Weights of 1 are the sum of the mean loss's terms.
        mean = client.create_job(model=SPEC, precision="fp32", seed=5).step(ids, targets).loss
        summed = client.create_job(model=SPEC, precision="fp32", seed=5).step(
            ids, targets, loss_fn="cross_entropy").loss
        assert summed == pytest.approx(mean * np.count_nonzero(targets != -100), rel=1e-5)


def test_token_losses_refuse_naming_the_field(server):
    ids, targets, weights, advantages, _ = batch(0)
    with ampd.Client(server.address) as client:
        job = client.create_job(model=SPEC, precision="fp32")
        with pytest.raises(ampd.InvalidArgument, match="advantages"):
            job.step(ids, targets, loss_fn="ppo", sampling_logprobs=weights)
        with pytest.raises(ampd.InvalidArgument, match="weights"):
            job.step(ids, targets, loss_fn="importance_sampling", advantages=advantages,
                     sampling_logprobs=weights, weights=weights)
        with pytest.raises(ampd.InvalidArgument, match="weights"):
            job.step(ids, targets, weights=weights)  # the model's own loss reads none
        with pytest.raises(ampd.InvalidArgument, match="sampling_logprobs"):
            job.step(ids, targets, loss_fn="ppo", advantages=advantages,
                     sampling_logprobs=weights[:, :3])
        bad = weights.copy()
        bad[1, 2] = np.nan
        with pytest.raises(ampd.InvalidArgument, match="weights"):
            job.step(ids, targets, loss_fn="cross_entropy", weights=bad)
        # Each bound of the clip range is named on its own.
        for clip, field in (((1.2, 1.5), "ppo_clip_low"), ((0.8, 0.9), "ppo_clip_high"),
                            ((-0.1, 1.2), "ppo_clip_low"), ((0.8, float("inf")), "ppo_clip_high")):
            with pytest.raises(ampd.InvalidArgument, match=field) as refused:
                job.step(ids, targets, loss_fn="ppo", advantages=advantages,
                         sampling_logprobs=weights, ppo_clip=clip)
            assert refused.value.field == field, (clip, refused.value.field)
        # A loss that does not read the clip range refuses it, as it refuses
        # a per-token input it does not read.
        for loss_fn, kwargs in (("importance_sampling",
                                 dict(advantages=advantages, sampling_logprobs=weights)),
                                ("cross_entropy", dict(weights=weights)), (None, {})):
            with pytest.raises(ampd.InvalidArgument, match="does not read it") as refused:
                job.step(ids, targets, loss_fn=loss_fn, ppo_clip=(0.8, 1.2), **kwargs)
            assert refused.value.field == "ppo_clip_low", (loss_fn, refused.value.field)
        # Every target -100: refused in words true of a sum as of a mean.
        ignored = np.full_like(targets, -100)
        for loss_fn, kwargs in (("cross_entropy", dict(weights=weights)),
                                ("ppo", dict(advantages=advantages, sampling_logprobs=weights)),
                                (None, {})):
            with pytest.raises(ampd.InvalidArgument, match="at least one target token") as refused:
                job.step(ids, ignored, loss_fn=loss_fn, **kwargs)
            assert "mean" not in str(refused.value), str(refused.value)
            assert refused.value.field == "micro_batches[0].targets"
        assert job.refresh().step_count == 0
        mlp = client.create_job(model=ampd.Model([ampd.Linear(4, 2)]), precision="fp32")
        x = np.zeros((3, 4), np.float32)
        y = np.zeros((3, 2), np.float32)
        with pytest.raises(ampd.InvalidArgument, match="loss_fn"):
            mlp.step(x, y, loss_fn="cross_entropy")


@pytest.mark.parametrize("kind", ["gpt", "decoder"])
def test_logprobs_are_pytorchs_and_the_training_forwards_own(server, kind):
    spec, peer, export = models(kind)
    rng = np.random.default_rng(11)
    sequences = [rng.integers(0, VOCAB, size=n) for n in (CONTEXT + 1, 5, 2, 9)]
    with ampd.Client(server.address) as client:
        job = client.create_job(model=spec, precision="fp32", seed=6)
        model = peer()
        model.load_state_dict(export(job), strict=True)
        got = job.logprobs(sequences)
        assert [g.shape for g in got] == [(len(s) - 1,) for s in sequences]
        for sequence, values in zip(sequences, got):
            ids = torch.from_numpy(np.asarray(sequence[None, :-1], dtype=np.int64))
            with torch.no_grad():
                logp = F.log_softmax(model.logits(ids).float(), dim=-1)[0]
            want = logp.gather(-1, torch.from_numpy(sequence[1:]).unsqueeze(-1)).squeeze(-1)
            np.testing.assert_allclose(values, want.numpy(), rtol=1e-5, atol=1e-5)

        # The log-probs are the ones a step of the same batch trains on: as
        # the sampler's, every ratio r = exp(logp - q) is exactly 1, so the
        # importance-sampling loss with advantages of 1 is minus the count of
        # target tokens, exactly.
        ids, targets, _, _, _ = batch(3)
        q = job.evaluate(ids, targets, return_logprobs=True).logprobs[0]
        assert q.shape == targets.shape and np.all(q[targets == -100] == 0)
        result = job.step(ids, targets, loss_fn="importance_sampling",
                          advantages=np.ones(ids.shape, np.float32), sampling_logprobs=q,
                          return_logprobs=True)
        assert result.loss == -float(np.count_nonzero(targets != -100))
        # The step reports the same log-probs, so no mismatch and ratios of 1.
        assert result.logprob_mismatch == 0.0
        assert np.array_equal(result.logprobs[0], q)
        assert np.all(result.ratios[0] == (targets != -100))

        # Micro-batches of two shapes, one shape twice (its workspace
        # reused): each one's log-probs in input order, Evaluate's bits.
        split = [(ids[:1], targets[:1]), (ids[1:], targets[1:]), (ids[2:], targets[2:])]
        want = job.evaluate(micro_batches=split, return_logprobs=True).logprobs
        got = job.step(micro_batches=split, return_logprobs=True)
        assert got.ratios is None and got.logprob_mismatch is None
        assert [g.shape for g in got.logprobs] == [t.shape for _, t in split]
        for g, w in zip(got.logprobs, want):
            assert np.array_equal(g, w)
        assert job.step(ids, targets).logprobs is None

        mlp = client.create_job(model=ampd.Model([ampd.Linear(4, 2)]), precision="fp32")
        with pytest.raises(ampd.InvalidArgument, match="return_logprobs"):
            mlp.evaluate(np.zeros((3, 4), np.float32), np.zeros((3, 2), np.float32),
                         return_logprobs=True)
        with pytest.raises(ampd.InvalidArgument, match="return_logprobs"):
            mlp.step(np.zeros((3, 4), np.float32), np.zeros((3, 2), np.float32),
                     return_logprobs=True)
        assert mlp.refresh().step_count == 0
