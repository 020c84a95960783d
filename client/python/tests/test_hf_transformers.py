"""ampd against transformers itself (the pinned versions of
scripts/requirements-hf.txt, run by CTest under scripts/python-env.sh's
environment): for GPT-2, Llama 3.x (GQA and llama3 RoPE scaling over a
context longer than its original one, untied and tied, config keys in
transformers 5.x's and 4.x's styles; also linear scaling), Qwen2.5 (q/k/v
biases, tied) and Qwen3 (per-head q/k norm, head_dim other than hidden /
heads, GQA; untied, and tied with attention_bias in 4.x's keys), a model
transformers builds from a small config (random weights, nothing
downloaded) and writes with save_pretrained loads into a real ampd through ampd.from_pretrained, and in fp32:
- its log-probabilities over the whole vocabulary (the logits up to each
  row's constant: what ampd's Evaluate returns) and its loss equal
  transformers' forward and loss function to 1e-5 relative;
- 10 AdamW steps give transformers + torch.optim.AdamW's losses to 1e-5
  relative, and the same weights;
- greedy Sample gives transformers' greedy generate token for token;
- job.save_pretrained writes a folder AutoModelForCausalLM.from_pretrained
  opens, with ampd's log-probabilities.
And in fp16 (the job's default dynamic loss scaling) and bf16, against
transformers' fp32 model run under torch.autocast("cpu", dtype) (with
torch.amp.GradScaler for fp16 training), each side measured against the
fp32 reference: ampd's log-probs, loss and 5-step AdamW losses are no
further from fp32 than 2x autocast's own error plus 4 ulps of the dtype at
1, and within a bound derived from the dtype's rounding (see the comment
above DTYPES; docs/BENCHMARKS.md tables the measured errors).
Each test prints its largest differences (pytest -s shows them).

Outside CI these skip, saying so, where transformers is not importable (run
them through CTest after scripts/python-env.sh); with CI=true they fail."""
import json
import os

import numpy as np
import pytest

if os.environ.get("CI") != "true":
    pytest.importorskip("transformers", reason="transformers is not importable: these tests run "
                                               "under scripts/python-env.sh's environment")
import torch  # noqa: E402
import transformers  # noqa: E402

import ampd  # noqa: E402
from ampd.v1 import trainer_pb2 as pb  # noqa: E402

torch.use_deterministic_algorithms(True)
VOCAB = 96
RTOL = 1e-5
LR, WEIGHT_DECAY = 1e-3, 0.01

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               # A 16-token original context: the 48-token sequences below
               # reach three times past it, where the scaling matters.
               "original_max_position_embeddings": 16}
DECODER = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
               initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=None)

