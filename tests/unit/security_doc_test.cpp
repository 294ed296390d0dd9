// docs/security.md cites the tests that show each claim as `Suite.TestName`: every cited name must
// be a TEST, TEST_F or TEST_P somewhere under tests/ (found from this file's path, as
// ledger_test.cpp finds docs/ledger-abi.md).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <string>

namespace {

std::string slurp(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(SecurityDoc, EveryCitedTestExists) {
  const auto root = std::filesystem::path(__FILE__).parent_path().parent_path().parent_path();
  const std::string doc = slurp(root / "docs" / "security.md");
  ASSERT_FALSE(doc.empty()) << "docs/security.md not found from " << __FILE__;

  std::set<std::string> cited;
  const std::regex citation("`([A-Z][A-Za-z0-9_]*)\\.([A-Z][A-Za-z0-9_]*)`");
  for (std::sregex_iterator it(doc.begin(), doc.end(), citation), end; it != end; ++it)
    cited.insert((*it)[1].str() + "." + (*it)[2].str());

  std::set<std::string> defined;
  const std::regex test("\\bTEST(?:_F|_P)?\\s*\\(\\s*([A-Za-z_][A-Za-z0-9_]*)\\s*,\\s*([A-Za-z_][A-Za-z0-9_]*)\\s*\\)");
  for (const auto& e : std::filesystem::recursive_directory_iterator(root / "tests")) {
    if (!e.is_regular_file()) continue;
    const auto ext = e.path().extension().string();
    if (ext != ".cpp" && ext != ".cc" && ext != ".h" && ext != ".hpp") continue;
    const std::string src = slurp(e.path());
    for (std::sregex_iterator it(src.begin(), src.end(), test), end; it != end; ++it)
      defined.insert((*it)[1].str() + "." + (*it)[2].str());
  }

  std::string missing;
  for (const auto& name : cited)
    if (!defined.count(name)) missing += "\n  " + name;
  EXPECT_TRUE(missing.empty()) << "docs/security.md cites tests that do not exist under tests/:" << missing;
  EXPECT_GE(cited.size(), 20u) << "docs/security.md cites only " << cited.size() << " tests";
}

}  // namespace
