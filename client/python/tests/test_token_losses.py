"""A language model's token losses (Step's loss_fn) through the real ampd
against a hand-written PyTorch version of Tinker's definitions, in fp32.

The job's initial weights load into bench/pytorch/gpt.py's GPT (or
bench/pytorch/decoder.py's Qwen2-style decoder); then each
loss (cross_entropy with per-token weights, importance_sampling, ppo and
cispo with clip ranges that some ratios leave, dro) trains 4 plain-SGD steps
on both sides. SGD moves the weights by lr times the gradient, so equal
weights after the steps say the gradients were equal, and each step's
reported loss must be PyTorch's sum over the target tokens to 1e-5 relative,
each token's loss (token_losses) PyTorch's elementwise loss. Also: the
defaults of cispo and dro are Tinker's, fp16 and bf16 jobs agree with
PyTorch to their precision, a sum over two micro-batches is the sum over one
batch of both, and the refusals name the field. Each loss also at a
sampling temperature (temperature=0.7: logp the log-softmax of logits / 0.7
on both sides, so the gradients carry its 1 / T). Skipped, saying so, where
torch is not importable."""
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
CISPO_CLIP = (0.95, 1.1)  # not the defaults (0, 4): both sides clip some ratios
DRO_BETA = 0.5  # not the default 0.05
# The parameters each loss is sent (the others it would refuse).
PARAMS = {"ppo": {"ppo_clip": CLIP}, "cispo": {"cispo_clip": CISPO_CLIP},
          "dro": {"dro_beta": DRO_BETA}}


def torch_token_terms(model, ids, targets, loss_fn, weights, advantages, sampling,
                      cispo_clip=CISPO_CLIP, dro_beta=DRO_BETA, temperature=None):
    """Tinker's definitions (tinker-docs.thinkingmachines.ai/losses), each
    target token's elementwise loss (0 where the target is -100), and logp
    (of logits / temperature when given)."""
    logits = model.logits(torch.from_numpy(ids)).float()
    if temperature is not None:
        logits = logits / temperature
    targets = torch.from_numpy(targets)
    keep = targets != -100
    logp = F.log_softmax(logits, dim=-1).gather(-1, targets.clamp(min=0).unsqueeze(-1))
    logp = logp.squeeze(-1)
    if loss_fn == "cross_entropy":
        term = -torch.from_numpy(weights) * logp
    else:
        q = torch.from_numpy(sampling)
        ratio = torch.exp(logp - q)
        a = torch.from_numpy(advantages)
        if loss_fn == "importance_sampling":
            term = -ratio * a
        elif loss_fn == "ppo":
            term = -torch.minimum(ratio * a, torch.clamp(ratio, *CLIP) * a)
        elif loss_fn == "cispo":
            term = -(torch.clamp(ratio, *cispo_clip).detach() * logp * a)
        else:
            term = -(logp * a - 0.5 * dro_beta * (logp - q) ** 2)
    return term * keep, logp.detach()


def definition(loss_fn, logp, weights, advantages, sampling, cispo_clip=CISPO_CLIP,
               dro_beta=DRO_BETA):
    """Each token's term by Tinker's definitions, in float64, from given
    log-probs (ignored targets not masked)."""
    logp = logp.astype(np.float64)
    if loss_fn == "cross_entropy":
        return -weights * logp
    q = sampling.astype(np.float64)
    a = advantages.astype(np.float64)
    r = np.exp(logp - q)
    if loss_fn == "importance_sampling":
        return -r * a
    if loss_fn == "ppo":
        return -np.minimum(r * a, np.clip(r, *CLIP) * a)
    if loss_fn == "cispo":
        return -(np.clip(r, *cispo_clip) * logp * a)
    return -(logp * a - 0.5 * dro_beta * (logp - q) ** 2)


def torch_token_loss(model, ids, targets, loss_fn, weights, advantages, sampling,
                     temperature=None):
    """Tinker's definitions, summed over the target tokens (-100 adds nothing)."""
    terms, logp = torch_token_terms(model, ids, targets, loss_fn, weights, advantages, sampling,
                                    temperature=temperature)
    return terms.sum(), logp


def batch(step, size=3):
    rng = np.random.default_rng(900 + step)
    ids = rng.integers(0, VOCAB, size=(size, CONTEXT), dtype=np.int64)
    targets = (3 * ids + 1) % VOCAB
    targets[rng.random(targets.shape) < 0.15] = -100
    weights = rng.uniform(0.0, 2.0, size=ids.shape).astype(np.float32)
    advantages = rng.uniform(-1.0, 1.0, size=ids.shape).astype(np.float32)
    return ids, targets, weights, advantages, rng


@pytest.mark.parametrize("temperature", [None, 0.7])
@pytest.mark.parametrize("kind", ["gpt", "decoder"])
@pytest.mark.parametrize("loss_fn", ["cross_entropy", "importance_sampling", "ppo", "cispo",
                                     "dro"])
