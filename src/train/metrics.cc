#include "octet/train/metrics.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <sstream>

#include "octet/core/error.h"
#include "octet/train/safetensors.h"

extern char** environ;

namespace octet::train {
namespace {

// Significant digits that make a float32 read back exactly (FLT_DECIMAL_DIG), and a double
// (DBL_DECIMAL_DIG).
constexpr int kFloatDigits = 9;
constexpr int kDoubleDigits = 17;
// Width of the terminal progress bar, in characters.
constexpr int kBarWidth = 30;
// The PNG file signature (PNG spec, section 5.2).
constexpr std::array<unsigned char, 8> kPngSignature{0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
// Pixel size of the loss plot.
constexpr const char* kPlotSize = "1000,600";

/// JSON has no NaN or infinity: they become strings that JavaScript and Python recognise.
std::string non_finite(double value) {
  if (std::isnan(value)) return "\"NaN\"";
  return value > 0 ? "\"Infinity\"" : "\"-Infinity\"";
}

/// `value` in the "%.<digits>g" form, locale-independent.
template <typename T>
std::string general(T value, int digits) {
  std::array<char, 64> buffer;
  const auto result = std::to_chars(buffer.data(), buffer.data() + buffer.size(), value,
                                    std::chars_format::general, digits);
  return std::string(buffer.data(), result.ptr);
}

template <typename T>
bool reads_back(const std::string& text, T value) {
  T parsed{};
  const auto result = std::from_chars(text.data(), text.data() + text.size(), parsed);
  return result.ec == std::errc() && parsed == value;
}

std::string quoted(const std::string& text) {
  return nlohmann::json(text).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

/// Serializes JSON with octet's number formatting (nlohmann's own is not used for floats).
void append_json(const nlohmann::json& j, std::string& out) {
  switch (j.type()) {
    case nlohmann::json::value_t::number_float:
      out += format_double(j.get<double>());
      return;
    case nlohmann::json::value_t::array: {
      out += '[';
      bool first = true;
      for (const nlohmann::json& element : j) {
        if (!first) out += ',';
        first = false;
        append_json(element, out);
      }
      out += ']';
      return;
    }
    case nlohmann::json::value_t::object: {
      out += '{';
      bool first = true;
      for (const auto& [key, value] : j.items()) {
        if (!first) out += ',';
        first = false;
        out += quoted(key) + ':';
        append_json(value, out);
      }
      out += '}';
      return;
    }
    case nlohmann::json::value_t::binary:
    case nlohmann::json::value_t::discarded:
      OCTET_ERROR("metrics cannot hold a JSON value of type ", j.type_name());
    default:  // null, bool, integers, strings: no formatting choices
      out += j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  }
}

std::string read_text_file(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) OCTET_ERROR("cannot open ", what, " '", path, "': ", std::strerror(errno));
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) OCTET_ERROR("reading ", what, " '", path, "' failed");
  return text;
}

/// The complete lines of a metrics file, each parsed; a final line without '\n' is a partial
/// write (a crash mid-line) and is left out.
std::vector<std::pair<std::string, nlohmann::json>> metrics_lines(const std::string& path) {
  const std::string text = read_text_file(path, "metrics file");
  std::vector<std::pair<std::string, nlohmann::json>> lines;
  size_t begin = 0;
  for (size_t end; (end = text.find('\n', begin)) != std::string::npos; begin = end + 1) {
    std::string line = text.substr(begin, end - begin);
    nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded())
      OCTET_ERROR("metrics file '", path, "' line ", lines.size() + 1, " is not valid JSON: '",
                  line, "'");
    lines.emplace_back(std::move(line), std::move(j));
  }
  return lines;
}

/// Rewrites a metrics file without the lines after `resume_step`.
void truncate_after(const std::string& path, int64_t resume_step) {
  if (!std::filesystem::exists(path)) return;
  std::string kept;
  for (const auto& [line, j] : metrics_lines(path)) {
    const bool later = j.is_object() && j.contains("step") && j["step"].is_number_integer() &&
                       j["step"].get<int64_t>() > resume_step;
    if (!later) kept += line + '\n';
  }
  write_file_atomically(path, [&](std::FILE* file) {
    if (!kept.empty() && std::fwrite(kept.data(), 1, kept.size(), file) != kept.size())
      OCTET_ERROR("write failed: ", std::strerror(errno));
  });
}

/// The full path of `name` in $PATH, if it is there and executable.
std::optional<std::string> find_on_path(const std::string& name) {
  const char* path = std::getenv("PATH");
  std::istringstream dirs(path != nullptr ? path : "");
  for (std::string dir; std::getline(dirs, dir, ':');) {
    const std::string candidate = (dir.empty() ? "." : dir) + "/" + name;
    struct stat info {};
    if (::stat(candidate.c_str(), &info) == 0 && S_ISREG(info.st_mode) &&
        ::access(candidate.c_str(), X_OK) == 0)
      return candidate;
  }
  return std::nullopt;
}

/// A gnuplot single-quoted string ('' stands for a quote inside).
std::string gnuplot_string(const std::string& text) {
  OCTET_CHECK(text.find('\n') == std::string::npos, "plot path must not contain a newline: '", text,
              "'");
  std::string out = "'";
  for (char c : text) out += c == '\'' ? std::string("''") : std::string(1, c);
  return out + "'";
}

/// A gnuplot data block "$name << EOD" of (step, value) rows.
std::string data_block(const char* name, const std::vector<std::pair<int64_t, double>>& points) {
  std::string out = std::string(name) + " << EOD\n";
  for (const auto& [step, value] : points)
    out += std::to_string(step) + ' ' + format_double(value) + '\n';
  return out + "EOD\n";
}

std::string gnuplot_script(const std::string& png_path,
                           const std::vector<std::pair<int64_t, double>>& loss,
                           const std::vector<std::pair<int64_t, double>>& val_loss) {
  // pngcairo draws antialiased lines; plain png (libgd) is the fallback.
  std::string s = std::string("if (strstrt(GPVAL_TERMINALS, 'pngcairo') > 0) {\n") +
                  "  set terminal pngcairo noenhanced size " + kPlotSize + "\n" + "} else {\n" +
                  "  set terminal png noenhanced size " + kPlotSize + "\n" + "}\n" + "set output " +
                  gnuplot_string(png_path) + "\n" +
                  "set xlabel 'step'\nset ylabel 'loss'\nset grid\nset key top right\n";
  s += data_block("$loss", loss);
  if (!val_loss.empty()) s += data_block("$val", val_loss);
  s += "plot $loss using 1:2 with lines linewidth 2 title 'train loss'";
  if (!val_loss.empty()) s += ", $val using 1:2 with linespoints pointtype 7 title 'val loss'";
  return s + "\nunset output\n";
}

/// Runs `program script`, with its output in `log`; returns the exit status (or -1).
int run_program(const std::string& program, const std::string& script, const std::string& log) {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0600);
  posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  std::vector<char*> argv{const_cast<char*>(program.c_str()), const_cast<char*>(script.c_str()),
                          nullptr};
  pid_t pid = 0;
  const int rc = ::posix_spawn(&pid, program.c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) OCTET_ERROR("cannot run ", program, ": ", std::strerror(rc));
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) OCTET_ERROR("waiting for ", program, " failed: ", std::strerror(errno));
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

