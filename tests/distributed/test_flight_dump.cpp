// The flight recorder's ring, watermarks and JSON dump (issue 22, item 1):
// calls recorded by hand (expected values written out below, not computed
// by the recorder), a dump written and read back field by field, and the
// one-line errors of truncated and malformed files.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "diffcomm/distributed/backend/options.hpp"
#include "diffcomm/distributed/flight_dump.hpp"
#include "diffcomm/distributed/flight_recorder.hpp"
#include "diffcomm/tensor/error.hpp"
#include "diffcomm/tensor/tensor.hpp"

namespace diffcomm::dist {
namespace {

using testing::HasSubstr;
using testing::StartsWith;

dist::Options sized(std::size_t n) {
  dist::Options o;
  o.flight_recorder_size = n;
  o.flight_recorder_dump_dir = "";
  return o;
}

// Records one completed call `op` #seq on `group` (rank 1 of 4 there).
void record(FlightRecorder& fr, const char* group, OpType op, uint64_t seq,
            const Tensor& t = zeros({2, 3})) {
  fr.note_group(group, 1, [] { return std::vector<int>{4, 5, 6, 7}; });
  Call c;
  c.op = op;
  c.seq = seq;
  c.group = group;
  c.rank = 1;
  c.group_size = 4;
  c.dtype = t.dtype();
  c.inputs = TensorList(t);
  c.outputs = TensorList(t);
  fr.end(fr.begin(c), FlightRecord::State::Completed);
}

const DumpedGroup& group(const FlightDump& d, const std::string& name) {
  for (const DumpedGroup& g : d.groups)
    if (g.group.name == name) return g;
  throw std::runtime_error("no group " + name);
}

TEST(FlightRecorder, RingKeepsTheNewestCallsAndTheWatermarkIsTheOldestKept) {
  FlightRecorder fr(sized(3));
  EXPECT_EQ(fr.capacity(), 3u);
  for (uint64_t s = 0; s < 5; ++s) record(fr, "world", OpType::AllReduce, s);
  const auto recs = fr.records();
  ASSERT_EQ(recs.size(), 3u);
  EXPECT_EQ(recs[0].seq, 2u);
  EXPECT_EQ(recs[2].seq, 4u);
  EXPECT_EQ(recs[0].id, 3u);
  const FlightDump d = snapshot_flight_dump(fr);
  EXPECT_EQ(group(d, "world").watermark, 2u);
  EXPECT_EQ(group(d, "world").group.calls, 5u);
  EXPECT_EQ(group(d, "world").group.members, (std::vector<int>{4, 5, 6, 7}));
}

TEST(FlightRecorder, AGroupWhoseCallsLeftTheRingHasItsCallCountAsWatermark) {
  FlightRecorder fr(sized(2));
  record(fr, "tp", OpType::Broadcast, 0);
  record(fr, "tp", OpType::Broadcast, 1);
  record(fr, "world", OpType::Barrier, 0);
  record(fr, "world", OpType::Barrier, 1);
  const FlightDump d = snapshot_flight_dump(fr);
  EXPECT_EQ(group(d, "tp").watermark, 2u);  // calls 0 and 1 evicted: nothing known
  EXPECT_EQ(group(d, "world").watermark, 0u);
}

TEST(FlightRecorder, SendRecvHaveTheirOwnWatermark) {
  FlightRecorder fr(sized(8));
  record(fr, "world", OpType::AllReduce, 0);
  record(fr, "world", OpType::Send, 0);
  record(fr, "world", OpType::Send, 1);
  const FlightDump d = snapshot_flight_dump(fr);
  EXPECT_EQ(group(d, "world").watermark, 0u);
  EXPECT_EQ(group(d, "world").p2p_watermark, 0u);
  EXPECT_EQ(group(d, "world").group.calls, 1u);
  EXPECT_EQ(group(d, "world").group.p2p_calls, 2u);
}

TEST(FlightRecorder, SimulatedWorldRecordersAreSmallAndKeepNoShapes) {
  FlightRecorder fr([](const void*) { return 0.0; }, nullptr);
  EXPECT_EQ(fr.capacity(), FlightRecorder::kSimCapacity);
  EXPECT_FALSE(fr.detailed());
  record(fr, "world", OpType::AllReduce, 0);
  EXPECT_TRUE(fr.records()[0].input_shapes.empty());
  EXPECT_TRUE(fr.groups().empty());
  // Its dump could not be replayed (no shapes, groups or global rank):
  // dump(dir) refuses instead of writing rank--1.json for every rank.
  const std::string dir =
      (std::filesystem::temp_directory_path() / ("fr-sim-" + std::to_string(::getpid()))).string();
  try {
    (void)fr.dump(dir);
    FAIL() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("simulated world's recorder"));
  }
  EXPECT_FALSE(std::filesystem::exists(dir));
  EXPECT_THAT(fr.dump(), HasSubstr("all_reduce #0 on 'world'"));
}

FlightDump one_of_each() {
  FlightDump d;
  d.rank = 3;
  d.world_size = 4;
  d.capacity = 2000;
  DumpedGroup g;
  g.group = {"tp{2,3}", {2, 3}, 1, 7, 2};
  g.watermark = 5;
  g.p2p_watermark = 1;
  d.groups.push_back(g);
  FlightRecord r;
  r.id = 9;
  r.group = "tp{2,3}";
  r.group_rank = 1;
  r.group_size = 2;
  r.op = OpType::AllToAllSingle;
  r.seq = 6;
  r.dtype = DType::BFloat16;
  r.numel = 12;
  r.input_shapes = {{4, 3}};
  r.output_shapes = {{5, 3}};
  r.input_splits = SplitList(std::vector<int64_t>{1, 3});
  r.output_splits = SplitList(std::vector<int64_t>{2, 3});
  r.reduce_op = ReduceOp::premul_sum(0.25);
  r.members = {0, 1};
  r.members_are_ranks = true;
  r.backward_of = CallId{OpType::AllGatherV, 4};
  r.state = FlightRecord::State::Issued;
  r.start_s = 1.5;
  r.bytes_sent = 18;
  r.bytes_received = 30;
  d.entries.push_back(r);
  return d;
}

TEST(FlightDump, JsonRoundTripKeepsEveryField) {
  const FlightDump back = parse_flight_dump(flight_dump_json(one_of_each()), "x.json");
  EXPECT_EQ(back.version, 2);
  EXPECT_EQ(back.rank, 3);
  EXPECT_EQ(back.world_size, 4);
  EXPECT_EQ(back.capacity, 2000u);
  ASSERT_EQ(back.groups.size(), 1u);
  EXPECT_EQ(back.groups[0].group.members, (std::vector<int>{2, 3}));
  EXPECT_EQ(back.groups[0].group.calls, 7u);
  EXPECT_EQ(back.groups[0].watermark, 5u);
  EXPECT_EQ(back.groups[0].p2p_watermark, 1u);
  ASSERT_EQ(back.entries.size(), 1u);
  const FlightRecord& r = back.entries[0];
  EXPECT_EQ(r.op, OpType::AllToAllSingle);
  EXPECT_EQ(r.seq, 6u);
  EXPECT_EQ(r.dtype, DType::BFloat16);
  EXPECT_EQ(r.input_shapes, (std::vector<Shape>{{4, 3}}));
  EXPECT_EQ(r.output_shapes, (std::vector<Shape>{{5, 3}}));
  EXPECT_EQ(r.input_splits.to_vector(), (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(r.output_splits.to_vector(), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(r.reduce_op, ReduceOp::premul_sum(0.25));
  EXPECT_EQ(r.members, (std::vector<int64_t>{0, 1}));
  EXPECT_TRUE(r.members_are_ranks);
  ASSERT_TRUE(r.backward_of.has_value());
  EXPECT_EQ(r.backward_of->op, OpType::AllGatherV);
  EXPECT_EQ(r.backward_of->seq, 4u);
  EXPECT_EQ(r.state, FlightRecord::State::Issued);
  EXPECT_EQ(r.start_s, 1.5);
  EXPECT_EQ(r.bytes_received, 30u);
}

TEST(FlightDump, TruncatedFileNamesTheFileAndTheByteOffset) {
  const std::string text = flight_dump_json(one_of_each());
  try {
    (void)parse_flight_dump(std::string_view(text).substr(0, 100), "rank-3.json");
    FAIL() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.site().op, "rank-3.json");
    EXPECT_THAT(std::string(e.detail()), StartsWith("byte offset 100: truncated"));
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos);
  }
}

TEST(FlightDump, MissingFieldOrWrongVersionIsOneLineNamingWhere) {
  std::string text = flight_dump_json(one_of_each());
  std::string no_op = text;
  no_op.replace(no_op.find("\"op\":"), 4, "\"xx\"");
  EXPECT_THROW(
      {
        try {
          (void)parse_flight_dump(no_op, "f.json");
        } catch (const InvalidArgument& e) {
          EXPECT_EQ(e.site().op, "f.json");
          EXPECT_THAT(std::string(e.detail()), StartsWith("calls[0]: missing field 'op'"));
          throw;
        }
      },
      InvalidArgument);
  std::string v3 = text;
  v3.replace(v3.find("\"version\":2"), 11, "\"version\":3");
  try {
    (void)parse_flight_dump(v3, "f.json");
    FAIL() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.site().op, "f.json");
    EXPECT_THAT(std::string(e.detail()), StartsWith("format version 3 (this build reads 1 and 2)"));
  }
  EXPECT_THROW((void)parse_flight_dump("[1,2]", "f.json"), InvalidArgument);
  try {
    (void)parse_flight_dump("{\"a\": x}", "g.json");
    FAIL() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.site().op, "g.json");
    EXPECT_THAT(std::string(e.detail()), StartsWith("byte offset 6: not valid JSON"));
  }
}

