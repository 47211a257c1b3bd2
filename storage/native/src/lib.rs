//! hyperkafka's native core: the per-byte work of the produce path, with the GIL released.
//!
//! `storage._native` exports:
//! * `validate_records(batch, max_inflated, check_ts, low, high)`: every record of one
//!   whole v2 batch (header already checked by Python), by the rules of
//!   `broker/validation.py`, whose pure-Python twin it must agree with
//!   (same codes, same record index). Returns `(code, record_index, message, max_ts)`;
//!   code 0 is accepted, 2 CORRUPT_MESSAGE, 32 INVALID_TIMESTAMP, 87 INVALID_RECORD.
//!   Compressed records are inflated as a stream through a small window, so a bomb
//!   costs CPU up to the cap and no memory.
//! * `check_batch(batch, max_inflated, check_ts, low, high)`: the per-byte work of one
//!   produced batch in one call: CRC-32C of bytes 21.. (the caller compares it with the
//!   stored one in its own order of checks), then `validate_records`' walk. Returns
//!   `(crc, code, record_index, message, max_ts)`.
//! * `crc32c(buffer)`: CRC-32C (hardware instructions where the CPU has them).
//! * `leaf_hashes(buffers)`: Hypercore leaf hashes, BLAKE2b-256(0x00 ‖ u64le(len) ‖
//!   block), several blocks at once in SIMD lanes (blake2b_simd's `many`).
//!
//! Every function takes its buffers (and checks them) with the GIL, then does all of its
//! per-byte work inside one `allow_threads` closure, which touches no Python object: the
//! GIL is released for the whole of the hashing, checksumming, inflating and walking
//! (broker/tests/test_record_validation.py runs a thread during a long call to show it).
//! The leaf hash is not part of `check_batch`: it covers the base offset the log writes
//! into the batch after the check, and the commit round hashes all its batches at once.
//!
//! Nothing here panics on input bytes: every read is bounds-checked, every length is
//! compared with what remains before it is used, and nothing is allocated from a length
//! the input states (raw snappy's stated size is checked against the cap first).

use std::io::Read;

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

const OK: i32 = 0;
const CORRUPT_MESSAGE: i32 = 2;
const INVALID_TIMESTAMP: i32 = 32;
const INVALID_RECORD: i32 = 87;

const HEADER: usize = 61;
const NO_TIMESTAMP: i64 = -1;
const WINDOW: usize = 64 * 1024;
const XERIAL_MAGIC: &[u8] = b"\x82SNAPPY\x00";

/// Why a batch is refused: code, index of the first bad record (-1: none), message.
struct Verdict {
    code: i32,
    index: i64,
    message: String,
}

fn verdict(code: i32, index: i64, message: String) -> Verdict {
    Verdict { code, index, message }
}

/// An error of the inflated stream itself (it wins over record errors, as in Python,
/// which inflates the whole payload before reading a record).
enum StreamError {
    Corrupt(String),
    TooLarge,
}

/// A decoder's way to say the cap is reached before it allocates (raw snappy).
#[derive(Debug)]
struct OverCap;

impl std::fmt::Display for OverCap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("inflated size past the cap")
    }
}

impl std::error::Error for OverCap {}

/// A source of record bytes: the batch itself, or an inflating stream.
trait Input {
    /// The next byte, or None at the end of the records.
    fn byte(&mut self) -> Result<Option<u8>, StreamError>;
    /// Skip up to `n` bytes; how many there were.
    fn skip(&mut self, n: u64) -> Result<u64, StreamError>;
    /// Whether any byte remains.
    fn at_end(&mut self) -> Result<bool, StreamError>;
    /// Read to the end (so that a stream error past a record error still wins).
    fn drain(&mut self) -> Result<u64, StreamError> {
        let mut n = 0;
        loop {
            let k = self.skip(u64::MAX)?;
            if k == 0 {
                return Ok(n);
            }
            n += k;
        }
    }
}

struct Slice<'a> {
    data: &'a [u8],
    pos: usize,
}

