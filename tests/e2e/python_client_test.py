#!/usr/bin/env python3
"""E2E with a client whose transport no one here wrote: grpcio + grpcio-health-checking +
grpcio-reflection against the real dropkv-server binary. Stubs are generated from
proto/dropkv/v1/*.proto at test time with grpcio-tools. Exits non-zero on the first failure."""
import argparse
import os
import signal
import subprocess
import sys
import time


def fail(msg):
    print("FAIL:", msg, flush=True)
    sys.exit(1)


def check(cond, msg):
    if not cond:
        fail(msg)
    print("ok:", msg, flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--proto-dir", required=True)
    ap.add_argument("--scratch", required=True)
    args = ap.parse_args()

    os.makedirs(args.scratch, exist_ok=True)
    from grpc_tools import protoc
    proto = os.path.join("dropkv", "v1", "inference.proto")
    rc = protoc.main(["protoc", f"-I{args.proto_dir}", f"--python_out={args.scratch}",
                      f"--grpc_python_out={args.scratch}", os.path.join(args.proto_dir, proto)])
    if rc != 0:
        fail("protoc failed")
    sys.path.insert(0, args.scratch)
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
    from dropkv.v1 import inference_pb2 as pb
    from dropkv.v1 import inference_pb2_grpc as pb_grpc

    proc = subprocess.Popen([args.server, "--model", args.model, "--port", "0", "--metrics-port", "0",
                             "--kv-memory", "32MiB"], stdout=subprocess.PIPE, text=True)
    try:
        port = None
        deadline = time.time() + 60
        while time.time() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith("LISTENING "):
                port = int(line.split()[1])
                break
        if port is None:
            fail("server did not report a port")
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")

        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "dropkv.v1.Inference"):
            resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            check(resp.status == health_pb2.HealthCheckResponse.SERVING, f"health '{service}' SERVING")

        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        answers = list(refl.ServerReflectionInfo(iter([
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol="dropkv.v1.Inference"),
        ]), timeout=5))
        names = {s.name for s in answers[0].list_services_response.service}
        check({"dropkv.v1.Inference", "grpc.health.v1.Health"} <= names, f"reflection lists {sorted(names)}")
        check(len(answers[1].file_descriptor_response.file_descriptor_proto) >= 1,
              "reflection returns the descriptor of dropkv.v1.Inference")

        stub = pb_grpc.InferenceStub(channel)
        req = pb.GenerateRequest(prompt="Once upon a time", max_new_tokens=48,
                                 sampling=pb.SamplingParams(ignore_eos=True))
        chunks = list(stub.Generate(req, timeout=60))
        stream_text = "".join(c.text for c in chunks)
        stream_ids = [i for c in chunks for i in c.token_ids]
        unary = stub.GenerateUnary(req, timeout=60)
        check(len(chunks) > 1, f"streamed {len(chunks)} messages")
        check(stream_ids == list(unary.token_ids) and len(stream_ids) == 48, "stream ids == unary ids")
        check(stream_text == unary.text, "stream text == unary text")
        check(chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH, "finish_reason LENGTH")
        check(chunks[-1].usage.completion_tokens == 48, "usage.completion_tokens")
        check("Lily" in stream_text, f"golden story text: {stream_text!r}")

        # Tokenize -> Detokenize round trip; the prompt's ids agree with usage.prompt_tokens.
        ids = stub.Tokenize(pb.TokenizeRequest(text="Once upon a time"), timeout=5).token_ids
        check(len(ids) == unary.usage.prompt_tokens, "tokenize length == usage.prompt_tokens")
        text = stub.Detokenize(pb.DetokenizeRequest(token_ids=ids, skip_special_tokens=True), timeout=5).text
        check(text.strip() == "Once upon a time", f"detokenize round trip: {text!r}")

        info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
        check(info.num_layers == 5 and info.vocab_size == 512, "model info: 5 layers, vocab 512")

        try:
            stub.GenerateUnary(pb.GenerateRequest(prompt="x", max_new_tokens=4,
                                                  sampling=pb.SamplingParams(temperature=-1.0)), timeout=5)
            fail("negative temperature accepted")
        except grpc.RpcError as e:
            check(e.code() == grpc.StatusCode.INVALID_ARGUMENT and
                  e.details().startswith("sampling.temperature"), f"INVALID_ARGUMENT: {e.details()}")
        try:
            stub.GenerateUnary(pb.GenerateRequest(prompt="x", token_ids=pb.TokenIds(ids=[1]),
                                                  max_new_tokens=4), timeout=5)
            fail("two inputs accepted")
        except grpc.RpcError as e:
            check(e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details().startswith("input"),
                  f"two inputs: {e.details()}")

        # Replay scoring: served, and a bad value names its field.
        replay = pb.CompressionSettings(method="dropkv", keep_ratio=0.25, scoring_queries="replay")
        long_prompt = "Once upon a time there was a little girl who liked to play. " * 12
        full = stub.GenerateUnary(pb.GenerateRequest(prompt=long_prompt, max_new_tokens=4),
                                  timeout=60)
        replayed = stub.GenerateUnary(pb.GenerateRequest(prompt=long_prompt, max_new_tokens=4,
                                                         compression=replay), timeout=60)
        check(replayed.usage.completion_tokens == 4 and
              0 < replayed.usage.kv_tokens_kept < full.usage.kv_tokens_kept,
              f"scoring_queries replay: kept {list(replayed.usage.kv_tokens_kept_per_layer)}")
        for bad, what in ((pb.CompressionSettings(method="dropkv", scoring_queries="question"),
                           "an unknown name"),
                          (pb.CompressionSettings(method="snapkv", scoring_queries="replay"),
                           "replay with snapkv")):
            try:
                stub.GenerateUnary(pb.GenerateRequest(prompt="x", max_new_tokens=2,
                                                      compression=bad), timeout=5)
                fail(f"scoring_queries {what} accepted")
            except grpc.RpcError as e:
                check(e.code() == grpc.StatusCode.INVALID_ARGUMENT and
                      e.details().startswith("compression.scoring_queries"),
                      f"scoring_queries {what}: {e.details()}")

        # The stats are the pool as of the end of the engine's last step, and a request's last
        # message leaves before the step that finished it ends (its blocks are released after
        # the push): on a loaded machine the first read can still see that step's blocks.
        deadline = time.time() + 5
        while True:
            stats = stub.GetServerStats(pb.GetServerStatsRequest(), timeout=5)
            if stats.kv_blocks_used == 0 or time.time() > deadline:
                break
            time.sleep(0.05)
        check(stats.kv_blocks_used == 0 and stats.kv_blocks_free == stats.kv_blocks_total > 0,
              "KV pool all free when idle")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            fail("server did not exit after SIGTERM")
    check(code == 0, f"server exit code {code} after SIGTERM")
    print("PASS")


if __name__ == "__main__":
    main()
