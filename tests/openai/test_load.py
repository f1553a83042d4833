"""The load test runs against the real model, bounded in time, without errors."""
import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def test_load_test_runs_bounded_in_time_without_errors(real):
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "load_test.py"), "--base", real.base + "/v1",
         "--duration", "4", "--concurrency", "4", "--max-tokens", "8"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "| 4 |" in out.stdout
