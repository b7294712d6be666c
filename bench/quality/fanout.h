// One prefill, many presses: the quality harness prefills a prompt once with the full
// cache kept while every configured press (scorer x keep x allocator) selects from the same layer
// views, then gives each press a copy of the full cache compacted to its selection.
//
// Why this equals a compressed prefill (single pass, or the last_chunk policy): during prefill a
// layer's attention always uses the full K/V and only what is stored is compressed, so every
// layer's queries, keys and values, and the last position's logits, are the same with and without
// compression; a press therefore sees the same LayerKvView in both runs and selects the same
// entries. CompactLayer then stores the kept entries as the compressed prefill's StoreKept does.
// The every_chunk and budget policies compress between chunks, which changes what later chunks
// attend to: they are not equivalent and need a prefill of their own.
// tests/quality/passkey_test checks the equivalence (kept positions and the greedy output).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "engine/compression/kv_selector.h"
#include "engine/runner/model_runner.h"

namespace dropkv::quality {

// Every child press sees each layer view; what each selects is recorded, and the runner keeps
// everything (Select returns std::nullopt).
class FanOutSelector final : public KvSelector {
 public:
  FanOutSelector(std::vector<std::unique_ptr<KvSelector>> presses, int32_t num_layers);
  absl::StatusOr<std::optional<at::Tensor>> Select(const LayerKvView& view) override;
  // The most any child asks for.
  int64_t num_attention_rows() const override;
  // What press `press_idx` kept in (compressed) layer `layer_idx` (0..G-1), int64 [Hkv, k];
  // std::nullopt = everything.
  const std::optional<at::Tensor>& kept(size_t press_idx, int32_t layer_idx) const {
    return kept_[press_idx][layer_idx];
  }
  size_t num_presses() const { return presses_.size(); }

 private:
  std::vector<std::unique_ptr<KvSelector>> presses_;
  std::vector<std::vector<std::optional<at::Tensor>>> kept_;  // [press][layer]
};

// A new sequence `dst` holding a copy of every layer of `src` (blocks, stored and logical
// lengths, stored positions; a sliding layer's ring as it lies). All-or-nothing: on
// RESOURCE_EXHAUSTED `dst` does not exist.
absl::Status ForkSequence(ModelRunner& runner, SequenceId src, SequenceId dst);

// Compacts the compressed layers of `seq` to press `press_idx`'s selection in `fan_out`.
absl::Status CompactToSelection(ModelRunner& runner, SequenceId seq, const FanOutSelector& fan_out,
                                size_t press_idx);

}  // namespace dropkv::quality
