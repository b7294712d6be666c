#!/usr/bin/env python3
"""Soak test (ctest server_soak_test, label soak): the real dropkv-server on stories260K
under ~3 minutes of mixed load, CPU, loopback only.

Load: 16 client threads, each a closed loop of streaming Generate calls with random prompt lengths
(token ids), random output lengths, random compression settings (method / budget form / allocator /
window / pooling / chunking), 20% cancelled by the client at a random point, 10% with a tight
deadline. All requests are greedy (temperature 0) so outputs are reproducible.

Passes when:
  * no unexpected gRPC status (OK everywhere; CANCELLED only for our cancels; DEADLINE_EXCEEDED only
    for tight deadlines);
  * every completed response is well formed (finish_reason set, usage.completion_tokens = number of
    streamed ids, <= max_new_tokens);
  * a 10% sample of completed responses equals the same request run alone on the idle server
    afterwards (the single-request greedy output);
  * the KV pool returns to all-free and nothing is running or waiting (GetServerStats);
  * server RSS (VmRSS of /proc/PID/status) grows < 5% between the first and the last minute.
Bounded: fixed duration, at most --max-requests requests, every call has a deadline.
"""
import argparse
import os
import random
import re
import subprocess
import sys
import threading
import time

from soak_common import prepare_scratch, stop


def log(msg):
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--server", required=True, help="dropkv-server binary")
    ap.add_argument("--convert", required=True, help="dropkv-convert binary")
    ap.add_argument("--proto-dir", required=True, help="folder holding dropkv/v1/inference.proto")
    ap.add_argument("--shared", default=os.environ.get("DROPKV_SHARED", ""))
    ap.add_argument("--scratch", required=True)
    ap.add_argument("--duration", type=float, default=160.0, help="load phase, seconds")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--max-requests", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=20261130)
    return ap.parse_args()


def start_server(args, model_dir):
    log_path = os.path.join(args.scratch, "server.log")
    log_file = open(log_path, "w")
    proc = subprocess.Popen(
        [args.server, "--model", model_dir, "--host", "127.0.0.1", "--port", "0",
         "--metrics-port", "0", "--device", "cpu", "--max-batch", "16", "--kv-blocks", "320", "--block-size", "16",
         # A small step budget: prompts over 128 tokens are prefilled in chunks between decode
         # steps (compressed ones under last_chunk), under preemption and cancellation.
         "--prefill-tokens-per-step", "128", "--shutdown-grace-seconds", "2"],
        stdout=subprocess.PIPE, stderr=log_file, text=True)
    deadline = time.time() + 120
    port = None
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                break
            continue
        m = re.match(r"LISTENING (\d+)", line)
        if m:
            port = int(m.group(1))
            break
    if port is None:
        proc.kill()
        raise RuntimeError(f"server did not start; see {log_path}")
    # Keep draining stdout so the server never blocks on a full pipe.
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    return proc, port


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


METHODS = ["none", "dropkv", "snapkv", "h2o", "streaming_llm", "knorm", "random"]


def random_request(pb, rng, vocab, ctx_len, idx):
    prompt_len = rng.choice([rng.randint(1, 16), rng.randint(16, 128), rng.randint(128, 400)])
    max_new = rng.randint(1, min(64, ctx_len - prompt_len - 1))
    ids = [rng.randrange(3, vocab) for _ in range(prompt_len)]
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), max_new_tokens=max_new,
                             request_id=f"soak-{idx}")
    req.sampling.temperature = 0.0
    method = rng.choice(METHODS)
    if method != "none":
        c = req.compression
        c.method = method
        form = rng.randint(0, 2)
        if form == 0:
            c.keep_ratio = rng.choice([0.1, 0.25, 0.5, 0.75, 1.0])
        elif form == 1:
            c.compression_ratio = rng.choice([0.0, 0.3, 0.6, 0.9])
        else:
            c.budget_tokens = rng.randint(1, 64)
        c.allocator = rng.choice(["uniform", "pyramid"])
        window = rng.choice([1, 4, 8])
        c.window = window
        c.pooling = rng.choice(["max", "avg", "none"])
        c.pooling_kernel = rng.choice([1, 3, 5])
        policy = rng.choice(["last_chunk", "last_chunk", "every_chunk", "budget"])
        c.chunk_policy = policy
        if policy != "last_chunk" or rng.random() < 0.3:
            c.chunk_size = rng.choice([window, 32, 64])
        if policy == "budget":
            c.budget_cap_tokens = rng.randint(16, 128)
        if rng.random() < 0.3:
            c.protect_sinks = True
            c.num_sinks = rng.randint(0, 4)
        c.random_seed = rng.randrange(1 << 30)
        if rng.random() < 0.3:
            c.decode_margin = rng.choice([window, 16])  # compression during decode too
    return req


