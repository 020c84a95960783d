#!/usr/bin/env python3
"""gpu_check_report.py: turns the logs scripts/gpu-check.sh wrote into one
Markdown report: the machine, each part's outcome, and a table of workload,
ampd, PyTorch and ratio for every figure that has a peer. Ratios are ampd's
speed over PyTorch's (above 1: ampd is faster), from the same run.

    python3 scripts/gpu_check_report.py OUT_DIR > OUT_DIR/report.md

Standard library only: it runs on the GPU machine and in CI alike."""

import collections
import csv
import pathlib
import re
import sys

PRECISIONS = ("fp32", "fp16", "bf16")


def read(out: pathlib.Path, name: str) -> str:
    path = out / f"{name}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def mlp_steps(text: str) -> dict:
    """'fp16: median step 0.512 ms' (engine bench and amp_mlp.py alike)."""
    return {m[0]: float(m[1]) for m in re.findall(r"^(fp32|fp16|bf16): median step ([\d.]+) ms",
                                                 text, re.M)}


def gpt_lines(text: str) -> dict:
    """'bf16  step median    40.1 ms      204000 tokens/s ...' (gpt.py's line)."""
    return {m[0]: (float(m[1]), float(m[2])) for m in re.findall(
        r"^(fp32|fp16|bf16)\s+step median\s+([\d.]+) ms\s+([\d.]+) tokens/s", text, re.M)}


def token_service(text: str) -> dict:
    """'fp16  create  0.8 s  first step  0.1 s  step median  21.0 ms ...'."""
    return {m[0]: (float(m[1]), float(m[2]), float(m[3])) for m in re.findall(
        r"^(fp32|fp16|bf16)\s+create\s+([\d.]+) s\s+first step\s+([\d.]+) s\s+"
        r"step median\s+([\d.]+) ms", text, re.M)}


def token_torch(text: str) -> dict:
    return {m[0]: float(m[1]) for m in re.findall(
        r"^(fp32|fp16|bf16)\s+step median\s+([\d.]+) ms\s+[\d.]+ TFLOP/s", text, re.M)}


SAMPLE_PARTS = ("service_sample_", "torch_sample_", "hf_sample_")


def sample_figures(text: str) -> dict:
    """precision -> sampled tokens/s, or why there is none: 'bf16  sample
    median  812.3 ms  2522 sampled tokens/s ...' (sample_bench.py,
    generate.py and hf_generate.py alike), 'bf16 refused: REASON' (a job
    ampd refused), 'fp16: not supported: REASON' (this torch), or one
    'skipped: REASON' line for every precision (no transformers)."""
    out = {}
    skipped = re.search(r"^skipped: (.*)$", text, re.M)
    if skipped:
        out.update({p: f"skipped: {skipped[1]}" for p in PRECISIONS})
    for p, why in re.findall(r"^(fp32|fp16|bf16):?\s+(refused|not supported)", text, re.M):
        out[p] = why
    for p, tps in re.findall(r"^(fp32|fp16|bf16)\s+sample median\s+[\d.]+ ms\s+([\d.]+) "
                             r"sampled tokens/s", text, re.M):
        out[p] = float(tps)
    return out


def sample_outcome(text: str):
    """(outcome, summary) of a sampling part that exited 0 but measured
    nothing, or part of it: its refusals and skips, said as such."""
    skipped = re.search(r"^skipped: (.*)$", text, re.M)
    if skipped:
        return "skipped", skipped[1]
    why = re.findall(r"^((?:fp32|fp16|bf16):?\s+(?:refused|not supported):? .*)$", text, re.M)
    measured = re.findall(r"^(?:fp32|fp16|bf16)\s+sample median", text, re.M)
    if not why:
        return None, ""
    summary = "; ".join(w[:160] for w in why)
    return ("refused" if not measured and "refused" in summary else "ok"), summary


