//! Packing and padding of SFT examples as TRL 1.16.0 does them.
//!
//! [`pack_bfd_batch`] is TRL's `_pack_bfd` (`trl/data_utils.py`, the default `"bfd"` strategy):
//! empty sequences are dropped, longer ones cut to `seq_len`, the rest sorted by length,
//! longest first (a stable sort: equal lengths keep their order), and each placed in the open
//! row with the least room that still fits it (the first such row opened when several have the
//! same room), else in a new row; rows come out in the order they were opened, each with its
//! examples in the order they were placed. [`pack_bfd`] is `pack_dataset(dataset, seq_len,
//! "bfd")`, which runs `_pack_bfd` through `Dataset.map(batched=True)`, i.e. on consecutive
//! batches of [`TRL_PACK_BATCH`] examples (`datasets`' default batch size), one after the
//! other.
//!
//! [`PackedRow`] is a packed row as TRL's `DataCollatorForLanguageModeling(padding_free=True)`
//! hands it to the model (BFD packing turns padding-free on); [`pad_batch`] is the same
//! collator without padding-free: right padding with the pad token, `attention_mask`, and
//! labels padded with -100.

use std::collections::{BTreeMap, VecDeque};

use super::{IGNORE_INDEX, SftExample};

/// The number of examples TRL's `pack_dataset` packs at a time (`datasets`' `map` batch size).
pub const TRL_PACK_BATCH: usize = 1000;

/// TRL's `pack_dataset(strategy="bfd")` on sequences of `lengths`: rows of indices into
/// `lengths`, in TRL's order (see the module docs). Empty sequences are left out; a sequence
/// longer than `seq_len` takes a row of its own (TRL keeps its first `seq_len` tokens). Nothing
/// fits in rows of 0 tokens: `seq_len == 0` gives no rows.
pub fn pack_bfd(lengths: &[usize], seq_len: usize) -> Vec<Vec<usize>> {
    let mut rows = Vec::new();
    for (batch, chunk) in lengths.chunks(TRL_PACK_BATCH).enumerate() {
        let offset = batch * TRL_PACK_BATCH;
        rows.extend(
            pack_bfd_batch(chunk, seq_len)
                .into_iter()
                .map(|row| row.into_iter().map(|i| i + offset).collect::<Vec<_>>()),
        );
    }
    rows
}

/// TRL's `_pack_bfd` on one batch of sequences of `lengths` (see the module docs): rows of
/// indices into `lengths`.
pub fn pack_bfd_batch(lengths: &[usize], seq_len: usize) -> Vec<Vec<usize>> {
    if seq_len == 0 {
        return Vec::new();
    }
    let mut order: Vec<(usize, usize)> = lengths
        .iter()
        .enumerate()
        .filter(|(_, len)| **len > 0)
        .map(|(i, &len)| (len.min(seq_len), i))
        .collect();
    // Stable, as Arrow's `sort_indices`.
    order.sort_by_key(|&(len, _)| std::cmp::Reverse(len));
    let mut rows: Vec<Vec<usize>> = Vec::new();
    // Room left → the open rows with that much room, oldest first (TRL's segment tree over
    // the room values plus its `space_to_bin` queues).
    let mut open: BTreeMap<usize, VecDeque<usize>> = BTreeMap::new();
    for (len, index) in order {
        let fit = open
            .range_mut(len..)
            .next()
            .and_then(|(&room, rows)| rows.pop_front().map(|row| (room, row)));
        let (room, row) = match fit {
            Some((room, row)) => {
                if open.get(&room).is_some_and(VecDeque::is_empty) {
                    open.remove(&room);
                }
                (room, row)
            }
            None => {
                rows.push(Vec::new());
                (seq_len, rows.len() - 1)
            }
        };
        if let Some(members) = rows.get_mut(row) {
            members.push(index);
        }
        let left = room - len;
        if left > 0 {
            open.entry(left).or_default().push_back(row);
        }
    }
    rows
}

/// A packed row as TRL's padding-free collator builds it: the examples' tokens one after the
/// other, positions restarting at each example, and the labels of the examples with the first
/// token of each example not trained (that label would be predicted from the previous
/// example's last token once the model shifts the labels).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedRow {
    /// Indices of the row's examples (into the examples packed), in row order.
    pub examples: Vec<usize>,
    /// The examples' tokens, concatenated.
    pub input_ids: Vec<u32>,
    /// HF labels (unshifted): token ids where trained, -100 elsewhere and at each example's
    /// first token.
    pub labels: Vec<i64>,
    /// Position of each token within its example.
    pub position_ids: Vec<usize>,
    /// The examples' lengths, in row order (TRL's `seq_lengths`).
    pub seq_lengths: Vec<usize>,
}

impl PackedRow {
    /// The row of `indices` into `examples` (indices out of range are skipped).
    pub(super) fn new(examples: &[SftExample], indices: Vec<usize>) -> Self {
        let mut row = Self {
            examples: Vec::with_capacity(indices.len()),
            input_ids: Vec::new(),
            labels: Vec::new(),
            position_ids: Vec::new(),
            seq_lengths: Vec::with_capacity(indices.len()),
        };
        for index in indices {
            let Some(example) = examples.get(index) else {
                continue;
            };
            let start = row.labels.len();
            row.examples.push(index);
            row.input_ids.extend_from_slice(&example.input_ids);
            row.labels.extend(example.labels());
            if let Some(first) = row.labels.get_mut(start) {
                *first = IGNORE_INDEX;
            }
            row.position_ids.extend(0..example.len());
            row.seq_lengths.push(example.len());
        }
        row
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.input_ids.len()
    }

    /// Whether the row has no token.
    pub fn is_empty(&self) -> bool {
        self.input_ids.is_empty()
    }

    /// Cumulative example lengths `[0, l0, l0 + l1, …, len]` (flash-attention's
    /// `cu_seqlens`, TRL's `cu_seq_lens_q`).
    pub fn cu_seqlens(&self) -> Vec<usize> {
        std::iter::once(0)
            .chain(self.seq_lengths.iter().scan(0, |sum, &len| {
                *sum += len;
                Some(*sum)
            }))
            .collect()
    }
}

/// A right-padded batch as TRL's collator builds it without padding-free.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PaddedBatch {
    /// Token ids, padded with the pad token to the longest example.
    pub input_ids: Vec<Vec<u32>>,
    /// 1 on the examples' tokens, 0 on padding.
    pub attention_mask: Vec<Vec<u8>>,
    /// HF labels (unshifted), -100 on untrained tokens and padding.
    pub labels: Vec<Vec<i64>>,
}

/// Right-pads `examples` into one batch with `pad_token_id` (see
/// [`super::trl_pad_token_id`]), as TRL's `DataCollatorForLanguageModeling` does.
pub fn pad_batch(examples: &[&SftExample], pad_token_id: u32) -> PaddedBatch {
    let width = examples.iter().map(|e| e.len()).max().unwrap_or(0);
    let mut batch = PaddedBatch {
        input_ids: Vec::with_capacity(examples.len()),
        attention_mask: Vec::with_capacity(examples.len()),
        labels: Vec::with_capacity(examples.len()),
    };
    for example in examples {
        let pad = width - example.len();
        let mut ids = example.input_ids.clone();
        ids.resize(width, pad_token_id);
        let mut mask = vec![1u8; example.len()];
        mask.resize(width, 0);
        let mut labels = example.labels();
        labels.extend(std::iter::repeat_n(IGNORE_INDEX, pad));
        batch.input_ids.push(ids);
        batch.attention_mask.push(mask);
        batch.labels.push(labels);
    }
    batch
}
