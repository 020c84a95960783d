// StateDirectory on a real temporary directory: write/read/list/remove,
// atomic overwrite, clean-up of temp files a crash left behind, job id
// validation and Open's failure modes.
#include "server/engine/checkpoint/state_directory.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/engine/checkpoint/state_dict.h"

namespace ampd::engine::checkpoint {
namespace {

using codec::DType;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

// A fresh directory per test, removed with its contents afterwards.
class StateDirectoryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = ::testing::TempDir();
    if (tmpl.empty() || tmpl.back() != '/') tmpl.push_back('/');
    tmpl += "ampd_state_dir_XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr) << tmpl;
    root_ = tmpl;
  }

  void TearDown() override { RemoveTree(root_); }

  static void RemoveTree(const std::string& path) {
    struct stat st;
    if (::lstat(path.c_str(), &st) != 0) return;
    if (S_ISDIR(st.st_mode)) {
      if (DIR* dir = ::opendir(path.c_str())) {
        std::vector<std::string> names;
        while (const dirent* e = ::readdir(dir)) {
          const std::string name = e->d_name;
          if (name != "." && name != "..") names.push_back(name);
        }
        ::closedir(dir);
        for (const std::string& name : names) RemoveTree(path + "/" + name);
      }
      ::rmdir(path.c_str());
    } else {
      ::unlink(path.c_str());
    }
  }

  // File names in `dir`, sorted, without "." and "..".
  static std::vector<std::string> Entries(const std::string& dir) {
    std::vector<std::string> names;
    if (DIR* d = ::opendir(dir.c_str())) {
      while (const dirent* e = ::readdir(d)) {
        const std::string name = e->d_name;
        if (name != "." && name != "..") names.push_back(name);
      }
      ::closedir(d);
    }
    std::sort(names.begin(), names.end());
    return names;
  }

  static void WriteFile(const std::string& path, const std::string& bytes) {
    std::ofstream out(path, std::ios::binary);
    out << bytes;
  }

  static StateDict SmallState(float value) {
    StateDict s;
    HostTensor w;
    w.dtype = DType::kF32;
    w.shape = {2};
    w.data.assign(reinterpret_cast<const char*>(&value), sizeof(value));
    w.data.append(reinterpret_cast<const char*>(&value), sizeof(value));
    s.tensors.push_back({"model.0.weight", w});
    HostTensor step;
    step.dtype = DType::kI64;
    step.shape = {};
    step.data = std::string(8, '\x03');
    s.tensors.push_back({"scalar", step});
    s.metadata["ampd.step"] = "3";
    return s;
  }

  std::string root_;
};

