//! Prometheus text exposition format (0.0.4, and the parts of OpenMetrics a
//! model server emits), parsed without allocating.
//!
//! Why: every endpoint's `/metrics` is scraped every 50 ms inside Envoy, and
//! a vLLM scrape is 30-60 KB of which kvroute needs four lines. The parser is
//! a line iterator over the borrowed text: for each line it first reads the
//! metric name (a few bytes), asks the caller's name filter, and skips the
//! rest of an unwanted line with one newline search. Only wanted lines have
//! their labels validated and their value parsed. Label values are returned
//! borrowed, and unescaped into an owned string only when they contain a
//! backslash.
//!
//! Grammar accepted (one sample per line):
//!
//! ```text
//! line     = blank | "#" comment | sample
//! sample   = name [ "{" [ label { "," label } [ "," ] ] "}" ] ws value [ ws timestamp ] [ ws ]
//! name     = [a-zA-Z_:][a-zA-Z0-9_:]*      (or a quoted name as first item in braces)
//! label    = lname ws? "=" ws? '"' escaped-value '"'   (escapes: \\ \" \n)
//! value    = float | "NaN" | "+Inf" | "-Inf" | "Inf" (Rust `f64` syntax, exponents allowed)
//! timestamp= integer milliseconds (kept, not used by routing)
//! ```
//!
//! `\r\n` line ends and blank lines are accepted. `# HELP`/`# TYPE` and all
//! other comments (`# EOF` included) are skipped. A line that does not fit
//! the grammar is skipped and counted in [`Parser::garbage`]; nothing here
//! panics on any input (fuzz-like tests below).

use std::borrow::Cow;

/// One parsed sample line, borrowing from the scrape text.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sample<'a> {
    /// Metric name (for a histogram this includes `_bucket`/`_sum`/`_count`).
    pub name: &'a str,
    /// Raw text between `{` and `}` (already validated), empty when none.
    raw_labels: &'a str,
    /// The value (`NaN` and infinities included).
    pub value: f64,
    /// Optional timestamp in milliseconds.
    pub timestamp_ms: Option<i64>,
}

impl<'a> Sample<'a> {
    /// The sample's labels in written order, values unescaped.
    pub fn labels(&self) -> Labels<'a> {
        Labels {
            rest: self.raw_labels,
        }
    }

    /// Value of one label, if present.
    pub fn label(&self, name: &str) -> Option<Cow<'a, str>> {
        self.labels().find(|(n, _)| *n == name).map(|(_, v)| v)
    }
}

/// Iterator over a sample's `(name, value)` label pairs.
#[derive(Clone, Debug)]
pub struct Labels<'a> {
    rest: &'a str,
}

impl<'a> Iterator for Labels<'a> {
    type Item = (&'a str, Cow<'a, str>);

    fn next(&mut self) -> Option<Self::Item> {
        // The text was validated by `scan_labels`, so parsing cannot fail;
        // stay defensive anyway and end the iteration on any surprise.
        let mut s = self.rest;
        loop {
            s = s.trim_start_matches([' ', '\t', ',']);
            if s.is_empty() {
                self.rest = s;
                return None;
            }
            let (item, after) = scan_label(s)?;
            self.rest = after;
            match item {
                LabelItem::Pair(n, raw) => return Some((n, unescape(raw))),
                LabelItem::QuotedName(_) => {
                    s = after;
                    continue;
                }
            }
        }
    }
}

/// A streaming parser over the lines of one scrape.
#[derive(Debug)]
pub struct Parser<'a, F> {
    rest: &'a str,
    wanted: F,
    garbage: usize,
    lines: usize,
}

/// Parses every sample of `text`.
pub fn parse(text: &str) -> Parser<'_, fn(&str) -> bool> {
    fn all(_: &str) -> bool {
        true
    }
    Parser::new(text, all as fn(&str) -> bool)
}

/// Parses only samples whose metric name `wanted` accepts; other lines are
/// skipped without looking past their name (and never counted as garbage).
pub fn parse_filtered<F: FnMut(&str) -> bool>(text: &str, wanted: F) -> Parser<'_, F> {
    Parser::new(text, wanted)
}

impl<'a, F: FnMut(&str) -> bool> Parser<'a, F> {
    fn new(text: &'a str, wanted: F) -> Self {
        Parser {
            rest: text.strip_prefix('\u{feff}').unwrap_or(text),
            wanted,
            garbage: 0,
            lines: 0,
        }
    }

