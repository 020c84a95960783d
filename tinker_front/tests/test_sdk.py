"""The tinker SDK, unchanged, against ampd-tinker and a real ampd: a LoRA
training client on a tiny Qwen2-family base, forward_backward with each of
Tinker's five losses (several chunked calls sent before any is awaited),
optim_step with AdamParams, save_state / load_state with and without the
optimizer, a sampler from the saved weights (seeded, greedy at temperature
0), compute_logprobs, and the sampler's log-probs equal to the trainer's
forward bit for bit (the job is batch_invariant)."""
import glob
import os
import time

import numpy as np
import pytest
import tinker
from tinker import types

from conftest import BASE, KEY, start_front

LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro")
TEXTS = ["1+1=2", "2+3=5", "4+4=8", "3+5=8", "6+1=7"]


def resolved(value):
    """Newer SDKs return a future where older ones return the client."""
    return value.result() if type(value).__name__.startswith("Backcompat") else value


@pytest.fixture(scope="module")
def front(workdir, ampd_server, models_dir):
    # Two datums a request: five datums go out as three requests at once.
    server = start_front(workdir, ampd_server.address, models_dir, "--sdk-chunk-len=2")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def service(front):
    client = tinker.ServiceClient(base_url="http://" + front.address, api_key=KEY)
    return client


@pytest.fixture(scope="module")
def trainer(service):
    return resolved(service.create_lora_training_client(base_model=BASE, rank=4, seed=3))


@pytest.fixture(scope="module")
def tokenizer(trainer):
    return trainer.get_tokenizer()


def datum(ids, loss, rng):
    """Next-token datum of ids for a loss (its per-token inputs drawn from rng)."""
    n = len(ids) - 1
    inputs = {"target_tokens": np.asarray(ids[1:], dtype=np.int64)}
    if loss == "cross_entropy":
        inputs["weights"] = rng.uniform(0.5, 1.5, n).astype(np.float32)
    else:
        inputs["logprobs"] = rng.uniform(-4.0, -1.0, n).astype(np.float32)
        inputs["advantages"] = rng.standard_normal(n).astype(np.float32)
    return types.Datum(model_input=types.ModelInput.from_ints(list(ids[:-1])),
                       loss_fn_inputs=inputs)


def logprobs_of(result):
    return [np.asarray(o["logprobs"].to_numpy(), dtype=np.float32) for o in result.loss_fn_outputs]


def forward_logprobs(trainer, sequences):
    data = [datum(s, "cross_entropy", np.random.default_rng(0)) for s in sequences]
    return logprobs_of(trainer.forward(data, "cross_entropy").result())


def test_the_sdk_is_the_pinned_one():
    from tinker import _version
    assert _version.__version__ == os.environ["AMPD_TINKER_SDK_VERSION"]


