//! Which parts of a model each virtual pipeline stage holds: an even split of the decoder
//! layers, or an explicit layout in the syntax of Megatron-LM's
//! `--pipeline-model-parallel-layout` (flexible / asymmetric stages, report §7.5).
//!
//! A layout lists the `pp · vpp` virtual stages in order, separated by `|`; each stage is a
//! sequence of `E` (the embedding), `t` (one decoder layer), `m` (one MTP module) and `L`
//! (the final norm, output layer and loss). `X*N` repeats a token or a parenthesised group
//! `N` times; spaces and commas are ignored. `"Et*3|t*4|t*4|t*3L"` gives stage 0 the
//! embedding and 3 layers, then 4, 4 and 3 layers with the loss on the last stage;
//! `"E|(t*2|)*4L"` gives the embedding a stage of its own. Virtual stage `v` runs on pipeline
//! rank `v mod pp` as its chunk `v / pp` (as [`super::PipelineSchedule::virtual_stage`]).

use std::ops::Range;

use crate::error::{BackendError, Result};

/// What one virtual pipeline stage holds.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StageParts {
    /// The token embedding (virtual stage 0 only).
    pub embedding: bool,
    /// Decoder layers, in model order.
    pub layers: Range<usize>,
    /// MTP modules (depths), in order.
    pub mtp: Range<usize>,
    /// The final norm, the output layer and the loss (the last virtual stage only).
    pub loss: bool,
}

/// The parts of a model held by each of `pp · vpp` virtual pipeline stages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PipelineSplit {
    pp: usize,
    vpp: usize,
    stages: Vec<StageParts>,
}

fn layout_error(detail: impl Into<String>) -> BackendError {
    BackendError::Config {
        field: "pipeline_layout",
        detail: detail.into(),
    }
}

/// One parsed token of a layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Token {
    Embedding,
    Layer,
    Mtp,
    Loss,
    Stage,
}

/// Expands repetitions: the flat token list of `text`.
fn tokens(text: &str) -> Result<Vec<Token>> {
    let chars: Vec<char> = text
        .chars()
        .filter(|c| !c.is_whitespace() && *c != ',')
        .collect();
    let mut at = 0;
    let out = group(&chars, &mut at, 0)?;
    if at != chars.len() {
        return Err(layout_error(format!(
            "`{text}`: unmatched `)` at character {at}"
        )));
    }
    Ok(out)
}

/// Parses until the end or a `)` closing the group opened at `depth`.
fn group(chars: &[char], at: &mut usize, depth: usize) -> Result<Vec<Token>> {
    let mut out: Vec<Token> = Vec::new();
    // Start of the last item in `out` (a token or an expanded group), for `*N`.
    let mut last: Option<usize> = None;
    while let Some(&c) = chars.get(*at) {
        *at += 1;
        let token = match c {
            'E' => Token::Embedding,
            't' => Token::Layer,
            'm' => Token::Mtp,
            'L' => Token::Loss,
            '|' => Token::Stage,
            '(' => {
                let inner = group(chars, at, depth + 1)?;
                if chars.get(*at) != Some(&')') {
                    return Err(layout_error("a `(` is never closed"));
                }
                *at += 1;
                last = Some(out.len());
                out.extend(inner);
                continue;
            }
            ')' if depth > 0 => {
                *at -= 1;
                return Ok(out);
            }
            ')' => return Err(layout_error("a `)` closes no `(`")),
            '*' => {
                let start = *at;
                while chars.get(*at).is_some_and(char::is_ascii_digit) {
                    *at += 1;
                }
                let digits: String = chars[start..*at].iter().collect();
                let n: usize = digits.parse().map_err(|_| {
                    layout_error(format!("`*` must be followed by a count, got `{digits}`"))
                })?;
                let from = last.ok_or_else(|| layout_error("`*` repeats nothing"))?;
                let item = out[from..].to_vec();
                if n == 0 {
                    out.truncate(from);
                } else {
                    for _ in 1..n {
                        out.extend_from_slice(&item);
                    }
                }
                last = None;
                continue;
            }
            other => {
                return Err(layout_error(format!(
                    "unknown symbol `{other}` (expected E, t, m, L, |, (, ), *N)"
                )));
            }
        };
        last = Some(out.len());
        out.push(token);
    }
    if depth > 0 {
        return Err(layout_error("a `(` is never closed"));
    }
    Ok(out)
}

impl PipelineSplit {
    /// The decoder layers split evenly over `pp · vpp` virtual stages (embedding on the first,
    /// MTP modules and loss on the last), as Megatron splits them without a layout. Refused
    /// when the layers do not divide evenly (give a layout) or are fewer than the stages.
    pub fn even(layers: usize, mtp: usize, pp: usize, vpp: usize) -> Result<Self> {
        check_sizes(pp, vpp)?;
        let stages = pp * vpp;
        if layers < stages {
            return Err(BackendError::Config {
                field: "pp",
                detail: format!(
                    "{stages} pipeline stages (pp = {pp} × vpp = {vpp}) for {layers} decoder layers: every stage needs a layer (or give a pipeline layout)"
                ),
            });
        }
        if !layers.is_multiple_of(stages) {
            return Err(BackendError::Config {
                field: "pp",
                detail: format!(
                    "{layers} decoder layers do not split evenly over pp = {pp} × vpp = {vpp} stages; give an explicit pipeline layout (e.g. `Et*k|…|t*kL`)"
                ),
            });
        }
        let per = layers / stages;
        let parts = (0..stages)
            .map(|v| StageParts {
                embedding: v == 0,
                layers: v * per..(v + 1) * per,
                mtp: if v + 1 == stages { 0..mtp } else { 0..0 },
                loss: v + 1 == stages,
            })
            .collect();
        Ok(Self {
            pp,
            vpp,
            stages: parts,
        })
    }

