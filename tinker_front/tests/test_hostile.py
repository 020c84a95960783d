"""ampd-tinker under hostile and unlucky HTTP: bad JSON and protobuf, huge
bodies, unknown and other keys' ids, replayed seq_ids, missing keys; each
gets the status the SDK acts on and a {"detail"} naming the fault, and the
front and ampd stay up. A restart of the front (SIGKILL) keeps every
acknowledged optim_step's result and its models."""
import os
import signal
import time

import httpx
import numpy as np
import pytest

from ampd_tinker.wire_pb2 import tinker_wire_pb2 as pb
from conftest import BASE, KEY, OTHER_KEY, start_front

MAX_BODY = 1 << 20


@pytest.fixture(scope="module")
def front(workdir, ampd_server, models_dir):
    server = start_front(workdir, ampd_server.address, models_dir,
                         "--max-body-bytes=%d" % MAX_BODY, "--gap-timeout=600")
    yield server
    server.stop()


class Api:
    def __init__(self, front, key=KEY):
        self.front, self.key = front, key
        self.http = httpx.Client(base_url="http://" + front.address, timeout=60)

    def post(self, path, body=None, content=None, headers=None, key=None):
        h = {"X-API-Key": key or self.key}
        h.update(headers or {})
        if body is not None:
            return self.http.post("/api/v1/" + path, json=body, headers=h)
        return self.http.post("/api/v1/" + path, content=content, headers=h)

    def result(self, request_id, key=None, accept=None):
        deadline = time.monotonic() + 60  # a stalled model fails here, not at ctest's timeout
        while time.monotonic() < deadline:
            h = {"Accept": accept} if accept else {}
            r = self.post("retrieve_future", {"request_id": request_id}, headers=h, key=key)
            if r.status_code != 200 or "application/json" not in r.headers["content-type"]:
                return r
            if r.json().get("type") != "try_again":
                return r
        raise AssertionError("request %s never finished" % request_id)

    def create_model(self):
        r = self.post("create_model", {"session_id": "s", "model_seq_id": 0,
                                       "base_model": BASE, "lora_config": {"rank": 2}})
        assert r.status_code == 200, r.text
        return self.result(r.json()["request_id"]).json()["model_id"]


def fb_body(model_id, seq_id, tokens=(5, 6, 7, 8), loss="cross_entropy"):
    m = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn=loss)
    d = m.data.add()
    d.model_input.add().encoded_text.tokens = np.asarray(tokens[:-1], "<i4").tobytes()
    d.loss_fn_inputs["target_tokens"].CopyFrom(pb.Tensor(
        dense=np.asarray(tokens[1:], "<i8").tobytes(), dtype=pb.DTYPE_INT64,
        shape=[len(tokens) - 1]))
    return m.SerializeToString()


PROTO = {"Content-Type": "application/x-protobuf"}


@pytest.fixture(scope="module")
def api(front):
    return Api(front)


@pytest.fixture(scope="module")
def model_id(api):
    return api.create_model()


def detail(r, status):
    assert r.status_code == status, (r.status_code, r.text)
    return r.json()["detail"]


def test_keys(api):
    assert detail(api.post("get_info", {"model_id": "x"}, key="nope"), 401)
    r = api.http.post("/api/v1/get_info", json={"model_id": "x"})
    assert detail(r, 401)
    assert api.http.get("/healthz").json() == {"status": "ok"}


def test_bad_json(api):
    for content in (b"{", b"[1, 2]", b"\xff\xfe", b"[" * 100000 + b"]" * 100000, b""):
        assert detail(api.post("create_model", content=content,
                               headers={"Content-Type": "application/json"}), 400)
    assert "base_model" in detail(api.post("create_model", {"base_model": "../../etc"}), 400)
    assert "not served" in detail(api.post("create_model", {"base_model": "no/model"}), 400)
    r = api.post("create_model", {"base_model": BASE, "lora_config": {"rank": -3}})
    failed = api.result(r.json()["request_id"]).json()
    assert failed["category"] == "user" and "rank" in failed["error"]


