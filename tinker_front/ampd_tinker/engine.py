"""Tinker's models, checkpoints and samplers on ampd's jobs.

A Tinker model is a LoRA job on the Hugging Face folder its base_model names
in the models directory (ampd.from_pretrained), in the front's precision,
batch_invariant so that a sampler's log-probs equal the trainer's bit for
bit. Its calls run one at a time in seq_id order (Runner). A checkpoint
lives under the state directory at the path its tinker:// name spells:
tinker://MODEL/weights/NAME (save_state: what training changed, the
adapters with their AdamW moments and the scaler, and the adapter as PEFT
writes one) and tinker://MODEL/sampler_weights/NAME (the adapter alone),
which samplers.py serves.

Every method here blocks on gRPC; the server runs them in threads.
"""
import json
import math
import os
import shutil
import threading
import time
import uuid

import numpy as np

import ampd
from ampd import safetensors

from ampd_tinker import losses
from ampd_tinker.errors import MODEL_ID, NAME, NotFound, UserError, check_name
from ampd_tinker.samplers import Samplers

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
LORA_ALPHA = 32.0
KEEP_EPHEMERAL = 32  # unnamed sampler checkpoints kept per model
KEEP_SNAPSHOTS = 16  # ampd sampler snapshots kept per job (ampd holds at most 32)


def _is_base_weight(name):
    """A LoRA job's frozen base weight (every name but the adapters' and the
    optimizer's): the same in every job on that base, so never checkpointed."""
    return not (name.startswith("base_model.model.") or name.startswith("optimizer."))


def _load_trained_state(job, path):
    """A save_state file into a job on the same base: the job's own base
    weights complete it into the full state a full load takes."""
    with open(path, "rb") as f:
        trained = safetensors.loads(f.read())
    state = job.state_dict("full")
    unknown = sorted(set(trained) - set(state))
    if unknown:
        raise UserError("checkpoint: %d tensors this model has not (%s...)" % (
            len(unknown), unknown[0]))
    state.update(trained)
    state.dtypes.update(trained.dtypes)
    job.load_state_dict(state, metadata=trained.metadata)


class Model:
    """One Tinker training model: its ampd job and what made it."""

    def __init__(self, model_id, owner, base_model, rank, job):
        self.model_id = model_id
        self.owner = owner
        self.base_model = base_model
        self.rank = rank
        self.job = job
        self.runner = None  # set by the server: its Runner

    def record(self):
        return {"owner": self.owner, "base_model": self.base_model, "rank": self.rank,
                "job_id": self.job.job_id}


