// Hugging Face interoperability: the safetensors format, and checkpoint import/export against fixtures
// written by PyTorch (tests/golden/make_hf_fixture.py): logits of the imported model against an
// independent float64 implementation for F32, BF16 (old gamma/beta names) and sharded F16 weights;
// export -> import bit exact; a bare BertModel; bad checkpoints.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>

#include "data/hdf5_io.h"
#include "model/bert.h"
#include "store/checkpoint.h"
#include "store/hf_checkpoint.h"
#include "store/model_source.h"
#include "store/safetensors.h"
#include "sys/error.h"
#include "sys/text_file.h"
#include "tests/common/expect_user_error.h"
#include "tests/common/temp_dir.h"

namespace bert::hf {
namespace {

namespace fs = std::filesystem;
using testing::expect_user_error;
using testing::TempDir;

const std::string kFixtures = std::string(BERT_TEST_FIXTURES_DIR) + "/hf";

std::vector<float> read_tensor(const std::string& path, const std::string& name) {
  SafetensorsFile f(path);
  const TensorEntry* e = f.find(name);
  if (!e) throw std::runtime_error("fixture lacks " + name);
  return f.read(*e);
}

// The fixture's inputs and the logits PyTorch computed for weight set `tag` (f32, bf16, f16).
struct Expected {
  std::vector<int32_t> input_ids, masked_positions, masked_ids;
  std::vector<int8_t> attention_mask, token_type_ids;
  std::vector<float> mlm, nsp;
  int64_t batch = 2, seq = 12, predictions = 3;

