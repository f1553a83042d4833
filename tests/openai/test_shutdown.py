"""SIGTERM: the server stops accepting, lets the in-flight stream finish, then exits 0."""
import json
import signal
import time

import urllib.error

from conftest import SCRIPT, Server, raw


def test_sigterm_finishes_in_flight_stream_then_exits(tmp_path):
    script = tmp_path / "script.json"
    script.write_text(json.dumps(SCRIPT))
    s = Server(["--scripted-replies", str(script), "--shutdown-timeout-s", "20"], tmp_path)
    try:
        c = s.client()
        stream = c.chat.completions.create(model="smollm2", max_tokens=150, stream=True,
                                           messages=[{"role": "user", "content": "talk for a long time"}])
        it = iter(stream)
        next(it)
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        try:
            assert raw(s.base + "/ready", timeout=2).status_code == 503
        except (urllib.error.URLError, ConnectionError):
            pass  # listener already closed: refused as well
        rest = list(it)
        assert rest[-1].choices[0].finish_reason == "length"
        assert s.proc.wait(timeout=20) == 0
    finally:
        s.stop()
