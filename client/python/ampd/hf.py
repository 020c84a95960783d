"""Hugging Face folders in and out: a job made from what transformers'
save_pretrained writes (config.json, model.safetensors or sharded
model-0000k-of-0000n.safetensors with model.safetensors.index.json), a PEFT
adapter (adapter_config.json, adapter_model.safetensors) loaded into a LoRA
job, and a job's weights written back as a folder that
AutoModelForCausalLM.from_pretrained opens.

    job = client.create_job(model=ampd.from_pretrained(DIR), precision="bf16")
    job.save_pretrained(OUT)

The weights travel through the state-dict calls (each file a partial
LoadStateDict), so nothing here reads a tensor.
"""
import json
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ampd import safetensors, spec
from ampd.v1 import trainer_pb2 as pb

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
_DECODER_TYPES = ("llama", "qwen2")


def _weight_files(directory):
    """The folder's safetensors files in load order: the index's, or the one file."""
    index = os.path.join(directory, _INDEX)
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(directory, name) for name in sorted(set(weight_map.values()))]
    single = os.path.join(directory, _SINGLE)
    if os.path.exists(single):
        return [single]
    raise FileNotFoundError("%s: neither %s nor %s" % (directory, _INDEX, _SINGLE))


def _peft_targets(modules, num_layers):
    """PEFT's target_modules as ampd takes them. Names, dotted suffixes and
    "all-linear" pass as they are (the server reads them); full paths
    (model.layers.{i}.self_attn.q_proj: what PEFT saves after expanding
    "all-linear") become their module's name when they list it in every
    layer, as ampd adapts every layer alike."""
    if isinstance(modules, str):
        if modules != "all-linear":
            raise ValueError("target_modules %r: a regular expression; give module names"
                             % modules)
        return modules
    if not modules:
        return None
    paths = [m for m in modules if m.startswith("model.layers.")]
    if not paths:
        return list(modules)
    layers_of = {}
    for path in paths:
        parts = path.split(".")
        if len(parts) != 5 or not parts[2].isdigit():
            raise ValueError("target_modules %r: not a projection of a layer" % path)
        layers_of.setdefault(".".join(parts[3:]), set()).add(int(parts[2]))
    for module, layers in sorted(layers_of.items()):
        if layers != set(range(num_layers)):
            raise ValueError("target_modules: %s in layers %s only; ampd adapts all %d layers "
                             "alike" % (module, sorted(layers), num_layers))
    return [m for m in modules if not m.startswith("model.layers.")] + sorted(layers_of)


def lora_of_peft_config(config, num_layers=None):
    """A LoRA spec of PEFT's adapter_config.json (a path, or its dict): r,
    lora_alpha, target_modules (PEFT's forms: names, dotted suffixes,
    "all-linear", or full paths in every one of num_layers layers). Refused,
    naming the key: what would train differently (bias other than "none",
    rslora, DoRA, LoRA biases, per-module ranks or alphas,
    layers_to_transform, modules_to_save)."""
    config = spec._read_config(config)
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError("peft_type %r: only LORA adapters" % (config.get("peft_type"),))
    refused = (("bias", "none"), ("use_rslora", False), ("use_dora", False),
               ("rank_pattern", {}), ("alpha_pattern", {}), ("layers_to_transform", None),
               ("modules_to_save", None), ("lora_bias", False))
    for key, wanted in refused:
        value = config.get(key)
        if value and value != wanted:  # None, {} and [] are PEFT's "not set" too
            raise ValueError("%s %r: ampd trains LoRA with %s = %r" % (key, value, key, wanted))
    return spec.LoRA(rank=int(config["r"]), alpha=float(config["lora_alpha"]),
                     target_modules=_peft_targets(config.get("target_modules"), num_layers))


@dataclass(frozen=True)
class Pretrained:
    """A model spec read from a Hugging Face folder, and the weights to load
    into the job Client.create_job makes of it (load_weights). adapter: a
    PEFT adapter folder whose weights follow the base's."""
    model: object  # spec.GPT or spec.Decoder
    directory: str
    adapter: Optional[str] = None

    def to_proto(self):
        return self.model.to_proto()

    def load_weights(self, job):
        """Every weight file of the folder (then the adapter's), each a partial load."""
        for path in _weight_files(self.directory):
            _load_widened(job, path)
        if self.adapter is not None:
            _load_widened(job, os.path.join(self.adapter, "adapter_model.safetensors"))


def _load_widened(job, path):
    """One file as a partial load. A checkpoint in bf16 or fp16 (as most
    published ones are) is widened to F32 here, exactly: every job takes
    F32 weights (a full job's masters are F32; a LoRA job rounds its base
    to the working dtype), not every job another dtype. An F32 file goes up
    as its own bytes."""
    with open(path, "rb") as f:
        data = f.read()
    state = safetensors.loads(data)
    if not state.dtypes and all(v.dtype == np.float32 for v in state.values()):
        job.load_state_dict_bytes(data, partial=True)
        return
    widened = {name: np.asarray(value, dtype=np.float32) for name, value in state.items()}
    job.load_state_dict(widened, metadata={"format": "pt"}, partial=True)


