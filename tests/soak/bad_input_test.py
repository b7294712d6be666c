#!/usr/bin/env python3
"""Bad input against the real dropkv-server process (ctest server_bad_input_test, label e2e):
what a client or an operator can get wrong, the status or exit code each gets, and that the
server is still serving afterwards. docs/reliability.md's table cites the case names printed here.

Client side (server with a bearer token, TLS and max_message_bytes 1 MiB):
  no_token, wrong_token, plaintext_to_tls, untrusted_ca, oversized_message, invalid_utf8_prompt,
  garbage_bytes, token_id_out_of_vocab, max_new_tokens_zero, chat_without_template,
  tokenize_invalid_utf8, detokenize_unknown_id, pooling_kernel_huge,
  largest_compression_does_not_stall_others, largest_compression_runs,
  no_server_path_in_model_info, alive_after_all, second_server_same_port.
Stalled clients (plaintext server, write_stall_seconds 1): stalled_streams_memory_flat.
Mutual TLS: mtls_grpc_with_client_cert, mtls_grpc_without_client_cert,
  mtls_http_with_client_cert, mtls_http_without_client_cert.
Shutdown: sigterm_with_stalled_streams. JSON logs: json_log_lines_only.
Operator side (server start-up): unknown_config_key, missing_model_dir, truncated_safetensors,
  broken_config_json, tls_cert_missing, tls_key_without_cert, tls_key_mismatch,
  profile_not_a_profile, config_is_a_directory, config_json_max_position_embeddings,
  config_json_rms_norm_eps, empty_auth_token_file.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

from soak_common import prepare_scratch, stop


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--convert", required=True)
    ap.add_argument("--proto-dir", required=True)
    ap.add_argument("--shared", default=os.environ.get("DROPKV_SHARED", ""))
    ap.add_argument("--scratch", required=True)
    return ap.parse_args()


FAILURES = []


def check(case, ok, detail):
    print(f"{'PASS' if ok else 'FAIL'} {case}: {detail}", flush=True)
    if not ok:
        FAILURES.append(case)


def start(server, args, scratch, name, wait_listen=True, timeout=120):
    err_path = os.path.join(scratch, f"{name}.log")
    err = open(err_path, "w")
    proc = subprocess.Popen([server] + args, stdout=subprocess.PIPE, stderr=err, text=True)
    if not wait_listen:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        err.close()
        return proc, None, open(err_path).read()
    deadline = time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        m = re.match(r"LISTENING (\d+)", line or "")
        if m:
            return proc, int(m.group(1)), None
    proc.kill()
    raise RuntimeError(f"{name}: server did not start; see {err_path}")


def main():
    args = parse_args()
    scratch = args.scratch
    model = prepare_scratch(scratch, args.shared, args.convert, args.proto_dir)
    import grpc
    from dropkv.v1 import inference_pb2 as pb
    from dropkv.v1 import inference_pb2_grpc as pbg

    # A self-signed certificate for 127.0.0.1 and an unrelated CA.
    cert, key = os.path.join(scratch, "cert.pem"), os.path.join(scratch, "key.pem")
    other_cert, other_key = os.path.join(scratch, "other.pem"), os.path.join(scratch, "other.key")
    for c, k in ((cert, key), (other_cert, other_key)):
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                        "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                        "-keyout", k, "-out", c], check=True, capture_output=True)
    token_file = os.path.join(scratch, "token")
    open(token_file, "w").write("s3cret-token\n")
    base = ["--model", model, "--host", "127.0.0.1", "--metrics-port", "0", "--device", "cpu",
            "--kv-blocks", "256", "--shutdown-grace-seconds", "1"]
    proc, port, _ = start(args.server, base + [
        "--port", "0", "--tls-cert-file", cert, "--tls-key-file", key,
        "--auth-token-file", token_file, "--max-message-bytes", "1MiB"], scratch, "tls_server")
    try:
        target = f"127.0.0.1:{port}"
        creds = grpc.ssl_channel_credentials(root_certificates=open(cert, "rb").read())
        channel = grpc.secure_channel(target, creds)
        stub = pbg.InferenceStub(channel)
        auth = [("authorization", "Bearer s3cret-token")]

        def code_of(fn, *a, **kw):
            try:
                fn(*a, timeout=30, **kw)
                return grpc.StatusCode.OK, ""
            except grpc.RpcError as e:
                return e.code(), e.details() or ""

        good = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 50, 60]), max_new_tokens=3)
        c, d = code_of(stub.GenerateUnary, good, metadata=auth)
        check("valid_request", c == grpc.StatusCode.OK, f"{c.name} {d}")
        c, d = code_of(stub.GenerateUnary, good)
        check("no_token", c == grpc.StatusCode.UNAUTHENTICATED, f"{c.name} {d}")
        c, d = code_of(stub.GenerateUnary, good, metadata=[("authorization", "Bearer nope")])
        check("wrong_token", c == grpc.StatusCode.UNAUTHENTICATED, f"{c.name} {d}")

        plain = pbg.InferenceStub(grpc.insecure_channel(target))
        c, d = code_of(plain.GenerateUnary, good, metadata=auth)
        check("plaintext_to_tls", c == grpc.StatusCode.UNAVAILABLE, f"{c.name}")
        untrusted = pbg.InferenceStub(grpc.secure_channel(
            target, grpc.ssl_channel_credentials(root_certificates=open(other_cert, "rb").read())))
        c, d = code_of(untrusted.GenerateUnary, good, metadata=auth)
        check("untrusted_ca", c == grpc.StatusCode.UNAVAILABLE, f"{c.name}")

        big = pb.GenerateRequest(prompt="a" * (2 << 20), max_new_tokens=1)
        c, d = code_of(stub.GenerateUnary, big, metadata=auth)
        check("oversized_message", c == grpc.StatusCode.RESOURCE_EXHAUSTED, f"{c.name} {d[:80]}")

        # Raw bytes: field 1 (prompt) holding invalid UTF-8, field 4 max_new_tokens = 2.
        raw = grpc.secure_channel(target, creds).unary_unary(
            "/dropkv.v1.Inference/GenerateUnary", request_serializer=None,
            response_deserializer=pb.GenerateResponse.FromString)
        bad_utf8 = b"\x0a\x03\xff\xfe\x41" + b"\x20\x02"
        # gRPC C++ 1.51 answers a request it cannot parse with UNIMPLEMENTED and no message (the
        # service never sees it); INVALID_ARGUMENT would be better. Any of the three is accepted,
        # OK is not, and the server must live on (alive_after_all).
        unparsable = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL,
                      grpc.StatusCode.UNIMPLEMENTED)
        c, d = code_of(raw, bad_utf8, metadata=auth)
        check("invalid_utf8_prompt", c in unparsable,
              f"{c.name} {d[:100]}")
        c, d = code_of(raw, b"\xff\xff\xff\xff\xff\xff", metadata=auth)
        check("garbage_bytes", c in unparsable,
              f"{c.name} {d[:100]}")

        r = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 512]), max_new_tokens=2)
        c, d = code_of(stub.GenerateUnary, r, metadata=auth)
        check("token_id_out_of_vocab",
              c == grpc.StatusCode.INVALID_ARGUMENT and d.startswith("token_ids.ids[1]"),
              f"{c.name} {d}")
        r = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 5]), max_new_tokens=0)
        c, d = code_of(stub.GenerateUnary, r, metadata=auth)
        check("max_new_tokens_zero",
              c == grpc.StatusCode.INVALID_ARGUMENT and d.startswith("max_new_tokens"),
              f"{c.name} {d}")
        r = pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user",
                                                                             content="hi")]),
                               max_new_tokens=2)
        c, d = code_of(stub.GenerateUnary, r, metadata=auth)
        check("chat_without_template", c == grpc.StatusCode.FAILED_PRECONDITION and
              d.startswith("chat"), f"{c.name} {d}")
        raw_tok = grpc.secure_channel(target, creds).unary_unary(
            "/dropkv.v1.Inference/Tokenize", request_serializer=None,
            response_deserializer=pb.TokenizeResponse.FromString)
        c, d = code_of(raw_tok, b"\x0a\x02\xc3\x28", metadata=auth)
        check("tokenize_invalid_utf8",
              c in unparsable, f"{c.name} {d}")
        c, d = code_of(stub.Detokenize, pb.DetokenizeRequest(token_ids=[5, 99999]), metadata=auth)
        check("detokenize_unknown_id", c == grpc.StatusCode.INVALID_ARGUMENT, f"{c.name} {d}")

        # Bounded work per request: a huge pooling kernel is refused, the largest accepted one
        # does not stall another client.
        huge = pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(range(1, 11))), max_new_tokens=2,
                                  compression=pb.CompressionSettings(method="dropkv",
                                                                     pooling_kernel=2147483647))
        c, d = code_of(stub.GenerateUnary, huge, metadata=auth)
        check("pooling_kernel_huge", c == grpc.StatusCode.INVALID_ARGUMENT and
              d.startswith("compression.pooling_kernel"), f"{c.name} {d}")
        largest = pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(range(1, 200))),
                                     max_new_tokens=2,
                                     compression=pb.CompressionSettings(
                                         method="dropkv", pooling_kernel=127, window=1024))
        heavy = stub.GenerateUnary.future(largest, metadata=auth, timeout=60)
        t0 = time.time()
        c, d = code_of(stub.GenerateUnary, good, metadata=auth)
        waited = time.time() - t0
        check("largest_compression_does_not_stall_others", c == grpc.StatusCode.OK and waited < 5,
              f"{c.name} {d} after {waited:.2f} s")
        try:
            heavy.result()
            check("largest_compression_runs", True, "OK")
        except grpc.RpcError as e:
            check("largest_compression_runs", False, f"{e.code().name} {e.details()}")

        info = stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=auth, timeout=30)
        check("no_server_path_in_model_info", "/" not in info.model_name, info.model_name)

        c, d = code_of(stub.GenerateUnary, good, metadata=auth)
        check("alive_after_all", c == grpc.StatusCode.OK and proc.poll() is None, f"{c.name}")

        # Exclusive port: a second server on the same port fails (no SO_REUSEPORT sharing).
        p2, _, err = start(args.server, ["--model", model, "--host", "127.0.0.1",
                                         "--port", str(port), "--metrics-port", "0",
                                         "--device", "cpu", "--kv-blocks", "64"],
                           scratch, "same_port", wait_listen=False, timeout=60)
        check("second_server_same_port", p2.returncode not in (0, None, -9) and
              "cannot listen" in err, f"exit {p2.returncode}")
    finally:
        stop(proc)

    # Mutual TLS: with tls_client_ca_file, a client without a certificate that CA signed is refused
    # on the gRPC and the HTTP port; one with it is served.
    ca, ca_key = os.path.join(scratch, "ca.pem"), os.path.join(scratch, "ca.key")
    client, client_key = os.path.join(scratch, "client.pem"), os.path.join(scratch, "client.key")
    csr = os.path.join(scratch, "client.csr")
    for cmd in (["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                 "-subj", "/CN=dropkv-test-ca", "-keyout", ca_key, "-out", ca],
                ["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=client",
                 "-keyout", client_key, "-out", csr],
                ["openssl", "x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key,
                 "-CAcreateserial", "-days", "2", "-out", client]):
        subprocess.run(cmd, check=True, capture_output=True)
    import socket
    import ssl
    import http.client
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        http_port = s.getsockname()[1]
    proc, port, _ = start(args.server, base + [
        "--port", "0", "--tls-cert-file", cert, "--tls-key-file", key, "--tls-client-ca-file", ca,
        "--http-port", str(http_port)], scratch, "mtls_server")
    try:
        server_ca = open(cert, "rb").read()
        with_cert = pbg.InferenceStub(grpc.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials(
            root_certificates=server_ca, private_key=open(client_key, "rb").read(),
            certificate_chain=open(client, "rb").read())))
        without_cert = pbg.InferenceStub(grpc.secure_channel(
            f"127.0.0.1:{port}", grpc.ssl_channel_credentials(root_certificates=server_ca)))
        good = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 50, 60]), max_new_tokens=3)
        c, d = code_of(with_cert.GenerateUnary, good)
        check("mtls_grpc_with_client_cert", c == grpc.StatusCode.OK, f"{c.name} {d}")
        c, d = code_of(without_cert.GenerateUnary, good)
        check("mtls_grpc_without_client_cert", c == grpc.StatusCode.UNAVAILABLE, f"{c.name}")

        def http_health(client_cert):
            ctx = ssl.create_default_context(cafile=cert)
            if client_cert:
                ctx.load_cert_chain(client, client_key)
            try:
                conn = http.client.HTTPSConnection("127.0.0.1", http_port, context=ctx, timeout=10)
                conn.request("GET", "/health")
                return conn.getresponse().status
            except (ssl.SSLError, ConnectionError, OSError) as e:
                return type(e).__name__
        got = http_health(True)
        check("mtls_http_with_client_cert", got == 200, f"{got}")
        got = http_health(False)
        check("mtls_http_without_client_cert", got != 200, f"{got}")
    finally:
        stop(proc)

    def reads_nothing_stub(port):
        """A plaintext stub whose streams the test never reads: no BDP probing and 1 KiB of
        lookahead keep each stream's window at 64 KiB, so the server's writes stall."""
        return pbg.InferenceStub(grpc.insecure_channel(
            f"127.0.0.1:{port}",
            options=[("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]))

    # A client that reads nothing of 100 streams (no BDP probing, 1 KiB lookahead: its 64 KiB
    # stream windows fill): the server cuts each off after write_stall_seconds, so the streams of
    # a second round reuse what the first one held instead of adding to it.
    proc, port, _ = start(args.server, [
        "--model", model, "--host", "127.0.0.1", "--metrics-port", "0", "--device", "cpu",
        "--kv-blocks", "8192", "--max-batch", "128", "--port", "0",
        "--write-stall-seconds", "1"], scratch, "stall_server")
    try:
        def rss_kib():
            for line in open(f"/proc/{proc.pid}/status"):
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
            return 0

        stall_stub = reads_nothing_stub(port)
        heavy_stream = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[1, 50, 60]), max_new_tokens=500,
            sampling=pb.SamplingParams(return_logprobs=True, num_top_logprobs=20))
        open_calls = []

        def stalled_round():
            open_calls.extend(stall_stub.Generate(heavy_stream, timeout=120) for _ in range(100))
            time.sleep(8)
            return rss_kib()

        before = rss_kib()
        first = stalled_round()
        second = stalled_round()
        for call in open_calls:
            call.cancel()
        growth_mib = (second - first) / 1024
        check("stalled_streams_memory_flat", growth_mib < 5,
              f"RSS {before / 1024:.0f} -> {first / 1024:.0f} -> {second / 1024:.0f} MiB")
    finally:
        stop(proc)

    # SIGTERM with stalled streams (the stall watch off): the server exits within its grace period
    # plus the 3 s shutdown margin (it took grace + ~6 s before).
    proc, port, _ = start(args.server, [
        "--model", model, "--host", "127.0.0.1", "--metrics-port", "0", "--device", "cpu",
        "--kv-blocks", "8192", "--max-batch", "64", "--port", "0", "--write-stall-seconds", "3600",
        "--shutdown-grace-seconds", "2"], scratch, "shutdown_server")
    try:
        stall_stub = reads_nothing_stub(port)
        stalled = [stall_stub.Generate(heavy_stream, timeout=120) for _ in range(32)]
        time.sleep(4)
        t0 = time.time()
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        took = time.time() - t0
        check("sigterm_with_stalled_streams", proc.returncode == 0 and took < 2 + 3 + 1.5,
              f"exit {proc.returncode} after {took:.1f} s (grace 2 s + margin 3 s)")
        for call in stalled:
            call.cancel()
    finally:
        if proc.poll() is None:
            stop(proc)

    # --log-format json: every stderr line is one JSON object, gRPC's and protobuf's own messages
    # (invalid UTF-8 in a string field makes protobuf log an error) included.
    proc, port, _ = start(args.server, [
        "--model", model, "--host", "127.0.0.1", "--metrics-port", "0", "--device", "cpu",
        "--kv-blocks", "64", "--port", "0", "--log-format", "json"], scratch, "json_server")
    try:
        raw_json = grpc.insecure_channel(f"127.0.0.1:{port}").unary_unary(
            "/dropkv.v1.Inference/GenerateUnary", request_serializer=None,
            response_deserializer=pb.GenerateResponse.FromString)
        try:
            raw_json(b"\x0a\x03\xff\xfe\x41" + b"\x20\x02", timeout=30)
        except grpc.RpcError:
            pass
    finally:
        stop(proc)
    lines = [l for l in open(os.path.join(scratch, "json_server.log")).read().splitlines()
             if l.strip()]
    not_json = []
    for line in lines:
        try:
            json.loads(line)
        except ValueError:
            not_json.append(line)
    check("json_log_lines_only", lines and not not_json,
          f"{len(lines)} lines, not JSON: {not_json[:2]}")

    # Operator mistakes: the process exits non-zero with a message naming the culprit.
    def startup(case, extra, model_dir, expect):
        p, _, err = start(args.server, ["--model", model_dir, "--host", "127.0.0.1", "--port", "0",
                                        "--metrics-port", "0", "--device", "cpu",
                                        "--kv-blocks", "64"] + extra, scratch, case,
                          wait_listen=False, timeout=60)
        last = err.strip().splitlines()[-1] if err.strip() else ""
        check(case, p.returncode not in (0, None, -9) and expect in err,
              f"exit {p.returncode}: {last[:160]}")

    bad_cfg = os.path.join(scratch, "bad.yaml")
    open(bad_cfg, "w").write("port: 0\nmax_batch_size: 4\n")
    startup("unknown_config_key", ["--config", bad_cfg], model, "max_batch_size")
    startup("missing_model_dir", [], os.path.join(scratch, "nope"), "nope")
    trunc = os.path.join(scratch, "truncated")
    shutil.copytree(model, trunc)
    st = os.path.join(trunc, "model.safetensors")
    with open(st, "r+b") as f:
        f.truncate(os.path.getsize(st) // 2)
    startup("truncated_safetensors", [], trunc, "model.safetensors")
    broken = os.path.join(scratch, "broken_config")
    shutil.copytree(model, broken)
    open(os.path.join(broken, "config.json"), "w").write('{"architectures": ["LlamaForCausalLM"],')
    startup("broken_config_json", [], broken, "config.json")
    startup("tls_cert_missing", ["--tls-cert-file", os.path.join(scratch, "none.pem"),
                                 "--tls-key-file", key], model, "none.pem")
    startup("tls_key_without_cert", ["--tls-key-file", key], model, "tls")
    startup("tls_key_mismatch", ["--tls-cert-file", cert, "--tls-key-file", other_key], model,
            "does not match the certificate")
    startup("profile_not_a_profile", ["--compression-profile-path", "/etc/passwd"], model,
            "compression.profile_path")
    startup("config_is_a_directory", ["--config", scratch], model, "is not a file")
    for field, value in (("max_position_embeddings", 0), ("rms_norm_eps", -1)):
        bad_model = os.path.join(scratch, f"bad_{field}")
        shutil.copytree(model, bad_model)
        cfg_path = os.path.join(bad_model, "config.json")
        cfg = json.load(open(cfg_path))
        cfg[field] = value
        json.dump(cfg, open(cfg_path, "w"))
        startup(f"config_json_{field}", [], bad_model, field)
    empty_token = os.path.join(scratch, "empty_token")
    open(empty_token, "w").write("\n")
    startup("empty_auth_token_file", ["--auth-token-file", empty_token], model, "auth_token_file")

    print(f"{len(FAILURES)} failures: {FAILURES}" if FAILURES else "all bad-input cases PASSED")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
