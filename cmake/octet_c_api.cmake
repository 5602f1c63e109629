# liboctet_c: the C API (include/octet/octet.h) as a shared library over the static octet library,
# its C test, and the install rules with a find_package(octet) config for downstream projects.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

# DLPack is header-only; Debian ships it as libdlpack-dev (scripts/setup.sh installs it).
find_path(OCTET_DLPACK_INCLUDE_DIR dlpack/dlpack.h)
if(NOT OCTET_DLPACK_INCLUDE_DIR)
  message(FATAL_ERROR "dlpack/dlpack.h not found: install libdlpack-dev (scripts/setup.sh does), "
                      "pass -DOCTET_DLPACK_INCLUDE_DIR=..., or -DOCTET_BUILD_C_API=OFF")
endif()

file(GLOB octet_c_sources CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/src/capi/*.cc)
add_library(octet_c SHARED ${octet_c_sources})
target_include_directories(octet_c
  PUBLIC $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include> $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>
  PRIVATE ${PROJECT_SOURCE_DIR}/src)
# A system include directory in an interface would turn into -isystem /usr/include, which breaks
# the C++ standard headers' #include_next; it is searched anyway.
if(NOT OCTET_DLPACK_INCLUDE_DIR IN_LIST CMAKE_C_IMPLICIT_INCLUDE_DIRECTORIES
   AND NOT OCTET_DLPACK_INCLUDE_DIR STREQUAL "/usr/include")
  target_include_directories(octet_c PUBLIC $<BUILD_INTERFACE:${OCTET_DLPACK_INCLUDE_DIR}>)
endif()
target_link_libraries(octet_c PRIVATE octet)
target_compile_definitions(octet_c PRIVATE OCTET_LIBRARY_VERSION="${PROJECT_VERSION}")
target_compile_options(octet_c PRIVATE -Wall -Wextra -Wno-unused-parameter)
# Only the octet_* functions are exported: the C++ library inside stays private, so it cannot
# clash with another copy of octet (or of its dependencies) in the same process.
set_target_properties(octet_c PROPERTIES CXX_VISIBILITY_PRESET hidden VISIBILITY_INLINES_HIDDEN ON
                      VERSION ${PROJECT_VERSION} SOVERSION ${PROJECT_VERSION_MAJOR})
target_link_options(octet_c PRIVATE -Wl,--exclude-libs,ALL -Wl,--no-undefined)
if(octet_cuda)
  # An installed copy (a wheel) finds the CUDA runtime and cuBLASLt where it was built against.
  set_target_properties(octet_c PROPERTIES INSTALL_RPATH "${CUDAToolkit_LIBRARY_DIR}")
endif()

if(OCTET_BUILD_TESTS)
  enable_language(C)
  # Written in C11 and compiled as C: the header must stay plain C.
  add_executable(octet_capi_test ${PROJECT_SOURCE_DIR}/tests/capi/capi_test.c
                                 ${PROJECT_SOURCE_DIR}/tests/capi/capi_modules_test.c
                                 ${PROJECT_SOURCE_DIR}/tests/capi/capi_check.c)
  set_target_properties(octet_capi_test PROPERTIES C_STANDARD 11 C_STANDARD_REQUIRED ON
                        C_EXTENSIONS OFF)
  target_compile_options(octet_capi_test PRIVATE -Wall -Wextra -Werror -pedantic)
  target_link_libraries(octet_capi_test PRIVATE octet_c m)
  add_test(NAME octet_capi_test COMMAND octet_capi_test)
endif()

install(TARGETS octet_c EXPORT octetTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(FILES ${PROJECT_SOURCE_DIR}/include/octet/octet.h
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/octet)
set(octet_cmake_dir ${CMAKE_INSTALL_LIBDIR}/cmake/octet)
install(EXPORT octetTargets NAMESPACE octet:: DESTINATION ${octet_cmake_dir})
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/octetConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/octetConfig.cmake
                              INSTALL_DESTINATION ${octet_cmake_dir})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/octetConfigVersion.cmake
                                 VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/octetConfig.cmake ${PROJECT_BINARY_DIR}/octetConfigVersion.cmake
        DESTINATION ${octet_cmake_dir})