FAMILIES = {
    "gpt2": (transformers.GPT2Config,
             dict(vocab_size=VOCAB, n_positions=48, n_embd=64, n_layer=2, n_head=4,
                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.1,
                  bos_token_id=None, eos_token_id=None)),
    "llama3": (transformers.LlamaConfig,
               dict(DECODER, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False)),
    "llama3_tied": (transformers.LlamaConfig,
                    dict(DECODER, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True,
                         attention_bias=True)),
    "llama_linear": (transformers.LlamaConfig,
                     dict(DECODER, rope_parameters={"rope_type": "linear", "rope_theta": 500000.0,
                                                    "factor": 4.0},
                          tie_word_embeddings=False)),
    "qwen2.5": (transformers.Qwen2Config,
                dict(DECODER, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                     tie_word_embeddings=True, rms_norm_eps=1e-6)),
    # hidden / heads is 16: head_dim 24 and 8 are Qwen3's own.
    "qwen3": (transformers.Qwen3Config,
              dict(DECODER, head_dim=24, tie_word_embeddings=False, rms_norm_eps=1e-6,
                   rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "qwen3_tied": (transformers.Qwen3Config,
                   dict(DECODER, head_dim=8, num_key_value_heads=1, tie_word_embeddings=True,
                        attention_bias=True,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # Four layers, two of each type; a 20-key window over 48-token
    # sequences; head_dim 24 (not hidden / heads) and a query_pre_attn_scalar
    # of its own; the full layers' RoPE linearly scaled, the local ones' not.
    "gemma3": (transformers.Gemma3TextConfig,
               dict(DECODER, num_hidden_layers=4, head_dim=24, query_pre_attn_scalar=32,
                    sliding_window=20, tie_word_embeddings=True, rms_norm_eps=1e-6,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                 "full_attention"],
                    rope_parameters={"sliding_attention": {"rope_type": "default",
                                                           "rope_theta": 10000.0},
                                     "full_attention": {"rope_type": "linear",
                                                        "rope_theta": 1000000.0,
                                                        "factor": 2.0}})),
}
SEQ = {"gpt2": 48}  # tokens per sequence (decoders 48 of their 64)


def seq_len(family):
    return SEQ.get(family, 48)


def make_folder(family, directory, seed=0):
    """transformers' model of the family from its config, random weights,
    written with save_pretrained (llama3's in shards with their index); the
    llama3_tied and qwen3_tied folders' config.json are rewritten in
    transformers 4.x's keys (rope_theta + rope_scaling)."""
    config_class, values = FAMILIES[family]
    torch.manual_seed(seed)
    config = config_class(**values)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    if family == "gemma3":
        # Gemma3RMSNorm's weights start at 0 (scale 1 + 0): random ones, so
        # that each norm's scale shows in the logits.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(0.0, 0.5)
    model.save_pretrained(directory, max_shard_size="100KB" if family == "llama3" else "1GB")
    if family in ("llama3_tied", "qwen3_tied"):
        path = os.path.join(directory, "config.json")
        with open(path) as f:
            saved = json.load(f)
        rope = saved.pop("rope_parameters")
        saved["rope_theta"] = rope.pop("rope_theta")
        saved["rope_scaling"] = rope
        with open(path, "w") as f:
            json.dump(saved, f)
    return load_hf(directory)


def load_hf(directory):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, attn_implementation="eager", dtype=torch.float32)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def batch(family, step, rows=2):
    """(rows, T) int64 ids and targets, a few -100: each target a fixed
    function of its token (a bigram to learn, so that training goes
    somewhere and equal curves say something)."""
    rng = np.random.default_rng(900 + step)
    ids = rng.integers(0, VOCAB, size=(rows, seq_len(family)), dtype=np.int64)
    targets = (7 * ids + 2) % VOCAB
    targets[rng.random(targets.shape) < 0.1] = -100
    return ids, targets


def hf_logprobs_and_loss(model, ids, targets, grad=False):
    """transformers' (B, T, V) log-probs and its causal-LM loss function's
    loss (shift_labels: the targets are already the next tokens)."""
    with torch.set_grad_enabled(grad):
        logits = model(input_ids=torch.from_numpy(ids)).logits
        loss = model.loss_function(logits=logits, labels=None, vocab_size=VOCAB,
                                   shift_labels=torch.from_numpy(targets))
    return torch.log_softmax(logits.detach().double(), dim=-1).numpy(), loss


def ampd_logprobs(job, ids):
    """ampd's (B, T, V) log-probs: one Evaluate of the B rows repeated V times,
    copy v's targets all v."""
    rows, t = ids.shape
    inputs = np.tile(ids, (VOCAB, 1))
    targets = np.repeat(np.arange(VOCAB, dtype=np.int64), rows)[:, None].repeat(t, axis=1)
    values = job.evaluate(inputs, targets, return_logprobs=True).logprobs[0]
    return values.reshape(VOCAB, rows, t).transpose(1, 2, 0).astype(np.float64)


def report(what, ours, theirs):
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    diff = np.abs(ours - theirs)
    rel = diff / np.maximum(np.abs(theirs), 1e-30)
    print("%s: max abs diff %.3g, max rel diff %.3g" % (what, diff.max(), rel.max()))
    return diff.max(), rel.max()


def assert_close(what, ours, theirs, rtol=RTOL, atol=0.0):
    report(what, ours, theirs)
    np.testing.assert_allclose(ours, theirs, rtol=rtol, atol=atol, err_msg=what)


def train_both(job, model, opt, family, steps):
    """`steps` steps of the same batches in ampd (job.step) and in PyTorch
    (model, opt): the two loss curves."""
    ours, theirs = [], []
    for step in range(steps):
        ids, targets = batch(family, step)
        ours.append(job.step(ids, targets).loss)
        opt.zero_grad()
        _, loss = hf_logprobs_and_loss(model, ids, targets, grad=True)
        loss.backward()
        opt.step()
        theirs.append(loss.item())
    return ours, theirs


def create(client, directory, **kwargs):
    return client.create_job(model=ampd.from_pretrained(directory), precision="fp32",
                             optimizer=ampd.AdamW(lr=LR, weight_decay=WEIGHT_DECAY), **kwargs)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_forward_equals_transformers(server, tmp_path, family):
    model = make_folder(family, tmp_path / "hf")
    if family == "llama3":  # a sharded folder, loaded file by file
        index = json.load(open(tmp_path / "hf" / "model.safetensors.index.json"))
        assert len(set(index["weight_map"].values())) > 2
    with ampd.Client(server.address) as client:
        job = create(client, str(tmp_path / "hf"))
        ids, targets = batch(family, 0)
        theirs, loss = hf_logprobs_and_loss(model, ids, targets)
        assert_close("%s log-probs" % family, ampd_logprobs(job, ids), theirs)
        ours = job.evaluate(ids, targets).loss
        assert_close("%s loss" % family, ours, loss.item())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_bf16_folder_loads_widened(server, tmp_path, precision):
    """Published checkpoints are bf16: such a folder loads into any job (its
    weights widened exactly), and an fp32 job computes what transformers
    computes in fp32 from them. A folder that does not fit leaves no job."""
    make_folder("qwen2.5", tmp_path / "f32").to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    model = load_hf(str(tmp_path / "bf16"))  # dtype float32: the bf16 values, widened
    with ampd.Client(server.address) as client:
        job = client.create_job(model=ampd.from_pretrained(str(tmp_path / "bf16")),
                                precision=precision)
        if precision == "fp32":
            ids, targets = batch("qwen2.5", 0)
            theirs, _ = hf_logprobs_and_loss(model, ids, targets)
            assert_close("bf16 folder log-probs", ampd_logprobs(job, ids), theirs)
        before = len(client.jobs())
        with pytest.raises(ampd.InvalidArgument, match="model.embed_tokens.weight"):
            client.create_job(model=ampd.from_pretrained(str(tmp_path / "bf16"),
                                                         vocab_size=VOCAB + 1), precision=precision)
        assert len(client.jobs()) == before


def mapped(client, model):
    """The effective pb.ModelSpec the server makes of from_pretrained's or
    from_hf_config's config.json (a job created from it)."""
    return client.create_job(model=model, precision="fp32").config.model


def refused(client, config, match):
    """The server refuses config.json naming the key (field
    config.hf_config_json); no job is left behind."""
    before = len(client.jobs())
    with pytest.raises(ampd.InvalidArgument, match=match) as error:
        client.create_job(model=ampd.from_hf_config(config), precision="fp32")
    assert error.value.field == "config.hf_config_json"
    assert len(client.jobs()) == before
    return error.value


def test_llama3_scaling_matters_and_both_key_styles_read_alike(server, tmp_path):
    """The llama3 folder's RoPE is not the default's over these positions
    (so the test above checks the scaling), and 4.x's keys give 5.x's spec."""
    make_folder("llama3", tmp_path / "a")
    with ampd.Client(server.address) as client:
        spec = mapped(client, ampd.from_pretrained(str(tmp_path / "a"))).decoder
        r = spec.rope_scaling
        assert (r.rope_type, r.factor, r.low_freq_factor, r.high_freq_factor,
                r.original_max_position_embeddings) == (pb.ROPE_TYPE_LLAMA3, 8.0, 1.0, 4.0, 16)
        assert spec.rope_theta == 10000.0
        with open(tmp_path / "a" / "config.json") as f:
            config = json.load(f)
        rope = dict(config.pop("rope_parameters"))
        old = dict(config, rope_theta=rope.pop("rope_theta"), rope_scaling=rope)
        assert mapped(client, ampd.from_hf_config(old)).decoder == spec
    # transformers' own frequencies differ from the unscaled ones.
    scaled = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["llama3"](
        transformers.LlamaConfig(**FAMILIES["llama3"][1]), "cpu")[0]
    plain = 1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16))
    assert not torch.allclose(scaled, plain, rtol=1e-3)


