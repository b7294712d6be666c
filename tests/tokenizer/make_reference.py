"""Reference data for the tokenizer parity tests (run by a ctest fixture with $DROPKV_PYTHON).

Writes into OUT_DIR:
  tokenizers/{llama3,qwen3,gemma3}/   the shared tokenizers, gunzipped
  corpus.json                         >= 2,000 deterministic test strings (seeded)
  ref_<name>.json                     HF `tokenizers` ids (with / without special tokens) and
                                      decodes of those ids and of random id sequences
  runc_tok512.json                    ids by llama2.c run.c's encode rule on tok512.bin
  chat_<name>.json                    20 conversations + HF apply_chat_template output
Skips the work when a stamp (this script's hash + inputs) is up to date.
"""
import gzip
import hashlib
import json
import os
import random
import shutil
import struct
import sys

FAMILIES = ["llama3", "qwen3", "gemma3"]
SEED = 20261130


def stamp_of(shared):
    h = hashlib.sha256(open(__file__, "rb").read())
    for f in FAMILIES:
        for n in ("tokenizer.json.gz", "tokenizer_config.json.gz"):
            h.update(str(os.path.getsize(os.path.join(shared, "tokenizers", f, n))).encode())
    h.update(open(os.path.join(shared, "models/stories260K/tok512.bin"), "rb").read())
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------
# Corpus
PROSE = [
    "Once upon a time, there was a little girl named Lily.",
    "She loved to play outside in the park with her friends.",
    "The quick brown fox jumps over the lazy dog.",
    "I don't think we'll make it; they're late, aren't they?",
    "HE'LL SAY IT'S FINE, BUT WE'VE SEEN WHAT HE'D DO.",
    "Dr. Smith's lab (room 4B) opens at 9:30 a.m. on Mon.-Fri.",
    "\"Quoted text,\" she said, 'and single quotes too.'",
    "E-mail me at someone@example.com or visit https://example.org/path?q=1&x=y#frag.",
    "Prices rose 3.5% to $1,234.56 in Q3 2024 -- a record!",
    "Well... that was unexpected!!! Wasn't it???",
    "The mitochondria is the powerhouse of the cell.",
    "In 1492, Columbus sailed the ocean blue.",
    "Transformers use self-attention to mix information across positions.",
    "Key-value caches grow linearly with the sequence length.",
    "naïve café résumé coöperate façade jalapeño über Straße",
    "Ünïcödé wörds wïth dïäcrïtïcs everywhere.",
    "It's 5 o'clock somewhere; let's go!",
    "She said: “curly quotes” and ‘single curly’ — with em dashes – and en dashes…",
    "A\u00a0non-breaking\u00a0space and a thin\u2009space.",
    "Tab\tseparated\tvalues\tlive\there.",
]
CODE = [
    "def f(x):\n    return x * 2\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}\n",
    "#include <vector>\nint main() { std::vector<int> v{1, 2, 3}; return v.size(); }",
    '{"key": "value", "list": [1, 2, 3], "nested": {"a": null, "b": true}}',
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC;",
    "if [ -f ~/.bashrc ]; then source ~/.bashrc; fi",
    "x = [i**2 for i in range(10) if i % 2 == 0]  # squares",
    "<div class=\"main\"><p>Hello &amp; welcome</p></div>",
    "fn main() -> Result<(), Box<dyn Error>> { println!(\"{:?}\", vec![1u8; 4]); Ok(()) }",
    "    indented    with    four    spaces\n        and eight",
    "const add = (a, b) => a + b; // arrow\n/* block\n   comment */",
    "$ git commit -m 'fix: off-by-one in kv_cache.cpp:123'",
    "@@ -1,3 +1,4 @@\n-old line\n+new line\n context",
    "    \n\t\n  \t  \n",
    "a=1;b=2;c=a+b;print(c)",
]
CJK = [
    "你好，世界！今天天气很好。",
    "我喜欢学习自然语言处理。",
    "日本語のテキストもテストします。カタカナとひらがな。",
    "東京は日本の首都です。",
    "한국어 문장도 포함합니다. 안녕하세요!",
    "混合English和中文text在一起",
    "全角の数字１２３と記号！？",
    "中文标点：，。、；：？！“”‘’（）《》",
]
SCRIPTS = [
    "مرحبا بالعالم، كيف حالك اليوم؟",
    "السلام عليكم ورحمة الله",
    "שלום עולם, מה שלומך?",
    "नमस्ते दुनिया, आप कैसे हैं?",
    "สวัสดีชาวโลก ภาษาไทยไม่มีช่องว่าง",
    "Привет, мир! Как дела?",
    "Γειά σου Κόσμε! Ελληνικά γράμματα.",
    "Բարեւ աշխարհ",
    "ሰላም ለዓለም",
    "Xin chào thế giới, tiếng Việt có dấu.",
]
EMOJI = [
    "😀", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇺🇸🇯🇵🇩🇪", "❤️", "1️⃣", "👩🏻‍💻", "🧑‍🚀", "🐈‍⬛", "🫠", "😶‍🌫️",
    "I ❤️ NY 🗽!", "party 🎉🎉🎉 time", "🤖 + 🧠 = ✨",
]
COMBINING = [
    "e\u0301", "a\u0300\u0301\u0302", "n\u0303o", "Z\u0351\u0352\u0353a\u0354l\u0355g\u0356o\u0357",
    "\u0301starts with a mark", "cafe\u0301 vs café", "A\u030a vs Å vs \u212b", "\u1100\u1161\u11a8",
    "ﬁ ligature ﬀ", "Ⅻ ½ ² ℌ", "\u0958 \u095f", "o\u0308\u0304", "\u2126 ohm vs Ω",
]
ODD_VALID = [
    "\ufffd", "\ufeffBOM at start", "\ufffe\uffff", "\U0010ffff", "\ue000 private use \uf8ff",
    "\ud7ff\ue000", "\x00 nul byte", "\x01\x02\x1f control", "\x7f del", "\u0085 next line",
    "\u2028 line sep \u2029 para sep", "\u200b zero\u200bwidth \u200c\u200d", "\u00ad soft hyphen",
    "<0x41> literal byte token text", "Ġ Ċ ▁ byte-level lookalikes ▁▁x", "\u180e mongolian vs",
    "\u3000ideographic space\u3000", "\U0001d400\U0001d401 math bold", "\u0600\u0601 arabic number",
    "\x0b vertical tab \x0c form feed", "\r carriage return only \r", "'s 'S 'ſ 'K 'K",
]
SPECIAL = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
    "<|reserved_special_token_5|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>",
    "</tool_call>", "<think>", "</think>", "<|fim_prefix|>", "<bos>", "<eos>", "<pad>", "<unk>",
    "<start_of_turn>", "<end_of_turn>", "<mask>", "<unused0>", "<start_of_image>", "<s>", "</s>",
    "<|im_start", "im_end|>", "<|eot_id|", "<start_of_turn", "<<bos>>", "<|<|im_start|>|>",
]


