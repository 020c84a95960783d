#!/usr/bin/env python3
"""A Python client generated from the proto, against the real secured ampd.

What an orchestration team would write on day one: `grpc.ssl_channel_credentials`
with the CA and a client certificate, `authorization: Bearer TOKEN` metadata,
and the stubs protoc made from proto/ (build/ci/proto/gen-python, passed as
--stubs). ampd is started with --tls-cert/--tls-key/--tls-client-ca and
--auth-tokens, on certificates and tokens from scripts/make-dev-certs.sh.

Checked: alice trains an fp16 job with dynamic loss scaling (the loss falls,
every skipped step halves the scale); bob's token gets NOT_FOUND with reason
JOB_NOT_FOUND for alice's job and an empty ListJobs; no token is
UNAUTHENTICATED; a plaintext channel fails.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

import numpy as np

ARGS = None


def start_ampd(ampd, flags, log_path):
    log = open(log_path, "w", encoding="utf-8")
    proc = subprocess.Popen([ampd] + flags, stdout=subprocess.PIPE, stderr=log, text=True)
    for line in proc.stdout:
        m = re.match(r"ampd: listening on [^:]+:(\d+)", line)
        if m:
            return proc, int(m.group(1))
    proc.wait(timeout=30)
    with open(log_path, encoding="utf-8") as f:
        raise RuntimeError("ampd did not start (exit %s): %s" % (proc.returncode, f.read()))


class SecuredServerTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        sys.path.insert(0, ARGS.stubs)
        global grpc, pb, pb_grpc, error_details_pb2, status_pb2
        import grpc  # noqa: F401  (python3-grpcio)
        from ampd.v1 import trainer_pb2 as pb
        from ampd.v1 import trainer_pb2_grpc as pb_grpc
        from google.rpc import error_details_pb2, status_pb2

        cls.dir = tempfile.mkdtemp(prefix="ampd_python_tls_")
        cls.secrets = os.path.join(cls.dir, "secrets")
        subprocess.run(["bash", ARGS.make_certs, cls.secrets], check=True, capture_output=True)
        s = lambda name: os.path.join(cls.secrets, name)  # noqa: E731
        cls.proc, cls.port = start_ampd(ARGS.ampd, [
            "--listen=127.0.0.1:0", "--metrics-listen=", "--device=cpu",
            "--tls-cert=" + s("server.crt"), "--tls-key=" + s("server.key"),
            "--tls-client-ca=" + s("ca.crt"), "--auth-tokens=" + s("tenants")],
            os.path.join(cls.dir, "ampd.log"))

        def read(name, mode="rb"):
            with open(s(name), mode) as f:
                return f.read()

        cls.credentials = grpc.ssl_channel_credentials(
            root_certificates=read("ca.crt"), private_key=read("alice.key"),
            certificate_chain=read("alice.crt"))
        cls.tokens = {t: read(t + ".token", "r").strip() for t in ("alice", "bob")}
        cls.channel = grpc.secure_channel("localhost:%d" % cls.port, cls.credentials)
        cls.stub = pb_grpc.TrainerStub(cls.channel)

    @classmethod
    def tearDownClass(cls):
        cls.channel.close()
        cls.proc.terminate()
        cls.proc.wait(timeout=60)
        cls.proc.stdout.close()
        shutil.rmtree(cls.dir, ignore_errors=True)

    def auth(self, tenant):
        return [("authorization", "Bearer " + self.tokens[tenant])]

    def error_reason(self, error):
        """The google.rpc.ErrorInfo reason ampd attaches to every error."""
        for key, value in error.trailing_metadata() or ():
            if key == "grpc-status-details-bin":
                status = status_pb2.Status.FromString(value)
                for detail in status.details:
                    info = error_details_pb2.ErrorInfo()
                    if detail.Unpack(info):
                        return info.reason
        return None

    @staticmethod
    def tensor(array, dtype):
        return pb.Tensor(dtype=dtype, shape=list(array.shape), data=array.tobytes())

    def create_job(self, tenant):
        model = pb.ModelSpec(loss=pb.LOSS_MSE, layers=[
            pb.Layer(linear=pb.Linear(in_features=8, out_features=32)),
            pb.Layer(relu=pb.ReLU()),
            pb.Layer(linear=pb.Linear(in_features=32, out_features=1))])
        config = pb.JobConfig(
            display_name="python-tls", model=model, precision=pb.PRECISION_FP16, seed=7,
            optimizer=pb.OptimizerConfig(kind=pb.OPTIMIZER_ADAMW, lr=1e-2),
            scaler=pb.ScalerConfig(policy=pb.SCALER_POLICY_PYTORCH))
        return self.stub.CreateJob(pb.CreateJobRequest(config=config), metadata=self.auth(tenant),
                                   timeout=60).job

    def test_alice_trains_and_bob_sees_nothing(self):
        job = self.create_job("alice")
        rng = np.random.default_rng(7)
        w = rng.standard_normal((8, 1)).astype(np.float32)
        losses, skipped = [], 0
        for sequence in range(1, 61):
            x = rng.standard_normal((64, 8)).astype(np.float32)
            y = np.tanh(x @ w).astype(np.float32)
            r = self.stub.Step(pb.StepRequest(
                job_id=job.job_id, sequence=sequence,
                micro_batches=[pb.MicroBatch(inputs=self.tensor(x, pb.DTYPE_F32),
                                             targets=self.tensor(y, pb.DTYPE_F32))]),
                metadata=self.auth("alice"), timeout=60)
            self.assertEqual(r.global_step, sequence)
            if r.skipped:
                skipped += 1
                self.assertEqual(r.scale_after, r.scale_before / 2)
            else:
                losses.append(r.loss)
        self.assertGreater(len(losses), 50)
        self.assertLess(np.mean(losses[-10:]), 0.5 * np.mean(losses[:10]))
        got = self.stub.GetJob(pb.GetJobRequest(job_id=job.job_id), metadata=self.auth("alice"))
        self.assertEqual(got.job.step, 60)
        self.assertEqual(got.job.applied_steps, 60 - skipped)

        # bob: the job does not exist for him, and he lists nothing.
        with self.assertRaises(grpc.RpcError) as caught:
            self.stub.GetJob(pb.GetJobRequest(job_id=job.job_id), metadata=self.auth("bob"))
        self.assertEqual(caught.exception.code(), grpc.StatusCode.NOT_FOUND)
        self.assertEqual(self.error_reason(caught.exception), "JOB_NOT_FOUND")
        listed = self.stub.ListJobs(pb.ListJobsRequest(), metadata=self.auth("bob"))
        self.assertEqual(len(listed.jobs), 0)
        mine = self.stub.ListJobs(pb.ListJobsRequest(), metadata=self.auth("alice"))
        self.assertIn(job.job_id, [j.job_id for j in mine.jobs])

    def test_no_token_is_unauthenticated(self):
        with self.assertRaises(grpc.RpcError) as caught:
            self.stub.ListJobs(pb.ListJobsRequest(), timeout=30)
        self.assertEqual(caught.exception.code(), grpc.StatusCode.UNAUTHENTICATED)
        self.assertEqual(self.error_reason(caught.exception), "UNAUTHENTICATED")

    def test_plaintext_fails(self):
        with grpc.insecure_channel("127.0.0.1:%d" % self.port) as plain:
            with self.assertRaises(grpc.RpcError) as caught:
                pb_grpc.TrainerStub(plain).ListJobs(pb.ListJobsRequest(),
                                                    metadata=self.auth("alice"), timeout=10)
        self.assertEqual(caught.exception.code(), grpc.StatusCode.UNAVAILABLE)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--stubs", required=True)
    ap.add_argument("--ampd", required=True)
    ap.add_argument("--make-certs", required=True)
    ARGS, rest = ap.parse_known_args()
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)
