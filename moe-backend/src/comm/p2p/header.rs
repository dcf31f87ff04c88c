//! The header every member of a process-transport collective sends to every other member
//! before the payload, and the cross-member checks on it.
//!
//! Layout (little-endian `u64` words, then fixed text fields, for a group of `n` members):
//! `magic, op, seq, param, ndim, dims[8], has_splits, has_recv, splits[n], recv_splits[n]`,
//! then `dtype` (32 bytes), `site` (160 bytes), `error` (224 bytes), each NUL-padded and cut
//! at a character boundary if longer. Point-to-point messages use `n = 0`.

use burn::tensor::DType;

use super::super::{CallSite, ReduceOp};

const MAGIC: u64 = 0x4d4f_455f_5032_5031; // "MOE_P2P1"
const MAX_DIMS: usize = 8;
const DTYPE_BYTES: usize = 32;
const SITE_BYTES: usize = 160;
const ERROR_BYTES: usize = 224;
const FIXED_WORDS: usize = 5 + MAX_DIMS + 2;

/// The collective a header announces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Op {
    AllReduce = 1,
    AllGather = 2,
    ReduceScatter = 3,
    AllToAll = 4,
    Broadcast = 5,
    Barrier = 6,
    Send = 7,
}

impl Op {
    pub(super) fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "all_reduce",
            Op::AllGather => "all_gather",
            Op::ReduceScatter => "reduce_scatter",
            Op::AllToAll => "all_to_all_v",
            Op::Broadcast => "broadcast",
            Op::Barrier => "barrier",
            Op::Send => "send",
        }
    }

    fn from_code(code: u64) -> Option<Self> {
        Some(match code {
            1 => Op::AllReduce,
            2 => Op::AllGather,
            3 => Op::ReduceScatter,
            4 => Op::AllToAll,
            5 => Op::Broadcast,
            6 => Op::Barrier,
            7 => Op::Send,
            _ => return None,
        })
    }
}

/// Wire code of a reduce op.
pub(super) fn reduce_code(op: ReduceOp) -> u64 {
    match op {
        ReduceOp::Sum => 0,
        ReduceOp::Mean => 1,
        ReduceOp::Max => 2,
    }
}

fn reduce_name(code: u64) -> &'static str {
    match code {
        0 => "Sum",
        1 => "Mean",
        2 => "Max",
        _ => "?",
    }
}

/// One member's announcement of a collective.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Header {
    pub(super) op: Op,
    pub(super) seq: u64,
    /// Reduce op code, or the broadcast root.
    pub(super) param: u64,
    ndim: usize,
    dims: [u64; MAX_DIMS],
    /// Splits (empty when the op has none or the member's own were invalid).
    pub(super) splits: Vec<u64>,
    pub(super) recv_splits: Vec<u64>,
    dtype: String,
    site: String,
    error: String,
}

fn put_text(out: &mut Vec<u8>, text: &str, width: usize) {
    let mut end = text.len().min(width);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    out.extend_from_slice(&text.as_bytes()[..end]);
    out.resize(out.len() + width - end, 0);
}

fn get_text(bytes: &[u8]) -> String {
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

impl Header {
    pub(super) fn new(op: Op) -> Self {
        Self {
            op,
            seq: 0,
            param: 0,
            ndim: 0,
            dims: [0; MAX_DIMS],
            splits: Vec::new(),
            recv_splits: Vec::new(),
            dtype: String::new(),
            site: String::new(),
            error: String::new(),
        }
    }

    /// Records the dtype and shape of `data`.
    pub(super) fn set_shape(&mut self, shape: &[usize], dtype: DType) {
        self.ndim = shape.len();
        for (d, &s) in self.dims.iter_mut().zip(shape) {
            *d = s as u64;
        }
        self.dtype = format!("{dtype:?}");
    }

    /// A problem the transport has with the tensor itself.
    pub(super) fn tensor_problem(&self) -> Option<String> {
        (self.ndim > MAX_DIMS).then(|| {
            format!(
                "the process transport carries tensors of at most {MAX_DIMS} dims, not {}",
                self.ndim
            )
        })
    }

    pub(super) fn set_site(&mut self, site: CallSite) {
        self.site = site.to_string();
    }

    pub(super) fn set_error(&mut self, message: &str) {
        self.error = message.to_string();
    }

    pub(super) fn site(&self) -> &str {
        &self.site
    }

    /// Rows (dim 0); a 0-d tensor counts as one row.
    pub(super) fn rows(&self) -> usize {
        if self.ndim == 0 {
            1
        } else {
            self.dims[0] as usize
        }
    }

    fn shape(&self) -> &[u64] {
        &self.dims[..self.ndim.min(MAX_DIMS)]
    }

    fn trailing(&self) -> &[u64] {
        self.shape().get(1..).unwrap_or_default()
    }

    /// Same dtype and shape.
    pub(super) fn same_tensor(&self, other: &Header) -> bool {
        self.dtype == other.dtype && self.ndim == other.ndim && self.shape() == other.shape()
    }

    pub(super) fn describe_tensor(&self) -> String {
        format!("{} {:?}", self.dtype, self.shape())
    }

    /// Wire bytes for a group of `n` members.
    pub(super) fn encode(&self, n: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(Self::len(n));
        let mut word = |w: u64| out.extend_from_slice(&w.to_le_bytes());
        word(MAGIC);
        word(self.op as u64);
        word(self.seq);
        word(self.param);
        word(self.ndim as u64);
        for d in self.dims {
            word(d);
        }
        word(u64::from(self.splits.len() == n && n > 0));
        word(u64::from(self.recv_splits.len() == n && n > 0));
        for list in [&self.splits, &self.recv_splits] {
            for j in 0..n {
                word(list.get(j).copied().unwrap_or(0));
            }
        }
        put_text(&mut out, &self.dtype, DTYPE_BYTES);
        put_text(&mut out, &self.site, SITE_BYTES);
        put_text(&mut out, &self.error, ERROR_BYTES);
        out
    }

    fn len(n: usize) -> usize {
        (FIXED_WORDS + 2 * n) * 8 + DTYPE_BYTES + SITE_BYTES + ERROR_BYTES
    }

    /// Reads the bytes [`Header::encode`] wrote for a group of `n` members.
    pub(super) fn decode(bytes: &[u8], n: usize) -> Result<Self, String> {
        if bytes.len() != Self::len(n) {
            return Err(format!(
                "{} bytes where a header of {} was expected",
                bytes.len(),
                Self::len(n)
            ));
        }
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&bytes[i * 8..i * 8 + 8]);
            u64::from_le_bytes(w)
        };
        if word(0) != MAGIC {
            return Err("bad magic (not a burn-moe collective header)".into());
        }
        let op = Op::from_code(word(1)).ok_or_else(|| format!("unknown op code {}", word(1)))?;
        let mut dims = [0u64; MAX_DIMS];
        for (k, d) in dims.iter_mut().enumerate() {
            *d = word(5 + k);
        }
        let list = |at: usize, present: bool| {
            if present {
                (0..n).map(|j| word(at + j)).collect()
            } else {
                Vec::new()
            }
        };
        let base = FIXED_WORDS;
        let text = base * 8 + 2 * n * 8;
        Ok(Self {
            op,
            seq: word(2),
            param: word(3),
            ndim: word(4) as usize,
            dims,
            splits: list(base, word(5 + MAX_DIMS) == 1),
            recv_splits: list(base + n, word(6 + MAX_DIMS) == 1),
            dtype: get_text(&bytes[text..text + DTYPE_BYTES]),
            site: get_text(&bytes[text + DTYPE_BYTES..text + DTYPE_BYTES + SITE_BYTES]),
            error: get_text(&bytes[text + DTYPE_BYTES + SITE_BYTES..]),
        })
    }
}

