// PyTorch Flight Recorder dumps read and replayed (issue 22, item 2): the
// restricted unpickler on pickles Python wrote, and the replay of real gloo
// dumps (tests/data/torch_fr, written by its generate.py with torch 2.15
// from PyPI) whose failure each fixture's job caused on purpose.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>

#include "diffcomm/sim/replay.hpp"
#include "diffcomm/tensor/error.hpp"
#include "unpickle.hpp"

namespace diffcomm::sim {
namespace {
namespace fs = std::filesystem;
using testing::ElementsAre;
using testing::EndsWith;
using testing::HasSubstr;
using testing::Not;
using testing::StartsWith;

std::string from_hex(const std::string& hex) {
  std::string out;
  for (std::size_t i = 0; i + 1 < hex.size(); i += 2)
    out.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  return out;
}

// pickle.dumps({'a': [1, -2, 300, 70000, 2**40, -2**40, 1.5, None, True,
// False, (1, 2), (1, 2, 3, 4)], 'k': {'n': 's'}}, protocol=P)
const char* kProto2 =
    "80027d71002858010000006171015d7102284b014afeffffff4d2c014a701101008a06000000000001"
    "8a060000000000ff473ff80000000000004e88894b014b02867103284b014b024b034b04747104655801"
    "0000006b71057d710658010000006e7107580100000073710873752e";
const char* kProto4 =
    "80049558000000000000007d94288c0161945d94284b014afeffffff4d2c014a701101008a0600000000"
    "00018a060000000000ff473ff80000000000004e88894b014b028694284b014b024b034b047494658c01"
    "6b947d948c016e948c01739473752e";

TEST(Unpickle, ReadsWhatPythonWritesInProtocols2And4) {
  const auto expected = nlohmann::json::parse(
      R"({"a": [1, -2, 300, 70000, 1099511627776, -1099511627776, 1.5, null, true, false,
               [1, 2], [1, 2, 3, 4]], "k": {"n": "s"}})");
  EXPECT_EQ(detail::unpickle(from_hex(kProto2), "p2"), expected);
  EXPECT_EQ(detail::unpickle(from_hex(kProto4), "p4"), expected);
}

TEST(Unpickle, AMemoizedValueReadTwiceKeepsItsContent) {
  // s = 'shared'; pickle.dumps({'p': [s, s], 'q': [s]}, protocol=2): BINGET of a moved value
  const std::string bytes = from_hex(
      "80027d71002858010000007071015d7102285806000000736861726564710368036558010000007171045d"
      "7105680361752e");
  EXPECT_EQ(detail::unpickle(bytes, "memo"),
            nlohmann::json::parse(R"({"p": ["shared", "shared"], "q": ["shared"]})"));
}

TEST(Unpickle, AMemoBombIsRefusedWithinItsBudget) {
  // L = []; then 40 times: L = [L, L] through BINGET of the memoised L (10 bytes a round): 406
  // bytes whose JSON tree would hold 2^41 values (issue 52: a 626-byte pickle grew to 2 GB and
  // std::bad_alloc). Read in shared form, refused once writing the tree passes the budget.
  std::string hex = "80025d7100";  // PROTO 2, EMPTY_LIST, BINPUT 0
  for (int round = 0; round < 40; ++round) hex += "305d2868006800657100";  // POP ] ( h0 h0 e q0
  hex += "2e";                                                             // STOP
  const std::string bytes = from_hex(hex);
  ASSERT_EQ(bytes.size(), 5u + 40u * 10u + 1u);
  try {
    detail::unpickle(bytes, "bomb.pkl");
    FAIL() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.site().op, "bomb.pkl");
    // The budget grows with the input (64 values a byte over 2^16): 91520 here, so the bomb
    // stops after about 10^5 values instead of the cap's 2^23.
    EXPECT_THAT(std::string(e.detail()),
                HasSubstr("pickle expands to more than " +
                          std::to_string((1u << 16) + 64 * bytes.size()) + " values"));
  }
  // A string read from the memo over and over counts its bytes: 4 KiB read 2^17 times.
  std::string shex =
      "80025d7100"
      "5800100000";  // ..., BINUNICODE of 4096 bytes
  for (int i = 0; i < 4096; ++i) shex += "73";
  shex += "71013028";  // BINPUT 1, POP, MARK
  for (int i = 0; i < (1 << 17); ++i) shex += "6801";
  shex += "652e";
  const std::string strings = from_hex(shex);
  try {
    detail::unpickle(strings, "strings.pkl");
    FAIL() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(std::string(e.detail()),
                HasSubstr(std::to_string((1u << 20) + 256 * strings.size()) + " bytes"));
  }
}

