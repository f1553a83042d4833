//! A small deterministic mutator for the CI smoke run: the kinds of edits libFuzzer makes first (bit
//! flips, random and boundary bytes, inserted, deleted and repeated runs, splices of two inputs),
//! without coverage feedback. Deterministic so that a failure in CI replays locally.

/// xorshift64*: a fixed sequence from a seed, no dependency.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.max(1))
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in `0..n` (`n` > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// Values that sit on size and sign boundaries, little-endian as the binary formats store them.
const BOUNDARY: &[&[u8]] = &[
    &[0],
    &[0xff],
    &[0x7f],
    &[0x80],
    &[0xff, 0xff, 0xff, 0xff],
    &[0xff, 0xff, 0xff, 0x7f],
    &[0, 0, 0, 0x80],
    &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
    &[0, 0, 0, 0, 0, 0, 0, 0x80],
    b"-1",
    b"1e308",
    b"18446744073709551616",
    b"null",
    b"\"",
    b"{",
    b"[",
];

/// Longest input a mutation may produce: the targets' work grows with the input, and the smoke run
/// has a time budget.
pub const MAX_LEN: usize = 64 << 10;

/// One to four edits of `input`; `other` is spliced in by some of them.
pub fn mutate(rng: &mut Rng, input: &[u8], other: &[u8]) -> Vec<u8> {
    let mut v = input.to_vec();
    for _ in 0..1 + rng.below(4) {
        edit(rng, &mut v, other);
    }
    v.truncate(MAX_LEN);
    v
}

fn edit(rng: &mut Rng, v: &mut Vec<u8>, other: &[u8]) {
    let len = v.len();
    match rng.below(8) {
        0 if len > 0 => {
            let i = rng.below(len);
            v[i] ^= 1 << rng.below(8);
        }
        1 if len > 0 => {
            let i = rng.below(len);
            v[i] = rng.next_u64() as u8;
        }
        2 => {
            let b = BOUNDARY[rng.below(BOUNDARY.len())];
            let i = rng.below(len + 1);
            if rng.below(2) == 0 && i + b.len() <= len {
                v[i..i + b.len()].copy_from_slice(b);
            } else {
                v.splice(i..i, b.iter().copied());
            }
        }
        3 if len > 0 => {
            let i = rng.below(len);
            let n = 1 + rng.below((len - i).min(64));
            v.drain(i..i + n);
        }
        4 => {
            let i = rng.below(len + 1);
            let n = 1 + rng.below(16);
            let bytes: Vec<u8> = (0..n).map(|_| rng.next_u64() as u8).collect();
            v.splice(i..i, bytes);
        }
        5 if len > 0 => {
            // repeat a run: what grows counts, nesting and lengths
            let i = rng.below(len);
            let n = 1 + rng.below((len - i).min(32));
            let run = v[i..i + n].to_vec();
            for _ in 0..1 + rng.below(8) {
                v.splice(i..i, run.iter().copied());
            }
        }
        6 if !other.is_empty() => {
            // splice: a prefix of this input, a suffix of the other
            let i = rng.below(len + 1);
            let j = rng.below(other.len());
            v.truncate(i);
            v.extend_from_slice(&other[j..]);
        }
        _ if len > 1 => {
            let i = rng.below(len);
            v.truncate(i.max(1));
        }
        _ => v.push(rng.next_u64() as u8),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mutations_are_deterministic_bounded_and_change_the_input() {
        let seed = br#"{"messages":[{"role":"user","content":"hi"}]}"#;
        let run = |s| {
            let mut rng = Rng::new(s);
            (0..200)
                .map(|_| mutate(&mut rng, seed, b"other"))
                .collect::<Vec<_>>()
        };
        let a = run(7);
        assert_eq!(a, run(7));
        assert_ne!(a, run(8));
        assert!(a.iter().all(|m| m.len() <= MAX_LEN));
        assert!(a.iter().filter(|m| m.as_slice() != seed).count() > 180);
    }
}
