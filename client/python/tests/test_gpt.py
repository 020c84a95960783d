"""A GPT trained through the real ampd against the same GPT in PyTorch.

The job's initial state dict, exported over GetStateDict, loads into
bench/pytorch/gpt.py's GPT (Hugging Face GPT-2 names and Conv1D layouts,
attention as a plain masked softmax) by name with strict checking; then 20
identical AdamW steps on identical (B, T) batches (some targets -100) must
give the same loss curve to 1e-5 relative in fp32, and the weights ampd
ends with must load into PyTorch and be close to the ones PyTorch ended
with. Also: GPT-2 weights in PyTorch load into a job (names with or
without "transformer.", the old attn.bias buffers ignored), the
initialisation is nanoGPT's, and the benchmark script runs on the CPU.

Skipped, saying so, where torch is not importable (it is optional; Debian's
python3-torch provides it)."""
import math
import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not importable: the GPT conformance "
                                           "tests compare ampd with a PyTorch GPT")

import ampd  # noqa: E402
import ampd.safetensors  # noqa: E402
import ampd.torch as ampd_torch  # noqa: E402
from ampd.v1 import trainer_pb2 as pb  # noqa: E402

sys.path.insert(0, os.path.join(os.environ["AMPD_SOURCE_DIR"], "bench", "pytorch"))
import gpt as torch_gpt  # noqa: E402  (bench/pytorch/gpt.py)

VOCAB, CONTEXT, D_MODEL, N_LAYER, N_HEAD = 64, 16, 32, 2, 2
SPEC = ampd.GPT(vocab_size=VOCAB, context_length=CONTEXT, d_model=D_MODEL, n_layer=N_LAYER,
                n_head=N_HEAD)
LR, WEIGHT_DECAY = 3e-3, 0.01


def torch_model():
    return torch_gpt.GPT(VOCAB, CONTEXT, D_MODEL, N_LAYER, N_HEAD, attention="manual")


def sequences(step, batch=4, seq_len=CONTEXT):
    """Step's (B, T) int64 ids and targets, a few of them -100. Each target is
    a fixed function of its input token (a bigram to learn), so the loss falls
    within the 20 steps and the curves compared are those of a model learning."""
    rng = np.random.default_rng(500 + step)
    ids = rng.integers(0, VOCAB, size=(batch, seq_len), dtype=np.int64)
    targets = (5 * ids + 3) % VOCAB
    targets[rng.random(targets.shape) < 0.1] = -100
    return ids, targets


def torch_loss(model, ids, targets):
    return model(torch.from_numpy(ids), torch.from_numpy(targets))


def test_spec_becomes_the_proto_gpt():
    proto = SPEC.to_proto()
    assert proto.WhichOneof("architecture") == "gpt"
    assert (proto.gpt.vocab_size, proto.gpt.context_length, proto.gpt.d_model,
            proto.gpt.n_layer, proto.gpt.n_head) == (VOCAB, CONTEXT, D_MODEL, N_LAYER, N_HEAD)
    assert not proto.gpt.HasField("mlp_ratio") and not proto.gpt.HasField("tie_embeddings")
    assert len(proto.layers) == 0
    full = ampd.GPT(8, 4, 4, 1, 1, mlp_ratio=2, layer_norm_eps=1e-6, tie_embeddings=False,
                    loss_multiplier=2.0).to_proto()
    assert (full.gpt.mlp_ratio, full.gpt.tie_embeddings, full.loss_multiplier) == (2, False, 2.0)
    assert full.gpt.layer_norm_eps == pytest.approx(1e-6)
    assert isinstance(full, pb.ModelSpec)


def test_fp32_loss_curve_equals_pytorch(server):
    with ampd.Client(server.address) as client:
        job = client.create_job(model=SPEC, precision="fp32", seed=11,
                                optimizer=ampd.AdamW(lr=LR, weight_decay=WEIGHT_DECAY))
        model = torch_model()
        # Strict: every Hugging Face name matches, shapes included.
        model.load_state_dict(ampd_torch.gpt2_state_dict(job), strict=True)
        initial = {k: v.clone() for k, v in model.state_dict().items()}
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        ours, theirs = [], []
        for step in range(20):
            ids, targets = sequences(step)
            ours.append(job.step(ids, targets).loss)
            opt.zero_grad()
            loss = torch_loss(model, ids, targets)
            loss.backward()
            opt.step()
            theirs.append(loss.item())
        for step, (a, b) in enumerate(zip(ours, theirs)):
            assert a == pytest.approx(b, rel=1e-5), "step %d: ampd %r, PyTorch %r" % (step + 1, a, b)
        assert theirs[-1] < theirs[0] - 0.5  # it learned, so equal curves say something

        # ampd's final weights load into PyTorch and are PyTorch's, loosely.
        # The key bias (c_attn.bias[C:2C]) adds the same q.b_k to every score
        # of a row, which the softmax cancels: its true gradient is 0 and both
        # sides train it on rounding noise, which Adam's division by sqrt(v)
        # turns into steps of their own (about 2e-5 apart after 20 steps).
        final = torch_model()
        final.load_state_dict(ampd_torch.gpt2_state_dict(job), strict=True)
        moved = 0.0
        for name, value in final.state_dict().items():
            expected = model.state_dict()[name]
            if name.endswith("attn.c_attn.bias"):
                keys = slice(D_MODEL, 2 * D_MODEL)
                assert torch.allclose(value[keys], expected[keys], rtol=0, atol=1e-4), name
                value, expected = value.clone(), expected.clone()
                value[keys] = expected[keys] = 0
            assert torch.allclose(value, expected, rtol=1e-4, atol=1e-5), name
            moved = max(moved, (expected - initial[name]).abs().max().item())
        assert moved > 10 * LR  # the comparison is about trained weights
        # The loaded model's loss on a new batch is the loss ampd's next step reports.
        ids, targets = sequences(20)
        with torch.no_grad():
            expected = torch_loss(final, ids, targets).item()
        assert job.step(ids, targets).loss == pytest.approx(expected, rel=1e-5)