def random_number(r):
    kind = r.randrange(6)
    n = r.randint(1, 40)
    digits = "".join(r.choice("0123456789") for _ in range(n))
    if kind == 0:
        return digits
    if kind == 1:
        return "-" + digits + "." + "".join(r.choice("0123456789") for _ in range(r.randint(1, 8)))
    if kind == 2:
        return "{:,}".format(int(digits))
    if kind == 3:
        return digits[:3] + "e-" + str(r.randint(1, 300))
    if kind == 4:
        return "0x" + "".join(r.choice("0123456789abcdef") for _ in range(r.randint(1, 16)))
    return " ".join("".join(r.choice("0123456789") for _ in range(r.randint(1, 5))) for _ in range(r.randint(2, 6)))


def make_corpus():
    r = random.Random(SEED)
    out = ["", " ", "a", "\n", "\t", "  ", "Hello", "hello world", " leading space", "trailing space "]
    pools = [PROSE, CODE, CJK, SCRIPTS, EMOJI, COMBINING, ODD_VALID, SPECIAL]
    for pool in pools:
        out.extend(pool)
    for _ in range(250):  # English prose paragraphs
        out.append(" ".join(r.choice(PROSE) for _ in range(r.randint(1, 4))))
    for _ in range(150):  # code
        out.append("\n".join(r.choice(CODE) for _ in range(r.randint(1, 3))))
    for n in range(1, 41):  # numbers of every length
        out.append("".join(str((n * 7 + k) % 10) for k in range(n)))
        out.append("x" + "9" * n + "y")
    for _ in range(160):
        out.append(random_number(r) + r.choice(["", " apples", "% of ", "km", ",", "\n"]) + random_number(r))
    ws = [" ", "  ", "   ", "\t", "\t\t", "\n", "\n\n", "\r\n", " \n", "\n ", "\u00a0", "\u3000", "    "]
    for _ in range(220):  # whitespace runs, tabs, newlines
        words = [r.choice(["word", "x", "Hello", "42", "日本", "()", "end"]) for _ in range(r.randint(1, 6))]
        s = ""
        for w in words:
            s += "".join(r.choice(ws) for _ in range(r.randint(0, 4))) + w
        s += "".join(r.choice(ws) for _ in range(r.randint(0, 5)))
        out.append(s)
    for n in (1, 2, 3, 5, 8, 16, 31, 32, 33, 64, 100):
        out.append(" " * n)
        out.append("\n" * n)
        out.append("\t" * n)
        out.append("a" + " " * n + "b")
    for _ in range(150):  # CJK, mixed
        out.append("".join(r.choice(CJK + [" ", "abc", "123"]) for _ in range(r.randint(1, 4))))
    for _ in range(150):  # other scripts
        out.append(" ".join(r.choice(SCRIPTS) for _ in range(r.randint(1, 3))))
    for _ in range(150):  # emoji and ZWJ sequences
        out.append("".join(r.choice(EMOJI + [" ", "ok", "!"]) for _ in range(r.randint(1, 6))))
    for _ in range(150):  # combining marks
        base = r.choice("aeiouxyzAEIOU日ب")
        marks = "".join(chr(r.randint(0x300, 0x36F)) for _ in range(r.randint(1, 5)))
        out.append(r.choice(PROSE)[:20] + base + marks + " " + r.choice(COMBINING))
    for _ in range(120):  # invalid-looking but valid UTF-8
        out.append(r.choice(PROSE)[:15] + r.choice(ODD_VALID) + r.choice(ODD_VALID))
    for _ in range(250):  # special-token text inside prose
        p = r.choice(PROSE)
        k = r.randint(0, len(p))
        sep = r.choice(["", " ", "\n"])
        out.append(p[:k] + sep + r.choice(SPECIAL) + r.choice(["", " ", "\n"]) + r.choice(SPECIAL) + p[k:])
    for n in (50, 100, 255, 256, 257, 500, 1000, 3000):  # very long words
        out.append("a" * n)
        out.append("ab" * (n // 2))
        out.append("".join(r.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(n)))
    out.append("Pneumonoultramicroscopicsilicovolcanoconiosis" * 20)
    out.append("https://example.com/" + "a1b2c3/" * 100)
    out.append("QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVo" * 30)
    out.append("中" * 500)
    out.append("😀" * 200)
    out.append("!" * 300 + "?" * 300)
    all_pools = PROSE + CODE + CJK + SCRIPTS + EMOJI + COMBINING + ODD_VALID + SPECIAL
    for _ in range(330):  # random mixes
        out.append("".join(r.choice(all_pools) + r.choice(["", " ", "\n", "\t"]) for _ in range(r.randint(1, 5))))
    return out


# ----------------------------------------------------------------------------------------------
def runc_encode_factory(tok512_path, vocab_size=512):
    """llama2.c run.c encode(): BOS, dummy ' ' prefix, codepoint lookup with byte fallback, then
    greedy best-score pair merging (leftmost on ties)."""
    d = open(tok512_path, "rb").read()
    o = 4
    vocab, scores = [], []
    for _ in range(vocab_size):
        s, n = struct.unpack("<fi", d[o:o + 8])
        o += 8
        vocab.append(d[o:o + n])
        scores.append(s)
        o += n
    lut = {}
    for i, p in enumerate(vocab):
        lut.setdefault(p, i)

    def encode(text):
        b = text.encode("utf-8")
        toks = [1]
        if b:
            toks.append(lut[b" "])
        i = 0
        while i < len(b):
            j = i + 1
            while j < len(b) and (b[j] & 0xC0) == 0x80 and j - i < 4:
                j += 1
            cp = b[i:j]
            if cp in lut:
                toks.append(lut[cp])
            else:
                toks.extend(x + 3 for x in cp)
            i = j
        while True:
            best, bi, bid = -1e10, -1, -1
            for k in range(len(toks) - 1):
                m = vocab[toks[k]] + vocab[toks[k + 1]]
                idx = lut.get(m)
                if idx is not None and scores[idx] > best:
                    best, bi, bid = scores[idx], k, idx
            if bi < 0:
                break
            toks[bi:bi + 2] = [bid]
        return toks

    return encode


CHAT_TEXTS = [
    "Hello!", "What is the capital of France?", "  padded with spaces  ", "\n\nnewlines around\n\n",
    "Explain KV caches in one sentence.", "日本語で答えてください。", "Code:\n```python\nprint(1)\n```",
    "Emoji 🎉 and ZWJ 👨‍👩‍👧", "tabs\tand\ttabs", "<|im_start|> looks special", "Sure, here it is.",
    "2 + 2 = 4", "Thanks!", "مرحبا", "A longer message that goes on for a while, with commas, "
    "semicolons; and other punctuation... to make sure nothing odd happens.",
]


def make_conversations(family, r):
    convs = []
    for k in range(20):
        msgs = []
        if k % 3 == 0:
            msgs.append({"role": "system", "content": r.choice(["You are a helpful assistant.",
                                                                "  Be brief.  ", "Réponds en français."])})
        turns = 1 + (k % 4)
        for t in range(turns):
            msgs.append({"role": "user", "content": r.choice(CHAT_TEXTS)})
            if t + 1 < turns:
                content = r.choice(CHAT_TEXTS)
                if family == "qwen3" and k % 2 == 1:
                    content = "<think>\nreasoning " + str(k) + "\n</think>\n\n" + content
                msgs.append({"role": "assistant", "content": content})
        if family == "qwen3" and k in (5, 11):
            msgs.append({"role": "assistant", "content": "<think>\nlast thought\n</think>\nfinal"})
        if family == "qwen3" and k == 7:
            msgs.insert(len(msgs) - 1, {"role": "assistant", "content": "calling a tool"})
            msgs.insert(len(msgs) - 1, {"role": "tool", "content": "{\"temp\": 21}"})
            msgs.insert(len(msgs) - 1, {"role": "tool", "content": "second result"})
        if family == "gemma3" and k in (17, 19):
            msgs.append({"role": "user", "content": "two users in a row"})  # the template raises
        if family != "gemma3" and k == 19:
            msgs.insert(1, {"role": "system", "content": "a second system message"})
        convs.append(msgs)
    return convs


def main():
    out_dir, shared = sys.argv[1], sys.argv[2]
    os.makedirs(out_dir, exist_ok=True)
    stamp_path = os.path.join(out_dir, "stamp")
    stamp = stamp_of(shared)
    if os.path.exists(stamp_path) and open(stamp_path).read() == stamp:
        print("reference data up to date")
        return
    os.environ.setdefault("RAYON_NUM_THREADS", "2")
    from tokenizers import Tokenizer

    for f in FAMILIES:
        dst = os.path.join(out_dir, "tokenizers", f)
        os.makedirs(dst, exist_ok=True)
        for n in ("tokenizer.json", "tokenizer_config.json"):
            with gzip.open(os.path.join(shared, "tokenizers", f, n + ".gz"), "rb") as src, \
                    open(os.path.join(dst, n), "wb") as o:
                shutil.copyfileobj(src, o)

    corpus = make_corpus()
    assert len(corpus) >= 2000, len(corpus)
    json.dump({"strings": corpus}, open(os.path.join(out_dir, "corpus.json"), "w"), ensure_ascii=False)

    r = random.Random(SEED + 1)
    for f in FAMILIES:
        tok = Tokenizer.from_file(os.path.join(out_dir, "tokenizers", f, "tokenizer.json"))
        with_special = [e.ids for e in tok.encode_batch(corpus, add_special_tokens=True)]
        no_special = [e.ids for e in tok.encode_batch(corpus, add_special_tokens=False)]
        decoded = tok.decode_batch(with_special, skip_special_tokens=False)
        decoded_skip = tok.decode_batch(with_special, skip_special_tokens=True)
        n = tok.get_vocab_size(with_added_tokens=True)
        random_ids = [[r.randrange(n) for _ in range(r.randint(1, 12))] for _ in range(300)]
        random_ids += [[r.randrange(min(n, 300)) for _ in range(r.randint(1, 12))] for _ in range(100)]
        json.dump({"with_special": with_special, "no_special": no_special, "decoded": decoded,
                   "decoded_skip": decoded_skip, "random_ids": random_ids,
                   "roundtrip": tok.decode_batch(no_special, skip_special_tokens=False),
                   "random_decoded": tok.decode_batch(random_ids, skip_special_tokens=False),
                   "random_decoded_skip": tok.decode_batch(random_ids, skip_special_tokens=True),
                   "vocab_size": n},
                  open(os.path.join(out_dir, "ref_" + f + ".json"), "w"), ensure_ascii=False)

    # Unicode helpers: Python's lossy UTF-8 decoding (same maximal-subpart rule as Rust's
    # from_utf8_lossy) on random byte strings, and NFC of the corpus.
    import unicodedata
    rb = random.Random(SEED + 3)
    alphabet = [0x00, 0x41, 0x7F, 0x80, 0x9F, 0xA0, 0xBF, 0xC0, 0xC1, 0xC2, 0xDF, 0xE0, 0xE1, 0xEC, 0xED,
                0xEE, 0xEF, 0xF0, 0xF1, 0xF3, 0xF4, 0xF5, 0xFF, 0x8F, 0x90]
    blobs = [bytes(rb.choice(alphabet) if rb.random() < 0.7 else rb.randrange(256)
                   for _ in range(rb.randint(1, 10))) for _ in range(3000)]
    blobs += [c.encode("utf-8")[:k] for c in corpus[:400] for k in (1, 2, 3, 5)]
    json.dump({"bytes_hex": [b.hex() for b in blobs],
               "lossy": [b.decode("utf-8", errors="replace") for b in blobs],
               "nfc": [unicodedata.normalize("NFC", c) for c in corpus]},
              open(os.path.join(out_dir, "unicode.json"), "w"), ensure_ascii=False)

    runc = runc_encode_factory(os.path.join(shared, "models/stories260K/tok512.bin"))
    json.dump({"with_special": [runc(s) for s in corpus]},
              open(os.path.join(out_dir, "runc_tok512.json"), "w"))

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local folders only; never the network
    from transformers import AutoTokenizer
    for f in FAMILIES:
        hf = AutoTokenizer.from_pretrained(os.path.join(out_dir, "tokenizers", f))
        tok = Tokenizer.from_file(os.path.join(out_dir, "tokenizers", f, "tokenizer.json"))
        rows = []
        for conv in make_conversations(f, random.Random(SEED + 2)):
            try:
                text = hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
                rows.append({"messages": conv, "text": text,
                             "ids": tok.encode(text, add_special_tokens=False).ids})
            except Exception as e:  # the template raised (Gemma: roles must alternate)
                rows.append({"messages": conv, "error": str(e)})
        json.dump({"conversations": rows}, open(os.path.join(out_dir, "chat_" + f + ".json"), "w"),
                  ensure_ascii=False)
    open(stamp_path, "w").write(stamp)
    print("wrote reference data for %d strings to %s" % (len(corpus), out_dir))


if __name__ == "__main__":
    main()
