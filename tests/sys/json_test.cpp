// JSON: parsing (valid and invalid documents), access, and writing that round-trips.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "sys/error.h"
#include "sys/json.h"
#include "sys/utf8.h"

namespace bert {
namespace {

TEST(Json, ParsesEveryKindOfValue) {
  Json j = Json::parse(R"( {"a": 1, "b": [true, false, null], "c": {"d": -2.5e-3}, "e": "x\ny\u00e9\ud83d\ude00"} )");
  EXPECT_EQ(j.find("a")->as_int(), 1);
  ASSERT_EQ(j.find("b")->as_array().size(), 3u);
  EXPECT_TRUE(j.find("b")->as_array()[0].as_bool());
  EXPECT_TRUE(j.find("b")->as_array()[2].is_null());
  EXPECT_DOUBLE_EQ(j.find("c")->find("d")->as_number(), -2.5e-3);
  EXPECT_EQ(j.find("e")->as_string(), "x\ny\xc3\xa9\xf0\x9f\x98\x80");
  EXPECT_EQ(j.find("missing"), nullptr);
  EXPECT_EQ(Json::parse("0").as_int(), 0);
  EXPECT_EQ(Json::parse("[]").as_array().size(), 0u);
}

TEST(Json, DumpRoundTripsAndKeepsKeyOrder) {
  Json j;
  j["zeta"] = 1;
  j["alpha"] = Json::Array{Json(0.1), Json("q\"uote"), Json(nullptr)};
  j["mid"]["inner"] = 1e-12;
  j["big"] = int64_t{1} << 40;
  const std::string compact = j.dump();
  EXPECT_EQ(
      compact,
      R"({"zeta":1,"alpha":[0.1,"q\"uote",null],"mid":{"inner":1e-12},"big":1099511627776})");
  Json back = Json::parse(j.dump(2));
  EXPECT_EQ(back.dump(), compact);
  EXPECT_DOUBLE_EQ(back.find("alpha")->as_array()[0].as_number(), 0.1);
}

TEST(Json, RejectsMalformedDocumentsWithLineAndColumn) {
  auto error_of = [](const std::string& text) {
    try {
      Json::parse(text);
    } catch (const UserError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(error_of("{\"a\": 1,\n \"b\" 2}"),
            "invalid JSON at line 2, column 6: syntax error while parsing object separator - unexpected number "
            "literal; expected ':'");
  EXPECT_NE(error_of("[1, 2"), "no error");
  EXPECT_NE(error_of("{\"a\": 01}"), "no error");
  EXPECT_NE(error_of("\"unterminated"), "no error");
  EXPECT_NE(error_of("[1] trailing"), "no error");
  EXPECT_NE(error_of("{'single': 1}"), "no error");
  EXPECT_NE(error_of("nul"), "no error");
  EXPECT_NE(error_of("\"\\ud800\""), "no error");  // lone surrogate
  EXPECT_NE(error_of("1e999"), "no error");        // not finite
  EXPECT_NE(error_of(""), "no error");
  EXPECT_EQ(error_of(std::string(300, '[') + std::string(300, ']')).find("256 levels") != std::string::npos, true);
}

TEST(Json, TypedAccessNamesTheExpectedType) {
  Json j = Json::parse(R"({"n": 1.5, "s": "x"})");
  EXPECT_THROW(j.find("n")->as_int(), UserError);
  EXPECT_THROW(j.find("s")->as_number(), UserError);
  EXPECT_THROW(Json::parse("[1]").find("a"), UserError);
}

}  // namespace
}  // namespace bert

namespace bert {
namespace {

TEST(Utf8, RoundTripsEveryLengthAndReplacesInvalidBytes) {
  const std::u32string points = {U'a', 0x7F, 0x80, 0x7FF, 0x800, 0xFFFD, 0xFFFF, 0x10000, 0x10FFFF};
  const std::string bytes = utf8::encode(points);
  EXPECT_EQ(bytes.size(), 1u + 1 + 2 + 2 + 3 + 3 + 3 + 4 + 4);
  EXPECT_EQ(utf8::decode(bytes), points);
  // Lone continuation byte, truncated sequence, overlong '/', UTF-16 surrogate, past U+10FFFF.
  EXPECT_EQ(utf8::decode("a\x80z"), (std::u32string{U'a', 0xFFFD, U'z'}));
  EXPECT_EQ(utf8::decode("\xE2\x82"), (std::u32string{0xFFFD, 0xFFFD}));
  EXPECT_EQ(utf8::decode("\xC0\xAF"), (std::u32string{0xFFFD, 0xFFFD}));
  EXPECT_EQ(utf8::decode("\xED\xA0\x80"), (std::u32string{0xFFFD, 0xFFFD, 0xFFFD}));
  EXPECT_EQ(utf8::decode("\xF4\x90\x80\x80"), (std::u32string{0xFFFD, 0xFFFD, 0xFFFD, 0xFFFD}));
}

TEST(Json, IntegersKeepAll64Bits) {
  const uint64_t seed = (uint64_t{1} << 53) + 1;  // not a double
  for (uint64_t v : {seed, std::numeric_limits<uint64_t>::max(), uint64_t{0}}) {
    const Json back = Json::parse(Json(v).dump());
    EXPECT_EQ(back.as_uint(), v);
  }
  EXPECT_EQ(Json::parse("-9223372036854775808").as_int(), std::numeric_limits<int64_t>::min());
  EXPECT_EQ(Json::parse("9007199254740993").as_int(), 9007199254740993);
  EXPECT_EQ(Json::parse("{\"seed\": 18446744073709551615}").find("seed")->as_uint(),
            std::numeric_limits<uint64_t>::max());
  EXPECT_THROW(Json::parse("18446744073709551615").as_int(), UserError);  // beyond int64
  EXPECT_THROW(Json::parse("-1").as_uint(), UserError);
  EXPECT_THROW(Json::parse("1.5").as_int(), UserError);
  // Fractions, exponents and integers beyond 64 bits stay doubles.
  EXPECT_EQ(Json::parse("1e3").as_int(), 1000);
  EXPECT_DOUBLE_EQ(Json::parse("1.5").as_number(), 1.5);
  EXPECT_DOUBLE_EQ(Json::parse("36893488147419103232").as_number(), 36893488147419103232.0);
  EXPECT_EQ(Json(int64_t{-42}).dump(), "-42");
  EXPECT_EQ(Json(2.5).dump(), "2.5");
  EXPECT_EQ(Json(3.0).dump(), "3.0") << "a double stays one when read back";
  EXPECT_TRUE(Json::parse(Json(3.0).dump()).integer().is_integer == false);
}

// What the writer does with what JSON cannot hold: non-finite numbers become null, bytes that are not
// UTF-8 become U+FFFD (the text written is always valid JSON).
TEST(Json, WritesValidJsonFromAnyValue) {
  Json j;
  j["nan"] = std::nan("");
  j["inf"] = std::numeric_limits<double>::infinity();
  j["bytes"] = std::string("a\x80z");
  j["control"] = std::string("\x01\t");
  EXPECT_EQ(j.dump(), "{\"nan\":null,\"inf\":null,\"bytes\":\"a\xEF\xBF\xBDz\",\"control\":\"\\u0001\\t\"}");
  EXPECT_NO_THROW(Json::parse(j.dump()));
}

}  // namespace
}  // namespace bert