// Version 2 keeps a description once and each entry as a row: three
// all_reduce calls of one shape and a barrier are two descriptions, four rows.
TEST(FlightDump, Version2KeepsEachDescriptionOnceAndARowPerEntry) {
  FlightDump d = one_of_each();
  d.entries.clear();
  for (uint64_t i = 0; i < 4; ++i) {
    FlightRecord r;
    r.id = 10 + i;
    r.group = "world";
    r.group_size = 4;
    r.group_rank = 3;
    r.op = i == 2 ? OpType::Barrier : OpType::AllReduce;
    r.seq = i;
    r.input_shapes = r.output_shapes = {{8}};
    r.numel = 8;
    r.state = FlightRecord::State::Completed;
    r.start_s = 0.25 * static_cast<double>(i);
    d.entries.push_back(r);
  }
  d.groups[0] = {{"world", {0, 1, 2, 3}, 3, 4, 0}, 0, 0};
  const std::string text = flight_dump_json(d);
  const CompactFlightDump c = parse_compact_flight_dump(text, "r.json");
  EXPECT_EQ(c.calls.size(), 2u);
  ASSERT_EQ(c.rows.size(), 4u);
  EXPECT_EQ(c.rows[3].call_index, 0u);
  EXPECT_EQ(c.rows[2].call_index, 1u);
  EXPECT_EQ(c.rows[3].start_ns, 750000000);
  EXPECT_EQ(c.groups[0].group.members, (std::vector<int>{0, 1, 2, 3}));
  // The members are written as a range; each row is a line of integers.
  EXPECT_THAT(text, HasSubstr("\"member_range\":[0,1,4]"));
  EXPECT_THAT(text, HasSubstr("\n[13,0,3,1,-1,750000000,0,0,0]]}"));
  const FlightDump back = expand(c);
  ASSERT_EQ(back.entries.size(), 4u);
  EXPECT_EQ(back.entries[2].op, OpType::Barrier);
  EXPECT_EQ(back.entries[3].seq, 3u);
  EXPECT_EQ(back.entries[3].start_s, 0.75);
}

