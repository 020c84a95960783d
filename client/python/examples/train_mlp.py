#!/usr/bin/env python3
"""Train a small MLP on ampd in fp16, watch the dynamic loss scale, export the state.

    python3 train_mlp.py --server 127.0.0.1:50051 --out mlp.safetensors

The scaler starts at 2^20 so the first steps overflow in fp16 and are
skipped while the scale backs off; then it grows every --growth-interval
clean steps. With torch installed, the exported weights are loaded into the
matching nn.Sequential and its loss is compared with ampd's.
"""
import argparse

import numpy as np

import ampd


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server", default="127.0.0.1:50051")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--growth-interval", type=int, default=10)
    ap.add_argument("--out", default="mlp.safetensors")
    ap.add_argument("--token", default=None, help="bearer token (default: $AMPD_TOKEN)")
    ap.add_argument("--tls-ca", default=None)
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    teacher = rng.standard_normal((16, 4)).astype(np.float32)

    def batch():
        x = rng.standard_normal((64, 16)).astype(np.float32)
        return x, np.tanh(x @ teacher)

    with ampd.Client(args.server, token=args.token, tls_ca=args.tls_ca) as client:
        job = client.create_job(
            model=ampd.Model([ampd.Linear(16, 64), ampd.GELU(), ampd.Linear(64, 4)], loss="mse"),
            precision="fp16", optimizer=ampd.AdamW(lr=3e-3), seed=1,
            scaler=ampd.Scaler(policy="pytorch", init_scale=2.0 ** 20,
                               growth_interval=args.growth_interval))
        print("job %s: %d parameters" % (job.job_id, job.parameter_count))
        for _ in range(args.steps):
            r = job.step(*batch())
            scale = ("%g -> %g" % (r.scale_before, r.scale_after)
                     if r.scale_after != r.scale_before else "%g" % r.scale_before)
            print("step %3d  loss %-10.5g scale %-16s %s" % (
                r.global_step, r.loss, scale, "SKIPPED (overflow)" if r.skipped else "applied"))
        job.refresh()
        print("%d steps, %d applied, loss scale now %g" % (job.step_count, job.applied_steps,
                                                          job.loss_scale))
        job.export(args.out)
        print("exported to %s" % args.out)

        try:
            import torch
            from torch import nn

            import ampd.torch as ampd_torch
        except ImportError:
            return
        module = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))
        module.load_state_dict(ampd_torch.to_state_dict(ampd.safetensors.load_file(args.out)))
        x, y = batch()
        with torch.no_grad():
            torch_loss = nn.functional.mse_loss(module(torch.from_numpy(x)), torch.from_numpy(y))
        print("next batch: torch (fp32) loss %.5g, ampd (fp16) loss %.5g"
              % (torch_loss.item(), job.step(x, y).loss))
        job.delete()


if __name__ == "__main__":
    main()
