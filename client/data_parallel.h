// DataParallelJob: a client's handle on one job that spans world_size ampd
// replicas (docs/DISTRIBUTED.md). It creates the job on every replica (the
// same config but for distributed.rank) and sends each step to every rank at
// once, with the same sequence number and the rank's share of the batch: a
// rank's Step blocks until every rank has come, so the sends run in
// parallel. While a rank is missing (UNAVAILABLE, PEER_UNAVAILABLE) the whole
// step is sent again to every rank, for up to retry_for: each rank answers a
// step it applied already with its recorded report, so a resend is
// exactly-once everywhere.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "ampd/v1/trainer.pb.h"
#include "client/client.h"

namespace ampd {

struct DataParallelOptions {
  std::vector<std::string> servers;  // rank order; world_size = servers.size()
  std::string rendezvous;            // HOST:PORT of rank 0's --peer-address
  std::string group;                 // "" : a fresh random one
  // The job's distributed.secret (16..64 bytes; the ranks sign their calls
  // to the meeting point with it). "": 32 fresh random bytes. Give the same
  // one again to create the rest of a group some of whose ranks exist.
  std::string secret;
  absl::Duration timeout = absl::Seconds(30);   // the job's distributed.timeout_ms
  absl::Duration retry_for = absl::Minutes(5);  // how long one step is resent
  ClientOptions client;                         // per rank; its deadline must exceed `timeout`
};

// Every micro-batch of `batch` cut along dim 0 into `parts` consecutive row
// ranges of equal size, its token-loss inputs (weights, advantages,
// sampling_logprobs) with it where present: InvalidArgument when the rows do
// not divide.
absl::StatusOr<std::vector<v1::MicroBatch>> SplitRows(const v1::MicroBatch& batch, int64_t parts);

class DataParallelJob {
 public:
  // Creates the job (request.config's distributed is filled in here) on
  // every rank, retried as one step is.
  static absl::StatusOr<std::unique_ptr<DataParallelJob>> Create(v1::CreateJobRequest request,
                                                                 DataParallelOptions options);

  int world_size() const { return static_cast<int>(clients_.size()); }
  const std::vector<v1::Job>& jobs() const { return jobs_; }
  const std::string& group() const { return group_; }

  // Step `sequence` with shares[r] the micro-batches of rank r, and the
  // rest of the request (loss_fn, its parameters, learning_rate) from
  // `common`, the same on every rank (its job_id, sequence and micro_batches
  // are ignored). Rank 0's response, after checking that every rank reports
  // the same step, loss, scale and skip (DataLoss when they do not: the
  // replicas diverged). A token loss's reported loss is the sum over every
  // rank's tokens, the same on every rank.
  absl::StatusOr<v1::StepResponse> Step(int64_t sequence,
                                        const std::vector<std::vector<v1::MicroBatch>>& shares,
                                        const v1::StepRequest& common = v1::StepRequest());
  // DeleteJob on every rank.
  absl::Status Delete();

 private:
  DataParallelJob(std::vector<std::unique_ptr<Client>> clients, DataParallelOptions options,
                  std::string group)
      : clients_(std::move(clients)), options_(std::move(options)), group_(std::move(group)) {}

  std::vector<std::unique_ptr<Client>> clients_;
  DataParallelOptions options_;
  std::string group_;
  std::vector<v1::Job> jobs_;
};

}  // namespace ampd
