// Paged decode attention on the CPU (paged_attention.h). Each sequence is read in chunks of
// kChunkTokens tokens straight from the pool through the block table (no gather, no host sync),
// every KV head of a slot at once: a slot's [Hkv, D] rows are contiguous, and reading them head by
// head (a strided walk per head) ran at a third of the bandwidth. For each chunk, every query row
// (query head h reads KV head h / g, GQA) scores each key, takes the chunk's max and exp-sum, and
// accumulates the values, in fp32 with the chunk's scores in L1. Chunks are independent tasks
// (at::parallel_for), so one long sequence still spreads over the threads; a second pass merges a
// sequence's chunks by their max and exp-sum (the split-K merge of flash-decoding).
//
// Thread grid: task = chunk_idx over the list of every sequence's chunks; merge = seq_idx * Hq +
// query head.
#include "kernels/cpu/paged_attention_cpu.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kernels/cpu/avx2_math.h"

namespace dropkv::kernels::cpu {
namespace {

// Tokens per task. Fixed rather than derived from the thread count, so that the result does not
// depend on it. 256 slots of SmolLM2 (3 KV heads x 64) are 192 KB of K and 192 KB of V: the
// task's work (~50 us) dwarfs its overhead, and a 2K-token sequence still gives 8 tasks.
constexpr int64_t kChunkTokens = 256;

// Where a sequence's K (or V) rows live: slot j of its table at element
// (table[j / block_size] * block_size + j % block_size) * slot_stride of the pool
// ([num_slots, Hkv, D], dense).
struct SequenceSlots {
  const int32_t* table;  // the sequence's block table
  int64_t block_size;
  int64_t slot_stride;  // Hkv * D elements
};

// Tokens t0 + first .. t0 + first + count - 1 of a sequence: consecutive slots in one block, the
// first starting at element `offset` of the pool.
struct SlotRun {
  int64_t offset, first, count;
};

// The runs of tokens [t0, t0 + n), in order. A loop instead of a callback: the AVX2 functions
// inline it (a lambda would not get their target attribute).
class SlotRuns {
 public:
  SlotRuns(const SequenceSlots& slots, int64_t t0, int64_t n) : slots_(slots), t0_(t0), n_(n) {}
  bool Next(SlotRun* run) {
    if (done_ >= n_) return false;
    const int64_t t = t0_ + done_;
    const int64_t offset_in_block = t % slots_.block_size;
    run->count = std::min(slots_.block_size - offset_in_block, n_ - done_);
    run->first = done_;
    run->offset =
        (int64_t{slots_.table[t / slots_.block_size]} * slots_.block_size + offset_in_block) *
        slots_.slot_stride;
    done_ += run->count;
    return true;
  }

 private:
  const SequenceSlots& slots_;
  int64_t t0_, n_, done_ = 0;
};

// One chunk: tokens [token_begin, token_end) of sequence seq_idx.
struct SequenceChunk {
  int64_t seq_idx;
  int64_t token_begin;
  int64_t token_end;
};

// The sizes a chunk's loops need.
struct HeadGeometry {
  int64_t num_kv_heads;
  int64_t group;  // query heads per KV head
  int64_t head_dim;
};

// The three loops of a chunk, in a portable and an AVX2 version. q [Hq, D], scores and p [Hq, n],
// acc [Hq, D]; query row h reads KV head h / group.
//   score_keys:        scores[h * n + i] = scale * q[h] . K[t0 + i, h / group]
//   exp_shift_sum:     x[i] = exp(x[i] - shift) for i < n; returns their sum
//   accumulate_values: acc[h] += sum_i p[h * n + i] * V[t0 + i, h / group]
template <typename T>
struct ChunkOps {
  void (*score_keys)(const float* q, const T* k_cache, const SequenceSlots& slots, int64_t t0,
                     int64_t n, const HeadGeometry& geo, float scale, float* scores);
  float (*exp_shift_sum)(float* x, int64_t n, float shift);
  void (*accumulate_values)(const float* p, const T* v_cache, const SequenceSlots& slots,
                            int64_t t0, int64_t n, const HeadGeometry& geo, float* acc);
};

template <typename T>
void ScoreKeysPortable(const float* q, const T* k_cache, const SequenceSlots& slots, int64_t t0,
                       int64_t n, const HeadGeometry& geo, float scale, float* scores) {
  const int64_t d = geo.head_dim, num_rows = geo.num_kv_heads * geo.group;
  SlotRun run;
  for (SlotRuns runs(slots, t0, n); runs.Next(&run);) {
    int64_t offset = run.offset;
    for (int64_t i = run.first; i < run.first + run.count; ++i, offset += slots.slot_stride) {
      for (int64_t h = 0; h < num_rows; ++h) {
        const T* k = k_cache + offset + (h / geo.group) * d;
        const float* qh = q + h * d;
        float s = 0;
        for (int64_t j = 0; j < d; ++j) s += qh[j] * static_cast<float>(k[j]);
        scores[h * n + i] = s * scale;
      }
    }
  }
}

float ExpShiftSumPortable(float* x, int64_t n, float shift) {
  float sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += (x[i] = std::exp(x[i] - shift));
  return sum;
}

template <typename T>
void AccumulateValuesPortable(const float* p, const T* v_cache, const SequenceSlots& slots,
                              int64_t t0, int64_t n, const HeadGeometry& geo, float* acc) {
  const int64_t d = geo.head_dim, num_rows = geo.num_kv_heads * geo.group;
  SlotRun run;
  for (SlotRuns runs(slots, t0, n); runs.Next(&run);) {
    int64_t offset = run.offset;
    for (int64_t i = run.first; i < run.first + run.count; ++i, offset += slots.slot_stride) {
      for (int64_t h = 0; h < num_rows; ++h) {
        const T* v = v_cache + offset + (h / geo.group) * d;
        const float ph = p[h * n + i];
        float* a = acc + h * d;
        for (int64_t j = 0; j < d; ++j) a[j] += ph * static_cast<float>(v[j]);
      }
    }
  }
}

#ifdef DROPKV_CPU_X86
template <typename T>
DROPKV_AVX2 void ScoreKeysAvx2(const float* q, const T* k_cache, const SequenceSlots& slots,
                               int64_t t0, int64_t n, const HeadGeometry& geo, float scale,
                               float* scores) {
  const int64_t d = geo.head_dim, num_rows = geo.num_kv_heads * geo.group;
  SlotRun run;
  for (SlotRuns runs(slots, t0, n); runs.Next(&run);) {
    int64_t offset = run.offset;
    for (int64_t i = run.first; i < run.first + run.count; ++i, offset += slots.slot_stride) {
      for (int64_t h = 0; h < num_rows; ++h) {
        const T* k = k_cache + offset + (h / geo.group) * d;
        const float* qh = q + h * d;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();  // two chains: FMA latency
        int64_t j = 0;
        for (; j + 16 <= d; j += 16) {
          a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + j), Load8(k + j), a0);
          a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + j + 8), Load8(k + j + 8), a1);
        }
        if (j + 8 <= d) {
          a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + j), Load8(k + j), a0);
          j += 8;
        }
        float s = Sum8(_mm256_add_ps(a0, a1));
        for (; j < d; ++j) s += qh[j] * static_cast<float>(k[j]);
        scores[h * n + i] = s * scale;
      }
    }
  }
}