def attention_lines(text: str) -> dict:
    """(dtype, kernels) -> (forward ms, backward ms): 'attention B=8 T=1024
    H=12 D=64 bf16, register-tile kernels: forward 0.5 ms (..), backward
    1.2 ms (..)' (ampd_bench_cuda_attention) and '..., sdpa flash: ...'
    (bench/pytorch/attention.py)."""
    return {(m[0], m[1]): (float(m[2]), float(m[3])) for m in re.findall(
        r"^attention B=\d+ T=\d+ H=\d+ D=\d+ (bf16|fp16), (register-tile|wmma|sdpa \w+)"
        r"(?: kernels)?: forward ([\d.]+) ms .*?backward ([\d.]+) ms", text, re.M)}


def rl_summary(text: str) -> str:
    """examples/rl_fp16.py's last line: 'reward A -> B; max sampler-trainer mismatch M'."""
    m = re.search(r"^(reward .* mismatch .*)$", text, re.M)
    failed = re.search(r"^check failed.*$", text, re.M)
    return (m[1] if m else "no summary line") + (f"; {failed[0]}" if failed else "")


def fmt(x, unit="", digits=3):
    return "n/a" if x is None else f"{x:.{digits}g}{unit}"


def sample_cell(x) -> str:
    """A sampled tokens/s figure, or the reason in its place."""
    if isinstance(x, float):
        return fmt(x)
    return x or "n/a"


def sample_ratio(ampd_speed, torch_speed) -> str:
    if isinstance(ampd_speed, float) and isinstance(torch_speed, float):
        return ratio(ampd_speed, torch_speed)
    return "n/a"


def ratio(ampd_speed, torch_speed):
    if ampd_speed is None or torch_speed is None or torch_speed == 0:
        return "n/a"
    return f"{ampd_speed / torch_speed:.2f}x"


def gtest_summary(text: str) -> str:
    if not text:
        return "no log"
    parts = []
    for label in ("PASSED", "FAILED", "SKIPPED"):
        m = re.search(rf"\[\s+{label}\s+\] (\d+) tests?", text)
        if m:
            parts.append(f"{m[1]} {label.lower()}")
    failed = sorted(set(re.findall(r"^\[\s+FAILED\s+\] (\S+)", text, re.M)) -
                    {"tests,", "test,"})
    failed = [f for f in failed if not f[0].isdigit()]
    s = ", ".join(parts) or "no gtest summary (crashed?)"
    if failed:
        s += "; failed: " + " ".join(failed[:12]) + (" ..." if len(failed) > 12 else "")
    return s


def profile_table(text: str, what: str, top: int = 30) -> list:
    """Nsight Compute's raw CSV (one row per kernel launch, a
    gpu__time_duration.sum column) summed per kernel name."""
    rows = [line for line in text.splitlines() if line.startswith('"')]
    if not rows:
        return []
    reader = csv.reader(rows)
    header = next(reader)
    if "Kernel Name" not in header or "gpu__time_duration.sum" not in header:
        return ["", f"## GPU time per kernel: {what}", "", "(no kernel rows in the profile log)"]
    name_col, time_col = header.index("Kernel Name"), header.index("gpu__time_duration.sum")
    scale = {"nsecond": 1e-6, "ns": 1e-6, "usecond": 1e-3, "us": 1e-3, "msecond": 1.0, "ms": 1.0}
    unit = 1e-6
    total = collections.Counter()
    count = collections.Counter()
    for row in reader:
        if len(row) <= max(name_col, time_col):
            continue
        if not row[0].isdigit():  # the units row
            unit = scale.get(row[time_col], unit)
            continue
        try:
            ms = float(row[time_col].replace(",", "")) * unit
        except ValueError:
            continue
        name = re.sub(r"\(.*", "", row[name_col])[:90]
        total[name] += ms
        count[name] += 1
    all_ms = sum(total.values())
    out = ["", f"## GPU time per kernel: {what} (Trainer::Create + 2 steps, {all_ms:.1f} ms in all)",
           "",
           "| kernel | launches | total ms | share |", "|---|---|---|---|"]
    for name, ms in total.most_common(top):
        out.append(f"| `{name}` | {count[name]} | {ms:.2f} | {ms / all_ms:.1%} |")
    return out


