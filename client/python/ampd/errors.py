"""Typed exceptions for ampd's errors: the gRPC code and the ErrorInfo reason.

Every non-OK status from ampd carries a google.rpc.ErrorInfo (domain "ampd")
whose reason is stable across releases, unlike the message, which is for
people. Each exception class below stands for one reason (or, without one,
one gRPC code), so callers write `except ampd.SequenceMismatch as e:` and read
`e.expected_sequence` instead of parsing text.
"""
import grpc

from ampd import _rpc_status


class AmpdError(Exception):
    """An error from ampd (or from this client about ampd's state).

    code: the grpc.StatusCode; reason: the ErrorInfo reason ("" when the
    status carried none, e.g. gRPC's own RESOURCE_EXHAUSTED for an oversized
    request); metadata: the ErrorInfo's facts, a dict of strings; message: the
    server's message.
    """

    def __init__(self, code, message, reason="", metadata=None, domain=""):
        self.code = code
        self.message = message
        self.reason = reason
        self.metadata = dict(metadata or {})
        self.domain = domain
        super().__init__(str(self))

    def __str__(self):
        name = self.code.name if isinstance(self.code, grpc.StatusCode) else str(self.code)
        facts = " ".join("%s=%s" % kv for kv in sorted(self.metadata.items()))
        tag = " ".join(x for x in (self.reason, facts) if x)
        return "%s [%s]: %s" % (name, tag, self.message) if tag else "%s: %s" % (name, self.message)


class InvalidArgument(AmpdError):
    """INVALID_ARGUMENT; `field` names the request field when the server did."""

    @property
    def field(self):
        return self.metadata.get("field")


class InvalidField(InvalidArgument):
    pass


class InvalidStateDict(InvalidArgument):
    pass


class NotFound(AmpdError):
    pass


class JobNotFound(NotFound):
    @property
    def job_id(self):
        return self.metadata.get("job_id")


class FailedPrecondition(AmpdError):
    pass


class SequenceMismatch(FailedPrecondition):
    """The Step's sequence is not the job's next one."""

    @property
    def expected_sequence(self):
        value = self.metadata.get("expected_sequence")
        return int(value) if value is not None else None


class StepsLost(SequenceMismatch):
    """Acknowledged steps were lost: the server restarted from an older checkpoint.

    Raised by Job.step when, after a retry across a restart, the job's step
    on the server is behind steps this client saw acknowledged. The client
    does not keep batches, so it cannot replay them: resend the batches of
    `lost_sequences` (in order), then the batch of `pending_sequence` (the
    one whose step was in flight), with Job.step. The Job's next sequence is
    already set to `lost_sequences[0]`.
    """

    def __init__(self, code, message, lost_sequences, pending_sequence, metadata=None):
        self.lost_sequences = lost_sequences
        self.pending_sequence = pending_sequence
        super().__init__(code, message, "SEQUENCE_MISMATCH", metadata, "ampd")


class StepResponseLost(SequenceMismatch):
    """The step was applied before a restart, but its recorded response is gone.

    The batch did train (the job's step is `sequence`); only the response
    (loss, scale) cannot be returned. The Job's next sequence is sequence + 1.
    """

    def __init__(self, code, message, sequence, metadata=None):
        self.sequence = sequence
        super().__init__(code, message, "SEQUENCE_MISMATCH", metadata, "ampd")


class AccumulationLost(FailedPrecondition):
    """Gradients this client accumulated with forward_backward are gone.

    A server restart (or a state load, or a call that failed part-way)
    dropped them; nothing was applied from them. `pending_lost` calls must
    be sent again, from index `expected_index`, before the call that raised
    (or optim_step). Raised by Job.forward_backward and Job.optim_step.
    """

    @property
    def pending_lost(self):
        value = self.metadata.get("pending_lost")
        return int(value) if value is not None else None

    @property
    def expected_index(self):
        value = self.metadata.get("expected_index")
        return int(value) if value is not None else None


class AccumulationPending(FailedPrecondition):
    """A step() while forward_backward calls are accumulated: optim_step first."""

    @property
    def pending(self):
        value = self.metadata.get("pending")
        return int(value) if value is not None else None


class JobFailed(FailedPrecondition):
    """The job failed (its loss scaler gave up at its minimum scale).

    Load a good state with Job.load_state_dict to make it active again.
    """

    @property
    def job_id(self):
        return self.metadata.get("job_id")


class ScalerAtMinScale(JobFailed):
    """This step overflowed at the minimum scale (raise_at_min_scale, or no usable
    scale left below it); not applied, and the job is now failed."""


class ResourceExhausted(AmpdError):
    pass


class JobLimit(ResourceExhausted):
    pass


class MemoryLimit(ResourceExhausted):
    pass


class Aborted(AmpdError):
    pass


class CreateRetry(Aborted):
    pass


class Unavailable(AmpdError):
    pass


class ServerDraining(Unavailable):
    pass


class DeadlineExceeded(AmpdError):
    pass


class Unauthenticated(AmpdError):
    pass


class PermissionDenied(AmpdError):
    pass


class Internal(AmpdError):
    pass


class DataLoss(AmpdError):
    pass


class SnapshotNotFound(NotFound):
    """The job holds no sampler snapshot of that name (SNAPSHOT_NOT_FOUND)."""

    @property
    def snapshot(self):
        return self.metadata.get("snapshot")


class AlreadyExists(AmpdError):
    pass


class SnapshotExists(AlreadyExists):
    """save_sampler_snapshot with a name the job holds for other weights
    (SNAPSHOT_EXISTS, ALREADY_EXISTS): delete it first or choose another."""

    @property
    def snapshot(self):
        return self.metadata.get("snapshot")


class SnapshotLimit(ResourceExhausted):
    """The job holds as many sampler snapshots as it may (SNAPSHOT_LIMIT)."""

    @property
    def max_snapshots(self):
        value = self.metadata.get("max_snapshots")
        return int(value) if value is not None else None


_BY_REASON = {
    "INVALID_FIELD": InvalidField,
    "INVALID_STATE_DICT": InvalidStateDict,
    "JOB_NOT_FOUND": JobNotFound,
    "SEQUENCE_MISMATCH": SequenceMismatch,
    "SCALER_AT_MIN_SCALE": ScalerAtMinScale,
    "JOB_FAILED": JobFailed,
    "ACCUMULATION_LOST": AccumulationLost,
    "ACCUMULATION_PENDING": AccumulationPending,
    "JOB_LIMIT": JobLimit,
    "MEMORY_LIMIT": MemoryLimit,
    "CREATE_RETRY": CreateRetry,
    "SERVER_DRAINING": ServerDraining,
    "UNAUTHENTICATED": Unauthenticated,
    "SNAPSHOT_NOT_FOUND": SnapshotNotFound,
    "SNAPSHOT_EXISTS": SnapshotExists,
    "SNAPSHOT_LIMIT": SnapshotLimit,
}

_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.ABORTED: Aborted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.INTERNAL: Internal,
    grpc.StatusCode.DATA_LOSS: DataLoss,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
}


def from_rpc_error(error):
    """The typed AmpdError for a grpc.RpcError raised by a call."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    message = error.details() if hasattr(error, "details") else str(error)
    trailers = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    info = _rpc_status.error_info_from_trailers(trailers)
    reason, domain, metadata = info if info else ("", "", {})
    cls = _BY_REASON.get(reason) if domain == "ampd" else None
    if cls is None or not issubclass(cls, _BY_CODE.get(code, AmpdError)):
        cls = _BY_CODE.get(code, AmpdError)
    return cls(code, message or "", reason, metadata, domain)
