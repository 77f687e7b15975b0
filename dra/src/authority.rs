//! Kubelet's plugin watcher dials a registration socket by its bare path,
//! so its gRPC client sends that path as the HTTP/2 `:authority`,
//! percent-encoded (`%2Fvar%2Flib%2Fkubelet%2F...`): not an authority, and
//! the HTTP/2 server under tonic resets such a stream with
//! PROTOCOL_ERROR before any service sees it, so kubelet could never ask
//! the driver who it is. (Kubelet's DRA client dials `unix:` targets and
//! sends `localhost`; only registration is affected.)
//!
//! [`AuthorityFix`] sits between the socket and the server and rewrites
//! the header blocks the client sends: each block is decoded (HPACK, with
//! the client's dynamic table) and sent on re-encoded as literals that
//! never enter a dynamic table, with an `:authority` that is not a valid
//! authority replaced by `localhost`. Every other frame passes unchanged.

use loona_hpack::decoder::Decoder;
use loona_hpack::encoder::encode_integer;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// What a client sends first.
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const FRAME_HEADER: usize = 9;
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// The frame size every HTTP/2 peer accepts; rewritten blocks are split
/// to it.
const MAX_FRAME: usize = 16_384;
/// The largest header block accepted from a client.
const MAX_BLOCK: usize = 1 << 20;
/// What replaces an authority that is not one.
const LOCALHOST: &[u8] = b"localhost";

fn invalid(message: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message.into())
}

/// A header block being collected from HEADERS and CONTINUATION frames.
struct Block {
    stream: u32,
    flags: u8,
    priority: Option<[u8; 5]>,
    fragment: Vec<u8>,
}

/// The client-to-server half of one connection, rewritten.
pub struct Rewriter {
    decoder: Decoder<'static>,
    preface_seen: bool,
    pending: Vec<u8>,
    block: Option<Block>,
}

impl Default for Rewriter {
    fn default() -> Self {
        Self {
            decoder: Decoder::new(),
            preface_seen: false,
            pending: Vec::new(),
            block: None,
        }
    }
}

/// A plain `host[:port]`.
fn valid_authority(value: &[u8]) -> bool {
    !value.is_empty()
        && value
            .iter()
            .all(|&b| b.is_ascii_alphanumeric() || b"-.:[]".contains(&b))
}

fn put_string(out: &mut Vec<u8>, bytes: &[u8]) {
    // Not Huffman-coded: the H bit of the length's prefix stays 0.
    out.extend(encode_integer(bytes.len(), 7));
    out.extend_from_slice(bytes);
}

fn frame_header(out: &mut Vec<u8>, length: usize, kind: u8, flags: u8, stream: u32) {
    let length = length as u32;
    out.extend_from_slice(&length.to_be_bytes()[1..]);
    out.push(kind);
    out.push(flags);
    out.extend_from_slice(&stream.to_be_bytes());
}

