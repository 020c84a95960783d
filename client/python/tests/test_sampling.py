"""Job.sample through the real ampd (the Sample RPC) on the CPU backend.

On batch-invariant jobs (a GPT, a grouped-query decoder, a LoRA decoder;
fp16), every sampled token's log-prob equals bit for bit the one
Job.logprobs (the training forward, Evaluate) computes for the finished
sequence; the same request draws the same tokens; bad requests are refused
with INVALID_ARGUMENT naming the field; and examples/rl_fp16.py, a GRPO
loop in fp16, at least doubles its reward with a mismatch of exactly 0."""
import os
import subprocess
import sys

import numpy as np
import pytest

import ampd

VOCAB = 23
MODELS = {
    "gpt": ampd.GPT(vocab_size=VOCAB, context_length=24, d_model=32, n_layer=2, n_head=4),
    "decoder": ampd.Decoder(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=24),
    "lora": ampd.Decoder(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=24, lora=ampd.LoRA(rank=4, alpha=8.0)),
}


def trained_job(client, which):
    job = client.create_job(model=MODELS[which], precision="fp16", seed=3,
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


def test_rl_example_doubles_its_reward_with_no_mismatch(server):
    example = os.path.join(os.environ["AMPD_SOURCE_DIR"], "examples", "rl_fp16.py")
    result = subprocess.run([sys.executable, example, "--server=" + server.address,
                             "--iterations=40", "--check"],
                            capture_output=True, text=True, timeout=500)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "mismatch 0 " in result.stdout or "mismatch 0\n" in result.stdout
    assert "max sampler-trainer mismatch 0" in result.stdout