def from_pretrained(directory, *, lora=None, adapter=None, **overrides):
    """A model to pass to Client.create_job, read from a folder that
    transformers' save_pretrained wrote: config.json gives the spec (GPT-2:
    GPT.from_hf_config; Llama, Qwen2: Decoder.from_hf_config, which name what
    they refuse), and create_job loads the folder's weights into the new job.
    lora: an ampd.LoRA to fine-tune with fresh adapters; adapter: a PEFT
    adapter folder (adapter_config.json + adapter_model.safetensors) to go on
    training. overrides: spec fields by keyword (max_position_embeddings=...)."""
    config = spec._read_config(os.path.join(directory, "config.json"))
    model_type = config.get("model_type")
    if adapter is not None:
        if lora is not None:
            raise ValueError("lora and adapter: give one (the adapter carries its LoRA config)")
        lora = lora_of_peft_config(os.path.join(adapter, "adapter_config.json"),
                                   config.get("num_hidden_layers"))
    if model_type == "gpt2":
        if lora is not None:
            raise ValueError("lora: LoRA adapters are a decoder's (llama, qwen2), not GPT-2's")
        model = spec.GPT.from_hf_config(config, **overrides)
    elif model_type in _DECODER_TYPES:
        if lora is not None:
            overrides["lora"] = lora
        model = spec.Decoder.from_hf_config(config, **overrides)
    else:
        raise ValueError("model_type %r: one of gpt2, %s" % (model_type, ", ".join(_DECODER_TYPES)))
    return Pretrained(model, os.path.abspath(directory),
                      os.path.abspath(adapter) if adapter is not None else None)


def _decoder_config(d):
    """transformers' config.json of a pb.Decoder: qwen2 when only q/k/v are
    biased, else llama (attention_bias biases all four). RoPE in 4.x's
    keys (rope_theta, rope_scaling), which 5.x reads too."""
    if d.qkv_bias and not d.o_bias:
        config = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
                  "use_sliding_window": False}
    elif d.qkv_bias == d.o_bias:
        config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                  "attention_bias": bool(d.qkv_bias), "mlp_bias": False}
    else:
        raise ValueError("a decoder with o_proj biased and q/k/v not is no transformers family")
    config.update(vocab_size=d.vocab_size, hidden_size=d.hidden_size,
                  intermediate_size=d.intermediate_size, num_hidden_layers=d.num_hidden_layers,
                  num_attention_heads=d.num_attention_heads,
                  num_key_value_heads=d.num_key_value_heads, head_dim=d.head_dim,
                  rms_norm_eps=d.rms_norm_eps, rope_theta=d.rope_theta,
                  max_position_embeddings=d.max_position_embeddings,
                  tie_word_embeddings=d.tie_word_embeddings,
                  initializer_range=d.initializer_range, hidden_act="silu",
                  torch_dtype="float32")
    if d.HasField("rope_scaling") and d.rope_scaling.rope_type != pb.ROPE_TYPE_DEFAULT:
        r = d.rope_scaling
        if r.rope_type == pb.ROPE_TYPE_LINEAR:
            config["rope_scaling"] = {"rope_type": "linear", "factor": r.factor}
        else:
            config["rope_scaling"] = {
                "rope_type": "llama3", "factor": r.factor, "low_freq_factor": r.low_freq_factor,
                "high_freq_factor": r.high_freq_factor,
                "original_max_position_embeddings": r.original_max_position_embeddings}
    return config


def _gpt_config(g):
    return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
            "vocab_size": g.vocab_size, "n_positions": g.context_length, "n_embd": g.d_model,
            "n_layer": g.n_layer, "n_head": g.n_head, "n_inner": g.mlp_ratio * g.d_model,
            "layer_norm_epsilon": g.layer_norm_eps, "tie_word_embeddings": g.tie_embeddings,
            "activation_function": "gelu_new", "resid_pdrop": 0.0, "embd_pdrop": 0.0,
            "attn_pdrop": 0.0, "torch_dtype": "float32"}


def hf_config(model_spec):
    """transformers' config.json (a dict) of a job's effective pb.ModelSpec."""
    kind = model_spec.WhichOneof("architecture")
    if kind == "decoder":
        return _decoder_config(model_spec.decoder)
    if kind == "gpt":
        return _gpt_config(model_spec.gpt)
    raise ValueError("a layer stack has no Hugging Face config: only GPT-2 and decoder jobs")


def save_pretrained(job, directory):
    """Write the job's weights as transformers' save_pretrained does:
    config.json from the job's spec and model.safetensors with the merged
    view (fp32 masters; a LoRA job's adapters merged in; a tied head left to
    the embedding), in `directory` (made if needed). Returns directory."""
    job.refresh()
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf_config(job.config.model), f, indent=2)
    state = job.state_dict("merged")
    with open(os.path.join(directory, _SINGLE), "wb") as f:
        f.write(safetensors.dumps(state, {"format": "pt"}, getattr(state, "dtypes", {})))
    return directory