def test_five_losses_chunked_then_optim_step(trainer, tokenizer):
    sequences = [tokenizer.encode(t) for t in TEXTS]
    before = forward_logprobs(trainer, sequences)
    rng = np.random.default_rng(1)
    data = {loss: [datum(s, loss, rng) for s in sequences] for loss in LOSSES}
    # Every call is sent before any is awaited; each is three requests.
    config = {"ppo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05},
              "dro": {"beta": 0.2}}
    futures = [trainer.forward_backward(data[loss], loss, config.get(loss)) for loss in LOSSES]
    results = [f.result() for f in futures]
    for loss, result in zip(LOSSES, results):
        assert len(result.loss_fn_outputs) == len(TEXTS), loss
        # No update between them: each call saw the weights forward saw.
        for ours, theirs in zip(logprobs_of(result), before):
            np.testing.assert_array_equal(ours, theirs, err_msg=loss)
        total = sum(float(np.sum(o["elementwise_loss"].to_numpy(), dtype=np.float64))
                    for o in result.loss_fn_outputs)
        assert result.metrics["loss:sum"] == pytest.approx(total, rel=1e-6), loss
    ce = results[0]
    for d, out in zip(data["cross_entropy"], ce.loss_fn_outputs):
        w = d.loss_fn_inputs["weights"].to_numpy()
        np.testing.assert_allclose(out["elementwise_loss"].to_numpy(),
                                   -w * out["logprobs"].to_numpy(), rtol=1e-6)
    for d, out in zip(data["importance_sampling"], results[1].loss_fn_outputs):
        q, a = d.loss_fn_inputs["logprobs"].to_numpy(), d.loss_fn_inputs["advantages"].to_numpy()
        lp = out["logprobs"].to_numpy().astype(np.float64)
        np.testing.assert_allclose(out["elementwise_loss"].to_numpy(), -np.exp(lp - q) * a,
                                   rtol=1e-4, atol=1e-6)

    for loss, result in zip(LOSSES, results):
        if loss == "cross_entropy":
            continue
        for d, out in zip(data[loss], result.loss_fn_outputs):
            q = d.loss_fn_inputs["logprobs"].to_numpy().astype(np.float64)
            a = d.loss_fn_inputs["advantages"].to_numpy().astype(np.float64)
            lp = out["logprobs"].to_numpy().astype(np.float64)
            r = np.exp(lp - q)
            expected = {
                "importance_sampling": -r * a,
                "ppo": -np.minimum(r * a, np.clip(r, 0.9, 1.05) * a),
                "cispo": -np.clip(r, 0.0, 4.0) * lp * a,
                "dro": -(lp * a - 0.5 * 0.2 * (lp - q) ** 2)}[loss]
            np.testing.assert_allclose(out["elementwise_loss"].to_numpy(), expected,
                                       rtol=1e-4, atol=1e-5, err_msg=loss)
        # forward (no gradients) reports the same losses, computed by the front.
        again = trainer.forward(data[loss], loss, config.get(loss)).result()
        for ours, theirs in zip(again.loss_fn_outputs, result.loss_fn_outputs):
            np.testing.assert_allclose(ours["elementwise_loss"].to_numpy(),
                                       theirs["elementwise_loss"].to_numpy(), rtol=1e-5,
                                       atol=1e-6, err_msg=loss)

    # fp16 with dynamic loss scaling: an update may be skipped while the
    # scale backs off, so train until the weights move.
    for _ in range(6):
        step = trainer.optim_step(types.AdamParams(learning_rate=5e-2, beta1=0.9, beta2=0.99,
                                                   eps=1e-8, weight_decay=0.01,
                                                   grad_clip_norm=1.0)).result()
        assert "loss_scale:unique" in step.metrics
        if step.metrics["skipped:unique"] == 0.0:
            break
        trainer.forward_backward(data["cross_entropy"], "cross_entropy").result()
    else:
        pytest.fail("every update was skipped")
    after = forward_logprobs(trainer, sequences)
    assert any(not np.array_equal(a, b) for a, b in zip(after, before))


def train_once(trainer, sequences):
    rng = np.random.default_rng(5)
    trainer.forward_backward([datum(s, "cross_entropy", rng) for s in sequences],
                             "cross_entropy").result()
    return trainer.optim_step(types.AdamParams(learning_rate=5e-2)).result()


def test_save_state_and_load_state(trainer, tokenizer, workdir):
    sequences = [tokenizer.encode(t) for t in TEXTS]
    path = trainer.save_state("ckpt-a").result().path
    assert path.startswith("tinker://") and path.endswith("/weights/ckpt-a")
    # What training changed (adapters, their moments), never the frozen base.
    from ampd import safetensors
    [saved_file] = glob.glob(os.path.join(workdir, "front-state", "checkpoints", "*",
                                          trainer.model_id, "weights", "ckpt-a",
                                          "state.safetensors"))
    names = list(safetensors.loads(open(saved_file, "rb").read()))
    assert any(".lora_A." in n for n in names) and any(n.endswith(".exp_avg") for n in names)
    assert not [n for n in names if n.startswith("model.")]
    saved = forward_logprobs(trainer, sequences)
    for _ in range(3):
        train_once(trainer, sequences)
    moved = forward_logprobs(trainer, sequences)
    assert any(not np.array_equal(a, b) for a, b in zip(saved, moved))

    trainer.load_state_with_optimizer(path).result()
    for ours, theirs in zip(forward_logprobs(trainer, sequences), saved):
        np.testing.assert_array_equal(ours, theirs)
    # The same update from the same state (optimizer moments included).
    first = train_once(trainer, sequences)
    one = forward_logprobs(trainer, sequences)
    trainer.load_state_with_optimizer(path).result()
    second = train_once(trainer, sequences)
    # The same update from the same state (the job's step count goes on).
    assert {k: v for k, v in first.metrics.items() if k != "step:unique"} == \
        {k: v for k, v in second.metrics.items() if k != "step:unique"}
    for ours, theirs in zip(forward_logprobs(trainer, sequences), one):
        np.testing.assert_array_equal(ours, theirs)

    trainer.load_state(path).result()  # weights only: a fresh optimizer
    for ours, theirs in zip(forward_logprobs(trainer, sequences), saved):
        np.testing.assert_array_equal(ours, theirs)


