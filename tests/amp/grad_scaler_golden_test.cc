// The scaler's outward text pinned to a recorded transcript
// (tests/data/grad_scaler_golden.txt): the state dict each policy exports,
// as a checkpoint stores it ("scaler.<key>=<FormatStateNumber>", in export
// order); the exact message LoadStateDict gives for a missing, bad, unknown
// or foreign key; what ParseStateNumber accepts and how it refuses the
// rest; and the messages of config validation, which name fields by the
// policy's own labels. The transcript was recorded once and is compared
// line by line, so that restructuring the scaler cannot change a key, an
// order, a digit or a word of what checkpoints and clients see.
//
// AMPD_WRITE_GOLDEN=<path> writes the transcript there instead of comparing
// (for recording a deliberate change of the scaler's text, never to make a
// refactor pass).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "server/engine/amp/grad_scaler.h"

namespace ampd::engine::amp {
namespace {

constexpr bool G = false;  // a good step
constexpr bool I = true;   // found_inf

const ScalerPolicy kPolicies[] = {ScalerPolicy::kPyTorch, ScalerPolicy::kPaddle,
                                  ScalerPolicy::kDeepSpeed, ScalerPolicy::kMegatron};

// A step sequence that moves every counter of every policy off its start.
const std::vector<bool> kSteps = {G, I, G, G, I, I, G, G, G, I, G, G, G};

// The values every key of every policy is set to in turn: the boundaries of
// each check (0, 1, the float32 and 2^53 limits) and a non-integer.
const double kProbeValues[] = {std::nan(""),
                               HUGE_VAL,
                               -HUGE_VAL,
                               -2.0,
                               -1.0,
                               -0.0,
                               0.0,
                               0.5,
                               1.0,
                               1.5,
                               2.0,
                               3.0,
                               4.0,
                               5.0,
                               1e-50,
                               1e39,
                               9007199254740992.0,
                               9007199254740994.0,
                               1e300};

std::string Describe(const absl::Status& status) {
  if (status.ok()) return "OK";
  return absl::StrCat(absl::StatusCodeToString(status.code()), ": ", status.message());
}

// Exact text for a probe value ("%.17g" names every double uniquely).
std::string Exact(double v) { return absl::StrFormat("%.17g", v); }

void AppendState(std::string& out, absl::string_view indent, const ScalerState& state) {
  if (state.empty()) absl::StrAppend(&out, indent, "(empty)\n");
  for (const auto& [key, value] : state) {
    absl::StrAppend(&out, indent, "scaler.", key, "=", FormatStateNumber(value), "\n");
  }
}

std::optional<GradScaler> Make(const ScalerConfig& config, std::string& out) {
  absl::StatusOr<GradScaler> scaler = GradScaler::Create(config);
  if (!scaler.ok()) {
    absl::StrAppend(&out, "  create: ", Describe(scaler.status()), "\n");
    return std::nullopt;
  }
  return *std::move(scaler);
}

// The config each policy's probes start from: small interval and a
// hysteresis above 1, so the counters reach interesting values.
ScalerConfig Probed(ScalerPolicy policy) {
  ScalerConfig c = ScalerConfig::Defaults(policy);
  c.init_scale = 4096;
  c.growth_interval = 4;
  c.hysteresis = 3;
  return c;
}

// A scaler of `config` after `steps`, loaded with `state`: the status and,
// when it loaded, the state it then exports.
void AppendLoad(std::string& out, const ScalerConfig& config, const ScalerState& state) {
  std::optional<GradScaler> s = Make(config, out);
  if (!s.has_value()) return;
  for (bool inf : kSteps) {
    if (!s->Update(inf).ok()) break;
  }
  const ScalerState before = s->StateDict();
  const absl::Status status = s->LoadStateDict(state);
  absl::StrAppend(&out, "  ", Describe(status), "\n");
  if (status.ok()) {
    AppendState(out, "    ", s->StateDict());
  } else if (s->StateDict() != before) {
    absl::StrAppend(&out, "    a refused load changed the state\n");
  }
}

std::string Transcript() {
  std::string out;

  out += "# Exported state dicts\n";
  for (ScalerPolicy policy : kPolicies) {
    std::vector<std::pair<std::string, ScalerConfig>> configs;
    configs.emplace_back("defaults", ScalerConfig::Defaults(policy));
    configs.emplace_back("probed", Probed(policy));
    {
      // Factors and a scale that are not powers of two exercise the 9- and
      // 17-digit forms of FormatStateNumber.
      ScalerConfig c = Probed(policy);
      c.init_scale = 3.3;
      c.growth_factor = 1.1;
      c.backoff_factor = 0.3;
      c.min_scale = 0.1;
      c.max_scale = 1e6;
      configs.emplace_back("odd factors", c);
    }
    {
      ScalerConfig c = Probed(policy);
      c.consecutive_hysteresis = true;
      c.raise_at_min_scale = false;
      configs.emplace_back("consecutive hysteresis", c);
    }
    {
      ScalerConfig c = Probed(policy);
      c.dynamic = false;
      configs.emplace_back("static", c);
    }
    {
      ScalerConfig c = Probed(policy);
      c.enabled = false;
      configs.emplace_back("disabled", c);
    }
    configs.emplace_back("bf16 default",
                         ScalerConfig::ForPrecisionDefault(codec::DType::kBF16, policy));
    for (const auto& [name, config] : configs) {
      absl::StrAppend(&out, "policy ", PolicyName(policy), ", ", name, "\n");
      std::optional<GradScaler> s = Make(config, out);
      if (!s.has_value()) continue;
      AppendState(out, "  fresh: ", s->StateDict());
      for (bool inf : kSteps) {
        absl::StatusOr<ScalerUpdate> u = s->Update(inf);
        if (!u.ok()) {
          absl::StrAppend(&out, "  update: ", Describe(u.status()), "\n");
          break;
        }
      }
      AppendState(out, "  stepped: ", s->StateDict());
    }
  }

  out += "\n# LoadStateDict: empty, missing, probed and extra keys\n";
  for (ScalerPolicy policy : kPolicies) {
    const ScalerConfig config = Probed(policy);
    std::optional<GradScaler> reference = Make(config, out);
    if (!reference.has_value()) continue;
    for (bool inf : kSteps) (void)reference->Update(inf);
    const ScalerState full = reference->StateDict();
    absl::StrAppend(&out, "policy ", PolicyName(policy), " empty state\n");
    AppendLoad(out, config, {});
    for (const auto& [key, value] : full) {
      ScalerState partial = full;
      partial.erase(key);
      absl::StrAppend(&out, "policy ", PolicyName(policy), " without ", key, "\n");
      AppendLoad(out, config, partial);
    }
    for (const auto& [key, value] : full) {
      for (double probe : kProbeValues) {
        ScalerState probed = full;
        probed[key] = probe;
        absl::StrAppend(&out, "policy ", PolicyName(policy), " ", key, "=", Exact(probe), "\n");
        AppendLoad(out, config, probed);
      }
    }
    for (const char* extra : {"_hysteresis", "aaa", "zzz", "scale", "cur_scale"}) {
      if (full.contains(extra)) continue;
      ScalerState with_extra = full;
      with_extra[extra] = 1.0;
      absl::StrAppend(&out, "policy ", PolicyName(policy), " with extra ", extra, "\n");
      AppendLoad(out, config, with_extra);
    }
  }

  out += "\n# LoadStateDict: one policy's state into another's scaler\n";
  for (ScalerPolicy from : kPolicies) {
    std::optional<GradScaler> source = Make(Probed(from), out);
    if (!source.has_value()) continue;
    for (ScalerPolicy to : kPolicies) {
      absl::StrAppend(&out, "state of ", PolicyName(from), " into ", PolicyName(to), "\n");
      AppendLoad(out, Probed(to), source->StateDict());
    }
  }

  out += "\n# LoadStateDict: a loaded scale and floor against the config's bounds\n";
  for (ScalerPolicy policy : kPolicies) {
    ScalerConfig bounded = Probed(policy);
    bounded.min_scale = 2.0;
    bounded.max_scale = 65536.0;
    std::optional<GradScaler> reference = Make(bounded, out);
    if (!reference.has_value()) continue;
    const ScalerState full = reference->StateDict();
    const std::string scale_key = full.contains("cur_scale") ? "cur_scale" : "scale";
    for (double scale : {1.0, 2.0, 65536.0, 131072.0}) {
      ScalerState state = full;
      state[scale_key] = scale;
      absl::StrAppend(&out, "policy ", PolicyName(policy), " bounded [2, 65536], ", scale_key, "=",
                      Exact(scale), "\n");
      AppendLoad(out, bounded, state);
    }
    if (full.contains("min_scale")) {
      for (double floor : {0.5, 65536.0, 131072.0}) {
        ScalerState state = full;
        state["min_scale"] = floor;
        absl::StrAppend(&out, "policy ", PolicyName(policy),
                        " bounded [2, 65536], min_scale=", Exact(floor), "\n");
        AppendLoad(out, bounded, state);
      }
    }
  }
  {
    // A disabled scaler ignores whatever it is given.
    ScalerConfig disabled;
    disabled.enabled = false;
    out += "disabled pytorch, state {scale=8}\n";
    AppendLoad(out, disabled, {{"scale", 8.0}});
  }

  out += "\n# ParseStateNumber\n";
  for (const std::string& text : std::vector<std::string>{"16",
                                                          "-1",
                                                          "0",
                                                          "-0",
                                                          "0.5",
                                                          ".5",
                                                          "5.",
                                                          "65536",
                                                          "1e+30",
                                                          "1.5E-3",
                                                          "4294967296",
                                                          "3.29999995",
                                                          "1.1000000000000001",
                                                          "9007199254740993",
                                                          "1e308",
                                                          "1e-320",
                                                          "0x10",
                                                          "0X10",
                                                          "0x1p4",
                                                          "1e-999",
                                                          "1e999",
                                                          "inf",
                                                          "-inf",
                                                          "nan",
                                                          "infinity",
                                                          "+16",
                                                          " 16",
                                                          "16 ",
                                                          "16abc",
                                                          "",
                                                          "-",
                                                          ".",
                                                          "e5",
                                                          "1e",
                                                          "1e+",
                                                          "1..5",
                                                          "--1",
                                                          "1,5",
                                                          "\"16\"",
                                                          std::string("1\0", 2),
                                                          "\xff"}) {
    absl::StatusOr<double> v = ParseStateNumber("scale", text);
    absl::StrAppend(&out, "\"", absl::CHexEscape(text), "\" -> ",
                    v.ok() ? Exact(*v) : Describe(v.status()), "\n");
  }

  out += "\n# FormatStateNumber\n";
  for (double v : {0.0,
                   -0.0,
                   1.0,
                   -1.0,
                   65536.0,
                   4294967296.0,
                   9007199254740991.0,
                   9007199254740992.0,
                   9007199254740994.0,
                   1e300,
                   0.5,
                   0.1,
                   1.1,
                   static_cast<double>(3.3f),
                   static_cast<double>(0.1f),
                   3.3,
                   1e-45,
                   std::ldexp(1.0, -149),
                   std::nan(""),
                   HUGE_VAL,
                   -HUGE_VAL}) {
    absl::StrAppend(&out, Exact(v), " -> ", FormatStateNumber(v), "\n");
  }

  out += "\n# ScalerConfig::Validate, field by field\n";
  for (ScalerPolicy policy : kPolicies) {
    std::vector<std::pair<std::string, ScalerConfig>> cases;
    auto with = [&](const std::string& name, auto change) {
      ScalerConfig c = ScalerConfig::Defaults(policy);
      change(c);
      cases.emplace_back(name, c);
    };
    with("defaults", [](ScalerConfig&) {});
    with("init_scale=0", [](ScalerConfig& c) { c.init_scale = 0; });
    with("init_scale=1e39", [](ScalerConfig& c) { c.init_scale = 1e39; });
    with("init_scale=nan", [](ScalerConfig& c) { c.init_scale = std::nan(""); });
    with("growth_factor=1", [](ScalerConfig& c) { c.growth_factor = 1; });
    with("growth_factor=inf", [](ScalerConfig& c) { c.growth_factor = HUGE_VAL; });
    with("backoff_factor=1", [](ScalerConfig& c) { c.backoff_factor = 1; });
    with("backoff_factor=0", [](ScalerConfig& c) { c.backoff_factor = 0; });
    with("growth_interval=0", [](ScalerConfig& c) { c.growth_interval = 0; });
    with("hysteresis=0", [](ScalerConfig& c) { c.hysteresis = 0; });
    with("min_scale=-1", [](ScalerConfig& c) { c.min_scale = -1; });
    with("min_scale unset", [](ScalerConfig& c) { c.min_scale.reset(); });
    with("max_scale=inf", [](ScalerConfig& c) { c.max_scale = HUGE_VAL; });
    with("min_scale=8 max_scale=4", [](ScalerConfig& c) {
      c.min_scale = 8;
      c.max_scale = 4;
    });
    with("init_scale below min_scale", [](ScalerConfig& c) {
      c.init_scale = 0.5;
      c.min_scale = 1;
    });
    with("init_scale above max_scale", [](ScalerConfig& c) { c.max_scale = 1024; });
    for (const auto& [name, config] : cases) {
      absl::StrAppend(&out, "policy ", PolicyName(policy), " ", name, ": ",
                      Describe(config.Validate()), "\n");
    }
  }

  out += "\n# deepspeed at its floor\n";
  {
    ScalerConfig c = ScalerConfig::Defaults(ScalerPolicy::kDeepSpeed);
    c.init_scale = 1;
    c.hysteresis = 1;
    std::optional<GradScaler> s = Make(c, out);
    if (s.has_value()) {
      absl::StrAppend(&out, "update: ", Describe(s->Update(true).status()), "\n");
    }
  }
  return out;
}

std::string GoldenPath() { return absl::StrCat(AMPD_TEST_DATA_DIR, "/grad_scaler_golden.txt"); }

TEST(GradScalerGolden, TextMatchesTheRecording) {
  const std::string got = Transcript();
  if (const char* path = std::getenv("AMPD_WRITE_GOLDEN"); path != nullptr && *path != '\0') {
    // Regeneration still compares with the recording below, so the run that
    // writes a new transcript also shows what changed.
    std::ofstream(path, std::ios::binary) << got;
  }
  std::ifstream in(GoldenPath(), std::ios::binary);
  ASSERT_TRUE(in.good()) << "cannot read " << GoldenPath();
  std::stringstream buffer;
  buffer << in.rdbuf();
  const std::string want = buffer.str();
  const std::vector<std::string> want_lines = absl::StrSplit(want, '\n');
  const std::vector<std::string> got_lines = absl::StrSplit(got, '\n');
  size_t mismatches = 0;
  for (size_t i = 0; i < std::max(want_lines.size(), got_lines.size()); ++i) {
    const std::string w = i < want_lines.size() ? want_lines[i] : "(none)";
    const std::string g = i < got_lines.size() ? got_lines[i] : "(none)";
    if (w == g) continue;
    ADD_FAILURE() << "line " << i + 1 << "\n  recorded: " << w << "\n  now:      " << g;
    if (++mismatches == 20) break;
  }
  EXPECT_EQ(want_lines.size(), got_lines.size());
  // Guards against an empty or truncated recording passing vacuously.
  EXPECT_GT(want_lines.size(), 1000u);
}

}  // namespace
}  // namespace ampd::engine::amp
