// StateDirectory on POSIX calls rather than std::filesystem: atomic
// replacement needs fsync of the file and of the directory, which the
// standard library does not offer, and errors must name errno's text.
#include "server/engine/checkpoint/state_directory.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <system_error>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/engine/checkpoint/state_dict.h"

namespace ampd::engine::checkpoint {
namespace {

constexpr absl::string_view kSuffix = ".safetensors";
// mkstemp replaces the six X's; ListJobs recognises leftovers by this infix.
constexpr absl::string_view kTempInfix = ".safetensors.tmp-";
constexpr size_t kMaxJobIdLength = 128;

// std::error_code's message is strerror's text without strerror's shared
// static buffer, so it is safe from any thread.
std::string ErrnoText(int err) { return std::error_code(err, std::generic_category()).message(); }

absl::Status OsError(absl::StatusCode code, absl::string_view what, const std::string& path,
                     int err) {
  return absl::Status(code, absl::StrCat(what, " ", path, ": ", ErrnoText(err)));
}

bool IsValidJobId(absl::string_view id) {
  if (id.empty() || id.size() > kMaxJobIdLength) return false;
  return std::all_of(id.begin(), id.end(), [](char c) {
    return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' ||
           c == '-';
  });
}

absl::Status CheckJobId(const std::string& job_id) {
  if (IsValidJobId(job_id)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("job id \"", job_id,
                                                 "\" is not a safe file name ([A-Za-z0-9_-], 1 to ",
                                                 kMaxJobIdLength, " characters)"));
}

// Closes the descriptor on every path out; Release() hands it back.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  int Release() { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

// A rename or unlink is durable only once the directory entry is on disk.
absl::Status FsyncDirectory(const std::string& dir) {
  Fd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) return OsError(absl::StatusCode::kInternal, "cannot open", dir, errno);
  if (::fsync(fd.get()) != 0)
    return OsError(absl::StatusCode::kInternal, "cannot fsync", dir, errno);
  return absl::OkStatus();
}

absl::Status WriteAll(int fd, absl::string_view bytes, const std::string& path) {
  while (!bytes.empty()) {
    const ssize_t n = ::write(fd, bytes.data(), bytes.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return OsError(absl::StatusCode::kInternal, "cannot write", path, errno);
    }
    bytes.remove_prefix(static_cast<size_t>(n));  // short writes loop
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<StateDirectory> StateDirectory::Open(const std::string& path) {
  if (path.empty()) return absl::InvalidArgumentError("state directory path is empty");
  std::string dir = path;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();

  // mkdir -p: create each missing component; EEXIST is fine here and the
  // final stat decides whether what exists is a directory.
  for (size_t i = 1; i <= dir.size(); ++i) {
    if (i != dir.size() && dir[i] != '/') continue;
    const std::string prefix = dir.substr(0, i);
    if (::mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) {
      return OsError(absl::StatusCode::kFailedPrecondition, "cannot create state directory", prefix,
                     errno);
    }
  }
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0) {
    return OsError(absl::StatusCode::kFailedPrecondition, "cannot stat state directory", dir,
                   errno);
  }
  if (!S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat("state directory ", dir, " exists and is not a directory"));
  }
  if (::access(dir.c_str(), W_OK | X_OK) != 0) {
    return OsError(absl::StatusCode::kFailedPrecondition, "cannot write to state directory", dir,
                   errno);
  }
  return StateDirectory(std::move(dir));
}

absl::Status StateDirectory::Write(const std::string& job_id, const StateDict& state) const {
  AMPD_ASSIGN_OR_RETURN(const std::string temp_path, WriteTemp(job_id, state));
  return Publish(job_id, temp_path);
}

absl::StatusOr<std::string> StateDirectory::WriteTemp(const std::string& job_id,
                                                      const StateDict& state) const {
  AMPD_RETURN_IF_ERROR(CheckJobId(job_id));
  AMPD_RETURN_IF_ERROR(ValidateStateDict(state));
  // The header, then each tensor's bytes where they are: no copy of the
  // whole file in memory.
  const std::string header = EncodeSafetensorsHeader(state);
  std::string temp_path = absl::StrCat(path_, "/", job_id, kTempInfix, "XXXXXX");

  Fd fd(::mkstemp(temp_path.data()));
  if (fd.get() < 0) {
    return OsError(absl::StatusCode::kInternal, "cannot create temp file", temp_path, errno);
  }
  // Runs the steps that can fail; any failure unlinks the temp file so a
  // failed write leaves the previous checkpoint and nothing else.
  absl::Status status = [&]() -> absl::Status {
    AMPD_RETURN_IF_ERROR(WriteAll(fd.get(), header, temp_path));
    for (const NamedTensor& t : state.tensors) {
      AMPD_RETURN_IF_ERROR(WriteAll(fd.get(), t.tensor.data, temp_path));
    }
    if (::fsync(fd.get()) != 0) {
      return OsError(absl::StatusCode::kInternal, "cannot fsync", temp_path, errno);
    }
    // close() can report a deferred write error (NFS); it must not be lost.
    if (::close(fd.Release()) != 0) {
      return OsError(absl::StatusCode::kInternal, "cannot close", temp_path, errno);
    }
    return absl::OkStatus();
  }();
  if (!status.ok()) {
    Discard(temp_path);
    return status;
  }
  return temp_path;
}

absl::Status StateDirectory::Publish(const std::string& job_id,
                                     const std::string& temp_path) const {
  AMPD_RETURN_IF_ERROR(CheckJobId(job_id));
  const std::string final_path = absl::StrCat(path_, "/", job_id, kSuffix);
  if (::rename(temp_path.c_str(), final_path.c_str()) != 0) {
    const int err = errno;
    Discard(temp_path);
    return OsError(absl::StatusCode::kInternal, absl::StrCat("cannot rename ", temp_path, " to"),
                   final_path, err);
  }
  return FsyncDirectory(path_);
}

void StateDirectory::Discard(const std::string& temp_path) const { ::unlink(temp_path.c_str()); }

absl::StatusOr<StateDict> StateDirectory::Read(const std::string& job_id) const {
  AMPD_RETURN_IF_ERROR(CheckJobId(job_id));
  const std::string file = absl::StrCat(path_, "/", job_id, kSuffix);
  Fd fd(::open(file.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) {
    const int err = errno;
    if (err == ENOENT) {
      return absl::NotFoundError(absl::StrCat("no checkpoint for job ", job_id, " (", file, ")"));
    }
    return OsError(absl::StatusCode::kInternal, "cannot open", file, err);
  }
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) {
    return OsError(absl::StatusCode::kInternal, "cannot stat", file, errno);
  }
  // Read straight into one buffer of the file's size (files are replaced by
  // rename, never grown in place); a shorter read leaves a file that does
  // not decode, reported below.
  std::string bytes;
  ResizeForBulkCopy(&bytes, static_cast<size_t>(st.st_size));
  size_t got = 0;
  while (got < bytes.size()) {
    const ssize_t n = ::read(fd.get(), bytes.data() + got, bytes.size() - got);
    if (n < 0) {
      if (errno == EINTR) continue;
      return OsError(absl::StatusCode::kInternal, "cannot read", file, errno);
    }
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  bytes.resize(got);
  absl::StatusOr<StateDict> state = DecodeSafetensors(bytes);
  if (!state.ok()) {
    // A corrupt file is bad data on disk, not a bad request: DataLoss.
    return absl::DataLossError(absl::StrCat(file, ": ", state.status().message()));
  }
  return state;
}

absl::StatusOr<std::map<std::string, std::string>> StateDirectory::ReadMetadata(
    const std::string& job_id) const {
  AMPD_RETURN_IF_ERROR(CheckJobId(job_id));
  const std::string file = absl::StrCat(path_, "/", job_id, kSuffix);
  Fd fd(::open(file.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) {
    const int err = errno;
    if (err == ENOENT) {
      return absl::NotFoundError(absl::StrCat("no checkpoint for job ", job_id, " (", file, ")"));
    }
    return OsError(absl::StatusCode::kInternal, "cannot open", file, err);
  }
  // Reads exactly n more bytes onto `bytes`, or fewer at the end of the file.
  std::string bytes;
  const auto read_more = [&](uint64_t n) -> absl::Status {
    const size_t start = bytes.size();
    bytes.resize(start + n);
    size_t got = 0;
    while (got < n) {
      const ssize_t r = ::read(fd.get(), bytes.data() + start + got, n - got);
      if (r < 0) {
        if (errno == EINTR) continue;
        return OsError(absl::StatusCode::kInternal, "cannot read", file, errno);
      }
      if (r == 0) break;
      got += static_cast<size_t>(r);
    }
    bytes.resize(start + got);
    return absl::OkStatus();
  };
  constexpr uint64_t kPrefix = 8;
  AMPD_RETURN_IF_ERROR(read_more(kPrefix));
  if (bytes.size() == kPrefix) {
    uint64_t n = 0;
    for (size_t i = 0; i < kPrefix; ++i) {
      n |= static_cast<uint64_t>(static_cast<unsigned char>(bytes[i])) << (8 * i);
    }
    // Past the limit the decoder below names the defect; read nothing more.
    if (n <= kMaxSafetensorsHeaderBytes) AMPD_RETURN_IF_ERROR(read_more(n));
  }
  absl::StatusOr<std::map<std::string, std::string>> metadata = DecodeSafetensorsMetadata(bytes);
  if (!metadata.ok()) {
    return absl::DataLossError(absl::StrCat(file, ": ", metadata.status().message()));
  }
  return metadata;
}

absl::StatusOr<int64_t> StateDirectory::WriteTimeNanos(const std::string& job_id) const {
  AMPD_RETURN_IF_ERROR(CheckJobId(job_id));
  const std::string file = absl::StrCat(path_, "/", job_id, kSuffix);
  struct stat st;
  if (::stat(file.c_str(), &st) != 0) {
    const int err = errno;
    if (err == ENOENT) return absl::NotFoundError(absl::StrCat("no checkpoint ", file));
    return OsError(absl::StatusCode::kInternal, "cannot stat", file, err);
  }
  return int64_t{st.st_mtim.tv_sec} * 1000000000 + int64_t{st.st_mtim.tv_nsec};
}

absl::Status StateDirectory::Remove(const std::string& job_id) const {
  AMPD_RETURN_IF_ERROR(CheckJobId(job_id));
  const std::string file = absl::StrCat(path_, "/", job_id, kSuffix);
  if (::unlink(file.c_str()) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return OsError(absl::StatusCode::kInternal, "cannot remove", file, errno);
  }
  return FsyncDirectory(path_);
}

absl::StatusOr<std::vector<std::string>> StateDirectory::ListJobs() const {
  DIR* dir = ::opendir(path_.c_str());
  if (dir == nullptr) return OsError(absl::StatusCode::kInternal, "cannot list", path_, errno);
  std::vector<std::string> jobs;
  std::vector<std::string> stale;
  while (true) {
    errno = 0;
    const dirent* entry = ::readdir(dir);
    if (entry == nullptr) {
      const int err = errno;
      ::closedir(dir);
      if (err != 0) return OsError(absl::StatusCode::kInternal, "cannot list", path_, err);
      break;
    }
    const absl::string_view name = entry->d_name;
    if (absl::EndsWith(name, kSuffix)) {
      const absl::string_view id = name.substr(0, name.size() - kSuffix.size());
      if (IsValidJobId(id)) jobs.emplace_back(id);
      continue;
    }
    const size_t infix = name.find(kTempInfix);
    if (infix != absl::string_view::npos && IsValidJobId(name.substr(0, infix))) {
      stale.emplace_back(name);
    }
  }
  for (const std::string& name : stale) {
    const std::string file = absl::StrCat(path_, "/", name);
    if (::unlink(file.c_str()) != 0 && errno != ENOENT) {
      return OsError(absl::StatusCode::kInternal, "cannot remove stale temp file", file, errno);
    }
  }
  std::sort(jobs.begin(), jobs.end());
  return jobs;
}

absl::Status StateDirectory::RemoveAll() const {
  AMPD_ASSIGN_OR_RETURN(const std::vector<std::string> ids, ListJobs());
  for (const std::string& id : ids) AMPD_RETURN_IF_ERROR(Remove(id));
  // Anything else (not ours) keeps the directory: rmdir fails, and that
  // is fine.
  if (::rmdir(path_.c_str()) != 0 && errno != ENOTEMPTY && errno != EEXIST && errno != ENOENT) {
    return OsError(absl::StatusCode::kInternal, "cannot remove", path_, errno);
  }
  return absl::OkStatus();
}

}  // namespace ampd::engine::checkpoint
