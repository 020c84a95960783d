#!/usr/bin/env python3
"""PyTorch peer of ampd's decoder benchmarks: a hand-written Llama/Qwen2, timed per step.

Model: Hugging Face's LlamaForCausalLM / Qwen2ForCausalLM as they lay it out
(model.embed_tokens, model.layers.{i}.input_layernorm / self_attn.{q,k,v,o}_proj
/ post_attention_layernorm / mlp.{gate,up,down}_proj, model.norm, lm_head,
Linear weights (out, in)): pre-RMSNorm blocks (RMSNorm in fp32, then cast),
rotary position embeddings in Hugging Face's rotate-half form (inv_freq =
1 / rope_theta^(2i / D) in fp32), grouped-query attention with K/V heads
repeated to the query heads (repeat_kv), causal attention by
F.scaled_dot_product_attention where torch has it or a masked softmax, the
SwiGLU MLP down(silu(gate(x)) * up(x)) without biases, a final RMSNorm, the
LM head (tied to the embedding with tie_word_embeddings) and the mean
token cross-entropy (targets of -100 ignored). Biases: qkv_bias on q/k/v
(Qwen2; Llama's attention_bias), o_bias on o_proj (Llama's attention_bias).
Hugging Face's initialisation: normal(0, initializer_range) for every Linear
and the embedding, zero biases, RMSNorm weights one.

Step: as bench/pytorch/gpt.py's (zero_grad, autocast forward, fp16 with a
GradScaler, backward, AdamW lr 6e-4 betas (0.9, 0.95) weight decay 0.1,
fused on CUDA; TF32 off). Defaults are Qwen2.5-0.5B's shape (24 layers,
hidden 896, 14 heads, 2 K/V heads, intermediate 4864, vocab 151936, tied),
micro-batch 8 x 1024 tokens, random weights.

FLOPs per step: 6 N tokens + 12 L T (H D) tokens (attention's QK^T and PV
over the full T x T square, as gpt.py counts), N every parameter but the
embedding when the head is untied (a lookup); a tied embedding is counted
once, as the LM head's GEMM.

--lora-rank R: a LoRA fine-tune of that model as PEFT users run one: the
base held in the precision's 16-bit dtype (model.to(dtype), as a base
loaded with torch_dtype is), bench/pytorch/lora.py's adapters (rank R,
alpha 2 R, targets q/k/v/o_proj or --lora-targets) left in fp32 (PEFT's
autocast_adapter_dtype default), autocast on, a GradScaler for fp16, and
the same AdamW over the adapters alone. FLOPs per token: 4 N_base (the
frozen base's forward and input gradients; no weight gradients) +
6 N_adapters + the attention's 12 L T (H D).

Usage: python3 decoder.py [--vocab 151936] [--hidden 896] [--intermediate 4864]
           [--layers 24] [--heads 14] [--kv-heads 2] [--batch 8] [--seq-len 1024]
           [--steps 20] [--warmup 5] [--device cuda] [--precisions bf16,fp16]
           [--compile] [--attention auto|sdpa|manual] [--untied] [--peak-tflops 989.4]
           [--lora-rank 16 [--lora-targets q_proj,k_proj,v_proj,o_proj]]
"""

import argparse
import contextlib
import math
import statistics
import sys
import time

import torch
from torch import nn
from torch.nn import functional as F

import lora
from amp_compat import autocast_supported, make_scaler
from gpt import H100_SXM_BF16_DENSE_TFLOPS, has_sdpa, make_optimizer


