"""Sampling through ampd's Sample RPC: the median sampled tokens/s of one
call of --prompts prompts x --max-tokens new tokens, on a GPT-2-style GPT
(--model gpt: learned positions, LayerNorm, tied head) or a Qwen2-shaped
decoder (--model decoder: tied, q/k/v biases, rope_theta 1e6), beside
bench/pytorch/generate.py's KV-cache loop and bench/pytorch/hf_generate.py's
transformers `generate` of the same shapes.

  python3 bench/service/sample_bench.py --server=127.0.0.1:50051 [--model decoder]
      [--precisions fp16,bf16] [--vocab V --hidden C --layers L --heads H]
      [--intermediate I --kv-heads K] [--prompts 16 --prompt-len 32 --max-tokens 64]
      [--temperature 1] [--repeats 5] [--batch-invariant]

Shapes default to the model's full size: GPT-2 small (vocab 50304, 768 wide,
12 layers, 12 heads; the GPT benchmarks' padded vocab) or Qwen2.5-0.5B (vocab
151936, hidden 896, intermediate 4864, 24 layers, 14 heads / 2 K/V heads).
The context is --prompt-len + --max-tokens. Each precision runs on a job of
its own, created for it and deleted after it. Only generated tokens count
(no stop tokens: every sequence runs --max-tokens). A --batch-invariant job
the server refuses (a backend without batch-invariant kernels) prints
"PRECISION refused: REASON" and is not an error.

Needs the ampd Python package (a build's client/python/package) and numpy.
"""

import argparse
import os
import statistics
import sys
import time

import numpy as np

import ampd

# The arguments every sampling benchmark shares (bench/pytorch/sampling_args.py).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "pytorch"))
import sampling_args  # noqa: E402


def make_model(args):
    context = args.prompt_len + args.max_tokens
    if args.model == "gpt":
        return ampd.GPT(vocab_size=args.vocab, context_length=context, d_model=args.hidden,
                        n_layer=args.layers, n_head=args.heads)
    return ampd.Decoder(vocab_size=args.vocab, hidden_size=args.hidden,
                        intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                        max_position_embeddings=context, rope_theta=1e6,
                        tie_word_embeddings=True, qkv_bias=True)


def time_precision(client, args, precision, prompts):
    """(median seconds, generated tokens a call), or the refusal's text."""
    try:
        job = client.create_job(model=make_model(args), precision=precision, seed=0,
                                batch_invariant=args.batch_invariant)
    except ampd.AmpdError as e:
        # Only the batch-invariant mode may be refused: any other error is one.
        if args.batch_invariant and "batch_invariant" in str(e):
            return str(e)
        raise
    try:
        times, sampled = [], 0
        for i in range(args.repeats + 1):
            t0 = time.perf_counter()
            groups = job.sample(prompts, max_tokens=args.max_tokens,
                                temperature=args.temperature, seed=i)
            elapsed = time.perf_counter() - t0
            sampled = sum(len(c.tokens) for g in groups for c in g)
            if sampled != args.prompts * args.max_tokens:
                raise RuntimeError(f"{sampled} tokens sampled, expected {args.prompts} x "
                                   f"{args.max_tokens}: a sequence stopped early")
            if i > 0:  # the first call warms up (allocations, the workspace)
                times.append(elapsed)
    finally:
        job.delete()
    return statistics.median(times), sampled


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", default="127.0.0.1:50051")
    sampling_args.add_arguments(parser)
    parser.add_argument("--batch-invariant", action="store_true")
    args, precisions = sampling_args.parse(parser, "sample_bench.py")
    if args is None:
        return 2
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, args.vocab, size=(args.prompts, args.prompt_len)).tolist()
    shape = sampling_args.describe(args)
    print(f"sample: {shape}; {args.prompts} prompts x {args.prompt_len} tokens, "
          f"{args.max_tokens} new tokens each, temperature {args.temperature:g}"
          f"{', batch-invariant' if args.batch_invariant else ''}, through the Sample RPC; "
          f"median of {args.repeats} after one warm-up call")
    with ampd.Client(args.server, timeout=600) as client:
        for precision in precisions:
            result = time_precision(client, args, precision, prompts)
            if isinstance(result, str):
                print(f"{precision:5s} refused: {result}")
                continue
            sampling_args.report(precision, *result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
