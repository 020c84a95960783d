// SafetensorsReceiver: a safetensors file decoded as its bytes arrive.
#include "codec/safetensors_receiver.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "codec/host_tensor.h"
#include "common/status_macros.h"

namespace ampd::codec {

SafetensorsReceiver::SafetensorsReceiver(Reserve reserve) : reserve_(std::move(reserve)) {}

std::optional<uint64_t> SafetensorsReceiver::declared_bytes() const {
  if (!layout_.has_value()) return std::nullopt;
  return layout_->file_bytes;
}

absl::Status SafetensorsReceiver::Fail(absl::Status status) {
  error_ = std::move(status);
  // What was received is of no use now; give its memory back at once.
  head_ = std::string();
  state_ = StateDict();
  return error_;
}

absl::Status SafetensorsReceiver::Append(absl::string_view bytes) {
  AMPD_RETURN_IF_ERROR(error_);
  while (!bytes.empty()) {
    const absl::Status s = layout_.has_value() ? AppendToTensors(&bytes) : AppendToHeader(&bytes);
    if (!s.ok()) return Fail(s);
  }
  return absl::OkStatus();
}

absl::Status SafetensorsReceiver::AppendToHeader(absl::string_view* bytes) {
  const size_t take = static_cast<size_t>(
      std::min<uint64_t>(bytes->size(), head_bytes_ - static_cast<uint64_t>(head_.size())));
  head_.append(bytes->data(), take);
  bytes->remove_prefix(take);
  received_ += take;
  if (head_.size() < head_bytes_) return absl::OkStatus();
  if (head_bytes_ == 8) {
    // The length is in: checked against the format's limit, then held
    // against the caller's before the header is buffered.
    AMPD_ASSIGN_OR_RETURN(const uint64_t n, DecodeSafetensorsHeaderLength(head_));
    AMPD_RETURN_IF_ERROR(reserve_(8 + n));
    head_bytes_ = 8 + n;
    head_.reserve(static_cast<size_t>(head_bytes_));
    if (n > 0) return absl::OkStatus();
  }
  AMPD_ASSIGN_OR_RETURN(SafetensorsLayout layout, DecodeSafetensorsLayout(head_));
  state_.metadata = std::move(layout.metadata);
  state_.tensors.reserve(layout.tensors.size());
  for (const SafetensorsEntry& t : layout.tensors) {
    NamedTensor named;
    named.name = t.name;
    named.tensor.dtype = t.dtype;
    named.tensor.shape = t.shape;
    state_.tensors.push_back(std::move(named));
  }
  layout_ = std::move(layout);
  head_ = std::string();
  return absl::OkStatus();
}

absl::Status SafetensorsReceiver::AppendToTensors(absl::string_view* bytes) {
  // Tensors of no bytes take none: skip to the one this byte belongs to.
  while (next_ < layout_->tensors.size() &&
         layout_->tensors[next_].end == layout_->tensors[next_].begin) {
    ++next_;
  }
  if (next_ == layout_->tensors.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("safetensors: trailing bytes after the last tensor (the header describes a ",
                     layout_->file_bytes, "-byte file)"));
  }
  const SafetensorsEntry& entry = layout_->tensors[next_];
  std::string& data = state_.tensors[next_].tensor.data;
  const uint64_t size = entry.end - entry.begin;
  if (data.capacity() < size) {
    AMPD_RETURN_IF_ERROR(reserve_(size));
    ReserveForBulkCopy(&data, static_cast<size_t>(size));
  }
  const size_t take = static_cast<size_t>(std::min<uint64_t>(bytes->size(), size - data.size()));
  data.append(bytes->data(), take);
  bytes->remove_prefix(take);
  received_ += take;
  if (data.size() == size) ++next_;
  return absl::OkStatus();
}

absl::StatusOr<StateDict> SafetensorsReceiver::Finish() {
  AMPD_RETURN_IF_ERROR(error_);
  if (!layout_.has_value()) {
    if (head_.size() < 8) {
      return Fail(absl::InvalidArgumentError(absl::StrCat(
          "safetensors: ", head_.size(), " bytes is shorter than the 8-byte header length")));
    }
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("safetensors: header length ", head_bytes_ - 8, " runs past the end of the ",
                     received_, "-byte input")));
  }
  if (received_ != layout_->file_bytes) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("safetensors: the file ends after ", received_,
                     " bytes, but its header describes ", layout_->file_bytes)));
  }
  layout_.reset();
  return std::move(state_);
}

}  // namespace ampd::codec
