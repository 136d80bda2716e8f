# Every third-party dependency, found once here (all from Debian packages; see scripts/setup.sh).
find_package(Eigen3 3.3 REQUIRED NO_MODULE)
find_package(OpenMP REQUIRED COMPONENTS CXX)
find_package(spdlog REQUIRED)
find_package(CLI11 CONFIG REQUIRED)
find_package(nlohmann_json 3.10 REQUIRED)
find_package(HDF5 REQUIRED COMPONENTS C)  # the C API (data/hdf5_io.h wraps it), not the C++ one
find_package(Protobuf REQUIRED)
find_package(ONNX REQUIRED)
find_package(PkgConfig REQUIRED)
pkg_check_modules(SentencePiece REQUIRED IMPORTED_TARGET sentencepiece)
find_package(GTest REQUIRED)

# Debian's libsentencepiece.so carries (and exports) its own copy of protobuf-lite 3.14; the system
# libprotobuf is 3.21. A process that loads both crashes or aborts in protobuf's start-up checks, so no
# program may load both: SentencePiece is linked only where text is tokenized (the bert_sentencepiece
# library), and ONNX/protobuf only by export/. tests/CMakeLists.txt checks that no binary needs both.
# Link a shared library only into programs that use it (keeps SentencePiece out of export/ programs).
add_link_options("LINKER:--as-needed")
