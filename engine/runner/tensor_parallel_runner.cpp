#include "engine/runner/tensor_parallel_runner.h"

#include <ATen/ATen.h>

#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/common/status_macros.h"
#include "engine/compression/schema.h"
#include "engine/parallel/communicator.h"

namespace dropkv {
namespace {

// The calls that change a rank's cache, as rank 0 sends them.
enum class Call : int64_t {
  kStop,
  kPrefill,
  kStep,
  kDecode,
  kForkSequence,
  kRelease,
  kSetCudaGraphs,
  kCompactLayer,
};

// A message: plain values and arrays, in the order they are read back.
class Writer {
 public:
  template <typename T>
  void Put(const T& value) {
    static_assert(std::is_trivially_copyable_v<T>);
    bytes_.append(reinterpret_cast<const char*>(&value), sizeof(T));
  }
  template <typename T>
  void PutSpan(std::span<const T> values) {
    Put<int64_t>(static_cast<int64_t>(values.size()));
    bytes_.append(reinterpret_cast<const char*>(values.data()), values.size_bytes());
  }
  void PutString(const std::string& s) { PutSpan(std::span<const char>(s.data(), s.size())); }
  // The schema's encoding: every stored field, so none can be left out here.
  void PutCompression(const CompressionParams& c) { PutString(compression::EncodeCompression(c)); }
  std::string& bytes() { return bytes_; }

 private:
  std::string bytes_;
};

class Reader {
 public:
  explicit Reader(const at::Tensor& bytes)
      : data_(static_cast<const char*>(bytes.data_ptr())), size_(bytes.numel()) {}
  template <typename T>
  T Get() {
    T value{};
    Take(&value, sizeof(T));
    return value;
  }
  template <typename T>
  std::vector<T> GetVector() {
    const int64_t n = Get<int64_t>();
    if (n < 0 || n > size_) {
      ok_ = false;
      return {};
    }
    std::vector<T> values(n);
    Take(values.data(), values.size() * sizeof(T));
    return values;
  }
  std::string GetString() {
    std::vector<char> chars = GetVector<char>();
    return std::string(chars.begin(), chars.end());
  }
  CompressionParams GetCompression() {
    absl::StatusOr<CompressionParams> c = compression::DecodeCompression(GetString());
    if (!c.ok()) {
      ok_ = false;
      return {};
    }
    return *c;
  }
  // Every field read so far was there.
  bool valid() const { return ok_; }
  // All of the message read, no more: a message of another length says rank 0 and this rank
  // were built differently.
  bool ok() const { return ok_ && offset_ == size_; }

 private:
  void Take(void* out, size_t n) {
    if (offset_ + static_cast<int64_t>(n) > size_) {
      ok_ = false;
      return;
    }
    if (n > 0) std::memcpy(out, data_ + offset_, n);
    offset_ += static_cast<int64_t>(n);
  }
  const char* data_;
  int64_t size_;
  int64_t offset_ = 0;
  bool ok_ = true;
};

// One message over the control channel: a header {call, bytes}, then the bytes.
absl::Status Send(Communicator& control, Call call, std::string bytes) {
  at::Tensor header = at::empty({2}, at::kLong);
  header[0] = static_cast<int64_t>(call);
  header[1] = static_cast<int64_t>(bytes.size());
  RETURN_IF_ERROR(control.Broadcast(header, 0));
  if (bytes.empty()) return absl::OkStatus();
  at::Tensor payload = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  std::memcpy(payload.data_ptr(), bytes.data(), bytes.size());
  return control.Broadcast(payload, 0);
}

absl::StatusOr<std::pair<Call, at::Tensor>> Receive(Communicator& control) {
  at::Tensor header = at::zeros({2}, at::kLong);
  RETURN_IF_ERROR(control.Broadcast(header, 0));
  const auto call = static_cast<Call>(header[0].item<int64_t>());
  at::Tensor payload = at::empty({header[1].item<int64_t>()}, at::kByte);
  if (payload.numel() > 0) RETURN_IF_ERROR(control.Broadcast(payload, 0));
  return std::make_pair(call, payload);
}

class LeadingRunner final : public ModelRunner {
 public:
  LeadingRunner(std::unique_ptr<ModelRunner> local, Communicator* control)
      : local_(std::move(local)), control_(control) {}
  ~LeadingRunner() override {
    if (control_ok_) (void)Send(*control_, Call::kStop, {});
  }