    /// Lines so far that were neither blank, comment nor a valid sample.
    pub fn garbage(&self) -> usize {
        self.garbage
    }

    /// Lines read so far.
    pub fn lines(&self) -> usize {
        self.lines
    }

    fn next_line(&mut self) -> Option<&'a str> {
        if self.rest.is_empty() {
            return None;
        }
        let (line, rest) = match self.rest.find('\n') {
            Some(i) => (&self.rest[..i], &self.rest[i + 1..]),
            None => (self.rest, ""),
        };
        self.rest = rest;
        self.lines += 1;
        Some(line.strip_suffix('\r').unwrap_or(line))
    }
}

impl<'a, F: FnMut(&str) -> bool> Iterator for Parser<'a, F> {
    type Item = Sample<'a>;

    fn next(&mut self) -> Option<Sample<'a>> {
        while let Some(line) = self.next_line() {
            let line = line.trim_start_matches([' ', '\t']);
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            match parse_line(line, &mut self.wanted) {
                Line::Sample(s) => return Some(s),
                Line::Unwanted => {}
                Line::Garbage => self.garbage += 1,
            }
        }
        None
    }
}

enum Line<'a> {
    Sample(Sample<'a>),
    Unwanted,
    Garbage,
}

fn is_name_start(b: u8) -> bool {
    b.is_ascii_alphabetic() || b == b'_' || b == b':'
}

fn is_name_char(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b == b':'
}

/// Length of the leading metric name of `s` (0 when there is none).
fn name_len(s: &str) -> usize {
    let b = s.as_bytes();
    if b.is_empty() || !is_name_start(b[0]) {
        return 0;
    }
    1 + b[1..].iter().take_while(|&&c| is_name_char(c)).count()
}

fn parse_line<'a, F: FnMut(&str) -> bool>(line: &'a str, wanted: &mut F) -> Line<'a> {
    let n = name_len(line);
    let (name, after_name) = if n > 0 {
        let name = &line[..n];
        if !wanted(name) {
            return Line::Unwanted;
        }
        (name, &line[n..])
    } else if let Some(body) = line.strip_prefix('{') {
        // Prometheus 3 UTF-8 form: `{"metric.name", label="v"} 1`.
        match scan_label(body) {
            Some((LabelItem::QuotedName(q), _)) if !q.contains('\\') => {
                if !wanted(q) {
                    return Line::Unwanted;
                }
                (q, line)
            }
            _ => return Line::Garbage,
        }
    } else {
        return Line::Garbage;
    };
    let (raw_labels, after) = if let Some(body) = after_name.strip_prefix('{') {
        match scan_labels(body) {
            Some(x) => x,
            None => return Line::Garbage,
        }
    } else {
        ("", after_name)
    };
    // A separator is required between the name/labels and the value.
    if !after.starts_with([' ', '\t']) {
        return Line::Garbage;
    }
    let mut fields = after.split_ascii_whitespace();
    let value = match fields.next().and_then(parse_value) {
        Some(v) => v,
        None => return Line::Garbage,
    };
    let timestamp_ms = match fields.next() {
        None => None,
        Some(t) => match t.parse::<i64>() {
            Ok(t) => Some(t),
            // OpenMetrics allows fractional-second timestamps.
            Err(_) => match t.parse::<f64>() {
                Ok(f) if f.is_finite() => Some((f * 1000.0) as i64),
                _ => return Line::Garbage,
            },
        },
    };
    if fields.next().is_some() {
        return Line::Garbage;
    }
    Line::Sample(Sample {
        name,
        raw_labels,
        value,
        timestamp_ms,
    })
}

/// Parses a sample value: Rust float syntax plus the Prometheus spellings.
fn parse_value(s: &str) -> Option<f64> {
    match s {
        "NaN" | "nan" => return Some(f64::NAN),
        "+Inf" | "Inf" | "+inf" | "inf" => return Some(f64::INFINITY),
        "-Inf" | "-inf" => return Some(f64::NEG_INFINITY),
        _ => {}
    }
    // Reject words Rust would accept ("infinity") but Prometheus would not
    // write, and anything that is not plainly numeric.
    if !s
        .bytes()
        .all(|b| b.is_ascii_digit() || matches!(b, b'.' | b'e' | b'E' | b'+' | b'-' | b'_'))
        || s.contains('_')
    {
        return None;
    }
    s.parse().ok()
}