def test_bad_protobuf(api, model_id):
    assert detail(api.post("forward_backward", content=b"\xff\xff\xff\x0f garbage",
                           headers=PROTO), 400)
    assert "no such model" in detail(api.post("forward_backward", content=fb_body("nope", 1),
                                              headers=PROTO), 404)
    bad = pb.ForwardBackwardRequest.FromString(fb_body(model_id, 1))
    bad.data[0].model_input[0].encoded_text.tokens = b"\x01\x02\x03"
    assert "int32" in detail(api.post("forward_backward", content=bad.SerializeToString(),
                                      headers=PROTO), 400)
    assert "loss_fn" in detail(api.post("forward_backward",
                                        content=fb_body(model_id, 1, loss="mse"),
                                        headers=PROTO), 400)
    short = pb.ForwardBackwardRequest.FromString(fb_body(model_id, 1))
    short.data[0].loss_fn_inputs["target_tokens"].dense = b"\x00" * 8
    assert "target_tokens" in detail(api.post("forward_backward", content=short.SerializeToString(),
                                        headers=PROTO), 400)
    rl = pb.ForwardBackwardRequest.FromString(fb_body(model_id, 1, loss="ppo"))
    assert "needs loss_fn_inputs" in detail(api.post(
        "forward_backward", content=rl.SerializeToString(), headers=PROTO), 400)
    zstd = api.post("forward_backward", content=fb_body(model_id, 1),
                    headers=dict(PROTO, **{"Content-Encoding": "zstd"}))
    assert zstd.status_code == 400


