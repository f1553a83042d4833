//! Incremental JSON syntax check: accepts text one character at a time and refuses the first character
//! that cannot continue a valid JSON object. Used to constrain `response_format: json_object` output
//! token by token, and to know when the object is complete.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Num {
    Minus,
    Zero,
    Int,
    Dot,
    Frac,
    Exp,
    ExpSign,
    ExpDigits,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Before the top-level `{`.
    Start,
    Value,
    /// After `{`: a key or `}`.
    KeyOrEnd,
    /// After `,` in an object.
    Key,
    Colon,
    /// After a value: `,` or the closing bracket.
    AfterValue,
    /// Inside a string; `key` says where it goes when closed.
    Str {
        key: bool,
        escape: bool,
        hex_left: u8,
    },
    Number(Num),
    Literal {
        word: &'static str,
        at: u8,
    },
    Done,
}

#[derive(Debug, Clone)]
pub struct JsonPrefix {
    stack: Vec<u8>,
    state: State,
}

impl Default for JsonPrefix {
    fn default() -> Self {
        Self {
            stack: Vec::new(),
            state: State::Start,
        }
    }
}

impl JsonPrefix {
    pub fn is_complete(&self) -> bool {
        self.state == State::Done
    }

    /// Accepts all of `s` or nothing (state unchanged on refusal).
    pub fn push_str(&mut self, s: &str) -> bool {
        let mut next = self.clone();
        if s.chars().all(|c| next.push(c)) {
            *self = next;
            true
        } else {
            false
        }
    }

    fn after_value(&mut self) {
        self.state = if self.stack.is_empty() {
            State::Done
        } else {
            State::AfterValue
        };
    }

    pub fn push(&mut self, c: char) -> bool {
        let ws = matches!(c, ' ' | '\n' | '\r' | '\t');
        match self.state {
            State::Start => match c {
                '{' => {
                    self.stack.push(b'{');
                    self.state = State::KeyOrEnd;
                    true
                }
                _ => ws,
            },
            State::Done => ws,
            State::Value => ws || self.start_value(c),
            State::KeyOrEnd | State::Key => match c {
                '"' => {
                    self.state = State::Str {
                        key: true,
                        escape: false,
                        hex_left: 0,
                    };
                    true
                }
                '}' if self.state == State::KeyOrEnd => self.close(b'{'),
                _ => ws,
            },
            State::Colon => match c {
                ':' => {
                    self.state = State::Value;
                    true
                }
                _ => ws,
            },
            State::AfterValue => match (c, self.stack.last()) {
                (',', Some(b'{')) => {
                    self.state = State::Key;
                    true
                }
                (',', Some(b'[')) => {
                    self.state = State::Value;
                    true
                }
                ('}', _) => self.close(b'{'),
                (']', _) => self.close(b'['),
                _ => ws,
            },
            State::Str {
                key,
                escape,
                hex_left,
            } => {
                if hex_left > 0 {
                    self.state = State::Str {
                        key,
                        escape: false,
                        hex_left: hex_left - 1,
                    };
                    return c.is_ascii_hexdigit();
                }
                if escape {
                    let hex = if c == 'u' { 4 } else { 0 };
                    self.state = State::Str {
                        key,
                        escape: false,
                        hex_left: hex,
                    };
                    return "\"\\/bfnrtu".contains(c);
                }
                match c {
                    '"' if key => self.state = State::Colon,
                    '"' => self.after_value(),
                    '\\' => {
                        self.state = State::Str {
                            key,
                            escape: true,
                            hex_left: 0,
                        }
                    }
                    c if (c as u32) < 0x20 => return false,
                    _ => {}
                }
                true
            }
            State::Number(n) => {
                use Num::*;
                let digit = c.is_ascii_digit();
                let next = match (n, c) {
                    (Minus, '0') => Some(Zero),
                    (Minus, _) if digit => Some(Int),
                    (Int, _) if digit => Some(Int),
                    (Zero | Int, '.') => Some(Dot),
                    (Dot | Frac, _) if digit => Some(Frac),
                    (Zero | Int | Frac, 'e' | 'E') => Some(Exp),
                    (Exp, '+' | '-') => Some(ExpSign),
                    (Exp | ExpSign | ExpDigits, _) if digit => Some(ExpDigits),
                    _ => None,
                };
                match next {
                    Some(n) => {
                        self.state = State::Number(n);
                        true
                    }
                    None if matches!(n, Zero | Int | Frac | ExpDigits) => {
                        self.after_value();
                        self.push(c)
                    }
                    None => false,
                }
            }
            State::Literal { word, at } => {
                if word.as_bytes().get(at as usize) != Some(&(c as u8)) || !c.is_ascii() {
                    return false;
                }
                if at as usize + 1 == word.len() {
                    self.after_value();
                } else {
                    self.state = State::Literal { word, at: at + 1 };
                }
                true
            }
        }
    }

    fn start_value(&mut self, c: char) -> bool {
        self.state = match c {
            '{' => {
                self.stack.push(b'{');
                State::KeyOrEnd
            }
            '[' => {
                self.stack.push(b'[');
                State::Value
            }
            '"' => State::Str {
                key: false,
                escape: false,
                hex_left: 0,
            },
            '-' => State::Number(Num::Minus),
            '0' => State::Number(Num::Zero),
            '1'..='9' => State::Number(Num::Int),
            't' => State::Literal {
                word: "true",
                at: 1,
            },
            'f' => State::Literal {
                word: "false",
                at: 1,
            },
            'n' => State::Literal {
                word: "null",
                at: 1,
            },
            ']' if self.stack.last() == Some(&b'[') => return self.close(b'['),
            _ => return false,
        };
        true
    }

    fn close(&mut self, open: u8) -> bool {
        if self.stack.last() != Some(&open) {
            return false;
        }
        self.stack.pop();
        self.after_value();
        true
    }
}

#[cfg(test)]
mod tests {
    use super::JsonPrefix;

    fn accepts(s: &str) -> (bool, bool) {
        let mut p = JsonPrefix::default();
        (p.push_str(s), p.is_complete())
    }

    #[test]
    fn valid_objects_are_accepted_and_completed() {
        for s in [
            r#"{}"#,
            r#" {"a": 1, "b": [true, false, null, -0.5e+3, "x\"\u00e9"], "c": {"d": []}} "#,
            "{\"name\": \"Paris\", \"pop\": 2100000}",
        ] {
            assert_eq!(accepts(s), (true, true), "{s}");
        }
    }

    #[test]
    fn invalid_continuations_are_refused() {
        for s in [
            r#"["#,
            r#"{"a" 1}"#,
            r#"{"a": 01}"#,
            r#"{"a": tru }"#,
            r#"{"a": 1,}"#,
            "{\"a\n\": 1}",
            r#"{} x"#,
            r#"{"a": [1}"#,
        ] {
            assert!(!accepts(s).0, "{s}");
        }
        assert_eq!(accepts(r#"{"a": [1, 2"#), (true, false));
    }
}
