//! A/B knobs: environment variables, read once per process, that switch a code path for a measurement
//! (`MOE_CPU_DECODE`, `MOE_CPU_DECODE_ITEM_KIB`, `MOE_CPU_PREFETCH`, `MOE_CPU_PREFETCH_HINT`; the
//! daemon has its own). A value a knob does not take is never read as its default without a word:
//! `moe-daemon` refuses to start with one ([`crate::cpu::moe::check_env_knobs`] and the daemon's own
//! checks), and a knob read where nothing checked it first (benchmarks, examples, tests) warns once on
//! stderr and keeps its default.
use std::ffi::OsString;

/// One knob: its variable, what it takes (for the message), and its parser (`None`: not a value).
pub struct Knob<T: 'static> {
    pub name: &'static str,
    pub takes: &'static str,
    pub parse: fn(&str) -> Option<T>,
}

/// A knob set to a value it does not take.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{name}={value:?} is not a value it takes ({takes}); unset it for the default")]
pub struct KnobError {
    pub name: &'static str,
    pub value: String,
    pub takes: &'static str,
}

impl<T> Knob<T> {
    /// The knob as the environment sets it: `None` when unset or empty.
    pub fn check(&self) -> Result<Option<T>, KnobError> {
        self.parse_value(std::env::var_os(self.name))
    }

    /// The knob set to `raw` (`None`: unset); surrounding blanks are ignored.
    pub fn parse_value(&self, raw: Option<OsString>) -> Result<Option<T>, KnobError> {
        let Some(raw) = raw else { return Ok(None) };
        let refused = |value: String| KnobError {
            name: self.name,
            value,
            takes: self.takes,
        };
        let Some(v) = raw.to_str() else {
            return Err(refused(raw.to_string_lossy().into_owned()));
        };
        let v = v.trim();
        if v.is_empty() {
            return Ok(None);
        }
        (self.parse)(v)
            .map(Some)
            .ok_or_else(|| refused(v.to_string()))
    }

    /// The knob's value, or `default` when unset; a value it does not take gives `default` after a
    /// warning on stderr (callers read a knob once per process, so the warning comes once).
    pub fn read_or(&self, default: T) -> T {
        match self.check() {
            Ok(v) => v.unwrap_or(default),
            Err(e) => {
                eprintln!("warning: {e}; using the default");
                default
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small(v: &str) -> Option<u8> {
        v.parse().ok()
    }

    const SMALL: Knob<u8> = Knob {
        name: "MOE_TEST_SMALL",
        takes: "0..=255",
        parse: small,
    };

    #[test]
    fn unset_and_empty_are_the_default_and_bad_values_are_refused_by_name() {
        assert_eq!(SMALL.parse_value(None), Ok(None));
        assert_eq!(SMALL.parse_value(Some(" ".into())), Ok(None));
        assert_eq!(SMALL.parse_value(Some(" 7 ".into())), Ok(Some(7)));
        let e = SMALL.parse_value(Some("300".into())).unwrap_err();
        assert_eq!((e.name, e.value.as_str()), ("MOE_TEST_SMALL", "300"));
        let msg = e.to_string();
        assert!(
            msg.contains("MOE_TEST_SMALL=\"300\"") && msg.contains("0..=255"),
            "{msg}"
        );
        #[cfg(unix)]
        {
            use std::os::unix::ffi::OsStringExt;
            let bad = OsString::from_vec(vec![0xff, b'1']);
            assert!(SMALL.parse_value(Some(bad)).is_err());
        }
        // a variable no test sets: the default
        assert_eq!(SMALL.read_or(3), 3);
    }
}
