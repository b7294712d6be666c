#include "engine/model/model.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/common/status_macros.h"
#include "engine/model/attention.h"
#include "engine/model/fp8.h"
#include "engine/model/log.h"
#include "engine/model/safetensors.h"
#include "engine/parallel/communicator.h"
#include "kernels/cpu_gemv.h"
#include "kernels/fused_gemv.h"
#include "kernels/fused_ops.h"

namespace dropkv {
namespace {

// One row of a family's weight table: the Hugging Face name, the shape config.json implies, and
// where it goes.
struct WeightSpec {
  std::string hf_name;
  std::vector<int64_t> shape;
  at::Tensor* dst;
  bool required = true;
  at::Tensor* scale = nullptr;  // projections: where FP8 scales go (they alone may be FP8)
  // Tensor parallelism: this rank keeps [shard_begin, shard_begin + shard_len) along shard_dim
  // (0: output rows, column-parallel; 1: input columns, row-parallel); -1: the whole tensor.
  int shard_dim = -1;
  int64_t shard_begin = 0;
  int64_t shard_len = 0;
};

// The rank's shard of a tensor read or drawn whole (contiguous: the full one can go).
at::Tensor ShardOf(const at::Tensor& t, const WeightSpec& spec) {
  if (spec.shard_dim < 0) return t;
  return t.narrow(spec.shard_dim, spec.shard_begin, spec.shard_len).contiguous();
}

// The FP8 scales [out, G] of a sharded projection: rows with the weight's rows; per-channel
// scales (G = 1) stay whole for a column shard, block scales take the blocks of its columns.
absl::StatusOr<at::Tensor> ShardScales(const at::Tensor& s, const WeightSpec& spec,
                                       int64_t group_k) {
  if (spec.shard_dim == 0) return ShardOf(s, spec);
  if (spec.shard_dim != 1 || s.size(1) == 1) return s;
  if (group_k <= 0 || spec.shard_begin % group_k != 0 || spec.shard_len % group_k != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor_parallel_size: tensor '", spec.hf_name, "' has FP8 scale blocks of ", group_k,
        " columns, which do not divide this rank's ", spec.shard_len, " columns"));
  }
  return s.narrow(1, spec.shard_begin / group_k, spec.shard_len / group_k).contiguous();
}

std::string ShapeStr(at::IntArrayRef s) {
  return absl::StrCat("[", absl::StrJoin(s, ", "), "]");
}

int64_t CeilDiv(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// The fp32 scales [out, G] of the FP8 projection `weight_name` (shape [out, in]) as fp8.h lays
// them out, from the tensor config.json's quantization_config names. Block checkpoints set
// *group_k to their block_k.
absl::StatusOr<at::Tensor> ReadFp8Scales(const SafetensorsFolder& folder, const ModelConfig& c,
                                         const std::string& weight_name,
                                         const std::vector<int64_t>& shape, int64_t* group_k) {
  const int64_t out = shape[0], in = shape[1];
  std::string name;
  switch (c.checkpoint_quant) {
    case CheckpointQuantMethod::kNone:
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor '", weight_name, "' is FP8 but config.json has no quantization_config"));
    case CheckpointQuantMethod::kFp8:
      name = weight_name + "_scale_inv";
      break;
    case CheckpointQuantMethod::kCompressedTensors:
      name = weight_name + "_scale";
      break;
  }
  const SafetensorsFile* file = folder.Find(name);
  if (file == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("tensor '", name, "' (the scales of FP8 '", weight_name, "') is missing"));
  }
  ASSIGN_OR_RETURN(at::Tensor s, file->Read(name));
  s = s.to(at::kFloat);
  if (c.checkpoint_quant == CheckpointQuantMethod::kFp8 && !c.fp8_block.empty()) {
    const int64_t bn = c.fp8_block[0], bk = c.fp8_block[1];
    const std::vector<int64_t> want = {CeilDiv(out, bn), CeilDiv(in, bk)};
    if (s.sizes().vec() != want) {
      return absl::InvalidArgumentError(absl::StrCat(
          file->path(), ": tensor '", name, "' has shape ", ShapeStr(s.sizes()), ", ",
          ShapeStr(shape), " in blocks of [", bn, ", ", bk, "] implies ", ShapeStr(want)));
    }
    if (want[1] > 1) {
      if (*group_k != 0 && *group_k != bk) {
        return absl::InvalidArgumentError(
            absl::StrCat(file->path(), ": tensor '", name, "': a second block size ", bk));
      }
      *group_k = bk;
    }
    return s.repeat_interleave(bn, 0).narrow(0, 0, out).contiguous();  // [out, G]
  }
  // Per output channel ([out] or [out, 1]) or one scale for the tensor.
  if (s.numel() == out && (s.dim() == 1 || (s.dim() == 2 && s.size(1) == 1)))
    return s.reshape({out, 1}).contiguous();
  if (s.numel() == 1) return s.reshape({1, 1}).expand({out, 1}).contiguous();
  return absl::InvalidArgumentError(absl::StrCat(
      file->path(), ": tensor '", name, "' has shape ", ShapeStr(s.sizes()), "; the scales of ",
      ShapeStr(shape), " are [", out, ", 1] (per channel) or [1] (per tensor)"));
}