impl Input for Slice<'_> {
    #[inline]
    fn byte(&mut self) -> Result<Option<u8>, StreamError> {
        let b = self.data.get(self.pos).copied();
        if b.is_some() {
            self.pos += 1;
        }
        Ok(b)
    }
    #[inline]
    fn skip(&mut self, n: u64) -> Result<u64, StreamError> {
        let left = (self.data.len() - self.pos) as u64;
        let k = n.min(left);
        self.pos += k as usize;
        Ok(k)
    }
    #[inline]
    fn at_end(&mut self) -> Result<bool, StreamError> {
        Ok(self.pos >= self.data.len())
    }
}

/// An inflating reader seen through a fixed window, counting what it produced.
struct Stream<R: Read> {
    inner: R,
    buf: Vec<u8>,
    pos: usize,
    len: usize,
    total: u64,
    cap: u64,
    done: bool,
}

impl<R: Read> Stream<R> {
    fn new(inner: R, cap: u64) -> Self {
        Stream { inner, buf: vec![0; WINDOW], pos: 0, len: 0, total: 0, cap, done: false }
    }

    fn fill(&mut self) -> Result<bool, StreamError> {
        if self.pos < self.len {
            return Ok(true);
        }
        if self.done {
            return Ok(false);
        }
        loop {
            // Inflate at most two bytes past the cap and call it too large only then (or
            // at the end): exactly what the Python twin's bounded reads see, so a decoder
            // error near the cap gets the same verdict on both paths.
            let want = (self.cap + 2).saturating_sub(self.total).min(WINDOW as u64) as usize;
            if want == 0 {
                return Err(StreamError::TooLarge);
            }
            match self.inner.read(&mut self.buf[..want]) {
                Ok(0) => {
                    self.done = true;
                    if self.total > self.cap {
                        return Err(StreamError::TooLarge);
                    }
                    return Ok(false);
                }
                Ok(n) => {
                    self.total += n as u64;
                    if self.total > self.cap + 1 {
                        return Err(StreamError::TooLarge);
                    }
                    self.pos = 0;
                    self.len = n;
                    return Ok(true);
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) if e.get_ref().is_some_and(|x| x.is::<OverCap>()) => return Err(StreamError::TooLarge),
                // A payload cut short is judged once its output is known, as in Python
                // (size first, then "truncated"); bad data is corrupt at once.
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && self.total > self.cap => {
                    return Err(StreamError::TooLarge)
                }
                Err(e) => return Err(StreamError::Corrupt(e.to_string())),
            }
        }
    }
}

impl<R: Read> Input for Stream<R> {
    #[inline]
    fn byte(&mut self) -> Result<Option<u8>, StreamError> {
        if !self.fill()? {
            return Ok(None);
        }
        let b = self.buf[self.pos];
        self.pos += 1;
        Ok(Some(b))
    }
    fn skip(&mut self, n: u64) -> Result<u64, StreamError> {
        let mut left = n;
        while left > 0 && self.fill()? {
            let k = ((self.len - self.pos) as u64).min(left);
            self.pos += k as usize;
            left -= k;
        }
        Ok(n - left)
    }
    fn at_end(&mut self) -> Result<bool, StreamError> {
        Ok(!self.fill()?)
    }
}

/// Raw snappy blocks (one, or xerial-framed) inflated block by block, each block's
/// stated size checked against what is left of the cap before anything is allocated.
struct Snappy<'a> {
    data: &'a [u8],
    pos: usize,
    xerial: bool,
    out: Vec<u8>,
    out_pos: usize,
    budget: u64,
    started: bool,
}

impl<'a> Snappy<'a> {
    fn new(data: &'a [u8], cap: u64) -> Self {
        let xerial = data.starts_with(XERIAL_MAGIC);
        Snappy { data, pos: if xerial { 16 } else { 0 }, xerial, out: Vec::new(), out_pos: 0, budget: cap, started: false }
    }