def test_qwen3_folder_gives_its_parts_and_what_it_refuses_is_named(server, tmp_path):
    """Qwen3's keys become parts (the per-head q/k norm, its own head_dim,
    attention_bias on all four projections); a sliding window, in either
    key, and another activation are refused by name."""
    make_folder("qwen3", tmp_path / "a")
    make_folder("qwen3_tied", tmp_path / "b")
    with ampd.Client(server.address) as client:
        spec = mapped(client, ampd.from_pretrained(str(tmp_path / "a"))).decoder
        assert (spec.qk_norm, spec.head_dim, spec.qkv_bias, spec.o_bias) == (True, 24, False,
                                                                             False)
        tied = mapped(client, ampd.from_pretrained(str(tmp_path / "b"))).decoder
        assert (tied.qk_norm, tied.head_dim, tied.qkv_bias, tied.o_bias) == (True, 8, True, True)
        assert tied.tie_word_embeddings and tied.rope_theta == 10000.0
        with open(tmp_path / "a" / "config.json") as f:
            config = json.load(f)
        for key, value in (("use_sliding_window", True),
                           ("layer_types", ["sliding_attention", "full_attention"]),
                           ("hidden_act", "gelu")):
            refused(client, dict(config, **{key: value}), "config.json: " + key)


def test_gemma3_folder_gives_its_parts_and_what_it_refuses_is_named(server, tmp_path):
    """Gemma 3's keys become parts (every norm by 1 + w, the sandwich norms,
    GeGLU, the embedding scale, query_pre_attn_scalar, the sliding layers
    with their window and local RoPE base beside the full layers' scaled
    RoPE); transformers 4.x's keys (rope_theta, rope_local_base_freq,
    rope_scaling, sliding_window_pattern) give the same spec; soft-capping,
    bidirectional attention and another activation are refused by name. And
    the window matters over these sequences: transformers' logits change
    without it."""
    model = make_folder("gemma3", tmp_path / "a")
    with ampd.Client(server.address) as client:
        spec = mapped(client, ampd.from_pretrained(str(tmp_path / "a"))).decoder
        assert (spec.qk_norm, spec.norm_unit_offset, spec.sandwich_norms, spec.scale_embeddings,
                spec.mlp_activation) == (True, True, True, True, pb.MLP_ACTIVATION_GELU_TANH)
        assert (list(spec.sliding_layers), spec.sliding_window, spec.rope_local_theta,
                spec.rope_theta, spec.query_pre_attn_scalar) == ([True, False, True, False], 20,
                                                                 10000.0, 1000000.0, 32.0)
        assert (spec.rope_scaling.rope_type, spec.rope_scaling.factor) == (pb.ROPE_TYPE_LINEAR,
                                                                           2.0)
        with open(tmp_path / "a" / "config.json") as f:
            config = json.load(f)
        rope = config.pop("rope_parameters")
        full = dict(rope["full_attention"])
        old = dict(config, rope_theta=full.pop("rope_theta"),
                   rope_local_base_freq=rope["sliding_attention"]["rope_theta"],
                   rope_scaling=full)
        old.pop("layer_types")
        old["sliding_window_pattern"] = 2  # layers 1 and 3 full, 0 and 2 sliding
        assert mapped(client, ampd.from_hf_config(old)).decoder == spec
        for key, value in (("final_logit_softcapping", 30.0), ("attn_logit_softcapping", 50.0),
                           ("use_bidirectional_attention", True), ("hidden_activation", "gelu")):
            refused(client, dict(config, rope_parameters=rope, **{key: value}),
                    "config.json: " + key)
    ids, targets = batch("gemma3", 0)
    windowed, _ = hf_logprobs_and_loss(model, ids, targets)
    model.config.sliding_window = 64
    for layer in model.model.layers:
        if layer.self_attn.sliding_window is not None:
            layer.self_attn.sliding_window = 64
    unwindowed, _ = hf_logprobs_and_loss(model, ids, targets)
    assert np.abs(windowed - unwindowed).max() > 1e-3


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_ten_adamw_steps_equal_transformers(server, tmp_path, family):
    model = make_folder(family, tmp_path / "hf")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    with ampd.Client(server.address) as client:
        job = create(client, str(tmp_path / "hf"))
        ours, theirs = train_both(job, model, opt, family, 10)
        assert_close("%s 10-step losses" % family, ours, theirs)
        assert theirs[-1] < theirs[0]  # it moved, so equal curves say something
        # The weights: Adam moves an element by about lr a step whatever its
        # gradient's size, so the few whose gradient is at fp32's rounding
        # noise (a key bias's, exactly 0 in real numbers; sums that cancel)
        # go their own way in any two implementations. All but those agree.
        merged = job.state_dict("merged")
        hf_state = model.state_dict()
        diffs = np.concatenate([np.abs(value - hf_state[name].numpy()).ravel()
                                for name, value in merged.items()])
        apart = float((diffs > 1e-5).mean())
        print("%s weights after 10 steps: max abs diff %.3g; %.3g%% of elements over 1e-5"
              % (family, diffs.max(), 100 * apart))
        assert apart < 0.005
        model.eval()
        ids, targets = batch(family, 10)
        theirs_lp, _ = hf_logprobs_and_loss(model, ids, targets)
        assert_close("%s log-probs after 10 steps" % family, ampd_logprobs(job, ids), theirs_lp)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_sample_equals_generate(server, tmp_path, family):
    model = make_folder(family, tmp_path / "hf")
    rng = np.random.default_rng(3)
    prompts = rng.integers(0, VOCAB, size=(3, 6), dtype=np.int64)
    new = seq_len(family) - prompts.shape[1]
    with ampd.Client(server.address) as client:
        job = create(client, str(tmp_path / "hf"))
        completions = job.sample(list(prompts), max_tokens=new, temperature=0.0)
        seen = set()
        for prompt, [completion] in zip(prompts, completions):
            with torch.no_grad():
                out = model.generate(torch.from_numpy(prompt[None]), max_new_tokens=new,
                                     min_new_tokens=new, do_sample=False)
            theirs = out[0, len(prompt):].tolist()
            assert completion.tokens == theirs
            seen.update(theirs)
        assert len(seen) > 5  # not one token over and over


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_export_loads_back_into_transformers(server, tmp_path, family):
    make_folder(family, tmp_path / "hf")
    with ampd.Client(server.address) as client:
        job = create(client, str(tmp_path / "hf"))
        for step in range(3):  # weights of ampd's own, not the folder's
            job.step(*batch(family, step))
        # llama3's in shards with their index, as transformers shards.
        job.save_pretrained(str(tmp_path / "out"),
                            max_shard_size="100KB" if family == "llama3" else "50GB")
        files = os.listdir(tmp_path / "out")
        assert ("model.safetensors.index.json" in files) == (family == "llama3"), files
        assert "generation_config.json" in files
        model = load_hf(str(tmp_path / "out"))
        assert model.config.model_type == FAMILIES[family][0].model_type
        ids, targets = batch(family, 5)
        theirs, loss = hf_logprobs_and_loss(model, ids, targets)
        assert_close("%s exported log-probs" % family, ampd_logprobs(job, ids), theirs)
        assert_close("%s exported loss" % family, job.evaluate(ids, targets).loss, loss.item())


