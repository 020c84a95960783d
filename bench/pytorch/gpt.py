#!/usr/bin/env python3
"""PyTorch peer of ampd's GPT benchmarks: a nanoGPT-style GPT-2, timed per step.

Model: GPT-2 as Hugging Face's GPT2LMHeadModel lays it out (parameter names
transformer.wte / wpe / h.{i}.ln_1 / attn.c_attn / attn.c_proj / ln_2 /
mlp.c_fc / mlp.c_proj / ln_f, lm_head tied to wte; the Conv1D weights stored
(in, out)): learned positions, pre-LayerNorm blocks with causal multi-head
self-attention (F.scaled_dot_product_attention(is_causal=True) where torch
has it, a masked softmax otherwise), GELU with the tanh approximation, final
LayerNorm, LM head, mean token cross-entropy (targets of -100 ignored).
nanoGPT's initialisation: normal(0, 0.02), the residual projections
normal(0, 0.02 / sqrt(2 n_layer)), zero biases.

Step: zero_grad, forward under torch.autocast (fp16 with a GradScaler, bf16
without one; fp32 without autocast, TF32 off as in ampd), backward, AdamW
(fused=True on CUDA where torch has it; lr 6e-4, betas (0.9, 0.95), weight
decay 0.1 on every parameter), synchronised. --compile wraps the model in
torch.compile. Defaults are GPT-2 small (124M parameters with vocab 50304),
micro-batch 8 x 1024 tokens.

FLOPs per step: 6 N tokens + 12 n_layer T d_model tokens (the causal
attention's QK^T and PV, forward and backward, counted over the full T x T
square as nanoGPT does), where N counts every parameter except the position
embedding (a lookup, no multiply; the tied wte is counted once, as the LM
head's GEMM). MFU divides the achieved FLOP/s by --peak-tflops (default
989.4, an H100 SXM's dense bf16; on CPU pass a figure or MFU is not shown).

Usage: python3 gpt.py [--vocab 50304] [--context 1024] [--d-model 768]
           [--n-layer 12] [--n-head 12] [--batch 8] [--seq-len 1024]
           [--steps 20] [--warmup 5] [--device cuda] [--precisions bf16,fp16]
           [--compile] [--attention auto|sdpa|manual] [--peak-tflops 989.4]
"""

import argparse
import contextlib
import math
import statistics
import sys
import time

import torch
from torch import nn

from amp_compat import autocast_supported, make_scaler
from torch.nn import functional as F

H100_SXM_BF16_DENSE_TFLOPS = 989.4


class Conv1D(nn.Module):
    """Hugging Face's Conv1D: a linear layer whose weight is stored (in, out)."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape[:-1] + (self.weight.shape[1],)
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(shape)


def has_sdpa() -> bool:
    return hasattr(F, "scaled_dot_product_attention")


class Attention(nn.Module):
    def __init__(self, d_model: int, n_head: int, context: int, attention: str):
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"n_head {n_head} does not divide d_model {d_model}")
        self.n_head = n_head
        self.c_attn = Conv1D(d_model, 3 * d_model)
        self.c_proj = Conv1D(d_model, d_model)
        self.use_sdpa = attention == "sdpa" or (attention == "auto" and has_sdpa())
        if not self.use_sdpa:
            # A buffer that is not part of the state dict, unlike GPT-2's old attn.bias.
            mask = torch.tril(torch.ones(context, context, dtype=torch.bool))
            self.register_buffer("causal", mask.view(1, 1, context, context), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        hs = c // self.n_head
        q = q.view(b, t, self.n_head, hs).transpose(1, 2)  # (B, H, T, hs)
        k = k.view(b, t, self.n_head, hs).transpose(1, 2)
        v = v.view(b, t, self.n_head, hs).transpose(1, 2)
        if self.use_sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
            att = att.masked_fill(~self.causal[:, :, :t, :t], float("-inf"))
            y = F.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Mlp(nn.Module):
    def __init__(self, d_model: int, mlp_ratio: int):
        super().__init__()
        self.c_fc = Conv1D(d_model, mlp_ratio * d_model)
        self.c_proj = Conv1D(mlp_ratio * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, d_model, n_head, context, mlp_ratio, eps, attention):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model, eps=eps)
        self.attn = Attention(d_model, n_head, context, attention)
        self.ln_2 = nn.LayerNorm(d_model, eps=eps)
        self.mlp = Mlp(d_model, mlp_ratio)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2 with Hugging Face's state dict names; forward returns the mean
    token cross-entropy of (B, T) ids against (B, T) targets (-100 ignored)."""

    def __init__(self, vocab_size: int, context_length: int, d_model: int, n_layer: int,
                 n_head: int, mlp_ratio: int = 4, layer_norm_eps: float = 1e-5,
                 tie_embeddings: bool = True, attention: str = "auto"):
        super().__init__()
        if attention not in ("auto", "sdpa", "manual"):
            raise ValueError(f"attention must be auto, sdpa or manual, not {attention!r}")
        if attention == "sdpa" and not has_sdpa():
            raise ValueError(f"torch {torch.__version__} has no F.scaled_dot_product_attention")
        self.context_length = context_length
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, d_model),
            wpe=nn.Embedding(context_length, d_model),
            h=nn.ModuleList([Block(d_model, n_head, context_length, mlp_ratio, layer_norm_eps,
                                   attention) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(d_model, eps=layer_norm_eps),
        ))
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        if tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        residual_std = 0.02 / math.sqrt(2 * n_layer)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=residual_std)
            elif name.endswith(("c_attn.weight", "c_fc.weight", "wte.weight", "wpe.weight",
                                "lm_head.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            # LayerNorm weights keep their ones.

    def num_flop_params(self) -> int:
        """Parameters that take part in a multiply: all but the position embedding."""
        return sum(p.numel() for p in self.parameters()) - self.transformer.wpe.weight.numel()

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """(B, T, V) logits of (B, T) ids."""
        t = ids.shape[1]
        if t > self.context_length:
            raise ValueError(f"sequence length {t} exceeds the context {self.context_length}")
        pos = torch.arange(t, device=ids.device)
        x = self.transformer.wte(ids) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.logits(ids)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1),
                               ignore_index=-100)


