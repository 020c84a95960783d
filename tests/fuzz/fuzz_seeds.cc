// Writes the fuzz targets' seed corpus: well-formed requests and state
// dicts of the fixed jobs (fuzz_jobs.h), plus the hostile inputs that once
// crashed or corrupted ampd, so each run starts from them. Generated from
// code rather than committed as binary files, so the seeds follow the proto
// and the state-dict format as they change.
//   ampd_fuzz_seeds DIR   writes DIR/<target>/<seed> for every target
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <utility>

#include "ampd/v1/peer.pb.h"
#include "codec/safetensors.h"
#include "server/engine/amp/grad_scaler.h"
#include "tests/fuzz/fuzz_jobs.h"

namespace {

namespace fs = std::filesystem;
using ampd::fuzz::FuzzJob;

bool Write(const fs::path& dir, const std::string& name, const std::string& bytes) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  std::ofstream out(dir / name, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.close();
  if (!out) {
    std::fprintf(stderr, "ampd_fuzz_seeds: cannot write %s\n", (dir / name).c_str());
    return false;
  }
  return true;
}

// The state dict the job exports, with one metadata value replaced.
std::string StateWith(FuzzJob job, const std::string& key, const std::string& value) {
  absl::StatusOr<ampd::codec::StateDict> state = ampd::fuzz::TrainerFor(job).ExportState();
  ampd::fuzz::Check(state.ok(), "the fuzz job exports its state");
  if (!key.empty()) state->metadata[key] = value;
  return ampd::codec::EncodeSafetensors(*state);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR\n", argv[0]);
    return 2;
  }
  const fs::path root = argv[1];
  bool ok = true;

  // CreateJob: both jobs, and the sizes that once overflowed or allocated
  // before any check.
  const fs::path create = root / "create_job";
  ok &= Write(create, "mlp", ampd::fuzz::CreateRequestFor(FuzzJob::kMlp).SerializeAsString());
  ok &= Write(create, "ce", ampd::fuzz::CreateRequestFor(FuzzJob::kEmbedding).SerializeAsString());
  for (const int64_t in : {std::numeric_limits<int64_t>::max(), int64_t{2147483648}}) {
    ampd::v1::CreateJobRequest huge = ampd::fuzz::CreateRequestFor(FuzzJob::kMlp);
    huge.mutable_config()->mutable_model()->mutable_layers(0)->mutable_linear()->set_in_features(
        in);
    ok &= Write(create, "linear_in_" + std::to_string(in), huge.SerializeAsString());
    ampd::v1::CreateJobRequest table = ampd::fuzz::CreateRequestFor(FuzzJob::kEmbedding);
    table.mutable_config()
        ->mutable_model()
        ->mutable_layers(0)
        ->mutable_embedding()
        ->set_num_embeddings(in);
    ok &= Write(create, "embedding_rows_" + std::to_string(in), table.SerializeAsString());
  }

  // Step: well-formed batches of both jobs, two micro-batches, a bad label.
  const fs::path step = root / "step";
  ok &= Write(step, "mlp", ampd::fuzz::StepRequestFor(FuzzJob::kMlp, 4).SerializeAsString());
  ok &= Write(step, "ce", ampd::fuzz::StepRequestFor(FuzzJob::kEmbedding, 4).SerializeAsString());
  ok &= Write(step, "gpt", ampd::fuzz::StepRequestFor(FuzzJob::kGpt, 2).SerializeAsString());
  ok &= Write(step, "gpt_cross_entropy",
              ampd::fuzz::TokenLossStepFor(ampd::v1::LOSS_FN_CROSS_ENTROPY, 2).SerializeAsString());
  ok &= Write(
      step, "gpt_importance_sampling",
      ampd::fuzz::TokenLossStepFor(ampd::v1::LOSS_FN_IMPORTANCE_SAMPLING, 2).SerializeAsString());
  ok &= Write(step, "gpt_ppo",
              ampd::fuzz::TokenLossStepFor(ampd::v1::LOSS_FN_PPO, 3).SerializeAsString());
  ok &= Write(step, "gpt_cispo",
              ampd::fuzz::TokenLossStepFor(ampd::v1::LOSS_FN_CISPO, 2).SerializeAsString());
  ok &= Write(step, "gpt_dro",
              ampd::fuzz::TokenLossStepFor(ampd::v1::LOSS_FN_DRO, 2).SerializeAsString());
  ampd::v1::StepRequest two = ampd::fuzz::StepRequestFor(FuzzJob::kMlp, 3);
  *two.add_micro_batches() = two.micro_batches(0);
  ok &= Write(step, "mlp_two_micro_batches", two.SerializeAsString());

