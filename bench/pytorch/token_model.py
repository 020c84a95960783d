#!/usr/bin/env python3
"""PyTorch peer of ampd_bench_service's token model, timed per step.

Model: Embedding(V, D), depth x (Linear D->D, GELU exact), Linear D->V,
cross-entropy over T tokens a step (random ids and targets), AdamW(lr 1e-4)
with fused=True where available; fp16 under torch.autocast with a
GradScaler, bf16 under autocast without one, fp32 without autocast (TF32
off, as in ampd). Defaults are the 335M-parameter model of the H100
comparison: V 32768, D 4096, depth 4, T 8192.

TFLOP/s counts the GEMMs only, 6 x (Linear parameters) x T, the same
count ampd_bench_service prints. Prints the median step time (forward,
backward, optimizer step, synchronised) per precision.

Usage: python3 token_model.py [--vocab 32768] [--width 4096] [--depth 4]
           [--tokens 8192] [--steps 20] [--warmup 3] [--device cuda]
           [--precisions fp16,bf16,fp32]
"""

import argparse
import contextlib
import statistics
import sys
import time

import torch
from torch import nn

from amp_compat import autocast_supported, make_scaler


def make_model(vocab: int, width: int, depth: int, device: torch.device) -> nn.Module:
    layers = [nn.Embedding(vocab, width)]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    layers.append(nn.Linear(width, vocab))
    return nn.Sequential(*layers).to(device)


def make_optimizer(model: nn.Module, device: torch.device) -> torch.optim.Optimizer:
    if device.type == "cuda":
        try:
            return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        except (TypeError, RuntimeError):
            pass
    return torch.optim.AdamW(model.parameters(), lr=1e-4)


def time_precision(args, precision: str, device: torch.device) -> float:
    torch.manual_seed(0)
    model = make_model(args.vocab, args.width, args.depth, device)
    opt = make_optimizer(model, device)
    dtype = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    scaler = make_scaler(device, enabled=(precision == "fp16"))
    ids = torch.randint(0, args.vocab, (args.tokens,), device=device)
    targets = torch.randint(0, args.vocab, (args.tokens,), device=device)
    loss_fn = nn.CrossEntropyLoss()
    times = []
    for i in range(args.warmup + args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        # fp32 runs outside autocast: older CPU autocast refuses any dtype but bf16.
        autocast = (torch.autocast(device.type, dtype=dtype) if dtype is not None
                    else contextlib.nullcontext())
        with autocast:
            loss = loss_fn(model(ids), targets)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    del model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--precisions", default="fp16,bf16,fp32")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("token_model.py: no CUDA device visible; pass --device cpu", file=sys.stderr)
        return 1
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    linear_params = args.depth * args.width * args.width + args.width * args.vocab
    print(f"device: {name}  torch {torch.__version__}")
    print(f"token model: Embedding({args.vocab}, {args.width}), {args.depth} x (Linear "
          f"{args.width}->{args.width}, GELU), Linear {args.width}->{args.vocab}, "
          f"cross-entropy, {args.tokens} tokens/step")
    for precision in args.precisions.split(","):
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
        if dtype is not None and not autocast_supported(device, dtype):
            print(f"{precision}: autocast does not support it on {device.type} in this torch")
            continue
        median = time_precision(args, precision, device)
        tflops = 6.0 * linear_params * args.tokens / median / 1e12
        print(f"{precision:5s} step median {median * 1e3:9.3f} ms  {tflops:8.1f} TFLOP/s  "
              f"{args.tokens / median:10.0f} rows/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