// oneDNN's linear over a weight reordered once at load into its blocked layout. On this
// project's x86 CPUs it is 1.4-1.9x faster than at::linear (MKL's GEMM re-packs the weight in
// every call) at 1..128 rows. Reached through the dispatcher: the ops live in torch's `mkldnn`
// library, not in the generated at:: API. Absent or failing ops leave the weights as they are.
struct OneDnnLinearOps {
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, std::optional<int64_t>)> reorder;
  c10::TypedOperatorHandle<at::Tensor(
      const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::string_view,
      c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>)>
      linear;
};

const OneDnnLinearOps* OneDnnOps() {
  static const std::optional<OneDnnLinearOps> ops = []() -> std::optional<OneDnnLinearOps> {
    try {
      auto& d = c10::Dispatcher::singleton();
      return OneDnnLinearOps{
          d.findSchemaOrThrow("mkldnn::_reorder_linear_weight", "")
              .typed<at::Tensor(const at::Tensor&, std::optional<int64_t>)>(),
          d.findSchemaOrThrow("mkldnn::_linear_pointwise", "")
              .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                                const std::optional<at::Tensor>&, c10::string_view,
                                c10::List<std::optional<at::Scalar>>,
                                std::optional<c10::string_view>)>()};
    } catch (const std::exception&) {
      return std::nullopt;
    }
  }();
  return ops ? &*ops : nullptr;
}

// x [N, in] @ w^T (+ b): w is a plain [out, in] tensor or a oneDNN-packed one. A decode step's
// few rows against a plain fp32 weight on the CPU go to kernels::CpuGemv, which reads w once
// (ATen's GEMM copies it into its packed layout on every call from 2 rows on).
at::Tensor Linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  if (w.is_mkldnn()) {
    return OneDnnOps()->linear.call(x, w, b.defined() ? std::optional<at::Tensor>(b) : std::nullopt,
                                    "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
  }
  if (kernels::CpuGemvApplies(x, w)) {
    auto y = kernels::CpuGemv(x, w, b);
    if (y.ok()) return *std::move(y);
    throw std::runtime_error(y.status().ToString());  // Forward turns it into its status
  }
  return at::linear(x, w, b);
}

// The fused GEMVs read x in 16-byte pieces: the backend's attention output must allow it.
bool RowsAligned16(const at::Tensor& t) {
  return t.stride(1) == 1 && (t.stride(0) * t.element_size()) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

// The most rows the decode GEMV takes over weight w (x in x_dtype); 0: none. FP8 weights: K a
// multiple of 16, at most 8 rows, where the FP8 GEMM catches up (Llama-3.1-8B on the H200 at 8
// rows: the four projections 132 us a layer through the GEMV, 130 us through the GEMM; at 16, 154
// against 134; docs/benchmarks.md).
int64_t GemvMaxRows(const at::Tensor& w, at::ScalarType x_dtype) {
  constexpr int64_t kFp8GemvMaxRows = 8;
  const int64_t fits = kernels::FusedGemvMaxRows(w.size(1), x_dtype);
  if (!IsFp8(w)) return fits;
  return w.size(1) % 16 == 0 ? std::min(fits, kFp8GemvMaxRows) : 0;
}

// Linear with a weight that may be FP8 (scale defined). On CUDA, forwards the decode GEMV takes
// read the FP8 weight as it is (kernels::Gemv: exact e4m3 values, fp32 sums, the row's scale
// once), larger ones the FP8 GEMM with per-token activation scales (fp8.h). Everything else
// (the CPU, block scales) dequantizes to x's dtype and runs the linear a plain weight gets: the
// logits are then those of the weights w8 * scale exactly (up to the activation dtype's rounding),
// which is what the CPU measures against the full model and HF, and what the GPU paths are tested
// against.
at::Tensor LinearMaybeFp8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                          int64_t group_k, const at::Tensor& b) {
  if (!scale.defined()) return Linear(x, w, b);
  if (x.is_cuda() && x.dim() == 2 && scale.size(1) == 1 &&
      x.size(0) <= GemvMaxRows(w, x.scalar_type()) && RowsAligned16(x)) {
    if (auto y = kernels::Gemv(x, w, b, scale); y.ok()) return *std::move(y);
  }
  if (auto y = Fp8ScaledMm(x, w, scale, b)) return *std::move(y);
  return Linear(x, DequantizeFp8(w, scale, group_k).to(x.scalar_type()), b);
}

at::Tensor RotateHalf(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

}  // namespace

