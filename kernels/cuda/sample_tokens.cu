// SampleTokens (the contract in kernels/backend.h): one token per live row
// of logits drawn on the device, one block per row, so the host reads S
// token ids instead of the (S, V) logits.
//
// Each element's key orders the row most likely first with ties by id
// (the CPU oracle's total order): key = ordered(z) << 32 | (2^32 - 1 - id),
// ordered() the float's bits mapped to an unsigned order (+0 for -0, so the
// two zeros tie as the CPU's comparisons make them). The larger key is the
// likelier token, and every key is distinct.
//   temperature 0   the largest key (the most likely, lowest id of ties).
//   untruncated     (top_k 0 or >= V, top_p 1) the inverse CDF in id order: thread t owns a run of
//                   ceil(V / threads) consecutive ids and sums its weights
//                   in id order; a fixed scan over the threads' sums gives
//                   each run's start and the total; the run in which u
//                   times the total falls walks its ids again.
//   truncated       three thresholds on the key, no sort: the keep-th
//                   largest key (a radix select over the key's 8 bytes,
//                   integer counts), the nucleus's smallest key (a binary
//                   search: the largest key whose mass of keys at or above
//                   it, over the kept mass, reaches top_p) and the drawn
//                   key (the largest key whose mass at or above it exceeds
//                   u times the nucleus's mass). Each mass is one pass over
//                   the row, a fixed-order block sum; up to 64 passes per
//                   search, each cheap where few keys clear the probe.
// Weights are float64 as on the CPU, w = exp(z inv_t - z_max inv_t) with
// the product and the difference each rounded (no fused multiply-add);
// CUDA's exp is within 1 ulp of the correctly rounded value, and the sums
// run in the orders above rather than the CPU's sequential ones, so a
// token can differ from the CPU's only where u lands within rounding of a
// cumulative boundary. Every order depends on the shape alone (V, the
// block size), never on the row's address: threads visit units of 16
// bytes of the row in a fixed assignment, loaded as one vector where the
// row is aligned and element by element otherwise, in the same order.
//
// log_kept (when asked): 0 untruncated and at temperature 0; a truncated
// draw's log(nucleus mass / the row's mass), the row's mass one more
// MassAtLeast pass (threshold 0: every key) where top_k drops tokens.
//
// Cost: the untruncated draw reads the row three times (max, sums, walk);
// a truncated one reads it 8 times for a top_k select and once per probe of
// each binary search (at most 64 each, about 40 + log2 V typical).
#include <cstdint>

#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/launchers.h"
#include "kernels/philox.h"