template <typename T>
DROPKV_AVX2 void AccumulateValuesAvx2(const float* p, const T* v_cache, const SequenceSlots& slots,
                                      int64_t t0, int64_t n, const HeadGeometry& geo, float* acc) {
  const int64_t d = geo.head_dim, num_rows = geo.num_kv_heads * geo.group;
  SlotRun run;
  for (SlotRuns runs(slots, t0, n); runs.Next(&run);) {
    int64_t offset = run.offset;
    for (int64_t i = run.first; i < run.first + run.count; ++i, offset += slots.slot_stride) {
      for (int64_t h = 0; h < num_rows; ++h) {
        const T* v = v_cache + offset + (h / geo.group) * d;
        const float ph = p[h * n + i];
        const __m256 ph8 = _mm256_set1_ps(ph);
        float* a = acc + h * d;
        int64_t j = 0;
        for (; j + 8 <= d; j += 8)
          _mm256_storeu_ps(a + j, _mm256_fmadd_ps(ph8, Load8(v + j), _mm256_loadu_ps(a + j)));
        for (; j < d; ++j) a[j] += ph * static_cast<float>(v[j]);
      }
    }
  }
}

#endif  // DROPKV_CPU_X86

template <typename T>
ChunkOps<T> SelectOps(bool simd) {
#ifdef DROPKV_CPU_X86
  if (simd && CpuHasAvx2()) {
    return {&ScoreKeysAvx2<T>, &ExpShiftSum, &AccumulateValuesAvx2<T>};
  }
#endif
  return {&ScoreKeysPortable<T>, &ExpShiftSumPortable, &AccumulateValuesPortable<T>};
}

// Per-task results, reused across calls (one engine thread calls the kernel; a second caller
// thread gets its own): for each (task, query row) the chunk's max logit, its exp-sum, and the
// unnormalized output sum_i exp(s_i - max) V_i [D].
struct Partials {
  std::vector<float> max, sum, out;
  void Resize(int64_t rows, int64_t d) {
    max.resize(rows);
    sum.resize(rows);
    out.resize(rows * d);
  }
};