class RMSNorm(nn.Module):
    """Hugging Face's LlamaRMSNorm: in fp32, cast back, then the weight."""

    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, Hkv, T, D) -> (B, Hkv * groups, T, D), each K/V head repeated."""
    if groups == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None, :, :].expand(b, h, groups, t, d).reshape(b, h * groups, t, d)


class Attention(nn.Module):
    def __init__(self, hidden, heads, kv_heads, head_dim, context, qkv_bias, o_bias, attention):
        super().__init__()
        if heads % kv_heads:
            raise ValueError(f"kv_heads {kv_heads} does not divide heads {heads}")
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=o_bias)
        self.use_sdpa = attention == "sdpa" or (attention == "auto" and has_sdpa())
        if not self.use_sdpa:
            mask = torch.tril(torch.ones(context, context, dtype=torch.bool))
            self.register_buffer("causal", mask.view(1, 1, context, context), persistent=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        groups = self.heads // self.kv_heads
        k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        if self.use_sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
            att = att.masked_fill(~self.causal[:, :, :t, :t], float("-inf"))
            y = F.softmax(att.float(), dim=-1).to(q.dtype) @ v
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class Mlp(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, hidden, intermediate, heads, kv_heads, head_dim, context, eps, qkv_bias,
                 o_bias, attention):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = Attention(hidden, heads, kv_heads, head_dim, context, qkv_bias, o_bias,
                                   attention)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = Mlp(hidden, intermediate)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """A Llama/Qwen2 decoder with Hugging Face's state dict names; forward
    returns the mean token cross-entropy of (B, T) ids against (B, T)
    targets (-100 ignored)."""

    def __init__(self, vocab_size: int, hidden_size: int, intermediate_size: int,
                 num_hidden_layers: int, num_attention_heads: int, num_key_value_heads: int,
                 max_position_embeddings: int, head_dim: int = 0, rms_norm_eps: float = 1e-6,
                 rope_theta: float = 10000.0, tie_word_embeddings: bool = False,
                 initializer_range: float = 0.02, qkv_bias: bool = False, o_bias: bool = False,
                 attention: str = "auto"):
        super().__init__()
        if attention not in ("auto", "sdpa", "manual"):
            raise ValueError(f"attention must be auto, sdpa or manual, not {attention!r}")
        head_dim = head_dim or hidden_size // num_attention_heads
        self.context = max_position_embeddings
        self.tied = tie_word_embeddings
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.model.layers = nn.ModuleList([
            Layer(hidden_size, intermediate_size, num_attention_heads, num_key_value_heads,
                  head_dim, max_position_embeddings, rms_norm_eps, qkv_bias, o_bias, attention)
            for _ in range(num_hidden_layers)])
        self.model.norm = RMSNorm(hidden_size, rms_norm_eps)
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)
        if tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Hugging Face's _compute_default_rope_parameters, in fp32.
        inv_freq = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64)
                                         .float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=initializer_range)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    def num_flop_params(self) -> int:
        """Parameters that take part in a multiply: all but an untied embedding."""
        total = sum(p.numel() for p in self.parameters())
        return total if self.tied else total - self.model.embed_tokens.weight.numel()

    def rotary(self, t: int, device, dtype):
        """cos, sin (1, 1, T, D) as Hugging Face's LlamaRotaryEmbedding gives them."""
        positions = torch.arange(t, device=device, dtype=torch.float32)
        freqs = positions[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[None, None], emb.sin().to(dtype)[None, None]

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """(B, T, V) logits of (B, T) ids."""
        t = ids.shape[1]
        if t > self.context:
            raise ValueError(f"sequence length {t} exceeds max_position_embeddings {self.context}")
        x = self.model.embed_tokens(ids)
        dtype = torch.get_autocast_gpu_dtype() if torch.is_autocast_enabled() else x.dtype
        if ids.device.type == "cpu" and torch.is_autocast_cpu_enabled():
            dtype = torch.get_autocast_cpu_dtype()
        cos, sin = self.rotary(t, ids.device, dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.model.norm(x))

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.logits(ids)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1),
                               ignore_index=-100)


def flops_per_token(n_params: int, layers: int, seq_len: int, attention_width: int,
                    n_frozen: int = 0) -> float:
    """6 per trainable parameter, 4 per frozen one (forward and input
    gradients, no weight gradients), and the attention's QK^T and PV."""
    return 6.0 * n_params + 4.0 * n_frozen + 12.0 * layers * seq_len * attention_width