namespace ampd::kernels::cuda {
namespace {

constexpr int kSampleThreads = 512;
constexpr int kWarps = kSampleThreads / 32;
constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ uint64_t KeyOf(float z, int id) {
  if (z == 0.0f) z = 0.0f;  // -0 ties with +0, as the CPU compares them
  uint32_t bits = __float_as_uint(z);
  bits = (bits & 0x80000000u) != 0 ? ~bits : (bits | 0x80000000u);
  return (static_cast<uint64_t>(bits) << 32) | (0xffffffffu - static_cast<uint32_t>(id));
}
__device__ __forceinline__ float LogitOf(uint64_t key) {
  const auto bits = static_cast<uint32_t>(key >> 32);
  return __uint_as_float((bits & 0x80000000u) != 0 ? (bits & 0x7fffffffu) : ~bits);
}
__device__ __forceinline__ int IdOf(uint64_t key) {
  return static_cast<int>(0xffffffffu - static_cast<uint32_t>(key));
}

// w = exp(z inv_t - top), each operation rounded once as on the CPU.
__device__ __forceinline__ double Weight(float z, double inv_t, double top) {
  return exp(__dsub_rn(__dmul_rn(static_cast<double>(z), inv_t), top));
}

// fn(id, z) for every element of the row this thread owns: units of 16
// bytes (N elements) u = threadIdx.x, + blockDim.x, ...; each unit's
// elements in id order. The order does not depend on the row's alignment.
template <typename T, typename Fn>
__device__ __forceinline__ void ForEachOwn(const T* row, int vocab, Fn&& fn) {
  constexpr int N = 16 / static_cast<int>(sizeof(T));
  const bool aligned = VecAligned<N>(row);
  // No vocab + N - 1 or base + N: V may be up to 2^31 - 1 (op_checks).
  const int units = vocab / N + (vocab % N != 0 ? 1 : 0);
  for (int u = threadIdx.x; u < units; u += blockDim.x) {
    const int base = u * N;
    if (aligned && N <= vocab - base) {
      const Vec<T, N> v = LoadVec<N>(row, base);
#pragma unroll
      for (int k = 0; k < N; ++k) fn(base + k, ToFloat(v.v[k]));
    } else {
      for (int k = 0; k < N && k < vocab - base; ++k) fn(base + k, ToFloat(row[base + k]));
    }
  }
}

// Block-wide reductions, fixed order (shuffle tree, then warp 0 over the
// warps' results); every thread gets the result. `slots` is kWarps words
// of shared memory the caller does not otherwise touch.
__device__ __forceinline__ double BlockSumDouble(double v, double* slots) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFull, v, offset);
  __syncthreads();  // slots may still be read by a previous call
  if ((threadIdx.x & 31) == 0) slots[threadIdx.x >> 5] = v;
  __syncthreads();
  double total = 0.0;
  for (int w = 0; w < kWarps; ++w) total += slots[w];  // the same order in every thread
  return total;
}
__device__ __forceinline__ uint64_t BlockMaxKey(uint64_t v, uint64_t* slots) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    const uint64_t other = __shfl_xor_sync(kFull, v, offset);
    v = other > v ? other : v;
  }
  __syncthreads();
  if ((threadIdx.x & 31) == 0) slots[threadIdx.x >> 5] = v;
  __syncthreads();
  uint64_t best = 0;
  for (int w = 0; w < kWarps; ++w) best = slots[w] > best ? slots[w] : best;
  return best;
}

// The sum of w over the row's keys >= threshold.
template <typename T>
__device__ double MassAtLeast(const T* row, int vocab, uint64_t threshold, double inv_t, double top,
                              double* slots) {
  double sum = 0.0;
  ForEachOwn(row, vocab, [&](int id, float z) {
    if (KeyOf(z, id) >= threshold) sum += Weight(z, inv_t, top);
  });
  return BlockSumDouble(sum, slots);
}

// The largest key in [lo, hi] whose mass at or above it satisfies pred
// (pred(mass at lo) holds and pred is monotone: true below, false above);
// *mass_at gets that key's mass.
template <typename T, typename Pred>
__device__ uint64_t SearchKey(const T* row, int vocab, uint64_t lo, double lo_mass, uint64_t hi,
                              double inv_t, double top, double* slots, Pred pred, double* mass_at) {
  const double hi_mass = MassAtLeast(row, vocab, hi, inv_t, top, slots);
  if (pred(hi_mass)) {
    *mass_at = hi_mass;
    return hi;
  }
  while (hi - lo > 1) {  // pred(lo) true, pred(hi) false
    const uint64_t mid = lo + (hi - lo) / 2;
    const double m = MassAtLeast(row, vocab, mid, inv_t, top, slots);
    if (pred(m)) {
      lo = mid;
      lo_mass = m;
    } else {
      hi = mid;
    }
  }
  *mass_at = lo_mass;
  return lo;
}