enum LabelItem<'a> {
    /// `name="raw value"` (value still escaped).
    Pair(&'a str, &'a str),
    /// A bare quoted string: the metric name in the UTF-8 form.
    QuotedName(&'a str),
}

/// Reads one label item at the start of `s` (no leading whitespace) and
/// returns it with the text after it (before any `,`).
fn scan_label(s: &str) -> Option<(LabelItem<'_>, &str)> {
    if let Some(q) = s.strip_prefix('"') {
        let end = quoted_end(q)?;
        return Some((LabelItem::QuotedName(&q[..end]), &q[end + 1..]));
    }
    let n = {
        let b = s.as_bytes();
        if b.is_empty() || !(b[0].is_ascii_alphabetic() || b[0] == b'_') {
            return None;
        }
        1 + b[1..]
            .iter()
            .take_while(|&&c| c.is_ascii_alphanumeric() || c == b'_')
            .count()
    };
    let name = &s[..n];
    let rest = s[n..].trim_start_matches([' ', '\t']);
    let rest = rest.strip_prefix('=')?.trim_start_matches([' ', '\t']);
    let q = rest.strip_prefix('"')?;
    let end = quoted_end(q)?;
    Some((LabelItem::Pair(name, &q[..end]), &q[end + 1..]))
}

/// Index of the closing quote in `q` (which starts after the opening one).
fn quoted_end(q: &str) -> Option<usize> {
    let b = q.as_bytes();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'\\' => i += 2,
            b'"' => return Some(i),
            b'\n' => return None,
            _ => i += 1,
        }
    }
    None
}

/// Validates `body` (the text after `{`) up to its `}`; returns the label
/// text and what follows the brace.
fn scan_labels(body: &str) -> Option<(&str, &str)> {
    let mut s = body;
    let mut first = true;
    loop {
        s = s.trim_start_matches([' ', '\t']);
        if let Some(after) = s.strip_prefix('}') {
            let len = body.len() - s.len();
            return Some((&body[..len], after));
        }
        if !first {
            s = s.strip_prefix(',')?.trim_start_matches([' ', '\t']);
            if let Some(after) = s.strip_prefix('}') {
                // Trailing comma.
                let len = body.len() - s.len();
                return Some((&body[..len], after));
            }
        }
        let (_, after) = scan_label(s)?;
        s = after;
        first = false;
    }
}