def test_a_training_client_from_state(service, trainer, tokenizer):
    if not hasattr(service, "create_training_client_from_state_with_optimizer"):
        pytest.skip("this SDK has no create_training_client_from_state_with_optimizer")
    sequences = [tokenizer.encode(t) for t in TEXTS]
    path = trainer.save_state("ckpt-c").result().path
    saved = forward_logprobs(trainer, sequences)
    first = train_once(trainer, sequences)
    one = forward_logprobs(trainer, sequences)
    for with_optimizer in (True, False):
        create = (service.create_training_client_from_state_with_optimizer if with_optimizer
                  else service.create_training_client_from_state)
        other = resolved(create(path))
        assert other.model_id != trainer.model_id
        for ours, theirs in zip(forward_logprobs(other, sequences), saved):
            np.testing.assert_array_equal(ours, theirs)
        if with_optimizer:
            second = train_once(other, sequences)
            assert second.metrics["loss_scale:unique"] == first.metrics["loss_scale:unique"]
            for ours, theirs in zip(forward_logprobs(other, sequences), one):
                np.testing.assert_array_equal(ours, theirs)


def sampler_jobs(ampd_server):
    """The ampd jobs the front made to hold adapters for sampling."""
    import ampd
    with ampd.Client(ampd_server.address) as client:
        return [j for j in client.jobs() if j.config.display_name.startswith("tinker-sampler")]


def test_sampler_equals_trainer_bit_for_bit(trainer, tokenizer, ampd_server):
    sampler = resolved(trainer.save_weights_and_get_sampling_client())
    prompt = tokenizer.encode("2+2=")
    params = types.SamplingParams(max_tokens=6, seed=11, temperature=1.0)
    first = sampler.sample(types.ModelInput.from_ints(prompt), 3, params).result()
    again = sampler.sample(types.ModelInput.from_ints(prompt), 3, params).result()
    assert [s.tokens for s in first.sequences] == [s.tokens for s in again.sequences]
    other = sampler.sample(types.ModelInput.from_ints(prompt), 3,
                           types.SamplingParams(max_tokens=6, seed=12)).result()
    assert [s.tokens for s in other.sequences] != [s.tokens for s in first.sequences]
    # Served by an ampd sampler snapshot of the training job: no second model.
    assert sampler_jobs(ampd_server) == []

    greedy = [sampler.sample(types.ModelInput.from_ints(prompt), 2,
                             types.SamplingParams(max_tokens=6, seed=seed, temperature=0.0)
                             ).result() for seed in (1, 2)]
    tokens = [s.tokens for r in greedy for s in r.sequences]
    assert all(t == tokens[0] for t in tokens)

    for sequence in first.sequences:
        full = prompt + list(sequence.tokens)
        trained = forward_logprobs(trainer, [full])[0][len(prompt) - 1:]
        sampled = np.asarray(sequence.logprobs, dtype=np.float32)
        np.testing.assert_array_equal(sampled, trained)
        scored = sampler.compute_logprobs(types.ModelInput.from_ints(full)).result()
        assert scored[0] is None
        np.testing.assert_array_equal(np.asarray(scored[len(prompt):], dtype=np.float32),
                                      trained)


