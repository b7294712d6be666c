// dropkv-bench-e2e: engine-level prefill and decode timings on real model geometry.
//
// The model is a Hugging Face config folder; with --random-weights no weights are read: they are
// drawn on the device (normal, std 0.02), so Llama-3.1-8B / Qwen2.5-7B / Gemma-7B shapes run with
// nothing downloaded (--geometry writes the config). The same run can time HF transformers on the
// same geometry (--hf-python): every number gets its peer beside it.
//
// Timings are wall clock around a call whose result is read back to the host (which waits for the
// device), median of --repeats after one warm-up. --interleave keeps the HF peer running beside us
// and alternates the two per case and round (shared CPU machines: load changes by the minute), the
// ratio then being the median of the rounds' ratios. --synthetic-context fills decode contexts
// with random K/V on both sides instead of prefilling them (an 8 x 8K prefill takes many minutes on
// a CPU; decode's cost does not depend on the values).
#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include "absl/strings/str_split.h"

#include "allocator/block_pool.h"
#include "engine/common/status_macros.h"
#include "engine/compression/press.h"
#include "engine/model/config.h"
#include "engine/model/fp8.h"
#include "engine/model/log.h"
#include "engine/runner/model_runner.h"
#include "kernels/kv_cache_fp8.h"

#ifdef DROPKV_BENCH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/fused_gemv.h"
#include "kernels/fused_ops.h"
#include "kernels/tuning.h"
#endif