def test_huge_bodies(api, model_id):
    big = fb_body(model_id, 1, tokens=tuple(range(2)) * (MAX_BODY // 4))
    assert api.post("forward_backward", content=big, headers=PROTO).status_code == 413
    assert api.post("create_model", content=b"{" + b" " * (2 * MAX_BODY) + b"}",
                    headers={"Content-Type": "application/json"}).status_code == 413


def test_a_token_out_of_the_vocabulary_fails_its_future_as_a_user_error(api, model_id):
    # (The refused calls above took seq_id 1, as the SDK counted it: the
    # model does not wait for it.)
    r = api.post("forward_backward", content=fb_body(model_id, 2, tokens=(1, 2, 10 ** 6)),
                 headers=PROTO)
    assert r.status_code == 200, r.text
    failed = api.result(r.json()["request_id"]).json()
    assert failed["category"] == "user" and failed["error"]


def test_unknown_and_other_keys_ids(api, front, model_id):
    assert detail(api.post("retrieve_future", {"request_id": "nope"}), 410)
    r = api.post("forward_backward", content=fb_body(model_id, 3), headers=PROTO)
    request_id = r.json()["request_id"]
    other = Api(front, OTHER_KEY)
    assert detail(other.post("retrieve_future", {"request_id": request_id}), 410)
    assert "no such model" in detail(other.post("get_info", {"model_id": model_id}), 404)
    assert "no such model" in detail(other.post("forward_backward",
                                                content=fb_body(model_id, 4), headers=PROTO), 404)
    assert detail(other.post("optim_step", {"model_id": model_id, "seq_id": 4,
                                            "adam_params": {}}), 404)
    r = api.post("save_weights", {"model_id": model_id, "path": "mine", "seq_id": 4})
    path = api.result(r.json()["request_id"]).json()["path"]
    assert "no such checkpoint" in detail(other.post("create_sampling_session", {
        "session_id": "s", "sampling_session_seq_id": 0, "model_path": path}), 404)
    assert "no such checkpoint" in detail(other.post("load_weights", {
        "session_id": "s", "model_seq_id": 1, "path": path, "optimizer": False}), 404)
    assert api.result(request_id).status_code == 200  # the owner's is still there


def test_replayed_seq_ids(api, model_id):
    body = fb_body(model_id, 5)
    first = api.post("forward_backward", content=body, headers=PROTO).json()["request_id"]
    again = api.post("forward_backward", content=body, headers=PROTO).json()["request_id"]
    assert first == again  # a resend: the same future
    assert "already used" in detail(api.post("forward_backward",
                                             content=fb_body(model_id, 5, tokens=(9, 9, 9)),
                                             headers=PROTO), 400)
    api.result(first)
    assert "seq_id 2" in detail(api.post("forward_backward", content=fb_body(model_id, 2,
                                                                           tokens=(3, 3, 3)),
                                       headers=PROTO), 400)


def test_bad_sample_requests(api, model_id):
    r = api.post("save_weights_for_sampler", {"model_id": model_id, "path": "s1", "seq_id": 6})
    path = api.result(r.json()["request_id"]).json()["path"]
    good = {"num_samples": 1, "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6]}]},
            "sampling_params": {"max_tokens": 2, "seed": 1}, "model_path": path}
    assert api.result(api.post("asample", good).json()["request_id"]).status_code == 200
    for change in ({"num_samples": 0}, {"num_samples": "x"},
                   {"prompt": {"chunks": [{"type": "image", "data": "x"}]}},
                   {"prompt": {"chunks": [{"tokens": [-1]}]}},
                   {"sampling_params": {"max_tokens": 0}},
                   {"sampling_params": {"stop": [3, "</s>"]}},
                   {"sampling_params": {"stop": [""]}},
                   {"sampling_params": {"stop": ["x"] * 65}},
                   {"prompt_logprobs_last_n": 1},
                   {"prompt_logprobs": True, "prompt_logprobs_last_n": 2},
                   {"sampling_params": {"temperature": "hot"}},
                   {"model_path": "tinker://../../etc/weights/x"},
                   {"model_path": "http://x"}, {"topk_prompt_logprobs": 5}):
        r = api.post("asample", dict(good, **change))
        assert r.status_code in (400, 404), (change, r.text)
        assert r.json()["detail"]


def test_unload_model(api):
    model_id = api.create_model()
    r = api.post("unload_model", {"model_id": model_id})
    assert api.result(r.json()["request_id"]).json()["model_id"] == model_id
    assert "no such model" in detail(api.post("get_info", {"model_id": model_id}), 404)
    assert detail(api.post("forward_backward", content=fb_body(model_id, 1), headers=PROTO), 404)


ODD_VALUES = [None, [], {}, "x", -1, 1.5, True, [1, "a"], {"a": {"b": []}}, "tinker://x/y/z",
              10 ** 30]


def test_odd_json_never_breaks_the_front(api, front, model_id):
    """Each field of a valid body of every JSON endpoint replaced by each odd
    JSON value: an answer the SDK reads (2xx, or 4xx with a detail), and if
    accepted, a future that settles; never a 500."""
    r = api.post("save_weights", {"model_id": model_id, "path": "odd-base"})
    state = api.result(r.json()["request_id"]).json()["path"]
    r = api.post("save_weights_for_sampler", {"model_id": model_id, "path": "odd-sampler"})
    sampler = api.result(r.json()["request_id"]).json()["path"]
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [5, 6]}]}
    bases = {
        "create_model": {"session_id": "s", "model_seq_id": 0, "base_model": BASE,
                         "lora_config": {"rank": 2, "seed": 1, "train_mlp": False}},
        "get_info": {"model_id": model_id},
        "weights_info": {"tinker_path": state},
        "optim_step": {"model_id": model_id, "adam_params": {"learning_rate": 1e-3}},
        "save_weights": {"model_id": model_id, "path": "odd"},
        "load_weights": {"model_id": model_id, "path": state, "optimizer": True},
        "save_weights_for_sampler": {"model_id": model_id, "path": "odd-s"},
        "create_sampling_session": {"session_id": "s", "sampling_session_seq_id": 0,
                                    "model_path": sampler},
        "asample": {"num_samples": 1, "prompt": prompt, "model_path": sampler,
                    "sampling_params": {"max_tokens": 1, "seed": 1, "stop": [3],
                                        "temperature": 1.0, "top_p": 1.0, "top_k": -1}},
        "retrieve_future": {"request_id": "x"},
    }
    for endpoint, base in bases.items():
        for field in list(base) + ["seq_id"]:
            for value in ODD_VALUES:
                body = dict(base, **{field: value})
                r = api.post(endpoint, body)
                assert r.status_code < 500, (endpoint, body, r.status_code, r.text)
                if r.status_code >= 400:
                    assert r.json()["detail"], (endpoint, body)
                elif "request_id" in r.json() and endpoint != "retrieve_future":
                    assert api.result(r.json()["request_id"]).status_code == 200
        for field in ("sampling_params", "prompt", "lora_config", "adam_params"):
            if field not in base:
                continue
            for key in list(base[field]) or ["x"]:
                for value in ODD_VALUES:
                    body = dict(base, **{field: dict(base[field], **{key: value})})
                    r = api.post(endpoint, body)
                    assert r.status_code < 500, (endpoint, body, r.status_code, r.text)
                    if r.status_code == 200 and "request_id" in r.json():
                        assert api.result(r.json()["request_id"]).status_code == 200
    assert front.alive()
    assert "ampd_tinker ERROR" not in front.log(), front.log()


