// FP8 (e4m3) projection weights: the quantization rule, the dequantization every backend runs,
// and the linear layer over a weight that may be FP8.
//
// A quantized weight is w8 [out, in] float8_e4m3fn with fp32 scales [out, G]: element (r, c) is
// w8[r, c] * scale[r, c / group_k], G = ceil(in / group_k). G == 1 is one scale per output channel
// (what quantize-at-load and compressed-tensors checkpoints give); G > 1 holds the block scales of
// `quant_method: fp8` checkpoints, their row blocks expanded to rows so that q/k/v (and gate/up)
// still concatenate along the output dimension.
#pragma once

#include <cstdint>
#include <optional>
#include <utility>

#include <ATen/core/Tensor.h>

namespace dropkv {

// The largest finite e4m3 value: a row's amax maps onto it.
inline constexpr double kFp8E4m3Max = 448.0;

// Per output channel: scale[r] = amax(|w[r, :]|) / 448 (1 for an all-zero row, whose codes are
// then zero), w8 = clamp(w / scale, -448, 448) rounded to e4m3 (round to nearest even).
// w: [out, in] any float dtype on any device. Returns {w8 [out, in] e4m3, scale fp32 [out, 1]}.
std::pair<at::Tensor, at::Tensor> QuantizeFp8PerChannel(const at::Tensor& w);

// fp32 [out, in] = w8 * scale expanded per the layout above; group_k is read only when G > 1.
at::Tensor DequantizeFp8(const at::Tensor& w8, const at::Tensor& scale, int64_t group_k);

bool IsFp8(const at::Tensor& w);

// CUDA only, and only when it applies (bf16 x [N, in], per-channel scales, in and out multiples
// of 16): x W^T (+ b) as one FP8 GEMM (cuBLASLt through at::_scaled_mm) with dynamic per-token
// activation scales amax(|x row|) / 448 (kernels::QuantizeRowsFp8, one kernel). Quantizing the
// activations makes it close to, not equal to, the dequantizing linear (fp8_gpu_test bounds the
// difference). The model sends it the forwards the decode GEMV cannot take (prefill chunks,
// large decode batches).
// nullopt: not applicable (or the GEMM failed once in this process, logged): dequantize instead.
std::optional<at::Tensor> Fp8ScaledMm(const at::Tensor& x, const at::Tensor& w8,
                                      const at::Tensor& scale, const at::Tensor& b);

}  // namespace dropkv
