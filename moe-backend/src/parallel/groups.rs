//! Process-group families of a [`ParallelLayout`] (docs/parallelism.md §Process groups) and the
//! experts each EP rank owns.

use std::ops::Range;

use super::layout::{ParallelLayout, RankGenerator};
use crate::error::{BackendError, Result};

/// Which generator a family comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Grid {
    /// `TP × CP × DP × PP` (attention, embeddings, norms, router, shared experts).
    Dense,
    /// `ETP × EP × EDP × PP` (routed experts).
    Expert,
}

/// One named family of process groups: every group of the family, in normative order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupFamily {
    /// Dense tensor parallel (`tp`).
    Tp,
    /// Context parallel (`cp`).
    Cp,
    /// Data parallel without CP (`dp`).
    Dp,
    /// Dense gradient reduction (`dp-cp`).
    DpCp,
    /// Aux-loss counts (`tp-cp`).
    TpCp,
    /// Global aux counts, expert-bias counts (`tp-dp-cp`).
    TpDpCp,
    /// `tp-dp`.
    TpDp,
    /// Model parallel, dense grad norm (`tp-pp`).
    Mp,
    /// Pipeline (`pp`).
    Pp,
    /// First and last rank of each pipeline group (tied embeddings).
    Embd,
    /// Expert parallel, token all-to-all (expert `ep`).
    Ep,
    /// Expert tensor parallel (expert `tp`).
    ExptTp,
    /// Count exchange, AllGather dispatcher (expert `tp-ep`).
    TpEp,
    /// Expert grad norm (expert `tp-ep-pp`).
    TpEpPp,
    /// Expert data parallel, expert gradient reduction (expert `dp`).
    ExptDp,
}

impl GroupFamily {
    /// Every family, in the deterministic creation order (the table order of
    /// docs/parallelism.md §Process groups).
    pub const ALL: [GroupFamily; 15] = [
        GroupFamily::Tp,
        GroupFamily::Cp,
        GroupFamily::Dp,
        GroupFamily::DpCp,
        GroupFamily::TpCp,
        GroupFamily::TpDpCp,
        GroupFamily::TpDp,
        GroupFamily::Mp,
        GroupFamily::Pp,
        GroupFamily::Embd,
        GroupFamily::Ep,
        GroupFamily::ExptTp,
        GroupFamily::TpEp,
        GroupFamily::TpEpPp,
        GroupFamily::ExptDp,
    ];

    /// The family name of docs/parallelism.md §Process groups (`tp`, `dp_cp`, `expt_dp`, ...).
    pub fn name(self) -> &'static str {
        match self {
            GroupFamily::Tp => "tp",
            GroupFamily::Cp => "cp",
            GroupFamily::Dp => "dp",
            GroupFamily::DpCp => "dp_cp",
            GroupFamily::TpCp => "tp_cp",
            GroupFamily::TpDpCp => "tp_dp_cp",
            GroupFamily::TpDp => "tp_dp",
            GroupFamily::Mp => "mp",
            GroupFamily::Pp => "pp",
            GroupFamily::Embd => "embd",
            GroupFamily::Ep => "ep",
            GroupFamily::ExptTp => "expt_tp",
            GroupFamily::TpEp => "tp_ep",
            GroupFamily::TpEpPp => "tp_ep_pp",
            GroupFamily::ExptDp => "expt_dp",
        }
    }

    /// The generator and token string of this family (`None` for `embd`, derived from `pp`).
    pub fn source(self) -> Option<(Grid, &'static str)> {
        use GroupFamily::*;
        Some(match self {
            Tp => (Grid::Dense, "tp"),
            Cp => (Grid::Dense, "cp"),
            Dp => (Grid::Dense, "dp"),
            DpCp => (Grid::Dense, "dp-cp"),
            TpCp => (Grid::Dense, "tp-cp"),
            TpDpCp => (Grid::Dense, "tp-dp-cp"),
            TpDp => (Grid::Dense, "tp-dp"),
            Mp => (Grid::Dense, "tp-pp"),
            Pp => (Grid::Dense, "pp"),
            Embd => return None,
            Ep => (Grid::Expert, "ep"),
            ExptTp => (Grid::Expert, "tp"),
            TpEp => (Grid::Expert, "tp-ep"),
            TpEpPp => (Grid::Expert, "tp-ep-pp"),
            ExptDp => (Grid::Expert, "dp"),
        })
    }
}

/// All groups of every family for a layout (the same on every rank).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupTable {
    layout: ParallelLayout,
    families: Vec<(GroupFamily, Vec<Vec<usize>>)>,
}

impl GroupTable {
    /// Enumerates every family of `layout`.
    pub fn new(layout: &ParallelLayout) -> Result<Self> {
        let dense = layout.dense_generator()?;
        let expert = layout.expert_generator()?;
        let mut families = Vec::with_capacity(GroupFamily::ALL.len());
        for family in GroupFamily::ALL {
            let groups = match family.source() {
                Some((Grid::Dense, tokens)) => dense.get_ranks(tokens)?,
                Some((Grid::Expert, tokens)) => expert.get_ranks(tokens)?,
                None => embedding_groups(&dense)?,
            };
            families.push((family, groups));
        }
        Ok(Self {
            layout: layout.clone(),
            families,
        })
    }

    /// The layout these groups belong to.
    pub fn layout(&self) -> &ParallelLayout {
        &self.layout
    }

