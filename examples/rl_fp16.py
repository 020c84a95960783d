"""GRPO-style RL fine-tuning through ampd, in fp16 with dynamic loss scaling,
where the sampler's log-probs are the trainer's bit for bit.

The task has a verifiable reward a small model learns on the CPU backend:
a prompt shows two digits of a counting sequence (a, a + 1 mod 10) and the
policy must continue it; a completion's reward is the fraction of its tokens
that are the previous token + 1 mod 10. Every iteration:

  1. job.sample(): num_samples completions of each prompt from the current
     weights at --temperature, each token with q, its log-prob under the
     distribution it was drawn from (sampling_logprobs: the trainer's own
     kernels at that temperature);
  2. rewards, and advantages A = reward - the mean reward of its prompt's
     group (GRPO's baseline);
  3. job.step(loss_fn="importance_sampling") with per-token advantages and
     sampling log-probs at the same temperature: -sum exp(logp - q) A over
     the completion tokens (Tinker's definition; the prompt's targets are
     -100), fp16 with the job's dynamic loss scaler;
  4. the mismatch: the step reports max |logp - q| over the completion
     tokens, logp from the training forward it trains on (the weights the
     samples came from); on a batch_invariant job it is exactly 0.

Prints reward, skipped steps, the loss scale and the mismatch per iteration.

  python3 examples/rl_fp16.py --server=127.0.0.1:50051 [--iterations=60] [--temperature=0.8]
          [--check]   (exit 1 unless the reward at least doubles, or reaches
                       0.8, and the mismatch is 0 on every iteration)

Needs the ampd Python package (client/python; a build puts it under
build/<preset>/client/python/package) and numpy.
"""

import argparse
import sys

import numpy as np

import ampd

DIGITS = 10
VOCAB = 12  # the digits and two tokens the task never uses


def prompts(rng, count):
    starts = rng.integers(0, DIGITS, size=count)
    return [[int(a), int((a + 1) % DIGITS)] for a in starts]


def reward(prompt, tokens):
    prev, right = prompt[-1], 0
    for t in tokens:
        right += int(t == (prev + 1) % DIGITS)
        prev = t
    return right / len(tokens)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", default="127.0.0.1:50051")
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument("--prompts", type=int, default=16, help="prompts per iteration")
    parser.add_argument("--group", type=int, default=4, help="samples per prompt")
    parser.add_argument("--tokens", type=int, default=4, help="tokens per completion")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="the sampler's, and the loss's")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()

    rng = np.random.default_rng(args.seed)
    model = ampd.Decoder(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=16)
    with ampd.Client(args.server) as client:
        job = client.create_job(model=model, precision="fp16", seed=args.seed,
                                optimizer=ampd.AdamW(lr=args.lr), batch_invariant=True)
        print(f"job {job.job_id}: decoder, fp16 with dynamic loss scaling, batch-invariant kernels")
        rewards, worst_mismatch, skipped = [], 0.0, 0
        for it in range(args.iterations):
            batch = prompts(rng, args.prompts)
            groups = job.sample(batch, num_samples=args.group, max_tokens=args.tokens,
                                temperature=args.temperature, seed=args.seed * 100003 + it)
            sequences, advantages, sampled, scores = [], [], [], []
            for prompt, completions in zip(batch, groups):
                r = np.array([reward(prompt, c.tokens) for c in completions])
                scores.extend(r)
                for c, a in zip(completions, r - r.mean()):
                    sequences.append(prompt + list(c.tokens))
                    advantages.append(a)
                    sampled.append(c.sampling_logprobs)
            # One micro-batch: inputs seq[:-1], targets seq[1:]; the prompt's
            # targets are -100 (not the policy's tokens: no loss, and outside
            # the mismatch).
            p = len(batch[0])
            ids = np.array(sequences, dtype=np.int64)
            inputs, targets = ids[:, :-1], ids[:, 1:].copy()
            targets[:, :p - 1] = -100
            adv = np.zeros(targets.shape, dtype=np.float32)
            q = np.zeros(targets.shape, dtype=np.float32)
            for i, (a, lp) in enumerate(zip(advantages, sampled)):
                adv[i, p - 1:] = a
                q[i, p - 1:] = lp
            result = job.step(inputs, targets, loss_fn="importance_sampling", advantages=adv,
                              sampling_logprobs=q, temperature=args.temperature)
            mismatch = result.logprob_mismatch
            worst_mismatch = float(np.maximum(worst_mismatch, mismatch))  # keeps a NaN
            skipped += int(result.skipped)
            rewards.append(float(np.mean(scores)))
            print(f"iter {it + 1:3d}  reward {rewards[-1]:.3f}  skipped {skipped:3d}  "
                  f"loss scale {result.scale_after:g}  mismatch {mismatch:.3g}", flush=True)
        start = float(np.mean(rewards[:3]))
        end = float(np.mean(rewards[-3:]))
        print(f"reward {start:.3f} -> {end:.3f}; max sampler-trainer mismatch {worst_mismatch:g}")
        job.delete()
        if args.check and not ((end >= 2 * start or end >= 0.8) and worst_mismatch == 0.0):
            print("check failed: the reward did not double (or reach 0.8), or a log-prob "
                  "differed", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
