# Every third-party dependency, found once here (all from Debian packages; see scripts/setup.sh).
find_package(Eigen3 3.3 REQUIRED NO_MODULE)
find_package(OpenMP REQUIRED COMPONENTS CXX)
find_package(spdlog REQUIRED)
find_package(CLI11 CONFIG REQUIRED)
find_package(HDF5 REQUIRED COMPONENTS C CXX)
find_package(Protobuf REQUIRED)
find_package(ONNX REQUIRED)
find_package(PkgConfig REQUIRED)
pkg_check_modules(SentencePiece REQUIRED IMPORTED_TARGET sentencepiece)
find_package(GTest REQUIRED)

# Debian's libsentencepiece.so carries (and exports) its own copy of protobuf-lite. If a program loads
# it before libprotobuf.so, protobuf's static initialisers bind to that copy and crash at start-up (seen
# with ONNX + SentencePiece in one binary). Making libprotobuf the first library every program loads
# lets its symbols win; tokenizer and ONNX tests then run in the same process.
add_link_options("LINKER:--push-state,--no-as-needed" "-lprotobuf" "LINKER:--pop-state")