def test_named_sampler_weights_and_a_sampling_client_of_them(service, trainer, tokenizer,
                                                             ampd_server):
    path = trainer.save_weights_for_sampler("sampler-b").result().path
    assert path.endswith("/sampler_weights/sampler-b")
    sampler = resolved(service.create_sampling_client(model_path=path))
    prompt = tokenizer.encode("1+")
    params = types.SamplingParams(max_tokens=4, seed=3)
    result = sampler.sample(types.ModelInput.from_ints(prompt), 2, params).result()
    full = prompt + list(result.sequences[0].tokens)
    np.testing.assert_array_equal(np.asarray(result.sequences[0].logprobs, dtype=np.float32),
                                  forward_logprobs(trainer, [full])[0][len(prompt) - 1:])
    # A weights-only load gives the model a new job; the old job's snapshot
    # goes with it, and the checkpoint's adapter in a job of its own serves
    # the same tokens with the same log-probs, bit for bit.
    before = {j.job_id for j in sampler_jobs(ampd_server)}
    trainer.load_state(trainer.save_state("before-new-job").result().path).result()
    again = sampler.sample(types.ModelInput.from_ints(prompt), 2, params).result()
    for ours, theirs in zip(again.sequences, result.sequences):
        assert ours.tokens == theirs.tokens
        np.testing.assert_array_equal(np.asarray(ours.logprobs, dtype=np.float32),
                                      np.asarray(theirs.logprobs, dtype=np.float32))
    assert {j.job_id for j in sampler_jobs(ampd_server)} - before  # made for the fallback
    # (A SamplingClient's get_tokenizer looks its base_model name up with
    # transformers, which finds no tiny/qwen2-chars offline: see docs/TINKER.md.)


def first_stop(tokenizer, tokens, strings):
    """The number of tokens a server stopping on strings returns: up to the
    first token whose decoded prefix holds one of them (the text decoded
    here by the SDK's own tokenizer, linearly)."""
    for k in range(1, len(tokens) + 1):
        if any(s in tokenizer.decode(tokens[:k]) for s in strings):
            return k
    return None


def test_stop_strings_cut_where_the_text_holds_them(trainer, tokenizer):
    sampler = resolved(trainer.save_weights_and_get_sampling_client())
    prompt = types.ModelInput.from_ints(tokenizer.encode("5+"))
    free = types.SamplingParams(max_tokens=40, seed=21, temperature=1.0, stop=[])
    unstopped = sampler.sample(prompt, 4, free).result().sequences
    assert all(len(s.tokens) == 40 and s.stop_reason == "length" for s in unstopped)
    eos = tokenizer.eos_token_id
    # Two characters sampled in the middle of the first sequence: a stop
    # string of two tokens (the tokenizer has one a character), found where
    # it first appears in each sequence, or nowhere.
    text = tokenizer.decode(unstopped[0].tokens[10:12])
    assert len(text) == 2
    for stop in (text, [text, "zz?"]):
        params = types.SamplingParams(max_tokens=40, seed=21, temperature=1.0, stop=stop)
        stopped = sampler.sample(prompt, 4, params).result().sequences
        cut_somewhere = False
        for ours, full in zip(stopped, unstopped):
            ends = [k for k in (first_stop(tokenizer, full.tokens, [text]),
                                full.tokens.index(eos) + 1 if eos in full.tokens else None)
                    if k is not None]
            k = min(ends) if ends else len(full.tokens)
            cut_somewhere |= bool(ends)
            assert ours.tokens == full.tokens[:k]
            np.testing.assert_array_equal(np.asarray(ours.logprobs, dtype=np.float32),
                                          np.asarray(full.logprobs, dtype=np.float32)[:k])
            assert ours.stop_reason == ("stop" if ends else "length")
        assert cut_somewhere
        # The text decoded from the returned tokens ends with the stop string
        # (the cookbook's renderers split on it).
        assert tokenizer.decode(stopped[0].tokens).endswith(text)
    # A string the tokenizer cannot spell ('!') never stops; EOS still does.
    never = sampler.sample(prompt, 1, types.SamplingParams(
        max_tokens=40, seed=21, temperature=1.0, stop="!")).result().sequences[0]
    full = unstopped[0].tokens
    assert never.tokens == (full[:full.index(eos) + 1] if eos in full else full)
    # The cut sequence is what a server that stopped on the spot samples:
    # the same tokens as max_tokens set to its length.
    k = len(stopped[0].tokens)
    short = sampler.sample(prompt, 4, types.SamplingParams(max_tokens=k, seed=21,
                                                           temperature=1.0, stop=[])).result()
    assert short.sequences[0].tokens == stopped[0].tokens


