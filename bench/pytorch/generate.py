"""PyTorch's KV-cache generation loop over bench/pytorch/gpt.py's GPT
(--model gpt) or bench/pytorch/decoder.py's Decoder (--model decoder): the
peer of ampd's Sample for the same shapes.

Prefill over the (S, P) prompts, then one token per sequence at a time
against per-layer K/V caches (the keys and values of every position so far;
the decoder's RoPE applied at each row's own position, the GPT's learned
position embedding looked up at it), the LM head's logits, a draw from
softmax(logits / temperature) (torch.multinomial) and each token's log-prob
at temperature 1 (what ampd's Sample returns), under torch.autocast in the
given precision with the weights in fp32 (as a training job's master) or,
--weights-16, in the 16-bit dtype (as transformers' generate with
torch_dtype, and ampd's 16-bit working copy). Prints, per precision, the
median over --repeats (after one warm-up call) of the whole call's sampled
tokens/s, as ampd's bench/service/sample_bench.py does; only generated
tokens count.

  python3 bench/pytorch/generate.py [--device cuda] [--model decoder]
      [--precisions fp16,bf16] [--weights-16] [--vocab V --hidden C --layers L
       --heads H] [--intermediate I --kv-heads K] [--prompts 16 --prompt-len 32
       --max-tokens 64] [--temperature 1] [--repeats 5]

Shapes default to the model's full size: GPT-2 small (vocab 50304, 768 wide,
12 layers, 12 heads) or Qwen2.5-0.5B (vocab 151936, hidden 896, intermediate
4864, 24 layers, 14 heads / 2 K/V heads; tied, q/k/v biases, rope_theta 1e6).
A precision this torch cannot run on the device (fp16 on an older torch's
CPU) prints "PRECISION: not supported ..." and is skipped.
"""

import argparse
import contextlib
import math
import statistics
import sys
import time

import torch
from torch.nn import functional as F

from amp_compat import autocast_supported
from decoder import Decoder, repeat_kv, rotate_half
from gpt import GPT
import sampling_args