// A file cut inside its rows, or a row with a wrong value, is one line
// naming the file and the offset or the entry.
TEST(FlightDump, Version2RowsTruncatedOrOutOfRangeNameWhere) {
  const std::string text = flight_dump_json(one_of_each());
  const std::size_t cut = text.size() - 6;  // inside the last row
  try {
    (void)parse_flight_dump(std::string_view(text).substr(0, cut), "rank-3.json");
    FAIL() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.site().op, "rank-3.json");
    EXPECT_THAT(std::string(e.detail()), StartsWith(fmt::format("byte offset {}: truncated", cut)));
  }
  std::string bad = text;
  bad.replace(bad.find("\n[9,0,"), 6, "\n[9,5,");  // call_index 5 of 1 description
  try {
    (void)parse_flight_dump(bad, "r.json");
    FAIL() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.site().op, "r.json");
    EXPECT_THAT(std::string(e.detail()),
                StartsWith("entries[0]: a value is out of range (call_index < 1"));
  }
}

// Version 1 files (one object per entry) are still read, and a version 2
// file rewritten by another tool (pretty-printed) is read through a tree.
TEST(FlightDump, Version1AndReformattedVersion2AreRead) {
  const std::string v1 =
      R"({"format":"diffcomm-flight-recorder","version":1,"rank":0,"world_size":1,)"
      R"("capacity":4,"groups":[{"name":"world","members":[0],"group_rank":0,"calls":1,)"
      R"("p2p_calls":0,"watermark":0,"p2p_watermark":0}],"entries":[{"id":1,"group":"world",)"
      R"("group_rank":0,"group_size":1,"call":0,"op":"all_reduce","dtype":"float32","numel":2,)"
      R"("input_shapes":[[2]],"output_shapes":[[2]],"input_splits":[],"output_splits":[],)"
      R"("root":-1,"tag":0,"reduce_op":"max","reduce_factor":1.0,"color":-1,"key":0,)"
      R"("members":[],"members_are_ranks":false,"backward_of":{"op":"all_gather","call":7},)"
      R"("state":"completed","start_s":2.0,"duration_s":0.5,"bytes_sent":8,"bytes_received":8}]})";
  const FlightDump a = parse_flight_dump(v1, "v1.json");
  EXPECT_EQ(a.version, 1);
  ASSERT_EQ(a.entries.size(), 1u);
  EXPECT_EQ(a.entries[0].reduce_op, ReduceOp(ReduceOp::Max));
  ASSERT_TRUE(a.entries[0].backward_of.has_value());
  EXPECT_EQ(a.entries[0].backward_of->seq, 7u);
  EXPECT_EQ(a.entries[0].duration_s, 0.5);
  const std::string pretty = nlohmann::json::parse(flight_dump_json(one_of_each())).dump(2);
  const FlightDump b = parse_flight_dump(pretty, "p.json");
  ASSERT_EQ(b.entries.size(), 1u);
  EXPECT_EQ(b.entries[0].backward_of->seq, 4u);
  EXPECT_EQ(b.entries[0].bytes_sent, 18u);
}

