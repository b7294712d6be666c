// dropkv-generate: one prompt through the ModelRunner + Sampler, text printed as it comes.
// No --model = the built-in demo model. --json prints {"token_ids": [...], "text": "..."} at the
// end. --tensor-parallel-size N starts N - 1 more processes (engine/parallel/group.h) that run
// the same generation on their shards; rank 0 prints.
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <optional>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "engine/compression/cli_flags.h"
#include "engine/compression/compression.h"
#include "engine/compression/press.h"
#include "engine/model/config.h"
#include "engine/model/log.h"
#include "engine/parallel/group.h"
#include "engine/runner/demo_model.h"
#include "engine/runner/model_runner.h"
#include "engine/sampling/sampler.h"
#include "engine/tokenizer/tokenizer.h"

namespace {

int Fail(const std::string& what) {
  std::fprintf(stderr, "dropkv-generate: %s\n", what.c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "dropkv-generate: generate text from a Hugging Face model folder (no --model = demo model)"};
  dropkv::RunnerOptions ro;
  dropkv::SamplingParams sp;
  sp.max_new_tokens = 64;
  std::string prompt, ids_text;
  std::optional<uint64_t> seed;
  bool json_out = false;
  bool stop_on_bos = false;
  app.add_option("--model", ro.model_dir, "Hugging Face model folder (default: the demo model)");
  app.add_option("--prompt", prompt, "prompt text (empty: start from BOS)");
  app.add_option("--ids", ids_text, "prompt token ids, comma-separated (instead of --prompt)");
  app.add_option("--max-new-tokens", sp.max_new_tokens, "tokens to generate")
      ->capture_default_str();
  app.add_option("--temperature", sp.temperature, "0 = greedy")->capture_default_str();
  app.add_option("--top-k", sp.top_k, "0 = off")->capture_default_str();
  app.add_option("--top-p", sp.top_p, "nucleus mass")->capture_default_str();
  app.add_option("--min-p", sp.min_p, "min-p filter")->capture_default_str();
  app.add_option("--repetition-penalty", sp.repetition_penalty)->capture_default_str();
  app.add_option("--seed", seed, "sampling seed (same seed, same output)");
  app.add_flag("--ignore-eos", sp.ignore_eos, "keep going past EOS");
  app.add_flag("--stop-on-bos", stop_on_bos, "stop when BOS is sampled (llama2.c run.c behaviour)");
  app.add_option("--device", ro.device, "cpu or cuda[:N]")->capture_default_str();
  app.add_option("--dtype", ro.dtype, "auto, float32, bfloat16, float16")->capture_default_str();
  app.add_option("--quantization", ro.quantization, "none, fp8 (projection weights in FP8 e4m3)")
      ->capture_default_str();
  app.add_option("--kv-cache-dtype", ro.kv_cache_dtype, "auto, fp8 (the KV pool in FP8 e4m3)")
      ->capture_default_str();
  app.add_option("--block-size", ro.block_size, "KV slots per block")->capture_default_str();
  app.add_flag("--json", json_out, "print one JSON object {token_ids, text} at the end");
  dropkv::CompressionParams cp;  // --method none (the default) = full cache
  dropkv::compression::AddCompressionFlags(app, &cp);
  int64_t kv_cache_mib = 256;
  app.add_option("--kv-cache-mib", kv_cache_mib, "KV pool size")->capture_default_str();
  int32_t tp_size = 1, tp_rank = 0;
  std::string tp_store;
  app.add_option("--tensor-parallel-size", tp_size,
                 "ranks the model is split over, one process each (cpu: Gloo; cuda:I: one GPU "
                 "per rank from I, NCCL)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  // Set by rank 0 on the processes it starts.
  app.add_option("--tp-rank", tp_rank)->group("");
  app.add_option("--tp-store", tp_store)->group("");
  CLI11_PARSE(app, argc, argv);
  dropkv::LogToStderr();  // stdout carries only the generated text / JSON
  ro.kv_cache_bytes = kv_cache_mib << 20;
  sp.seed = seed;
  if (auto st = dropkv::ValidateSamplingParams(sp); !st.ok())
    return Fail(std::string(st.message()));

  std::unique_ptr<dropkv::RankProcesses> ranks;
  std::unique_ptr<dropkv::Communicator> comm;
  if (tp_size > 1) {
    if (tp_rank == 0) {
      // Every rank samples from the same logits with the same seed, so they draw the same tokens.
      if (!sp.seed) sp.seed = std::random_device{}();
      std::vector<std::string> args(argv, argv + argc);
      if (!seed) args.insert(args.end(), {"--seed", std::to_string(*sp.seed)});
      auto started = dropkv::RankProcesses::Start(args, tp_size);
      if (!started.ok()) return Fail(std::string(started.status().message()));
      ranks = std::move(*started);
      tp_store = ranks->store_dir();
    } else if (std::freopen("/dev/null", "w", stdout) == nullptr) {
      return Fail("cannot silence rank " + std::to_string(tp_rank));
    }
    auto connected = dropkv::ConnectGroup(tp_rank, tp_size, ro.device, tp_store);
    if (!connected.ok()) return Fail(std::string(connected.status().message()));
    comm = std::move(*connected);
    ro.communicator = comm.get();
    auto device = dropkv::RankDevice(ro.device, tp_rank);
    if (!device.ok()) return Fail(std::string(device.status().message()));
    ro.device = *device;
  }

  auto runner_or = dropkv::ModelRunner::Create(ro);
  if (!runner_or.ok()) return Fail(std::string(runner_or.status().message()));
  auto& runner = *runner_or;
  if (auto st = dropkv::compression::ValidateCompression(cp, runner->config().num_layers); !st.ok())
    return Fail(std::string(st.message()));
  runner->SetKvSelectorFactory(&dropkv::compression::CreateKvSelectorForModel);
  const std::string model_dir =
      ro.model_dir.empty() ? dropkv::DemoModelDir(ro.demo_model_dir) : ro.model_dir;
  auto tok_or = dropkv::Tokenizer::FromDirectory(model_dir);
  std::unique_ptr<dropkv::Tokenizer> tokenizer;
  if (tok_or.ok()) {
    tokenizer = std::move(*tok_or);
  } else if (!json_out || ids_text.empty()) {
    return Fail(std::string(tok_or.status().message()));
  }
  const auto& config = runner->config();
  std::vector<int32_t> prompt_ids;
  if (!ids_text.empty()) {
    std::stringstream ss(ids_text);
    std::string item;
    while (std::getline(ss, item, ',')) {
      try {
        prompt_ids.push_back(std::stoi(item));
      } catch (const std::exception&) {
        return Fail("--ids: '" + item + "' is not an integer");
      }
    }
  } else if (!prompt.empty()) {
    auto enc = tokenizer->Encode(prompt, /*add_special_tokens=*/true);
    if (!enc.ok()) return Fail(std::string(enc.status().message()));
    prompt_ids = *enc;
  }
  if (prompt_ids.empty()) {
    int32_t bos = config.bos_token_id;
    if (bos < 0 && tokenizer && tokenizer->bos_token_id()) bos = *tokenizer->bos_token_id();
    if (bos < 0) return Fail("empty prompt and the model has no BOS token");
    prompt_ids.push_back(bos);
  }
  std::vector<int32_t> eos = config.eos_token_ids;
  if (tokenizer) {
    for (int32_t id : tokenizer->eos_token_ids()) eos.push_back(id);
  }
  if (stop_on_bos && config.bos_token_id >= 0) sp.stop_token_ids.push_back(config.bos_token_id);

  dropkv::SamplerState state(sp, prompt_ids);
  std::optional<dropkv::IncrementalDecoder> decoder;
  if (tokenizer) decoder.emplace(*tokenizer);
  std::string text;
  const dropkv::SequenceId seq = 1;
  // Chunked prefill when --chunk-size is given (the chunk policy decides when to compress).
  const size_t chunk_len =
      cp.chunk_size > 0 ? static_cast<size_t>(cp.chunk_size) : prompt_ids.size();
  absl::StatusOr<at::Tensor> logits = absl::InternalError("no prefill ran");
  for (size_t start = 0; start < prompt_ids.size(); start += chunk_len) {
    const size_t len = std::min(chunk_len, prompt_ids.size() - start);
    const bool is_last = start + len == prompt_ids.size();
    logits =
        runner->Prefill(seq, std::span<const int32_t>(prompt_ids).subspan(start, len), is_last, cp);
    if (!logits.ok()) return Fail(std::string(logits.status().message()));
  }
  at::Tensor step_logits = logits->unsqueeze(0);
  std::vector<int32_t> out_ids;
  while (true) {
    dropkv::SamplerState* states[] = {&state};
    auto sampled = dropkv::Sampler::Sample(step_logits, states);
    if (!sampled.ok()) return Fail(std::string(sampled.status().message()));
    const int32_t tok = (*sampled)[0].token_id;
    const auto reason = dropkv::CheckStop(state, tok, eos);
    const bool is_stop_token = reason == dropkv::FinishReason::kStop;
    if (!is_stop_token) {
      out_ids.push_back(tok);
      if (decoder) {
        std::string piece = decoder->Push(tok);
        text += piece;
        if (!json_out) {
          std::fwrite(piece.data(), 1, piece.size(), stdout);
          std::fflush(stdout);
        }
      }
    }
    if (reason != dropkv::FinishReason::kNone) break;
    auto next = runner->Decode(std::span(&seq, 1), std::span(&tok, 1));
    if (!next.ok()) return Fail(std::string(next.status().message()));
    step_logits = *next;
  }
  if (decoder) {
    std::string rest = decoder->Flush();
    text += rest;
    if (!json_out) std::fwrite(rest.data(), 1, rest.size(), stdout);
  }
  if (json_out) {
    nlohmann::json j = {{"token_ids", out_ids}, {"text", text}};
    std::cout << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  } else {
    std::printf("\n");
  }
  runner->Release(seq);
  if (ranks) {
    if (auto st = ranks->Join(); !st.ok()) return Fail(std::string(st.message()));
  }
  return 0;
}
