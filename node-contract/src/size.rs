//! Byte sizes and percentages as written in the shim's environment.
//!
//! A size is a whole number of bytes with an optional binary suffix:
//! `k`/`K`/`Ki`, `m`/`M`/`Mi`, `g`/`G`/`Gi`, `t`/`T`/`Ti` (all powers of 1024,
//! matching what HAMi's device plugin writes, e.g. `"3000m"`). Anything else,
//! including fractions (`1.5g`), signs, spaces inside, unknown suffixes and
//! values that overflow 64 bits, is an error: a cap that silently became
//! something else would be worse than no start at all.

use thiserror::Error;

/// Why a size string was rejected.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum SizeError {
    #[error("empty size")]
    Empty,
    #[error("size {0:?} must start with a digit (whole bytes, optional suffix k/m/g/t, K/M/G/T or Ki/Mi/Gi/Ti)")]
    NotANumber(String),
    #[error("size {0:?} has unknown suffix {1:?} (allowed: k/m/g/t, K/M/G/T, Ki/Mi/Gi/Ti; fractions are not allowed)")]
    BadSuffix(String, String),
    #[error("size {0:?} does not fit in 64 bits")]
    Overflow(String),
    #[error("percentage {0:?} must be a whole number from 0 to 100")]
    BadPercent(String),
}

/// Parses a byte size such as `"4096"`, `"3000m"`, `"2Gi"` or `"16G"`.
pub fn parse_size(text: &str) -> Result<u64, SizeError> {
    let trimmed = text.trim();
    if trimmed.is_empty() {
        return Err(SizeError::Empty);
    }
    let digits_end = trimmed
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(trimmed.len());
    if digits_end == 0 {
        return Err(SizeError::NotANumber(text.to_string()));
    }
    let (digits, suffix) = trimmed.split_at(digits_end);
    let shift = match suffix {
        "" => 0,
        "k" | "K" | "Ki" => 10,
        "m" | "M" | "Mi" => 20,
        "g" | "G" | "Gi" => 30,
        "t" | "T" | "Ti" => 40,
        other => return Err(SizeError::BadSuffix(text.to_string(), other.to_string())),
    };
    let value: u64 = digits
        .parse()
        .map_err(|_| SizeError::Overflow(text.to_string()))?;
    value
        .checked_mul(1u64 << shift)
        .ok_or_else(|| SizeError::Overflow(text.to_string()))
}

/// Parses a whole percentage from 0 to 100 (compute shares).
pub fn parse_percent(text: &str) -> Result<u32, SizeError> {
    let trimmed = text.trim();
    match trimmed.parse::<u32>() {
        Ok(value) if value <= 100 && trimmed.bytes().all(|b| b.is_ascii_digit()) => Ok(value),
        _ => Err(SizeError::BadPercent(text.to_string())),
    }
}

/// Writes a size so that [`parse_size`] reads back exactly `bytes`: a whole
/// number of MiB as HAMi's device plugin writes it (`3000m`), anything else
/// as plain bytes.
pub fn format_size(bytes: u64) -> String {
    if bytes != 0 && bytes.is_multiple_of(1 << 20) {
        format!("{}m", bytes >> 20)
    } else {
        bytes.to_string()
    }
}

/// Formats bytes the way a person reads them (`4096 MiB`, `1.5 GiB`), for logs.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut unit = 0;
    let mut value = bytes as f64;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if value.fract() == 0.0 {
        format!("{value:.0} {}", UNITS[unit])
    } else {
        format!("{value:.2} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_bytes_and_every_binary_suffix() {
        assert_eq!(parse_size("0"), Ok(0));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("3000m"), Ok(3000 << 20));
        assert_eq!(parse_size("2Gi"), Ok(2 << 30));
        assert_eq!(parse_size("2G"), Ok(2 << 30));
        assert_eq!(parse_size("2g"), Ok(2 << 30));
        assert_eq!(parse_size("7k"), Ok(7 << 10));
        assert_eq!(parse_size("7Ki"), Ok(7 << 10));
        assert_eq!(parse_size("1T"), Ok(1 << 40));
        assert_eq!(parse_size(" 12M "), Ok(12 << 20));
    }

    #[test]
    fn rejects_what_hami_core_misreads() {
        assert!(matches!(parse_size("1.5g"), Err(SizeError::BadSuffix(..))));
        assert!(matches!(parse_size("2GB"), Err(SizeError::BadSuffix(..))));
        assert!(matches!(parse_size("2 G"), Err(SizeError::BadSuffix(..))));
        assert!(matches!(parse_size("-1"), Err(SizeError::NotANumber(_))));
        assert!(matches!(parse_size("g"), Err(SizeError::NotANumber(_))));
        assert_eq!(parse_size(""), Err(SizeError::Empty));
        assert_eq!(parse_size("   "), Err(SizeError::Empty));
    }

    #[test]
    fn rejects_overflow() {
        assert!(matches!(
            parse_size("99999999999999999999"),
            Err(SizeError::Overflow(_))
        ));
        assert!(matches!(
            parse_size("20000000000T"),
            Err(SizeError::Overflow(_))
        ));
        assert_eq!(parse_size("16777215T"), Ok(16_777_215u64 << 40));
    }

    #[test]
    fn percentages() {
        assert_eq!(parse_percent("0"), Ok(0));
        assert_eq!(parse_percent("50"), Ok(50));
        assert_eq!(parse_percent("100"), Ok(100));
        assert!(parse_percent("101").is_err());
        assert!(parse_percent("-5").is_err());
        assert!(parse_percent("+5").is_err());
        assert!(parse_percent("12.5").is_err());
    }

    #[test]
    fn formatted_sizes_read_back_exactly() {
        for bytes in [
            0,
            1,
            4096,
            3000 << 20,
            (1 << 30) + 1,
            16_777_215u64 << 40,
            u64::MAX,
        ] {
            assert_eq!(parse_size(&format_size(bytes)), Ok(bytes), "{bytes}");
        }
        assert_eq!(format_size(3000 << 20), "3000m");
    }

    #[test]
    fn human_readable() {
        assert_eq!(human_bytes(4096 << 20), "4 GiB");
        assert_eq!(human_bytes(1536 << 20), "1.50 GiB");
        assert_eq!(human_bytes(100), "100 B");
    }
}
