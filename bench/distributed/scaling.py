#!/usr/bin/env python3
"""Data-parallel scaling of ampd on this machine: N CPU replicas over Gloo.

Starts N ampd processes (--device=cpu, each --peer-address on loopback),
trains one job across them with `ampctl train --world-size=N`, and the same
per-rank batch on one ampd alone, and prints the median wall time per step
(client side, all ranks answered) and the weak-scaling efficiency:

    efficiency(N) = samples/s with N ranks / (N x samples/s of one rank)
                  = step time of one rank / step time of N ranks

(each rank trains --batch-size rows, so N ranks train N times the rows a
step). Replicas share this machine's cores, so on a machine with fewer cores
than N x the threads a replica uses the figure measures contention as much
as communication; say so beside any figure quoted.

Usage: python3 bench/distributed/scaling.py --ampd build/ci/server/ampd
         --ampctl build/ci/client/ampctl [--ranks 1,2,4] [--steps 60]
         [--model mlp|ref|gpt] [--threads 1]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def start(ampd, log, threads):
    """ampd on kernel-picked ports: (process, gRPC address, peer address)."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(threads))
    proc = subprocess.Popen(
        [ampd, "--listen=127.0.0.1:0", "--metrics-listen=", "--device=cpu",
         "--peer-address=127.0.0.1:0", "--worker-threads=1"],
        stdout=subprocess.PIPE, stderr=log, env=env, text=True)
    peer = None
    for line in proc.stdout:
        if line.startswith("ampd: peers on "):
            peer = line.split()[-1]
        if line.startswith("ampd: listening on "):
            return proc, line.split()[-1], peer
    raise RuntimeError("ampd did not start")


def write_batches(path, rows, width):
    """A safetensors file of one batch, inputs.0 and targets.0, F32 (rows, width)."""
    import numpy as np
    rng = np.random.default_rng(7)
    tensors = {"inputs.0": rng.standard_normal((rows, width), dtype=np.float32),
               "targets.0": rng.standard_normal((rows, width), dtype=np.float32)}
    header, offset = {}, 0
    for name, t in tensors.items():
        header[name] = {"dtype": "F32", "shape": list(t.shape),
                        "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for t in tensors.values():
            f.write(t.tobytes())


def model_flags(model, ranks, tmp):
    """ampctl flags training `ranks` x one rank's rows a step."""
    if model == "gpt":
        return ["--layers=gpt:256:64:128:2:4", f"--batch-size={8 * ranks}", "--seq-len=64"]
    if model == "ref":
        # The engine benchmark's reference MLP: 4 x Linear(1024, 1024), GELU
        # between, MSE, 256 rows per rank.
        path = os.path.join(tmp, f"ref-{ranks}.safetensors")
        write_batches(path, 256 * ranks, 1024)
        layers = ",gelu,".join(["linear:1024:1024"] * 4)
        return [f"--layers={layers}", "--loss=mse", f"--batches={path}"]
    return ["--layers=linear:16:512,gelu,linear:512:512,gelu,linear:512:4",
            f"--batch-size={256 * ranks}"]


def run(args, ranks, tmp):
    procs, servers = [], []
    log = open(os.path.join(tmp, f"ampd-{ranks}.log"), "w")
    try:
        peer0 = None
        for _ in range(ranks):
            proc, address, peer = start(args.ampd, log, args.threads)
            procs.append(proc)
            servers.append(address)
            peer0 = peer0 or peer
        # The batch is split across the ranks: each trains one rank's rows.
        flags = model_flags(args.model, ranks, tmp)
        if ranks > 1:
            flags += [f"--world-size={ranks}", f"--rendezvous={peer0}"]
        cmd = [args.ampctl, f"--server={','.join(servers)}", "train", f"--steps={args.steps}",
               "--precision=fp16", "--json", "--seed=7"] + flags
        times, allreduce, wait, last = [], [], [], time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        for line in proc.stdout:
            now = time.perf_counter()
            step = json.loads(line)
            times.append(now - last)
            allreduce.append(step["allreduce_ms"])
            wait.append(step["wait_ms"])
            last = now
        if proc.wait() != 0:
            raise RuntimeError(f"ampctl failed with {ranks} ranks")
        skip = args.steps // 5
        return (statistics.median(times[skip:]), statistics.median(allreduce[skip:]),
                statistics.median(wait[skip:]))
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=60)
        log.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ampd", required=True)
    parser.add_argument("--ampctl", required=True)
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--model", choices=["mlp", "ref", "gpt"], default="mlp",
                        help="mlp: 16-512-512-4 on the synthetic task; ref: the engine "
                             "benchmark's 4 x Linear(1024, 1024); gpt: a small GPT")
    parser.add_argument("--threads", type=int, default=1, help="OpenBLAS threads per replica")
    args = parser.parse_args()
    ranks = [int(r) for r in args.ranks.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        base = None
        print(f"model {args.model}, fp16, {args.threads} BLAS thread(s) per replica, "
              f"{os.cpu_count()} cores here; median step wall time after warm-up")
        for n in ranks:
            t, allreduce_ms, wait_ms = run(args, n, tmp)
            base = base if base is not None else (t if n == 1 else None)
            eff = f"{base / t:6.1%}" if base is not None else "   n/a"
            print(f"ranks {n}: {t * 1e3:8.2f} ms/step  weak-scaling efficiency {eff}  "
                  f"(rank 0: all-reduce {allreduce_ms:.2f} ms, wait {wait_ms:.2f} ms)")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
