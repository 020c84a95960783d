// The row engine of both cross-entropy kernels (cross_entropy.cu,
// cross_entropy_chunk.cu): per row of logits z (V), in fp32,
//   max = the row's max; sum = sum of exp(z - max);
//   row loss = log(sum) - (z[label] - max);
//   gradient = softmax - onehot(label) = exp(z - max) * (1 / sum) - onehot,
// scaled and rounded once to the dtype. The chunk kernel may train the row
// on a token loss instead (kernels/token_loss.h): its term replaces the row
// loss and its coefficient multiplies the scale. The kernels are memory bound: one
// row (~100 KB at GPT-2's vocabulary) is read once and written once.
//
// Layout. A row is split into groups of W consecutive elements (W = 8 for
// fp16/bf16, 4 for fp32: 16 bytes). kRowThreads threads own a row; thread
// t of the row owns groups t, t + kRowThreads, t + 2 kRowThreads, ...; a
// tile is kSlots such groups per thread, held in registers as raw 16-byte
// vectors. Every row whose groups fit one tile (V <= 65536 in fp16/bf16,
// 32768 in fp32) is read from memory exactly once: the max, the sum and
// the gradient all come from the registers. Longer rows are streamed tile
// by tile and re-read (all but their last tile) for the gradient.
//
// Reduction order (deterministic: it depends only on the row's values,
// its length and its dtype, never on the grid, the device or where the
// row sits in memory):
//   max: exact in any order (fmaxf: a NaN is dropped, as std::fmax does).
//   sum: each thread adds exp(z - max) over its own elements in increasing
//     column order, then the threads' sums are added by a fixed butterfly
//     (warp shuffles, then across warps in warp order). For a row longer
//     than one tile, the max is the running max over the tiles so far and
//     a thread's sum is rescaled by exp(old max - new max) when a tile
//     raises it (the online softmax normaliser).
// When V is not a multiple of W, or a pointer is not 16-byte aligned, the
// same groups are loaded element by element, so the order (and the bits)
// are those of the vector path; the missing elements of the last group are
// -inf, which changes neither the max nor the sum (exp(-inf - max) adds 0).
//
// The chunk kernel's rows may be read at a temperature T (a sampler's):
// each element is z / T, divided once in fp32 (the CPU's division), and
// the gradient's scale carries 1 / T; at T = 1 nothing is divided. Its
// dlogits may be null (LabelLogprobs): the row's log-prob alone, the same
// arithmetic, nothing stored but logprobs.
//
// dlogits may be logits (in place): every element of a row is read, and the
// label logit with it, before the row's threads synchronise for the sum;
// all stores come after, and a re-read tile element is read only by the
// thread that writes it.
#pragma once

#include <algorithm>
#include <cstdint>

#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launchers.h"
#include "kernels/token_loss.h"