/// Undoes `\\`, `\"` and `\n`; borrows when there is nothing to undo.
/// Unknown escapes are kept as written.
fn unescape(raw: &str) -> Cow<'_, str> {
    if !raw.contains('\\') {
        return Cow::Borrowed(raw);
    }
    let mut out = String::with_capacity(raw.len());
    let mut chars = raw.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => out.push('\n'),
            Some('\\') => out.push('\\'),
            Some('"') => out.push('"'),
            Some(other) => {
                out.push('\\');
                out.push(other);
            }
            None => out.push('\\'),
        }
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    type Owned = (String, Vec<(String, String)>, f64, Option<i64>);
    type Case<'a> = (&'a str, &'a str, &'a [(&'a str, &'a str)], f64, Option<i64>);

    fn one(line: &str) -> Option<Owned> {
        let mut p = parse(line);
        let s = p.next()?;
        Some((
            s.name.to_string(),
            s.labels()
                .map(|(n, v)| (n.to_string(), v.into_owned()))
                .collect(),
            s.value,
            s.timestamp_ms,
        ))
    }

    fn l(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect()
    }

    #[test]
    fn sample_lines_table() {
        let cases: &[Case] = &[
            ("up 1", "up", &[], 1.0, None),
            ("up 1\r\n", "up", &[], 1.0, None),
            ("  up\t2.5  ", "up", &[], 2.5, None),
            ("a:b_c{} 3", "a:b_c", &[], 3.0, None),
            ("m{x=\"1\"} 1e3", "m", &[("x", "1")], 1000.0, None),
            ("m{x=\"1\",} -2.5E-2", "m", &[("x", "1")], -0.025, None),
            (
                "m{ x = \"a\" , y=\"b\" } +Inf",
                "m",
                &[("x", "a"), ("y", "b")],
                f64::INFINITY,
                None,
            ),
            ("m -Inf", "m", &[], f64::NEG_INFINITY, None),
            (
                "m 1.7537953269352946e+09",
                "m",
                &[],
                1.7537953269352946e9,
                None,
            ),
            ("m 5 1700000000000", "m", &[], 5.0, Some(1_700_000_000_000)),
            ("m 5 -3", "m", &[], 5.0, Some(-3)),
            (
                r#"m{p="a\"b",q="c\\d",r="e\nf"} 1"#,
                "m",
                &[("p", "a\"b"), ("q", "c\\d"), ("r", "e\nf")],
                1.0,
                None,
            ),
            (r#"m{p="}{,=\""} 7"#, "m", &[("p", "}{,=\"")], 7.0, None),
            (r#"m{p="ünï"} 7"#, "m", &[("p", "ünï")], 7.0, None),
            (
                r#"{"my.metric", le="1"} 4"#,
                "my.metric",
                &[("le", "1")],
                4.0,
                None,
            ),
            ("m .5", "m", &[], 0.5, None),
        ];
        for (line, name, labels, value, ts) in cases {
            let got = one(line).unwrap_or_else(|| panic!("{line:?} rejected"));
            assert_eq!(got.0, *name, "{line:?}");
            assert_eq!(got.1, l(labels), "{line:?}");
            assert_eq!(got.2, *value, "{line:?}");
            assert_eq!(got.3, *ts, "{line:?}");
        }
    }

    #[test]
    fn nan_parses() {
        assert!(one("m NaN").unwrap().2.is_nan());
    }

    #[test]
    fn garbage_lines_are_counted_and_skipped() {
        let bad = [
            "m",
            "m ",
            "m{} ",
            "m abc",
            "m 1 2 3",
            "m 1 x",
            "m infinity",
            "m 1_000",
            "m{x=1} 1",
            "m{x=\"1\" 1",
            "m{x=\"1\"}1",
            "m{x=\"1\" y=\"2\"} 1",
            "m{,} 1",
            "m{x=\"unterminated} 1",
            "9m 1",
            "-m 1",
            "{",
            "{\"a\\\"b\"} 1",
            "m{1x=\"1\"} 1",
        ];
        for b in bad {
            let mut p = parse(b);
            assert!(p.next().is_none(), "{b:?} accepted");
            assert_eq!(p.garbage(), 1, "{b:?}");
        }
        let text = "# HELP a x\n# TYPE a gauge\n\n\r\nbad line here\na 1\n# EOF\n";
        let mut p = parse(text);
        let v: Vec<_> = p.by_ref().map(|s| s.value).collect();
        assert_eq!(v, vec![1.0]);
        assert_eq!(p.garbage(), 1);
    }

    #[test]
    fn filter_skips_unwanted_lines_without_counting_them() {
        let text = "a{x=\"1\"} 1\nb{broken 2\nc 3\n";
        let mut p = parse_filtered(text, |n| n != "b");
        let names: Vec<_> = p.by_ref().map(|s| s.name).collect();
        assert_eq!(names, vec!["a", "c"]);
        assert_eq!(p.garbage(), 0);
        assert_eq!(p.lines(), 3);
    }

    #[test]
    fn labels_borrow_unless_escaped() {
        let mut p = parse("m{a=\"plain\",b=\"x\\\\y\"} 1");
        let s = p.next().unwrap();
        assert!(matches!(s.label("a"), Some(Cow::Borrowed("plain"))));
        assert!(matches!(s.label("b"), Some(Cow::Owned(ref v)) if v == "x\\y"));
        assert_eq!(s.label("zz"), None);
    }

    #[test]
    fn never_panics_on_cut_or_mangled_input() {
        let text = include_str!(
            "../../../tests/fixtures/metrics/vllm-0.29.0-v1-qwen2.5-1.5b-inferstack.txt"
        );
        let mut rng = fastrand::Rng::with_seed(7);
        // Every prefix cut at a char boundary, and random byte mangling.
        for cut in (0..text.len()).step_by(37) {
            if text.is_char_boundary(cut) {
                let _ = parse(&text[..cut]).count();
            }
        }
        let specials = b"{}\"\\=, \n\r#e+-.";
        for _ in 0..200 {
            let mut b = text.as_bytes()[..2000].to_vec();
            for _ in 0..20 {
                let i = rng.usize(..b.len());
                b[i] = specials[rng.usize(..specials.len())];
            }
            let s = String::from_utf8_lossy(&b);
            let mut p = parse(&s);
            let _ = p.by_ref().count();
            for s in parse(&s) {
                let _ = s.labels().count();
            }
        }
    }

    const FIXTURES: &[(&str, &str, usize)] = &[
        (
            "sglang-aibrix1614-deepseek-r1-dp-ranks-fragment.txt",
            include_str!("../../../tests/fixtures/metrics/sglang-aibrix1614-deepseek-r1-dp-ranks-fragment.txt"),
            9,
        ),
        (
            "sglang-docs-production-metrics-llama3.1-8b.txt",
            include_str!("../../../tests/fixtures/metrics/sglang-docs-production-metrics-llama3.1-8b.txt"),
            91,
        ),
        (
            "sglang-pr4412-llama3-8b-fragment.txt",
            include_str!("../../../tests/fixtures/metrics/sglang-pr4412-llama3-8b-fragment.txt"),
            4,
        ),
        (
            "sglang-pr7944-deepseek-r1-fragment.txt",
            include_str!("../../../tests/fixtures/metrics/sglang-pr7944-deepseek-r1-fragment.txt"),
            6,
        ),
        (
            "triton-base-metrics-readme.txt",
            include_str!("../../../tests/fixtures/metrics/triton-base-metrics-readme.txt"),
            10,
        ),
        (
            "triton-trtllm-backend-readme-inflight-batcher.txt",
            include_str!("../../../tests/fixtures/metrics/triton-trtllm-backend-readme-inflight-batcher.txt"),
            16,
        ),
        (
            "vllm-0.10.0-v1-glm4.5-fragment.txt",
            include_str!("../../../tests/fixtures/metrics/vllm-0.10.0-v1-glm4.5-fragment.txt"),
            5,
        ),
        (
            "vllm-0.29.0-v1-qwen2.5-1.5b-inferstack.txt",
            include_str!("../../../tests/fixtures/metrics/vllm-0.29.0-v1-qwen2.5-1.5b-inferstack.txt"),
            187,
        ),
        (
            "vllm-llm-d-inference-sim-kthena1129-fragment.txt",
            include_str!("../../../tests/fixtures/metrics/vllm-llm-d-inference-sim-kthena1129-fragment.txt"),
            12,
        ),
        (
            "vllm-v1-0.8-era-qwen2.5-coder-32b-fragment.txt",
            include_str!("../../../tests/fixtures/metrics/vllm-v1-0.8-era-qwen2.5-coder-32b-fragment.txt"),
            7,
        ),
    ];

    #[test]
    fn every_fixture_parses_without_garbage() {
        for (file, text, samples) in FIXTURES {
            let mut p = parse(text);
            let n = p.by_ref().count();
            assert_eq!(p.garbage(), 0, "{file}");
            // Every non-comment, non-blank line is a sample.
            let expect = text
                .lines()
                .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
                .count();
            assert_eq!(n, expect, "{file}");
            assert_eq!(n, *samples, "{file}");
        }
    }

    #[test]
    fn fixture_values_are_exact() {
        let text = FIXTURES[7].1;
        let s = parse(text)
            .find(|s| s.name == "vllm:cache_config_info")
            .unwrap();
        assert_eq!(s.labels().count(), 33);
        assert_eq!(s.label("block_size").as_deref(), Some("16"));
        assert_eq!(s.label("num_gpu_blocks").as_deref(), Some("20184"));
        assert_eq!(s.label("kv_cache_dtype_skip_layers").as_deref(), Some("[]"));
        assert_eq!(s.value, 1.0);
        let glm = parse(FIXTURES[6].1)
            .find(|s| s.name == "vllm:kv_cache_usage_perc")
            .unwrap();
        assert_eq!(glm.value, 9.75010481363281e-06);
        assert_eq!(glm.label("engine").as_deref(), Some("0"));
        let sg = parse(FIXTURES[1].1)
            .find(|s| s.name == "sglang:time_per_output_token_seconds_bucket")
            .unwrap();
        assert!(sg.label("le").is_some());
        let inf = parse(FIXTURES[1].1)
            .find(|s| s.label("le").as_deref() == Some("+Inf"))
            .unwrap();
        assert_eq!(inf.value, 11008.0);
    }
}
