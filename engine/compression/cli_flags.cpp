#include "engine/compression/cli_flags.h"

#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "engine/compression/budget.h"
#include "engine/compression/compression.h"

namespace dropkv::compression {
namespace {

// Turns a StatusOr into the value or a CLI11 validation error naming the flag.
template <typename T>
T OrThrow(const absl::StatusOr<T>& v, const std::string& flag) {
  if (!v.ok()) throw CLI::ValidationError(flag, std::string(v.status().message()));
  return *v;
}

}  // namespace

void AddCompressionFlags(CLI::App& app, CompressionParams* p) {
  app.add_option_function<std::string>(
         "--method",
         [p](const std::string& s) { p->method = OrThrow(ParseScoreMethod(s, ""), "--method"); },
         "Scorer: " + JoinNames(kScoreMethodNames) + " (default none = full cache)")
      ->envname("DROPKV_METHOD");
  auto* keep = app.add_option("--keep", p->keep_ratio, "Fraction of the KV cache kept, (0, 1]")
                   ->capture_default_str()
                   ->envname("DROPKV_KEEP");
  auto* cr = app.add_option_function<double>(
                    "--compression-ratio",
                    [p](double v) {
                      p->keep_ratio =
                          OrThrow(KeepRatioFromCompressionRatio(v), "--compression-ratio");
                    },
                    "Fraction removed, kvpress convention: keep = 1 - ratio, [0, 1)")
                 ->envname("DROPKV_COMPRESSION_RATIO");
  auto* bt = app.add_option_function<int64_t>(
                    "--budget-tokens", [p](int64_t v) { p->budget_tokens = v; },
                    "Absolute budget: tokens kept per layer on average per sequence")
                 ->envname("DROPKV_BUDGET_TOKENS");
  keep->excludes(cr)->excludes(bt);
  cr->excludes(bt);
  app.add_option_function<std::string>(
         "--allocator",
         [p](const std::string& s) {
           p->allocator = OrThrow(ParseBudgetAllocator(s, ""), "--allocator");
         },
         "Layer budgets: " + JoinNames(kBudgetAllocatorNames) + " (default uniform)")
      ->envname("DROPKV_ALLOCATOR");
  app.add_option("--profile", p->profile_path, "Layer profile JSON for mga / mlma*")
      ->envname("DROPKV_PROFILE");
  app.add_option("--explicit-prune", p->explicit_layer_prune,
                 "Per-layer prune ratios rho_l for --allocator explicit (one per layer)")
      ->delimiter(',')
      ->envname("DROPKV_EXPLICIT_PRUNE");
  app.add_option("--window", p->window, "Observation window W, protected from eviction")
      ->capture_default_str()
      ->envname("DROPKV_WINDOW");
  app.add_option_function<std::string>(
         "--pooling",
         [p](const std::string& s) { p->pooling = OrThrow(ParsePoolingType(s, ""), "--pooling"); },
         "DropKV score smoothing: " + JoinNames(kPoolingTypeNames) + " (default max)")
      ->envname("DROPKV_POOLING");
  app.add_option("--pooling-kernel", p->pooling_kernel, "Pooling kernel (odd)")
      ->capture_default_str()
      ->envname("DROPKV_POOLING_KERNEL");
  app.add_option("--sinks", p->num_sinks, "Sink tokens (StreamingLLM; others with --protect-sinks)")
      ->capture_default_str()
      ->envname("DROPKV_SINKS");
  app.add_flag("--protect-sinks", p->protect_sinks, "Never evict the first --sinks tokens")
      ->envname("DROPKV_PROTECT_SINKS");
  app.add_option_function<std::string>(
         "--chunk-policy",
         [p](const std::string& s) {
           p->chunk_policy = OrThrow(ParseChunkPolicy(s, ""), "--chunk-policy");
         },
         "Chunked prefill: " + JoinNames(kChunkPolicyNames) + " (default last_chunk)")
      ->envname("DROPKV_CHUNK_POLICY");
  app.add_option("--chunk-size", p->chunk_size, "Prefill chunk tokens (0 = one pass; >= window)")
      ->capture_default_str()
      ->envname("DROPKV_CHUNK_SIZE");
  app.add_option("--budget-cap-tokens", p->budget_cap_tokens,
                 "chunk-policy budget: compress when stored + next chunk exceed this")
      ->capture_default_str()
      ->envname("DROPKV_BUDGET_CAP_TOKENS");
  app.add_option("--decode-margin", p->decode_margin,
                 "Compress during decode when a layer passes its budget by this (0 = off)")
      ->capture_default_str()
      ->envname("DROPKV_DECODE_MARGIN");
  app.add_option("--compression-seed", p->random_seed, "Seed of --method random")
      ->capture_default_str()
      ->envname("DROPKV_COMPRESSION_SEED");
}

}  // namespace dropkv::compression
