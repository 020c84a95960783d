"""Job.sample through the real ampd (the Sample RPC) on the CPU backend.

On batch-invariant jobs (a GPT, a grouped-query decoder, a LoRA decoder;
fp16), every sampled token's log-prob equals bit for bit the one
Job.logprobs (the training forward, Evaluate) computes for the finished
sequence; at temperature 0.7 each token's sampling log-prob (the drawn
distribution's) equals bit for bit what Job.logprobs and a token loss at
temperature 0.7 compute (fp32 and fp16), while its log-prob stays the
policy's; greedy draws are certain (0); the same request draws the same
tokens; bad requests are refused with INVALID_ARGUMENT naming the field;
and examples/rl_fp16.py, a GRPO loop in fp16, at least doubles its reward
with a mismatch of exactly 0."""
import os
import subprocess
import sys

import numpy as np
import pytest

import ampd
from small_lms import MODELS, VOCAB


def trained_job(client, which, precision="fp16"):
    job = client.create_job(model=MODELS[which], precision=precision, seed=3,
                            optimizer=ampd.AdamW(lr=1e-2), batch_invariant=True)
    rng = np.random.default_rng(5)
    for _ in range(3):
        ids = rng.integers(0, VOCAB, size=(4, 12), dtype=np.int64)
        job.step(ids, (3 * ids + 1) % VOCAB)
    return job


@pytest.mark.parametrize("which", sorted(MODELS))
def test_sampled_logprobs_are_the_trainers_bit_for_bit(server, which):
    with ampd.Client(server.address) as client:
        job = trained_job(client, which)
        rng = np.random.default_rng(9)
        prompts = [rng.integers(0, VOCAB, size=n).tolist() for n in (1, 4, 7, 2, 9, 3, 5, 6)]
        groups = job.sample(prompts, num_samples=2, max_tokens=5, seed=11)
        assert [len(g) for g in groups] == [2] * len(prompts)
        sequences, sampled, starts = [], [], []
        for prompt, group in zip(prompts, groups):
            for c in group:
                assert len(c.tokens) == 5 and c.logprobs.dtype == np.float32
                assert c.stop_reason == "length"
                assert all(0 <= t < VOCAB for t in c.tokens)
                sequences.append(prompt + c.tokens)
                sampled.append(c.logprobs)
                starts.append(len(prompt) - 1)
        # Recomputed by the training forward, each sequence alone.
        for seq, lp, q, start in zip(sequences, job.logprobs(sequences), sampled, starts):
            assert lp[start:].view(np.uint32).tolist() == q.view(np.uint32).tolist(), seq
        # The same request, the same tokens and log-probs.
        again = job.sample(prompts, num_samples=2, max_tokens=5, seed=11)
        for g1, g2 in zip(groups, again):
            for c1, c2 in zip(g1, g2):
                assert c1.tokens == c2.tokens
                assert c1.logprobs.tobytes() == c2.logprobs.tobytes()


def test_a_prompt_with_its_own_seed_draws_the_same_wherever_it_sits(server):
    with ampd.Client(server.address) as client:
        job = trained_job(client, "decoder")
        rng = np.random.default_rng(21)
        mine = rng.integers(0, VOCAB, size=4).tolist()
        others = [rng.integers(0, VOCAB, size=n).tolist() for n in (3, 6, 2)]

        def tokens(groups):
            return [[c.tokens for c in group] for group in groups]

        kwargs = dict(num_samples=3, max_tokens=6, temperature=1.0)
        alone = tokens(job.sample([mine], seeds=[77], seed=5, **kwargs))[0]
        third = tokens(job.sample(others[:2] + [mine] + others[2:], seeds=[1, None, 77, 2],
                                  seed=9, **kwargs))[2]
        first = tokens(job.sample([mine] + others, seeds=[77, None, None, None], **kwargs))[0]
        assert alone == third == first
        # Its completion j draws from stream j: fewer samples, the first ones.
        assert tokens(job.sample([mine], seeds=[77], num_samples=2, max_tokens=6))[0] == alone[:2]
        # Without seeds of their own, the request's seed is split by position
        # (stream i * num_samples + j): prompt 0 draws what the same prompt
        # with its own seed equal to the request's draws, a later one does not.
        by_position = tokens(job.sample(others[:2] + [mine], seed=77, **kwargs))
        assert by_position[2] != alone
        assert tokens(job.sample([mine] + others[:2], seed=77, **kwargs))[0] == alone
        with pytest.raises(ValueError, match="seeds"):
            job.sample([mine, mine], seeds=[1])


