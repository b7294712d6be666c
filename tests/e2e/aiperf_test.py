#!/usr/bin/env python3
"""A real benchmark client against the HTTP API: NVIDIA's AIPerf (pinned in
scripts/requirements-aiperf.txt, its own venv) runs a short bounded load (streamed completions,
concurrency 4, 16 requests) against dropkv-server on loopback (the demo model: the engine is not
what is measured here), and its JSON report must show every request completed, none failed, and
token counts that match what was asked. Exits non-zero on the first failure."""
import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time

NUM_REQUESTS = 16
OUTPUT_TOKENS = 12


def check(cond, msg):
    if not cond:
        print("FAIL:", msg, flush=True)
        sys.exit(1)
    print("ok:", msg, flush=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--aiperf", required=True, help="the aiperf executable of the AIPerf venv")
    ap.add_argument("--scratch", required=True)
    args = ap.parse_args()
    check(os.path.exists(args.aiperf), f"AIPerf installed by scripts/setup.sh: {args.aiperf}")
    check(os.environ.get("DROPKV_MODELS"), "DROPKV_MODELS names the set-up's model folder")
    os.makedirs(args.scratch, exist_ok=True)
    http_port = free_port()
    log = open(os.path.join(args.scratch, "server.log"), "w")
    proc = subprocess.Popen([args.server, "--demo-model", "--port", "0", "--metrics-port", "0",
                             "--http-port", str(http_port)], stdout=subprocess.PIPE, stderr=log,
                            text=True)
    try:
        line = ""
        deadline = time.time() + 60
        while time.time() < deadline and not line.startswith("LISTENING "):
            line = proc.stdout.readline()
            if not line:
                break
        check(line.startswith("LISTENING "), "server started")
        # AIPerf writes its prompts with a Hugging Face tokenizer: the default model's (transformers
        # does not load the demo model's minimal tokenizer_config). Token counts below are the
        # server's own (--use-server-token-count), so the two vocabularies need not agree.
        tokenizer = os.path.join(os.environ["DROPKV_MODELS"], "smollm2-135m-instruct")
        artifacts = os.path.join(args.scratch, "artifacts")
        cmd = [args.aiperf, "profile", "--model", "demo", "--tokenizer", tokenizer,
               "--url", f"http://127.0.0.1:{http_port}", "--endpoint-type", "completions",
               "--streaming", "--concurrency", "4", "--request-count", str(NUM_REQUESTS),
               "--prompt-input-tokens-mean", "48", "--prompt-input-tokens-stddev", "0",
               "--prompt-output-tokens-mean", str(OUTPUT_TOKENS),
               "--prompt-output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true",
               "--use-server-token-count", "--random-seed", "7", "--request-timeout-seconds", "60",
               "--output-artifact-dir", artifacts, "--ui-type", "none"]
        started = time.time()
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
        with open(os.path.join(args.scratch, "aiperf.log"), "w") as f:
            f.write(run.stdout + run.stderr)
        check(run.returncode == 0, f"aiperf exit code {run.returncode} in {time.time() - started:.0f} s "
              f"(log: {args.scratch}/aiperf.log)")
        with open(os.path.join(artifacts, "profile_export_aiperf.json")) as f:
            report = json.load(f)
        check(report["error_summary"] == [] and not report["was_cancelled"],
              f"no errors: {report['error_summary']}")
        check(report["request_count"]["avg"] == NUM_REQUESTS,
              f"{report['request_count']['avg']:.0f} of {NUM_REQUESTS} requests completed")
        osl = report["output_sequence_length"]
        check(osl["min"] == osl["max"] == OUTPUT_TOKENS,
              f"every request streamed {OUTPUT_TOKENS} tokens (server counts: {osl['min']}..{osl['max']})")
        ttft = report["time_to_first_token"]
        check(ttft["count"] == NUM_REQUESTS and ttft["avg"] > 0,
              f"TTFT measured for every request (avg {ttft['avg']:.1f} ms)")
        check(report["output_token_throughput"]["avg"] > 0,
              f"output throughput {report['output_token_throughput']['avg']:.1f} tokens/s")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = None
    check(code == 0, f"server exit code {code} after SIGTERM")
    print("PASS")


if __name__ == "__main__":
    main()