  const ModelConfig& config() const override { return local_->config(); }
  BlockPool& pool() override { return local_->pool(); }
  int64_t num_reserved_blocks() const override { return local_->num_reserved_blocks(); }
  compression::KvCacheGeometry cache_geometry() const override { return local_->cache_geometry(); }
  int64_t BlocksToDecode(std::span<const SequenceId> seqs) const override {
    return local_->BlocksToDecode(seqs);
  }
  DecodeHostTimes last_decode_host_times() const override {
    return local_->last_decode_host_times();
  }
  DecodeCompressionStats decode_compression_stats() const override {
    return local_->decode_compression_stats();
  }
  SequenceCacheInfo CacheInfo(SequenceId seq) const override { return local_->CacheInfo(seq); }
  const Model* model() const override { return local_->model(); }
  void SetKvSelectorFactory(KvSelectorFactory factory) override {
    local_->SetKvSelectorFactory(std::move(factory));  // every rank sets its own
  }
  absl::StatusOr<at::Tensor> StoredPositions(SequenceId seq, int32_t layer_idx) const override {
    return local_->StoredPositions(seq, layer_idx);
  }

  absl::StatusOr<at::Tensor> Prefill(SequenceId seq, std::span<const int32_t> chunk,
                                     bool is_last_chunk,
                                     const CompressionParams& compression) override {
    Writer w;
    w.Put(seq);
    w.PutSpan(chunk);
    w.Put(is_last_chunk);
    w.PutCompression(compression);
    RETURN_IF_ERROR(Repeat(Call::kPrefill, w));
    return local_->Prefill(seq, chunk, is_last_chunk, compression);
  }

  absl::StatusOr<at::Tensor> Step(std::span<const SequenceId> decode_seqs,
                                  std::span<const int32_t> decode_tokens,
                                  std::span<const PrefillChunk> chunks) override {
    // The prompt's extra logits would be a vocabulary all-gather the other ranks do not join.
    for (const PrefillChunk& c : chunks)
      if (c.return_prompt_logprobs)
        return absl::UnimplementedError(
            "prompt logprobs are not supported with tensor parallelism");
    Writer w;
    w.PutSpan(decode_seqs);
    w.PutSpan(decode_tokens);
    w.Put<int64_t>(static_cast<int64_t>(chunks.size()));
    for (const PrefillChunk& c : chunks) {
      w.Put(c.seq);
      w.PutSpan(c.tokens);
      w.Put(c.is_last_chunk);
      w.Put(c.compression != nullptr);
      if (c.compression != nullptr) w.PutCompression(*c.compression);
    }
    RETURN_IF_ERROR(Repeat(Call::kStep, w));
    return local_->Step(decode_seqs, decode_tokens, chunks);
  }

  absl::StatusOr<at::Tensor> Decode(std::span<const SequenceId> seqs,
                                    std::span<const int32_t> tokens) override {
    Writer w;
    w.PutSpan(seqs);
    w.PutSpan(tokens);
    RETURN_IF_ERROR(Repeat(Call::kDecode, w));
    return local_->Decode(seqs, tokens);
  }

  absl::Status AdoptPrefix(SequenceId, std::span<const int32_t>,
                           std::span<const std::vector<int32_t>>) override {
    // The blocks are rank 0's prefix cache's; the other ranks keep none (the engine turns the
    // prefix cache off under tensor parallelism).
    return Unrepeated("AdoptPrefix (the prefix cache)");
  }

  absl::Status ForkSequence(SequenceId src, SequenceId dst) override {
    Writer w;
    w.Put(src);
    w.Put(dst);
    RETURN_IF_ERROR(Repeat(Call::kForkSequence, w));
    return local_->ForkSequence(src, dst);
  }

  void Release(SequenceId seq) override {
    Writer w;
    w.Put(seq);
    (void)Repeat(Call::kRelease, w);  // a group that is gone ends the server (group.h)
    local_->Release(seq);
  }

  void SetCudaGraphs(bool on) override {
    Writer w;
    w.Put(on);
    (void)Repeat(Call::kSetCudaGraphs, w);
    local_->SetCudaGraphs(on);
  }

  absl::Status CompactLayer(SequenceId seq, int32_t layer_idx, const at::Tensor& kept) override {
    const at::Tensor k = kept.to(at::kCPU, at::kLong).contiguous();
    Writer w;
    w.Put(seq);
    w.Put(layer_idx);
    w.PutSpan(std::span<const int64_t>(k.sizes().data(), k.sizes().size()));
    w.PutSpan(std::span<const int64_t>(k.data_ptr<int64_t>(), k.numel()));
    RETURN_IF_ERROR(Repeat(Call::kCompactLayer, w));
    return local_->CompactLayer(seq, layer_idx, kept);
  }

  absl::StatusOr<at::Tensor> PrefillWithSelector(SequenceId, std::span<const int32_t>, bool,
                                                 KvSelector*) override {
    return Unrepeated("PrefillWithSelector");
  }
  absl::StatusOr<std::vector<at::Tensor>> CaptureAttentionOutputs(
      std::span<const int32_t>) override {
    return Unrepeated("CaptureAttentionOutputs");
  }