def test_top_k_above_the_vocabulary_draws_as_top_k_zero(server):
    with ampd.Client(server.address) as client:
        job = trained_job(client, "gpt")
        rng = np.random.default_rng(4)
        prompts = [rng.integers(0, VOCAB, size=n).tolist() for n in (2, 5, 3)]
        draws = {}
        for top_k in (0, VOCAB, VOCAB + 1, 1000):
            groups = job.sample(prompts, num_samples=4, max_tokens=6, top_k=top_k, seed=13)
            draws[top_k] = [[c.tokens for c in g] for g in groups]
        assert draws[VOCAB] == draws[0]
        assert draws[VOCAB + 1] == draws[0]
        assert draws[1000] == draws[0]
        # A real truncation still truncates: top_k 1 is the most likely token.
        greedy = job.sample(prompts, max_tokens=6, temperature=0.0)
        top1 = job.sample(prompts, max_tokens=6, top_k=1, seed=13)
        assert [[c.tokens for c in g] for g in top1] == [[c.tokens for c in g] for g in greedy]


def test_max_tokens_zero_is_refused_and_unset_means_16(server):
    from ampd.v1 import trainer_pb2 as pb
    with ampd.Client(server.address) as client:
        job = trained_job(client, "gpt")
        with pytest.raises(ampd.InvalidArgument, match="max_tokens") as refused:
            job.sample([[1]], max_tokens=0)
        assert refused.value.field == "max_tokens"
        # A raw request without max_tokens: 16 tokens.
        request = pb.SampleRequest(job_id=job.job_id, prompts=[pb.TokenSequence(tokens=[1])],
                                   stop_token_ids=[], seed=3)
        stub = client._stub
        response = client._call(lambda md, t: stub.Sample(request, metadata=md, timeout=t))
        assert len(response.prompts[0].completions[0].tokens) == 16


def test_a_sample_over_the_memory_limit_names_samples_field(start_ampd):
    server = start_ampd("--max-memory-bytes=%d" % (24 << 20))
    with ampd.Client(server.address) as client:
        job = client.create_job(model=MODELS["gpt"], precision="fp32", seed=3)
        job.sample([[1, 2]], max_tokens=4)  # a small one fits
        with pytest.raises(ampd.ResourceExhausted) as refused:
            job.sample([[1, 2]] * 1024, num_samples=4, max_tokens=20)
        message = str(refused.value)
        assert "micro_batches" not in message and "micro-batches" not in message, message
        assert "num_samples: " in message, message


def bits(values):
    return np.asarray(values, dtype=np.float32).view(np.uint32).tolist()


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("which", ["gpt", "decoder"])
def test_sampling_logprobs_at_a_temperature_are_a_temperature_losss_bit_for_bit(
        server, which, precision):
    with ampd.Client(server.address) as client:
        job = trained_job(client, which, precision)
        rng = np.random.default_rng(19)
        prompts = [rng.integers(0, VOCAB, size=n).tolist() for n in (1, 4, 7, 2, 9, 3)]
        groups = job.sample(prompts, num_samples=2, max_tokens=5, temperature=0.7, seed=23)
        sequences, policy, sampled, starts = [], [], [], []
        for prompt, group in zip(prompts, groups):
            for c in group:
                assert c.sampling_logprobs.dtype == np.float32
                assert len(c.sampling_logprobs) == len(c.tokens) == 5
                sequences.append(prompt + c.tokens)
                policy.append(c.logprobs)
                sampled.append(c.sampling_logprobs)
                starts.append(len(prompt) - 1)
        # Fed back as sampling log-probs, the temperature-1 ones would be
        # off-policy by this much.
        gap = max(float(np.max(np.abs(p - q))) for p, q in zip(policy, sampled))
        assert gap > 0.05, gap
        # The training forward at temperature 0.7, and at 1.
        tempered = job.logprobs(sequences, temperature=0.7)
        plain = job.logprobs(sequences)
        for seq, t, p, q, lp, start in zip(sequences, tempered, plain, sampled, policy, starts):
            assert bits(t[start:]) == bits(q), seq
            assert bits(p[start:]) == bits(lp), seq
        # A token loss at temperature 0.7 on them: no mismatch at all.
        width = max(len(s) for s in sequences) - 1
        ids = np.zeros((len(sequences), width), dtype=np.int64)
        targets = np.full((len(sequences), width), -100, dtype=np.int64)
        q = np.zeros(targets.shape, dtype=np.float32)
        for i, (seq, s, start) in enumerate(zip(sequences, sampled, starts)):
            ids[i, :len(seq) - 1] = seq[:-1]
            targets[i, start:len(seq) - 1] = seq[start + 1:]
            q[i, start:len(seq) - 1] = s
        result = job.step(ids, targets, loss_fn="importance_sampling",
                          advantages=np.ones(targets.shape, dtype=np.float32),
                          sampling_logprobs=q, temperature=0.7, return_logprobs=True)
        assert result.logprob_mismatch == 0.0
        keep = targets != -100
        assert bits(result.logprobs[0][keep]) == bits(q[keep])