TEST(Unpickle, AMemoReadIsTheObjectItselfAsInPython) {
  // L = []; d = {'a': L, 'b': L}; then L.append(1) after both reads; the pickle of (d, L), by
  // hand. Python reads {'a': [1], 'b': [1]}: the dict's values are L itself. A reader that
  // copied memoised values read {'a': [], 'b': []}.
  const std::string bytes = from_hex(
      "80027d28"      // PROTO 2, EMPTY_DICT, MARK
      "8c01615d7100"  // 'a', EMPTY_LIST, BINPUT 0
      "8c01626800"    // 'b', BINGET 0
      "75"            // SETITEMS
      "68004b0161"    // BINGET 0, BININT1 1, APPEND
      "862e");        // TUPLE2, STOP
  EXPECT_EQ(detail::unpickle(bytes, "shared"),
            nlohmann::json::parse(R"([{"a": [1], "b": [1]}, [1]])"));
}

TEST(Unpickle, AContainerHoldingItselfIsRefused) {
  // L = []; L.append(L): EMPTY_LIST, BINPUT 0, BINGET 0, APPEND, STOP
  const std::string bytes = from_hex("80025d71006800612e");
  try {
    detail::unpickle(bytes, "cycle.pkl");
    FAIL() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(std::string(e.detail()),
                HasSubstr("deeper than 64 (or a container holds itself): the container made at "
                          "offset 2"));
  }
}

TEST(Unpickle, TruncatedStreamNamesTheFileAndOffset) {
  const std::string bytes = from_hex(kProto2).substr(0, 40);
  try {
    detail::unpickle(bytes, "rank_3.pkl");
    FAIL() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.site().op, "rank_3.pkl");
    EXPECT_THAT(std::string(e.detail()), StartsWith("pickle truncated"));
    EXPECT_THAT(e.what(), HasSubstr("at offset 40"));
  }
}

TEST(Unpickle, RefusesGlobalsSoReadingNeverRunsCode) {
  // pickle.dumps(b'by', protocol=2) calls _codecs.encode through GLOBAL + REDUCE
  const std::string bytes = from_hex(
      "8002635f636f646563730a656e636f64650a71005802000000627971015806"
      "0000006c6174696e3171028671035271042e");
  try {
    detail::unpickle(bytes, "evil.pkl");
    FAIL() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.site().op, "evil.pkl");
    EXPECT_THAT(
        std::string(e.detail()),
        StartsWith("pickle opcode 0x63 is not one a flight recorder dump uses at offset 2"));
  }
}

TEST(Unpickle, RefusesNestingDeeperThan64) {
  // 100 nested lists: EMPTY_LIST x 100, then APPEND x 99, STOP
  const std::string deep = "\x80\x02" + std::string(100, ']') + std::string(99, 'a') + ".";
  try {
    detail::unpickle(deep, "deep.pkl");
    FAIL() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.site().op, "deep.pkl");
    EXPECT_THAT(std::string(e.detail()), StartsWith("pickle nests containers deeper than 64"));
  }
  const std::string ok = "\x80\x02" + std::string(64, ']') + std::string(63, 'a') + ".";
  EXPECT_TRUE(detail::unpickle(ok, "ok.pkl").is_array());
}

std::string fixture(const std::string& name) {
  return (fs::path(DIFFCOMM_TORCH_FR_DIR) / name).string();
}

