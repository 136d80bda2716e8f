# The optional CUDA backend. BERT_CUDA=AUTO (default) builds it when nvcc is found (in PATH, CUDACXX,
# or /usr/local/cuda), ON requires it, OFF never builds it. Without it every tool is CPU-only and
# --device cuda says so. BERT_WITH_CUDA (0/1) tells the sources which build this is.
set(BERT_CUDA "AUTO" CACHE STRING "GPU backend: AUTO (when nvcc is found), ON, OFF")
set_property(CACHE BERT_CUDA PROPERTY STRINGS AUTO ON OFF)
set(BERT_WITH_CUDA OFF)
if(NOT BERT_CUDA STREQUAL "OFF")
  if(NOT CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX} AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    # Hopper (H100/H200) by default, with PTX so newer GPUs compile it at load time;
    # -DCMAKE_CUDA_ARCHITECTURES="80;90" adds Ampere.
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 90)
    endif()
    enable_language(CUDA)
    # CMake 3.25 does not know nvcc 13's C++20 flags; the kernels share core's C++20 headers.
    set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
    set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
    set(CMAKE_CUDA_STANDARD 20)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    find_package(CUDAToolkit REQUIRED)
    set(BERT_WITH_CUDA ON)
  elseif(BERT_CUDA STREQUAL "ON")
    message(FATAL_ERROR "BERT_CUDA=ON but no CUDA compiler was found (set CUDACXX or install the CUDA toolkit)")
  endif()
endif()
message(STATUS "BERT_CUDA=${BERT_CUDA}: GPU backend ${BERT_WITH_CUDA}")
