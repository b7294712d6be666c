"""HF `tokenizers` side of dropkv-bench-tokenizer: single-thread encode throughput on the same
text file. Usage (RAYON_NUM_THREADS=1 is set by the caller): bench_hf.py TEXT_FILE DIR..."""
import json
import os
import sys
import time

os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
from tokenizers import Tokenizer  # noqa: E402

text = open(sys.argv[1], encoding="utf-8").read()
lines = text.split("\n")
out = {}
for d in sys.argv[2:]:
    t0 = time.perf_counter()
    tok = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
    load_s = time.perf_counter() - t0
    best = 1e9
    n_ids = 0
    for _ in range(3):
        t0 = time.perf_counter()
        n_ids = sum(len(tok.encode(line, add_special_tokens=False).ids) for line in lines)
        best = min(best, time.perf_counter() - t0)
    out[d] = {"load_s": load_s, "encode_s": best, "num_ids": n_ids}
print(json.dumps(out))
