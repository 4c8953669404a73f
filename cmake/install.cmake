# The C++ package: the public headers (with the generated version.h and config.h), the library and the CMake config
# files of find_package(kdakit), whose imported target kdakit::kdakit carries the include folder and the dependencies
# (Threads; the CUDA runtime when the library has the CUDA kernels). examples/cpp consumes it.
include(CMakePackageConfigHelpers)

set(KDAKIT_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/kdakit)

install(TARGETS kdakit EXPORT kdakitTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(DIRECTORY include/kdakit DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} FILES_MATCHING PATTERN "*.h")
install(FILES ${PROJECT_BINARY_DIR}/include/kdakit/version.h ${PROJECT_BINARY_DIR}/include/kdakit/config.h
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/kdakit)
install(EXPORT kdakitTargets NAMESPACE kdakit:: DESTINATION ${KDAKIT_INSTALL_CMAKEDIR})

configure_package_config_file(cmake/kdakitConfig.cmake.in ${PROJECT_BINARY_DIR}/kdakitConfig.cmake
                              INSTALL_DESTINATION ${KDAKIT_INSTALL_CMAKEDIR})
# Minor versions keep the source compatible (docs/cpp-api.md): a request for 0.1 accepts any later 0.x; the shared
# library's soname (MAJOR.MINOR) keeps programs built against another minor version from loading it.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/kdakitConfigVersion.cmake COMPATIBILITY SameMajorVersion)
install(FILES ${PROJECT_BINARY_DIR}/kdakitConfig.cmake ${PROJECT_BINARY_DIR}/kdakitConfigVersion.cmake
        DESTINATION ${KDAKIT_INSTALL_CMAKEDIR})
