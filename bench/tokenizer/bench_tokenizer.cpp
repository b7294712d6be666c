// dropkv-bench-tokenizer: single-thread encode throughput (MB/s) on ~1 MB of mixed text for each
// tokenizer folder, side by side with HF `tokenizers` (Python, RAYON_NUM_THREADS=1) on the same
// text in the same run, plus tokenizer.json load times (the 33 MB Gemma one must be < 1 s).
// The text is encoded line by line (as a server sees requests); ids counts must agree.
// Then the chat template: render time of a --chat-turns conversation (with tools) next to the
// time to encode the rendered text, and HF apply_chat_template's time and text for the same chat.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "engine/tokenizer/chat_template.h"
#include "engine/tokenizer/tokenizer.h"

namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Process CPU seconds: the build machine is shared, so wall time alone says little.
double CpuSeconds() {
  return static_cast<double>(std::clock()) / CLOCKS_PER_SEC;
}

struct Timing {
  double wall_s = 1e9;
  double cpu_s = 1e9;
};

// Best of 3 (wall and CPU separately).
template <typename Fn>
Timing BestOf3(Fn fn) {
  Timing t;
  for (int rep = 0; rep < 3; ++rep) {
    const auto w0 = Clock::now();
    const double c0 = CpuSeconds();
    fn();
    t.wall_s = std::min(t.wall_s, Seconds(w0, Clock::now()));
    t.cpu_s = std::min(t.cpu_s, CpuSeconds() - c0);
  }
  return t;
}

// ~1 MB of mixed text: English prose, code, numbers, CJK, Arabic, emoji, whitespace runs.
std::string MixedText(size_t target_bytes) {
  const std::vector<std::string> pieces = {
      "Once upon a time, there was a little girl named Lily. She loved to play outside. ",
      "The quick brown fox jumps over the lazy dog; it's 5 o'clock and they're late! ",
      "def attention(q, k, v):\n    scores = q @ k.T / math.sqrt(d)\n    return softmax(scores) @ "
      "v\n",
      "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}\n",
      "Prices rose 3.5% to $1,234,567.89 in Q3 2024 (vs. 987654321 last year). ",
      "你好，世界！我喜欢学习自然语言处理。日本語のテキストもテストします。",
      "مرحبا بالعالم، كيف حالك اليوم؟ ",
      "Emoji 🎉👍🏽 and families 👨‍👩‍👧‍👦 in text. ",
      "    indented   with   runs    of   spaces\n\n\n",
      "naïve café résumé — “quotes” and ‘apostrophes’… ",
      "{\"key\": \"value\", \"list\": [1, 2, 3], \"nested\": {\"a\": null}}\n",
  };
  std::mt19937 rng(1234);
  std::string out;
  while (out.size() < target_bytes) {
    out += pieces[rng() % pieces.size()];
    if (rng() % 8 == 0) out += "\n";
  }
  return out;
}

// A `turns`-message chat (a system message, then user / assistant alternating; some answers
// carry <think> blocks) with two tool schemas: what a long agentic session sends.
dropkv::ChatRequest LongChat(int turns) {
  using ojson = nlohmann::ordered_json;
  const std::vector<std::string> questions = {
      "Can you explain how the KV cache grows with the sequence length, and what that means for "
      "memory on a 24 GB card?",
      "Rewrite this function so it avoids the quadratic loop:\n```python\nfor i in xs:\n    for j "
      "in xs:\n        total += i * j\n```",
      "Résume en français : la compression du cache garde les jetons les plus utiles. 日本語でも。",
      "What was the weather in Zürich last week? Use the tools if you need them.",
  };
  const std::vector<std::string> answers = {
      "The cache stores keys and values for every layer and head, so it grows linearly: at 8K "
      "tokens a 7B model needs about 4 GB in fp16.",
      "<think>\nThe inner loop computes a product with the sum.\n</think>\n\nUse "
      "`total = sum(xs) ** 2`; it is linear.",
      "La compression garde les jetons importants et jette les autres — "
      "重要なトークンだけを残します。",
      "<think>\nNo tool call needed for a summary.\n</think>\n\nIt was mostly sunny, 18 to 24 "
      "°C.",
  };
  dropkv::ChatRequest request;
  request.messages.push_back({{"role", "system"}, {"content", "You are a helpful assistant."}});
  for (int i = 1; i < turns; ++i) {
    const bool user = i % 2 == 1;
    const auto& pool = user ? questions : answers;
    request.messages.push_back(
        {{"role", user ? "user" : "assistant"}, {"content", pool[(i / 2) % pool.size()]}});
  }
  request.tools = ojson::parse(R"([
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
      "parameters": {"type": "object", "properties": {"city": {"type": "string"},
        "date": {"type": "string", "description": "ISO date"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "search", "description": "Search the web.",
      "parameters": {"type": "object", "properties": {"query": {"type": "string"},
        "limit": {"type": "integer", "default": 5}}, "required": ["query"]}}}])");
  request.add_generation_prompt = true;
  return request;
}