@pytest.mark.parametrize("key,value,match", [
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0},
     r'rope_parameters.rope_type: "yarn"'),
    ("rope_parameters", {"rope_type": "llama3", "rope_theta": 1e4, "factor": 4.0},
     r"rope_parameters.low_freq_factor"),
    ("rope_parameters", {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0,
                         "attention_factor": 2.0}, r"rope_parameters.attention_factor"),
    ("rope_scaling", {"type": "dynamic", "factor": 2.0}, r'rope_scaling.rope_type: "dynamic"'),
    ("partial_rotary_factor", 0.5, r"partial_rotary_factor"),
])
def test_what_ampd_cannot_compute_is_refused_naming_the_key(server, tmp_path, key, value, match):
    make_folder("llama3", tmp_path)
    with open(tmp_path / "config.json") as f:
        config = json.load(f)
    if key == "rope_scaling":
        config.pop("rope_parameters")
    config[key] = value
    with ampd.Client(server.address) as client:
        refused(client, config, "config.json: " + match)


# ---- the server reads the same folders (--models-dir, base_model) -------------

def _server_of_folders(start_ampd, root, families):
    for family in families:
        make_folder(family, root / family)
    return start_ampd("--models-dir=%s" % root)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_base_model_is_the_job_from_pretrained_makes(start_ampd, tmp_path, family):
    """base_model: the server's config.json mapping (model/hf_config.cc),
    which ampd.from_pretrained's config.json goes through too, makes the
    same model, and the server's own load of the weights the same job, bit
    for bit; a LoRA job on the shared base starts as transformers' model
    computes."""
    root = tmp_path / "models"
    server = _server_of_folders(start_ampd, root, [family])
    model = load_hf(str(root / family))
    ids, targets = batch(family, 0)
    with ampd.Client(server.address) as client:
        ours = client.create_job(base_model=family, precision="fp32", seed=1)
        theirs = create(client, str(root / family), seed=1)
        mine = ours.config.model
        assert mine == theirs.config.model, (mine, theirs.config.model)
        assert ampd_logprobs(ours, ids).tobytes() == ampd_logprobs(theirs, ids).tobytes()
        if family == "gpt2":
            with pytest.raises(ampd.InvalidArgument, match="LoRA adapters are a decoder's"):
                client.create_job(base_model=family, lora=ampd.LoRA(rank=4, alpha=8.0))
            with pytest.raises(ampd.InvalidArgument,
                               match="config.model.decoder: .* describes a GPT"):
                client.create_job(model=ampd.from_pretrained(str(root / family),
                                                             lora=ampd.LoRA(rank=4, alpha=8.0)))
            return
        lora = client.create_job(base_model=family, lora=ampd.LoRA(rank=4, alpha=8.0),
                                 precision="fp32")
        hf, _ = hf_logprobs_and_loss(model, ids, targets)
        assert_close("%s shared base log-probs" % family, ampd_logprobs(lora, ids), hf)


