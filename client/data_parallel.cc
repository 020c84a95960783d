// DataParallelJob: parallel sends, one retry loop for the whole group.
#include "client/data_parallel.h"

#include <cmath>
#include <cstdint>
#include <random>
#include <thread>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"

namespace ampd {

namespace {

// A step or create that failed only because a rank is not there (yet):
// worth sending again to every rank.
bool Retryable(const absl::Status& s) {
  return s.code() == absl::StatusCode::kUnavailable ||
         s.code() == absl::StatusCode::kDeadlineExceeded || s.code() == absl::StatusCode::kAborted;
}

// Equal, or both NaN (a step whose batch holds a NaN reports a NaN loss on
// every rank).
bool SameFloat(float a, float b) { return a == b || (std::isnan(a) && std::isnan(b)); }

// Runs fn(rank) on one thread per rank and returns each rank's result.
template <typename T, typename Fn>
std::vector<absl::StatusOr<T>> OnEveryRank(int world_size, Fn fn) {
  std::vector<absl::StatusOr<T>> results(static_cast<size_t>(world_size),
                                         absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int r = 0; r < world_size; ++r) {
    threads.emplace_back([&results, &fn, r] { results[static_cast<size_t>(r)] = fn(r); });
  }
  for (std::thread& t : threads) t.join();
  return results;
}

// Sends until every rank succeeds, one fails for good, or retry_for passes.
template <typename T, typename Fn>
absl::StatusOr<std::vector<T>> UntilEveryRankAnswers(int world_size, absl::Duration retry_for,
                                                     absl::string_view what, Fn fn) {
  const absl::Time give_up = absl::Now() + retry_for;
  absl::Duration backoff = absl::Milliseconds(100);
  for (;;) {
    std::vector<absl::StatusOr<T>> results = OnEveryRank<T>(world_size, fn);
    absl::Status first_error;
    bool retry = true;
    for (size_t r = 0; r < results.size(); ++r) {
      if (results[r].ok()) continue;
      const absl::Status& s = results[r].status();
      if (first_error.ok()) {
        // Named by call and rank, its ErrorInfo (the payload) kept.
        first_error = absl::Status(s.code(), absl::StrCat(what, ": rank ", r, ": ", s.message()));
        s.ForEachPayload([&first_error](absl::string_view url, const absl::Cord& payload) {
          first_error.SetPayload(url, payload);
        });
      }
      if (!Retryable(s)) retry = false;
    }
    if (first_error.ok()) {
      std::vector<T> values;
      for (absl::StatusOr<T>& v : results) values.push_back(*std::move(v));
      return values;
    }
    if (!retry || absl::Now() + backoff > give_up) return first_error;
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, absl::Seconds(2));
  }
}

}  // namespace

absl::StatusOr<std::vector<v1::MicroBatch>> SplitRows(const v1::MicroBatch& batch, int64_t parts) {
  if (parts < 1) return absl::InvalidArgumentError("parts: must be >= 1");
  std::vector<v1::MicroBatch> out(static_cast<size_t>(parts));
  auto split = [&](const v1::Tensor& t, absl::string_view name,
                   v1::Tensor* (v1::MicroBatch::*field)()) -> absl::Status {
    if (t.shape_size() < 1) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": has no rows to split"));
    }
    const int64_t rows = t.shape(0);
    if (rows % parts != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": ", rows, " rows do not split into ", parts, " equal shares"));
    }
    const size_t bytes_per_share = t.data().size() / static_cast<size_t>(parts);
    if (bytes_per_share * static_cast<size_t>(parts) != t.data().size()) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": data does not match its shape"));
    }
    for (int64_t p = 0; p < parts; ++p) {
      v1::Tensor* share = (out[static_cast<size_t>(p)].*field)();
      *share = t;
      share->set_shape(0, rows / parts);
      share->set_data(t.data().substr(static_cast<size_t>(p) * bytes_per_share, bytes_per_share));
    }
    return absl::OkStatus();
  };
  AMPD_RETURN_IF_ERROR(split(batch.inputs(), "inputs", &v1::MicroBatch::mutable_inputs));
  AMPD_RETURN_IF_ERROR(split(batch.targets(), "targets", &v1::MicroBatch::mutable_targets));
  // A token loss's per-token inputs share the targets' rows.
  if (batch.has_weights()) {
    AMPD_RETURN_IF_ERROR(split(batch.weights(), "weights", &v1::MicroBatch::mutable_weights));
  }
  if (batch.has_advantages()) {
    AMPD_RETURN_IF_ERROR(
        split(batch.advantages(), "advantages", &v1::MicroBatch::mutable_advantages));
  }
  if (batch.has_sampling_logprobs()) {
    AMPD_RETURN_IF_ERROR(split(batch.sampling_logprobs(), "sampling_logprobs",
                               &v1::MicroBatch::mutable_sampling_logprobs));
  }
  return out;
}