namespace dropkv {
namespace {

using Json = nlohmann::json;

// Real geometries (public config.json values), with max_position_embeddings raised where the
// benchmark goes beyond the checkpoint's context (Gemma-7B: 8K).
Json GeometryConfig(const std::string& name) {
  if (name == "llama-3.1-8b") {
    return {{"architectures", {"LlamaForCausalLM"}},
            {"model_type", "llama"},
            {"hidden_size", 4096},
            {"intermediate_size", 14336},
            {"num_hidden_layers", 32},
            {"num_attention_heads", 32},
            {"num_key_value_heads", 8},
            {"head_dim", 128},
            {"vocab_size", 128256},
            {"rms_norm_eps", 1e-5},
            {"rope_theta", 500000.0},
            {"rope_scaling",
             {{"rope_type", "llama3"},
              {"factor", 8.0},
              {"low_freq_factor", 1.0},
              {"high_freq_factor", 4.0},
              {"original_max_position_embeddings", 8192}}},
            {"max_position_embeddings", 131072},
            {"tie_word_embeddings", false},
            {"hidden_act", "silu"},
            {"bos_token_id", 128000},
            {"eos_token_id", 128001},
            {"torch_dtype", "bfloat16"}};
  }
  if (name == "llama-3.2-1b") {
    return {{"architectures", {"LlamaForCausalLM"}},
            {"model_type", "llama"},
            {"hidden_size", 2048},
            {"intermediate_size", 8192},
            {"num_hidden_layers", 16},
            {"num_attention_heads", 32},
            {"num_key_value_heads", 8},
            {"head_dim", 64},
            {"vocab_size", 128256},
            {"rms_norm_eps", 1e-5},
            {"rope_theta", 500000.0},
            {"rope_scaling",
             {{"rope_type", "llama3"},
              {"factor", 32.0},
              {"low_freq_factor", 1.0},
              {"high_freq_factor", 4.0},
              {"original_max_position_embeddings", 8192}}},
            {"max_position_embeddings", 131072},
            {"tie_word_embeddings", true},
            {"hidden_act", "silu"},
            {"bos_token_id", 128000},
            {"eos_token_id", 128001},
            {"torch_dtype", "bfloat16"}};
  }
  if (name == "qwen2.5-7b") {
    return {{"architectures", {"Qwen2ForCausalLM"}},
            {"model_type", "qwen2"},
            {"hidden_size", 3584},
            {"intermediate_size", 18944},
            {"num_hidden_layers", 28},
            {"num_attention_heads", 28},
            {"num_key_value_heads", 4},
            {"vocab_size", 152064},
            {"rms_norm_eps", 1e-6},
            {"rope_theta", 1000000.0},
            {"max_position_embeddings", 131072},
            {"tie_word_embeddings", false},
            {"hidden_act", "silu"},
            {"bos_token_id", 151643},
            {"eos_token_id", 151643},
            {"torch_dtype", "bfloat16"}};
  }
  if (name == "gemma-7b") {
    return {{"architectures", {"GemmaForCausalLM"}},
            {"model_type", "gemma"},
            {"hidden_size", 3072},
            {"intermediate_size", 24576},
            {"num_hidden_layers", 28},
            {"num_attention_heads", 16},
            {"num_key_value_heads", 16},
            {"head_dim", 256},
            {"vocab_size", 256000},
            {"rms_norm_eps", 1e-6},
            {"rope_theta", 10000.0},
            {"max_position_embeddings", 65536},
            {"tie_word_embeddings", true},
            {"hidden_act", "gelu_pytorch_tanh"},
            {"hidden_activation", "gelu_pytorch_tanh"},
            {"bos_token_id", 2},
            {"eos_token_id", 1},
            {"torch_dtype", "bfloat16"}};
  }
  return nullptr;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

template <typename Fn>
double TimeMs(Fn&& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

int64_t PeakDeviceBytes(bool reset) {
#ifdef DROPKV_BENCH_CUDA
  if (!at::hasCUDA()) return 0;
  if (reset) c10::cuda::CUDACachingAllocator::resetPeakStats(0);
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(0);
  return stats.allocated_bytes[0].peak;
#else
  return 0;
#endif
}

std::vector<int32_t> RandomIds(int64_t n, int64_t vocab, uint64_t seed) {
  std::vector<int32_t> ids(n);
  uint64_t x = seed * 6364136223846793005ULL + 1442695040888963407ULL;
  for (auto& id : ids) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    id = static_cast<int32_t>(x % static_cast<uint64_t>(vocab));
  }
  return ids;
}

#ifdef DROPKV_BENCH_CUDA
// Device time of one call of fn: kCalls calls captured in a CUDA graph (as the decode step
// replays them: no host launch cost), replayed 5 times, median per call. fn(i) should read a
// different weight copy per i so that the matrix comes from DRAM, not L2.
template <typename Fn>
double GraphTimeUs(Fn&& fn) {
  constexpr int kCalls = 24;
  auto stream = c10::cuda::getStreamFromPool();
  c10::cuda::CUDAStreamGuard guard(stream);
  for (int i = 0; i < 2; ++i) fn(i);  // warm-up (cuBLAS picks its kernel, smem limits raised)
  at::cuda::CUDAGraph graph;
  graph.capture_begin();
  for (int i = 0; i < kCalls; ++i) fn(i);
  graph.capture_end();
  std::vector<double> us;
  for (int r = 0; r < 6; ++r) {
    c10::cuda::device_synchronize();
    const double ms = TimeMs([&] {
      graph.replay();
      c10::cuda::device_synchronize();
    });
    if (r > 0) us.push_back(ms * 1e3 / kCalls);
  }
  return Median(us);
}

// --gemv-table: the decode projections of the geometry at M tokens, cuBLAS (at::linear) vs
// kernels/fused_gemv.h's GEMV over bf16 weights, the same GEMV over the weights in e4m3
// (per-channel scales), and the FP8 GEMM (engine/model/fp8.h: activation quantization +
// at::_scaled_mm) over those. GB/s = weight bytes / time (FP8: one byte per weight). "-": the
// GEMV does not take M rows at that K.
int RunGemvTable(const Json& geo) {
  c10::InferenceMode guard;
  const int64_t hidden = geo["hidden_size"], inter = geo["intermediate_size"];
  const int64_t heads = geo["num_attention_heads"], kv_heads = geo["num_key_value_heads"];
  const int64_t head_dim =
      geo.contains("head_dim") ? geo["head_dim"].get<int64_t>() : hidden / heads;
  const int64_t vocab = geo["vocab_size"];
  struct Proj {
    const char* name;
    int64_t n, k;
  };
  const Proj projs[] = {{"qkv", (heads + 2 * kv_heads) * head_dim, hidden},
                        {"o_proj", hidden, heads * head_dim},
                        {"gate_up", 2 * inter, hidden},
                        {"down", hidden, inter},
                        {"lm_head", vocab, hidden}};
  const auto opts = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  // With PDL on, the graph's consecutive GEMV calls overlap as they do in a decode step; cuBLAS's
  // do not.
  std::printf("PDL %s\n\n", kernels::Tuning().pdl ? "on" : "off");
  std::printf(
      "| proj | N x K | M | cuBLAS us | cuBLAS GB/s | GEMV us | GEMV GB/s | FP8 GEMV us | FP8 GEMV "
      "GB/s | FP8 GEMM us | FP8 GEMM GB/s |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const Proj& p : projs) {
    const double bytes = 2.0 * p.n * p.k;
    // Enough copies that a round of calls streams >= 512 MB (L2 is 50 MB).
    const int copies = static_cast<int>(std::max(2.0, std::ceil(512e6 / bytes)));
    std::vector<at::Tensor> ws;
    for (int c = 0; c < copies; ++c) ws.push_back(at::randn({p.n, p.k}, opts) * 0.02);
    std::vector<std::pair<at::Tensor, at::Tensor>> w8s;  // {e4m3 weights, fp32 scales [N, 1]}
    for (const at::Tensor& w : ws) w8s.push_back(QuantizeFp8PerChannel(w));
    for (int64_t m : {1, 2, 4, 8, 16}) {
      const bool gemv = m <= kernels::FusedGemvMaxRows(p.k, at::kBFloat16);
      auto x = at::randn({m, p.k}, opts);
      auto w = [&](int i) { return ws[i % copies]; };
      auto cell = [&](double us, double weight_bytes) {
        char text[48] = "- | -";
        if (us > 0) std::snprintf(text, sizeof(text), "%.1f | %.0f", us, weight_bytes / us * 1e-3);
        return std::string(text);
      };
      const double t_linear = GraphTimeUs([&](int i) { at::linear(x, w(i)); });
      const double t_gemv =
          gemv ? GraphTimeUs([&](int i) { (void)kernels::Gemv(x, w(i), at::Tensor()); }) : 0;
      const double t_fp8 = gemv ? GraphTimeUs([&](int i) {
        const auto& [w8, scale] = w8s[i % copies];
        (void)kernels::Gemv(x, w8, at::Tensor(), scale);
      })
                                : 0;
      const double t_gemm = GraphTimeUs([&](int i) {
        const auto& [w8, scale] = w8s[i % copies];
        (void)Fp8ScaledMm(x, w8, scale, at::Tensor());
      });
      std::printf("| %s | %lld x %lld | %lld | %s | %s | %s | %s |\n", p.name,
                  static_cast<long long>(p.n), static_cast<long long>(p.k),
                  static_cast<long long>(m), cell(t_linear, bytes).c_str(),
                  cell(t_gemv, bytes).c_str(), cell(t_fp8, bytes / 2).c_str(),
                  cell(t_gemm, bytes / 2).c_str());
      std::fflush(stdout);
    }
  }
  return 0;
}
#endif

// The HF peer kept running beside us (hf_peer.py --serve): one JSON request per line in, one
// JSON answer per line out.
class ServedPeer {
 public:
  static std::unique_ptr<ServedPeer> Start(const std::string& command) {
    int to_child[2], from_child[2];
    if (pipe(to_child) != 0) return nullptr;
    if (pipe(from_child) != 0) {
      close(to_child[0]);
      close(to_child[1]);
      return nullptr;
    }
    const pid_t pid = fork();
    if (pid < 0) return nullptr;
    if (pid == 0) {
      dup2(to_child[0], STDIN_FILENO);
      dup2(from_child[1], STDOUT_FILENO);
      for (int fd : {to_child[0], to_child[1], from_child[0], from_child[1]}) close(fd);
      execl("/bin/sh", "sh", "-c", command.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    close(to_child[0]);
    close(from_child[1]);
    std::signal(SIGPIPE, SIG_IGN);  // a peer that died is a failed Ask, not a killed benchmark
    return std::unique_ptr<ServedPeer>(
        new ServedPeer(pid, fdopen(to_child[1], "w"), fdopen(from_child[0], "r")));
  }
  ~ServedPeer() {
    std::fclose(to_);  // end of input: the peer exits
    std::fclose(from_);
    int status = 0;
    waitpid(pid_, &status, 0);
  }
  // The answer, or nullopt when the peer died or answered with something else than JSON.
  std::optional<Json> Ask(const Json& request) {
    std::fprintf(to_, "%s\n", request.dump().c_str());
    std::fflush(to_);
    char* line = nullptr;
    size_t capacity = 0;
    const ssize_t got = getline(&line, &capacity, from_);
    const std::string text = got > 0 ? std::string(line, got) : std::string();
    std::free(line);
    try {
      if (!text.empty()) return Json::parse(text);
    } catch (const std::exception& e) {
      std::cerr << "hf peer: unreadable answer: " << e.what() << "\n";
    }
    return std::nullopt;
  }

 private:
  ServedPeer(pid_t pid, FILE* to, FILE* from) : pid_(pid), to_(to), from_(from) {}
  pid_t pid_;
  FILE* to_;
  FILE* from_;
};

// A sequence whose cache holds `context` tokens without a prefill: every global layer
// `kept_tokens` entries (what a compressed prefill keeps), every sliding layer its window. The
// values are whatever the pool holds (random with --synthetic-context).
absl::Status AddSyntheticSequence(ModelRunner& runner, SequenceId seq, int64_t context,
                                  int64_t kept_tokens) {
  BlockPool& pool = runner.pool();
  const ModelConfig& config = runner.config();
  RETURN_IF_ERROR(pool.AddSequence(seq));
  for (int32_t l = 0; l < config.num_layers; ++l) {
    // A sliding layer's ring stops growing at its window (the pool's layer capacity).
    RETURN_IF_ERROR(pool.AppendLayerSlots(seq, l, config.is_sliding(l) ? context : kept_tokens));
  }
  pool.set_logical_len(seq, context);
  return absl::OkStatus();
}

CompressionParams Compression(double keep, const std::string& allocator, const std::string& profile,
                              int32_t decode_margin) {
  CompressionParams c;
  if (keep >= 1.0) return c;
  c.method = ScoreMethod::kDropKV;
  c.keep_ratio = keep;
  c.decode_margin = decode_margin;
  c.allocator = allocator == "mga" ? BudgetAllocator::kMGA : BudgetAllocator::kUniform;
  c.profile_path = profile;
  return c;
}

int Run(int argc, char** argv) {
  CLI::App app{"dropkv-bench-e2e: engine-level prefill / decode timings at real model geometry"};
  std::string model_dir, geometry, write_config, device = "cuda", dtype = "bfloat16";
  std::string quantization = "none", kv_cache_dtype = "auto";
  std::string prefill_arg = "8192,32768", decode_arg = "1x8192", keep_arg = "1.0,0.1";
  std::string allocator = "uniform", profile, hf_python, hf_script = "bench/e2e/hf_peer.py";
  bool random_weights = false, json_out = false, interleave = false, synthetic_context = false;
  int repeats = 3, decode_steps = 32;
  int32_t decode_margin = 0;
  std::string graphs_arg = "both", fused_arg = "on", gemv_arg = "plain";
  bool gemv_table = false;
  int64_t throughput_context = 0;
  double kv_gib = 0;
  app.add_option("--model", model_dir,
                 "Hugging Face folder (config.json; weights unless --random-weights)");
  app.add_option(
      "--geometry", geometry,
      "llama-3.1-8b | llama-3.2-1b | qwen2.5-7b | gemma-7b: write its config, random weights");
  app.add_option("--write-config", write_config, "where --geometry writes its config folder")
      ->capture_default_str();
  app.add_flag("--random-weights", random_weights, "draw weights on the device (normal, std 0.02)");
  app.add_option("--device", device, "cpu or cuda")->capture_default_str();
  app.add_option("--dtype", dtype, "bfloat16, float16 or float32")->capture_default_str();
  app.add_option("--quantization", quantization, "projection weights: none or fp8")
      ->capture_default_str();
  app.add_option("--kv-cache-dtype", kv_cache_dtype, "the paged KV pool: auto or fp8")
      ->capture_default_str();
  app.add_option("--prefill", prefill_arg, "prompt lengths to prefill, comma-separated")
      ->capture_default_str();
  app.add_option("--decode", decode_arg, "BATCHxCONTEXT cases, comma-separated")
      ->capture_default_str();
  app.add_option("--decode-steps", decode_steps, "timed decode steps per case")
      ->capture_default_str();
  app.add_option("--keep", keep_arg, "keep ratios (1.0 = full cache), comma-separated")
      ->capture_default_str();
  app.add_option("--allocator", allocator, "uniform or mga")->capture_default_str();
  app.add_option("--profile", profile, "InfoNCE profile for mga");
  app.add_option("--decode-margin", decode_margin,
                 "compressed rows also compress during decode past the budget by this (0 = off; "
                 "needs real prefills, not --synthetic-context)");
  app.add_option("--repeats", repeats, "timed repeats (median)")->capture_default_str();
  app.add_option("--kv-gib", kv_gib, "KV pool size in GiB (0 = runner default)");
  app.add_option("--hf-python", hf_python,
                 "python with transformers: time the HF peer in the same run");
  app.add_option("--hf-script", hf_script, "the peer script")->capture_default_str();
  app.add_flag("--interleave", interleave,
               "with --hf-python: keep the peer running beside us and alternate the two per case "
               "and round (--repeats rounds after a warm-up round); both stay in memory (CUDA: "
               "size the pool with --kv-gib); needs --graphs on or off");
  app.add_flag("--synthetic-context", synthetic_context,
               "decode contexts of random K/V on both sides instead of a prefill");
  app.add_flag("--json", json_out, "print one JSON object instead of the table");
  app.add_option("--graphs", graphs_arg,
                 "CUDA-graph decode: on, off or both (each decode case twice)")
      ->capture_default_str();
  app.add_option("--fused-ops", fused_arg,
                 "CUDA: fused RMSNorm / RoPE + K/V store / activation kernels, on or off")
      ->capture_default_str()
      ->check(CLI::IsMember({"on", "off"}));
  app.add_option("--fused-gemv", gemv_arg,
                 "CUDA, with --fused-ops on: batch-1 decode projections as kernels/fused_gemv.h's "
                 "plain GEMV (plain) or cuBLAS (off)")
      ->capture_default_str()
      ->check(CLI::IsMember({"plain", "off"}));
  app.add_flag("--gemv-table", gemv_table,
               "print the --geometry's decode GEMVs, cuBLAS vs kernels/fused_gemv.h, and exit");
  app.add_option("--throughput-context", throughput_context,
                 "also time decode at the full-memory batch of sequences of this context (KV "
                 "filled synthetically, no prefill; 0 = skip)")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  auto split = [](const std::string& s) -> std::vector<std::string> {
    return absl::StrSplit(s, ',', absl::SkipEmpty());
  };

  if (!geometry.empty()) {
    Json config = GeometryConfig(geometry);
    if (config.is_null()) {
      std::cerr << "--geometry: unknown '" << geometry
                << "' (llama-3.1-8b, llama-3.2-1b, qwen2.5-7b, gemma-7b)\n";
      return 2;
    }
    if (gemv_table) {
#ifdef DROPKV_BENCH_CUDA
      return RunGemvTable(config);
#else
      std::cerr << "--gemv-table needs a CUDA build\n";
      return 2;
#endif
    }
    if (write_config.empty()) write_config = "bench-models/" + geometry;
    std::filesystem::create_directories(write_config);
    std::ofstream(std::filesystem::path(write_config) / "config.json") << config.dump(2) << "\n";
    model_dir = write_config;
    random_weights = true;
  }
  if (model_dir.empty()) {
    std::cerr << "give --model DIR or --geometry NAME\n";
    return 2;
  }
  if (interleave && (hf_python.empty() || graphs_arg == "both")) {
    std::cerr << "--interleave needs --hf-python and --graphs on or off\n";
    return 2;
  }

  LogToStderr();  // stdout carries the table or the JSON
  c10::InferenceMode guard;
  RunnerOptions options;
  options.model_dir = model_dir;
  options.device = device;
  options.dtype = dtype;
  options.random_weights = random_weights;
  options.quantization = quantization;
  options.kv_cache_dtype = kv_cache_dtype;
  options.cuda_fused_ops = fused_arg == "on";
  options.cuda_decode_gemv = gemv_arg == "plain";
  if (kv_gib > 0) options.kv_cache_bytes = static_cast<int64_t>(kv_gib * (1LL << 30));
  auto runner_or = ModelRunner::Create(options);
  if (!runner_or.ok()) {
    std::cerr << "model: " << runner_or.status() << "\n";
    return 1;
  }
  ModelRunner& runner = **runner_or;
  runner.SetKvSelectorFactory(&compression::CreateKvSelectorForModel);
  const ModelConfig& config = runner.config();
  // Resident before any prefill: the weights plus the whole KV pool (allocated up front).
  const int64_t weights_bytes = PeakDeviceBytes(/*reset=*/false);

  Json result = {{"model", model_dir},
                 {"device", device},
                 {"dtype", dtype},
                 {"fused_ops", options.cuda_fused_ops},
                 {"fused_gemv", options.cuda_fused_ops ? gemv_arg : "off"},
                 {"layers", config.num_layers},
                 {"kv_blocks_total", runner.pool().num_blocks()},
                 {"prefill", Json::array()},
                 {"decode", Json::array()},
                 {"capacity", Json::array()},
                 {"throughput", Json::array()}};
  SequenceId next_seq = 1;

  // The peer command; --interleave starts it now (--serve) and asks it case by case.
  const std::string hf_cmd =
      hf_python.empty()
          ? std::string()
          : hf_python + " " + hf_script + " --model " + model_dir + " --prefill='" + prefill_arg +
                "' --decode='" + decode_arg + "' --repeats " + std::to_string(repeats) +
                " --decode-steps " + std::to_string(decode_steps) + " --device " +
                (device.rfind("cuda", 0) == 0 ? std::string("cuda") : device) + " --dtype " +
                dtype + (random_weights ? "" : " --weights") +
                (synthetic_context ? " --synthetic-context" : "");
  std::unique_ptr<ServedPeer> peer;
  if (interleave) {
    peer = ServedPeer::Start(hf_cmd + " --serve");
    if (!peer) {
      std::cerr << "hf peer: could not start " << hf_cmd << "\n";
      return 1;
    }
  }
  // One round of the peer (interleaved runs); nullopt when it failed (reported once).
  auto ask_peer = [&](const Json& request, const char* field) -> std::optional<double> {
    auto answer = peer->Ask(request);
    if (!answer || !answer->contains(field)) {
      std::cerr << "hf peer: no answer to " << request.dump() << "\n";
      return std::nullopt;
    }
    return (*answer)[field].get<double>();
  };
  // The interleaved figures of a case: the peer's median and the median of the rounds' ratios.
  auto add_peer_figures = [](Json& row, const std::vector<double>& ours,
                             const std::vector<double>& hf) {
    if (hf.empty() || hf.size() != ours.size()) return;
    std::vector<double> ratios;
    for (size_t i = 0; i < hf.size(); ++i) ratios.push_back(hf[i] / ours[i]);
    row["hf_ms"] = Median(hf);
    row["hf_over_ours"] = Median(ratios);
    row["hf_over_ours_rounds"] = ratios;
  };
  if (synthetic_context) {
    // Random K/V in every slot, once: decode then reads finite values of the usual magnitude.
    // (An FP8 pool has no normal_: drawn in bf16 and quantized, 4096 blocks at a time.)
    for (at::Tensor cache : {runner.pool().key_cache(), runner.pool().value_cache()}) {
      if (!kernels::IsFp8Cache(cache)) {
        cache.normal_();
        continue;
      }
      for (int64_t b = 0; b < cache.size(0); b += 4096) {
        at::Tensor part = cache.narrow(0, b, std::min<int64_t>(4096, cache.size(0) - b));
        part.copy_(
            kernels::QuantizeKv(at::randn(part.sizes(), part.options().dtype(at::kBFloat16))));
      }
    }
  }

  for (const auto& keep_s : split(keep_arg)) {
    const double keep = std::stod(keep_s);
    const CompressionParams comp = Compression(keep, allocator, profile, decode_margin);
    const bool with_peer = peer && keep >= 1.0;  // HF keeps everything
    for (const auto& n_s : split(prefill_arg)) {
      const int64_t n = std::stoll(n_s);
      const auto ids = RandomIds(n, config.vocab_size, static_cast<uint64_t>(n));
      std::vector<double> times, hf_times;
      int64_t peak = 0, kept_tokens = 0;
      for (int r = 0; r < repeats + 1; ++r) {
        const SequenceId seq = next_seq++;
        PeakDeviceBytes(/*reset=*/true);
        absl::Status status;
        const double ms = TimeMs([&] {
          auto logits = runner.Prefill(seq, ids, /*is_last_chunk=*/true, comp);
          if (!logits.ok())
            status = logits.status();
          else
            (void)logits->to(at::kCPU);
        });
        if (!status.ok()) {
          std::cerr << "prefill " << n << " keep " << keep << ": " << status << "\n";
          return 1;
        }
        peak = std::max(peak, PeakDeviceBytes(false));
        const auto info = runner.CacheInfo(seq);
        kept_tokens = std::accumulate(info.stored_len_per_layer.begin(),
                                      info.stored_len_per_layer.end(), int64_t{0});
        runner.Release(seq);
        if (r > 0) times.push_back(ms);  // the first run is the warm-up
        if (with_peer) {
          auto hf = ask_peer({{"op", "prefill"}, {"tokens", n}}, "ms");
          if (!hf) return 1;
          if (r > 0) hf_times.push_back(*hf);
        }
      }
      Json row = {{"tokens", n},
                  {"keep", keep},
                  {"ms", Median(times)},
                  {"peak_bytes", peak},
                  {"weights_bytes", weights_bytes},
                  {"kept_tokens_all_layers", kept_tokens}};
      add_peer_figures(row, times, hf_times);
      result["prefill"].push_back(row);
      std::cerr << "prefill n=" << n << " keep=" << keep << ": " << Median(times) << " ms"
                << (hf_times.empty() ? "" : ", HF " + std::to_string(Median(hf_times)) + " ms")
                << "\n";
    }

    for (const auto& spec : split(decode_arg)) {
      const auto x = spec.find('x');
      const int64_t batch = std::stoll(spec.substr(0, x)), ctx = std::stoll(spec.substr(x + 1));
      std::vector<SequenceId> seqs;
      std::vector<int32_t> tokens;
      absl::Status status;
      const int64_t kept = comp.method == ScoreMethod::kNone
                               ? ctx
                               : static_cast<int64_t>(std::ceil(keep * static_cast<double>(ctx)));
      for (int64_t b = 0; b < batch && status.ok(); ++b) {
        const SequenceId seq = next_seq++;
        seqs.push_back(seq);
        if (synthetic_context) {
          status = AddSyntheticSequence(runner, seq, ctx, kept);
          tokens.push_back(static_cast<int32_t>((b * 7919 + 13) % config.vocab_size));
          continue;
        }
        auto logits = runner.Prefill(seq, RandomIds(ctx, config.vocab_size, 1000 + b), true, comp);
        if (!logits.ok())
          status = logits.status();
        else
          tokens.push_back(static_cast<int32_t>(logits->argmax().item<int64_t>()));
      }
      std::vector<bool> modes;
      if (graphs_arg != "off") modes.push_back(true);
      if (graphs_arg != "on") modes.push_back(false);
      for (bool graphs : modes) {
        runner.SetCudaGraphs(graphs);
        std::vector<double> times, host_times;
        std::vector<double> prepare_us, fill_us, upload_us, launch_us;
        std::vector<double> round_ms, hf_round_ms;  // interleaved: per round, ours and the peer's
        // Interleaved: a warm-up round, then --repeats rounds of --decode-steps steps each side.
        // Alone: --decode-steps steps after two warm-up steps (the first capture the graphs).
        const int rounds = with_peer ? repeats + 1 : 1;
        for (int round = 0; round < rounds && status.ok(); ++round) {
          const int warmup_steps = with_peer ? 0 : 2;
          std::vector<double> this_round;
          for (int step = 0; step < decode_steps + warmup_steps && status.ok(); ++step) {
            const double ms = TimeMs([&] {
              auto logits = runner.Decode(seqs, tokens);
              if (!logits.ok()) {
                status = logits.status();
                return;
              }
              auto next = logits->argmax(-1).to(at::kCPU);  // the host needs the ids: a real sync
              for (int64_t b = 0; b < batch; ++b)
                tokens[b] = static_cast<int32_t>(next[b].item<int64_t>());
            });
            if (step < warmup_steps || (with_peer && round == 0)) continue;
            times.push_back(ms);
            this_round.push_back(ms);
            // The host's part (runner.Decode): the device idles while it runs, the previous
            // step's ids just read back, until the step's first kernel is queued.
            const auto parts = runner.last_decode_host_times();
            host_times.push_back(parts.total_us / 1e3);
            prepare_us.push_back(parts.prepare_us);
            fill_us.push_back(parts.fill_us);
            upload_us.push_back(parts.upload_us);
            launch_us.push_back(parts.launch_us);
          }
          if (!with_peer || !status.ok()) continue;
          auto hf = ask_peer(
              {{"op", "decode"}, {"batch", batch}, {"context", ctx}, {"steps", decode_steps}},
              "ms_per_step");
          if (!hf) return 1;
          if (round > 0) {
            round_ms.push_back(Median(this_round));
            hf_round_ms.push_back(*hf);
          }
        }
        if (!status.ok()) break;
        Json row = {{"batch", batch},
                    {"context", ctx},
                    {"keep", keep},
                    {"graphs", graphs},
                    {"ms_per_step", Median(times)},
                    {"host_ms_per_step", Median(host_times)},
                    {"host_us_parts",
                     {{"prepare", Median(prepare_us)},
                      {"fill", Median(fill_us)},
                      {"upload", Median(upload_us)},
                      {"launch", Median(launch_us)}}},
                    {"tokens_per_s", batch * 1000.0 / Median(times)}};
        add_peer_figures(row, round_ms, hf_round_ms);
        result["decode"].push_back(row);
        std::cerr << "decode " << spec << " keep=" << keep << " graphs=" << graphs << ": "
                  << Median(times) << " ms/step (runner.Decode on the host: " << Median(host_times)
                  << " ms: prepare " << Median(prepare_us) << " us, fill " << Median(fill_us)
                  << ", upload " << Median(upload_us) << ", launch " << Median(launch_us) << ")"
                  << (hf_round_ms.empty() ? ""
                                          : ", HF " + std::to_string(Median(hf_round_ms)) + " ms")
                  << "\n";
      }
      runner.SetCudaGraphs(graphs_arg != "off");
      for (SequenceId seq : seqs) runner.Release(seq);
      if (!status.ok()) {
        std::cerr << "decode " << spec << " keep " << keep << ": " << status << "\n";
        return 1;
      }
    }

    // How many 32K-token sequences fit in the pool (admission's own accounting, 256 decode tokens).
    const int64_t per_seq =
        compression::BlocksNeeded(comp, 32768, runner.cache_geometry(), 256).value_or(0);
    result["capacity"].push_back(
        {{"keep", keep},
         {"prompt_tokens", 32768},
         {"blocks_per_sequence", per_seq},
         {"sequences", per_seq > 0 ? runner.pool().num_blocks() / per_seq : 0}});

    if (throughput_context > 0) {
      // Decode throughput at the batch that fills the pool: as many sequences of
      // `throughput_context` tokens as admission's accounting admits, each layer holding what
      // the compressed prefill would keep. The K/V values are whatever the pool holds (the work
      // per step does not depend on them), so no prefill is needed to fill 100+ GiB.
      BlockPool& pool = runner.pool();
      const int64_t per = compression::BlocksNeeded(comp, throughput_context,
                                                    runner.cache_geometry(), decode_steps + 4)
                              .value_or(0);
      const int64_t num_seqs = per > 0 ? pool.num_free_blocks() / per : 0;
      const int64_t kept = comp.method == ScoreMethod::kNone
                               ? throughput_context
                               : static_cast<int64_t>(std::ceil(keep * throughput_context));
      std::vector<SequenceId> seqs;
      std::vector<int32_t> tokens;
      absl::Status status;
      for (int64_t b = 0; b < num_seqs && status.ok(); ++b) {
        const SequenceId seq = next_seq++;
        status = AddSyntheticSequence(runner, seq, throughput_context, kept);
        if (!status.ok()) break;
        seqs.push_back(seq);
        tokens.push_back(static_cast<int32_t>((b * 7919) % config.vocab_size));
      }
      std::vector<double> times;
      for (int step = 0; step < decode_steps + 2 && status.ok() && !seqs.empty(); ++step) {
        const double ms = TimeMs([&] {
          auto logits = runner.Decode(seqs, tokens);
          if (!logits.ok()) {
            status = logits.status();
            return;
          }
          (void)logits->argmax(-1).to(at::kCPU);
        });
        if (step >= 2) times.push_back(ms);
      }
      for (SequenceId seq : seqs) runner.Release(seq);
      if (!status.ok()) {
        std::cerr << "throughput keep " << keep << ": " << status << "\n";
        return 1;
      }
      const double ms = Median(times);
      const int64_t n = static_cast<int64_t>(seqs.size());
      result["throughput"].push_back({{"keep", keep},
                                      {"context", throughput_context},
                                      {"batch", n},
                                      {"kept_tokens_per_layer", kept},
                                      {"ms_per_step", ms},
                                      {"tokens_per_s", ms > 0 ? n * 1000.0 / ms : 0.0}});
      std::cerr << "throughput keep=" << keep << ": batch " << n << ", " << ms << " ms/step, "
                << (ms > 0 ? n * 1000.0 / ms : 0.0) << " tok/s\n";
    }
  }

  peer.reset();  // the interleaved peer exits
  if (!hf_python.empty() && !interleave) {
    // The peer needs the device memory our KV pool holds: free the runner first.
    runner_or->reset();
#ifdef DROPKV_BENCH_CUDA
    if (at::hasCUDA()) c10::cuda::CUDACachingAllocator::emptyCache();
#endif
    std::string text;
    if (FILE* pipe = popen(hf_cmd.c_str(), "r")) {
      char buf[4096];
      while (size_t got = fread(buf, 1, sizeof(buf), pipe)) text.append(buf, got);
      if (pclose(pipe) == 0) {
        try {
          result["hf"] = Json::parse(text);
        } catch (const std::exception& e) {
          std::cerr << "hf peer: unreadable output: " << e.what() << "\n";
        }
      } else {
        std::cerr << "hf peer failed: " << hf_cmd << "\n";
      }
    }
  }

  if (json_out) {
    std::cout << result.dump(2) << "\n";
    return 0;
  }
  std::printf("\n%-28s %10s %10s %10s\n", "case", "ours", "HF", "HF/ours");
  auto hf_prefill = [&](int64_t n) -> double {
    if (!result.contains("hf")) return 0;
    for (const auto& p : result["hf"]["prefill"])
      if (p["tokens"] == n) return p["ms"];
    return 0;
  };
  auto hf_decode = [&](int64_t b, int64_t c) -> double {
    if (!result.contains("hf")) return 0;
    for (const auto& p : result["hf"]["decode"])
      if (p["batch"] == b && p["context"] == c) return p["ms_per_step"];
    return 0;
  };
  // Interleaved rows carry the peer's median and the median of the rounds' ratios.
  auto ratio = [](const Json& row, double ours, double hf) {
    if (row.contains("hf_over_ours")) return row["hf_over_ours"].get<double>();
    return hf > 0 ? hf / ours : 0.0;
  };
  for (const auto& p : result["prefill"]) {
    const double ours = p["ms"];
    const double hf = p.contains("hf_ms") ? p["hf_ms"].get<double>()
                      : p["keep"] == 1.0  ? hf_prefill(p["tokens"])
                                          : 0;
    std::printf("prefill %6lld keep %.2f ms  %10.1f %10.1f %10.2f\n", (long long)p["tokens"],
                (double)p["keep"], ours, hf, ratio(p, ours, hf));
  }
  for (const auto& d : result["decode"]) {
    const double ours = d["ms_per_step"];
    const double hf = d.contains("hf_ms") ? d["hf_ms"].get<double>()
                      : d["keep"] == 1.0  ? hf_decode(d["batch"], d["context"])
                                          : 0;
    std::printf("decode bs%-3lld ctx%-6lld keep %.2f%s %8.2f %10.2f %10.2f\n",
                (long long)d["batch"], (long long)d["context"], (double)d["keep"],
                d["graphs"] ? "" : " eager", ours, hf, ratio(d, ours, hf));
  }
  for (const auto& t : result["throughput"]) {
    std::printf("full-memory batch keep %.2f: %lld x %lld tokens, %.2f ms/step, %.0f tok/s\n",
                (double)t["keep"], (long long)t["batch"], (long long)t["context"],
                (double)t["ms_per_step"], (double)t["tokens_per_s"]);
  }
  for (const auto& c : result["capacity"]) {
    std::printf("32K sequences that fit, keep %.2f: %lld\n", (double)c["keep"],
                (long long)c["sequences"]);
  }
  return 0;
}

}  // namespace
}  // namespace dropkv

int main(int argc, char** argv) {
  return dropkv::Run(argc, argv);
}