impl Rewriter {
    /// Takes bytes read from the client; returns what the server is to
    /// read.
    pub fn feed(&mut self, bytes: &[u8]) -> io::Result<Vec<u8>> {
        self.pending.extend_from_slice(bytes);
        let mut out = Vec::with_capacity(self.pending.len());
        if !self.preface_seen {
            if self.pending.len() < PREFACE.len() {
                return Ok(out);
            }
            // Not HTTP/2: pass it on and let the server say so.
            out.extend_from_slice(&self.pending[..PREFACE.len()]);
            self.pending.drain(..PREFACE.len());
            self.preface_seen = true;
        }
        let mut used = 0;
        while self.pending.len() - used >= FRAME_HEADER {
            let head = &self.pending[used..used + FRAME_HEADER];
            let length =
                (usize::from(head[0]) << 16) | (usize::from(head[1]) << 8) | usize::from(head[2]);
            if self.pending.len() - used < FRAME_HEADER + length {
                break;
            }
            let kind = head[3];
            let flags = head[4];
            let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
            let payload = &self.pending[used + FRAME_HEADER..used + FRAME_HEADER + length];
            match kind {
                HEADERS => {
                    let mut body = payload;
                    let mut padding = 0;
                    if flags & PADDED != 0 {
                        let (&pad, rest) = body
                            .split_first()
                            .ok_or_else(|| invalid("HEADERS frame too short for its padding"))?;
                        padding = usize::from(pad);
                        body = rest;
                    }
                    let mut priority = None;
                    if flags & PRIORITY != 0 {
                        let fields: [u8; 5] = body
                            .get(..5)
                            .and_then(|b| b.try_into().ok())
                            .ok_or_else(|| invalid("HEADERS frame too short for its priority"))?;
                        priority = Some(fields);
                        body = &body[5..];
                    }
                    let body = body
                        .get(
                            ..body
                                .len()
                                .checked_sub(padding)
                                .ok_or_else(|| invalid("HEADERS padding longer than the frame"))?,
                        )
                        .unwrap_or_default();
                    let block = Block {
                        stream,
                        flags: flags & !(PADDED | END_HEADERS),
                        priority,
                        fragment: body.to_vec(),
                    };
                    if flags & END_HEADERS != 0 {
                        self.emit(block, &mut out)?;
                    } else {
                        self.block = Some(block);
                    }
                }
                CONTINUATION => {
                    let mut block = self
                        .block
                        .take()
                        .ok_or_else(|| invalid("CONTINUATION without a header block"))?;
                    if block.stream != stream {
                        return Err(invalid("CONTINUATION of another stream"));
                    }
                    block.fragment.extend_from_slice(payload);
                    if block.fragment.len() > MAX_BLOCK {
                        return Err(invalid("header block too large"));
                    }
                    if flags & END_HEADERS != 0 {
                        self.emit(block, &mut out)?;
                    } else {
                        self.block = Some(block);
                    }
                }
                _ => out.extend_from_slice(&self.pending[used..used + FRAME_HEADER + length]),
            }
            used += FRAME_HEADER + length;
        }
        self.pending.drain(..used);
        Ok(out)
    }

    /// Decodes a whole block and writes it re-encoded.
    fn emit(&mut self, block: Block, out: &mut Vec<u8>) -> io::Result<()> {
        let headers = self
            .decoder
            .decode(&block.fragment)
            .map_err(|error| invalid(format!("header block: {error}")))?;
        let mut encoded = Vec::with_capacity(block.fragment.len() + 32);
        if let Some(priority) = block.priority {
            encoded.extend_from_slice(&priority);
        }
        for (name, value) in &headers {
            let value: &[u8] = if name == b":authority" && !valid_authority(value) {
                LOCALHOST
            } else {
                value
            };
            // Literal header field without indexing, new name.
            encoded.push(0);
            put_string(&mut encoded, name);
            put_string(&mut encoded, value);
        }
        let mut chunks = encoded.chunks(MAX_FRAME).peekable();
        let mut first = true;
        while let Some(chunk) = chunks.next() {
            let last = chunks.peek().is_none();
            let (kind, mut flags) = if first {
                (HEADERS, block.flags)
            } else {
                (CONTINUATION, 0)
            };
            if last {
                flags |= END_HEADERS;
            }
            frame_header(out, chunk.len(), kind, flags, block.stream);
            out.extend_from_slice(chunk);
            first = false;
        }
        Ok(())
    }
}

/// A connection whose client-to-server header blocks go through a
/// [`Rewriter`].
pub struct AuthorityFix<S> {
    inner: S,
    rewriter: Rewriter,
    ready: Vec<u8>,
    offset: usize,
}

impl<S> AuthorityFix<S> {
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            rewriter: Rewriter::default(),
            ready: Vec::new(),
            offset: 0,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for AuthorityFix<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        loop {
            if this.offset < this.ready.len() {
                let n = buf.remaining().min(this.ready.len() - this.offset);
                buf.put_slice(&this.ready[this.offset..this.offset + n]);
                this.offset += n;
                return Poll::Ready(Ok(()));
            }
            let mut scratch = [0u8; 8192];
            let mut read = ReadBuf::new(&mut scratch);
            match Pin::new(&mut this.inner).poll_read(cx, &mut read) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(error)) => return Poll::Ready(Err(error)),
                Poll::Ready(Ok(())) if read.filled().is_empty() => return Poll::Ready(Ok(())),
                Poll::Ready(Ok(())) => {
                    this.ready = this.rewriter.feed(read.filled())?;
                    this.offset = 0;
                }
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for AuthorityFix<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

impl<S> tonic::transport::server::Connected for AuthorityFix<S> {
    type ConnectInfo = ();