at::Tensor RopeInvFreq(const RopeParams& rope, int64_t head_dim, int64_t seq_len) {
  const int64_t d = head_dim;
  double base = rope.theta;
  if (rope.type == RopeType::kDynamic && seq_len > rope.original_max_position_embeddings) {
    // transformers' _compute_dynamic_ntk_parameters.
    const double f = rope.factor;
    const double orig = static_cast<double>(rope.original_max_position_embeddings);
    base = base * std::pow(f * static_cast<double>(seq_len) / orig - (f - 1),
                           static_cast<double>(d) / (d - 2));
  }
  auto exponents = at::arange(0, d, 2, at::kLong).to(at::kFloat) / static_cast<double>(d);
  at::Tensor inv_freq = 1.0 / at::pow(base, exponents);  // fp32 [D/2]
  if (rope.type == RopeType::kLinear) inv_freq = inv_freq / rope.factor;
  if (rope.type == RopeType::kYarn) {
    // transformers' _compute_yarn_parameters: interpolated frequencies (1 / (factor * base^e))
    // below the correction range, extrapolated ones (the plain frequencies) above it, a linear
    // ramp between. Its attention factor is in ModelConfig::attention_scale.
    const double orig = static_cast<double>(rope.original_max_position_embeddings);
    auto correction_dim = [&](double rotations) {
      return d * std::log(orig / (rotations * 2 * M_PI)) / (2 * std::log(base));
    };
    double low = correction_dim(rope.beta_fast);
    double high = correction_dim(rope.beta_slow);
    if (rope.truncate) {
      low = std::floor(low);
      high = std::ceil(high);
    }
    low = std::max(low, 0.0);
    high = std::min(high, static_cast<double>(d - 1));
    if (low == high) high += 0.001;
    auto ramp = ((at::arange(d / 2, at::kFloat) - low) / (high - low)).clamp(0, 1);
    auto extrapolation_factor = 1 - ramp;
    auto pos_freqs = at::pow(base, exponents);
    inv_freq = (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation_factor) +
               (1.0 / pos_freqs) * extrapolation_factor;
  }
  if (rope.type == RopeType::kLlama3) {
    // transformers' _compute_llama3_parameters, op for op.
    const double factor = rope.factor;
    const double low = rope.low_freq_factor;
    const double high = rope.high_freq_factor;
    const double old_len = static_cast<double>(rope.original_max_position_embeddings);
    const double low_freq_wavelen = old_len / low;
    const double high_freq_wavelen = old_len / high;
    auto wavelen = 2 * M_PI / inv_freq;
    auto inv_freq_llama = at::where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq);
    auto smooth = (old_len / wavelen - low) / (high - low);
    auto smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama;
    auto is_medium = (wavelen >= high_freq_wavelen).logical_and(wavelen <= low_freq_wavelen);
    inv_freq = at::where(is_medium, smoothed, inv_freq_llama);
  }
  return inv_freq;
}

absl::StatusOr<at::Tensor> FullAttentionBackend::Attend(int32_t layer_idx, const at::Tensor& q,
                                                        const at::Tensor& k, const at::Tensor& v) {
  return PrefillAttentionWithLse(q, k.transpose(0, 1), v.transpose(0, 1),
                                 config_.attention_scale(layer_idx), PrefillAttentionImpl::kAuto,
                                 LimitsOf(config_, layer_idx))
      .out;
}

Model::~Model() = default;
at::Device Model::device() const {
  return embed_.device();
}

absl::StatusOr<std::unique_ptr<Model>> Model::Load(const std::string& model_dir,
                                                   const ModelConfig& c, at::Device device,
                                                   at::ScalarType dtype, WeightQuantization quant,
                                                   Communicator* comm) {
  return LoadOrDraw(model_dir, c, device, dtype, std::nullopt, quant, comm);
}

absl::StatusOr<std::unique_ptr<Model>> Model::CreateRandom(const ModelConfig& c, at::Device device,
                                                           at::ScalarType dtype, uint64_t seed,
                                                           WeightQuantization quant,
                                                           Communicator* comm) {
  return LoadOrDraw("", c, device, dtype, seed, quant, comm);
}

bool Model::fp8_weights() const {
  return !layers_.empty() && IsFp8(layers_.front().qkv_w);
}

void Model::PackForCpu() {
  if (dtype_ != at::kFloat || !embed_.is_cpu() || OneDnnOps() == nullptr) return;
  try {
    // Check the packed op against at::linear once before trusting it with every weight. FP8
    // projections stay as they are (dequantized per call), so then only an untied head is packed.
    const bool tied = lm_head_.is_same(embed_);
    if (fp8_weights() && tied) return;
    const at::Tensor& probe_w = fp8_weights() ? lm_head_ : layers_.front().qkv_w;
    const at::Tensor& probe_b = fp8_weights() ? at::Tensor() : layers_.front().qkv_b;
    const int64_t in = probe_w.size(1);
    auto probe = at::arange(3 * in, at::kFloat).reshape({3, in}).sin();  // no RNG draw
    auto want = at::linear(probe, probe_w, probe_b);
    auto got = Linear(probe, OneDnnOps()->reorder.call(probe_w, std::nullopt), probe_b);
    if (!at::allclose(got, want, 1e-4, 1e-5)) {
      LogWarn("model: oneDNN packed linear disagrees with at::linear; weights stay unpacked");
      return;
    }
    // Small matrices lose: oneDNN's fixed cost per call outweighs the packing (stories260K's
    // 64 x 64 projections run 1.3-1.7x slower packed); from about 4 MB of weights it wins.
    constexpr int64_t kMinPackedElements = int64_t{1} << 20;
    auto pack = [&](at::Tensor* w) {
      if (w->numel() < kMinPackedElements || IsFp8(*w)) return;
      *w = OneDnnOps()->reorder.call(*w, std::nullopt);
      ++num_packed_weights_;
    };
    for (Layer& l : layers_) {
      for (at::Tensor* w : {&l.qkv_w, &l.o_w, &l.gate_up_w, &l.down_w}) pack(w);
    }
    // A tied head stays as it is: packing it would hold a second copy of the embedding.
    if (!tied) pack(&lm_head_);
    if (num_packed_weights_ > 0) {
      LogInfo(absl::StrCat("model: ", num_packed_weights_, " weights packed for oneDNN's linear"));
    }
  } catch (const std::exception& e) {
    LogWarn(absl::StrCat("model: packing weights for oneDNN failed (", e.what(),
                         "); a partly packed model still works, each weight picks its path"));
  }
}

