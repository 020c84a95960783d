// ProcessGroup over Gloo: the store adapter that puts Gloo's address
// exchange on the group's Rendezvous, and the collectives, each turning
// Gloo's exceptions into Unavailable.
#include "server/engine/dist/process_group.h"

#include <chrono>
#include <cstring>
#include <exception>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "gloo/allgather.h"
#include "gloo/allreduce.h"
#include "gloo/broadcast.h"
#include "gloo/common/error.h"
#include "gloo/rendezvous/context.h"
#include "gloo/rendezvous/store.h"
#include "gloo/transport/tcp/device.h"
#include "kernels/float16.h"

namespace ampd::engine::dist {

namespace {

// Gloo's Store on the Rendezvous, its keys under "<group>/<round>/" (the
// table drops older rounds' keys when a round forms). Gloo expects
// exceptions from a store; they end the Connect that called it.
class RendezvousStore : public gloo::rendezvous::Store {
 public:
  RendezvousStore(Rendezvous& rendezvous, std::string prefix, absl::Duration timeout)
      : rendezvous_(rendezvous), prefix_(std::move(prefix)), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    const absl::Status s = rendezvous_.Set(prefix_ + key, std::string(data.begin(), data.end()));
    if (!s.ok()) throw gloo::IoException(std::string(s.message()));
  }
  std::vector<char> get(const std::string& key) override {
    absl::StatusOr<std::string> value = rendezvous_.Get(prefix_ + key, timeout_);
    if (!value.ok()) throw gloo::IoException(std::string(value.status().message()));
    return std::vector<char>(value->begin(), value->end());
  }
  void wait(const std::vector<std::string>& keys) override {
    wait(keys, std::chrono::milliseconds(0));
  }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds&) override {
    for (const std::string& key : keys) get(key);
  }

 private:
  Rendezvous& rendezvous_;
  const std::string prefix_;
  const absl::Duration timeout_;
};

void SumF32(void* c, const void* a, const void* b, size_t n) {
  auto* out = static_cast<float*>(c);
  const auto* x = static_cast<const float*>(a);
  const auto* y = static_cast<const float*>(b);
  for (size_t i = 0; i < n; ++i) out[i] = x[i] + y[i];
}

// A 16-bit sum, rounded to the dtype after each addition.
template <float (*ToFloat)(uint16_t), uint16_t (*FromFloat)(float)>
void Sum16(void* c, const void* a, const void* b, size_t n) {
  auto* out = static_cast<uint16_t*>(c);
  const auto* x = static_cast<const uint16_t*>(a);
  const auto* y = static_cast<const uint16_t*>(b);
  for (size_t i = 0; i < n; ++i) out[i] = FromFloat(ToFloat(x[i]) + ToFloat(y[i]));
}

float HalfToFloat(uint16_t bits) { return kernels::HalfBitsToFloat(bits); }
uint16_t FloatToHalf(float value) { return kernels::FloatToHalfBits(value); }
float Bf16ToFloat(uint16_t bits) { return kernels::Bf16BitsToFloat(bits); }
uint16_t FloatToBf16(float value) { return kernels::FloatToBf16Bits(value); }

absl::Status Broken(absl::string_view what, const std::exception& e) {
  return absl::UnavailableError(absl::StrCat(what, ": ", e.what()));
}

}  // namespace

ProcessGroup::ProcessGroup(int32_t rank, int32_t world_size, int64_t round,
                           std::shared_ptr<gloo::Context> context)
    : rank_(rank), world_size_(world_size), round_(round), context_(std::move(context)) {}

ProcessGroup::~ProcessGroup() = default;

