"""Long-context task prompts after RULER's designs, written for this project.

Writes one JSON line per prompt: {task, length, idx, format, input_ids, answers, match,
max_new_tokens, num_tokens}. Both harnesses read the same ids: dropkv-quality-tasks (ours) and
kvpress_tasks.py (kvpress on HF transformers), so the two see identical prompts. Scoring (score.py)
looks for the answer strings in the greedy output, as RULER does: `all` = the fraction of the
answers found, `any` = 1 if one of them is found.

Tasks (each prompt = context, then a question, then an answer prefix):
  niah_number   one needle "the access code for KEY is 7 digits" in repeated filler sentences
  niah_word     one needle whose value is a word, in essay-like generated prose
  niah_uuid     one needle whose value is a UUID-like hex string, in essay-like prose
  mk_niah       four needles with different keys (three distractors), asked for one
  mv_niah       one key with four values in four needles, all four asked for
  mq_niah       four keys asked for at once
  vt            variable tracking: a chain of 5 assignments VAR X = VAR Y among distractor chains;
                which variables hold the value
  cwe           common words extraction: a numbered word list, the 10 most common words
  fwe           frequent words extraction: coded text of Zipf-distributed words, the 3 most frequent
  qa            question answering over generated documents (one gold document among distractors)

Formats: `raw` (a plain completion: context, question, answer prefix) or `chat` (the question in
one user turn through the model's chat template, then the answer prefix after the generation
prompt).

Usage: tasks.py --model DIR --lengths 1024,2048 --num 20 --format raw --out FILE.jsonl
       [--tasks niah_number,...] [--seed 0] [--check-chat build/bin/dropkv-tokenize]
(--check-chat: chat prompts are rendered by HF's apply_chat_template; this renders each one with
our tokenizer's template as well and stops at the first difference.)
"""
import argparse
import json
import random
import string
import subprocess
import sys

from transformers import AutoTokenizer

TASKS = ["niah_number", "niah_word", "niah_uuid", "mk_niah", "mv_niah", "mq_niah", "vt", "cwe",
         "fwe", "qa"]

# Word lists written for this file.
ADJECTIVES = """amber quiet rapid silver hollow gentle bitter crimson distant frozen golden humble
ivory jolly lucky mellow narrow olive patient rustic scarlet tender upper vivid wooden yellow
brave clever dusty eager faint grand hasty icy keen lively misty noble plain proud royal shiny
steady sunny tidy warm wild young ancient brisk calm cozy""".split()
NOUNS = """anchor badge cabin canyon castle cedar comet compass crystal desert dolphin engine falcon
feather forest garden glacier harbor helmet island jacket kettle ladder lantern lemon magnet
meadow mirror mountain needle orchard oyster palace parrot pepper pillow planet pocket quarry
rabbit ribbon river saddle shadow shelter spider statue tablet teapot thunder tiger tower tunnel
valley violin wagon walnut whistle window wizard""".split()
VERBS = """admires builds carries describes explores follows gathers guards measures notices
observes paints repairs studies visits watches collects discovers questions remembers""".split()
PLACES = """village harbor market library workshop station museum bakery school garden theater
factory lighthouse monastery courtyard""".split()
ADVERBS = """slowly carefully quietly often rarely eagerly patiently suddenly gladly openly""".split()

FILLER = [
    "The morning light settles over the fields and the wind moves through the tall reeds.",
    "A small boat drifts along the canal while the bells of the old tower ring twice.",
    "Nothing much happens here, and the afternoon passes like every other afternoon.",
    "Clouds gather above the hills, then thin out again before the evening comes.",
]


def essay_sentence(rng):
    """One sentence of generic prose from a small grammar."""
    a, n, v = rng.choice(ADJECTIVES), rng.choice(NOUNS), rng.choice(VERBS)
    n2, p, adv = rng.choice(NOUNS), rng.choice(PLACES), rng.choice(ADVERBS)
    forms = [
        f"The {a} {n} {v} the {n2} near the {p}.",
        f"In the {p}, a {a} {n} {adv} {v} every {n2} it finds.",
        f"People say that the {n} of the {p} {v} the {a} {n2} {adv}.",
        f"When the {n2} is {a}, the {n} {v} it {adv} and then returns to the {p}.",
        f"Nobody knows why the {a} {n} {adv} {v} the {n2}, but the {p} keeps records of it.",
    ]
    return rng.choice(forms)


