"""Qwen3 (Qwen3ForCausalLM): Qwen2's decoder with each q and k head
RMSNorm-ed on its own before RoPE (q_norm, k_norm: the qk_norm part), an
explicit head_dim, and attention_bias on q, k, v and o_proj alike (default
none). Refused: sliding-window attention (use_sliding_window, or a
layer_types entry other than full_attention)."""
from ampd.families import _decoder


def _parts(config):
    bias = bool(config.get("attention_bias", False))
    # Qwen3Config's head_dim defaults to 128, not hidden / heads.
    return dict(qkv_bias=bias, o_bias=bias, qk_norm=True, head_dim=config.get("head_dim") or 128)


FAMILY = _decoder.family(
    "qwen3", "Qwen3ForCausalLM", parts=_parts,
    owns=lambda d: d.qk_norm and d.qkv_bias == d.o_bias,
    exported=lambda d: {"attention_bias": bool(d.qkv_bias), "use_sliding_window": False},
    refused=(_decoder.SLIDING_WINDOW, _decoder.LAYER_TYPES))
