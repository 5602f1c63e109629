// Training metrics: a JSONL log (one object per line, one line per step or eval), a progress
// display for the terminal, and a gnuplot loss curve.
//
// Numbers are formatted here, not by nlohmann-json, so every value reads back bit for bit:
// floats with "%.9g" (exact for float32), doubles with "%.9g" when that reads back exactly and
// "%.17g" otherwise. JSON has no NaN or infinity; they are written as the strings "NaN",
// "Infinity" and "-Infinity" so a diverged loss is still recorded.
#pragma once

#include <chrono>
#include <concepts>
#include <cstdint>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace octet::train {

/// One metric value: an integer (stored as int64), a float32, a double, a string, a bool, or a
/// nested JSON value (for per-layer FP8 statistics; its numbers are formatted like the others).
class MetricValue {
 public:
  template <std::integral T>
  requires(!std::same_as<T, bool>) MetricValue(T value) : value_(static_cast<int64_t>(value)) {}
  MetricValue(bool value) : value_(nlohmann::json(value)) {}
  MetricValue(float value) : value_(value) {}
  MetricValue(double value) : value_(value) {}
  MetricValue(const char* value) : value_(std::string(value)) {}
  MetricValue(std::string value) : value_(std::move(value)) {}
  MetricValue(nlohmann::json value) : value_(std::move(value)) {}

  /// The value as JSON text.
  std::string json() const;

 private:
  std::variant<int64_t, float, double, std::string, nlohmann::json> value_;
};

/// Fields of one metrics line, in the order they are written.
using MetricFields = std::vector<std::pair<std::string, MetricValue>>;

/// Shortest of "%.9g" and "%.17g" that reads back as exactly `value` (NaN/inf as strings).
std::string format_double(double value);
/// "%.9g": reads back (as float) as exactly `value` (NaN/inf as strings).
std::string format_float(float value);
/// One metrics line without the newline: {"step":S, fields...}.
std::string metrics_line(int64_t step, const MetricFields& fields);

/// Appends one JSON object per line to a metrics file, flushed after every line.
class MetricsWriter {
 public:
  /// A fresh run (resume_step empty) starts the file empty. A resumed run keeps the lines with
  /// step <= *resume_step and drops the rest (and a partial last line), so the finished file
  /// equals an uninterrupted run's. Throws on an unreadable file or a malformed complete line.
  explicit MetricsWriter(std::string path, std::optional<int64_t> resume_step = std::nullopt);
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;

  /// Writes {"step": step, fields...} and flushes.
  void write(int64_t step, const MetricFields& fields);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
};

/// The lines of a metrics file whose `key` is true (e.g. the skipped steps, which a resumed run
/// goes on counting); 0 when the file does not exist.
int64_t count_true(const std::string& metrics_path, const std::string& key);

/// Text of a duration for ETAs: "45s", "3m07s", "2h05m".
std::string format_duration(double seconds);
/// One progress report: "step 120/1000 | loss 2.3457 | 12.3k tok/s | ETA 1m23s". With
/// bar_width > 0 a bar "[#####.....] " of that width comes first.
std::string format_progress(int64_t step, int64_t total_steps, double loss, double tokens_per_s,
                            double eta_seconds, int bar_width = 0);

/// Training progress on a stream (stderr by default). On a terminal: one line redrawn with '\r'
/// at every update. Otherwise: a plain line every `plain_every` steps (and at the first and last).
class ProgressDisplay {
 public:
  enum class Mode { automatic, terminal, plain };
  /// automatic picks terminal when isatty(fileno(out)).
  explicit ProgressDisplay(int64_t total_steps, int64_t plain_every = 10, std::FILE* out = stderr,
                           Mode mode = Mode::automatic);
  ~ProgressDisplay();
  /// Reports that `step` (1-based, <= total_steps) finished; the ETA follows the rate since the
  /// first update.
  void update(int64_t step, double loss, double tokens_per_s);
  /// Prints a full line (e.g. a val loss) without garbling the bar.
  void message(const std::string& line);
  /// Ends the bar's line; called by the destructor if not before.
  void finish();
  bool terminal() const { return terminal_; }

 private:
  using Clock = std::chrono::steady_clock;
  int64_t total_steps_, plain_every_;
  std::FILE* out_;
  bool terminal_;
  bool bar_open_ = false;
  std::optional<std::pair<int64_t, Clock::time_point>> first_;  ///< step and time of first update
};

/// Draws loss (and val_loss, when present) against step from a metrics file into a PNG with
/// gnuplot. Returns false when gnuplot is not on PATH; throws when the file has no loss values
/// or gnuplot fails.
bool plot_loss(const std::string& metrics_path, const std::string& png_path);

}  // namespace octet::train
