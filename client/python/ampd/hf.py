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

from ampd import families, safetensors, spec

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


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
    transformers' save_pretrained wrote: config.json gives the spec through
    its family (ampd.families, by model_type: gpt2, llama, qwen2, qwen3,
    each naming what it refuses), and create_job loads the folder's weights
    into the new job. lora: an ampd.LoRA to fine-tune with fresh adapters;
    adapter: a PEFT adapter folder (adapter_config.json +
    adapter_model.safetensors) to go on training. overrides: spec fields by
    keyword (max_position_embeddings=...)."""
    config = spec._read_config(os.path.join(directory, "config.json"))
    family = families.of_config(config)
    if adapter is not None:
        if lora is not None:
            raise ValueError("lora and adapter: give one (the adapter carries its LoRA config)")
        lora = lora_of_peft_config(os.path.join(adapter, "adapter_config.json"),
                                   config.get("num_hidden_layers"))
    if lora is not None:
        if not family.lora:
            raise ValueError("lora: LoRA adapters are a decoder's, not %s's" % family.model_type)
        overrides["lora"] = lora
    model = family.spec_of_config(config, overrides)
    return Pretrained(model, os.path.abspath(directory),
                      os.path.abspath(adapter) if adapter is not None else None)


def hf_config(model_spec):
    """transformers' config.json (a dict) of a job's effective pb.ModelSpec:
    that of the family whose parts it has."""
    return families.of_spec(model_spec).config_of_spec(model_spec)


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
