//! Context parallelism (docs/parallelism.md §Context parallelism; the Megatron Core MoE
//! report §6.3): the `cp` ranks of a replica share its sequences. Every row of `S` positions is cut
//! into `2·cp` equal chunks and rank `r` holds chunks `r` and `2·cp − 1 − r` (causal load balance:
//! each rank gets one early and one late chunk, so the attention work is even). Everything but
//! attention is per token; attention all-gathers the keys and values (GQA) or the compressed
//! latents (MLA) of the group along the sequence, and each query sees the gathered keys by their
//! global positions (causal, and within its document for a packed batch). The all-gather's backward
//! reduce-scatters the keys' gradients back to the ranks that own them.

use burn::tensor::{Bool, Device, Tensor, TensorData};
use moe_backend::comm::Comm;
use moe_backend::comm::autograd::gather_from_sequence_parallel_region;

use super::err;
use crate::ModelError;
use crate::layers::AttentionMask;

/// The global positions rank `rank` of `cp` holds of a row of `s` positions (its two chunks,
/// in order); `0..s` when `cp = 1`. `s` must be divisible by `2·cp`
/// ([`check_sequence`]).
pub(crate) fn cp_positions(s: usize, cp: usize, rank: usize) -> Vec<usize> {
    if cp == 1 {
        return (0..s).collect();
    }
    let c = s / (2 * cp);
    let early = rank * c..(rank + 1) * c;
    let late = (2 * cp - 1 - rank) * c..(2 * cp - rank) * c;
    early.chain(late).collect()
}

/// The positions of the keys after the all-gather: every rank's [`cp_positions`], in rank
/// order.
pub(crate) fn gathered_positions(s: usize, cp: usize) -> Vec<usize> {
    (0..cp).flat_map(|r| cp_positions(s, cp, r)).collect()
}

/// Refuses a row length that does not split into `2·cp` chunks.
pub(crate) fn check_sequence(s: usize, cp: usize) -> Result<(), ModelError> {
    if cp > 1 && !s.is_multiple_of(2 * cp) {
        return Err(ModelError::layout(
            "cp",
            format!(
                "context parallelism cuts every sequence into 2·cp = {} chunks; the sequence \
                 length {s} is not divisible by it",
                2 * cp
            ),
        ));
    }
    Ok(())
}

/// Row-major `values [B, s]` at `positions` of every row: `[B, positions.len()]`.
pub(crate) fn select_positions<T: Copy>(values: &[T], s: usize, positions: &[usize]) -> Vec<T> {
    values
        .chunks(s)
        .flat_map(|row| positions.iter().map(move |&p| row[p]))
        .collect()
}

/// The attention mask `[B, Sq, Sk]` of queries at global positions `queries` against keys at
/// `keys` (`true` = masked out): a key is seen when it is not later than the query and, with
/// `documents` (`[B·S]` row-major document id per position, `< 0` = padding), belongs to the
/// query's document (a padding query sees only itself). The mask carries the positions, so a
/// sliding-window layer hides the keys outside each query's window by their global positions
/// ([`AttentionMask::outside_window`]) wherever the keys' chunks came from.
pub(crate) fn position_mask(
    batch: usize,
    s: usize,
    queries: &[usize],
    keys: &[usize],
    documents: Option<&[i64]>,
    device: &Device,
) -> AttentionMask {
    let (sq, sk) = (queries.len(), keys.len());
    let mut blocked = Vec::with_capacity(batch * sq * sk);
    for b in 0..batch {
        let doc = |p: usize| documents.map(|d| d[b * s + p]);
        for &q in queries {
            for &k in keys {
                let visible = match doc(q) {
                    Some(dq) if dq < 0 => k == q,
                    dq => k <= q && dq == doc(k),
                };
                blocked.push(!visible);
            }
        }
    }
    AttentionMask::from_blocked(Tensor::<3, Bool>::from_data(
        TensorData::new(blocked, [batch, sq, sk]),
        device,
    ))
    .with_positions(queries, keys)
}

/// How the context-parallel ranks exchange keys and values (Megatron's `--cp-comm-type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CpCommType {
    /// One all-gather along the sequence (backward: a reduce-scatter).
    #[default]
    AllGather,
    /// Around the ring: `cp − 1` point-to-point steps, each rank passing on the block it last
    /// received (backward: the gradients around the ring the other way).
    P2p,
}

