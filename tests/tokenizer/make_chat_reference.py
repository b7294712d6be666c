"""Reference renders for the chat template tests (a ctest fixture run with $DROPKV_PYTHON).

Renders a pool of generated chat requests (system or not, multi-turn, tools and tool calls,
unicode, empty content, content parts, continue_final_message, template kwargs) with HF
transformers' apply_chat_template through:
  * the tokenizers in ../shared/tokenizers (gunzipped into OUT_DIR/tokenizers/<name>),
  * the real models' folders under $DROPKV_MODELS (SmolLM2-135M-Instruct, Gemma-3-270M) when
    scripts/setup.sh has made them; otherwise the case records why it is skipped,
  * the templates under tests/tokenizer/chat_templates/ (ours: model-family styles and templates
    exercising each construct), with bos/eos given as kwargs,
  * small error templates (syntax errors, raise_exception, type errors, sandbox refusals).
strftime_now sees a fixed clock (2024-07-26 15:04:05), as the C++ test sets it.

Writes OUT_DIR/chat_reference.json:
  {"clock": ..., "templates": [{"name", "kind": "dir" | "template", "dir" | "config", "skipped"?,
    "cases": [{"request": {...}, "text": str} | {"request": {...}, "error": str, "error_type": str}]}]}
Skips the work when a stamp (this script, the templates, the inputs) is up to date.
"""
import datetime
import glob
import gzip
import hashlib
import json
import os
import random
import shutil
import sys

SEED = 20261201
SHARED_FAMILIES = ["llama3", "qwen3", "gemma3"]
REAL_MODELS = ["smollm2-135m-instruct", "gemma-3-270m"]
CLOCK = (2024, 7, 26, 15, 4, 5)
# bos / eos our own templates see (as apply_chat_template kwargs, and in the C++ test's config).
AUTHORED_TOKENS = {"bos_token": "<s>", "eos_token": "</s>"}

ERROR_TEMPLATES = {
    "error_unclosed_for": "{% for m in messages %}{{ m.role }}",
    "error_unknown_tag": "line one\n{% frobnicate messages %}",
    "error_bad_expression": "{{ messages[ }}",
    "error_raise_exception": "{{ raise_exception('refused: ' ~ messages | length ~ ' messages') }}",
    "error_type": "{{ messages[0].role + 1 }}",
    "error_undefined_attribute": "{{ nothing.attr }}",
    "error_range_too_big": "{% for i in range(1000000) %}{% endfor %}",
    "error_recursive_macro": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "error_unsafe_method": "{{ messages.append(1) }}",
    "error_not_callable": "{{ messages[0].role() }}",
    "error_division_by_zero": "{{ 1 / (messages | length - messages | length) }}",
    "error_generator_length": "{{ messages | selectattr('role') | length }}",
}


def models_dir():
    if os.environ.get("DROPKV_MODELS"):
        return os.environ["DROPKV_MODELS"]
    cache = os.environ.get("DROPKV_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dropkv")
    return os.path.join(cache, "models")


def stamp_of(shared, templates_dir):
    h = hashlib.sha256(open(__file__, "rb").read())
    for f in SHARED_FAMILIES:
        h.update(open(os.path.join(shared, "tokenizers", f, "tokenizer_config.json.gz"), "rb").read())
    for path in sorted(glob.glob(os.path.join(templates_dir, "*.jinja"))):
        h.update(path.encode() + open(path, "rb").read())
    for m in REAL_MODELS:
        for n in ("tokenizer_config.json", "chat_template.jinja"):
            p = os.path.join(models_dir(), m, n)
            h.update((p + (open(p, "rb").read().hex() if os.path.exists(p) else "-")).encode())
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------
# Generated requests
TEXTS = [
    "Hello!", "What is the capital of France?", "  padded with spaces  ", "\n\nnewlines around\n\n",
    "", "Explain KV caches in one sentence.", "日本語で答えてください。", "Emoji 🎉 and ZWJ 👨‍👩‍👧",
    "Code:\n```python\nprint('hi')\n```", "tabs\tand\ttabs", "<|im_start|> looks special", "مرحبا",
    "quotes ' and \" and \\ backslash", "Thanks!", "a" * 300, "naïve café — “curly”",
]
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city (°C).",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name, e.g. Zürich"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"}},
            "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the web.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string"}, "limit": {"type": "integer", "minimum": 1, "maximum": 10.5},
            "safe": {"type": "boolean", "default": True}, "filters": {"type": ["array", "null"],
                                                                      "items": {"type": "string"}}},
            "required": ["query"]}}},
]