// The keep-th largest key of the row (1 <= keep <= vocab): a radix select,
// most significant byte first, over integer counts (exact in any order).
template <typename T>
__device__ uint64_t KthLargestKey(const T* row, int vocab, int keep, int* hist, uint64_t* chosen) {
  uint64_t prefix = 0;
  int remaining = keep;
  for (int shift = 56; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
    __syncthreads();
    const uint64_t high_mask = shift == 56 ? 0 : ~uint64_t{0} << (shift + 8);
    ForEachOwn(row, vocab, [&](int id, float z) {
      const uint64_t key = KeyOf(z, id);
      if ((key & high_mask) == prefix) atomicAdd(&hist[(key >> shift) & 0xff], 1);
    });
    __syncthreads();
    if (threadIdx.x == 0) {
      int above = 0;
      int digit = 255;
      for (; digit > 0; --digit) {
        if (above + hist[digit] >= remaining) break;
        above += hist[digit];
      }
      chosen[0] = prefix | (static_cast<uint64_t>(digit) << shift);
      chosen[1] = static_cast<uint64_t>(remaining - above);
    }
    __syncthreads();
    prefix = chosen[0];
    remaining = static_cast<int>(chosen[1]);
    __syncthreads();  // chosen and hist are rewritten next pass
  }
  return prefix;
}