// A number where an integer belongs (a huge one, or a fraction) is one line
// naming the field, never a cast of 1e102 to an integer (undefined
// behaviour; found by fuzz_flight_dump).
TEST(FlightDump, NonIntegerNumbersAreRefusedNamingTheField) {
  const std::string text = flight_dump_json(one_of_each());
  std::string huge = text;
  huge.replace(huge.find("\"p2p_watermark\":1"), 17, "\"p2p_watermark\":8.9e102");
  try {
    (void)parse_flight_dump(huge, "h.json");
    FAIL() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.site().op, "h.json");
    EXPECT_THAT(std::string(e.detail()),
                StartsWith("groups[0]: field 'p2p_watermark' has the wrong type or is out of "
                           "range (number)"));
  }
  std::string half = text;
  half.replace(half.find("\"rank\":3"), 8, "\"rank\":2.5");
  EXPECT_THROW((void)parse_flight_dump(half, "r.json"), InvalidArgument);
  std::string negative = text;
  negative.replace(negative.find("\"capacity\":2000"), 15, "\"capacity\":-1");
  EXPECT_THROW((void)parse_flight_dump(negative, "c.json"), InvalidArgument);
}

// nlohmann's copies recurse: a deeply nested value where a call's field
// belongs crashed the reader (stack overflow, found by a hostile-input
// run); any nesting deeper than a dump's own is refused while parsing, in
// both the written (rows scanned) and the tree form.
TEST(FlightDump, DeepNestingIsRefusedNamingTheFile) {
  const std::string written = flight_dump_json(one_of_each());
  const std::string pretty = nlohmann::json::parse(written).dump(2);  // read as a tree
  // `text` with the value of its first "tag" field replaced by `value`.
  auto with_tag = [](std::string text, const std::string& value) {
    std::size_t at = text.find("\"tag\":");
    at = text.find_first_not_of(' ', at + 6);
    text.replace(at, text.find_first_of(",}\n", at) - at, value);
    return text;
  };
  for (const std::string* base : {&written, &pretty}) {
    for (const std::size_t depth : {std::size_t{200000}, std::size_t{70}}) {
      const std::string deep = with_tag(*base, std::string(depth, '[') + std::string(depth, ']'));
      try {
        (void)parse_flight_dump(deep, "deep.json");
        FAIL() << "no error at depth " << depth;
      } catch (const InvalidArgument& e) {
        EXPECT_EQ(e.site().op, "deep.json");
        EXPECT_THAT(std::string(e.detail()), StartsWith("arrays and objects nest deeper than 64"));
      }
    }
    try {  // a wrong type, not too deep: named as before
      (void)parse_flight_dump(with_tag(*base, "[[1]]"), "s.json");
      FAIL() << "no error";
    } catch (const InvalidArgument& e) {
      EXPECT_THAT(e.what(), HasSubstr("field 'tag' has the wrong type"));
    }
  }
}

