// EnumNames: one table per enum gives its names both ways, the choices of an error and the list for a
// command line; the project's enums round-trip through their tables.
#include "sys/enum_names.h"

#include <gtest/gtest.h>

#include "core/device.h"
#include "tests/common/expect_user_error.h"

namespace bert {
namespace {

enum class Shade { kLight, kDark, kNone };
constexpr EnumNames<Shade, 2> kShades{{{{Shade::kLight, "light", "pale"}, {Shade::kDark, "dark"}}}};

TEST(EnumNames, ParseNameChoicesAndNames) {
  EXPECT_EQ(kShades.parse("dark", "--shade"), Shade::kDark);
  EXPECT_EQ(kShades.name(Shade::kLight), "light");
  EXPECT_EQ(kShades.name(Shade::kNone), "?");
  EXPECT_EQ(kShades.choices(), "light (pale) or dark");
  EXPECT_EQ(kShades.names(), (std::vector<std::string>{"light", "dark"}));
  testing::expect_user_error([] { kShades.parse("grey", "--shade"); }, "--shade 'grey': expected light (pale) or dark");
}

TEST(EnumNames, PrecisionRoundTrips) {
  for (Precision p : {Precision::kFp32, Precision::kTf32, Precision::kBf16})
    EXPECT_EQ(parse_precision(precision_name(p)), p);
  testing::expect_user_error([] { parse_precision("fp64"); }, "--precision 'fp64': expected fp32, tf32 or bf16");
}

}  // namespace
}  // namespace bert