    fn block(&mut self, block: &[u8]) -> std::io::Result<()> {
        let size = snappy_stated_size(block)
            .ok_or_else(|| std::io::Error::other("snappy block has no valid length header"))?;
        if size > self.budget {
            return Err(std::io::Error::other(OverCap));
        }
        let out = snap::raw::Decoder::new()
            .decompress_vec(block)
            .map_err(|e| std::io::Error::other(e.to_string()))?;
        self.budget -= out.len() as u64;
        self.out = out;
        self.out_pos = 0;
        Ok(())
    }
}

/// The block header's stated length, read as Python's `_uvarint_plain` reads it.
fn snappy_stated_size(block: &[u8]) -> Option<u64> {
    let mut result: u64 = 0;
    let mut shift = 0;
    for &b in block {
        result |= u64::from(b & 0x7F) << shift;
        if b & 0x80 == 0 {
            return Some(result);
        }
        shift += 7;
        if shift > 35 {
            return None;
        }
    }
    None
}

impl Read for Snappy<'_> {
    fn read(&mut self, dst: &mut [u8]) -> std::io::Result<usize> {
        while self.out_pos >= self.out.len() {
            if !self.xerial {
                if self.started {
                    return Ok(0);
                }
                self.started = true;
                let data = self.data;
                self.block(data)?;
                continue;
            }
            if self.pos >= self.data.len() {
                return Ok(0);
            }
            if self.pos + 4 > self.data.len() {
                return Err(std::io::Error::other("xerial snappy block length cut short"));
            }
            let n = i32::from_be_bytes(self.data[self.pos..self.pos + 4].try_into().unwrap());
            self.pos += 4;
            if n < 0 || self.pos + n as usize > self.data.len() {
                return Err(std::io::Error::other("xerial snappy block runs past the data"));
            }
            let data = self.data;
            let block = &data[self.pos..self.pos + n as usize];
            self.pos += n as usize;
            self.block(block)?;
        }
        let k = dst.len().min(self.out.len() - self.out_pos);
        dst[..k].copy_from_slice(&self.out[self.out_pos..self.out_pos + k]);
        self.out_pos += k;
        Ok(k)
    }
}

/// gzip members (or zlib streams, as Python's wbits=47 auto-detects) one after another,
/// each decoder owning the rest of the input and handing back what it did not consume.
enum Member<'a> {
    Gz(flate2::bufread::GzDecoder<&'a [u8]>),
    Zlib(flate2::bufread::ZlibDecoder<&'a [u8]>),
}

struct Deflate<'a> {
    member: Option<Member<'a>>,
}

impl<'a> Deflate<'a> {
    fn new(data: &'a [u8]) -> Self {
        Deflate { member: Some(Self::start(data)) }
    }

    fn start(data: &'a [u8]) -> Member<'a> {
        if data.starts_with(&[0x1f, 0x8b]) {
            Member::Gz(flate2::bufread::GzDecoder::new(data))
        } else {
            Member::Zlib(flate2::bufread::ZlibDecoder::new(data))
        }
    }
}

impl Read for Deflate<'_> {
    fn read(&mut self, dst: &mut [u8]) -> std::io::Result<usize> {
        loop {
            let n = match self.member.as_mut() {
                None => return Ok(0),
                Some(Member::Gz(d)) => d.read(dst)?,
                Some(Member::Zlib(d)) => d.read(dst)?,
            };
            if n > 0 || dst.is_empty() {
                return Ok(n);
            }
            let rest = match self.member.take() {
                Some(Member::Gz(d)) => d.into_inner(),
                Some(Member::Zlib(d)) => d.into_inner(),
                None => return Ok(0),
            };
            if rest.is_empty() {
                return Ok(0);
            }
            self.member = Some(Self::start(rest));
        }
    }
}

