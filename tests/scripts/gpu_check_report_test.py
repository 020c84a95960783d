#!/usr/bin/env python3
"""gpu_check_report.py's sampling rows and outcomes, from logs written here
in the form the sampling parts print: a refused batch_invariant job reads
"refused" (not "ok", not a failure), transformers' absence "skipped", a
torch that cannot run fp16 "not supported", and figures pair into ratios.
The CPU check (gpu_check_cpu_quick) never meets a refusal: this does.
Also: a part the budget ended reads "cut" (parts.tsv as gpu-check.sh
writes it), attention pairs with SDPA's flash backend, and the RL check's
summary line reaches the parts table.

    python3 tests/scripts/gpu_check_report_test.py
"""

import pathlib
import subprocess
import sys
import tempfile
import unittest

REPORT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "gpu_check_report.py"

LOGS = {
    "service_sample_decoder": "sample: decoder ...\n"
    "bf16  sample median   800.000 ms        2560 sampled tokens/s  (2048 tokens a call)\n"
    "fp16  sample median  1000.000 ms        2048 sampled tokens/s  (2048 tokens a call)\n",
    "service_sample_decoder_bi": "sample: decoder ..., batch-invariant\n"
    "bf16  refused: INVALID_ARGUMENT [INVALID_FIELD field=batch_invariant]: batch_invariant: "
    "not available on cuda:0\n"
    "fp16  refused: INVALID_ARGUMENT [INVALID_FIELD field=batch_invariant]: batch_invariant: "
    "not available on cuda:0\n",
    "service_sample_gpt": "bf16  sample median   100.000 ms       20480 sampled tokens/s  "
    "(2048 tokens a call)\n",
    "service_sample_gpt_bi": "bf16  sample median   200.000 ms       10240 sampled tokens/s  "
    "(2048 tokens a call)\n",
    "torch_sample_decoder": "device: cpu\n"
    "bf16  sample median  1600.000 ms        1280 sampled tokens/s  (2048 tokens a call)\n"
    "fp16: not supported: fp16 weights not supported on cpu in this torch\n",
    "hf_sample_decoder": "skipped: transformers not installed\n",
    "hf_sample_gpt": "bf16  sample median   400.000 ms        5120 sampled tokens/s  "
    "(2048 tokens a call)\n",
    "attention": "attention B=8 T=1024 H=12 D=64 bf16, register-tile kernels: forward 1.000 ms "
    "(103 TFLOP/s), backward 3.000 ms (86 TFLOP/s)\n"
    "attention B=8 T=1024 H=12 D=64 bf16, wmma kernels: forward 2.000 ms (51 TFLOP/s), "
    "backward 5.000 ms (52 TFLOP/s)\n",
    "torch_attention": "attention B=8 T=1024 H=12 D=64 bf16, sdpa flash: forward 0.500 ms "
    "(206 TFLOP/s), backward 1.500 ms (172 TFLOP/s)\n"
    "attention B=8 T=1024 H=12 D=64 fp16: skipped: no fp16\n",
    "rl_fp16": "iteration 0 ...\nreward 0.250 -> 0.700; max sampler-trainer mismatch 0\n",
}
# Outcomes other than ok, as gpu-check.sh's part() writes them.
PARTS = {"torch_gpt_compile": "cut\t42\tcmd", "profile_gpt": "cut\t0\tnot started: the budget was spent"}


class SamplingRows(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        with tempfile.TemporaryDirectory() as d:
            out = pathlib.Path(d)
            (out / "parts.tsv").write_text(
                "".join(f"{name}\tok\t3\tcmd\n" for name in LOGS) +
                "".join(f"{name}\t{row}\n" for name, row in PARTS.items()))
            for name, text in LOGS.items():
                (out / f"{name}.log").write_text(text)
            cls.report = subprocess.run([sys.executable, str(REPORT), str(out)], check=True,
                                        capture_output=True, text=True).stdout
        cls.rows = {line.split(" | ")[0].lstrip("| "): line
                    for line in cls.report.splitlines() if line.startswith("| ")}

    def test_refused_part_reads_refused(self):
        row = self.rows["service_sample_decoder_bi"]
        self.assertIn("| refused |", row)
        self.assertIn("bf16  refused: INVALID_ARGUMENT", row)

    def test_missing_transformers_reads_skipped(self):
        self.assertIn("| skipped | 3 | transformers not installed |",
                      self.rows["hf_sample_decoder"])

    def test_unsupported_precision_is_said_beside_ok(self):
        row = self.rows["torch_sample_decoder"]
        self.assertIn("| ok |", row)
        self.assertIn("fp16: not supported", row)

    def test_measured_part_stays_ok(self):
        self.assertIn("| ok | 3 |  |", self.rows["service_sample_decoder"])

    def test_figures_pair_into_ratios(self):
        rows = self.rows
        self.assertIn("| 2.56e+03 | 1.28e+03 | 2.00x |",
                      rows["decoder Sample tokens/s, bf16 (through gRPC) vs KV-cache loop"])
        self.assertIn("| 2.05e+04 | 5.12e+03 | 4.00x |",
                      rows["GPT Sample tokens/s, bf16 (through gRPC) vs transformers generate"])
        self.assertIn("| 1.02e+04 |  | 0.50x |",
                      rows["GPT Sample, bf16: batch_invariant's tokens/s over the plain job's"])

    def test_reasons_stand_in_for_missing_figures(self):
        self.assertIn("| 2.56e+03 | skipped: transformers not installed | n/a |",
                      self.rows["decoder Sample tokens/s, bf16 (through gRPC) vs transformers "
                                "generate"])
        self.assertIn("| refused | skipped: transformers not installed | n/a |",
                      self.rows["decoder Sample tokens/s, bf16, batch_invariant job vs "
                                "transformers generate"])
        self.assertIn("| 2.05e+03 | not supported | n/a |",
                      self.rows["decoder Sample tokens/s, fp16 (through gRPC) vs KV-cache loop"])


    def test_budget_cut_reads_cut(self):
        self.assertIn("| cut | 42 | ended by the budget |", self.rows["torch_gpt_compile"])
        self.assertIn("| cut | 0 | not started: the budget was spent |", self.rows["profile_gpt"])

    def test_attention_pairs_with_sdpa_flash(self):
        self.assertIn("| 4 ms | 2 ms | 0.50x |",
                      self.rows["causal attention forward + backward, bf16 (GPT-2 layer) vs SDPA "
                                "flash"])
        self.assertNotIn("causal attention forward + backward, fp16 (GPT-2 layer) vs SDPA flash",
                         self.rows)

    def test_rl_check_summary_in_the_parts_table(self):
        self.assertIn("reward 0.250 -> 0.700; max sampler-trainer mismatch 0",
                      self.rows["rl_fp16"])


if __name__ == "__main__":
    unittest.main()
