//! [`TrainBatch`]: one replica's batch of token rows (plain, packed or padded, optionally
//! carrying the routing an inference engine used), what every forward of the models reads.

use crate::ModelError;
use crate::causal_lm::IGNORE_INDEX;
use crate::packing::SequenceLayout;
use crate::routing::RoutedExperts;

/// One replica's batch: `batch` rows of equal length, row-major; optionally packed (several
/// documents per row, Megatron THD `cu_seqlens` per row) and/or padded (HF `attention_mask`),
/// see [`crate::packing`].
#[derive(Debug, Clone, PartialEq)]
pub struct TrainBatch {
    /// Token ids `[batch, S]`.
    pub input_ids: Vec<i64>,
    /// HF labels `[batch, S]` (shifted inside; −100 ignored).
    pub labels: Vec<i64>,
    /// Rows.
    pub batch: usize,
    /// Document boundaries and padding of the rows (`None`: every row one unpadded sequence).
    layout: Option<SequenceLayout>,
    /// The routing the training forwards replay (`None`: the routers choose).
    routed: Option<RoutedExperts>,
}

/// Which end of a row [`TrainBatch::padded`] fills with padding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PaddingSide {
    /// Padding before the tokens (HF generation batches).
    Left,
    /// Padding after the tokens.
    Right,
}

impl TrainBatch {
    /// Plain causal-LM batch: labels equal the ids.
    pub fn causal(input_ids: Vec<i64>, batch: usize) -> Result<Self, ModelError> {
        let labels = input_ids.clone();
        Self::new(input_ids, labels, batch)
    }

    /// A batch with explicit labels.
    pub fn new(input_ids: Vec<i64>, labels: Vec<i64>, batch: usize) -> Result<Self, ModelError> {
        if batch == 0
            || input_ids.is_empty()
            || input_ids.len() != labels.len()
            || !input_ids.len().is_multiple_of(batch)
        {
            return Err(ModelError::input(
                "batch",
                format!(
                    "{} ids and {} labels do not form {batch} equal non-empty rows",
                    input_ids.len(),
                    labels.len()
                ),
            ));
        }
        Ok(Self {
            input_ids,
            labels,
            batch,
            layout: None,
            routed: None,
        })
    }

    /// The batch packed and/or padded as `layout` says (its shape must be the ids'): the
    /// labels that are not next-token targets of their document (across a boundary, or
    /// padding) become −100 ([`SequenceLayout::mask_labels`]), and the forwards mask attention
    /// and route padding accordingly.
    pub fn with_layout(mut self, layout: SequenceLayout) -> Result<Self, ModelError> {
        layout.check_shape("input_ids", self.batch, self.seq_len())?;
        layout.mask_labels(&mut self.labels);
        self.layout = Some(layout);
        Ok(self)
    }

    /// [`with_layout`](Self::with_layout) of packed rows: `cu_seqlens[b]` are row `b`'s
    /// document boundaries (`[0, l₀, l₀+l₁, …]`, strictly increasing, ending at or before
    /// `S`; the rest of the row is padding). Errors name the field.
    pub fn with_cu_seqlens(self, cu_seqlens: Vec<Vec<usize>>) -> Result<Self, ModelError> {
        let layout = SequenceLayout::from_cu_seqlens(self.batch, self.seq_len(), cu_seqlens)?;
        self.with_layout(layout)
    }

    /// [`with_layout`](Self::with_layout) of padded rows: HF `attention_mask [batch, S]`
    /// (1 = real token, 0 = padding; left or right). Errors name the field.
    pub fn with_attention_mask(self, attention_mask: Vec<i64>) -> Result<Self, ModelError> {
        let layout =
            SequenceLayout::from_attention_mask(self.batch, self.seq_len(), attention_mask)?;
        self.with_layout(layout)
    }

    /// The batch's packing / padding layout, if any.
    pub fn layout(&self) -> Option<&SequenceLayout> {
        self.layout.as_ref()
    }

    /// The batch with its routing replayed (RL routing replay, docs/training-and-rl.md
    /// §Router replay): every training forward of the batch, under any layout, sends each
    /// token of each MoE layer to the experts `routed` gives
    /// ([`crate::distributed::replay`]: `[batch, S, layers, k]` over the batch's flattened
    /// tokens, packed rows and their padding included; `layers` the model's MoE layers, or
    /// those then DeepSeek-V3's MTP modules). The shape is checked here (`batch`, `S`); the
    /// layers, `k` and expert ids against the model at the forward. Errors name the field.
    pub fn with_routed_experts(mut self, routed: RoutedExperts) -> Result<Self, ModelError> {
        if routed.batch != self.batch || routed.seq != self.seq_len() {
            return Err(ModelError::input(
                "routed_experts",
                format!(
                    "a routing of [{}, {}] tokens for a batch of [{}, {}]",
                    routed.batch,
                    routed.seq,
                    self.batch,
                    self.seq_len()
                ),
            ));
        }
        self.routed = Some(routed);
        Ok(self)
    }