/// Walk the LZ4 frames' structure (header, block sizes, end mark, checksums) without
/// decoding: lz4_flex takes a frame cut before its end mark as complete; liblz4 (the
/// Python twin's) and Kafka's reader do not.
fn lz4_frames_whole(data: &[u8]) -> Result<(), String> {
    let mut pos = 0usize;
    let take = |pos: &mut usize, n: usize| -> Result<usize, String> {
        let at = *pos;
        if n > data.len() - at {
            return Err("lz4 data is truncated".into());
        }
        *pos += n;
        Ok(at)
    };
    while pos < data.len() {
        let at = take(&mut pos, 4)?;
        if data[at..at + 4] != [0x04, 0x22, 0x4d, 0x18] {
            return Err("not an lz4 frame".into());
        }
        let at = take(&mut pos, 2)?;
        let flg = data[at];
        let header_len = 1 + if flg & 0x08 != 0 { 8 } else { 0 } + if flg & 0x01 != 0 { 4 } else { 0 };
        take(&mut pos, header_len)?;
        loop {
            let at = take(&mut pos, 4)?;
            let raw = u32::from_le_bytes(data[at..at + 4].try_into().unwrap());
            if raw == 0 {
                break; // the end mark (an uncompressed block of 0 bytes is not one)
            }
            let size = raw & 0x7fff_ffff;
            take(&mut pos, size as usize + if flg & 0x10 != 0 { 4 } else { 0 })?;
        }
        if flg & 0x04 != 0 {
            take(&mut pos, 4)?;
        }
    }
    Ok(())
}

/// lz4_flex's frame decoder, plus what the structural walk found: a frame cut short is
/// reported where the decoder would have ended.
struct Lz4<'a> {
    inner: lz4_flex::frame::FrameDecoder<&'a [u8]>,
    shape: Option<String>,
}

impl Read for Lz4<'_> {
    fn read(&mut self, dst: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(dst)?;
        if n == 0 && !dst.is_empty() {
            if let Some(m) = self.shape.take() {
                let kind = if m.contains("truncated") { std::io::ErrorKind::UnexpectedEof } else { std::io::ErrorKind::InvalidData };
                return Err(std::io::Error::new(kind, m));
            }
        }
        Ok(n)
    }
}

/// A record's fields, read within its stated length.
enum Field {
    Short(&'static str),
    Bad(String),
}

struct Rec<'i, I: Input> {
    input: &'i mut I,
    left: u64,
}

impl<I: Input> Rec<'_, I> {
    #[inline]
    fn byte(&mut self, what: &'static str) -> Result<u8, Result<Field, StreamError>> {
        if self.left == 0 {
            return Err(Ok(Field::Short(what)));
        }
        match self.input.byte() {
            Err(e) => Err(Err(e)),
            Ok(None) => Err(Ok(Field::Short(what))),
            Ok(Some(b)) => {
                self.left -= 1;
                Ok(b)
            }
        }
    }

    #[inline]
    fn varint(&mut self, what: &'static str, max_bytes: u32) -> Result<i64, Result<Field, StreamError>> {
        let bits = if max_bytes == 5 { 32 } else { 64 };
        let mut raw: u128 = 0;
        let mut shift = 0;
        for _ in 0..max_bytes {
            let b = self.byte(what)?;
            raw |= u128::from(b & 0x7F) << shift;
            if b & 0x80 == 0 {
                if raw >> bits != 0 {
                    return Err(Ok(Field::Bad(format!("{what} varint is wider than {bits} bits"))));
                }
                let raw = raw as u64;
                return Ok(((raw >> 1) as i64) ^ -((raw & 1) as i64));
            }
            shift += 7;
        }
        Err(Ok(Field::Bad(format!("{what} varint is longer than {max_bytes} bytes"))))
    }

    #[inline]
    fn skip(&mut self, n: i64, what: &'static str) -> Result<(), Result<Field, StreamError>> {
        let n = n as u64;
        if n > self.left {
            return Err(Ok(Field::Bad(format!("{what} of {n} bytes runs past the record"))));
        }
        match self.input.skip(n) {
            Err(e) => Err(Err(e)),
            Ok(k) if k < n => Err(Ok(Field::Bad(format!("{what} of {n} bytes runs past the record")))),
            Ok(_) => {
                self.left -= n;
                Ok(())
            }
        }
    }
}

