//! Attention masks and sequence packing: which tokens of a `[batch, S]` batch are real, which
//! document each belongs to, and the positions RoPE sees.
//!
//! A [`SequenceLayout`] describes one batch of token rows in either (or both) of two forms:
//!
//! - **packed** rows (Megatron's `PackedSeqParams`, THD format): per row, the document
//!   boundaries `cu_seqlens = [0, l₀, l₀+l₁, …]` (ending at or before `S`; the rest of the row
//!   is padding). Attention never crosses a boundary (a block-diagonal causal mask) and RoPE
//!   positions restart at 0 for every document (HF / Megatron `position_ids` of packed
//!   sequences);
//! - **padded** rows (HF `attention_mask [B, S]`, 1 = real token, left or right padding or any
//!   mix): padded keys are masked out of attention and positions are HF's
//!   `cumsum(mask) − 1` (so a left-padded row sees the positions of its unpadded sequence).
//!
//! With both, a token is real when it lies inside a document and its mask value is 1, and its
//! position counts the real tokens of its document before it. Padding tokens attend only to
//! themselves (so every softmax row stays finite) and no real token attends to them.
//!
//! The losses skip what is not a target ([`SequenceLayout::mask_labels`]): a label `labels[c]`
//! (scored from position `c − 1`) is kept only when positions `c − 1` and `c` are real tokens
//! of the same document, so the last token of a document never predicts the first token of
//! the next, and padding is never a target. The routers leave padded rows out of their
//! load-balancing losses and expert-bias counts ([`SequenceLayout::padding_mask`], moe-backend's
//! `RouteOptions::padding_mask`).
//!
//! ```
//! # use moe_models::packing::SequenceLayout;
//! // One row of 8 tokens: documents of 3 and 4 tokens, then one padding token.
//! let layout = SequenceLayout::from_cu_seqlens(1, 8, vec![vec![0, 3, 7]])?;
//! assert_eq!(layout.position_ids(), vec![0, 1, 2, 0, 1, 2, 3, 0]);
//! let mut labels = vec![5, 6, 7, 8, 9, 10, 11, 12];
//! layout.mask_labels(&mut labels);
//! assert_eq!(labels, vec![5, 6, 7, -100, 9, 10, 11, -100]);
//! // A left-padded batch: HF's attention_mask, position_ids = cumsum(mask) − 1.
//! let layout = SequenceLayout::from_attention_mask(1, 4, vec![0, 0, 1, 1])?;
//! assert_eq!(layout.position_ids(), vec![0, 0, 0, 1]);
//! # Ok::<(), moe_models::packing::PackingError>(())
//! ```

use std::ops::Range;

use burn::tensor::{Bool, Device, Int, Tensor, TensorData};
use moe_backend::router::RouteOptions;

use crate::causal_lm::IGNORE_INDEX;
use crate::layers::attention::AttentionMask;
use crate::layers::rope::{RopeTables, RotaryEmbedding};

