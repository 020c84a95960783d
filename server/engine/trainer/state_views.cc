// Trainer::ExportView: the views of a job's state other than the whole of
// it (api.h StateView): a LoRA job's adapters in PEFT's form, and any job's
// model weights alone, F32, a LoRA job's adapters merged into the weights
// they adapt.
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/float16.h"
#include "server/engine/trainer/trainer.h"
#include "server/engine/trainer/trainer_impl.h"

namespace ampd::engine {

using kernels::DType;
using kernels::Tensor;

namespace {

// The host tensor's values as floats (F32, F16 or BF16; exact).
std::vector<float> FloatsOf(const HostTensor& h) {
  const size_t n = h.data.size() / kernels::SizeOf(h.dtype);
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) {
    if (h.dtype == DType::kF32) {
      std::memcpy(&out[i], h.data.data() + 4 * i, 4);
      continue;
    }
    uint16_t bits = 0;
    std::memcpy(&bits, h.data.data() + 2 * i, 2);
    out[i] =
        h.dtype == DType::kF16 ? kernels::HalfBitsToFloat(bits) : kernels::Bf16BitsToFloat(bits);
  }
  return out;
}

HostTensor F32Of(const std::vector<float>& values, const kernels::Shape& shape) {
  HostTensor h;
  h.dtype = DType::kF32;
  h.shape = shape;
  ResizeForBulkCopy(&h.data, values.size() * sizeof(float));
  std::memcpy(h.data.data(), values.data(), h.data.size());
  return h;
}

// W (out, in) + scale * B (out, r) A (r, in), each sum in float64 and
// rounded once to F32.
std::vector<float> Merged(const std::vector<float>& w, const std::vector<float>& a,
                          const std::vector<float>& b, int64_t out, int64_t in, int64_t rank,
                          float scale) {
  std::vector<float> merged(w.size());
  for (int64_t o = 0; o < out; ++o) {
    for (int64_t i = 0; i < in; ++i) {
      double sum = 0.0;
      for (int64_t k = 0; k < rank; ++k) {
        sum += static_cast<double>(b[static_cast<size_t>(o * rank + k)]) *
               static_cast<double>(a[static_cast<size_t>(k * in + i)]);
      }
      const size_t at = static_cast<size_t>(o * in + i);
      merged[at] =
          static_cast<float>(static_cast<double>(w[at]) + static_cast<double>(scale) * sum);
    }
  }
  return merged;
}

}  // namespace

absl::StatusOr<checkpoint::StateDict> Trainer::ExportView(StateView view) const {
  if (view == StateView::kFull) return ExportState();
  Impl& m = *impl_;
  model::Network& net = *m.model;
  const std::vector<model::Network::AdapterRef> adapters = net.Adapters();
  if (adapters.empty() && view == StateView::kAdapter) {
    return absl::InvalidArgumentError(
        "view: the adapter view is a LoRA job's; this job has no adapters (the merged view "
        "holds its weights alone)");
  }
  std::vector<model::Parameter>& params = net.params();
  auto source = [&params](int index) {
    model::Parameter& p = params[static_cast<size_t>(index)];
    return std::pair<std::string, Tensor*>(p.name, &p.held());
  };
  // Every adapter's A then B, in params()' order.
  std::vector<std::pair<std::string, Tensor*>> adapter_sources;
  for (const model::Network::AdapterRef& r : adapters) {
    adapter_sources.push_back(source(r.a));
    adapter_sources.push_back(source(r.b));
  }
  checkpoint::StateDict state;
  if (view == StateView::kAdapter) {
    AMPD_ASSIGN_OR_RETURN(state.tensors, ReadHostTensors(*m.backend, adapter_sources));
    net.AnnotateExport(state);
    state.metadata["adapter_config"] = net.AdapterConfigJson();
    return state;
  }
  // kMerged: every weight but the adapters, F32, the adapted ones merged
  // (a job without adapters: its weights as they are).
  absl::flat_hash_set<int> adapter_params;
  for (const model::Network::AdapterRef& r : adapters) adapter_params.insert({r.a, r.b});
  std::vector<std::pair<std::string, Tensor*>> sources;
  std::vector<int> index_of;  // params() index of each source
  for (size_t i = 0; i < params.size(); ++i) {
    if (adapter_params.contains(static_cast<int>(i))) continue;
    sources.push_back(source(static_cast<int>(i)));
    index_of.push_back(static_cast<int>(i));
  }
  AMPD_ASSIGN_OR_RETURN(std::vector<codec::NamedTensor> weights,
                        ReadHostTensors(*m.backend, sources));
  AMPD_ASSIGN_OR_RETURN(const std::vector<codec::NamedTensor> adapter_values,
                        ReadHostTensors(*m.backend, adapter_sources));
  std::vector<int> position(params.size(), -1);  // params() index -> weights index
  for (size_t i = 0; i < index_of.size(); ++i)
    position[static_cast<size_t>(index_of[i])] = static_cast<int>(i);
  std::vector<bool> merged(weights.size(), false);
  for (size_t j = 0; j < adapters.size(); ++j) {
    const int at = position[static_cast<size_t>(adapters[j].weight)];
    HostTensor& w = weights[static_cast<size_t>(at)].tensor;
    const HostTensor& a = adapter_values[2 * j].tensor;
    const HostTensor& b = adapter_values[2 * j + 1].tensor;
    w = F32Of(Merged(FloatsOf(w), FloatsOf(a), FloatsOf(b), w.shape[0], w.shape[1], a.shape[0],
                     net.AdapterScale()),
              w.shape);
    merged[static_cast<size_t>(at)] = true;
  }
  for (size_t i = 0; i < weights.size(); ++i) {
    if (!merged[i]) weights[i].tensor = F32Of(FloatsOf(weights[i].tensor), weights[i].tensor.shape);
  }
  state.tensors = std::move(weights);
  net.AnnotateExport(state);
  return state;
}

}  // namespace ampd::engine