def time_precision(args, precision: str, device: torch.device):
    """(median step seconds, trainable FLOP parameters, frozen FLOP
    parameters, last loss) of one precision."""
    torch.manual_seed(0)
    dtype = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    model = Decoder(args.vocab, args.hidden, args.intermediate, args.layers, args.heads,
                    args.kv_heads, args.seq_len, rope_theta=1e6, tie_word_embeddings=not args.untied,
                    qkv_bias=True, attention=args.attention)
    if args.lora_rank:
        if dtype is not None:
            # The base as from_pretrained(torch_dtype=...) holds it; the
            # rotary frequencies stay fp32 (Hugging Face computes them so).
            model.to(dtype)
            model.inv_freq = model.inv_freq.float()
        # Adapters in fp32 (nn.Linear's default dtype), as PEFT leaves them.
        lora.apply_lora(model, args.lora_rank, 2.0 * args.lora_rank, args.lora_targets)
    model.to(device)
    opt = make_optimizer(model, device, trainable_only=bool(args.lora_rank), lr=6e-4,
                         betas=(0.9, 0.95), weight_decay=0.1)
    step_model = torch.compile(model) if args.compile else model
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
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = n_params - trainable
    final_loss = float(loss)
    del step_model, model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return statistics.median(times), trainable, frozen, final_loss


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--intermediate", type=int, default=4864)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--heads", type=int, default=14)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--precisions", default="bf16,fp16")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--attention", default="auto", choices=("auto", "sdpa", "manual"))
    parser.add_argument("--untied", action="store_true", help="a separate lm_head")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="dense peak for MFU; default 989.4 (H100 SXM bf16) on CUDA")
    parser.add_argument("--threads", type=int, default=0,
                        help="CPU threads for torch (torch.set_num_threads); 0 keeps its default")
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="LoRA fine-tune of rank R (alpha 2 R, base frozen); 0: full")
    parser.add_argument("--lora-targets", default=",".join(lora.DEFAULT_TARGETS),
                        help="the projections LoRA adapts, comma-separated")
    args = parser.parse_args()
    args.lora_targets = tuple(t for t in args.lora_targets.split(",") if t)
    if args.lora_rank < 0:
        parser.error("--lora-rank must be >= 0")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("decoder.py: no CUDA device visible; pass --device cpu", file=sys.stderr)
        return 1
    if args.compile and not hasattr(torch, "compile"):
        print(f"decoder.py: torch {torch.__version__} has no torch.compile", file=sys.stderr)
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
    head_dim = args.hidden // args.heads
    print(f"device: {name}  torch {torch.__version__}  threads {torch.get_num_threads()}")
    print(f"decoder: vocab {args.vocab}, hidden {args.hidden}, intermediate {args.intermediate}, "
          f"{args.layers} layers, {args.heads} heads / {args.kv_heads} kv heads, "
          f"{'untied' if args.untied else 'tied'}, batch {args.batch} x {args.seq_len} tokens, "
          f"AdamW, attention {attention}{', torch.compile' if args.compile else ''}"
          f"{'' if peak is None else f', peak {peak:.1f} TFLOP/s'}")
    if args.lora_rank:
        print(f"LoRA rank {args.lora_rank}, alpha {2 * args.lora_rank}, targets "
              f"{','.join(args.lora_targets)}: base frozen in the precision's dtype, adapters "
              f"fp32, AdamW over the adapters; FLOPs a token 4 x base + 6 x adapter params + "
              f"attention")
    for precision in args.precisions.split(","):
        if precision not in ("fp32", "fp16", "bf16"):
            print(f"decoder.py: unknown precision {precision!r}", file=sys.stderr)
            return 2
        if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            print(f"{precision}: not supported on this device")
            continue
        if precision != "fp32" and not autocast_supported(
                device, {"fp16": torch.float16, "bf16": torch.bfloat16}[precision]):
            print(f"{precision}: autocast does not support it on {device.type} in this torch")
            continue
        median, n_params, n_frozen, final_loss = time_precision(args, precision, device)
        flops = flops_per_token(n_params, args.layers, args.seq_len,
                                args.heads * head_dim, n_frozen) * tokens
        tflops = flops / median / 1e12
        mfu = "MFU n/a" if peak is None else f"MFU {100.0 * tflops / peak:5.1f}%"
        params = (f"{n_frozen} base + {n_params} adapter params" if args.lora_rank
                  else f"{n_params} params")
        print(f"{precision:5s} step median {median * 1e3:9.3f} ms  {tokens / median:10.0f} "
              f"tokens/s  {tflops:7.2f} TFLOP/s  {mfu}  ({params}, "
              f"loss {final_loss:.4f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
