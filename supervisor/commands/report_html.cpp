// `megacpp report RUN... --out DIR`: one self-contained HTML page (inline CSS and SVG, no
// network, no script) of one or more runs: each run's state, stages and first failure, and plots
// of loss and tokens/s per step with one line per run and each later attempt's start marked.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"
#include "core/util.h"
#include "schemas/enums.h"
#include "schemas/json.h"
#include "schemas/manifest.capnp.h"
#include "schemas/run_layout.h"
#include "stages/collector/collector.h"
#include "supervisor/commands/commands.h"

namespace megacpp::supervisor {

namespace fs = std::filesystem;

namespace {

constexpr const char* kPalette[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd",
                                    "#ff7f0e", "#17becf", "#8c564b", "#e377c2"};
// A run's held-out (validation) loss line: a dark shade of its training line's colour, dashed,
// with a dot at each evaluation.
constexpr const char* kValidationPalette[] = {"#08306b", "#67000d", "#00441b", "#3f007d",
                                              "#7f2704", "#014636", "#3e2723", "#5c0a3c"};

std::string escape(std::string_view s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

struct Series {
  std::string name, color;
  std::vector<std::pair<double, double>> points;        // (step, value)
  std::vector<std::pair<uint32_t, uint32_t>> attempts;  // (attempt, first step)
  bool validation = false;  // dashed with dots (class "validation"), else a solid "series"
};

// Round tick spacing covering [lo, hi] in about `n` steps.
double tick_step(double lo, double hi, int n) {
  const double raw = (hi - lo) / n;
  if (!(raw > 0)) return 1;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (raw <= m * mag) return m * mag;
  return 10 * mag;
}

std::string plot(const std::string& title, const std::string& y_label,
                 const std::vector<Series>& series) {
  constexpr double W = 860, H = 320, L = 70, R = 20, T = 36, B = 44;
  double x0 = INFINITY, x1 = -INFINITY, y0 = INFINITY, y1 = -INFINITY;
  for (const auto& s : series)
    for (const auto& [x, y] : s.points) {
      if (!std::isfinite(y)) continue;
      x0 = std::min(x0, x);
      x1 = std::max(x1, x);
      y0 = std::min(y0, y);
      y1 = std::max(y1, y);
    }
  std::string svg = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" "
      "class=\"plot\" role=\"img\" aria-label=\"{}\">\n"
      "<rect x=\"0\" y=\"0\" width=\"{}\" height=\"{}\" fill=\"#ffffff\"/>\n"
      "<text x=\"{}\" y=\"22\" font-size=\"15\" font-weight=\"bold\">{}</text>\n",
      W, H, escape(title), W, H, L, escape(title));
  if (!std::isfinite(x0)) return svg + "<text x=\"70\" y=\"160\">no steps recorded</text></svg>\n";
  if (x1 == x0) x1 = x0 + 1;
  if (y1 == y0) y1 = y0 + 1;
  const double pad = (y1 - y0) * 0.05;
  y0 -= pad;
  y1 += pad;
  auto px = [&](double x) { return L + (x - x0) / (x1 - x0) * (W - L - R); };
  auto py = [&](double y) { return H - B - (y - y0) / (y1 - y0) * (H - T - B); };
  // Axes, grid and ticks.
  const double ys = tick_step(y0, y1, 5);
  for (double y = std::ceil(y0 / ys) * ys; y <= y1; y += ys)
    svg += fmt::format(
        "<line x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"#dddddd\"/>"
        "<text x=\"{:.1f}\" y=\"{:.1f}\" font-size=\"11\" text-anchor=\"end\">{:g}</text>\n",
        L, py(y), W - R, py(y), L - 6, py(y) + 4, y);
  const double xs = std::max(1.0, tick_step(x0, x1, 8));
  for (double x = std::ceil(x0 / xs) * xs; x <= x1; x += xs)
    svg += fmt::format(
        "<text x=\"{:.1f}\" y=\"{:.1f}\" font-size=\"11\" text-anchor=\"middle\">{:g}</text>\n",
        px(x), H - B + 16, x);
  svg += fmt::format(
      "<line x1=\"{0}\" y1=\"{1}\" x2=\"{0}\" y2=\"{2}\" stroke=\"#333333\"/>"
      "<line x1=\"{0}\" y1=\"{2}\" x2=\"{3}\" y2=\"{2}\" stroke=\"#333333\"/>\n"
      "<text x=\"{4}\" y=\"{5}\" font-size=\"12\" text-anchor=\"middle\">step</text>\n"
      "<text x=\"14\" y=\"{6}\" font-size=\"12\" transform=\"rotate(-90 14 {6})\" "
      "text-anchor=\"middle\">{7}</text>\n",
      L, T, H - B, W - R, (L + W - R) / 2, H - 8, (T + H - B) / 2, escape(y_label));
  // Attempt starts, then the lines, then the legend.
  for (const auto& s : series)
    for (const auto& [attempt, step] : s.attempts)
      svg += fmt::format(
          "<line x1=\"{0:.1f}\" y1=\"{1}\" x2=\"{0:.1f}\" y2=\"{2}\" stroke=\"{3}\" "
          "stroke-dasharray=\"5,4\" class=\"attempt\"/><text x=\"{4:.1f}\" y=\"{5}\" "
          "font-size=\"11\" fill=\"{3}\">attempt {6}</text>\n",
          px(step), T, H - B, s.color, px(step) + 4, T + 12, attempt);
  for (const auto& s : series) {
    std::string pts, dots;
    for (const auto& [x, y] : s.points) {
      if (!std::isfinite(y)) continue;
      pts += fmt::format("{:.1f},{:.1f} ", px(x), py(y));
      if (s.validation)
        dots += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"4\" fill=\"{}\"/>", px(x),
                            py(y), s.color);
    }
    svg += fmt::format(
        "<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"2.5\"{} points=\"{}\" "
        "class=\"{}\"/>{}\n",
        s.color, s.validation ? " stroke-dasharray=\"7,4\"" : "", pts,
        s.validation ? "validation" : "series", dots);
  }
  for (size_t i = 0; i < series.size(); ++i)
    svg += fmt::format(
        "<rect x=\"{0}\" y=\"{1}\" width=\"14\" height=\"4\" fill=\"{2}\"/>"
        "<text x=\"{3}\" y=\"{4}\" font-size=\"12\">{5}</text>\n",
        W - R - 230, T + 6 + 18 * i, series[i].color, W - R - 210, T + 11 + 18 * i,
        escape(series[i].name));
  return svg + "</svg>\n";
}

// The manifest's held-out evaluation as a table row (empty without one).
std::string validation_row(schema::Manifest::Reader m) {
  if (!m.hasValidation()) return {};
  const auto v = m.getValidation();
  if (v.getOff().size() > 0)
    return fmt::format("<tr><th>validation</th><td>{}</td></tr>", escape(v.getOff().cStr()));
  if (v.getEvaluations() == 0) return "<tr><th>validation</th><td>no evaluation yet</td></tr>";
  return fmt::format(
      "<tr><th>validation</th><td>loss {:.4f} after step {}, best {:.4f} after step {} ({} "
      "evaluations of {:.0f} tokens, {:.2f} s)</td></tr>",
      v.getLastLoss(), v.getLastStep(), v.getBestLoss(), v.getBestStep(), v.getEvaluations(),
      v.getTokens(), v.getSeconds());
}

}  // namespace