def main() -> int:
    out = pathlib.Path(sys.argv[1])
    lines = ["# gpu-check report", ""]
    machine = (out / "machine.log").read_text(errors="replace") if (out / "machine.log").exists() else ""
    lines += ["```", machine.strip(), "```", "", "## Parts", "",
              "| part | outcome | seconds | summary |", "|---|---|---|---|"]
    for row in (out / "parts.tsv").read_text().splitlines():
        name, what, secs, *rest = row.split("\t") + [""]
        summary = ""
        if what in ("skipped", "cut"):
            summary = rest[0] if what == "skipped" or secs == "0" else "ended by the budget"
        elif what == "ok" and name.startswith(SAMPLE_PARTS):
            outcome, summary = sample_outcome(read(out, name))
            what = outcome or what
        elif name == "rl_fp16":
            summary = rl_summary(read(out, name))
        elif name in ("cuda_backend_test", "cuda_training_test", "backend_ops_cuda",
                      "sample_ops_cuda", "sample_invariance_cuda", "memcheck",
                      "memcheck_sampler", "racecheck"):
            text = read(out, name)
            summary = gtest_summary(text)
            if name.startswith(("memcheck", "racecheck")):
                m = re.search(r"(?:ERROR|RACECHECK) SUMMARY: (\d+) (?:error|hazard)", text)
                summary = (f"{m[1]} errors; " if m else "no ERROR SUMMARY; ") + summary
        lines.append(f"| {name} | {what} | {secs} | {summary} |")

    rows = []
    # Reference MLP: step times, ratio = PyTorch's time over ampd's.
    engine, torch_mlp = mlp_steps(read(out, "engine_mlp")), mlp_steps(read(out, "torch_mlp"))
    torch_host = mlp_steps(read(out, "torch_mlp_host_batch"))
    for p in PRECISIONS:
        a, t, th = engine.get(p), torch_mlp.get(p), torch_host.get(p)
        rows.append((f"reference MLP step, {p} (in process) vs batch on device", fmt(a, " ms"),
                     fmt(t, " ms"), ratio(1 / a if a else None, 1 / t if t else None)))
        if th is not None:
            rows.append((f"reference MLP step, {p} (in process) vs batch from host", fmt(a, " ms"),
                         fmt(th, " ms"), ratio(1 / a if a else None, 1 / th)))
    up = re.search(r"batch upload: .*?median ([\d.]+) ms", read(out, "engine_mlp"))
    if up:
        rows.append(("reference MLP batch upload (2 MB, CopyFromHost + sync)", f"{up[1]} ms", "",
                     ""))
    # GPT-2: tokens/s, in process and through the service, against eager and compiled.
    eager, compiled = gpt_lines(read(out, "torch_gpt")), gpt_lines(read(out, "torch_gpt_compile"))
    for source, label in (("engine_gpt", "in process"), ("service_gpt", "through gRPC")):
        ours = gpt_lines(read(out, source))
        for p in ("bf16", "fp16"):
            a = ours.get(p, (None, None))[1]
            e = eager.get(p, (None, None))[1]
            c = compiled.get(p, (None, None))[1]
            rows.append((f"GPT tokens/s, {p} ({label}) vs eager", fmt(a), fmt(e), ratio(a, e)))
            if c is not None:
                rows.append((f"GPT tokens/s, {p} ({label}) vs torch.compile", fmt(a), fmt(c),
                             ratio(a, c)))
    # The Qwen2.5-0.5B-shaped decoder in process, against its eager PyTorch peer
    # (decoder.py prints gpt.py's line).
    # Full fine-tuning, then LoRA rank 16 (decoder.py --lora-rank: the base in
    # the 16-bit dtype, fp32 adapters, as PEFT runs it).
    for kind, suffix in (("decoder", ""), ("decoder LoRA", "_lora")):
        eager = gpt_lines(read(out, f"torch_decoder{suffix}"))
        compiled = gpt_lines(read(out, "torch_decoder_compile")) if not suffix else {}
        for source, label in ((f"engine_decoder{suffix}", "in process"),
                              (f"service_decoder{suffix}", "through gRPC")):
            ours = gpt_lines(read(out, source))
            for p in ("bf16", "fp16"):
                a = ours.get(p, (None, None))[1]
                e = eager.get(p, (None, None))[1]
                c = compiled.get(p, (None, None))[1]
                rows.append((f"{kind} tokens/s, {p} ({label}) vs eager", fmt(a), fmt(e),
                             ratio(a, e)))
                if c is not None:
                    rows.append((f"{kind} tokens/s, {p} ({label}) vs torch.compile", fmt(a),
                                 fmt(c), ratio(a, c)))
    # Causal attention, forward + backward, against SDPA's flash backend.
    ours = attention_lines(read(out, "attention"))
    theirs = attention_lines(read(out, "torch_attention"))
    for p in ("bf16", "fp16"):
        a = ours.get((p, "register-tile"))
        t = theirs.get((p, "sdpa flash"))
        if a or t:
            rows.append((f"causal attention forward + backward, {p} (GPT-2 layer) vs SDPA flash",
                         fmt(sum(a), " ms") if a else "n/a", fmt(sum(t), " ms") if t else "n/a",
                         ratio(1 / sum(a), 1 / sum(t)) if a and t else "n/a"))
    # Sampling: the Sample RPC's tokens/s against transformers' generate and
    # generate.py's KV-cache loop, then on a batch_invariant job (its cost:
    # its tokens/s over the plain job's). Where a side has no figure its
    # reason (refused, skipped: ...) stands in the cell.
    for model, label in (("gpt", "GPT"), ("decoder", "decoder")):
        ampd_plain = sample_figures(read(out, f"service_sample_{model}"))
        ampd_bi = sample_figures(read(out, f"service_sample_{model}_bi"))
        loop = sample_figures(read(out, f"torch_sample_{model}"))
        hf = sample_figures(read(out, f"hf_sample_{model}"))
        for p in ("bf16", "fp16"):
            a, b, lp, h = (ampd_plain.get(p), ampd_bi.get(p), loop.get(p), hf.get(p))
            rows.append((f"{label} Sample tokens/s, {p} (through gRPC) vs transformers generate",
                         sample_cell(a), sample_cell(h), sample_ratio(a, h)))
            rows.append((f"{label} Sample tokens/s, {p} (through gRPC) vs KV-cache loop",
                         sample_cell(a), sample_cell(lp), sample_ratio(a, lp)))
            rows.append((f"{label} Sample tokens/s, {p}, batch_invariant job vs transformers "
                         f"generate", sample_cell(b), sample_cell(h), sample_ratio(b, h)))
            if isinstance(a, float) and isinstance(b, float):
                rows.append((f"{label} Sample, {p}: batch_invariant's tokens/s over the plain "
                             f"job's", sample_cell(b), "", f"{b / a:.2f}x"))
    # Remote RL: accumulated updates against the fused Step (no PyTorch peer:
    # the ratio is ampd's Step time over its own accumulated update's), and
    # the memory of LoRA jobs on one shared base.
    remote = read(out, "service_remote_rl")
    for p, kind, fused, split in re.findall(
            r"^accumulate (\w+)\s+(full|lora r\d+)\s*: Step ([\d.]+) s, \d+ x ForwardBackward "
            r"\+ OptimStep ([\d.]+) s", remote, re.M):
        rows.append((f"decoder {kind} update, {p}: ForwardBackward calls + OptimStep vs one Step",
                     fmt(float(split), " s", 4), f"Step {fmt(float(fused), ' s', 4)}",
                     ratio(1 / float(split), 1 / float(fused))))
    m = re.search(r"^shared_base: (\d+) LoRA jobs .*?grew ([\d.]+) MiB against ([\d.]+) MiB.*?"
                  r"ratio ([\d.]+)", remote, re.M)
    if m:
        rows.append((f"{m[1]} LoRA jobs on one shared base: memory vs one base + adapters",
                     f"{m[2]} MiB", f"expected {m[3]} MiB", f"{m[4]}x"))
    # Token model through the service.
    svc_text = read(out, "service_token") + read(out, "service_token_bf16_fp32")
    svc, torch_tok = token_service(svc_text), token_torch(read(out, "torch_token"))
    for p in ("fp16", "bf16", "fp32"):
        a = svc.get(p, (None, None, None))[2]
        t = torch_tok.get(p)
        rows.append((f"token model step, {p} (through gRPC)", fmt(a, " ms"), fmt(t, " ms"),
                     ratio(1 / a if a else None, 1 / t if t else None)))
    engine_tok = token_torch(read(out, "engine_token"))
    for p in ("fp16", "bf16"):
        a, t = engine_tok.get(p), torch_tok.get(p)
        if a is not None:
            rows.append((f"token model step, {p} (in process)", fmt(a, " ms"), fmt(t, " ms"),
                         ratio(1 / a, 1 / t if t else None)))
    if "fp16" in svc:
        rows.append(("token model CreateJob, fp16", fmt(svc["fp16"][0], " s"), "", ""))
    m = re.search(r"state dict ([\d.]+) GB: export [\d.]+ s \(([\d.]+) GB/s\), import [\d.]+ s "
                  r"\(([\d.]+) GB/s\)", read(out, "service_token"))
    if m:
        rows.append((f"state dict export ({m[1]} GB)", f"{m[2]} GB/s", "", ""))
        rows.append((f"state dict import ({m[1]} GB)", f"{m[3]} GB/s", "", ""))
    for source, label in (("service_mlp", "reference MLP fp16"), ("service_io", "io model")):
        for n, sps, rt in re.findall(
                r"^\s*(\d+) concurrent small jobs.*?([\d.]+) steps/s in all(?:\s+\(round trip ([\d.]+) ms)?",
                read(out, source), re.M):
            rows.append((f"{n} concurrent small jobs, {label}",
                         f"{sps} steps/s" + (f" (round trip {rt} ms)" if rt else ""), "", ""))
    opt = read(out, "optimizer")
    bw = re.search(r"effective bandwidth\s+([\d.]+) GB/s", opt)
    cp = re.search(r"cudaMemcpy D2D.*?: ([\d.]+) GB/s", opt)
    dev = re.search(r"kernels alone \(device events\): median [\d.]+ ms, ([\d.]+) GB/s", opt)
    if bw and cp:
        rows.append(("fused unscale+AdamW+recast vs D2D copy, host-timed", f"{bw[1]} GB/s",
                     f"copy {cp[1]} GB/s", f"{float(bw[1]) / float(cp[1]):.0%} of copy"))
    if dev and cp:
        rows.append(("fused unscale+AdamW+recast vs D2D copy, device events", f"{dev[1]} GB/s",
                     f"copy {cp[1]} GB/s", f"{float(dev[1]) / float(cp[1]):.0%} of copy"))

    lines += ["", "## Figures (ratio: ampd's speed over PyTorch's)", "",
              "| workload | ampd | PyTorch | ratio |", "|---|---|---|---|"]
    lines += [f"| {w} | {a} | {t} | {r} |" for w, a, t, r in rows]
    lines += profile_table(read(out, "profile_gpt"), "GPT-2 small bf16")
    lines += profile_table(read(out, "profile_token"), "token model fp16")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
