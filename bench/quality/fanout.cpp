#include "bench/quality/fanout.h"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "allocator/block_pool.h"
#include "engine/model/config.h"

namespace dropkv::quality {

FanOutSelector::FanOutSelector(std::vector<std::unique_ptr<KvSelector>> presses, int32_t num_layers)
    : presses_(std::move(presses)),
      kept_(presses_.size(), std::vector<std::optional<at::Tensor>>(num_layers)) {}

absl::StatusOr<std::optional<at::Tensor>> FanOutSelector::Select(const LayerKvView& view) {
  for (size_t i = 0; i < presses_.size(); ++i) {
    auto kept = presses_[i]->Select(view);
    if (!kept.ok()) return kept.status();
    kept_[i].at(view.layer_idx) = std::move(*kept);
  }
  return std::optional<at::Tensor>();
}

int64_t FanOutSelector::num_attention_rows() const {
  int64_t rows = 0;
  for (const auto& p : presses_) rows = std::max(rows, p->num_attention_rows());
  return rows;
}

absl::Status ForkSequence(ModelRunner& runner, SequenceId src, SequenceId dst) {
  BlockPool& pool = runner.pool();
  if (!pool.HasSequence(src)) return absl::NotFoundError(absl::StrCat("unknown sequence ", src));
  // The copy takes the runner's implicit positions (0..stored_len-1) for every global layer, so
  // `src` must not be compacted.
  const ModelConfig& config = runner.config();
  for (int32_t l = 0; l < config.num_layers; ++l) {
    if (!config.is_sliding(l) && pool.stored_len(src, l) != pool.logical_len(src)) {
      return absl::FailedPreconditionError(
          absl::StrCat("ForkSequence: layer ", l, " of sequence ", src, " is compressed"));
    }
  }
  if (absl::Status s = pool.AddSequence(dst); !s.ok()) return s;
  std::vector<int64_t> src_blocks, dst_blocks;
  for (int32_t l = 0; l < pool.num_layers(); ++l) {
    const LayerBlockTable from = pool.table(src, l);
    std::vector<int32_t> none;  // dst's layer is empty: nothing to hand back
    if (absl::Status s = pool.ReplaceLayer(dst, l, from.stored_len, &none); !s.ok()) {
      pool.FreeSequence(dst);
      return s;
    }
    const LayerBlockTable& to = pool.table(dst, l);
    // A ring (sliding layer) holds entries by position modulo its size: block order is layout.
    for (size_t b = 0; b < to.block_ids.size(); ++b) {
      src_blocks.push_back(from.block_ids[b]);
      dst_blocks.push_back(to.block_ids[b]);
    }
  }
  pool.set_logical_len(dst, pool.logical_len(src));
  c10::InferenceMode guard;                 // the caches are inference tensors
  const at::Tensor& kc = pool.key_cache();  // [num_blocks, block_size, Hkv, D]
  const at::Tensor& vc = pool.value_cache();
  auto from = at::tensor(src_blocks, at::kLong).to(kc.device());
  auto to = at::tensor(dst_blocks, at::kLong).to(kc.device());
  for (const at::Tensor* cache : {&kc, &vc}) {
    // As bytes: ATen's CPU index_copy_ has no float8 kernel (kv_cache_dtype: fp8).
    at::Tensor bytes = cache->view(at::kByte);
    bytes.index_copy_(0, to, bytes.index_select(0, from));
  }
  return absl::OkStatus();
}

absl::Status CompactToSelection(ModelRunner& runner, SequenceId seq, const FanOutSelector& fan_out,
                                size_t press_idx) {
  const ModelConfig& config = runner.config();
  for (int32_t l = 0, g = 0; l < config.num_layers; ++l) {
    if (config.is_sliding(l)) continue;
    const std::optional<at::Tensor>& kept = fan_out.kept(press_idx, g++);
    if (!kept) continue;
    if (absl::Status s = runner.CompactLayer(seq, l, *kept); !s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace dropkv::quality
