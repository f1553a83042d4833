//! Stop strings matched across token boundaries: text that could still become a stop string is held
//! back until it either completes one (generation ends, the stop string is not returned) or cannot.

pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

/// What one push releases.
#[derive(Debug, PartialEq, Eq)]
pub struct StopOutcome {
    /// Text safe to emit now.
    pub text: String,
    /// A stop string matched; `text` ends right before it.
    pub stopped: bool,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
        }
    }

    pub fn push(&mut self, delta: &str) -> StopOutcome {
        self.held.push_str(delta);
        if self.stops.is_empty() {
            return StopOutcome {
                text: std::mem::take(&mut self.held),
                stopped: false,
            };
        }
        if let Some(at) = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min()
        {
            let text = self.held[..at].to_string();
            self.held.clear();
            return StopOutcome {
                text,
                stopped: true,
            };
        }
        // Hold back the longest suffix that is a proper prefix of some stop string.
        let keep = self
            .held
            .char_indices()
            .map(|(i, _)| i)
            .find(|&i| self.stops.iter().any(|s| s.starts_with(&self.held[i..])))
            .unwrap_or(self.held.len());
        let text = self.held[..keep].to_string();
        self.held.drain(..keep);
        StopOutcome {
            text,
            stopped: false,
        }
    }

    /// Text still held when generation ends for another reason.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_string_split_across_tokens_is_found_and_removed() {
        let mut m = StopMatcher::new(vec!["END".into(), "\n\n".into()]);
        assert_eq!(m.push("Hello E").text, "Hello ");
        assert_eq!(m.push("N").text, "");
        let o = m.push("Dxyz");
        assert_eq!(
            o,
            StopOutcome {
                text: String::new(),
                stopped: true
            }
        );
    }

    #[test]
    fn false_prefixes_are_released_and_flush_returns_the_rest() {
        let mut m = StopMatcher::new(vec!["END".into()]);
        assert_eq!(m.push("EN").text, "");
        assert_eq!(m.push("a café E").text, "ENa café ");
        assert_eq!(m.flush(), "E");
        let mut none = StopMatcher::new(vec![]);
        assert_eq!(none.push("abc").text, "abc");
    }
}