fn field_message(f: Field) -> String {
    match f {
        Field::Short(what) => format!("{what} runs past the record"),
        Field::Bad(m) => m,
    }
}

/// The fields of one record after its length; returns (timestamp delta, offset delta).
fn record_body<I: Input>(rec: &mut Rec<'_, I>) -> Result<(i64, i64), Result<Field, StreamError>> {
    rec.byte("attributes")?;
    let ts_delta = rec.varint("timestamp delta", 10)?;
    let offset_delta = rec.varint("offset delta", 5)?;
    for (what_len, what) in [("key length", "key"), ("value length", "value")] {
        let n = rec.varint(what_len, 5)?;
        if n < -1 {
            return Err(Ok(Field::Bad(format!("{what} length {n} is negative"))));
        }
        if n > 0 {
            rec.skip(n, what)?;
        }
    }
    let n_headers = rec.varint("header count", 5)?;
    if n_headers < 0 {
        return Err(Ok(Field::Bad(format!("header count {n_headers} is negative"))));
    }
    for _ in 0..n_headers {
        let n = rec.varint("header key length", 5)?;
        if n < 0 {
            return Err(Ok(Field::Bad(format!("header key length {n}: a header key may not be null"))));
        }
        rec.skip(n, "header key")?;
        let n = rec.varint("header value length", 5)?;
        if n < -1 {
            return Err(Ok(Field::Bad(format!("header value length {n} is negative"))));
        }
        if n > 0 {
            rec.skip(n, "header value")?;
        }
    }
    if rec.left != 0 {
        return Err(Ok(Field::Bad(format!("{} bytes left over after the record's fields", rec.left))));
    }
    Ok((ts_delta, offset_delta))
}

struct Batch {
    count: i64,
    base_ts: i64,
    fixed_ts: Option<i64>,
}

fn stream_verdict(e: StreamError, codec: &str, cap: u64) -> Verdict {
    match e {
        StreamError::Corrupt(m) => verdict(CORRUPT_MESSAGE, -1, format!("cannot decompress ({codec}): {m}")),
        StreamError::TooLarge => verdict(
            INVALID_RECORD,
            -1,
            format!("records inflate past {cap} bytes (64 x max.message.bytes)"),
        ),
    }
}

#[inline(always)]
fn zigzag(raw: u64) -> i64 {
    ((raw >> 1) as i64) ^ -((raw & 1) as i64)
}

/// A varint (5 bytes, 32 bits) or varlong (10, 64) at d[*p..]; None for anything the
/// careful path would refuse.
#[inline(always)]
fn fast_varint(d: &[u8], p: &mut usize, max_bytes: u32) -> Option<i64> {
    let b0 = *d.get(*p)?;
    if b0 < 0x80 {
        *p += 1;
        return Some(zigzag(u64::from(b0)));
    }
    let mut raw: u64 = 0;
    let mut shift = 0;
    for k in 0..max_bytes {
        let b = *d.get(*p)?;
        *p += 1;
        if k == 9 && b & 0x7f > 1 {
            return None;
        }
        raw |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            if max_bytes == 5 && raw >> 32 != 0 {
                return None;
            }
            return Some(zigzag(raw));
        }
        shift += 7;
    }
    None
}

#[inline(always)]
fn fast_skip(d: &[u8], p: &mut usize, n: i64) -> Option<()> {
    if n > 0 {
        if n as u64 > (d.len() - *p) as u64 {
            return None;
        }
        *p += n as usize;
    }
    Some(())
}

