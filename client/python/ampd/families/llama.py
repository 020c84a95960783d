"""Llama 2 and 3.x (LlamaForCausalLM): RMSNorm, RoPE with rope_scaling
default, linear or llama3, grouped K/V heads, SwiGLU; attention_bias biases
q, k, v and o_proj alike. Refused: mlp_bias."""
from ampd.families import _decoder


def _parts(config):
    bias = bool(config.get("attention_bias", False))
    return dict(qkv_bias=bias, o_bias=bias)


FAMILY = _decoder.family(
    "llama", "LlamaForCausalLM", parts=_parts,
    owns=lambda d: not d.qk_norm and d.qkv_bias == d.o_bias,
    exported=lambda d: {"attention_bias": bool(d.qkv_bias), "mlp_bias": False},
    refused=(_decoder.MLP_BIAS,))
