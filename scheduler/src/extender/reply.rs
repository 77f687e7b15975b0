//! The verbs' HTTP answers.

use serde::Serialize;

/// An HTTP answer: status and JSON body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reply {
    pub status: u16,
    pub body: Vec<u8>,
}

impl Reply {
    pub fn json<T: Serialize>(status: u16, value: &T) -> Self {
        Self::json_sized(status, value, 256)
    }

    /// Like [`Reply::json`], with room for about `capacity` bytes up front
    /// (answers listing thousands of nodes are not grown step by step).
    pub fn json_sized<T: Serialize>(status: u16, value: &T, capacity: usize) -> Self {
        let mut body = Vec::with_capacity(capacity);
        if serde_json::to_writer(&mut body, value).is_err() {
            body = b"{}".to_vec();
        }
        Self { status, body }
    }
}

/// A body carrying only an error, as kube-scheduler reads one.
#[derive(Serialize)]
pub struct ErrorBody {
    #[serde(rename = "Error")]
    pub error: String,
}