    fn connect_info(&self) -> Self::ConnectInfo {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use loona_hpack::encoder::Encoder;

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        frame_header(&mut out, payload.len(), kind, flags, stream);
        out.extend_from_slice(payload);
        out
    }

    fn frames(mut bytes: &[u8]) -> Vec<(u8, u8, u32, Vec<u8>)> {
        let mut found = Vec::new();
        while !bytes.is_empty() {
            let length = (usize::from(bytes[0]) << 16)
                | (usize::from(bytes[1]) << 8)
                | usize::from(bytes[2]);
            let stream = u32::from_be_bytes([bytes[5], bytes[6], bytes[7], bytes[8]]);
            found.push((bytes[3], bytes[4], stream, bytes[9..9 + length].to_vec()));
            bytes = &bytes[9 + length..];
        }
        found
    }

    #[test]
    fn a_socket_path_authority_becomes_localhost_and_the_rest_is_kept() {
        let mut client = Encoder::new();
        let request: Vec<(&[u8], &[u8])> = vec![
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", b"/pluginregistration.Registration/GetInfo"),
            (
                b":authority",
                b"/var/lib/kubelet/plugins_registry/vgpu.io-reg.sock",
            ),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
        ];
        // Two requests: the second refers to the client's dynamic table.
        let first = client.encode(request.clone());
        let second = client.encode(request.clone());
        let settings = frame(0x4, 0, 0, &[0, 3, 0, 0, 0, 100]);
        let (head, tail) = second.split_at(second.len() / 2);
        let mut input = PREFACE.to_vec();
        input.extend(&settings);
        input.extend(frame(HEADERS, END_HEADERS, 1, &first));
        input.extend(frame(0x0, 0x1, 1, b"data"));
        input.extend(frame(HEADERS, 0, 3, head));
        input.extend(frame(CONTINUATION, END_HEADERS, 3, tail));

        let mut rewriter = Rewriter::default();
        // Fed in small pieces, as a socket may deliver it.
        let mut output = Vec::new();
        for piece in input.chunks(7) {
            output.extend(rewriter.feed(piece).expect("feed"));
        }
        assert_eq!(&output[..PREFACE.len()], PREFACE);
        let found = frames(&output[PREFACE.len()..]);
        assert_eq!(found.len(), 4, "the split block becomes one frame");
        assert_eq!(found[0].3, settings[9..], "SETTINGS unchanged");
        assert_eq!(
            (found[2].0, found[2].3.as_slice()),
            (0x0, b"data".as_slice())
        );
        let mut server = Decoder::new();
        for (index, stream) in [(1, 1), (3, 3)] {
            let (kind, flags, id, block) = &found[index];
            assert_eq!(
                (*kind, *flags & END_HEADERS, *id),
                (HEADERS, END_HEADERS, stream)
            );
            let headers = server.decode(block).expect("decode");
            let expected: Vec<(Vec<u8>, Vec<u8>)> = request
                .iter()
                .map(|(name, value)| {
                    let value = if *name == b":authority" {
                        LOCALHOST
                    } else {
                        value
                    };
                    (name.to_vec(), value.to_vec())
                })
                .collect();
            assert_eq!(headers, expected);
        }
    }

    #[test]
    fn a_valid_authority_is_kept_and_garbage_is_refused() {
        let mut client = Encoder::new();
        let block = client.encode(vec![(b":authority".as_slice(), b"localhost:80".as_slice())]);
        let mut input = PREFACE.to_vec();
        input.extend(frame(HEADERS, END_HEADERS, 1, &block));
        let output = Rewriter::default().feed(&input).expect("feed");
        let found = frames(&output[PREFACE.len()..]);
        let headers = Decoder::new().decode(&found[0].3).expect("decode");
        assert_eq!(headers[0].1, b"localhost:80");

        let mut bad = PREFACE.to_vec();
        bad.extend(frame(CONTINUATION, END_HEADERS, 1, b"x"));
        assert!(Rewriter::default().feed(&bad).is_err());
        let mut bad = PREFACE.to_vec();
        bad.extend(frame(HEADERS, END_HEADERS, 1, &[0xff, 0xff, 0xff]));
        assert!(Rewriter::default().feed(&bad).is_err());
    }
}
