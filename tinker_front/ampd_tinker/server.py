"""The HTTP face: Tinker's /api/v1 endpoints on aiohttp, health and metrics.

Every body is checked here (size, JSON or protobuf, the fields a call reads)
before anything reaches ampd; a call that trains, saves or samples returns a
future at once ({"request_id": ...}) and runs in a thread, a model's calls in
seq_id order (Runner). Errors use the statuses the SDK acts on: 400 with a
{"detail"} body for a bad request (it retries a bare 400 a few times, then
raises), 401 for a missing or unknown key, 404 for an unknown id or another
key's, 410 for a future it no longer holds (it sends its request again), 429
when full (it backs off). A failed call's future answers
{"error", "category"}, which the SDK raises as RequestFailedError.
"""
import asyncio
import concurrent.futures
import hashlib
import json
import logging
import time
import uuid

import ampd
from aiohttp import web

from ampd_tinker import futures as futures_mod
from ampd_tinker import losses, sample_request, wire
from ampd_tinker.errors import NotFound, UserError, check_name
from ampd_tinker.runner import Replay, Runner

log = logging.getLogger("ampd_tinker")
MAX_JSON = 8 << 20
SDK_CONFIG = {
    # Parallel chunks (the SDK's default); the front orders them by seq_id.
    "parallel_fwdbwd_chunks": True,
    "proto_compress_fwdbwd": False,  # zstd bodies would need one more package
    "fwdbwd_max_chunk_len": 128,
    "fwdbwd_max_chunk_bytes_count": 4_000_000,
    "sample_max_concurrent_requests": 256,
    "pjwt_auth_enabled": False,
    "credential_default_source": "api_key",
}


def _json_response(value, status=200):
    return web.json_response(value, status=status, dumps=_dumps)


def _dumps(value):
    """JSON, never NaN or Infinity (which no JSON parser takes)."""
    return json.dumps(value, allow_nan=False)


def _error(status, detail):
    return _json_response({"detail": detail}, status=status)


