#!/usr/bin/env python3
"""PyTorch reference for ampd's engine benchmark: the same MLP, timed per step.

Model: 4 x (Linear 1024 -> 1024), GELU (exact erf) between them, batch 256,
MSE loss, AdamW; fp16/bf16 under torch.amp.autocast with a GradScaler for
fp16 (bf16 needs no loss scaling), fp32 without autocast. TF32 is disabled
so the fp32 row is true fp32, as in ampd (whose Backend has no TF32 switch).

Prints the median step time (forward + backward + optimizer step, measured
with torch.cuda.synchronize around each step) per precision, so it can be
set beside ampd's engine benchmark on the same GPU.

--host-batch feeds each step its batch from host memory (pinned, copied
with non_blocking=True inside the timed step), as ampd receives a batch with
every Step; by default the batch stays on the device.

Usage: python3 amp_mlp.py [--steps 200] [--warmup 20] [--device cuda] [--threads N]
                          [--host-batch]
"""

import argparse
import contextlib
import statistics
import sys
import time

import torch
from torch import nn

from amp_compat import autocast_supported, make_scaler

WIDTH = 1024
LAYERS = 4
BATCH = 256


def make_model(device: torch.device) -> nn.Module:
    layers = []
    for i in range(LAYERS):
        layers.append(nn.Linear(WIDTH, WIDTH))
        if i + 1 < LAYERS:
            layers.append(nn.GELU())  # approximate='none': the erf form
    return nn.Sequential(*layers).to(device)


def time_precision(precision: str, device: torch.device, steps: int, warmup: int,
                   host_batch: bool = False) -> float:
    torch.manual_seed(0)
    model = make_model(device)  # fp32 master weights, as ampd keeps them
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    dtype = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    scaler = make_scaler(device, enabled=(precision == "fp16"))
    x = torch.randn(BATCH, WIDTH, device=device)
    y = torch.randn(BATCH, WIDTH, device=device)
    if host_batch:
        x_host, y_host = x.cpu(), y.cpu()
        if device.type == "cuda":
            x_host, y_host = x_host.pin_memory(), y_host.pin_memory()
    loss_fn = nn.MSELoss()
    times = []
    for i in range(warmup + steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if host_batch:
            x = x_host.to(device, non_blocking=True)
            y = y_host.to(device, non_blocking=True)
        # fp32: no autocast context at all (torch 1.13's CPU autocast rejects
        # a float32 dtype even when disabled).
        autocast = (torch.autocast(device.type, dtype=dtype) if dtype is not None
                    else contextlib.nullcontext())
        with autocast:
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--threads", type=int, default=0,
                        help="CPU threads for torch (torch.set_num_threads); 0 keeps its default")
    parser.add_argument("--host-batch", action="store_true",
                        help="copy each step's batch from pinned host memory inside the step")
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("amp_mlp.py: no CUDA device visible; pass --device cpu to time on the CPU",
              file=sys.stderr)
        return 1
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {name}  torch {torch.__version__}  threads {torch.get_num_threads()}")
    print(f"MLP {LAYERS} x Linear({WIDTH}) + GELU, batch {BATCH}, MSE, AdamW")
    for precision in ("fp32", "fp16", "bf16"):
        if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            print(f"{precision}: not supported on this device")
            continue
        if precision == "fp16" and not autocast_supported(device, torch.float16):
            print(f"{precision}: autocast does not support it on {device.type} in this torch")
            continue
        median = time_precision(precision, device, args.steps, args.warmup, args.host_batch)
        print(f"{precision}: median step {median * 1e3:.3f} ms over {args.steps} steps"
              + (" (batch from host)" if args.host_batch else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
