"""Sampling sessions and the ampd jobs that serve them.

A session names what it samples: a base model, or a checkpoint's adapter
with the save time it had when the session was made. A sampler checkpoint
carries an ampd sampler snapshot of its training job (an immutable copy of
the adapters Sample reads while the job trains on); while that job lives,
its samples come from the snapshot. Otherwise (the job replaced or unloaded,
the snapshot dropped, a training checkpoint, a base model) and for prompt
log-probs (Evaluate has no snapshots), a LoRA job on the same base holding
the checkpoint's adapter serves them. Both are batch_invariant in the
front's precision, so their log-probs are the trainer's bit for bit; the
adapter jobs are made on first use and kept, least recently used first out
past max_jobs, and dropped with the checkpoint they were made from.
"""
import base64
import collections
import json
import os
import threading

import numpy as np

import ampd
from ampd_tinker import stops
from ampd_tinker.errors import NotFound, UserError


class Samplers:
    def __init__(self, engine, max_jobs):
        self._engine = engine
        self.max_jobs = max_jobs
        self._lock = threading.Lock()
        self._create_lock = threading.Lock()  # one load at a time; the next finds it
        self._samplers = collections.OrderedDict()  # (adapter, version) or base -> ampd.Job
        self.sessions = collections.OrderedDict()  # ids made since start (for metrics)
        self.stops = stops.Stops()  # base models' EOS ids and tokenizers

    def create_session(self, owner, model_path=None, base_model=None):
        """A session id that spells what it samples (the checkpoint's path
        and save time, or the base model), so that it outlives a restart of
        the front with nothing stored; it means something only to the key
        whose checkpoint it names."""
        if model_path:
            _, _, _, directory = self._engine.parse_path(owner, model_path)
            with open(os.path.join(directory, "meta.json"), encoding="utf-8") as f:
                spelled = [model_path, None, json.load(f)["time"]]
        elif base_model:
            self._engine.base_dir(base_model)
            spelled = [None, base_model, None]
        else:
            raise UserError("create_sampling_session: model_path or base_model")
        session_id = "s" + base64.urlsafe_b64encode(json.dumps(spelled).encode()).decode()
        self.sessions[session_id] = True  # counted by the metrics (bounded below)
        while len(self.sessions) > 4096:
            self.sessions.pop(next(iter(self.sessions)))
        return session_id

    def session(self, owner, session_id):
        """(owner, base_model, adapter dir or None, model_path, save time,
        the checkpoint's meta or None)."""
        try:
            if not session_id.startswith("s") or len(session_id) > 4096:
                raise ValueError(session_id)
            model_path, base_model, version = json.loads(
                base64.urlsafe_b64decode(session_id[1:].encode()))
        except (ValueError, TypeError, UnicodeError, AttributeError):
            raise NotFound("sampling session %r: no such session" % (session_id,)) from None
        if model_path is None:
            self._engine.base_dir(base_model)
            return owner, base_model, None, None, None, None
        try:
            _, kind, _, directory = self._engine.parse_path(owner, model_path)
        except (NotFound, UserError):
            raise NotFound("sampling session %r: no such session (its weights are gone or "
                           "another key's)" % (session_id,)) from None
        with open(os.path.join(directory, "meta.json"), encoding="utf-8") as f:
            meta = json.load(f)
        adapter = directory if kind == "sampler_weights" else os.path.join(directory, "adapter")
        return owner, meta["base_model"], adapter, model_path, version, meta

    def _job(self, owner, base_model, adapter, version):
        """The ampd job a sampler samples with, made once and kept (LRU).
        Keyed by the checkpoint's folder and its save time: a sampler never
        serves weights saved over the ones its session was made for."""
        key = (adapter, version) if adapter else ("base", base_model)
        with self._lock:
            job = self._samplers.get(key)
            if job is not None:
                self._samplers.move_to_end(key)
                return job
        with self._create_lock:  # one load at a time; the next finds it
            with self._lock:
                job = self._samplers.get(key)
                if job is not None:
                    return job
            if adapter:
                meta_path = os.path.join(os.path.dirname(adapter) if adapter.endswith(
                    os.sep + "adapter") else adapter, "meta.json")
                try:
                    with open(meta_path, encoding="utf-8") as f:
                        current = json.load(f)["time"]
                except FileNotFoundError:
                    current = None
                if current != version:
                    raise UserError("the weights this sampling client was made for were "
                                    "deleted or saved over; make a new sampling client")
            directory = self._engine.base_dir(base_model)
            pretrained = (ampd.from_pretrained(directory, adapter=adapter) if adapter
                          else ampd.from_pretrained(directory))
            job = self._engine.client(owner).create_job(pretrained, precision=self._engine.precision,
                                                batch_invariant=True,
                                                display_name="tinker-sampler:" + base_model)
            evicted = []
            with self._lock:
                self._samplers[key] = job
                while len(self._samplers) > self.max_jobs:
                    evicted.append(self._samplers.popitem(last=False)[1])
            for old in evicted:
                old.delete()
            return job

    def drop(self, directory):
        """Delete the sampler jobs made from a checkpoint folder."""
        with self._lock:
            keys = [k for k in self._samplers if k[0] in (directory, os.path.join(directory,
                                                                                  "adapter"))]
            jobs = [self._samplers.pop(k) for k in keys]
        for job in jobs:
            job.delete()

    def sample(self, owner, session, request):
        """One asample: ([(tokens, logprobs, reason)], prompt_logprobs or None)."""
        _, base_model, adapter, _, version, meta = session
        if meta is not None and meta["time"] != version:
            raise UserError("the weights this sampling client was made for were saved over; "
                            "make a new sampling client")
        prompt = request["tokens"]
        params = request["sampling_params"]
        directory = self._engine.base_dir(base_model)
        stop_strings = params["stop_strings"]
        tokenizer = self.stops.tokenizer(directory) if stop_strings else None
        stop_ids = params["stop_ids"]
        if stop_ids is None:  # stop None or strings: the model's EOS ends a sequence too
            stop_ids = self.stops.eos_ids(directory)
        sample_args = dict(num_samples=request["num_samples"], max_tokens=params["max_tokens"],
                           temperature=params["temperature"], top_k=params["top_k"],
                           top_p=params["top_p"], stop=stop_ids, seed=params["seed"])
        prompt_logprobs = None
        if request["prompt_logprobs"]:
            # ampd's snapshots serve Sample alone: the prompt's log-probs
            # come from a job holding the checkpoint's adapter.
            if len(prompt) < 2:
                prompt_logprobs = np.full(len(prompt), np.nan, dtype=np.float32)
            else:
                values = self._job(owner, base_model, adapter, version).logprobs([prompt])[0]
                prompt_logprobs = np.concatenate([[np.nan], values]).astype(np.float32)
        completions = None
        live = self._engine.live_snapshot(meta) if meta is not None else None
        if live is not None:
            try:
                completions = live[0].sample([prompt], snapshot=live[1], **sample_args)
            except (ampd.SnapshotNotFound, ampd.JobNotFound):
                completions = None  # dropped meanwhile: the adapter's own job serves it
        if completions is None:
            completions = self._job(owner, base_model, adapter, version).sample(
                [prompt], **sample_args)
        sequences = [(c.tokens, c.logprobs, c.stop_reason) for c in completions[0]]
        if stop_strings:
            for i, (tokens, logprobs, reason) in enumerate(sequences):
                end = stops.cut(tokenizer, tokens, stop_strings)
                if end is not None:
                    sequences[i] = (tokens[:end], logprobs[:end], "stop")
        # Diverged weights (an fp16 forward past 65504) give NaN logits, from
        # which ampd draws the last token with a NaN log-prob: an RL loop
        # would train on garbage. Say so instead.
        if not all(np.all(np.isfinite(lp)) for _, lp, _ in sequences) or (
                prompt_logprobs is not None and not np.all(np.isfinite(prompt_logprobs[1:]))):
            raise UserError("the sampler's forward is not finite (NaN or infinite log-probs): "
                            "the weights have diverged in %s; lower the learning rate, or "
                            "load an earlier state" % self._engine.precision)
        last_n = request["prompt_logprobs_last_n"]
        if prompt_logprobs is not None and last_n is not None:
            # The whole prompt is the context either way; only the last N
            # are answered (the earlier ones NaN: None to the SDK).
            prompt_logprobs[:len(prompt) - last_n] = np.nan
        return sequences, prompt_logprobs
