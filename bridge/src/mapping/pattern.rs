//! Name patterns of the mapping registry (docs/checkpoints.md §Name mapping): `*` matches `\d+`,
//! `**` matches `.*`, `{e}` matches `\d+` and marks the expert index; everything else is literal.
//! Matching is anchored (the whole name) and, like a regex, greedy with backtracking.
//!
//! A small hand-written matcher instead of the `regex` crate: three wildcard kinds are all the
//! registry needs.

use std::fmt;

/// One element of a pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Token {
    Literal(String),
    /// `*`: one or more ASCII digits, captured.
    Digits,
    /// `{e}`: one or more ASCII digits, the expert index (not part of the ordinary captures).
    Expert,
    /// `**`: any text (possibly empty), captured.
    Any,
}

/// A compiled name pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pattern {
    source: String,
    tokens: Vec<Token>,
}

/// The result of matching a name: ordinary captures in order, and the expert index if the
/// pattern has `{e}`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Captures {
    /// Texts matched by `*` and `**`, left to right.
    pub values: Vec<String>,
    /// The number matched by `{e}`.
    pub expert: Option<usize>,
}

/// The kind of each ordinary capture, for checking that two patterns are compatible.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CaptureKind {
    /// `*`.
    Digits,
    /// `**`.
    Any,
}

impl Pattern {
    /// Compiles `source`.
    pub fn new(source: &str) -> Self {
        let mut tokens = Vec::new();
        let mut literal = String::new();
        let mut rest = source;
        while let Some(c) = rest.chars().next() {
            let (token, len) = if rest.starts_with("**") {
                (Some(Token::Any), 2)
            } else if rest.starts_with("{e}") {
                (Some(Token::Expert), 3)
            } else if c == '*' {
                (Some(Token::Digits), 1)
            } else {
                literal.push(c);
                (None, c.len_utf8())
            };
            if let Some(token) = token {
                if !literal.is_empty() {
                    tokens.push(Token::Literal(std::mem::take(&mut literal)));
                }
                tokens.push(token);
            }
            rest = &rest[len..];
        }
        if !literal.is_empty() {
            tokens.push(Token::Literal(literal));
        }
        Self {
            source: source.to_owned(),
            tokens,
        }
    }

    /// The pattern text.
    pub fn as_str(&self) -> &str {
        &self.source
    }

    /// Kinds of the ordinary captures, left to right.
    pub fn capture_kinds(&self) -> Vec<CaptureKind> {
        self.tokens
            .iter()
            .filter_map(|t| match t {
                Token::Digits => Some(CaptureKind::Digits),
                Token::Any => Some(CaptureKind::Any),
                _ => None,
            })
            .collect()
    }

    /// Whether the pattern has an `{e}` expert wildcard.
    pub fn has_expert(&self) -> bool {
        self.tokens.contains(&Token::Expert)
    }

    /// Matches the whole of `name`.
    pub fn matches(&self, name: &str) -> Option<Captures> {
        let mut spans = Vec::new();
        if !match_from(&self.tokens, name, 0, &mut spans) {
            return None;
        }
        let mut captures = Captures::default();
        for (token, text) in self
            .tokens
            .iter()
            .filter(|t| !matches!(t, Token::Literal(_)))
            .zip(spans)
        {
            if *token == Token::Expert {
                captures.expert = Some(text.parse().ok()?);
            } else {
                captures.values.push(text);
            }
        }
        Some(captures)
    }

    /// Substitutes captures into the pattern (`None` when their number or kinds do not fit, or
    /// an expert index is needed but not given).
    pub fn fill(&self, captures: &Captures) -> Option<String> {
        let mut values = captures.values.iter();
        let mut out = String::new();
        for token in &self.tokens {
            match token {
                Token::Literal(text) => out.push_str(text),
                Token::Digits => {
                    let v = values.next()?;
                    if v.is_empty() || !v.bytes().all(|b| b.is_ascii_digit()) {
                        return None;
                    }
                    out.push_str(v);
                }
                Token::Any => out.push_str(values.next()?),
                Token::Expert => out.push_str(&captures.expert?.to_string()),
            }
        }
        values.next().is_none().then_some(out)
    }
}

impl fmt::Display for Pattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.source)
    }
}

