"""ampd.Client and ampd.Job: the ergonomic layer over the generated stubs.

Exactly-once steps: a Job keeps the next sequence number and sends it with
each Step. UNAVAILABLE and DEADLINE_EXCEEDED are retried with exponential
backoff and full jitter by resending the same sequence: the server returns
the recorded response when that sequence was already applied, and trains it
when it was not, so an acknowledged step is never applied twice. After a
server restart the retry may find the job behind (steps acknowledged after
the last checkpoint on disk were lost); the Job then resynchronises from
GetJob and raises StepsLost naming the sequences whose batches the caller
must resend.
"""
import collections
import os
import random
import time
import uuid
from dataclasses import dataclass
from typing import Optional, Tuple

import grpc
import numpy as np

from ampd import errors, safetensors, spec
from ampd.v1 import trainer_pb2 as pb
from ampd.v1 import trainer_pb2_grpc as pb_grpc

# Codes after which Client._call resends a call (every call it makes is safe to resend).
_TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
_CHUNK = 1 << 20  # LoadStateDict message size
# GetStateDictRequest.view by name.
_STATE_VIEWS = {"full": pb.STATE_VIEW_FULL, "adapter": pb.STATE_VIEW_ADAPTER,
                "merged": pb.STATE_VIEW_MERGED}

_NUMPY_DTYPES = {
    np.dtype(np.float32): pb.DTYPE_F32, np.dtype(np.float16): pb.DTYPE_F16,
    np.dtype(np.int32): pb.DTYPE_I32, np.dtype(np.int64): pb.DTYPE_I64,
}


def _read_pem(value):
    """PEM bytes from bytes, PEM text, or a file path; None stays None."""
    if value is None:
        return None
    if isinstance(value, bytes):
        return value
    if "-----BEGIN" in value:
        return value.encode()
    with open(value, "rb") as f:
        return f.read()


def to_tensor(value):
    """A pb.Tensor from a NumPy array, a torch tensor or anything np.asarray takes.

    float64 becomes float32 (NumPy's default float is not a dtype ampd
    trains in); torch.bfloat16 travels as BF16 bits; other dtypes are refused.
    """
    module = type(value).__module__
    if module.startswith("torch"):
        import torch  # only reached with a torch tensor in hand

        value = value.detach().cpu().contiguous()
        if value.dtype == torch.bfloat16:
            raw = value.view(torch.int16).numpy()
            return pb.Tensor(dtype=pb.DTYPE_BF16, shape=list(raw.shape),
                             data=raw.astype("<i2").tobytes())
        value = value.numpy()
    array = np.asarray(value)
    if array.dtype == np.float64:
        array = array.astype(np.float32)
    native = array.dtype.newbyteorder("=")
    if native not in _NUMPY_DTYPES:
        raise TypeError("unsupported dtype %s: ampd takes float32, float16, int32 and int64" % array.dtype)
    array = np.ascontiguousarray(array, dtype=native.newbyteorder("<"))
    return pb.Tensor(dtype=_NUMPY_DTYPES[native], shape=list(array.shape), data=array.tobytes())


@dataclass(frozen=True)
class Timings:
    forward_seconds: float
    backward_seconds: float
    unscale_seconds: float
    optimizer_seconds: float
    total_seconds: float


@dataclass(frozen=True)
class StepResult:
    """One Step's outcome. scale_before is the scale this step used."""
    global_step: int
    applied_steps: int
    loss: float
    scale_before: float
    scale_after: float
    found_inf: bool
    skipped: bool
    grad_norm: Optional[float]
    scale_grew: bool
    scale_backed_off: bool
    growth_tracker: int
    overflows_until_backoff: int
    samples: int
    timings: Timings
    learning_rate: float  # the lr this step's update used (schedule or override)
    # Per-layer scales: each layer group's scale after the step (group 0
    # first; the last is scale_after); empty for a job-wide scale.
    layer_scales_after: Tuple[float, ...] = ()
    # return_logprobs: one float32 array per micro-batch of the targets'
    # shape, each target token's log-prob from this step's forward (the
    # weights before its update; 0 where the target is -100).
    logprobs: Optional[list] = None
    # return_logprobs with a loss that reads sampling_logprobs
    # (importance_sampling, ppo, cispo, dro): exp(logprobs -
    # sampling_logprobs) per micro-batch, as the loss's ratios.
    ratios: Optional[list] = None
    # A loss that reads sampling_logprobs: max |logp - sampling_logprob| over
    # the step's target tokens (0 when the sampler and the trainer agree).
    logprob_mismatch: Optional[float] = None
    # return_logprobs with a loss_fn: one float32 array per micro-batch of the
    # targets' shape, what each target token added to loss (Tinker's
    # elementwise loss; 0 where the target is -100); they sum to loss.
    token_losses: Optional[list] = None

    @classmethod
    def from_proto(cls, r):
        t = r.timings
        return cls(
            global_step=r.global_step, applied_steps=r.applied_steps, loss=r.loss,
            scale_before=r.scale_before, scale_after=r.scale_after, found_inf=r.found_inf,
            skipped=r.skipped, grad_norm=r.grad_norm if r.HasField("grad_norm") else None,
            scale_grew=r.scale_grew, scale_backed_off=r.scale_backed_off,
            growth_tracker=r.scaler_counters.growth_tracker,
            overflows_until_backoff=r.scaler_counters.overflows_until_backoff,
            samples=r.samples,
            timings=Timings(t.forward_seconds, t.backward_seconds, t.unscale_seconds,
                            t.optimizer_seconds, t.total_seconds),
            learning_rate=r.learning_rate,
            layer_scales_after=tuple(r.layer_scales_after),
            logprobs=[_f32_array(t) for t in r.logprobs] if r.logprobs else None,
            ratios=[_f32_array(t) for t in r.ratios] if r.ratios else None,
            logprob_mismatch=(r.logprob_mismatch if r.HasField("logprob_mismatch")
                              else None),
            token_losses=[_f32_array(t) for t in r.token_losses] if r.token_losses else None)