/// The hot path for uncompressed records: the same rules as `walk` over plain indices.
/// It only says "all good" (the max timestamp) or None; a None batch is walked again by
/// `walk`, which finds and words the verdict, so the two can only differ in speed.
fn fast_walk(data: &[u8], b: &Batch, ts: Option<(i64, i64)>) -> Option<i64> {
    let mut p = 0usize;
    let mut max_ts = NO_TIMESTAMP;
    for i in 0..b.count {
        let length = fast_varint(data, &mut p, 5)?;
        if length < 0 || length as u64 > (data.len() - p) as u64 {
            return None;
        }
        let rec = &data[p..p + length as usize];
        p += length as usize;
        let mut q = 1usize;
        if rec.is_empty() {
            return None;
        }
        let ts_delta = fast_varint(rec, &mut q, 10)?;
        if fast_varint(rec, &mut q, 5)? != i {
            return None;
        }
        for _ in 0..2 {
            let n = fast_varint(rec, &mut q, 5)?;
            if n < -1 {
                return None;
            }
            fast_skip(rec, &mut q, n)?;
        }
        let n_headers = fast_varint(rec, &mut q, 5)?;
        if n_headers < 0 {
            return None;
        }
        for _ in 0..n_headers {
            let n = fast_varint(rec, &mut q, 5)?;
            if n < 0 {
                return None;
            }
            fast_skip(rec, &mut q, n)?;
            let n = fast_varint(rec, &mut q, 5)?;
            if n < -1 {
                return None;
            }
            fast_skip(rec, &mut q, n)?;
        }
        if q != rec.len() {
            return None;
        }
        let t = b.fixed_ts.unwrap_or_else(|| b.base_ts.wrapping_add(ts_delta));
        if let Some((low, high)) = ts {
            if t != NO_TIMESTAMP && !(low <= t && t <= high) {
                return None;
            }
        }
        max_ts = max_ts.max(t);
    }
    if p != data.len() {
        return None;
    }
    Some(max_ts)
}

/// Walk every record; Ok(max timestamp) or the verdict. `codec` names stream errors.
fn walk<I: Input>(input: &mut I, b: &Batch, ts: Option<(i64, i64)>, codec: &str, cap: u64) -> Result<i64, Verdict> {
    // A record error is final only once the stream is known to inflate cleanly.
    let settle = |input: &mut I, v: Verdict| -> Verdict {
        match input.drain() {
            Ok(_) => v,
            Err(e) => stream_verdict(e, codec, cap),
        }
    };
    let mut max_ts = NO_TIMESTAMP;
    let mut late: Option<(i64, i64)> = None;
    for i in 0..b.count {
        let at_end = match input.at_end() {
            Ok(x) => x,
            Err(e) => return Err(stream_verdict(e, codec, cap)),
        };
        if at_end {
            let v = verdict(INVALID_RECORD, i, format!("record {i} is missing: the batch declares {} records", b.count));
            return Err(settle(input, v));
        }
        // The length varint is read against the rest of the records, not a record.
        let mut outer = Rec { input: &mut *input, left: u64::MAX };
        let length = match outer.varint("length", 5) {
            Ok(n) => n,
            Err(Err(e)) => return Err(stream_verdict(e, codec, cap)),
            Err(Ok(f)) => {
                let v = verdict(INVALID_RECORD, i, format!("record {i}: {}", field_message(f)));
                return Err(settle(input, v));
            }
        };
        if length < 0 {
            let v = verdict(INVALID_RECORD, i, format!("record {i}: length {length} runs past the bytes left"));
            return Err(settle(input, v));
        }
        let mut rec = Rec { input: &mut *input, left: length as u64 };
        let body = record_body(&mut rec);
        let ran_out = rec.left > 0;
        let (ts_delta, offset_delta) = match body {
            Ok(x) => x,
            Err(Err(e)) => return Err(stream_verdict(e, codec, cap)),
            Err(Ok(f)) => {
                // The Python twin checks the length against the bytes left first.
                let msg = if ran_out && matches!(f, Field::Short(_)) && input.at_end().unwrap_or(true) {
                    format!("record {i}: length {length} runs past the bytes left")
                } else {
                    format!("record {i}: {}", field_message(f))
                };
                return Err(settle(input, verdict(INVALID_RECORD, i, msg)));
            }
        };
        if offset_delta != i {
            let v = verdict(INVALID_RECORD, i, format!("record {i}: offset delta {offset_delta}, expected {i}"));
            return Err(settle(input, v));
        }
        let t = b.fixed_ts.unwrap_or_else(|| b.base_ts.wrapping_add(ts_delta));
        if t > max_ts {
            max_ts = t;
        }
        if let Some((low, high)) = ts {
            if late.is_none() && t != NO_TIMESTAMP && !(low <= t && t <= high) {
                late = Some((i, t));
            }
        }
    }
    match input.drain() {
        Err(e) => return Err(stream_verdict(e, codec, cap)),
        Ok(0) => {}
        Ok(n) => {
            return Err(verdict(
                INVALID_RECORD,
                -1,
                format!("{n} bytes after the last of the {} records", b.count),
            ))
        }
    }
    if let (Some((i, t)), Some((low, high))) = (late, ts) {
        return Err(verdict(INVALID_TIMESTAMP, i, format!("record {i}: timestamp {t} is out of range [{low}, {high}]")));
    }
    Ok(max_ts)
}