TEST(TorchFlightDump, HealthyJobReplaysOkInBothFormats) {
  for (const char* dir : {"ok-pkl", "ok-json"}) {
    const auto dumps = read_dumps(fixture(dir));
    ASSERT_EQ(dumps.size(), 3u) << dir;
    EXPECT_EQ(dumps[1].producer, "torch flight recorder 2.10");
    const ReplayReport rep = replay(dumps);
    EXPECT_EQ(rep.verdict, Verdict::Ok) << dir << ": " << replay_text(rep);
    EXPECT_EQ(rep.exit_code(), 0);
    // torch records neither splits nor roots nor reduce ops: listed, never guessed
    EXPECT_THAT(rep.unknown, testing::Contains(HasSubstr("all_to_all_single splits")));
    EXPECT_THAT(rep.unknown, testing::Contains(HasSubstr("roots of broadcast")));
    EXPECT_THAT(rep.unknown, testing::Contains(HasSubstr("members of group '1'")));
  }
}

TEST(TorchFlightDump, GroupsCallsAndStatesAreMapped) {
  const auto dumps = read_dumps(fixture("ok-pkl"));
  const dist::FlightDump& d = dumps[1];
  ASSERT_EQ(d.groups.size(), 2u);
  EXPECT_EQ(d.groups[0].group.name, "1");  // new_group([0, 1])
  EXPECT_THAT(d.groups[0].group.members, ElementsAre(0, 1));
  EXPECT_EQ(d.groups[1].group.name, "world");
  EXPECT_EQ(d.groups[1].group.calls, 11u);
  EXPECT_EQ(d.groups[1].watermark, 0u);
  const dist::FlightRecord& first = d.entries.front();  // all_reduce(torch.ones(3))
  EXPECT_EQ(first.op, dist::OpType::AllReduce);
  EXPECT_EQ(first.seq, 0u);  // torch's collective_seq_id 1
  EXPECT_EQ(first.input_shapes, std::vector<Shape>{{3}});
  EXPECT_EQ(first.state, dist::FlightRecord::State::Completed);
  EXPECT_EQ(d.entries[1].dtype, DType::Float64);          // the float64 broadcast
  EXPECT_EQ(d.entries.back().op, dist::OpType::Barrier);  // issued, never waited for
  EXPECT_EQ(d.entries.back().state, dist::FlightRecord::State::Issued);
  // the subgroup's int64 all_reduce is on group '1' as its call #0
  const auto sub = std::find_if(d.entries.begin(), d.entries.end(),
                                [](const dist::FlightRecord& r) { return r.group == "1"; });
  ASSERT_NE(sub, d.entries.end());
  EXPECT_EQ(sub->seq, 0u);
  EXPECT_EQ(sub->dtype, DType::Int64);
}

struct Expected {
  const char* dir;
  Verdict verdict;
  const char* op;
  std::vector<int> ranks;
  const char* field;
};

TEST(TorchFlightDump, BrokenJobsReplayToTheirFailure) {
  const std::vector<Expected> cases{
      {"dtype-pkl", Verdict::Mismatch, "all_reduce", {0, 1}, "dtype"},
      {"size-json", Verdict::Mismatch, "all_reduce", {0, 2}, "shape"},
      // op: the call of the first rank the message names (rank 0 all_reduce,
      // rank 1 broadcast), whatever rank the schedule raised first.
      {"op-pkl", Verdict::Mismatch, "all_reduce", {0, 1}, "op"},
      {"skip-pkl", Verdict::Deadlock, "barrier", {2}, ""}};
  for (const Expected& c : cases) {
    const ReplayReport rep = replay(read_dumps(fixture(c.dir)));
    EXPECT_EQ(rep.verdict, c.verdict) << c.dir << ": " << replay_text(rep);
    EXPECT_EQ(rep.group, "world") << c.dir;
    EXPECT_EQ(rep.call, 10u) << c.dir;  // torch's collective_seq_id 11
    EXPECT_EQ(rep.op, c.op) << c.dir;
    EXPECT_EQ(rep.ranks, c.ranks) << c.dir;
    EXPECT_EQ(rep.field, c.field) << c.dir;
    EXPECT_EQ(rep.exit_code(), 3) << c.dir;
  }
}