def test_token_loss_and_gradients_equal_pytorch(server, loss_fn, kind, temperature):
    spec, peer, export = models(kind)
    # log_softmax(z / T)'s curvature in z is 1 / T^2 times the untempered
    # one: the learning rate scaled by T^2 keeps the steps as stable, so
    # that fp32's rounding grows no faster over the 4 steps than at T = 1
    # (dro at 0.7 with LR itself: 3.7e-7 of the weights' scale apart after
    # one step, 7.7e-4 after four; with LR T^2: 2.4e-5).
    lr = LR * (temperature or 1.0) ** 2
    with ampd.Client(server.address) as client:
        job = client.create_job(model=spec, precision="fp32", seed=4,
                                optimizer=ampd.SGD(lr=lr))
        model = peer()
        model.load_state_dict(export(job), strict=True)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        for step in range(4):
            ids, targets, weights, advantages, rng = batch(step)
            # The sampler's log-probs: the model's own, moved by up to 0.3,
            # so PPO's ratios straddle its clip range.
            with torch.no_grad():
                _, logp = torch_token_loss(model, ids, targets, "cross_entropy", weights,
                                           None, None, temperature=temperature)
            sampling = (logp.numpy() + rng.uniform(-0.3, 0.3, size=ids.shape)).astype(np.float32)
            kwargs = {"loss_fn": loss_fn, "temperature": temperature}
            if loss_fn == "cross_entropy":
                kwargs["weights"] = weights
            else:
                kwargs.update(advantages=advantages, sampling_logprobs=sampling)
            kwargs.update(PARAMS.get(loss_fn, {}))
            result = job.step(ids, targets, return_logprobs=True, **kwargs)
            ours = result.loss
            opt.zero_grad()
            their_terms, their_logp = torch_token_terms(model, ids, targets, loss_fn, weights,
                                                        advantages, sampling,
                                                        temperature=temperature)
            theirs = their_terms.sum()
            theirs.backward()
            opt.step()
            # Each token's log-prob agrees with PyTorch's to 1e-5 (below), so
            # the sum over the tokens to 1e-5 of the sum of their sizes.
            size = float(np.sum(np.abs(their_terms.detach().numpy())))
            assert ours == pytest.approx(theirs.item(), rel=1e-5, abs=1e-5 * max(1.0, size)), \
                "step %d: ampd %r, PyTorch %r" % (step + 1, ours, theirs.item())
            # Each token's loss: PyTorch's elementwise loss (to the log-probs'
            # agreement), Tinker's definition of the step's own log-probs in
            # float64 (to fp32 rounding), 0 where ignored, summing to the
            # reported loss.
            (token_losses,) = result.token_losses
            assert token_losses.shape == targets.shape
            np.testing.assert_allclose(token_losses, their_terms.detach().numpy(), rtol=1e-5,
                                       atol=2e-5)
            own = definition(loss_fn, result.logprobs[0], weights, advantages, sampling)
            own[targets == -100] = 0
            np.testing.assert_allclose(token_losses, own, rtol=1e-6, atol=1e-6)
            assert np.all(token_losses[targets == -100] == 0)
            assert float(np.sum(token_losses, dtype=np.float64)) == pytest.approx(
                ours, rel=1e-5, abs=1e-5)
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