@pytest.mark.parametrize("key, value", [
    ("hidden_act", "gelu"), ("mlp_bias", True), ("partial_rotary_factor", 0.5),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
    ("rope_parameters", {"rope_type": "llama3", "rope_theta": 1e4, "factor": 4.0}),
    ("rope_parameters", {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0,
                         "attention_factor": 2.0}),
])
def test_a_base_model_is_refused_as_a_folder_is(start_ampd, tmp_path, key, value):
    root = tmp_path / "models"
    make_folder("llama3", root / "base")
    with open(root / "base" / "config.json") as f:
        config = json.load(f)
    config[key] = value
    with open(root / "base" / "config.json", "w") as f:
        json.dump(config, f)
    server = start_ampd("--models-dir=%s" % root)
    with ampd.Client(server.address) as client:
        folder = refused(client, config, "config.json: ")
        with pytest.raises(ampd.InvalidArgument) as base:
            client.create_job(base_model="base", lora=ampd.LoRA(rank=4, alpha=8.0))
    assert base.value.field == "config.base_model"
    # Both name the same key, in the same words.
    assert folder.message.split("config.json: ")[1] == base.value.message.split("config.json: ")[1]
    assert key in folder.message


# ---- fp16 and bf16 against transformers under torch.autocast ------------------
#
# Neither side computes the fp32 values, so the two are not compared with each
# other directly: each is measured against the fp32 reference (transformers'
# fp32 forward, and fp32 training), and ampd's error must be of autocast's own
# size: at most AUTOCAST_FACTOR times autocast's error plus a floor of
# FLOOR_ULPS units in the last place of the dtype at 1 (FLOOR_ULPS * eps;
# so that an autocast error that happens to be tiny does not make the bound
# tighter than rounding allows). Both sides keep fp32 master weights and
# round the matmul operands to the dtype; they differ in which other
# operations they round (ampd stores activations in the dtype, autocast keeps
# norms, softmax and the loss in fp32), which the factor covers.
#
# An absolute bound, independent of autocast, too: the logits leave the last
# matmul rounded to the dtype (relative error eps / 2 each) after a chain of
# roundings of about ROUNDINGS_PER_LAYER per layer (norm, q/k/v, scores,
# probabilities, context, o, residual, norm, up/gate, activation, down,
# residual) plus the embedding and the head; to first order each adds eps / 2
# of the activations' scale, and a log-prob is a logit less the logsumexp of
# them all (twice a logit's error at most). So |log-prob error| <=
# 2 * (ROUNDINGS_PER_LAYER * layers + 2) * eps / 2 * max |logit|, with
# max |logit| <= max |fp32 log-prob|.
DTYPES = {"fp16": (torch.float16, 2.0 ** -10), "bf16": (torch.bfloat16, 2.0 ** -7)}
AUTOCAST_FACTOR = 2.0
FLOOR_ULPS = 4
ROUNDINGS_PER_LAYER = 12
MIXED_STEPS = 5