def test_greedy_draws_are_certain_and_a_nucleus_renormalises(server):
    with ampd.Client(server.address) as client:
        job = trained_job(client, "decoder", "fp32")
        prompts = [[1, 2, 3], [4], [5, 6]]
        for group in job.sample(prompts, max_tokens=4, temperature=0.0):
            for c in group:
                assert bits(c.sampling_logprobs) == [0] * 4
                assert np.all(c.logprobs < 0)
        groups = job.sample(prompts, num_samples=3, max_tokens=4, temperature=0.7, top_p=0.5,
                            seed=3)
        sequences, sampled, starts = [], [], []
        for prompt, group in zip(prompts, groups):
            for c in group:
                sequences.append(prompt + c.tokens)
                sampled.append(c.sampling_logprobs)
                starts.append(len(prompt) - 1)
        raised = False
        for t, q, start in zip(job.logprobs(sequences, temperature=0.7), sampled, starts):
            # Over the nucleus's mass (<= 1): never below the temperature's.
            assert np.all(q >= t[start:]) and np.all(q <= 0)
            raised = raised or bool(np.any(q > t[start:] + 1e-3))
        assert raised


def test_bad_requests_name_the_field(server):
    with ampd.Client(server.address) as client:
        job = trained_job(client, "decoder")
        for kwargs, field in ((dict(prompts=[[1], []]), "prompts[1]"),
                              (dict(prompts=[[1, VOCAB]]), "prompts[0][1]"),
                              (dict(prompts=[[1]], max_tokens=30), "prompts[0]"),
                              (dict(prompts=[[1]], temperature=-1.0), "temperature"),
                              (dict(prompts=[[1]], top_p=1.5), "top_p"),
                              (dict(prompts=[[1]], stop=[VOCAB]), "stop_token_ids[0]"),
                              (dict(prompts=[[1]], num_samples=300), "num_samples")):
            with pytest.raises(ampd.InvalidArgument, match=field.replace("[", r"\[")):
                job.sample(**kwargs)
        layer_job = client.create_job(model=ampd.Model([ampd.Linear(4, 4)], loss="mse"),
                                      precision="fp32")
        with pytest.raises(ampd.InvalidArgument, match="language model"):
            layer_job.sample([[1]])
        # A loss's or an evaluation's temperature: finite and > 0, a language
        # model's only.
        ids = np.array([[1, 2, 3]], dtype=np.int64)
        for t in (0.0, -0.5, float("inf")):
            with pytest.raises(ampd.InvalidArgument, match="temperature") as refused:
                job.step(ids, ids, loss_fn="cross_entropy", temperature=t)
            assert refused.value.field == "temperature"
            with pytest.raises(ampd.InvalidArgument, match="temperature") as refused:
                job.evaluate(ids, ids, temperature=t)
            assert refused.value.field == "temperature"
        x = np.ones((2, 4), dtype=np.float32)
        with pytest.raises(ampd.InvalidArgument, match="temperature") as refused:
            layer_job.evaluate(x, x, temperature=0.7)
        assert refused.value.field == "temperature"


def test_weights_that_give_nan_logits_are_refused_not_sampled(server):
    """An fp16 job whose masters are past fp16's range (a diverged run) has
    NaN logits: Sample says so, nothing comes back, and the job still
    samples once its weights are sane again."""
    with ampd.Client(server.address) as client:
        job = trained_job(client, "gpt")
        sane = {name: t for name, t in job.state_dict().items()
                if not name.startswith("optimizer.")}
        wild = {name: np.full_like(t, 1e6) if name.endswith(".weight") else t
                for name, t in sane.items()}
        job.load_state_dict(wild, partial=True)
        with pytest.raises(ampd.FailedPrecondition, match="not finite"):
            job.sample([[1, 2, 3]], max_tokens=4, seed=1)
        job.load_state_dict(sane, partial=True)
        (group,) = job.sample([[1, 2, 3]], max_tokens=4, seed=1)
        assert np.isfinite(group[0].logprobs).all()


def test_rl_example_doubles_its_reward_with_no_mismatch(server):
    example = os.path.join(os.environ["AMPD_SOURCE_DIR"], "examples", "rl_fp16.py")
    result = subprocess.run([sys.executable, example, "--server=" + server.address,
                             "--iterations=40", "--check"],
                            capture_output=True, text=True, timeout=500)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "mismatch 0 " in result.stdout or "mismatch 0\n" in result.stdout
    assert "max sampler-trainer mismatch 0" in result.stdout