    /// The routing the batch's training forwards replay, if any.
    pub fn routed_experts(&self) -> Option<&RoutedExperts> {
        self.routed.as_ref()
    }

    /// Tokens per row `S`.
    pub fn seq_len(&self) -> usize {
        self.input_ids.len() / self.batch.max(1)
    }

    /// Packs documents into `batch` rows of `seq_len` tokens: documents are concatenated
    /// back to back and a document that does not fit the space left in a row continues at the
    /// start of the next; the tail is padded with `pad_id`. The rows' document boundaries
    /// (pieces of a split document count as documents) become the batch's layout, so
    /// attention never crosses a boundary, positions restart at every document, and no label
    /// crosses one (each document's first token and the padding get label −100). Documents
    /// beyond `batch · seq_len` tokens are dropped.
    pub fn packed(
        documents: &[Vec<i64>],
        batch: usize,
        seq_len: usize,
        pad_id: i64,
    ) -> Result<Self, ModelError> {
        let total = batch * seq_len;
        let (mut ids, mut labels) = (Vec::with_capacity(total), Vec::with_capacity(total));
        let mut cu_seqlens: Vec<Vec<usize>> = vec![vec![0]; batch];
        for doc in documents {
            for (i, &t) in doc.iter().enumerate() {
                if ids.len() == total {
                    break;
                }
                ids.push(t);
                labels.push(if i == 0 { IGNORE_INDEX } else { t });
                // Close the piece at the end of the document or of the row.
                let (row, col) = ((ids.len() - 1) / seq_len, (ids.len() - 1) % seq_len);
                if i + 1 == doc.len() || col + 1 == seq_len {
                    cu_seqlens[row].push(col + 1);
                }
            }
        }
        while ids.len() < total {
            ids.push(pad_id);
            labels.push(IGNORE_INDEX);
        }
        Self::new(ids, labels, batch)?.with_cu_seqlens(cu_seqlens)
    }

    /// One document per row, padded with `pad_id` on `side` to `seq_len` tokens (labels = ids,
    /// −100 on the padding), with the matching attention mask. Errors if a document is empty
    /// or longer than `seq_len`.
    pub fn padded(
        documents: &[Vec<i64>],
        seq_len: usize,
        pad_id: i64,
        side: PaddingSide,
    ) -> Result<Self, ModelError> {
        let mut ids = Vec::with_capacity(documents.len() * seq_len);
        let mut mask = Vec::with_capacity(ids.capacity());
        for (row, doc) in documents.iter().enumerate() {
            if doc.is_empty() || doc.len() > seq_len {
                return Err(ModelError::InvalidInput {
                    what: "documents",
                    reason: format!(
                        "document {row} has {} tokens; padding needs 1..={seq_len}",
                        doc.len()
                    ),
                });
            }
            let pad = seq_len - doc.len();
            let (tokens, padding) = (doc.iter().map(|&t| (t, 1)), (0..pad).map(|_| (pad_id, 0)));
            let row: Vec<(i64, i64)> = match side {
                PaddingSide::Left => padding.chain(tokens).collect(),
                PaddingSide::Right => tokens.chain(padding).collect(),
            };
            ids.extend(row.iter().map(|&(t, _)| t));
            mask.extend(row.iter().map(|&(_, m)| m));
        }
        Self::causal(ids, documents.len())?.with_attention_mask(mask)
    }

    /// Target tokens counted by the loss.
    pub fn target_tokens(&self) -> usize {
        scored_targets(&self.labels, self.seq_len())
    }
}

/// Targets the causal-LM loss of `labels [B, S]` scores (shifted by one inside).
pub(crate) fn scored_targets(labels: &[i64], s: usize) -> usize {
    labels
        .chunks(s)
        .map(|row| row[1..].iter().filter(|&&t| t != IGNORE_INDEX).count())
        .sum()
}

/// Targets the causal-LM loss of `labels [B, S]` scores at the predicting `positions` of
/// every row (position `i` scores `labels[i + 1]`).
pub(crate) fn scored_targets_at(labels: &[i64], s: usize, positions: &[usize]) -> usize {
    labels
        .chunks(s)
        .map(|row| {
            (positions.iter())
                .filter(|&&i| row.get(i + 1).is_some_and(|&t| t != IGNORE_INDEX))
                .count()
        })
        .sum()
}