namespace ampd::kernels::cuda::xent {

struct RowArgs {
  const void* logits;  // (rows, vocab)
  void* dlogits;       // (rows, vocab), may be logits
  const void* labels;  // (rows) I32 or I64
  DType label_dtype;
  int64_t rows;
  int64_t vocab;
  int64_t ignore_index;  // the chunk kernel's; unused by the mean loss
  // gradient = (coef * (softmax - onehot)) * grad_scale (the mean loss) or
  // grad_scale * (softmax - onehot) (the chunk; coef unused).
  float coef;
  float grad_scale;
  float loss_scale;  // the chunk: each row adds loss_scale * row loss
  float* loss;       // partials (gridDim.x): each block's sum of its rows' terms
  int* error_flags;
  // The chunk's token-loss terms (kernels/token_loss.h); per-row (rows)
  // F32 pointers, null when not given. Plain cross-entropy is kind
  // kCrossEntropy with no weights.
  TokenLossKind token_kind;
  const float* weights;
  const float* advantages;
  const float* sampling_logprobs;
  float clip_low;
  float clip_high;
  float beta;
  float temperature;    // the chunk's (1: logits as they are); the mean loss's is 1
  float* logprobs;      // out: each kept row's logp, 0 for ignored rows
  float* token_losses;  // out: each kept row's loss_scale * term, 0 for ignored rows
  bool vectorized;      // vocab % W == 0 and both pointers 16-byte aligned
};

// A group is 16 bytes, held as 4 raw 32-bit words (two fp16/bf16 elements
// or one fp32 each), so that a tile takes 4 registers per group whatever
// the dtype; elements are widened to fp32 where they are used.
using Words = Vec<uint32_t, 4>;

template <typename T>
struct Bits;
template <>
struct Bits<float> {
  using Raw = uint32_t;
  static constexpr int kPerWord = 1;
  static constexpr Raw kNegInf = 0xFF800000u;
  __device__ static float Get(uint32_t w, int) { return __uint_as_float(w); }
  __device__ static uint32_t Put(float lo, float) { return __float_as_uint(lo); }
};
template <>
struct Bits<__half> {
  using Raw = uint16_t;
  static constexpr int kPerWord = 2;
  static constexpr Raw kNegInf = 0xFC00u;
  __device__ static float Get(uint32_t w, int h) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(h == 0 ? w : w >> 16)));
  }
  // Each half rounded once, nearest-even (__float2half_rn on each).
  __device__ static uint32_t Put(float lo, float hi) {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
};
template <>
struct Bits<__nv_bfloat16> {
  using Raw = uint16_t;
  static constexpr int kPerWord = 2;
  static constexpr Raw kNegInf = 0xFF80u;
  // A bf16 is the top half of its fp32.
  __device__ static float Get(uint32_t w, int h) {
    return __uint_as_float(h == 0 ? w << 16 : w & 0xFFFF0000u);
  }
  __device__ static uint32_t Put(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
};

// Element e of a group, widened.
template <typename T>
__device__ __forceinline__ float Element(const Words& g, int e) {
  constexpr int kPer = Bits<T>::kPerWord;
  return Bits<T>::Get(g.v[e / kPer], e % kPer);
}

// A logit as the row reads it: z / temperature (fp32, correctly rounded
// as nvcc's default division is), z itself at temperature 1.
__device__ __forceinline__ float AtTemperature(float z, float temperature) {
  return temperature == 1.0f ? z : z / temperature;
}

// Group g of a row: elements [g W, g W + W), -inf past the row's end; one
// 16-byte load when vectorized.
template <typename T>
__device__ __forceinline__ Words LoadGroup(const T* row, int64_t g, int64_t vocab,
                                           bool vectorized) {
  if (vectorized) return reinterpret_cast<const Words*>(row)[g];
  using B = Bits<T>;
  const auto* raw = reinterpret_cast<const typename B::Raw*>(row);
  const int64_t left = vocab - g * 16 / static_cast<int64_t>(sizeof(T));
  Words w;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    uint32_t word = 0;
#pragma unroll
    for (int h = 0; h < B::kPerWord; ++h) {
      const int e = k * B::kPerWord + h;
      const uint32_t bits = e < left ? raw[(g * 4 + k) * B::kPerWord + h] : B::kNegInf;
      word |= bits << (16 * h);
    }
    w.v[k] = word;
  }
  return w;
}

template <typename T>
__device__ __forceinline__ void StoreGroup(T* row, int64_t g, int64_t vocab, bool vectorized,
                                           const Words& w) {
  if (vectorized) {
    reinterpret_cast<Words*>(row)[g] = w;
    return;
  }
  using B = Bits<T>;
  auto* raw = reinterpret_cast<typename B::Raw*>(row);
  const int64_t left = vocab - g * 16 / static_cast<int64_t>(sizeof(T));
#pragma unroll
  for (int k = 0; k < 4; ++k) {
#pragma unroll
    for (int h = 0; h < B::kPerWord; ++h) {
      const int e = k * B::kPerWord + h;
      if (e < left) {
        raw[(g * 4 + k) * B::kPerWord + h] = static_cast<typename B::Raw>(w.v[k] >> (16 * h));
      }
    }
  }
}

// Max and sum over the kRowThreads threads of a row, for each of them:
// one warp (shuffles only) or the whole block (kRowThreads == blockDim.x,
// a multiple of 32). Fixed order. The block version's barriers also order
// every read of the row before any store that follows.
template <int kRowThreads>
__device__ __forceinline__ float RowMax(float v) {
  v = WarpMax(v);
  if constexpr (kRowThreads > 32) {
    constexpr int kWarps = kRowThreads / 32;
    __shared__ float warp_max[kWarps];
    const int lane = threadIdx.x & 31;
    __syncthreads();  // the previous call's values may still be read
    if (lane == 0) warp_max[threadIdx.x >> 5] = v;
    __syncthreads();
    v = WarpMax(lane < kWarps ? warp_max[lane] : -INFINITY);
  }
  return v;
}