def _layers(family):
    values = FAMILIES[family][1]
    return values.get("n_layer", values.get("num_hidden_layers"))


def assert_no_worse_than_autocast(what, ours, autocast, reference, eps, absolute):
    """ours and autocast measured against reference (all float64 arrays):
    ours' largest error within AUTOCAST_FACTOR x autocast's plus FLOOR_ULPS
    ulps of the dtype at 1, and within `absolute`."""
    ours, autocast, reference = (np.asarray(a, np.float64) for a in (ours, autocast, reference))
    ours_err = np.abs(ours - reference).max()
    autocast_err = np.abs(autocast - reference).max()
    floor = FLOOR_ULPS * eps
    bound = AUTOCAST_FACTOR * autocast_err + floor
    print("%s: ampd max err vs fp32 %.3g, autocast max err vs fp32 %.3g "
          "(bound %.3g, absolute bound %.3g)" % (what, ours_err, autocast_err, bound, absolute))
    assert ours_err <= bound, (what, ours_err, autocast_err, bound)
    assert ours_err <= absolute, (what, ours_err, absolute)
    return ours_err, autocast_err


def _autocast(dtype):
    return torch.autocast("cpu", dtype=dtype)


@pytest.mark.parametrize("precision", sorted(DTYPES))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_mixed_precision_forward_as_autocast(server, tmp_path, family, precision):
    """An fp16 / bf16 job's log-probs and loss are as far from transformers'
    fp32 forward as transformers' own forward under torch.autocast is (the
    model's weights fp32, the matmuls in the dtype)."""
    dtype, eps = DTYPES[precision]
    model = make_folder(family, tmp_path / "hf")
    ids, targets = batch(family, 0)
    reference, ref_loss = hf_logprobs_and_loss(model, ids, targets)
    with _autocast(dtype):
        autocast, ac_loss = hf_logprobs_and_loss(model, ids, targets)
    with ampd.Client(server.address) as client:
        job = client.create_job(model=ampd.from_pretrained(str(tmp_path / "hf")),
                                precision=precision)
        ours = ampd_logprobs(job, ids)
        ours_loss = job.evaluate(ids, targets).loss
    roundings = ROUNDINGS_PER_LAYER * _layers(family) + 2
    absolute = 2 * roundings * eps / 2 * np.abs(reference).max()
    assert_no_worse_than_autocast("%s %s log-probs" % (family, precision), ours, autocast,
                                  reference, eps, absolute)
    # The loss is a mean of log-probs: their bound holds for it.
    assert_no_worse_than_autocast("%s %s loss" % (family, precision), ours_loss,
                                  ac_loss.item(), ref_loss.item(), eps, absolute)


