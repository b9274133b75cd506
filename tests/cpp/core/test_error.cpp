// The two kinds of failure: MC_CHECK reports the caller's mistake as a typed error that names the fix;
// MC_INTERNAL_ASSERT reports megacore's own broken invariant as InternalError with file:line, and is not
// caught by code that handles bad input (catch ValueError).
#include "test_helpers.hpp"

using namespace megacore;

namespace {
void checked(int n) { MC_CHECK(n >= 0, "n is {}; pass a count >= 0", n); }
void invariant(int n) { MC_INTERNAL_ASSERT(n % 2 == 0, "an odd count {} reached the pairing step", n); }
}  // namespace

TEST_CASE("MC_CHECK is a ValueError with the message; MC_INTERNAL_ASSERT an InternalError naming file:line", "[core]") {
  REQUIRE_THROWS_AS(checked(-1), ValueError);
  REQUIRE_THROWS_WITH(checked(-1), "n is -1; pass a count >= 0");
  REQUIRE_NOTHROW(checked(1));
  REQUIRE_NOTHROW(invariant(2));
  REQUIRE_THROWS_AS(invariant(3), InternalError);
  REQUIRE_THROWS_WITH(invariant(3), Catch::Contains("internal error at ") && Catch::Contains("test_error.cpp:") &&
                                        Catch::Contains("`n % 2 == 0` does not hold") &&
                                        Catch::Contains("an odd count 3 reached the pairing step") &&
                                        Catch::Contains("This is a bug in megacore"));
  // A bug is not bad input: handlers of ValueError do not see it.
  bool as_value_error = false;
  try {
    invariant(3);
  } catch (const ValueError&) {
    as_value_error = true;
  } catch (const InternalError&) {
  }
  CHECK_FALSE(as_value_error);
}
