"""The loopback soak (scripts/soak.py) for a bounded time: streaming, disconnects, timeouts, queue
overflow and a SIGTERM-restart cycle at saturation; no request lost or duplicated, RSS flat.
MOE_SOAK_SECONDS sets the length (CI: 60 s; docs/RELIABILITY.md has the long run)."""
import json
import os
import subprocess
import sys

from conftest import ROOT, _binary


def test_soak_loses_and_duplicates_nothing():
    seconds = os.environ.get("MOE_SOAK_SECONDS", "60")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts/soak.py"), "--seconds", seconds,
                          "--restart-every", "25", "--binary", _binary()],
                         capture_output=True, text=True, timeout=float(seconds) + 240)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    report = json.loads(out.stdout)
    counts = report["counts"]
    assert counts.get("lost", 0) == 0 and counts.get("duplicated", 0) == 0
    assert counts["answered"] > 0 and counts.get("disconnected", 0) > 0
    assert len(report["exit_codes"]) >= 2 and not any(report["exit_codes"])
