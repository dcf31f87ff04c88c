//! The numerics of upcycling (docs/checkpoints.md §Upcycling) on host f32 buffers: the scale rule,
//! the seeded router draw with repeated rows, and the split of a dense SwiGLU MLP into `G` expert
//! shards.

/// How routing weights are formed in the upcycled model (docs/checkpoints.md §Upcycling).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RouterMode {
    /// Top-k of the logits, softmax over the selected k (HF `norm_topk_prob = true`):
    /// `s = G`; exact for `G = 1`, and for `k = G` with homogeneous activations.
    #[default]
    PostSoftmax,
    /// Softmax over all experts, then top-k without renormalisation (`norm_topk_prob =
    /// false`): `s = R·G²/k`, exact only for a uniform router.
    PreSoftmax,
}

/// The derived sizes and factors of one upcycling (docs/checkpoints.md §Upcycling, steps 1 and 4).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct UpcycleScale {
    /// `E`, routed experts.
    pub experts: usize,
    /// `k`, experts per token.
    pub topk: usize,
    /// `G = F_dense / F_moe`.
    pub granularity: usize,
    /// `R = E / G`, the expansion (copies of each shard).
    pub expansion: usize,
    /// `F_dense`, the dense MLP width.
    pub dense_intermediate: usize,
    /// `F_moe = F / G`, each expert's width (`moe_intermediate_size`).
    pub moe_intermediate: usize,
    /// `s`: `G` post-softmax, `R·G²/k` pre-softmax.
    pub scale: f64,
    /// `c = s^(1/3)`, the factor applied to each of gate, up and down (SwiGLU).
    pub weight_multiplier: f64,
}

impl UpcycleScale {
    /// Checks `G | F`, `G | E`, `1 ≤ k ≤ E` and derives `R`, `F/G`, `s` and `c` (GLU rule
    /// `c = s^(1/3)`). Errors name the offending option.
    pub fn new(
        experts: usize,
        topk: usize,
        granularity: usize,
        dense_intermediate: usize,
        mode: RouterMode,
    ) -> Result<Self, (&'static str, String)> {
        if granularity == 0 {
            return Err(("granularity", "must be ≥ 1".into()));
        }
        if experts == 0 {
            return Err(("experts", "must be ≥ 1".into()));
        }
        if topk == 0 || topk > experts {
            return Err(("topk", format!("k = {topk} must be in 1..={experts}")));
        }
        if !dense_intermediate.is_multiple_of(granularity) {
            return Err((
                "granularity",
                format!(
                    "G = {granularity} does not divide the dense intermediate_size \
                     F = {dense_intermediate}"
                ),
            ));
        }
        if !experts.is_multiple_of(granularity) {
            return Err((
                "granularity",
                format!("G = {granularity} does not divide the number of experts E = {experts}"),
            ));
        }
        if mode == RouterMode::PostSoftmax && topk == 1 {
            return Err((
                "topk",
                "post-softmax routing with k = 1 gives a constant weight of 1 \
                 (Qwen3-MoE norm_topk_prob); use pre-softmax"
                    .into(),
            ));
        }
        let expansion = experts / granularity;
        let g = granularity as f64;
        let scale = match mode {
            RouterMode::PostSoftmax => g,
            RouterMode::PreSoftmax => expansion as f64 * g * g / topk as f64,
        };
        Ok(Self {
            experts,
            topk,
            granularity,
            expansion,
            dense_intermediate,
            moe_intermediate: dense_intermediate / granularity,
            scale,
            weight_multiplier: scale.cbrt(),
        })
    }

    /// The shard expert `e` receives: `e % G` (list `[s0 … s_{G−1}] × R`).
    pub fn shard_of(&self, expert: usize) -> usize {
        expert % self.granularity
    }
}

/// SplitMix64: a tiny, portable generator so that a seed gives the same router everywhere.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform sample in `(0, 1]` (53 bits).
    fn unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64
    }

    /// A standard normal sample (Box–Muller, cosine branch).
    pub fn normal(&mut self) -> f64 {
        let (u1, u2) = (self.unit(), self.unit());
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

/// The upcycled router `[E, H]` (row-major) for one layer (docs/checkpoints.md §Upcycling, step 3):
/// the MoE model's own router `[E, H]` is drawn from `N(0, std²)` with `rng` (HF's
/// `initializer_range` init), its first `E/G` rows are kept and each is repeated `G` times, so row
/// `e` is drawn row `⌊e/G⌋`.
pub fn upcycled_router(
    rng: &mut SplitMix64,
    scale: &UpcycleScale,
    hidden: usize,
    std: f64,
) -> Vec<f32> {
    let drawn: Vec<f32> = (0..scale.experts * hidden)
        .map(|_| (rng.normal() * std) as f32)
        .collect();
    (0..scale.experts)
        .flat_map(|e| {
            let r = e / scale.granularity;
            drawn[r * hidden..(r + 1) * hidden].iter().copied()
        })
        .collect()
}

/// One expert shard of a dense SwiGLU MLP, already multiplied by `c`.
#[derive(Debug, Clone, PartialEq)]
pub struct ExpertShard {
    /// `gate_proj` rows `[F/G, H]`.
    pub gate: Vec<f32>,
    /// `up_proj` rows `[F/G, H]`.
    pub up: Vec<f32>,
    /// `down_proj` columns `[H, F/G]`.
    pub down: Vec<f32>,
}

/// Splits a dense SwiGLU MLP (`gate`, `up` `[F, H]`, `down` `[H, F]`, row-major) into the `G`
/// shards of docs/checkpoints.md §Upcycling, steps 4–6: gate and up are split **separately** into
/// `G` row blocks (shard `i` = `(gate_i, up_i)`), down into `G` column blocks; every value is
/// multiplied by `c` (in f64, rounded once to f32).
pub fn split_dense_mlp(
    gate: &[f32],
    up: &[f32],
    down: &[f32],
    hidden: usize,
    scale: &UpcycleScale,
) -> Vec<ExpertShard> {
    let (f, fm) = (scale.dense_intermediate, scale.moe_intermediate);
    let c = scale.weight_multiplier;
    let mul = |v: f32| {
        if c == 1.0 {
            v
        } else {
            (f64::from(v) * c) as f32
        }
    };
    (0..scale.granularity)
        .map(|i| {
            let rows = i * fm * hidden..(i + 1) * fm * hidden;
            ExpertShard {
                gate: gate[rows.clone()].iter().map(|&v| mul(v)).collect(),
                up: up[rows].iter().map(|&v| mul(v)).collect(),
                down: (0..hidden)
                    .flat_map(|r| down[r * f + i * fm..r * f + (i + 1) * fm].iter())
                    .map(|&v| mul(v))
                    .collect(),
            }
        })
        .collect()
}
