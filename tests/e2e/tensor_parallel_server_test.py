#!/usr/bin/env python3
"""The server under tensor parallelism, on the CPU over Gloo, driven by the official
`openai` client against the real dropkv-server binary and SmolLM2-135M-Instruct:

  the same requests to a server at tensor_parallel_size 1 and one at 3 (three rank processes):
    greedy completions with the full cache and with DropKV (keep 0.3, and keep 0.5 with
    compression during decode), four at once (batched decode and mixed steps) -> identical
    token ids;
  SIGTERM on the TP 3 server: exit 0, and its rank processes are gone;
  a rank killed mid-request (SIGKILL on rank 2 while a stream runs): the server exits with an
    error naming the rank within seconds, the stream ends instead of hanging, and no rank is left.

Exits non-zero on the first failure."""
import argparse
import os
import signal
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from openai_client_test import Server, check, fail  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "Here is a short story about a lighthouse keeper who finds a message in a bottle:",
    "List three prime numbers greater than ten:",
    "def fibonacci(n):",
]
# A longer prompt for the presses to act on (about 300 tokens).
LONG_PROMPT = (
    "The following notes are from a ship's log. " +
    " ".join(f"Day {d}: the wind was from the {('north', 'east', 'south', 'west')[d % 4]}, "
             f"we sailed {20 + 3 * d} miles and saw {d % 5} other ships." for d in range(1, 16)) +
    " The secret word is lantern. Question: what is the secret word? Answer:")


def children(pid):
    """The rank processes the server started (its direct children)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (not yet reaped) is dead too.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def run_requests(base):
    """Token ids for every request of the comparison, by name."""
    import openai
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=600, max_retries=0)

    def complete(prompt, max_tokens, compression=None):
        extra = {"return_token_ids": True, "ignore_eos": True}
        if compression:
            extra["kv_compression"] = compression
        r = client.completions.create(model="smollm2-135m-instruct", prompt=prompt,
                                      max_tokens=max_tokens, temperature=0, extra_body=extra)
        # The ids and the KV entries the prefill kept (token x layer): equal selections keep
        # equal counts, and a press that acted keeps fewer than the prompt's.
        return (r.choices[0].model_extra["token_ids"], r.usage.model_extra["kv_tokens_kept"],
                r.usage.prompt_tokens)

    out = {}
    out["full"] = complete(PROMPTS[0], 16)
    out["dropkv_0.3"] = complete(LONG_PROMPT, 20, {"method": "dropkv", "keep_ratio": 0.3})
    out["dropkv_0.5_decode"] = complete(LONG_PROMPT, 40, {"method": "dropkv", "keep_ratio": 0.5,
                                                          "window": 8, "decode_margin": 8})
    results = [None] * len(PROMPTS)

    def one(i):
        results[i] = complete(PROMPTS[i], 24, {"method": "snapkv", "keep_ratio": 0.5} if i % 2
                              else None)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, ids in enumerate(results):
        out[f"concurrent_{i}"] = ids
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--scratch", required=True)
    args = ap.parse_args()
    os.makedirs(args.scratch, exist_ok=True)
    model = os.path.join(os.environ["DROPKV_MODELS"], "smollm2-135m-instruct")
    if not os.path.exists(os.path.join(model, "config.json")):
        fail(f"no SmolLM2 at {model} (scripts/setup.sh installs it)")
    common = ["--model", model, "--device", "cpu", "--kv-blocks", "512"]

    reference = Server(args.server, common, args.scratch, "tp1")
    expected = run_requests(f"http://127.0.0.1:{reference.http_port}")
    check(reference.stop() == 0, "tp1 server exits 0")

    tp = Server(args.server, common + ["--tensor-parallel-size", "3"], args.scratch, "tp3")
    ranks = children(tp.proc.pid)
    check(len(ranks) == 2, f"tp3 server runs two more rank processes ({ranks})")
    got = run_requests(f"http://127.0.0.1:{tp.http_port}")
    for name, (ids, kept, prompt) in expected.items():
        check(got[name] == (ids, kept, prompt) and len(ids) > 0,
              f"{name}: TP 3 generates TP 1's {len(ids)} tokens (first {ids[:6]}) and keeps "
              f"as many KV entries ({kept} for {prompt} prompt tokens)")
    full_layers = 30  # SmolLM2's layers: an uncompressed prompt keeps prompt x 30 entries
    for name in ("dropkv_0.3", "dropkv_0.5_decode", "concurrent_1"):
        ids, kept, prompt = expected[name]
        check(kept < prompt * full_layers, f"{name}: the press acted ({kept} < {prompt} x 30)")
    import openai
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{tp.http_port}/v1", api_key="none",
                           timeout=120, max_retries=0)
    forced = client.completions.create(model="smollm2-135m-instruct", prompt=PROMPTS[0],
                                       max_tokens=2, temperature=0, logit_bias={"42": 100},
                                       extra_body={"return_token_ids": True})
    check(forced.choices[0].model_extra["token_ids"] == [42, 42], "TP 3: logit_bias forces 42")
    try:
        client.completions.create(model="smollm2-135m-instruct", prompt=PROMPTS[0], max_tokens=2,
                                  echo=True, logprobs=0)
        fail("TP 3: echo with logprobs accepted")
    except openai.APIStatusError as e:
        check(e.status_code == 400 and e.param == "echo",
              f"TP 3: echo with logprobs refused ({e.message[:80]})")
    check(tp.stop() == 0, "tp3 server exits 0 on SIGTERM")
    time.sleep(0.5)
    check(not any(alive(p) for p in ranks), "its rank processes are gone")

    # A rank dies while a request streams.
    tp = Server(args.server, common + ["--tensor-parallel-size", "3"], args.scratch, "tp3_kill")
    ranks = children(tp.proc.pid)
    check(len(ranks) == 2, "second tp3 server runs two more ranks")
    import openai
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{tp.http_port}/v1", api_key="none",
                           timeout=60, max_retries=0)
    stream = client.completions.create(model="smollm2-135m-instruct", prompt=PROMPTS[1],
                                       max_tokens=2000, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    received, ended_with = 0, None
    started = None
    try:
        for chunk in stream:
            received += 1
            if received == 3:
                os.kill(ranks[1], signal.SIGKILL)
                started = time.time()
        ended_with = "end of stream"
    except Exception as e:  # the connection closes under the client
        ended_with = type(e).__name__
    check(started is not None and received < 2000,
          f"the stream ended after {received} chunks ({ended_with}) instead of running on")
    try:
        code = tp.proc.wait(timeout=30)
    except Exception:
        tp.proc.kill()
        fail("the server did not exit within 30 s of a rank's death")
    check(code != 0, f"the server exits with an error (code {code}) "
                     f"{time.time() - started:.1f} s after the rank died")
    with open(os.path.join(args.scratch, "tp3_kill.log")) as f:
        log = f.read()
    line = next((l for l in log.splitlines() if "rank 2 exited" in l), None)
    check(line is not None, f"its log names the dead rank: {line}")
    time.sleep(0.5)
    check(not any(alive(p) for p in ranks), "no rank process is left")
    print("PASS")


if __name__ == "__main__":
    main()
