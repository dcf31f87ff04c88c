//! [`ParallelLayout`]: the dense (`TP × CP × DP × PP`) and expert (`ETP × EP × EDP × PP`) grids
//! folded over the same world (docs/parallelism.md §Parallel folding), with parsing and validation.

use std::fmt;
use std::str::FromStr;

use crate::error::{BackendError, Result};

/// The default rank order: the first token varies fastest (docs/parallelism.md §Rank groups).
pub const DEFAULT_ORDER: &str = "tp-cp-ep-dp-pp";

/// Parallel degrees of one training job.
///
/// `dp` and `edp` are derived: `dp = world / (tp·cp·pp)`, `edp = world / (etp·ep·pp)`. EP is not a
/// sub-dimension of DP: it may fold over `TP × CP × DP` (parallel folding).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParallelLayout {
    /// Number of ranks.
    pub world: usize,
    /// Dense tensor parallelism.
    pub tp: usize,
    /// Context parallelism (dense grid only).
    pub cp: usize,
    /// Pipeline parallelism (shared by both grids).
    pub pp: usize,
    /// Expert parallelism.
    pub ep: usize,
    /// Expert tensor parallelism (defaults to 1, as every omitted size: `world=4,tp=2,ep=4` =
    /// experts EP4 × EDP1 needs that, although Megatron defaults it to `tp`;
    /// docs/parallelism.md §Layout syntax).
    pub etp: usize,
    /// Dense data parallelism (derived).
    pub dp: usize,
    /// Expert data parallelism (derived).
    pub edp: usize,
    /// Rank order, hyphen-separated tokens from `tp, cp, ep, dp, pp`; first token has stride 1.
    pub order: String,
    /// Virtual pipeline stages per pipeline rank (Megatron's
    /// `--num-virtual-stages-per-pipeline-rank`; interleaved 1F1B when > 1; 1 by default).
    /// It does not change the rank grid.
    pub vpp: usize,
    /// Which layers each virtual pipeline stage holds, in the syntax of Megatron's
    /// `--pipeline-model-parallel-layout` (e.g. `Et*3|t*4|t*4|t*3L`, see
    /// [`crate::parallel::pipeline::PipelineSplit::parse`]); `None`: layers split evenly.
    /// Checked against the model when it is built.
    pub pp_layout: Option<String>,
}

/// Degrees given by the user; `None` means "default" (1).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LayoutSpec {
    /// Number of ranks (`None`: the smallest world both grids tile, see [`ParallelLayout::from_spec`]).
    pub world: Option<usize>,
    /// Dense tensor parallelism.
    pub tp: Option<usize>,
    /// Context parallelism.
    pub cp: Option<usize>,
    /// Pipeline parallelism.
    pub pp: Option<usize>,
    /// Expert parallelism.
    pub ep: Option<usize>,
    /// Expert tensor parallelism.
    pub etp: Option<usize>,
    /// Dense data parallelism; checked against the derived value when given.
    pub dp: Option<usize>,
    /// Expert data parallelism; checked against the derived value when given.
    pub edp: Option<usize>,
    /// Rank order (defaults to [`DEFAULT_ORDER`]).
    pub order: Option<String>,
    /// Virtual pipeline stages per pipeline rank (defaults to 1).
    pub vpp: Option<usize>,
    /// Megatron-style pipeline layout (`pp_layout=Et*3|t*4|t*4|t*3L`).
    pub pp_layout: Option<String>,
}

impl FromStr for LayoutSpec {
    type Err = BackendError;