 private:
  absl::Status Repeat(Call call, Writer& message) {
    if (!control_ok_) return absl::UnavailableError("tensor parallelism: the ranks are gone");
    absl::Status sent = Send(*control_, call, std::move(message.bytes()));
    if (!sent.ok()) {
      control_ok_ = false;
      return absl::UnavailableError(
          absl::StrCat("tensor parallelism: the other ranks do not answer: ", sent.message()));
    }
    return absl::OkStatus();
  }
  static absl::Status Unrepeated(const char* call) {
    return absl::UnimplementedError(
        absl::StrCat(call, " under tensor parallelism (tensor_parallel_size > 1)"));
  }

  std::unique_ptr<ModelRunner> local_;
  Communicator* control_;
  bool control_ok_ = true;
};

// Errors a runner returns before it changes anything or meets the other ranks: rank 0's call
// fails the same way on the same state, so the ranks stay equal.
bool LeavesRankUnchanged(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kOk:
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kAlreadyExists:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kUnimplemented:
      return true;
    default:
      return false;
  }
}

absl::Status Follow(ModelRunner& runner, Call call, Reader& r) {
  switch (call) {
    case Call::kPrefill: {
      const auto seq = r.Get<SequenceId>();
      const auto tokens = r.GetVector<int32_t>();
      const bool is_last = r.Get<bool>();
      const CompressionParams compression = r.GetCompression();
      if (!r.ok()) break;
      return runner.Prefill(seq, tokens, is_last, compression).status();
    }
    case Call::kStep: {
      const auto seqs = r.GetVector<SequenceId>();
      const auto tokens = r.GetVector<int32_t>();
      const auto num_chunks = r.Get<int64_t>();
      std::vector<std::vector<int32_t>> chunk_tokens;
      std::vector<CompressionParams> compressions;
      std::vector<PrefillChunk> chunks;
      for (int64_t i = 0; i < num_chunks && r.valid(); ++i) {
        PrefillChunk c;
        c.seq = r.Get<SequenceId>();
        chunk_tokens.push_back(r.GetVector<int32_t>());
        c.is_last_chunk = r.Get<bool>();
        compressions.push_back(r.Get<bool>() ? r.GetCompression() : CompressionParams{});
        chunks.push_back(c);
      }
      if (!r.ok()) break;
      for (size_t i = 0; i < chunks.size(); ++i) {  // the vectors no longer move
        chunks[i].tokens = chunk_tokens[i];
        chunks[i].compression = &compressions[i];
      }
      return runner.Step(seqs, tokens, chunks).status();
    }
    case Call::kDecode: {
      const auto seqs = r.GetVector<SequenceId>();
      const auto tokens = r.GetVector<int32_t>();
      if (!r.ok()) break;
      return runner.Decode(seqs, tokens).status();
    }
    case Call::kForkSequence: {
      const auto src = r.Get<SequenceId>();
      const auto dst = r.Get<SequenceId>();
      if (!r.ok()) break;
      return runner.ForkSequence(src, dst);
    }
    case Call::kRelease: {
      const auto seq = r.Get<SequenceId>();
      if (!r.ok()) break;
      runner.Release(seq);
      return absl::OkStatus();
    }
    case Call::kSetCudaGraphs: {
      const bool on = r.Get<bool>();
      if (!r.ok()) break;
      runner.SetCudaGraphs(on);
      return absl::OkStatus();
    }
    case Call::kCompactLayer: {
      const auto seq = r.Get<SequenceId>();
      const auto layer = r.Get<int32_t>();
      auto sizes = r.GetVector<int64_t>();
      auto kept = r.GetVector<int64_t>();
      if (!r.ok()) break;
      at::Tensor t = at::tensor(kept, at::kLong).view(sizes);
      return runner.CompactLayer(seq, layer, t);
    }
    case Call::kStop:
      return absl::OkStatus();
  }
  return absl::InternalError(absl::StrCat("tensor parallelism: rank 0's call ",
                                          static_cast<int64_t>(call),
                                          " did not parse (are all ranks the same build?)"));
}

}  // namespace

std::unique_ptr<ModelRunner> LeadTensorParallelRanks(std::unique_ptr<ModelRunner> local,
                                                     Communicator* control) {
  return std::make_unique<LeadingRunner>(std::move(local), control);
}

absl::Status FollowRankZero(ModelRunner& runner, Communicator& control) {
  while (true) {
    auto message = Receive(control);
    if (!message.ok()) {
      return absl::UnavailableError(
          absl::StrCat("tensor parallelism: rank 0 is gone: ", message.status().message()));
    }
    auto& [call, bytes] = *message;
    if (call == Call::kStop) return absl::OkStatus();
    Reader reader(bytes);
    absl::Status status = Follow(runner, call, reader);
    if (!LeavesRankUnchanged(status)) {
      return absl::InternalError(absl::StrCat("tensor parallelism: rank ", control.rank(),
                                              " failed in a way that may leave its shard "
                                              "unlike rank 0's: ",
                                              status.ToString()));
    }
  }
}

}  // namespace dropkv
