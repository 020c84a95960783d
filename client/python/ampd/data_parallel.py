"""One job across several ampd replicas, data-parallel (docs/DISTRIBUTED.md).

    import ampd
    job = ampd.DataParallelJob.create(
        ["ampd-0:50051", "ampd-1:50051"], rendezvous="ampd-0:50052",
        model=ampd.Model([ampd.Linear(8, 32), ampd.ReLU(), ampd.Linear(32, 1)], loss="mse"),
        precision="fp16")
    r = job.step(x, y)   # x, y: the whole batch; rank r trains rows r*B/N .. (r+1)*B/N

A GPT's or decoder's token losses split the same way (the per-token arrays
with their rows), and the reported loss is then the sum over every rank's
tokens:

    r = job.step(ids, targets, loss_fn="ppo", advantages=A, sampling_logprobs=q)

The job is created on every replica with the same config but for its rank.
Each step goes to every rank at once with the same sequence number and the
rank's share of the batch (a rank's Step waits until every rank has come).
While a replica is down the ranks answer UNAVAILABLE, and the whole step is
sent again to every rank: a rank that applied it already answers with its
recorded result, so every step is applied exactly once on every rank.
"""
import concurrent.futures
import math
import secrets
import time
import uuid

import grpc

from ampd import errors, spec
from ampd.client import Client, Job, StepResult, _set_token_loss, to_tensor
from ampd.v1 import trainer_pb2 as pb

# Failures that mean "a rank is not there (yet)": the step is sent again.
_GROUP_TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                    grpc.StatusCode.ABORTED)


def split_rows(array, parts):
    """array cut along its first axis into `parts` equal consecutive shares."""
    rows = array.shape[0]
    if rows % parts:
        raise ValueError("%d rows do not split into %d equal shares" % (rows, parts))
    n = rows // parts
    return [array[i * n:(i + 1) * n] for i in range(parts)]