absl::StatusOr<std::unique_ptr<DataParallelJob>> DataParallelJob::Create(
    v1::CreateJobRequest request, DataParallelOptions options) {
  const int world_size = static_cast<int>(options.servers.size());
  if (world_size < 2) return absl::InvalidArgumentError("world_size: needs at least 2 servers");
  std::string group = options.group;
  if (group.empty()) {
    absl::BitGen gen;
    group = absl::StrFormat("ampctl-%016x", absl::Uniform<uint64_t>(gen));
  }
  std::string secret = options.secret;
  if (secret.empty()) {
    // From the system's entropy (std::random_device reads getrandom), not
    // a seeded generator: it is what keeps others out of the group.
    std::random_device entropy;
    while (secret.size() < 32) {
      const uint32_t word = entropy();
      secret.append(reinterpret_cast<const char*>(&word), sizeof(word));
    }
  }
  // A resent create returns the job the first one made, on every rank.
  if (request.request_id().empty()) request.set_request_id(absl::StrCat(group, "-create"));
  std::vector<std::unique_ptr<Client>> clients;
  ClientOptions client_options = options.client;
  client_options.max_attempts = 1;  // the group's loop below retries
  for (const std::string& server : options.servers) {
    clients.push_back(Client::Connect(server, client_options));
  }
  auto job = std::unique_ptr<DataParallelJob>(
      new DataParallelJob(std::move(clients), std::move(options), group));
  v1::Distributed* d = request.mutable_config()->mutable_distributed();
  d->set_world_size(world_size);
  d->set_group(group);
  d->set_secret(secret);
  d->set_rendezvous(job->options_.rendezvous);
  d->set_timeout_ms(absl::ToInt64Milliseconds(job->options_.timeout));
  AMPD_ASSIGN_OR_RETURN(
      job->jobs_,
      UntilEveryRankAnswers<v1::Job>(
          world_size, job->options_.retry_for, "CreateJob", [&](int r) -> absl::StatusOr<v1::Job> {
            v1::CreateJobRequest mine = request;
            mine.mutable_config()->mutable_distributed()->set_rank(r);
            return job->clients_[static_cast<size_t>(r)]->CreateJob(mine);
          }));
  return job;
}

absl::StatusOr<v1::StepResponse> DataParallelJob::Step(
    int64_t sequence, const std::vector<std::vector<v1::MicroBatch>>& shares,
    const v1::StepRequest& common) {
  if (static_cast<int>(shares.size()) != world_size()) {
    return absl::InvalidArgumentError("shares: one list of micro-batches per rank");
  }
  AMPD_ASSIGN_OR_RETURN(const std::vector<v1::StepResponse> responses,
                        UntilEveryRankAnswers<v1::StepResponse>(
                            world_size(), options_.retry_for, absl::StrCat("Step ", sequence),
                            [&](int r) -> absl::StatusOr<v1::StepResponse> {
                              v1::StepRequest request = common;
                              request.clear_micro_batches();
                              request.set_job_id(jobs_[static_cast<size_t>(r)].job_id());
                              request.set_sequence(sequence);
                              for (const v1::MicroBatch& mb : shares[static_cast<size_t>(r)]) {
                                *request.add_micro_batches() = mb;
                              }
                              return clients_[static_cast<size_t>(r)]->Step(request);
                            }));
  const v1::StepResponse& first = responses[0];
  for (size_t r = 1; r < responses.size(); ++r) {
    const v1::StepResponse& other = responses[r];
    if (other.global_step() != first.global_step() || other.skipped() != first.skipped() ||
        other.scale_after() != first.scale_after() || !SameFloat(other.loss(), first.loss()) ||
        other.applied_steps() != first.applied_steps()) {
      return absl::DataLossError(absl::StrCat(
          "Step ", sequence, ": rank ", r, " reports step ", other.global_step(), " loss ",
          other.loss(), " scale ", other.scale_after(), (other.skipped() ? " skipped" : ""),
          " against rank 0's step ", first.global_step(), " loss ", first.loss(), " scale ",
          first.scale_after(), (first.skipped() ? " skipped" : ""), ": the replicas diverged"));
    }
  }
  return first;
}

absl::Status DataParallelJob::Delete() {
  absl::Status result;
  for (size_t r = 0; r < clients_.size(); ++r) {
    absl::Status s = clients_[r]->DeleteJob(jobs_[r].job_id());
    if (!s.ok() && result.ok()) result = s;
  }
  return result;
}

}  // namespace ampd