/// What is wrong with packing information or an attention mask; each variant names the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PackingError {
    /// The batch shape itself is empty.
    #[error("a layout needs at least one row and one token per row, got [{batch}, {seq_len}]")]
    EmptyShape {
        /// Rows.
        batch: usize,
        /// Tokens per row.
        seq_len: usize,
    },
    /// `cu_seqlens` does not hold one entry per row.
    #[error("`cu_seqlens` has {found} rows, the batch has {batch}")]
    CuSeqlensRows {
        /// Rows given.
        found: usize,
        /// Rows of the batch.
        batch: usize,
    },
    /// A row's `cu_seqlens` is empty or does not start at 0.
    #[error("`cu_seqlens` of row {row} must start with 0, found {found}")]
    CuSeqlensStart {
        /// The row.
        row: usize,
        /// Its first entry (`"nothing"` when empty).
        found: String,
    },
    /// A row's `cu_seqlens` is not strictly increasing (an empty or negative-length document).
    #[error(
        "`cu_seqlens` of row {row} must be strictly increasing: entry {index} is {value} after \
         {previous}"
    )]
    CuSeqlensNotIncreasing {
        /// The row.
        row: usize,
        /// Index of the offending entry.
        index: usize,
        /// The entry before it.
        previous: usize,
        /// The offending entry.
        value: usize,
    },
    /// A row's last document ends beyond the row.
    #[error("`cu_seqlens` of row {row} ends at {end}, beyond the row length S = {seq_len}")]
    CuSeqlensBeyondRow {
        /// The row.
        row: usize,
        /// Its last entry.
        end: usize,
        /// Tokens per row.
        seq_len: usize,
    },
    /// `attention_mask` does not have the shape of the ids.
    #[error(
        "`attention_mask` has {found} values, expected {} for the [{batch}, {seq_len}] shape of \
         `input_ids`",
        batch * seq_len
    )]
    AttentionMaskShape {
        /// Values given.
        found: usize,
        /// Rows.
        batch: usize,
        /// Tokens per row.
        seq_len: usize,
    },
    /// An `attention_mask` value other than 0 or 1.
    #[error("`attention_mask` at row {row}, column {column} is {value}; it must be 0 or 1")]
    AttentionMaskValue {
        /// The row.
        row: usize,
        /// The column.
        column: usize,
        /// The value found.
        value: i64,
    },
    /// The layout was built for another batch shape than the ids it is used with.
    #[error(
        "the packing layout describes a [{layout_batch}, {layout_seq}] batch but `{field}` is \
         [{batch}, {seq_len}]"
    )]
    ShapeMismatch {
        /// The input compared with the layout (`input_ids`, `labels`).
        field: &'static str,
        /// Rows of the layout.
        layout_batch: usize,
        /// Tokens per row of the layout.
        layout_seq: usize,
        /// Rows of the input.
        batch: usize,
        /// Tokens per row of the input.
        seq_len: usize,
    },
}

/// Where every token of a `[batch, S]` batch sits: its document, whether it is real, its RoPE
/// position (see the [module docs](self)). Validated on construction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SequenceLayout {
    batch: usize,
    seq_len: usize,
    /// `[B·S]` document of each real token (index within its row, ≥ 0); a padding token at
    /// column `c` gets `−(c + 1)`, unique in its row, so it attends only to itself.
    segments: Vec<i64>,
    /// `[B·S]` RoPE position of each token (0 for padding).
    positions: Vec<usize>,
    /// `[B·S]` run of each token: maximal stretches of consecutive real tokens of one document
    /// share a run id (unique in the row); padding tokens get their own. A target `c` is
    /// scored from position `c − d` at prediction distance `d` iff both share a run.
    runs: Vec<i64>,
    /// Per row, the document boundaries it was built from (`None`: one document per row).
    cu_seqlens: Option<Vec<Vec<usize>>>,
}

impl SequenceLayout {
    /// Packed rows: `cu_seqlens[b]` lists row `b`'s document boundaries (Megatron THD
    /// `cu_seqlens` of one row: `[0, l₀, l₀+l₁, …]`, strictly increasing, the last entry `≤ S`;
    /// tokens after it are padding; `[0]` alone is a row of padding only).
    pub fn from_cu_seqlens(
        batch: usize,
        seq_len: usize,
        cu_seqlens: Vec<Vec<usize>>,
    ) -> Result<Self, PackingError> {
        Self::new(batch, seq_len, Some(cu_seqlens), None)
    }

    /// Padded rows: HF `attention_mask [batch, S]` (row-major, 1 = real token, 0 = padding;
    /// left, right or any padding). Every row is one document.
    pub fn from_attention_mask(
        batch: usize,
        seq_len: usize,
        attention_mask: Vec<i64>,
    ) -> Result<Self, PackingError> {
        Self::new(batch, seq_len, None, Some(attention_mask))
    }

