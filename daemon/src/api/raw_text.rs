//! The lark terminal of a string value written as raw text (GLM's `<arg_value>` text, unquoted), so
//! that it is held to the same JSON Schema keywords a quoted JSON string would be: `minLength` /
//! `maxLength`, `pattern` (an ECMA-262 regex that matches anywhere unless anchored, as JSON Schema
//! says) and `format` (llguidance's formats, `string_formats.rs`).
//!
//! What cannot be enforced is treated as llguidance's JSON compiler treats it: an unknown `format` is
//! refused for a `strict` tool and ignored otherwise; a `pattern` that is not a valid regex is
//! refused either way.
use super::string_formats::lookup_format;
use llguidance::regex_to_lark;
use regex_syntax::ast::{self, Ast};
use serde_json::Value;

/// Lengths above this are left unbounded (a counted repetition that large only costs compile time).
const MAX_COUNTED_LENGTH: u64 = 4096;

/// Any text.
pub const ANY_TEXT: &str = "(?s:.*)";

/// The regexes a raw-text value must all match (full matches), from its schema `prop`. Empty: any
/// text. `strict`: the tool is `strict` (unknown formats refused rather than ignored).
pub fn text_regexes(prop: &Value, strict: bool) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    if let Some(len) = length_regex(prop) {
        out.push(len);
    }
    if let Some(p) = prop.get("pattern") {
        let p = p
            .as_str()
            .ok_or_else(|| format!("`pattern` must be a string, got {p}"))?;
        out.push(regex_to_lark(&full_match(p)?, "dw"));
    }
    if let Some(f) = prop.get("format") {
        let f = f
            .as_str()
            .ok_or_else(|| format!("`format` must be a string, got {f}"))?;
        match lookup_format(f) {
            Some(rx) => out.push(regex_to_lark(rx, "")),
            None if strict => return Err(format!("Unknown format: {f}")),
            None => tracing::warn!(format = f, "unknown string format ignored"),
        }
    }
    Ok(out)
}

/// The lark expression of a terminal matching all of `regexes` (their intersection), or any text.
pub fn terminal_expr(regexes: &[String]) -> String {
    match regexes {
        [] => format!("/{ANY_TEXT}/"),
        _ => regexes
            .iter()
            .map(|r| format!("/{r}/"))
            .collect::<Vec<_>>()
            .join(" & "),
    }
}

/// `minLength` / `maxLength` as a counted repetition (in characters, as JSON Schema counts).
fn length_regex(prop: &Value) -> Option<String> {
    let len = |k: &str| prop.get(k).and_then(Value::as_u64);
    let min = len("minLength").unwrap_or(0).min(MAX_COUNTED_LENGTH);
    match len("maxLength").filter(|&m| m <= MAX_COUNTED_LENGTH) {
        Some(max) => Some(format!("(?s:.{{{},{max}}})", min.min(max))),
        None if min > 0 => Some(format!("(?s:.{{{min},}})")),
        None => None,
    }
}

/// A JSON Schema `pattern` (a search: it may match anywhere in the string) as a regex that must
/// match the whole string: each top-level alternative gets `.*` on a side it is not anchored on
/// (`^` / `$` / `\A` / `\z`), and loses its anchors. Anchors anywhere else are left to llguidance,
/// which refuses them.
pub fn full_match(pattern: &str) -> Result<String, String> {
    let parsed = ast::parse::Parser::new()
        .parse(pattern)
        .map_err(|e| format!("invalid `pattern` {pattern:?}: {e}"))?;
    let alternatives = match &parsed {
        Ast::Alternation(a) => a.asts.iter().collect(),
        other => vec![other],
    };
    let parts: Vec<String> = alternatives
        .into_iter()
        .map(|alt| anchored_alternative(pattern, alt))
        .collect();
    Ok(parts.join("|"))
}

/// One alternative of a pattern, unanchored sides padded with any text.
fn anchored_alternative(pattern: &str, alt: &Ast) -> String {
    let items: Vec<&Ast> = match alt {
        Ast::Concat(c) => c.asts.iter().collect(),
        other => vec![other],
    };
    let is = |a: &Ast, kinds: &[ast::AssertionKind]| matches!(a, Ast::Assertion(x) if kinds.contains(&x.kind));
    let starts = items.first().is_some_and(|a| {
        is(
            a,
            &[ast::AssertionKind::StartLine, ast::AssertionKind::StartText],
        )
    });
    let ends = items.len() > usize::from(starts)
        && items.last().is_some_and(|a| {
            is(
                a,
                &[ast::AssertionKind::EndLine, ast::AssertionKind::EndText],
            )
        });
    let body_items = &items[usize::from(starts)..items.len() - usize::from(ends)];
    let body = match (body_items.first(), body_items.last()) {
        (Some(first), Some(last)) => &pattern[first.span().start.offset..last.span().end.offset],
        _ => "",
    };
    let pad = |anchored: bool| if anchored { "" } else { ANY_TEXT };
    format!("{}(?:{body}){}", pad(starts), pad(ends))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn patterns_match_anywhere_unless_anchored() {
        assert_eq!(full_match("^[A-Z]{3}$").unwrap(), "(?:[A-Z]{3})");
        assert_eq!(full_match("abc").unwrap(), "(?s:.*)(?:abc)(?s:.*)");
        assert_eq!(full_match("^ab").unwrap(), "(?:ab)(?s:.*)");
        assert_eq!(full_match(r"\d+\z").unwrap(), r"(?s:.*)(?:\d+)");
        assert_eq!(
            full_match("^a|b$").unwrap(),
            "(?:a)(?s:.*)|(?s:.*)(?:b)",
            "each alternative keeps its own anchors"
        );
        assert_eq!(full_match("^$").unwrap(), "(?:)");
        assert_eq!(full_match("^(a|b)$").unwrap(), "(?:(a|b))");
        assert!(full_match("a(").unwrap_err().contains("invalid `pattern`"));
    }

    #[test]
    fn keywords_become_regexes_and_unknown_formats_follow_strictness() {
        let rx = |p: Value, strict| text_regexes(&p, strict);
        assert!(rx(json!({"type": "string"}), true).unwrap().is_empty());
        assert_eq!(
            rx(json!({"pattern": r"^\d{2}/\w$"}), true).unwrap(),
            vec![r"(?:[0-9]{2}\/[0-9a-zA-Z_])"]
        );
        assert_eq!(
            rx(json!({"minLength": 2, "maxLength": 5}), true).unwrap(),
            vec!["(?s:.{2,5})"]
        );
        assert_eq!(rx(json!({"format": "uuid"}), true).unwrap().len(), 1);
        assert_eq!(
            rx(json!({"format": "colour"}), true).unwrap_err(),
            "Unknown format: colour"
        );
        assert!(rx(json!({"format": "colour"}), false).unwrap().is_empty());
        assert!(rx(json!({"pattern": 3}), false).is_err());
    }

    #[test]
    fn raw_text_lengths_become_counted_repetitions() {
        let len = |p: Value| length_regex(&p);
        assert_eq!(len(json!({"type": "string"})), None);
        assert_eq!(len(json!({"maxLength": 20})).unwrap(), "(?s:.{0,20})");
        assert_eq!(
            len(json!({"minLength": 2, "maxLength": 5})).unwrap(),
            "(?s:.{2,5})"
        );
        assert_eq!(len(json!({"minLength": 3})).unwrap(), "(?s:.{3,})");
        assert_eq!(len(json!({"maxLength": 1_000_000})), None);
    }
}