int write_report(const std::vector<fs::path>& runs, const fs::path& out) {
  if (runs.empty()) MEGACPP_FAIL(ErrorKind::kInvalidArgument, "report needs a run directory");
  std::vector<Series> loss, speed, validation;
  std::string body;
  for (size_t i = 0; i < runs.size(); ++i) {
    const fs::path& run = runs[i];
    if (!fs::exists(layout::launch_path(run)))
      MEGACPP_FAIL(ErrorKind::kInvalidArgument, "{} holds no run (no launch.json)", run.string());
    reconcile(run);
    if (!fs::exists(layout::manifest_path(run))) collector::collect_run(run);
    schemas::JsonFile<schema::Manifest> manifest(layout::manifest_path(run));
    auto m = manifest.get();
    const std::string color = kPalette[i % std::size(kPalette)];
    const std::string name = run.filename().string();
    Series l{name, color, {}, {}}, t{name, color, {}, {}};
    for (auto a : m.getAttempts())
      if (a.getAttempt() > 0) l.attempts.emplace_back(a.getAttempt(), a.getFromStep() + 1);
    t.attempts = l.attempts;
    const fs::path telemetry = layout::receipt_path(run, layout::kBenchTelemetry);
    const fs::path result = layout::receipt_path(run, layout::kBenchResult);
    if (fs::exists(telemetry) && fs::exists(result)) {
      schemas::JsonFile<schema::BenchResult> r(result);
      const double per_step =
          r.get().getSteps() > 0 ? r.get().getTokens() / r.get().getSteps() : 0.0;
      schemas::JsonFile<schema::BenchTelemetry> tel(telemetry);
      for (auto s : tel.get().getSteps()) {
        l.points.emplace_back(s.getStep(), s.getLoss());
        t.points.emplace_back(s.getStep(),
                              s.getStepSeconds() > 0 ? per_step / s.getStepSeconds() : NAN);
      }
      // The held-out loss: a second line of the run's on the loss plot.
      if (tel.get().getEvaluations().size() > 0) {
        Series v{name + " val",
                 kValidationPalette[i % std::size(kValidationPalette)],
                 {},
                 l.attempts,
                 true};
        for (auto e : tel.get().getEvaluations()) v.points.emplace_back(e.getStep(), e.getLoss());
        validation.push_back(std::move(v));
      }
    }
    loss.push_back(std::move(l));
    speed.push_back(std::move(t));

    body += fmt::format(
        "<section><h2><span class=\"swatch\" style=\"background:{}\"></span>{}</h2>\n"
        "<table class=\"facts\"><tr><th>run</th><td>{}</td></tr>"
        "<tr><th>state</th><td class=\"state-{}\">{}</td></tr>"
        "<tr><th>recipe</th><td>{} ({})</td></tr><tr><th>mode, blocks</th><td>{} {}</td></tr>"
        "<tr><th>steps</th><td>{} of {} on {} ranks</td></tr>"
        "<tr><th>launched</th><td>{}</td></tr><tr><th>completed</th><td>{}</td></tr>{}</table>\n",
        color, escape(name), escape(m.getRunId().cStr()), schemas::name(m.getState()),
        schemas::name(m.getState()), escape(m.getRecipe().cStr()), escape(m.getRecipeHash().cStr()),
        escape(m.getMode().cStr()), escape(m.getBlocks().cStr()), m.getStepsCompleted(),
        m.getStepsPlanned(), m.getWorld(), escape(m.getLaunchedAt().cStr()),
        escape(m.getCompletedAt().cStr()), validation_row(m));
    if (m.hasError() && m.getError().getKind() != schema::FailureKind::NONE) {
      auto e = m.getError();
      body += fmt::format(
          "<p class=\"failure\">first failure: <b>{}</b> in {}-{} at step {} ({}): {}</p>\n",
          escape(schemas::name(e.getKind())), escape(layout::stage_name(e.getStage())), e.getRank(),
          e.getStep(), escape(layout::phase_name(e.getPhase())), escape(e.getMessage().cStr()));
    }
    body +=
        "<table class=\"stages\"><tr><th>stage</th><th>pid</th><th>state</th><th>exit</th>"
        "<th>signal</th><th>last step</th><th>restarts</th></tr>\n";
    for (auto st : m.getStages())
      body += fmt::format(
          "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>"
          "</tr>\n",
          escape(layout::process_name(st.getStage(), st.getRank())), st.getPid(),
          escape(schemas::name(st.getState())), st.getExitCode(), st.getSignal(), st.getLastStep(),
          st.getRestarts());
    body += "</table>\n";
    if (m.getAttempts().size() > 1) {
      body += "<p>attempts:";
      for (auto a : m.getAttempts())
        body += fmt::format(" #{} {} from step {} to {} ({});", a.getAttempt(),
                            escape(a.getReason().cStr()), a.getFromStep(), a.getLastStep(),
                            a.getState() == schema::RunState::OK ? "ok" : "ended");
      body += "</p>\n";
    }
    body += "</section>\n";
  }
  std::string html = fmt::format(
      "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
      "<title>megacpp report: {}</title>\n<style>\n"
      "body{{font-family:sans-serif;margin:24px;color:#222}} h1{{font-size:20px}}"
      " h2{{font-size:16px;margin-bottom:6px}} table{{border-collapse:collapse;margin:6px 0}}"
      " td,th{{border:1px solid #ccc;padding:2px 8px;font-size:13px;text-align:left}}"
      " .swatch{{display:inline-block;width:14px;height:14px;margin-right:8px}}"
      " .failure{{color:#b00020}} .state-error,.state-orphaned{{color:#b00020;font-weight:bold}}"
      " .state-ok{{color:#1b7f1b;font-weight:bold}}\n</style></head><body>\n"
      "<h1>megacpp report: {} run(s)</h1>\n",
      escape(runs.size() == 1 ? runs[0].filename().string() : "comparison"), runs.size());
  for (auto& v : validation) loss.push_back(std::move(v));
  html += plot("loss per step (val: held-out)", "loss", loss);
  html += plot("tokens/s per step", "tokens/s", speed);
  html += body + "</body></html>\n";
  std::error_code ec;
  fs::create_directories(out, ec);
  if (ec)
    MEGACPP_FAIL_SYS(ec.value(), "cannot create --out {}: {}; pass a folder you can write",
                     out.string(), ec.message());
  write_file_atomic(out / "index.html", html);
  fmt::print("report of {} run(s): {}\n", runs.size(), (out / "index.html").string());
  return 0;
}

}  // namespace megacpp::supervisor