@dataclass(frozen=True)
class ForwardBackwardResult:
    """One forward_backward call's outcome: its loss (the mean over its
    micro-batches of the model's loss, or a token loss's sum over its
    tokens), the loss scale its gradients carry, and the calls accumulated
    for the next optim_step (this one included); logprobs, ratios,
    token_losses and logprob_mismatch as StepResult's, for this call's
    micro-batches."""
    sequence: int
    index: int
    loss: float
    loss_scale: float
    samples: int
    pending: int
    logprobs: Optional[list] = None
    ratios: Optional[list] = None
    logprob_mismatch: Optional[float] = None
    token_losses: Optional[list] = None


@dataclass(frozen=True)
class EvaluateResult:
    """One Evaluate's outcome: the loss a Step on the same micro-batches would
    report now (mean over them), rows evaluated, server-side seconds, and
    with return_logprobs one float32 array per micro-batch of the targets'
    shape: each target token's log-prob (0 where the target is -100)."""
    loss: float
    samples: int
    seconds: float
    logprobs: Optional[list] = None


def _f32_array(tensor):
    """A float32 pb.Tensor as a NumPy array of its shape."""
    return np.frombuffer(tensor.data, dtype="<f4").reshape(tuple(tensor.shape)).astype(np.float32)


def _micro_batches(inputs, targets, micro_batches, what):
    """step()'s and evaluate()'s arguments as a list of (inputs, targets)."""
    if micro_batches is None:
        if targets is None and isinstance(inputs, (list, tuple)):
            micro_batches = inputs
        else:
            micro_batches = [(inputs, targets)]
    micro_batches = list(micro_batches)
    if not micro_batches or not all(
            isinstance(mb, (list, tuple)) and len(mb) == 2 and mb[0] is not None
            and mb[1] is not None for mb in micro_batches):
        raise TypeError("%s takes (inputs, targets), or a non-empty list of "
                        "(inputs, targets) micro-batches" % what)
    return micro_batches


_LOSS_FNS = {
    "cross_entropy": pb.LOSS_FN_CROSS_ENTROPY,
    "importance_sampling": pb.LOSS_FN_IMPORTANCE_SAMPLING,
    "ppo": pb.LOSS_FN_PPO,
    "cispo": pb.LOSS_FN_CISPO,
    "dro": pb.LOSS_FN_DRO,
}


def _per_micro_batch(values, count, name):
    """A per-token input as one array per micro-batch (None: not sent)."""
    if values is None:
        return [None] * count
    if count == 1 and not isinstance(values, (list, tuple)):
        values = [values]
    values = list(values)
    if len(values) != count:
        raise ValueError("%s: %d arrays for %d micro-batches" % (name, len(values), count))
    return values


def _set_token_loss(request, micro_batches, loss_fn, weights, advantages, sampling_logprobs,
                    ppo_clip, cispo_clip=None, dro_beta=None, temperature=None):
    """step()'s token loss into the request (the server checks the rest,
    refusing a parameter the loss does not read)."""
    if loss_fn is not None:
        if loss_fn not in _LOSS_FNS:
            raise ValueError("loss_fn must be one of %s, got %r"
                             % (", ".join(sorted(_LOSS_FNS)), loss_fn))
        request.loss_fn = _LOSS_FNS[loss_fn]
    if ppo_clip is not None:
        request.ppo_clip_low, request.ppo_clip_high = (float(v) for v in ppo_clip)
    if cispo_clip is not None:
        request.cispo_clip_low, request.cispo_clip_high = (float(v) for v in cispo_clip)
    if dro_beta is not None:
        request.dro_beta = float(dro_beta)
    if temperature is not None:
        request.temperature = float(temperature)
    count = len(micro_batches)
    for name, values in (("weights", weights), ("advantages", advantages),
                         ("sampling_logprobs", sampling_logprobs)):
        for mb, value in zip(request.micro_batches, _per_micro_batch(values, count, name)):
            if value is not None:
                getattr(mb, name).CopyFrom(to_tensor(np.asarray(value, dtype=np.float32)))


