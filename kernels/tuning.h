// The kernel tuning knobs that stay: ways out of a default and the switches benchmarks compare
// against, read once per process from the environment (the only environment the engine reads
// besides the server config). Torch-free: config/ and server/ include it to list and print them.
// Variants that lost their A/B are deleted, not switched off; their figures are in
// docs/benchmarks.md.
#pragma once

#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace dropkv::kernels {

enum class PrefillAttentionChoice {
  kAuto,   // the measured rule (engine/model/attention.h: cuDNN from 8K tokens, else FA2)
  kSdpa,   // at::scaled_dot_product_attention everywhere (the baseline of the prefill tables)
  kFlash,  // ATen's FA2 op for every chunk
  kCudnn,  // cuDNN for first chunks, FA2 for later ones
};

struct KernelTuning {
  // DROPKV_PDL=0: no programmatic dependent launch on sm_90+ (a way out if a driver misbehaves;
  // costs ~0.1 ms per decode step at batch 1).
  bool pdl = true;
  // DROPKV_PREFILL_ATTENTION=auto|sdpa|flash|cudnn.
  PrefillAttentionChoice prefill_attention = PrefillAttentionChoice::kAuto;
  // DROPKV_CPU_PACKED_WEIGHTS=0: fp32 CPU weights stay plain instead of oneDNN-packed.
  bool cpu_packed_weights = true;
  // DROPKV_NUM_THREADS, else OMP_NUM_THREADS: intra-op threads of CPU runs (the machine's cores
  // are shared with the front ends, so not all of them by default).
  int cpu_threads = 2;

  // Parses the variables above from `env` (name -> value); unset ones keep the default, an
  // unparsable one too, with a line in `warnings` when given.
  static KernelTuning FromVariables(const std::map<std::string, std::string>& env,
                                    std::vector<std::string>* warnings = nullptr);
  static KernelTuning FromEnvironment();
};

// The variables KernelTuning reads (config/ lists them as known, so it warns only about others).
inline constexpr std::string_view kTuningVariables[] = {"DROPKV_PDL", "DROPKV_PREFILL_ATTENTION",
                                                        "DROPKV_CPU_PACKED_WEIGHTS",
                                                        "DROPKV_NUM_THREADS", "OMP_NUM_THREADS"};

// The process's tuning: KernelTuning::FromEnvironment() on first use, the same value afterwards.
const KernelTuning& Tuning();

std::string_view PrefillAttentionChoiceName(PrefillAttentionChoice choice);

// "kernel_tuning:" and one "  key: value  # VARIABLE" line per knob (--print-config, benchmarks).
std::string TuningToYaml(const KernelTuning& tuning);

}  // namespace dropkv::kernels