def make_optimizer(model: nn.Module, device: torch.device, trainable_only: bool = False,
                   **kwargs) -> torch.optim.Optimizer:
    """AdamW over the model's parameters (those with requires_grad alone when
    trainable_only, as a LoRA fine-tune's), fused on CUDA where torch has it."""
    params = [p for p in model.parameters() if p.requires_grad or not trainable_only]
    if device.type == "cuda":
        try:
            return torch.optim.AdamW(params, fused=True, **kwargs)
        except (TypeError, RuntimeError):  # torch without the fused kernel
            pass
    return torch.optim.AdamW(params, **kwargs)


def flops_per_token(n_params: int, n_layer: int, seq_len: int, d_model: int) -> float:
    return 6.0 * n_params + 12.0 * n_layer * seq_len * d_model


def time_precision(args, precision: str, device: torch.device):
    torch.manual_seed(0)
    model = GPT(args.vocab, args.context, args.d_model, args.n_layer, args.n_head,
                attention=args.attention).to(device)
    opt = make_optimizer(model, device, lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
    step_model = torch.compile(model) if args.compile else model
    dtype = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    scaler = make_scaler(device, enabled=(precision == "fp16"))
    ids = torch.randint(0, args.vocab, (args.batch, args.seq_len), device=device)
    targets = torch.randint(0, args.vocab, (args.batch, args.seq_len), device=device)
    times, loss = [], None
    for i in range(args.warmup + args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        autocast = (torch.autocast(device.type, dtype=dtype) if dtype is not None
                    else contextlib.nullcontext())
        with autocast:
            loss = step_model(ids, targets)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    n_params = model.num_flop_params()
    final_loss = float(loss)
    del step_model, model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return statistics.median(times), n_params, final_loss


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--n-layer", type=int, default=12)
    parser.add_argument("--n-head", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=0, help="tokens per sequence; 0: --context")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--precisions", default="bf16,fp16")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--attention", default="auto", choices=("auto", "sdpa", "manual"))
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="dense peak for MFU; default 989.4 (H100 SXM bf16) on CUDA")
    parser.add_argument("--threads", type=int, default=0,
                        help="CPU threads for torch (torch.set_num_threads); 0 keeps its default")
    args = parser.parse_args()
    if args.seq_len == 0:
        args.seq_len = args.context
    if args.seq_len > args.context:
        print(f"gpt.py: --seq-len {args.seq_len} exceeds --context {args.context}",
              file=sys.stderr)
        return 2
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpt.py: no CUDA device visible; pass --device cpu", file=sys.stderr)
        return 1
    if args.compile and not hasattr(torch, "compile"):
        print(f"gpt.py: torch {torch.__version__} has no torch.compile", file=sys.stderr)
        return 1
    peak = args.peak_tflops
    if peak is None and device.type == "cuda":
        peak = H100_SXM_BF16_DENSE_TFLOPS
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    attention = ("sdpa" if args.attention == "sdpa" or (args.attention == "auto" and has_sdpa())
                 else "manual")
    tokens = args.batch * args.seq_len
    print(f"device: {name}  torch {torch.__version__}  threads {torch.get_num_threads()}")
    print(f"gpt: vocab {args.vocab}, context {args.context}, d_model {args.d_model}, "
          f"{args.n_layer} layers, {args.n_head} heads, batch {args.batch} x {args.seq_len} "
          f"tokens, AdamW, attention {attention}{', torch.compile' if args.compile else ''}"
          f"{'' if peak is None else f', peak {peak:.1f} TFLOP/s'}")
    for precision in args.precisions.split(","):
        if precision not in ("fp32", "fp16", "bf16"):
            print(f"gpt.py: unknown precision {precision!r}", file=sys.stderr)
            return 2
        if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            print(f"{precision}: not supported on this device")
            continue
        if precision != "fp32" and not autocast_supported(
                device, {"fp16": torch.float16, "bf16": torch.bfloat16}[precision]):
            print(f"{precision}: autocast does not support it on {device.type} in this torch")
            continue
        median, n_params, final_loss = time_precision(args, precision, device)
        flops = flops_per_token(n_params, args.n_layer, args.seq_len, args.d_model) * tokens
        tflops = flops / median / 1e12
        mfu = "MFU n/a" if peak is None else f"MFU {100.0 * tflops / peak:5.1f}%"
        print(f"{precision:5s} step median {median * 1e3:9.3f} ms  {tokens / median:10.0f} "
              f"tokens/s  {tflops:7.2f} TFLOP/s  {mfu}  ({n_params} params, "
              f"loss {final_loss:.4f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
