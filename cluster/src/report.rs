//! How an error is written where a Kubernetes component shows only one
//! message (kubelet's gRPC status, kube-scheduler's extender error): the
//! error and each of its causes, on one line.

use std::error::Error;

/// `error: cause: cause's cause ...`.
pub fn with_causes(error: &(dyn Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(next) = cause {
        text.push_str(": ");
        text.push_str(&next.to_string());
        cause = next.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("outer")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn every_cause_is_written() {
        let error = Outer(std::io::Error::other("inner"));
        assert_eq!(with_causes(&error), "outer: inner");
        assert_eq!(with_causes(&std::io::Error::other("alone")), "alone");
    }
}
