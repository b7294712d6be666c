// How a ModelRunner is built (model folder, device, dtype, KV pool, CUDA decode options). Torch-
// free, so that the engine facade (engine/engine.h) and its callers need no LibTorch headers.
#pragma once

#include <cstdint>
#include <string>

#include "kernels/tuning.h"

namespace dropkv {

class Communicator;

struct RunnerOptions {
  std::string model_dir;  // Hugging Face folder; empty = the built-in demo model
  // Where the demo model is written when model_dir is empty; "" = DefaultDemoModelDir() (the
  // server passes its cache folder, resolved by the config).
  std::string demo_model_dir;
  std::string device = "cpu";  // "cpu" or "cuda[:N]"
  std::string dtype =
      "auto";  // "auto" (bf16 on CUDA, fp32 on CPU), "float32", "bfloat16", "float16"
  // Projection weights: "none" (as the checkpoint has them) or "fp8" (float8 e4m3, one fp32
  // scale per output channel, quantized at load; engine/model/fp8.h). An FP8 checkpoint's
  // projections stay FP8 either way.
  std::string quantization = "none";
  // The paged KV pool's storage: "auto" (the model dtype) or "fp8" (float8 e4m3, scale 1.0, one
  // byte per element: kernels/kv_cache_fp8.h). CUDA: compute capability 8.9 or newer.
  std::string kv_cache_dtype = "auto";
  int32_t block_size = 16;       // KV slots per block
  int64_t kv_cache_bytes = 0;    // 0 = a default (CPU: 1 GiB; CUDA: free memory after weights
                                 // minus an activation reserve, see kv_reserve_bytes)
  int64_t kv_reserve_bytes = 0;  // CUDA default pool: bytes left free (0 = max(4 GiB, 10%))
  int64_t num_kv_blocks = 0;     // > 0 overrides kv_cache_bytes (tests use tiny pools)
  bool random_weights =
      false;                 // draw weights (normal, std 0.02) instead of reading them: benchmarks
  uint64_t random_seed = 0;  // at real geometry from a config.json alone
  // CUDA decode replays a captured graph per (batch bucket, context bucket) instead of launching
  // each kernel from the host. Off: every step runs eagerly (for comparison and debugging).
  bool cuda_graphs = true;
  // CUDA: the fused residual + RMSNorm, RoPE + K/V store and gated-activation kernels
  // (kernels/fused_ops.h) instead of chains of ATen ops. Off: for comparison and debugging.
  bool cuda_fused_ops = true;
  // CUDA, with the fused ops: at batch 1, every decode projection through our plain GEMV
  // (kernels/fused_gemv.h) instead of cuBLAS, the norms and the activation as the fused ops, so
  // every kernel of the step is ours and programmatic dependent launch links them all, and the
  // qkv GEMV does RoPE + the K/V store (kernels::GemvRopeWriteKv): bs1 8K 4.72-4.77 ms against
  // cuBLAS's 4.91-4.93 in one call on the H200 (docs/benchmarks.md). Larger batches keep cuBLAS
  // (the GEMV's stages are tuned for one token). Off: cuBLAS, for comparison.
  bool cuda_decode_gemv = true;
  // CPU fp32: the large projections in oneDNN's packed layout (Model::PackForCpu).
  bool cpu_packed_weights = kernels::Tuning().cpu_packed_weights;
  // Tensor parallelism: this rank's group (not owned; it outlives the runner). The
  // runner then holds this rank's shard of the model and a pool of its KV heads, and every rank
  // must make the same runner calls in the same order. null: the whole model here.
  Communicator* communicator = nullptr;
};

}  // namespace dropkv
