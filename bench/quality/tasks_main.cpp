// dropkv-quality-tasks: accuracy of each press on the long-context tasks of tasks.py.
//   dropkv-quality-tasks --model DIR --prompts PROMPTS.jsonl [--methods full,dropkv,...]
//       [--keeps 0.05,0.1,0.25] [--allocators uniform] [--quantization none|fp8]
//       [--kv-cache-dtype auto|fp8] [--device cpu|cuda[:N]] [--dtype float32|bfloat16|...]
//       [--out RESULTS.jsonl]
// A method may carry settings of its own after colons, so that variants share the one prefill:
// `dropkv:max21` (max-pool 21), `dropkv:avg5`, `dropkv:none` (no pooling), `snapkv:w16`
// (window 16), `dropkv:sinks4` (never evict the first 4 tokens), `dropkv:lb32` (pooling lookback
// 32: the 32 entries after a high score share it), `dropkv:tol10` (the automatic
// budget at tolerance 0.10, the keep ratio its ceiling; `tol0.5` is 0.005); unset ones come from
// the flags.
// Each prompt is prefilled once with every press selecting from the same layer views
// (task_eval.h), then every configuration decodes greedily from its own compressed copy. A
// prompt's score is RULER's string match of its answers in the output (cut at EOS). Prints one
// Markdown table (accuracy mean ± standard error over prompts, n) per task and length; --out
// writes one JSON line per prompt and configuration (score.py reads it, beside kvpress_tasks.py's).
// --quantization / --kv-cache-dtype are the runner's (RunnerOptions, as dropkv-generate and
// dropkv-bench-e2e take them): FP8 weights and an FP8 KV pool apply to every
// configuration of the run, the full cache included; each result line records them.
// --device / --dtype too (default: the CPU in fp32; on a GPU, e.g. --device cuda --dtype bfloat16).
#include <ATen/ATen.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "CLI/CLI.hpp"
#include "bench/quality/task_eval.h"
#include "engine/compression/compression.h"
#include "engine/compression/params.h"
#include "engine/model/config.h"
#include "engine/runner/runner_options.h"
#include "engine/tokenizer/tokenizer.h"
#include "nlohmann/json.hpp"

