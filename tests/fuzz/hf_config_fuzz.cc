// libFuzzer target: a Hugging Face config.json onto a ModelSpec
// (ModelSpecOfHfConfig), what CreateJob does with JobConfig.hf_config_json
// and the server with a --models-dir base's config.json. Any input must be
// refused with InvalidArgument or mapped, without allocating by what it
// claims (a layer count, a vocabulary); a mapped spec that validates and
// that a family writes (HfConfigOfModelSpec) must read back to a spec that
// writes the same text.
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "server/engine/config/model_spec.h"
#include "server/engine/model/hf_config.h"
#include "tests/fuzz/fuzz_jobs.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using ampd::engine::model::HfConfigOfModelSpec;
  using ampd::engine::model::ModelSpecOfHfConfig;
  using ampd::fuzz::Check;
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<ampd::engine::model::ModelSpec> spec = ModelSpecOfHfConfig(text);
  if (!spec.ok()) {
    Check(spec.status().code() == absl::StatusCode::kInvalidArgument,
          "a refused config.json is InvalidArgument");
    return 0;
  }
  if (!ampd::engine::model::ValidateModelSpec(*spec).ok()) return 0;
  absl::StatusOr<std::string> written = HfConfigOfModelSpec(*spec);
  if (!written.ok()) return 0;  // parts no family writes
  absl::StatusOr<ampd::engine::model::ModelSpec> again = ModelSpecOfHfConfig(*written);
  Check(again.ok(), "the config.json a family writes maps again");
  absl::StatusOr<std::string> rewritten = HfConfigOfModelSpec(*again);
  Check(rewritten.ok() && *rewritten == *written,
        "a written config.json reads back to a spec that writes it again");
  return 0;
}
