#include "kernels/tuning.h"

#include <cstdlib>
#include <string>

namespace dropkv::kernels {
namespace {

// "0" / "1" (also false / true); nullopt-like: returns `fallback` and warns otherwise.
bool ParseSwitch(const std::string& name, const std::string& value, bool fallback,
                 std::vector<std::string>* warnings) {
  if (value == "0" || value == "false") return false;
  if (value == "1" || value == "true") return true;
  if (warnings != nullptr)
    warnings->push_back("environment " + name + "='" + value + "' is not 0 or 1 and was ignored");
  return fallback;
}

}  // namespace

KernelTuning KernelTuning::FromVariables(const std::map<std::string, std::string>& env,
                                         std::vector<std::string>* warnings) {
  KernelTuning t;
  auto get = [&](const char* name) -> const std::string* {
    auto it = env.find(name);
    return it == env.end() || it->second.empty() ? nullptr : &it->second;
  };
  if (const std::string* v = get("DROPKV_PDL"))
    t.pdl = ParseSwitch("DROPKV_PDL", *v, t.pdl, warnings);
  if (const std::string* v = get("DROPKV_PREFILL_ATTENTION")) {
    bool known = false;
    for (auto c : {PrefillAttentionChoice::kAuto, PrefillAttentionChoice::kSdpa,
                   PrefillAttentionChoice::kFlash, PrefillAttentionChoice::kCudnn}) {
      if (*v == PrefillAttentionChoiceName(c)) {
        t.prefill_attention = c;
        known = true;
      }
    }
    if (!known && warnings != nullptr) {
      warnings->push_back("environment DROPKV_PREFILL_ATTENTION='" + *v +
                          "' is not one of auto, sdpa, flash, cudnn and was ignored");
    }
  }
  if (const std::string* v = get("DROPKV_CPU_PACKED_WEIGHTS")) {
    t.cpu_packed_weights =
        ParseSwitch("DROPKV_CPU_PACKED_WEIGHTS", *v, t.cpu_packed_weights, warnings);
  }
  for (const char* name : {"DROPKV_NUM_THREADS", "OMP_NUM_THREADS"}) {
    const std::string* v = get(name);
    if (v == nullptr) continue;
    if (std::atoi(v->c_str()) > 0) {
      t.cpu_threads = std::atoi(v->c_str());
      break;
    }
    if (warnings != nullptr) {
      warnings->push_back("environment " + std::string(name) + "='" + *v +
                          "' is not a positive thread count and was ignored");
    }
  }
  return t;
}

KernelTuning KernelTuning::FromEnvironment() {
  std::map<std::string, std::string> env;
  for (std::string_view name : kTuningVariables) {
    const std::string n(name);
    if (const char* v = std::getenv(n.c_str()); v != nullptr) env.emplace(n, v);
  }
  return FromVariables(env);
}

const KernelTuning& Tuning() {
  static const KernelTuning tuning = KernelTuning::FromEnvironment();
  return tuning;
}

std::string_view PrefillAttentionChoiceName(PrefillAttentionChoice choice) {
  switch (choice) {
    case PrefillAttentionChoice::kSdpa:
      return "sdpa";
    case PrefillAttentionChoice::kFlash:
      return "flash";
    case PrefillAttentionChoice::kCudnn:
      return "cudnn";
    case PrefillAttentionChoice::kAuto:
      break;
  }
  return "auto";
}

std::string TuningToYaml(const KernelTuning& t) {
  auto flag = [](bool b) { return b ? "true" : "false"; };
  std::string out = "# Kernel tuning: environment variables only, read once at start-up.\n";
  out += "# kernel_tuning:\n";
  out += std::string("#   pdl: ") + flag(t.pdl) + "  # DROPKV_PDL\n";
  out += "#   prefill_attention: " + std::string(PrefillAttentionChoiceName(t.prefill_attention)) +
         "  # DROPKV_PREFILL_ATTENTION\n";
  out += std::string("#   cpu_packed_weights: ") + flag(t.cpu_packed_weights) +
         "  # DROPKV_CPU_PACKED_WEIGHTS\n";
  out += "#   cpu_threads: " + std::to_string(t.cpu_threads) +
         "  # DROPKV_NUM_THREADS, else OMP_NUM_THREADS\n";
  return out;
}

}  // namespace dropkv::kernels