  explicit Expected(const std::string& tag) {
    const std::string path = kFixtures + "/expected.safetensors";
    for (float v : read_tensor(path, "input_ids")) input_ids.push_back(static_cast<int32_t>(v));
    for (float v : read_tensor(path, "masked_positions")) masked_positions.push_back(static_cast<int32_t>(v));
    for (float v : read_tensor(path, "attention_mask")) attention_mask.push_back(static_cast<int8_t>(v));
    for (float v : read_tensor(path, "token_type_ids")) token_type_ids.push_back(static_cast<int8_t>(v));
    masked_ids.assign(masked_positions.size(), 0);
    mlm = read_tensor(path, "mlm_logits_" + tag);
    nsp = read_tensor(path, "nsp_logits_" + tag);
  }
  BatchView batch_view() const {
    return {batch,      seq, predictions, input_ids, attention_mask, token_type_ids, masked_positions,
            masked_ids, {},  {},          {}};
  }
};

double relative_error(TensorView<float> actual, const std::vector<float>& expected) {
  EXPECT_EQ(actual.numel(), static_cast<int64_t>(expected.size()));
  double diff = 0, scale = 0;
  for (size_t i = 0; i < expected.size() && static_cast<int64_t>(i) < actual.numel(); ++i) {
    diff = std::max(diff, std::abs(double(actual[i]) - expected[i]));
    scale = std::max(scale, std::abs(double(expected[i])));
  }
  return diff / scale;
}

// Imports `dir` and checks the logits against PyTorch's for the same weights.
ImportReport expect_logits_match(const std::string& dir, const std::string& tag) {
  model::Bert m(read_config(dir));
  ImportReport report = import_model(dir, m);
  Expected e(tag);
  Graph<float> g;
  NoGradGuard<float> no_grad(g);
  Rng unused(0);
  const BatchView batch = e.batch_view();
  model::ModelOutputs out = m.forward(g, batch, false, unused);
  EXPECT_LT(relative_error(g.value(out.mlm_logits), e.mlm), 1e-4) << dir;
  EXPECT_LT(relative_error(g.value(out.nsp_logits), e.nsp), 1e-4) << dir;
  return report;
}

TEST(Safetensors, WriterRoundTripsValuesAndMetadata) {
  TempDir dir;
  SafetensorsWriter w;
  const std::vector<float> a = {1.5f, -2.25f, 3e-38f, 7.0f, 0.1f, -0.0f};
  const std::vector<float> b = {42.0f};
  w.add("a", {2, 3}, a.data());
  w.add("b", {}, b.data());
  w.set_metadata("format", "pt");
  w.write(dir.file("x.safetensors"));
  SafetensorsFile f(dir.file("x.safetensors"));
  ASSERT_EQ(f.tensors().size(), 2u);
  EXPECT_EQ(f.metadata().at("format"), "pt");
  const TensorEntry* ea = f.find("a");
  ASSERT_NE(ea, nullptr);
  EXPECT_EQ(ea->shape, (std::vector<int64_t>{2, 3}));
  const std::vector<float> ra = f.read(*ea);
  EXPECT_EQ(std::memcmp(ra.data(), a.data(), a.size() * 4), 0);
  EXPECT_EQ(f.read(*f.find("b")), b);
  // The data section starts 8-byte aligned.
  std::ifstream in(dir.file("x.safetensors"), std::ios::binary);
  uint64_t n = 0;
  in.read(reinterpret_cast<char*>(&n), 8);
  EXPECT_EQ((8 + n) % 8, 0u);
}

TEST(Safetensors, HalfAndBfloat16DecodeExactly) {
  EXPECT_EQ(half_to_float(0x3C00), 1.0f);
  EXPECT_EQ(half_to_float(0xC000), -2.0f);
  EXPECT_EQ(half_to_float(0x7BFF), 65504.0f);
  EXPECT_EQ(half_to_float(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(half_to_float(0x03FF), std::ldexp(1023.0f, -24));
  EXPECT_TRUE(std::isinf(half_to_float(0x7C00)));
  EXPECT_TRUE(std::isnan(half_to_float(0x7E00)));
  EXPECT_EQ(half_to_float(0x3555), 0.333251953125f);
  EXPECT_EQ(bfloat16_to_float(0x3F80), 1.0f);
  EXPECT_EQ(bfloat16_to_float(0x4049), 3.140625f);
  EXPECT_EQ(bfloat16_to_float(0xC2F7), -123.5f);
}

// Writes a file with the given header text and `data_bytes` bytes of data.
std::string write_raw(const TempDir& dir, const std::string& header, size_t data_bytes, uint64_t claimed = 0) {
  const std::string path = dir.file("raw.safetensors");
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  const uint64_t n = claimed ? claimed : header.size();
  out.write(reinterpret_cast<const char*>(&n), 8);
  out << header << std::string(data_bytes, '\0');
  return path;
}

TEST(Safetensors, CorruptFilesAreRejectedWithTheReason) {
  TempDir dir;
  expect_user_error([&] { SafetensorsFile f(dir.file("none.safetensors")); }, "does not exist");
  {
    std::ofstream(dir.file("short.safetensors")) << "abc";
    expect_user_error([&] { SafetensorsFile f(dir.file("short.safetensors")); }, "shorter than its 8-byte header");
  }
  const std::string ok = R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})";
  EXPECT_NO_THROW(SafetensorsFile(write_raw(dir, ok, 16)));
  expect_user_error([&] { SafetensorsFile f(write_raw(dir, ok, 16, 1u << 30)); }, "header length");
  expect_user_error([&] { SafetensorsFile f(write_raw(dir, ok, 8)); }, "truncated file?");
  expect_user_error([&] { SafetensorsFile f(write_raw(dir, "{\"w\":", 0)); }, "not valid JSON");
  expect_user_error(
      [&] { SafetensorsFile f(write_raw(dir, R"({"w":{"dtype":"F32","shape":[3,2],"data_offsets":[0,16]}})", 16)); },
      "tensor 'w': data_offsets hold 16 bytes, but shape and dtype need 24");
  expect_user_error(
      [&] { SafetensorsFile f(write_raw(dir, R"({"w":{"dtype":"C64","shape":[1],"data_offsets":[0,8]}})", 8)); },
      "dtype 'C64' is not supported");
  expect_user_error(
      [&] { SafetensorsFile f(write_raw(dir, R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[8,4]}})", 8)); },
      "are not a range");
  expect_user_error([&] { SafetensorsFile f(write_raw(dir, R"({"w":{"dtype":"F32","shape":[1]}})", 8)); },
                    "needs dtype, shape and data_offsets");
  expect_user_error(
      [&] {
        SafetensorsFile f(write_raw(
            dir,
            R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
            12));
      },
      "overlap");
  expect_user_error([&] { SafetensorsFile f(write_raw(dir, R"({"__metadata__":{"k":1}})", 0)); }, "is not a string");
}

TEST(HfImport, F32CheckpointMatchesPyTorch) {
  const ImportReport r = expect_logits_match(kFixtures + "/tiny", "f32");
  EXPECT_EQ(r.tensors_loaded, 46);
  EXPECT_TRUE(r.unexpected.empty());
  EXPECT_TRUE(r.initialized.empty());
  EXPECT_TRUE(r.warnings.empty());
  EXPECT_EQ(r.dtypes, std::vector<std::string>{"F32"});
  EXPECT_EQ(r.quantizers_enabled, 0);
}

TEST(HfImport, Bfloat16CheckpointWithLegacyNamesLoads) {
  const ImportReport r = expect_logits_match(kFixtures + "/tiny-bf16", "bf16");
  EXPECT_EQ(r.legacy_names.size(), 12u);  // gamma and beta of 6 LayerNorms
  EXPECT_EQ(r.dtypes, (std::vector<std::string>{"BF16", "I64"}));
  EXPECT_TRUE(r.unexpected.empty()) << "position_ids is a known buffer";
  EXPECT_TRUE(r.warnings.empty()) << "the tied decoder equals the word embeddings";
  // Values are the F32 fixture's rounded to bfloat16.
  model::Bert f32(read_config(kFixtures + "/tiny")), bf16(read_config(kFixtures + "/tiny-bf16"));
  import_model(kFixtures + "/tiny", f32);
  import_model(kFixtures + "/tiny-bf16", bf16);
  Parameter<float> a = f32.parameters().get("bert.encoder.layer.1.output.LayerNorm.weight");
  Parameter<float> b = bf16.parameters().get("bert.encoder.layer.1.output.LayerNorm.weight");
  for (int64_t i = 0; i < a.value.numel(); ++i) {
    uint32_t bits;
    std::memcpy(&bits, &b.value[i], 4);
    EXPECT_EQ(bits & 0xffff, 0u);
    EXPECT_NEAR(b.value[i], a.value[i], std::abs(a.value[i]) * (1.0 / 256));
  }
}

TEST(HfImport, ShardedF16CheckpointLoads) {
  const ImportReport r = expect_logits_match(kFixtures + "/tiny-sharded", "f16");
  EXPECT_EQ(r.files.size(), 2u);
  EXPECT_EQ(r.tensors_loaded, 46);
  EXPECT_EQ(r.dtypes, std::vector<std::string>{"F16"});
}

TEST(HfImport, ModelSourceFindsHuggingFaceDirectories) {
  const store::ModelSource s = store::find_model(kFixtures + "/tiny");
  EXPECT_TRUE(s.hugging_face);
  EXPECT_EQ(fs::path(s.tokenizer).filename(), "vocab.txt");
  store::TrainingState state;
  auto m = store::open_model(kFixtures + "/tiny", nullptr, &state);
  EXPECT_EQ(m->config().vocab_size, 384);
  EXPECT_EQ(state.tokenizer_sha256.size(), 64u);
  expect_user_error([&] { store::find_model(kFixtures); }, "neither a run folder");
  expect_user_error([&] { store::find_model(kFixtures + "/nope"); }, "does not exist");
}

// Copies a parameter set into a writer, under possibly changed names.
void add_all(SafetensorsWriter& w, model::Bert& m, const std::function<std::string(const std::string&)>& rename) {
  ParameterArena<float>& p = m.parameters();
  for (ParamId id = 0; id < p.size(); ++id) {
    if (model::is_quantizer_scale(p.name(id))) continue;
    const std::string name = rename(p.name(id));
    if (name.empty()) continue;
    std::vector<int64_t> shape;
    for (int i = 0; i < p.shape(id).rank(); ++i) shape.push_back(p.shape(id)[i]);
    w.add(name, shape, p.get(id).value.data());
  }
}

void copy_config(const std::string& to) {
  fs::create_directories(to);
  fs::copy_file(kFixtures + "/tiny/config.json", fs::path(to) / "config.json", fs::copy_options::overwrite_existing);
}

TEST(HfImport, BareBertModelGetsFreshHeadsAndAWarning) {
  TempDir dir;
  model::Bert source(read_config(kFixtures + "/tiny"));
  import_model(kFixtures + "/tiny", source);
  SafetensorsWriter w;
  add_all(w, source, [](const std::string& n) {
    if (n.starts_with("cls.") || n.starts_with("bert.pooler.")) return std::string();
    return n.substr(5);  // BertModel's own names: no "bert." prefix
  });
  copy_config(dir.file("bare"));
  w.write(dir.file("bare/model.safetensors"));
  model::Bert m(read_config(dir.file("bare")));
  const ImportReport r = import_model(dir.file("bare"), m);
  EXPECT_EQ(r.initialized.size(), 9u);  // pooler (2), transform dense + LayerNorm (4), bias, seq_relationship (2)
  ASSERT_EQ(r.warnings.size(), 1u);
  EXPECT_NE(r.warnings[0].find("freshly initialised"), std::string::npos) << r.warnings[0];
  Parameter<float> a = source.parameters().get("bert.encoder.layer.0.attention.self.query.weight");
  Parameter<float> b = m.parameters().get("bert.encoder.layer.0.attention.self.query.weight");
  EXPECT_TRUE(std::equal(a.value.begin(), a.value.end(), b.value.begin()));
  // Heads get BERT's initialisation: LayerNorm weight 1, biases 0.
  Parameter<float> gamma = m.parameters().get("cls.predictions.transform.LayerNorm.weight");
  EXPECT_EQ(gamma.value[0], 1.0f);
}

TEST(HfImport, BadCheckpointsNameTheProblem) {
  TempDir dir;
  model::Bert source(read_config(kFixtures + "/tiny"));
  import_model(kFixtures + "/tiny", source);
  auto write_variant = [&](const std::string& name, const std::function<std::string(const std::string&)>& rename) {
    SafetensorsWriter w;
    add_all(w, source, rename);
    copy_config(dir.file(name));
    w.write(dir.file(name + "/model.safetensors"));
    return dir.file(name);
  };
  // An encoder tensor missing.
  const std::string missing = write_variant("missing", [](const std::string& n) {
    return n == "bert.encoder.layer.1.intermediate.dense.weight" ? std::string() : n;
  });
  expect_user_error(
      [&] {
        model::Bert m(read_config(missing));
        import_model(missing, m);
      },
      "lacks 1 tensor(s) the encoder needs: bert.encoder.layer.1.intermediate.dense.weight");
  // A wrong shape: config.json claims intermediate_size 96, the tensors have 64.
  const std::string wrong = write_variant("wrong", [](const std::string& n) { return n; });
  {
    std::string text;
    std::ifstream in(kFixtures + "/tiny/config.json");
    std::stringstream ss;
    ss << in.rdbuf();
    text = ss.str();
    const size_t at = text.find("\"intermediate_size\": 64");
    ASSERT_NE(at, std::string::npos);
    text.replace(at, 23, "\"intermediate_size\": 96");
    std::ofstream(wrong + "/config.json", std::ios::trunc) << text;
  }
  expect_user_error(
      [&] {
        model::Bert m(read_config(wrong));
        import_model(wrong, m);
      },
      "tensor 'bert.encoder.layer.0.intermediate.dense.weight' has shape (64, 32), the model (config.json) expects "
      "(96, 32)");
  // Unsupported configurations.
  fs::create_directories(dir.file("relative"));
  std::ofstream(dir.file("relative/config.json"))
      << R"({"model_type": "bert", "position_embedding_type": "relative_key"})";
  expect_user_error([&] { read_config(dir.file("relative")); },
                    "position_embedding_type \"relative_key\" is not supported");
  std::ofstream(dir.file("relative/config.json"), std::ios::trunc) << R"({"model_type": "roberta"})";
  expect_user_error([&] { read_config(dir.file("relative")); }, "model_type \"roberta\" is not supported");
  std::ofstream(dir.file("relative/config.json"), std::ios::trunc)
      << R"({"hidden_size": 30, "num_attention_heads": 4})";
  expect_user_error([&] { read_config(dir.file("relative")); }, "not divisible by num_attention_heads");
  // No weights, or only a pickle.
  copy_config(dir.file("empty"));
  model::Bert m(read_config(kFixtures + "/tiny"));
  expect_user_error([&] { import_model(dir.file("empty"), m); }, "has neither model.safetensors");
  std::ofstream(dir.file("empty/pytorch_model.bin")) << "pickle";
  expect_user_error([&] { import_model(dir.file("empty"), m); }, "holds only pytorch_model.bin");
  // An untied decoder that differs is reported.
  const std::string untied = write_variant("untied", [](const std::string& n) { return n; });
  {
    SafetensorsWriter w;
    add_all(w, source, [](const std::string& n) { return n; });
    Parameter<float> words = source.parameters().get("bert.embeddings.word_embeddings.weight");
    std::vector<float> other(words.value.begin(), words.value.end());
    other[5] += 1.0f;
    w.add("cls.predictions.decoder.weight", {words.value.shape()[0], words.value.shape()[1]}, other.data());
    w.add("unrelated.tensor", {1}, other.data());
    w.write(untied + "/model.safetensors");
  }
  model::Bert u(read_config(untied));
  const ImportReport r = import_model(untied, u);
  ASSERT_EQ(r.warnings.size(), 2u);
  EXPECT_NE(r.warnings[0].find("cls.predictions.decoder.weight differs"), std::string::npos) << r.warnings[0];
  EXPECT_EQ(r.unexpected, std::vector<std::string>{"unrelated.tensor"});
}

TEST(HfExport, ExportImportIsBitExactWithLearnedScales) {
  TempDir dir;
  model::Bert m(read_config(kFixtures + "/tiny"));
  import_model(kFixtures + "/tiny", m);
  // As after QAT: some quantizers enabled with learned (odd) scales.
  Rng rng(7);
  int enabled = 0;
  for (model::Quantizer* q : m.quantizers()) {
    if (q->name.find("layer.1") == std::string::npos) continue;
    q->mode = model::QuantMode::kQuantize;
    for (float& s : m.parameters().get(q->scale).value) s = static_cast<float>(0.001 + 0.1 * rng.next_uniform());
    ++enabled;
  }
  ASSERT_GT(enabled, 10);
  Json recipe;
  recipe["qat"] = true;
  export_model(dir.file("out"), m, recipe);
  EXPECT_TRUE(fs::exists(dir.file("out/quantization.json")));
  SafetensorsFile written(dir.file("out/model.safetensors"));
  EXPECT_EQ(written.metadata().at("format"), "pt");
  EXPECT_EQ(written.tensors().size(), 46u) << "no quantizer scales among the weights";

  model::Bert back(read_config(dir.file("out")));
  const ImportReport r = import_model(dir.file("out"), back);
  EXPECT_EQ(r.quantizers_enabled, enabled);
  EXPECT_TRUE(r.quantization.find("qat")->as_bool());
  ASSERT_EQ(back.parameters().values().numel(), m.parameters().values().numel());
  EXPECT_EQ(std::memcmp(back.parameters().values().data(), m.parameters().values().data(),
                        m.parameters().values().numel() * sizeof(float)),
            0);
  auto qa = m.quantizers(), qb = back.quantizers();
  for (size_t i = 0; i < qa.size(); ++i) EXPECT_EQ(qa[i]->mode, qb[i]->mode) << qa[i]->name;

  // The side file alone restores the scales too (metadata stripped by another tool).
  {
    SafetensorsWriter w;
    add_all(w, m, [](const std::string& n) { return n; });
    w.write(dir.file("out/model.safetensors"));
  }
  model::Bert side(read_config(dir.file("out")));
  EXPECT_EQ(import_model(dir.file("out"), side).quantizers_enabled, enabled);
  EXPECT_EQ(std::memcmp(side.parameters().values().data(), m.parameters().values().data(),
                        m.parameters().values().numel() * sizeof(float)),
            0);

  // An FP32 export over it removes the stale side file, so nothing comes back quantized.
  for (model::Quantizer* q : m.quantizers()) q->mode = model::QuantMode::kFloat;
  export_model(dir.file("out"), m, Json());
  EXPECT_FALSE(fs::exists(dir.file("out/quantization.json")));
  model::Bert plain(read_config(dir.file("out")));
  EXPECT_EQ(import_model(dir.file("out"), plain).quantizers_enabled, 0);
}

// Models quantized before Q, K and V shared one input quantizer hold three scales a layer, under the three
// projections' names. Both our checkpoints and Hugging Face directories load: the shared quantizer takes the
// largest of the three and is enabled if they were; a plan naming one of them keeps the shared one in float.
TEST(EarlierLayout, ThreeQkvInputScalesMergeAtTheLargest) {
  TempDir dir;
  model::Bert m(read_config(kFixtures + "/tiny"));
  import_model(kFixtures + "/tiny", m);
  for (model::Quantizer* q : m.quantizers()) {
    q->mode = model::QuantMode::kQuantize;
    for (float& s : m.parameters().get(q->scale).value) s = 0.02f;
  }
  const std::string layer = "bert.encoder.layer.1.attention.self.";
  const float earlier[3] = {0.031f, 0.047f, 0.029f};  // query, key, value
  const char* projections[3] = {"query", "key", "value"};
  auto shared_scale = [&](model::Bert& b) { return b.parameters().get(layer + "input_quantizer.scale").value[0]; };
  auto check = [&](model::Bert& b, const std::string& what) {
    SCOPED_TRACE(what);
    EXPECT_EQ(shared_scale(b), 0.047f);
    EXPECT_EQ(b.find_quantizer(layer + "input_quantizer")->mode, model::QuantMode::kQuantize);
    EXPECT_EQ(b.parameters().get("bert.encoder.layer.0.attention.self.input_quantizer.scale").value[0], 0.02f);
  };

  // Our checkpoint: the shared dataset replaced by the three earlier ones, the enabled list by their names.
  const std::string path = dir.file("earlier.h5");
  store::save_checkpoint(path, m, nullptr, store::TrainingState{});
  {
    data::hdf5::Quiet quiet;
    data::hdf5::Handle f(H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT), H5Fclose);
    ASSERT_TRUE(f.ok());
    ASSERT_GE(H5Ldelete(f.get(), ("model/" + layer + "input_quantizer.scale").c_str(), H5P_DEFAULT), 0);
    Json::Array enabled;
    for (model::Quantizer* q : m.quantizers())
      if (q->name != layer + "input_quantizer") enabled.emplace_back(q->name);
    for (int i = 0; i < 3; ++i) {
      const std::string name = layer + projections[i] + ".input_quantizer";
      data::hdf5::write_dataset(f.get(), "model/" + name + ".scale", &earlier[i], {1}, path);
      enabled.emplace_back(name);
    }
    ASSERT_GE(H5Adelete(f.get(), "quantizers_enabled"), 0);
    data::hdf5::write_attribute(f.get(), "quantizers_enabled", Json(enabled).dump());
  }
  model::Bert from_checkpoint(read_config(kFixtures + "/tiny"));
  store::load_checkpoint(path, from_checkpoint, nullptr);
  check(from_checkpoint, "checkpoint");

