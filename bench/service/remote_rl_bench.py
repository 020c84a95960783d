"""Remote-RL calls through ampd, the figures issue 36 asks of a GPU:

  accumulate: per precision and for the full model and its LoRA (rank
    --lora-rank), the median seconds of one update made of --calls
    ForwardBackward calls (one micro-batch of --batch x --seq tokens each)
    and an OptimStep, beside one Step over the same --calls micro-batches,
    on two jobs of the same seed. The two must train alike (the engine tests
    hold them equal bit for bit); here each update's losses are compared too,
    and a difference fails the run. Printed: both medians and their ratio.
  shared_base: --jobs LoRA jobs on one base of --models-dir (written first by
    job.save_pretrained from a bf16 job of the same shape): the server's
    device memory (nvidia-smi, by --server-pid) or, on the CPU, its resident
    memory, before and after; against one base plus --jobs adapter jobs'
    admitted bytes. Then one step of each job, and the median step seconds.

  python3 bench/service/remote_rl_bench.py --server=127.0.0.1:50051
      --models-dir=DIR --server-pid=PID [--device=cuda] [--parts accumulate,shared_base]
      [--precisions bf16,fp16] [--vocab V --hidden C --layers L --heads H
      --intermediate I --kv-heads K] [--calls 4 --batch 2 --seq 512] [--updates 5]
      [--jobs 16] [--lora-rank 16]

Shapes default to Qwen2.5-0.5B's (vocab 151936, hidden 896, intermediate
4864, 24 layers, 14 heads / 2 K/V heads). --models-dir must be the server's
own --models-dir (the base is written there for the server to read).

Needs the ampd Python package (a build's client/python/package) and numpy.
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np

import ampd

PRECISIONS = ("fp32", "fp16", "bf16")
BASE_NAME = "remote-rl-bench-base"


def decoder(args, lora=None):
    return ampd.Decoder(vocab_size=args.vocab, hidden_size=args.hidden,
                        intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                        max_position_embeddings=args.seq, rope_theta=1e6,
                        tie_word_embeddings=True, qkv_bias=True, lora=lora)


def lora_config(args):
    return ampd.LoRA(rank=args.lora_rank, alpha=2.0 * args.lora_rank,
                     target_modules="all-linear")


def micro_batches(args, update):
    rng = np.random.default_rng(update)
    ids = rng.integers(0, args.vocab, size=(args.calls, args.batch, args.seq + 1))
    return [(m[:, :-1].astype(np.int32), m[:, 1:].astype(np.int32)) for m in ids]


def accumulate(client, args, precision, lora):
    """(fused median s, accumulated median s) over --updates, after one warm-up each."""
    model = decoder(args, lora_config(args) if lora else None)
    fused = client.create_job(model=model, precision=precision, seed=1)
    split = client.create_job(model=model, precision=precision, seed=1)
    try:
        fused_times, split_times = [], []
        for update in range(args.updates + 1):
            batches = micro_batches(args, update)
            t0 = time.perf_counter()
            step = fused.step(micro_batches=batches)
            t1 = time.perf_counter()
            for x, y in batches:
                split.forward_backward(x, y, micro_batches_in_update=args.calls)
            applied = split.optim_step()
            t2 = time.perf_counter()
            if step.loss != applied.loss or step.skipped != applied.skipped:
                raise RuntimeError(
                    f"{precision} update {update}: Step's loss {step.loss!r} (skipped "
                    f"{step.skipped}) but ForwardBackward + OptimStep's {applied.loss!r} "
                    f"(skipped {applied.skipped})")
            if update > 0:  # the first update warms up (workspaces, optimizer state)
                fused_times.append(t1 - t0)
                split_times.append(t2 - t1)
    finally:
        fused.delete()
        split.delete()
    return statistics.median(fused_times), statistics.median(split_times)


def server_memory(args):
    """The server's device memory (cuda) or resident memory (cpu), bytes."""
    if args.device.startswith("cuda"):
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                              "--format=csv,noheader,nounits"], check=True,
                             capture_output=True, text=True).stdout
        for line in out.splitlines():
            pid, used = (field.strip() for field in line.split(","))
            if int(pid) == args.server_pid:
                return int(used) * 2**20
        return 0  # no context on the device yet
    with open(f"/proc/{args.server_pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {args.server_pid}")