// A dump that disagrees with itself (edited or corrupted: well formed, but
// not what a recorder writes) is refused naming the file and the field, as
// written and read as a tree; replayed, it could give a verdict about calls
// that never happened (found by a hostile-input run).
TEST(FlightDump, InconsistentFieldsAreRefusedNamingTheFileAndField) {
  struct Case {
    std::function<void(FlightDump&)> edit;
    std::string message;
  };
  const std::vector<Case> cases = {
      {[](FlightDump& d) { d.entries[0].numel = 13; },
       "calls[0]: all_to_all_single on group 'tp{2,3}' records numel 13, but its first input "
       "shape [4,3] holds 12"},
      {[](FlightDump& d) { d.entries[0].input_shapes.clear(); },  // then the output's: 15
       "records numel 12, but its first output shape [5,3] holds 15"},
      {[](FlightDump& d) { d.entries[0].group_size = 3; },
       "calls[0]: all_to_all_single on group 'tp{2,3}' records group_rank 1 of 3, but the group "
       "is rank 1 of 2 members"},
      {[](FlightDump& d) { d.entries[0].group_rank = 0; }, "records group_rank 0 of 2"},
      {[](FlightDump& d) { d.groups[0].group.group_rank = 2; },
       "groups[0]: group_rank 2 of group 'tp{2,3}' outside its 2 members"},
      {[](FlightDump& d) { d.groups[0].watermark = 8; },
       "groups[0]: group 'tp{2,3}' has watermark 8 / p2p_watermark 1 above its calls 7 / "
       "p2p_calls 2"},
      {[](FlightDump& d) { d.groups[0].p2p_watermark = 3; }, "p2p_watermark 3 above"},
      {[](FlightDump& d) { d.entries[0].seq = 7; },
       "entry 0: all_to_all_single #7 on group 'tp{2,3}' lies outside its group's recorded call "
       "numbers [5, 7)"},
      {[](FlightDump& d) { d.entries[0].seq = 4; }, "#4 on group 'tp{2,3}' lies outside"},
  };
  for (const Case& c : cases) {
    FlightDump d = one_of_each();
    c.edit(d);
    const std::string written = flight_dump_json(d);
    for (const std::string& text : {written, nlohmann::json::parse(written).dump(2)}) {
      try {
        (void)parse_flight_dump(text, "bad.json");
        ADD_FAILURE() << "no error, expected " << c.message;
      } catch (const InvalidArgument& e) {
        EXPECT_EQ(e.site().op, "bad.json");
        EXPECT_THAT(std::string(e.detail()), HasSubstr(c.message));
      }
    }
  }
  // What the recorder writes passes: a barrier records no shapes, numel 0.
  FlightDump d = one_of_each();
  FlightRecord b = d.entries[0];
  b.op = OpType::Barrier;
  b.input_shapes.clear();
  b.output_shapes.clear();
  b.numel = 0;
  b.seq = 7;
  d.groups[0].group.calls = 8;
  d.entries.push_back(b);
  EXPECT_EQ(parse_flight_dump(flight_dump_json(d), "ok.json").entries.size(), 2u);
}