def tool_call(r, k):
    if r.random() < 0.5:
        return {"id": "call_%d" % k, "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": r.choice(["Paris", "東京", "Zürich"]),
                                                                    "unit": "celsius"}}}
    return {"id": "call_%d" % k, "type": "function",
            "function": {"name": "search", "arguments": {"query": r.choice(TEXTS[:6]), "limit": 3,
                                                         "safe": False, "filters": None}}}


def make_requests():
    r = random.Random(SEED)
    reqs = []
    # Plain conversations: system or not, 1-4 turns, ends with a user turn.
    for k in range(16):
        msgs = []
        if k % 3 == 0:
            msgs.append({"role": "system", "content": r.choice(["You are a helpful assistant.", "  Be brief.  ",
                                                                "Réponds en français.", ""])})
        for t in range(1 + k % 4):
            msgs.append({"role": "user", "content": r.choice(TEXTS)})
            if t < k % 4:
                content = r.choice(TEXTS)
                if k % 5 == 1:
                    content = "<think>\nreasoning %d\n</think>\n\n%s" % (k, content)
                msgs.append({"role": "assistant", "content": content})
        reqs.append({"messages": msgs, "add_generation_prompt": k % 4 != 3})
    # Tools: schemas, an assistant tool call, tool results, a final user or assistant turn.
    for k in range(8):
        msgs = []
        if k % 2 == 0:
            msgs.append({"role": "system", "content": "You can use tools."})
        msgs.append({"role": "user", "content": r.choice(TEXTS[:8])})
        calls = [tool_call(r, k)] + ([tool_call(r, k + 100)] if k % 3 == 1 else [])
        msgs.append({"role": "assistant", "content": "" if k % 4 else "Let me check.", "tool_calls": calls})
        for c in calls:
            msgs.append({"role": "tool", "tool_call_id": c["id"], "name": c["function"]["name"],
                         "content": json.dumps({"result": r.choice(["sunny", "42", "日本"])}, ensure_ascii=False)})
        if k % 2:
            msgs.append({"role": "assistant", "content": "It is sunny."})
            msgs.append({"role": "user", "content": "And tomorrow?"})
        reqs.append({"messages": msgs, "tools": TOOLS[: 1 + k % 2], "add_generation_prompt": True})
    # Tools declared but unused; tool results without a call; an assistant tool call with null content.
    reqs.append({"messages": [{"role": "user", "content": "Hi"}], "tools": TOOLS, "add_generation_prompt": True})
    reqs.append({"messages": [{"role": "user", "content": "Hi"}], "tools": [], "add_generation_prompt": True})
    reqs.append({"messages": [{"role": "user", "content": "weather?"},
                              {"role": "assistant", "content": None, "tool_calls": [tool_call(r, 7)]},
                              {"role": "tool", "content": "rain"}], "tools": TOOLS[:1], "add_generation_prompt": True})
    # Content as a list of parts (OpenAI's shape).
    reqs.append({"messages": [{"role": "user", "content": [{"type": "text", "text": "part one"},
                                                           {"type": "text", "text": " part two"}]}],
                 "add_generation_prompt": True})
    # continue_final_message: the last assistant turn stays open.
    for text in ["The answer is", "  spaced out  ", "日本"]:
        reqs.append({"messages": [{"role": "user", "content": "Finish my sentence."},
                                  {"role": "assistant", "content": text}],
                     "add_generation_prompt": False, "continue_final_message": True})
    reqs.append({"messages": [{"role": "user", "content": [{"type": "text", "text": "Continue the parts."}]},
                              {"role": "assistant", "content": [{"type": "text", "text": "First"}]}],
                 "add_generation_prompt": False, "continue_final_message": True})
    # Template kwargs and roles outside the usual four.
    reqs.append({"messages": [{"role": "user", "content": "Think less."}], "add_generation_prompt": True,
                 "kwargs": {"enable_thinking": False}})
    reqs.append({"messages": [{"role": "user", "content": "What day is it?"}], "add_generation_prompt": True,
                 "kwargs": {"date_string": "01 Feb 2025", "tools_in_user_message": False}})
    reqs.append({"messages": [{"role": "developer", "content": "dev note"}, {"role": "user", "content": "hi"}],
                 "add_generation_prompt": True})
    # Roles that do not alternate; an empty conversation (HF refuses it).
    reqs.append({"messages": [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}],
                 "add_generation_prompt": True})
    reqs.append({"messages": [], "add_generation_prompt": True})
    return reqs


