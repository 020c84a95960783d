"""A cookbook-style RL loop written against the tinker SDK alone (GRPO-like):
sample a group of completions per prompt from the current weights, reward
them, centre the rewards within each group (the advantages), train with the
importance_sampling loss on the sampler's own log-probs, take an optim_step,
and make a new sampler from the updated weights: every iteration.

The toy task: completions of --max-tokens characters are rewarded for
the share of them that are the --target character. Pointed at ampd-tinker
(fp16, batch_invariant jobs), the trainer's log-probs of the sampled tokens
equal the sampler's, so the printed mismatch (max |trainer - sampler| over
every sampled token) is 0 on every iteration: the loop is exactly on-policy.

    TINKER_API_KEY=tml-... python examples/tinker_rl.py --base-url http://127.0.0.1:8000 \\
        --base-model tiny/qwen2-chars --check

--check exits 1 unless the last iterations' reward beats the first ones' and
every mismatch was 0.
"""
import argparse
import os
import sys

import numpy as np
import tinker
from tinker import types


def resolved(value):
    """Newer SDKs return a future where older ones return the client."""
    return value.result() if type(value).__name__.startswith("Backcompat") else value


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default=os.environ.get("TINKER_BASE_URL"))
    p.add_argument("--base-model", default="tiny/qwen2-chars")
    p.add_argument("--iterations", type=int, default=30)
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--learning-rate", type=float, default=5e-2)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--target", default="7")
    p.add_argument("--check", action="store_true")
    args = p.parse_args()

    service = tinker.ServiceClient(base_url=args.base_url)  # the key: $TINKER_API_KEY
    trainer = resolved(service.create_lora_training_client(base_model=args.base_model,
                                                           rank=args.rank, seed=0))
    tokenizer = trainer.get_tokenizer()
    target = tokenizer.encode(args.target)[0]
    prompts = [tokenizer.encode(text) for text in ("3+4=", "9-2=", "1+6=", "14/2=")]

    rewards, mismatches = [], []
    for iteration in range(args.iterations):
        sampler = resolved(trainer.save_weights_and_get_sampling_client())
        # stop=[]: every completion is --max-tokens long (None would end
        # one at the model's EOS as well).
        params = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0,
                                      seed=1000 + iteration, stop=[])
        futures = [sampler.sample(types.ModelInput.from_ints(prompt), args.group_size, params)
                   for prompt in prompts]
        data, sampled, group_rewards = [], [], []
        for prompt, future in zip(prompts, futures):
            sequences = future.result().sequences
            reward = np.array([np.mean(np.asarray(s.tokens) == target) for s in sequences])
            group_rewards.append(reward.mean())
            advantage = reward - reward.mean()
            for seq, adv in zip(sequences, advantage):
                tokens = list(prompt) + list(seq.tokens)
                n_prompt, n = len(prompt) - 1, len(tokens) - 1
                logprobs = np.zeros(n, np.float32)
                logprobs[n_prompt:] = seq.logprobs
                advantages = np.zeros(n, np.float32)
                advantages[n_prompt:] = adv
                data.append(types.Datum(
                    model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={"target_tokens": np.asarray(tokens[1:], np.int64),
                                    "logprobs": logprobs, "advantages": advantages}))
                sampled.append((n_prompt, np.asarray(seq.logprobs, np.float32)))
        result = trainer.forward_backward(data, "importance_sampling").result()
        # The trainer's log-probs of the sampled tokens, at the weights sampled from.
        mismatch = max(
            float(np.max(np.abs(out["logprobs"].to_numpy()[start:] - theirs)))
            for out, (start, theirs) in zip(result.loss_fn_outputs, sampled))
        step = trainer.optim_step(types.AdamParams(learning_rate=args.learning_rate)).result()
        rewards.append(float(np.mean(group_rewards)))
        mismatches.append(mismatch)
        print("iteration %2d  reward %.3f  sampler/trainer mismatch %g  loss scale %g%s" % (
            iteration, rewards[-1], mismatch, step.metrics.get("loss_scale:unique", 0.0),
            "  (update skipped: fp16 overflow)" if step.metrics.get("skipped:unique") else ""),
            flush=True)

    k = max(1, len(rewards) // 4)
    first, last = float(np.mean(rewards[:k])), float(np.mean(rewards[-k:]))
    print("reward: first %d iterations %.3f, last %d %.3f; max mismatch %g"
          % (k, first, k, last, max(mismatches)))
    if args.check and not (last > first and max(mismatches) == 0.0):
        print("FAIL: the reward did not rise, or the sampler and trainer disagreed")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
