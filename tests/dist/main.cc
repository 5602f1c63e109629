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
    // and says so below. The JSON writer was installed by InitGoogleTest from --gtest_output, so
    // clearing the flag is not enough: without removing it, every rank writes the same file and
    // the interleaved result miscounts (or does not parse).
    GTEST_FLAG_SET(output, "");
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
