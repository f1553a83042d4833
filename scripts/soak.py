#!/usr/bin/env python3
"""Loopback soak of `moe-daemon serve` at saturation: streaming and non-streaming requests, clients
that disconnect mid-stream, requests that hit the server's request timeout, queue overflow (429),
and SIGTERM-restart cycles. It counts every request sent and how it ended, and samples the server's
RSS.

Pass criteria (exit status 1 otherwise):
- lost = 0: every request the server accepted (HTTP 200) ends properly: a whole JSON body with a
  finish_reason, or an SSE stream whose last event is `[DONE]` (an error event before it is allowed:
  timeouts). Refusals (429 queue full, 503 draining) and refused connections while the server
  restarts are counted apart: clients retry those.
- duplicated = 0: no choice gets two finish_reasons and no stream two `[DONE]`s.
- RSS flat: in each server lifetime, after a warm-up, the last sample is within 25% + 32 MiB of the
  first.

Usage: python3 scripts/soak.py --seconds 1800 [--binary target/release/moe-daemon] [--model X.gguf]
The default model is the SmolLM2 GGUF (scripts/smollm2_gguf_path.py); replies are scripted
(`--scripted-replies`), so what is soaked is the serving stack, not the arithmetic.
"""
import argparse
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
TRIGGER = "talk for a long time"
SCRIPT = {"step_delay_ms": 2, "replies": [{"trigger": TRIGGER, "reply": " ".join(["word"] * 4000)}]}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_kib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class Daemon:
    """One server process after another on the same port."""

    def __init__(self, args, log_dir):
        self.args, self.log_dir, self.port = args, log_dir, free_port()
        self.proc, self.lifetimes, self.exit_codes = None, [], []
        fd, self.script = tempfile.mkstemp(suffix=".json", dir=log_dir)
        os.write(fd, json.dumps(SCRIPT).encode())
        os.close(fd)

    def start(self):
        log = open(os.path.join(self.log_dir, f"server-{len(self.lifetimes)}.log"), "w")
        cmd = [self.args.binary, "serve", "--model", self.args.model, "--port", str(self.port),
               "--served-model-name", "soak", "--scripted-replies", self.script,
               "--max-running", "8", "--max-waiting", "16", "--request-timeout-s", "2",
               "--shutdown-timeout-s", "20", "--max-model-len", "8192"]
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        self.lifetimes.append([])
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                sys.exit(f"server exited at start; see {log.name}")
            try:
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=1)
                c.request("GET", "/ready")
                if c.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        sys.exit("server not ready in 120 s")

    def sample(self):
        kib = rss_kib(self.proc.pid) if self.proc else None
        if kib:
            self.lifetimes[-1].append((time.time(), kib))

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        self.exit_codes.append(self.proc.wait(timeout=60))


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.counts = Counter()
        self.problems = []

    def add(self, key, problem=None):
        with self.lock:
            self.counts[key] += 1
            if problem and len(self.problems) < 20:
                self.problems.append(problem)


