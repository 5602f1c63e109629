// The main of octet_dist_tests: MPI starts before the tests and ends after them (every rank runs
// every test, in the same order, so their collectives meet). Run it under
// `mpirun -np 2 octet_dist_tests`; one process runs the tests that need one rank and skips the
// rest.
#include <gtest/gtest.h>

#include <cstdio>

#include "octet/dist/communicator.h"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  const auto world = octet::dist::from_environment();
  if (world->rank() != 0) {
    // One report: rank 0's. A failure on another rank still fails the run (mpirun's exit status)
    // and says so below. InitGoogleTest already installed the JSON writer from --gtest_output:
    // removed, so that the ranks do not all write, interleaved, the same file.
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    delete listeners.Release(listeners.default_xml_generator());
  }
  const int status = RUN_ALL_TESTS();
  if (world->rank() != 0 && status != 0)
    std::fprintf(stderr, "octet_dist_tests: rank %d failed (run it alone for details)\n",
                 world->rank());
  octet::dist::shutdown(true);
  return status;
}