def filler_sentence(rng):
    return rng.choice(FILLER)


def make_key(rng, used):
    while True:
        k = f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
        if k not in used:
            used.add(k)
            return k


def number(rng):
    return str(rng.randint(1000000, 9999999))


def uuid_like(rng):
    h = lambda k: "".join(rng.choice("0123456789abcdef") for _ in range(k))
    return f"{h(8)}-{h(4)}-{h(4)}-{h(4)}-{h(12)}"


class Builder:
    """Fills a context up to a token target: a list of sentences with needles at given depths."""

    def __init__(self, tok, fmt):
        self.tok = tok
        self.fmt = fmt
        self.last_messages = None  # the chat of the last render (format chat)

    def count(self, text):
        return len(self.tok.encode(text, add_special_tokens=False))

    def render(self, context, question, prefix):
        if self.fmt == "raw":
            text = f"{context}\n\n{question}\n{prefix}"
            return self.tok.encode(text, add_special_tokens=True)
        msgs = [{"role": "user", "content": f"{context}\n\n{question}"}]
        self.last_messages = msgs
        rendered = self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        return self.tok.encode(rendered + prefix, add_special_tokens=False)

    def fill(self, length, rng, sentence_fn, needles, question, prefix, intro=""):
        """Haystack sentences around `needles` (inserted at random depths) so that the whole
        prompt has about `length` tokens (never more)."""
        overhead = len(self.render(intro, question, prefix)) + sum(self.count(x) for x in needles)
        budget = length - overhead - 8
        sents, used = [], 0
        while True:
            s = sentence_fn(rng)
            c = self.count(" " + s)
            if used + c > budget:
                break
            sents.append(s)
            used += c
        depths = sorted(rng.randint(0, len(sents)) for _ in needles)
        for d, needle in sorted(zip(depths, needles), key=lambda x: -x[0]):
            sents.insert(d, needle)
        ids = self.render(intro + " ".join(sents), question, prefix)
        while len(ids) > length and len(sents) > len(needles):  # trim haystack from the end
            for i in range(len(sents) - 1, -1, -1):
                if sents[i] not in needles:
                    del sents[i]
                    break
            ids = self.render(intro + " ".join(sents), question, prefix)
        return ids


def niah(b, length, rng, task):
    used = set()
    key = make_key(rng, used)
    if task == "niah_number":
        value, sent = number(rng), filler_sentence
    elif task == "niah_word":
        value, sent = rng.choice(NOUNS + ADJECTIVES), essay_sentence
    else:
        value, sent = uuid_like(rng), essay_sentence
    needle = f"The access code for {key} is {value}."
    q = f"What is the access code for {key} mentioned in the text above?"
    prefix = f"The access code for {key} is"
    return b.fill(length, rng, sent, [needle], q, prefix), [value], "all"


def multi_key(b, length, rng):
    used = set()
    keys = [make_key(rng, used) for _ in range(4)]
    values = [number(rng) for _ in keys]
    needles = [f"The access code for {k} is {v}." for k, v in zip(keys, values)]
    q = f"What is the access code for {keys[0]} mentioned in the text above?"
    prefix = f"The access code for {keys[0]} is"
    return b.fill(length, rng, essay_sentence, needles, q, prefix), [values[0]], "all"


def multi_value(b, length, rng):
    key = make_key(rng, set())
    values = [number(rng) for _ in range(4)]
    needles = [f"One of the access codes for {key} is {v}." for v in values]
    q = f"What are all the access codes for {key} mentioned in the text above?"
    prefix = f"The access codes for {key} are"
    return b.fill(length, rng, essay_sentence, needles, q, prefix), values, "all"


def multi_query(b, length, rng):
    used = set()
    keys = [make_key(rng, used) for _ in range(4)]
    values = [number(rng) for _ in keys]
    needles = [f"The access code for {k} is {v}." for k, v in zip(keys, values)]
    q = ("What are the access codes for " + ", ".join(keys[:-1]) + f" and {keys[-1]} "
         "mentioned in the text above?")
    prefix = "The access codes for " + ", ".join(keys[:-1]) + f" and {keys[-1]} are"
    return b.fill(length, rng, filler_sentence, needles, q, prefix), values, "all"


