//! Who a DRA claim's region belongs to: the file `claim.owner` the DRA
//! driver writes beside the region of a claim (`claim-<uid>/`), read by the
//! node monitor to name the claim's series by namespace, pods and claim.
//!
//! The format is lines of `key=value` (`namespace`, `claim`, and one `pod`
//! line per pod the claim is reserved for), so that it needs no parser
//! beyond this one; unknown keys are ignored.

use std::fmt;

/// The prefix of a claim's region directory, `claim-<uid>` (no `_`: it is
/// not a pod's container).
pub const CLAIM_DIR_PREFIX: &str = "claim-";
/// The owner file's name in a claim's directory.
pub const CLAIM_OWNER_FILE: &str = "claim.owner";

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClaimOwner {
    pub namespace: String,
    pub claim: String,
    /// The pods the claim was reserved for when it was prepared.
    pub pods: Vec<String>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ClaimOwnerError {
    #[error("line {0:?} is not key=value")]
    NotKeyValue(String),
    #[error("no {0} line")]
    Missing(&'static str),
    #[error("a value holds a line break")]
    LineBreak,
}

impl ClaimOwner {
    /// The file's text; names with a line break cannot be written (no
    /// Kubernetes name has one).
    pub fn to_text(&self) -> Result<String, ClaimOwnerError> {
        let values = [&self.namespace, &self.claim].into_iter().chain(&self.pods);
        if values.into_iter().any(|value| value.contains('\n')) {
            return Err(ClaimOwnerError::LineBreak);
        }
        Ok(self.to_string())
    }

    pub fn parse(text: &str) -> Result<Self, ClaimOwnerError> {
        let mut owner = Self::default();
        let (mut namespace, mut claim) = (false, false);
        for line in text.lines().filter(|line| !line.trim().is_empty()) {
            let (key, value) = line
                .split_once('=')
                .ok_or_else(|| ClaimOwnerError::NotKeyValue(line.to_string()))?;
            match key {
                "namespace" => (owner.namespace, namespace) = (value.to_string(), true),
                "claim" => (owner.claim, claim) = (value.to_string(), true),
                "pod" => owner.pods.push(value.to_string()),
                _ => {}
            }
        }
        if !namespace {
            return Err(ClaimOwnerError::Missing("namespace"));
        }
        if !claim {
            return Err(ClaimOwnerError::Missing("claim"));
        }
        Ok(owner)
    }
}

impl fmt::Display for ClaimOwner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "namespace={}", self.namespace)?;
        writeln!(f, "claim={}", self.claim)?;
        for pod in &self.pods {
            writeln!(f, "pod={pod}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_refuses_what_it_cannot_read() {
        let owner = ClaimOwner {
            namespace: "ml".into(),
            claim: "train-gpu-x7".into(),
            pods: vec!["train-0".into(), "train-1".into()],
        };
        let text = owner.to_text().expect("text");
        assert_eq!(
            text,
            "namespace=ml\nclaim=train-gpu-x7\npod=train-0\npod=train-1\n"
        );
        assert_eq!(ClaimOwner::parse(&text), Ok(owner));
        assert_eq!(
            ClaimOwner::parse("namespace=a\nclaim=b\nlater=ignored\n").map(|o| o.pods.len()),
            Ok(0)
        );
        assert_eq!(
            ClaimOwner::parse("claim=b\n"),
            Err(ClaimOwnerError::Missing("namespace"))
        );
        assert!(matches!(
            ClaimOwner::parse("namespace=a\nnonsense\n"),
            Err(ClaimOwnerError::NotKeyValue(_))
        ));
        let bad = ClaimOwner {
            namespace: "a\nb".into(),
            ..ClaimOwner::default()
        };
        assert_eq!(bad.to_text(), Err(ClaimOwnerError::LineBreak));
    }
}