def shared_base(client, args):
    folder = os.path.join(args.models_dir, BASE_NAME)
    writer = client.create_job(model=decoder(args), precision="bf16", seed=3)
    try:
        writer.save_pretrained(folder)
    finally:
        writer.delete()
    jobs = []
    try:
        before = server_memory(args)
        for i in range(args.jobs):
            jobs.append(client.create_job(base_model=BASE_NAME, lora=lora_config(args),
                                          precision="bf16", seed=i))
        after = server_memory(args)
        adapter_bytes = jobs[0].estimated_bytes
        # The adapters have AdamW's 16 bytes a parameter in bf16 (master,
        # working copy, two moments... as the admission counts them); the
        # base 2 bytes a parameter.
        base_params = jobs[0].parameter_count - adapter_bytes // 16
        expected = 2 * base_params + args.jobs * adapter_bytes
        grew = after - before
        print(f"shared_base: {args.jobs} LoRA jobs (rank {args.lora_rank}, all-linear) on one "
              f"bf16 base of {base_params / 1e6:.1f}M parameters: server memory grew "
              f"{grew / 2**20:.1f} MiB against {expected / 2**20:.1f} MiB for one base plus "
              f"{args.jobs} adapter jobs (ratio {grew / expected:.3f}; {args.jobs} private "
              f"copies would be {args.jobs * 2 * base_params / 2**20:.0f} MiB)")
        batches = micro_batches(args, 0)
        times = []
        for job in jobs:
            t0 = time.perf_counter()
            job.step(*batches[0])
            times.append(time.perf_counter() - t0)
        stepped = server_memory(args)
        print(f"shared_base: one step of each job: median {statistics.median(times[1:] or times):.4f} s "
              f"(the first, with its workspace, {times[0]:.4f} s); server memory after "
              f"{(stepped - before) / 2**20:.1f} MiB over the start")
    finally:
        for job in jobs:
            job.delete()
        shutil.rmtree(folder, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", default="127.0.0.1:50051")
    parser.add_argument("--models-dir", required=True)
    parser.add_argument("--server-pid", type=int, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--parts", default="accumulate,shared_base")
    parser.add_argument("--precisions", default="bf16,fp16")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--intermediate", type=int, default=4864)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--heads", type=int, default=14)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--updates", type=int, default=5)
    parser.add_argument("--jobs", type=int, default=16)
    parser.add_argument("--lora-rank", type=int, default=16)
    args = parser.parse_args()
    precisions = args.precisions.split(",")
    parts = args.parts.split(",")
    for value, known, what in [(p, PRECISIONS, "precision") for p in precisions] + \
            [(p, ("accumulate", "shared_base"), "part") for p in parts]:
        if value not in known:
            print(f"remote_rl_bench.py: unknown {what} {value!r}", file=sys.stderr)
            return 2
    print(f"remote_rl: decoder vocab {args.vocab}, hidden {args.hidden}, intermediate "
          f"{args.intermediate}, {args.layers} layers, {args.heads} heads / {args.kv_heads} kv "
          f"heads; {args.calls} micro-batches of {args.batch} x {args.seq} tokens an update")
    with ampd.Client(args.server, timeout=600) as client:
        if "accumulate" in parts:
            for precision in precisions:
                for lora in (False, True):
                    fused, split = accumulate(client, args, precision, lora)
                    kind = f"lora r{args.lora_rank}" if lora else "full"
                    print(f"accumulate {precision:5s} {kind:9s}: Step {fused:.4f} s, "
                          f"{args.calls} x ForwardBackward + OptimStep {split:.4f} s "
                          f"(ratio {split / fused:.3f}; median of {args.updates})")
        if "shared_base" in parts:
            shared_base(client, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
