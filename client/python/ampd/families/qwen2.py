"""Qwen2 and Qwen2.5 (Qwen2ForCausalLM): Llama's decoder with q, k and v
biased and o_proj not. Refused: sliding-window attention
(use_sliding_window, or a layer_types entry other than full_attention)."""
from ampd.families import _decoder

FAMILY = _decoder.family(
    "qwen2", "Qwen2ForCausalLM", parts=lambda config: dict(qkv_bias=True, o_bias=False),
    owns=lambda d: not d.qk_norm and d.qkv_bias and not d.o_bias,
    exported=lambda d: {"use_sliding_window": False},
    refused=(_decoder.SLIDING_WINDOW, _decoder.LAYER_TYPES))
