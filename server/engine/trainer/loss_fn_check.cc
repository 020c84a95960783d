// CheckLossFn (api.h): a step's loss parameters, each read by one token
// loss only (a parameter another loss does not read is refused, as a
// per-token input is in model/batch_check.cc) and each within its range.
#include <cmath>
#include <optional>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/engine/api.h"

namespace ampd::engine {

namespace {

// A loss parameter given to a kind that does not read it: refused, as a
// per-token input the loss does not read is (batch_check.cc).
absl::Status RefuseUnread(const std::optional<float>& value, absl::string_view name,
                          LossFnKind reader, LossFnKind kind) {
  if (!value.has_value() || kind == reader) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(name, ": loss_fn ", LossFnName(kind),
                                                 " does not read it (only ", LossFnName(reader),
                                                 " does); send none"));
}

}  // namespace

absl::Status CheckLossFn(const LossFn& fn) {
  AMPD_RETURN_IF_ERROR(RefuseUnread(fn.ppo_clip_low, "ppo_clip_low", LossFnKind::kPpo, fn.kind));
  AMPD_RETURN_IF_ERROR(RefuseUnread(fn.ppo_clip_high, "ppo_clip_high", LossFnKind::kPpo, fn.kind));
  AMPD_RETURN_IF_ERROR(
      RefuseUnread(fn.cispo_clip_low, "cispo_clip_low", LossFnKind::kCispo, fn.kind));
  AMPD_RETURN_IF_ERROR(
      RefuseUnread(fn.cispo_clip_high, "cispo_clip_high", LossFnKind::kCispo, fn.kind));
  AMPD_RETURN_IF_ERROR(RefuseUnread(fn.dro_beta, "dro_beta", LossFnKind::kDro, fn.kind));
  if (fn.temperature.has_value() && !(std::isfinite(*fn.temperature) && *fn.temperature > 0.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("temperature: must be finite and > 0, got ", *fn.temperature));
  }
  const float low = fn.clip_low();
  const float high = fn.clip_high();
  const bool finite = std::isfinite(low) && std::isfinite(high);
  if (fn.kind == LossFnKind::kPpo && !(finite && low >= 0.0f && low <= 1.0f && high >= 1.0f)) {
    // Named after the bound that breaks the order (the low one when both do).
    const bool low_bad = !(std::isfinite(low) && low >= 0.0f && low <= 1.0f);
    return absl::InvalidArgumentError(
        absl::StrCat(low_bad ? "ppo_clip_low" : "ppo_clip_high",
                     ": the ppo clip range must satisfy 0 <= ppo_clip_low <= 1 <= "
                     "ppo_clip_high, got ppo_clip_low ",
                     low, " and ppo_clip_high ", high));
  }
  if (fn.kind == LossFnKind::kCispo && !(finite && low >= 0.0f && low <= high)) {
    const bool low_bad = !(std::isfinite(low) && low >= 0.0f);
    return absl::InvalidArgumentError(
        absl::StrCat(low_bad ? "cispo_clip_low" : "cispo_clip_high",
                     ": the cispo clip range must be finite with 0 <= cispo_clip_low <= "
                     "cispo_clip_high, got cispo_clip_low ",
                     low, " and cispo_clip_high ", high));
  }
  if (fn.kind == LossFnKind::kDro && !(std::isfinite(fn.beta()) && fn.beta() >= 0.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("dro_beta: must be finite and >= 0, got ", fn.beta()));
  }
  return absl::OkStatus();
}

}  // namespace ampd::engine