TEST(FlightDump, DumpWritesRankFileIntoTheDirectory) {
  const std::string dir =
      (std::filesystem::temp_directory_path() / ("fr-test-" + std::to_string(::getpid()))).string();
  FlightRecorder fr(sized(4));
  fr.set_identity(6, 8);
  record(fr, "world", OpType::AllReduce, 0);
  const std::string path = fr.dump(dir);
  EXPECT_EQ(path, dir + "/rank-6.json");
  const FlightDump d = read_flight_dump(path);
  EXPECT_EQ(d.rank, 6);
  EXPECT_EQ(d.world_size, 8);
  ASSERT_EQ(d.entries.size(), 1u);
  EXPECT_EQ(d.entries[0].input_shapes, (std::vector<Shape>{{2, 3}}));
  std::filesystem::remove_all(dir);
}

// A group name that is not UTF-8 (a user's bytes) is written with U+FFFD in
// place of each bad byte, as the text report prints it, instead of failing
// the dump with nlohmann's internal type_error.316 (issue [4/7] item 4).
TEST(FlightDump, NonUtf8GroupNamesAreWrittenWithReplacementCharacters) {
  const std::string dir =
      (std::filesystem::temp_directory_path() / ("fr-utf8-" + std::to_string(::getpid()))).string();
  FlightRecorder fr(sized(4));
  fr.set_identity(0, 2);
  record(fr, "tp\xff\xfe", OpType::AllReduce, 0);
  const std::string path = fr.dump(dir);
  const FlightDump d = read_flight_dump(path);
  ASSERT_EQ(d.groups.size(), 1u);
  EXPECT_EQ(d.groups[0].group.name, "tp\xef\xbf\xbd\xef\xbf\xbd");
  EXPECT_EQ(d.entries.size(), 1u);
  std::filesystem::remove_all(dir);
}

// The user's call site travels with each entry: the text dump prints it and
// the JSON dump keeps it (issue [4/7] item 5); an entry without one (older
// dumps) reads back without one.
TEST(FlightDump, CallersArePrintedAndRoundTrip) {
  FlightRecorder fr(sized(4));
  fr.set_identity(0, 2);
  fr.note_group("world", 0, [] { return std::vector<int>{0, 1}; });
  Call c;
  c.op = OpType::Barrier;
  c.group = "world";
  c.group_size = 2;
  c.caller = Caller{"model.py", 42};
  fr.end(fr.begin(c), FlightRecord::State::Completed);
  c.seq = 1;
  c.caller = Caller{};
  fr.end(fr.begin(c), FlightRecord::State::Completed);
  EXPECT_THAT(fr.dump(), HasSubstr(" at model.py:42\n"));
  const std::string dir =
      (std::filesystem::temp_directory_path() / ("fr-caller-" + std::to_string(::getpid())))
          .string();
  const FlightDump d = read_flight_dump(fr.dump(dir));
  ASSERT_EQ(d.entries.size(), 2u);
  EXPECT_EQ(d.entries[0].caller.str(), "model.py:42");
  EXPECT_FALSE(d.entries[1].caller);
  std::filesystem::remove_all(dir);
}

TEST(FlightDump, DumpOnErrorNeverThrows) {
  dist::Options o = sized(4);
  o.flight_recorder_dump_dir = "/proc/no/such/dir";
  FlightRecorder fr(o);
  record(fr, "world", OpType::Barrier, 0);
  EXPECT_NO_THROW(fr.dump_on_error());
}

// A rank ending on an uncaught C++ exception (std::terminate) leaves its
// dump: diffcomm's terminate handler writes every recorder that has a dump
// directory, then the previous handler ends the process as before.
void die_uncaught(const std::string& dir) {
  dist::Options o = sized(4);
  o.flight_recorder_dump_dir = dir;
  auto fr = FlightRecorder::for_rank(o, 3, 4);
  record(*fr, "world", OpType::AllReduce, 0);
  std::terminate();
}

