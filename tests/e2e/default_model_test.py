#!/usr/bin/env python3
"""README's serve command as a new user meets it: dropkv-server started with no --model serves the
default model (SmolLM2-135M-Instruct, converted by scripts/setup.sh into $DROPKV_MODELS) and
completes "The capital of France is" with Paris over gRPC (grpcio client), and answers the chat
question through the model's own template, stopping at the end of its turn. Exits non-zero on the
first failure."""
import argparse
import os
import signal
import subprocess
import sys
import time


def check(cond, msg):
    if not cond:
        print("FAIL:", msg, flush=True)
        sys.exit(1)
    print("ok:", msg, flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--proto-dir", required=True)
    ap.add_argument("--scratch", required=True)
    args = ap.parse_args()
    check(os.environ.get("DROPKV_MODELS"), "DROPKV_MODELS names the set-up's model folder")

    os.makedirs(args.scratch, exist_ok=True)
    from grpc_tools import protoc
    rc = protoc.main(["protoc", f"-I{args.proto_dir}", f"--python_out={args.scratch}",
                      f"--grpc_python_out={args.scratch}",
                      os.path.join(args.proto_dir, "dropkv", "v1", "inference.proto")])
    check(rc == 0, "protoc")
    sys.path.insert(0, args.scratch)
    import grpc
    from dropkv.v1 import inference_pb2 as pb
    from dropkv.v1 import inference_pb2_grpc as pb_grpc

    proc = subprocess.Popen([args.server, "--port", "0", "--metrics-port", "0", "--device", "cpu",
                             "--kv-memory", "256MiB"], stdout=subprocess.PIPE, text=True)
    try:
        port = None
        deadline = time.time() + 120
        while time.time() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith("LISTENING "):
                port = int(line.split()[1])
                break
        check(port is not None, "server started on the default model")
        stub = pb_grpc.InferenceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        check(info.model_name.endswith("smollm2-135m-instruct") and info.num_layers == 30,
              f"default model: {info.model_name}, {info.num_layers} layers")
        reply = stub.GenerateUnary(pb.GenerateRequest(prompt="The capital of France is",
                                                      max_new_tokens=8), timeout=120)
        check("Paris" in reply.text, f"raw completion: {reply.text!r}")
        chat = stub.GenerateUnary(pb.GenerateRequest(
            chat=pb.ChatMessages(messages=[pb.ChatMessage(
                role="user", content="What is the capital of France?")]),
            max_new_tokens=16), timeout=120)
        check("Paris" in chat.text and chat.finish_reason == pb.FINISH_REASON_STOP,
              f"chat through the model's ChatML template: {chat.text!r}, stops at <|im_end|>")
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
