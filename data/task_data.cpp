#include "data/task_data.h"

#include <algorithm>
#include <fstream>
#include <map>
#include <set>

#include "sys/error.h"
#include "sys/json.h"
#include "sys/text_file.h"

namespace bert::data {

namespace {

struct Line {
  std::string where;  // "file:line" for messages
  Json json;
};

const std::string& string_field(const Line& line, const char* key) {
  const Json* v = line.json.find(key);
  if (!v || !v->is_string()) throw UserError(line.where + ": expected a string field \"" + key + "\"");
  return v->as_string();
}

const Json::Array& array_field(const Line& line, const char* key) {
  const Json* v = line.json.find(key);
  if (!v || !v->is_array()) throw UserError(line.where + ": expected an array field \"" + key + "\"");
  for (const Json& item : v->as_array())
    if (!item.is_string()) throw UserError(line.where + ": \"" + key + "\" must hold strings");
  return v->as_array();
}

std::vector<Line> read_lines(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw UserError("task data '" + path + "' cannot be read (missing?)");
  std::vector<Line> lines;
  std::string text;
  for (int64_t number = 1; std::getline(in, text); ++number) {
    if (text.find_first_not_of(" \t\r") == std::string::npos) continue;
    Line line{path + ":" + std::to_string(number), {}};
    try {
      line.json = Json::parse(text);
    } catch (const UserError& e) {
      throw UserError(line.where + ": not a JSON object (" + e.what() + ")");
    }
    if (!line.json.is_object()) throw UserError(line.where + ": expected a JSON object");
    lines.push_back(std::move(line));
  }
  if (lines.empty()) throw UserError("task data '" + path + "' holds no examples");
  return lines;
}

}  // namespace

std::vector<std::string> read_label_names(const std::string& path) {
  if (path.ends_with(".hdf5") || path.ends_with(".h5")) {
    const Shard shard = read_shard(path);
    if (!shard.is_task()) throw UserError("'" + path + "' is a pretraining shard: it has no labels");
    return shard.label_names;
  }
  std::vector<std::string> names;
  std::string all = read_text_file(path, "labels file"), line;
  for (size_t start = 0; start < all.size();) {
    size_t end = all.find('\n', start);
    if (end == std::string::npos) end = all.size();
    line = all.substr(start, end - start);
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (!line.empty()) names.push_back(line);
    start = end + 1;
  }
  if (names.size() < 2) throw UserError("labels file '" + path + "': expected at least 2 labels, one per line");
  std::set<std::string> distinct(names.begin(), names.end());
  if (distinct.size() != names.size()) throw UserError("labels file '" + path + "' lists a label twice");
  return names;
}

Shard make_task_shard(const std::string& path, const tokenizer::Tokenizer& tokenizer, const TaskDataOptions& options,
                      TaskDataReport* report) {
  BERT_CHECK(options.kind != ShardKind::kPretraining, "make_task_shard needs a task kind");
  if (options.max_seq_len < 3) throw UserError("--max-seq-len: expected at least 3");
  const bool per_token = options.kind == ShardKind::kTokenLabels;
  const std::vector<Line> lines = read_lines(path);

  std::vector<std::string> labels = options.labels;
  if (labels.empty()) {
    std::set<std::string> seen;
    for (const Line& line : lines) {
      if (per_token)
        for (const Json& tag : array_field(line, "tags")) seen.insert(tag.as_string());
      else
        seen.insert(string_field(line, "label"));
    }
    labels.assign(seen.begin(), seen.end());
    if (labels.size() < 2)
      throw UserError("task data '" + path + "' has fewer than 2 distinct labels: nothing to classify");
  }
  std::map<std::string, int32_t> label_ids;
  for (size_t i = 0; i < labels.size(); ++i) label_ids[labels[i]] = static_cast<int32_t>(i);
  auto label_id = [&](const Line& line, const std::string& name) {
    auto it = label_ids.find(name);
    if (it == label_ids.end())
      throw UserError(line.where + ": label '" + name + "' is not one of the " + std::to_string(labels.size()) +
                      " labels (--labels)");
    return it->second;
  };

  const tokenizer::SpecialTokens& special = tokenizer.specials();
  Shard shard(options.max_seq_len, 0);
  shard.kind = options.kind;
  shard.label_names = labels;
  shard.metadata = ShardMetadata{tokenizer.vocab_size(), tokenizer.file_sha256(), options.max_seq_len, 0, 0};
  TaskDataReport r;
  const auto limit = static_cast<size_t>(options.max_seq_len);
  std::vector<int32_t> tokens, token_labels;
  std::vector<int8_t> segments;
  for (const Line& line : lines) {
    tokens.assign(1, special.cls);
    token_labels.assign(1, kIgnoredLabel);
    bool truncated = false;
    if (per_token) {
      const Json::Array& words = array_field(line, "tokens");
      const Json::Array& tags = array_field(line, "tags");
      if (words.size() != tags.size())
        throw UserError(line.where + ": " + std::to_string(words.size()) + " tokens but " +
                        std::to_string(tags.size()) + " tags");
      for (size_t w = 0; w < words.size(); ++w) {
        const int32_t tag = label_id(line, tags[w].as_string());
        std::vector<int32_t> pieces = tokenizer.encode(words[w].as_string());
        if (pieces.empty()) pieces.push_back(special.unk);  // a word the tokenizer drops still carries its tag
        if (tokens.size() + pieces.size() + 1 > limit) {
          truncated = true;
          r.labels_dropped += static_cast<int64_t>(words.size() - w);
          break;
        }
        for (size_t p = 0; p < pieces.size(); ++p) {
          tokens.push_back(pieces[p]);
          token_labels.push_back(p == 0 ? tag : kIgnoredLabel);
        }
      }
      tokens.push_back(special.sep);
      token_labels.push_back(kIgnoredLabel);
      segments.assign(tokens.size(), 0);
    } else {
      std::vector<int32_t> a = tokenizer.encode(string_field(line, "text")), b;
      const bool pair = line.json.find("text_b") != nullptr;
      if (pair) b = tokenizer.encode(string_field(line, "text_b"));
      const size_t room = limit - (pair ? 3 : 2);
      while (a.size() + b.size() > room) {  // longest first, as BERT's and Hugging Face's truncation
        truncated = true;
        (a.size() >= b.size() ? a : b).pop_back();
      }
      tokens.insert(tokens.end(), a.begin(), a.end());
      tokens.push_back(special.sep);
      segments.assign(tokens.size(), 0);
      if (pair) {
        tokens.insert(tokens.end(), b.begin(), b.end());
        tokens.push_back(special.sep);
        segments.resize(tokens.size(), 1);
      }
      token_labels.assign(1, label_id(line, string_field(line, "label")));
    }
    r.truncated += truncated;
    shard.append_labeled(tokens, segments, token_labels);
    ++r.examples;
  }
  if (report) *report = r;
  return shard;
}

}  // namespace bert::data
