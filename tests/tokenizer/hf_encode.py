"""HF `tokenizers` on a tokenizer.json we generated (tok512 conversion): encode + decode a corpus.
Usage: hf_encode.py TOKENIZER_DIR CORPUS_JSON OUT_JSON"""
import json
import os
import sys

os.environ.setdefault("RAYON_NUM_THREADS", "2")
from tokenizers import Tokenizer  # noqa: E402

tok_dir, corpus_path, out_path = sys.argv[1:4]
tok = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
corpus = json.load(open(corpus_path))["strings"]
ids = [e.ids for e in tok.encode_batch(corpus, add_special_tokens=True)]
json.dump({"with_special": ids,
           "no_special": [e.ids for e in tok.encode_batch(corpus, add_special_tokens=False)],
           "decoded": tok.decode_batch(ids, skip_special_tokens=False),
           "decoded_skip": tok.decode_batch(ids, skip_special_tokens=True)},
          open(out_path, "w"), ensure_ascii=False)
