"""ampd's LoRA against PEFT itself (the pinned versions of
scripts/requirements-hf.txt, under scripts/python-env.sh's environment): a
Llama 3.x base (a Qwen3 one, whose q and k adapters feed the per-head
q/k norm, and a Gemma 3 text one, with its sandwich norms and sliding
layers) written by transformers' save_pretrained and a PEFT adapter
(LoraConfig, random A and B so that it changes the model from the start)
written by PEFT's save_pretrained load into one ampd LoRA job through
ampd.from_pretrained(base, adapter=...), for target_modules in PEFT's forms
(names; dotted suffixes; "all-linear"). In fp32:
- the adapted model's log-probs equal PEFT's forward to 1e-5 relative;
- 5 AdamW steps in PEFT (torch.optim.AdamW on the adapters) and in ampd
  give the same losses to 1e-5 relative and the same adapters;
- PeftModel.from_pretrained opens ampd's adapter export (export_peft), with
  ampd's log-probs;
- merge_and_unload() equals ampd's merged view, weights and log-probs.

Outside CI these skip, saying so, where peft is not importable (run them
through CTest after scripts/python-env.sh); with CI=true they fail."""
import json
import os

import numpy as np
import pytest

if os.environ.get("CI") != "true":
    pytest.importorskip("peft", reason="peft is not importable: these tests run under "
                                       "scripts/python-env.sh's environment")
import peft  # noqa: E402
import torch  # noqa: E402

import ampd  # noqa: E402
from test_hf_transformers import (ampd_logprobs, assert_close, batch, hf_logprobs_and_loss,  # noqa: E402,E501
                                  load_hf, make_folder, train_both)

FAMILY = "llama3"
LR, WEIGHT_DECAY = 1e-3, 0.01
TARGETS = {
    "names": ["q_proj", "v_proj"],
    "suffixes": ["self_attn.q_proj", "mlp.down_proj"],
    "all-linear": "all-linear",
}


def peft_folders(tmp_path, targets, family=FAMILY):
    """The base folder, and PEFT's adapter folder over it with random A and B."""
    base = str(tmp_path / "base")
    model = make_folder(family, base)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets,
                             task_type="CAUSAL_LM")
    adapted = peft.get_peft_model(model, config)
    torch.manual_seed(1)
    for name, param in adapted.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)
    adapter = str(tmp_path / "adapter")
    adapted.save_pretrained(adapter)
    return base, adapter, adapted


def create(client, base, adapter):
    return client.create_job(model=ampd.from_pretrained(base, adapter=adapter), precision="fp32",
                             optimizer=ampd.AdamW(lr=LR, weight_decay=WEIGHT_DECAY))


def adapter_weights(adapted):
    """PEFT's adapter tensors in the names its save_pretrained writes."""
    state = peft.get_peft_model_state_dict(adapted)
    return {name: value.detach().numpy() for name, value in state.items()}


@pytest.mark.parametrize("family,which", [(FAMILY, which) for which in sorted(TARGETS)]
                         + [("qwen3", "all-linear"), ("qwen3", "names"),
                            ("gemma3", "all-linear"), ("gemma3", "names")])
def test_lora_trains_as_peft_and_goes_back_to_it(server, tmp_path, family, which):
    base, adapter, adapted = peft_folders(tmp_path, TARGETS[which], family)
    saved = json.load(open(os.path.join(adapter, "adapter_config.json")))
    print("%s: PEFT saved target_modules %r" % (which, saved["target_modules"]))
    with ampd.Client(server.address) as client:
        job = create(client, base, adapter)
        ids, targets = batch(family, 0)
        adapted.eval()
        theirs, _ = hf_logprobs_and_loss(adapted, ids, targets)
        assert_close("%s initial log-probs" % which, ampd_logprobs(job, ids), theirs)

        adapted.train()
        trainable = [p for p in adapted.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(trainable, lr=LR, weight_decay=WEIGHT_DECAY)
        ours, theirs = train_both(job, adapted, opt, family, 5)
        assert_close("%s 5-step losses" % which, ours, theirs)
        # It learned, so equal curves say something: the first batch's loss
        # fell (five different batches make the curve's own ends, one batch
        # against another, no measure of that).
        adapted.eval()
        _, again = hf_logprobs_and_loss(adapted, *batch(family, 0))
        print("%s first batch's loss: %.6g before, %.6g after" % (which, theirs[0], again.item()))
        assert again.item() < theirs[0]
        ours_adapter = job.state_dict("adapter")
        theirs_adapter = adapter_weights(adapted)
        assert sorted(ours_adapter) == sorted(theirs_adapter)
        # As for full weights (test_hf_transformers.py): all but the few
        # elements whose gradient is at fp32's rounding noise agree to 1e-5.
        diffs = np.concatenate([np.abs(ours_adapter[n] - theirs_adapter[n]).ravel()
                                for n in theirs_adapter])
        apart = float((diffs > 1e-5).mean())
        print("%s adapters after 5 steps: max abs diff %.3g; %.3g%% of elements over 1e-5"
              % (which, diffs.max(), 100 * apart))
        assert apart < 0.005

        # ampd's adapter export opens in PEFT over a fresh base.
        adapted.eval()
        ids, targets = batch(family, 7)
        exported = peft.PeftModel.from_pretrained(load_hf(base), job.export_peft(
            str(tmp_path / "exported")))
        theirs, _ = hf_logprobs_and_loss(exported.eval(), ids, targets)
        ours = ampd_logprobs(job, ids)
        assert_close("%s exported adapter log-probs" % which, ours, theirs)

        # merge_and_unload is ampd's merged view.
        merged = exported.merge_and_unload()
        view = job.state_dict("merged")
        merged_state = merged.state_dict()
        worst = max(float(np.abs(view[n] - merged_state[n].numpy()).max()) for n in view)
        print("%s merged weights: max abs diff %.3g" % (which, worst))
        assert worst < 1e-6
        theirs, _ = hf_logprobs_and_loss(merged, ids, targets)
        assert_close("%s merged log-probs" % which, ours, theirs)


def test_peft_config_ampd_cannot_train_is_refused_naming_the_key(tmp_path):
    base, adapter, _ = peft_folders(tmp_path, ["q_proj"])
    path = os.path.join(adapter, "adapter_config.json")
    config = json.load(open(path))
    for key, value in (("use_dora", True), ("bias", "all"), ("use_rslora", True),
                       ("target_modules", r".*\.q_proj")):
        with open(path, "w") as f:
            json.dump(dict(config, **{key: value}), f)
        with pytest.raises(ValueError, match=key):
            ampd.from_pretrained(base, adapter=adapter)
