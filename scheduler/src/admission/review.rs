//! The envelope the API server sends a webhook and the answers to a body
//! that is not one.

use serde::Deserialize;
use serde_json::json;

/// The envelope the API server sends a webhook (an `AdmissionReview`, a
/// `ConversionReview`), as much of it as is read; `R` is its request.
#[derive(Debug, Deserialize)]
pub(crate) struct Review<R> {
    #[serde(rename = "apiVersion")]
    pub api_version: Option<String>,
    pub kind: Option<String>,
    pub request: Option<R>,
}

impl<R: serde::de::DeserializeOwned> Review<R> {
    /// Reads `body` as a review of `kind`; the reply for a body that is
    /// not one.
    pub fn read(body: &[u8], kind: &str) -> Result<(Option<String>, R), WebhookReply> {
        let review: Self = serde_json::from_slice(body)
            .map_err(|error| bad_request(format!("not a{} {kind}: {error}", article(kind))))?;
        if review.kind.as_deref() != Some(kind) {
            return Err(bad_request(format!(
                "expected kind {kind}, got {:?}",
                review.kind.unwrap_or_default()
            )));
        }
        match review.request {
            Some(request) => Ok((review.api_version, request)),
            None => Err(bad_request(format!("the {kind} has no request"))),
        }
    }
}

fn article(word: &str) -> &'static str {
    if word.starts_with(['A', 'E', 'I', 'O', 'U']) {
        "n"
    } else {
        ""
    }
}

/// The webhook's answer: HTTP status and JSON body.
#[derive(Debug)]
pub struct WebhookReply {
    pub status: u16,
    pub body: Vec<u8>,
}

/// A `400` naming what is wrong with the request.
pub fn bad_request(message: String) -> WebhookReply {
    WebhookReply {
        status: 400,
        body: json!({ "error": message }).to_string().into_bytes(),
    }
}
