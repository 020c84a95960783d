#!/usr/bin/env python3
"""Train through server crashes without losing or repeating a step.

Against the server of docs/USER_GUIDE.md's "Running" command:

    build/dev/server/ampd --listen=0.0.0.0:50051 --metrics-listen=0.0.0.0:9464 \\
        --state-dir=/var/lib/ampd --device=auto
    python3 resilient_training.py --server 127.0.0.1:50051 --steps 500

Kill ampd (even with SIGKILL) and start it again while this runs: Job.step
retries UNAVAILABLE with backoff, resending the same sequence, so a step is
applied once. The server checkpoints every --checkpoint-every steps (100 by
default) in the background, so a crash can lose acknowledged steps since the
last checkpoint on disk; the client then raises ampd.StepsLost naming them.
That can be more than --checkpoint-every steps: while a periodic write is
still running, the steps since the previous one are only in memory. This
script keeps the batches of the last --keep steps (default 250, for the
default --checkpoint-every=100) and resends them. The batches here come from a seeded generator, so any step's
batch could be rebuilt; a real data loader keeps them or can seek back.
"""
import argparse
import collections

import numpy as np

import ampd


def make_batch(sequence):
    rng = np.random.default_rng(sequence)
    teacher = np.random.default_rng(0).standard_normal((8, 1)).astype(np.float32)
    x = rng.standard_normal((32, 8)).astype(np.float32)
    return x, np.tanh(x @ teacher)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server", default="127.0.0.1:50051")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--keep", type=int, default=250,
                    help="batches kept for resending (well over twice the server's "
                         "--checkpoint-every)")
    ap.add_argument("--job", default=None, help="continue this job instead of creating one")
    args = ap.parse_args()

    with ampd.Client(args.server, retry_deadline=600) as client:
        if args.job:
            job = client.job(args.job)
        else:
            job = client.create_job(
                model=ampd.Model([ampd.Linear(8, 32), ampd.ReLU(), ampd.Linear(32, 1)]),
                precision="fp16", optimizer=ampd.AdamW(lr=1e-2), scaler=ampd.Scaler())
        print("job %s, next sequence %d" % (job.job_id, job.next_sequence))
        kept = collections.OrderedDict()  # sequence -> batch, the last --keep steps
        while job.next_sequence <= args.steps:
            sequence = job.next_sequence
            kept.setdefault(sequence, make_batch(sequence))
            while len(kept) > args.keep:
                kept.popitem(last=False)
            try:
                r = job.step(*kept[sequence])
            except ampd.StepsLost as e:
                missing = [s for s in e.lost_sequences if s not in kept]
                if missing:
                    raise SystemExit("steps %s were lost and their batches are no longer kept: "
                                     "raise --keep" % missing) from e
                print("server restarted from step %d: resending %d..%d"
                      % (e.lost_sequences[0] - 1, e.lost_sequences[0], e.lost_sequences[-1]))
                continue  # job.next_sequence is now the first lost step
            except ampd.StepResponseLost as e:
                print("step %d trained before a restart; its response is lost" % e.sequence)
                continue
            if r.global_step % 10 == 0 or r.skipped:
                print("step %4d  loss %-10.5g scale %-8g %s" % (
                    r.global_step, r.loss, r.scale_after, "SKIPPED" if r.skipped else ""))
        print("done: %d steps, %d applied" % (job.refresh().step_count, job.applied_steps))


if __name__ == "__main__":
    main()
