# One library per folder, with a one-way dependency order the build enforces:
#   core -> model -> quant -> eval -> train;  quant -> export;  tokenizer -> core;  data -> core, tokenizer
#   (eval, train, export read it). tokenizer holds the Tokenizer interface, WordPiece and the tokenizer
#   files that travel with models; sentencepiece (SentencePiece, load_tokenizer) -> tokenizer is linked
#   by the programs that tokenize only, never by a library (cmake/dependencies.cmake says why).
#   ort (the ONNX Runtime bridge) -> core, data; eval scores exports and export calibrates through it.
#   store (model storage: our checkpoints, Hugging Face directories, opening any model) -> model, data;
#   train and export save and open models through it, as do the tools.
#   train uses eval for its periodic held-out evaluation.
# A library may link only the project libraries listed for it here; anything else is a configure
# error, so a layering violation cannot slip in unnoticed.
set(BERT_ALLOWED_DEPS_core   "")
set(BERT_ALLOWED_DEPS_tokenizer "core")
set(BERT_ALLOWED_DEPS_sentencepiece "core;tokenizer")
set(BERT_ALLOWED_DEPS_data   "core;tokenizer")
set(BERT_ALLOWED_DEPS_model  "core")
set(BERT_ALLOWED_DEPS_store  "core;model;data;tokenizer")
set(BERT_ALLOWED_DEPS_quant  "core;model;data")
set(BERT_ALLOWED_DEPS_train  "core;model;quant;data;tokenizer;eval;store")
set(BERT_ALLOWED_DEPS_ort    "core;data")
set(BERT_ALLOWED_DEPS_eval   "core;model;quant;data;tokenizer;ort")
set(BERT_ALLOWED_DEPS_export "core;model;quant;data;tokenizer;ort;store")

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
