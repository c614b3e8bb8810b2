//! Writing the Prometheus text exposition format the way vLLM's and SGLang's Python
//! `prometheus_client` writes it.
//!
//! Scrapers in the routing layer are tested against real scrapes, so the simulator's
//! output must not be "equivalent" but the same shape: `# HELP`/`# TYPE` lines, labels in
//! sorted order, and numbers formatted like Python's `floatToGoString` (`0.0`, `530.0`,
//! `1.789901963352685e+09`, `+Inf`). The `prometheus` crates format numbers differently
//! (`0`, `530`), which is why this small writer exists instead.

use std::fmt::Write as _;

/// Formats a sample value as the Python client does (`repr()`, with Go-style exponents
/// once there are more than 6 integer digits).
pub fn format_value(v: f64) -> String {
    if v.is_nan() {
        return "NaN".to_owned();
    }
    if v == f64::INFINITY {
        return "+Inf".to_owned();
    }
    if v == f64::NEG_INFINITY {
        return "-Inf".to_owned();
    }
    let s = python_repr(v);
    if v > 0.0 {
        if let Some(dot) = s.find('.') {
            if dot > 6 && !s.contains('e') {
                let mut mantissa = String::with_capacity(s.len() + 1);
                mantissa.push_str(&s[..1]);
                mantissa.push('.');
                mantissa.push_str(&s[1..dot]);
                mantissa.push_str(&s[dot + 1..]);
                let trimmed = mantissa.trim_end_matches(['0', '.']);
                return format!("{trimmed}e+0{}", dot - 1);
            }
        }
    }
    s
}

/// Python's `repr(float)`: shortest round-trip digits, `.0` on integral values,
/// exponent form (`1e-05`, `1e+16`) outside `[1e-4, 1e16)`.
fn python_repr(v: f64) -> String {
    let s = format!("{v:?}");
    match s.find('e') {
        None => s,
        Some(pos) => {
            let (mantissa, exp) = s.split_at(pos);
            let exp = &exp[1..];
            let (sign, digits) = match exp.strip_prefix('-') {
                Some(d) => ('-', d),
                None => ('+', exp),
            };
            let mantissa = mantissa.strip_suffix(".0").unwrap_or(mantissa);
            if digits.len() < 2 {
                format!("{mantissa}e{sign}0{digits}")
            } else {
                format!("{mantissa}e{sign}{digits}")
            }
        }
    }
}

/// Escapes a label value (`\`, `"` and newlines).
fn escape_label(value: &str, out: &mut String) {
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}

/// The metric types used here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricType {
    /// A counter.
    Counter,
    /// A gauge.
    Gauge,
    /// A histogram.
    Histogram,
}

impl MetricType {
    fn as_str(self) -> &'static str {
        match self {
            MetricType::Counter => "counter",
            MetricType::Gauge => "gauge",
            MetricType::Histogram => "histogram",
        }
    }
}

/// An exposition being written. Labels are written sorted by name.
#[derive(Debug, Default)]
pub struct Exposition {
    out: String,
}

impl Exposition {
    /// An empty exposition with room for `capacity` bytes.
    pub fn with_capacity(capacity: usize) -> Self {
        Self {
            out: String::with_capacity(capacity),
        }
    }

    /// Writes the `# HELP` and `# TYPE` lines of a family.
    pub fn family(&mut self, name: &str, help: &str, kind: MetricType) {
        let _ = writeln!(self.out, "# HELP {name} {help}");
        let _ = writeln!(self.out, "# TYPE {name} {}", kind.as_str());
    }

    /// Writes one sample line; `labels` are sorted by name before writing.
    pub fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: f64) {
        self.out.push_str(name);
        if !labels.is_empty() {
            let mut sorted: Vec<&(&str, &str)> = labels.iter().collect();
            sorted.sort_by(|a, b| a.0.cmp(b.0));
            self.out.push('{');
            for (i, (k, v)) in sorted.iter().enumerate() {
                if i > 0 {
                    self.out.push(',');
                }
                self.out.push_str(k);
                self.out.push_str("=\"");
                escape_label(v, &mut self.out);
                self.out.push('"');
            }
            self.out.push('}');
        }
        self.out.push(' ');
        self.out.push_str(&format_value(value));
        self.out.push('\n');
    }

    /// A family with a single sample.
    pub fn single(
        &mut self,
        name: &str,
        help: &str,
        kind: MetricType,
        labels: &[(&str, &str)],
        value: f64,
    ) {
        self.family(name, help, kind);
        self.sample(name, labels, value);
    }

    /// The text written so far.
    pub fn finish(self) -> String {
        self.out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_like_python_prometheus_client() {
        assert_eq!(format_value(0.0), "0.0");
        assert_eq!(format_value(530.0), "530.0");
        assert_eq!(format_value(0.28), "0.28");
        assert_eq!(format_value(1.4721317291259766), "1.4721317291259766");
        assert_eq!(format_value(8128902.0), "8.128902e+06");
        assert_eq!(format_value(1048576.0), "1.048576e+06");
        assert_eq!(format_value(1789901963.352685), "1.789901963352685e+09");
        assert_eq!(format_value(9.75010481363281e-06), "9.75010481363281e-06");
        assert_eq!(format_value(1e-5), "1e-05");
        assert_eq!(format_value(123456.0), "123456.0");
        assert_eq!(format_value(f64::INFINITY), "+Inf");
    }

    #[test]
    fn sorted_escaped_labels() {
        let mut e = Exposition::default();
        e.single(
            "vllm:x",
            "Help.",
            MetricType::Gauge,
            &[("model_name", "a\"b"), ("engine", "0")],
            1.0,
        );
        assert_eq!(
            e.finish(),
            "# HELP vllm:x Help.\n# TYPE vllm:x gauge\nvllm:x{engine=\"0\",model_name=\"a\\\"b\"} 1.0\n"
        );
    }
}
