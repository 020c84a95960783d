// libFuzzer target: the scaler-state loader on its own. The bytes are
// "key=value" lines, a checkpoint's scaler.* metadata without the prefix;
// the first byte picks the policy (adaptive included). Values are parsed as
// LoadStateDict's caller parses them (ParseStateNumber) and loaded into a
// fresh scaler of that policy. An accepted state must give a finite,
// positive scale, and the scaler's own StateDict must load back to the same
// state. A few updates follow, with gradient statistics (max|g|, underflow
// fraction) drawn from the first byte, so the adaptive policy's deferral,
// early growth and calibration run from every state it accepts; every
// state they reach must load back as it is, and an update the scaler
// refuses (at its floor) must change nothing.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "server/engine/amp/grad_scaler.h"
#include "tests/fuzz/fuzz_jobs.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace amp = ampd::engine::amp;
  if (size == 0) return 0;
  const amp::ScalerPolicy policies[] = {amp::ScalerPolicy::kPyTorch, amp::ScalerPolicy::kPaddle,
                                        amp::ScalerPolicy::kDeepSpeed, amp::ScalerPolicy::kMegatron,
                                        amp::ScalerPolicy::kAdaptive};
  const amp::ScalerPolicy policy = policies[data[0] % 5];
  const absl::string_view text(reinterpret_cast<const char*>(data) + 1, size - 1);
  amp::ScalerState state;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    const size_t eq = line.find('=');
    if (eq == absl::string_view::npos) return 0;
    const absl::string_view key = line.substr(0, eq);
    absl::StatusOr<double> value = amp::ParseStateNumber(key, line.substr(eq + 1));
    if (!value.ok()) return 0;
    ampd::fuzz::Check(std::isfinite(*value), "a parsed state value is finite");
    state[std::string(key)] = *value;
  }
  absl::StatusOr<amp::GradScaler> scaler =
      amp::GradScaler::Create(amp::ScalerConfig::Defaults(policy));
  ampd::fuzz::Check(scaler.ok(), "the policy's defaults make a scaler");
  const amp::ScalerState defaults = scaler->StateDict();
  if (!scaler->LoadStateDict(state).ok()) {
    ampd::fuzz::Check(scaler->StateDict() == defaults, "a refused state changes nothing");
    return 0;
  }
  ampd::fuzz::Check(std::isfinite(scaler->scale()) && scaler->scale() > 0.0f,
                    "a loaded scale is finite and positive");
  absl::StatusOr<amp::GradScaler> again =
      amp::GradScaler::Create(amp::ScalerConfig::Defaults(policy));
  ampd::fuzz::Check(again.ok() && again->LoadStateDict(scaler->StateDict()).ok(),
                    "the scaler's own state loads back");
  ampd::fuzz::Check(again->StateDict() == scaler->StateDict(), "and is the same state");
  // max|g| values from tiny to past fp16's range, inf (an overflow the
  // check pass saw) and none at all, and underflow fractions 0..1.
  const float max_abs_choices[] = {
      0.0f, 1e-30f, 1e-3f, 1.0f, 7e4f, 3e38f, std::numeric_limits<float>::infinity()};
  const uint8_t pick = data[0];
  if (again->NeedsCalibration()) {
    const float calibrated = again->Calibrate(max_abs_choices[pick % 7]);
    ampd::fuzz::Check(std::isfinite(calibrated) && calibrated > 0.0f,
                      "calibration gives a finite, positive scale");
  }
  // A few updates from the loaded state must keep the scale usable, and
  // every state they reach (or refuse to leave) must load back.
  for (int i = 0; i < 4; ++i) {
    amp::StepGradStats stats;
    stats.found_inf = (pick >> 2) & (1 << i);
    if ((pick >> i) & 1) stats.max_abs = max_abs_choices[(pick + i) % 7];
    if ((pick >> (i + 1)) & 1) stats.underflow_fraction = ((pick >> i) & 7) / 7.0;
    const amp::ScalerState before = again->StateDict();
    absl::StatusOr<amp::ScalerUpdate> update = again->Update(stats);
    absl::StatusOr<amp::GradScaler> reloaded =
        amp::GradScaler::Create(amp::ScalerConfig::Defaults(policy));
    ampd::fuzz::Check(reloaded.ok() && reloaded->LoadStateDict(again->StateDict()).ok() &&
                          reloaded->StateDict() == again->StateDict(),
                      "every state a scaler reaches loads back as it is");
    if (!update.ok()) {
      // At its floor: a clean refusal that fails the job.
      ampd::fuzz::Check(update.status().code() == absl::StatusCode::kFailedPrecondition &&
                            again->StateDict() == before,
                        "a refused update is FailedPrecondition and changes nothing");
      break;
    }
    ampd::fuzz::Check(std::isfinite(again->scale()) && again->scale() > 0.0f,
                      "updates keep the scale finite and positive");
    ampd::fuzz::Check(update->skipped == (stats.found_inf && again->config().enabled),
                      "a step is skipped exactly when it overflowed");
  }
  return 0;
}
