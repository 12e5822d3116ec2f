#pragma once
// The conformance suite's test bodies, written once for every backend. A
// backend's conformance executable includes this header in exactly one
// translation unit, defines make_backend_runner() and instantiates
// ConformanceTest with its parameters (see backend_fixture.hpp).
#include "backend_fixture.hpp"
#include "conformance_cases.hpp"

namespace diffcomm::conformance {

// Cases are grouped by family, one TEST_P each, so that a backend's
// executable registers few tests per parameter (ctest runs each test in its
// own process); every failure message names the call, group and rank.
TEST_P(ConformanceTest, GroupsAndBarrier) {
  run_case(case_group_basics);
  run_case(case_barrier);
}
TEST_P(ConformanceTest, AllReduceAndReduce) {
  run_case(case_all_reduce);
  run_case(case_reduce);
}
TEST_P(ConformanceTest, BroadcastGatherScatter) {
  run_case(case_broadcast);
  run_case(case_gather);
  run_case(case_scatter);
}
TEST_P(ConformanceTest, AllGathers) {
  run_case(case_all_gather);
  run_case(case_all_gather_single);
  run_case(case_all_gather_v);
}
TEST_P(ConformanceTest, ReduceScatters) {
  run_case(case_reduce_scatter);
  run_case(case_reduce_scatter_single);
  run_case(case_reduce_scatter_v);
}
TEST_P(ConformanceTest, AllToAllAndSendRecv) {
  run_case(case_all_to_all);
  run_case(case_all_to_all_single);
  run_case(case_send_recv);
}

}  // namespace diffcomm::conformance
