//! A batch's routing as data: what a routing must match ([`ReplaySpec`]) and the experts
//! every token was routed to ([`RoutedExperts`], RL routing replay; docs/training-and-rl.md
//! §Router replay). The sharded forwards replay it ([`crate::distributed::replay`]); replay
//! files ([`crate::replay`]) store it.

use crate::ModelError;

/// What a model expects of a replay file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplaySpec {
    /// HF `model_type`.
    pub model_type: &'static str,
    /// Decoder-layer indices of the MoE layers, ascending.
    pub moe_layers: Vec<usize>,
    /// Decoder-layer indices `N + j` of the multi-token-prediction modules' MoE layers
    /// (DeepSeek-V3, depth order; empty for other models). A routing may cover them after
    /// [`moe_layers`](Self::moe_layers) (Megatron numbers the MTP routers after the
    /// decoder's, in the order it builds them).
    pub mtp_layers: Vec<usize>,
    /// `k`.
    pub topk: usize,
    /// `E`, routed experts.
    pub num_experts: usize,
}

/// Expert ids routed to by every token of a batch in every MoE layer:
/// `indices [batch, seq, layers, topk]`, row-major (see the [module docs](self)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutedExperts {
    /// `B`, sequences.
    pub batch: usize,
    /// `S`, tokens per sequence.
    pub seq: usize,
    /// MoE layers (ascending decoder-layer order; dense layers are not counted), optionally
    /// followed by the MTP modules' (depth order).
    pub layers: usize,
    /// `k`, experts per token.
    pub topk: usize,
    /// Row-major `[batch, seq, layers, topk]` expert ids.
    pub indices: Vec<i64>,
}

fn invalid(what: &'static str, reason: String) -> ModelError {
    ModelError::InvalidInput { what, reason }
}

impl RoutedExperts {
    /// Wraps row-major `[batch, seq, layers, topk]` ids; errors unless their count is
    /// `batch·seq·layers·topk`.
    pub fn new(
        batch: usize,
        seq: usize,
        layers: usize,
        topk: usize,
        indices: Vec<i64>,
    ) -> Result<Self, ModelError> {
        let routed = Self {
            batch,
            seq,
            layers,
            topk,
            indices,
        };
        routed.check_len()?;
        Ok(routed)
    }

    /// Builds the ids from per-layer row-major `[batch·seq, topk]` tensors' values.
    pub fn from_layers(
        batch: usize,
        seq: usize,
        topk: usize,
        layers: &[Vec<i64>],
    ) -> Result<Self, ModelError> {
        let t = batch * seq;
        if let Some((l, ids)) = layers.iter().enumerate().find(|(_, v)| v.len() != t * topk) {
            return Err(invalid(
                "routed_experts.indices",
                format!(
                    "layer {l} has {} ids, expected batch·seq·topk = {t}·{topk}",
                    ids.len()
                ),
            ));
        }
        let mut indices = Vec::with_capacity(t * layers.len() * topk);
        for row in 0..t {
            for layer in layers {
                indices.extend_from_slice(&layer[row * topk..(row + 1) * topk]);
            }
        }
        Self::new(batch, seq, layers.len(), topk, indices)
    }

    /// `B·S`.
    pub fn num_tokens(&self) -> usize {
        self.batch * self.seq
    }

    /// The `k` ids of token `(b, s)` in MoE layer `layer`.
    pub fn token(&self, b: usize, s: usize, layer: usize) -> &[i64] {
        let at = ((b * self.seq + s) * self.layers + layer) * self.topk;
        &self.indices[at..at + self.topk]
    }

    /// MoE layer `layer`'s ids of the token rows `rows` (of the `b·S + s` flattening),
    /// row-major `[rows.len(), topk]`.
    pub fn layer_rows(&self, layer: usize, rows: std::ops::Range<usize>) -> Vec<i64> {
        let (l, k) = (self.layers, self.topk);
        rows.flat_map(|row| {
            let at = (row * l + layer) * k;
            self.indices[at..at + k].iter().copied()
        })
        .collect()
    }

