"""The Pi coding agent (`@mariozechner/pi-coding-agent`, npm) in print mode with its own config dir:
a full tool loop against the scripted model (it reads a file with its `read` tool and answers from it),
and a protocol smoke test against the real default model. A recording proxy on loopback keeps every
request and response, so each tool call's arguments are validated against the schema Pi sent.

PI_CLI picks the CLI (default: node_modules/.bin/pi under PI_PREFIX or the repository); the tests skip
when it is not installed, except under CI (.ci/run installs it)."""
import http.server
import json
import os
import shutil
import subprocess
import threading
import urllib.error
import urllib.request

import jsonschema
import pytest

from conftest import API_KEY, ROOT


def _pi_cli():
    if os.environ.get("PI_CLI"):
        return os.environ["PI_CLI"]
    for prefix in (os.environ.get("PI_PREFIX"), ROOT):
        if prefix:
            p = os.path.join(prefix, "node_modules", ".bin", "pi")
            if os.path.exists(p):
                return p
    return shutil.which("pi")


PI = _pi_cli()
# CI installs Pi (.ci/run): there a missing CLI is a failure, not a skip.
pytestmark = pytest.mark.skipif(not PI and not os.environ.get("CI"), reason="the Pi coding agent is not installed")


class Recorder:
    """Forwards every request to `upstream` and keeps (request body, response body) pairs."""

    def __init__(self, upstream):
        self.exchanges = []
        rec = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                headers = {k: v for k, v in self.headers.items() if k.lower() in ("authorization", "content-type")}
                req = urllib.request.Request(upstream + self.path, data=body, headers=headers, method="POST")
                try:
                    with urllib.request.urlopen(req, timeout=120) as r:
                        status, ctype, data = r.status, r.headers.get("content-type", ""), r.read()
                except urllib.error.HTTPError as e:
                    status, ctype, data = e.code, e.headers.get("content-type", ""), e.read()
                rec.exchanges.append((json.loads(body or b"{}"), status, data.decode()))
                self.send_response(status)
                self.send_header("content-type", ctype)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


def tool_calls_of(sse_text):
    """Tool calls assembled from a chat-completions SSE body (or a whole JSON body)."""
    calls = {}
    if not sse_text.lstrip().startswith("data:"):
        msg = json.loads(sse_text)["choices"][0]["message"]
        return [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls") or []]
    for line in sse_text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for ch in json.loads(line[6:]).get("choices", []):
            for tc in ch.get("delta", {}).get("tool_calls") or []:
                e = calls.setdefault(tc["index"], ["", ""])
                e[0] += tc["function"].get("name") or ""
                e[1] += tc["function"].get("arguments") or ""
    return [tuple(v) for v in calls.values()]


def run_pi(tmp_path, base, key, prompt, extra=(), context=4096, max_tokens=256, settings=None):
    agent_dir = tmp_path / "pi-agent"
    agent_dir.mkdir()
    (agent_dir / "models.json").write_text(json.dumps({"providers": {"moe": {
        "baseUrl": base + "/v1", "api": "openai-completions", "apiKey": key,
        "compat": {"supportsDeveloperRole": False, "supportsReasoningEffort": False},
        "models": [{"id": "smollm2", "contextWindow": context, "maxTokens": max_tokens, "input": ["text"]}]}}}))
    if settings:
        (agent_dir / "settings.json").write_text(json.dumps(settings))
    work = tmp_path / "work"
    work.mkdir()
    (work / "hello.txt").write_text("The secret word is tangerine.\n")
    env = dict(os.environ, PI_CODING_AGENT_DIR=str(agent_dir), PI_OFFLINE="1", PI_TELEMETRY="0",
               HOME=str(tmp_path), NO_COLOR="1")
    args = [PI, "--provider", "moe", "--model", "smollm2", "--no-session", "--no-extensions",
            "--no-skills", "--no-context-files", "--tools", "read", *extra, "-p", prompt]
    return subprocess.run(args, cwd=work, env=env, capture_output=True, text=True, timeout=180)


def test_pi_reads_a_file_with_its_tool_and_answers(scripted, tmp_path):
    rec = Recorder(scripted.base)
    try:
        out = run_pi(tmp_path, rec.base, API_KEY, "read hello.txt and tell me the secret word.")
    finally:
        rec.close()
    assert out.returncode == 0, out.stderr + out.stdout
    assert "tangerine" in out.stdout, "\n".join(f"{s} {b[-2500:]}" for _, s, b in rec.exchanges)
    chats = [(req, status, body) for req, status, body in rec.exchanges if "messages" in req]
    assert len(chats) >= 2 and all(s == 200 for _, s, _ in chats)
    validated = 0
    for req, _, body in chats:
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in req.get("tools") or []}
        for name, args in tool_calls_of(body):
            jsonschema.validate(json.loads(args), schemas[name])
            validated += 1
    assert validated == 1
    # The tool's result went back to the model as a tool message.
    assert any(m.get("role") == "tool" and "tangerine" in json.dumps(m) for req, _, _ in chats
               for m in req["messages"])


def test_pi_protocol_smoke_against_the_real_model(real, tmp_path):
    rec = Recorder(real.base)
    try:
        out = run_pi(tmp_path, rec.base, "unused", "What is the capital of France?", context=2048, max_tokens=16,
                     # Compaction sized for a 2K context (Pi reserves 16K by default).
                     settings={"compaction": {"reserveTokens": 256, "keepRecentTokens": 1024}},
                     extra=["--system-prompt", "You are a helpful assistant. Answer briefly."])
    finally:
        rec.close()
    assert out.returncode == 0, out.stderr + out.stdout
    assert out.stdout.strip()
    (req, status, body) = [e for e in rec.exchanges if "messages" in e[0]][0]
    assert status == 200 and req.get("stream") is True
    assert "data: [DONE]" in body
    for name, args in tool_calls_of(body):
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in req.get("tools") or []}
        jsonschema.validate(json.loads(args), schemas[name])
