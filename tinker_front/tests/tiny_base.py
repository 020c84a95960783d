"""A tiny Qwen2-family base model folder, as transformers' save_pretrained
lays one out (config.json, model.safetensors in Qwen2's tensor names), plus
a character-level tokenizer.json and tokenizer_config.json that
transformers.AutoTokenizer opens offline. Written with NumPy, safetensors
and tokenizers alone (no torch), for the front's tests and the demo:

    python tiny_base.py MODELS_DIR [NAME]   # NAME default tiny/qwen2-chars
"""
import json
import os
import string
import sys

import numpy as np

CHARS = string.ascii_lowercase + string.digits + " +-=?.,:"
SPECIALS = ["<|endoftext|>", "<unk>"]
VOCAB = SPECIALS + list(CHARS)
VOCAB_SIZE = 64  # the embedding's rows; ids past len(VOCAB) are never produced
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 32, 64, 2, 4, 2


def _config():
    return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
            "vocab_size": VOCAB_SIZE, "hidden_size": HIDDEN,
            "intermediate_size": INTERMEDIATE, "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
            "head_dim": HIDDEN // HEADS, "max_position_embeddings": 256,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True,
            "hidden_act": "silu", "use_sliding_window": False, "initializer_range": 0.02,
            "bos_token_id": 0, "eos_token_id": 0, "torch_dtype": "float32"}


def _weights(seed):
    rng = np.random.default_rng(seed)
    head = HIDDEN // HEADS

    def w(*shape, scale=0.08):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    t = {"model.embed_tokens.weight": w(VOCAB_SIZE, HIDDEN, scale=0.1),
         "model.norm.weight": np.ones(HIDDEN, np.float32)}
    for i in range(LAYERS):
        p = "model.layers.%d." % i
        t[p + "input_layernorm.weight"] = np.ones(HIDDEN, np.float32)
        t[p + "post_attention_layernorm.weight"] = np.ones(HIDDEN, np.float32)
        t[p + "self_attn.q_proj.weight"] = w(HEADS * head, HIDDEN)
        t[p + "self_attn.q_proj.bias"] = w(HEADS * head, scale=0.02)
        t[p + "self_attn.k_proj.weight"] = w(KV_HEADS * head, HIDDEN)
        t[p + "self_attn.k_proj.bias"] = w(KV_HEADS * head, scale=0.02)
        t[p + "self_attn.v_proj.weight"] = w(KV_HEADS * head, HIDDEN)
        t[p + "self_attn.v_proj.bias"] = w(KV_HEADS * head, scale=0.02)
        t[p + "self_attn.o_proj.weight"] = w(HIDDEN, HEADS * head)
        t[p + "mlp.gate_proj.weight"] = w(INTERMEDIATE, HIDDEN)
        t[p + "mlp.up_proj.weight"] = w(INTERMEDIATE, HIDDEN)
        t[p + "mlp.down_proj.weight"] = w(HIDDEN, INTERMEDIATE)
    return t


def _tokenizer(directory):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                   "unk_token": "<unk>", "pad_token": "<|endoftext|>",
                   "model_max_length": 256}, f)


def make(models_dir, name="tiny/qwen2-chars", seed=0):
    """Write the folder models_dir/name; returns its path."""
    from safetensors.numpy import save_file

    directory = os.path.join(models_dir, *name.split("/"))
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(_config(), f, indent=2)
    save_file(_weights(seed), os.path.join(directory, "model.safetensors"),
              metadata={"format": "pt"})
    _tokenizer(directory)
    return directory


if __name__ == "__main__":
    print(make(sys.argv[1], *(sys.argv[2:3] or [])))