    /// Every group of `family`, in normative order.
    pub fn groups(&self, family: GroupFamily) -> &[Vec<usize>] {
        self.families
            .iter()
            .find(|(f, _)| *f == family)
            .map(|(_, g)| g.as_slice())
            .unwrap_or(&[])
    }

    /// The group of `family` containing `rank` (for `embd`, ranks outside every group get the
    /// singleton `[rank]`).
    pub fn group_of(&self, family: GroupFamily, rank: usize) -> Result<&[usize]> {
        self.groups(family)
            .iter()
            .find(|g| g.contains(&rank))
            .map(Vec::as_slice)
            .ok_or_else(|| BackendError::Layout {
                field: "rank",
                detail: format!(
                    "rank {rank} is in no `{}` group of a world of {}",
                    family.name(),
                    self.layout.world
                ),
            })
    }

    /// The membership of `rank` in every family.
    pub fn for_rank(&self, rank: usize) -> Result<ProcessGroups> {
        if rank >= self.layout.world {
            return Err(BackendError::Layout {
                field: "rank",
                detail: format!("rank {rank} is outside a world of {}", self.layout.world),
            });
        }
        let mut members = Vec::with_capacity(GroupFamily::ALL.len());
        for family in GroupFamily::ALL {
            let ranks = match family {
                GroupFamily::Embd => self
                    .groups(family)
                    .iter()
                    .find(|g| g.contains(&rank))
                    .cloned()
                    .unwrap_or_else(|| vec![rank]),
                _ => self.group_of(family, rank)?.to_vec(),
            };
            members.push(Membership::new(family, ranks, rank)?);
        }
        Ok(ProcessGroups {
            rank,
            layout: self.layout.clone(),
            members,
        })
    }
}

/// Megatron's embedding groups: first and last rank of each pipeline group (the whole group
/// when it has one rank).
fn embedding_groups(dense: &RankGenerator) -> Result<Vec<Vec<usize>>> {
    Ok(dense
        .get_ranks("pp")?
        .into_iter()
        .map(|g| match (g.first(), g.last()) {
            (Some(&a), Some(&b)) if g.len() > 1 => vec![a, b],
            _ => g,
        })
        .collect())
}

/// One rank's place in one group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Membership {
    /// Family of the group.
    pub family: GroupFamily,
    /// Global ranks of the group, in normative member order.
    pub ranks: Vec<usize>,
    /// This rank's index in `ranks` (its rank within the group).
    pub index: usize,
}

impl Membership {
    fn new(family: GroupFamily, ranks: Vec<usize>, rank: usize) -> Result<Self> {
        let index = ranks
            .iter()
            .position(|&r| r == rank)
            .ok_or_else(|| BackendError::Layout {
                field: "rank",
                detail: format!("rank {rank} not in its `{}` group {ranks:?}", family.name()),
            })?;
        Ok(Self {
            family,
            ranks,
            index,
        })
    }

    /// Number of ranks in the group.
    pub fn size(&self) -> usize {
        self.ranks.len()
    }
}

/// Every group one rank belongs to (Megatron's `ProcessGroupCollection`,
/// docs/parallelism.md §Process groups).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessGroups {
    /// Global rank.
    pub rank: usize,
    /// The layout.
    pub layout: ParallelLayout,
    members: Vec<Membership>,
}

impl ProcessGroups {
    /// Groups of `rank` under `layout`.
    pub fn new(layout: &ParallelLayout, rank: usize) -> Result<Self> {
        GroupTable::new(layout)?.for_rank(rank)
    }

    /// Membership in `family`.
    pub fn get(&self, family: GroupFamily) -> &Membership {
        // `members` holds every family of `GroupFamily::ALL`, in that order.
        let at = GroupFamily::ALL
            .iter()
            .position(|f| *f == family)
            .unwrap_or_default();
        &self.members[at]
    }

    /// All memberships, in creation order.
    pub fn iter(&self) -> impl Iterator<Item = &Membership> {
        self.members.iter()
    }

    /// Dense TP rank.
    pub fn tp_rank(&self) -> usize {
        self.get(GroupFamily::Tp).index
    }

    /// EP rank (index in the `ep` group).
    pub fn ep_rank(&self) -> usize {
        self.get(GroupFamily::Ep).index
    }

    /// Pipeline stage.
    pub fn pp_rank(&self) -> usize {
        self.get(GroupFamily::Pp).index
    }

    /// Global expert ids this rank's EP position owns: `ep_rank·L .. (ep_rank+1)·L`, `L = E/ep`.
    pub fn local_expert_ids(&self, num_experts: usize) -> Result<Range<usize>> {
        local_expert_range(num_experts, self.layout.ep, self.ep_rank())
    }
}

/// Experts owned by EP rank `ep_rank` of `ep`: `ep_rank·L .. (ep_rank+1)·L` with `L = E/ep`.
pub fn local_expert_range(num_experts: usize, ep: usize, ep_rank: usize) -> Result<Range<usize>> {
    if ep == 0 || !num_experts.is_multiple_of(ep) {
        return Err(BackendError::Layout {
            field: "ep",
            detail: format!("{num_experts} experts cannot be split evenly over ep = {ep}"),
        });
    }
    if ep_rank >= ep {
        return Err(BackendError::Layout {
            field: "ep",
            detail: format!("ep rank {ep_rank} out of range for ep = {ep}"),
        });
    }
    let local = num_experts / ep;
    Ok(ep_rank * local..(ep_rank + 1) * local)
}

#[cfg(test)]
mod tests;