class Client:
    """A connection to one ampd server.

    target: "host:port". token: the bearer token (default: $AMPD_TOKEN).
    tls_ca: the server certificate's CA (PEM bytes/text or a path; turns TLS
    on); tls_cert/tls_key: a client certificate for mutual TLS;
    tls_server_name: the name the server's certificate carries when target
    dials another (e.g. 127.0.0.1). timeout: seconds per call attempt.
    retry_deadline: seconds a retryable call keeps retrying UNAVAILABLE and
    DEADLINE_EXCEEDED (with backoff from initial_backoff doubling to
    max_backoff, full jitter) before raising.
    """

    def __init__(self, target, *, token=None, tls_ca=None, tls_cert=None, tls_key=None,
                 tls_server_name=None, timeout=60.0, retry_deadline=120.0,
                 initial_backoff=0.05, max_backoff=5.0, channel_options=()):
        self.target = target
        self.token = token if token is not None else os.environ.get("AMPD_TOKEN") or None
        self.timeout = timeout
        self.retry_deadline = retry_deadline
        self.initial_backoff = initial_backoff
        self.max_backoff = max_backoff
        options = [("grpc.max_receive_message_length", -1)] + list(channel_options)
        if tls_server_name:
            options.append(("grpc.ssl_target_name_override", tls_server_name))
        if tls_ca is not None or tls_cert is not None:
            if (tls_cert is None) != (tls_key is None):
                raise ValueError("tls_cert and tls_key go together")
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_read_pem(tls_ca), private_key=_read_pem(tls_key),
                certificate_chain=_read_pem(tls_cert))
            self._channel = grpc.secure_channel(target, credentials, options=options)
        else:
            self._channel = grpc.insecure_channel(target, options=options)
        self._stub = pb_grpc.TrainerStub(self._channel)

    def close(self):
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- plumbing --------------------------------------------------------------

    def _metadata(self):
        return (("authorization", "Bearer " + self.token),) if self.token else ()

    def _sleep_before_retry(self, attempt, deadline):
        """Sleep a jittered backoff; False when the retry deadline has passed."""
        # The exponent is capped: a long retry_deadline with a tiny backoff
        # reaches attempt counts whose 2**attempt no float can hold.
        backoff = min(self.max_backoff, self.initial_backoff * 2.0 ** min(attempt, 60))
        pause = random.uniform(0, backoff)
        if time.monotonic() + pause > deadline:
            return False
        time.sleep(pause)
        return True

    def _call(self, invoke):
        """invoke(metadata, timeout) once, or until it stops failing transiently.

        Every call passed here is safe to resend: reads (Evaluate among them),
        CreateJob (request_id), Step and OptimStep (sequence), ForwardBackward
        (sequence and index) and LoadStateDict (the same bytes load the same state). DeleteJob is not (a resend finds the job gone) and has its own loop.
        """
        deadline = time.monotonic() + self.retry_deadline
        attempt = 0
        while True:
            try:
                return invoke(self._metadata(), self.timeout)
            except grpc.RpcError as e:
                error = errors.from_rpc_error(e)
            if not (error.code in _TRANSIENT and self._sleep_before_retry(attempt, deadline)):
                raise error
            attempt += 1

    # ---- jobs ------------------------------------------------------------------

    def create_job(self, model=None, precision="fp16", optimizer=None, scaler=None, seed=0,
                   display_name="", request_id=None, batch_invariant=False, base_model=None,
                   lora=None):
        """Create a job; returns its Job.

        model: an ampd.Model (or a pb.ModelSpec), or ampd.from_pretrained(DIR)
        (a Hugging Face folder, whose weights are loaded before this returns).
        base_model: instead of model, a folder of the server's --models-dir
        (Client.models() lists them), whose config.json is the model and
        whose weights the server loads itself; with lora (an ampd.LoRA) a
        LoRA job whose base the server shares, read-only, with every other
        LoRA job on it (same precision); without, a full job with its own
        copy. optimizer: ampd.SGD / Adam /
        AdamW (default AdamW with PyTorch's defaults); scaler: ampd.Scaler
        (default the pytorch policy's defaults for fp16, a static scale of 1
        for bf16/fp32). request_id makes a retried create return the same job;
        one is generated when not given, so this call's own retries are safe.
        batch_invariant: kernels whose every row's bits do not depend on the
        batch, so Job.sample's log-probs equal the trainer's bit for bit.
        """
        if base_model is not None:
            if model is not None:
                raise ValueError("model and base_model: give one (the base's config.json is "
                                 "the model)")
            model = pb.ModelSpec()
            if lora is not None:
                model.decoder.lora.CopyFrom(lora.to_proto() if hasattr(lora, "to_proto") else lora)
        elif lora is not None:
            raise ValueError("lora: with base_model only (else give it in the model's spec)")
        elif model is None:
            raise ValueError("model: required (or base_model)")
        config = pb.JobConfig(
            display_name=display_name,
            model=model.to_proto() if hasattr(model, "to_proto") else model,
            precision=spec.precision_proto(precision), seed=seed,
            batch_invariant=batch_invariant, base_model=base_model or "",
            hf_config_json=getattr(model, "hf_config_json", ""))
        if optimizer is not None:
            config.optimizer.CopyFrom(optimizer.to_proto() if hasattr(optimizer, "to_proto") else optimizer)
        if scaler is not None:
            config.scaler.CopyFrom(scaler.to_proto() if hasattr(scaler, "to_proto") else scaler)
        request = pb.CreateJobRequest(config=config, request_id=request_id or uuid.uuid4().hex)
        deadline = time.monotonic() + self.retry_deadline
        attempt = 0
        while True:
            try:
                response = self._call(
                    lambda md, t: self._stub.CreateJob(request, metadata=md, timeout=t))
                job = Job(self, response.job)
                # ampd.from_pretrained: the folder's weights (loading them twice is harmless).
                if hasattr(model, "load_weights"):
                    try:
                        model.load_weights(job)
                    except BaseException:
                        job.delete()  # no half-loaded job left behind
                        raise
                return job
            except errors.CreateRetry:
                # The first create with this request_id failed server-side; a
                # new attempt with the same id is what the server asks for.
                if not self._sleep_before_retry(attempt, deadline):
                    raise
                attempt += 1

    def models(self):
        """The base models of the server's --models-dir (ListModels): the
        names create_job(base_model=...) takes, sorted."""
        response = self._call(
            lambda md, t: self._stub.ListModels(pb.ListModelsRequest(), metadata=md, timeout=t))
        return list(response.models)

    def job(self, job_id):
        """The Job with this id (GetJob); its next sequence is the server's step + 1."""
        return Job(self, self._get_job(job_id))

    def jobs(self, page_size=0):
        """Every job of the caller's tenant, sorted by id (all pages)."""
        result, token = [], ""
        while True:
            request = pb.ListJobsRequest(page_size=page_size, page_token=token)
            response = self._call(
                lambda md, t: self._stub.ListJobs(request, metadata=md, timeout=t))
            result.extend(Job(self, j) for j in response.jobs)
            token = response.next_page_token
            if not token:
                return result

    def _get_job(self, job_id):
        request = pb.GetJobRequest(job_id=job_id)
        response = self._call(
            lambda md, t: self._stub.GetJob(request, metadata=md, timeout=t))
        return response.job