TEST(TorchFlightDump, OneRanksWrappedRingIsIncompleteNotAMismatch) {
  const ReplayReport rep = replay(read_dumps(fixture("wrap-pkl")));
  EXPECT_EQ(rep.verdict, Verdict::Incomplete) << replay_text(rep);
  EXPECT_THAT(rep.ranks, ElementsAre(1));  // its ring kept 8 entries
  EXPECT_EQ(rep.exit_code(), 4);
}

// A copy of fixture `from` in a fresh directory, for damaging.
std::string copy_of(const std::string& from) {
  const fs::path dir =
      fs::temp_directory_path() / ("diffcomm-torch-fr-" + std::to_string(::getpid()) + "-" + from);
  fs::remove_all(dir);
  fs::copy(fixture(from), dir);
  return dir.string();
}

TEST(TorchFlightDump, MissingRankFileIsBadInputNamingIt) {
  const std::string dir = copy_of("dtype-pkl");
  fs::remove(fs::path(dir) / "rank_1.pkl");
  try {
    read_dumps(dir);
    FAIL() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("no dump of rank 1 (the world has 3 ranks"));
  }
  fs::remove_all(dir);
}

std::string text_of(const fs::path& f) {
  std::ifstream in(f);
  std::stringstream all;
  all << in.rdbuf();
  return all.str();
}

// Where torch kept stacks, an entry's "frames" (innermost first) give the
// record its caller: the innermost frame outside torch's files (issue [4/7]
// item 5); replay's reports then name the user's line.
TEST(TorchFlightDump, FramesGiveTheUsersCallSite) {
  const std::string dir = copy_of("ok-json");
  const fs::path f = fs::path(dir) / "rank_0.json";
  std::string text = text_of(f);
  const std::string first = "{\"collective_seq_id\":1,";
  text.replace(text.find(first), first.size(),
               first +
                   "\"frames\":[{\"name\":\"all_reduce\",\"filename\":\"/venv/lib/"
                   "python3.11/site-packages/torch/distributed/c10d_logger.py\",\"line\":81},"
                   "{\"name\":\"step\",\"filename\":\"/home/u/train.py\",\"line\":42},"
                   "{\"name\":\"<module>\",\"filename\":\"/home/u/train.py\",\"line\":90}],");
  std::ofstream(f, std::ios::trunc) << text;
  const auto dumps = read_dumps(dir);
  EXPECT_EQ(dumps[0].entries.front().caller.str(), "/home/u/train.py:42");
  EXPECT_FALSE(dumps[0].entries[1].caller);  // no frames recorded
  EXPECT_FALSE(dumps[1].entries.front().caller);
  fs::remove_all(dir);
}

// A size or a call number that is not an integer (1e300: nlohmann's own
// conversion would cast it, undefined behaviour) is one line of bad input.
TEST(TorchFlightDump, NonIntegerNumbersAreBadInput) {
  for (const char* bad : {"\"input_sizes\":[[1e300]]", "\"input_sizes\":[[2.5]]"}) {
    const std::string dir = copy_of("ok-json");
    const fs::path f = fs::path(dir) / "rank_0.json";
    std::string text = text_of(f);
    text.replace(text.find("\"input_sizes\":[[3]]"), 19, bad);
    std::ofstream(f, std::ios::trunc) << text;
    try {
      read_dumps(dir);
      FAIL() << "no error for " << bad;
    } catch (const InvalidArgument& e) {
      EXPECT_THAT(e.what(), HasSubstr("a torch dump has a malformed number: not an integer"));
    }
    fs::remove_all(dir);
  }
}