    /// MoE layer `layer`'s ids of the token rows `rows` (of the `b·S + s` flattening, any
    /// order), row-major `[rows.len(), topk]`.
    pub fn layer_at_rows(&self, layer: usize, rows: &[usize]) -> Vec<i64> {
        let (l, k) = (self.layers, self.topk);
        rows.iter()
            .flat_map(|&row| {
                let at = (row * l + layer) * k;
                self.indices[at..at + k].iter().copied()
            })
            .collect()
    }

    /// The sequences `batches` (e.g. one data-parallel replica's rows of a global batch).
    pub fn slice_batch(&self, batches: std::ops::Range<usize>) -> Result<Self, ModelError> {
        if batches.start > batches.end || batches.end > self.batch {
            return Err(invalid(
                "routed_experts.batch",
                format!("sequences {batches:?} of a batch of {}", self.batch),
            ));
        }
        let per = self.seq * self.layers * self.topk;
        Self::new(
            batches.len(),
            self.seq,
            self.layers,
            self.topk,
            self.indices[batches.start * per..batches.end * per].to_vec(),
        )
    }

    fn check_len(&self) -> Result<(), ModelError> {
        let want = self.batch * self.seq * self.layers * self.topk;
        if self.indices.len() != want {
            return Err(invalid(
                "routed_experts.indices",
                format!(
                    "{} ids, expected batch·seq·layers·topk = {}·{}·{}·{} = {want}",
                    self.indices.len(),
                    self.batch,
                    self.seq,
                    self.layers,
                    self.topk
                ),
            ));
        }
        Ok(())
    }

    /// Checks the routing against a forward of `input_ids [batch, seq]` of a model described
    /// by `spec`: id count, `batch`, `seq`, `layers` (the model's MoE layers, or those and its
    /// MTP layers), `topk` (the router's `k`), ids in `0..E` and distinct within each token.
    /// Errors name the field (`routed_experts.batch`, `.seq`, `.layers`, `.topk`, `.indices`).
    pub fn validate(&self, batch: usize, seq: usize, spec: &ReplaySpec) -> Result<(), ModelError> {
        self.check_len()?;
        if self.batch != batch {
            return Err(invalid(
                "routed_experts.batch",
                format!("{} sequences routed, the forward has {batch}", self.batch),
            ));
        }
        if self.seq != seq {
            return Err(invalid(
                "routed_experts.seq",
                format!(
                    "{} tokens per sequence routed, the forward has {seq}",
                    self.seq
                ),
            ));
        }
        let (main, mtp) = (spec.moe_layers.len(), spec.mtp_layers.len());
        if self.layers != main && (mtp == 0 || self.layers != main + mtp) {
            let with_mtp = match mtp {
                0 => String::new(),
                _ => format!(" (and {mtp} MTP layers {:?})", spec.mtp_layers),
            };
            return Err(invalid(
                "routed_experts.layers",
                format!(
                    "{} layers routed, the model has {main} MoE layers {:?}{with_mtp}",
                    self.layers, spec.moe_layers
                ),
            ));
        }
        if self.topk != spec.topk {
            return Err(invalid(
                "routed_experts.topk",
                format!(
                    "topk = {}, the router selects num_experts_per_tok = {}",
                    self.topk, spec.topk
                ),
            ));
        }
        let e = spec.num_experts as i64;
        for (at, chunk) in self.indices.chunks(self.topk.max(1)).enumerate() {
            let (token, layer) = (at / self.layers.max(1), at % self.layers.max(1));
            let (b, s) = (token / self.seq.max(1), token % self.seq.max(1));
            for (j, &id) in chunk.iter().enumerate() {
                if !(0..e).contains(&id) {
                    return Err(invalid(
                        "routed_experts.indices",
                        format!("[{b}, {s}, {layer}, {j}]: expert {id} out of range 0..{e}"),
                    ));
                }
                if chunk[..j].contains(&id) {
                    return Err(invalid(
                        "routed_experts.indices",
                        format!("[{b}, {s}, {layer}]: expert {id} selected twice"),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Whether the routing covers the MTP modules of a model described by `spec` (after its
    /// main MoE layers).
    pub fn covers_mtp(&self, spec: &ReplaySpec) -> bool {
        !spec.mtp_layers.is_empty() && self.layers == spec.moe_layers.len() + spec.mtp_layers.len()
    }
}