// Mean seconds per call over `reps` calls, best of 3.
template <typename Fn>
Timing PerCall(int reps, Fn fn) {
  Timing t = BestOf3([&] {
    for (int i = 0; i < reps; ++i) fn();
  });
  t.wall_s /= reps;
  t.cpu_s /= reps;
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"dropkv-bench-tokenizer: encode MB/s vs HF tokenizers, tokenizer.json load time"};
  std::vector<std::string> dirs;
  std::string python = "python3";
  std::string hf_script;
  std::string load_dir;
  size_t mbytes = 1;
  app.add_option("--tokenizer", dirs, "tokenizer folders to measure encode on")->required();
  app.add_option("--load", load_dir, "tokenizer folder whose load time to measure (Gemma)");
  app.add_option("--python", python, "Python with `tokenizers` (empty: skip HF)");
  app.add_option("--hf-script", hf_script, "path of bench/tokenizer/bench_hf.py");
  app.add_option("--mb", mbytes, "text size in MB");
  int chat_turns = 50;
  app.add_option("--chat-turns", chat_turns, "messages in the chat-template benchmark (0: skip)");
  CLI11_PARSE(app, argc, argv);
  const dropkv::ChatRequest chat = LongChat(chat_turns);
  const auto chat_path = std::filesystem::temp_directory_path() / "dropkv_bench_chat.json";
  std::ofstream(chat_path) << nlohmann::ordered_json{
      {"messages", chat.messages},
      {"tools", *chat.tools}}.dump();

  const std::string text = MixedText(mbytes << 20);
  const auto text_path = std::filesystem::temp_directory_path() / "dropkv_bench_tokenizer.txt";
  std::ofstream(text_path) << text;
  std::vector<std::string_view> lines;
  for (size_t pos = 0; pos <= text.size();) {
    size_t nl = text.find('\n', pos);
    if (nl == std::string::npos) nl = text.size();
    lines.emplace_back(text.data() + pos, nl - pos);
    pos = nl + 1;
  }
  const double mb = static_cast<double>(text.size()) / (1 << 20);

  nlohmann::json hf = nlohmann::json::object();
  if (!python.empty() && !hf_script.empty()) {
    std::string cmd = "RAYON_NUM_THREADS=1 " + python + " " + hf_script + " " + text_path.string();
    if (chat_turns > 0) cmd += " --chat " + chat_path.string();
    for (const auto& d : dirs) cmd += " " + d;
    FILE* p = popen(cmd.c_str(), "r");
    std::string out;
    char buf[4096];
    while (p != nullptr && fgets(buf, sizeof(buf), p) != nullptr) out += buf;
    if (p != nullptr) pclose(p);
    hf = nlohmann::json::parse(out, nullptr, false);
    if (hf.is_discarded()) hf = nlohmann::json::object();
  }

  std::printf("text: %.2f MB, %zu lines, 1 thread; MB/s = MB / best-of-3 seconds (wall | CPU)\n",
              mb, lines.size());
  std::printf("%-10s %-6s %19s %19s %10s %10s\n", "tokenizer", "mode", "ours MB/s wall|cpu",
              "HF MB/s wall|cpu", "ours ids", "HF ids");
  for (const auto& d : dirs) {
    auto tok = dropkv::Tokenizer::FromDirectory(d);
    if (!tok.ok()) {
      std::cerr << tok.status() << "\n";
      return 1;
    }
    const std::string name = std::filesystem::path(d).filename().string();
    size_t line_ids = 0, whole_ids = 0;
    const Timing by_line = BestOf3([&] {
      line_ids = 0;
      for (auto line : lines) line_ids += (*tok)->Encode(line, false)->size();
    });
    const Timing whole = BestOf3([&] { whole_ids = (*tok)->Encode(text, false)->size(); });
    const nlohmann::json h = hf.contains(d) ? hf[d] : nlohmann::json::object();
    auto hf_rate = [&](const char* key) {
      return h.contains(key) ? mb / h[key].get<double>() : 0.0;
    };
    auto hf_ids = [&](const char* key) { return h.contains(key) ? h[key].get<long long>() : -1LL; };
    std::printf("%-10s %-6s %9.2f|%-9.2f %9.2f|%-9.2f %10zu %10lld\n", name.c_str(), "lines",
                mb / by_line.wall_s, mb / by_line.cpu_s, hf_rate("lines_wall_s"),
                hf_rate("lines_cpu_s"), line_ids, hf_ids("lines_ids"));
    std::printf("%-10s %-6s %9.2f|%-9.2f %9.2f|%-9.2f %10zu %10lld\n", name.c_str(), "whole",
                mb / whole.wall_s, mb / whole.cpu_s, hf_rate("whole_wall_s"),
                hf_rate("whole_cpu_s"), whole_ids, hf_ids("whole_ids"));
  }
  if (chat_turns > 0) {
    std::printf(
        "\nchat template: %d messages + 2 tools, add_generation_prompt; microseconds per "
        "call (wall | CPU), best of 3\n",
        chat_turns);
    std::printf("%-10s %9s %19s %19s %9s %19s %8s\n", "tokenizer", "bytes", "render us",
                "encode us", "render/", "HF render us", "HF text");
    std::printf("%-10s %9s %19s %19s %9s %19s %8s\n", "", "", "", "", "encode", "", "equal");
    for (const auto& d : dirs) {
      auto tok = dropkv::Tokenizer::FromDirectory(d);
      if (!tok.ok()) continue;
      const std::string name = std::filesystem::path(d).filename().string();
      auto text = (*tok)->ApplyChatTemplate(chat);
      if (!text.ok()) {
        std::printf("%-10s %s\n", name.c_str(), std::string(text.status().message()).c_str());
        continue;
      }
      const Timing render = PerCall(200, [&] { (void)(*tok)->ApplyChatTemplate(chat); });
      const Timing encode = PerCall(200, [&] { (void)(*tok)->Encode(*text, false); });
      const nlohmann::json h = hf.contains(d) ? hf[d] : nlohmann::json::object();
      const bool hf_equal = h.contains("chat_text") && h["chat_text"].get<std::string>() == *text;
      std::printf("%-10s %9zu %9.1f|%-9.1f %9.1f|%-9.1f %9.3f %9.1f|%-9.1f %8s\n", name.c_str(),
                  text->size(), render.wall_s * 1e6, render.cpu_s * 1e6, encode.wall_s * 1e6,
                  encode.cpu_s * 1e6, render.cpu_s / encode.cpu_s,
                  h.value("chat_wall_s", 0.0) * 1e6, h.value("chat_cpu_s", 0.0) * 1e6,
                  h.contains("chat_text") ? (hf_equal ? "yes" : "NO") : "-");
    }
  }
  std::filesystem::remove(chat_path);
  if (!load_dir.empty()) {
    bool failed = false;
    const Timing load =
        BestOf3([&] { failed |= !dropkv::Tokenizer::FromDirectory(load_dir).ok(); });
    if (failed) {
      std::cerr << "cannot load " << load_dir << "\n";
      return 1;
    }
    std::printf("load %s: best of 3 %.3f s wall, %.3f s CPU\n", load_dir.c_str(), load.wall_s,
                load.cpu_s);
  }
  std::filesystem::remove(text_path);
  return 0;
}