fn be_i64(b: &[u8], at: usize) -> i64 {
    i64::from_be_bytes(b[at..at + 8].try_into().unwrap())
}

fn be_i32(b: &[u8], at: usize) -> i32 {
    i32::from_be_bytes(b[at..at + 4].try_into().unwrap())
}

/// The whole check of one batch's records (see the module docs).
fn check(batch: &[u8], cap: u64, ts: Option<(i64, i64)>) -> Result<i64, Verdict> {
    if batch.len() < HEADER {
        return Err(verdict(CORRUPT_MESSAGE, -1, "record batch header cut short".into()));
    }
    let size = 12 + be_i32(batch, 8) as i64;
    if size < HEADER as i64 || size as usize > batch.len() {
        return Err(verdict(CORRUPT_MESSAGE, -1, "batch length does not match its bytes".into()));
    }
    let attributes = u16::from_be_bytes([batch[21], batch[22]]);
    let b = Batch {
        count: i64::from(be_i32(batch, 57)),
        base_ts: be_i64(batch, 27),
        fixed_ts: if attributes & 0x08 != 0 { Some(be_i64(batch, 35)) } else { None },
    };
    let body = &batch[HEADER..size as usize];
    let codec = attributes & 0x07;
    if codec == 0 {
        if let Some(max_ts) = fast_walk(body, &b, ts) {
            return Ok(max_ts);
        }
        return walk(&mut Slice { data: body, pos: 0 }, &b, ts, "NONE", cap);
    }
    let name = ["NONE", "GZIP", "SNAPPY", "LZ4", "ZSTD"].get(codec as usize).copied().unwrap_or("?");
    if body.is_empty() {
        return Err(verdict(CORRUPT_MESSAGE, -1, format!("empty {name} payload")));
    }
    match codec {
        1 => walk(&mut Stream::new(Deflate::new(body), cap), &b, ts, name, cap),
        2 => walk(&mut Stream::new(Snappy::new(body, cap), cap), &b, ts, name, cap),
        3 => {
            let shape = lz4_frames_whole(body).err();
            let reader = Lz4 { inner: lz4_flex::frame::FrameDecoder::new(body), shape };
            walk(&mut Stream::new(reader, cap), &b, ts, name, cap)
        }
        4 => match zstd::stream::read::Decoder::with_buffer(body) {
            Ok(d) => walk(&mut Stream::new(d, cap), &b, ts, name, cap),
            Err(e) => Err(verdict(CORRUPT_MESSAGE, -1, format!("cannot decompress (ZSTD): {e}"))),
        },
        _ => Err(verdict(76, -1, format!("unknown compression codec {codec}"))),
    }
}