@pytest.mark.parametrize("precision", sorted(DTYPES))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_mixed_precision_adamw_steps_as_autocast(server, tmp_path, family, precision):
    """5 AdamW steps of an fp16 / bf16 job (fp16 with the job's default
    dynamic loss scaling, PyTorch's GradScaler's policy) stay as close to
    fp32 training in transformers as transformers + AdamW under autocast
    (with torch.amp.GradScaler for fp16) does."""
    dtype, eps = DTYPES[precision]
    reference_model = make_folder(family, tmp_path / "hf").train()
    autocast_model = load_hf(str(tmp_path / "hf")).train()
    ref_opt = torch.optim.AdamW(reference_model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    ac_opt = torch.optim.AdamW(autocast_model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16")
    with ampd.Client(server.address) as client:
        job = client.create_job(model=ampd.from_pretrained(str(tmp_path / "hf")),
                                precision=precision,
                                optimizer=ampd.AdamW(lr=LR, weight_decay=WEIGHT_DECAY))
        # The fp32 model's losses on the same batches untrained: training
        # must move the curve by far more than ampd's error, so that close
        # curves say something about the updates.
        untrained = [hf_logprobs_and_loss(reference_model, *batch(family, step))[1].item()
                     for step in range(MIXED_STEPS)]
        ours, reference, autocast = [], [], []
        for step in range(MIXED_STEPS):
            ids, targets = batch(family, step)
            ours.append(job.step(ids, targets).loss)
            ref_opt.zero_grad()
            _, loss = hf_logprobs_and_loss(reference_model, ids, targets, grad=True)
            loss.backward()
            ref_opt.step()
            reference.append(loss.item())
            ac_opt.zero_grad()
            with _autocast(dtype):
                _, loss = hf_logprobs_and_loss(autocast_model, ids, targets, grad=True)
            scaler.scale(loss).backward()
            scaler.step(ac_opt)
            scaler.update()
            autocast.append(loss.item())
        applied = job.applied_steps
    # Every step applied on both sides (no overflow skipped one), so the
    # curves compare the same updates.
    assert applied == MIXED_STEPS
    if precision == "fp16":
        assert scaler.get_scale() == torch.amp.GradScaler("cpu").get_scale()
    print("%s %s losses: ampd %s, autocast %s, fp32 %s (ampd applied %s)"
          % (family, precision, np.round(ours, 5), np.round(autocast, 5), np.round(reference, 5),
             applied))
    # Each step's loss is a forward's: the forward's absolute bound, for the
    # weights after up to 4 updates (Adam moves each by about lr a step
    # whatever the gradient's rounding, so the weights stay within a few lr).
    roundings = ROUNDINGS_PER_LAYER * _layers(family) + 2
    absolute = 2 * roundings * eps / 2 * max(np.abs(reference).max(), 1.0)
    ours_err, _ = assert_no_worse_than_autocast(
        "%s %s %d-step losses" % (family, precision, MIXED_STEPS), ours, autocast, reference,
        eps, absolute)
    moved = np.abs(np.subtract(reference, untrained)).max()
    print("%s %s: training moved the losses by %.3g" % (family, precision, moved))
    assert moved > 10 * ours_err