template <int kRowThreads>
__device__ __forceinline__ float RowSum(float v) {
  v = WarpSum(v);
  if constexpr (kRowThreads > 32) {
    constexpr int kWarps = kRowThreads / 32;
    __shared__ float warp_sum[kWarps];
    const int lane = threadIdx.x & 31;
    __syncthreads();
    if (lane == 0) warp_sum[threadIdx.x >> 5] = v;
    __syncthreads();
    v = WarpSum(lane < kWarps ? warp_sum[lane] : 0.0f);  // + 0 is exact
  } else {
    __syncwarp();  // orders the warp's reads of the row before its stores
  }
  return v;
}

// Zeroes the row's gradient (an ignored row or a bad label).
template <int kRowThreads, typename T>
__device__ __forceinline__ void ZeroRow(T* dz, int64_t groups, int64_t vocab, bool vectorized,
                                        int rt) {
  const Words zero{};  // +0 in every dtype
  for (int64_t g = rt; g < groups; g += kRowThreads) StoreGroup(dz, g, vocab, vectorized, zero);
}

// row_scale: the chunk's grad_scale * the row's token coefficient (exactly
// grad_scale for plain cross-entropy, whose coefficient is 1).
template <bool kChunk>
__device__ __forceinline__ float Gradient(const RowArgs& a, float row_scale, float d) {
  if constexpr (kChunk) {
    return row_scale * d;
  } else {
    return (a.coef * d) * a.grad_scale;  // the scale last: see cross_entropy.cu
  }
}

// The chunk's row: its token term and the gradient's row scale, from its
// nll = log(sum) - (z[label] - max) and the row's inputs.
__device__ __forceinline__ TokenTerm ChunkRowTerm(const RowArgs& a, int64_t row, float nll) {
  const float weight = a.weights == nullptr ? 1.0f : a.weights[row];
  const float advantage = a.advantages == nullptr ? 0.0f : a.advantages[row];
  const float sampled = a.sampling_logprobs == nullptr ? 0.0f : a.sampling_logprobs[row];
  return TokenLossTerm(a.token_kind, -nll, weight, advantage, sampled, a.clip_low, a.clip_high,
                       a.beta);
}

// How many of a tile's kSlots groups, g0, g0 + kRowThreads, ..., lie in
// the row: a prefix.
template <int kRowThreads, int kSlots>
__device__ __forceinline__ int SlotsInRow(int64_t g0, int64_t groups) {
  if (g0 >= groups) return 0;
  const int64_t n = (groups - g0 + kRowThreads - 1) / kRowThreads;
  return n < kSlots ? static_cast<int>(n) : kSlots;
}