  // State dicts: both jobs' own, and scaler values that were once accepted.
  const fs::path safetensors = root / "safetensors";
  const fs::path load = root / "load_state";
  for (const FuzzJob job : {FuzzJob::kMlp, FuzzJob::kEmbedding}) {
    const std::string name = job == FuzzJob::kMlp ? "mlp" : "ce";
    const std::string scale_key = job == FuzzJob::kMlp ? "scaler.scale" : "scaler.cur_scale";
    ok &= Write(safetensors, name, StateWith(job, "", ""));
    ok &= Write(load, name, StateWith(job, "", ""));
    for (const char* bad : {"0", "1e-999", "0x10", "inf", "-1"}) {
      ok &= Write(load, name + "_scale_" + bad, StateWith(job, scale_key, bad));
    }
  }
  // Scaler states: a policy byte, then "key=value" lines. Each policy's own
  // state, and the scale values that were once accepted.
  const fs::path scaler = root / "scaler_state";
  const char* const policies[] = {"pytorch", "paddle", "deepspeed", "megatron", "adaptive"};
  for (int policy = 0; policy < 5; ++policy) {
    absl::StatusOr<ampd::engine::amp::GradScaler> s =
        ampd::engine::amp::GradScaler::Create(ampd::engine::amp::ScalerConfig::Defaults(
            static_cast<ampd::engine::amp::ScalerPolicy>(policy)));
    ampd::fuzz::Check(s.ok(), "a scaler of each policy");
    std::string lines(1, static_cast<char>(policy));
    for (const auto& [key, value] : s->StateDict()) {
      lines += key + "=" + ampd::engine::amp::FormatStateNumber(value) + "\n";
    }
    ok &= Write(scaler, policies[policy], lines);
    // The same state with a scale far beyond int64's range: loading it once
    // converted every value to int64 before knowing the field was a scale.
    std::string huge(1, static_cast<char>(policy));
    for (const auto& [key, value] : s->StateDict()) {
      const bool is_scale = key == "scale" || key == "cur_scale";
      huge += key + "=" + (is_scale ? "1e300" : ampd::engine::amp::FormatStateNumber(value)) + "\n";
    }
    ok &= Write(scaler, std::string(policies[policy]) + "_scale_1e300", huge);
  }
  for (const char* bad : {"0", "1e-999", "0x10", "inf", "-1", "+16", " 16"}) {
    ok &= Write(scaler, std::string("pytorch_scale_") + bad,
                std::string(1, '\0') + "scale=" + bad + "\n");
  }
  // Peer: signed and unsigned calls of the hosted group, a stranger's
  // group, keys without a group, and the 64 KiB value of a flood.
  const fs::path peer = root / "peer";
  auto peer_input = [](uint8_t op, const google::protobuf::Message& request) {
    return std::string(1, static_cast<char>(op)) + request.SerializeAsString();
  };
  for (int rank = 0; rank < 2; ++rank) {
    ampd::v1::JoinRequest join;
    join.set_group(ampd::fuzz::kPeerGroup);
    join.set_rank(rank);
    join.set_world_size(2);
    join.set_fingerprint("fingerprint");
    join.set_timeout_ms(25000);
    const std::string name = "join_rank_" + std::to_string(rank);
    ok &= Write(peer, name + "_signed",
                peer_input(ampd::fuzz::kPeerJoin | ampd::fuzz::kPeerSigned, join));
    ok &= Write(peer, name, peer_input(ampd::fuzz::kPeerJoin, join));
    join.set_group("stranger");
    ok &= Write(peer, name + "_stranger",
                peer_input(ampd::fuzz::kPeerJoin | ampd::fuzz::kPeerSigned, join));
  }
  ampd::v1::SetRequest set;
  set.set_key(std::string(ampd::fuzz::kPeerGroup) + "/0/rank_0");
  set.set_value("127.0.0.1:40000");
  ok &= Write(peer, "set_signed", peer_input(ampd::fuzz::kPeerSet | ampd::fuzz::kPeerSigned, set));
  ok &= Write(peer, "set", peer_input(ampd::fuzz::kPeerSet, set));
  set.set_value(std::string(64 << 10, 'v'));
  ok &= Write(peer, "set_64k_signed",
              peer_input(ampd::fuzz::kPeerSet | ampd::fuzz::kPeerSigned, set));
  set.set_key("no-group");
  ok &= Write(peer, "set_no_group", peer_input(ampd::fuzz::kPeerSet, set));
  ampd::v1::GetRequest get;
  get.set_key(std::string(ampd::fuzz::kPeerGroup) + "/0/rank_0");
  get.set_timeout_ms(25000);
  ok &= Write(peer, "get_signed", peer_input(ampd::fuzz::kPeerGet | ampd::fuzz::kPeerSigned, get));
  ok &= Write(peer, "get", peer_input(ampd::fuzz::kPeerGet, get));