    /// Parses `world=4,tp=2,ep=4,order=tp-cp-ep-dp-pp` (any subset, any order; spaces allowed;
    /// omitted sizes are 1, `etp` included); `vpp=V` and `pp_layout=…` describe the
    /// pipeline's virtual stages and their layers.
    fn from_str(s: &str) -> Result<Self> {
        let mut spec = LayoutSpec::default();
        for item in s.split(',').map(str::trim).filter(|t| !t.is_empty()) {
            let (key, value) = item.split_once('=').ok_or_else(|| BackendError::Layout {
                field: "layout",
                detail: format!("`{item}` is not of the form key=value"),
            })?;
            let (key, value) = (key.trim(), value.trim());
            if key == "order" {
                spec.order = Some(value.to_string());
                continue;
            }
            if key == "pp_layout" {
                spec.pp_layout = Some(value.to_string());
                continue;
            }
            let slot = match key {
                "world" => &mut spec.world,
                "tp" => &mut spec.tp,
                "cp" => &mut spec.cp,
                "pp" => &mut spec.pp,
                "ep" => &mut spec.ep,
                "etp" => &mut spec.etp,
                "dp" => &mut spec.dp,
                "edp" => &mut spec.edp,
                "vpp" => &mut spec.vpp,
                _ => {
                    return Err(BackendError::Layout {
                        field: "layout",
                        detail: format!(
                            "unknown key `{key}` (expected world, tp, cp, pp, vpp, ep, etp, dp, edp, order, pp_layout)"
                        ),
                    });
                }
            };
            let n: usize = value.parse().map_err(|_| BackendError::Layout {
                field: "layout",
                detail: format!("`{key}={value}` is not a positive integer"),
            })?;
            if slot.replace(n).is_some() {
                return Err(BackendError::Layout {
                    field: "layout",
                    detail: format!("`{key}` given twice"),
                });
            }
        }
        Ok(spec)
    }
}

fn positive(field: &'static str, value: usize) -> Result<usize> {
    if value == 0 {
        return Err(BackendError::Layout {
            field,
            detail: "must be at least 1".into(),
        });
    }
    Ok(value)
}

impl ParallelLayout {
    /// Builds a layout from a spec alone: `world` as given, else the smallest world both grids
    /// tile, `lcm(tp·cp·pp, etp·ep·pp)` times `dp` or `edp` when those are given.
    pub fn from_spec(spec: &LayoutSpec) -> Result<Self> {
        let world = match spec.world {
            Some(w) => w,
            None => {
                let tp = spec.tp.unwrap_or(1);
                let pp = spec.pp.unwrap_or(1);
                let dense = tp * spec.cp.unwrap_or(1) * pp * spec.dp.unwrap_or(1);
                let expert =
                    spec.etp.unwrap_or(1) * spec.ep.unwrap_or(1) * pp * spec.edp.unwrap_or(1);
                lcm(dense.max(1), expert.max(1))
            }
        };
        Self::new(world, spec)
    }

    /// Parses a full layout string (`world=4,tp=2,ep=4`; see [`ParallelLayout::from_spec`]).
    pub fn parse_spec(spec: &str) -> Result<Self> {
        Self::from_spec(&spec.parse()?)
    }