// The row's loss (in each of its threads), with dz written: the mean
// loss's row loss, or the chunk's token term (ChunkRowTerm).
template <typename T, int kRowThreads, int kSlots, bool kChunk>
__device__ __forceinline__ float ProcessRow(const RowArgs& a, const T* z, T* dz, int64_t row,
                                            int64_t label, int rt) {
  constexpr int W = VecWidth<T>();
  constexpr int64_t kTileGroups = int64_t{kRowThreads} * kSlots;
  const int64_t vocab = a.vocab;
  const bool vectorized = a.vectorized;
  const int64_t groups = (vocab + W - 1) / W;
  const int64_t tiles = (groups + kTileGroups - 1) / kTileGroups;
  // Read before the row's first store (in place, another thread may own
  // its group); one broadcast load per warp.
  const float t = a.temperature;
  const float label_logit = AtTemperature(ToFloat(z[label]), t);

  Words d[kSlots];      // the tile: d[j] is group tile * kTileGroups + j kRowThreads + rt
  float m = -INFINITY;  // the running row max (the same in every thread of the row)
  float s = 0.0f;       // this thread's sum of exp(z - m)
  for (int64_t tile = 0; tile < tiles; ++tile) {
    const int64_t g0 = tile * kTileGroups + rt;
    const int n = SlotsInRow<kRowThreads, kSlots>(g0, groups);
#pragma unroll
    for (int j = 0; j < kSlots; ++j) {  // every load in flight before any use
      if (j < n) d[j] = LoadGroup(z, g0 + int64_t{j} * kRowThreads, vocab, vectorized);
    }
    float tile_max = -INFINITY;
#pragma unroll
    for (int j = 0; j < kSlots; ++j) {
      if (j < n) {
#pragma unroll
        for (int e = 0; e < W; ++e) {
          tile_max = fmaxf(tile_max, AtTemperature(Element<T>(d[j], e), t));
        }
      }
    }
    const float new_m = fmaxf(m, RowMax<kRowThreads>(tile_max));
    // s is 0 while m is -inf, and expf(-inf) is 0 when new_m is finite.
    if (new_m != m) s *= expf(m - new_m);
    m = new_m;
    // All elements so far -inf: they add exp(-inf - max) = 0 once a finite
    // max turns up. (A row of -inf alone: sum 0, loss and gradient NaN, as
    // on the CPU, where exp(-inf - -inf) is NaN.)
    if (m != -INFINITY) {
#pragma unroll
      for (int j = 0; j < kSlots; ++j) {
        if (j < n) {
#pragma unroll
          for (int e = 0; e < W; ++e) s += expf(AtTemperature(Element<T>(d[j], e), t) - m);
        }
      }
    }
  }
  const float sum = RowSum<kRowThreads>(s);
  const float inv_sum = 1.0f / sum;
  // log(sum) - (z[label] - max), not (max + log(sum)) - z[label]: the
  // latter cancels catastrophically when the logits are large.
  const float nll = logf(sum) - (label_logit - m);
  float row_scale = a.grad_scale;
  float row_loss = nll;
  if constexpr (kChunk) {
    const TokenTerm term = ChunkRowTerm(a, row, nll);
    row_scale = a.grad_scale * term.coef;
    if (t != 1.0f) row_scale = row_scale / t;
    row_loss = term.term;
    if (a.logprobs != nullptr && rt == 0) a.logprobs[row] = -nll;
    if (dz == nullptr) return row_loss;  // LabelLogprobs: no gradient
  }

  // The gradient: the last tile from the registers, the others re-read.
  for (int64_t tile = tiles - 1; tile >= 0; --tile) {
    const int64_t g0 = tile * kTileGroups + rt;
    const int n = SlotsInRow<kRowThreads, kSlots>(g0, groups);
    if (tile != tiles - 1) {
#pragma unroll
      for (int j = 0; j < kSlots; ++j) {
        if (j < n) d[j] = LoadGroup(z, g0 + int64_t{j} * kRowThreads, vocab, vectorized);
      }
    }
    constexpr int kPer = Bits<T>::kPerWord;
#pragma unroll
    for (int j = 0; j < kSlots; ++j) {
      if (j < n) {
        // softmax everywhere, the label's element included (fixed below).
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const float lo = expf(AtTemperature(Bits<T>::Get(d[j].v[k], 0), t) - m) * inv_sum;
          const float hi =
              kPer == 2 ? expf(AtTemperature(Bits<T>::Get(d[j].v[k], 1), t) - m) * inv_sum : 0.0f;
          d[j].v[k] =
              Bits<T>::Put(Gradient<kChunk>(a, row_scale, lo), Gradient<kChunk>(a, row_scale, hi));
        }
        StoreGroup(dz, g0 + int64_t{j} * kRowThreads, vocab, vectorized, d[j]);
      }
    }
  }
  // The label's element, softmax - 1, rewritten by the thread that stored
  // its group (program order: this store lands last).
  if (rt == (label / W) % kRowThreads) {
    dz[label] =
        FromFloat<T>(Gradient<kChunk>(a, row_scale, expf(label_logit - m) * inv_sum - 1.0f));
  }
  return row_loss;
}