# ----------------------------------------------------------------------------------------------
def render_case(render, req):
    try:
        text = render(req)
        return {"request": req, "text": text}
    except Exception as e:  # the template (or HF) refused the request
        return {"request": req, "error": str(e), "error_type": type(e).__name__}


def main():
    out_dir, shared, templates_dir = sys.argv[1], sys.argv[2], sys.argv[3]
    os.makedirs(out_dir, exist_ok=True)
    stamp_path = os.path.join(out_dir, "stamp")
    stamp = stamp_of(shared, templates_dir)
    if os.path.exists(stamp_path) and open(stamp_path).read() == stamp:
        print("chat reference data up to date")
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local folders only; never the network
    sys.setrecursionlimit(400)  # the recursive-macro case fails fast
    import transformers.utils.chat_template_utils as chat_utils
    from transformers import AutoTokenizer

    class FixedClock(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(*CLOCK)

    chat_utils.datetime = FixedClock  # strftime_now reads the module's datetime

    for f in SHARED_FAMILIES:
        dst = os.path.join(out_dir, "tokenizers", f)
        os.makedirs(dst, exist_ok=True)
        for n in ("tokenizer.json", "tokenizer_config.json"):
            with gzip.open(os.path.join(shared, "tokenizers", f, n + ".gz"), "rb") as src, \
                    open(os.path.join(dst, n), "wb") as o:
                shutil.copyfileobj(src, o)

    requests = make_requests()

    def hf_render(tok, req, chat_template=None, extra=None):
        kwargs = dict(extra or {})
        kwargs.update(req.get("kwargs", {}))
        return tok.apply_chat_template(
            req["messages"], tools=req.get("tools"), documents=req.get("documents"),
            chat_template=chat_template, add_generation_prompt=req.get("add_generation_prompt", False),
            continue_final_message=req.get("continue_final_message", False), tokenize=False, **kwargs)

    templates = []
    dirs = [(f, os.path.join(out_dir, "tokenizers", f)) for f in SHARED_FAMILIES]
    dirs += [(m, os.path.join(models_dir(), m)) for m in REAL_MODELS]
    for name, d in dirs:
        entry = {"name": name, "kind": "dir", "dir": os.path.abspath(d), "model": name in REAL_MODELS}
        if not os.path.exists(os.path.join(d, "tokenizer.json")):
            entry["skipped"] = "%s has no tokenizer.json (scripts/setup.sh converts the model there)" % d
            templates.append(entry)
            continue
        config = json.load(open(os.path.join(d, "tokenizer_config.json"))) \
            if os.path.exists(os.path.join(d, "tokenizer_config.json")) else {}
        if not os.path.exists(os.path.join(d, "chat_template.jinja")) and not config.get("chat_template"):
            entry["skipped"] = "%s has no chat template (neither chat_template.jinja nor one in " \
                               "tokenizer_config.json)" % d
            templates.append(entry)
            continue
        tok = AutoTokenizer.from_pretrained(d)
        entry["cases"] = [render_case(lambda req: hf_render(tok, req), req) for req in requests]
        templates.append(entry)

    # Our templates and the error templates, through a tokenizer whose own special tokens the
    # kwargs replace (apply_chat_template passes {**special_tokens_map, **kwargs}).
    host = AutoTokenizer.from_pretrained(os.path.join(out_dir, "tokenizers", "llama3"))
    authored = [(os.path.splitext(os.path.basename(p))[0], open(p, encoding="utf-8").read())
                for p in sorted(glob.glob(os.path.join(templates_dir, "*.jinja")))]
    for name, source in authored + sorted(ERROR_TEMPLATES.items()):
        pool = requests if not name.startswith("error_") else requests[:2]
        config = dict(AUTHORED_TOKENS, chat_template=source)
        cases = [render_case(lambda req: hf_render(host, req, source, AUTHORED_TOKENS), req) for req in pool]
        templates.append({"name": name, "kind": "template", "config": config, "cases": cases})

    out = {"clock": list(CLOCK), "templates": templates}
    json.dump(out, open(os.path.join(out_dir, "chat_reference.json"), "w"), ensure_ascii=False)
    open(stamp_path, "w").write(stamp)
    n = sum(len(t.get("cases", [])) for t in templates)
    print("wrote %d chat reference renders for %d templates to %s" % (n, len(templates), out_dir))


if __name__ == "__main__":
    main()