def test_stop_none_ends_at_the_models_eos_and_an_empty_list_does_not(trainer, tokenizer):
    sampler = resolved(trainer.save_weights_and_get_sampling_client())
    prompt = types.ModelInput.from_ints(tokenizer.encode("1"))
    eos = tokenizer.eos_token_id  # config.json's eos_token_id, 0 in the tiny base
    # A hot temperature spreads the draws over the whole vocabulary, so that
    # some of these sequences draw EOS.
    free = sampler.sample(prompt, 8, types.SamplingParams(
        max_tokens=200, seed=5, temperature=50.0, stop=[])).result().sequences
    assert all(len(s.tokens) == 200 for s in free)
    assert any(eos in s.tokens for s in free)
    implicit = sampler.sample(prompt, 8, types.SamplingParams(
        max_tokens=200, seed=5, temperature=50.0)).result().sequences
    for ours, full in zip(implicit, free):
        if eos in full.tokens:
            end = full.tokens.index(eos) + 1
            assert ours.tokens == full.tokens[:end] and ours.stop_reason == "stop"
        else:
            assert ours.tokens == full.tokens and ours.stop_reason == "length"


def test_prompt_logprobs_of_the_last_n_prompt_tokens(trainer, tokenizer):
    import inspect
    sampler = resolved(trainer.save_weights_and_get_sampling_client())
    if "prompt_logprobs_last_n" not in inspect.signature(sampler.sample).parameters:
        pytest.skip("this SDK has no prompt_logprobs_last_n")
    prompt = tokenizer.encode("12+34=46")
    whole = sampler.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    result = sampler.sample(types.ModelInput.from_ints(prompt), 1,
                            types.SamplingParams(max_tokens=1, seed=1),
                            include_prompt_logprobs=True, prompt_logprobs_last_n=3).result()
    scored = result.prompt_logprobs
    assert len(scored) == len(prompt)
    assert scored[:-3] == [None] * (len(prompt) - 3)
    np.testing.assert_array_equal(np.asarray(scored[-3:], dtype=np.float32),
                                  np.asarray(whole[-3:], dtype=np.float32))
    with pytest.raises(Exception, match="prompt_logprobs_last_n"):
        sampler.sample(types.ModelInput.from_ints(prompt), 1,
                       types.SamplingParams(max_tokens=1, seed=1), include_prompt_logprobs=True,
                       prompt_logprobs_last_n=len(prompt)).result()


def test_an_unknown_base_model_is_refused_naming_it(service):
    with pytest.raises(Exception, match="not served here"):
        resolved(service.create_lora_training_client(base_model="no/such-model", rank=4))


def test_the_front_and_ampd_are_alive(front, ampd_server):
    assert front.alive() and ampd_server.alive()
    assert "ampd_tinker ERROR" not in front.log(), front.log()  # no bug of its own


def trainer_data(tokenizer):
    return [datum(tokenizer.encode(t), "cross_entropy", np.random.default_rng(0)) for t in TEXTS]


def test_checkpoints_listed_and_deleted(service, trainer, tokenizer):
    if not hasattr(service, "create_rest_client"):
        pytest.skip("this SDK has no RestClient")
    rest = service.create_rest_client()
    path = trainer.save_state("to-delete").result().path
    listed = rest.list_checkpoints(trainer.model_id).result().checkpoints
    by_path = {c.tinker_path: c for c in listed}
    assert path in by_path and by_path[path].checkpoint_type == "training"
    assert any(c.checkpoint_type == "sampler" for c in listed)
    info = rest.get_weights_info_by_tinker_path(path).result()
    assert (info.base_model, info.is_lora, info.lora_rank) == (BASE, True, 4)
    if hasattr(rest, "list_training_runs"):
        runs = rest.list_training_runs().result()
        assert trainer.model_id in [r.training_run_id for r in runs.training_runs]
        run = rest.get_training_run(trainer.model_id).result()
        assert (run.base_model, run.lora_rank) == (BASE, 4)
        assert run.last_checkpoint is not None
    rest.delete_checkpoint_from_tinker_path(path).result()
    assert path not in {c.tinker_path for c in rest.list_checkpoints(trainer.model_id)
                        .result().checkpoints}
    with pytest.raises(Exception):
        trainer.load_state_with_optimizer(path).result()
    # The refused call took its seq_id: the next call does not wait for it
    # (the front would skip the gap only after --gap-timeout, 120 s).
    start = time.monotonic()
    trainer.forward(trainer_data(tokenizer), "cross_entropy").result()
    assert time.monotonic() - start < 30