def var_name(rng, used):
    while True:
        v = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if v not in used:
            used.add(v)
            return v


def variable_tracking(b, length, rng):
    used = set()
    chains = []
    for _ in range(2):  # the asked chain and one distractor chain
        names = [var_name(rng, used) for _ in range(5)]
        chains.append((names, number(rng)))
    needles = []
    # Needles are inserted at sorted random depths in list order, so each chain reads in order.
    order = []
    for names, val in chains:
        order.append([f"VAR {names[0]} = {val}."] +
                     [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, len(names))])
    for i in range(5):  # interleave the two chains
        needles += [order[0][i], order[1][i]]
    names, val = chains[0]
    q = (f"Find every variable that holds the value {val} in the text above, directly or "
         "through another variable.")
    prefix = f"The variables that hold the value {val} are:"
    ids = b.fill(length, rng, filler_sentence, needles, q, prefix)
    return ids, names, "all"


def common_words(b, length, rng):
    vocab = rng.sample(NOUNS + ADJECTIVES + PLACES + VERBS, len(NOUNS + ADJECTIVES + PLACES + VERBS))
    common, rare = vocab[:10], vocab[10:]
    q = "What are the 10 most common words in the numbered list above?"
    prefix = "The 10 most common words in the list are:"
    overhead = len(b.render("", q, prefix)) + 8
    # Each common word appears `fc` times; rare words (each at most fc - 2 times) fill the rest.
    fc = max(5, length // 400)
    words = common * fc
    rare_left = {w: fc - 2 for w in rare}
    entry_tokens = lambda i, w: b.count(f" {i}. {w}")
    used = sum(entry_tokens(i + 1, w) for i, w in enumerate(words))
    while rare_left:
        w = rng.choice(sorted(rare_left))
        c = entry_tokens(len(words) + 1, w)
        if used + c + overhead > length:
            break
        words.append(w)
        used += c
        rare_left[w] -= 1
        if rare_left[w] == 0:
            del rare_left[w]
    rng.shuffle(words)
    ids = b.render(" ".join(f"{i + 1}. {w}" for i, w in enumerate(words)), q, prefix)
    while len(ids) > length:  # drop rare entries until it fits
        for i in range(len(words) - 1, -1, -1):
            if words[i] not in common:
                del words[i]
                break
        ids = b.render(" ".join(f"{i + 1}. {w}" for i, w in enumerate(words)), q, prefix)
    return ids, common, "all"


def frequent_words(b, length, rng):
    # Coded words: random 3-5 letter strings drawn with Zipf-like weights 1/rank.
    used = set()
    vocab = []
    while len(vocab) < 200:
        w = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 5)))
        if w not in used:
            used.add(w)
            vocab.append(w)
    weights = [1.0 / (r + 1) for r in range(len(vocab))]
    q = ("Read the coded text above. What are the 3 most frequently appearing coded words in "
         "it?")
    prefix = "The 3 most frequent words in the coded text are:"
    overhead = len(b.render("", q, prefix)) + 8
    words = []
    chunk = rng.choices(vocab, weights, k=50)
    while b.count(" ".join(words + chunk)) + overhead <= length:
        words += chunk
        chunk = rng.choices(vocab, weights, k=50)
    counts = {w: words.count(w) for w in vocab[:6]}
    top = sorted(counts, key=lambda w: -counts[w])[:3]
    return b.render(" ".join(words), q, prefix), top, "all"


FIRST = "Agnes Boris Clara Dmitri Elena Felix Greta Hugo Irene Jonas Katya Lionel".split()
LAST = "Pell Varga Okafor Lindqvist Moreau Tanaka Brandt Ferreira Novak Quinn".split()
TOWNS = "Velmora Ostrand Kellburg Maravel Thistlewick Corran Duskmere Ashfold".split()


def document(rng, town):
    founder = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
    year = rng.randint(1100, 1900)
    product = rng.choice(NOUNS)
    river = rng.choice(TOWNS) + " river"
    sents = [f"{town} is a small town on the banks of the {river}.",
             f"It was founded in {year} by {founder}.",
             f"For centuries the town has been known for making {product}s.",
             essay_sentence(rng), essay_sentence(rng)]
    return " ".join(sents), {"founder": founder, "year": str(year), "product": product}