void Model::FuseProjections(Layer& l) {
  // Scales concatenate along the output dimension like their weights; a group of FP8 and plain
  // weights (or of different scale grids) cannot share one GEMM.
  auto fuse_scales = [](std::initializer_list<const at::Tensor*> ws,
                        std::initializer_list<const at::Tensor*> ss) -> at::Tensor {
    const bool fp8 = IsFp8(**ws.begin());
    std::vector<at::Tensor> scales;
    for (const at::Tensor* w : ws) {
      if (IsFp8(*w) != fp8)
        throw std::invalid_argument("projections fused into one GEMM mix FP8 and plain weights");
    }
    if (!fp8) return at::Tensor();
    for (const at::Tensor* s : ss) {
      if (s->size(1) != (*ss.begin())->size(1))
        throw std::invalid_argument("projections fused into one GEMM have different scale grids");
      scales.push_back(*s);
    }
    return at::cat(scales, 0);
  };
  l.qkv_s = fuse_scales({&l.q_w, &l.k_w, &l.v_w}, {&l.q_s, &l.k_s, &l.v_s});
  l.gate_up_s = fuse_scales({&l.gate_w, &l.up_w}, {&l.gate_s, &l.up_s});
  // Biases: all of q/k/v have one or none (Qwen2 and Llama attention_bias set all three).
  l.qkv_w = at::cat({l.q_w, l.k_w, l.v_w}, 0);
  if (l.q_b.defined()) l.qkv_b = at::cat({l.q_b, l.k_b, l.v_b}, 0);
  l.gate_up_w = at::cat({l.gate_w, l.up_w}, 0);
  if (l.gate_b.defined()) l.gate_up_b = at::cat({l.gate_b, l.up_b}, 0);
  for (at::Tensor* t : {&l.q_w, &l.k_w, &l.v_w, &l.q_b, &l.k_b, &l.v_b, &l.gate_w, &l.up_w,
                        &l.gate_b, &l.up_b, &l.q_s, &l.k_s, &l.v_s, &l.gate_s, &l.up_s}) {
    *t = at::Tensor();
  }
}

