//! When an X.509 certificate stops being valid: its `notAfter`, read from
//! the DER encoding (RFC 5280 section 4.1.2.5).
//!
//! rustls checks that a served certificate and its key belong together but
//! never looks at the served certificate's dates, so nothing else tells the
//! extender that the certificate the API server will soon refuse is the
//! one it serves. Only the path to the validity field is walked; the rest
//! of the certificate is skipped by its lengths.

use thiserror::Error;

/// Why a certificate's end date cannot be read.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ValidityError {
    #[error("the certificate ends inside an element")]
    Truncated,
    #[error("expected {expected} at byte {offset}, found tag 0x{found:02x}")]
    UnexpectedTag {
        expected: &'static str,
        offset: usize,
        found: u8,
    },
    #[error("an element's length takes more than 4 bytes")]
    LengthTooLong,
    #[error("time {0:?} is not of the form YYMMDDHHMMSSZ or YYYYMMDDHHMMSSZ")]
    Time(String),
}

const SEQUENCE: u8 = 0x30;
const INTEGER: u8 = 0x02;
/// `[0] EXPLICIT Version`, absent from version 1 certificates.
const VERSION: u8 = 0xa0;
const UTC_TIME: u8 = 0x17;
const GENERALIZED_TIME: u8 = 0x18;

/// One DER element: its tag and its content.
struct Element<'a> {
    tag: u8,
    content: &'a [u8],
}

/// Reads elements one after another from a slice of DER.
struct Reader<'a> {
    bytes: &'a [u8],
    offset: usize,
}

impl<'a> Reader<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        Self { bytes, offset: 0 }
    }

    fn peek_tag(&self) -> Option<u8> {
        self.bytes.get(self.offset).copied()
    }

    fn next(&mut self) -> Result<Element<'a>, ValidityError> {
        let rest = self.bytes.get(self.offset..).unwrap_or_default();
        let (&tag, rest) = rest.split_first().ok_or(ValidityError::Truncated)?;
        let (&first, rest) = rest.split_first().ok_or(ValidityError::Truncated)?;
        let (length, header) = if first < 0x80 {
            (usize::from(first), 2)
        } else {
            let count = usize::from(first & 0x7f);
            if count > 4 {
                return Err(ValidityError::LengthTooLong);
            }
            let digits = rest.get(..count).ok_or(ValidityError::Truncated)?;
            let length = digits
                .iter()
                .fold(0usize, |length, &digit| (length << 8) | usize::from(digit));
            (length, 2 + count)
        };
        let start = self.offset + header;
        let end = start.checked_add(length).ok_or(ValidityError::Truncated)?;
        let content = self.bytes.get(start..end).ok_or(ValidityError::Truncated)?;
        self.offset = end;
        Ok(Element { tag, content })
    }

    fn expect(&mut self, tag: u8, expected: &'static str) -> Result<&'a [u8], ValidityError> {
        let offset = self.offset;
        let element = self.next()?;
        if element.tag != tag {
            return Err(ValidityError::UnexpectedTag {
                expected,
                offset,
                found: element.tag,
            });
        }
        Ok(element.content)
    }
}

/// The end of the validity of the DER certificate `der`, in seconds since
/// the Unix epoch.
pub fn not_after_unix(der: &[u8]) -> Result<i64, ValidityError> {
    let certificate = Reader::new(der).expect(SEQUENCE, "the certificate (SEQUENCE)")?;
    let tbs = Reader::new(certificate).expect(SEQUENCE, "tbsCertificate (SEQUENCE)")?;
    let mut fields = Reader::new(tbs);
    if fields.peek_tag() == Some(VERSION) {
        fields.next()?;
    }
    fields.expect(INTEGER, "serialNumber (INTEGER)")?;
    fields.expect(SEQUENCE, "signature (SEQUENCE)")?;
    fields.expect(SEQUENCE, "issuer (SEQUENCE)")?;
    let validity = fields.expect(SEQUENCE, "validity (SEQUENCE)")?;
    let mut times = Reader::new(validity);
    times.next()?; // notBefore
    let offset = times.offset;
    let not_after = times.next()?;
    let text = std::str::from_utf8(not_after.content)
        .map_err(|_| ValidityError::Time(String::from_utf8_lossy(not_after.content).into()))?;
    match not_after.tag {
        UTC_TIME => unix_seconds(text, false),
        GENERALIZED_TIME => unix_seconds(text, true),
        found => Err(ValidityError::UnexpectedTag {
            expected: "notAfter (UTCTime or GeneralizedTime)",
            offset,
            found,
        }),
    }
}