absl::StatusOr<std::unique_ptr<ProcessGroup>> ProcessGroup::Connect(const DistributedSpec& spec,
                                                                    const std::string& fingerprint,
                                                                    const std::string& peer_host,
                                                                    Rendezvous& rendezvous) {
  const absl::Duration timeout = absl::Milliseconds(spec.timeout_ms);
  AMPD_ASSIGN_OR_RETURN(const int64_t round, rendezvous.Join(spec.group, spec.rank, spec.world_size,
                                                             fingerprint, timeout));
  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = peer_host;
    std::shared_ptr<gloo::transport::Device> device = gloo::transport::tcp::CreateDevice(attr);
    auto context = std::make_shared<gloo::rendezvous::Context>(spec.rank, spec.world_size);
    context->setTimeout(std::chrono::milliseconds(spec.timeout_ms));
    RendezvousStore store(rendezvous, absl::StrCat(spec.group, "/", round, "/"), timeout);
    context->connectFullMesh(store, device);
    return std::unique_ptr<ProcessGroup>(
        new ProcessGroup(spec.rank, spec.world_size, round, std::move(context)));
  } catch (const std::exception& e) {
    return Broken(absl::StrCat("connecting the ranks of group ", spec.group, " (round ", round,
                               ", transport on ", peer_host, ")"),
                  e);
  }
}

absl::StatusOr<std::vector<int64_t>> ProcessGroup::AllGather(absl::Span<const int64_t> mine) {
  std::vector<int64_t> in(mine.begin(), mine.end());
  std::vector<int64_t> out(in.size() * static_cast<size_t>(world_size_));
  try {
    gloo::AllgatherOptions opts(context_);
    opts.setInput(in.data(), in.size());
    opts.setOutput(out.data(), out.size());
    gloo::allgather(opts);
  } catch (const std::exception& e) {
    return Broken("all-gather across the ranks", e);
  }
  return out;
}

absl::Status ProcessGroup::Broadcast(std::string& bytes, int32_t root) {
  try {
    int64_t size = static_cast<int64_t>(bytes.size());
    gloo::BroadcastOptions size_opts(context_);
    size_opts.setRoot(root);
    if (rank_ == root) size_opts.setInput(&size, 1);
    size_opts.setOutput(&size, 1);
    gloo::broadcast(size_opts);
    if (size < 0) return absl::DataLossError("broadcast: a negative size came from the root");
    if (rank_ != root) bytes.resize(static_cast<size_t>(size));
    if (size == 0) return absl::OkStatus();
    gloo::BroadcastOptions opts(context_);
    opts.setRoot(root);
    if (rank_ == root) opts.setInput(bytes.data(), bytes.size());
    opts.setOutput(bytes.data(), bytes.size());
    gloo::broadcast(opts);
  } catch (const std::exception& e) {
    return Broken(absl::StrCat("broadcast from rank ", root), e);
  }
  return absl::OkStatus();
}

absl::Status ProcessGroup::AllReduceSum(void* data, int64_t count, kernels::DType dtype) {
  if (count <= 0) return absl::OkStatus();
  const auto n = static_cast<size_t>(count);
  try {
    gloo::AllreduceOptions opts(context_);
    switch (dtype) {
      case kernels::DType::kF32:
        opts.setInput(static_cast<float*>(data), n);
        opts.setOutput(static_cast<float*>(data), n);
        opts.setReduceFunction(&SumF32);
        break;
      case kernels::DType::kF16:
        opts.setInput(static_cast<uint16_t*>(data), n);
        opts.setOutput(static_cast<uint16_t*>(data), n);
        opts.setReduceFunction(&Sum16<HalfToFloat, FloatToHalf>);
        break;
      case kernels::DType::kBF16:
        opts.setInput(static_cast<uint16_t*>(data), n);
        opts.setOutput(static_cast<uint16_t*>(data), n);
        opts.setReduceFunction(&Sum16<Bf16ToFloat, FloatToBf16>);
        break;
      default:
        return absl::InvalidArgumentError("all-reduce: only F32, F16 and BF16 tensors are summed");
    }
    gloo::allreduce(opts);
  } catch (const std::exception& e) {
    return Broken("all-reduce across the ranks", e);
  }
  return absl::OkStatus();
}

}  // namespace ampd::engine::dist