absl::StatusOr<std::unique_ptr<Model>> Model::LoadOrDraw(
    const std::string& model_dir, const ModelConfig& c, at::Device device, at::ScalarType dtype,
    std::optional<uint64_t> random_seed, WeightQuantization quant, Communicator* comm) {
  ASSIGN_OR_RETURN(const TensorParallelLayout tp,
                   comm == nullptr ? PlanTensorParallel(c, 0, 1)
                                   : PlanTensorParallel(c, comm->rank(), comm->size()));
  std::unique_ptr<Model> m(new Model(tp, dtype, comm));
  std::unique_ptr<SafetensorsFolder> folder;
  if (!random_seed) {
    ASSIGN_OR_RETURN(folder, SafetensorsFolder::Open(model_dir));
  }
  const int64_t h = c.hidden_size;
  const int64_t inter = c.intermediate_size;
  m->layers_.resize(c.num_layers);
  // The weight table. Every family shares HF's Llama naming; they differ in which biases exist
  // (Qwen2: q/k/v), whether lm_head is stored (tied: not), q/k norms (Qwen3, Gemma 3) and the
  // norms around attention and MLP (Gemma 2/3: post_attention_layernorm is on the attention
  // output and pre_feedforward_layernorm before the MLP).
  std::vector<WeightSpec> table;
  // This rank's slices (the whole tensors at one rank): query and KV head rows, MLP columns,
  // vocabulary rows.
  const ModelConfig& shard = tp.shard;
  const int64_t q_begin = int64_t{tp.q_head_begin} * c.head_dim, q_len = shard.q_size();
  const int64_t kv_begin = int64_t{tp.kv_head_begin} * c.head_dim, kv_len = shard.kv_size();
  const int64_t inter_begin = tp.inter_begin, inter_len = shard.intermediate_size;
  auto sharded = [&](WeightSpec spec, int dim, int64_t begin, int64_t len) {
    if (tp.size > 1) {
      spec.shard_dim = dim;
      spec.shard_begin = begin;
      spec.shard_len = len;
    }
    table.push_back(std::move(spec));
  };
  sharded({"model.embed_tokens.weight", {c.vocab_size, h}, &m->embed_}, 0, tp.vocab_begin,
          tp.vocab_rows);
  table.push_back({"model.norm.weight", {h}, &m->final_norm_});
  sharded({"lm_head.weight", {c.vocab_size, h}, &m->lm_head_, !c.tie_word_embeddings}, 0,
          tp.vocab_begin, tp.vocab_rows);
  for (int32_t i = 0; i < c.num_layers; ++i) {
    Layer& l = m->layers_[i];
    const std::string p = absl::StrCat("model.layers.", i, ".");
    table.push_back({p + "input_layernorm.weight", {h}, &l.input_norm});
    if (c.sandwich_norms) {
      table.push_back({p + "post_attention_layernorm.weight", {h}, &l.attn_out_norm});
      table.push_back({p + "pre_feedforward_layernorm.weight", {h}, &l.post_norm});
      table.push_back({p + "post_feedforward_layernorm.weight", {h}, &l.mlp_out_norm});
    } else {
      table.push_back({p + "post_attention_layernorm.weight", {h}, &l.post_norm});
    }
    if (c.qk_norm) {
      table.push_back({p + "self_attn.q_norm.weight", {c.head_dim}, &l.q_norm});
      table.push_back({p + "self_attn.k_norm.weight", {c.head_dim}, &l.k_norm});
    }
    // Column-parallel (output rows): q, k, v, gate, up; row-parallel (input columns): o, down,
    // whose biases are added once after the all-reduce.
    sharded({p + "self_attn.q_proj.weight", {c.q_size(), h}, &l.q_w, true, &l.q_s}, 0, q_begin,
            q_len);
    sharded({p + "self_attn.k_proj.weight", {c.kv_size(), h}, &l.k_w, true, &l.k_s}, 0, kv_begin,
            kv_len);
    sharded({p + "self_attn.v_proj.weight", {c.kv_size(), h}, &l.v_w, true, &l.v_s}, 0, kv_begin,
            kv_len);
    sharded({p + "self_attn.o_proj.weight", {h, c.q_size()}, &l.o_w, true, &l.o_s}, 1, q_begin,
            q_len);
    sharded({p + "mlp.gate_proj.weight", {inter, h}, &l.gate_w, true, &l.gate_s}, 0, inter_begin,
            inter_len);
    sharded({p + "mlp.up_proj.weight", {inter, h}, &l.up_w, true, &l.up_s}, 0, inter_begin,
            inter_len);
    sharded({p + "mlp.down_proj.weight", {h, inter}, &l.down_w, true, &l.down_s}, 1, inter_begin,
            inter_len);
    if (c.attention_bias) {
      sharded({p + "self_attn.q_proj.bias", {c.q_size()}, &l.q_b}, 0, q_begin, q_len);
      sharded({p + "self_attn.k_proj.bias", {c.kv_size()}, &l.k_b}, 0, kv_begin, kv_len);
      sharded({p + "self_attn.v_proj.bias", {c.kv_size()}, &l.v_b}, 0, kv_begin, kv_len);
      if (c.family != ModelFamily::kQwen2)
        table.push_back({p + "self_attn.o_proj.bias", {h}, &l.o_b});
    }
    if (c.mlp_bias) {
      sharded({p + "mlp.gate_proj.bias", {inter}, &l.gate_b}, 0, inter_begin, inter_len);
      sharded({p + "mlp.up_proj.bias", {inter}, &l.up_b}, 0, inter_begin, inter_len);
      table.push_back({p + "mlp.down_proj.bias", {h}, &l.down_b});
    }
  }
  try {
    if (random_seed) {
      // Benchmarks at real geometry with nothing downloaded: every stored tensor drawn on the
      // device from normal(0, 0.02), the same init the HF peer gets.
      auto gen = at::make_generator<at::CPUGeneratorImpl>(*random_seed);
      if (device.is_cuda()) at::manual_seed(*random_seed);
      for (const auto& spec : table) {
        if (!spec.required) continue;
        at::Tensor t = at::empty(spec.shape, at::TensorOptions().device(device).dtype(dtype));
        if (device.is_cuda())
          t.normal_(0.0, 0.02);
        else
          t.normal_(0.0, 0.02, gen);
        *spec.dst = ShardOf(t, spec);
      }
      table.clear();
    }
    for (const auto& spec : table) {
      const SafetensorsFile* file = folder->Find(spec.hf_name);
      if (file == nullptr) {
        if (!spec.required) continue;
        std::vector<std::string> files;
        for (const auto& f : folder->files()) files.push_back(f->path());
        return absl::NotFoundError(absl::StrCat("tensor '", spec.hf_name, "' is missing from ",
                                                absl::StrJoin(files, ", ")));
      }
      const auto& entry = file->entries().at(spec.hf_name);
      if (entry.shape != spec.shape) {
        return absl::InvalidArgumentError(
            absl::StrCat(file->path(), ": tensor '", spec.hf_name, "' has shape ",
                         ShapeStr(entry.shape), ", config.json implies ", ShapeStr(spec.shape)));
      }
      ASSIGN_OR_RETURN(at::Tensor t, file->Read(spec.hf_name));
      if (IsFp8(t)) {
        if (spec.scale == nullptr) {
          return absl::InvalidArgumentError(
              absl::StrCat(file->path(), ": tensor '", spec.hf_name,
                           "' is FP8; only the projection weights may be"));
        }
        ASSIGN_OR_RETURN(at::Tensor scales,
                         ReadFp8Scales(*folder, c, spec.hf_name, spec.shape, &m->fp8_group_k_));
        ASSIGN_OR_RETURN(scales, ShardScales(scales, spec, m->fp8_group_k_));
        *spec.dst = ShardOf(t, spec).to(device);
        *spec.scale = scales.to(device);
        continue;
      }
      *spec.dst = ShardOf(t, spec).to(device, dtype);
    }
    if (quant == WeightQuantization::kFp8) {
      for (auto& l : m->layers_) {
        for (auto [w, s] : {std::pair{&l.q_w, &l.q_s},
                            {&l.k_w, &l.k_s},
                            {&l.v_w, &l.v_s},
                            {&l.o_w, &l.o_s},
                            {&l.gate_w, &l.gate_s},
                            {&l.up_w, &l.up_s},
                            {&l.down_w, &l.down_s}}) {
          if (!IsFp8(*w)) std::tie(*w, *s) = QuantizeFp8PerChannel(*w);
        }
      }
    }
    if (!m->lm_head_.defined()) m->lm_head_ = m->embed_;
    if (c.gemma_norms()) {
      // Gemma's RMSNorm multiplies by (1 + w) in fp32; fold the 1 in once.
      auto fold = [&](at::Tensor* w) {
        if (w->defined()) *w = w->to(at::kFloat) + 1.0;
      };
      fold(&m->final_norm_);
      for (auto& l : m->layers_) {
        for (at::Tensor* w :
             {&l.input_norm, &l.post_norm, &l.attn_out_norm, &l.mlp_out_norm, &l.q_norm, &l.k_norm})
          fold(w);
      }
    }
    for (auto& l : m->layers_) FuseProjections(l);
    m->inv_freq_ =
        RopeInvFreq(c.rope, c.head_dim, c.rope.original_max_position_embeddings).to(device);
    m->inv_freq_local_ =
        RopeInvFreq(c.rope_local, c.head_dim, c.rope_local.original_max_position_embeddings)
            .to(device);
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(model_dir, ": loading weights failed: ", e.what()));
  }
  LogInfo(absl::StrCat("model: loaded ", c.model_type, " (", c.num_layers, " layers, hidden ",
                       c.hidden_size, ", heads ", c.num_heads, "/", c.num_kv_heads, ", head_dim ",
                       c.head_dim, ") on ", device.str(), " as ", c10::toString(dtype),
                       m->fp8_weights() ? ", projections in FP8 e4m3" : "",
                       tp.size > 1
                           ? absl::StrCat(", tensor-parallel rank ", tp.rank, " of ", tp.size,
                                          " (heads ", shard.num_heads, "/", shard.num_kv_heads, ")")
                           : ""));
  return m;
}