def test_initialisation_is_nanogpts(server):
    with ampd.Client(server.address) as client:
        job = client.create_job(model=ampd.GPT(vocab_size=512, context_length=64, d_model=64,
                                               n_layer=2, n_head=4),
                                precision="fp32", seed=1)
        state = ampd_torch.gpt2_state_dict(job)
    residual = 0.02 / math.sqrt(2 * 2)
    for name, value in state.items():
        if name.endswith("c_proj.weight"):
            assert value.std().item() == pytest.approx(residual, rel=0.1), name
        elif name.endswith(("wte.weight", "wpe.weight", "c_attn.weight", "c_fc.weight")):
            assert value.std().item() == pytest.approx(0.02, rel=0.1), name
        elif "ln_" in name and name.endswith("weight"):
            assert torch.equal(value, torch.ones_like(value)), name
        elif name.endswith("bias"):
            assert torch.equal(value, torch.zeros_like(value)), name
    # Conv1D layouts: (in, out).
    assert tuple(state["transformer.h.0.attn.c_attn.weight"].shape) == (64, 192)
    assert tuple(state["transformer.h.1.mlp.c_proj.weight"].shape) == (256, 64)
    assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])


def test_pytorch_gpt2_weights_load_into_a_job(server):
    torch.manual_seed(5)
    source = torch_model()
    # GPT2Model's own names (no "transformer."), with the old causal-mask
    # buffers that pretrained checkpoints carry.
    weights = {}
    for name, value in source.state_dict().items():
        if name.startswith("transformer."):
            weights[name[len("transformer."):]] = value
    for i in range(N_LAYER):
        weights["h.%d.attn.bias" % i] = torch.tril(torch.ones(CONTEXT, CONTEXT)).view(
            1, 1, CONTEXT, CONTEXT)
        weights["h.%d.attn.masked_bias" % i] = torch.tensor(-1e4)
    with ampd.Client(server.address) as client:
        job = client.create_job(model=SPEC, precision="fp32", seed=2)
        ampd_torch.load_gpt2(job, weights)
        loaded = ampd_torch.gpt2_state_dict(job)
        for name, value in source.state_dict().items():
            assert torch.equal(loaded[name], value), name
        ids, targets = sequences(0)
        with torch.no_grad():
            expected = torch_loss(source, ids, targets).item()
        assert job.step(ids, targets).loss == pytest.approx(expected, rel=1e-5)

        # The same weights as a pretrained model.safetensors is laid out,
        # sent as is: the server takes a weights-only file (and starts the
        # optimizer afresh).
        other = client.create_job(model=SPEC, precision="fp32", seed=3)
        other.load_state_dict_bytes(ampd.safetensors.dumps(
            {k: v.numpy() for k, v in weights.items()}, {"format": "pt"}))
        for name, value in ampd_torch.gpt2_state_dict(other).items():
            assert torch.equal(value, source.state_dict()[name]), name

        wrong = dict(weights)
        wrong.pop("ln_f.weight")
        with pytest.raises(ValueError, match="missing .*transformer.ln_f.weight"):
            ampd_torch.load_gpt2(job, wrong)


def test_bad_sequences_are_refused_naming_the_field(server):
    with ampd.Client(server.address) as client:
        job = client.create_job(model=SPEC, precision="fp32")
        ids, targets = sequences(0, seq_len=CONTEXT + 1)
        with pytest.raises(ampd.InvalidArgument, match="inputs"):
            job.step(ids, targets)
        ids, targets = sequences(0)
        targets[0, 0] = VOCAB
        with pytest.raises(ampd.InvalidArgument, match="targets"):
            job.step(ids, targets)
        ids, targets = sequences(0)
        ids[1, 2] = -1
        with pytest.raises(ampd.InvalidArgument, match="inputs"):
            job.step(ids, targets)
        assert job.refresh().step_count == 0


def test_bench_peer_runs_and_counts_the_parameters_ampd_counts(server):
    """bench/pytorch/gpt.py end to end on the CPU with tiny flags: a line per
    precision torch can autocast here, and the N of its FLOP count (every
    parameter but the position table) from the same sizes as ampd's job."""
    import re
    import subprocess
    script = os.path.join(os.environ["AMPD_SOURCE_DIR"], "bench", "pytorch", "gpt.py")
    run = subprocess.run(
        [sys.executable, script, "--device", "cpu", "--vocab", str(VOCAB), "--context",
         str(CONTEXT), "--d-model", str(D_MODEL), "--n-layer", str(N_LAYER), "--n-head",
         str(N_HEAD), "--batch", "2", "--steps", "2", "--warmup", "1", "--precisions",
         "fp32,bf16", "--peak-tflops", "1"],
        capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = re.findall(r"^(fp32|bf16) +step median +[0-9.]+ ms +[0-9]+ tokens/s +[0-9.]+ TFLOP/s "
                       r"+MFU +[0-9.]+%  \((\d+) params, loss ([0-9.]+)\)$", run.stdout, re.M)
    assert [line[0] for line in lines] == ["fp32", "bf16"], run.stdout
    with ampd.Client(server.address) as client:
        job = client.create_job(model=SPEC, precision="fp32")
    assert int(lines[0][1]) == job.parameter_count - CONTEXT * D_MODEL
    for line in lines:
        assert 0 < float(line[2]) < 2 * math.log(VOCAB)