class Soak:
    def __init__(self, args, grpc, pb, stub):
        self.args, self.grpc, self.pb, self.stub = args, grpc, pb, stub
        self.lock = threading.Lock()
        self.next_idx = 0
        self.counts = {}
        self.errors = []
        self.completed = []  # (request, token ids)
        self.stop_at = 0.0

    def take_index(self):
        with self.lock:
            if self.next_idx >= self.args.max_requests:
                return None
            self.next_idx += 1
            return self.next_idx

    def count(self, key):
        with self.lock:
            self.counts[key] = self.counts.get(key, 0) + 1

    def error(self, msg):
        with self.lock:
            self.errors.append(msg)
        log("ERROR " + msg)

    def worker(self, wid, vocab, ctx_len):
        grpc = self.grpc
        rng = random.Random(self.args.seed * 100 + wid)
        while time.time() < self.stop_at:
            idx = self.take_index()
            if idx is None:
                return
            req = random_request(self.pb, rng, vocab, ctx_len, idx)
            kind = rng.random()
            cancel = kind < 0.2
            tight = 0.2 <= kind < 0.3
            timeout = rng.uniform(0.005, 0.1) if tight else 60.0
            cancel_after_msgs = rng.randint(0, max(0, req.max_new_tokens - 1)) if cancel else -1
            ids, finish, usage = [], 0, None
            call = self.stub.Generate(req, timeout=timeout)
            try:
                n = 0
                for msg in call:
                    if cancel and n >= cancel_after_msgs:
                        call.cancel()
                        break
                    ids.extend(msg.token_ids)
                    if msg.finish_reason:
                        finish, usage = msg.finish_reason, msg.usage
                    n += 1
                if cancel:
                    # Drain what is left; a cancelled call ends with CANCELLED.
                    try:
                        for _ in call:
                            pass
                    except grpc.RpcError:
                        pass
                code = call.code()
            except grpc.RpcError as e:
                code = e.code()
            name = code.name if code else "NONE"
            if cancel:
                self.count(f"cancelled:{name}")
                if code not in (grpc.StatusCode.CANCELLED, grpc.StatusCode.OK):
                    self.error(f"{req.request_id}: cancelled call ended {name}")
                continue
            if tight:
                self.count(f"tight_deadline:{name}")
                if code not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.OK):
                    self.error(f"{req.request_id}: tight-deadline call ended {name}: "
                               f"{call.details() if code else ''}")
                if code != grpc.StatusCode.OK:
                    continue
            else:
                self.count(f"normal:{name}")
                if code != grpc.StatusCode.OK:
                    self.error(f"{req.request_id}: ended {name}: {call.details()}")
                    continue
            if finish == self.pb.FINISH_REASON_CANCELLED and tight:
                continue  # the deadline hit while the last message was on its way
            if finish not in (self.pb.FINISH_REASON_STOP, self.pb.FINISH_REASON_LENGTH):
                self.error(f"{req.request_id}: OK but finish_reason {finish}")
                continue
            if usage is None or usage.completion_tokens != len(ids) or \
                    len(ids) > req.max_new_tokens or usage.prompt_tokens != len(req.token_ids.ids):
                self.error(f"{req.request_id}: usage {usage} does not match {len(ids)} streamed ids")
                continue
            with self.lock:
                self.completed.append((req, ids))