  // config.json: one of each family (what an export writes), and the
  // documents and keys that once stalled the server or built a per-layer
  // list of a claimed size. Both the JSON reader and the mapping start
  // from them.
  const std::string llama =
      R"({"model_type": "llama", "vocab_size": 64, "hidden_size": 32, )"
      R"("intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, )"
      R"("num_key_value_heads": 2, "max_position_embeddings": 16, "rope_theta": 500000.0, )"
      R"("rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, )"
      R"("high_freq_factor": 4.0, "original_max_position_embeddings": 8}})";
  const std::string qwen3 =
      R"({"model_type": "qwen3", "vocab_size": 64, "hidden_size": 32, )"
      R"("intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, )"
      R"("head_dim": 8, "max_position_embeddings": 16, "attention_bias": true, )"
      R"("layer_types": ["full_attention", "full_attention"]})";
  const std::string gemma =
      R"({"model_type": "gemma3_text", "vocab_size": 64, "hidden_size": 32, )"
      R"("intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4, )"
      R"("head_dim": 8, "max_position_embeddings": 16, "sliding_window": 4, )"
      R"("rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0}, )"
      R"("sliding_attention": {"rope_theta": 10000.0}}, )"
      R"("layer_types": ["sliding_attention", "sliding_attention", "full_attention"]})";
  const std::string gpt2 =
      R"({"model_type": "gpt2", "vocab_size": 64, "n_positions": 16, "n_embd": 32, )"
      R"("n_layer": 2, "n_head": 4, "n_inner": null, "activation_function": "gelu_new", )"
      R"("layer_norm_epsilon": 1e-05, "tie_word_embeddings": true})";
  std::string many_keys = "{";
  for (int i = 0; i < 2000; ++i) many_keys += "\"" + std::to_string(i) + "\": 0, ";
  many_keys += "\"model_type\": \"llama\"}";
  const std::pair<const char*, std::string> configs[] = {
      {"llama", llama},
      {"qwen3", qwen3},
      {"gemma3", gemma},
      {"gpt2", gpt2},
      {"layers_1e12", std::string(R"({"model_type": "gemma3_text", "vocab_size": 64, )"
                                  R"("hidden_size": 32, "intermediate_size": 64, )"
                                  R"("num_hidden_layers": 1e12, "num_attention_heads": 4, )"
                                  R"("max_position_embeddings": 16})")},
      {"float_overflow", llama.substr(0, llama.size() - 1) + R"(, "rms_norm_eps": 1e39})"},
      {"deep", std::string(100, '[') + std::string(100, ']')},
      {"many_keys", many_keys},
      {"escapes", R"({"model_type": "\u006c\u006cama", "k\ud83d\ude00": "\n\t\""})"},
  };
  for (const auto& [name, text] : configs) {
    ok &= Write(root / "json_value", name, text);
    ok &= Write(root / "hf_config", name, text);
  }
  return ok ? 0 : 1;
}