// A field of the wrong type names the file and the entry, in words (not
// nlohmann's "[json.exception.type_error.302]" tag).
TEST(TorchFlightDump, AFieldOfTheWrongTypeNamesTheFileAndEntry) {
  const std::string dir = copy_of("ok-json");
  const fs::path f = fs::path(dir) / "rank_0.json";
  std::string text = text_of(f);
  const std::string name = "\"profiling_name\":\"gloo:broadcast\"";  // entry 1
  text.replace(text.find(name), name.size(), "\"profiling_name\":5");
  std::ofstream(f, std::ios::trunc) << text;
  try {
    read_dumps(dir);
    FAIL() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.site().op, EndsWith("rank_0.json"));
    EXPECT_THAT(std::string(e.detail()),
                StartsWith("entry 1: a field is missing or of the wrong type: type must be string, "
                           "but is number"));
    EXPECT_THAT(e.what(), Not(HasSubstr("json.exception")));
  }
  fs::remove_all(dir);
}

TEST(TorchFlightDump, TruncatedFileNamesTheFileAndOffset) {
  const std::string dir = copy_of("ok-pkl");
  const fs::path f = fs::path(dir) / "rank_2.pkl";
  fs::resize_file(f, 300);
  try {
    read_dumps(dir);
    FAIL() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.site().op, EndsWith("rank_2.pkl"));
    EXPECT_THAT(std::string(e.detail()), StartsWith("pickle truncated"));
    EXPECT_THAT(e.what(), HasSubstr("at offset 300"));
  }
  const std::string jdir = copy_of("ok-json");
  fs::resize_file(fs::path(jdir) / "rank_0.json", 100);
  try {
    read_dumps(jdir);
    FAIL() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.site().op, EndsWith("rank_0.json"));
    EXPECT_THAT(std::string(e.detail()), StartsWith("JSON syntax error at offset 100"));
  }
  fs::remove_all(dir);
  fs::remove_all(jdir);
}

// Found by fuzz_torch_dump: a number too large for a double ("1E733421841")
// is nlohmann's out_of_range, not a parse_error; it escaped the reader
// (std::terminate in the fuzzer, nlohmann's own message from the CLI).
TEST(TorchFlightDump, ANumberOutOfRangeNamesTheFile) {
  const std::string dir = copy_of("ok-json");
  const fs::path f = fs::path(dir) / "rank_0.json";
  std::string text;
  {
    std::ifstream in(f, std::ios::binary);
    text.assign(std::istreambuf_iterator<char>(in), {});
  }
  const std::size_t at = text.find("\"time_created_ns\":");
  ASSERT_NE(at, std::string::npos);
  // "1E733421841" before the digits there: an exponent far past a double's.
  text.insert(at + std::string("\"time_created_ns\":").size(), "1E733421841");
  {
    std::ofstream out(f, std::ios::binary | std::ios::trunc);
    out << text;
  }
  try {
    read_dumps(dir);
    FAIL() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.site().op, EndsWith("rank_0.json"));
    EXPECT_THAT(std::string(e.detail()), HasSubstr("out of range"));
    EXPECT_THAT(e.what(), Not(HasSubstr("json.exception")));
  }
  fs::remove_all(dir);
}

// A .pkl that is not a pickle was reported as a JSON syntax error.
TEST(TorchFlightDump, APklThatIsNoPickleSaysSo) {
  const std::string dir = copy_of("ok-pkl");
  const fs::path f = fs::path(dir) / "rank_1.pkl";
  for (const auto& [bytes, line] : std::vector<std::pair<std::string, std::string>>{
           {"{\"entries\": []}",
            "not a pickle of protocol 2 or later (its first byte is 0x7b, not 0x80)"},
           {"", "empty"}}) {
    std::ofstream(f, std::ios::binary | std::ios::trunc) << bytes;
    try {
      read_dumps(dir);
      FAIL() << "no error";
    } catch (const InvalidArgument& e) {
      EXPECT_THAT(e.site().op, EndsWith("rank_1.pkl"));
      EXPECT_THAT(std::string(e.detail()), StartsWith(line));
    }
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace diffcomm::sim
