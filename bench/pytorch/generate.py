"""PyTorch's KV-cache generation loop over bench/pytorch/decoder.py's
Decoder: the peer of ampd's Sample for the same shapes.

Prefill over the (S, P) prompts, then one token per sequence at a time
against per-layer K/V caches (the keys and values of every position so far,
RoPE applied at each row's own position), the LM head's logits, a draw from
softmax(logits) (temperature 1, torch.multinomial) and each token's
log-prob, under torch.autocast in the given precision with the weights in
fp32 (as a training job's master) or, --weights-16, in the 16-bit dtype. Prints
the median over --repeats of the whole call's sampled tokens/s, as ampd's
bench/service/sample_bench.py does.

  python3 bench/pytorch/generate.py [--device cuda] [--precision fp16]
      [--vocab 151936 --hidden 896 --intermediate 4864 --layers 24 --heads 14
       --kv-heads 2] [--prompts 16 --prompt-len 32 --max-tokens 64] [--repeats 5]
"""

import argparse
import contextlib
import math
import statistics
import sys
import time

import torch
from torch.nn import functional as F

from decoder import Decoder, repeat_kv, rotate_half


def rotary(model, positions, dtype):
    """cos, sin (S, 1, T, D) for positions (S, T), Hugging Face's form."""
    freqs = positions.float()[..., None] * model.inv_freq[None, None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def attend(layer, x, cos, sin, cache, start):
    """One layer's attention over x (S, T, C) at positions start.. with the
    cache (k, v) of (S, Hkv, max, D), filled in place."""
    a = layer.self_attn
    s, t, _ = x.shape
    q = a.q_proj(x).view(s, t, a.heads, a.head_dim).transpose(1, 2)
    k = a.k_proj(x).view(s, t, a.kv_heads, a.head_dim).transpose(1, 2)
    v = a.v_proj(x).view(s, t, a.kv_heads, a.head_dim).transpose(1, 2)
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    cache[0][:, :, start:start + t] = k
    cache[1][:, :, start:start + t] = v
    groups = a.heads // a.kv_heads
    keys = repeat_kv(cache[0][:, :, :start + t], groups)
    values = repeat_kv(cache[1][:, :, :start + t], groups)
    if hasattr(F, "scaled_dot_product_attention"):
        y = F.scaled_dot_product_attention(q, keys, values, is_causal=(t > 1))
    else:  # torch < 2.0: the same masked softmax by hand
        att = (q @ keys.transpose(-2, -1)) * (1.0 / math.sqrt(a.head_dim))
        if t > 1:
            mask = torch.ones(t, start + t, dtype=torch.bool, device=x.device).tril(start)
            att = att.masked_fill(~mask, float("-inf"))
        y = F.softmax(att.float(), dim=-1).to(q.dtype) @ values
    return a.o_proj(y.transpose(1, 2).reshape(s, t, a.heads * a.head_dim))


@torch.no_grad()
def generate(model, prompts, max_tokens, dtype, generator):
    """(S, P) prompts of one length -> (S, max_tokens) tokens and log-probs."""
    s, p = prompts.shape
    device = prompts.device
    cache_dtype = dtype or torch.float32
    caches = [(torch.empty(s, layer.self_attn.kv_heads, p + max_tokens, layer.self_attn.head_dim,
                           device=device, dtype=cache_dtype),
               torch.empty(s, layer.self_attn.kv_heads, p + max_tokens, layer.self_attn.head_dim,
                           device=device, dtype=cache_dtype))
              for layer in model.model.layers]
    tokens, logprobs = [], []
    ids, start = prompts, 0
    for _ in range(max_tokens):
        t = ids.shape[1]
        positions = torch.arange(start, start + t, device=device).expand(s, t)
        cos, sin = rotary(model, positions, cache_dtype)
        x = model.model.embed_tokens(ids)
        for layer, cache in zip(model.model.layers, caches):
            x = x + attend(layer, layer.input_layernorm(x), cos, sin, cache, start)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        logits = model.lm_head(model.model.norm(x[:, -1])).float()
        logp = F.log_softmax(logits, dim=-1)
        nxt = torch.multinomial(logp.exp(), 1, generator=generator)
        tokens.append(nxt)
        logprobs.append(logp.gather(1, nxt))
        ids, start = nxt, start + t
    return torch.cat(tokens, 1), torch.cat(logprobs, 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--precision", default="fp16", choices=("fp32", "fp16", "bf16"))
    parser.add_argument("--weights-16", action="store_true",
                        help="hold the weights in the 16-bit dtype instead of fp32")
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("generate.py: no CUDA device visible; pass --device cpu", file=sys.stderr)
        return 1
    torch.manual_seed(0)
    context = args.prompt_len + args.max_tokens
    model = Decoder(args.vocab, args.hidden, args.intermediate, args.layers, args.heads,
                    args.kv_heads, context, rope_theta=1e6, tie_word_embeddings=True,
                    qkv_bias=True, attention="sdpa").to(device)
    dtype = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}[args.precision]
    if dtype is not None and args.weights_16:
        model = model.to(dtype)
    autocast = (torch.autocast(device.type, dtype=dtype) if dtype is not None and
                not args.weights_16 else contextlib.nullcontext())
    prompts = torch.randint(0, args.vocab, (args.prompts, args.prompt_len), device=device)
    generator = torch.Generator(device=device)
    generator.manual_seed(1)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {name}  torch {torch.__version__}  threads {torch.get_num_threads()}")
    print(f"generate: decoder vocab {args.vocab}, hidden {args.hidden}, {args.layers} layers, "
          f"{args.heads} heads / {args.kv_heads} kv heads; {args.prompts} prompts x "
          f"{args.prompt_len} tokens, {args.max_tokens} new tokens each, {args.precision}"
          f"{' (16-bit weights)' if args.weights_16 else ''}, KV cache, eager")
    times = []
    with autocast:
        for i in range(args.repeats + 1):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            tokens, _ = generate(model, prompts, args.max_tokens, dtype, generator)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i > 0:  # the first call warms up
                times.append(time.perf_counter() - t0)
    median = statistics.median(times)
    sampled = tokens.numel()
    print(f"{args.precision:5s} sample median {median * 1e3:9.3f} ms  "
          f"{sampled / median:10.0f} sampled tokens/s  ({sampled} tokens a call)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
