"""Scale from zero end to end on loopback: `moe-operator activator` in front of a real
`moe-daemon` (scripted replies over the SmolLM2 tokenizer) that only starts after a request came in.

A chat request sent while no replica exists is held, shows in the activator's
`moe:num_requests_waiting` (what the builtin autoscaler and the KEDA trigger read to wake the
deployment), and is answered once the daemon is ready, streaming included.
"""

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OPERATOR = Path(os.environ.get("MOE_OPERATOR_BIN", ROOT / "target" / "debug" / "moe-operator"))
DAEMON = Path(os.environ.get("MOE_DAEMON_BIN", ROOT / "target" / "debug" / "moe-daemon"))
SCRIPT = {"step_delay_ms": 1, "replies": [{"trigger": "wake up", "reply": "Good morning."}]}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read().decode()


def waiting(base):
    _, text = get(base + "/metrics")
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.startswith("moe:num_requests_waiting"))


def chat(base, stream=False):
    body = json.dumps({"model": "smollm2", "stream": stream, "max_tokens": 32, "temperature": 0,
                       "messages": [{"role": "user", "content": "wake up"}]}).encode()
    req = urllib.request.Request(base + "/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=180) as r:
        return r.status, r.headers.get("content-type", ""), r.read().decode()


class ActivatorEndToEnd(unittest.TestCase):
    def setUp(self):
        for b in (OPERATOR, DAEMON):
            if not b.exists():
                raise RuntimeError(f"{b} missing: `cargo test --workspace` builds it")
        self.tmp = tempfile.TemporaryDirectory()
        self.procs = []
        self.daemon_port, self.front_port = free_port(), free_port()
        self.front = f"http://127.0.0.1:{self.front_port}"
        self.spawn([str(OPERATOR), "activator", "--listen", f"127.0.0.1:{self.front_port}",
                    "--upstream", f"http://127.0.0.1:{self.daemon_port}", "--probe-interval-ms", "100",
                    "--wait-timeout-seconds", "150"], "activator")
        self.wait_for(lambda: get(self.front + "/activator/healthz")[0] == 200, 30, "activator up")

    def tearDown(self):
        for p in self.procs:
            p.terminate()
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        self.tmp.cleanup()

    def spawn(self, args, name):
        with open(Path(self.tmp.name) / f"{name}.log", "w") as log:
            self.procs.append(subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT))

    def wait_for(self, check, seconds, what):
        deadline = time.time() + seconds
        while time.time() < deadline:
            try:
                if check():
                    return
            except OSError:
                pass
            time.sleep(0.05)
        logs = "\n".join(p.read_text() for p in Path(self.tmp.name).glob("*.log"))
        self.fail(f"{what} not reached in {seconds} s\n{logs}")

    def start_daemon(self):
        gguf = subprocess.run([sys.executable, str(ROOT / "scripts" / "smollm2_gguf_path.py")],
                              capture_output=True, text=True, check=True).stdout.strip()
        script = Path(self.tmp.name) / "script.json"
        script.write_text(json.dumps(SCRIPT))
        self.spawn([str(DAEMON), "serve", "--model", gguf, "--port", str(self.daemon_port),
                    "--served-model-name", "smollm2", "--scripted-replies", str(script)], "daemon")

    def test_a_request_sent_at_zero_replicas_is_answered(self):
        result = {}
        t = threading.Thread(target=lambda: result.update(answer=chat(self.front)))
        t.start()
        # Held and counted: this is the signal that scales the deployment up from zero.
        self.wait_for(lambda: waiting(self.front) == 1, 30, "queue depth 1")
        self.assertFalse(result, "answered before any replica existed")
        self.start_daemon()
        t.join(timeout=150)
        self.assertIn("answer", result, "no answer after the replica started")
        status, _, body = result["answer"]
        self.assertEqual(status, 200)
        self.assertEqual(json.loads(body)["choices"][0]["message"]["content"], "Good morning.")
        self.assertEqual(waiting(self.front), 0)
        # With a replica up, streams pass straight through as server-sent events.
        status, ctype, body = chat(self.front, stream=True)
        self.assertEqual(status, 200)
        self.assertIn("text/event-stream", ctype)
        self.assertIn("data: [DONE]", body)


if __name__ == "__main__":
    unittest.main()