def one_request(port, rng, tally):
    """Sends one request of a random kind and records how it ended."""
    kind = rng.choice(["stream", "stream", "whole", "disconnect", "timeout"])
    stream = kind != "whole"
    max_tokens = {"timeout": 3000, "disconnect": 400}.get(kind, rng.randint(4, 60))
    body = json.dumps({"model": "soak", "max_tokens": max_tokens, "stream": stream, "n": rng.choice([1, 1, 2]),
                       "messages": [{"role": "user", "content": f"{TRIGGER} #{rng.random()}"}]})
    tally.add("sent")
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        c.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
        r = c.getresponse()
    except (ConnectionRefusedError, ConnectionResetError):
        tally.add("not_connected")  # the server is restarting: nothing was accepted
        time.sleep(0.1)
        return
    except OSError as e:
        tally.add("lost", f"{kind}: {e!r} before the response")
        return
    if r.status in (429, 503):
        r.read()
        tally.add(f"refused_{r.status}")
        time.sleep(rng.uniform(0.02, 0.1))  # a client honouring Retry-After, shortened
        return
    if r.status == 504:
        r.read()
        tally.add("answered_with_error")  # the request timeout, as a whole JSON error
        return
    if r.status != 200:
        tally.add("lost", f"{kind}: HTTP {r.status} {r.read()[:200]!r}")
        return
    try:
        if not stream:
            out = json.loads(r.read())
            reasons = [ch["finish_reason"] for ch in out["choices"]]
            tally.add("answered" if all(reasons) else "lost", None if all(reasons) else f"whole: {out}")
            return
        finishes, done, errors = Counter(), 0, 0
        events = 0
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            events += 1
            if data == b"[DONE]":
                done += 1
                continue
            if done:
                tally.add("duplicated", f"{kind}: data after [DONE]")
            ev = json.loads(data)
            if "error" in ev:
                errors += 1
                continue
            for ch in ev.get("choices", []):
                if ch.get("finish_reason"):
                    finishes[ch["index"]] += 1
            if kind == "disconnect" and events >= 5:
                c.close()  # the client goes away mid-stream
                tally.add("disconnected")
                return
        if done != 1 or any(v > 1 for v in finishes.values()):
            key = "duplicated" if done > 1 or any(v > 1 for v in finishes.values()) else "lost"
            tally.add(key, f"{kind}: done={done} finishes={dict(finishes)} errors={errors}")
        elif errors:
            tally.add("answered_with_error")  # e.g. the request timeout, then [DONE]
        else:
            tally.add("answered")
    except (OSError, http.client.HTTPException, json.JSONDecodeError) as e:
        tally.add("lost", f"{kind}: {e!r} mid-response")
    finally:
        c.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--restart-every", type=float, default=20, help="seconds between SIGTERM-restarts")
    ap.add_argument("--clients", type=int, default=24, help="concurrent clients (saturation: > 8 + 16)")
    ap.add_argument("--binary", default=os.environ.get("MOE_DAEMON_BIN", os.path.join(ROOT, "target/debug/moe-daemon")))
    ap.add_argument("--model", default=None)
    ap.add_argument("--warmup", type=float, default=5, help="seconds of each lifetime before RSS counts")
    args = ap.parse_args()
    if args.model is None:
        args.model = subprocess.run([sys.executable, os.path.join(ROOT, "scripts/smollm2_gguf_path.py")],
                                    capture_output=True, text=True, check=True).stdout.strip()
    log_dir = tempfile.mkdtemp(prefix="moe-soak-")
    daemon, tally = Daemon(args, log_dir), Tally()
    daemon.start()
    stop_at = time.time() + args.seconds
    done = threading.Event()

    def client(seed):
        rng = random.Random(seed)
        while not done.is_set():
            one_request(daemon.port, rng, tally)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
    for t in threads:
        t.start()
    next_restart = time.time() + args.restart_every
    while time.time() < stop_at:
        daemon.sample()
        if time.time() >= next_restart and stop_at - time.time() > args.restart_every / 2:
            daemon.stop()
            daemon.start()
            next_restart = time.time() + args.restart_every
        time.sleep(0.5)
    done.set()
    for t in threads:
        t.join(timeout=90)
    daemon.sample()
    daemon.stop()

    flat = True
    rss_report = []
    for life in daemon.lifetimes:
        if not life:
            continue
        t0 = life[0][0]
        warm = [kib for t, kib in life if t - t0 >= args.warmup] or [life[-1][1]]
        first, last, peak = warm[0], warm[-1], max(warm)
        ok = last <= first * 1.25 + 32 * 1024
        flat &= ok
        rss_report.append({"first_mib": first // 1024, "last_mib": last // 1024, "peak_mib": peak // 1024, "flat": ok})
    c = tally.counts
    ended = sum(v for k, v in c.items() if k not in ("sent", "duplicated"))
    if ended != c["sent"]:
        tally.problems.append(f"{c['sent']} sent but {ended} accounted for")
    failed = (c["lost"] or c["duplicated"] or not flat or any(daemon.exit_codes) or c["answered"] == 0
              or ended != c["sent"])
    report = {"seconds": args.seconds, "counts": dict(c), "exit_codes": daemon.exit_codes, "rss": rss_report,
              "problems": tally.problems, "logs": log_dir}
    print(json.dumps(report, indent=1))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