def qa(b, length, rng):
    towns = [f"{rng.choice(TOWNS)}{rng.choice(['', ' Minor', ' Upon Hill', 'by'])}"
             for _ in range(4)]
    gold_town = towns[0]
    gold_doc, facts = document(rng, gold_town)
    attr = rng.choice(["founder", "year"])
    if attr == "founder":
        q = f"Answer the question using the documents above. Who founded {gold_town}?"
        prefix = f"Answer: {gold_town} was founded by"
    else:
        q = f"Answer the question using the documents above. In which year was {gold_town} founded?"
        prefix = f"Answer: {gold_town} was founded in"
    q_len = len(b.render("", q, prefix)) + 8
    docs, used = [], b.count(gold_doc) + 6
    while True:
        t = rng.choice([x for x in TOWNS if x not in gold_town])
        d, _ = document(rng, t + rng.choice([" East", " West", " North", " South", ""]))
        c = b.count(d) + 6
        if used + c + q_len > length:
            break
        docs.append(d)
        used += c
    docs.insert(rng.randint(0, len(docs)), gold_doc)
    ctx = "\n".join(f"Document {i + 1}: {d}" for i, d in enumerate(docs))
    return b.render(ctx, q, prefix), [facts[attr]], "all"


# niah_uuid: SmolLM2 spells digits one token each, so " <uuid>." is 32-37 tokens; 32 cut it short.
MAX_NEW = {"niah_number": 12, "niah_word": 8, "niah_uuid": 48, "mk_niah": 12, "mv_niah": 48,
           "mq_niah": 48, "vt": 30, "cwe": 50, "fwe": 20, "qa": 12}


def generate(tok, fmt, task, length, rng, builder=None):
    b = builder or Builder(tok, fmt)
    if task.startswith("niah_"):
        return niah(b, length, rng, task)
    return {"mk_niah": multi_key, "mv_niah": multi_value, "mq_niah": multi_query,
            "vt": variable_tracking, "cwe": common_words, "fwe": frequent_words,
            "qa": qa}[task](b, length, rng)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--lengths", default="1024,2048")
    ap.add_argument("--num", type=int, default=20)
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--format", choices=["raw", "chat"], default="raw")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--check-chat", metavar="DROPKV_TOKENIZE",
                    help="with --format chat: render every prompt's chat with our tokenizer too "
                    "(dropkv-tokenize --chat --render) and stop unless it equals HF's render")
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(args.model)
    checked = 0
    with open(args.out, "w") as f:
        for length in [int(x) for x in args.lengths.split(",")]:
            tasks = args.tasks.split(",")
            for task in tasks:
                if task not in TASKS:
                    sys.exit(f"--tasks: unknown task '{task}' (known: {', '.join(TASKS)})")
            # Prompt-major: a run its time budget cuts short still has every task at one n.
            for i in range(args.num):
                for task in tasks:
                    # One generator per prompt: a prompt does not change when --num grows.
                    rng = random.Random(f"{args.seed}-{task}-{length}-{i}")
                    b = Builder(tok, args.format)
                    ids, answers, match = generate(tok, args.format, task, length, rng, b)
                    if args.check_chat and args.format == "chat":
                        ours = subprocess.run(
                            [args.check_chat, "--tokenizer", args.model, "--chat", "--render"],
                            input=json.dumps(b.last_messages) + "\n", capture_output=True,
                            text=True, check=True).stdout
                        hf = tok.apply_chat_template(b.last_messages, tokenize=False,
                                                     add_generation_prompt=True)
                        if json.loads(ours) != hf:
                            sys.exit(f"{task} {length} {i}: our chat render differs from HF's")
                        checked += 1
                    f.write(json.dumps({"task": task, "length": length, "idx": i,
                                        "format": args.format, "num_tokens": len(ids),
                                        "answers": answers, "match": match,
                                        "max_new_tokens": MAX_NEW[task],
                                        "input_ids": ids}) + "\n")
    if args.check_chat and args.format == "chat":
        print(f"our chat template render equals HF's on all {checked} prompts", file=sys.stderr)


if __name__ == "__main__":
    main()