    /// Builds and validates a layout of `world` ranks from `spec` (a `world` in `spec` must
    /// agree).
    pub fn new(world: usize, spec: &LayoutSpec) -> Result<Self> {
        if let Some(w) = spec.world
            && w != world
        {
            return Err(BackendError::Layout {
                field: "world",
                detail: format!("layout says world={w} but {world} ranks are running"),
            });
        }
        let world = positive("world", world)?;
        let tp = positive("tp", spec.tp.unwrap_or(1))?;
        let cp = positive("cp", spec.cp.unwrap_or(1))?;
        let pp = positive("pp", spec.pp.unwrap_or(1))?;
        let ep = positive("ep", spec.ep.unwrap_or(1))?;
        let etp = positive("etp", spec.etp.unwrap_or(1))?;
        let dense = tp * cp * pp;
        if world % dense != 0 {
            return Err(BackendError::Layout {
                field: "world",
                detail: format!(
                    "world {world} is not divisible by tp·cp·pp = {tp}·{cp}·{pp} = {dense}"
                ),
            });
        }
        let expert = etp * ep * pp;
        if world % expert != 0 {
            return Err(BackendError::Layout {
                field: "world",
                detail: format!(
                    "world {world} is not divisible by etp·ep·pp = {etp}·{ep}·{pp} = {expert}"
                ),
            });
        }
        let dp = world / dense;
        let edp = world / expert;
        for (field, given, derived) in [("dp", spec.dp, dp), ("edp", spec.edp, edp)] {
            if let Some(given) = given
                && given != derived
            {
                return Err(BackendError::Layout {
                    field,
                    detail: format!(
                        "given {given} but world and the other degrees imply {derived}"
                    ),
                });
            }
        }
        let order = normalize_order(spec.order.as_deref().unwrap_or(DEFAULT_ORDER))?;
        if !(order.ends_with("pp") || pp == 1 || edp == dp) {
            return Err(BackendError::Layout {
                field: "order",
                detail: format!(
                    "order `{order}` must end with `pp` when pp = {pp} > 1 and edp ({edp}) != dp ({dp})"
                ),
            });
        }
        let vpp = positive("vpp", spec.vpp.unwrap_or(1))?;
        if vpp > 1 && pp == 1 {
            return Err(BackendError::Layout {
                field: "vpp",
                detail: format!("vpp = {vpp} virtual stages need pipeline parallelism (pp > 1)"),
            });
        }
        let pp_layout = spec.pp_layout.clone();
        if pp_layout.is_some() && pp == 1 {
            return Err(BackendError::Layout {
                field: "pp_layout",
                detail: "a pipeline layout needs pipeline parallelism (pp > 1)".into(),
            });
        }
        let layout = Self {
            world,
            tp,
            cp,
            pp,
            ep,
            etp,
            dp,
            edp,
            order,
            vpp,
            pp_layout,
        };
        let dense_pp = layout.dense_generator()?.get_ranks("pp")?;
        let expert_pp = layout.expert_generator()?.get_ranks("pp")?;
        if dense_pp != expert_pp {
            return Err(BackendError::Layout {
                field: "order",
                detail: format!(
                    "dense and expert pipeline groups differ under order `{}` (dense {:?}, expert {:?})",
                    layout.order,
                    dense_pp.first(),
                    expert_pp.first()
                ),
            });
        }
        Ok(layout)
    }

    /// Parses `spec` (see [`LayoutSpec::from_str`]) and validates it for `world` ranks.
    pub fn parse(world: usize, spec: &str) -> Result<Self> {
        Self::new(world, &spec.parse()?)
    }

    /// The one-rank layout.
    pub fn single() -> Self {
        Self {
            world: 1,
            tp: 1,
            cp: 1,
            pp: 1,
            ep: 1,
            etp: 1,
            dp: 1,
            edp: 1,
            order: DEFAULT_ORDER.into(),
            vpp: 1,
            pp_layout: None,
        }
    }

    /// Generator of the dense grid: `RankGenerator(tp, ep=1, dp, pp, cp)`.
    pub fn dense_generator(&self) -> Result<RankGenerator> {
        RankGenerator::new(self.tp, 1, self.dp, self.pp, self.cp, &self.order, 0)
    }

    /// Generator of the expert grid: `RankGenerator(tp=etp, ep, dp=edp, pp, cp=1)`.
    pub fn expert_generator(&self) -> Result<RankGenerator> {
        RankGenerator::new(self.etp, self.ep, self.edp, self.pp, 1, &self.order, 0)
    }
}

impl fmt::Display for ParallelLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "world={} tp={} cp={} pp={} dp={} | etp={} ep={} edp={} | order={}",
            self.world, self.tp, self.cp, self.pp, self.dp, self.etp, self.ep, self.edp, self.order
        )?;
        if self.vpp > 1 {
            write!(f, " | vpp={}", self.vpp)?;
        }
        if let Some(layout) = &self.pp_layout {
            write!(f, " | pp_layout={layout}")?;
        }
        Ok(())
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

fn lcm(a: usize, b: usize) -> usize {
    a / gcd(a, b) * b
}

const TOKENS: [&str; 5] = ["tp", "cp", "ep", "dp", "pp"];

/// Checks the tokens of an order string (known, unique); returns it unchanged otherwise.
fn normalize_order(order: &str) -> Result<String> {
    let mut seen = Vec::new();
    for token in order.split('-') {
        if !TOKENS.contains(&token) {
            return Err(BackendError::Layout {
                field: "order",
                detail: format!(
                    "unknown token `{token}` in `{order}` (expected tp, cp, ep, dp, pp)"
                ),
            });
        }
        if seen.contains(&token) {
            return Err(BackendError::Layout {
                field: "order",
                detail: format!("token `{token}` repeated in `{order}`"),
            });
        }
        seen.push(token);
    }
    Ok(order.to_string())
}

