#!/usr/bin/env python3
"""Load test of a running moe-daemon over loopback with the official `openai` async client.

Keeps --concurrency streaming chat requests in flight for --duration seconds (requests still running at
the end are finished and counted), then prints requests/s, output tokens/s and percentiles of time to
first token, inter-token gap and end-to-end latency as a Markdown table (docs/PERF.md, section Server).

    python3 scripts/load_test.py --base http://127.0.0.1:8000/v1 --model smollm2 --duration 30 --concurrency 8

Without the `openai` package (e.g. on a machine with no package index) it falls back to the standard
library (http.client in threads, SSE parsed by hand) with the same measurements.
"""
import argparse
import asyncio
import json
import statistics
import sys
import time

try:
    import openai
except ImportError:  # stdlib fallback below
    openai = None

PROMPTS = [
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Write one sentence about the sea.",
    "What is 12 plus 30?",
    "Give a synonym for happy.",
    "Which planet is closest to the sun?",
    "Say hello in Spanish.",
    "What do bees make?",
]


def pct(values, p):
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, int(round(p / 100 * (len(v) - 1))))]


async def one(client, model, i, max_tokens, rec):
    t0 = time.perf_counter()
    first, last, gaps, n = None, None, [], 0
    stream = await client.chat.completions.create(
        model=model, stream=True, max_tokens=max_tokens, temperature=0,
        messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
        stream_options={"include_usage": True})
    async for ch in stream:
        now = time.perf_counter()
        if ch.choices and ch.choices[0].delta.content:
            if first is None:
                first = now - t0
            else:
                gaps.append(now - last)
            last = now
        if ch.usage:
            n = ch.usage.completion_tokens
    rec["e2e"].append(time.perf_counter() - t0)
    rec["ttft"].append(first if first is not None else time.perf_counter() - t0)
    rec["itl"].extend(gaps)
    rec["tokens"] += n


def one_stdlib(base, model, i, max_tokens, api_key, rec, lock):
    import http.client
    import urllib.parse
    u = urllib.parse.urlparse(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    body = json.dumps({"model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0,
                       "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                       "stream_options": {"include_usage": True}})
    t0 = time.perf_counter()
    conn.request("POST", u.path + "/chat/completions", body,
                 {"content-type": "application/json", "authorization": f"Bearer {api_key}"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:200]!r}")
    first, last, gaps, n = None, None, [], 0
    for line in resp:
        line = line.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        ch = json.loads(line[6:])
        now = time.perf_counter()
        if ch.get("choices") and ch["choices"][0]["delta"].get("content"):
            if first is None:
                first = now - t0
            else:
                gaps.append(now - last)
            last = now
        if ch.get("usage"):
            n = ch["usage"]["completion_tokens"]
    conn.close()
    with lock:
        rec["e2e"].append(time.perf_counter() - t0)
        rec["ttft"].append(first if first is not None else time.perf_counter() - t0)
        rec["itl"].extend(gaps)
        rec["tokens"] += n


def run_stdlib(args, rec):
    import threading
    lock = threading.Lock()
    start = time.perf_counter()
    counter = iter(range(10**9))

    def worker():
        while time.perf_counter() - start < args.duration:
            with lock:
                i = next(counter)
            try:
                one_stdlib(args.base, args.model, i, args.max_tokens, args.api_key, rec, lock)
            except Exception as e:
                with lock:
                    rec["errors"] += 1
                print("request failed:", e, file=sys.stderr)

    threads = [threading.Thread(target=worker) for _ in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start


async def run(args):
    rec = {"e2e": [], "ttft": [], "itl": [], "tokens": 0, "errors": 0}
    if openai is None:
        wall = run_stdlib(args, rec)
    else:
        client = openai.AsyncOpenAI(base_url=args.base, api_key=args.api_key, max_retries=0, timeout=300)
        start = time.perf_counter()
        counter = iter(range(10**9))

        async def worker():
            while time.perf_counter() - start < args.duration:
                try:
                    await one(client, args.model, next(counter), args.max_tokens, rec)
                except Exception as e:  # counted, not fatal: the figure is what the server sustained
                    rec["errors"] += 1
                    print("request failed:", e, file=sys.stderr)

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        wall = time.perf_counter() - start
    ms = lambda xs, p: f"{pct(xs, p) * 1000:.0f}"
    result = {
        "concurrency": args.concurrency, "duration_s": round(wall, 1), "requests": len(rec["e2e"]),
        "errors": rec["errors"], "req_per_s": round(len(rec["e2e"]) / wall, 2),
        "out_tok_per_s": round(rec["tokens"] / wall, 1),
        "ttft_ms": [ms(rec["ttft"], p) for p in (50, 90, 99)],
        "itl_ms": [ms(rec["itl"], p) for p in (50, 90, 99)],
        "e2e_ms": [ms(rec["e2e"], p) for p in (50, 90, 99)],
    }
    print("| concurrency | requests | errors | req/s | out tok/s | TTFT p50/p90/p99 ms | ITL p50/p90/p99 ms | e2e p50/p90/p99 ms |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {args.concurrency} | {result['requests']} | {result['errors']} | {result['req_per_s']} | "
          f"{result['out_tok_per_s']} | {'/'.join(result['ttft_ms'])} | {'/'.join(result['itl_ms'])} | "
          f"{'/'.join(result['e2e_ms'])} |")
    print(json.dumps(result), file=sys.stderr)
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--api-key", default="unused")
    ap.add_argument("--duration", type=float, default=30)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    result = asyncio.run(run(args))
    sys.exit(1 if result["errors"] or not result["requests"] else 0)


if __name__ == "__main__":
    main()