def test_cispo_and_dro_defaults_are_tinkers(server):
    """cispo without cispo_clip clips to (0, 4), dro without dro_beta
    weighs the penalty by 0.05; over two micro-batches, each one's
    token_losses in input order."""
    ids, targets, weights, advantages, rng = batch(5, size=4)
    with ampd.Client(server.address) as client:
        for loss_fn, defaults in (("cispo", {"cispo_clip": (0.0, 4.0)}),
                                  ("dro", {"dro_beta": 0.05})):
            job = client.create_job(model=SPEC, precision="fp32", seed=8)
            model = torch_gpt.GPT(VOCAB, CONTEXT, D_MODEL, N_LAYER, N_HEAD, attention="manual")
            model.load_state_dict(ampd_torch.gpt2_state_dict(job), strict=True)
            with torch.no_grad():
                _, logp = torch_token_terms(model, ids, targets, "cross_entropy", weights,
                                            None, None)
                # Ratios up to e^1.6, some past cispo's default bound of 4.
                sampling = (logp.numpy() - rng.uniform(-0.2, 1.6, size=ids.shape)).astype(
                    np.float32)
                # Tinker's defaults (each loss reads its own).
                terms, _ = torch_token_terms(model, ids, targets, loss_fn, weights, advantages,
                                             sampling, cispo_clip=(0.0, 4.0), dro_beta=0.05)
            result = job.step(micro_batches=[(ids[:1], targets[:1]), (ids[1:], targets[1:])],
                              loss_fn=loss_fn, advantages=[advantages[:1], advantages[1:]],
                              sampling_logprobs=[sampling[:1], sampling[1:]],
                              return_logprobs=True)
            assert result.loss == pytest.approx(terms.sum().item(), rel=1e-5, abs=1e-5)
            assert [t.shape for t in result.token_losses] == [(1, CONTEXT), (3, CONTEXT)]
            np.testing.assert_allclose(np.concatenate(result.token_losses), terms.numpy(),
                                       rtol=1e-5, atol=1e-6)
            if loss_fn == "cispo":
                assert np.any(np.exp(logp.numpy() - sampling)[targets != -100] > 4.0)
            # The same losses with the defaults spelled out: the same bits.
            again = client.create_job(model=SPEC, precision="fp32", seed=8).step(
                micro_batches=[(ids[:1], targets[:1]), (ids[1:], targets[1:])], loss_fn=loss_fn,
                advantages=[advantages[:1], advantages[1:]],
                sampling_logprobs=[sampling[:1], sampling[1:]], **defaults)
            assert again.loss == result.loss


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("loss_fn", ["cispo", "dro"])
def test_cispo_and_dro_in_16_bits_agree_with_pytorch_to_the_precision(server, loss_fn,
                                                                       precision):
    """A 16-bit job's first step against PyTorch's fp32 on the weights the
    job computes with (its masters rounded to the precision): its loss, each
    token's loss, and its SGD update (lr times the gradient, read from the
    fp32 masters) to the precision's tolerance (the job's activations and
    gradients are rounded to 16 bits)."""
    ids, targets, weights, advantages, rng = batch(6)
    tol = {"fp16": 2e-2, "bf16": 8e-2}[precision]
    with ampd.Client(server.address) as client:
        # A static scale of 8: no overflow in either dtype, and no skip.
        job = client.create_job(model=SPEC, precision=precision, seed=9,
                                optimizer=ampd.SGD(lr=LR),
                                scaler=ampd.Scaler(dynamic=False, init_scale=8.0))
        before = ampd_torch.gpt2_state_dict(job)
        working = {"fp16": torch.float16, "bf16": torch.bfloat16}[precision]
        model = torch_gpt.GPT(VOCAB, CONTEXT, D_MODEL, N_LAYER, N_HEAD, attention="manual")
        model.load_state_dict({k: v.to(working).float() for k, v in before.items()},
                              strict=True)
        with torch.no_grad():
            _, logp = torch_token_terms(model, ids, targets, "cross_entropy", weights, None, None)
        sampling = (logp.numpy() + rng.uniform(-0.3, 0.3, size=ids.shape)).astype(np.float32)
        terms, _ = torch_token_terms(model, ids, targets, loss_fn, weights, advantages, sampling)
        terms.sum().backward()
        result = job.step(ids, targets, loss_fn=loss_fn, advantages=advantages,
                          sampling_logprobs=sampling, return_logprobs=True, **PARAMS[loss_fn])
        assert not result.skipped
        want = terms.detach().numpy()
        scale = float(np.max(np.abs(want)))
        assert result.loss == pytest.approx(want.sum(), rel=tol,
                                            abs=tol * float(np.sum(np.abs(want))))
        (token_losses,) = result.token_losses
        np.testing.assert_allclose(token_losses, want, rtol=tol, atol=tol * scale)
        assert float(np.sum(token_losses, dtype=np.float64)) == pytest.approx(
            result.loss, rel=1e-5, abs=1e-5)
        after = ampd_torch.gpt2_state_dict(job)
        grads = dict(model.named_parameters())
        for name, value in after.items():
            if name not in grads or grads[name].grad is None:
                continue
            ours = (value - before[name]).numpy()
            theirs = (-LR * grads[name].grad).numpy()
            bound = tol * float(np.max(np.abs(theirs))) + 1e-6  # + fp32 cancellation
            assert np.max(np.abs(ours - theirs)) <= bound, name


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
        # A loss parameter is refused by every loss that does not read it,
        # and out of its range by the one that does; ErrorInfo names it.
        policy = {"advantages": advantages, "sampling_logprobs": weights}
        for field, loss_fn, extra in (
                ("cispo_clip_low", "ppo", {"cispo_clip": (0.0, 4.0)}),
                ("dro_beta", "cispo", {"dro_beta": 0.05}),
                ("ppo_clip_low", "importance_sampling", {"ppo_clip": (0.8, 1.2)}),
                ("ppo_clip_low", "dro", {"ppo_clip": (0.8, 1.2)}),
                ("cispo_clip_low", "cross_entropy", {"cispo_clip": (0.0, 4.0)}),
                ("cispo_clip_high", "cispo", {"cispo_clip": (2.0, 1.0)}),
                ("cispo_clip_low", "cispo", {"cispo_clip": (-0.5, 1.0)}),
                ("cispo_clip_high", "cispo", {"cispo_clip": (0.0, float("inf"))}),
                ("dro_beta", "dro", {"dro_beta": -0.5}),
                ("dro_beta", "dro", {"dro_beta": float("nan")})):
            inputs = {} if loss_fn == "cross_entropy" else policy
            with pytest.raises(ampd.InvalidArgument, match=field) as refused:
                job.step(ids, targets, loss_fn=loss_fn, **inputs, **extra)
            assert refused.value.field == field, (loss_fn, extra, refused.value)
        with pytest.raises(ampd.InvalidArgument, match="weights"):
            job.step(ids, targets, loss_fn="dro", weights=weights, **policy)
        with pytest.raises(ampd.InvalidArgument, match="advantages"):
            job.step(ids, targets, loss_fn="cispo", sampling_logprobs=weights)
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
