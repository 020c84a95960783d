"""Sampling through ampd's Sample RPC: the median sampled tokens/s of one
call of --prompts prompts x --max-tokens new tokens on a Qwen2-shaped
decoder (tied, q/k/v biases, rope_theta 1e6), beside bench/pytorch/
generate.py's KV-cache loop of the same shapes.

  python3 bench/service/sample_bench.py --server=127.0.0.1:50051 [--precision fp16]
      [--vocab 151936 --hidden 896 --intermediate 4864 --layers 24 --heads 14
       --kv-heads 2] [--prompts 16 --prompt-len 32 --max-tokens 64] [--repeats 5]
      [--batch-invariant]

Needs the ampd Python package (a build's client/python/package) and numpy.
"""

import argparse
import statistics
import sys
import time

import numpy as np

import ampd


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", default="127.0.0.1:50051")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--intermediate", type=int, default=4864)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--heads", type=int, default=14)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--precision", default="fp16", choices=("fp32", "fp16", "bf16"))
    parser.add_argument("--batch-invariant", action="store_true")
    args = parser.parse_args()
    model = ampd.Decoder(vocab_size=args.vocab, hidden_size=args.hidden,
                         intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                         max_position_embeddings=args.prompt_len + args.max_tokens,
                         rope_theta=1e6, tie_word_embeddings=True, qkv_bias=True)
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, args.vocab, size=(args.prompts, args.prompt_len)).tolist()
    with ampd.Client(args.server, timeout=600) as client:
        job = client.create_job(model=model, precision=args.precision, seed=0,
                                batch_invariant=args.batch_invariant)
        print(f"sample: decoder vocab {args.vocab}, hidden {args.hidden}, {args.layers} layers, "
              f"{args.heads} heads / {args.kv_heads} kv heads; {args.prompts} prompts x "
              f"{args.prompt_len} tokens, {args.max_tokens} new tokens each, {args.precision}"
              f"{', batch-invariant' if args.batch_invariant else ''}, through the Sample RPC")
        times, sampled = [], 0
        for i in range(args.repeats + 1):
            t0 = time.perf_counter()
            groups = job.sample(prompts, max_tokens=args.max_tokens, seed=i)
            elapsed = time.perf_counter() - t0
            sampled = sum(len(c.tokens) for g in groups for c in g)
            if i > 0:  # the first call warms up (allocations, the workspace)
                times.append(elapsed)
        job.delete()
    median = statistics.median(times)
    print(f"{args.precision:5s} sample median {median * 1e3:9.3f} ms  "
          f"{sampled / median:10.0f} sampled tokens/s  ({sampled} tokens a call)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
