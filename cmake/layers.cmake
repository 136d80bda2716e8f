# One library per folder, with a one-way dependency order the build enforces:
#   sys (errors, files, JSON, processes, threads) <- kernels (CPU GEMM, INT8, vector math) and core (tensors,
#   graph, arena, devices) <- ops (forward and backward, CPU and CUDA) <- model -> quant -> eval -> train;
#   quant -> export;  tokenizer -> sys;  data -> core, tokenizer
#   (eval, train, export read it). tokenizer holds the Tokenizer interface, WordPiece and the tokenizer
#   files that travel with models; sentencepiece (SentencePiece, load_tokenizer) -> tokenizer is linked
#   by the programs that tokenize only, never by a library (cmake/dependencies.cmake says why).
#   ort (the ONNX Runtime bridge) -> core, data; eval scores exports and export calibrates through it.
#   store (model storage: our checkpoints, Hugging Face directories, opening any model) -> model, data;
#   train and export save and open models through it, as do the tools.
#   train uses eval for its periodic held-out evaluation.
# A library may link only the project libraries listed for it here; anything else is a configure
# error, so a layering violation cannot slip in unnoticed.
set(BERT_ALLOWED_DEPS_sys     "")
set(BERT_ALLOWED_DEPS_kernels "sys")
set(BERT_ALLOWED_DEPS_core    "sys")
set(BERT_ALLOWED_DEPS_ops     "sys;kernels;core")
set(BERT_ALLOWED_DEPS_tokenizer "sys")
set(BERT_ALLOWED_DEPS_sentencepiece "sys;tokenizer")
set(BERT_ALLOWED_DEPS_data   "sys;core;tokenizer")
set(BERT_ALLOWED_DEPS_model  "sys;kernels;core;ops")
set(BERT_ALLOWED_DEPS_store  "sys;core;model;data;tokenizer")
set(BERT_ALLOWED_DEPS_quant  "sys;core;ops;model;data")
set(BERT_ALLOWED_DEPS_train  "sys;kernels;core;ops;model;quant;data;tokenizer;eval;store")
set(BERT_ALLOWED_DEPS_ort    "sys;core;data")
set(BERT_ALLOWED_DEPS_eval   "sys;kernels;core;ops;model;quant;data;tokenizer;ort")
set(BERT_ALLOWED_DEPS_export "sys;core;ops;model;quant;data;tokenizer;ort;store")

# bert_add_library(<folder> SOURCES ... [DEPENDS <project libs>] [LIBS <third-party targets>])
# creates target bert_<folder>.
function(bert_add_library name)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPENDS;LIBS" ${ARGN})
  if(NOT DEFINED BERT_ALLOWED_DEPS_${name})
    message(FATAL_ERROR "bert_add_library(${name}): '${name}' has no entry in cmake/layers.cmake")
  endif()
  foreach(dep IN LISTS ARG_DEPENDS)
    if(NOT dep IN_LIST BERT_ALLOWED_DEPS_${name})
      message(FATAL_ERROR "Layering violation: ${name} may not depend on ${dep} "
                          "(allowed: ${BERT_ALLOWED_DEPS_${name}})")
    endif()
  endforeach()
  add_library(bert_${name} STATIC ${ARG_SOURCES})
  target_include_directories(bert_${name} PUBLIC ${PROJECT_SOURCE_DIR})
  list(TRANSFORM ARG_DEPENDS PREPEND bert_)
  target_link_libraries(bert_${name} PUBLIC ${ARG_DEPENDS} ${ARG_LIBS})
endfunction()
