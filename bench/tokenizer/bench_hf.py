"""HF `tokenizers` side of dropkv-bench-tokenizer: single-thread encode of the same text file,
line by line and as one string; best of 3 wall and CPU seconds.
Usage: bench_hf.py TEXT_FILE DIR..."""
import json
import os
import sys
import time

os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
from tokenizers import Tokenizer  # noqa: E402

text = open(sys.argv[1], encoding="utf-8").read()
lines = text.split("\n")


def best_of_3(fn):
    wall, cpu, result = 1e9, 1e9, None
    for _ in range(3):
        w0, c0 = time.perf_counter(), time.process_time()
        result = fn()
        wall = min(wall, time.perf_counter() - w0)
        cpu = min(cpu, time.process_time() - c0)
    return wall, cpu, result


out = {}
for d in sys.argv[2:]:
    w0, c0 = time.perf_counter(), time.process_time()
    tok = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
    load = (time.perf_counter() - w0, time.process_time() - c0)
    lw, lc, n_lines = best_of_3(lambda: sum(len(tok.encode(l, add_special_tokens=False).ids) for l in lines))
    ww, wc, n_whole = best_of_3(lambda: len(tok.encode(text, add_special_tokens=False).ids))
    out[d] = {"load_wall_s": load[0], "load_cpu_s": load[1], "lines_wall_s": lw, "lines_cpu_s": lc,
              "lines_ids": n_lines, "whole_wall_s": ww, "whole_cpu_s": wc, "whole_ids": n_whole}
print(json.dumps(out))