at::Tensor Model::Norm(const at::Tensor& x, const at::Tensor& w) const {
  const bool gemma = config_.gemma_norms();
  if (!gemma && (x.is_cuda() || x.scalar_type() == at::kFloat)) {
    // One fused kernel (fp32 inside) instead of seven: decode launches ~2 per layer instead of
    // ~16. In bf16 it skips HF's rounding of the normed value before the weight (< 1 bf16 ulp);
    // bf16 on the CPU keeps HF's exact rounding below (the CPU bf16 parity test).
    return at::rms_norm(x, {x.size(-1)}, w, config_.rms_norm_eps);
  }
  auto xf = x.to(at::kFloat);
  auto normed = xf * at::rsqrt(xf.pow(2).mean(-1, true) + config_.rms_norm_eps);
  if (gemma) return (normed * w).to(x.scalar_type());  // w = 1 + w, fp32
  return w * normed.to(x.scalar_type());  // Llama: cast back before the weight, as HF does
}

bool Model::uses_fused_ops(const at::Tensor& x) const {
  return fused_cuda_ops_ && x.is_cuda() && kernels::FusedOpsBuilt();
}

Model::GemvPlan Model::PlanGemvs(const at::Tensor& x, bool fused) const {
  GemvPlan plan;
  const int64_t n = x.size(0);
  // Plain weights: bs1 decode only (from 2 rows cuBLAS is as fast or faster, docs/benchmarks.md).
  // FP8 weights: every forward the GEMV takes (GemvMaxRows; larger ones take the FP8 GEMM,
  // LinearMaybeFp8). Per-channel scales only.
  const bool fp8 = fp8_weights();
  if (!fused_gemv_ || !fused || !kernels::FusedGemvBuilt() || (n > 1 && !fp8)) return plan;
  const Layer& l = layers_.front();
  if (fp8 && l.qkv_s.size(1) != 1) return plan;
  auto fits = [&](const at::Tensor& w) { return n <= GemvMaxRows(w, x.scalar_type()); };
  plan.qkv = fits(l.qkv_w);
  plan.o = fits(l.o_w);
  plan.gate_up = fits(l.gate_up_w);
  plan.down = fits(l.down_w);
  return plan;
}

absl::StatusOr<at::Tensor> Model::AddNorm(at::Tensor& x, const at::Tensor& delta,
                                          const at::Tensor& w, bool fused) const {
  if (fused) return kernels::AddRmsNorm(x, delta, w, config_.rms_norm_eps);
  if (delta.defined()) x = x + delta;
  return Norm(x, w);
}

at::Tensor Model::RopeFrequencies(const RopeParams& rope, const at::Tensor& cached,
                                  int64_t max_position) const {
  if (rope.type == RopeType::kDynamic && max_position + 1 > rope.original_max_position_embeddings) {
    return RopeInvFreq(rope, config_.head_dim, max_position + 1).to(cached.device());
  }
  return cached;
}

Model::Rope Model::MakeRope(const RopeParams& params, const at::Tensor& cached,
                            const at::Tensor& positions, int64_t max_position, bool fused) const {
  Rope rope;
  rope.positions = positions;
  at::Tensor inv_freq = RopeFrequencies(params, cached, max_position);
  if (fused) {
    rope.inv_freq = inv_freq;
    return rope;
  }
  auto freqs = positions.to(at::kFloat).unsqueeze(1) * inv_freq.unsqueeze(0);  // [N, D/2]
  auto emb = at::cat({freqs, freqs}, -1);                                      // [N, D]
  rope.cos_h = emb.cos().to(dtype_).unsqueeze(1);                              // [N, 1, D]
  rope.sin_h = emb.sin().to(dtype_).unsqueeze(1);
  return rope;
}

