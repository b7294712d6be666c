// One rank of a tensor-parallel group on the CPU (Gloo), started by tensor_parallel_test.cpp.
// It runs a fixed scenario twice, on its shard (the group runs it in lockstep) and on the whole
// model alone, and checks that the shard's run matches: logits within fp32 tolerance, the same
// greedy tokens, the same kept positions for its KV heads after compression (prefill and decode).
//   tp_rank --rank R --size N --store DIR --model DIR [--exit-at-step K]
//           [--device cuda --dtype bfloat16 --random-weights 1 --max-logit-diff X]
// (CUDA: rank R on cuda:R over NCCL; the store folder must be fresh for each group.)
// Prints one line "rank R: ..." and exits 0 when everything matches, 1 on a mismatch, 2 on an
// error (a peer that died included). --exit-at-step K: the process ends itself (exit code 3)
// before its K-th decode step, as a crashed rank would.
#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <unistd.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/common/status_macros.h"
#include "engine/compression/press.h"
#include "engine/model/config.h"
#include "engine/model/model.h"
#include "engine/parallel/group.h"
#include "engine/runner/model_runner.h"

namespace dropkv {
namespace {

struct Args {
  int32_t rank = 0, size = 1;
  std::string store, model;
  int exit_at_step = -1;
  std::string device = "cpu", dtype = "float32";
  bool random_weights = false;
  double max_logit_diff = 1e-3;
};

// What one run of the scenario produced.
struct Run {
  std::vector<at::Tensor> logits;              // every step's logits, in order
  std::vector<int32_t> tokens;                 // greedy tokens, in order
  std::vector<at::Tensor> kept_after_prefill;  // compressed sequence: positions per layer
  std::vector<at::Tensor> kept_after_decode;   // the same after decode-time evictions
  int64_t decode_evicted = 0;
};

int exit_at_step = -1;
int decode_steps_done = 0;

int32_t Greedy(const at::Tensor& row) {
  return static_cast<int32_t>(row.argmax().item<int64_t>());
}

absl::Status CheckedDecodeStep() {
  if (exit_at_step >= 0 && decode_steps_done == exit_at_step) {
    std::fprintf(stderr, "exiting on purpose before decode step %d\n", decode_steps_done);
    std::fflush(stderr);
    _exit(3);
  }
  ++decode_steps_done;
  return absl::OkStatus();
}

std::vector<at::Tensor> KeptPositions(const ModelRunner& r, SequenceId seq) {
  std::vector<at::Tensor> out;
  for (int32_t l = 0; l < r.config().num_layers; ++l) {
    if (r.config().is_sliding(l)) continue;
    auto p = r.StoredPositions(seq, l);
    out.push_back(p.ok() ? *p : at::Tensor());
  }
  return out;
}

// Sequence 1 uncompressed (prefill in chunks, greedy decode); sequence 2 compressed with DropKV
// at keep 25% and decode-time compression, decoded in mixed steps beside sequence 3's prefill.
absl::StatusOr<Run> Scenario(ModelRunner& r) {
  c10::InferenceMode guard;
  Run run;
  const int64_t vocab = r.config().vocab_size;
  const int64_t len = std::min<int64_t>(160, r.config().max_position_embeddings / 2);
  std::vector<int32_t> prompt;
  for (int64_t i = 0; i < len; ++i) prompt.push_back(static_cast<int32_t>((i * 7919 + 13) % vocab));
  const int64_t chunk = 32;
  CompressionParams none;
  at::Tensor last;
  for (int64_t s = 0; s < len; s += chunk) {
    const int64_t n = std::min(chunk, len - s);
    auto out = r.Prefill(1, std::span(prompt).subspan(s, n), s + n == len, none);
    if (!out.ok()) return out.status();
    if (s + n == len) last = *out;
  }
  run.logits.push_back(last);
  const std::vector<SequenceId> one = {1};
  for (int step = 0; step < 8; ++step) {
    run.tokens.push_back(Greedy(last));
    if (absl::Status s = CheckedDecodeStep(); !s.ok()) return s;
    auto out = r.Decode(one, std::vector<int32_t>{run.tokens.back()});
    if (!out.ok()) return out.status();
    last = (*out)[0];
    run.logits.push_back(last);
  }

  CompressionParams dropkv;
  dropkv.method = ScoreMethod::kDropKV;
  dropkv.keep_ratio = 0.25;
  dropkv.window = 8;
  dropkv.decode_margin = 8;
  std::vector<int32_t> prompt2(prompt.rbegin(), prompt.rend());
  auto out2 = r.Prefill(2, prompt2, true, dropkv);
  if (!out2.ok()) return out2.status();
  last = *out2;
  run.logits.push_back(last);
  run.kept_after_prefill = KeptPositions(r, 2);
  const std::vector<int32_t> prompt3(prompt.begin(), prompt.begin() + len / 2);
  for (int step = 0; step < 24; ++step) {
    run.tokens.push_back(Greedy(last));
    if (absl::Status s = CheckedDecodeStep(); !s.ok()) return s;
    const std::vector<SequenceId> two = {2};
    const std::vector<int32_t> tok = {run.tokens.back()};
    std::vector<PrefillChunk> chunks;
    if (step == 0) chunks.push_back({3, prompt3, true, &none});
    auto out = r.Step(two, tok, chunks);
    if (!out.ok()) return out.status();
    last = (*out)[0];
    run.logits.push_back(last);
    if (step == 0) run.logits.push_back((*out)[1]);
  }
  run.kept_after_decode = KeptPositions(r, 2);
  run.decode_evicted = r.CacheInfo(2).decode_evicted_entries;
  return run;
}

absl::StatusOr<std::unique_ptr<ModelRunner>> MakeRunner(const Args& a, Communicator* comm) {
  RunnerOptions o;
  o.model_dir = a.model;
  ASSIGN_OR_RETURN(o.device, RankDevice(a.device, a.rank));
  o.dtype = a.dtype;
  o.random_weights = a.random_weights;
  o.num_kv_blocks = 8192;
  o.block_size = 8;
  o.communicator = comm;
  auto r = ModelRunner::Create(o);
  if (!r.ok()) return r.status();
  (*r)->SetKvSelectorFactory(&compression::CreateKvSelectorForModel);
  return r;
}

int Main(const Args& a) {
  auto comm = ConnectGroup(a.rank, a.size, a.device, a.store);
  if (!comm.ok()) {
    std::printf("rank %d: error: %s\n", a.rank, comm.status().ToString().c_str());
    return 2;
  }
  auto sharded = MakeRunner(a, comm->get());
  if (!sharded.ok()) {
    std::printf("rank %d: error: %s\n", a.rank, sharded.status().ToString().c_str());
    return 2;
  }
  exit_at_step = a.exit_at_step;
  auto got = Scenario(**sharded);
  if (!got.ok()) {
    std::printf("rank %d: error: %s\n", a.rank, got.status().ToString().c_str());
    return 2;
  }
  exit_at_step = -1;
  auto whole = MakeRunner(a, nullptr);
  if (!whole.ok()) {
    std::printf("rank %d: error: %s\n", a.rank, whole.status().ToString().c_str());
    return 2;
  }
  auto want = Scenario(**whole);
  if (!want.ok()) {
    std::printf("rank %d: error: %s\n", a.rank, want.status().ToString().c_str());
    return 2;
  }
  std::string problems;
  double max_diff = 0;
  for (size_t i = 0; i < want->logits.size(); ++i) {
    max_diff = std::max(max_diff, (got->logits[i] - want->logits[i]).abs().max().item<double>());
  }
  if (max_diff > a.max_logit_diff) absl::StrAppend(&problems, " logits differ by ", max_diff, ";");
  if (got->tokens != want->tokens) absl::StrAppend(&problems, " greedy tokens differ;");
  // This rank's KV heads are rows [kv_head_begin, + Hkv) of the whole model's.
  const TensorParallelLayout& tp = (*sharded)->model()->tensor_parallel();
  const int64_t hkv = (*sharded)->config().num_kv_heads;
  int layers_equal = 0, layers = 0;
  auto compare = [&](const std::vector<at::Tensor>& g, const std::vector<at::Tensor>& w) {
    for (size_t l = 0; l < w.size(); ++l) {
      ++layers;
      if (g[l].defined() && w[l].defined() &&
          at::equal(g[l], w[l].narrow(0, tp.kv_head_begin, hkv)))
        ++layers_equal;
    }
  };
  compare(got->kept_after_prefill, want->kept_after_prefill);
  compare(got->kept_after_decode, want->kept_after_decode);
  if (layers_equal != layers)
    absl::StrAppend(&problems, " kept positions differ in ", layers - layers_equal, " of ", layers,
                    " layer checks;");
  if (got->decode_evicted != want->decode_evicted || want->decode_evicted == 0)
    absl::StrAppend(&problems, " decode-time evictions ", got->decode_evicted, " vs ",
                    want->decode_evicted, ";");
  std::printf(
      "rank %d of %d: max |logit diff| %.3g over %zu steps, %zu greedy tokens %s, kept positions "
      "equal in %d of %d layer checks, %ld entries evicted during decode%s%s\n",
      a.rank, a.size, max_diff, want->logits.size(), want->tokens.size(),
      got->tokens == want->tokens ? "equal" : "DIFFERENT", layers_equal, layers,
      static_cast<long>(got->decode_evicted),
      problems.empty() ? "" : "; MISMATCH:", problems.c_str());
  return problems.empty() ? 0 : 1;
}

}  // namespace
}  // namespace dropkv

int main(int argc, char** argv) {
  dropkv::Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--rank")
      a.rank = std::atoi(v.c_str());
    else if (k == "--size")
      a.size = std::atoi(v.c_str());
    else if (k == "--store")
      a.store = v;
    else if (k == "--model")
      a.model = v;
    else if (k == "--exit-at-step")
      a.exit_at_step = std::atoi(v.c_str());
    else if (k == "--device")
      a.device = v;
    else if (k == "--dtype")
      a.dtype = v;
    else if (k == "--random-weights")
      a.random_weights = v == "1";
    else if (k == "--max-logit-diff")
      a.max_logit_diff = std::atof(v.c_str());
  }
  return dropkv::Main(a);
}