class Front:
    def __init__(self, engine, keys, state_dir, workers=16, gap_timeout=120.0,
                 max_body=64 << 20, max_pending=4096, max_done=16384):
        self.engine = engine
        self.keys = keys
        self.max_body = max_body
        self.gap_timeout = gap_timeout
        self.futures = futures_mod.FutureStore(state_dir, max_pending, max_done)
        self.pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="ampd-call")
        self.started = time.time()
        self.counters = {}  # (endpoint, status) -> count
        self._waiters = {}  # request_id -> asyncio.Event of the polls waiting on it
        self._loop = None  # the event loop, once serving

    # ---- plumbing ----------------------------------------------------------------

    def app(self):
        app = web.Application(client_max_size=self.max_body,
                              middlewares=[self._middleware])
        r = app.router
        r.add_get("/healthz", self.healthz)
        r.add_get("/metrics", self.metrics)
        r.add_route("*", "/api/v1/healthz", self.healthz)
        for name in ("client/config", "client/dynamic_config"):
            r.add_post("/api/v1/" + name, self.client_config)
        r.add_post("/api/v1/create_session", self.create_session)
        r.add_post("/api/v1/session_heartbeat", self.heartbeat)
        r.add_post("/api/v1/sessions/{session_id}/finish", self.finish_session)
        r.add_post("/api/v1/telemetry", self.telemetry)
        r.add_get("/api/v1/get_server_capabilities", self.capabilities)
        r.add_post("/api/v1/create_model", self.create_model)
        r.add_post("/api/v1/get_info", self.get_info)
        r.add_post("/api/v1/weights_info", self.weights_info)
        r.add_post("/api/v1/unload_model", self.unload_model)
        r.add_post("/api/v1/forward_backward", self.forward_backward)
        r.add_post("/api/v1/optim_step", self.optim_step)
        r.add_post("/api/v1/save_weights", self.save_weights)
        r.add_post("/api/v1/load_weights", self.load_weights)
        r.add_post("/api/v1/save_weights_for_sampler", self.save_weights_for_sampler)
        r.add_post("/api/v1/create_sampling_session", self.create_sampling_session)
        r.add_get("/api/v1/samplers/{sampler_id}", self.get_sampler)
        r.add_post("/api/v1/asample", self.asample)
        r.add_post("/api/v1/retrieve_future", self.retrieve_future)
        r.add_get("/api/v1/training_runs", self.list_training_runs)
        r.add_get("/api/v1/training_runs/{model_id}", self.get_training_run)
        r.add_get("/api/v1/training_runs/{model_id}/checkpoints", self.list_checkpoints)
        r.add_delete("/api/v1/training_runs/{model_id}/checkpoints/{kind}/{name}",
                     self.delete_checkpoint)
        app.on_startup.append(self._restore)
        return app

    @web.middleware
    async def _middleware(self, request, handler):
        """Authentication, and no exception ever escapes as a crash."""
        path = request.path
        status = 500
        try:
            if path in ("/healthz", "/metrics", "/api/v1/healthz"):
                response = await handler(request)
            else:
                owner = self.keys.owner(request.headers.get("X-API-Key"))
                if owner is None:
                    response = _error(401, "a valid X-API-Key is needed")
                else:
                    request["owner"] = owner
                    response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as e:
            status = e.status
            if e.status == 413:
                return _error(413, "body too large: at most %d bytes" % self.max_body)
            raise
        except ValueError as e:  # UserError, WireError, BadRequest: the caller's mistake
            status = 400
            return _error(400, str(e))
        except NotFound as e:
            status = 404
            return _error(404, str(e))
        except futures_mod.Full as e:
            status = 429
            return _error(429, str(e))
        except Exception:  # a bug: the front answers and stays up
            log.exception("%s %s", request.method, path)
            return _error(500, "internal error")
        finally:
            key = (request.match_info.route.resource.canonical
                   if request.match_info.route.resource is not None else "unmatched", status)
            self.counters[key] = self.counters.get(key, 0) + 1

    async def _json(self, request):
        body = await request.read()
        return wire.json_body(body, MAX_JSON)

    def _blocking(self, fn):
        return asyncio.get_running_loop().run_in_executor(self.pool, fn)

    def _model(self, request, body, key="model_id"):
        model_id = body.get(key)
        if not isinstance(model_id, str):
            raise UserError("%s: a string" % key)
        return self.engine.model(request["owner"], model_id)

    def _runner(self, model):
        if model.runner is None:
            model.runner = Runner(self._run_work, self.gap_timeout)
        return model.runner

    async def _run_work(self, work):
        await self._blocking(work)

    def _complete(self, future, fn, durable=False):
        """A blocking callable that runs fn and settles future with its
        result, or its error (user errors as such, the rest as server's)."""
        def work():
            try:
                self.futures.finish(future, fn(), durable=durable)
            except (UserError, ValueError, NotFound) as e:
                self.futures.fail(future, str(e), "user")
            except ampd.AmpdError as e:
                user = isinstance(e, (ampd.InvalidArgument, ampd.NotFound, ampd.FailedPrecondition,
                                      ampd.PermissionDenied, ampd.MemoryLimit, ampd.JobLimit))
                self.futures.fail(future, "ampd: %s" % e, "user" if user else "server")
            except Exception as e:  # noqa: BLE001 - reported in the future, logged here
                log.exception("call %s", future.request_id)
                self.futures.fail(future, "internal error: %s" % type(e).__name__, "server")
            self._loop.call_soon_threadsafe(self._settled, future.request_id)
        return work

    def _settled(self, request_id):
        """On the event loop: wake the polls waiting for this future."""
        event = self._waiters.pop(request_id, None)
        if event is not None:
            event.set()

    async def _wait(self, future, timeout):
        """Until the future settles or timeout seconds pass (a long poll)."""
        if future.state != futures_mod.PENDING:
            return
        # The worker sets the state before it schedules _settled on this
        # loop, so a future still pending here will find its event set.
        event = self._waiters.setdefault(future.request_id, asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    def _in_order(self, request, model, body_digest, seq_id, prepare, kind="json",
                  durable=False):
        """Queue prepare()'s callable on the model's runner under seq_id; the
        future's JSON. A call refused by prepare (its body's checks) still
        takes its seq_id, as the SDK counted it: else the model would wait
        for it until the gap timeout."""
        if seq_id is not None and (not isinstance(seq_id, int) or isinstance(seq_id, bool)
                                   or not 0 <= seq_id < 1 << 31):
            raise UserError("seq_id %r: an integer in [0, 2^31)" % (seq_id,))
        try:
            fn = prepare()
        except Exception as e:
            if seq_id is not None:
                refused = self.futures.create(request["owner"], kind)
                self.futures.fail(refused, "refused: %s" % e)
                try:
                    self._runner(model).submit(seq_id, body_digest, refused, lambda: None)
                except Replay:
                    pass
            raise
        future = self.futures.create(request["owner"], kind)
        try:
            chosen = self._runner(model).submit(seq_id, body_digest, future,
                                                self._complete(future, fn, durable))
        except Replay as e:
            self.futures.fail(future, str(e))
            raise UserError(str(e)) from None
        if chosen is not future:  # an identical resend: the first call's future
            self.futures.fail(future, "superseded")
        return _json_response({"request_id": chosen.request_id, "model_id": model.model_id})

    def _now(self, request, fn, kind="json", durable=False, extra=None):
        """Run fn in a thread now (not ordered); the future's JSON."""
        future = self.futures.create(request["owner"], kind)
        asyncio.get_running_loop().run_in_executor(self.pool, self._complete(future, fn, durable))
        body = {"request_id": future.request_id}
        body.update(extra(future) if extra else {})
        return _json_response(body)

    async def _restore(self, app):
        self._loop = asyncio.get_running_loop()
        restored = await self._blocking(self.engine.restore)
        for model in restored:
            model.runner = Runner(self._run_work, self.gap_timeout, next_seq=None)
        if restored:
            log.info("reattached %d models", len(restored))

    # ---- service -----------------------------------------------------------------

    async def healthz(self, request):
        return _json_response({"status": "ok"})

    async def metrics(self, request):
        pending, done = self.futures.counts()
        lines = [
            "# TYPE ampd_tinker_futures gauge",
            'ampd_tinker_futures{state="pending"} %d' % pending,
            'ampd_tinker_futures{state="finished"} %d' % done,
            "# TYPE ampd_tinker_futures_evicted_total counter",
            "ampd_tinker_futures_evicted_total %d" % self.futures.evicted,
            "# TYPE ampd_tinker_models gauge",
            "ampd_tinker_models %d" % len(self.engine.models),
            "# TYPE ampd_tinker_sampling_sessions gauge",
            "ampd_tinker_sampling_sessions %d" % len(self.engine.samplers.sessions),
            "# TYPE ampd_tinker_start_time_seconds gauge",
            "ampd_tinker_start_time_seconds %.3f" % self.started,
            "# TYPE ampd_tinker_requests_total counter",
        ]
        for (endpoint, status), count in sorted(self.counters.items()):
            lines.append('ampd_tinker_requests_total{endpoint="%s",status="%d"} %d'
                         % (endpoint.replace('"', ""), status, count))
        return web.Response(text="\n".join(lines) + "\n",
                            content_type="text/plain", charset="utf-8")

    async def client_config(self, request):
        await self._json(request)
        return _json_response(SDK_CONFIG)

    async def create_session(self, request):
        await self._json(request)
        session_id = "session-" + uuid.uuid4().hex[:16]
        return _json_response({"type": "create_session", "session_id": session_id})

    async def heartbeat(self, request):
        await self._json(request)
        return _json_response({"type": "session_heartbeat"})

    async def finish_session(self, request):
        return _json_response({})

    async def telemetry(self, request):
        return _json_response({"status": "accepted"})

    async def capabilities(self, request):
        names = await self._blocking(self.engine.base_models)
        return _json_response({"supported_models": [
            {"model_name": n, "trainable": True, "sampleable": True} for n in names]})

    # ---- training ----------------------------------------------------------------

    async def create_model(self, request):
        body = await self._json(request)
        base_model = body.get("base_model")
        lora = body.get("lora_config") or {}
        if not isinstance(lora, dict):
            raise UserError("lora_config: an object")
        self.engine.base_dir(base_model)  # an unknown name is refused now, not in the future
        owner = request["owner"]

        def create():
            model = self.engine.create_model(owner, base_model, lora)
            return {"type": "create_model", "model_id": model.model_id}

        return self._now(request, create)

    async def get_info(self, request):
        body = await self._json(request)
        model = self._model(request, body)
        return _json_response({
            "type": "get_info", "model_id": model.model_id, "is_lora": True,
            "lora_rank": model.rank, "model_name": model.base_model,
            "model_data": {"arch": "ampd", "model_name": model.base_model,
                           "tokenizer_id": self.engine.base_dir(model.base_model)}})

    async def weights_info(self, request):
        body = await self._json(request)
        path = body.get("tinker_path") or body.get("path")
        _, _, _, directory = self.engine.parse_path(request["owner"], path)
        with open(directory + "/meta.json", encoding="utf-8") as f:
            meta = json.load(f)
        return _json_response({"base_model": meta["base_model"], "is_lora": True,
                                  "lora_rank": meta["rank"], "train_unembed": False,
                                  "train_mlp": True, "train_attn": True})

    async def unload_model(self, request):
        body = await self._json(request)
        model = self._model(request, body)

        def unload():
            self.engine.unload_model(model)
            return {"type": "unload_model", "model_id": model.model_id}

        if model.runner is not None:
            for dropped in model.runner.close():
                self.futures.fail(dropped, "the model was unloaded")
                self._settled(dropped.request_id)
        return self._now(request, unload)

    async def forward_backward(self, request):
        body = await request.read()
        if request.content_type == "application/json":
            raise UserError("forward_backward: send it as protobuf (%s)" % wire.PROTO)
        message = wire.parse_forward_backward(body)
        model = self.engine.model(request["owner"], message.model_id)

        def prepare():
            batch = losses.batch_of_request(message)
            forward_only = message.forward_only
            return lambda: wire.forward_backward_output(
                *self.engine.forward_backward(model, batch, forward_only))

        digest = hashlib.sha256(body).hexdigest()
        return self._in_order(request, model, digest, message.seq_id or None, prepare,
                              kind="forward_backward")

    async def optim_step(self, request):
        raw = await request.read()
        body = wire.json_body(raw, MAX_JSON)
        model = self._model(request, body)

        def prepare():
            adam = body.get("adam_params") or body.get("optim_params") or {}
            if not isinstance(adam, dict) or body.get("optimizer_params") is not None:
                raise UserError("optim_step: adam_params (ampd trains with AdamW)")
            return lambda: self.engine.optim_step(model, adam)

        return self._in_order(request, model, hashlib.sha256(raw).hexdigest(), body.get("seq_id"),
                              prepare, durable=True)

    async def save_weights(self, request):
        raw = await request.read()
        body = wire.json_body(raw, MAX_JSON)
        model = self._model(request, body)

        def prepare():
            name = check_name(body.get("path") or "state-%d" % int(time.time() * 1000),
                              "checkpoint name")
            return lambda: {"type": "save_weights", "path": self.engine.save_state(model, name)}

        return self._in_order(request, model, hashlib.sha256(raw).hexdigest(), body.get("seq_id"),
                              prepare, durable=True)

    async def load_weights(self, request):
        raw = await request.read()
        body = wire.json_body(raw, MAX_JSON)
        path = body.get("path")
        optimizer = bool(body.get("optimizer"))
        owner = request["owner"]
        if body.get("model_id") is None:
            self.engine.parse_path(owner, path, kinds=("weights",))
            # Create-from-state: the SDK names the model SESSION:train:SEQ.
            session_id, seq = body.get("session_id"), body.get("model_seq_id")
            if not isinstance(session_id, str) or not isinstance(seq, int):
                raise UserError("load_weights: a model_id, or a session_id and model_seq_id")
            model_id = "%s:train:%d" % (session_id, seq)

            def create():
                self.engine.create_model_from_state(owner, model_id, path, optimizer)
                return {"type": "load_weights", "path": path, "model_id": model_id}

            return self._now(request, create)
        model = self._model(request, body)

        def prepare():
            self.engine.parse_path(owner, path, kinds=("weights",))

            def load():
                self.engine.load_state(model, path, optimizer)
                return {"type": "load_weights", "path": path, "model_id": model.model_id}
            return load

        return self._in_order(request, model, hashlib.sha256(raw).hexdigest(), body.get("seq_id"),
                              prepare)

    async def save_weights_for_sampler(self, request):
        raw = await request.read()
        body = wire.json_body(raw, MAX_JSON)
        model = self._model(request, body)
        name = body.get("path")
        owner = request["owner"]

        def prepare():
            if name is not None:
                check_name(name, "sampler name")
            if body.get("kind", "snapshot") != "snapshot":
                raise UserError("save_weights_for_sampler: kind 'snapshot' only")
            return save

        def save():
            path = self.engine.save_for_sampler(model, name)
            if name is not None:
                return {"type": "save_weights_for_sampler", "path": path}
            session_id = self.engine.samplers.create_session(owner, model_path=path)
            return {"type": "save_weights_for_sampler", "path": path,
                    "sampling_session_id": session_id}

        return self._in_order(request, model, hashlib.sha256(raw).hexdigest(), body.get("seq_id"),
                              prepare)

    # ---- sampling ----------------------------------------------------------------

    async def create_sampling_session(self, request):
        body = await self._json(request)
        session_id = await self._blocking(lambda: self.engine.samplers.create_session(
            request["owner"], body.get("model_path"), body.get("base_model")))
        return _json_response({"type": "create_sampling_session",
                                  "sampling_session_id": session_id})

    async def get_sampler(self, request):
        session_id = request.match_info["sampler_id"]
        _, base_model, _, model_path, _, _ = self.engine.samplers.session(request["owner"],
                                                                          session_id)
        return _json_response({"sampler_id": session_id, "base_model": base_model,
                                  "model_path": model_path})

    async def asample(self, request):
        body = await self._json(request)
        owner = request["owner"]
        if body.get("sampling_session_id"):
            session = self.engine.samplers.session(owner, body["sampling_session_id"])
        else:
            session_id = await self._blocking(lambda: self.engine.samplers.create_session(
                owner, body.get("model_path"), body.get("base_model")))
            session = self.engine.samplers.session(owner, session_id)
        sample = sample_request.parse(body)

        def run():
            sequences, prompt_logprobs = self.engine.samplers.sample(owner, session, sample)
            return wire.sample_output(sequences, prompt_logprobs)

        return self._now(request, run, kind="sample", extra=lambda f: {
            "sample_sequence_ids": ["%s-%d" % (f.request_id, i)
                                    for i in range(sample["num_samples"])]})

    # ---- futures and checkpoints ---------------------------------------------------

    async def retrieve_future(self, request):
        body = await self._json(request)
        request_id = body.get("request_id")
        if not isinstance(request_id, str):
            raise UserError("request_id: a string")
        future = self.futures.get(request_id, request["owner"])
        if future is None:
            return _error(410, "request %s: not held (unknown, or evicted); send it again"
                          % request_id)
        await self._wait(future, 20.0)  # a long poll, under the SDK's 45 s
        if future.state == futures_mod.PENDING:
            return _json_response({"type": "try_again", "request_id": request_id,
                                      "queue_state": "active"})
        if future.state == futures_mod.FAILED:
            return _json_response({"error": future.error, "category": future.category})
        if future.kind == "json":
            return _json_response(future.result)  # finite by construction
        proto, as_json = future.result
        if wire.PROTO in request.headers.get("Accept", ""):
            return web.Response(body=proto, content_type=wire.PROTO)
        try:
            return _json_response(as_json)
        except ValueError:  # NaN or infinity, which JSON cannot carry
            return _json_response({"error": "the result holds values JSON cannot carry (NaN "
                                   "or infinity); ask for it as %s" % wire.PROTO,
                                   "category": "user"})

    def _training_run(self, model):
        found = self.engine.list_checkpoints(model.owner, model.model_id)
        last = {kind: [c for c in found if c["checkpoint_type"] == kind][-1:]
                for kind in ("training", "sampler")}
        return {"training_run_id": model.model_id, "base_model": model.base_model,
                "model_owner": model.owner, "is_lora": True, "lora_rank": model.rank,
                "last_request_time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "last_checkpoint": (last["training"] or [None])[0],
                "last_sampler_checkpoint": (last["sampler"] or [None])[0]}

    async def list_training_runs(self, request):
        try:
            limit = int(request.query.get("limit", 20))
            offset = int(request.query.get("offset", 0))
        except ValueError:
            raise UserError("limit and offset: integers") from None
        if not 0 < limit <= 1000 or offset < 0:
            raise UserError("limit in 1..1000, offset >= 0")
        owner = request["owner"]
        mine = sorted((m for m in list(self.engine.models.values()) if m.owner == owner),
                      key=lambda m: m.model_id)
        runs = await self._blocking(lambda: [self._training_run(m)
                                             for m in mine[offset:offset + limit]])
        return _json_response({"training_runs": runs, "cursor": {
            "offset": offset, "limit": limit, "total_count": len(mine)}})

    async def get_training_run(self, request):
        model = self.engine.model(request["owner"], request.match_info["model_id"])
        return _json_response(await self._blocking(lambda: self._training_run(model)))

    async def list_checkpoints(self, request):
        model_id = check_name(request.match_info["model_id"], "model id")
        found = self.engine.list_checkpoints(request["owner"], model_id)
        return _json_response({"checkpoints": found, "cursor": None})

    async def delete_checkpoint(self, request):
        info = request.match_info
        path = "tinker://%s/%s/%s" % (info["model_id"], info["kind"], info["name"])
        await self._blocking(lambda: self.engine.delete_checkpoint(request["owner"], path))
        return _json_response({})