TEST(FlightRecorderDeathTest, UncaughtErrorDumpsAtExit) {
  GTEST_FLAG_SET(death_test_style, "fast");  // fork: the child shares `dir`
  const std::string dir =
      (std::filesystem::temp_directory_path() / ("fr-exit-" + std::to_string(::getpid()))).string();
  EXPECT_DEATH(die_uncaught(dir), "");
  const FlightDump d = read_flight_dump(dir + "/rank-3.json");  // written by the child
  EXPECT_EQ(d.world_size, 4);
  ASSERT_EQ(d.entries.size(), 1u);
  EXPECT_EQ(d.entries[0].op, OpType::AllReduce);
  std::filesystem::remove_all(dir);
}

TEST(FlightRecorder, DumpAllOnErrorAsksOnlyRecordersWithADumpDirectory) {
  const std::string dir =
      (std::filesystem::temp_directory_path() / ("fr-all-" + std::to_string(::getpid()))).string();
  const int before = FlightRecorder::dump_all_on_error();
  dist::Options o = sized(4);
  o.flight_recorder_dump_dir = dir;
  {
    auto with_dir = FlightRecorder::for_rank(o, 1, 2);
    auto without = FlightRecorder::for_rank(sized(4), 0, 2);
    record(*with_dir, "world", OpType::Barrier, 0);
    EXPECT_EQ(FlightRecorder::dump_all_on_error(), before + 1);
    EXPECT_TRUE(std::filesystem::exists(dir + "/rank-1.json"));
    EXPECT_FALSE(std::filesystem::exists(dir + "/rank-0.json"));
  }
  EXPECT_EQ(FlightRecorder::dump_all_on_error(), before);  // destroyed: unregistered
  std::filesystem::remove_all(dir);
}

TEST(FlightRecorderOptions, SizeFromEnvironmentDefault2000) {
  ::unsetenv("DIFFCOMM_FR_SIZE");
  EXPECT_EQ(dist::Options{}.resolved_flight_recorder_size(), 2000u);
  ::setenv("DIFFCOMM_FR_SIZE", "17", 1);
  EXPECT_EQ(dist::Options{}.resolved_flight_recorder_size(), 17u);
  EXPECT_EQ(FlightRecorder().capacity(), 17u);
  ::setenv("DIFFCOMM_FR_SIZE", "0", 1);
  EXPECT_THROW((void)dist::Options{}.resolved_flight_recorder_size(), InvalidArgument);
  ::setenv("DIFFCOMM_FR_SIZE", "ten", 1);
  EXPECT_THROW((void)dist::Options{}.resolved_flight_recorder_size(), InvalidArgument);
  // Too large to allocate: named, before any ring is allocated (was std::bad_alloc).
  for (const char* huge : {"1000000000000", "1000001", "99999999999999999999999"}) {
    ::setenv("DIFFCOMM_FR_SIZE", huge, 1);
    try {
      (void)dist::Options{}.resolved_flight_recorder_size();
      ADD_FAILURE() << huge << " was accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_THAT(e.what(), ::testing::HasSubstr("DIFFCOMM_FR_SIZE"));
      EXPECT_THAT(e.what(), ::testing::HasSubstr("from 1 to 1000000"));
    }
  }
  ::setenv("DIFFCOMM_FR_SIZE", "1000000", 1);
  EXPECT_EQ(dist::Options{}.resolved_flight_recorder_size(), 1000000u);
  dist::Options too_many;
  too_many.flight_recorder_size = dist::Options::kMaxFlightRecorderSize + 1;
  EXPECT_THROW((void)too_many.resolved_flight_recorder_size(), InvalidArgument);
  ::unsetenv("DIFFCOMM_FR_SIZE");
  ::setenv("DIFFCOMM_FR_DUMP_DIR", "/tmp/x", 1);
  EXPECT_EQ(dist::Options{}.resolved_flight_recorder_dump_dir(), "/tmp/x");
  ::unsetenv("DIFFCOMM_FR_DUMP_DIR");
}

}  // namespace
}  // namespace diffcomm::dist