/// Checks every member's header against the others'; `Err` describes the first disagreement,
/// naming ranks and call sites. Every member runs it on the same headers, so all members reach
/// the same verdict.
pub(super) fn agree(headers: &[Header], ranks: &[usize]) -> Result<(), String> {
    if let Some((i, h)) = headers
        .iter()
        .enumerate()
        .find(|(_, h)| !h.error.is_empty())
    {
        return Err(format!(
            "rank {} rejected its arguments to {} at {}: {}",
            ranks[i],
            h.op.name(),
            h.site,
            h.error
        ));
    }
    let first = &headers[0];
    let mismatch = |what: &str, i: usize, show: &dyn Fn(&Header) -> String| {
        let other = &headers[i];
        format!(
            "{what} mismatch: rank {} passed {} ({}), rank {} passed {} ({})",
            ranks[0],
            show(first),
            first.site,
            ranks[i],
            show(other),
            other.site
        )
    };
    for (i, h) in headers.iter().enumerate().skip(1) {
        if h.op != first.op || h.seq != first.seq {
            return Err(format!(
                "collective order mismatch: rank {} called {} at {} (call #{}), rank {} called {} at {} (call #{})",
                ranks[0],
                first.op.name(),
                first.site,
                first.seq,
                ranks[i],
                h.op.name(),
                h.site,
                h.seq
            ));
        }
        if first.op == Op::Barrier {
            continue;
        }
        if h.dtype != first.dtype {
            return Err(mismatch("dtype", i, &|h| h.dtype.clone()));
        }
        let shape = |h: &Header| format!("{:?}", h.shape());
        match first.op {
            Op::AllReduce | Op::ReduceScatter | Op::Broadcast => {
                if h.ndim != first.ndim || h.shape() != first.shape() {
                    return Err(mismatch("shape", i, &shape));
                }
            }
            Op::AllGather | Op::AllToAll => {
                if h.ndim != first.ndim || h.trailing() != first.trailing() {
                    return Err(mismatch("trailing shape", i, &shape));
                }
            }
            Op::Barrier | Op::Send => {}
        }
        match first.op {
            Op::AllReduce | Op::ReduceScatter if h.param != first.param => {
                return Err(mismatch("reduce op", i, &|h| {
                    reduce_name(h.param).to_string()
                }));
            }
            Op::Broadcast if h.param != first.param => {
                return Err(mismatch("root", i, &|h| h.param.to_string()));
            }
            Op::ReduceScatter if h.splits != first.splits => {
                return Err(mismatch("splits", i, &|h| format!("{:?}", h.splits)));
            }
            _ => {}
        }
    }
    if first.op == Op::AllToAll {
        // recv[j][i] == send[i][j] for every pair.
        for (i, si) in headers.iter().enumerate() {
            for (j, sj) in headers.iter().enumerate() {
                if sj.recv_splits[i] != si.splits[j] {
                    return Err(format!(
                        "split mismatch: rank {} sends {} rows to rank {} (send_splits {:?} at {}), \
                         but rank {} expects {} (recv_splits {:?} at {})",
                        ranks[i],
                        si.splits[j],
                        ranks[j],
                        si.splits,
                        si.site,
                        ranks[j],
                        sj.recv_splits[i],
                        sj.recv_splits,
                        sj.site
                    ));
                }
            }
        }
    }
    Ok(())
}