// kRowThreads threads per row (32, or the whole block), kBlockThreads /
// kRowThreads rows at a time per block, rows grid-strided. Each block
// writes the sum of its rows' terms (each row slot's rows in order, then
// the slots in order) to a.loss[blockIdx.x]: the mean loss's row losses,
// for finalize_loss_kernel; the chunk's (kChunk) loss_scale * row loss of
// each kept row, for accumulate_loss_kernel. No atomics: the grid depends
// only on the shape, so the loss is the same bits from run to run.
template <typename T, int kRowThreads, int kBlockThreads, int kSlots, bool kChunk>
__global__ void __launch_bounds__(kBlockThreads, 1024 / kBlockThreads)
    cross_entropy_rows_kernel(RowArgs a) {
  static_assert(kRowThreads == 32 || kRowThreads == kBlockThreads, "a warp or the block per row");
  constexpr int W = VecWidth<T>();
  constexpr int kRowsPerBlock = kBlockThreads / kRowThreads;
  const auto* logits = static_cast<const T*>(a.logits);
  auto* dlogits = static_cast<T*>(a.dlogits);
  const int rt = static_cast<int>(threadIdx.x) % kRowThreads;
  const int slot = static_cast<int>(threadIdx.x) / kRowThreads;
  const int64_t groups = (a.vocab + W - 1) / W;
  float loss_sum = 0.0f;  // this slot's rows' terms, in order
  for (int64_t row = blockIdx.x * int64_t{kRowsPerBlock} + slot; row < a.rows;
       row += int64_t{gridDim.x} * kRowsPerBlock) {
    const int64_t label = LoadIndex(a.labels, row, a.label_dtype);
    const T* z = logits + row * a.vocab;
    T* dz = dlogits == nullptr ? nullptr : dlogits + row * a.vocab;
    const bool ignored = kChunk && label == a.ignore_index;
    if (ignored || label < 0 || label >= a.vocab) {  // uniform over the row's threads
      if (!ignored && rt == 0) {
        atomicOr(a.error_flags, kChunk ? kErrorCrossEntropyChunkLabel : kErrorCrossEntropyLabel);
      }
      if (kChunk && a.logprobs != nullptr && rt == 0) a.logprobs[row] = 0.0f;
      if (kChunk && a.token_losses != nullptr && rt == 0) a.token_losses[row] = 0.0f;
      if (dz != nullptr) ZeroRow<kRowThreads>(dz, groups, a.vocab, a.vectorized, rt);
      continue;  // counted 0
    }
    const float row_loss = ProcessRow<T, kRowThreads, kSlots, kChunk>(a, z, dz, row, label, rt);
    if (rt == 0) {
      if constexpr (kChunk) {
        const float added = a.loss_scale * row_loss;
        loss_sum += added;
        if (a.token_losses != nullptr) a.token_losses[row] = added;
      } else {
        loss_sum += row_loss;
      }
    }
  }
  __shared__ float slot_loss[kRowsPerBlock];
  if (rt == 0) slot_loss[slot] = loss_sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.0f;
    for (int i = 0; i < kRowsPerBlock; ++i) total += slot_loss[i];
    a.loss[blockIdx.x] = total;
  }
}

// Picks the row shape from V and launches; returns the grid size. The
// caller checks the launch.
// Up to 128 groups (1024 fp16/bf16 elements): a warp per row, 4 groups a
// thread. Up to 2048 groups: 256 threads, 8 groups a thread. Longer: 1024
// threads, 8 groups a thread (32 registers of row data; at GPT-2's 50304
// bf16 logits 6288 groups fill 7 of each thread's 8 slots; one block of
// 32 warps per SM, its loads all in flight at once).
template <typename T, bool kChunk>
int LaunchRows(RowArgs a, int64_t max_blocks, cudaStream_t stream) {
  constexpr int W = VecWidth<T>();
  a.vectorized = a.vocab % W == 0 && VecAligned<W>(static_cast<const T*>(a.logits)) &&
                 VecAligned<W>(static_cast<const T*>(a.dlogits));
  const int64_t groups = (a.vocab + W - 1) / W;
  int blocks = 0;
  auto grid = [&](int rows_per_block) {
    const int64_t want = (a.rows + rows_per_block - 1) / rows_per_block;
    blocks = static_cast<int>(std::max<int64_t>(1, std::min(want, max_blocks)));
    return static_cast<unsigned>(blocks);
  };
  if (groups <= 32 * 4) {
    cross_entropy_rows_kernel<T, 32, 256, 4, kChunk><<<grid(256 / 32), 256, 0, stream>>>(a);
  } else if (groups <= 256 * 8) {
    cross_entropy_rows_kernel<T, 256, 256, 8, kChunk><<<grid(1), 256, 0, stream>>>(a);
  } else {
    cross_entropy_rows_kernel<T, 1024, 1024, 8, kChunk><<<grid(1), 1024, 0, stream>>>(a);
  }
  return blocks;
}

}  // namespace ampd::kernels::cuda::xent