@pytest.mark.parametrize("precision", ["bf16"])
def test_other_precisions_sample_as_they_train(workdir, ampd_server, models_dir, precision):
    front = start_front(workdir, ampd_server.address, models_dir, "--precision=" + precision)
    try:
        service = tinker.ServiceClient(base_url="http://" + front.address, api_key=KEY)
        trainer = resolved(service.create_lora_training_client(base_model=BASE, rank=4))
        tokenizer = trainer.get_tokenizer()
        sequences = [tokenizer.encode(t) for t in TEXTS]
        train_once(trainer, sequences)
        train_once(trainer, sequences)
        sampler = resolved(trainer.save_weights_and_get_sampling_client())
        prompt = tokenizer.encode("5+")
        result = sampler.sample(types.ModelInput.from_ints(prompt), 2,
                                types.SamplingParams(max_tokens=5, seed=4)).result()
        for sequence in result.sequences:
            full = prompt + list(sequence.tokens)
            np.testing.assert_array_equal(np.asarray(sequence.logprobs, dtype=np.float32),
                                          forward_logprobs(trainer, [full])[0][len(prompt) - 1:])
    finally:
        front.stop()


def test_sampler_weights_saved_over_are_never_served_stale(service, trainer, tokenizer):
    sequences = [tokenizer.encode(t) for t in TEXTS]
    prompt = tokenizer.encode("8-")
    params = types.SamplingParams(max_tokens=3, seed=9)
    path = trainer.save_weights_for_sampler("same-name").result().path
    old = resolved(service.create_sampling_client(model_path=path))
    old.sample(types.ModelInput.from_ints(prompt), 1, params).result()
    for _ in range(3):
        train_once(trainer, sequences)
    assert trainer.save_weights_for_sampler("same-name").result().path == path
    new = resolved(service.create_sampling_client(model_path=path))
    result = new.sample(types.ModelInput.from_ints(prompt), 1, params).result()
    full = prompt + list(result.sequences[0].tokens)
    np.testing.assert_array_equal(np.asarray(result.sequences[0].logprobs, dtype=np.float32),
                                  forward_logprobs(trainer, [full])[0][len(prompt) - 1:])
    with pytest.raises(Exception, match="saved over"):
        old.sample(types.ModelInput.from_ints(prompt), 1, params).result()


def test_a_diverged_sampler_is_an_error_not_nan_log_probs(service, trainer, tokenizer, workdir):
    """Adapters scaled past what fp16 holds (as a too-high learning rate
    leaves them) make the forward NaN: the sample fails saying so."""
    import json
    import shutil

    from ampd import safetensors
    good = trainer.save_weights_for_sampler("not-yet-diverged").result().path
    [folder] = glob.glob(os.path.join(workdir, "front-state", "checkpoints", "*",
                                      trainer.model_id, "sampler_weights", "not-yet-diverged"))
    bad_folder = os.path.join(os.path.dirname(folder), "diverged")
    shutil.copytree(folder, bad_folder)
    weights = os.path.join(bad_folder, "adapter_model.safetensors")
    state = safetensors.loads(open(weights, "rb").read())
    for name in state:
        state[name] = (state[name] + 1.0) * 3e3
    with open(weights, "wb") as f:
        f.write(safetensors.dumps(state, state.metadata, state.dtypes))
    meta = json.load(open(os.path.join(bad_folder, "meta.json")))
    meta["time"] += 1.0
    meta.pop("snapshot", None)  # its snapshot holds the good weights: an adapter-only copy
    json.dump(meta, open(os.path.join(bad_folder, "meta.json"), "w"))
    bad = resolved(service.create_sampling_client(model_path=good.replace("not-yet-diverged",
                                                                          "diverged")))
    with pytest.raises(Exception, match="not finite"):
        bad.sample(types.ModelInput.from_ints(tokenizer.encode("1+")), 1,
                   types.SamplingParams(max_tokens=3, seed=1)).result()