class DataParallelJob:
    """A job across len(servers) ampd replicas; build it with create()."""

    def __init__(self, clients, jobs, group, retry_deadline):
        self._clients = clients
        self.jobs = jobs  # the pb.Job of each rank
        self.group = group
        self.retry_deadline = retry_deadline
        self.next_sequence = 1  # create() sets it from the jobs it made
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(clients))

    @property
    def world_size(self):
        return len(self._clients)

    @classmethod
    def create(cls, servers, rendezvous, model, precision="fp16", optimizer=None, scaler=None,
               seed=0, group=None, timeout_ms=30000, retry_deadline=300.0, secret=None,
               **client_options):
        """Create the job on every server (rank order) meeting at `rendezvous`
        (rank 0's --peer-address). client_options go to each ampd.Client
        (token, tls_ca, ...); each call waits up to the group's timeout.
        `secret` (16..64 bytes) is what the ranks sign their calls to the
        meeting point with; None draws 32 random bytes. Give the same one
        again to create the rest of a group some of whose ranks exist."""
        if len(servers) < 2:
            raise ValueError("a data-parallel job needs at least 2 servers")
        group = group or "py-" + uuid.uuid4().hex[:16]
        client_options.setdefault("timeout", timeout_ms / 1000.0 + 30.0)
        clients = [Client(s, **client_options) for s in servers]
        config = pb.JobConfig(model=model.to_proto() if hasattr(model, "to_proto") else model,
                              precision=spec.precision_proto(precision), seed=seed)
        if optimizer is not None:
            config.optimizer.CopyFrom(optimizer.to_proto() if hasattr(optimizer, "to_proto")
                                      else optimizer)
        if scaler is not None:
            config.scaler.CopyFrom(scaler.to_proto() if hasattr(scaler, "to_proto") else scaler)
        config.distributed.world_size = len(servers)
        config.distributed.group = group
        # What the ranks sign their calls to the meeting point with: known
        # to this client and the ranks only.
        config.distributed.secret = secret if secret is not None else secrets.token_bytes(32)
        config.distributed.rendezvous = rendezvous
        config.distributed.timeout_ms = timeout_ms
        job = cls(clients, [None] * len(servers), group, retry_deadline)

        def create_on(rank):
            request = pb.CreateJobRequest(config=config, request_id=group + "-create")
            request.config.distributed.rank = rank
            c = clients[rank]
            return c._stub.CreateJob(request, metadata=c._metadata(), timeout=c.timeout).job

        job.jobs = job._on_every_rank(create_on, "CreateJob")
        job.next_sequence = job.jobs[0].step + 1
        return job

    def _on_every_rank(self, call, what):
        """call(rank) on every rank at once, sent again while a rank is missing."""
        deadline = time.monotonic() + self.retry_deadline
        attempt = 0
        while True:
            futures = [self._pool.submit(call, r) for r in range(self.world_size)]
            results, failures = [], []
            for rank, f in enumerate(futures):
                try:
                    results.append(f.result())
                except grpc.RpcError as e:
                    failures.append((rank, errors.from_rpc_error(e)))
            if not failures:
                return results
            if not all(e.code in _GROUP_TRANSIENT for _, e in failures) or \
                    not self._clients[0]._sleep_before_retry(attempt, deadline):
                rank, error = failures[0]
                raise type(error)(error.code, "%s: rank %d: %s" % (what, rank, error.message),
                                  error.reason, error.metadata, error.domain)
            attempt += 1

    def step(self, inputs, targets, *, micro_batches_per_rank=1, learning_rate=None,
             loss_fn=None, weights=None, advantages=None, sampling_logprobs=None,
             ppo_clip=None, cispo_clip=None, dro_beta=None, temperature=None):
        """Train one step on the whole batch (NumPy arrays or torch tensors),
        its rows split evenly across the ranks (and within a rank into
        micro_batches_per_rank micro-batches). learning_rate, loss_fn and
        its parameters (ppo_clip, cispo_clip, dro_beta, temperature) as Job.step's, the
        same on every rank; weights, advantages
        and sampling_logprobs are the whole batch's (the targets' shape),
        split with its rows. A token loss's loss is the sum over every
        rank's tokens. Rank 0's StepResult, after checking every rank
        reports the same step and loss."""
        parts = self.world_size * micro_batches_per_rank
        xs, ys = split_rows(inputs, parts), split_rows(targets, parts)
        ws, advs, qs = (None if v is None else split_rows(v, parts)
                        for v in (weights, advantages, sampling_logprobs))
        sequence = self.next_sequence

        def step_on(rank):
            share = range(rank * micro_batches_per_rank, (rank + 1) * micro_batches_per_rank)
            request = pb.StepRequest(
                job_id=self.jobs[rank].job_id, sequence=sequence,
                micro_batches=[pb.MicroBatch(inputs=to_tensor(xs[i]), targets=to_tensor(ys[i]))
                               for i in share])
            if learning_rate is not None:
                request.learning_rate = learning_rate

            def mine(parts_of):  # this rank's micro-batches' arrays
                return None if parts_of is None else [parts_of[i] for i in share]

            _set_token_loss(request, share, loss_fn, mine(ws), mine(advs), mine(qs), ppo_clip,
                            cispo_clip, dro_beta, temperature)
            c = self._clients[rank]
            return c._stub.Step(request, metadata=c._metadata(), timeout=c.timeout)

        responses = self._on_every_rank(step_on, "Step %d" % sequence)
        first = responses[0]
        for rank, r in enumerate(responses[1:], start=1):
            same_loss = r.loss == first.loss or (math.isnan(r.loss) and math.isnan(first.loss))
            if (r.global_step, r.skipped, r.scale_after) != \
                    (first.global_step, first.skipped, first.scale_after) or not same_loss:
                raise errors.DataLoss(
                    grpc.StatusCode.DATA_LOSS,
                    "Step %d: rank %d reports step %d loss %r scale %r skipped %s against rank "
                    "0's step %d loss %r scale %r skipped %s: the replicas diverged"
                    % (sequence, rank, r.global_step, r.loss, r.scale_after, r.skipped,
                       first.global_step, first.loss, first.scale_after, first.skipped))
        self.next_sequence = sequence + 1
        return StepResult.from_proto(first)

    def delete(self):
        for c, j in zip(self._clients, self.jobs):
            Job(c, j).delete()

    def close(self):
        self._pool.shutdown()
        for c in self._clients:
            c.close()