template <typename T>
void Attend(const at::Tensor& qf, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& tables, const std::vector<SequenceChunk>& chunks,
            const std::vector<int64_t>& first_chunk, float scale, float softcap, bool simd,
            at::Tensor& out) {
  const int64_t batch = qf.size(0), hq = qf.size(1), d = qf.size(2);
  const int64_t block_size = k_cache.size(1), hkv = k_cache.size(2);
  const HeadGeometry geo{hkv, hq / hkv, d};
  const float* q_ptr = qf.data_ptr<float>();
  const T* k_ptr = k_cache.data_ptr<T>();
  const T* v_ptr = v_cache.data_ptr<T>();
  const int32_t* table_ptr = tables.data_ptr<int32_t>();
  const int64_t table_stride = tables.stride(0);
  float* out_ptr = out.data_ptr<float>();
  const ChunkOps<T> ops = SelectOps<T>(simd);
  const auto num_chunks = static_cast<int64_t>(chunks.size());
  thread_local Partials partials;
  partials.Resize(num_chunks * hq, d);
  float* part_max = partials.max.data();
  float* part_sum = partials.sum.data();
  float* part_out = partials.out.data();

  at::parallel_for(0, num_chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(kChunkTokens * hq);  // [Hq, n]
    for (int64_t task = begin; task < end; ++task) {
      const SequenceChunk& c = chunks[task];
      const int64_t n = c.token_end - c.token_begin;
      const SequenceSlots slots{table_ptr + c.seq_idx * table_stride, block_size, hkv * d};
      const float* q_rows = q_ptr + c.seq_idx * hq * d;  // [Hq, D]
      float* s = scores.data();
      ops.score_keys(q_rows, k_ptr, slots, c.token_begin, n, geo, scale, s);
      if (softcap > 0) {
        for (int64_t i = 0; i < hq * n; ++i) s[i] = softcap * std::tanh(s[i] / softcap);
      }
      for (int64_t h = 0; h < hq; ++h) {
        const float m = *std::max_element(s + h * n, s + (h + 1) * n);
        part_max[task * hq + h] = m;
        part_sum[task * hq + h] = ops.exp_shift_sum(s + h * n, n, m);
      }
      float* acc = part_out + task * hq * d;  // [Hq, D]
      std::fill(acc, acc + hq * d, 0.0f);
      ops.accumulate_values(s, v_ptr, slots, c.token_begin, n, geo, acc);
    }
  });

  // out = sum_c exp(max_c - M) out_c / sum_c exp(max_c - M) sum_c over the sequence's chunks c
  // (in chunk order: deterministic), M the largest max. Sequences with no entries stay zero.
  at::parallel_for(0, batch * hq, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / hq, h = row % hq;
      const int64_t c0 = first_chunk[b], c1 = first_chunk[b + 1];
      if (c0 == c1) continue;
      float* o = out_ptr + row * d;
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t c = c0; c < c1; ++c) top = std::max(top, part_max[c * hq + h]);
      float total = 0;
      for (int64_t c = c0; c < c1; ++c) {
        const float w = std::exp(part_max[c * hq + h] - top);
        total += w * part_sum[c * hq + h];
        const float* po = part_out + (c * hq + h) * d;
        for (int64_t j = 0; j < d; ++j) o[j] += w * po[j];
      }
      const float inv = 1.0f / total;
      for (int64_t j = 0; j < d; ++j) o[j] *= inv;
    }
  });
}

}  // namespace

bool PagedDecodeKernelApplies(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  const auto dtype = k_cache.scalar_type();
  return (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf) &&
         k_cache.is_contiguous() && v_cache.is_contiguous();
}

at::Tensor PagedDecodeAttention(const at::Tensor& q, const at::Tensor& k_cache,
                                const at::Tensor& v_cache, const at::Tensor& block_tables,
                                const at::Tensor& seq_lens, double scale, double softcap,
                                bool simd) {
  const int64_t batch = q.size(0);
  auto qf = q.to(at::kFloat).contiguous();  // [B, Hq, D], small
  auto lens = seq_lens.contiguous();
  auto tables = block_tables.contiguous();
  const int32_t* len_ptr = lens.data_ptr<int32_t>();
  std::vector<SequenceChunk> chunks;
  std::vector<int64_t> first_chunk(batch + 1);
  for (int64_t b = 0; b < batch; ++b) {
    first_chunk[b] = static_cast<int64_t>(chunks.size());
    for (int64_t t0 = 0; t0 < len_ptr[b]; t0 += kChunkTokens)
      chunks.push_back({b, t0, std::min<int64_t>(len_ptr[b], t0 + kChunkTokens)});
  }
  first_chunk[batch] = static_cast<int64_t>(chunks.size());
  auto out = at::zeros(qf.sizes(), qf.options());
  const auto s = static_cast<float>(scale);
  const auto cap = static_cast<float>(softcap);
  switch (k_cache.scalar_type()) {
    case at::kFloat:
      Attend<float>(qf, k_cache, v_cache, tables, chunks, first_chunk, s, cap, simd, out);
      break;
    case at::kBFloat16:
      Attend<c10::BFloat16>(qf, k_cache, v_cache, tables, chunks, first_chunk, s, cap, simd, out);
      break;
    case at::kHalf:
      Attend<c10::Half>(qf, k_cache, v_cache, tables, chunks, first_chunk, s, cap, simd, out);
      break;
    default:
      TORCH_CHECK(false, "paged decode attention (CPU): cache dtype ", k_cache.scalar_type(),
                  " (PagedDecodeKernelApplies is false)");
  }
  return q.scalar_type() == at::kFloat ? out : out.to(q.scalar_type());
}

}  // namespace dropkv::kernels::cpu
