// libFuzzer target: the scaler-state loader on its own. The bytes are
// "key=value" lines, a checkpoint's scaler.* metadata without the prefix;
// the first byte picks the policy. Values are parsed as LoadStateDict's
// caller parses them (ParseStateNumber) and loaded into a fresh scaler of
// that policy. An accepted state must give a finite, positive scale, and
// the scaler's own StateDict must load back to the same state.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "server/engine/amp/grad_scaler.h"
#include "tests/fuzz/fuzz_jobs.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace amp = ampd::engine::amp;
  if (size == 0) return 0;
  const amp::ScalerPolicy policies[] = {amp::ScalerPolicy::kPyTorch, amp::ScalerPolicy::kPaddle,
                                        amp::ScalerPolicy::kDeepSpeed,
                                        amp::ScalerPolicy::kMegatron};
  const amp::ScalerPolicy policy = policies[data[0] % 4];
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
  // A few updates from the loaded state must keep the scale usable.
  for (int i = 0; i < 4; ++i) {
    absl::StatusOr<amp::ScalerUpdate> update =
        again->Update(/*found_inf=*/(data[0] >> 2) & (1 << i));
    if (!update.ok()) break;  // deepspeed at its minimum: a clean refusal
    ampd::fuzz::Check(std::isfinite(again->scale()) && again->scale() >= 0.0f,
                      "updates keep the scale finite");
  }
  return 0;
}