impl std::str::FromStr for CpCommType {
    type Err = ModelError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "all_gather" | "all-gather" => Ok(Self::AllGather),
            "p2p" | "ring" => Ok(Self::P2p),
            other => Err(ModelError::input(
                "cp_comm_type",
                format!("`{other}` (expected all_gather or p2p)"),
            )),
        }
    }
}

impl std::fmt::Display for CpCommType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::AllGather => "all_gather",
            Self::P2p => "p2p",
        })
    }
}

/// The context-parallel group attention exchanges keys and values over, and how.
#[derive(Debug, Clone, Copy)]
pub struct CpExchange<'a> {
    /// The context-parallel group.
    pub comm: &'a Comm,
    /// All-gather or ring.
    pub kind: CpCommType,
}

impl CpExchange<'_> {
    /// Every rank's `x [B, n, S_local, d]` along the sequence, in rank order (each rank's
    /// early then late chunk), exchanged as `kind` says.
    pub fn gather(&self, x: Tensor<4>) -> Result<Tensor<4>, ModelError> {
        match self.kind {
            CpCommType::AllGather => gather_sequence(self.comm, x),
            CpCommType::P2p => ring_gather_sequence(self.comm, x),
        }
    }
}

/// The context-parallel all-gather along the sequence done around the ring: in step `i` of `cp − 1` every rank sends the block it
/// holds from rank `r − i` to rank `r + 1` and receives rank `r − i − 1`'s block from rank
/// `r − 1` (a differentiable exchange whose backward sends the gradient the other way);
/// the blocks are then put in rank order.
pub fn ring_gather_sequence(cp: &Comm, x: Tensor<4>) -> Result<Tensor<4>, ModelError> {
    let n = cp.size();
    if n == 1 {
        return Ok(x);
    }
    let r = cp.rank();
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    // Rows along dim 0 for the exchange: the sequence first.
    let rows = x.dims()[2];
    let mut blocks: Vec<Option<Tensor<4>>> = vec![None; n];
    let mut current = x.swap_dims(0, 2);
    blocks[r] = Some(current.clone());
    for step in 1..n {
        let mut send = vec![0; n];
        send[next] = rows;
        let mut recv = vec![0; n];
        recv[prev] = rows;
        current = cp.all_to_all_v(current, &send, &recv).map_err(err)?;
        blocks[(r + n - step) % n] = Some(current.clone());
    }
    let blocks: Vec<Tensor<4>> = blocks.into_iter().flatten().collect();
    Ok(Tensor::cat(blocks, 0).swap_dims(0, 2))
}