  // A Hugging Face directory whose quantization record names the three.
  export_model(dir.file("hf"), m, Json());
  Json record = Json::parse(read_text_file(dir.file("hf/quantization.json"), "record"));
  Json::Object scales;
  for (const auto& [name, values] : record.find("scales")->as_object())
    if (name != layer + "input_quantizer") scales.emplace_back(name, values);
  for (int i = 0; i < 3; ++i)
    scales.emplace_back(layer + projections[i] + ".input_quantizer", Json(Json::Array{Json(double(earlier[i]))}));
  record["scales"] = Json(scales);
  std::ofstream(dir.file("hf/quantization.json")) << record.dump();
  // The safetensors metadata holds the record too; drop it so the side file is what is read.
  {
    SafetensorsWriter w;
    add_all(w, m, [](const std::string& n) { return n; });
    w.write(dir.file("hf/model.safetensors"));
  }
  model::Bert from_hf(read_config(dir.file("hf")));
  const ImportReport report = import_model(dir.file("hf"), from_hf);
  check(from_hf, "Hugging Face directory");
  ASSERT_EQ(report.warnings.size(), 1u);
  EXPECT_NE(report.warnings[0].find("merged into '" + layer + "input_quantizer' at the largest"), std::string::npos);
}

// Per-tensor weight scales (config "weight_quantization"): a quantized per-tensor model round-trips through
// our checkpoints and Hugging Face directories; an FP32 checkpoint of the per-channel layout loads into a
// per-tensor model (its placeholder scales are not used); quantized weights of the other layout are refused
// with a message naming the layouts and --weights.
TEST(WeightScales, PerTensorModelsRoundTripAndTheOtherLayoutLoadsOnlyUnquantized) {
  TempDir dir;
  model::BertConfig channel_config = read_config(kFixtures + "/tiny");
  model::BertConfig tensor_config = channel_config;
  tensor_config.weight_scales = model::WeightScales::kPerTensor;
  model::Bert fp32(channel_config);
  import_model(kFixtures + "/tiny", fp32);
  store::save_checkpoint(dir.file("fp32.h5"), fp32, nullptr, store::TrainingState{});

  model::Bert per_tensor(tensor_config);
  store::load_checkpoint(dir.file("fp32.h5"), per_tensor, nullptr);
  EXPECT_TRUE(per_tensor.enabled_quantizers().empty());
  const std::string weight = "bert.encoder.layer.1.output.dense.weight";
  const TensorView<float> a = per_tensor.parameters().get(weight).value, b = fp32.parameters().get(weight).value;
  EXPECT_EQ(std::vector<float>(a.begin(), a.end()), std::vector<float>(b.begin(), b.end()));

  Rng rng(3);
  for (model::Quantizer* q : per_tensor.quantizers()) {
    q->mode = model::QuantMode::kQuantize;
    for (float& v : per_tensor.parameters().get(q->scale).value) v = static_cast<float>(0.001 + 0.1 * rng.next_uniform());
  }
  auto same_model = [&](model::Bert& back, const std::string& what) {
    SCOPED_TRACE(what);
    EXPECT_EQ(back.config().weight_scales, model::WeightScales::kPerTensor);
    EXPECT_EQ(back.enabled_quantizers().size(), per_tensor.quantizers().size());
    ASSERT_EQ(back.parameters().values().numel(), per_tensor.parameters().values().numel());
    EXPECT_EQ(std::memcmp(back.parameters().values().data(), per_tensor.parameters().values().data(),
                          per_tensor.parameters().values().numel() * sizeof(float)),
              0);
  };
  store::save_checkpoint(dir.file("per_tensor.h5"), per_tensor, nullptr, store::TrainingState{});
  model::Bert from_checkpoint(store::read_checkpoint_config(dir.file("per_tensor.h5")));
  store::load_checkpoint(dir.file("per_tensor.h5"), from_checkpoint, nullptr);
  same_model(from_checkpoint, "checkpoint");
  export_model(dir.file("hf"), per_tensor, Json());
  EXPECT_EQ(Json::parse(read_text_file(dir.file("hf/config.json"), "config")).find("weight_quantization")->as_string(),
            "per-tensor");
  model::Bert from_hf(read_config(dir.file("hf")));
  import_model(dir.file("hf"), from_hf);
  same_model(from_hf, "Hugging Face directory");

  // Quantized per channel, asked per tensor: refused, naming the file and what to do.
  for (model::Quantizer* q : fp32.quantizers()) q->mode = model::QuantMode::kQuantize;
  store::save_checkpoint(dir.file("qat.h5"), fp32, nullptr, store::TrainingState{});
  model::Bert refused(tensor_config);
  expect_user_error([&] { store::load_checkpoint(dir.file("qat.h5"), refused, nullptr); },
                    "quantizes weights per-channel ('bert.encoder.layer.0.attention.self.query.weight_quantizer' is "
                    "enabled), and this model asks per-tensor (--weights)");
  export_model(dir.file("hf-channel"), fp32, Json());
  expect_user_error([&] { import_model(dir.file("hf-channel"), refused); },
                    "the model's weight scales are per-tensor: leave --weights out, or quantize the FP32 model");
}

TEST(HfExport, TaskModelsRoundTripAndFineTuningStartsFromAPretrainingDirectory) {
  TempDir dir;
  for (const model::Head head :
       {model::Head::kSequenceClassification, model::Head::kTokenClassification, model::Head::kQuestionAnswering}) {
    SCOPED_TRACE(model::head_architecture(head));
    const bool qa = head == model::Head::kQuestionAnswering;
    // Fine-tuning from the pretraining checkpoint: the encoder comes from it, the classifier (qa_outputs)
    // is new (and, for token classification and question answering, there is no pooler).
    model::BertConfig c = read_config(kFixtures + "/tiny");
    c.head = head;
    c.labels = qa ? std::vector<std::string>{"start", "end"} : std::vector<std::string>{"neg", "neutral", "pos"};
    model::Bert m(c);
    const ImportReport r = import_model(kFixtures + "/tiny", m, 5);
    EXPECT_EQ(r.initialized, qa ? (std::vector<std::string>{"qa_outputs.weight", "qa_outputs.bias"})
                                : (std::vector<std::string>{"classifier.weight", "classifier.bias"}));
    const bool pooler = head == model::Head::kSequenceClassification;
    int unused_pooler = 0;
    for (const std::string& name : r.unexpected) unused_pooler += name.starts_with("bert.pooler.");
    EXPECT_EQ(unused_pooler, pooler ? 0 : 2);
    // Export: config.json names the architecture and labels as transformers writes them.
    export_model(dir.file("out"), m, Json());
    const Json config = Json::parse(read_text_file(dir.file("out/config.json"), "config"));
    EXPECT_EQ(config.find("architectures")->as_array().front().as_string(), model::head_architecture(head));
    EXPECT_EQ(config.find("id2label")->find(qa ? "1" : "2")->as_string(), qa ? "end" : "pos");
    EXPECT_EQ(config.find("label2id")->find(qa ? "start" : "neg")->as_int(), 0);
    model::Bert back(read_config(dir.file("out")));
    EXPECT_EQ(back.config().labels, c.labels);
    EXPECT_TRUE(import_model(dir.file("out"), back).initialized.empty());
    EXPECT_EQ(std::memcmp(back.parameters().values().data(), m.parameters().values().data(),
                          m.parameters().values().numel() * sizeof(float)),
              0);
  }
  // A regression (a cross-encoder reranker, STS-B): one output, id2label LABEL_0, problem_type "regression",
  // as transformers writes it; it comes back a regression with the same weights.
  {
    model::BertConfig c = read_config(kFixtures + "/tiny");
    c.head = model::Head::kSequenceClassification;
    c.labels = {"LABEL_0"};
    model::Bert m(c);
    import_model(kFixtures + "/tiny", m, 5);
    export_model(dir.file("reranker"), m, Json());
    const Json config = Json::parse(read_text_file(dir.file("reranker/config.json"), "config"));
    EXPECT_EQ(config.find("problem_type")->as_string(), "regression");
    EXPECT_EQ(config.find("id2label")->as_object().size(), 1u);
    model::Bert back(read_config(dir.file("reranker")));
    EXPECT_TRUE(back.config().regression());
    EXPECT_TRUE(import_model(dir.file("reranker"), back).initialized.empty());
    EXPECT_EQ(std::memcmp(back.parameters().values().data(), m.parameters().values().data(),
                          m.parameters().values().numel() * sizeof(float)),
              0);
  }
  // transformers' BertForQuestionAnswering config: id2label LABEL_0, LABEL_1 (or none: num_labels 2).
  std::ofstream(dir.file("qa.json"))
      << R"({"architectures": ["BertForQuestionAnswering"], "hidden_size": 32, "id2label": {"0": "LABEL_0", "1": )"
         R"("LABEL_1"}})";
  EXPECT_EQ(model::BertConfig::load(dir.file("qa.json")).head, model::Head::kQuestionAnswering);
  std::ofstream(dir.file("qa.json")) << R"({"architectures": ["BertForQuestionAnswering"], "hidden_size": 32})";
  EXPECT_EQ(model::BertConfig::load(dir.file("qa.json")).labels, (std::vector<std::string>{"start", "end"}));
  std::ofstream(dir.file("qa.json"))
      << R"({"architectures": ["BertForQuestionAnswering"], "hidden_size": 32, "id2label": {"0": "a", "1": "b", )"
         R"("2": "c"}})";
  expect_user_error([&] { model::BertConfig::load(dir.file("qa.json")); }, "has 2 outputs (start, end), not 3");
  // An architecture without a head here is refused by name.
  std::ofstream(dir.file("qa.json")) << R"({"architectures": ["BertForMultipleChoice"], "hidden_size": 32})";
  expect_user_error([&] { model::BertConfig::load(dir.file("qa.json")); }, "BertForMultipleChoice");
  std::ofstream(dir.file("nolabels.json")) << R"({"architectures": ["BertForSequenceClassification"]})";
  expect_user_error([&] { model::BertConfig::load(dir.file("nolabels.json")); }, "needs 'id2label'");
}

}  // namespace
}  // namespace bert::hf
