#!/usr/bin/env python3
"""gpu_check_report.py's sampling rows and outcomes, from logs written here
in the form the sampling parts print: a refused batch_invariant job reads
"refused" (not "ok", not a failure), transformers' absence "skipped", a
torch that cannot run fp16 "not supported", and figures pair into ratios.
The CPU check (gpu_check_cpu_quick) never meets a refusal: this does.

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
}


class SamplingRows(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        with tempfile.TemporaryDirectory() as d:
            out = pathlib.Path(d)
            (out / "parts.tsv").write_text("".join(f"{name}\tok\t3\tcmd\n" for name in LOGS))
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


if __name__ == "__main__":
    unittest.main()
