"""PyTorch's causal attention, forward and backward, at the shape of
bench/cuda/attention_bench.cc (one GPT-2 small layer: B = 8, T = 1024, 12
heads of 64), in bf16 and fp16: the peer of ampd's fused attention kernels
in scripts/gpu-check.sh.

torch.nn.functional.scaled_dot_product_attention with is_causal=True, on
the flash backend where the device has it (sdpa_kernel pins it, so the
figure is FlashAttention-2's as PyTorch ships it, not whichever backend
the dispatcher prefers), else on whatever backend is available, and with
the softmax written out where torch predates SDPA (Debian's 1.13, in
gpu-check's CPU --quick mode, which only keeps this script running). The backward is timed alone: a forward
outside the timed region builds the graph, then out.backward(dout,
retain_graph=True) is timed. Medians of --runs, device events on a GPU.

Prints one line per dtype, in the form gpu_check_report.py reads:
  attention B=8 T=1024 H=12 D=64 bf16, sdpa flash: forward 0.412 ms (167 TFLOP/s), backward ...
"""
import argparse
import statistics
import sys
import time

import torch


def timed_ms(fn, runs: int, device: str) -> float:
    """Median milliseconds of fn() over runs calls, after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(runs):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("attention.py: no CUDA device visible", file=sys.stderr)
        return 1
    b, t, h, d = args.batch, args.seq, args.heads, args.head_dim
    # The causal products as flash-attention counts them: 2 GEMMs of
    # 2 B H T^2 D flops, halved by the mask; the backward 2.5 times that.
    fwd_flop = 2.0 * 2.0 * b * h * t * t * d / 2
    sdpa = getattr(torch.nn.functional, "scaled_dot_product_attention", None)
    backend = "math" if sdpa is not None else "manual"
    context = None
    if args.device == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backend = "flash"
        context = lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION)  # noqa: E731
    gen = torch.Generator(device=args.device).manual_seed(1)
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        # (B, H, T, D), as SDPA takes them.
        q, k, v = (torch.randn(b, h, t, d, device=args.device, dtype=dtype, generator=gen)
                   .requires_grad_() for _ in range(3))
        dout = torch.randn(b, h, t, d, device=args.device, dtype=dtype, generator=gen)

        def forward():
            if sdpa is not None:
                return sdpa(q, k, v, is_causal=True)
            scores = (q @ k.transpose(-2, -1)) * d ** -0.5  # (B, H, T, T)
            mask = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
            return scores.masked_fill(mask, float("-inf")).softmax(-1) @ v

        def run(fn):
            if context is None:
                return fn()
            with context():
                return fn()

        try:
            fwd = timed_ms(lambda: run(forward), args.runs, args.device)
        except RuntimeError as e:  # e.g. no fp16 matmul in an old torch on the CPU
            print(f"attention B={b} T={t} H={h} D={d} {name}: skipped: {e}", flush=True)
            continue
        out = run(forward)
        bwd = timed_ms(lambda: run(lambda: out.backward(dout, retain_graph=True)), args.runs,
                       args.device)
        print(f"attention B={b} T={t} H={h} D={d} {name}, sdpa {backend}: forward {fwd:.3f} ms "
              f"({fwd_flop / fwd / 1e9:.0f} TFLOP/s), backward {bwd:.3f} ms "
              f"({2.5 * fwd_flop / bwd / 1e9:.0f} TFLOP/s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