/// Backtracking matcher: does `tokens[i..]` match `text[pos..]` exactly? Wildcard spans are
/// pushed onto `spans` (popped again on failure).
fn match_from(tokens: &[Token], text: &str, pos: usize, spans: &mut Vec<String>) -> bool {
    let Some((token, rest)) = tokens.split_first() else {
        return pos == text.len();
    };
    let tail = &text[pos..];
    match token {
        Token::Literal(lit) => {
            tail.starts_with(lit.as_str()) && match_from(rest, text, pos + lit.len(), spans)
        }
        Token::Digits | Token::Expert => {
            let digits = tail.bytes().take_while(u8::is_ascii_digit).count();
            (1..=digits)
                .rev()
                .any(|len| try_span(rest, text, pos, len, spans))
        }
        Token::Any => (0..=tail.len())
            .rev()
            .filter(|&len| tail.is_char_boundary(len))
            .any(|len| try_span(rest, text, pos, len, spans)),
    }
}

fn try_span(rest: &[Token], text: &str, pos: usize, len: usize, spans: &mut Vec<String>) -> bool {
    spans.push(text[pos..pos + len].to_owned());
    if match_from(rest, text, pos + len, spans) {
        return true;
    }
    spans.pop();
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caps(values: &[&str], expert: Option<usize>) -> Captures {
        Captures {
            values: values.iter().map(|s| (*s).to_owned()).collect(),
            expert,
        }
    }

    #[test]
    fn digits_match_only_numbers() {
        let p = Pattern::new("model.layers.*.mlp.gate.weight");
        assert_eq!(
            p.matches("model.layers.12.mlp.gate.weight"),
            Some(caps(&["12"], None))
        );
        assert_eq!(p.matches("model.layers.x.mlp.gate.weight"), None);
        assert_eq!(p.matches("model.layers..mlp.gate.weight"), None);
        // Anchored at both ends.
        assert_eq!(p.matches("model.layers.1.mlp.gate.weight.extra"), None);
        assert_eq!(p.matches("x.model.layers.1.mlp.gate.weight"), None);
        assert_eq!(
            p.fill(&caps(&["7"], None)).as_deref(),
            Some("model.layers.7.mlp.gate.weight")
        );
        assert_eq!(p.fill(&caps(&["a"], None)), None);
        assert_eq!(p.fill(&caps(&["1", "2"], None)), None);
    }

    #[test]
    fn double_star_matches_anything_with_backtracking() {
        let p = Pattern::new("**_scale_inv");
        assert_eq!(
            p.matches("model.layers.0.mlp.down_proj.weight_scale_inv"),
            Some(caps(&["model.layers.0.mlp.down_proj.weight"], None))
        );
        assert_eq!(p.matches("_scale_inv"), Some(caps(&[""], None)));
        assert_eq!(p.matches("weight_scale"), None);
        let p = Pattern::new("a.**.b.*");
        assert_eq!(p.matches("a.x.b.y.b.3"), Some(caps(&["x.b.y", "3"], None)));
        assert_eq!(p.matches("a..b.3"), Some(caps(&["", "3"], None)));
        assert_eq!(p.matches("a.x.b.y"), None);
        assert_eq!(
            p.capture_kinds(),
            vec![CaptureKind::Any, CaptureKind::Digits]
        );
    }

    #[test]
    fn expert_wildcard_is_separate() {
        let p = Pattern::new("model.layers.*.mlp.experts.{e}.up_proj.weight");
        assert!(p.has_expert());
        let c = p
            .matches("model.layers.3.mlp.experts.17.up_proj.weight")
            .unwrap();
        assert_eq!(c, caps(&["3"], Some(17)));
        assert_eq!(
            p.fill(&c).as_deref(),
            Some("model.layers.3.mlp.experts.17.up_proj.weight")
        );
        assert_eq!(p.fill(&caps(&["3"], None)), None);
        assert_eq!(p.capture_kinds(), vec![CaptureKind::Digits]);
        // Adjacent digit wildcards split greedily, the first taking the longest prefix.
        let p = Pattern::new("*{e}");
        assert_eq!(p.matches("123"), Some(caps(&["12"], Some(3))));
        assert_eq!(p.matches("1"), None);
    }

    #[test]
    fn non_ascii_literals() {
        let p = Pattern::new("é.**.ü");
        assert_eq!(p.matches("é.ßx.ü"), Some(caps(&["ßx"], None)));
        assert_eq!(p.to_string(), "é.**.ü");
    }
}