class Engine:
    def __init__(self, ampd_address, models_dir, state_dir, precision="fp16", tokens=None,
                 max_samplers=4, max_models=64, default_token=None):
        self.models_dir = os.path.abspath(models_dir)
        self.state_dir = os.path.abspath(state_dir)
        self.precision = precision
        self.max_models = max_models
        self._address = ampd_address
        self._tokens = tokens or {}  # owner -> ampd bearer token
        self._default_token = default_token  # owners without their own
        self._clients = {}
        self._lock = threading.Lock()
        self._registry_lock = threading.Lock()
        self.models = {}  # model_id -> Model
        self.samplers = Samplers(self, max_samplers)
        os.makedirs(os.path.join(self.state_dir, "checkpoints"), exist_ok=True)

    # ---- ampd connections and the models registry --------------------------------

    def client(self, owner):
        token = self._tokens.get(owner, self._default_token)
        with self._lock:
            if token not in self._clients:
                self._clients[token] = ampd.Client(self._address, token=token,
                                                   timeout=600.0, retry_deadline=60.0)
            return self._clients[token]

    def _registry_path(self):
        return os.path.join(self.state_dir, "models.json")

    def _save_registry(self):
        """models.json as the table is now (one writer at a time)."""
        tmp = self._registry_path() + ".tmp"
        with self._registry_lock:
            with self._lock:
                data = {mid: m.record() for mid, m in self.models.items()}
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(data, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self._registry_path())

    def restore(self):
        """Reattach the models of an earlier run to their ampd jobs; returns them."""
        if not os.path.exists(self._registry_path()):
            return []
        with open(self._registry_path(), encoding="utf-8") as f:
            data = json.load(f)
        restored = []
        for model_id, r in data.items():
            try:
                job = self.client(r["owner"]).job(r["job_id"])
                # Gradients accumulated before the restart belong to calls
                # whose futures died with it; loading the job's own state
                # drops them (and nothing else), so the model starts clean.
                job.load_state_dict_bytes(job.state_dict_bytes("full"))
            except ampd.AmpdError:
                continue  # the job is gone (ampd restarted without its state)
            model = Model(model_id, r["owner"], r["base_model"], r["rank"], job)
            self.models[model_id] = model
            restored.append(model)
        return restored

    def model(self, owner, model_id):
        with self._lock:
            model = self.models.get(model_id)
        if model is None or model.owner != owner:
            raise NotFound("model %r: no such model" % (model_id,))
        return model

    def base_dir(self, base_model):
        """The folder of a base model name ("Qwen/Qwen2.5-0.5B" -> DIR/Qwen/Qwen2.5-0.5B)."""
        parts = str(base_model).split("/")
        if not base_model or any(p in ("", ".", "..") or not NAME.match(p) for p in parts):
            raise UserError("base_model %r: not a model name" % (base_model,))
        path = os.path.join(self.models_dir, *parts)
        if not os.path.exists(os.path.join(path, "config.json")):
            raise UserError("base_model %r: not served here (no %s/config.json)"
                            % (base_model, "/".join(parts)))
        return path

    def base_models(self):
        """The names of the folders under the models directory that hold config.json."""
        names = []
        for root, dirs, files in os.walk(self.models_dir):
            dirs.sort()
            if "config.json" in files:
                names.append(os.path.relpath(root, self.models_dir).replace(os.sep, "/"))
        return names

    # ---- training ----------------------------------------------------------------

    def create_model(self, owner, base_model, lora_config, model_id=None):
        lora_config = lora_config or {}
        rank = lora_config.get("rank", 32)
        if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= 1024:
            raise UserError("lora_config.rank %r: an integer in 1..1024" % (rank,))
        flags = {}
        for key in ("train_attn", "train_mlp", "train_unembed"):
            flags[key] = lora_config.get(key, True)
            if not isinstance(flags[key], bool):
                raise UserError("lora_config.%s %r: true or false" % (key, flags[key]))
        targets = list(_ATTN if flags["train_attn"] else ()) + list(
            _MLP if flags["train_mlp"] else ())
        if not targets:
            raise UserError("lora_config: train_attn or train_mlp (ampd adapts no unembedding)")
        seed = lora_config.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)
                                 or not 0 <= seed < 1 << 64):
            raise UserError("lora_config.seed %r: an integer in [0, 2^64)" % (seed,))
        seed = seed or 0
        directory = self.base_dir(base_model)
        with self._lock:
            if len(self.models) >= self.max_models:
                raise UserError("%d models loaded, the front's limit: unload one" % len(self.models))
        job = self.client(owner).create_job(
            ampd.from_pretrained(directory, lora=ampd.LoRA(rank=rank, alpha=LORA_ALPHA,
                                                           target_modules=list(targets))),
            precision=self.precision, optimizer=ampd.AdamW(lr=1e-4, betas=(0.9, 0.95), eps=1e-12,
                                                            weight_decay=0.0),
            seed=seed, batch_invariant=True, display_name="tinker:" + base_model)
        model = Model(model_id or "m" + uuid.uuid4().hex[:20], owner, base_model, rank, job)
        with self._lock:
            if model.model_id in self.models:
                job.delete()
                raise UserError("model %s exists" % model.model_id)
            self.models[model.model_id] = model
        self._save_registry()
        return model

    def unload_model(self, model):
        with self._lock:
            self.models.pop(model.model_id, None)
        self._save_registry()
        model.job.delete()

    def forward_backward(self, model, batch, forward_only):
        """Returns ({"logprobs": [...], "elementwise_loss": [...]}, metrics)."""
        if forward_only:
            result = model.job.evaluate(micro_batches=batch.micro_batches, return_logprobs=True)
            logprobs = [lp.reshape(-1) for lp in result.logprobs]
            elementwise = losses.elementwise_losses(batch, logprobs)
        else:
            kwargs = dict(batch.kwargs)
            result = model.job.forward_backward(micro_batches=batch.micro_batches,
                                                return_logprobs=True, **kwargs)
            logprobs = [lp.reshape(-1) for lp in result.logprobs]
            elementwise = [t.reshape(-1) for t in result.token_losses]
        loss = float(np.sum([np.sum(e, dtype=np.float64) for e in elementwise]))
        metrics = {"loss:sum": loss} if np.isfinite(loss) else {}  # JSON has no inf
        return {"logprobs": logprobs, "elementwise_loss": elementwise}, metrics

    def optim_step(self, model, adam):
        def number(key, default):
            value = adam.get(key, default)
            try:
                ok = not isinstance(value, bool) and math.isfinite(float(value))
            except (TypeError, ValueError, OverflowError):
                ok = False
            if not ok or isinstance(value, str):
                raise UserError("adam_params.%s %r: a finite number" % (key, value))
            return float(value)

        lr = number("learning_rate", 1e-4)
        betas = (number("beta1", 0.9), number("beta2", 0.95))
        eps, wd = number("eps", 1e-12), number("weight_decay", 0.0)
        clip = number("grad_clip_norm", 0.0)
        if lr < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1) or eps <= 0 or wd < 0:
            raise UserError("adam_params: lr >= 0, betas in [0, 1), eps > 0, weight_decay >= 0")
        r = model.job.optim_step(lr=lr, betas=betas, eps=eps, weight_decay=wd, max_grad_norm=clip)
        metrics = {"loss_scale:unique": float(r.scale_after), "skipped:unique": float(r.skipped),
                   "step:unique": float(r.global_step)}
        if r.grad_norm is not None and np.isfinite(r.grad_norm):  # JSON has no inf
            metrics["grad_norm:mean"] = float(r.grad_norm)
        return {"metrics": metrics}

    # ---- checkpoints -------------------------------------------------------------

    def _checkpoint_dir(self, owner, model_id, kind, name):
        return os.path.join(self.state_dir, "checkpoints", owner, model_id, kind, name)

    def parse_path(self, owner, path, kinds=("weights", "sampler_weights")):
        """A tinker:// path of this owner as (model_id, kind, name, directory)."""
        if not isinstance(path, str) or not path.startswith("tinker://"):
            raise UserError("path %r: a tinker:// path" % (path,))
        parts = path[len("tinker://"):].split("/")
        if len(parts) != 3 or parts[1] not in kinds:
            raise UserError("path %r: tinker://MODEL/{%s}/NAME" % (path, "|".join(kinds)))
        model_id, kind, name = parts
        if not MODEL_ID.match(model_id):
            raise UserError("path %r: no model id" % (path,))
        check_name(name, "checkpoint name")
        directory = self._checkpoint_dir(owner, model_id, kind, name)
        if not os.path.exists(os.path.join(directory, "meta.json")):
            raise NotFound("checkpoint %s: no such checkpoint" % path)
        return model_id, kind, name, directory

    def _write_checkpoint(self, model, kind, name, write, extra=None):
        directory = self._checkpoint_dir(model.owner, model.model_id, kind, name)
        tmp = directory + ".tmp-" + uuid.uuid4().hex[:8]
        os.makedirs(tmp)
        try:
            write(tmp)
            meta = {"base_model": model.base_model, "rank": model.rank,
                    "step": model.job.step_count, "time": time.time()}
            meta.update(extra or {})
            with open(os.path.join(tmp, "meta.json"), "w", encoding="utf-8") as f:
                json.dump(meta, f)
            if os.path.exists(directory):
                self._forget(directory)
            os.replace(tmp, directory)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return "tinker://%s/%s/%s" % (model.model_id, kind, name)

    def save_state(self, model, name):
        """The job's full state but its frozen base (what training changes:
        the adapters, their AdamW moments, the scaler and step counts), and
        its adapter as PEFT lays one out."""
        check_name(name, "checkpoint name")

        def write(directory):
            state = model.job.state_dict("full")
            trained = {k: v for k, v in state.items() if not _is_base_weight(k)}
            with open(os.path.join(directory, "state.safetensors"), "wb") as f:
                f.write(safetensors.dumps(trained, state.metadata, state.dtypes))
            model.job.export_peft(os.path.join(directory, "adapter"))

        return self._write_checkpoint(model, "weights", name, write)

    def load_state(self, model, path, optimizer):
        """The weights (and with optimizer, the optimizer's moments and the
        scaler) of a save_state checkpoint. Without optimizer the model gets
        a fresh job with the checkpoint's adapter, so its optimizer starts anew."""
        _, _, _, directory = self.parse_path(model.owner, path, kinds=("weights",))
        with open(os.path.join(directory, "meta.json"), encoding="utf-8") as f:
            meta = json.load(f)
        if meta["base_model"] != model.base_model or meta["rank"] != model.rank:
            raise UserError("checkpoint %s: base %s rank %d, the model's %s rank %d" % (
                path, meta["base_model"], meta["rank"], model.base_model, model.rank))
        if optimizer:
            _load_trained_state(model.job, os.path.join(directory, "state.safetensors"))
            return
        old = model.job
        model.job = self.client(model.owner).create_job(
            ampd.from_pretrained(self.base_dir(model.base_model),
                                 adapter=os.path.join(directory, "adapter")),
            precision=self.precision, optimizer=ampd.AdamW(lr=1e-4, betas=(0.9, 0.95), eps=1e-12,
                                                            weight_decay=0.0),
            batch_invariant=True, display_name="tinker:" + model.base_model)
        self._save_registry()
        old.delete()

    def create_model_from_state(self, owner, model_id, path, optimizer):
        """The SDK's create_training_client_from_state: a new model named
        model_id with a checkpoint's weights (and optimizer, with optimizer)."""
        if not isinstance(model_id, str) or not MODEL_ID.match(model_id):
            raise UserError("model id %r: not a model id" % (model_id,))
        _, _, _, directory = self.parse_path(owner, path, kinds=("weights",))
        with open(os.path.join(directory, "meta.json"), encoding="utf-8") as f:
            meta = json.load(f)
        with self._lock:
            if model_id in self.models:
                raise UserError("model %s exists" % model_id)
        job = self.client(owner).create_job(
            ampd.from_pretrained(self.base_dir(meta["base_model"]),
                                 adapter=os.path.join(directory, "adapter")),
            precision=self.precision, optimizer=ampd.AdamW(lr=1e-4, betas=(0.9, 0.95), eps=1e-12,
                                                            weight_decay=0.0),
            batch_invariant=True, display_name="tinker:" + meta["base_model"])
        model = Model(model_id, owner, meta["base_model"], meta["rank"], job)
        try:
            if optimizer:
                _load_trained_state(job, os.path.join(directory, "state.safetensors"))
        except BaseException:
            job.delete()
            raise
        with self._lock:
            self.models[model_id] = model
        self._save_registry()
        return model

    def save_for_sampler(self, model, name=None):
        """The adapter as a sampler checkpoint; returns its tinker:// path.
        Unnamed (save_weights_and_get_sampling_client): an ephemeral one, of
        which a model keeps its newest KEEP_EPHEMERAL."""
        if name is None:
            name = "ephemeral-%d-%s" % (model.job.step_count, uuid.uuid4().hex[:8])
        check_name(name, "sampler name")
        snapshot = self._snapshot(model)
        path = self._write_checkpoint(
            model, "sampler_weights", name, model.job.export_peft,
            extra={"snapshot": snapshot, "job_id": model.job.job_id} if snapshot else None)
        folder = os.path.join(self.state_dir, "checkpoints", model.owner, model.model_id,
                              "sampler_weights")
        ephemeral = sorted((os.path.getmtime(os.path.join(folder, n, "meta.json")), n)
                           for n in os.listdir(folder) if n.startswith("ephemeral-")
                           and os.path.exists(os.path.join(folder, n, "meta.json")))
        for _, old in ephemeral[:-KEEP_EPHEMERAL]:
            self._forget(os.path.join(folder, old))
        return path

    def _snapshot(self, model):
        """A sampler snapshot of the model's job now (ampd's immutable copy
        of the weights Sample reads: a LoRA job's adapters alone), its
        oldest dropped when the job holds KEEP_SNAPSHOTS; None when ampd
        cannot hold one (its memory limits): the sampler then loads the
        adapter into a job of its own."""
        name = "tk-" + uuid.uuid4().hex[:20]
        for _ in range(2):
            try:
                held = model.job.sampler_snapshots()
                for old in sorted(held, key=lambda s: s.step)[:max(0, len(held) + 1
                                                                   - KEEP_SNAPSHOTS)]:
                    model.job.delete_sampler_snapshot(old.name)
                return model.job.save_sampler_snapshot(name)
            except (ampd.SnapshotLimit, ampd.SnapshotNotFound):
                continue  # another save raced this one: look again
            except ampd.MemoryLimit:
                return None
        return None

    def live_snapshot(self, meta):
        """(the job, snapshot name) a checkpoint's meta names, while that job
        is still the model's; else None."""
        if not meta.get("snapshot"):
            return None
        with self._lock:
            for model in self.models.values():
                if model.job.job_id == meta["job_id"]:
                    return model.job, meta["snapshot"]
        return None

    def _forget(self, directory):
        """Remove a checkpoint folder, its snapshot and the samplers made of it."""
        try:
            with open(os.path.join(directory, "meta.json"), encoding="utf-8") as f:
                live = self.live_snapshot(json.load(f))
        except (OSError, ValueError):
            live = None
        if live is not None:
            try:
                live[0].delete_sampler_snapshot(live[1])
            except ampd.AmpdError:
                pass  # gone with its job, or already
        self.samplers.drop(directory)
        shutil.rmtree(directory, ignore_errors=True)

    def delete_checkpoint(self, owner, path):
        _, _, _, directory = self.parse_path(owner, path)
        self._forget(directory)

    def list_checkpoints(self, owner, model_id):
        out = []
        for kind in ("weights", "sampler_weights"):
            folder = os.path.join(self.state_dir, "checkpoints", owner, model_id, kind)
            for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
                meta_path = os.path.join(folder, name, "meta.json")
                if not os.path.exists(meta_path):
                    continue  # a write in progress
                with open(meta_path, encoding="utf-8") as f:
                    meta = json.load(f)
                out.append({"checkpoint_id": kind + "/" + name,
                            "checkpoint_type": "training" if kind == "weights" else "sampler",
                            "tinker_path": "tinker://%s/%s/%s" % (model_id, kind, name),
                            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                  time.gmtime(meta["time"])),
                            "size_bytes": None, "public": False})
        return out
