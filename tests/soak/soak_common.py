"""Set-up shared by the server tests in this folder (soak, loadgen, bad input)."""
import os
import shutil
import subprocess
import sys


def prepare_scratch(scratch, shared, convert, proto_dir):
    """Fresh `scratch` with stories260K converted to an HF folder and the gRPC Python stubs on
    sys.path. Returns the model folder."""
    shutil.rmtree(scratch, ignore_errors=True)
    os.makedirs(scratch)
    src = os.path.join(shared, "models", "stories260K")
    model_dir = os.path.join(scratch, "stories260K")
    subprocess.run([convert, "llama2c", "--model", os.path.join(src, "stories260K.bin"),
                    "--tokenizer", os.path.join(src, "tok512.bin"), "--out", model_dir],
                   check=True, stdout=subprocess.DEVNULL)
    stubs = os.path.join(scratch, "stubs")
    os.makedirs(stubs)
    from grpc_tools import protoc
    if protoc.main(["protoc", f"-I{proto_dir}", f"--python_out={stubs}",
                    f"--grpc_python_out={stubs}",
                    os.path.join(proto_dir, "dropkv", "v1", "inference.proto")]) != 0:
        raise RuntimeError("protoc failed")
    sys.path.insert(0, stubs)
    return model_dir


def stop(proc, timeout=30):
    """SIGTERM (the server drains), then SIGKILL if it does not exit in `timeout` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
