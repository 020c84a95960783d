"""examples/tinker_rl.py, the GRPO-like loop written against the tinker SDK
alone, run as a user runs it against the front: the reward rises and the
sampler's log-probs equal the trainer's on every iteration (--check)."""
import os
import subprocess
import sys


def test_the_rl_example_trains_on_policy(base_url):
    example = os.path.join(os.environ["AMPD_SOURCE_DIR"], "examples", "tinker_rl.py")
    run = subprocess.run([sys.executable, example, "--base-url", base_url, "--check"],
                         env=dict(os.environ, TINKER_API_KEY="tml-rl-example"),
                         capture_output=True, text=True, timeout=600)
    print(run.stdout)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "max mismatch 0\n" in run.stdout
