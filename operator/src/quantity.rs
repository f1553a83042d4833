//! Kubernetes resource quantities ("64Gi", "1500m", "2e9") to numbers and back.
//!
//! Only what placement needs: bytes (memory, hugepages) and CPUs in millicores.

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

pub const KIB: u64 = 1024;
pub const MIB: u64 = 1024 * KIB;
pub const GIB: u64 = 1024 * MIB;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("invalid quantity {0:?}")]
pub struct QuantityError(pub String);

/// Parses a quantity into a value scaled by `scale` (1 for bytes, 1000 for millicores), rounding up.
fn parse_scaled(text: &str, scale: u128) -> Result<u64, QuantityError> {
    let err = || QuantityError(text.to_string());
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '+'))
        .unwrap_or(t.len());
    let (number, suffix) = t.split_at(split);
    if number.is_empty() {
        return Err(err());
    }
    // The multiplier as a fraction num/den so "1500m" and "1.5Gi" stay exact.
    let (mul_num, mul_den): (u128, u128) = match suffix {
        "" => (1, 1),
        "m" => (1, 1000),
        "k" => (1000, 1),
        "M" => (1_000_000, 1),
        "G" => (1_000_000_000, 1),
        "T" => (1_000_000_000_000, 1),
        "P" => (1_000_000_000_000_000, 1),
        "Ki" => (KIB as u128, 1),
        "Mi" => (MIB as u128, 1),
        "Gi" => (GIB as u128, 1),
        "Ti" => (GIB as u128 * 1024, 1),
        "Pi" => (GIB as u128 * 1024 * 1024, 1),
        s if s.starts_with(['e', 'E']) => {
            let exp: u32 = s[1..].parse().map_err(|_| err())?;
            if exp > 18 {
                return Err(err());
            }
            (10u128.pow(exp), 1)
        }
        _ => return Err(err()),
    };
    let (int_part, frac_part) = number.split_once('.').unwrap_or((number, ""));
    if frac_part.len() > 9 || (int_part.is_empty() && frac_part.is_empty()) {
        return Err(err());
    }
    let digits = format!("{int_part}{frac_part}");
    let mantissa: u128 = digits.trim_start_matches('+').parse().map_err(|_| err())?;
    let frac_den = 10u128.pow(frac_part.len() as u32);
    let num = mantissa
        .checked_mul(mul_num)
        .and_then(|v| v.checked_mul(scale))
        .ok_or_else(err)?;
    let den = frac_den * mul_den;
    let value = num.div_ceil(den);
    u64::try_from(value).map_err(|_| err())
}

pub fn parse_bytes(text: &str) -> Result<u64, QuantityError> {
    parse_scaled(text, 1)
}

pub fn parse_millicores(text: &str) -> Result<u64, QuantityError> {
    parse_scaled(text, 1000)
}

pub fn quantity_bytes(q: &Quantity) -> Result<u64, QuantityError> {
    parse_bytes(&q.0)
}

/// Bytes as the largest binary suffix that represents them exactly ("64Gi", "1536Mi").
pub fn format_bytes(bytes: u64) -> String {
    for (suffix, unit) in [("Ti", GIB * 1024), ("Gi", GIB), ("Mi", MIB), ("Ki", KIB)] {
        if bytes >= unit && bytes.is_multiple_of(unit) {
            return format!("{}{suffix}", bytes / unit);
        }
    }
    bytes.to_string()
}

/// Rounds bytes up to whole MiB, so requests read well and stay exact.
pub fn round_up_mib(bytes: u64) -> u64 {
    bytes.div_ceil(MIB) * MIB
}

pub fn bytes_quantity(bytes: u64) -> Quantity {
    Quantity(format_bytes(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_binary_and_decimal_suffixes() {
        assert_eq!(parse_bytes("64Gi"), Ok(64 * GIB));
        assert_eq!(parse_bytes("1.5Gi"), Ok(1536 * MIB));
        assert_eq!(parse_bytes("2M"), Ok(2_000_000));
        assert_eq!(parse_bytes("128974848"), Ok(128_974_848));
        assert_eq!(parse_bytes("129e6"), Ok(129_000_000));
        assert_eq!(parse_bytes("1Ti"), Ok(1024 * GIB));
    }

    #[test]
    fn parses_cpu_millicores() {
        assert_eq!(parse_millicores("1500m"), Ok(1500));
        assert_eq!(parse_millicores("64"), Ok(64_000));
        assert_eq!(parse_millicores("0.5"), Ok(500));
        assert_eq!(parse_millicores("95.5"), Ok(95_500));
    }

    #[test]
    fn rejects_garbage() {
        for bad in ["", "Gi", "12XB", "1.2.3Gi", "-5", "abc", "1e99"] {
            assert!(parse_bytes(bad).is_err(), "{bad} should not parse");
        }
    }

    #[test]
    fn formats_with_largest_exact_suffix() {
        assert_eq!(format_bytes(64 * GIB), "64Gi");
        assert_eq!(format_bytes(1536 * MIB), "1536Mi");
        assert_eq!(format_bytes(1000), "1000");
        assert_eq!(format_bytes(2048 * GIB), "2Ti");
        assert_eq!(round_up_mib(MIB + 1), 2 * MIB);
    }
}
