"""HF `tokenizers` side of dropkv-bench-tokenizer: single-thread encode of the same text file,
line by line and as one string; best of 3 wall and CPU seconds. With --chat FILE ({"messages",
"tools"}), also transformers' apply_chat_template(tokenize=False, add_generation_prompt=True) of
that chat per folder: mean seconds per call (best of 3 x 20 calls) and the rendered text.
Usage: bench_hf.py TEXT_FILE [--chat FILE] DIR..."""
import json
import os
import sys
import time

os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
from tokenizers import Tokenizer  # noqa: E402

text = open(sys.argv[1], encoding="utf-8").read()
lines = text.split("\n")
dirs = sys.argv[2:]
chat = None
if dirs[:1] == ["--chat"]:
    chat = json.load(open(dirs[1], encoding="utf-8"))
    dirs = dirs[2:]


def best_of_3(fn):
    wall, cpu, result = 1e9, 1e9, None
    for _ in range(3):
        w0, c0 = time.perf_counter(), time.process_time()
        result = fn()
        wall = min(wall, time.perf_counter() - w0)
        cpu = min(cpu, time.process_time() - c0)
    return wall, cpu, result


out = {}
for d in dirs:
    w0, c0 = time.perf_counter(), time.process_time()
    tok = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
    load = (time.perf_counter() - w0, time.process_time() - c0)
    lw, lc, n_lines = best_of_3(lambda: sum(len(tok.encode(l, add_special_tokens=False).ids) for l in lines))
    ww, wc, n_whole = best_of_3(lambda: len(tok.encode(text, add_special_tokens=False).ids))
    out[d] = {"load_wall_s": load[0], "load_cpu_s": load[1], "lines_wall_s": lw, "lines_cpu_s": lc,
              "lines_ids": n_lines, "whole_wall_s": ww, "whole_cpu_s": wc, "whole_ids": n_whole}
    if chat is not None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoTokenizer
        hf_tok = AutoTokenizer.from_pretrained(d)

        def render():
            return hf_tok.apply_chat_template(chat["messages"], tools=chat["tools"], tokenize=False,
                                              add_generation_prompt=True)
        try:
            cw, cc, rendered = best_of_3(lambda: [render() for _ in range(20)][-1])
            out[d].update({"chat_wall_s": cw / 20, "chat_cpu_s": cc / 20, "chat_text": rendered})
        except Exception as e:  # the template refused the chat
            out[d]["chat_error"] = str(e)
print(json.dumps(out))