/// Megatron's `RankGenerator`: enumerates the rank groups of one grid
/// (docs/parallelism.md §Rank groups).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankGenerator {
    tokens: Vec<&'static str>,
    sizes: Vec<usize>,
    world: usize,
    rank_offset: usize,
}

impl RankGenerator {
    /// A generator for the given degrees; tokens missing from `order` are appended (their size
    /// must be 1). Requires `ep == 1 || cp == 1`.
    pub fn new(
        tp: usize,
        ep: usize,
        dp: usize,
        pp: usize,
        cp: usize,
        order: &str,
        rank_offset: usize,
    ) -> Result<Self> {
        if ep != 1 && cp != 1 {
            return Err(BackendError::Layout {
                field: "cp",
                detail: format!(
                    "a rank generator cannot have both ep ({ep}) and cp ({cp}) above 1"
                ),
            });
        }
        let size_of = |token: &str| match token {
            "tp" => tp,
            "cp" => cp,
            "ep" => ep,
            "dp" => dp,
            _ => pp,
        };
        normalize_order(order)?;
        let mut tokens: Vec<&'static str> = Vec::new();
        for token in order.split('-') {
            if let Some(known) = TOKENS.iter().find(|t| **t == token) {
                tokens.push(known);
            }
        }
        for token in TOKENS {
            if !tokens.contains(&token) {
                if size_of(token) != 1 {
                    return Err(BackendError::Layout {
                        field: "order",
                        detail: format!(
                            "`{order}` omits `{token}` whose size is {} (only size-1 tokens may be omitted)",
                            size_of(token)
                        ),
                    });
                }
                tokens.push(token);
            }
        }
        let sizes: Vec<usize> = tokens.iter().map(|t| size_of(t)).collect();
        Ok(Self {
            world: sizes.iter().product(),
            tokens,
            sizes,
            rank_offset,
        })
    }

    /// Number of ranks this generator spans.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The groups varying along the hyphenated `tokens` (e.g. `"tp-ep"`), in normative order.
    pub fn get_ranks(&self, tokens: &str) -> Result<Vec<Vec<usize>>> {
        let wanted: Vec<&str> = tokens.split('-').collect();
        for token in &wanted {
            if !TOKENS.contains(token) {
                return Err(BackendError::Layout {
                    field: "order",
                    detail: format!("unknown token `{token}` in group spec `{tokens}`"),
                });
            }
        }
        let mask: Vec<bool> = self.tokens.iter().map(|t| wanted.contains(t)).collect();
        let mut groups = generate_masked_orthogonal_rank_groups(self.world, &self.sizes, &mask);
        for group in &mut groups {
            for rank in group.iter_mut() {
                *rank += self.rank_offset;
            }
        }
        Ok(groups)
    }
}

fn prefix_product(sizes: &[usize]) -> Vec<usize> {
    let mut out = Vec::with_capacity(sizes.len() + 1);
    let mut acc = 1;
    out.push(acc);
    for s in sizes {
        acc *= s;
        out.push(acc);
    }
    out
}

fn decompose(index: usize, shape: &[usize]) -> Vec<usize> {
    let stride = prefix_product(shape);
    shape
        .iter()
        .zip(&stride)
        .map(|(&s, &st)| (index / st) % s)
        .collect()
}