def main():
    args = parse_args()
    model_dir = prepare_scratch(args.scratch, args.shared, args.convert, args.proto_dir)
    import grpc
    from dropkv.v1 import inference_pb2 as pb
    from dropkv.v1 import inference_pb2_grpc as pbg

    proc, port = start_server(args, model_dir)
    log(f"server pid {proc.pid} on 127.0.0.1:{port}")
    ok = False
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        stub = pbg.InferenceStub(channel)
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        vocab, ctx_len = info.vocab_size, info.max_context_len
        log(f"model {info.model_name}: {info.num_layers} layers, vocab {vocab}, context {ctx_len}")

        soak = Soak(args, grpc, pb, stub)
        t0 = time.time()
        soak.stop_at = t0 + args.duration
        threads = [threading.Thread(target=soak.worker, args=(i, vocab, ctx_len), daemon=True)
                   for i in range(args.streams)]
        for t in threads:
            t.start()
        rss = []  # (seconds since start, KiB)
        while any(t.is_alive() for t in threads):
            rss.append((time.time() - t0, rss_kib(proc.pid)))
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode} during the soak")
            time.sleep(2.0)
        for t in threads:
            t.join(timeout=120)
        elapsed = time.time() - t0
        log(f"load phase {elapsed:.0f}s: {soak.next_idx} requests, {len(soak.completed)} "
            f"completed; statuses {dict(sorted(soak.counts.items()))}")
        failures = list(soak.errors)

        # KV pool back to all-free once the cancelled sequences have left.
        stats = None
        for _ in range(50):
            stats = stub.GetServerStats(pb.GetServerStatsRequest(), timeout=10)
            if stats.kv_blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0:
                break
            time.sleep(0.2)
        log(f"stats after load: blocks used {stats.kv_blocks_used}/{stats.kv_blocks_total}, "
            f"free {stats.kv_blocks_free}, running {stats.num_running}, waiting {stats.num_waiting}, "
            f"finished {stats.num_requests_finished}, preemptions {stats.num_preemptions}")
        if stats.kv_blocks_used != 0 or stats.kv_blocks_free != stats.kv_blocks_total:
            failures.append(f"KV pool not all-free: {stats.kv_blocks_used} blocks used, "
                            f"{stats.kv_blocks_free} of {stats.kv_blocks_total} free")
        if stats.num_running or stats.num_waiting:
            failures.append(f"{stats.num_running} running / {stats.num_waiting} waiting after load")

        # RSS: the first minute vs the last minute of the load phase (max within each window).
        first = [k for s, k in rss if s < 60.0]
        last = [k for s, k in rss if s >= elapsed - 60.0]
        if not first or not last or elapsed < 120:
            failures.append(f"load phase too short for the RSS check ({elapsed:.0f}s)")
        else:
            growth = max(last) / max(first) - 1.0
            log(f"RSS max first minute {max(first)} KiB, last minute {max(last)} KiB "
                f"({growth * 100:+.2f}%)")
            if growth >= 0.05:
                failures.append(f"server RSS grew {growth * 100:.1f}% (>= 5%) between the first and "
                                f"last minute")

        # 10% of completed responses against the same request alone on the idle server.
        rng = random.Random(args.seed)
        sample = rng.sample(soak.completed, max(1, len(soak.completed) // 10)) \
            if soak.completed else []
        if len(soak.completed) < 50:
            failures.append(f"only {len(soak.completed)} requests completed: the load is not a soak")
        # Compression during decode scores with the queries of the decode steps, which carry the
        # last bits of the batch they ran in: a near tie can then keep another entry, so those
        # responses are run alone too (errors, lengths) but their tokens are not held equal.
        mismatches = decode_compressed = decode_differed = 0
        for req, ids in sample:
            alone = stub.GenerateUnary(req, timeout=60)
            if req.compression.decode_margin > 0:
                decode_compressed += 1
                decode_differed += list(alone.token_ids) != ids
                if not alone.token_ids and ids:
                    failures.append(f"{req.request_id}: alone gave no tokens")
                continue
            if list(alone.token_ids) != ids:
                mismatches += 1
                failures.append(f"{req.request_id}: under load {ids[:12]}... != alone "
                                f"{list(alone.token_ids)[:12]}... (compression "
                                f"{req.compression.method or 'none'})")
        log(f"checked {len(sample)} sampled responses alone: {mismatches} mismatches; of them "
            f"{decode_compressed} compressed during decode, not held equal ({decode_differed} "
            f"differed)")
        if proc.poll() is not None:
            failures.append(f"server exited with {proc.returncode}")
        if failures:
            log(f"FAILED ({len(failures)}):")
            for f in failures[:40]:
                print("  " + f)
        else:
            ok = True
            log("PASSED")
    finally:
        if proc.poll() is None:
            stop(proc)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