TEST_F(StateDirectoryTest, WritesReadsListsAndRemoves) {
  absl::StatusOr<StateDirectory> dir = StateDirectory::Open(root_);
  ASSERT_TRUE(dir.ok()) << dir.status();
  EXPECT_EQ(dir->path(), root_);

  ASSERT_TRUE(dir->Write("job-b", SmallState(2.0f)).ok());
  ASSERT_TRUE(dir->Write("job_a", SmallState(1.0f)).ok());
  EXPECT_THAT(Entries(root_), ElementsAre("job-b.safetensors", "job_a.safetensors"));

  absl::StatusOr<std::vector<std::string>> jobs = dir->ListJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  EXPECT_THAT(*jobs, ElementsAre("job-b", "job_a"));

  absl::StatusOr<StateDict> read = dir->Read("job_a");
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(EncodeSafetensors(*read), EncodeSafetensors(SmallState(1.0f)));

  ASSERT_TRUE(dir->Remove("job_a").ok());
  EXPECT_EQ(dir->Read("job_a").status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(dir->Remove("job_a").ok());  // absent: still OK
  jobs = dir->ListJobs();
  ASSERT_TRUE(jobs.ok());
  EXPECT_THAT(*jobs, ElementsAre("job-b"));
}

TEST_F(StateDirectoryTest, FileOnDiskIsTheSafetensorsEncoding) {
  absl::StatusOr<StateDirectory> dir = StateDirectory::Open(root_);
  ASSERT_TRUE(dir.ok());
  ASSERT_TRUE(dir->Write("j", SmallState(4.0f)).ok());
  std::ifstream in(root_ + "/j.safetensors", std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(bytes, EncodeSafetensors(SmallState(4.0f)));
}

TEST_F(StateDirectoryTest, OverwriteKeepsExactlyOneFile) {
  absl::StatusOr<StateDirectory> dir = StateDirectory::Open(root_);
  ASSERT_TRUE(dir.ok());
  for (int i = 0; i < 5; ++i) {
    ASSERT_TRUE(dir->Write("job", SmallState(static_cast<float>(i))).ok());
  }
  EXPECT_THAT(Entries(root_), ElementsAre("job.safetensors"));
  absl::StatusOr<StateDict> read = dir->Read("job");
  ASSERT_TRUE(read.ok());
  EXPECT_EQ(EncodeSafetensors(*read), EncodeSafetensors(SmallState(4.0f)));
}

// The two-step write: the temp file leaves the checkpoint as it was until
// Publish replaces it; Discard leaves the checkpoint and nothing else.
TEST_F(StateDirectoryTest, WriteTempChangesNothingUntilPublished) {
  absl::StatusOr<StateDirectory> dir = StateDirectory::Open(root_);
  ASSERT_TRUE(dir.ok());
  ASSERT_TRUE(dir->Write("job", SmallState(1.0f)).ok());
  absl::StatusOr<std::string> temp = dir->WriteTemp("job", SmallState(2.0f));
  ASSERT_TRUE(temp.ok()) << temp.status();
  EXPECT_EQ(Entries(root_).size(), 2u);
  absl::StatusOr<StateDict> read = dir->Read("job");
  ASSERT_TRUE(read.ok());
  EXPECT_EQ(EncodeSafetensors(*read), EncodeSafetensors(SmallState(1.0f)));
  dir->Discard(*temp);
  EXPECT_THAT(Entries(root_), ElementsAre("job.safetensors"));

  temp = dir->WriteTemp("job", SmallState(3.0f));
  ASSERT_TRUE(temp.ok()) << temp.status();
  ASSERT_TRUE(dir->Publish("job", *temp).ok());
  EXPECT_THAT(Entries(root_), ElementsAre("job.safetensors"));
  read = dir->Read("job");
  ASSERT_TRUE(read.ok());
  EXPECT_EQ(EncodeSafetensors(*read), EncodeSafetensors(SmallState(3.0f)));
  // A temp file that is gone cannot be published; the checkpoint stays.
  const absl::Status gone = dir->Publish("job", *temp);
  EXPECT_EQ(gone.code(), absl::StatusCode::kInternal) << gone;
  EXPECT_THAT(Entries(root_), ElementsAre("job.safetensors"));
}

TEST_F(StateDirectoryTest, LeftoverTempFileIsIgnoredAndCleanedByListJobs) {
  absl::StatusOr<StateDirectory> dir = StateDirectory::Open(root_);
  ASSERT_TRUE(dir.ok());
  ASSERT_TRUE(dir->Write("job", SmallState(1.0f)).ok());
  // What a crash between mkstemp and rename leaves: a torn temp file.
  WriteFile(root_ + "/job.safetensors.tmp-Ab12Cd", "torn");
  WriteFile(root_ + "/other.safetensors.tmp-XyZ789", "");
  WriteFile(root_ + "/README", "not ours");  // unrelated files are left alone

  absl::StatusOr<std::vector<std::string>> jobs = dir->ListJobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  EXPECT_THAT(*jobs, ElementsAre("job"));
  EXPECT_THAT(Entries(root_), ElementsAre("README", "job.safetensors"));
  ASSERT_TRUE(dir->Read("job").ok());
}

TEST_F(StateDirectoryTest, RejectsInvalidJobIds) {
  absl::StatusOr<StateDirectory> dir = StateDirectory::Open(root_);
  ASSERT_TRUE(dir.ok());
  for (const std::string& id :
       {std::string(""), std::string("../x"), std::string("a/b"), std::string("a.b"),
        std::string("with space"), std::string("nul\0x", 5), std::string(129, 'a'),
        std::string("\xC3\xA9")}) {
    SCOPED_TRACE(id);
    EXPECT_EQ(dir->Write(id, SmallState(1.0f)).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(dir->Read(id).status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(dir->Remove(id).code(), absl::StatusCode::kInvalidArgument);
  }
  EXPECT_TRUE(dir->Write(std::string(128, 'a'), SmallState(1.0f)).ok());
  EXPECT_THAT(Entries(root_), ElementsAre(std::string(128, 'a') + ".safetensors"));
}

TEST_F(StateDirectoryTest, InvalidStateIsRejectedAndWritesNothing) {
  absl::StatusOr<StateDirectory> dir = StateDirectory::Open(root_);
  ASSERT_TRUE(dir.ok());
  StateDict bad = SmallState(1.0f);
  bad.tensors[0].tensor.data.pop_back();
  EXPECT_EQ(dir->Write("job", bad).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Entries(root_), IsEmpty());
}

TEST_F(StateDirectoryTest, FailedWriteReportsThePathAndRemovesTheTempFile) {
  absl::StatusOr<StateDirectory> dir = StateDirectory::Open(root_);
  ASSERT_TRUE(dir.ok());
  // A directory where the checkpoint should go makes the rename fail (even
  // for root, which permission bits would not stop).
  ASSERT_EQ(::mkdir((root_ + "/job.safetensors").c_str(), 0755), 0);
  const absl::Status status = dir->Write("job", SmallState(1.0f));
  ASSERT_FALSE(status.ok());
  EXPECT_THAT(std::string(status.message()), HasSubstr(root_ + "/job.safetensors"));
  EXPECT_THAT(std::string(status.message()), HasSubstr("Is a directory"));
  EXPECT_THAT(Entries(root_), ElementsAre("job.safetensors"));  // no temp file left
}

TEST_F(StateDirectoryTest, CorruptCheckpointIsDataLossNamingTheFile) {
  absl::StatusOr<StateDirectory> dir = StateDirectory::Open(root_);
  ASSERT_TRUE(dir.ok());
  WriteFile(root_ + "/job.safetensors", "garbage");
  absl::StatusOr<StateDict> read = dir->Read("job");
  EXPECT_EQ(read.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(read.status().message()), HasSubstr(root_ + "/job.safetensors"));
}

TEST_F(StateDirectoryTest, OpenCreatesMissingParents) {
  const std::string nested = root_ + "/a/b/c/";
  absl::StatusOr<StateDirectory> dir = StateDirectory::Open(nested);
  ASSERT_TRUE(dir.ok()) << dir.status();
  EXPECT_EQ(dir->path(), root_ + "/a/b/c");
  struct stat st;
  ASSERT_EQ(::stat(nested.c_str(), &st), 0);
  EXPECT_TRUE(S_ISDIR(st.st_mode));
  ASSERT_TRUE(dir->Write("job", SmallState(1.0f)).ok());
  // Opening an existing directory again is fine and sees the same jobs.
  absl::StatusOr<StateDirectory> again = StateDirectory::Open(nested);
  ASSERT_TRUE(again.ok());
  absl::StatusOr<std::vector<std::string>> jobs = again->ListJobs();
  ASSERT_TRUE(jobs.ok());
  EXPECT_THAT(*jobs, ElementsAre("job"));
}

TEST_F(StateDirectoryTest, OpenOnARegularFileFails) {
  const std::string file = root_ + "/plain";
  WriteFile(file, "x");
  absl::StatusOr<StateDirectory> dir = StateDirectory::Open(file);
  ASSERT_FALSE(dir.ok());
  EXPECT_EQ(dir.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(dir.status().message()), HasSubstr(file));

  // A regular file as a parent component fails too, with the OS's reason.
  absl::StatusOr<StateDirectory> under = StateDirectory::Open(file + "/sub");
  ASSERT_FALSE(under.ok());
  EXPECT_EQ(under.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(under.status().message()), HasSubstr("Not a directory"));
}

}  // namespace
}  // namespace ampd::engine::checkpoint