fn dot(a: &[usize], b: &[usize]) -> usize {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// The masked orthogonal rank-group algorithm of docs/parallelism.md §Rank groups (group order and
/// member order are normative).
pub fn generate_masked_orthogonal_rank_groups(
    world: usize,
    sizes: &[usize],
    mask: &[bool],
) -> Vec<Vec<usize>> {
    let stride = prefix_product(sizes);
    let pick = |want: bool| -> (Vec<usize>, Vec<usize>) {
        sizes
            .iter()
            .zip(&stride)
            .zip(mask)
            .filter(|(_, m)| **m == want)
            .map(|((s, st), _)| (*s, *st))
            .unzip()
    };
    let (masked_shape, masked_stride) = pick(true);
    let (unmasked_shape, unmasked_stride) = pick(false);
    let group_size: usize = masked_shape.iter().product();
    let num_groups = world / group_size.max(1);
    (0..num_groups)
        .map(|gidx| {
            let gi = decompose(gidx, &unmasked_shape);
            let base = dot(&gi, &unmasked_stride);
            (0..group_size)
                .map(|r| dot(&decompose(r, &masked_shape), &masked_stride) + base)
                .collect()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_derives_degrees() {
        let layout = ParallelLayout::parse(8, "tp=2, ep=4").unwrap();
        assert_eq!((layout.dp, layout.etp, layout.edp), (4, 1, 2));
        let layout = ParallelLayout::parse(16, "tp=2,cp=2,pp=2,ep=4,etp=1").unwrap();
        assert_eq!((layout.dp, layout.edp), (2, 2));
    }

    #[test]
    fn rejects_bad_layouts_naming_the_field() {
        let cases = [
            (8, "tp=3", "world"),
            (8, "ep=16", "world"),
            (8, "tp=0", "tp"),
            (8, "dp=2", "dp"),
            (8, "tp=2,tp=2", "layout"),
            (8, "xx=2", "layout"),
            (8, "tp=two", "layout"),
            (8, "order=tp-cp-ep-dp-qq", "order"),
            (8, "order=tp-tp-ep-dp-pp", "order"),
            (8, "pp=2,order=tp-cp-dp", "order"),
            (8, "vpp=2", "vpp"),
            (8, "pp=2,vpp=0", "vpp"),
            (8, "pp_layout=Et|tL", "pp_layout"),
            (8, "pp=2,vpp=2,vpp=2", "layout"),
        ];
        for (world, spec, field) in cases {
            match ParallelLayout::parse(world, spec) {
                Err(BackendError::Layout { field: f, .. }) => assert_eq!(f, field, "{spec}"),
                other => panic!("{spec}: expected a layout error, got {other:?}"),
            }
        }
    }

    #[test]
    fn virtual_stages_and_pipeline_layouts_parse_and_print() {
        let layout = ParallelLayout::parse(4, "pp=2, vpp=3, pp_layout=E(t|)*5tL").unwrap();
        assert_eq!((layout.pp, layout.vpp), (2, 3));
        assert_eq!(layout.pp_layout.as_deref(), Some("E(t|)*5tL"));
        // The rank grid is the one without virtual stages.
        let plain = ParallelLayout::parse(4, "pp=2").unwrap();
        assert_eq!(plain.vpp, 1);
        assert_eq!(
            layout.dense_generator().unwrap(),
            plain.dense_generator().unwrap()
        );
        let text = layout.to_string();
        assert!(text.ends_with("| vpp=3 | pp_layout=E(t|)*5tL"), "{text}");
        assert!(!plain.to_string().contains("vpp"), "{plain}");
    }

    #[test]
    fn order_not_ending_in_pp_needs_equal_dp() {
        // pp first: dense dp 2, expert edp 1 -> rejected.
        let err = ParallelLayout::parse(8, "pp=2,ep=4,order=pp-tp-cp-ep-dp").unwrap_err();
        assert!(err.to_string().contains("must end with `pp`"), "{err}");
        // With edp == dp the order is fine.
        ParallelLayout::parse(8, "pp=2,ep=1,order=tp-cp-pp-ep-dp").unwrap();
    }

    #[test]
    fn world_defaults_to_the_smallest_common_tiling() {
        // docs/parallelism.md §Layout syntax: attention TP2 × DP2, experts EP4 × EDP1.
        let l = ParallelLayout::parse_spec("tp=2,ep=4").unwrap();
        assert_eq!((l.world, l.dp, l.etp, l.edp), (4, 2, 1, 1));
        let l = ParallelLayout::parse_spec("world=8,tp=2,ep=4").unwrap();
        assert_eq!((l.world, l.dp, l.edp), (8, 4, 2));
        let l = ParallelLayout::parse_spec("tp=3,ep=2").unwrap();
        assert_eq!(l.world, 6);
        assert!(ParallelLayout::parse(4, "world=8,tp=2").is_err());
    }

    #[test]
    fn vpp_parses_displays_and_keeps_the_grid() {
        let plain = ParallelLayout::parse(8, "pp=2,ep=2").unwrap();
        assert_eq!(plain.vpp, 1);
        let spec: LayoutSpec = "pp=2, vpp=3 ,ep=2".parse().unwrap();
        assert_eq!(spec.vpp, Some(3));
        let interleaved = ParallelLayout::new(8, &spec).unwrap();
        assert_eq!(interleaved.vpp, 3);
        // The rank grid is the same: degrees and every group.
        assert_eq!(
            ParallelLayout {
                vpp: 1,
                ..interleaved.clone()
            },
            plain
        );
        for tokens in ["pp", "tp-cp", "dp", "dp-cp"] {
            assert_eq!(
                interleaved
                    .dense_generator()
                    .unwrap()
                    .get_ranks(tokens)
                    .unwrap(),
                plain.dense_generator().unwrap().get_ranks(tokens).unwrap()
            );
        }
        for tokens in ["ep", "pp", "dp", "tp-ep-pp"] {
            assert_eq!(
                interleaved
                    .expert_generator()
                    .unwrap()
                    .get_ranks(tokens)
                    .unwrap(),
                plain.expert_generator().unwrap().get_ranks(tokens).unwrap()
            );
        }
        // Display: `vpp=V` only when V > 1, so existing strings print as before.
        let shown = plain.to_string();
        assert!(!shown.contains("vpp"), "{shown}");
        assert_eq!(
            ParallelLayout::parse(8, "pp=2,ep=2,vpp=1")
                .unwrap()
                .to_string(),
            shown
        );
        assert_eq!(interleaved.to_string(), format!("{shown} | vpp=3"));
        // The displayed values parse back to the same layout.
        let again = ParallelLayout::parse(
            8,
            &format!(
                "tp={},cp={},pp={},ep={},etp={},order={},vpp={}",
                interleaved.tp,
                interleaved.cp,
                interleaved.pp,
                interleaved.ep,
                interleaved.etp,
                interleaved.order,
                interleaved.vpp
            ),
        )
        .unwrap();
        assert_eq!(again, interleaved);
        assert_eq!(ParallelLayout::single().vpp, 1);
    }

    #[test]
    fn vpp_refusals_name_vpp() {
        let cases = [
            (4, "vpp=2", "vpp"),
            (4, "pp=1,vpp=2", "vpp"),
            (4, "pp=2,vpp=0", "vpp"),
            (4, "pp=2,vpp=2,vpp=2", "layout"),
            (4, "pp=2,vpp=two", "layout"),
            (4, "pp_layout=Et|tL", "pp_layout"),
        ];
        for (world, spec, field) in cases {
            match ParallelLayout::parse(world, spec) {
                Err(BackendError::Layout { field: f, detail }) => {
                    assert_eq!(f, field, "{spec}: {detail}");
                    if field == "vpp" && spec.contains("vpp=2") {
                        assert!(detail.contains("pp > 1"), "{detail}");
                    }
                }
                other => panic!("{spec}: expected a layout error, got {other:?}"),
            }
        }
        // The unknown-key message lists vpp.
        let err = ParallelLayout::parse(4, "vp=2").unwrap_err().to_string();
        assert!(err.contains("vpp"), "{err}");
    }

    #[test]
    fn generator_rejects_ep_with_cp() {
        assert!(RankGenerator::new(1, 2, 1, 1, 2, DEFAULT_ORDER, 0).is_err());
    }

    #[test]
    fn masked_groups_follow_the_spec_formula() {
        // sizes tp=2, dp=3: tp groups are consecutive pairs, dp groups stride 2.
        let tp = generate_masked_orthogonal_rank_groups(6, &[2, 3], &[true, false]);
        assert_eq!(tp, vec![vec![0, 1], vec![2, 3], vec![4, 5]]);
        let dp = generate_masked_orthogonal_rank_groups(6, &[2, 3], &[false, true]);
        assert_eq!(dp, vec![vec![0, 2, 4], vec![1, 3, 5]]);
    }
}