    /// Packed and/or padded rows (see the [module docs](self)); with neither, every token is
    /// real and every row one document (the plain causal batch).
    pub fn new(
        batch: usize,
        seq_len: usize,
        cu_seqlens: Option<Vec<Vec<usize>>>,
        attention_mask: Option<Vec<i64>>,
    ) -> Result<Self, PackingError> {
        if batch == 0 || seq_len == 0 {
            return Err(PackingError::EmptyShape { batch, seq_len });
        }
        if let Some(cu) = &cu_seqlens {
            check_cu_seqlens(cu, batch, seq_len)?;
        }
        if let Some(mask) = &attention_mask {
            check_mask(mask, batch, seq_len)?;
        }
        let n = batch * seq_len;
        let (mut segments, mut positions, mut runs) =
            (vec![0i64; n], vec![0usize; n], vec![0i64; n]);
        for b in 0..batch {
            // Document of each column (None: after the last boundary).
            let doc_of = |c: usize| -> Option<usize> {
                match &cu_seqlens {
                    None => Some(0),
                    Some(cu) => {
                        let row = &cu[b];
                        let end = row.last().copied().unwrap_or(0);
                        (c < end).then(|| row.partition_point(|&x| x <= c) - 1)
                    }
                }
            };
            let mut count_in_doc = 0usize;
            let mut current: Option<usize> = None;
            let mut run = 0i64;
            let mut prev_real_doc: Option<usize> = None;
            for c in 0..seq_len {
                let i = b * seq_len + c;
                let doc = doc_of(c);
                if doc != current {
                    current = doc;
                    count_in_doc = 0;
                }
                let masked = attention_mask.as_ref().is_some_and(|m| m[i] == 0);
                match doc.filter(|_| !masked) {
                    Some(d) => {
                        segments[i] = d as i64;
                        positions[i] = count_in_doc;
                        count_in_doc += 1;
                        if prev_real_doc != Some(d) {
                            run += 1;
                        }
                        runs[i] = run;
                        prev_real_doc = Some(d);
                    }
                    None => {
                        segments[i] = -(c as i64) - 1;
                        positions[i] = 0;
                        runs[i] = -(c as i64) - 1;
                        prev_real_doc = None;
                    }
                }
            }
        }
        Ok(Self {
            batch,
            seq_len,
            segments,
            positions,
            runs,
            cu_seqlens,
        })
    }

    /// Rows `B`.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Tokens per row `S`.
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// The per-row document boundaries given at construction (`None` for a mask-only layout).
    pub fn cu_seqlens(&self) -> Option<&[Vec<usize>]> {
        self.cu_seqlens.as_deref()
    }

    /// Errors unless the layout describes a `[batch, seq_len]` batch; `field` names the input
    /// compared with it.
    pub fn check_shape(
        &self,
        field: &'static str,
        batch: usize,
        seq_len: usize,
    ) -> Result<(), PackingError> {
        if self.batch == batch && self.seq_len == seq_len {
            Ok(())
        } else {
            Err(PackingError::ShapeMismatch {
                field,
                layout_batch: self.batch,
                layout_seq: self.seq_len,
                batch,
                seq_len,
            })
        }
    }

    /// Whether token `i` (row-major index) is real.
    fn is_real(&self, i: usize) -> bool {
        self.segments[i] >= 0
    }

    /// HF `attention_mask [B·S]` (row-major): 1 for a real token, 0 for padding.
    pub fn attention_mask(&self) -> Vec<i64> {
        (0..self.segments.len())
            .map(|i| i64::from(self.is_real(i)))
            .collect()
    }

    /// `[B·S]` padding flags in Megatron's convention (`true` = padded), the router's padding
    /// mask for rows `b·S + s`.
    pub fn padding_mask(&self) -> Vec<bool> {
        self.segments.iter().map(|&s| s < 0).collect()
    }

    /// Whether any token is padding.
    pub fn has_padding(&self) -> bool {
        self.segments.iter().any(|&s| s < 0)
    }

    /// Real tokens of the batch.
    pub fn real_tokens(&self) -> usize {
        self.segments.iter().filter(|&&s| s >= 0).count()
    }

    /// [`position_ids`](Self::position_ids) as stored.
    pub(crate) fn positions(&self) -> &[usize] {
        &self.positions
    }

    /// `[B·S]` document of every token (row-major; `< 0` for padding, each padded token its
    /// own id).
    pub(crate) fn segment_ids(&self) -> &[i64] {
        &self.segments
    }