bool is_png(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::array<char, kPngSignature.size()> head{};
  if (!in.read(head.data(), head.size())) return false;
  return std::equal(head.begin(), head.end(), kPngSignature.begin(),
                    [](char a, unsigned char b) { return static_cast<unsigned char>(a) == b; });
}

}  // namespace

// ----------------------------------------------------------------------------
// Numbers and lines

std::string format_double(double value) {
  if (!std::isfinite(value)) return non_finite(value);
  // "-0" would read back as the integer 0 in most JSON readers; "-0.0" keeps the sign.
  if (value == 0 && std::signbit(value)) return "-0.0";
  std::string text = general(value, kFloatDigits);
  return reads_back(text, value) ? text : general(value, kDoubleDigits);
}

std::string format_float(float value) {
  if (!std::isfinite(value)) return non_finite(value);
  if (value == 0 && std::signbit(value)) return "-0.0";
  return general(value, kFloatDigits);
}

std::string MetricValue::json() const {
  struct Visitor {
    std::string operator()(int64_t v) const { return std::to_string(v); }
    std::string operator()(float v) const { return format_float(v); }
    std::string operator()(double v) const { return format_double(v); }
    std::string operator()(const std::string& v) const { return quoted(v); }
    std::string operator()(const nlohmann::json& v) const {
      std::string out;
      append_json(v, out);
      return out;
    }
  };
  return std::visit(Visitor{}, value_);
}