/// `YYMMDDHHMMSSZ` (UTCTime: years 1950-2049) or `YYYYMMDDHHMMSSZ`
/// (GeneralizedTime), the only forms RFC 5280 allows, as Unix seconds.
fn unix_seconds(text: &str, four_digit_year: bool) -> Result<i64, ValidityError> {
    let bad = || ValidityError::Time(text.to_string());
    let digits = text.strip_suffix('Z').ok_or_else(bad)?;
    let year_digits = if four_digit_year { 4 } else { 2 };
    if digits.len() != year_digits + 10 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let number = |range: std::ops::Range<usize>| -> i64 {
        digits[range]
            .bytes()
            .fold(0, |n, digit| n * 10 + i64::from(digit - b'0'))
    };
    let year = match number(0..year_digits) {
        short if !four_digit_year && short >= 50 => 1900 + short,
        short if !four_digit_year => 2000 + short,
        long => long,
    };
    let at = year_digits;
    let (month, day) = (number(at..at + 2), number(at + 2..at + 4));
    let (hour, minute, second) = (
        number(at + 4..at + 6),
        number(at + 6..at + 8),
        number(at + 8..at + 10),
    );
    if !(1..=12).contains(&month)
        || !(1..=31).contains(&day)
        || hour > 23
        || minute > 59
        || second > 60
    {
        return Err(bad());
    }
    Ok(days_since_epoch(year, month, day) * 86_400 + hour * 3_600 + minute * 60 + second)
}

/// Days from 1970-01-01 to the given date of the proleptic Gregorian
/// calendar: whole 400-year eras (146,097 days each) counted from
/// 0000-03-01, so that the leap day ends a year.
fn days_since_epoch(year: i64, month: i64, day: i64) -> i64 {
    // Years start in March: January and February belong to the year before.
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let year_of_era = year - era * 400;
    let month_from_march = (month + 9) % 12;
    let day_of_year = (153 * month_from_march + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    // 719,468 days from 0000-03-01 to 1970-01-01.
    era * 146_097 + day_of_era - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::CertificateDer;

    fn fixture(name: &str) -> Vec<u8> {
        let path = format!("{}/tests/fixtures/tls/{name}", env!("CARGO_MANIFEST_DIR"));
        let first = CertificateDer::pem_file_iter(&path)
            .expect("fixture")
            .next()
            .expect("a certificate")
            .expect("PEM");
        first.to_vec()
    }

    #[test]
    fn dates_count_days_and_leap_years() {
        assert_eq!(days_since_epoch(1970, 1, 1), 0);
        assert_eq!(days_since_epoch(2000, 3, 1), 11_017);
        // 2024 is a leap year, 2100 is not.
        assert_eq!(
            days_since_epoch(2024, 3, 1) - days_since_epoch(2024, 2, 28),
            2
        );
        assert_eq!(
            days_since_epoch(2100, 3, 1) - days_since_epoch(2100, 2, 28),
            1
        );
        assert_eq!(days_since_epoch(1969, 12, 31), -1);
    }

    #[test]
    fn both_time_forms_read_as_unix_seconds() {
        // `date -u -d '2049-12-31 23:59:59' +%s`
        assert_eq!(unix_seconds("491231235959Z", false), Ok(2_524_607_999));
        // UTCTime's two-digit years from 50 are 19xx.
        assert_eq!(unix_seconds("700101000000Z", false), Ok(0));
        // `date -u -d '2126-10-29 04:47:26' +%s`
        assert_eq!(unix_seconds("21261029044726Z", true), Ok(4_948_922_846));
        for bad in [
            "491231235959",
            "4912312359Z",
            "20491231235959Z",
            "491331235959Z",
            "49123123595aZ",
        ] {
            assert!(unix_seconds(bad, false).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_certificates_end_is_read_from_its_validity() {
        // `openssl x509 -in tests/fixtures/tls/server.pem -noout -enddate`:
        // Oct 29 04:47:26 2126 GMT (a GeneralizedTime: after 2049).
        assert_eq!(not_after_unix(&fixture("server.pem")), Ok(4_948_922_846));
        // Nov 3 06:14:32 2126 GMT.
        assert_eq!(not_after_unix(&fixture("client.pem")), Ok(4_949_360_072));
    }

    #[test]
    fn cut_or_foreign_bytes_are_errors_not_panics() {
        let der = fixture("server.pem");
        for end in 0..der.len() {
            assert!(not_after_unix(&der[..end]).is_err(), "cut at {end}");
        }
        assert_eq!(not_after_unix(&[]), Err(ValidityError::Truncated));
        assert!(matches!(
            not_after_unix(&[0x02, 0x01, 0x00]),
            Err(ValidityError::UnexpectedTag {
                offset: 0,
                found: 0x02,
                ..
            })
        ));
        assert_eq!(
            not_after_unix(&[0x30, 0x85, 1, 1, 1, 1, 1]),
            Err(ValidityError::LengthTooLong)
        );
    }
}
