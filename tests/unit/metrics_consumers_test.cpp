// What reads the broker's metrics names them right: docs/operations.md's metrics table lists every
// family the broker exports with exactly its labels, and every metric and label the Prometheus
// alerting rules (deploy/prometheus/cushare-alerts.yaml) and the Grafana dashboard
// (deploy/grafana/cushare-dashboard.json) use is one the broker exports on that metric (or one
// Prometheus adds itself: instance, job). The families and labels come from rendering a snapshot
// in which every family has samples, not from a list kept by hand.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>

#include "core/snapshot.h"
#include "metrics/prometheus.h"

namespace cushare::broker {
namespace {

std::filesystem::path root() { return std::filesystem::path(__FILE__).parent_path().parent_path().parent_path(); }

std::string slurp(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// A broker with every family sampled: two devices' worth of state on one device, a contending
// tenant with probe results, MPS running with a faulted server, tamper counts, a ledger error.
BrokerSnapshot everything() {
  BrokerSnapshot s;
  s.version = "test";
  s.migLayout.checked = true;
  DeviceSnapshot d;
  d.index = 0;
  d.uuid = "GPU-1";
  d.capacity = 1 << 30;
  d.read = true;
  s.devices.push_back(d);
  TenantSnapshot a;
  a.name = "alpha";
  TenantDeviceSnapshot td;
  td.device = 0;
  td.uuid = "GPU-1";
  td.limit = 1 << 30;
  td.guarantee = 1 << 28;  // bursting: 256 MiB guaranteed, 64 MiB above it
  td.used = (1 << 28) + (1 << 26);
  td.burst = 1 << 26;
  td.plain = true;  // bursting into plain memory: the reclaim time is sampled too
  td.reclaimSeconds = 0.05;
  td.contending = true;
  td.probe.known = td.probe.complete = td.probe.enough = true;
  td.probe.rounds = td.probe.roundsWithWork = 4;
  td.probe.share = 0.5;
  td.probe.bandwidthShare = 0.5;
  td.probe.computeIndex = 0.1;
  td.probe.bandwidthIndex = 0.1;
  td.probe.latencyIndexNs = 1000;
  a.devices.push_back(td);
  a.tamper["hidden"] = 1;
  ProcessSnapshot p;
  p.pid = p.hostPid = 10;
  p.used = {1 << 20};
  p.pod = PodRef{"team-a", "infer-0", "server"};
  a.processes.push_back(p);
  s.tenants.push_back(a);
  s.podLabels.on = s.podLabels.up = true;
  TenantSnapshot g;
  g.name = "gamma";
  g.error = "broken";
  s.tenants.push_back(g);
  s.mps.active = true;
  s.mps.up = true;
  s.mps.servers = {{4242, "FAULT", {10}, ""}};
  s.mps.published = {{"alpha", 30}};
  return s;
}

// family -> the label names its samples carry (HELP lines give families without samples).
std::map<std::string, std::set<std::string>> exported() {
  std::map<std::string, std::set<std::string>> out;
  std::istringstream in(renderMetrics(everything()));
  std::string line;
  const std::regex sample(R"(^(cushare_\w+)(\{(.*)\})? )");
  const std::regex label(R"((\w+)=")");
  while (std::getline(in, line)) {
    std::smatch m;
    if (line.rfind("# HELP ", 0) == 0) {
      out[line.substr(7, line.find(' ', 7) - 7)];
      continue;
    }
    if (!std::regex_search(line, m, sample)) continue;
    auto& labels = out[m[1]];
    const std::string body = m[3];
    for (std::sregex_iterator it(body.begin(), body.end(), label), end; it != end; ++it) labels.insert((*it)[1]);
  }
  return out;
}

const std::set<std::string> kPrometheusLabels = {"instance", "job"};

TEST(MetricsConsumers, EveryFamilyIsSampledHere) {
  // The check below is only as good as the snapshot: every family must have a sample in it.
  const std::string text = renderMetrics(everything());
  for (const auto& [family, labels] : exported())
    EXPECT_NE(text.find("\n" + family + (labels.empty() ? " " : "{")), std::string::npos)
        << family << " has no sample in the snapshot; extend everything()";
}

TEST(MetricsConsumers, TheOperationsTableListsEveryFamilyWithItsLabels) {
  const std::string doc = slurp(root() / "docs" / "operations.md");
  ASSERT_FALSE(doc.empty());
  std::map<std::string, std::set<std::string>> documented;
  const std::regex row(R"(\n\| `(cushare_\w+)` \| (gauge|counter) \|([^|]*)\|)");
  const std::regex label("`(\\w+)`");
  for (std::sregex_iterator it(doc.begin(), doc.end(), row), end; it != end; ++it) {
    auto& labels = documented[(*it)[1]];
    const std::string cell = (*it)[3];
    for (std::sregex_iterator l(cell.begin(), cell.end(), label), e; l != e; ++l) labels.insert((*l)[1]);
  }
  const auto families = exported();
  ASSERT_GT(families.size(), 40u);
  for (const auto& [family, labels] : families) {
    if (!documented.count(family)) {
      ADD_FAILURE() << family << " is exported but not in docs/operations.md's metrics table";
      continue;
    }
    EXPECT_EQ(documented.at(family), labels) << family << ": the table's labels are not the exported ones";
  }
  for (const auto& [family, labels] : documented)
    EXPECT_TRUE(families.count(family)) << family << " is in docs/operations.md's table but not exported";
}

// Checks one PromQL expression: its metrics exist, and each label it names (in a selector, in
// by/on/without/ignoring, in a legend or annotation) exists on one of its metrics.
void checkExpression(const std::string& where, const std::string& expr, const std::string& labelText,
                     const std::map<std::string, std::set<std::string>>& families, int* metricsSeen) {
  std::set<std::string> available = kPrometheusLabels;
  std::vector<std::set<std::string>> each;  // every metric's own labels, for joins
  const std::regex metric(R"((cushare_\w+|\bup\b)(\{([^}]*)\})?)");
  const std::regex matcher(R"((\w+)\s*(=~|!~|!=|=))");
  for (std::sregex_iterator it(expr.begin(), expr.end(), metric), end; it != end; ++it) {
    const std::string name = (*it)[1];
    if (name == "up") continue;  // Prometheus's own, with instance and job
    ++*metricsSeen;
    const auto f = families.find(name);
    if (f == families.end()) {
      ADD_FAILURE() << where << ": " << name << " is not a metric the broker exports";
      continue;
    }
    available.insert(f->second.begin(), f->second.end());
    each.push_back(f->second);
    const std::string sel = (*it)[3];
    for (std::sregex_iterator m(sel.begin(), sel.end(), matcher), e; m != e; ++m)
      EXPECT_TRUE(f->second.count((*m)[1]) || kPrometheusLabels.count((*m)[1]))
          << where << ": " << name << " has no label " << (*m)[1];
  }
  const std::regex grouping(R"(\b(by|on|without|ignoring|group_left|group_right)\s*\(([^)]*)\))");
  const std::regex word(R"(\w+)");
  for (std::sregex_iterator it(expr.begin(), expr.end(), grouping), end; it != end; ++it) {
    const std::string list = (*it)[2];
    // A join (on) matches only on labels both sides carry: every metric of the expression must
    // have each one; by/without group within one side: some metric must have it.
    const bool join = (*it)[1] == "on" || (*it)[1] == "ignoring";
    for (std::sregex_iterator w(list.begin(), list.end(), word), e; w != e; ++w) {
      const std::string label = (*w)[0];
      EXPECT_TRUE(available.count(label)) << where << ": no metric of `" << expr << "` has label " << label;
      if (join && !kPrometheusLabels.count(label)) {
        for (const std::set<std::string>& labels : each) {
          EXPECT_TRUE(labels.count(label)) << where << ": `" << expr << "` joins on " << label
                                           << ", which one of its metrics lacks: the join never matches";
        }
      }
    }
  }
  const std::regex templ(R"(\{\{\s*(?:\$labels\.)?(\w+)\s*\}\})");
  for (std::sregex_iterator it(labelText.begin(), labelText.end(), templ), end; it != end; ++it)
    EXPECT_TRUE(available.count((*it)[1])) << where << ": no metric of `" << expr << "` has label " << (*it)[1];
}

TEST(MetricsConsumers, AlertingRulesUseExportedMetricsAndLabels) {
  const std::string rules = slurp(root() / "deploy" / "prometheus" / "cushare-alerts.yaml");
  ASSERT_FALSE(rules.empty());
  const auto families = exported();
  // Each rule: its expr (one line, or a folded block) and the text up to the next rule.
  const std::regex rule(R"(- alert: (\w+)\n([\s\S]*?)(?=\n      - alert: |$))");
  const std::regex exprLine(R"(expr: (?:>-\n((?:          .*\n)+)|(.*)\n))");
  int rulesSeen = 0, metricsSeen = 0;
  for (std::sregex_iterator it(rules.begin(), rules.end(), rule), end; it != end; ++it) {
    ++rulesSeen;
    const std::string body = (*it)[2];
    std::smatch e;
    ASSERT_TRUE(std::regex_search(body, e, exprLine)) << (*it)[1] << " has no expr";
    const std::string expr = e[1].matched ? e[1].str() : e[2].str();
    const std::string annotations = body.substr(body.find("annotations:") == std::string::npos ? body.size()
                                                                                           : body.find("annotations:"));
    checkExpression((*it)[1], expr, annotations, families, &metricsSeen);
  }
  EXPECT_EQ(rulesSeen, 12);
  EXPECT_GE(metricsSeen, 12);
}

TEST(MetricsConsumers, TheDashboardUsesExportedMetricsAndLabels) {
  const std::string dash = slurp(root() / "deploy" / "grafana" / "cushare-dashboard.json");
  ASSERT_FALSE(dash.empty());
  const auto families = exported();
  // Every query: "expr" (with its "legendFormat" after it) and the variables' "query" strings.
  const std::regex target(R"re("expr": "((?:[^"\\]|\\.)*)"(?:,\s*"legendFormat": "((?:[^"\\]|\\.)*)")?)re");
  const std::regex variable(R"re("query": "(label_values\((?:[^"\\]|\\.)*)")re");
  int targets = 0, metricsSeen = 0;
  auto unescape = [](std::string s) {
    for (size_t p; (p = s.find("\\\"")) != std::string::npos;) s.replace(p, 2, "\"");
    return s;
  };
  for (std::sregex_iterator it(dash.begin(), dash.end(), target), end; it != end; ++it, ++targets)
    checkExpression("dashboard", unescape((*it)[1]), unescape((*it)[2]), families, &metricsSeen);
  for (std::sregex_iterator it(dash.begin(), dash.end(), variable), end; it != end; ++it) {
    std::string q = unescape((*it)[1]);
    const std::string lastLabel = q.substr(q.rfind(',') + 1, q.rfind(')') - q.rfind(',') - 1);
    checkExpression("dashboard variable", q, "{{" + lastLabel + "}}", families, &metricsSeen);
  }
  EXPECT_GE(targets, 20);
  EXPECT_GE(metricsSeen, 20);
}

}  // namespace
}  // namespace cushare::broker