std::string metrics_line(int64_t step, const MetricFields& fields) {
  std::string line = "{\"step\":" + std::to_string(step);
  std::set<std::string> keys{"step"};
  for (const auto& [key, value] : fields) {
    OCTET_CHECK(keys.insert(key).second, "metric '", key,
                "' given twice (or named 'step', which the writer sets)");
    line += ',' + quoted(key) + ':' + value.json();
  }
  return line + '}';
}

// ----------------------------------------------------------------------------
// MetricsWriter

MetricsWriter::MetricsWriter(std::string path, std::optional<int64_t> resume_step)
    : path_(std::move(path)) {
  if (resume_step) truncate_after(path_, *resume_step);
  file_ = std::fopen(path_.c_str(), resume_step ? "ab" : "wb");
  if (file_ == nullptr)
    OCTET_ERROR("cannot open metrics file '", path_, "': ", std::strerror(errno));
}

MetricsWriter::~MetricsWriter() {
  if (file_ != nullptr) std::fclose(file_);
}

void MetricsWriter::write(int64_t step, const MetricFields& fields) {
  const std::string line = metrics_line(step, fields) + '\n';
  if (std::fwrite(line.data(), 1, line.size(), file_) != line.size() || std::fflush(file_) != 0)
    OCTET_ERROR("writing metrics file '", path_, "' failed: ", std::strerror(errno));
}

int64_t count_true(const std::string& metrics_path, const std::string& key) {
  if (!std::filesystem::exists(metrics_path)) return 0;
  int64_t count = 0;
  for (const auto& [line, j] : metrics_lines(metrics_path))
    count += j.is_object() && j.contains(key) && j[key].is_boolean() && j[key].get<bool>();
  return count;
}

// ----------------------------------------------------------------------------
// Progress

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const int64_t s = std::llround(seconds);
  char buffer[32];
  if (s < 60) {
    std::snprintf(buffer, sizeof(buffer), "%llds", static_cast<long long>(s));
  } else if (s < 3600) {
    std::snprintf(buffer, sizeof(buffer), "%lldm%02llds", static_cast<long long>(s / 60),
                  static_cast<long long>(s % 60));
  } else {
    std::snprintf(buffer, sizeof(buffer), "%lldh%02lldm", static_cast<long long>(s / 3600),
                  static_cast<long long>(s / 60 % 60));
  }
  return buffer;
}

std::string format_progress(int64_t step, int64_t total_steps, double loss, double tokens_per_s,
                            double eta_seconds, int bar_width) {
  std::string out;
  if (bar_width > 0) {
    const int64_t filled =
        total_steps > 0 ? std::clamp<int64_t>(step * bar_width / total_steps, 0, bar_width) : 0;
    out.append("[").append(filled, '#').append(bar_width - filled, '.').append("] ");
  }
  char numbers[96];
  if (tokens_per_s >= 1e6) {
    std::snprintf(numbers, sizeof(numbers), "%.4f | %.2fM", loss, tokens_per_s / 1e6);
  } else if (tokens_per_s >= 1e3) {
    std::snprintf(numbers, sizeof(numbers), "%.4f | %.1fk", loss, tokens_per_s / 1e3);
  } else {
    std::snprintf(numbers, sizeof(numbers), "%.4f | %.0f", loss, tokens_per_s);
  }
  out.append("step ").append(std::to_string(step)).append("/").append(std::to_string(total_steps));
  out.append(" | loss ")
      .append(numbers)
      .append(" tok/s | ETA ")
      .append(format_duration(eta_seconds));
  return out;
}