/// All-gathers `x [B, n, S_local, d]` along the sequence over the context-parallel group
/// (rank order, [`gathered_positions`]); the backward sums every rank's gradient of the
/// gathered keys and returns this rank's block.
pub fn gather_sequence(cp: &Comm, x: Tensor<4>) -> Result<Tensor<4>, ModelError> {
    if cp.size() == 1 {
        return Ok(x);
    }
    let gathered =
        gather_from_sequence_parallel_region(cp, x.swap_dims(0, 2), true).map_err(err)?;
    Ok(gathered.swap_dims(0, 2))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_balance_the_causal_work() {
        assert_eq!(cp_positions(8, 2, 0), [0, 1, 6, 7]);
        assert_eq!(cp_positions(8, 2, 1), [2, 3, 4, 5]);
        assert_eq!(gathered_positions(8, 2), [0, 1, 6, 7, 2, 3, 4, 5]);
        assert_eq!(cp_positions(5, 1, 0), [0, 1, 2, 3, 4]);
        // Each rank's queries see the same number of (query, key) pairs.
        let work = |r| -> usize { cp_positions(12, 3, r).iter().map(|p| p + 1).sum() };
        assert_eq!(work(0), work(1));
        assert_eq!(work(1), work(2));
        assert!(check_sequence(12, 3).is_ok());
        let e = check_sequence(10, 3).unwrap_err().to_string();
        assert!(e.contains("cp") && e.contains("10"), "{e}");
    }

    #[test]
    fn the_mask_follows_global_positions_and_documents() {
        let device = Device::flex();
        let m = position_mask(1, 4, &[0, 3], &[0, 3, 1, 2], None, &device);
        let got = m
            .blocked()
            .clone()
            .into_data()
            .try_into_vec::<bool>()
            .unwrap();
        assert_eq!(got, [false, true, true, true, false, false, false, false]);
        // Two documents [0, 1] and [2, 3]; position 3 is padding in the second row.
        let docs = [0, 0, 1, 1, 0, 0, 0, -1];
        let m = position_mask(2, 4, &[1, 3], &[0, 1, 2, 3], Some(&docs), &device);
        let got = m
            .blocked()
            .clone()
            .into_data()
            .try_into_vec::<bool>()
            .unwrap();
        let want = [
            [false, false, true, true],
            [true, true, false, false],
            [false, false, true, true],
            [true, true, true, false],
        ];
        assert_eq!(got, want.concat());
    }

    /// An attention block with sinks, biases and a window of 3 under cp = 2 (each rank's
    /// queries against the keys and values of both ranks, gathered in rank order, under
    /// [`position_mask`]) gives the single-rank output at its positions: the sink counts once
    /// per query row however the keys are chunked.
    #[test]
    fn sinks_and_windows_under_cp_match_one_rank() {
        use burn::module::Param;
        use burn::tensor::{Distribution, Tolerance};

        use crate::config::RopeParameters;
        use crate::layers::AttentionConfig;
        use crate::layers::rope::RotaryEmbedding;

        let device = Device::flex();
        let mut attn = AttentionConfig::new(16, 4, 2, 8)
            .with_attention_bias(true)
            .with_sinks(true)
            .with_sliding_window(Some(3))
            .init(&device)
            .unwrap();
        attn.sinks = Some(Param::from_tensor(Tensor::random(
            [4],
            Distribution::Normal(0.0, 1.0),
            &device,
        )));
        let rope = RotaryEmbedding::new(&RopeParameters::default(), 8).unwrap();
        let (b, s, cp) = (2, 8, 2);
        let x = Tensor::<3>::random([b, s, 16], Distribution::Normal(0.0, 1.0), &device);
        let full = attn.forward(x.clone(), &rope.tables(0, s, &device), None);
        let select = |t: &Tensor<3>, positions: &[usize]| {
            Tensor::cat(
                positions
                    .iter()
                    .map(|&p| t.clone().narrow(1, p, 1))
                    .collect(),
                1,
            )
        };
        let local = |r: usize| {
            let positions = cp_positions(s, cp, r);
            let tables = rope.tables_at(&positions, [1, positions.len()], &device);
            (select(&x, &positions), tables, positions)
        };
        // Each rank's keys and values (the exchange sees k, then v).
        let exchanged: Vec<Vec<Tensor<4>>> = (0..cp)
            .map(|r| {
                let (xr, tables, _) = local(r);
                let mut seen = Vec::new();
                let _ = attn.forward_exchanged(
                    xr,
                    &tables,
                    None,
                    |t| {
                        seen.push(t.clone());
                        Ok::<_, std::convert::Infallible>(t)
                    },
                    false,
                );
                seen
            })
            .collect();
        let keys = gathered_positions(s, cp);
        for r in 0..cp {
            let (xr, tables, positions) = local(r);
            let mask = position_mask(b, s, &positions, &keys, None, &device);
            let mut call = 0;
            let Ok(out) = attn.forward_exchanged(
                xr,
                &tables,
                Some(&mask),
                |_| {
                    let gathered = exchanged.iter().map(|e| e[call].clone()).collect();
                    call += 1;
                    Ok::<_, std::convert::Infallible>(Tensor::cat(gathered, 2))
                },
                false,
            );
            out.into_data().assert_approx_eq::<f32>(
                &select(&full, &positions).into_data(),
                Tolerance::rel_abs(1e-5, 1e-5),
            );
        }
    }

    /// Under cp = 2 a window of 3 over a row of 8: rank 0's queries (positions 0, 1, 6, 7)
    /// see the gathered keys (0, 1, 6, 7, 2, 3, 4, 5) with `q − 3 < k ≤ q`.
    #[test]
    fn the_window_follows_global_positions() {
        let device = Device::flex();
        let (queries, keys) = (cp_positions(8, 2, 0), gathered_positions(8, 2));
        let m = position_mask(1, 8, &queries, &keys, None, &device);
        let outside = m.outside_window(3);
        let blocked = m.blocked().clone().squeeze_dim::<2>(0).bool_or(outside);
        let got = blocked.into_data().try_into_vec::<bool>().unwrap();
        for (i, &q) in queries.iter().enumerate() {
            for (j, &k) in keys.iter().enumerate() {
                let seen = k <= q && q < k + 3;
                assert_eq!(!got[i * keys.len() + j], seen, "query {q} key {k}");
            }
        }
    }
}