namespace {

using dropkv::CompressionParams;
using dropkv::ScoreMethod;

struct Config {
  std::string method, allocator;
  std::string variant;  // the method's own settings as written after its name, "" if none
  double keep = 1;
  CompressionParams params;
};

// Applies `spec`'s settings after the method name ("dropkv:max21:w16") to `p`; returns the
// method's name.
absl::StatusOr<std::string> ApplyVariant(const std::string& spec, CompressionParams* p) {
  std::vector<std::string> parts;
  for (size_t b = 0, e; b <= spec.size(); b = e + 1) {
    e = spec.find(':', b);
    if (e == std::string::npos) e = spec.size();
    parts.push_back(spec.substr(b, e - b));
  }
  auto number = [&](const std::string& tag, size_t prefix) -> absl::StatusOr<int> {
    const std::string digits = tag.substr(prefix);
    if (digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos) {
      return absl::InvalidArgumentError("--methods: bad setting '" + tag + "' in '" + spec + "'");
    }
    return std::stoi(digits);
  };
  for (size_t i = 1; i < parts.size(); ++i) {
    const std::string& t = parts[i];
    absl::StatusOr<int> n =
        absl::InvalidArgumentError("--methods: unknown setting '" + t + "' in '" + spec +
                                   "' (maxK, avgK, none, wN, sinksN, tolN, lbN)");
    if (t == "none") {
      p->pooling = dropkv::PoolingType::kNone;
      continue;
    } else if (t.rfind("max", 0) == 0) {
      n = number(t, 3);
      if (n.ok()) p->pooling = dropkv::PoolingType::kMax, p->pooling_kernel = *n;
    } else if (t.rfind("avg", 0) == 0) {
      n = number(t, 3);
      if (n.ok()) p->pooling = dropkv::PoolingType::kAvg, p->pooling_kernel = *n;
    } else if (t.rfind("sinks", 0) == 0) {
      n = number(t, 5);
      if (n.ok()) p->protect_sinks = true, p->num_sinks = *n;
    } else if (t.rfind("tol", 0) == 0) {  // tolN: automatic budget, tolerance N / 100 (tol0.5)
      const std::string percent = t.substr(3);
      char* end = nullptr;
      const double value = std::strtod(percent.c_str(), &end);
      if (percent.empty() || *end != '\0' || !(value > 0.0 && value < 100.0)) {
        return absl::InvalidArgumentError("--methods: bad setting '" + t + "' in '" + spec + "'");
      }
      p->tolerance = value / 100.0;
      continue;
    } else if (t.rfind("lb", 0) == 0) {  // lbN: pooling lookback N
      n = number(t, 2);
      if (n.ok()) p->pooling_lookback = *n;
    } else if (t.rfind("w", 0) == 0) {
      n = number(t, 1);
      if (n.ok()) p->window = *n;
    }
    if (!n.ok()) return n.status();
  }
  return parts[0];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("Accuracy of each press on tasks.py's long-context prompts");
  std::string model_dir, prompts_path, out_path, profile, pooling = "max";
  std::vector<std::string> methods = {"full", "dropkv", "snapkv", "streaming_llm", "knorm", "h2o"};
  std::vector<double> keeps = {0.05, 0.1, 0.25};
  std::vector<std::string> allocators = {"uniform"};
  int window = 8, pooling_kernel = 11, limit = 0;
  bool h2o_per_query = false;
  dropkv::RunnerOptions ro;
  ro.dtype = "float32";
  app.add_option("--model", model_dir, "Hugging Face model folder")->required();
  app.add_option("--prompts", prompts_path, "tasks.py output (JSON lines)")->required();
  app.add_option("--methods", methods, "Scorers; `full` = the uncompressed cache")->delimiter(',');
  app.add_option("--keeps", keeps)->delimiter(',');
  app.add_option("--allocators", allocators)->delimiter(',');
  app.add_option("--profile", profile, "InfoNCE profile for mga / mlma*");
  app.add_option("--window", window, "Observation window W of every press")->capture_default_str();
  app.add_option("--pooling", pooling, "DropKV score pooling: max, avg, none")
      ->capture_default_str();
  app.add_option("--pooling-kernel", pooling_kernel, "DropKV pooling kernel (odd)")
      ->capture_default_str();
  app.add_flag("--h2o-per-query", h2o_per_query,
               "H2O divides each key's attention sum by the number of queries that see it");
  app.add_option("--device", ro.device, "cpu or cuda[:N]")->capture_default_str();
  app.add_option("--dtype", ro.dtype,
                 "auto (bf16 on CUDA, fp32 on the CPU), float32, bfloat16, float16")
      ->capture_default_str();
  app.add_option("--quantization", ro.quantization, "none, fp8 (projection weights in FP8 e4m3)")
      ->capture_default_str();
  app.add_option("--kv-cache-dtype", ro.kv_cache_dtype, "auto, fp8 (the KV pool in FP8 e4m3)")
      ->capture_default_str();
  app.add_option("--limit", limit, "Use only the first N prompts (0 = all)");
  app.add_option("--out", out_path, "Write one JSON line per prompt and configuration");
  CLI11_PARSE(app, argc, argv);

  auto prompts = dropkv::quality::LoadTaskPrompts(prompts_path);
  if (!prompts.ok()) return std::cerr << prompts.status() << "\n", 1;
  if (limit > 0 && static_cast<size_t>(limit) < prompts->size()) prompts->resize(limit);
  if (prompts->empty()) return std::cerr << "--prompts: no prompts\n", 1;
  auto tokenizer = dropkv::Tokenizer::FromDirectory(model_dir);
  if (!tokenizer.ok()) return std::cerr << tokenizer.status() << "\n", 1;
  auto pooling_type = dropkv::ParsePoolingType(pooling, "--pooling");
  if (!pooling_type.ok()) return std::cerr << pooling_type.status() << "\n", 1;

  ro.model_dir = model_dir;
  ro.num_kv_blocks = 16;  // resized below, once the configurations are known
  std::vector<Config> configs;
  int64_t max_len = 0;
  int32_t max_new = 0;
  for (const auto& p : *prompts) {
    max_len = std::max<int64_t>(max_len, static_cast<int64_t>(p.input_ids.size()));
    max_new = std::max(max_new, p.max_new_tokens);
  }
  // The runner is created twice: once to size the pool from its geometry, once with that pool.
  for (int pass = 0; pass < 2; ++pass) {
    auto runner_or = dropkv::ModelRunner::Create(ro);
    if (!runner_or.ok()) return std::cerr << runner_or.status() << "\n", 1;
    if (pass == 0) {
      const int32_t num_layers = (*runner_or)->config().num_global_layers();
      for (const auto& m : methods) {
        if (m == "full") {
          configs.push_back({m, "-", "", 1.0, CompressionParams{}});
          continue;
        }
        CompressionParams base;
        base.window = window;
        base.pooling = *pooling_type;
        base.pooling_kernel = pooling_kernel;
        auto name = ApplyVariant(m, &base);
        if (!name.ok()) return std::cerr << name.status() << "\n", 1;
        auto method = dropkv::ParseScoreMethod(*name, "--methods");
        if (!method.ok()) return std::cerr << method.status() << "\n", 1;
        const std::string variant = m.size() > name->size() ? m.substr(name->size() + 1) : "";
        for (double keep : keeps) {
          for (const auto& a : allocators) {
            auto alloc = dropkv::ParseBudgetAllocator(a, "--allocators");
            if (!alloc.ok()) return std::cerr << alloc.status() << "\n", 1;
            CompressionParams p = base;
            p.method = *method;
            p.allocator = *alloc;
            p.keep_ratio = keep;
            p.profile_path = profile;
            if (auto s = dropkv::compression::ValidateCompression(p, num_layers); !s.ok()) {
              std::cerr << m << " keep " << keep << " " << a << ": infeasible: " << s << "\n";
              continue;
            }
            configs.push_back({*name, a, variant, keep, p});
          }
        }
      }
      std::vector<CompressionParams> params;
      for (const auto& c : configs) params.push_back(c.params);
      ro.num_kv_blocks = dropkv::quality::BlocksNeeded(**runner_or, max_len, params, max_new) + 64;
      continue;
    }
    dropkv::ModelRunner& runner = **runner_or;
    std::vector<CompressionParams> params;
    for (const auto& c : configs) params.push_back(c.params);
    dropkv::quality::KvpressOptions options;
    options.h2o_divide_by_num_queries = h2o_per_query;
    const std::vector<int32_t> eos = runner.config().eos_token_ids;

    std::ofstream out;
    if (!out_path.empty()) {
      out.open(out_path);
      if (!out) return std::cerr << "--out: cannot write " << out_path << "\n", 1;
    }
    // scores[(task, length)][config] = per-prompt scores.
    std::map<std::pair<std::string, int64_t>, std::vector<std::vector<double>>> scores;
    const auto t0 = std::chrono::steady_clock::now();
    for (size_t i = 0; i < prompts->size(); ++i) {
      const auto& p = (*prompts)[i];
      std::vector<double> kept;
      auto gen = dropkv::quality::GreedyUnderEveryPress(runner, p.input_ids, params,
                                                        p.max_new_tokens, options, &kept);
      if (!gen.ok()) return std::cerr << gen.status() << "\n", 1;
      auto& cell = scores[{p.task, p.length}];
      cell.resize(configs.size());
      for (size_t c = 0; c < configs.size(); ++c) {
        const std::vector<int32_t> ids = dropkv::quality::CutAtEos((*gen)[c], eos);
        auto text = (*tokenizer)->Decode(ids, true);
        if (!text.ok()) return std::cerr << text.status() << "\n", 1;
        const double score = dropkv::quality::AnswerScore(*text, p.answers, p.match);
        cell[c].push_back(score);
        if (out.is_open()) {
          nlohmann::json j = {
              {"engine", "dropkv"},
              {"method", configs[c].method},
              {"keep", configs[c].keep},
              {"allocator", configs[c].allocator},
              {"variant", configs[c].variant},
              {"window", configs[c].params.window},
              {"pooling", std::string(dropkv::PoolingTypeName(configs[c].params.pooling))},
              {"pooling_kernel", configs[c].params.pooling_kernel},
              {"pooling_lookback", configs[c].params.pooling_lookback},
              {"protect_sinks", configs[c].params.protect_sinks},
              {"num_sinks", configs[c].params.num_sinks},
              {"tolerance", configs[c].params.tolerance},
              {"kept_fraction", kept[c]},
              {"h2o_per_query", h2o_per_query},
              {"device", ro.device},
              {"dtype", ro.dtype},
              {"quantization", ro.quantization},
              {"kv_cache_dtype", ro.kv_cache_dtype},
              {"task", p.task},
              {"length", p.length},
              {"idx", p.idx},
              {"format", p.format},
              {"num_tokens", p.input_ids.size()},
              {"answers", p.answers},
              {"match", p.match},
              {"score", score},
              {"text", *text}};
          out << j.dump() << "\n" << std::flush;
        }
      }
      const double secs =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::fprintf(stderr, "prompt %zu/%zu (%s %lld, %zu tokens): %.1f s\n", i + 1, prompts->size(),
                   p.task.c_str(), static_cast<long long>(p.length), p.input_ids.size(), secs);
    }
    for (const auto& [key, cell] : scores) {
      std::printf(
          "\n%s, %lld tokens, %s prompts, %s %s, quantization %s, kv_cache_dtype %s\n\n"
          "| method | keep | allocator | accuracy | n |\n",
          key.first.c_str(), static_cast<long long>(key.second), prompts->front().format.c_str(),
          ro.device.c_str(), ro.dtype.c_str(), ro.quantization.c_str(), ro.kv_cache_dtype.c_str());
      std::printf("|---|---|---|---|---|\n");
      for (size_t c = 0; c < configs.size(); ++c) {
        const auto s = dropkv::quality::Summarise(cell[c]);
        const std::string name =
            configs[c].method + (configs[c].variant.empty() ? "" : ":" + configs[c].variant);
        std::printf("| %s | %.2f | %s | %.3f ± %.3f | %zu |\n", name.c_str(), configs[c].keep,
                    configs[c].allocator.c_str(), s.mean, s.se, cell[c].size());
      }
    }
    std::printf("\nwall time: %.1f s\n",
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return 0;
}
