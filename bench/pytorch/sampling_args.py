"""The command line the sampling benchmarks share: ampd's Sample
(bench/service/sample_bench.py), the hand-written PyTorch KV-cache loop
(generate.py) and transformers' generate (hf_generate.py) take the same
model shapes, prompt counts and precisions, so that each gpu-check row
compares the same work. Imports nothing beyond the standard library (the
CPU check machine runs it without transformers, and the service benchmark
without torch)."""

import sys

PRECISIONS = ("fp32", "fp16", "bf16")

# (vocab, hidden, layers, heads, intermediate, kv_heads): GPT-2 small with
# the GPT benchmarks' padded vocab, and Qwen2.5-0.5B.
DEFAULTS = {"gpt": (50304, 768, 12, 12, None, None),
            "decoder": (151936, 896, 24, 14, 4864, 2)}
_SHAPE = ("vocab", "hidden", "layers", "heads", "intermediate", "kv_heads")


def add_arguments(parser):
    """The shared arguments (each tool adds its own)."""
    parser.add_argument("--model", default="decoder", choices=sorted(DEFAULTS))
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--hidden", type=int, help="the GPT's d_model or the decoder's hidden")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--intermediate", type=int, help="the decoder's MLP width")
    parser.add_argument("--kv-heads", type=int, help="the decoder's K/V heads")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--precisions", "--precision", default="fp16",
                        help="comma-separated: fp32, fp16, bf16")


def parse(parser, tool):
    """Parsed arguments with the model's default shape filled in, and the
    precisions as a list; None (after saying why) for an unknown precision."""
    args = parser.parse_args()
    for name, value in zip(_SHAPE, DEFAULTS[args.model]):
        if getattr(args, name) is None:
            setattr(args, name, value)
    precisions = args.precisions.split(",")
    for precision in precisions:
        if precision not in PRECISIONS:
            print(f"{tool}: unknown precision {precision!r}", file=sys.stderr)
            return None, None
    return args, precisions


def describe(args):
    """The model's shape in one phrase, the same in every tool's output."""
    if args.model == "gpt":
        return (f"gpt vocab {args.vocab}, d_model {args.hidden}, {args.layers} layers, "
                f"{args.heads} heads")
    return (f"decoder vocab {args.vocab}, hidden {args.hidden}, intermediate "
            f"{args.intermediate}, {args.layers} layers, {args.heads} heads / "
            f"{args.kv_heads} kv heads")


def report(precision, median, tokens):
    """The result line every sampling tool prints, the form
    scripts/gpu_check_report.py reads: median seconds of a call that
    generated `tokens` tokens."""
    print(f"{precision:5s} sample median {median * 1e3:9.3f} ms  "
          f"{tokens / median:10.0f} sampled tokens/s  ({tokens} tokens a call)")


def torch_device(torch, args, tool):
    """A PyTorch peer's device (after --threads) and its name; (None, None),
    after saying why, when CUDA is asked for and none is visible."""
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"{tool}: no CUDA device visible; pass --device cpu", file=sys.stderr)
        return None, None
    return device, torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def bf16_unsupported(torch, device, precision):
    """Whether `precision` is bf16 on a CUDA device without it (said so)."""
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        print(f"{precision}: not supported on this device")
        return True
    return False