    /// The split a Megatron-style layout string gives (see the module docs), checked against
    /// the model (`layers` decoder layers, `mtp` MTP modules) and `pp · vpp` stages.
    pub fn parse(layout: &str, layers: usize, mtp: usize, pp: usize, vpp: usize) -> Result<Self> {
        check_sizes(pp, vpp)?;
        let tokens = tokens(layout)?;
        // The finished stages and the one being read.
        let mut stages = Vec::new();
        let mut stage = StageParts::default();
        let (mut layer, mut depth) = (0usize, 0usize);
        let (mut embeddings, mut losses) = (0usize, 0usize);
        for token in tokens {
            let v = stages.len();
            if stage.loss && token != Token::Stage {
                return Err(layout_error(format!(
                    "`{layout}`: `L` must end its stage (virtual stage {v})"
                )));
            }
            match token {
                Token::Stage => {
                    let next = StageParts {
                        layers: layer..layer,
                        mtp: depth..depth,
                        ..StageParts::default()
                    };
                    stages.push(std::mem::replace(&mut stage, next));
                }
                Token::Embedding => {
                    if v != 0
                        || stage.layers.end > stage.layers.start
                        || stage.mtp.end > stage.mtp.start
                    {
                        return Err(layout_error(format!(
                            "`{layout}`: `E` must open virtual stage 0"
                        )));
                    }
                    stage.embedding = true;
                    embeddings += 1;
                }
                Token::Layer => {
                    if stage.mtp.end > stage.mtp.start {
                        return Err(layout_error(format!(
                            "`{layout}`: decoder layer {layer} after an MTP module (virtual stage {v})"
                        )));
                    }
                    stage.layers.end += 1;
                    layer += 1;
                }
                Token::Mtp => {
                    stage.mtp.end += 1;
                    depth += 1;
                }
                Token::Loss => {
                    stage.loss = true;
                    losses += 1;
                }
            }
        }
        stages.push(stage);
        let n = stages.len();
        if n != pp * vpp {
            return Err(layout_error(format!(
                "`{layout}` has {n} stages, pp = {pp} × vpp = {vpp} needs {}",
                pp * vpp
            )));
        }
        if embeddings != 1 || losses != 1 {
            return Err(layout_error(format!(
                "`{layout}` must hold `E` once (it has {embeddings}) and `L` once (it has {losses})"
            )));
        }
        if !stages[n - 1].loss {
            return Err(layout_error(format!(
                "`{layout}`: `L` must be on the last virtual stage"
            )));
        }
        if layer != layers {
            return Err(layout_error(format!(
                "`{layout}` places {layer} decoder layers, the model has {layers}"
            )));
        }
        if depth != mtp {
            return Err(layout_error(format!(
                "`{layout}` places {depth} MTP modules, the model has {mtp}"
            )));
        }
        if let Some(v) = (0..n).find(|&v| v + 1 < n && stages[v].mtp.end > stages[v].mtp.start) {
            return Err(layout_error(format!(
                "`{layout}`: MTP modules must be on the last virtual stage (with the loss), virtual stage {v} has some"
            )));
        }
        Ok(Self { pp, vpp, stages })
    }

    /// Pipeline-parallel size.
    pub fn pp(&self) -> usize {
        self.pp
    }

    /// Virtual stages per pipeline rank.
    pub fn vpp(&self) -> usize {
        self.vpp
    }

    /// Every virtual stage's parts, in pipeline order.
    pub fn stages(&self) -> &[StageParts] {
        &self.stages
    }

    /// The parts of pipeline rank `rank`'s chunk `chunk` (virtual stage `chunk · pp + rank`).
    pub fn parts(&self, rank: usize, chunk: usize) -> Option<&StageParts> {
        if rank >= self.pp {
            return None;
        }
        self.stages.get(chunk * self.pp + rank)
    }

    /// The pipeline rank holding each decoder layer, in layer order (virtual stage `v` runs
    /// on rank `v mod pp`).
    pub fn layer_ranks(&self) -> Vec<usize> {
        let mut out = Vec::new();
        for (v, stage) in self.stages.iter().enumerate() {
            for layer in stage.layers.clone() {
                if out.len() <= layer {
                    out.resize(layer + 1, 0);
                }
                out[layer] = v % self.pp;
            }
        }
        out
    }

    /// Decoder layers held by pipeline rank `rank` over all its chunks, ascending.
    pub fn rank_layers(&self, rank: usize) -> Vec<usize> {
        (0..self.vpp)
            .filter_map(|c| self.parts(rank, c))
            .flat_map(|p| p.layers.clone())
            .collect()
    }
}

fn check_sizes(pp: usize, vpp: usize) -> Result<()> {
    if pp == 0 || vpp == 0 {
        return Err(BackendError::Config {
            field: if pp == 0 { "pp" } else { "vpp" },
            detail: "must be at least 1".into(),
        });
    }
    Ok(())
}
