"""transformers' `generate` on a GPT-2 (GPT2Config) or Qwen2 (Qwen2Config)
model of the given shape, random weights (built from the config, nothing
downloaded): the library peer of ampd's Sample and of
bench/pytorch/generate.py's hand-written KV-cache loop.

The model is held in the precision's dtype (fp16 or bf16; fp32 as is), eager
(no torch.compile), attention --attention (sdpa, transformers' default, or
eager). generate(do_sample=True, temperature, top_k=0, top_p=1,
max_new_tokens=T, min_new_tokens=T, use_cache=True): every sequence runs
all T tokens (the end-of-sequence token is masked until then), as ampd's
Sample without stop tokens does. It returns no log-probs (ampd's Sample
does; asking transformers for its scores would keep S x V logits a token).
Prints, per precision, the median over --repeats (after one warm-up call)
of the call's generated tokens/s, in bench/service/sample_bench.py's form.
Without transformers it prints "skipped: transformers not installed" and
exits 0: the CPU check machine has none.

  python3 bench/pytorch/hf_generate.py [--device cuda] [--model decoder]
      [--precisions fp16,bf16] [--vocab V --hidden C --layers L --heads H]
      [--intermediate I --kv-heads K] [--prompts 16 --prompt-len 32
       --max-tokens 64] [--temperature 1] [--repeats 5] [--attention sdpa]
"""

import argparse
import contextlib
import importlib.util
import statistics
import sys
import time

import sampling_args  # bench/pytorch, beside this file


def make_config(transformers, args):
    context = args.prompt_len + args.max_tokens
    if args.model == "gpt":
        # GPT-2: tanh GELU (gelu_new), LayerNorm eps 1e-5, tied head; no dropout at eval.
        return transformers.GPT2Config(vocab_size=args.vocab, n_positions=context,
                                       n_embd=args.hidden, n_layer=args.layers,
                                       n_head=args.heads, tie_word_embeddings=True,
                                       bos_token_id=0, eos_token_id=args.vocab - 1)
    config = transformers.Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden,
                                      intermediate_size=args.intermediate,
                                      num_hidden_layers=args.layers,
                                      num_attention_heads=args.heads,
                                      num_key_value_heads=args.kv_heads,
                                      max_position_embeddings=context,
                                      tie_word_embeddings=True, use_sliding_window=False,
                                      bos_token_id=0, eos_token_id=args.vocab - 1)
    # Qwen2.5's rope_theta 1e6: transformers 5 keeps it in rope_parameters,
    # older ones as rope_theta (set after construction: neither spelling is
    # taken by both).
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict):
        config.rope_parameters = dict(rope, rope_theta=1e6)
    else:
        config.rope_theta = 1e6
    return config


def rope_theta(config):
    rope = getattr(config, "rope_parameters", None)
    return rope.get("rope_theta") if isinstance(rope, dict) else getattr(config, "rope_theta", None)


def build(torch, transformers, args, device, dtype):
    config = make_config(transformers, args)
    torch.manual_seed(0)
    # Initialised where it runs (torch >= 2 has device contexts): a 0.5B
    # model's random init on the host alone takes seconds.
    with device if hasattr(device, "__enter__") else contextlib.nullcontext():
        try:
            model = transformers.AutoModelForCausalLM.from_config(
                config, attn_implementation=args.attention)
        except TypeError:  # transformers before 4.36: no attn_implementation
            model = transformers.AutoModelForCausalLM.from_config(config)
    if args.model == "decoder" and rope_theta(model.config) != 1e6:
        raise RuntimeError(f"rope_theta {rope_theta(model.config)} after construction, not 1e6")
    return model.to(device=device, dtype=dtype).eval()


def time_precision(torch, transformers, args, precision, device):
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    model = build(torch, transformers, args, device, dtype)
    torch.manual_seed(1)
    prompts = torch.randint(0, args.vocab - 1, (args.prompts, args.prompt_len), device=device)
    mask = torch.ones_like(prompts)
    sampling = (dict(do_sample=True, temperature=args.temperature, top_k=0, top_p=1.0)
                if args.temperature > 0 else dict(do_sample=False))
    times, generated = [], 0
    with torch.no_grad():
        for i in range(args.repeats + 1):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model.generate(prompts, attention_mask=mask, max_new_tokens=args.max_tokens,
                                 min_new_tokens=args.max_tokens, use_cache=True,
                                 pad_token_id=0, **sampling)
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - t0
            generated = out[:, args.prompt_len:].numel()
            if generated != args.prompts * args.max_tokens:
                raise RuntimeError(f"{generated} tokens generated, expected {args.prompts} x "
                                   f"{args.max_tokens}")
            if i > 0:  # the first call warms up
                times.append(elapsed)
    return statistics.median(times), generated


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sampling_args.add_arguments(parser)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--attention", default="sdpa", choices=("sdpa", "eager"))
    parser.add_argument("--threads", type=int, default=0)
    args, precisions = sampling_args.parse(parser, "hf_generate.py")
    if args is None:
        return 2
    # The CPU check machine has torch without transformers: say so, do not
    # fail, and do not spend seconds importing torch first.
    for module in ("transformers", "torch"):
        if importlib.util.find_spec(module) is None:
            print(f"skipped: {module} not installed")
            return 0
    import torch
    import transformers
    transformers.logging.set_verbosity_error()
    device, name = sampling_args.torch_device(torch, args, "hf_generate.py")
    if device is None:
        return 1
    shape = sampling_args.describe(args)
    print(f"device: {name}  torch {torch.__version__}  transformers {transformers.__version__}  "
          f"threads {torch.get_num_threads()}")
    print(f"hf generate: {shape}; {args.prompts} prompts x {args.prompt_len} tokens, "
          f"{args.max_tokens} new tokens each, temperature {args.temperature:g}, top_k 0, "
          f"weights in the precision's dtype, {args.attention} attention, eager; median of "
          f"{args.repeats} after one warm-up call")
    for precision in precisions:
        if sampling_args.bf16_unsupported(torch, device, precision):
            continue
        sampling_args.report(precision, *time_precision(torch, transformers, args, precision,
                                                        device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