# One completion of Job.sample: its tokens, each token's log-prob (float32,
# temperature 1, the trainer's), why it ended ("length" or "stop"), and each
# token's log-prob under the distribution it was drawn from (float32: at the
# call's temperature, renormalised over what top_k and top_p kept; 0 at
# temperature 0), what a token loss takes as sampling_logprobs.
Completion = collections.namedtuple("Completion",
                                    ["tokens", "logprobs", "stop_reason", "sampling_logprobs"])
# A sampler snapshot of a job (Job.sampler_snapshots): step is the job's step
# count when it was taken, bytes what it holds on the device.
SamplerSnapshot = collections.namedtuple("SamplerSnapshot",
                                         ["name", "step", "applied_steps", "bytes"])

class Job:
    """A training job on the server, and this client's place in its sequence.

    Attributes mirror the last GetJob/CreateJob seen (refresh() reads them
    again): job_id, config (the effective pb.JobConfig), step,
    applied_steps, loss_scale, layer_scales (each layer group's scale with
    per-layer scales, else empty), state ("active"/"failed"), failure,
    parameter_count, estimated_bytes, growth_tracker, overflows_until_backoff.
    next_sequence is the sequence the next step() (or optim_step()) sends;
    pending, the forward_backward calls sent since the last update.
    """

    def __init__(self, client, proto):
        self._client = client
        self._update(proto)
        self.next_sequence = proto.step + 1
        # forward_backward calls this client sent for the next optim_step.
        self.pending = 0

    def _update(self, proto):
        self.proto = proto
        self.job_id = proto.job_id
        self.config = proto.config
        self.step_count = proto.step
        self.applied_steps = proto.applied_steps
        self.loss_scale = proto.loss_scale
        self.layer_scales = list(proto.layer_scales)
        self.state = {pb.JOB_STATE_ACTIVE: "active", pb.JOB_STATE_FAILED: "failed"}.get(
            proto.state, "unspecified")
        self.failure = proto.failure
        self.parameter_count = proto.parameter_count
        self.estimated_bytes = proto.estimated_bytes
        self.grad_norm = proto.grad_norm if proto.HasField("grad_norm") else None
        self.growth_tracker = proto.scaler_counters.growth_tracker
        self.overflows_until_backoff = proto.scaler_counters.overflows_until_backoff

    def __repr__(self):
        return "ampd.Job(%r, step=%d, loss_scale=%g, state=%s)" % (
            self.job_id, self.step_count, self.loss_scale, self.state)

    def refresh(self):
        """Read the job again (GetJob) and resynchronise next_sequence to its step + 1."""
        self._update(self._client._get_job(self.job_id))
        self.next_sequence = self.step_count + 1
        return self

    # ---- steps -----------------------------------------------------------------

    def step(self, inputs=None, targets=None, *, micro_batches=None, learning_rate=None,
             loss_fn=None, weights=None, advantages=None, sampling_logprobs=None,
             ppo_clip=None, cispo_clip=None, dro_beta=None, return_logprobs=False,
             temperature=None):
        """Train one step; returns a StepResult.

        job.step(inputs, targets) with NumPy arrays or torch tensors, or
        job.step([(inputs, targets), ...]) (or micro_batches=[...]) for
        gradient accumulation over micro-batches with one scale for the step.
        learning_rate overrides the optimizer's lr for this step only.

        loss_fn (a GPT's token losses, Tinker's names and definitions, sums
        over every target token): "cross_entropy" (-sum weights * logp;
        weights optional), "importance_sampling" (-sum exp(logp - q) * A),
        "ppo" (-sum min(r A, clip(r, lo, hi) A), ppo_clip=(lo, hi),
        default (0.8, 1.2)), "cispo" (-sum sg(clip(r, lo, hi)) logp A, the
        clipped ratio a constant, cispo_clip=(lo, hi), default (0, 4)) or
        "dro" (-sum (logp A - dro_beta / 2 (logp - q)^2), dro_beta default
        0.05), with advantages A, sampling_logprobs q and r = exp(logp - q).
        A parameter the loss does not read is refused (InvalidArgument).
        weights, advantages and sampling_logprobs are float32 arrays of the
        targets' shape, one per micro-batch (a list when there are several).
        None: the model's own loss (the mean token cross-entropy).
        A loss with sampling_logprobs reports logprob_mismatch, max |logp - q|
        over the target tokens. return_logprobs (a GPT or decoder): the
        result's logprobs (and ratios, with sampling_logprobs; and
        token_losses, each token's share of loss, with a loss_fn) per
        micro-batch, from this step's forward.
        temperature (a GPT or decoder, any loss): logp is
        log_softmax(logits / temperature), as job.sample(temperature=...)
        computes its sampling_logprobs (bit for bit on a batch_invariant
        job when top_k and top_p keep every token); the gradient carries
        the 1 / temperature. None: 1.
        """
        micro_batches = _micro_batches(inputs, targets, micro_batches, "step")
        request = pb.StepRequest(
            job_id=self.job_id, sequence=self.next_sequence,
            micro_batches=[pb.MicroBatch(inputs=to_tensor(x), targets=to_tensor(y))
                           for x, y in micro_batches])
        if learning_rate is not None:
            request.learning_rate = learning_rate
        request.return_logprobs = bool(return_logprobs)
        _set_token_loss(request, micro_batches, loss_fn, weights, advantages,
                        sampling_logprobs, ppo_clip, cispo_clip, dro_beta, temperature)
        stub = self._client._stub
        try:
            response = self._client._call(
                lambda md, t: stub.Step(request, metadata=md, timeout=t))
        except errors.SequenceMismatch as e:
            raise self._resynchronise(request.sequence, e) from e
        self.next_sequence = request.sequence + 1
        self.step_count = response.global_step
        self.applied_steps = response.applied_steps
        self.loss_scale = response.scale_after
        self.layer_scales = list(response.layer_scales_after)
        return StepResult.from_proto(response)

    def forward_backward(self, inputs=None, targets=None, *, micro_batches=None, loss_fn=None,
                         weights=None, advantages=None, sampling_logprobs=None, ppo_clip=None,
                         cispo_clip=None, dro_beta=None, return_logprobs=False,
                         micro_batches_in_update=0, temperature=None):
        """Forward and backward only: the gradients are added to those the
        job holds for its next update, applied by optim_step(); returns a
        ForwardBackwardResult.

        Takes step()'s batch and token-loss arguments (temperature too). Several calls, then
        one optim_step(), train exactly as one step() over all their
        micro-batches (in order) does. The model's own loss is a mean over
        micro-batches: pass micro_batches_in_update, the number of
        micro-batches over every call of the update, for each call to carry
        its share (0: this call's own count). Token losses are sums and need
        nothing. The accumulated gradients live in the server's memory: a
        restart loses them and the next call raises AccumulationLost, whose
        pending_lost calls (from expected_index) must be sent again.
        """
        micro_batches = _micro_batches(inputs, targets, micro_batches, "forward_backward")
        request = pb.ForwardBackwardRequest(
            job_id=self.job_id, sequence=self.next_sequence, index=self.pending + 1,
            micro_batches=[pb.MicroBatch(inputs=to_tensor(x), targets=to_tensor(y))
                           for x, y in micro_batches],
            return_logprobs=bool(return_logprobs),
            micro_batches_in_update=int(micro_batches_in_update))
        _set_token_loss(request, micro_batches, loss_fn, weights, advantages,
                        sampling_logprobs, ppo_clip, cispo_clip, dro_beta, temperature)
        stub = self._client._stub
        # Safe to resend: the server answers a resent last call from its record.
        r = self._accumulating_call(
            lambda md, t: stub.ForwardBackward(request, metadata=md, timeout=t))
        self.pending = r.pending
        return ForwardBackwardResult(
            sequence=r.sequence, index=r.index, loss=r.loss, loss_scale=r.loss_scale,
            samples=r.samples, pending=r.pending,
            logprobs=[_f32_array(t) for t in r.logprobs] if r.logprobs else None,
            ratios=[_f32_array(t) for t in r.ratios] if r.ratios else None,
            logprob_mismatch=(r.logprob_mismatch if r.HasField("logprob_mismatch") else None),
            token_losses=[_f32_array(t) for t in r.token_losses] if r.token_losses else None)

    def _accumulating_call(self, rpc):
        """A ForwardBackward or OptimStep call; on AccumulationLost the
        calls the server still holds (expected_index - 1) become pending, so
        the caller resends from there."""
        try:
            return self._client._call(rpc)
        except errors.AccumulationLost as e:
            self.pending = (e.expected_index or 1) - 1
            raise

    def optim_step(self, lr=None, betas=None, eps=None, weight_decay=None, max_grad_norm=None):
        """Apply the gradients of the forward_backward calls since the last
        update; returns a StepResult (its loss: the update's, as one step()
        over the same micro-batches reports it).

        Each hyperparameter given replaces the job's for this update only,
        as torch.optim.AdamW reads it: lr, betas=(beta1, beta2), eps,
        weight_decay, max_grad_norm (<= 0: no clipping). An overflow skips
        the update (result.skipped) and drops the accumulated gradients, as
        PyTorch's GradScaler does. Raises AccumulationLost when the server
        no longer holds every call sent (a restart): nothing is applied; and
        InvalidArgument when no forward_backward call was sent.
        """
        request = pb.OptimStepRequest(job_id=self.job_id, sequence=self.next_sequence,
                                      forward_backward_calls=self.pending)
        if lr is not None:
            request.learning_rate = lr
        if betas is not None:
            request.beta1, request.beta2 = (float(b) for b in betas)
        if eps is not None:
            request.eps = eps
        if weight_decay is not None:
            request.weight_decay = weight_decay
        if max_grad_norm is not None:
            request.max_grad_norm = max_grad_norm
        stub = self._client._stub
        response = self._accumulating_call(
            lambda md, t: stub.OptimStep(request, metadata=md, timeout=t))
        self.pending = 0
        self.next_sequence = request.sequence + 1
        self.step_count = response.global_step
        self.applied_steps = response.applied_steps
        self.loss_scale = response.scale_after
        self.layer_scales = list(response.layer_scales_after)
        return StepResult.from_proto(response)

    def evaluate(self, inputs=None, targets=None, *, micro_batches=None, return_logprobs=False,
                 temperature=None):
        """Forward and loss only (a validation loss); returns an EvaluateResult.

        Takes what step() takes. The job's weights, optimizer, loss scale and
        step sequence are unchanged; it runs after the steps sent before it.
        return_logprobs (a GPT or decoder): each target token's log-prob too.
        temperature (a GPT or decoder): the log-probs and the loss of
        softmax(logits / temperature), as step()'s; None: 1.
        """
        request = pb.EvaluateRequest(job_id=self.job_id, return_logprobs=return_logprobs,
                                     micro_batches=[
            pb.MicroBatch(inputs=to_tensor(x), targets=to_tensor(y))
            for x, y in _micro_batches(inputs, targets, micro_batches, "evaluate")])
        if temperature is not None:
            request.temperature = float(temperature)
        stub = self._client._stub
        response = self._client._call(
            lambda md, t: stub.Evaluate(request, metadata=md, timeout=t))
        logprobs = [_f32_array(t) for t in response.logprobs] if return_logprobs else None
        return EvaluateResult(response.loss, response.samples, response.seconds, logprobs)

    def logprobs(self, sequences, temperature=None):
        """Per-token log-probs of token sequences under the job's weights,
        without training (Tinker's compute_logprobs): one float32 array per
        sequence of length len - 1, whose entry i is the log-prob of token
        i + 1 given tokens 0..i. Sequences may differ in length (each is its
        own micro-batch of one) and need at least two tokens. temperature:
        those of softmax(logits / temperature) (None: 1)."""
        batches = []
        for i, sequence in enumerate(sequences):
            ids = np.asarray(sequence, dtype=np.int64).reshape(-1)
            if ids.size < 2:
                raise ValueError("sequences[%d]: needs at least two tokens, got %d" % (i, ids.size))
            batches.append((ids[None, :-1], ids[None, 1:]))
        if not batches:
            raise ValueError("logprobs takes at least one sequence")
        result = self.evaluate(micro_batches=batches, return_logprobs=True,
                               temperature=temperature)
        return [values[0] for values in result.logprobs]

    def sample(self, prompts, num_samples=1, max_tokens=16, temperature=1.0, top_k=0, top_p=1.0,
               stop=(), seed=0, seeds=None, snapshot=None):
        """Completions of token-id prompts from the job's current weights (the
        Sample RPC, after the steps sent before it): per prompt, a list of
        num_samples Completion(tokens, logprobs, stop_reason,
        sampling_logprobs), logprobs[i] being the log-prob of tokens[i] at
        temperature 1 as the trainer computes it (bit for bit on a
        batch_invariant job), sampling_logprobs[i] its log-prob under the
        distribution it was drawn from: at the temperature, over the tokens
        top_k and top_p kept (what a token loss's sampling_logprobs are;
        when top_k and top_p keep every token, bit for bit on a
        batch_invariant job what step(..., temperature=temperature)
        computes; 0 at temperature 0, the certain greedy draw). temperature 0
        takes the most likely token; top_k 0 (or >= the vocabulary) keeps
        every token; stop: token ids that end a completion (kept, at most
        64); max_tokens >= 1. seed: the same request gives the same tokens
        (completion j of prompt i draws from Philox stream i * num_samples
        + j under it). seeds: None, or one per prompt, each an int (the
        prompt's own key: its completion j draws from stream j, so the
        prompt gives the same completions wherever it sits in any request)
        or None (the request's seed, by position). snapshot: the name of a
        sampler snapshot (save_sampler_snapshot) to sample from instead of
        the current weights, however far the job trained since; an unknown
        name raises SnapshotNotFound."""
        prompts = list(prompts)
        if seeds is not None:
            seeds = list(seeds)
            if len(seeds) != len(prompts):
                raise ValueError(f"seeds: one per prompt ({len(prompts)}), got {len(seeds)}")
        request = pb.SampleRequest(
            job_id=self.job_id,
            prompts=[pb.TokenSequence(tokens=[int(t) for t in np.asarray(p).reshape(-1)])
                     for p in prompts],
            num_samples=num_samples, max_tokens=max_tokens, temperature=temperature,
            top_k=top_k, top_p=top_p, stop_token_ids=[int(t) for t in stop], seed=seed,
            snapshot=snapshot or "")
        for sequence, own in zip(request.prompts, seeds or ()):
            if own is not None:
                sequence.seed = int(own)
        stub = self._client._stub
        response = self._client._call(lambda md, t: stub.Sample(request, metadata=md, timeout=t))
        return [[Completion(list(c.tokens), np.asarray(c.logprobs, dtype=np.float32),
                            "stop" if c.stop_reason == pb.STOP_REASON_STOP_TOKEN else "length",
                            np.asarray(c.sampling_logprobs, dtype=np.float32))
                 for c in prompt.completions]
                for prompt in response.prompts]

    # ---- sampler snapshots -------------------------------------------------------

    def save_sampler_snapshot(self, name=None):
        """Name an immutable copy of the weights sample() reads now (Tinker's
        save_weights_for_sampler), after the steps sent before it; returns
        its name. sample(..., snapshot=NAME) then samples from it while the
        job trains on (on a batch_invariant job its log-probs are, bit for
        bit, the training forward's at this step). A LoRA job's snapshot
        holds its adapters alone. name: 1 to 64 of [A-Za-z0-9_-]; None:
        "step-N". Saving again under a name that holds exactly the weights
        now returns it (a retry makes no second copy); a name held for other
        weights raises SnapshotExists. The copy is admitted against the
        server's memory limits (MemoryLimit), at most 32 a job
        (SnapshotLimit), and with --state-dir it survives a restart."""
        request = pb.SaveSamplerSnapshotRequest(job_id=self.job_id, snapshot=name or "")
        stub = self._client._stub
        response = self._client._call(
            lambda md, t: stub.SaveSamplerSnapshot(request, metadata=md, timeout=t))
        return response.snapshot.name

    def sampler_snapshots(self):
        """The job's sampler snapshots, sorted by name: SamplerSnapshot(name,
        step, applied_steps, bytes), step being the job's step count when it
        was taken."""
        request = pb.ListSamplerSnapshotsRequest(job_id=self.job_id)
        stub = self._client._stub
        response = self._client._call(
            lambda md, t: stub.ListSamplerSnapshots(request, metadata=md, timeout=t))
        return [SamplerSnapshot(s.name, s.step, s.applied_steps, s.bytes)
                for s in response.snapshots]

    def delete_sampler_snapshot(self, name):
        """Free a sampler snapshot (and its file); SnapshotNotFound if none."""
        request = pb.DeleteSamplerSnapshotRequest(job_id=self.job_id, snapshot=name)
        stub = self._client._stub
        self._client._call(
            lambda md, t: stub.DeleteSamplerSnapshot(request, metadata=md, timeout=t))

    def _resynchronise(self, sequence, mismatch):
        """The error to raise for a SEQUENCE_MISMATCH on `sequence`, after GetJob.

        The server's step is the truth: next_sequence becomes step + 1.
        """
        self.refresh()
        server_step = self.step_count
        if server_step == sequence:
            return errors.StepResponseLost(
                mismatch.code,
                "step %d was applied before a server restart but its response is lost: %s"
                % (sequence, mismatch.message), sequence, mismatch.metadata)
        if server_step < sequence - 1:
            lost = list(range(server_step + 1, sequence))
            return errors.StepsLost(
                mismatch.code,
                "the server restarted from step %d: acknowledged steps %d..%d were lost; resend "
                "their batches, then step %d's" % (server_step, lost[0], lost[-1], sequence),
                lost, sequence, mismatch.metadata)
        # Ahead of this client (another client steps the same job): nothing to
        # replay, the caller decides; next_sequence already follows the server.
        return mismatch

    # ---- state -----------------------------------------------------------------

    def state_dict_bytes(self, view="full"):
        """The job's state as safetensors bytes (GetStateDict).

        view: "full" (weights, optimizer, scaler: what load_state_dict
        restores); "merged" (the model's weights alone, F32, a LoRA job's
        adapters merged into them: a plain model, or a base another job loads
        with partial=True); for a LoRA job "adapter" (the adapters in PEFT's
        names, with PEFT's adapter_config JSON in the metadata key
        "adapter_config")."""
        if view not in _STATE_VIEWS:
            raise ValueError(f"view: one of {sorted(_STATE_VIEWS)}, got {view!r}")
        request = pb.GetStateDictRequest(job_id=self.job_id, view=_STATE_VIEWS[view])
        stub = self._client._stub

        def fetch(md, t):
            return b"".join(c.data for c in stub.GetStateDict(request, metadata=md, timeout=t))

        data = self._client._call(fetch)
        return data

    def state_dict(self, view="full"):
        """A StateDict: name -> NumPy array (model.{i}.weight, optimizer moments...),
        with .metadata holding scaler.<key> (the policy's own names),
        optimizer.step and ampd.step; or the "merged" or a LoRA job's
        "adapter" view (state_dict_bytes)."""
        return safetensors.loads(self.state_dict_bytes(view))

    def load_state_dict_bytes(self, data, partial=False):
        """Replace the job's state with safetensors bytes (LoadStateDict).

        partial=True: the file holds some of the model's weights (one file of
        a sharded checkpoint); they replace theirs and nothing else changes.
        Loading the same bytes twice leaves the same state, so this retries
        transient failures; next_sequence follows the loaded ampd.step.
        """
        stub = self._client._stub
        job_id = self.job_id

        def messages():
            yield pb.LoadStateDictRequest(job_id=job_id, data=data[:_CHUNK], partial=partial)
            for offset in range(_CHUNK, len(data), _CHUNK):
                yield pb.LoadStateDictRequest(data=data[offset:offset + _CHUNK])

        self._client._call(lambda md, t: stub.LoadStateDict(messages(), metadata=md, timeout=t))
        self.refresh()

    def load_state_dict(self, state, metadata=None, partial=False):
        """Load a state dict: a StateDict from state_dict()/ampd.safetensors, or a
        plain dict of arrays with metadata given here. Every tensor and the
        scaler metadata of the job must be present (the server checks), or
        every weight for a weights-only load; partial=True loads the weights
        it holds and leaves the rest as it is."""
        if metadata is None:
            metadata = getattr(state, "metadata", {})
        self.load_state_dict_bytes(safetensors.dumps(state, metadata, getattr(state, "dtypes", {})),
                                   partial=partial)

    def export(self, path, view="full"):
        """Write the job's state (or its "merged" or a LoRA job's "adapter"
        view) to a safetensors file (as `ampctl state export`)."""
        data = self.state_dict_bytes(view)
        with open(path, "wb") as f:
            f.write(data)
        return path

    def export_peft(self, directory):
        """Write a LoRA job's adapter as PEFT saves one: adapter_model.safetensors
        and adapter_config.json in `directory` (created if needed), which
        peft.PeftModel.from_pretrained(base_model, directory) loads."""
        import json
        import os
        state = self.state_dict("adapter")
        os.makedirs(directory, exist_ok=True)
        config = json.loads(state.metadata["adapter_config"])
        with open(os.path.join(directory, "adapter_config.json"), "w") as f:
            json.dump(config, f, indent=2)
        with open(os.path.join(directory, "adapter_model.safetensors"), "wb") as f:
            f.write(safetensors.dumps(state, {"format": "pt"}, getattr(state, "dtypes", {})))
        return directory

    def save_pretrained(self, directory, max_shard_size="50GB"):
        """Write the job's weights as a Hugging Face folder (the config.json
        the server writes for its model, generation_config.json, and
        model.safetensors, or shards of at most max_shard_size with their
        index; a LoRA job's adapters merged in) that
        transformers.AutoModelForCausalLM.from_pretrained opens (ampd.hf)."""
        from ampd import hf
        return hf.save_pretrained(self, directory, max_shard_size)

    def load(self, path, partial=False):
        """Load a safetensors file written by export() (or ampctl) into this job;
        partial=True for one file of a sharded checkpoint."""
        with open(path, "rb") as f:
            self.load_state_dict_bytes(f.read(), partial=partial)

    def load_sharded(self, paths):
        """Load a sharded checkpoint (model-00001-of-00002.safetensors, ...)
        file by file, each a partial load: every file must hold only weights
        of this job's model, and together they replace the ones they hold.
        paths: the files, or a model.safetensors.index.json whose weight_map
        names them (relative to its folder)."""
        if isinstance(paths, (str, bytes)) and str(paths).endswith(".index.json"):
            import json
            import os
            with open(paths) as f:
                weight_map = json.load(f)["weight_map"]
            folder = os.path.dirname(os.path.abspath(paths))
            paths = [os.path.join(folder, name) for name in sorted(set(weight_map.values()))]
        for path in paths:
            self.load(path, partial=True)

    def delete(self):
        """Delete the job (and its checkpoint).

        A retry that finds the job gone counts as success: the first attempt
        deleted it.
        """
        request = pb.DeleteJobRequest(job_id=self.job_id)
        stub = self._client._stub
        deadline = time.monotonic() + self._client.retry_deadline
        attempt = 0
        while True:
            try:
                stub.DeleteJob(request, metadata=self._client._metadata(),
                               timeout=self._client.timeout)
                return
            except grpc.RpcError as e:
                error = errors.from_rpc_error(e)
            if attempt > 0 and isinstance(error, errors.JobNotFound):
                return
            if not (error.code in _TRANSIENT and self._client._sleep_before_retry(attempt, deadline)):
                raise error
            attempt += 1