def test_mangled_protobuf_never_breaks_the_front(api, front, model_id):
    """A valid forward_backward body with bytes flipped, dropped or
    truncated (seeded): never a 500; an accepted one settles."""
    rng = np.random.default_rng(7)
    body = fb_body(model_id, 0, tokens=(5, 6, 7, 8, 9), loss="importance_sampling")
    message = pb.ForwardBackwardRequest.FromString(body)
    datum = message.data[0]
    for name in ("logprobs", "advantages"):
        datum.loss_fn_inputs[name].CopyFrom(pb.Tensor(
            dense=np.zeros(4, "<f4").tobytes(), dtype=pb.DTYPE_FLOAT32, shape=[4]))
    message.seq_id = 0  # unnumbered: each accepted one runs at once
    body = message.SerializeToString()
    for _ in range(300):
        mangled = bytearray(body)
        for _ in range(int(rng.integers(1, 4))):
            if not mangled:
                break
            at = int(rng.integers(len(mangled)))
            kind = rng.integers(3)
            if kind == 0:
                mangled[at] = int(rng.integers(256))
            elif kind == 1:
                del mangled[at]
            else:
                mangled = mangled[:at]
        r = api.post("forward_backward", content=bytes(mangled), headers=PROTO)
        assert r.status_code < 500, (bytes(mangled), r.text)
        if r.status_code == 200:
            assert api.result(r.json()["request_id"]).status_code == 200
    assert front.alive()
    assert "ampd_tinker ERROR" not in front.log(), front.log()


def test_still_up_with_metrics(front, ampd_server, api):
    assert front.alive() and ampd_server.alive()
    text = api.http.get("/metrics").text
    assert "ampd_tinker_futures" in text and 'status="400"' in text
    assert "ampd_tinker ERROR" not in front.log(), front.log()  # no bug of its own


def test_a_restart_keeps_acknowledged_optim_steps(workdir, ampd_server, models_dir):
    state = os.path.join(workdir, "restart-state")
    flags = ["--state-dir=" + state]
    front = start_front(workdir, ampd_server.address, models_dir, *flags)
    try:
        api = Api(front)
        model_id = api.create_model()
        r = api.post("forward_backward", content=fb_body(model_id, 1), headers=PROTO)
        assert api.result(r.json()["request_id"]).status_code == 200
        r = api.post("optim_step", {"model_id": model_id, "seq_id": 2,
                                    "adam_params": {"learning_rate": 0.01}})
        step_id = r.json()["request_id"]
        acknowledged = api.result(step_id).json()
        assert "metrics" in acknowledged
        # Accumulated, not applied, when the front dies: its future dies too.
        r = api.post("forward_backward", content=fb_body(model_id, 3), headers=PROTO)
        assert api.result(r.json()["request_id"]).status_code == 200
        front.stop(signal.SIGKILL)
        front.start()
        api = Api(front)
        assert api.result(step_id).json() == acknowledged
        info = api.post("get_info", {"model_id": model_id})
        assert info.status_code == 200 and info.json()["model_id"] == model_id
        # The model goes on from the next seq_id the SDK sends, without the
        # dead call's gradients (nor its recorded answer given for a new call).
        tokens = (9, 10, 11, 12, 13)
        r = api.post("forward_backward", content=fb_body(model_id, 4, tokens=tokens),
                     headers=PROTO)
        out = api.result(r.json()["request_id"], accept="application/x-protobuf")
        assert out.status_code == 200, out.text
        record = pb.ForwardBackwardOutput.FromString(out.content).loss_fn_outputs[0]
        assert len(record.fields["logprobs"].data) == 4 * (len(tokens) - 1)
        r = api.post("optim_step", {"model_id": model_id, "seq_id": 5, "adam_params": {}})
        assert "metrics" in api.result(r.json()["request_id"]).json()

        # A sampling session outlives a restart (its id spells what it samples).
        r = api.post("save_weights_for_sampler", {"model_id": model_id, "seq_id": 6})
        session = api.result(r.json()["request_id"]).json()["sampling_session_id"]
        ask = {"sampling_session_id": session, "seq_id": 1, "num_samples": 2,
               "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
               "sampling_params": {"max_tokens": 4, "seed": 3}}
        r = api.post("asample", ask)
        before = api.result(r.json()["request_id"]).json()
        front.stop(signal.SIGKILL)
        front.start()
        api = Api(front)
        r = api.post("asample", ask)
        assert api.result(r.json()["request_id"]).json() == before
        assert detail(Api(front, OTHER_KEY).post("asample", ask), 404)
    finally:
        front.stop()