    /// `[B·S]` RoPE positions (row-major): restarting at 0 for every document, counting only
    /// real tokens (HF `cumsum(mask) − 1`); 0 on padding.
    pub fn position_ids(&self) -> Vec<i64> {
        self.positions.iter().map(|&p| p as i64).collect()
    }

    /// `[B·S]` document of every token (row-major): its index within the row for a real token,
    /// `−(column + 1)` for padding.
    pub fn document_ids(&self) -> &[i64] {
        &self.segments
    }

    /// Whether the target at row-major index `i` (`labels[i]`, scored from position `i − back`
    /// of the same row) is real and in the same document run as that position.
    fn target_kept(&self, i: usize, back: usize) -> bool {
        let c = i % self.seq_len;
        c >= back && self.runs[i] >= 0 && self.runs[i - back] == self.runs[i]
    }

    /// Sets to −100 every label that is not a next-token target of its document: padding, and
    /// `labels[c]` whose predicting position `c − 1` is padding or another document (the
    /// first token of every document but a row's first). Column 0 keeps its label unless it is
    /// padding (it is never a target). `labels` is `[B·S]` row-major; other lengths are left
    /// alone (shapes are checked where labels meet ids).
    pub fn mask_labels(&self, labels: &mut [i64]) {
        if labels.len() != self.segments.len() {
            return;
        }
        for (i, label) in labels.iter_mut().enumerate() {
            let c = i % self.seq_len;
            let keep = if c == 0 {
                self.is_real(i)
            } else {
                self.target_kept(i, 1)
            };
            if !keep {
                *label = IGNORE_INDEX;
            }
        }
    }

    /// `labels` (`[B·S]` row-major) as targets at prediction distance `back` (`labels[c]`
    /// scored from position `c − back`, e.g. `back = j + 2` for multi-token-prediction depth
    /// `j`): −100 unless positions `c − back ..= c` are real tokens of one document.
    pub fn mask_labels_at_distance(&self, labels: &[i64], back: usize) -> Vec<i64> {
        labels
            .iter()
            .enumerate()
            .map(|(i, &t)| {
                if i < self.segments.len() && self.target_kept(i, back) {
                    t
                } else {
                    IGNORE_INDEX
                }
            })
            .collect()
    }

    /// `values` (`[B·S]` row-major, e.g. ids) rolled left by `by` within every document
    /// (Megatron's `roll_tensor` of packed sequences): position `c` gets `values[c + by]` when
    /// positions `c ..= c + by` are real tokens of one document, else `fill` (the tail of every
    /// document, and padding), as each document rolled alone.
    pub fn roll_within_documents(&self, values: &[i64], by: usize, fill: i64) -> Vec<i64> {
        (0..values.len())
            .map(|i| {
                let same = i % self.seq_len + by < self.seq_len
                    && i + by < self.runs.len()
                    && self.runs[i] >= 0
                    && self.runs[i] == self.runs[i + by];
                if same { values[i + by] } else { fill }
            })
            .collect()
    }

    /// The RoPE tables `[B, S, dim]` of [`position_ids`](Self::position_ids).
    pub fn rope_tables(&self, rope: &RotaryEmbedding, device: &Device) -> RopeTables {
        rope.tables_at(&self.positions, [self.batch, self.seq_len], device)
    }

    /// The block-diagonal causal attention mask `[B, S, S]` of the batch: query `i` sees key
    /// `j ≤ i` of its own document (a padding token only itself).
    pub fn attention_mask_tensor(&self, device: &Device) -> AttentionMask {
        // Ids fit i32: a row has fewer than 2³¹ columns.
        let ids: Vec<i32> = self.segments.iter().map(|&s| s as i32).collect();
        let ids =
            Tensor::<2, Int>::from_data(TensorData::new(ids, [self.batch, self.seq_len]), device);
        AttentionMask::from_document_ids(ids)
    }