void Model::NormQk(const at::Tensor& qkv, const Layer& l) const {
  const auto& c = config_;
  const int64_t n = qkv.size(0);
  auto q = qkv.narrow(1, 0, c.q_size()).view({n, c.num_heads, c.head_dim});
  auto k = qkv.narrow(1, c.q_size(), c.kv_size()).view({n, c.num_kv_heads, c.head_dim});
  q.copy_(Norm(q, l.q_norm));
  k.copy_(Norm(k, l.k_norm));
}

absl::StatusOr<Model::QkvHeads> Model::SplitHeads(const at::Tensor& qkv, const Rope& rope,
                                                  bool fused, int32_t layer_idx,
                                                  AttentionBackend& backend) const {
  const auto& c = config_;
  const int64_t n = qkv.size(0);
  QkvHeads heads;
  if (c.qk_norm) NormQk(qkv, layers_[layer_idx]);
  if (fused) {
    const kernels::QkvGeometry geo{c.num_heads, c.num_kv_heads, c.head_dim};
    if (auto dst = backend.kv_slots(layer_idx)) {
      // Decode: K and V go straight into their cache slots; only q comes back.
      ASSIGN_OR_RETURN(heads.q, kernels::RopeWriteKv(qkv, geo, rope.positions, rope.inv_freq,
                                                     dst->key_cache, dst->value_cache, dst->slots));
      return heads;
    }
    ASSIGN_OR_RETURN(std::tie(heads.q, heads.k, heads.v),
                     kernels::RopeSplitQkv(qkv, geo, rope.positions, rope.inv_freq));
    return heads;
  }
  // RoPE on q and k together (one set of elementwise kernels): [N, Hq + Hkv, D].
  auto qk = qkv.narrow(1, 0, c.q_size() + c.kv_size())
                .view({n, c.num_heads + c.num_kv_heads, c.head_dim});
  qk = qk * rope.cos_h + RotateHalf(qk) * rope.sin_h;
  heads.q = qk.narrow(1, 0, c.num_heads);               // [N, Hq, D]
  heads.k = qk.narrow(1, c.num_heads, c.num_kv_heads);  // [N, Hkv, D]
  heads.v = qkv.narrow(1, c.q_size() + c.kv_size(), c.kv_size())
                .view({n, c.num_kv_heads, c.head_dim});  // [N, Hkv, D], rows strided
  if (backend.wants_contiguous()) {
    // Prefill: the selectors and cache writes get dense tensors (a decode step's index_copy_
    // and the paged kernel read the strided rows as they are).
    heads.q = heads.q.contiguous();
    heads.k = heads.k.contiguous();
    heads.v = heads.v.contiguous();
  }
  return heads;
}