ProgressDisplay::ProgressDisplay(int64_t total_steps, int64_t plain_every, std::FILE* out,
                                 Mode mode)
    : total_steps_(total_steps),
      plain_every_(std::max<int64_t>(1, plain_every)),
      out_(out),
      terminal_(mode == Mode::terminal ||
                (mode == Mode::automatic && ::isatty(::fileno(out)) == 1)) {}

ProgressDisplay::~ProgressDisplay() { finish(); }

void ProgressDisplay::update(int64_t step, double loss, double tokens_per_s) {
  const Clock::time_point now = Clock::now();
  if (!first_) first_ = {step, now};
  const int64_t done = step - first_->first;
  const double elapsed = std::chrono::duration<double>(now - first_->second).count();
  const double eta = done > 0 ? elapsed / done * static_cast<double>(total_steps_ - step) : NAN;
  if (terminal_) {
    // "\x1b[K" erases the rest of the previous, possibly longer, line.
    std::fprintf(out_, "\r%s\x1b[K",
                 format_progress(step, total_steps_, loss, tokens_per_s, eta, kBarWidth).c_str());
    bar_open_ = true;
  } else if (done == 0 || step % plain_every_ == 0 || step == total_steps_) {
    std::fprintf(out_, "%s\n",
                 format_progress(step, total_steps_, loss, tokens_per_s, eta).c_str());
  }
  std::fflush(out_);
}

void ProgressDisplay::message(const std::string& line) {
  std::fprintf(out_, "%s%s\n", bar_open_ ? "\r\x1b[K" : "", line.c_str());
  bar_open_ = false;  // the next update draws the bar again below the message
  std::fflush(out_);
}

void ProgressDisplay::finish() {
  if (!bar_open_) return;
  std::fputc('\n', out_);
  std::fflush(out_);
  bar_open_ = false;
}

// ----------------------------------------------------------------------------
// Plot

bool plot_loss(const std::string& metrics_path, const std::string& png_path) {
  const std::optional<std::string> gnuplot = find_on_path("gnuplot");
  if (!gnuplot) return false;

  std::vector<std::pair<int64_t, double>> loss, val_loss;
  for (const auto& [line, j] : metrics_lines(metrics_path)) {
    if (!j.is_object() || !j.contains("step") || !j["step"].is_number_integer()) continue;
    const int64_t step = j["step"].get<int64_t>();
    // Only numbers are plotted: a NaN loss (written as a string) leaves a gap.
    if (j.contains("loss") && j["loss"].is_number())
      loss.emplace_back(step, j["loss"].get<double>());
    if (j.contains("val_loss") && j["val_loss"].is_number())
      val_loss.emplace_back(step, j["val_loss"].get<double>());
  }
  if (loss.empty()) OCTET_ERROR("metrics file '", metrics_path, "' has no numeric 'loss' values");

  std::string script_path = (std::filesystem::temp_directory_path() / "octet-plot-XXXXXX").string();
  const int fd = ::mkstemp(script_path.data());
  if (fd < 0) OCTET_ERROR("cannot create a gnuplot script file: ", std::strerror(errno));
  const std::string log_path = script_path + ".log";
  struct Cleanup {
    const std::string &script, &log;
    ~Cleanup() {
      std::remove(script.c_str());
      std::remove(log.c_str());
    }
  } cleanup{script_path, log_path};
  const std::string script = gnuplot_script(png_path, loss, val_loss);
  const bool written =
      ::write(fd, script.data(), script.size()) == static_cast<ssize_t>(script.size());
  ::close(fd);
  if (!written) OCTET_ERROR("writing gnuplot script '", script_path, "' failed");

  const int status = run_program(*gnuplot, script_path, log_path);
  if (status != 0 || !is_png(png_path)) {
    std::string output = read_text_file(log_path, "gnuplot log");
    OCTET_ERROR("gnuplot (", *gnuplot, ") exited with status ", status, " and ",
                is_png(png_path) ? "" : "no ", "PNG at '", png_path, "': ", output);
  }
  return true;
}

}  // namespace octet::train