    /// The router padding mask (`true` = padded) of rows `rows` of the flattened `[B·S]` batch,
    /// e.g. one sequence-parallel rank's block.
    pub fn padding_rows(&self, rows: Range<usize>, device: &Device) -> Tensor<1, Bool> {
        let n = rows.len();
        let flags: Vec<bool> = rows
            .map(|r| self.segments.get(r).is_none_or(|&s| s < 0))
            .collect();
        Tensor::from_data(TensorData::new(flags, [n]), device)
    }
}

/// A [`SequenceLayout`] on the device, built once per forward and shared by every layer: the
/// per-row RoPE tables, the attention mask and the routers' padding mask.
#[derive(Debug, Clone)]
pub struct PackedInputs {
    /// RoPE tables `[B, S, dim]` of the layout's positions.
    pub rope: RopeTables,
    /// Block-diagonal causal mask `[B, S, S]` (padding masked out).
    pub mask: AttentionMask,
    /// The routers' `[T]` padding mask (`true` = padded) of the rows this rank routes.
    pub padding: Tensor<1, Bool>,
}

impl PackedInputs {
    /// The device inputs of `layout` for RoPE frequencies `rope`, the router seeing every row
    /// `b·S + s` of the batch.
    pub fn new(layout: &SequenceLayout, rope: &RotaryEmbedding, device: &Device) -> Self {
        Self::for_rows(layout, rope, 0..layout.batch * layout.seq_len, device)
    }

    /// [`new`](Self::new) whose router padding mask covers only `rows` of the flattened
    /// `[B·S]` batch (one sequence-parallel rank's block; attention still sees every row).
    pub fn for_rows(
        layout: &SequenceLayout,
        rope: &RotaryEmbedding,
        rows: Range<usize>,
        device: &Device,
    ) -> Self {
        Self {
            rope: layout.rope_tables(rope, device),
            mask: layout.attention_mask_tensor(device),
            padding: layout.padding_rows(rows, device),
        }
    }

    /// Router options carrying the padding mask.
    pub fn route_options(&self) -> RouteOptions<'static> {
        RouteOptions::default().with_padding_mask(self.padding.clone())
    }
}

fn check_cu_seqlens(cu: &[Vec<usize>], batch: usize, seq_len: usize) -> Result<(), PackingError> {
    if cu.len() != batch {
        return Err(PackingError::CuSeqlensRows {
            found: cu.len(),
            batch,
        });
    }
    for (row, bounds) in cu.iter().enumerate() {
        match bounds.first() {
            Some(0) => {}
            other => {
                return Err(PackingError::CuSeqlensStart {
                    row,
                    found: other.map_or_else(|| "nothing".to_owned(), |v| v.to_string()),
                });
            }
        }
        for (index, pair) in bounds.windows(2).enumerate() {
            if pair[1] <= pair[0] {
                return Err(PackingError::CuSeqlensNotIncreasing {
                    row,
                    index: index + 1,
                    previous: pair[0],
                    value: pair[1],
                });
            }
        }
        let end = bounds.last().copied().unwrap_or(0);
        if end > seq_len {
            return Err(PackingError::CuSeqlensBeyondRow { row, end, seq_len });
        }
    }
    Ok(())
}