fn contiguous<'a>(buf: &'a PyBuffer<u8>) -> PyResult<&'a [u8]> {
    if !buf.is_c_contiguous() {
        return Err(PyValueError::new_err("buffer must be contiguous"));
    }
    // SAFETY: the buffer is exported (held by `buf`) for as long as the slice lives,
    // contiguous and of `len_bytes()` bytes; callers never mutate it meanwhile.
    Ok(unsafe { std::slice::from_raw_parts(buf.buf_ptr() as *const u8, buf.len_bytes()) })
}

/// Check every record of one whole batch; returns (code, record index, message, max ts).
#[pyfunction]
fn validate_records(
    py: Python<'_>,
    batch: PyBuffer<u8>,
    max_inflated: u64,
    check_ts: bool,
    low: i64,
    high: i64,
) -> PyResult<(i32, i64, Option<String>, i64)> {
    let data = contiguous(&batch)?;
    let ts = if check_ts { Some((low, high)) } else { None };
    let result = py.allow_threads(|| check(data, max_inflated, ts));
    Ok(match result {
        Ok(max_ts) => (OK, -1, None, max_ts),
        Err(v) => (v.code, v.index, Some(v.message), NO_TIMESTAMP),
    })
}

/// One produced batch: CRC-32C of bytes 21.. and the records' verdict, in one call with the
/// GIL released; returns (crc, code, record index, message, max ts).
#[pyfunction]
fn check_batch(
    py: Python<'_>,
    batch: PyBuffer<u8>,
    max_inflated: u64,
    check_ts: bool,
    low: i64,
    high: i64,
) -> PyResult<(u32, i32, i64, Option<String>, i64)> {
    let data = contiguous(&batch)?;
    let ts = if check_ts { Some((low, high)) } else { None };
    let (crc, result) = py.allow_threads(|| {
        let crc = data.get(21..).map_or(0, ::crc32c::crc32c);
        (crc, check(data, max_inflated, ts))
    });
    Ok(match result {
        Ok(max_ts) => (crc, OK, -1, None, max_ts),
        Err(v) => (crc, v.code, v.index, Some(v.message), NO_TIMESTAMP),
    })
}

/// CRC-32C of a buffer.
#[pyfunction(name = "crc32c")]
fn crc32c_of(py: Python<'_>, data: PyBuffer<u8>) -> PyResult<u32> {
    let data = contiguous(&data)?;
    Ok(py.allow_threads(|| ::crc32c::crc32c(data)))
}

/// Hypercore leaf hashes of many blocks, hashed side by side in SIMD lanes.
#[pyfunction]
fn leaf_hashes<'py>(py: Python<'py>, blocks: Vec<PyBuffer<u8>>) -> PyResult<Bound<'py, PyList>> {
    let slices = blocks.iter().map(contiguous).collect::<PyResult<Vec<&[u8]>>>()?;
    let digests: Vec<[u8; 32]> = py.allow_threads(|| hash_leaves(&slices));
    PyList::new(py, digests.iter().map(|d| PyBytes::new(py, d)))
}

fn hash_leaves(blocks: &[&[u8]]) -> Vec<[u8; 32]> {
    let mut params = blake2b_simd::Params::new();
    params.hash_length(32);
    let mut states: Vec<blake2b_simd::State> = blocks
        .iter()
        .map(|b| {
            let mut s = params.to_state();
            let mut prefix = [0u8; 9];
            prefix[1..].copy_from_slice(&(b.len() as u64).to_le_bytes());
            s.update(&prefix);
            s
        })
        .collect();
    blake2b_simd::many::update_many(states.iter_mut().zip(blocks.iter().copied()));
    states
        .iter()
        .map(|s| {
            let mut out = [0u8; 32];
            out.copy_from_slice(s.finalize().as_bytes());
            out
        })
        .collect()
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(validate_records, m)?)?;
    m.add_function(wrap_pyfunction!(check_batch, m)?)?;
    m.add_function(wrap_pyfunction!(crc32c_of, m)?)?;
    m.add_function(wrap_pyfunction!(leaf_hashes, m)?)?;
    m.add("INFLATE_WINDOW", WINDOW)?;
    Ok(())
}