template <typename T>
__global__ void __launch_bounds__(kSampleThreads)
    sample_tokens_kernel(const T* __restrict__ logits, int vocab, const int64_t* __restrict__ live,
                         const int64_t* __restrict__ keys, SampleParams params,
                         int64_t* __restrict__ tokens, float* __restrict__ log_kept) {
  __shared__ double dslots[kWarps];
  __shared__ uint64_t kslots[kWarps];
  __shared__ int hist[256];
  __shared__ uint64_t chosen[2];
  __shared__ int first_hit;
  const int r = blockIdx.x;
  // Nothing truncated until the truncated draw says otherwise.
  if (log_kept != nullptr && threadIdx.x == 0) log_kept[r] = 0.0f;
  if (live[r] == 0) {  // uniform over the block: no barrier is skipped by part of it
    if (threadIdx.x == 0) tokens[r] = params.ignore_index;
    return;
  }
  const T* row = logits + static_cast<int64_t>(r) * vocab;  // (V)
  uint64_t best = 0;
  uint64_t worst_flipped = 0;  // ~(the smallest key this thread saw)
  ForEachOwn(row, vocab, [&](int id, float z) {
    const uint64_t key = KeyOf(z, id);
    best = key > best ? key : best;
    worst_flipped = ~key > worst_flipped ? ~key : worst_flipped;
  });
  const uint64_t max_key = BlockMaxKey(best, kslots);
  if (params.temperature == 0.0f) {
    if (threadIdx.x == 0) tokens[r] = IdOf(max_key);
    return;
  }
  // Row r's (key, stream): its own when given (keys (S, 2)), else (seed, r).
  const uint64_t key = keys != nullptr ? static_cast<uint64_t>(keys[2 * r]) : params.seed;
  const uint64_t stream =
      keys != nullptr ? static_cast<uint64_t>(keys[2 * r + 1]) : static_cast<uint64_t>(r);
  const philox::Block b = philox::StreamBlock(key, stream, params.step);
  const double u = philox::Unit53(b.v[0], b.v[1]);
  const double inv_t = 1.0 / static_cast<double>(params.temperature);
  const double top = __dmul_rn(static_cast<double>(LogitOf(max_key)), inv_t);

  // top_k >= V keeps every token: drawn as top_k 0 (the CPU oracle's rule).
  const bool all_kept = params.top_k == 0 || params.top_k >= vocab;
  if (all_kept && params.top_p >= 1.0f) {
    // Thread t's run of ids [t run, (t + 1) run), summed in id order.
    // Without vocab + 511 or begin + run, which overflow an int for V
    // near 2^31 (op_checks allows up to 2^31 - 1); t run < 2^31 still.
    const int run = vocab / kSampleThreads + (vocab % kSampleThreads != 0 ? 1 : 0);
    const int begin = min(vocab, static_cast<int>(threadIdx.x) * run);
    const int end = begin + min(run, vocab - begin);
    double own = 0.0;
    for (int i = begin; i < end; ++i) own += Weight(ToFloat(row[i]), inv_t, top);
    // Inclusive scan over the threads in thread order: a shuffle scan in
    // each warp, then the warps' totals in warp order.
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    double inclusive = own;
    for (int offset = 1; offset < 32; offset <<= 1) {
      const double other = __shfl_up_sync(kFull, inclusive, offset);
      if (lane >= offset) inclusive += other;
    }
    const double lane_before = __shfl_up_sync(kFull, inclusive, 1);
    if (lane == 31) dslots[warp] = inclusive;
    if (threadIdx.x == 0) first_hit = vocab;
    __syncthreads();
    double warp_start = 0.0;
    double total = 0.0;
    for (int w = 0; w < kWarps; ++w) {
      if (w < warp) warp_start += dslots[w];
      total += dslots[w];
    }
    const double start = lane == 0 ? warp_start : warp_start + lane_before;
    const double target = __dmul_rn(u, total);
    if (begin < end) {
      if (target < start) {
        atomicMin(&first_hit, begin);  // an earlier run already crossed it
      } else {
        double cumulative = start;
        for (int i = begin; i < end; ++i) {
          cumulative += Weight(ToFloat(row[i]), inv_t, top);
          if (target < cumulative) {
            atomicMin(&first_hit, i);
            break;
          }
        }
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) tokens[r] = first_hit < vocab ? first_hit : vocab - 1;
    return;
  }

  const int keep = all_kept ? vocab : static_cast<int>(params.top_k);
  // The lower bound of both searches must be a real key of the row: where
  // every mass is NaN (a +inf or NaN logit, or a row of all -inf, so
  // exp(-inf - -inf)) no probe satisfies its predicate and the searches
  // return their lower bound, whose IdOf must be an id. With keep == V
  // that is the row's smallest key (~ the largest ~key), never 0, whose
  // IdOf is -1; it keeps the same elements as threshold 0 and gives the
  // CPU's token for such a row, order[keep - 1].
  const uint64_t kept_from = keep == vocab ? ~BlockMaxKey(worst_flipped, kslots)
                                           : KthLargestKey(row, vocab, keep, hist, chosen);
  const double total = MassAtLeast(row, vocab, kept_from, inv_t, top, dslots);
  uint64_t nucleus_from = kept_from;
  double in_nucleus = total;
  if (params.top_p < 1.0f) {
    const double top_p = static_cast<double>(params.top_p);
    nucleus_from = SearchKey(
        row, vocab, kept_from, total, max_key, inv_t, top, dslots,
        [=](double mass) { return mass / total >= top_p; }, &in_nucleus);
  }
  if (log_kept != nullptr && nucleus_from != ~BlockMaxKey(worst_flipped, kslots)) {
    // Some key is below the nucleus: the kept share of the whole row.
    const double all =
        keep == vocab ? total : MassAtLeast(row, vocab, uint64_t{0}, inv_t, top, dslots);
    if (threadIdx.x == 0) log_kept[r] = static_cast<float>(log(in_nucleus / all));
  }
  const double target = __dmul_rn(u, in_nucleus);
  double unused = 0.0;
  const uint64_t drawn = SearchKey(
      row, vocab, nucleus_from, in_nucleus, max_key, inv_t, top, dslots,
      [=](double mass) { return target < mass; }, &unused);
  if (threadIdx.x == 0) tokens[r] = IdOf(drawn);
}

}  // namespace

absl::Status LaunchSampleTokens(const void* logits, DType dtype, int64_t rows, int64_t vocab,
                                const int64_t* live, const int64_t* keys,
                                const SampleParams& params, int64_t* tokens, float* log_kept,
                                cudaStream_t stream) {
  if (rows == 0) return absl::OkStatus();
  if (rows > 0x7fffffff) return absl::InvalidArgumentError("SampleTokens: more than 2^31 rows");
  return DispatchFloat(dtype, [&](auto tag) -> absl::Status {
    using T = decltype(tag);
    sample_tokens_kernel<T><<<static_cast<unsigned>(rows), kSampleThreads, 0, stream>>>(
        static_cast<const T*>(logits), static_cast<int>(vocab), live, keys, params, tokens,
        log_kept);
    AMPD_CUDA_RETURN_IF_LAUNCH_FAILED();
    return absl::OkStatus();
  });
}

}  // namespace ampd::kernels::cuda