fn check_mask(mask: &[i64], batch: usize, seq_len: usize) -> Result<(), PackingError> {
    if mask.len() != batch * seq_len {
        return Err(PackingError::AttentionMaskShape {
            found: mask.len(),
            batch,
            seq_len,
        });
    }
    match mask.iter().position(|&v| v != 0 && v != 1) {
        None => Ok(()),
        Some(i) => Err(PackingError::AttentionMaskValue {
            row: i / seq_len,
            column: i % seq_len,
            value: mask[i],
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_rows_restart_positions_and_mask_boundaries() {
        let l = SequenceLayout::from_cu_seqlens(2, 5, vec![vec![0, 2, 5], vec![0, 3]]).unwrap();
        assert_eq!(l.position_ids(), vec![0, 1, 0, 1, 2, 0, 1, 2, 0, 0]);
        assert_eq!(l.document_ids(), &[0, 0, 1, 1, 1, 0, 0, 0, -4, -5]);
        assert_eq!(l.attention_mask(), vec![1, 1, 1, 1, 1, 1, 1, 1, 0, 0]);
        let mut labels: Vec<i64> = (10..20).collect();
        l.mask_labels(&mut labels);
        assert_eq!(labels, vec![10, 11, -100, 13, 14, 15, 16, 17, -100, -100]);
        let rolled = l.roll_within_documents(&(10..20).collect::<Vec<_>>(), 1, 0);
        assert_eq!(rolled, vec![11, 0, 13, 14, 0, 16, 17, 0, 0, 0]);
        // MTP depth 0 (distance 2): targets whose position two back is in the same document.
        let mtp = l.mask_labels_at_distance(&(10..20).collect::<Vec<_>>(), 2);
        assert_eq!(
            mtp,
            vec![-100, -100, -100, -100, 14, -100, -100, 17, -100, -100]
        );
        assert!(l.has_padding());
        assert_eq!(l.real_tokens(), 8);
    }

    #[test]
    fn left_padding_uses_hf_positions_and_masks_the_first_target() {
        let l = SequenceLayout::from_attention_mask(2, 4, vec![0, 1, 1, 1, 1, 1, 0, 0]).unwrap();
        assert_eq!(l.position_ids(), vec![0, 0, 1, 2, 0, 1, 0, 0]);
        let mut labels = vec![1, 2, 3, 4, 5, 6, 7, 8];
        l.mask_labels(&mut labels);
        assert_eq!(labels, vec![-100, -100, 3, 4, 5, 6, -100, -100]);
        assert_eq!(
            l.padding_mask(),
            vec![true, false, false, false, false, false, true, true]
        );
    }

    #[test]
    fn mask_and_cu_seqlens_combine() {
        // Documents [0, 3) and [3, 6); the mask drops column 1 (a hole) and column 6.
        let l = SequenceLayout::new(
            1,
            7,
            Some(vec![vec![0, 3, 6]]),
            Some(vec![1, 0, 1, 1, 1, 1, 0]),
        )
        .unwrap();
        assert_eq!(l.position_ids(), vec![0, 0, 1, 0, 1, 2, 0]);
        let mut labels = vec![1, 2, 3, 4, 5, 6, 7];
        l.mask_labels(&mut labels);
        assert_eq!(labels, vec![1, -100, -100, -100, 5, 6, -100]);
    }

    #[test]
    fn bad_inputs_name_the_field() {
        let err = |r: Result<SequenceLayout, PackingError>| r.unwrap_err().to_string();
        let e = err(SequenceLayout::from_cu_seqlens(1, 8, vec![vec![0, 4, 3]]));
        assert!(
            e.contains("`cu_seqlens` of row 0") && e.contains("increasing"),
            "{e}"
        );
        let e = err(SequenceLayout::from_cu_seqlens(1, 8, vec![vec![0, 4, 9]]));
        assert!(e.contains("`cu_seqlens`") && e.contains("beyond"), "{e}");
        let e = err(SequenceLayout::from_cu_seqlens(1, 8, vec![vec![1, 4]]));
        assert!(e.contains("start with 0"), "{e}");
        let e = err(SequenceLayout::from_cu_seqlens(1, 8, vec![vec![]]));
        assert!(e.contains("start with 0"), "{e}");
        let e = err(SequenceLayout::from_cu_seqlens(2, 8, vec![vec![0, 8]]));
        assert!(e.contains("`cu_seqlens` has 1 rows"), "{e}");
        let e = err(SequenceLayout::from_attention_mask(2, 4, vec![1; 7]));
        assert!(e.contains("`attention_mask` has 7 values"), "{e}");
        let e = err(SequenceLayout::from_attention_mask(1, 2, vec![1, 2]));
        assert!(
            e.contains("`attention_mask` at row 0, column 1 is 2"),
            "{e}"
        );
        let l = SequenceLayout::from_attention_mask(1, 2, vec![1, 1]).unwrap();
        let e = l.check_shape("input_ids", 1, 3).unwrap_err().to_string();
        assert!(e.contains("`input_ids` is [1, 3]"), "{e}");
    }
}