DTYPES = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def rotary(model, positions, dtype):
    """cos, sin (S, 1, T, D) for positions (S, T), Hugging Face's form."""
    freqs = positions.float()[..., None] * model.inv_freq[None, None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def attention(q, cache, k, v, start, groups):
    """softmax(q K^T / sqrt(D)) V of q (S, H, T, D) at positions start..
    over the cache (keys, values) of (S, Hkv, max, D), after writing this
    step's k, v (S, Hkv, T, D) into it at start.."""
    t = q.shape[2]
    cache[0][:, :, start:start + t] = k
    cache[1][:, :, start:start + t] = v
    keys = repeat_kv(cache[0][:, :, :start + t], groups)
    values = repeat_kv(cache[1][:, :, :start + t], groups)
    if hasattr(F, "scaled_dot_product_attention"):
        # is_causal masks from the top left: right for the prefill (start 0),
        # and a single new row sees every cached position.
        return F.scaled_dot_product_attention(q, keys, values, is_causal=(t > 1))
    # torch < 2.0: the same masked softmax by hand.
    att = (q @ keys.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    if t > 1:
        mask = torch.ones(t, start + t, dtype=torch.bool, device=q.device).tril(start)
        att = att.masked_fill(~mask, float("-inf"))
    return F.softmax(att.float(), dim=-1).to(q.dtype) @ values


def decoder_rows(model, ids, start, caches, dtype):
    """The decoder's final-norm output (S, C) of the last of ids (S, T) at
    positions start.., its K/V caches filled in place."""
    s, t = ids.shape
    positions = torch.arange(start, start + t, device=ids.device).expand(s, t)
    cos, sin = rotary(model, positions, dtype)
    x = model.model.embed_tokens(ids)
    for layer, cache in zip(model.model.layers, caches):
        a = layer.self_attn
        h = layer.input_layernorm(x)
        q = a.q_proj(h).view(s, t, a.heads, a.head_dim).transpose(1, 2)
        k = a.k_proj(h).view(s, t, a.kv_heads, a.head_dim).transpose(1, 2)
        v = a.v_proj(h).view(s, t, a.kv_heads, a.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        y = attention(q, cache, k, v, start, a.heads // a.kv_heads)
        x = x + a.o_proj(y.transpose(1, 2).reshape(s, t, a.heads * a.head_dim))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.model.norm(x[:, -1])


def gpt_rows(model, ids, start, caches, dtype):
    """The GPT's final-LayerNorm output (S, C) of the last of ids (S, T) at
    positions start.., its K/V caches filled in place."""
    del dtype  # learned positions: nothing to build in the compute dtype
    s, t = ids.shape
    tr = model.transformer
    x = tr.wte(ids) + tr.wpe(torch.arange(start, start + t, device=ids.device))
    for block, cache in zip(tr.h, caches):
        a = block.attn
        c = x.shape[-1]
        hs = c // a.n_head
        q, k, v = (z.view(s, t, a.n_head, hs).transpose(1, 2)
                   for z in a.c_attn(block.ln_1(x)).split(c, dim=2))
        y = attention(q, cache, k, v, start, 1)
        x = x + a.c_proj(y.transpose(1, 2).reshape(s, t, c))
        x = x + block.mlp(block.ln_2(x))
    return tr.ln_f(x[:, -1])


def cache_heads(model):
    """(K/V heads, head size) of each layer."""
    if isinstance(model, GPT):
        return [(b.attn.n_head, b.attn.c_proj.weight.shape[0] // b.attn.n_head)
                for b in model.transformer.h]
    return [(layer.self_attn.kv_heads, layer.self_attn.head_dim) for layer in model.model.layers]


@torch.no_grad()
def generate(model, prompts, max_tokens, temperature, dtype, generator):
    """(S, P) prompts of one length -> (S, max_tokens) tokens and their
    log-probs at temperature 1."""
    s, p = prompts.shape
    device = prompts.device
    cache_dtype = dtype or torch.float32
    caches = [tuple(torch.empty(s, heads, p + max_tokens, size, device=device, dtype=cache_dtype)
                    for _ in range(2))
              for heads, size in cache_heads(model)]
    rows = gpt_rows if isinstance(model, GPT) else decoder_rows
    tokens, logprobs = [], []
    ids, start = prompts, 0
    for _ in range(max_tokens):
        logits = model.lm_head(rows(model, ids, start, caches, cache_dtype)).float()
        logp = F.log_softmax(logits, dim=-1)
        if temperature == 0:
            nxt = logits.argmax(dim=-1, keepdim=True)
        else:
            probs = logp.exp() if temperature == 1 else F.softmax(logits / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator)
        tokens.append(nxt)
        logprobs.append(logp.gather(1, nxt))
        ids, start = nxt, start + ids.shape[1]
    return torch.cat(tokens, 1), torch.cat(logprobs, 1)


def build(args, device, dtype):
    torch.manual_seed(0)
    context = args.prompt_len + args.max_tokens
    if args.model == "gpt":
        model = GPT(args.vocab, context, args.hidden, args.layers, args.heads)
    else:
        model = Decoder(args.vocab, args.hidden, args.intermediate, args.layers, args.heads,
                        args.kv_heads, context, rope_theta=1e6, tie_word_embeddings=True,
                        qkv_bias=True, attention="sdpa" if hasattr(
                            F, "scaled_dot_product_attention") else "manual")
    model = model.to(device).eval()
    if dtype is not None and args.weights_16:
        model = model.to(dtype)
        if hasattr(model, "inv_freq"):  # RoPE's frequencies stay fp32, as Hugging Face's
            model.inv_freq = model.inv_freq.float()
    return model


def time_precision(args, precision, device):
    """(median seconds, generated tokens a call), or why it cannot run."""
    dtype = DTYPES[precision]
    if dtype is not None and not args.weights_16 and not autocast_supported(device, dtype):
        return f"autocast does not support it on {device.type} in this torch"
    model = build(args, device, dtype)
    autocast = (torch.autocast(device.type, dtype=dtype) if dtype is not None and
                not args.weights_16 else contextlib.nullcontext())
    prompts = torch.randint(0, args.vocab, (args.prompts, args.prompt_len), device=device)
    generator = torch.Generator(device=device)
    generator.manual_seed(1)
    times = []
    with autocast:
        for i in range(args.repeats + 1):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            try:
                tokens, _ = generate(model, prompts, args.max_tokens, args.temperature, dtype,
                                     generator)
            except RuntimeError as e:
                # An older torch's CPU kernels lack 16-bit matmuls ("not
                # implemented for 'Half'"); on a GPU every failure is one.
                if i == 0 and device.type == "cpu" and "not implemented" in str(e):
                    return f"{precision} weights not supported on cpu in this torch ({e})"
                raise
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i > 0:  # the first call warms up
                times.append(time.perf_counter() - t0)
    return statistics.median(times), tokens.numel()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sampling_args.add_arguments(parser)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--weights-16", action="store_true",
                        help="hold the weights in the 16-bit dtype instead of fp32")
    parser.add_argument("--threads", type=int, default=0)
    args, precisions = sampling_args.parse(parser, "generate.py")
    if args is None:
        return 2
    device, name = sampling_args.torch_device(torch, args, "generate.py")
    if device is None:
        return 1
    shape = sampling_args.describe(args)
    print(f"device: {name}  torch {torch.__version__}  threads {torch.get_num_threads()}")
    print(f"generate: {shape}; {args.prompts} prompts x {args.prompt_len} tokens, "
          f"{args.max_tokens} new tokens each, temperature {args.temperature:g}, "
          f"{'16-bit weights' if args.weights_16 else 'autocast over fp32 weights'}, KV cache, "
          f"eager; median of {args.repeats} after one warm-up call")
    for precision in precisions:
        if sampling_args.bf16_unsupported(torch, device, precision):
            continue
        result = time_precision(args, precision, device)
        if isinstance(result, str):
            print(f"{precision}: not supported: {result}")
            continue
        sampling_args.report(precision, *result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