absl::StatusOr<at::Tensor> Model::Forward(const at::Tensor& tokens, const at::Tensor& positions,
                                          int64_t max_position, AttentionBackend& backend,
                                          const AttentionObserver* observer) const {
  try {
    const auto& c = config_;
    const int64_t n = tokens.size(0);
    at::Tensor x = Embed(tokens);  // [N, hidden]
    if (c.gemma_norms()) {
      // HF rounds sqrt(hidden) to the model dtype first.
      x = x * at::scalar_tensor(std::sqrt(static_cast<double>(c.hidden_size)), x.options());
    }
    const bool fused = uses_fused_ops(x);
    Ropes ropes;
    ropes.global = MakeRope(c.rope, inv_freq_, positions, max_position, fused);
    ropes.local = c.sliding_layers.empty()
                      ? ropes.global
                      : MakeRope(c.rope_local, inv_freq_local_, positions, max_position, fused);
    const auto act = c.hidden_act == "silu" ? kernels::GateActivation::kSilu
                                            : kernels::GateActivation::kGeluTanh;
    const GemvPlan gemv = PlanGemvs(x, fused);
    // in W^T (+ b): our plain GEMV where the plan says so and the rows allow its 16-byte loads,
    // else cuBLAS.
    // (s: the FP8 weight's scales, else undefined.)
    auto project = [&](const at::Tensor& in, const at::Tensor& w, const at::Tensor& s,
                       const at::Tensor& b, bool use_gemv) -> absl::StatusOr<at::Tensor> {
      if (use_gemv && RowsAligned16(in)) return kernels::Gemv(in, w, b, s);
      return LinearMaybeFp8(in, w, s, fp8_group_k_, b);
    };
    // o_proj and down: under tensor parallelism each rank's partial sum is all-reduced and the
    // bias added once, after it.
    auto project_row_parallel = [&](const at::Tensor& in, const at::Tensor& w, const at::Tensor& s,
                                    const at::Tensor& b,
                                    bool use_gemv) -> absl::StatusOr<at::Tensor> {
      if (comm_ == nullptr) return project(in, w, s, b, use_gemv);
      ASSIGN_OR_RETURN(at::Tensor partial, project(in, w, s, at::Tensor(), use_gemv));
      return ReduceRowParallel(std::move(partial), b);
    };
    // x += delta, then norm(x) W^T (+ b).
    auto norm_linear = [&](const at::Tensor& d, const at::Tensor& norm_w, const at::Tensor& w,
                           const at::Tensor& s, const at::Tensor& b,
                           bool use_gemv) -> absl::StatusOr<at::Tensor> {
      ASSIGN_OR_RETURN(at::Tensor hs, AddNorm(x, d, norm_w, fused));
      return project(hs, w, s, b, use_gemv);
    };
    // The last sub-layer's output, added into x by the next norm (one kernel when fused).
    at::Tensor delta;
    for (int32_t i = 0; i < c.num_layers; ++i) {
      const Layer& l = layers_[i];
      QkvHeads heads;
      const Rope& rope = ropes.of(c, i);
      // (q/k norms come between the projection and RoPE: not in the GEMV's epilogue.)
      auto kv_dst = gemv.qkv && !c.qk_norm ? backend.kv_slots(i) : std::nullopt;
      if (kv_dst) {
        // Decode through the plain GEMVs: the qkv GEMV's epilogue does RoPE and the K/V store
        // (kernels::RopeWriteKv's work, the same bits) and returns q.
        ASSIGN_OR_RETURN(at::Tensor hs, AddNorm(x, delta, l.input_norm, fused));
        ASSIGN_OR_RETURN(heads.q,
                         kernels::GemvRopeWriteKv(hs, l.qkv_w, l.qkv_b,
                                                  {c.num_heads, c.num_kv_heads, c.head_dim},
                                                  rope.positions, rope.inv_freq, kv_dst->key_cache,
                                                  kv_dst->value_cache, kv_dst->slots, l.qkv_s));
      } else {
        // [N, q_size + 2 kv_size]
        ASSIGN_OR_RETURN(auto qkv,
                         norm_linear(delta, l.input_norm, l.qkv_w, l.qkv_s, l.qkv_b, gemv.qkv));
        ASSIGN_OR_RETURN(heads, SplitHeads(qkv, rope, fused, i, backend));
      }
      ASSIGN_OR_RETURN(at::Tensor attn, backend.Attend(i, heads.q, heads.k, heads.v));
      // [N, hidden]
      ASSIGN_OR_RETURN(at::Tensor o, project_row_parallel(attn.reshape({n, c.q_size()}), l.o_w,
                                                          l.o_s, l.o_b, gemv.o));
      if (c.sandwich_norms) o = Norm(o, l.attn_out_norm);
      if (observer != nullptr && *observer) (*observer)(i, o);
      // [N, 2 inter]
      ASSIGN_OR_RETURN(auto gate_up, norm_linear(o, l.post_norm, l.gate_up_w, l.gate_up_s,
                                                 l.gate_up_b, gemv.gate_up));
      const int64_t inter = c.intermediate_size;
      at::Tensor gated;
      if (fused) {
        ASSIGN_OR_RETURN(gated, kernels::GatedActivation(gate_up, act));
      } else {
        auto gate = gate_up.narrow(1, 0, inter);
        gate = act == kernels::GateActivation::kSilu ? at::silu(gate) : at::gelu(gate, "tanh");
        gated = gate * gate_up.narrow(1, inter, inter);
      }
      ASSIGN_OR_RETURN(delta, project_row_parallel(gated, l.down_w, l.down_s, l.down_b, gemv.down));
      if (c.sandwich_norms) delta = Norm(delta, l.mlp_out_norm);
    }
    return AddNorm(x, delta, final_norm_, fused);
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("model forward failed: ", e.what()));
  }
}

at::Tensor Model::Embed(const at::Tensor& tokens) const {
  if (comm_ == nullptr) return at::embedding(embed_, tokens);
  at::Tensor local = tokens - tp_.vocab_begin;
  at::Tensor mine = local.ge(0).logical_and(local.lt(tp_.vocab_rows));
  at::Tensor x = at::embedding(embed_, local.clamp(0, std::max<int64_t>(tp_.vocab_rows - 1, 0)));
  x.mul_(mine.unsqueeze(1).to(x.scalar_type()));
  return ReduceRowParallel(std::move(x), at::Tensor());
}

at::Tensor Model::ReduceRowParallel(at::Tensor y, const at::Tensor& bias) const {
  if (!y.is_contiguous()) y = y.contiguous();
  if (absl::Status s = comm_->AllReduceSum(y); !s.ok()) throw std::runtime_error(s.ToString());
  if (bias.defined()) y.add_(bias);
  return y;
}

at::Tensor Model::Logits(const at::Tensor& hidden) const {
  at::Tensor logits = Linear(hidden, lm_head_, at::Tensor()).to(at::kFloat);
  if (comm_ != nullptr) {
    // Each rank's vocabulary rows, padded to one size, gathered and laid side by side.
    const int64_t n = logits.size(0);
    if (tp_.vocab_rows < tp_.vocab_chunk)
      logits = at::constant_pad_nd(logits, {0, tp_.vocab_chunk - tp_.vocab_rows});
    auto gathered = comm_->AllGather(logits);  // [size, N, chunk]
    if (!gathered.ok()) throw std::runtime_error(gathered.status().ToString());
    logits = gathered->permute({1, 0, 2})
                 .reshape({n, tp_.size * tp_.vocab_chunk})
                 .narrow(1, 0, config_.vocab_size)
                 .contiguous();
  }
  if (const double cap = config_.final_logit_softcapping; cap > 0) {
    logits = at::tanh(logits / cap) * cap;
  }
  return logits;
}

}  // namespace dropkv
