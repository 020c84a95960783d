"""Job.sample's sampling log-probs through the real ampd against PyTorch.

The job's weights load into bench/pytorch's GPT (or Qwen2-style decoder);
PyTorch's logits of each finished sequence, divided by the temperature,
give the distribution each token was drawn from: softmax over the tokens
top_k and top_p keep (sorted most likely first, the nucleus the shortest
prefix whose share of the kept mass reaches top_p), renormalised. At
temperature 0.7 with top_p 0.9 (and with top_k 5 too) every token lies in
its nucleus and its sampling log-prob equals that reference's to 1e-5,
while its log-prob (temperature 1) equals PyTorch's log_softmax(logits).
Skipped, saying so, where torch is not importable."""
import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not importable: the sampling "
                                           "reference tests compare ampd with PyTorch")
import torch.nn.functional as F  # noqa: E402

import ampd  # noqa: E402
import ampd.torch as ampd_torch  # noqa: E402

sys.path.insert(0, os.path.join(os.environ["AMPD_SOURCE_DIR"], "bench", "pytorch"))
import decoder as torch_decoder  # noqa: E402  (bench/pytorch/decoder.py)
import gpt as torch_gpt  # noqa: E402  (bench/pytorch/gpt.py)

VOCAB, CONTEXT = 48, 16


def models(kind):
    """ampd's spec, a PyTorch peer factory and the exporter, per model kind."""
    if kind == "gpt":
        return (ampd.GPT(vocab_size=VOCAB, context_length=CONTEXT, d_model=32, n_layer=2,
                         n_head=2),
                lambda: torch_gpt.GPT(VOCAB, CONTEXT, 32, 2, 2, attention="manual"),
                ampd_torch.gpt2_state_dict)
    return (ampd.Decoder(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=CONTEXT, qkv_bias=True),
            lambda: torch_decoder.Decoder(VOCAB, 32, 64, 2, 4, 2, max_position_embeddings=CONTEXT,
                                          qkv_bias=True, attention="manual"),
            ampd_torch.decoder_state_dict)


def drawn_logprob(logits, token, temperature, top_k, top_p):
    """log p(token) under softmax(logits / temperature) cut to top_k and the
    top_p nucleus and renormalised, in float64; None when the token was cut."""
    p = torch.softmax(logits.double() / temperature, dim=-1)
    order = torch.sort(p, descending=True, stable=True).indices
    keep = len(order) if top_k == 0 else min(top_k, len(order))
    kept = order[:keep]
    share = torch.cumsum(p[kept], dim=0) / p[kept].sum()
    nucleus = kept[:int(torch.searchsorted(share, torch.tensor(top_p, dtype=share.dtype))) + 1]
    if token not in nucleus.tolist():
        return None
    return float(torch.log(p[token] / p[nucleus].sum()))


@pytest.mark.parametrize("top_k", [0, 5])
@pytest.mark.parametrize("kind", ["gpt", "decoder"])
def test_sampling_logprobs_are_the_drawn_distributions(server, kind, top_k):
    spec, peer, export = models(kind)
    temperature, top_p = 0.7, 0.9
    with ampd.Client(server.address) as client:
        job = client.create_job(model=spec, precision="fp32", seed=5,
                                optimizer=ampd.AdamW(lr=1e-2))
        rng = np.random.default_rng(3)
        for _ in range(3):
            ids = rng.integers(0, VOCAB, size=(4, CONTEXT), dtype=np.int64)
            job.step(ids, (5 * ids + 2) % VOCAB)
        model = peer()
        model.load_state_dict(export(job), strict=True)
        prompts = [rng.integers(0, VOCAB, size=n).tolist() for n in (1, 3, 6, 2)]
        groups = job.sample(prompts, num_samples=3, max_tokens=6, temperature=temperature,
                            top_k=top_k, top_p=top_p, seed=29)
        checked = 0
        worst = 0.0
        cut = 0  # tokens whose nucleus left out some of the row's mass
        with torch.no_grad():
            for prompt, group in zip(prompts, groups):
                for c in group:
                    sequence = prompt + c.tokens
                    logits = model.logits(torch.tensor([sequence[:-1]]))[0].float()
                    for k, token in enumerate(c.tokens):
                        row = logits[len(prompt) - 1 + k]
                        want = drawn_logprob(row, token, temperature, top_k, top_p)
                        assert want is not None, "token %d was outside its nucleus" % token
                        got = float(c.sampling_logprobs[k])
                        worst = max(worst, abs(got - want))
                        assert got == pytest.approx(want, abs=1e-5), (sequence, k)
                        tempered = float(F.log_softmax(row.double() / temperature, dim=-1)[token])
                        cut += int(want > tempered + 1e-3)
                        policy = float(F.log_softmax(row.double(), dim=-1)[token])
                        assert float(c.logprobs[k]) == pytest.approx(policy, abs=1e-5)
                        checked += 1
        assert checked == 4 * 3 * 6
        assert cut > checked // 4, "top_p 0.9 cut too little to test the renormalisation"
        print("%s top_k %d: max |sampling_logprobs - PyTorch| %.3g over %d tokens (%d cut)"
              % (kind, top_k, worst, checked, cut))
